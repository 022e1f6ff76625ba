#!/usr/bin/env bash
# A driver for a GPU machine reached in calls of at most 10 minutes: how to tune the kernel and record its suite when
# the whole run is longer than one call. Its records are the kernel_int4 and entropy_overhead records in telemetry/;
# what each run found is in docs/kernel-log.md. The kernel and entropy reproductions, in the order tuning needs them:
# [A/B against a baseline kernel] -> sweep -> use the swept table -> kernel tests over every candidate (tuned
# ones included) -> suite record (kernel_int4) and entropy record -> thorough property tests while time remains.
# Progress goes to stdout; `.run/done` holds the exit status when everything has finished. Start it detached and
# poll for `.run/done` in later calls (one call is at most 10 minutes; the tests alone take about 8):
#   setsid nohup bash research/kernels/gpu_run.sh > .run/log 2>&1 &
# To validate a kernel change without re-tuning (about 12 minutes):
#   AB_BASELINE=.ab/base_int4_gemm.py AB_ARGS="--m 4 16" SWEEP=0 SDSIE_SOURCE_COMMIT=<sha> setsid nohup ...
# Outputs (the A/B, the sweep's raw file and table) go to .run/out, which git ignores: the device tool copies the
# working tree again at every call, which removes untracked outputs and puts tracked files back (an A/B and sweep
# were lost that way, and a suite ran on the committed table instead of the swept one). So the
# swept table is not copied into sdsie/kernels: the later steps read it through SDSIE_TUNED_CONFIGS, and the records
# name it; commit it from .run/out. Records themselves land in telemetry/ and must be fetched in the same call.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p .run/out && rm -f .run/done
step() { echo "=== $(date -u +%T) $*"; }
status=0
step environment
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -n "${AB_BASELINE:-}" ]; then
    step "A/B against $AB_BASELINE"
    # shellcheck disable=SC2086
    python3 -m reproductions.kernels.ab_bench --baseline "$AB_BASELINE" --out .run/out/ab.json ${AB_ARGS:-} \
        || status=1
fi
if [ "${SWEEP:-1}" != 0 ]; then
    step sweep
    # SWEEP_ARGS focuses the sweep (e.g. "--m 4 8 16 --only swap": those cases, the incumbent timed beside, the
    # table merged into the installed one); SWEEP=0 skips it; SUITE=0 skips the suite records.
    # shellcheck disable=SC2086
    if python3 -m reproductions.kernels.int4_bench --sweep --no-energy --out .run/out ${SWEEP_ARGS:-}; then
        export SDSIE_TUNED_CONFIGS="$PWD/.run/out/tuned_configs.json"
    else
        status=1
    fi
fi
step kernel tests, every candidate configuration
python3 -m pytest tests/test_int4_kernel.py tests/test_int4_modules.py -q -x -p no:cacheprovider \
    -k "${KERNEL_TESTS:-not nothing}" || status=1
if [ "${SUITE:-1}" != 0 ]; then
    step suite records: kernel_int4, entropy_overhead
    python3 -m pytest reproductions/test_kernel_int4.py reproductions/test_entropy_overhead.py -m gpu -q -s \
        -p no:cacheprovider || status=1
fi
if [ "${THOROUGH_S:-0}" -gt 0 ]; then
    step "thorough property tests, ${THOROUGH_S} s at most"
    SDSIE_HYPOTHESIS_PROFILE=thorough timeout "$THOROUGH_S" python3 -m pytest tests/test_int4_kernel.py -q -x \
        -p no:cacheprovider -k "matches_reference or rows" || status=1
fi
step done "status=$status"
echo "$status" > .run/done
