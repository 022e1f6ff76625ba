"""Does a graphed call's time depend on how its memory was allocated? A probe of the suite's graphed timer.

The kernel suites timed a graphed device copy of each case's bytes (`int4_bench.copy_graph_us`) beside the
M = 1 and M = 16 cases. In both records the same bytes took 104-106 us beside the M = 1 LM head and 70 us beside
M = 16 (gate_up and down_proj: 11.2-11.4 us against 8.5-8.6). The M = 1 case is the first of its shape in the
suite's graphed pass: its weights and the copies' buffers come from new cudaMalloc segments, while the M = 16
case's come from the caching allocator's pool. If fresh memory is slower, the M = 1 INT4 and bf16 graphed times
beside it are slowed too.

Per shape, in one process, each measurement with `int4_bench.graph_us` (L2-cold rotation, median of 20 replays):
  copy  fresh   after torch.cuda.empty_cache(), new buffers
        again   the same buffers, a new graph
        reused  the buffers freed and allocated again (the allocator hands back the same cached blocks)
        fresh2  after empty_cache() once more, new buffers
        aligned the size rounded up to a 4 KiB multiple (int4_bench.copy_half_bytes), new buffers
  int4 and bf16 (M = 1, group 128): fresh weights, then the same weights again; then a copy as the suite times it
        (copy_beside_weights: new buffers while those weights are held)

Measured on the H200 (telemetry/raw/graph_floor_probe_20261130T1906_h200.json, before the `aligned` arm existed):
allocation does not matter. Fresh, repeated, reused and held-beside copies of the M = 1 LM head's bytes all took 104-109
us, gate_up's 11.3-11.4, kv's 2.3; INT4 and bf16 gave the same times fresh and again. What differs between the suites'
M = 1 and M = 16 copies is the size: every M = 1 size that was not a multiple of 4 KiB (LM head, gate_up, down_proj, kv:
256-2048-byte multiples) copied slowly, every 4 KiB multiple (all M = 16 sizes, and 4096x4096 at M = 1: 8 KiB) fast. The
`aligned` arm, added after that run, confirmed it in a second one (graph_floor_probe_aligned_20261130T1923_h200.json:
70.3 us against 105-110 for the LM head's bytes); int4_bench now sizes its floor copies in 4 KiB blocks
(docs/kernel-log.md).

    python -m research.kernels.graph_floor_probe --out telemetry/raw/graph_floor_probe_20261130T1906_h200.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from reproductions.kernels.int4_bench import (
    LLAMA_SHAPES,
    Case,
    bytes_moved_int4,
    copy_buffers,
    copy_graph_us,
    copy_half_bytes,
    copy_time_us,
    cuda_missing,
    graph_us,
    weight_rotation,
)
from sdsie.kernels import int4_matmul
from sdsie.telemetry.records import write_raw

PROBE_SHAPES = ("lm_head_128256x4096", "gate_up_14336x4096", "kv_1024x4096")


def probe_copy(nbytes: int, device: str) -> dict[str, float]:
    """Graphed copy time of the same bytes (unrounded: nbytes // 2 per buffer) from fresh, repeated, reused and
    fresh-again buffers, and of the size rounded up to COPY_ALIGN."""
    half = max(1, nbytes // 2)
    out: dict[str, float] = {}
    torch.cuda.empty_cache()
    srcs, dst = copy_buffers(half, device)
    out["fresh"] = copy_time_us(srcs, dst, device)
    out["again"] = copy_time_us(srcs, dst, device)
    del srcs, dst
    srcs, dst = copy_buffers(half, device)
    out["reused"] = copy_time_us(srcs, dst, device)
    del srcs, dst
    torch.cuda.empty_cache()
    srcs, dst = copy_buffers(half, device)
    out["fresh2"] = copy_time_us(srcs, dst, device)
    del srcs, dst
    out["aligned"] = copy_time_us(*copy_buffers(copy_half_bytes(nbytes), device), device)
    return out


def probe_matmuls(case: Case, device: str) -> dict[str, float]:
    """Graphed INT4 and bf16 times on fresh weights, then on the same weights again."""
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.m, case.k, generator=gen).to(torch.bfloat16).to(device)
    ws, wb = weight_rotation(case, gen, device)
    int4_call: Callable[[int], Callable[[], object]] = lambda i: (lambda: int4_matmul(x, ws[i % len(ws)]))  # noqa: E731
    bf16_call: Callable[[int], Callable[[], object]] = lambda i: (lambda: F.linear(x, wb[i % len(wb)]))  # noqa: E731
    nbytes = case.n * case.k // 2
    out = {"int4_fresh": graph_us(int4_call, nbytes, device), "int4_again": graph_us(int4_call, nbytes, device),
           "bf16_fresh": graph_us(bf16_call, 4 * nbytes, device), "bf16_again": graph_us(bf16_call, 4 * nbytes, device),
           "bytes_int4": float(bytes_moved_int4(ws[0], case.m))}
    # as the suite times it (int4_bench.copy_graph_us): new copy buffers while the weights are still held
    out["copy_beside_weights"] = copy_graph_us(int(out["bytes_int4"]), device)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=list(PROBE_SHAPES), choices=sorted(LLAMA_SHAPES))
    a = p.parse_args(argv)
    if cuda_missing("graph_floor_probe"):
        return 2
    device = "cuda"
    results = {}
    for shape in a.shapes:
        n, k = LLAMA_SHAPES[shape]
        case = Case(shape, n, k, 1, 128)
        mm = probe_matmuls(case, device)
        cp = probe_copy(int(mm["bytes_int4"]), device)
        results[shape] = {**mm, **{f"copy_{name}": us for name, us in cp.items()}}
        print(shape, " ".join(f"{name}={us:.1f}" for name, us in results[shape].items() if name != "bytes_int4"),
              flush=True)
    write_raw(a.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "command": "python -m research.kernels.graph_floor_probe " + " ".join(argv or sys.argv[1:]),
                      "unit": "us per call, graphed (int4_bench.graph_us)", "results": results})
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
