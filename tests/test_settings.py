"""Every ``TE_GQA_FIX_*`` setting: its accepted spellings, and a typo, read where it is used.

One table of typos per variable: each must be a :class:`SettingError` naming the variable,
the value (cut when long) and what is accepted, at every place the variable is read: the
wrapper and the post-pass raise before TE runs, the start-up line logs it at ERROR and
stays off, and ``doctor`` shows it (a mistyped guard: no fallback in its verdict either).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

import _te_gqa_fix_autopatch as boot
from fakes.interpreter import run_pth_line
from fakes.oracle import make_ragged
from fakes.te_outputs import FakeTE, call_arguments
from te_gqa_fix import autopatch, settings, validation, zero_dead_rows
from te_gqa_fix import wrapper as wrapper_module
from te_gqa_fix.cli import doctor, report
from te_gqa_fix.settings import SETTINGS, SettingError
from te_gqa_fix.stack import affected, cudnn
from te_gqa_fix.stack.versions import RuntimeFacts

RAGGED = make_ragged([(2, 3), (0, 2), (3, 1)], gaps_kv=[1, 0, 1], lead_kv=1, tail_kv=1)
LONG = "x" * 100_000  # a pasted file: echoed in full at every interpreter start, before


OFF, ON = ("0", "off", "False", " no ", "disable", "Disabled"), ("1", "on", "TRUE", "yes")
#: variable -> parsed value -> every spelling of it (None: unset).
ACCEPTED: Dict[str, Dict[str, tuple]] = {
    "TE_GQA_FIX": {"auto": (None, "", "auto", "On", "1", "gqa"), "always": (" ALWAYS ", "all"),
                   "off": OFF},
    "TE_GQA_FIX_GUARD": {"fallback": (None, "", "fallback"), "warn": ("Warn",),
                         "strict": ("strict",), "off": OFF},
    "TE_GQA_FIX_VALIDATE": {"off": (None, "", *OFF), "on": ON},
    "TE_GQA_FIX_AUTOPATCH": {"off": (None, "", *OFF), "on": ON, "strict": ("STRICT",)},
    "TE_GQA_FIX_CUDNN": {"off": (None, "", *OFF), "auto": ("auto", *ON), "strict": ("strict",),
                         "/opt/cudnn": (" /opt/cudnn ",),
                         **{f: (f,) for f in (".", "..", "strict:.", "STRICT:/opt/cudnn")}},
}  # fmt: skip


@pytest.mark.parametrize(
    "name, raw, expected",
    [(n, raw, v) for n in SETTINGS for v, raws in ACCEPTED[n].items() for raw in raws],
)
def test_accepted_values(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: Optional[str], expected: str
) -> None:
    if raw is not None:
        monkeypatch.setenv(name, raw)
    assert settings.describe()[name]["value"] == expected and settings.describe()[name]["help"]
    with monkeypatch.context() as m:  # os.environ's own store: no KeyError (Mapping.get's)
        m.setattr(type(os.environ), "__getitem__", lambda self, key: pytest.fail(key))
        value = settings.get(name)
    assert value == expected


def test_settings_read_os_environ_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """``get`` reads os.environ's own store: a set, changed or deleted variable, an
    os.environ replaced by another mapping, and an ``environ`` argument are read as given."""
    monkeypatch.setenv("TE_GQA_FIX", "off")
    assert settings.get("TE_GQA_FIX") == "off"
    monkeypatch.setenv("TE_GQA_FIX", "Always")
    assert settings.get("TE_GQA_FIX") == "always"
    monkeypatch.delenv("TE_GQA_FIX")
    assert settings.get("TE_GQA_FIX") == "auto"
    assert settings.get("TE_GQA_FIX", {"TE_GQA_FIX": "0"}) == "off"
    monkeypatch.setattr(os, "environ", {"TE_GQA_FIX": "off", "TE_GQA_FIX_GUARD": "strict"})
    assert settings.get("TE_GQA_FIX") == "off"
    assert settings.get("TE_GQA_FIX_GUARD") == "strict"


def test_a_shown_value_is_cut_past_80_characters_of_its_repr() -> None:
    assert settings.shown(b"x" * 77) == repr(b"x" * 77)  # 80 characters: whole
    assert settings.shown(b"x" * 78) == f"{repr(b'x' * 78)[:80]}...(81 chars)"


@pytest.mark.parametrize("module", [settings, cudnn, autopatch, validation])
def test_every_exported_name_exists(module) -> None:
    assert module.__all__ and all(hasattr(module, n) for n in module.__all__)


def _wrapper_call(monkeypatch: pytest.MonkeyPatch, head_dim: int) -> List[dict]:
    """A wrapped fake TE on an affected Hopper stack; returns the backend's calls."""
    monkeypatch.setattr(wrapper_module, "_device_index", lambda q: 0)
    monkeypatch.setattr(
        affected, "runtime_facts", lambda index=None: RuntimeFacts((9, 0), (9, 14, 0))
    )
    affected.reset()
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for _ in range(2):  # every call, not only the first
        with pytest.raises(SettingError):
            wrapped(**call_arguments("2.20", RAGGED, head_dim=head_dim))
    return fake.backend.calls


