#!/usr/bin/env bash
# GPU validation run (GPU machine, repository root, GPU kit staged; see docs/validation.md).
# For each cuDNN build the kit offers (system 9.14 = affected, pip 9.19 = fixed upstream):
# doctor, then the gpu-marked tests with per-case JSON records. Then the markdown report.
# Writes the results folder ${RES:-/tmp/te-gqa-fix-validation} and packs it as
# ${OUT:-that folder's parent}/validation.tgz (one file to bring back).
set -uo pipefail
res=${RES:-/tmp/te-gqa-fix-validation}
out=${OUT:-$(dirname "$res")}
mkdir -p "$res" "$out"
builds=${BUILDS:-system pip}
for build in $builds; do
  (
    export GPU_KIT_CUDNN=$build
    # shellcheck disable=SC1091
    source .gpu-kit/env.sh
    timeout 120 python3 -m te_gqa_fix doctor --json >"$res/doctor-$build.json" 2>"$res/doctor-$build.log"
    echo "doctor ($build): exit $?"
    rm -f "$res/records-$build.jsonl"
    TE_GQA_FIX_RECORD="$res/records-$build.jsonl" timeout "${PYTEST_TIMEOUT:-270}" python3 -m pytest tests/gpu -m gpu -q \
      -p no:cacheprovider --junitxml="$res/junit-$build.xml" ${PYTEST_ARGS:-} \
      >"$res/pytest-$build.log" 2>&1
    echo "pytest ($build): exit $?"
    tail -5 "$res/pytest-$build.log"
  )
done
python3 tests/gpu/report.py "$res" --builds "$(echo $builds | tr ' ' ',')" \
  --command "bash tests/gpu/run_validation.sh" >"$res/validation.md"
cp "$res/validation.md" "$out/validation.md"
tar czf "$out/validation.tgz" -C "$(dirname "$res")" "$(basename "$res")"
echo "results in $out/validation.tgz"
