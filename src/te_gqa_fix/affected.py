"""The one rule: is THD + GQA attention on this GPU and cuDNN affected, and can the post-pass
repair it?

Every consumer asks here: ``te-gqa-fix doctor``, the wrapper's pass-through on fixed stacks,
the runtime guard, the GPU tests, the benchmark and the context-parallel checks. The rule is
a table of what was measured (H200, TE 2.20.2, cuDNN 9.14 and 9.19, 2026-11-30; see
``docs/validation.md``), not a guess:

* Hopper (sm90) with cuDNN < 9.18, THD, h_q > h_kv: stale workspace is summed into dK/dV rows
  of sequences without query tokens. Rows that receive attention are right for head dims
  (q/k and v) up to 128, so zeroing the dead rows repairs the result exactly: ``affected``.
* On the same stack, head dim 192 or 256 (q/k and v alike) is wrong on live rows too, MHA and
  GQA, even with all-zero stale memory: nothing after the call can repair it:
  ``unrepairable``. The MLA shape (q/k 192, v 128) was measured clean and is repairable.
  Any other shape above 128 was not measured, so it is reported as unrepairable too: the
  post-pass cannot vouch for it, a fixed cuDNN can.
* cuDNN 9.18 and newer initialise the workspace (upstream, TE #2186); 9.19 measured clean:
  ``not_affected``.
* Other architectures: the bug is known on Hopper only: ``not_affected``.

Pure functions of plain values: no torch, no TE, nothing imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, Optional, Sequence, Tuple

__all__ = [
    "CUDNN_FIXED",
    "HOPPER_MAJOR",
    "MAX_REPAIRABLE_HEAD_DIM",
    "MEASURED_CLEAN_ABOVE_128",
    "Verdict",
    "cudnn_is_fixed",
    "head_dims_repairable",
    "verdict",
]

CUDNN_FIXED: Tuple[int, int, int] = (9, 18, 0)
HOPPER_MAJOR = 9  # compute capability 9.x
MAX_REPAIRABLE_HEAD_DIM = 128
#: (head dim of q/k, head dim of v) above 128 that were measured clean on an affected cuDNN.
MEASURED_CLEAN_ABOVE_128: FrozenSet[Tuple[int, int]] = frozenset({(192, 128)})


def _vstr(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def cudnn_is_fixed(cudnn_version: Optional[Sequence[int]]) -> bool:
    """True when this cuDNN is known to be fixed (9.18 or newer); False when older or unknown."""
    return cudnn_version is not None and tuple(int(x) for x in cudnn_version) >= CUDNN_FIXED


def head_dims_repairable(head_dim_qk: int, head_dim_v: Optional[int] = None) -> bool:
    """Whether the post-pass makes the result exact at these head dims on an affected cuDNN."""
    d_v = head_dim_qk if head_dim_v is None else head_dim_v
    if head_dim_qk <= MAX_REPAIRABLE_HEAD_DIM and d_v <= MAX_REPAIRABLE_HEAD_DIM:
        return True
    return (int(head_dim_qk), int(d_v)) in MEASURED_CLEAN_ABOVE_128


@dataclass(frozen=True)
class Verdict:
    """``status``: ``affected``, ``not_affected``, ``unrepairable`` or ``unknown``."""

    status: str
    reasons: Tuple[str, ...]


def verdict(
    capability: Optional[Sequence[int]],
    cudnn_version: Optional[Sequence[int]],
    head_dim: Optional[int] = None,
    head_dim_v: Optional[int] = None,
) -> Verdict:
    """What the measured facts say for THD + GQA attention on this GPU and cuDNN.

    ``cudnn_version`` is the cuDNN Transformer Engine runs (not torch's). ``head_dim`` is the
    q/k head dim and ``head_dim_v`` the v head dim (default: the same), both optional.
    """
    if capability is None or cudnn_version is None:
        missing = []
        if capability is None:
            missing.append("the GPU's compute capability")
        if cudnn_version is None:
            missing.append("the cuDNN version Transformer Engine runs")
        return Verdict("unknown", (f"cannot tell without {' and '.join(missing)}",))
    cap = tuple(int(x) for x in capability)
    cud = tuple(int(x) for x in cudnn_version)
    sm = f"sm{cap[0]}{cap[1] if len(cap) > 1 else 0}"
    if cap[0] != HOPPER_MAJOR:
        return Verdict(
            "not_affected",
            (
                f"{sm} is not Hopper: the stale-workspace bug is known on Hopper (sm90) only; "
                "te-gqa-fix does no harm elsewhere",
            ),
        )
    if cudnn_is_fixed(cud):
        return Verdict(
            "not_affected",
            (f"cuDNN {_vstr(cud)} >= 9.18 initialises the GQA workspace (9.19 measured clean)",),
        )
    base = (
        f"Hopper ({sm}) with cuDNN {_vstr(cud)} < 9.18: TE's fused_attn_bwd (THD layout, "
        "GQA/MQA) sums stale workspace into dK/dV rows of sequences without query tokens"
    )
    if head_dim is not None and not head_dims_repairable(head_dim, head_dim_v):
        shape = f"{head_dim}" if head_dim_v in (None, head_dim) else f"{head_dim}/{head_dim_v}"
        return Verdict(
            "unrepairable",
            (
                base,
                f"head dim {shape} on this cuDNN is wrong on rows that receive attention too "
                "(measured at 192 and 256: dQ up to 8.6e4, NaN): no post-pass can repair it; "
                "use cuDNN 9.18 or newer (TE_GQA_FIX_CUDNN=auto loads an installed one)",
            ),
        )
    reasons = [base, "te-gqa-fix repairs it exactly (head dims up to 128, and q/k 192 with v 128)"]
    if head_dim is None:
        reasons.append(
            f"if your model's head dim is above {MAX_REPAIRABLE_HEAD_DIM} (192, 256), this "
            "cuDNN is broken beyond repair: use 9.18 or newer (pass --head-dim to check)"
        )
    return Verdict("affected", tuple(reasons))
