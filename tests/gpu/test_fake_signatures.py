"""The fake TE signatures (tests/fakes/te_signatures.py) against the installed TE.

The CPU binding tests replay TE's call sites against fakes with TE's exact signatures;
that is only as good as the fakes. Here, where TE is importable, the fake of the
installed release must have exactly the installed ``fused_attn_bwd``'s parameters: names,
order, kinds and defaults (issue #13: the old check needed TE sources at fixed /tmp
paths and always skipped). An installed release without a fake fails, so a new TE
cannot go untested unnoticed.
"""

from __future__ import annotations

import inspect

import pytest

from fakes.te_signatures import SIGNATURES, build_fake
from te_gqa_fix._te import release, te_version
from thd import te_function

pytestmark = pytest.mark.gpu


def _shape(fn) -> list:
    return [
        (p.name, p.kind, None if p.default is p.empty else repr(p.default))
        for p in inspect.signature(fn).parameters.values()
    ]


def _installed_key() -> str:
    version = te_version()
    assert version is not None and len(release(version)) == 2, version
    return "{}.{}".format(*release(version))


def test_fake_signature_matches_installed_te(te) -> None:
    key = _installed_key()
    assert key in SIGNATURES, (
        f"no fake for the installed TE {te_version()}: add its fused_attn_bwd signature to "
        f"tests/fakes/te_signatures.py (have {sorted(SIGNATURES)})"
    )
    fake = build_fake(key, lambda arguments: None)
    assert _shape(fake) == _shape(te_function())


def test_the_comparison_can_fail(te) -> None:
    # A fake of another release differs from the installed one (so the check is not vacuous).
    key = _installed_key()
    others = [v for v in SIGNATURES if v != key]
    real = te_function()
    assert others and all(_shape(build_fake(v, lambda a: None)) != _shape(real) for v in others)
