#!/usr/bin/env bash
# GPU validation run (GPU machine, repository root, GPU kit staged; see docs/validation.md).
# For each cuDNN build the kit offers (system 9.14 = affected, pip 9.19 = fixed upstream):
# doctor, then the gpu-marked tests with per-case JSON records. Then the one data file the
# page is made from ($OUT/run.json) and the page ($OUT/validation.md): those two are what
# gets committed (docs/results/<run>/run.json, docs/validation.md). The raw outputs (logs,
# junit XML) stay in ${RES:-/tmp/te-gqa-fix-validation}, packed as $OUT/validation.tgz for
# debugging only.
set -uo pipefail
# shellcheck source=tests/gpu/builds.sh
source tests/gpu/builds.sh
res=${RES:-/tmp/te-gqa-fix-validation}
out=${OUT:-$(dirname "$res")}
mkdir -p "$res" "$out"
builds=${BUILDS:-system pip route}
for build in $builds; do
  (
    use_build "$build"
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
python3 tests/gpu/report.py collect "$res" --builds "$(echo $builds | tr ' ' ',')" \
  ${EXTRA:+--extra "$EXTRA"} --command "${COMMAND:-bash tests/gpu/run_validation.sh}" \
  -o "$out/run.json"
python3 tests/gpu/report.py render "$out/run.json" >"$out/validation.md"
tar czf "$out/validation.tgz" -C "$(dirname "$res")" "$(basename "$res")"
echo "data file $out/run.json, page $out/validation.md (raw outputs: $out/validation.tgz)"
