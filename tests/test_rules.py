"""The rule (:mod:`te_gqa_fix.rules`): what was measured per cuDNN build on Hopper, and what
the wrapper does with one call shape.

Every expected value below is stated by hand from the rule's definition (docs/validation.md
and the design): on Hopper, cuDNN 9.14 leaves stale rows and is wrong on live rows above
head dim 128 except q/k 192 with v 128; 9.19, 9.20 and 9.24.1 are right except q/k 256 with
v 128; 9.27 and 9.28.1 are right everywhere measured; a head-dim pair measured neither way counts as wrong. A build
that was not measured keeps the post-pass and is judged on live rows by the newest measured
build at or below it (the oldest where none is below, or where its version is unknown).
"""

from __future__ import annotations

from typing import Optional, Tuple

import pytest

from te_gqa_fix.rules import (
    CallShape,
    Verdict,
    decide,
    judge,
    measurement_for,
    newest_right,
    pip_hint,
    version_text,
)

HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)
V914, V919, V920, V9241, V927, V9281 = (
    (9, 14, 0),
    (9, 19, 0),
    (9, 20, 0),
    (9, 24, 1),
    (9, 27, 0),
    (9, 28, 1),
)

#: (capability, cuDNN TE runs, d_qk, d_v) -> (status, cuDNN of the measurement that judged
#: it, whether that is this build's own measurement).
JUDGED = {
    # No GPU capability (CPU tensors, or not known): nothing measured applies.
    "no GPU": ((None, V914, None, None), ("unknown", None, False)),
    "no GPU, no cuDNN": ((None, None, 256, None), ("unknown", None, False)),
    # The bug is known on Hopper only.
    "Ampere": ((AMPERE, V914, 256, None), ("not_hopper", None, False)),
    "Blackwell, cuDNN unknown": ((BLACKWELL, None, None, None), ("not_hopper", None, False)),
    # 9.14: stale rows; live rows wrong above 128 except 192/128.
    "9.14": ((HOPPER, V914, None, None), ("stale_rows", V914, True)),
    "9.14.2 (a patch release)": ((HOPPER, (9, 14, 2), 128, 128), ("stale_rows", V914, True)),
    "9.14 at 128": ((HOPPER, V914, 128, None), ("stale_rows", V914, True)),
    "9.14 at 256": ((HOPPER, V914, 256, None), ("live_rows_wrong", V914, True)),
    "9.14 at 160": ((HOPPER, V914, 160, 160), ("live_rows_wrong", V914, True)),
    "9.14 at 192/128": ((HOPPER, V914, 192, 128), ("stale_rows", V914, True)),
    "9.14 at 128/192 (measured neither way)": (
        (HOPPER, V914, 128, 192), ("live_rows_wrong", V914, True)),
    # 9.19: right, except 256/128 on live rows; unmeasured pairs count as wrong.
    "9.19": ((HOPPER, V919, None, None), ("right", V919, True)),
    "9.19 at 64": ((HOPPER, V919, 64, 64), ("right", V919, True)),
    "9.19 at 256": ((HOPPER, V919, 256, None), ("right", V919, True)),
    "9.19 at 192/128": ((HOPPER, V919, 192, 128), ("right", V919, True)),
    "9.19 at 256/128": ((HOPPER, V919, 256, 128), ("live_rows_wrong", V919, True)),
    "9.19 at 136 (measured neither way)": ((HOPPER, V919, 136, 136), ("live_rows_wrong", V919, True)),
    # 9.20 and 9.24.1 (torch's own cuDNN wheels): as 9.19.
    "9.20 at 256": ((HOPPER, V920, 256, 256), ("right", V920, True)),
    "9.20 at 256/128": ((HOPPER, V920, 256, 128), ("live_rows_wrong", V920, True)),
    "9.24.0 (a patch release below the one measured)": ((HOPPER, (9, 24, 0), 192, 128), ("right", V9241, True)),
    "9.24.1 at 256/128": ((HOPPER, V9241, 256, 128), ("live_rows_wrong", V9241, True)),
    # 9.27 and 9.28.1: right at every pair measured.
    "9.28.0 at 256/128": ((HOPPER, (9, 28, 0), 256, 128), ("right", V9281, True)),
    "9.27 at 256/128": ((HOPPER, V927, 256, 128), ("right", V927, True)),
    "9.27.5 at 96": ((HOPPER, (9, 27, 5), 96, None), ("right", V927, True)),
    # Unmeasured builds: the post-pass stays; live rows judged by the build below.
    "9.18 (fixed upstream, not measured)": ((HOPPER, (9, 18, 0), None, None), ("stale_rows", V914, False)),
    "9.18 at 256": ((HOPPER, (9, 18, 0), 256, 256), ("live_rows_wrong", V914, False)),
    "9.22.1": ((HOPPER, (9, 22, 1), None, None), ("stale_rows", V920, False)),
    "9.22.1 at 256": ((HOPPER, (9, 22, 1), 256, 256), ("stale_rows", V920, False)),
    "9.22.1 at 256/128": ((HOPPER, (9, 22, 1), 256, 128), ("live_rows_wrong", V920, False)),
    "9.29 (newer than the newest measured)": ((HOPPER, (9, 29, 0), None, None), ("stale_rows", V9281, False)),
    "9.29 at 256/128": ((HOPPER, (9, 29, 0), 256, 128), ("stale_rows", V9281, False)),
    "9.10 (older than the oldest measured)": ((HOPPER, (9, 10, 0), 128, 128), ("stale_rows", V914, False)),
    "9.10 at 256": ((HOPPER, (9, 10, 0), 256, 256), ("live_rows_wrong", V914, False)),
    # The cuDNN TE runs cannot be read: judged as the oldest measured build.
    "unknown cuDNN": ((HOPPER, None, None, None), ("stale_rows", V914, False)),
    "unknown cuDNN at 128": ((HOPPER, None, 128, 128), ("stale_rows", V914, False)),
    "unknown cuDNN at 256": ((HOPPER, None, 256, None), ("live_rows_wrong", V914, False)),
    "unknown cuDNN at 192/128": ((HOPPER, None, 192, 128), ("stale_rows", V914, False)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(JUDGED))
def test_judge(case: str) -> None:
    (capability, cudnn, d_qk, d_v), (status, judged_as, measured) = JUDGED[case]
    verdict = judge(capability, cudnn, d_qk, d_v)
    assert verdict.status == status
    assert (verdict.judged_as and verdict.judged_as.cudnn) == judged_as
    assert verdict.measured is measured
    assert verdict.cudnn_known is (cudnn is not None)


#: cuDNN -> (the build whose measurement judges it, whether it is its own).
MEASUREMENTS = {
    None: (V914, False),
    (9, 10, 0): (V914, False),
    (9, 14, 3): (V914, True),
    (9, 19, 0): (V919, True),
    (9, 24, 0): (V9241, True),
    (9, 26, 9): (V9241, False),
    (9, 27, 5): (V927, True),
    (9, 28, 0): (V9281, True),
    (10, 0, 0): (V9281, False),
}


@pytest.mark.parametrize("cudnn", list(MEASUREMENTS), ids=str)
def test_measurement_for(cudnn: Optional[Tuple[int, int, int]]) -> None:
    m, own = measurement_for(cudnn)
    assert (m.cudnn, own) == MEASUREMENTS[cudnn]


def test_measured_builds_right_everywhere_and_the_remedy() -> None:
    """Only 9.27 and 9.28.1 are right everywhere measured; a remedy names the newer, at any
    head dims."""
    builds = (V914, V919, V920, V9241, V927, V9281)
    right = [measurement_for(v)[0].right_at_every_shape for v in builds]
    assert right == [False, False, False, False, True, True]
    for dims in ((128, None), (256, 128), (192, 128), (256, 256)):
        assert newest_right(*dims).cudnn == V9281
    assert version_text((9, 14, 0)) == "9.14.0"
    assert pip_hint((9, 27, 0)) == (
        "pip install 'nvidia-cudnn-cu12>=9.27' (CUDA 12) or 'nvidia-cudnn-cu13>=9.27' (CUDA 13)"
    )


# --------------------------------------------------------------------------- decide

#: Call shapes: (kv_thd, gqa, shared_offsets, filled_by_te).
GQA = CallShape(True, True, False, True)
MHA = CallShape(True, False, False, True)
SELF = CallShape(True, True, True, True)  # one offsets tensor for q and kv, bf16
SELF_FP32 = CallShape(True, True, True, False)  # the same in fp32: TE zero-fills nothing
NOT_THD = CallShape(False, True, False, True)

#: (policy, guard, verdict status, call shape) -> (run, zero).
DECIDED = {
    # The policy off: TE alone, whatever was measured.
    ("off", "fallback", "live_rows_wrong", GQA): ("te", False),
    ("off", "strict", "stale_rows", GQA): ("te", False),
    # k and v not THD: nothing to repair or guard.
    ("auto", "strict", "live_rows_wrong", NOT_THD): ("te", False),
    ("always", "fallback", "stale_rows", NOT_THD): ("te", False),
    # Measured right: auto passes through; always still runs the post-pass.
    ("auto", "strict", "right", GQA): ("te", False),
    ("always", "fallback", "right", GQA): ("te", True),
    ("always", "fallback", "right", MHA): ("te", True),
    # Stale rows (or nothing measured applies): the post-pass on GQA calls whose key rows can
    # lack queries.
    ("auto", "fallback", "stale_rows", GQA): ("te", True),
    ("auto", "fallback", "unknown", GQA): ("te", True),
    ("auto", "strict", "not_hopper", GQA): ("te", True),
    ("auto", "fallback", "stale_rows", MHA): ("te", False),
    ("auto", "fallback", "not_hopper", MHA): ("te", False),
    ("auto", "fallback", "stale_rows", SELF): ("te", False),
    ("auto", "fallback", "stale_rows", SELF_FP32): ("te", True),
    ("always", "fallback", "stale_rows", SELF): ("te", True),
    ("always", "fallback", "stale_rows", MHA): ("te", True),
    # Live rows wrong: the guard decides, GQA or MHA.
    ("auto", "fallback", "live_rows_wrong", GQA): ("fallback", True),
    ("auto", "fallback", "live_rows_wrong", MHA): ("fallback", True),
    ("auto", "strict", "live_rows_wrong", GQA): ("raise", False),
    ("auto", "strict", "live_rows_wrong", MHA): ("raise", False),
    ("auto", "warn", "live_rows_wrong", GQA): ("warn", True),
    ("auto", "warn", "live_rows_wrong", MHA): ("warn", False),
    ("auto", "warn", "live_rows_wrong", SELF): ("warn", False),
    ("always", "warn", "live_rows_wrong", MHA): ("warn", True),
    ("auto", "off", "live_rows_wrong", GQA): ("te", True),
    ("auto", "off", "live_rows_wrong", MHA): ("te", False),
    ("always", "off", "live_rows_wrong", MHA): ("te", True),
}
_NAMES = {GQA: "gqa", MHA: "mha", SELF: "self", SELF_FP32: "self-fp32", NOT_THD: "not-thd"}


@pytest.mark.parametrize(
    "case", list(DECIDED), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{_NAMES[c[3]]}"
)
def test_decide(case: tuple) -> None:
    policy, guard, status, shape = case
    action = decide(Verdict(status, None, False, True), shape, policy, guard)
    assert (action.run, action.zero) == DECIDED[case]
    assert action.why  # one line for the log and for doctor
