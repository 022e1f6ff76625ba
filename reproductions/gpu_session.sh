#!/usr/bin/env bash
# Device-side driver for the decoding reproduction (reproductions/decode_repro.py), for a machine lent
# in calls of at most 10 minutes: `start` launches the run detached (it outlives the call) and
# returns; `wait` waits for it up to a time limit and copies what it has produced so far.
#
#   bash reproductions/gpu_session.sh start [decode_repro flags...]
#   bash reproductions/gpu_session.sh wait SECONDS OUTDIR
#
# start: snapshots sdsie/ and reproductions/ into .gpu_session/src (the running process then never
#   reads a source file that a later call's copy of the working tree rewrites), and runs
#   `python3 -m reproductions.decode_repro --out .gpu_session/telemetry <flags>` from it in a new
#   process session, logging to .gpu_session/log. SDSIE_CACHE=$PWD/.sdsie_cache keeps the built
#   stand-in pair for later runs on the same machine. Both folders must be git-ignored (they are
#   left alone by a warm machine's next copy of the tree): .git/info/exclude lists them.
# wait: returns when the run has exited or SECONDS have passed, whichever is first, after copying
#   into OUTDIR (flat, at most 7 files): log, status (state, exit code, elapsed seconds, records),
#   standin_manifest.json (the newest built pair's manifest, if any) and the run's records.
# Exit status of `wait`: 0 when the run exited with 0, 3 while it is still running, else the run's
# exit code (1 if it vanished without one).
set -euo pipefail

STATE=.gpu_session
PYTHON=${PYTHON:-python3}
MAX_FILES=7

usage() {
    echo "usage: $0 start [decode_repro flags...] | $0 wait SECONDS OUTDIR" >&2
    exit 2
}

running() {
    [[ -f $STATE/pid ]] && ! [[ -f $STATE/exit_code ]] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null
}

start() {
    if running; then
        echo "a run is already going (pid $(cat "$STATE/pid")); wait for it first" >&2
        exit 1
    fi
    if [[ -d $STATE/telemetry ]] && [[ -n $(ls -A "$STATE/telemetry") ]]; then  # an earlier run's records stay
        mv "$STATE/telemetry" "$STATE/telemetry.$(cat "$STATE/started" 2>/dev/null || date +%s)"
    fi
    rm -rf "$STATE/src" "$STATE/telemetry" "$STATE/log" "$STATE/exit_code" "$STATE/pid"
    mkdir -p "$STATE/src" "$STATE/telemetry" .sdsie_cache
    cp -r sdsie reproductions "$STATE/src/"
    date +%s >"$STATE/started"
    printf '%q ' "$@" >"$STATE/args"
    # -P: the snapshot on PYTHONPATH, not the working tree in the current directory, provides the modules.
    SDSIE_CACHE=$PWD/.sdsie_cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/$STATE/src${PYTHONPATH:+:$PYTHONPATH} \
        setsid nohup bash -c 'echo $$ >"$0/pid"; "$1" -P -m reproductions.decode_repro --out "$0/telemetry" "${@:2}"
                              echo $? >"$0/exit_code"' "$STATE" "$PYTHON" "$@" >"$STATE/log" 2>&1 </dev/null &
    for _ in $(seq 50); do [[ -s $STATE/pid ]] && break; sleep 0.1; done
    echo "started decode_repro (pid $(cat "$STATE/pid")): $PYTHON -m reproductions.decode_repro $*"
}

collect() {
    local outdir=$1 state=$2 code=$3
    mkdir -p "$outdir"
    cp "$STATE/log" "$outdir/log" 2>/dev/null || : >"$outdir/log"
    local n=2 manifest
    manifest=$(ls -t .sdsie_cache/standin/*/manifest.json 2>/dev/null | head -n 1 || true)
    if [[ -n $manifest ]]; then
        cp "$manifest" "$outdir/standin_manifest.json"
        n=$((n + 1))
    fi
    local records=() left=()
    mapfile -t records < <(ls -tr "$STATE"/telemetry/*.json 2>/dev/null || true)
    local room=$((MAX_FILES - n))
    if ((${#records[@]} > room)); then  # keep the newest; name the rest in the status
        left=("${records[@]:0:${#records[@]}-room}")
        records=("${records[@]: -room}")
    fi
    for r in "${records[@]}"; do cp "$r" "$outdir/"; done
    {
        echo "state=$state"
        echo "exit_code=$code"
        echo "elapsed_s=$(($(date +%s) - $(cat "$STATE/started")))"
        echo "args=$(cat "$STATE/args")"
        echo "records=$(for r in "${records[@]}"; do basename "$r"; done | paste -sd ' ' -)"
        echo "records_left_behind=$(for r in "${left[@]}"; do basename "$r"; done | paste -sd ' ' -)"
        echo "standin_manifest=${manifest:-none}"
    } >"$outdir/status"
    cat "$outdir/status"
}

wait_for() {
    local seconds=$1 outdir=$2
    [[ $seconds =~ ^[0-9]+$ ]] || usage
    [[ -f $STATE/started ]] || { echo "no run was started here ($STATE/started is missing)" >&2; exit 1; }
    local deadline=$(($(date +%s) + seconds))
    while running && (($(date +%s) < deadline)); do sleep 2; done
    if [[ -f $STATE/exit_code ]]; then
        local code
        code=$(cat "$STATE/exit_code")
        collect "$outdir" exited "$code"
        exit "$code"
    elif running; then
        collect "$outdir" running ""
        exit 3
    else
        collect "$outdir" vanished ""
        exit 1
    fi
}

case ${1:-} in
    start) shift; start "$@" ;;
    wait) (($# == 3)) || usage; wait_for "$2" "$3" ;;
    *) usage ;;
esac
