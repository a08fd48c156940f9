#!/usr/bin/env bash
# Today's simulator against every kept H200 run of the validation suite (no GPU; ~1 min):
#
#   bash bench/validation_predict.sh [OUT]        # OUT/summary.md, summary.json, summary.html
#
# Each run is predicted with the profile of the runtime that measured it. The bundled profiles
# were measured at e261c2b, where the tensor-core attention (verify rows, and decode from batch
# 4) became the default; the runs measured before it keep their runtime's profile, archived in
# calibration/profiles/archive/ (named by the commit that measured it) until they are measured
# again. The bundle: bench/results/validation/measured.json.gz (a later --on both output
# merges into it the same way: predict it into OUT with --only, then copy OUT's bundle).
set -u  # `kestrel validate` exits 1 when a scenario fails its tolerance: go on, say so last
OUT=${1:-runs/validation}
KEPT=bench/results/validation/measured.json.gz
ARCHIVE=$PWD/calibration/profiles/archive
V="kestrel validate scenarios/validation --out $OUT --measured $KEPT"
$V
# qwen3-8b bf16 runs from before e261c2b (271d5cf's profile; fourth and fifth sessions)
$V --only colocated-saturated,disaggregated-saturated,ladder-1-bf16-colocated,light-load-mixed-lengths,preempt-kv-pressure,spec-k12-heldout \
  --set costs.profile=$ARCHIVE/qwen3-8b_h200_271d5cf.json
$V --only spec-organic-int4-copy --set costs.profile=$ARCHIVE/qwen3-0.6b-organic_h200_8fbd978.json
echo "summary (every scenario): $OUT/summary.md"
