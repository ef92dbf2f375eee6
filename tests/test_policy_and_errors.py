"""Settings (each ``TE_GQA_FIX*`` value, typos are errors), bad inputs (each message
checked), no host sync, TE absent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, Dict

import pytest
import torch

import te_gqa_fix
from fakes.oracle import make_ragged
from fakes.te_outputs import FakeTE, call_arguments
from te_gqa_fix import postpass as postpass_module
from te_gqa_fix import settings, zero_dead_rows
from te_gqa_fix.postpass import dead_row_masks
from te_gqa_fix.wrapper import wrapper_for

I32 = torch.int32
RAGGED = make_ragged([(2, 3), (0, 2), (3, 1)], gaps_kv=[1, 0, 1], lead_kv=1, tail_kv=1)


def _offsets(values: Any, dtype: torch.dtype = I32, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _good(**overrides: Any) -> Dict[str, Any]:
    """Arguments of a valid zero_dead_rows call (3 sequences, 10 KV rows, 5 q rows)."""
    args: Dict[str, Any] = dict(
        dq=torch.zeros(5, 4, 2),
        dk=torch.zeros(10, 2, 2),
        dv=torch.zeros(10, 2, 2),
        cu_seqlens_q=_offsets([0, 2, 2, 5]),
        cu_seqlens_kv=_offsets([0, 3, 5, 6]),
        cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=_offsets([1, 5, 7, 9]),
    )
    args.update(overrides)
    return args


def _call(args: Dict[str, Any], **kwargs: Any) -> None:
    zero_dead_rows(
        args["dq"],
        args["dk"],
        args["dv"],
        args["cu_seqlens_q"],
        args["cu_seqlens_kv"],
        args["cu_seqlens_q_padded"],
        args["cu_seqlens_kv_padded"],
        impl="torch",
        **kwargs,
    )


# ---------------------------------------------------------------------------- settings


def test_policy_is_read_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTE("2.20")
    wrapped = wrapper_for(fake.fn)
    arguments = call_arguments("2.20", RAGGED)
    for value, fixed in (("off", 0), ("auto", 1), ("off", 1), ("always", 2)):
        monkeypatch.setenv("TE_GQA_FIX", value)
        wrapped(**arguments)
        assert te_gqa_fix.call_counts()["fixed"] == fixed, value
    assert te_gqa_fix.call_counts()["calls"] == 4


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


# ------------------------------------------------------------- metadata checks (no sync)


def test_heads_not_dividing_through_wrapper() -> None:
    fake = FakeTE("2.20")
    wrapped = wrapper_for(fake.fn)
    arguments = call_arguments("2.20", RAGGED, heads_q=3, heads_kv=2)
    with pytest.raises(
        ValueError,
        match=r"^k: expected a number of KV heads that divides the query heads \(3\), got 2",
    ):
        wrapped(**arguments)
    assert fake.backend.calls == [], "a bad call must be refused before TE runs"


def test_wrapper_names_te_inputs_in_messages() -> None:
    fake = FakeTE("2.8")
    wrapped = wrapper_for(fake.fn)
    arguments = call_arguments("2.8", RAGGED, offsets_dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected dtype torch\.int32"):
        wrapped(**arguments)
    arguments = call_arguments("2.8", RAGGED)
    arguments["k"] = arguments["k"].unsqueeze(0)
    with pytest.raises(ValueError, match=r"^k: expected a THD tensor"):
        wrapped(**arguments)
    assert fake.backend.calls == []


# --------------------------------------------------------- deep checks (TE_GQA_FIX_VALIDATE)


DEEP_CASES = {
    "non_monotonic": (
        dict(cu_seqlens_kv=_offsets([0, 3, 2, 6]), cu_seqlens_kv_padded=None),
        r"^cu_seqlens_kv: expected non-decreasing offsets, got 3 then 2 at index 2",
    ),
    "non_monotonic_padded": (
        dict(cu_seqlens_kv_padded=_offsets([1, 5, 4, 9])),
        r"^cu_seqlens_kv_padded: expected non-decreasing offsets, got 5 then 4 at index 2",
    ),
    "negative": (
        dict(cu_seqlens_q=_offsets([-1, 2, 2, 5])),
        r"^cu_seqlens_q: expected offsets >= 0, got -1 first",
    ),
    "length_exceeds_room": (
        dict(cu_seqlens_kv=_offsets([0, 3, 7, 8])),
        r"^cu_seqlens_kv: sequence 1 has 4 tokens but cu_seqlens_kv_padded gives it only 2 rows",
    ),
    "padded_past_buffer": (
        dict(cu_seqlens_kv_padded=_offsets([1, 5, 7, 12])),
        r"^cu_seqlens_kv_padded: last offset 12 is past the 10 kv rows of the buffer",
    ),
    "valid_past_buffer": (
        dict(cu_seqlens_q=_offsets([0, 2, 2, 6])),
        r"^cu_seqlens_q: last offset 6 is past the 5 q rows of the buffer",
    ),
}


@pytest.mark.parametrize("case", sorted(DEEP_CASES))
@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_deep_checks_under_validate(case: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, message = DEEP_CASES[case]
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", value)
    with pytest.raises(ValueError, match=message):
        _call(_good(**overrides))


@pytest.mark.parametrize("case", sorted(DEEP_CASES))
def test_deep_checks_off_by_default(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # They read offsets on the host (a sync): never in the hot path unless asked for.
    def must_not_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("check_values ran without TE_GQA_FIX_VALIDATE")

    # Issue #13: the device-side verdict still refuses them, without check_values (on
    # CPU it surfaces at once; on CUDA at the next call: tests/test_bad_input.py).
    monkeypatch.setattr(postpass_module, "check_values", must_not_run)
    overrides, message = DEEP_CASES[case]
    name = message.lstrip("^").split(":")[0]
    with pytest.raises(ValueError, match=rf"\b{name}\b.*impossible offsets"):
        _call(_good(**overrides))
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "0")
    with pytest.raises(ValueError, match=rf"\b{name}\b.*impossible offsets"):
        _call(_good(**overrides))


def test_deep_checks_accept_valid_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
    _call(_good())


# ------------------------------------------------------------------------ no host sync


def test_post_pass_and_wrapper_never_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every way Python code can pull a tensor value to the host raises here; the
    # post-pass (and the wrapper around it) must not need any of them.
    def sync(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host sync in the post-pass")

    dk = torch.randn(10, 2, 2)
    args = _good(dk=dk, dv=torch.randn(10, 2, 2), dq=torch.randn(5, 4, 2))
    fake = FakeTE("2.20")
    wrapped = wrapper_for(fake.fn)
    arguments = call_arguments(
        "2.20", RAGGED, attn_mask_type="padding_causal_bottom_right", window_size=(1, 0)
    )
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    _call(args, attn_mask_type="padding_causal", window_size=(2, 0))
    dead_row_masks(
        args["cu_seqlens_q"], args["cu_seqlens_kv"], rows_q=5, rows_kv=10, window_size=(0, 1)
    )
    wrapped(**arguments)
    monkeypatch.undo()
    assert te_gqa_fix.call_counts()["fixed"] == 1
    with pytest.raises(AssertionError, match="host sync"):  # the trap itself works
        monkeypatch.setattr(torch.Tensor, "item", sync)
        torch.zeros(1).item()


# ------------------------------------------------------------------------ TE absent


def test_import_does_not_import_transformer_engine() -> None:
    code = textwrap.dedent(
        """
        import sys
        import te_gqa_fix
        import te_gqa_fix.patch, te_gqa_fix.wrapper, te_gqa_fix.postpass, te_gqa_fix.affected
        assert callable(te_gqa_fix.fused_attn_bwd) and callable(te_gqa_fix.install)
        assert te_gqa_fix.is_installed() is False
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "transformer_engine")
        print("TE-MODULES", loaded)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "TE-MODULES []" in result.stdout, result.stdout


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


def test_drop_in_and_install_without_te_raise_import_error(no_te: None) -> None:
    with pytest.raises(ImportError, match=r"pip install 'transformer-engine\[pytorch\]"):
        te_gqa_fix.fused_attn_bwd(1, 2, 3)
    with pytest.raises(ImportError, match=r"pip install"):
        te_gqa_fix.install()
    assert te_gqa_fix.is_installed() is False
    assert te_gqa_fix.uninstall() == []


def test_version_helpers_without_te(no_te: None) -> None:
    assert te_gqa_fix.get_te_version() is None


def test_post_pass_works_without_te(no_te: None) -> None:
    dk = torch.full((4, 1, 1), 7.0)
    dv = torch.full((4, 1, 1), 7.0)
    zero_dead_rows(None, dk, dv, _offsets([0, 0, 2]), _offsets([0, 2, 4]))
    assert dk.flatten().tolist() == [0.0, 0.0, 7.0, 7.0]
    assert dv.flatten().tolist() == [0.0, 0.0, 7.0, 7.0]
