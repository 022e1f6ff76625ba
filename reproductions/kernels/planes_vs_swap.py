"""planes against the words swap kernel (eight dots and one_dot) per output channel at M = 4 and 16, graphed.

    python -m reproductions.kernels.planes_vs_swap      # on a GPU; writes $OUT/pc_planes.json

The sweeps time M > 1 at group 128 only; this run settles per channel before the words kernel is removed
(reproductions/kernels/NOTES.md, session 12). Each case checks every configuration against the float reference.
"""

from __future__ import annotations

import json
import os
import time

import torch

from reproductions.kernels.int4_bench import LLAMA_SHAPES, config_name, graph_us, l2_busting_copies, random_int4
from sdsie.kernels import Int4KernelConfig, int4_matmul, int4_matmul_reference

_P = dict(num_warps=4, num_stages=3, swap_ab=True)
CONFIGS = (Int4KernelConfig(16, 256, 128, split_k=4, planes=True, **_P),
           Int4KernelConfig(16, 64, 128, split_k=8, planes=True, **_P),
           Int4KernelConfig(16, 256, 128, split_k=4, one_dot=True, **_P),
           Int4KernelConfig(16, 256, 128, split_k=8, one_dot=True, **_P),
           Int4KernelConfig(16, 64, 128, split_k=8, **_P),
           Int4KernelConfig(16, 128, 128, split_k=4, **_P))


def main() -> None:
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    out = {"configs": [config_name(c) for c in CONFIGS], "cases": []}
    t0 = time.time()
    for shape, (n, k) in LLAMA_SHAPES.items():
        ws = [random_int4(n, k, None, dev, gen) for _ in range(l2_busting_copies(dev, n * k // 2))]
        for m in (4, 16):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
            ref = int4_matmul_reference(x, ws[0]).float()
            row = {"shape": shape, "m": m, "group": "channel", "us": {}, "rel_err": {}}
            for c in CONFIGS:
                y = int4_matmul(x, ws[0], config=c).float()
                row["rel_err"][config_name(c)] = ((y - ref).norm() / ref.norm()).item()
                row["us"][config_name(c)] = graph_us(
                    lambda i, c=c, x=x, ws=ws: (lambda: int4_matmul(x, ws[i % len(ws)], config=c)), n * k // 2, dev)
            out["cases"].append(row)
            print(shape, m, {name: round(v, 2) for name, v in row["us"].items()},
                  f"max rel err {max(row['rel_err'].values()):.1e}", flush=True)
    out["seconds"] = time.time() - t0
    os.makedirs(os.environ["OUT"], exist_ok=True)
    with open(os.path.join(os.environ["OUT"], "pc_planes.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
