"""GPU reproduction of the Resolution Gear claims on the stand-in pair: token fidelity by number of
INT4-gated `mlp.down_proj` layers, and INT4 usage / throughput / power with every one of them gated
and the clutch driving the gear.

Each test runs its suite from `reproductions.decode_repro` and writes one record under telemetry/. A
test fails when its suite cannot run or the record cannot be judged for the claims it serves; whether
the numbers hold is the claims gate's verdict (`sdsie claims check`).
"""

from __future__ import annotations

import pytest

from reproductions.decode_repro import (
    FIDELITY_TESTS,
    GEAR_TESTS,
    assert_serves,
    fidelity_record,
    gear_record,
    gpu_setup,
    node_claims,
)
from sdsie.telemetry.records import write_record

NODE = "reproductions/test_resolution_gear_gpu.py::{}"


@pytest.mark.gpu
@pytest.mark.benchmark
def test_fidelity_by_gated_layers():
    rec, table = fidelity_record(gpu_setup())
    print("record:", write_record(rec, "telemetry"))
    print(table)
    node = NODE.format("test_fidelity_by_gated_layers")
    assert_serves(rec, FIDELITY_TESTS, node, node_claims(node))


@pytest.mark.gpu
@pytest.mark.benchmark
def test_int4_usage_throughput_power():
    setup = gpu_setup()
    rec = gear_record(setup)
    print("record:", write_record(rec, "telemetry"))
    kinds = ["int4-usage", "throughput"] + (["power"] if setup.meter is not None else [])
    required = [f"gear-{f}-{k}" for f in ("poem", "physics", "code") for k in kinds]
    assert_serves(rec, GEAR_TESTS, NODE.format("test_int4_usage_throughput_power"), required)


def test_gear_metrics_usage_throughput_and_power():
    from reproductions.decode_repro import Run, gear_metrics

    def run(variant: str, seconds: float, energy: float | None, int4_cycles: int) -> Run:
        return Run(variant, "code", 0, [0] * 10, seconds, energy, {"int4_cycles": int4_cycles, "cycles": 9})

    runs = [run("gear_full", 1.0, 100.0, 0), run("gear_int4", 1.25, 150.0, 3), run("gear_int4", 1.25, 150.0, 6)]
    m = gear_metrics(runs)
    assert m["gear.code.int4_usage_pct"] == pytest.approx(50.0)  # 9 of 18 decode cycles
    assert m["gear.code.throughput_change_pct"] == pytest.approx(-20.0)
    assert m["gear.code.power_change_pct"] == pytest.approx(20.0)  # 120 W against 100 W
    no_energy = gear_metrics([run("gear_full", 1.0, None, 0), run("gear_int4", 1.0, None, 0)])
    assert "gear.code.power_change_pct" not in no_energy  # absent, never a made-up number
