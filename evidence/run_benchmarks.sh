#!/usr/bin/env bash
# Everything docs/performance.md shows, on the GPU machine (repository root, GPU kit staged;
# the te-gqa-fix wheel in .whl-mcore/ for the start-up timing, as evidence/builds.sh says):
# bench_postpass.py and bench_step.py on each build (system: cuDNN 9.14, affected; pip: 9.19,
# fixed), fallback_cost.py on pip (TE's backward on the fixed cuDNN), then startup_cudnn.py.
# About 6 minutes on one H200.
# Knobs: PARTS (default "postpass step fallback startup"), BUILDS (default "system pip"), QUICK=1,
# STARTUP_REPEAT (default 5).
# Raw outputs stay in /tmp between commands on one warm machine, so a run may be split.
# Brings back $OUT/performance.json (commit as docs/data/performance.json) and
# $OUT/performance.md (the page it renders to: docs/performance.md).
set -uo pipefail
# shellcheck source=evidence/builds.sh
source evidence/builds.sh
out=${OUT:-/tmp/te-gqa-fix-bench}
raw=/tmp/te-gqa-fix-bench-raw
mkdir -p "$out" "$raw"
parts=" ${PARTS:-postpass step fallback startup} "
for build in ${BUILDS:-system pip}; do
  (
    use_build "$build"
    if [[ $parts == *" fallback "* ]] && [ "$build" = pip ]; then  # TE's bwd on a fixed cuDNN
      timeout 240 python3 benchmarks/fallback_cost.py --out "$raw/fallback-$build.json" \
        >"$raw/fallback-$build.log" 2>&1
      echo "fallback_cost.py ($build): exit $?"
      tail -n 9 "$raw/fallback-$build.log"
    fi
    for b in postpass step; do
      [[ $parts == *" $b "* ]] || continue
      opts=()
      [ "$b" = postpass ] && [ -n "${QUICK:-}" ] && opts=(--quick)
      # On a fixed cuDNN both offsets variants are the same pass-through: one is measured.
      [ "$b" = step ] && [ "$build" = pip ] && opts=(--offsets one)
      timeout "${BENCH_TIMEOUT:-240}" python3 "benchmarks/bench_$b.py" --out "$raw/$b-$build.json" \
        "${opts[@]}" >"$raw/$b-$build.log" 2>&1
      echo "bench_$b.py ($build): exit $?"
      tail -n 6 "$raw/$b-$build.log"
    done
  )
done
if [[ $parts == *" startup "* ]]; then
  (
    use_build system
    ensure_wheel
    timeout 400 python3 benchmarks/startup_cudnn.py --repeat "${STARTUP_REPEAT:-5}" \
      --out "$raw/startup.json" >"$raw/startup.log" 2>&1
    echo "startup_cudnn.py: exit $?"
    tail -n 3 "$raw/startup.log"
  )
fi
python3 evidence/performance_report.py collect "$raw"/*.json --command "${COMMAND:-bash evidence/run_benchmarks.sh}" \
  -o "$out/performance.json"
python3 evidence/performance_report.py render "$out/performance.json" -o "$out/performance.md"
echo "data file $out/performance.json, page $out/performance.md"
