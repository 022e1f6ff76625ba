"""The packed-arithmetic probe compiles (research/kernels/packed_sass_probe.py); offline, no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_packed_probe_compiles_its_toy_loops_to_bf16x2_arithmetic():
    """research/kernels/packed_sass_probe.py: Triton ops on a joined pair of bf16 codes become packed bf16x2
    instructions (the premise of its SASS counts, docs/kernel-log.md)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from research.kernels.packed_sass_probe import count; "
            "print(json.dumps(count('join', block_n=64, block_cols=32)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    packed = sum(v for op, v in r["per_code"].items() if op.startswith("HFMA2") and "BF16_V2" in op)
    assert packed > 0 and r["sass_per_code"] > 0
