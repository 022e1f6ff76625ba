"""The kernel sweep's choice of tuned configurations (reproductions/kernels/int4_bench.py), on synthetic
timings: it ranks by graphed time where measured, and never picks a configuration that computed wrongly."""

from __future__ import annotations

from dataclasses import asdict

from reproductions.kernels.int4_bench import best_configs
from sdsie.kernels import Int4KernelConfig

A = Int4KernelConfig(1, 256, 128, split_k=4)
B = Int4KernelConfig(1, 64, 128, split_k=4, num_warps=2)
C = Int4KernelConfig(1, 128, 256, split_k=8)


def _result(median_us: dict, errors: dict, graph_us: dict | None = None) -> dict:
    r = {"case": {"shape": "kv", "n": 1024, "k": 4096, "m": 1, "group": 128},
         "configs": {"A": asdict(A), "B": asdict(B), "C": asdict(C)}, "median_us": median_us, "errors": errors}
    if graph_us is not None:
        r["graph_us"] = graph_us
    return r


def test_graphed_time_decides_over_host_bound_eager_medians():
    # eager medians of a tiny shape measure host time: A looks fastest there, B is fastest on the GPU
    r = _result({"A": 20.9, "B": 21.5, "C": 23.0}, {"A": 3e-3, "B": 3e-3, "C": 3e-3},
                graph_us={"A": 12.4, "B": 5.0, "C": 6.1})
    assert best_configs([r], "GPU")["GPU"]["m1|1024|4096|128"] == asdict(B)


def test_eager_medians_rank_when_no_graphed_time_and_wrong_results_never_win():
    r = _result({"A": 20.9, "B": 21.5, "C": 23.0}, {"A": 0.5, "B": 3e-3, "C": 3e-3})
    assert best_configs([r], "GPU")["GPU"]["m1|1024|4096|128"] == asdict(B)  # A is fastest but wrong
