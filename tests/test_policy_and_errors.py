"""Settings read as the environment is now, and TE absent (that importing te_gqa_fix imports
no TE: the first check of tests/test_triton_postpass.py's worker). The bad-input tables:
tests/test_bad_input.py (the post-pass), test_hot_path.py (the wrapper), test_cli.py (plan and
doctor); the setting typos: test_settings.py; no host sync: test_oracle.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import te_gqa_fix
from te_gqa_fix import settings, zero_dead_rows


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


# ------------------------------------------------------------------------ TE absent


@pytest.fixture
def no_te(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``transformer_engine`` unimportable, whether or not it is installed."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("transformer_engine", "transformer_engine_torch"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    import importlib.metadata as metadata

    def not_found(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_found)


def test_without_te_the_drop_in_and_install_raise_and_the_post_pass_works(no_te: None) -> None:
    with pytest.raises(ImportError, match=r"pip install 'transformer-engine\[pytorch\]"):
        te_gqa_fix.fused_attn_bwd(1, 2, 3)
    with pytest.raises(ImportError, match=r"pip install"):
        te_gqa_fix.install()
    assert te_gqa_fix.is_installed() is False
    assert te_gqa_fix.uninstall() == []
    assert te_gqa_fix.get_te_version() is None
    dk, dv = torch.full((4, 1, 1), 7.0), torch.full((4, 1, 1), 7.0)
    cu_q, cu_kv = (torch.tensor(x, dtype=torch.int32) for x in ([0, 0, 2], [0, 2, 4]))
    zero_dead_rows(None, dk, dv, cu_q, cu_kv)
    assert dk.flatten().tolist() == dv.flatten().tolist() == [0.0, 0.0, 7.0, 7.0]
