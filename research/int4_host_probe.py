"""Where an INT4 call's host time goes on a GPU machine: the launcher called directly against the `sdsie::int4_mm`
op, eagerly and inside a small compiled function (dynamic length), at M = 1, 16 and 32, on a small weight whose GPU
time is below the host's, so a loop of calls without synchronization times the host. Beside them: a bf16 matmul
(one launch through ATen) and a cProfile of the op's calls at M = 32, by function. The answer is in docs/log.md; the
raw file in telemetry/raw/.

    python -m research.int4_host_probe --out telemetry/raw/int4_host_probe_h100.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdsie import kernels
from sdsie.kernels.ops import weight_for
from sdsie.quant import Int4Linear, QuantConfig
from sdsie.telemetry.records import capture_environment


def host_us(fn: Callable[[], Any], calls: int = 200, repeats: int = 5) -> dict[str, float]:
    """Wall microseconds a call over `calls` back-to-back calls, synchronized only at the ends; median and range
    over `repeats`."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call), "max_us": max(per_call)}


def profile_top(fn: Callable[[], Any], calls: int = 200, top: int = 25) -> list[dict[str, Any]]:
    """cProfile of `calls` calls: the functions with the most own time, microseconds a call of `fn`."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls_per_call": ncalls / calls,
                     "own_us": tottime / calls * 1e6, "cum_us": cumtime / calls * 1e6})
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--k", type=int, default=1024)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    linear = nn.Linear(args.k, args.n, bias=False, device=dev, dtype=torch.bfloat16)
    layer = Int4Linear.from_linear(linear, QuantConfig(group_size=128))
    w = layer.int4_weight
    results: dict[str, Any] = {}
    for m in (1, 16, 32):
        x = torch.randn(m, args.k, device=dev, dtype=torch.bfloat16)
        op = torch.compile(lambda x: torch.ops.sdsie.int4_mm(x, layer.qweight, layer.scales, layer.zeros, 128),
                           dynamic=True)
        arms = {
            "int4_matmul": lambda x=x: kernels.int4_matmul(x, w),
            "op": lambda x=x: torch.ops.sdsie.int4_mm(x, layer.qweight, layer.scales, layer.zeros, 128),
            "compiled_op": lambda x=x, op=op: op(x),
            "weight_for": lambda: weight_for(layer.qweight, layer.scales, layer.zeros, args.k, 128),
            "bf16_mm": lambda x=x: torch.mm(x, linear.weight.T),
            "empty": lambda m=m: torch.empty((m, args.n), dtype=torch.bfloat16, device=dev),
        }
        for name, fn in arms.items():
            results[f"m{m}.{name}"] = host_us(fn)
            print(f"M={m} {name}: {results[f'm{m}.{name}']}", flush=True)
    x32 = torch.randn(32, args.k, device=dev, dtype=torch.bfloat16)
    top = profile_top(lambda: torch.ops.sdsie.int4_mm(x32, layer.qweight, layer.scales, layer.zeros, 128))
    for row in top[:12]:
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": [args.n, args.k], "group_size": 128, "host_us": results,
                               "profile_m32_op": top, "environment": capture_environment()}, indent=1))


if __name__ == "__main__":
    main()
