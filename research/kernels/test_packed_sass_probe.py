"""The packed-arithmetic probe compiles (research/kernels/packed_sass_probe.py); offline, no GPU."""

from __future__ import annotations

from reproductions.kernels.inspect_ptx import compiled_offline


def test_the_packed_probe_compiles_its_toy_loops_to_bf16x2_arithmetic():
    """research/kernels/packed_sass_probe.py: Triton ops on a joined pair of bf16 codes become packed bf16x2
    instructions (the premise of its SASS counts, docs/kernel-log.md)."""
    r = compiled_offline("import json; from research.kernels.packed_sass_probe import count; "
                         "print(json.dumps(count('join', block_n=64, block_cols=32)))", "the packed-arithmetic probe")
    packed = sum(v for op, v in r["per_code"].items() if op.startswith("HFMA2") and "BF16_V2" in op)
    assert packed > 0 and r["sass_per_code"] > 0
