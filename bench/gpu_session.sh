#!/usr/bin/env bash
# Checks and measures the GPU runtime, each step under its own time limit: the GPU tests, the
# speculative decoding and serving tables, the decode benchmark, calibration (the bundled
# profiles), the gemv stream per kernel, the decode attention's phase probe and an options
# ablation. Logs and tables go under OUT/session, packed into OUT/session.tgz.
#
#   bash bench/gpu_session.sh COMMIT [OUT] [STEPS]   # COMMIT: `git rev-parse HEAD` here
#
# STEPS: a comma list of calib_tests, attn_tests, tests, spec, serve, decode, calibrate, cpu_rounds,
# calibrate_int4,
# calibrate_moe, calibrate_organic, gates, validate1..5, validate_organic, validate_moe, beforeafter, predict_k, predict_d1,
# predict_d2, gemv, probe, clock, rounds, draft_prefill, verify, ablation, moe_graphs (default
# tests,spec,serve,decode,calibrate). Measured on 2026-12-02 (steps take about half their
# limits): tests 190 s, calibrate 180 s with spec 100 s, calibrate_organic 60 s with serve
# 70 s, validate1 220 s, validate3 + validate4 290 s; the default grid's 469 points took 3.6
# min (calibrate with validate5: 313 s; calibrate_int4 with validate3: 416 s; predict_d1:
# 414 s); calibration's rests after long runs (since this line) add about a minute. At
# e261c2b (tensor-core attention on, sixth session): tests 147 s, spec + serve ~200 s,
# calibrate (487 points, 3.1 min) + validate1 412 s, calibrate_organic 59 s, validate5 76 s,
# attn_tests 33 s, verify ~75 s. A cold machine takes about 90 s of held time to start; an
# idle one is released after 30 s, so chain calls without a pause.
# Only OUT/session.tgz and OUT/summary.txt come back (the device tool returns a limited number
# of files: a profile written beside many logs was once left behind).
# The tests step compiles every kernel module first, in parallel (tests/conftest.py,
# kestrel_rt/cuda/precompile.py). The device's copy of .git may be older than the working
# tree: pass the commit from here.
set -u
COMMIT=${1:?usage: bash bench/gpu_session.sh COMMIT [OUT] [STEPS]}
OUT=${2:-${OUT:-runs/gpu}}
STEPS=,${3:-tests,spec,serve,decode,calibrate},
LOG=$OUT/session
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
export KESTREL_COMMIT=$COMMIT  # the runs' fingerprints (kestrel_cli/compare.py git_commit)
step() {  # step NAME SECONDS COMMAND...: run, log to LOG/NAME.log, report its exit status
  local name=$1 limit=$2
  shift 2
  [[ $STEPS == *,$name,* ]] || return 0
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "$name: exit $? (limit ${limit}s)" | tee -a "$LOG/summary.txt"
  pack  # after each step: a call cut short keeps it
  # a profile just measured replaces the bundled one in this copy of the tree, so the
  # validation steps of the same call predict with it (the runs and their profile share a
  # session: the CPU draft's steps and the stages drift between sessions)
  if [[ $name == calibrate* ]]; then
    cp "$LOG"/qwen3*_h200.json calibration/profiles/ 2>/dev/null
    mkdir -p "$FRESH" && cp "$LOG"/qwen3*_h200.json "$FRESH"/ 2>/dev/null
  fi
  return 0
}
# ... and so do the later calls to the same (warm) machine: the device copies the tracked
# profiles over on each call, but keeps ignored folders such as runs/ while it stays warm
FRESH=runs/fresh-profiles
if compgen -G "$FRESH/*.json" > /dev/null; then
  cp "$FRESH"/*.json calibration/profiles/
  echo "profiles measured earlier on this machine: $(ls "$FRESH" | tr '\n' ' ')" | tee -a "$LOG/summary.txt"
fi
# what comes back (at most 16 MiB a file): the logs, tables, profiles and each validated
# scenario's measured metrics and comparison; not the reports, traces or predicted runs
pack() {
  tar czf "$OUT/session.tgz" -C "$OUT" --exclude='*.html' --exclude='trace.json' \
    --exclude='timeseries.json' --exclude='kestrel_trace.json' --exclude='sim' session
}
step calib_tests 240 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/test_calibrate_gpu.py tests/test_moe_grouped.py "tests/gpu/test_torch_backend_cuda.py::test_cuda_matches_cpu[moe]"
step attn_tests 200 python3 -m pytest -o addopts="" -q -n 8 -p no:cacheprovider tests/gpu/test_attention.py tests/gpu/test_calibrate_overlap_gpu.py
step tests 330 python3 -m pytest -o addopts="" -q -n 12 --durations=25 -p no:cacheprovider tests/gpu tests/test_cli_generate.py tests/test_calibrate_gpu.py
step spec 240 python3 bench/spec_bench.py --out "$LOG" --commit "$COMMIT"
step serve 200 python3 bench/serve_bench.py --out "$LOG" --commit "$COMMIT"
step gemv 120 python3 bench/gemv_bench.py --out "$LOG" --ms 1 --kinds bf16,int4 --paths table,tuned
step decode 330 python3 bench/h200_decode.py --out "$LOG" --commit "$COMMIT" --breakdown
step calibrate 540 python3 -m kestrel_cli.app calibrate --model qwen3-8b --draft qwen3-0.6b --commit "$COMMIT" --max-minutes 8 --out "$LOG/qwen3-8b_h200.json"
# the CPU draft's steps timed inside rounds (calibration/draft_rounds.py, helper-32), in the
# same call as calibrate's draft@cpu rows (timed alone) and validate5's served draft-cpu run;
# not named calibrate*: its profile must not replace the bundled one
step cpu_rounds 180 bash -c "printf 'name: draft-cpu-rounds\ntiming: {warmup: 2, repeats: 7, cpu_warmup: 1, cpu_repeats: 5}\ndraft:\n  cpu: {batches: [1, 2, 4], contexts: [128, 512, 1024], new_tokens: [1, 2], timed: in_rounds}\n' > /tmp/draft-cpu-rounds.yaml && python3 -m kestrel_cli.app calibrate --model qwen3-8b --draft qwen3-0.6b --draft-device cpu --grid /tmp/draft-cpu-rounds.yaml --commit $COMMIT --out $LOG/draft-cpu-rounds.json"
step calibrate_int4 480 python3 -m kestrel_cli.app calibrate --model qwen3-8b --draft qwen3-0.6b --draft-device gpu --quant int4 --commit "$COMMIT" --max-minutes 6.5 --out "$LOG/qwen3-8b-int4_h200.json"
step calibrate_moe 540 python3 -m kestrel_cli.app calibrate --model qwen3-30b-a3b --draft qwen3-0.6b --draft-device gpu --grid moe --commit "$COMMIT" --max-minutes 7 --out "$LOG/qwen3-30b-a3b_h200.json"
# the organic pair (scenarios/validation/spec-organic-int4-copy.yaml): qwen3-0.6b and its
# int4-last-14 copy as the draft; the default grid, estimated 2.3 min (--dry-run)
step calibrate_organic 330 python3 -m kestrel_cli.app calibrate --model qwen3-0.6b --draft qwen3-0.6b --draft-quant int4-last-14 --draft-device gpu --commit "$COMMIT" --max-minutes 4 --out "$LOG/qwen3-0.6b-organic_h200.json"
# issue 23 item 7: record the GPU regression gates' baselines (they come back in the archive)
step gates 200 bash -c "KESTREL_UPDATE_BASELINES=1 python3 -m pytest -o addopts='' -q -p no:cacheprovider tests/bench -m gpu --benchmark-enable && cp bench/regression/baselines/gpu_h200.json $LOG/"
V="python3 -m kestrel_cli.app validate scenarios/validation --out $LOG/validation --only"
step validate1 570 $V spec-off,spec-k1-fused,spec-k2-separate,spec-k4-fused,spec-k4-separate,spec-k6-per-position,spec-k8-fused
step validate2 570 $V spec-k12-heldout,spec-organic-int4-copy,int4,colocated-saturated,preempt-kv-pressure,draft-cpu
# (measured on 2026-12-02 and kept: chunks 1-2, disaggregated-light, qwen3-30b-a3b and
# light-load-mixed-lengths, which validate4 measures again: its warm-up now captures the
# graphs of chunks that start mid-prompt)
step validate3 570 $V ladder-1-bf16-colocated,ladder-2-int4,ladder-3-int4-disaggregated,ladder-4-int4-disaggregated-spec
step validate4 570 $V disaggregated-saturated,light-load-mixed-lengths
# right after `calibrate` in the same call: the CPU draft's steps vary between sessions (its
# profile and its run must share one), and disaggregated-light predates the split of steps
# beside the other loop
step validate5 300 $V draft-cpu,disaggregated-light
# each right after its profile's calibration in the same call (calibrate_organic: the organic
# pair's per-sequence agreement; calibrate_moe: qwen3-30b-a3b)
step validate_organic 200 $V spec-organic-int4-copy
step validate_moe 300 $V qwen3-30b-a3b
# before/after (issue 20 item 7): the quantized decode rows at d5cb851 (the tree before the
# options object) and here, one after the other; needs the device's .git to hold d5cb851
Q="--no-transformers --quants int8,int4 --models qwen3-0.6b,qwen3-8b,qwen3-30b-a3b"
step beforeafter 300 bash -c "rm -rf /tmp/before && mkdir -p /tmp/before && git archive d5cb851 | tar -x -C /tmp/before && (cd /tmp/before && python3 bench/h200_decode.py --out $LOG/before $Q --commit d5cb851) && python3 bench/h200_decode.py --out $LOG/after $Q --commit $COMMIT"
# issue 23 item 6: the committed k-goodput prediction against the runtime (docs/validation.md)
step predict_k 570 bash -c 'for k in 0 2 1 3 4 6; do if [ $k = 0 ]; then S="--set spec=null --set draft=null"; else S="--set spec.k=$k"; fi; python3 -m kestrel_cli.app run scenarios/validation/predictions/k-goodput.yaml --on both $S --out '"$LOG"'/k-goodput/k$k --trace none; done'
# prediction 3: disaggregation on one GPU against colocation (docs/validation.md), two rates a step
P="scenarios/validation/predictions"
for pair in "predict_d1:4 5" "predict_d2:3 6"; do
  step "${pair%%:*}" 570 bash -c 'for r in '"${pair#*:}"'; do for f in disagg-1gpu colocated-1gpu; do python3 -m kestrel_cli.app run '"$P"'/$f.yaml --on both --set workload.arrivals.rate=$r --out '"$LOG"'/one-gpu/$f-r$r --trace none; done; done'
done
step probe 120 python3 bench/probes/attention_probe.py
# are calibration's back-to-back repeats slower than serving's rhythm (clock under load)?
step clock 150 python3 bench/probes/clock_probe.py
# the round overhead: calibration's one-round-from-idle timing against back-to-back rounds
step rounds 150 python3 bench/probes/round_probe.py
# the draft's prefill alone (calibration) against right after the target's chunk (serving)
step draft_prefill 150 python3 bench/probes/draft_prefill_probe.py --out "$LOG"
# verify forwards with the tensor-core verify attention (mma_verify) off and on
step verify 240 python3 bench/probes/verify_probe.py
# qwen3-30b-a3b prefill of 512 and 2048 tokens, MoE prefill graphs off and on (not a default)
step moe_graphs 240 python3 bench/moe_prefill_bench.py --out "$LOG" --commit "$COMMIT"
step ablation 200 python3 bench/ablation.py --models qwen3-8b:bf16,qwen3-0.6b:bf16 --set pdl=true,false --set fold_norms=true,false
pack
cp "$LOG/summary.txt" "$OUT/" 2>/dev/null
KEEP=$(mktemp -d)
mv "$LOG" "$KEEP/"  # the logs travel in the archive only
LOG=$KEEP/session
for t in tests attn_tests; do
  grep -E "passed|failed" "$LOG/$t.log" 2>/dev/null | tail -1
  grep -E "^(FAILED|ERROR)" "$LOG/$t.log" 2>/dev/null | head -20
done
cat "$LOG/summary.txt"
tail -n 8 "$LOG/ablation.log" 2>/dev/null
tail -n 8 "$LOG/moe_graphs.log" 2>/dev/null
tail -n 45 "$LOG/verify.log" 2>/dev/null
grep -A12 "^| section" "$LOG/h200_decode.md" 2>/dev/null | grep "decode b=1"
tail -n 3 "$LOG/spec_bench.md" "$LOG/serve_bench.md" 2>/dev/null
