#!/usr/bin/env bash
# One device call that checks and measures the GPU runtime (fits the device's 10-minute call):
# the GPU tests, the gemv stream, the decode benchmark and the feature ablation, each under
# its own time limit, logs and tables under OUT.
#
#   bash bench/gpu_session.sh COMMIT [OUT]      # COMMIT: `git rev-parse HEAD` of the checkout
#
# (The device's copy of .git may be older than the working tree: pass the commit from here.)
set -u
COMMIT=${1:?usage: bash bench/gpu_session.sh COMMIT [OUT]}
OUT=${2:-${OUT:-runs/gpu}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run, log to OUT/NAME.log, report its exit status
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? (limit ${limit}s)" | tee -a "$OUT/summary.txt"
}
step gpu_tests 200 python3 -m pytest -o addopts="" -q -n 8 -p no:cacheprovider tests/gpu tests/test_cli_generate.py
step gemv_bench 80 python3 bench/gemv_bench.py --out "$OUT" --ms 1,4
step h200_decode 180 python3 bench/h200_decode.py --out "$OUT" --commit "$COMMIT" --breakdown
step ablation 120 python3 bench/ablation.py --models qwen3-8b:bf16,qwen3-0.6b:bf16,qwen3-8b:int4
grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1
cat "$OUT/summary.txt"
tail -n 30 "$OUT/h200_decode.md" 2>/dev/null
