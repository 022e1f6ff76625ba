"""The fragment-order tensor-core GEMV (`sdsie.kernels.int4_mma`) beside the shipped INT4 kernel, bf16, tinygemm and a
copy of its bytes, graphed and L2-cold, with its errors against the float64 reference (GPU only). --silu adds
`int4_silu_mul` on the same weights (taken as fused [gate; up]): the silu * up epilogue's cost. --max-registers
times each warps count again under ptxas register caps (`Int4KernelConfig.max_registers`), and checks each capped
result bit for bit against the uncapped one: does a cap that fits more programs on an SM make the mid shapes faster?

    python -m research.kernels.mma_probe --out telemetry/raw/mma_probe_h200.json [--shapes 4096x4096 ...] [--silu] \
        [--max-registers 80 72 64] [--blocks 2 4] [--stages 3 4]

--stages times each warps count with 3 or 4 pairs of chunks in flight a warp (2 by default), each result checked
bit for bit against 2 stages: do more bytes in flight a warp make the mid shapes, whose programs leave SM slots
empty or whose warps get few pairs of K each, faster?

--x-broadcast times each warps count again with x's M rows one row in memory (row stride 0): the same mma work,
but each load of x is one broadcast, as at M = 1. The gap to the plain time is what x's row-by-row fragment loads
cost (docs/kernel-log.md, 2026-12-05 22:50).

--epilogues times, at M <= 8 with the shipped choice, what the decoder's fused norms add to a launch
(docs/kernel-log.md, 2026-12-06 20:40: 1.1-1.2 us a normed launch in the H200 decode, 0-0.5 on the H100): the plain
launch on x read from the stream [h, h * g, row_squares(h)] as the decode reads it (`strided`), the same with the
norm's pre-pass over h (`norm`) and over h's partial sums of squares, as the decode reads it (`norm_squares`), and
the residual-and-gained-copy epilogue of o_proj and down_proj, which also writes the next stream's squares
(`residual_gain`); with --silu, `int4_silu_mul` with either norm too (`silu_norm`, `silu_norm_squares`). Each fused
result is checked against the plain product composed in torch (`compose_epilogue`), relative to its largest
magnitude.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from reproductions.kernels.int4_bench import (
    Case,
    bytes_moved_int4,
    copy_graph_us,
    cuda_missing,
    graph_us,
    random_int4,
    tinygemm_pack,
    weight_rotation,
)
from sdsie.cli import shape_arg
from sdsie.kernels import compose_epilogue, int4_matmul, int4_matmul_reference, int4_silu_mul, silu_mul_halves
from sdsie.kernels.int4_config import MMA_CONFIGS, mma_blocks, parse_shape

SHAPES = ("6144x4096", "4096x4096", "1024x4096", "28672x4096", "14336x4096", "4096x14336", "128256x4096",
          "3584x3584", "4608x3584", "18944x3584", "3584x18944", "512x3584", "8960x1536", "2048x3584")


def check(n: int, k: int, group: int | None, m: int, warps: int, gen: torch.Generator, blocks: int = 1) -> dict:
    """Worst error of the mma GEMV (`blocks` row blocks a program) and of the shipped kernel against the float64
    reference, relative to max |ref|."""
    w = random_int4(n, k, group, "cuda", gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    ref = int4_matmul_reference(x.double(), w).double()
    y = int4_matmul(x, w, config=mma_blocks(warps, blocks)).double()
    y0 = int4_matmul(x, w).double()
    scale = ref.abs().max().item()
    return {"n": n, "k": k, "group": group, "m": m, "warps": warps, "blocks": blocks,
            "mma_err": (y - ref).abs().max().item() / scale, "int4_err": (y0 - ref).abs().max().item() / scale}


def time_case(n: int, k: int, m: int, warps_list: list[int], gen: torch.Generator, silu: bool = False,
              caps: tuple[int, ...] = (), blocks: tuple[int, ...] = (), stages: tuple[int, ...] = (),
              x_broadcast: bool = False, epilogues: bool = False) -> dict:
    case = Case(f"{n}x{k}", n, k, m, 128)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    ws, wb = weight_rotation(case, gen, "cuda")
    out = {"n": n, "k": k, "m": m, "copies": len(ws)}
    out["int4"] = graph_us(lambda i: (lambda: int4_matmul(x, ws[i % len(ws)])), n * k // 2, "cuda")

    def timed(cfg, xs=x):  # graphed, cycling over the rotated weights
        return graph_us(lambda i: (lambda: int4_matmul(xs, ws[i % len(ws)], config=cfg)), n * k // 2, "cuda")

    for warps in warps_list:
        out[f"mma_w{warps}"] = timed(MMA_CONFIGS[warps])
        base = int4_matmul(x, ws[0], config=MMA_CONFIGS[warps])  # the bits a variant must give
        variants = [(f"r{cap}", dataclasses.replace(MMA_CONFIGS[warps], max_registers=cap)) for cap in caps]
        variants += [(f"p{s}", mma_blocks(warps, 1, s)) for s in stages]  # pairs in flight a warp (num_stages)
        for tag, cfg in variants:
            out[f"same_bits_w{warps}_{tag}"] = bool(torch.equal(int4_matmul(x, ws[0], config=cfg), base))
            out[f"mma_w{warps}_{tag}"] = timed(cfg)
        for b in blocks:  # several row blocks a program, x's registers shared (`Int4KernelConfig.block_n`)
            out[f"mma_w{warps}_b{b}"] = timed(mma_blocks(warps, b))
        if x_broadcast:  # x's rows all one row in memory: every load of x a broadcast
            out[f"mma_w{warps}_xbcast"] = timed(MMA_CONFIGS[warps], x[:1].expand(m, k))
    if silu:
        out["silu_mul"] = graph_us(lambda i: (lambda: int4_silu_mul(x, ws[i % len(ws)])), n * k // 2, "cuda")
    if epilogues:
        out.update(time_epilogues(n, k, m, ws, gen, silu))
    out["bf16"] = graph_us(lambda i: (lambda: F.linear(x, wb[i % len(wb)])), 2 * n * k, "cuda")
    out["copy"] = copy_graph_us(bytes_moved_int4(ws[0], m), "cuda")
    try:
        packs = [tinygemm_pack(w) for w in ws[:32]]
        if packs[0] is not None:
            out["tinygemm"] = graph_us(lambda i: (lambda: torch.ops.aten._weight_int4pack_mm(
                x, packs[i % len(packs)][0], 128, packs[i % len(packs)][1])), n * k // 2, "cuda")
    except RuntimeError as err:
        out["tinygemm_error"] = str(err)[:200]
    best = min(v for key, v in out.items() if key.startswith("mma_w"))
    out["mma_best"] = best
    out["speedup_mma"] = out["bf16"] / best
    out["speedup_int4"] = out["bf16"] / out["int4"]
    return out


EPS = 1e-5


def time_epilogues(n: int, k: int, m: int, ws: list, gen: torch.Generator, silu: bool) -> dict:
    """The fused norm's and residual's launches beside the plain one on x read from the stream [h, h * g,
    row_squares(h)] (the decode's layout), graphed over the rotated weights, with each fused result's error against
    the plain product composed in torch (relative to its largest magnitude)."""
    hs = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    stream = compose_epilogue(hs, hs, out_gain=(torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16).cuda())
    h, x, sq = stream[:, :k], stream[:, k:2 * k], stream[:, 2 * k:]  # views at the stream's row stride
    r = torch.randn(m, n, generator=gen).to(torch.bfloat16).cuda()
    g = torch.rand(n, generator=gen).to(torch.bfloat16).cuda()
    w0 = ws[0]

    def timed(call):
        return graph_us(lambda i: (lambda: call(ws[i % len(ws)])), n * k // 2, "cuda")

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    out = {"strided": timed(lambda w: int4_matmul(x, w)),
           "norm": timed(lambda w: int4_matmul(x, w, norm_eps=EPS, norm_source=h)),
           "norm_squares": timed(lambda w: int4_matmul(x, w, norm_eps=EPS, norm_source=h, norm_squares=sq)),
           "residual_gain": timed(lambda w: int4_matmul(x, w, residual=r, out_gain=g))}
    plain = int4_matmul(x, w0)
    out["norm_err"] = error(int4_matmul(x, w0, norm_eps=EPS, norm_source=h),
                            compose_epilogue(plain, x, EPS, norm_source=h))
    out["norm_squares_err"] = error(int4_matmul(x, w0, norm_eps=EPS, norm_source=h, norm_squares=sq),
                                    compose_epilogue(plain, x, EPS, norm_source=h))
    out["residual_gain_err"] = error(int4_matmul(x, w0, residual=r, out_gain=g),
                                     compose_epilogue(plain, x, residual=r, out_gain=g))
    if silu:  # the weight taken as fused [gate; up]
        out["silu_strided"] = timed(lambda w: int4_silu_mul(x, w))
        out["silu_norm"] = timed(lambda w: int4_silu_mul(x, w, norm_eps=EPS, norm_source=h))
        out["silu_norm_squares"] = timed(lambda w: int4_silu_mul(x, w, norm_eps=EPS, norm_source=h, norm_squares=sq))
        want = silu_mul_halves(compose_epilogue(int4_matmul(x, w0), x, EPS, norm_source=h))
        out["silu_norm_err"] = error(int4_silu_mul(x, w0, norm_eps=EPS, norm_source=h), want)
        out["silu_norm_squares_err"] = error(int4_silu_mul(x, w0, norm_eps=EPS, norm_source=h, norm_squares=sq), want)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="*", type=shape_arg, default=[parse_shape(s) for s in SHAPES])
    ap.add_argument("--m", nargs="*", type=int, default=[1])
    ap.add_argument("--warps", nargs="*", type=int, default=[4, 8])
    ap.add_argument("--silu", action="store_true", help="also time int4_silu_mul (the silu * up epilogue)")
    ap.add_argument("--no-checks", dest="checks", action="store_false", help="skip the error checks")
    ap.add_argument("--blocks", nargs="*", type=int, default=[],
                    help="also time each warps count with these row blocks a program (2, 4), checked as the rest")
    ap.add_argument("--stages", nargs="*", type=int, default=[],
                    help="also time each warps count with these pairs in flight a warp (3, 4), checked bit for bit")
    ap.add_argument("--x-broadcast", action="store_true",
                    help="also time each warps count with x's rows one row in memory (row stride 0)")
    ap.add_argument("--max-registers", nargs="*", type=int, default=[],
                    help="also time each warps count under these register caps (multiples of 8)")
    ap.add_argument("--epilogues", action="store_true",
                    help="also time the fused norm's and residual's launches (M <= 8), checked against torch's")
    args = ap.parse_args(argv)
    if args.epilogues and max(args.m) > 8:  # the norm's epilogue runs in the mma GEMV at M <= 8 only
        ap.error(f"--epilogues times the norm's launch, which the mma GEMV takes at M <= 8: got --m {max(args.m)}")
    for cap in args.max_registers:  # refused before anything runs, not in the middle of the timings
        try:
            dataclasses.replace(MMA_CONFIGS[4], max_registers=cap)
        except ValueError as err:
            ap.error(f"--max-registers {cap}: {err}")
    shapes = args.shapes
    if cuda_missing("mma_probe"):
        return 2
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    checks = [check(n, k, g, m, w, gen) for n, k, g in ((256, 4096, 128), (512, 1024, 256), (128, 3584, None),
                                                     (256, 14336, 128), (160, 1536, 128))
              for m in (1, 3, 8, 13) for w in args.warps] if args.checks else []
    checks += [check(n, k, g, m, w, gen, b) for n, k, g in ((256, 4096, 128), (80, 1536, 128), (208, 3584, None))
               for m in (1, 5, 8, 16) for w in args.warps for b in args.blocks] if args.checks else []
    for c in checks:
        print(json.dumps(c), flush=True)
    rows = []
    for m in args.m:
        for n, k in shapes:
            r = time_case(n, k, m, args.warps, gen, args.silu, tuple(args.max_registers), tuple(args.blocks),
                          tuple(args.stages), args.x_broadcast, args.epilogues)
            print(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items()}), flush=True)
            rows.append(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "checks": checks, "timings": rows, "seconds": time.time() - t0}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
