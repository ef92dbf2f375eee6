"""The one fake ``transformer_engine`` package, written to disk and parameterised.

Every CPU test that needs TE importable uses it: the patching tests (in-process), doctor's
live check and ``te-gqa-fix doctor`` (subprocesses), and the context-parallel harness's
CPU dry run (``cp_check.py --cpu-dry-run`` under torchrun with gloo). Layout, where it
matters to te-gqa-fix, mirrors TE 2.20::

    transformer_engine/__init__.py                          ``__version__``
    transformer_engine/pytorch/__init__.py                  imports the consumers, as TE does
    transformer_engine/pytorch/utils.py                     get_cudnn_version()
    transformer_engine/pytorch/constants.py                 TE_DType
    transformer_engine/pytorch/cpp_extensions/__init__.py   ``from .fused_attn import *``
    transformer_engine/pytorch/cpp_extensions/fused_attn.py fused_attn_fwd, fused_attn_bwd
    transformer_engine/pytorch/attention/dot_product_attention/backends.py          (consumers)
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py  (consumers
        and/or context_parallel)
    transformer_engine/pytorch/attention/late_consumer.py   (consumers) NOT imported by __init__
    fake_framework/attn.py   (consumers) ``from ...fused_attn import fused_attn_bwd as te_...``

``fused_attn_bwd`` has the installed release's exact signature (``te_signatures``); its body
is :func:`original_body`, which runs one of two kernels:

* ``"stale"``: :data:`BACKEND` (``te_outputs.FakeBackend``), stale values in every row, kept
  bit-exactly so a test can tell kept rows from zeroed ones (in-process tests only).
* ``"reference"``: the exact gradients from ``te_gqa_fix.testing.reference_attention`` (the
  one fp32 reference), then the bug: with GQA, 1000 x group size in every dK/dV row no query
  reaches (rows of sequences without queries, padding, tail); ``bug="broken"`` also adds 1.0
  to live dK rows (damage no post-pass can repair), ``bug="healthy"`` adds nothing.

Whatever the kernel, a call marked ``fused_attention_backend == MUST_BE_PATCHED`` from
anywhere but te-gqa-fix's wrapper raises ``AssertionError("patch did not take ...")``: every
consumer passes that marker, so one still holding the original after ``install()`` cannot
pass silently.

The generated modules import this one (``fakes.te_package``): put the ``tests`` folder on
the path of a subprocess too (:func:`pythonpath`).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from types import FrameType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .te_outputs import FakeBackend
from .te_signatures import SIGNATURES

TESTS = Path(__file__).resolve().parents[1]
MUST_BE_PATCHED = "must-be-reached-through-te_gqa_fix"
WRAPPER_MODULE = "te_gqa_fix.wrapper"
SENTINEL = 1000.0
KERNELS = ("stale", "reference")
BUGS = ("affected", "healthy", "broken")

#: The body of the "stale" kernel (reset by the tests' fixture).
BACKEND = FakeBackend(seed=99)

#: Which modules called the original directly (not through the wrapper).
DIRECT_CALLERS: List[str] = []

CONSUMERS = {
    "backends": "transformer_engine.pytorch.attention.dot_product_attention.backends",
    "context_parallel": "transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
    "framework": "fake_framework.attn",
    "late": "transformer_engine.pytorch.attention.late_consumer",
}
DEFINING = "transformer_engine.pytorch.cpp_extensions.fused_attn"
REEXPORT = "transformer_engine.pytorch.cpp_extensions"
TOP_LEVEL = ("transformer_engine", "fake_framework")


class Precomputed(list):
    """``aux_ctx_tensors`` that carry the exact (dq, dk, dv): the context-parallel fake
    computes them on the gathered batch, which one rank's call cannot."""


# ----------------------------------------------------------------------------- kernels


def original_body(arguments: Dict[str, Any], caller: FrameType, config: Dict[str, Any]) -> list:
    """Body of the fake original: refuse marked calls that bypass the wrapper, then run
    the configured kernel."""
    caller_module = caller.f_globals.get("__name__", "?")
    if caller_module != WRAPPER_MODULE:
        DIRECT_CALLERS.append(caller_module)
        if arguments["fused_attention_backend"] == MUST_BE_PATCHED:
            raise AssertionError(
                f"patch did not take: {caller_module} called the original fused_attn_bwd "
                "directly instead of te_gqa_fix's wrapper"
            )
    if config["kernel"] == "stale":
        return BACKEND(arguments)
    return reference_kernel(arguments, config["bug"])


