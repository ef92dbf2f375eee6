"""TE absent: what te-gqa-fix does without Transformer Engine (that importing te_gqa_fix
imports no TE is the first check of tests/test_triton_postpass.py's worker)."""

from __future__ import annotations

import sys

import pytest
import torch

import te_gqa_fix
from te_gqa_fix import zero_dead_rows


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
