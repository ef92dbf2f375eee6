#!/usr/bin/env bash
# Everything docs/validation.md shows, on the GPU machine (repository root, GPU kit staged;
# 2 GPUs for the context-parallel part, 2 GPUs and .whl-mcore/ for Megatron-Core):
#   validation  the GPU tests and doctor on each build (evidence/run_validation.sh)
#   cp          evidence/multigpu/cp_check.py under torchrun, each build
#   examples    examples/seed_repro.py, drop_in.py (and context_parallel.py on 2 GPUs)
#   megatron    evidence/multigpu/megatron/run.sh
# Knobs: PARTS (default "validation cp examples"), BUILDS (default "system pip route"; add
# cudnn927 once tests/gpu/cudnn_kit.sh has staged cuDNN 9.27), CP_ARGS, and COMMIT (the
# code measured, where the tree here has no .git; see builds.sh).
# Raw outputs stay in /tmp between commands on one warm machine, so a run may be split over
# several commands: the last one's file holds every part.
# Brings back $OUT/validation.jsonl: the (build, suite) blocks this run measured, each with
# its date, commit, GPU and stack. Merge it into docs/data/validation.jsonl on the CPU side
# (it replaces those blocks only; every other build and suite keeps its own run):
#   python3 evidence/validation_report.py merge validation.jsonl
#   python3 evidence/validation_report.py render
# $OUT/validation.md is this run alone, rendered for a first look (not for committing).
set -uo pipefail
# shellcheck source=evidence/builds.sh
source evidence/builds.sh
out=${OUT:-/tmp/te-gqa-fix-out}
res=${RES:-/tmp/te-gqa-fix-validation}
extra=/tmp/te-gqa-fix-extra
mres=/tmp/te-gqa-fix-megatron
mkdir -p "$out" "$extra"
parts=" ${PARTS:-validation cp examples} "
builds=${BUILDS:-system pip route}
commit=$(code_commit)
echo "code measured: $commit"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[[ $parts == *" validation "* ]] && RES=$res BUILDS=$builds bash evidence/run_validation.sh
for build in $builds; do
  (
    use_build "$build"
    # The stack of this build, for the blocks whose outputs carry none (the examples).
    timeout 120 python3 evidence/stack_probe.py --out "$extra/stack-$build.json" \
      >"$extra/stack-$build.log" 2>&1 || echo "stack_probe ($build): exit $?"
    if [ "$ngpu" -ge 2 ] && [[ $parts == *" cp "* ]]; then
      timeout "${CP_TIMEOUT:-200}" torchrun --standalone --nproc-per-node "$ngpu" \
        evidence/multigpu/cp_check.py --out "$extra" --tag "$build" ${CP_ARGS:-} >"$extra/cp-$build.log" 2>&1
      echo "cp_check ($build, $ngpu ranks): exit $?"
    fi
    [[ $parts == *" examples "* ]] || exit 0
    for ex in seed_repro drop_in; do
      timeout 120 python3 "examples/$ex.py" >"$extra/$ex-$build.log" 2>&1
      rc=$?; echo "exit $rc" >>"$extra/$ex-$build.log"; echo "examples/$ex.py ($build): exit $rc"
    done
    if [ "$ngpu" -ge 2 ]; then
      timeout 120 torchrun --standalone --nproc-per-node "$ngpu" examples/context_parallel.py \
        >"$extra/context_parallel-$build.log" 2>&1
      rc=$?; echo "exit $rc" >>"$extra/context_parallel-$build.log"
      echo "examples/context_parallel.py ($build): exit $rc"
    fi
  )
done
megatron=()
if [[ $parts == *" megatron "* ]]; then
  RES=$mres OUT=$out bash evidence/multigpu/megatron/run.sh
  echo "megatron: exit $?"
  megatron=(--megatron "$mres")
fi
command="bash evidence/run_all.sh"  # with the knobs this run was given
for knob in CP_ARGS TESTS PYTEST_ARGS PYTEST_TIMEOUT BUILDS PARTS; do
  [ -n "${!knob:-}" ] && command="$knob=${!knob@Q} $command"
done
python3 evidence/validation_report.py collect --tests "$res" --builds "$(echo $builds | tr ' ' ',')" \
  --extra "$extra" "${megatron[@]}" --command "${COMMAND:-$command}" --commit "$commit" \
  -o "$out/validation.jsonl"
python3 evidence/validation_report.py render "$out/validation.jsonl" -o "$out/validation.md" --no-figures
echo "blocks of this run: $out/validation.jsonl (merge it: see the top of this script)"