def _lengths(cu: Sequence[int]) -> List[int]:
    return [b - a for a, b in zip(cu, cu[1:])]


def unreached_kv_rows(
    rows: int, cu_q: Sequence[int], cu_kv: Sequence[int], pad_kv: Sequence[int]
) -> List[int]:
    """dK/dV rows no query can reach, by layout alone: rows of sequences without query
    tokens, and rows outside every sequence's valid keys (padding, before, tail)."""
    dead = set(range(rows))
    for b, (lq, lk) in enumerate(zip(_lengths(cu_q), _lengths(cu_kv))):
        if lq:
            dead -= set(range(pad_kv[b], pad_kv[b] + lk))
    return sorted(r for r in dead if r < rows)


def reference_kernel(args: Dict[str, Any], bug: str) -> list:
    """Exact gradients (fp32 reference), then the bug's stale rows."""
    from thd import ThdBatch, reference_attention

    q, k, v = args["q"], args["k"], args["v"]
    assert args["qkv_layout"] == "thd_thd_thd", args["qkv_layout"]
    if "dqkv_layout" in args:  # TE 2.20: the default (sbh3d) would be a caller's mistake
        assert args["dqkv_layout"] == args["qkv_layout"], args["dqkv_layout"]
    if "dqkv_dtype" in args:  # TE 2.8 requires it
        from transformer_engine.pytorch.constants import TE_DType

        assert args["dqkv_dtype"] == TE_DType[args["fake_dtype"]], args["dqkv_dtype"]
    cu_q = args["cu_seqlens_q"].tolist()
    cu_kv = args["cu_seqlens_kv"].tolist()
    pads = [args[f"cu_seqlens_{s}_padded"] for s in ("q", "kv")]
    pad_q, pad_kv = (p.tolist() if p is not None else c for p, c in zip(pads, (cu_q, cu_kv)))
    aux = args["aux_ctx_tensors"]
    if isinstance(aux, Precomputed):
        dq, dk, dv = (t.to(x.dtype).clone() for t, x in zip(aux, (q, k, v)))
    else:
        scale = args["attn_scale"]
        assert scale is None or abs(scale - q.shape[-1] ** -0.5) < 1e-9, scale
        batch = ThdBatch.of_tensors(
            {"q": q, "k": k, "v": v, "d_o": args["d_o"]},
            cu_q,
            cu_kv,
            pad_q,
            pad_kv,
            mask=args["attn_mask_type"],
            window=tuple(args["window_size"]),
            bottom_right_diagonal=args.get("bottom_right_diagonal"),
        )
        with torch.enable_grad():  # a real backward runs without autograd; the fake uses it
            ref = reference_attention(batch, torch.float32, device=str(q.device))
        dq, dk, dv = (ref[n].to(x.dtype) for n, x in (("dq", q), ("dk", k), ("dv", v)))
        if bug == "broken":
            for b, (lq, lk) in enumerate(zip(batch.lq, batch.lk)):
                if lq and lk:
                    dk[pad_kv[b] : pad_kv[b] + lk] += 1.0
    group = q.shape[-2] // k.shape[-2]
    if group > 1 and bug in ("affected", "broken"):
        dead = unreached_kv_rows(dk.shape[0], cu_q, cu_kv, pad_kv)
        if dead:
            idx = torch.tensor(dead, dtype=torch.long, device=dk.device)
            dk.index_fill_(0, idx, SENTINEL * group)
            dv.index_fill_(0, idx, SENTINEL * group)
    return [dq, dk, dv, None]


def forward_body(arguments: Dict[str, Any], config: Dict[str, Any]) -> Tuple[Any, list]:
    """Body of the fake ``fused_attn_fwd`` (what testing.te_forward needs back)."""
    if config["kernel"] != "reference":
        raise NotImplementedError("this fake TE has no forward")
    assert arguments["qkv_layout"] == "thd_thd_thd", arguments["qkv_layout"]
    return torch.zeros_like(arguments["q"]), [torch.zeros(1)]


# ----------------------------------------------------------------------------- sources

# fused_attn_fwd: the parameters te_gqa_fix.testing passes, by release (not verbatim).
_FWD_PARAMS = {
    "2.8": "",
    "2.20": "o_format='sbhd', bottom_right_diagonal=None, ",
}

