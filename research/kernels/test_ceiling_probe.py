"""The ceiling probe's arithmetic and argument checks (research/kernels/ceiling_probe.py)."""

from __future__ import annotations

import pytest


def test_the_ceiling_probe_sets_bf16_against_the_faster_of_moving_the_bytes_by_copy_or_by_read():
    """ceiling_probe.summarize: per case, bf16 over INT4 and over min(copy, read), the percent of the copy bandwidth
    those bytes reach, and geometric means only over all five shapes."""
    import math

    from reproductions.kernels.int4_bench import LLAMA_SHAPES
    from research.kernels.ceiling_probe import summarize

    def case(shape: str, m: int, bf16: float, int4: float, copy: float, read: float, nbytes: float) -> dict:
        t = {"bf16": bf16, "int4": int4, "copy": copy, "read": read}
        return {"case": {"shape": shape, "m": m}, "bytes_int4": nbytes, "eager_us": t,
                "graph_us": {k: v / 2 for k, v in t.items()}}

    cases = [case(shape, 1, 40.0, 20.0, 10.0, 8.0, 32e6) for shape in LLAMA_SHAPES]
    s = summarize(cases, copy_gbs=4000.0)
    assert s["eager.gate_up_14336x4096.m1.speedup"] == 2.0
    assert s["eager.gate_up_14336x4096.m1.ceiling_speedup"] == 5.0  # the read arm is the faster
    assert math.isclose(s["eager.gate_up_14336x4096.m1.ceiling_pct_of_copy"], 100.0)  # 32 MB in 8 us = 4000 GB/s
    assert math.isclose(s["eager.m1.geomean_ceiling_speedup"], 5.0) and math.isclose(s["graph.m1.geomean_speedup"], 2.0)
    assert math.isclose(s["graph.m1.min_ceiling_pct_of_copy_large"], 200.0)
    partial = summarize(cases[:2], copy_gbs=4000.0)  # two shapes: no geomean, no large-shape figure
    assert "eager.m1.geomean_ceiling_speedup" not in partial and "eager.m1.min_ceiling_pct_of_copy_large" not in partial


@pytest.mark.parametrize("argv, named", [(["--m", "0"], "--m"), (["--m", "3"], "--m"), (["--rep-ms", "0"], "--rep-ms")])
def test_the_ceiling_probe_refuses_an_m_or_window_outside_its_range_by_name(argv, named, tmp_path, capsys):
    from research.kernels.ceiling_probe import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "x.json"), *argv])
    assert exc.value.code == 2 and named in capsys.readouterr().err and not (tmp_path / "x.json").exists()
