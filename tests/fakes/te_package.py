"""A fake ``transformer_engine`` package written to disk, for the patching tests.

Layout mirrors TE 2.20 where it matters to :func:`te_gqa_fix.install`::

    transformer_engine/__init__.py
    transformer_engine/pytorch/__init__.py          imports the consumers, as TE does
    transformer_engine/pytorch/cpp_extensions/__init__.py   ``from .fused_attn import *``
    transformer_engine/pytorch/cpp_extensions/fused_attn.py defines fused_attn_bwd
    transformer_engine/pytorch/attention/dot_product_attention/backends.py
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py
    transformer_engine/pytorch/attention/late_consumer.py   NOT imported by __init__
    fake_framework/attn.py    ``from ...fused_attn import fused_attn_bwd as te_fused_attn_bwd``

The original ``fused_attn_bwd`` fails loudly: called with ``fused_attention_backend ==
MUST_BE_PATCHED`` from anywhere but te-gqa-fix's wrapper, it raises
``AssertionError("patch did not take ...")``. Every consumer passes that marker, so a
consumer that still holds the original after ``install()`` cannot pass silently.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import FrameType
from typing import Any, Dict, List

from .te_outputs import FakeBackend
from .te_signatures import SIGNATURE_TE220

MUST_BE_PATCHED = "must-be-reached-through-te_gqa_fix"
WRAPPER_MODULE = "te_gqa_fix.wrapper"

#: The body every fake original runs (reset by the tests' fixture).
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


def original_body(arguments: Dict[str, Any], caller: FrameType) -> list:
    """Body of the fake original: refuse marked calls that bypass the wrapper."""
    caller_module = caller.f_globals.get("__name__", "?")
    if caller_module != WRAPPER_MODULE:
        DIRECT_CALLERS.append(caller_module)
        if arguments["fused_attention_backend"] == MUST_BE_PATCHED:
            raise AssertionError(
                f"patch did not take: {caller_module} called the original fused_attn_bwd "
                "directly instead of te_gqa_fix's wrapper"
            )
    return BACKEND(arguments)


_FUSED_ATTN = '''\
"""Fake transformer_engine.pytorch.cpp_extensions.fused_attn (tests only)."""
import sys
from typing import List, Optional, Tuple, Union

import torch

from fakes.te_package import original_body as _original_body
from fakes.te_signatures import _Tex as tex

Quantizer = object
FusedAttnBackend = object

__all__ = ["fused_attn_bwd"]


{signature}    return _original_body(dict(locals()), sys._getframe(1))
'''

_CALLERS = '''\
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
from transformer_engine.pytorch._callers import call_mixed


def backward(arguments):
    return call_mixed(fused_attn_bwd, arguments)
'''

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


def write_fake_te(root: Path, *, with_symbol: bool = True) -> Path:
    """Write the fake packages under ``root`` (put ``root`` on ``sys.path`` to import).

    ``with_symbol`` False writes a TE whose ``fused_attn`` lacks ``fused_attn_bwd``.
    """
    signature = SIGNATURE_TE220 if with_symbol else ""
    body = (
        _FUSED_ATTN.format(signature=signature)
        if with_symbol
        else '"""Fake fused_attn without fused_attn_bwd."""\n__all__ = []\n'
    )
    files = {
        "transformer_engine/__init__.py": '"""Fake TE (tests only)."""\n__version__ = "2.20.2"\n',
        "transformer_engine/pytorch/__init__.py": textwrap.dedent(
            '''\
            """Fake transformer_engine.pytorch: loads the consumers, as TE does."""
            from . import cpp_extensions
            from .attention.dot_product_attention import backends, context_parallel
            '''
        )
        if with_symbol
        else '"""Fake transformer_engine.pytorch."""\nfrom . import cpp_extensions\n',
        "transformer_engine/pytorch/_callers.py": "import inspect\n\n\n" + _CALLERS,
        "transformer_engine/pytorch/cpp_extensions/__init__.py": (
            '"""Re-exports, as TE does."""\nfrom .fused_attn import *\n\n\n'
            "def fused_attn_fwd(*args, **kwargs):\n    raise NotImplementedError\n"
        ),
        "transformer_engine/pytorch/cpp_extensions/fused_attn.py": body,
        "transformer_engine/pytorch/attention/__init__.py": "",
        "transformer_engine/pytorch/attention/dot_product_attention/__init__.py": "",
        "transformer_engine/pytorch/attention/dot_product_attention/backends.py": _BACKENDS,
        "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py": (
            _CONTEXT_PARALLEL
        ),
        "transformer_engine/pytorch/attention/late_consumer.py": _LATE,
        "fake_framework/__init__.py": "",
        "fake_framework/attn.py": _FRAMEWORK,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def loaded_fake_modules() -> List[str]:
    return sorted(
        name
        for name in sys.modules
        if any(name == top or name.startswith(top + ".") for top in TOP_LEVEL)
    )
