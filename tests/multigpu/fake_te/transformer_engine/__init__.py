"""A fake Transformer Engine, for ``cp_check.py --cpu-dry-run`` only.

It lets the multi-GPU harness run end to end on CPU (gloo): same module paths and
names as TE 2.20.2 where cp_check.py and te_gqa_fix touch them, exact fp32 attention
math, and a ``fused_attn_bwd`` that imitates the bug (sentinel rows in dK/dV where the
true gradient is 0, for GQA) so the patched/unpatched bookkeeping can be checked.
It says nothing about the real TE; never put it on the path of a GPU run.
"""

__version__ = "0.0.0+fake"
