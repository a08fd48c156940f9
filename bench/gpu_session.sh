#!/usr/bin/env bash
# Checks and measures the GPU runtime: the GPU tests, the gemv stream (tuned and bulk-copy
# kernels), the decode benchmark, the decode attention's phase probe, the feature ablation
# (bf16 with and without the bulk kernel), int4 with and without its bulk kernel and the bulk
# kernel against the tuned ones per rows of x (verify shapes), each under its own time limit
# (all seven take up to 23 minutes: on a device with a 10-minute call, run STEPS tests,gemv,
# then decode,probe, then ablation,int4,rows); logs and
# tables under OUT/session, packed into OUT/session.tgz (the device hands back <= 8 files).
#
#   bash bench/gpu_session.sh COMMIT [OUT] [STEPS]   # COMMIT: `git rev-parse HEAD` here
#
# STEPS: a comma list of tests, gemv, decode, probe, ablation, int4, rows (default all). The tests step
# compiles every kernel module first, in parallel (tests/conftest.py, kestrel_rt/cuda/precompile.py).
# (The device's copy of .git may be older than the working tree: pass the commit from here.)
set -u
COMMIT=${1:?usage: bash bench/gpu_session.sh COMMIT [OUT] [STEPS]}
OUT=${2:-${OUT:-runs/gpu}}
STEPS=,${3:-tests,gemv,decode,probe,ablation,int4,rows},
LOG=$OUT/session
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run, log to LOG/NAME.log, report its exit status
  local name=$1 limit=$2
  shift 2
  [[ $STEPS == *,$name,* ]] || return 0
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "$name: exit $? (limit ${limit}s)" | tee -a "$LOG/summary.txt"
}
step tests 240 python3 -m pytest -o addopts="" -q -n 12 --durations=25 -p no:cacheprovider tests/gpu tests/test_cli_generate.py
step gemv 120 python3 bench/gemv_bench.py --out "$LOG" --ms 1 --kinds bf16,int4 --ring off,b8.4.2048
step decode 420 python3 bench/h200_decode.py --out "$LOG" --commit "$COMMIT" --breakdown
step probe 120 python3 bench/attention_probe.py
step ablation 200 python3 bench/ablation.py --models qwen3-8b:bf16,qwen3-30b-a3b:bf16,qwen3-0.6b:bf16 --pdl all --late-trigger 1 --glu 1 --ring off --bulk off,8.4.2048 --breakdown
step int4 150 python3 bench/ablation.py --models qwen3-8b:int4 --pdl all --late-trigger 1 --glu 1 --ring off --bulk-int4 off,8.4.2048,16.4.2048
step rows 90 python3 bench/bulk_rows.py --reps 1
tar czf "$OUT/session.tgz" -C "$OUT" session
cp "$LOG/summary.txt" "$OUT/" 2>/dev/null
grep -E "passed|failed" "$LOG/tests.log" 2>/dev/null | tail -1
grep -E "^(FAILED|ERROR)" "$LOG/tests.log" 2>/dev/null | head -20
cat "$LOG/summary.txt"
tail -n 12 "$LOG/ablation.log" 2>/dev/null
grep "step" "$LOG/int4.log" 2>/dev/null | head -6
tail -n 7 "$LOG/rows.log" 2>/dev/null
grep -A12 "^| section" "$LOG/h200_decode.md" 2>/dev/null | grep "decode b=1"
