#!/usr/bin/env bash
# Everything the GPU machine has to show, in one command (2 GPUs for the CP part):
# the validation run (doctor + gpu tests, both cuDNN builds), the two-rank context-parallel
# check (both builds) and the examples. Committed: $OUT/run.json (everything, one data file)
# and $OUT/validation.md (the page made from it). Raw outputs, for debugging only:
# $OUT/validation.tgz, $OUT/extra.tgz.
set -uo pipefail
# shellcheck source=tests/gpu/builds.sh
source tests/gpu/builds.sh
out=${OUT:-/tmp/te-gqa-fix-out}
extra=/tmp/te-gqa-fix-extra
mkdir -p "$out" "$extra"
# Knobs (one command may run 10 minutes on the GPU machine, so a run can be split):
#   PARTS="validation cp examples" (default: all three), BUILDS="system pip route",
#   CP_ARGS (more cp_check.py arguments, e.g. "--steps 3" to take the wrapper's fast lane).
# A run split over two commands on one warm machine collects both halves: the raw
# outputs stay in $RES and /tmp/te-gqa-fix-extra between them.
parts=${PARTS:-validation cp examples}
case " $parts " in *" validation "*) bash tests/gpu/run_validation.sh ;; esac
nproc_cp=${CP_NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
for build in ${BUILDS:-system pip route}; do
  (
    use_build "$build"
    if [ "$nproc_cp" -ge 2 ] && [[ " $parts " == *" cp "* ]]; then
      timeout "${CP_TIMEOUT:-200}" torchrun --standalone --nproc-per-node "$nproc_cp" \
        tests/multigpu/cp_check.py --out "$extra" --tag "$build" ${CP_ARGS:-} >"$extra/cp-$build.log" 2>&1
      echo "cp_check ($build, $nproc_cp ranks): exit $?"
      grep -E "^RESULT" "$extra/cp-$build.log"
    fi
    [[ " $parts " == *" examples "* ]] || exit 0
    for ex in seed_repro drop_in; do
      timeout 120 python3 "examples/$ex.py" >"$extra/$ex-$build.log" 2>&1
      echo "examples/$ex.py ($build): exit $?"
    done
    if [ "$nproc_cp" -ge 2 ]; then
      timeout 120 torchrun --standalone --nproc-per-node "$nproc_cp" examples/context_parallel.py \
        >"$extra/context_parallel-$build.log" 2>&1
      echo "examples/context_parallel.py ($build): exit $?"
    fi
    timeout 120 python3 -m te_gqa_fix doctor >"$extra/doctor-$build.txt" 2>&1
    echo "doctor ($build, text): exit $?"
  )
done
res=${RES:-/tmp/te-gqa-fix-validation}
python3 tests/gpu/report.py collect "$res" --builds "$(echo ${BUILDS:-system pip route} | tr ' ' ',')" \
  --extra "$extra" --command "${COMMAND:-bash tests/gpu/run_all.sh}" -o "$out/run.json"
python3 tests/gpu/report.py render "$out/run.json" >"$out/validation.md"
tar czf "$out/extra.tgz" -C "$(dirname "$extra")" "$(basename "$extra")"
echo "data file $out/run.json, page $out/validation.md (raw outputs: $out/validation.tgz, $out/extra.tgz)"
