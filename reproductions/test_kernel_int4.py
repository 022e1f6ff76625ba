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


def test_the_kernel_record_names_the_tuned_table_it_ran_on(tmp_path: Path, monkeypatch):
    """The suite record's config.tuned_table says which table chose the configurations: the shipped one, or the one
    $SDSIE_TUNED_CONFIGS names (gpu_run.sh after a sweep), with the sha256 of its bytes."""
    import hashlib

    from reproductions.kernels.int4_bench import tuned_table_provenance
    from sdsie.kernels.int4_gemm import SHIPPED_TUNED_PATH

    monkeypatch.delenv("SDSIE_TUNED_CONFIGS", raising=False)
    shipped = tuned_table_provenance()
    assert shipped == {"path": str(SHIPPED_TUNED_PATH), "shipped": True,
                       "sha256": hashlib.sha256(SHIPPED_TUNED_PATH.read_bytes()).hexdigest()}
    swept = tmp_path / "tuned_configs.json"
    swept.write_text("{}")
    monkeypatch.setenv("SDSIE_TUNED_CONFIGS", str(swept))
    assert tuned_table_provenance() == {"path": str(swept), "shipped": False,
                                        "sha256": hashlib.sha256(b"{}").hexdigest()}