_FUSED_ATTN = '''\
"""Fake transformer_engine.pytorch.cpp_extensions.fused_attn (tests only)."""
import sys
from typing import List, Optional, Tuple, Union

import torch

from fakes.te_package import forward_body as _forward_body
from fakes.te_package import original_body as _original_body
from fakes.te_signatures import _Tex as tex

Quantizer = object
FusedAttnBackend = {{"No_Backend": -1, "F16_arbitrary_seqlen": 1}}
_CONFIG = {config}

__all__ = {exports}


def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                   q, k, v, fake_dtype, fused_attention_backend, attn_bias=None,
                   cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, attn_scale=None,
                   dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", {fwd_params}
                   attn_bias_type="no_bias", attn_mask_type="padding", softmax_type="vanilla",
                   window_size=(-1, -1), rng_gen=None):
    return _forward_body(dict(locals()), _CONFIG)


{signature}'''

_BWD_BODY = "    return _original_body(dict(locals()), sys._getframe(1), _CONFIG)\n"

_CALLERS = '''\
import inspect


def call_all_positional(fn, arguments):
    """FusedAttnFunc.backward in TE 2.20: every argument positional."""
    names = list(inspect.signature(fn).parameters)
    return fn(*[arguments[n] for n in names])


def call_mixed(fn, arguments):
    """context_parallel.py in TE 2.20: 12 positional, the rest by keyword."""
    names = list(inspect.signature(fn).parameters)
    return fn(*[arguments[n] for n in names[:12]], **{n: arguments[n] for n in names[12:]})


def call_keywords(fn, arguments):
    return fn(**arguments)
'''

_BACKENDS = '''\
"""Fake backends.py: imports fused_attn_bwd by name, as TE does."""
from transformer_engine.pytorch.cpp_extensions import (
    fused_attn_fwd,
    fused_attn_bwd,
)
from transformer_engine.pytorch._callers import call_all_positional


def backward(arguments):
    return call_all_positional(fused_attn_bwd, arguments)
'''

_CONTEXT_PARALLEL = '''\
"""Fake context_parallel.py: imports fused_attn_bwd by name, as TE does."""
from transformer_engine.pytorch.cpp_extensions import (
    fused_attn_fwd,
    fused_attn_bwd,
)
'''

_CONTEXT_PARALLEL_REPLAY = """
from transformer_engine.pytorch._callers import call_mixed


def backward(arguments):
    return call_mixed(fused_attn_bwd, arguments)
"""

_CONTEXT_PARALLEL_CP = """
# The CP attention: gather, compute exactly, call fused_attn_bwd as bound here.
from fakes.te_cp import FakeAttnFunc, get_thd_partitioned_indices  # noqa: F401
"""

_LATE = '''\
"""A TE module nobody imports until a test does (after install)."""
from ..cpp_extensions.fused_attn import fused_attn_bwd
from .._callers import call_keywords


def backward(arguments):
    return call_keywords(fused_attn_bwd, arguments)
'''

_FRAMEWORK = '''\
"""A framework module outside TE that kept TE's function under another name."""
from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_bwd as te_fused_attn_bwd
from transformer_engine.pytorch._callers import call_mixed


def backward(arguments):
    return call_mixed(te_fused_attn_bwd, arguments)
'''


_LOADS_SYSTEM_CUDNN = """
import ctypes as _ctypes
import os as _os

# TE's _load_cuda_library: the system copy first, by path, into the global scope.
_CUDNN = _ctypes.CDLL(_os.environ["FAKE_TE_SYSTEM_CUDNN"], mode=_ctypes.RTLD_GLOBAL)
"""

_CUDNN_FROM_GLOBAL_SCOPE = """\
import ctypes
import os


def get_cudnn_version():
    \"\"\"The cuDNN TE's calls bind to: the global scope's cudnnGetVersion.\"\"\"
    report = os.environ.get("FAKE_TE_REPORTS")  # a TE that reports another version
    if report:
        v = int(report)
    else:
        fn = ctypes.CDLL(None).cudnnGetVersion
        fn.restype = ctypes.c_size_t
        v = int(fn())
    return (v // 10000, v % 10000 // 100, v % 100)
"""


