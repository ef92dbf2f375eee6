"""Draw the loss curves and gradient norms of the issue-11 runs (matplotlib only here).

One row per trigger (the runs as they are; then, if present, the ``--poison`` runs), three
panels side by side: the loss, Megatron's grad norm (log scale) and the attention qkv
grad norm (log scale). (a) is red, the three correct runs (b), (c), (d) are drawn over each
other, so a run that departs from them stands out at a glance; NaN steps are marked with x
on the top edge of the panel.
"""

from __future__ import annotations

import math
from typing import Any, Dict

from check import label, series

STYLE = {
    "a": {"color": "tab:red", "lw": 2.0, "ls": "-"},
    "b": {"color": "tab:blue", "lw": 2.5, "ls": "-"},
    "c": {"color": "tab:green", "lw": 1.5, "ls": "--"},
    "d": {"color": "black", "lw": 1.0, "ls": ":"},
}
PANELS = (
    ("loss", "loss", False),
    ("grad_norm", "grad norm", True),
    ("attn_qkv", "attention qkv grad norm", True),
)


def render(runs: Dict[str, Dict[str, Any]], report: Dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("", "as run")]
    if any(n.endswith("_poison") for n in runs):
        rows.append(("_poison", "allocator poisoned before each attention backward"))
    fig, axes = plt.subplots(len(rows), len(PANELS), figsize=(15, 4.2 * len(rows)), squeeze=False)
    for r, (suffix, title) in enumerate(rows):
        for c, (quantity, ylabel, log) in enumerate(PANELS):
            ax = axes[r][c]
            for key in ("a", "b", "c", "d"):
                name = key + suffix if key + suffix in runs else key
                if name not in runs or (suffix and name == key and key in ("a", "b")):
                    continue
                y = series(runs[name], quantity)
                x = list(range(len(y)))
                st = STYLE[key]
                ax.plot(x, y, color=st["color"], lw=st["lw"], ls=st["ls"], label=label(name))
                bad = [s for s, v in enumerate(y) if math.isnan(v) or math.isinf(v)]
                if bad:
                    ax.plot(
                        bad,
                        [1.0] * len(bad),
                        "x",
                        color=st["color"],
                        ms=9,
                        transform=ax.get_xaxis_transform(),
                        clip_on=False,
                    )
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if c == 0:
                ax.set_title(title, loc="left", fontsize=10)
            if r == 0 and c == len(PANELS) - 1:
                ax.legend(fontsize=8)
            elif c == len(PANELS) - 1:
                ax.legend(fontsize=8)
    verdict = "PASS: (b) matches (c) and (d)" if report.get("ok") else "FAIL (see summary)"
    fig.suptitle(f"Megatron-Core, THD + GQA 16/4 + CP 2, bf16 — {verdict}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
