"""Every ``TE_GQA_FIX_*`` setting: its accepted spellings, a typo read where it is used, and a
misspelt variable name.

One table of typos per variable: each must be a :class:`SettingError` naming the variable,
the value (cut when long) and what is accepted, at every place the variable is read: the
wrapper and the post-pass raise before TE runs, the start-up line logs it at ERROR and
stays off, and ``doctor`` shows it (a mistyped guard: no fallback in its verdict either).
A set ``TE_GQA_FIX*`` name that is no setting is reported with the closest known name.
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
from te_gqa_fix import cudnn_route, fallback, settings, zero_dead_rows
from te_gqa_fix import wrapper as wrapper_module
from te_gqa_fix.cli import doctor
from te_gqa_fix.errors import InputError
from te_gqa_fix.settings import SETTINGS, SettingError

RAGGED = make_ragged([(2, 3), (0, 2), (3, 1)], gaps_kv=[1, 0, 1], lead_kv=1, tail_kv=1)
LONG = "x" * 100_000  # a pasted file: echoed in full at every interpreter start, before

#: Every setting's off and on spellings (issue #53: ``enable``/``enabled`` wherever
#: ``disable`` is), as users write them; on means the setting's default behaviour.
OFF = ("", "0", "off", "False", " no ", "disable", "Disabled", "DISABLED")
ON = ("1", "on", "TRUE", "yes", "Enable", " enabled ")
ON_MEANS = {
    "TE_GQA_FIX": "auto",
    "TE_GQA_FIX_GUARD": "fallback",
    "TE_GQA_FIX_VALIDATE": "on",
    "TE_GQA_FIX_AUTOPATCH": "on",
    "TE_GQA_FIX_CUDNN": "auto",
}
#: variable -> parsed value -> its other spellings (None: unset).
ACCEPTED: Dict[str, Dict[str, tuple]] = {
    "TE_GQA_FIX": {"auto": (None, "auto", "gqa"), "always": (" ALWAYS ", "all")},
    "TE_GQA_FIX_GUARD": {"fallback": (None, "fallback"), "warn": ("Warn",),
                         "strict": ("strict",)},
    "TE_GQA_FIX_VALIDATE": {"off": (None,)},
    "TE_GQA_FIX_AUTOPATCH": {"off": (None,), "strict": ("STRICT",)},
    "TE_GQA_FIX_CUDNN": {"off": (None,), "auto": ("auto",), "strict": ("strict",),
                         "/opt/cudnn": (" /opt/cudnn ",),
                         **{f: (f,) for f in (".", "..", "strict:.", "STRICT:/opt/cudnn")}},
}  # fmt: skip


def _expected(name: str, raw: Optional[str]) -> str:
    if raw is not None and raw.strip().lower() in {s.strip().lower() for s in OFF}:
        return "off" if raw.strip() else SETTINGS[name][1]  # empty: the default
    if raw is not None and raw.strip().lower() in {s.strip().lower() for s in ON}:
        return ON_MEANS[name]
    return next(v for v, raws in ACCEPTED[name].items() if raw in raws)


@pytest.mark.parametrize(
    "name, raw",
    [(n, raw) for n in SETTINGS for raw in (*OFF, *ON)]
    + [(n, raw) for n in SETTINGS for raws in ACCEPTED[n].values() for raw in raws],
)
def test_accepted_values(monkeypatch: pytest.MonkeyPatch, name: str, raw: Optional[str]) -> None:
    """Every setting takes every off and on spelling, in any case and padding, and its own
    values; the empty value is the default. ``get`` reads os.environ's own store (no
    KeyError for an unset variable); ``describe`` (doctor's) agrees."""
    if raw is not None:
        monkeypatch.setenv(name, raw)
    expected = _expected(name, raw)
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


def test_the_wrapper_reads_its_three_settings_at_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``per_call`` (the wrapper's read) follows the environment from call to call."""
    assert settings.per_call() == ("auto", "fallback", "off")
    monkeypatch.setenv("TE_GQA_FIX", "always")
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "enabled")
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "yes")
    assert settings.per_call() == ("always", "fallback", "on")
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "disable")
    assert settings.per_call() == ("always", "off", "on")


def test_a_shown_value_is_cut_past_80_characters_of_its_repr() -> None:
    assert settings.shown(b"x" * 77) == repr(b"x" * 77)  # 80 characters: whole
    assert settings.shown(b"x" * 78) == f"{repr(b'x' * 78)[:80]}...(81 chars)"
    assert settings.shown("x" * 80) == repr("x" * 80)  # a str: its characters count
    assert settings.shown("x" * 81) == f"{'x' * 80!r}...(81 chars)"


