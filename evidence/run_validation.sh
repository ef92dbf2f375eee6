#!/usr/bin/env bash
# The GPU tests on each cuDNN build (GPU machine, repository root, GPU kit staged):
# doctor --json, then `pytest tests -m gpu` (every gpu-marked test, tests/gpu and the
# GPU cases of the CPU files) with per-case records (GPU_TESTS_RECORD) and junit
# outcomes. Raw outputs only, in ${RES:-/tmp/te-gqa-fix-validation}; evidence/run_all.sh
# turns them into a file of blocks to merge into docs/data/validation.jsonl.
# Knobs: BUILDS, TESTS (default tests: the files or folders pytest collects), PYTEST_TIMEOUT,
# PYTEST_ARGS.
# The builds run side by side on the one GPU (each about 6 minutes on a cold Triton cache).
set -uo pipefail
# shellcheck source=evidence/builds.sh
source evidence/builds.sh
res=${RES:-/tmp/te-gqa-fix-validation}
mkdir -p "$res"
builds=${BUILDS:-system pip route}
# The wheel goes into site-packages once, before any build's processes start.
[[ " $builds " == *" route "* || " $builds " == *" cudnn9"* ]] && ensure_wheel
for build in $builds; do
  (
    use_build "$build"
    timeout 120 python3 -m te_gqa_fix doctor --json >"$res/doctor-$build.json" 2>"$res/doctor-$build.log"
    echo "doctor ($build): exit $?"
    rm -f "$res/records-$build.jsonl"
    GPU_TESTS_RECORD="$res/records-$build.jsonl" timeout "${PYTEST_TIMEOUT:-420}" \
      python3 -m pytest ${TESTS:-tests} -m gpu -q -p no:cacheprovider --junitxml="$res/junit-$build.xml" \
      ${PYTEST_ARGS:-} >"$res/pytest-$build.log" 2>&1
    echo "pytest ($build): exit $?"
    tail -3 "$res/pytest-$build.log"
  ) &
done
wait
