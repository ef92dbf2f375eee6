"""Comparison helpers for the GPU tests: fp32 reference, dtype-derived tolerance.

As flash-attention's tests do, the bound for TE's error against an fp32 reference is
twice the error of the same computation done by PyTorch in the input precision, plus a
few ulps of the reference's magnitude. Rows whose true gradient is 0 must be exactly 0.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from te_gqa_fix import dead_row_masks
from te_gqa_fix.reproduce import ThdBatch, reference_attention

GRADS = ("dq", "dk", "dv")


def dead_masks(batch: ThdBatch, device: str = "cuda"):
    return dead_row_masks(
        **batch.offsets(device),
        rows_q=batch.rows_q,
        rows_kv=batch.rows_kv,
        attn_mask_type=batch.mask,
        window_size=batch.window,
        bottom_right_diagonal=batch.bottom_right_diagonal,
    )


def live_q_rows(batch: ThdBatch) -> torch.Tensor:
    """Query rows that attend at least one key (their output is defined)."""
    from te_gqa_fix.reproduce import attention_mask

    live = torch.zeros(batch.rows_q, dtype=torch.bool)
    for b, (lq, lk) in enumerate(zip(batch.lq, batch.lk)):
        if lq and lk:
            has_key = attention_mask(lq, lk, batch).any(dim=1)
            live[batch.pad_q[b] : batch.pad_q[b] + lq] = has_key
    return live


def references(batch: ThdBatch) -> Dict[str, Dict[str, torch.Tensor]]:
    return {
        "fp32": reference_attention(batch, torch.float32, "cuda"),
        "same": reference_attention(batch, batch.dtype, "cuda"),
    }


def compare(
    batch: ThdBatch, out: List[torch.Tensor], refs, factor: float = 2.0
) -> Dict[str, float]:
    """Errors of TE's (dq, dk, dv) on live rows, their bounds, and dead-row maxima."""
    dead = dead_masks(batch)
    live_q = live_q_rows(batch).cuda() & ~dead.q
    res: Dict[str, float] = {}
    for name, got in zip(GRADS, out[:3]):
        mask = live_q if name == "dq" else ~dead.kv
        ref = refs["fp32"][name][mask].float()
        same = refs["same"][name][mask].float()
        mine = got[mask].float()
        err = (mine - ref).abs().max().item() if ref.numel() else 0.0
        err_pt = (same - ref).abs().max().item() if ref.numel() else 0.0
        ref_max = ref.abs().max().item() if ref.numel() else 0.0
        bound = factor * err_pt + 4 * torch.finfo(batch.dtype).eps * max(ref_max, 1e-3)
        dead_rows = got[dead.q if name == "dq" else dead.kv]
        res[f"{name}_err"] = err
        res[f"{name}_bound"] = bound
        res[f"{name}_dead_max"] = (
            dead_rows.float().abs().nan_to_num(float("inf")).max().item()
            if dead_rows.numel()
            else 0.0
        )
        res[f"{name}_nonfinite_live"] = int((~torch.isfinite(mine)).sum().item())
    return res


def exact(res: Dict[str, float]) -> bool:
    return all(
        res[f"{g}_err"] <= res[f"{g}_bound"]
        and res[f"{g}_dead_max"] == 0.0
        and res[f"{g}_nonfinite_live"] == 0
        for g in GRADS
    )


def corrupted(res: Dict[str, float]) -> bool:
    """Damage on rows that must be 0 (the bug's signature)."""
    return res["dk_dead_max"] > 0 or res["dv_dead_max"] > 0
