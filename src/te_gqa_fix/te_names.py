"""Transformer Engine's names that te-gqa-fix reads, stated once: layouts, masks, offsets.

Standard library only. Every module that reads one of these names takes it from here.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["LAYOUTS", "MASKS", "OFFSET_NAMES", "PACKED", "THD_LAYOUTS", "THD_MASKS"]

_OTHER_LAYOUTS = """sb3hd sbh3d sbhd_sb2hd sbhd_sbh2d sbhd_sbhd_sbhd bs3hd bsh3d bshd_bs2hd bshd_bsh2d
    bshd_bshd_bshd sbhd_bshd_bshd bshd_sbhd_sbhd bhsd_bhsd_bhsd"""
#: TE's ``qkv_layout`` names -> (q's tensor is THD, k's and v's are THD).
LAYOUTS: Dict[str, Tuple[bool, bool]] = {
    **dict.fromkeys(("thd_thd_thd", "thd_t2hd", "thd_th2d", "t3hd", "th3d"), (True, True)),
    **dict.fromkeys(("thd_bshd_bshd", "thd_sbhd_sbhd"), (True, False)),
    **dict.fromkeys(_OTHER_LAYOUTS.split(), (False, False)),
}
#: The layouts with q, k and v all THD.
THD_LAYOUTS: Tuple[str, ...] = tuple(n for n, (q, kv) in LAYOUTS.items() if q and kv)
#: Packed THD layouts -> (index of the first packed tensor of q, k, v; the dim they stack on).
PACKED: Dict[str, Tuple[int, int]] = {
    "thd_t2hd": (1, 1),
    "thd_th2d": (1, 2),
    "t3hd": (0, 1),
    "th3d": (0, 2),
}

#: TE's ``attn_mask_type`` names -> (causal, bottom-right by name). THD masks are per
#: sequence, so the names without ``padding`` behave as their padding twins there.
MASKS: Dict[str, Tuple[bool, bool]] = {
    "padding": (False, False),
    "no_mask": (False, False),
    "padding_causal": (True, False),
    "causal": (True, False),
    "padding_causal_bottom_right": (True, True),
    "causal_bottom_right": (True, True),
}
#: The mask names TE's fused attention takes with THD input (the others it refuses there, or
#: runs without the per-sequence lengths on older cuDNN).
THD_MASKS: Tuple[str, ...] = tuple(n for n in MASKS if n.startswith("padding"))

#: TE's four offset arguments, in the order of its signature.
OFFSET_NAMES: Tuple[str, str, str, str] = (
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
)
