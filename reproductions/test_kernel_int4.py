"""GPU reproduction of the INT4 kernel claims: latency, bandwidth, bytes moved, power/energy.

Writes one run record under telemetry/; the claims gate (`sdsie claims check`) judges it.
This test fails only if the kernel computes wrong results during the performance run or the
suite cannot run; whether the numbers hold is the claims gate's verdict, from the record.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.gpu
@pytest.mark.benchmark
def test_int4_kernel_suite(tmp_path: Path):
    from reproductions.kernels.int4_bench import run_suite

    summary = run_suite(tmp_path, sweep=False, energy=True, write_record=True)
    worst = max(row["max_rel_err"] for row in summary["table"])
    assert worst < 2e-2, f"a kernel produced wrong results during the performance run (rel err {worst:.3e})"
    assert Path(summary["record"]).exists()