def _post_pass() -> None:
    i32 = dict(dtype=torch.int32)
    cu_q, cu_kv = torch.tensor([0, 0, 2], **i32), torch.tensor([0, 2, 4], **i32)
    with pytest.raises(SettingError):
        zero_dead_rows(None, torch.ones(4, 1, 1), torch.ones(4, 1, 1), cu_q, cu_kv)


def _start_up_line(caplog: pytest.LogCaptureFixture) -> str:
    """Run the shipped ``.pth`` line here (after the ``hook`` fixture); it must log one ERROR
    and put no hook in place."""
    with caplog.at_level(logging.ERROR, logger="te_gqa_fix"):
        run_pth_line()
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert not boot._hooks() and not boot._hooks(boot._CUDNN_MARKER)
    assert boot.state()["cudnn_route"] is False and boot.state()["activated_by"] is None
    return record.getMessage()


#: variable -> typos, each once read as something the user did not ask for.
#: A value that looks like a path is a folder for TE_GQA_FIX_CUDNN only; 80 characters are
#: echoed in full, 100,000 are cut.
TYPOS: Dict[str, List[str]] = {
    "TE_GQA_FIX": ["bogus", "alway", "true", "./auto", LONG],
    "TE_GQA_FIX_GUARD": ["stirct", "raise", "warning", "/strict", "y" * 80],
    "TE_GQA_FIX_VALIDATE": ["2", "onn", ".on", LONG],
    "TE_GQA_FIX_AUTOPATCH": ["none", "stirct", "~/on", LONG],
    "TE_GQA_FIX_CUDNN": ["atuo", "stirct", "cudnn", "strict:", "maybe", LONG],
}


@pytest.mark.parametrize(
    "name, value",
    [(n, v) for n in SETTINGS for v in TYPOS[n]],
    ids=lambda x: x if len(x) < 30 else f"{len(x)}-chars",
)
def test_a_mistyped_setting_is_a_named_error_wherever_it_is_read(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    doctor_probes: Callable[..., List[str]],
    hook: Any,
    name: str,
    value: str,
) -> None:
    """Before: stirct/raise meant warn (and doctor counted the fallback), 2 meant off, none
    meant on, atuo was a folder, and a long value was echoed in full in every process."""
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError) as err:
        settings.get(name)
    message = str(err.value)
    shown = repr(value) if len(value) <= 80 else f"{value[:80]!r}...({len(value)} chars)"
    assert message.startswith(f"{name}={shown} is not an accepted value; expected one of ")
    listed = message.split("; expected one of ", 1)[1].split(", ")
    folder = ["a folder", "'strict:FOLDER'"] if name == "TE_GQA_FIX_CUDNN" else []
    assert sorted(listed) == sorted([repr(s) for s in SETTINGS[name][0] if s] + folder)
    assert len(message) < 400
    # doctor shows it, as a setting and a warning; a mistyped guard is no fallback there
    doctor_probes("9.14.0", installed=True)  # head dim 256 on it: only the fallback serves it
    rep = doctor.collect(live=False, head_dim=256)
    assert rep["settings"][name]["error"] == message and message in rep["warnings"]
    assert rep["settings"][name]["help"] == SETTINGS[name][2] != ""
    text = report.format_report(rep)
    assert f"  {name:<20} ERROR: {message}" in text
    if name == "TE_GQA_FIX_GUARD":
        assert rep["verdict"]["fallback"] is False and "computes its gradients" not in text
        assert rep["exit_code"] == doctor.EXIT_UNREPAIRABLE
    # where the variable is read; the wrapper's three: at its first call, before TE runs, even
    # a call (MHA) that needs none of them
    if name in ("TE_GQA_FIX", "TE_GQA_FIX_GUARD", "TE_GQA_FIX_VALIDATE"):
        fake, mha = FakeTE("2.20"), call_arguments("2.20", RAGGED, heads_q=2, heads_kv=2)
        with pytest.raises(SettingError) as first_call:
            wrapper_module.wrapper_for(fake.fn)(**mha)
        assert str(first_call.value) == message and fake.backend.calls == []
    if name in ("TE_GQA_FIX", "TE_GQA_FIX_GUARD"):  # the guard: at a head dim beyond repair
        assert _wrapper_call(monkeypatch, 256 if name == "TE_GQA_FIX_GUARD" else 3) == []
    elif name == "TE_GQA_FIX_VALIDATE":
        _post_pass()
    else:
        assert (
            _start_up_line(caplog) == f"te_gqa_fix: {message}; the start-up hook ignores it (off)"
        )
