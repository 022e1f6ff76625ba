#!/usr/bin/env bash
# Device-side driver for the GPU reproductions, for a machine reached in calls of at most 10 minutes (how to run a
# suite longer than one call; its records land in telemetry/ like any other):
# a `start` launches a job detached (it outlives the call) and returns; `wait` waits for it up to a
# time limit and copies what it has produced so far. Calls chained while the machine stays warm
# follow one job to its end.
#
#   bash research/gpu_session.sh start [decode_repro flags...]   the decoding suites only
#   bash research/gpu_session.sh start-nox [pytest args...]      `nox -s gpu_repro --no-venv -- ARGS`
#   bash research/gpu_session.sh wait SECONDS OUTDIR
#
# start: snapshots sdsie/ and reproductions/ into .gpu_session/src (the running process then never
#   reads a source file that a later call's copy of the working tree rewrites) and runs
#   `python3 -m reproductions.decode_repro --out .gpu_session/telemetry <flags>` from it.
# start-nox: snapshots the checkout (package, tests, reproductions, records, noxfile, pyproject) into
#   .gpu_session/repo and runs the whole GPU reproduction there through nox, which the machine lacks:
#   its wheels travel in .whl/ (carry it) and are installed into .gpu_session/site. Records land in
#   .gpu_session/repo/telemetry beside the committed ones.
# Both run in a new process session, log to .gpu_session/log and keep the built stand-in pair in
#   SDSIE_CACHE=$PWD/.sdsie_cache for later runs on the same machine. Both folders must be git-ignored
#   (a warm machine's next copy of the tree leaves them alone): .gitignore lists them.
# wait: returns when the job has exited or SECONDS have passed, whichever is first, after copying into
#   OUTDIR: log, status (state, exit code, elapsed seconds, the files it wrote), standin_manifest.json
#   (the newest built pair's manifest, if any) and records.tgz (every file the job wrote under its
#   records folder, raw logs included, paths relative to that folder).
# Exit status of `wait`: 0 when the job exited with 0, 3 while it is still running, else the job's
# exit code (1 if it vanished without one).
set -euo pipefail

ROOT=$PWD
STATE=.gpu_session
PYTHON=${PYTHON:-python3}

usage() {
    echo "usage: $0 start [decode_repro flags...] | $0 start-nox [pytest args...] | $0 wait SECONDS OUTDIR" >&2
    exit 2
}

running() {
    [[ -f $STATE/pid ]] && ! [[ -f $STATE/exit_code ]] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null
}

prepare() {
    if running; then
        echo "a job is already going (pid $(cat "$STATE/pid")); wait for it first" >&2
        exit 1
    fi
    if [[ -d $STATE/telemetry ]] && [[ -n $(ls -A "$STATE/telemetry") ]]; then  # an earlier run's records stay
        mv "$STATE/telemetry" "$STATE/telemetry.$(cat "$STATE/started" 2>/dev/null || date +%s)"
    fi
    rm -rf "$STATE/src" "$STATE/repo" "$STATE/telemetry" "$STATE/log" "$STATE/exit_code" "$STATE/pid"
    mkdir -p "$STATE" .sdsie_cache
    date +%s >"$STATE/started"
}

# launch DIR RECORDS_DIR CMD...: run CMD in DIR, detached, in a new process session
launch() {
    local dir=$1 records=$2
    shift 2
    echo "$records" >"$STATE/records_dir"
    touch "$STATE/marker"  # the job's files are the ones newer than this (snapshot copies are older)
    printf '%q ' "$@" >"$STATE/args"
    (cd "$dir" && SDSIE_CACHE=$ROOT/.sdsie_cache PYTHONUNBUFFERED=1 \
        setsid nohup bash -c 'echo $$ >"$0/pid"; "${@:1}"; echo $? >"$0/exit_code"' "$ROOT/$STATE" "$@" \
        >"$ROOT/$STATE/log" 2>&1 </dev/null &)
    for _ in $(seq 50); do [[ -s $STATE/pid ]] && break; sleep 0.1; done
    echo "started (pid $(cat "$STATE/pid")): $*"
}

start() {
    prepare
    mkdir -p "$STATE/src" "$STATE/telemetry"
    cp -r sdsie reproductions "$STATE/src/"
    # -P: the snapshot on PYTHONPATH, not the working tree in the current directory, provides the modules.
    PYTHONPATH=$ROOT/$STATE/src${PYTHONPATH:+:$PYTHONPATH} \
        launch . "$ROOT/$STATE/telemetry" "$PYTHON" -P -m reproductions.decode_repro --out "$ROOT/$STATE/telemetry" "$@"
}

start_nox() {
    prepare
    local repo=$ROOT/$STATE/repo site=$ROOT/$STATE/site bin=$ROOT/$STATE/bin
    mkdir -p "$repo" "$bin"
    cp -r sdsie tests reproductions telemetry noxfile.py pyproject.toml conftest.py "$repo/"
    if ! "$PYTHON" -c "import nox" 2>/dev/null; then
        ls .whl/*.whl >/dev/null 2>&1 || { echo "nox is not installed and no wheels are in .whl/ (carry it)" >&2; exit 1; }
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    fi
    # nox runs `python` and `pytest` from PATH: make both this interpreter's, whatever the image calls them
    printf '#!/bin/sh\nexec %q "$@"\n' "$PYTHON" >"$bin/python"
    printf '#!/bin/sh\nexec %q -m pytest "$@"\n' "$PYTHON" >"$bin/pytest"
    chmod +x "$bin/python" "$bin/pytest"
    PATH=$bin:$PATH PYTHONPATH=$repo:$site${PYTHONPATH:+:$PYTHONPATH} \
        launch "$repo" "$repo/telemetry" "$PYTHON" -m nox -s gpu_repro --no-venv -- "$@"
}

collect() {
    local outdir=$1 state=$2 code=$3
    mkdir -p "$outdir"
    cp "$STATE/log" "$outdir/log" 2>/dev/null || : >"$outdir/log"
    local manifest records files=()
    manifest=$(ls -t .sdsie_cache/standin/*/manifest.json 2>/dev/null | head -n 1 || true)
    [[ -n $manifest ]] && cp "$manifest" "$outdir/standin_manifest.json"
    records=$(cat "$STATE/records_dir")
    if [[ -d $records ]]; then
        mapfile -t files < <(cd "$records" && find . -type f -newer "$ROOT/$STATE/marker" | sort)
        ((${#files[@]})) && tar -czf "$outdir/records.tgz" -C "$records" "${files[@]}"
    fi
    {
        echo "state=$state"
        echo "exit_code=$code"
        echo "elapsed_s=$(($(date +%s) - $(cat "$STATE/started")))"
        echo "args=$(cat "$STATE/args")"
        echo "files=${files[*]}"
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
    start-nox) shift; start_nox "$@" ;;
    wait) (($# == 3)) || usage; wait_for "$2" "$3" ;;
    *) usage ;;
esac
