#!/usr/bin/env bash
# The CUDA tests (tests/test_gpu_fast_paths.py) on the device, within one call's limit, their output in
# $OUT/gpu_tests.log and its last lines printed. Usage: bash bench/gpu_tests.sh [LIMIT_S] [pytest -k expression]
# Session 18 lost a call to `timeout 230 python -m pytest … | grep …`: timeout stopped pytest, but inductor's
# compile workers kept the pipe open, so grep, and the call, waited to the device limit. Here pytest writes to
# a file, not a pipe, its workers are killed with it (-k), and compilation stays in the process.
# Beside a variant's run in one call: `GPU_TESTS="decod or top_k" bash bench/ablation.sh run NAME` (or GPU_TESTS=all),
# which waits for both. Not `while pgrep -f "pytest …"`: the pattern is in the call's own command line, so it
# waits for itself to the call's limit (session 19 lost 4 device minutes so). -v: each test's name and outcome is in
# the log as it ends, so a run stopped at the limit still says which test failed (session 25's `-q` said only "F").
set -uo pipefail
# NVG_TESTS_INSTAFAIL: each failure's report in the log as it happens (tests/conftest.py), not only in the summary
# that the limit may cut off
export PYTHONPATH=/root/site:/root/smk:$PWD TORCHINDUCTOR_COMPILE_THREADS=1 NVG_TESTS_INSTAFAIL=1
# nvg.settings needs jsonschema, which comes with the Snakemake wheels (the staging's third call): without them every
# test fails at collection (session 31 lost a call so)
python -c "import jsonschema" 2> /dev/null || { echo "no jsonschema: install .device/snakemake/*.whl into /root/smk first" >&2; exit 2; }
timeout -k 10 "${1:-240}" python -m pytest -v tests/test_gpu_fast_paths.py ${2:+-k "$2"} > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"
grep -E "passed|failed|skipped|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -25
