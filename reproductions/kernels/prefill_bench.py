"""INT4 at prompt sizes (M = 17 .. 2048 rows): which path `int4_matmul` should take, side by side in one run.

Per shape and M: cuBLAS bf16 (`F.linear`), the fused bytes tl.dot kernel (`_LARGE_M_CONFIG`), the unpack + cuBLAS
path (`int4_dequantize` then `torch.mm`, what M >= DEQUANT_MIN_M runs), the rows ROW_SLICE at a time through the
small-M kernels (`_row_slices`, what M = ROW_SLICE + 1 .. DEQUANT_MIN_M - 1 runs), torch's tinygemm INT4 on the same
weights, and the unpack alone. do_bench medians (L2 flushed before each call) with p10/p90; each INT4 path's output
checked against bf16 `F.linear` over the same dequantized weights (relative error).

    python -m reproductions.kernels.prefill_bench --out telemetry/raw/prefill_paths_h200.json
    python -m reproductions.kernels.prefill_bench --tiny --device cpu --out /tmp/prefill.json   (CPU dry run)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from reproductions.args import positive_int
from reproductions.kernels.int4_bench import bench, random_int4, spread, tinygemm_pack
from sdsie.kernels import int4_gemm
from sdsie.kernels.int4_config import _LARGE_M_CONFIG
from sdsie.kernels.int4_gemm import int4_dequantize, int4_matmul
from sdsie.kernels.int4_tune import rel_error
from sdsie.telemetry.env import capture_environment
from sdsie.telemetry.records import write_raw

# N x K, fused as decode_e2e fuses them (q/k/v, gate/up)
SHAPES: dict[str, tuple[int, int]] = {
    "llama3.1-8b qkv 6144x4096": (6144, 4096),
    "llama3.1-8b o 4096x4096": (4096, 4096),
    "llama3.1-8b gate_up 28672x4096": (28672, 4096),
    "llama3.1-8b down 4096x14336": (4096, 14336),
    "qwen2.5-7b gate_up 37888x3584": (37888, 3584),
    "qwen2.5-7b down 3584x18944": (3584, 18944),
}
TINY_SHAPES = {"tiny 96x128": (96, 128)}
M_VALUES = (17, 32, 48, 64, 128, 256, 512, 2048)


def time_us(fn: Callable[[], object], device: str) -> dict:
    """Median and spread of do_bench samples on a GPU; one timed call elsewhere (the dry run checks plumbing)."""
    if device == "cuda":
        samples = bench(fn, rep_ms=100)
    else:
        t0 = time.perf_counter()
        fn()
        samples = [(time.perf_counter() - t0) * 1e6]
    return {"median": statistics.median(samples), **spread(samples)}


def paths_for(x: torch.Tensor, y: torch.Tensor, w, wd: torch.Tensor, tg) -> dict[str, Callable[[], object]]:
    """The timed calls for one x [M, K]: y is the unpack path's output buffer, wd the bf16 weights, tg tinygemm's
    packing of w (None: not timed)."""
    paths: dict[str, Callable[[], object]] = {
        "bf16": lambda: F.linear(x, wd),
        "fused": lambda: int4_matmul(x, w, _LARGE_M_CONFIG),
        "unpack_mm": lambda: int4_gemm._dequant_matmul(x, w, y),
        "slices": lambda: int4_gemm._row_slices(x, w, y),
        "unpack_only": lambda: int4_dequantize(w, x.dtype),
    }
    if tg is not None:
        paths["tinygemm"] = lambda: torch.ops.aten._weight_int4pack_mm(x, tg[0], w.group_size, tg[1])
    return paths


def run(shapes: dict[str, tuple[int, int]], ms: tuple[int, ...], device: str, group: int = 128) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in shapes.items():
        w = random_int4(n, k, group, device, gen)
        wd = int4_dequantize(w, torch.bfloat16)  # [N, K]
        tg = tinygemm_pack(w) if device == "cuda" else None
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
            y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            ref = F.linear(x, wd).double()
            paths = paths_for(x, y, w, wd, tg)
            row = {"shape": name, "n": n, "k": k, "m": m, "group": group, "us": {}, "rel_err": {}}
            for path, fn in paths.items():
                out = fn()
                if path in ("fused", "tinygemm"):
                    row["rel_err"][path] = rel_error(out, ref)
                elif path in ("unpack_mm", "slices"):  # both write y
                    row["rel_err"][path] = rel_error(y, ref)
                row["us"][path] = time_us(fn, device)
            med = {p: v["median"] for p, v in row["us"].items()}
            print(f"{name} M={m}: " + " ".join(f"{p} {v:.1f}" for p, v in med.items()), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="raw JSON file to write")
    p.add_argument("--m", type=positive_int, nargs="+", default=list(M_VALUES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="one small shape (CPU dry run)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("prefill_bench: no CUDA device (use --device cpu --tiny for the dry run)", file=sys.stderr)
        return 2
    rows = run(TINY_SHAPES if args.tiny else SHAPES, tuple(args.m), args.device)
    write_raw(args.out, {"suite": "int4_prefill_paths", "dequant_min_m": int4_gemm.DEQUANT_MIN_M,
                         "row_slice": int4_gemm.ROW_SLICE,
                         "fused_config": str(_LARGE_M_CONFIG), "environment": capture_environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
