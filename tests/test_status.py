"""``te_gqa_fix.status()``: the in-process answer to ``te-gqa-fix doctor`` (is the fix active
here, where, on what stack, and what have the calls so far done), readable with ``str()``
and plain with ``.as_dict()``. It reads only what is loaded: it imports neither TE nor torch.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Dict

import pytest
import torch

import te_gqa_fix
from fakes import te_package
from fakes.interpreter import child_env, probed, run_code
from fakes.oracle import make_ragged
from fakes.te_outputs import FakeTE, call_arguments
from te_gqa_fix import postpass, settings
from te_gqa_fix._status import Status

BACKENDS = f"{te_package.CONSUMERS['backends']}.fused_attn_bwd"
CONTEXT_PARALLEL = f"{te_package.CONSUMERS['context_parallel']}.fused_attn_bwd"


def _rows(status: Status) -> Dict[str, str]:
    """``str(status)`` as {row name: value}: one row a line, two spaces or more between."""
    lines = str(status).splitlines()
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)  # type: ignore[misc]
    assert len(rows) == len(lines), "a row name is repeated"
    return rows


@pytest.fixture
def no_te(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``transformer_engine`` loaded or installed, whatever this machine has."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("transformer_engine", "transformer_engine_torch"):
            monkeypatch.delitem(sys.modules, name)
    import importlib.metadata as metadata

    def not_found(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_found)


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees one Hopper GPU, whose post-pass would be the Triton kernel."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(postpass, "implementation", lambda: ("triton", None))


def test_without_te_nothing_is_known_or_active(no_te: None) -> None:
    status = te_gqa_fix.status()
    assert (status.te, status.te_imported, status.cudnn) == (None, False, None)
    assert (status.gpu, status.verdict, status.wrong_above_128) == (None, "unknown", [])
    assert (status.installed, status.sites, status.unreached) == (False, [], [])
    assert (status.postpass, status.postpass_why) == ("pytorch", "no CUDA device")
    assert status.version == te_gqa_fix.__version__
    assert set(status.settings) == set(settings.SETTINGS) and status.unknown_settings == []
    rows = _rows(status)
    assert rows["Transformer Engine"] == "not installed (not imported yet)"
    assert (rows["cuDNN (TE runs)"], rows["GPU"], rows["fix"]) == (
        "unknown",
        "unknown",
        "NOT active",
    )
    assert rows["sites"] == "none" and "NOT reached" not in rows


def test_with_te_before_and_after_install(fake_te: Path) -> None:
    """TE imported, not installed: its call sites are named as not reached; after install()
    the fix is active at every site it rebound."""
    import transformer_engine.pytorch  # noqa: F401

    status = te_gqa_fix.status()
    assert (status.te, status.te_imported, status.cudnn) == ("2.20.2", True, "9.14.0")
    assert not status.installed and status.sites == []
    assert status.unreached == [BACKENDS, CONTEXT_PARALLEL]
    rows = _rows(status)
    assert rows["Transformer Engine"] == "2.20.2" and rows["cuDNN (TE runs)"] == "9.14.0"
    assert rows["fix"] == "NOT active" and rows["NOT reached"] == f"{BACKENDS}, {CONTEXT_PARALLEL}"

    sites = te_gqa_fix.install()
    status = te_gqa_fix.status()
    assert status.installed and sorted(status.sites) == sorted(sites) and status.unreached == []
    rows = _rows(status)
    assert rows["fix"] == "ACTIVE" and "NOT reached" not in rows
    assert sorted(rows["sites"].split(", ")) == sorted(sites)
    te_gqa_fix.uninstall()
    assert not te_gqa_fix.status().installed


#: The cuDNN TE reports -> (verdict, head dims wrong on live rows there), by hand from
#: the measurements: 9.14 is wrong above 128 except q/k 192 with v 128; 9.19 only at
#: 256/128; 9.27 nowhere measured.
ON_HOPPER = {
    (9, 14, 0): ("stale_rows", ["160", "192", "224", "256", "256/128"]),
    (9, 19, 0): ("right", ["256/128"]),
    (9, 27, 0): ("right", []),
    (9, 29, 0): ("stale_rows", []),  # not measured: judged by 9.28.1, post-pass kept
}


@pytest.mark.parametrize("cudnn", list(ON_HOPPER), ids=str)
def test_on_hopper_the_verdict_for_the_cudnn_te_runs(
    fake_te: Path, hopper: None, monkeypatch: pytest.MonkeyPatch, cudnn: tuple
) -> None:
    import transformer_engine.pytorch.utils as te_utils

    monkeypatch.setattr(te_utils, "get_cudnn_version", lambda: cudnn)
    status = te_gqa_fix.status()
    verdict, wrong = ON_HOPPER[cudnn]
    assert (status.gpu, status.cudnn) == ("sm90", ".".join(map(str, cudnn)))
    assert (status.verdict, status.wrong_above_128) == (verdict, wrong)
    rows = _rows(status)
    assert rows["GPU"] == "sm90" and rows["post-pass on CUDA"] == "triton"
    assert rows["verdict"] == verdict + (
        f"; wrong on live rows at {', '.join(wrong)}" if wrong else ""
    )


def test_calls_settings_and_what_started_it(monkeypatch: pytest.MonkeyPatch, no_te: None) -> None:
    """The counts of the calls so far; every setting's value, a bad one as its error (no
    raise), a misspelt name with the closest setting; the start-up hook that installed it;
    what the cuDNN route did."""
    import _te_gqa_fix_autopatch as boot
    from te_gqa_fix import cudnn_route

    _, wrapped = FakeTE.with_wrapper("2.20")
    wrapped(**call_arguments("2.20", make_ragged([(2, 3), (0, 2)], tail_kv=1)))
    monkeypatch.setenv("TE_GQA_FIX_GAURD", "strict")
    monkeypatch.setenv("TE_GQA_FIX", "bogus")
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
    monkeypatch.setitem(boot._state, "activated_by", "TE_GQA_FIX_AUTOPATCH=1")
    route = {"setting": "auto", "loaded": True, "chosen_version": "9.27.0", "chosen_measured": "right"}  # fmt: skip
    monkeypatch.setattr(cudnn_route, "route_state", lambda: dict(route))
    status = te_gqa_fix.status()
    assert status.calls == {"calls": 1, "fixed": 1, "skipped": 0, "passthrough": 0, "fallback": 0}
    assert status.settings["TE_GQA_FIX"].startswith("ERROR: ")
    assert status.settings["TE_GQA_FIX_VALIDATE"] == "on"
    assert status.unknown_settings == ["TE_GQA_FIX_GAURD (did you mean TE_GQA_FIX_GUARD?)"]
    assert status.activated_by == "TE_GQA_FIX_AUTOPATCH=1"
    rows = _rows(status)
    assert rows["calls so far"] == "calls 1, fixed 1, skipped 0, passthrough 0, fallback 0"
    assert rows["TE_GQA_FIX_VALIDATE"] == "on" and rows["TE_GQA_FIX"].startswith("ERROR: ")
    assert rows["unknown settings"] == "TE_GQA_FIX_GAURD (did you mean TE_GQA_FIX_GUARD?)"
    assert rows["activated by"] == "TE_GQA_FIX_AUTOPATCH=1"
    assert rows["cuDNN route"] == "auto: loaded cuDNN 9.27.0 (right)"
    route.update(loaded=False, error="no cuDNN 9.18 or newer found")
    assert _rows(te_gqa_fix.status())["cuDNN route"] == "auto: nothing loaded: no cuDNN 9.18 or newer found"  # fmt: skip


def test_as_dict_is_every_field_as_plain_json(fake_te: Path) -> None:
    import transformer_engine.pytorch  # noqa: F401

    te_gqa_fix.install()
    status = te_gqa_fix.status()
    plain = status.as_dict()
    assert list(plain) == [f.name for f in fields(Status)]
    assert all(plain[f.name] == getattr(status, f.name) for f in fields(Status))
    assert json.loads(json.dumps(plain))["sites"] == status.sites


def test_status_imports_neither_te_nor_torch(tmp_path: Path) -> None:
    """In a fresh process with TE installed, status() loads neither: TE's version comes
    from its distribution, what is not loaded yet reads as unknown."""
    te_package.write_fake_te(tmp_path)
    dist = tmp_path / "transformer_engine-2.20.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.20.2\n"
    )
    code = (
        "import json, sys, te_gqa_fix\n"
        "s = te_gqa_fix.status()\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformer_engine'})\n"
        "print('PROBE' + json.dumps({'loaded': loaded, 'te': s.te, 'imported': s.te_imported,\n"
        "      'verdict': s.verdict, 'postpass': s.postpass}))\n"
    )
    env = child_env(te_package.TESTS.parent / "src", *te_package.pythonpath(tmp_path))
    got = probed(run_code(code, env))
    assert got == {"loaded": [], "te": "2.20.2", "imported": False, "verdict": "unknown",
                   "postpass": None}  # fmt: skip
