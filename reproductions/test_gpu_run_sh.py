"""reproductions/kernels/gpu_run.sh's switches act: run with stub python3 and nvidia-smi that log their arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent / "kernels" / "gpu_run.sh"
STUB = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
case "$*" in *int4_bench*) touch telemetry/raw/tuned_configs.json ;; esac
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
    calls = [line for line in log.read_text().splitlines() if line.startswith("-m ")]
    return calls, (repo / ".run" / "done").read_text().strip()


def test_default_run_sweeps_installs_the_table_tests_and_records(tmp_path):
    calls, done = run_script(tmp_path)
    assert [c.split()[1] for c in calls] == ["reproductions.kernels.int4_bench", "pytest", "pytest"]
    assert (tmp_path / "repo" / "sdsie" / "kernels" / "tuned_configs.json").exists()  # the sweep's table installed
    assert done == "0"


def test_ab_baseline_runs_first_and_sweep_0_skips_the_sweep(tmp_path):
    calls, done = run_script(tmp_path, AB_BASELINE=".ab/base.py", AB_ARGS="--m 4 16", SWEEP="0")
    assert [c.split()[1] for c in calls] == ["reproductions.kernels.ab_bench", "pytest", "pytest"]
    assert calls[0].endswith("--baseline .ab/base.py --out telemetry/raw/ab.json --m 4 16")
    assert not (tmp_path / "repo" / "sdsie" / "kernels" / "tuned_configs.json").exists()
    assert done == "0"


def test_a_failing_step_marks_the_run_failed_and_the_rest_still_runs(tmp_path):
    calls, done = run_script(tmp_path, SWEEP="0", STUB_RC="1")
    assert [c.split()[1] for c in calls] == ["pytest", "pytest"]
    assert done == "1"
