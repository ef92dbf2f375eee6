#!/usr/bin/env bash
# GPU validation run (GPU machine, repository root, GPU kit staged; see docs/validation.md).
# For each cuDNN build the kit offers (system 9.14 = affected, pip 9.19 = fixed upstream):
# doctor, then the gpu-marked tests with per-case JSON records. Then the markdown report.
# Writes under ${OUT:-/tmp/te-gqa-fix-validation}/res and packs it as results.tgz.
set -uo pipefail
out=${OUT:-/tmp/te-gqa-fix-validation}
res="$out/res"
mkdir -p "$res"
builds=${BUILDS:-system pip}
for build in $builds; do
  (
    export GPU_KIT_CUDNN=$build
    # shellcheck disable=SC1091
    source .gpu-kit/env.sh
    python3 -m te_gqa_fix doctor --json >"$res/doctor-$build.json" 2>"$res/doctor-$build.log"
    echo "doctor ($build): exit $?"
    rm -f "$res/records-$build.jsonl"
    TE_GQA_FIX_RECORD="$res/records-$build.jsonl" python3 -m pytest tests/gpu -m gpu -q \
      -p no:cacheprovider --junitxml="$res/junit-$build.xml" ${PYTEST_ARGS:-} \
      >"$res/pytest-$build.log" 2>&1
    echo "pytest ($build): exit $?"
    tail -5 "$res/pytest-$build.log"
  )
done
python3 tests/gpu/report.py "$res" --builds "$(echo $builds | tr ' ' ',')" \
  --command "bash tests/gpu/run_validation.sh" >"$res/validation.md"
tar czf "$out/results.tgz" -C "$out" res
echo "results in $out/results.tgz"
