#!/usr/bin/env bash
# Everything docs/performance.md shows, on the GPU machine (repository root, GPU kit staged;
# the te-gqa-fix wheel in .whl-mcore/ for the start-up timing, as evidence/builds.sh says):
# bench_postpass.py and bench_step.py on each build (system: cuDNN 9.14, affected; pip: 9.19,
# fixed), fallback_cost.py on pip (TE's backward on the fixed cuDNN), then startup_cudnn.py.
# About 6 minutes on one H200.
# Knobs: PARTS (default "postpass step fallback startup"), BUILDS (default "system pip"), QUICK=1,
# STARTUP_REPEAT (default 5), COMMIT (the code measured, where the tree here has no .git).
# Raw outputs stay in /tmp between commands on one warm machine, so a run may be split.
# Brings back $OUT/performance.jsonl: the (build, benchmark) blocks this run measured, each
# with its date, commit, GPU and stack. Merge it into docs/data/performance.jsonl on the CPU
# side (it replaces the rows it measured again only; every other row keeps its own run):
#   python3 evidence/performance_report.py merge performance.jsonl
#   python3 evidence/performance_report.py render
# $OUT/performance.md is this run alone, rendered for a first look (not for committing).
set -uo pipefail
# shellcheck source=evidence/builds.sh
source evidence/builds.sh
out=${OUT:-/tmp/te-gqa-fix-bench}
raw=/tmp/te-gqa-fix-bench-raw
mkdir -p "$out" "$raw"
parts=" ${PARTS:-postpass step fallback startup} "
commit=$(code_commit)
echo "code measured: $commit"
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
command="bash evidence/run_benchmarks.sh"  # with the knobs this run was given
for knob in PARTS BUILDS QUICK STARTUP_REPEAT; do
  [ -n "${!knob:-}" ] && command="$knob=${!knob@Q} $command"
done
python3 evidence/performance_report.py collect "$raw"/*.json --run "${COMMAND:-$command}" \
  --commit "$commit" -o "$out/performance.jsonl"
python3 evidence/performance_report.py render "$out/performance.jsonl" -o "$out/performance.md" --no-figures
echo "blocks of this run: $out/performance.jsonl (merge it: see the top of this script)"
