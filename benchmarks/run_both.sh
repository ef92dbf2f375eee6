#!/usr/bin/env bash
# The post-pass benchmark on both cuDNN builds of the GPU kit, in one session, then the
# combined report (GPU machine, repository root, GPU kit staged; see docs/performance.md).
#   system (cuDNN 9.14, affected): every workload and workaround;
#   pip    (cuDNN 9.19, fixed):    the backward, the wrapper, the post-pass, host times.
# Writes into ${OUT:-./bench-out} (5 files): bench.md (all tables), performance.md and
# README.md (this checkout's files with their generated blocks rewritten: copy them over
# docs/performance.md and README.md), raw.tgz (bench.json and log of each build), and
# run.log. About 3 minutes on one H200; QUICK=1 for a shorter run (no 128K, MQA 32K).
set -uo pipefail
out=${OUT:-$PWD/bench-out}
work=$(mktemp -d)
mkdir -p "$out"
quick=${QUICK:+--quick}
{
  for build in system pip; do
    extra=""
    [ "$build" = pip ] && extra="--skip-workarounds"
    (
      export GPU_KIT_CUDNN=$build
      # shellcheck disable=SC1091
      source .gpu-kit/env.sh
      mkdir -p "$work/$build"
      limit=140; [ "$build" = pip ] && limit=90
      timeout "${BENCH_TIMEOUT:-$limit}" python3 benchmarks/bench_postpass.py --out "$work/$build" \
        --label "$build" $quick $extra ${BENCH_ARGS:-} >"$work/$build/bench.log" 2>&1
      echo "bench ($build): exit $? after ${SECONDS}s"
      tail -3 "$work/$build/bench.log"
    )
  done
  cp docs/performance.md "$work/performance.md"
  cp README.md "$work/README.md"
  python3 benchmarks/bench_report.py "$work/system/bench.json" "$work/pip/bench.json" \
    --md "$out/bench.md" --doc "$work/performance.md" --readme "$work/README.md" >/dev/null
  echo "report: exit $?"
  cp "$work/performance.md" "$work/README.md" "$out/"
  tar czf "$out/raw.tgz" -C "$work" system pip
} 2>&1 | tee "$out/run.log"
