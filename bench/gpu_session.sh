#!/usr/bin/env bash
# Checks and measures the GPU runtime, each step under its own time limit: the GPU tests, the
# gemv stream per kernel, the decode benchmark, the decode attention's phase probe and an
# options ablation. Logs and tables go under OUT/session, packed into OUT/session.tgz.
#
#   bash bench/gpu_session.sh COMMIT [OUT] [STEPS]   # COMMIT: `git rev-parse HEAD` here
#
# STEPS: a comma list of tests, gemv, decode, probe, ablation (default all; together up to
# 20 minutes: on a device with a 10-minute call, run tests,gemv then decode,probe,ablation).
# The tests step compiles every kernel module first, in parallel (tests/conftest.py,
# kestrel_rt/cuda/precompile.py). The device's copy of .git may be older than the working
# tree: pass the commit from here.
set -u
COMMIT=${1:?usage: bash bench/gpu_session.sh COMMIT [OUT] [STEPS]}
OUT=${2:-${OUT:-runs/gpu}}
STEPS=,${3:-tests,gemv,decode,probe,ablation},
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
step tests 300 python3 -m pytest -o addopts="" -q -n 12 --durations=25 -p no:cacheprovider tests/gpu tests/test_cli_generate.py
step gemv 120 python3 bench/gemv_bench.py --out "$LOG" --ms 1 --kinds bf16,int4 --paths table,tuned
step decode 420 python3 bench/h200_decode.py --out "$LOG" --commit "$COMMIT" --breakdown
step probe 120 python3 bench/probes/attention_probe.py
step ablation 200 python3 bench/ablation.py --models qwen3-8b:bf16,qwen3-0.6b:bf16 --set pdl=true,false --set fold_norms=true,false
tar czf "$OUT/session.tgz" -C "$OUT" session
cp "$LOG/summary.txt" "$OUT/" 2>/dev/null
grep -E "passed|failed" "$LOG/tests.log" 2>/dev/null | tail -1
grep -E "^(FAILED|ERROR)" "$LOG/tests.log" 2>/dev/null | head -20
cat "$LOG/summary.txt"
tail -n 8 "$LOG/ablation.log" 2>/dev/null
grep -A12 "^| section" "$LOG/h200_decode.md" 2>/dev/null | grep "decode b=1"
