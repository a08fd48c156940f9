#!/usr/bin/env bash
# Today's simulator against every kept H200 run of the validation suite (no GPU; ~1 min):
#
#   bash bench/validation_predict.sh [OUT]        # OUT/summary.md, summary.json, summary.html
#
# Each run is predicted with the bundled profile of its model (calibration/profiles/), measured
# by the same runtime as the run: the qwen3-8b bf16 profile at e261c2b (its CPU draft rows at
# dd741ff, timed inside rounds), the int4 profile and the runs of the seventh session at
# 3b21a80, the organic-pair and qwen3-30b-a3b profiles and their runs at dd741ff (the same
# kernels since e261c2b made the tensor-core attention the default). The bundle:
# bench/results/validation/measured.json.gz
# (a later --on both output merges into it the same way: predict it into OUT with --only,
# then copy OUT's bundle). A run measured by an older runtime than its profile's would be
# predicted with that runtime's profile (--set costs.profile=...), kept until it is measured
# again.
set -u  # `kestrel validate` exits 1 when a scenario fails its tolerance: go on, say so last
OUT=${1:-runs/validation}
KEPT=bench/results/validation/measured.json.gz
kestrel validate scenarios/validation --out "$OUT" --measured "$KEPT"
status=$?
echo "summary (every scenario): $OUT/summary.md"
exit $status
