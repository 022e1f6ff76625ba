#!/usr/bin/env bash
# Where do the INT4 GEMV's warps stall? Nsight Compute over one M = 1 launch per target (research/kernels/ncu_probe.py),
# then one JSON summary; the answer is in docs/kernel-log.md (telemetry/raw/ncu_20261130T2011_h200.json).
# Clocks are left as found (--clock-control none); caches are flushed before every replay pass (ncu's default).
#   OUT=dir bash research/kernels/ncu_run.sh [TARGET...]     (targets default to NCU_TARGETS below)
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the CSVs and the summary}
mkdir -p "$OUT/ncu"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
if [[ -z $NCU ]]; then echo "ncu not found" >&2; exit 2; fi
NCU_TARGETS=(
    int4:gate_up_14336x4096:128                 # the tuned entry: 1,128,256,s2,w4,p4
    int4:gate_up_14336x4096:128:1,128,256,s2,w4  # register prefetch, one tile ahead, no cp.async staging
    int4:gate_up_14336x4096:128:1,64,256,s2,w4,p3
    int4:gate_up_14336x4096:128:1,128,256,s2,w8,p4
    bf16:gate_up_14336x4096:128
    tinygemm:gate_up_14336x4096:128
    int4:down_4096x14336:128
    int4:lm_head_128256x4096:128
    bf16:lm_head_128256x4096:128
    tinygemm:lm_head_128256x4096:128
)
EXTRA_METRICS=$(python3 -c "from research.kernels.ncu_probe import EXTRA_METRICS; print(','.join(EXTRA_METRICS))")
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=("${NCU_TARGETS[@]}")
status=0
for t in "${targets[@]}"; do
    name=$(echo "$t" | tr ':,' '__')
    echo "=== $(date -u +%T) $t"
    "$NCU" --clock-control none --profile-from-start off --csv --page raw \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats \
        --metrics "$EXTRA_METRICS" \
        python3 -m research.kernels.ncu_probe run "$t" >"$OUT/ncu/$name.csv" 2>"$OUT/ncu/$name.err" || {
        echo "ncu failed on $t (see $name.err)"; status=1; }
done
# SOURCE_TARGET: one target's SASS with warp-state samples per instruction (the source page), for where it stalls
if [[ -n ${SOURCE_TARGET:-} ]]; then
    echo "=== $(date -u +%T) source page: $SOURCE_TARGET"
    "$NCU" --clock-control none --profile-from-start off --section SourceCounters --section WarpStateStats \
        --page source --print-source sass --csv \
        python3 -m research.kernels.ncu_probe run "$SOURCE_TARGET" >"$OUT/ncu_source_sass.csv" \
        2>"$OUT/ncu_source_sass.err" || { echo "ncu source page failed"; status=1; }
fi
source_args=()
[[ -s $OUT/ncu_source_sass.csv ]] && source_args=(--source "$OUT/ncu_source_sass.csv" --source-target "$SOURCE_TARGET")
python3 -m research.kernels.ncu_probe summarize --out "$OUT/ncu_summary.json" "${source_args[@]}" "$OUT"/ncu/*.csv \
    || status=1
exit $status