def write_fake_te(
    root: Path,
    *,
    signature: Optional[str] = "2.20",
    kernel: str = "stale",
    bug: str = "affected",
    consumers: bool = True,
    context_parallel: bool = False,
    cudnn_version: Optional[Tuple[int, int, int]] = (9, 14, 0),
    version: str = "2.20.2",
) -> Path:
    """Write the fake packages under ``root`` (put ``root`` and :data:`TESTS` on the path).

    ``signature``: the TE release whose ``fused_attn_bwd`` signature the fake has ("2.8",
    "2.20"), or None for a ``fused_attn`` without ``fused_attn_bwd``. ``kernel``/``bug``:
    what the original computes (module docstring). ``consumers``: the modules that bind
    ``fused_attn_bwd`` by name (backends, context_parallel, late_consumer, fake_framework),
    whose calls carry :data:`MUST_BE_PATCHED`. ``context_parallel``: ``DotProductAttention``
    with ``set_context_parallel_group`` and TE's THD partitioning helper (``fakes.te_cp``),
    for the CP harness's dry run. ``cudnn_version``: what ``get_cudnn_version`` reports;
    None makes the fake load cuDNN the way TE's loader does (``$FAKE_TE_SYSTEM_CUDNN``, by
    path, ``RTLD_GLOBAL``, when ``transformer_engine`` is imported) and report the
    ``cudnnGetVersion`` that symbol lookup in the global scope binds to (or
    ``$FAKE_TE_REPORTS``): what the cuDNN route's tests need (``fakes.cudnn_builds``).
    """
    assert kernel in KERNELS and bug in BUGS, (kernel, bug)
    config = {"kernel": kernel, "bug": bug}
    exports = ["fused_attn_fwd"] + (["fused_attn_bwd"] if signature else [])
    bwd = SIGNATURES[signature] + _BWD_BODY if signature else ""
    fused_attn = _FUSED_ATTN.format(
        config=json.dumps(config),
        exports=json.dumps(exports),
        fwd_params=_FWD_PARAMS.get(signature or "2.20", ""),
        signature=bwd,
    )
    imports = ["from . import constants, cpp_extensions, utils"]
    imports.append("from .utils import get_cudnn_version")
    if signature and consumers:
        imports.append("from .attention.dot_product_attention import backends, context_parallel")
    if context_parallel:
        imports.append("from .attention import DotProductAttention")
    top = f'"""Fake TE (tests only)."""\n__version__ = "{version}"\n'
    utils = f"def get_cudnn_version():\n    return {tuple(cudnn_version or ())!r}\n"
    if cudnn_version is None:
        top += _LOADS_SYSTEM_CUDNN
        utils = _CUDNN_FROM_GLOBAL_SCOPE
    files = {
        "transformer_engine/__init__.py": top,
        "transformer_engine/pytorch/__init__.py": (
            '"""Fake transformer_engine.pytorch: loads the consumers, as TE does."""\n'
            + "\n".join(imports)
            + "\n"
        ),
        "transformer_engine/pytorch/utils.py": utils,
        "transformer_engine/pytorch/constants.py": (
            "import torch\n\nTE_DType = {torch.float16: 'kFloat16', torch.bfloat16: 'kBFloat16'}\n"
        ),
        "transformer_engine/pytorch/_callers.py": _CALLERS,
        "transformer_engine/pytorch/cpp_extensions/__init__.py": (
            '"""Re-exports, as TE does."""\nfrom .fused_attn import *\n'
        ),
        "transformer_engine/pytorch/cpp_extensions/fused_attn.py": fused_attn,
        "transformer_engine/pytorch/attention/__init__.py": (
            "from .dot_product_attention import DotProductAttention\n" if context_parallel else ""
        ),
        "transformer_engine/pytorch/attention/dot_product_attention/__init__.py": (
            # TE's DotProductAttention loads both modules that call fused_attn_bwd
            "from . import backends, context_parallel  # noqa: F401\n"
            "from fakes.te_cp import DotProductAttention, _attention_backends  # noqa: F401\n"
            if context_parallel
            else ""
        ),
    }
    if signature and (consumers or context_parallel):
        cp = _CONTEXT_PARALLEL
        cp += _CONTEXT_PARALLEL_REPLAY if consumers else ""
        cp += _CONTEXT_PARALLEL_CP if context_parallel else ""
        files[CONSUMERS["context_parallel"].replace(".", "/") + ".py"] = cp
    if signature and (consumers or context_parallel):
        files[CONSUMERS["backends"].replace(".", "/") + ".py"] = _BACKENDS
    if signature and consumers:
        files[CONSUMERS["late"].replace(".", "/") + ".py"] = _LATE
        files["fake_framework/__init__.py"] = ""
        files["fake_framework/attn.py"] = _FRAMEWORK
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text) if text.startswith(" ") else text)
    return root


def pythonpath(fake: Path, *more: Path) -> List[str]:
    """PYTHONPATH entries a subprocess needs to import the fake written under ``fake``."""
    return [str(fake), str(TESTS), *map(str, more)]


def loaded_fake_modules() -> List[str]:
    return sorted(
        name
        for name in sys.modules
        if any(name == top or name.startswith(top + ".") for top in TOP_LEVEL)
    )
