"""research/standin/tree_run.sh's steps and switches act: run with a stub python3 that logs its arguments."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent / "tree_run.sh"
# The stub plays each step: the build prints the pair's folder last, the probe writes its best trees, the one-liner
# that reads the probe prints the code family's tree; STUB_RC fails the GPU tests alone.
STUB = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
case "$*" in
  "-m pytest"*) exit "${STUB_RC:-0}" ;;
  *sdsie.standin\\ build*) mkdir -p pair && echo '{}' > pair/manifest.json && echo "$PWD/pair" ;;
  "-c import json"*) echo 6,4,4 ;;
  *tree_probe*) echo '{"best": {"code": {"widths": "6,4,4"}}}' > "$OUT/tree_probe_gpu.json" ;;
esac
exit 0
"""


def run_script(tmp_path: Path, **env: str) -> tuple[list[str], dict[str, str]]:
    bin_dir, repo, out = tmp_path / "bin", tmp_path / "repo", tmp_path / "out"
    bin_dir.mkdir()
    repo.mkdir()
    (bin_dir / "python3").write_text(STUB)
    (bin_dir / "python3").chmod(0o755)
    log = tmp_path / "calls.log"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log), "OUT": str(out),
                **env}
    subprocess.run(["bash", str(SCRIPT)], cwd=repo, env=full_env, check=True, capture_output=True, timeout=60)
    steps = dict(line.split(" ", 1) for line in (out / "steps.txt").read_text().splitlines() if " rc=" in line)
    return log.read_text().splitlines(), steps


def test_the_probe_picks_the_tree_the_decode_runs(tmp_path):
    calls, steps = run_script(tmp_path)
    assert list(steps) == ["build", "tree_probe", "decode", "gpu_static_tests"]
    assert all(v.startswith("rc=0") for v in steps.values())
    decode = next(c for c in calls if "decode_repro" in c)
    assert "--tree-widths 6,4,4" in decode and "tree_graphs" in decode and "--cuda-graphs" in decode
    assert "tree_graphs_wide" not in decode and "--wide-tree-widths" not in decode
    assert json.loads((tmp_path / "out" / "standin_gpu_manifest.json").read_text()) == {}


def test_tree_widths_skips_the_probe_and_a_failing_gpu_test_stops_nothing(tmp_path):
    calls, steps = run_script(tmp_path, TREE_WIDTHS="4,3,3", STUB_RC="1")
    assert list(steps) == ["build", "decode", "gpu_static_tests"] and steps["gpu_static_tests"].startswith("rc=1")
    assert not any("tree_probe" in c for c in calls)
    assert "--tree-widths 4,3,3" in next(c for c in calls if "decode_repro" in c)


def test_wide_tree_widths_adds_the_second_tree_to_the_same_decode_and_chain_0_drops_the_chain(tmp_path):
    calls, _ = run_script(tmp_path, TREE_WIDTHS="4,3,3", WIDE_TREE_WIDTHS="6,4,4")
    decode = next(c for c in calls if "decode_repro" in c)
    assert "fixed_k5_graphs_adaptive tree_graphs tree_graphs_wide" in decode and "--wide-tree-widths 6,4,4" in decode
    assert "--tree-widths 4,3,3" in decode
    (tmp_path / "again").mkdir()
    calls, _ = run_script(tmp_path / "again", TREE_WIDTHS="4,3,3", WIDE_TREE_WIDTHS="6,4,4", CHAIN="0")
    decode = next(c for c in calls if "decode_repro" in c)
    assert "--variants plain plain_graphs tree_graphs tree_graphs_wide" in decode


def test_fused_scout_adds_the_fused_tree(tmp_path):
    calls, _ = run_script(tmp_path, TREE_WIDTHS="4,3,3", CHAIN="0", FUSED_SCOUT="1")
    decode = next(c for c in calls if "decode_repro" in c)
    assert "--variants plain plain_graphs tree_graphs tree_graphs_fused_scout --tree-widths 4,3,3" in decode


def test_compiled_scout_adds_the_compiled_tree(tmp_path):
    calls, _ = run_script(tmp_path, TREE_WIDTHS="4,3,3", CHAIN="0", FUSED_SCOUT="1", COMPILED_SCOUT="1")
    decode = next(c for c in calls if "decode_repro" in c)
    assert ("--variants plain plain_graphs tree_graphs tree_graphs_fused_scout tree_graphs_compiled_scout "
            "--tree-widths 4,3,3") in decode


def test_gated_tree_eager_tree_and_trials_switches(tmp_path):
    """GATED_TREE=1 adds the two gated compiled-scout trees, EAGER_TREE=0 drops tree_graphs, TRIALS sets the trial count
    (default 5)."""
    calls, _ = run_script(tmp_path, TREE_WIDTHS="4,3,3", CHAIN="0", EAGER_TREE="0", COMPILED_SCOUT="1",
                          GATED_TREE="1", TRIALS="10")
    decode = next(c for c in calls if "decode_repro" in c)
    assert decode.split("--variants ")[1].split(" --")[0].split() == [
        "plain", "plain_graphs", "tree_graphs_compiled_scout", "gated_production_tree_graphs_compiled_scout",
        "gated_tuned_tree_graphs_compiled_scout"]
    assert "--trials 10" in decode and "--tree-widths 4,3,3" in decode
    (tmp_path / "again").mkdir()
    calls, _ = run_script(tmp_path / "again", TREE_WIDTHS="4,3,3")
    assert "--trials 5" in next(c for c in calls if "decode_repro" in c)


def test_a_switch_other_than_0_or_1_is_refused_by_name_before_anything_runs(tmp_path):
    for switch in ("CHAIN", "EAGER_TREE", "FUSED_SCOUT", "COMPILED_SCOUT", "GATED_TREE"):
        out = tmp_path / switch
        r = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "OUT": str(out), switch: "yes", "PYTHON": "false"})
        assert r.returncode == 2 and f"{switch} must be 0 or 1, got 'yes'" in r.stderr
        assert not out.exists()  # refused before the build or any step