@pytest.mark.parametrize("module", [settings, cudnn_route, fallback])
def test_every_exported_name_exists(module) -> None:
    assert module.__all__ and all(hasattr(module, n) for n in module.__all__)


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
    "TE_GQA_FIX": ["bogus", "alway", "enabel", "./auto", LONG],
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
    assert isinstance(err.value, InputError)  # and so a ValueError
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
    text = doctor.format_report(rep)
    assert f"  {name:<20} ERROR: {message}" in text
    if name == "TE_GQA_FIX_GUARD":
        assert rep["verdict"]["fallback"] is False and "computes its gradients" not in text
        assert rep["exit_code"] == doctor.EXIT_UNREPAIRABLE
    # where the variable is read; the wrapper's three: at every call, before TE runs, even
    # a call (MHA) that needs none of them
    if name in settings.PER_CALL:
        fake, mha = FakeTE("2.20"), call_arguments("2.20", RAGGED, heads_q=2, heads_kv=2)
        wrapped = wrapper_module.wrapper_for(fake.fn)
        for _ in range(2):
            with pytest.raises(SettingError) as at_call:
                wrapped(**mha)
            assert str(at_call.value) == message
        assert fake.backend.calls == []
    if name == "TE_GQA_FIX_VALIDATE":  # the post-pass reads it too
        i32 = dict(dtype=torch.int32)
        cu_q, cu_kv = torch.tensor([0, 0, 2], **i32), torch.tensor([0, 2, 4], **i32)
        with pytest.raises(SettingError, match="TE_GQA_FIX_VALIDATE="):
            zero_dead_rows(None, torch.ones(4, 1, 1), torch.ones(4, 1, 1), cu_q, cu_kv)
    if name in (boot.ENV_AUTOPATCH, boot.ENV_CUDNN):
        said = _start_up_line(caplog)
        assert said == f"{message}; the start-up hook ignores it (off)"


# ------------------------------------------------------------- misspelt variable names
@pytest.mark.parametrize(
    "name, closest",
    [("TE_GQA_FIX_GAURD", "TE_GQA_FIX_GUARD"), ("TE_GQA_FIX_AUTOPATH", "TE_GQA_FIX_AUTOPATCH"),
     ("TE_GQA_FIX_VALIDATION", "TE_GQA_FIX_VALIDATE"), ("TE_GQA_FIXX", "TE_GQA_FIX"),
     ("te_gqa_fix_cudnn", "TE_GQA_FIX_CUDNN"), ("TE_GQA_FIX_RECORD", None),
     ("TE_GQA_FIX_POLICY", None)],
)  # fmt: skip
def test_an_unknown_name_is_reported_with_the_closest_known_one(
    name: str, closest: Optional[str]
) -> None:
    """Issue #51 (4): a misspelt variable is silently ignored otherwise. The closest name
    must be a real likeness, in any case: the shared prefix alone is none."""
    env = {name: "strict", "TE_GQA_FIX_GUARD": "warn", "OTHER_GAURD": "1", "PATH": "/bin"}
    assert settings.unknown_names(env) == [(name, closest)]
    assert settings.unknown_names({"TE_GQA_FIX_GUARD": "warn"}) == []


def test_the_wrappers_first_call_logs_an_unknown_name_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #51 (4): ``TE_GQA_FIX_GAURD=strict`` is named at WARNING with the setting
    meant, once per process however often and with whatever values the wrapper reads its
    settings; a name of no likeness is named alone."""
    monkeypatch.setenv("TE_GQA_FIX_GAURD", "strict")
    monkeypatch.setenv("TE_GQA_FIX_OTHER_THING", "1")
    fake, mha = FakeTE("2.20"), call_arguments("2.20", RAGGED, heads_q=2, heads_kv=2)
    wrapped = wrapper_module.wrapper_for(fake.fn)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        wrapped(**mha)
        wrapped(**mha)
        monkeypatch.setenv("TE_GQA_FIX_GUARD", "warn")  # new values, read anew
        assert settings.per_call() == ("auto", "warn", "off")
    said = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert said == [
        "TE_GQA_FIX_GAURD is not a te-gqa-fix setting (ignored); did you mean TE_GQA_FIX_GUARD?",
        "TE_GQA_FIX_OTHER_THING is not a te-gqa-fix setting (ignored)",
    ]
    assert len(fake.backend.calls) == 2
