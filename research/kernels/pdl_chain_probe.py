"""A decode-shaped chain of INT4 GEMVs (per layer: fused q/k/v, o, fused gate/up with silu * up, down), graphed,
timed with the mma GEMV launched plainly and as a programmatic dependent (`set_programmatic_launch`): what PDL buys
at the kernel boundaries, with and without a non-PDL RMSNorm (torch ops) before the q/k/v and gate/up projections.
Also checks that the outputs are bit for bit the same either way (GPU only).

    python -m research.kernels.pdl_chain_probe --out telemetry/raw/pdl_chain_probe_h200.json [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from reproductions.kernels.int4_bench import cuda_missing, random_int4
from sdsie.kernels import int4_matmul, int4_silu_mul
from sdsie.kernels.device import programmatic_launch, set_programmatic_launch
from sdsie.telemetry.timing import cuda_event_ms

# Llama-3.1-8B's decoder linears, q/k/v and gate/up fused
HIDDEN, QKV, FFN = 4096, 6144, 14336


def rms(h: torch.Tensor) -> torch.Tensor:
    """RMSNorm without a weight, in torch ops: a producer kernel that does not launch dependents early."""
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype)


def chain(layers: list[tuple], x: torch.Tensor, norm: bool) -> torch.Tensor:
    h = x
    for qkv, o, gate_up, down in layers:
        q = int4_matmul(rms(h) if norm else h, qkv)[:, :HIDDEN]  # [M, 4096] of [M, 6144]
        a = int4_matmul(q, o)
        u = int4_silu_mul(rms(a) if norm else a, gate_up)  # [M, 14336]
        h = int4_matmul(u, down)
    return h


def time_chain(layers: list[tuple], x: torch.Tensor, norm: bool, pdl: bool,
               reps: int) -> tuple[float, torch.Tensor]:
    """Median replay time of the graphed chain (us) and its output, with PDL as given."""
    before = programmatic_launch()
    set_programmatic_launch(pdl)
    try:
        out = chain(layers, x, norm)  # warm-up outside the capture: plans, repacking, compilation
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(layers, x, norm)
        graph.replay()
        torch.cuda.synchronize()
        times = [cuda_event_ms(graph.replay) * 1e3 for _ in range(reps)]
        return statistics.median(times), out.clone()
    finally:
        set_programmatic_launch(before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--m", nargs="*", type=int, default=[1, 4])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if cuda_missing("pdl_chain_probe"):
        return 2
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    layers = [(random_int4(QKV, HIDDEN, 128, "cuda", gen), random_int4(HIDDEN, HIDDEN, 128, "cuda", gen),
               random_int4(2 * FFN, HIDDEN, 128, "cuda", gen), random_int4(HIDDEN, FFN, 128, "cuda", gen))
              for _ in range(args.layers)]
    rows = []
    for m in args.m:
        x = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        for norm in (False, True):
            row: dict = {"m": m, "norm": norm, "layers": args.layers}
            modes = [("plain", False), ("pdl", True)]
            outs = {}
            for name, pdl in modes * 2:  # twice each, interleaved: drift shows as a gap between repeats
                us, outs[name] = time_chain(layers, x, norm, pdl, args.reps)
                row.setdefault(f"{name}_us", []).append(us)
            # bit for bit alike (NaN where the chain without norms overflows, so compared as bytes)
            row["same_output"] = all(torch.equal(o.view(torch.int16), outs["plain"].view(torch.int16))
                                     for o in outs.values())
            for name, _ in modes:
                row[f"{name}_us_per_layer"] = min(row[f"{name}_us"]) / args.layers
                row[f"{name}_speedup"] = min(row["plain_us"]) / min(row[f"{name}_us"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"probe": "pdl_chain_probe", "device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "rows": rows, "seconds": time.time() - t0},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
