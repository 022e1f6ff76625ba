"""research/kernels/gpu_run.sh's switches act: run with stub python3 and nvidia-smi that log their arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent / "gpu_run.sh"
STUB = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
echo "table=${SDSIE_TUNED_CONFIGS:-shipped}" >> "$STUB_LOG"
case "$*" in *int4_bench*) touch .run/out/tuned_configs.json ;; esac
exit "${STUB_RC:-0}"
"""


def run_script(tmp_path: Path, **env: str) -> tuple[list[str], str]:
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir()
    (repo / "telemetry" / "raw").mkdir(parents=True)
    (repo / "sdsie" / "kernels").mkdir(parents=True)
    for name in ("python3", "nvidia-smi"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log), **env}
    subprocess.run(["bash", str(SCRIPT)], cwd=repo, env=full_env, check=True, capture_output=True, timeout=60)
    lines = log.read_text().splitlines()
    # each python3 call logs its arguments, then the table it was given
    calls = [f"{line} [{lines[i + 1]}]" for i, line in enumerate(lines) if line.startswith("-m ")]
    return calls, (repo / ".run" / "done").read_text().strip()


def test_default_run_sweeps_then_tests_and_records_on_the_swept_table(tmp_path):
    """The sweep writes under .run/out (git-ignored: the device tool's next copy of the tree leaves it alone) and the
    later steps read its table through SDSIE_TUNED_CONFIGS; the tracked table is not touched."""
    calls, done = run_script(tmp_path)
    assert [c.split()[1] for c in calls] == ["reproductions.kernels.int4_bench", "pytest", "pytest"]
    assert "--out .run/out" in calls[0] and calls[0].endswith("[table=shipped]")
    swept = tmp_path / "repo" / ".run" / "out" / "tuned_configs.json"
    assert all(c.endswith(f"[table={swept}]") for c in calls[1:])
    assert not (tmp_path / "repo" / "sdsie" / "kernels" / "tuned_configs.json").exists()
    assert done == "0"


def test_ab_baseline_runs_first_and_sweep_0_skips_the_sweep(tmp_path):
    calls, done = run_script(tmp_path, AB_BASELINE=".ab/base.py", AB_ARGS="--m 4 16", SWEEP="0")
    assert [c.split()[1] for c in calls] == ["reproductions.kernels.ab_bench", "pytest", "pytest"]
    assert calls[0].endswith("--baseline .ab/base.py --out .run/out/ab.json --m 4 16 [table=shipped]")
    assert all(c.endswith("[table=shipped]") for c in calls)  # no sweep: the shipped table throughout
    assert done == "0"


def test_a_failing_step_marks_the_run_failed_and_the_rest_still_runs(tmp_path):
    calls, done = run_script(tmp_path, SWEEP="0", STUB_RC="1")
    assert [c.split()[1] for c in calls] == ["pytest", "pytest"]
    assert done == "1"


def test_a_failed_sweep_leaves_the_later_steps_on_the_shipped_table(tmp_path):
    calls, done = run_script(tmp_path, STUB_RC="1")
    assert [c.split()[1] for c in calls] == ["reproductions.kernels.int4_bench", "pytest", "pytest"]
    assert all(c.endswith("[table=shipped]") for c in calls)
    assert done == "1"
