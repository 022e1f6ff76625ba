#!/usr/bin/env bash
# A driver for one GPU call of at most 10 minutes: which static tree to decode on the gpu stand-in pair, and how it
# decodes beside plain and the adaptive chain (its records: decode_standin records with tree variants; findings in
# docs/log.md). The build takes 280-330 s of the call; with the probe too a call can run past the limit before its
# decode: set TREE_WIDTHS to fit one call. Steps:
#   1. the gpu pair, built into the cache or loaded from it, and its manifest;
#   2. tree_probe (unless TREE_WIDTHS is set): every static tree's kept tokens (exact under greedy verification),
#      priced at graphed forward times;
#   3. decode_repro with the probe's best tree for code (tree_graphs) beside plain, graphed plain and the adaptive
#      chain, interleaved, greedy identity checked, energy windows after the trials; WIDE_TREE_WIDTHS adds a second
#      tree (tree_graphs_wide) to the same decode;
#   4. the GPU tests of the static cache's graphs (tree cycles, forwards, the gear's precisions) against eager runs
#      (tiny models).
# Every step runs whatever the others returned; each step's exit code is in $OUT/steps.txt.
#
#   OUT=/path/to/out bash research/standin/tree_run.sh [extra decode_repro flags...]
#   TREE_WIDTHS=4,3,3 ...   skip the probe and decode this tree (build + tests + decode: about 9 minutes)
#   WIDE_TREE_WIDTHS=6,4,4 ...   and decode this tree beside it
#   FUSED_SCOUT=1 ...   add the tree_graphs tree with the scout's RMSNorms fused (tree_graphs_fused_scout)
#   COMPILED_SCOUT=1 ...   add the tree_graphs tree with a torch.compile'd copy of the scout (tree_graphs_compiled_scout)
#   CHAIN=0 ...   leave the adaptive chain out (its standing figures are in record 9d3c7d76), which keeps a run of two
#                 trees inside one call
#   EAGER_TREE=0 ...   leave tree_graphs (the tree with the uncompiled scout) out, with COMPILED_SCOUT=1 or FUSED_SCOUT=1
#   GATED_TREE=1 ...   add the compiled-scout tree gated by the seed's production and tuned clutches (decode_repro's
#                      GATED_TREES; they compile their own copy of the scout, the one tree_graphs_compiled_scout uses
#                      when COMPILED_SCOUT=1 is set too)
#   TRIALS=10 ...   interleaved trials of the decode (default 5); fix it before the call, never after seeing results
set -uo pipefail
for switch in CHAIN EAGER_TREE FUSED_SCOUT COMPILED_SCOUT GATED_TREE; do  # a typo must not change the variants silently
    value=${!switch:-}
    if [[ -n $value && $value != 0 && $value != 1 ]]; then
        echo "tree_run.sh: $switch must be 0 or 1, got '$value'" >&2
        exit 2
    fi
done

OUT=${OUT:-.run/out}
mkdir -p "$OUT"
export SDSIE_CACHE=${SDSIE_CACHE:-$PWD/.sdsie_cache} PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
: >"$OUT/steps.txt"

step() {  # step NAME CMD...: run CMD, its output into $OUT/NAME.log, its exit code into steps.txt
    local name=$1 t0=$SECONDS
    shift
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/steps.txt"
    return $rc
}

step build "$PYTHON" -m sdsie.standin build --preset gpu
manifest=$(tail -n 1 "$OUT/build.log")
[[ -f $manifest/manifest.json ]] && cp "$manifest/manifest.json" "$OUT/standin_gpu_manifest.json"
widths=${TREE_WIDTHS:-}
if [[ -z $widths ]]; then  # the probe picks the tree; with TREE_WIDTHS it is skipped (about a minute saved)
    step tree_probe "$PYTHON" -m research.standin.tree_probe --pair gpu --device cuda --max-nodes 127 \
        --overhead-ms "${TREE_OVERHEAD_MS:-0.6}" --out "$OUT/tree_probe_gpu.json"
fi
if [[ -z $widths && -f $OUT/tree_probe_gpu.json ]]; then
    widths=$("$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['best']['code']['widths'])" \
        "$OUT/tree_probe_gpu.json")
fi
wide=${WIDE_TREE_WIDTHS:-}
echo "tree widths: ${widths:-default}${wide:+ and $wide}" | tee -a "$OUT/steps.txt"
step decode "$PYTHON" -m reproductions.decode_repro --cuda-graphs --trials "${TRIALS:-5}" --out "$OUT" \
    --variants plain plain_graphs $([[ ${CHAIN:-1} == 0 ]] || echo fixed_k5_graphs_adaptive) \
    $([[ ${EAGER_TREE:-1} == 0 ]] || echo tree_graphs) \
    ${wide:+tree_graphs_wide} $([[ ${FUSED_SCOUT:-0} == 1 ]] && echo tree_graphs_fused_scout) \
    $([[ ${COMPILED_SCOUT:-0} == 1 ]] && echo tree_graphs_compiled_scout) \
    $([[ ${GATED_TREE:-0} == 1 ]] && echo gated_production_tree_graphs_compiled_scout \
        gated_tuned_tree_graphs_compiled_scout) \
    ${widths:+--tree-widths "$widths"} ${wide:+--wide-tree-widths "$wide"} \
    --skip grid fidelity gear near_ties entropy_sync "$@"
# last: a call near its limit loses the tests, not the decode (a failing graph capture also fails the decode, at once)
step gpu_static_tests "$PYTHON" -m pytest tests/test_static_cache.py -m gpu -q -p no:cacheprovider
exit 0
