"""TE's ``fused_attn_bwd`` signatures, copied verbatim, with fake bodies.

The text between the triple quotes is the ``def`` line through the return annotation of
``transformer_engine/pytorch/cpp_extensions/fused_attn.py`` in TE 2.8.0 and TE 2.20.2
(``tests/gpu/test_fake_signatures.py`` checks the installed TE's against its fake). A fake is
built by ``exec`` of that text plus a one-line body, so the wrapper sees exactly the
parameter names, kinds, order and defaults TE has, and TE's call sites can be replayed
positionally or by keyword.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

SIGNATURE_TE28 = """\
def fused_attn_bwd(
    max_seqlen_q: int,
    max_seqlen_kv: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    fake_dtype: torch.dtype,
    dqkv_dtype: tex.DType,
    aux_ctx_tensors: List[torch.Tensor],
    fused_attention_backend: tex.NVTE_Fused_Attn_Backend,
    cu_seqlens_q_padded: torch.Tensor = None,
    cu_seqlens_kv_padded: torch.Tensor = None,
    s_quantizer: Quantizer = None,
    dp_quantizer: Quantizer = None,
    dqkv_quantizer: Quantizer = None,
    attn_scale: Optional[float] = None,
    dropout: float = 0.0,
    fast_zero_fill: bool = True,
    qkv_layout: str = "sbh3d",
    attn_bias_type: str = "no_bias",
    attn_mask_type: str = "padding",
    softmax_type: str = "vanilla",
    window_size: Tuple[int, int] = (-1, -1),
    deterministic: bool = False,
) -> Tuple[Union[torch.Tensor, None], ...]:
"""

SIGNATURE_TE220 = """\
def fused_attn_bwd(
    max_seqlen_q: int,
    max_seqlen_kv: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    fake_dtype: torch.dtype,
    aux_ctx_tensors: List[torch.Tensor],
    fused_attention_backend: FusedAttnBackend,
    cu_seqlens_q_padded: torch.Tensor = None,
    cu_seqlens_kv_padded: torch.Tensor = None,
    s_quantizer: Quantizer = None,
    dp_quantizer: Quantizer = None,
    dqkv_quantizer: Quantizer = None,
    attn_scale: Optional[float] = None,
    dropout: float = 0.0,
    fast_zero_fill: bool = True,
    qkv_layout: str = "sbh3d",
    o_format: str = "sbhd",
    do_format: str = "sbhd",
    dqkv_layout: str = "sbh3d",
    qkv_scale_inv_format: str = None,
    do_scale_inv_format: str = None,
    attn_bias_type: str = "no_bias",
    attn_mask_type: str = "padding",
    softmax_type: str = "vanilla",
    window_size: Tuple[int, int] = (-1, -1),
    bottom_right_diagonal: bool = None,
    deterministic: bool = False,
    cuda_graph: bool = False,
) -> Tuple[Union[torch.Tensor, None], ...]:
"""

SIGNATURES: Dict[str, str] = {"2.8": SIGNATURE_TE28, "2.20": SIGNATURE_TE220}


class _Tex:
    """Stand-in for ``transformer_engine_torch`` (only used in annotations)."""

    DType = object
    NVTE_Fused_Attn_Backend = object


FAKE_NAMESPACE: Dict[str, Any] = {
    "torch": torch,
    "tex": _Tex,
    "Quantizer": object,
    "FusedAttnBackend": object,
    "List": List,
    "Optional": Optional,
    "Tuple": Tuple,
    "Union": Union,
}


def build_fake(
    version: str,
    impl: Callable[[Dict[str, Any]], Any],
    module_name: str = "fake_te_fused_attn",
) -> Callable[..., Any]:
    """A function with TE ``version``'s exact signature whose body is ``impl(arguments)``.

    ``arguments`` maps every parameter name to the value the call bound to it, the way
    TE's own body sees them (``locals()`` on entry).
    """
    namespace = dict(FAKE_NAMESPACE)
    namespace["_impl"] = impl
    namespace["__name__"] = module_name
    source = SIGNATURES[version] + "    return _impl(dict(locals()))\n"
    exec(compile(source, f"<fake TE {version} fused_attn_bwd>", "exec"), namespace)
    return namespace["fused_attn_bwd"]
