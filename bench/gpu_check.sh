#!/usr/bin/env bash
# GPU check in one go (under 6 minutes on an H200): the device, the tests marked `gpu`, then
# bench/gpu.py, then bench/compiled.py on the GPU; one summary file, $OUT_DIR/gpu_check.md.
#
#   bash bench/gpu_check.sh                      # from anywhere
#   OUT=/some/dir PYTHON=/path/to/python bash bench/gpu_check.sh
#
# OUT_DIR: $OUT_DIR, else $OUT, else bench/results/gpu (a relative path is taken from the repository
# root). PYTHON: default .venv/bin/python.
# Exit status: 1 if the GPU tests fail (or time out), 3 if the bench crashed or timed out,
# 0 otherwise; the bench's target misses are reported in the summary, not fatal.
# Without a CUDA device the tests are skipped and the bench writes a "not measured" file.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
OUT_DIR="${OUT_DIR:-${OUT:-bench/results/gpu}}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/gpu_check.md"
T_SMI="${T_SMI:-5}"         # seconds per phase (3 x T_SMI + T_TESTS + T_BENCH + T_COMPILED = 355 s, under 6 minutes)
T_TESTS="${T_TESTS:-135}"   # collection, then ~33 Triton compilations of the quantize tests, ~14 of the block kernels
T_BENCH="${T_BENCH:-150}"   # bench/gpu.py writes its file after each section: a timeout keeps what it measured
                            # (its blocks section, the block-scaled kernel at 256M float32, adds ~20 s of compilation)
T_COMPILED="${T_COMPILED:-55}"  # bench/compiled.py on the GPU: the compiled model untraced, traced, applied (fresh compiles)
start=$(date +%s)

echo "== device"
if command -v nvidia-smi >/dev/null 2>&1; then
    device_info=$(timeout "$T_SMI" nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
                  --format=csv,noheader 2>&1 || true)
    timeout "$T_SMI" nvidia-smi 2>&1 || true
else
    device_info="nvidia-smi not found"
fi
echo "$device_info"
torch_info=$(timeout "$T_SMI" "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1 || true)
echo "$torch_info"

echo "== GPU tests (pytest -m gpu)"
tests_log="$OUT_DIR/gpu_tests.log"
set +e
timeout "$T_TESTS" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$tests_log"
tests_rc=${PIPESTATUS[0]}
set -e
tests_line=$(grep -E '(passed|failed|skipped|deselected|error|no tests ran)' "$tests_log" | grep -E ' in [0-9.]+s' | tail -1 || true)
[ "$tests_rc" -eq 124 ] && tests_line="timed out after ${T_TESTS} s ${tests_line}"
# pytest: 0 all passed, 5 no tests collected; anything else is a failure
tests_ok=1
if [ "$tests_rc" -ne 0 ] && [ "$tests_rc" -ne 5 ]; then tests_ok=0; fi

echo "== bench/gpu.py --out $OUT_DIR"
bench_log="$OUT_DIR/gpu_bench.log"
rm -f "$OUT_DIR/gpu.md" "$OUT_DIR/gpu.json"     # no stale results in the summary
set +e
timeout "$T_BENCH" "$PYTHON" bench/gpu.py --out "$OUT_DIR" 2>&1 | tee "$bench_log"
bench_rc=${PIPESTATUS[0]}
set -e

echo "== bench/compiled.py --device cuda (torch.compile: traced and applied, from a fresh compile)"
compiled_log="$OUT_DIR/compiled.log"
compiled_rc=0
if [ "$(timeout "$T_SMI" "$PYTHON" -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null)" = "True" ]; then
    set +e
    timeout "$T_COMPILED" "$PYTHON" bench/compiled.py --device cuda --rounds 1 --steps 12 \
        --configs compiled "compiled + trace" "compiled + apply" > "$compiled_log" 2>&1
    compiled_rc=$?
    set -e
else
    echo "no CUDA device: not measured" > "$compiled_log"
fi

elapsed=$(( $(date +%s) - start ))
{
    echo "# GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (uncommitted changes)')"
    echo "- device: ${device_info}"
    echo "- ${torch_info}"
    echo "- GPU tests (\`pytest -q -m gpu tests\`, exit ${tests_rc}): ${tests_line:-no result line}"
    echo "- bench (\`bench/gpu.py\`, exit ${bench_rc}$([ "$bench_rc" -eq 124 ] && echo ", timed out after ${T_BENCH} s"))"
    echo "- total: ${elapsed} s"
    echo
    if [ -f "$OUT_DIR/gpu.md" ]; then
        sed -e '1s/^# /## /' "$OUT_DIR/gpu.md"
    else
        echo "bench/gpu.py wrote no results file (see gpu_bench.log)"
    fi
    echo
    echo "## torch.compile (\`bench/compiled.py --device cuda\`, exit ${compiled_rc}$([ "$compiled_rc" -eq 124 ] && echo ", timed out after ${T_COMPILED} s"); target: traced at most 1.5x the untraced compiled run)"
    echo
    grep -E '^\||steps from a fresh compile|not measured' "$compiled_log" || echo "no table (see compiled.log)"
} > "$SUMMARY"
echo "== summary: $SUMMARY (${elapsed} s)"

if [ "$tests_ok" -ne 1 ]; then
    echo "GPU tests FAILED (exit $tests_rc)" >&2
    exit 1
fi
if [ "$bench_rc" -ne 0 ]; then
    echo "bench/gpu.py failed (exit $bench_rc)" >&2
    exit 3
fi
exit 0
