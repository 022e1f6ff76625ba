"""The persistent mma GEMV (`_persistent_mma_gemv_kernel`, here) beside the one-block-a-program mma GEMV it
derives from, the shipped choice, bf16 and a copy of its bytes: graphed, L2-cold, group 128 (GPU only).

A persistent program walks row blocks i, i + P, ... and asks for the next block's first pairs before the current
block's cross-warp sum, so the fixed part of a program (its first loads' wait and its epilogue, 43-48% of the mma
GEMV's warp samples on an H100, docs/kernel-log.md 2026-12-07 21:30) is paid once a program, not once a block. Each
arm is checked bit for bit against the one-block kernel of the same warps and stages (same order of sums), and
against the float64 reference.

    python -m research.kernels.persist_probe --out telemetry/raw/persist_probe_h200.json \
        [--shapes 4096x4096 ...] [--m 1 16] [--arms 4x2x4 8x2x2 ...]

An arm WxSxP is W warps, S pairs in flight a warp, P programs an SM. sm_90 registers a thread (offline compile, M <= 8
/ M = 16): 4 warps 2 stages 128 / 168, 4 warps 4 stages 242, 8 warps 2 stages 122; the default arms are the most
programs an SM those allow and fewer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from reproductions.kernels.int4_bench import (
    Case,
    bytes_moved_int4,
    copy_graph_us,
    cuda_missing,
    random_int4,
    weight_rotation,
)
from sdsie.cli import shape_arg
from sdsie.int4_format import Int4Weight
from sdsie.kernels import int4_matmul, int4_matmul_reference
from sdsie.kernels.device import pdl_on
from sdsie.kernels.int4_config import mma_blocks, parse_shape
from sdsie.kernels.int4_mma import (
    PAIR,
    _first_pairs,
    _first_x,
    _iteration,
    _release_dependents,
    _store_rows,
    _wait_for_producer,
    pack_fragments,
)
from sdsie.telemetry.timing import graph_us

SHAPES = ("4096x4096", "3584x3584", "6144x4096", "4096x14336", "14336x4096", "28672x4096", "18944x3584",
          "1536x8960", "1024x4096", "512x3584", "128256x4096")

ARMS = ("4x2x4", "4x2x3", "4x2x2", "4x2x1", "4x4x2", "4x4x1", "8x2x2", "8x2x1")


def arm(spec: str) -> tuple[int, int, int]:
    """WARPSxSTAGESxPROGRAMS -> (warps, stages, programs an SM)."""
    try:
        warps, stages, programs = (int(v) for v in spec.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an arm is WARPSxSTAGESxPROGRAMS, e.g. 4x2x4, got {spec!r}") from None
    if warps not in (4, 8) or stages not in (2, 3, 4) or programs < 1:
        raise argparse.ArgumentTypeError(f"an arm takes 4 or 8 warps, 2-4 stages, at least 1 program an SM: {spec!r}")
    return warps, stages, programs


@gluon.jit
def _persistent_mma_gemv_kernel(x_ptr, pw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                                GROUP_PAIRS: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZEROS: gl.constexpr,
                                WARPS: gl.constexpr, HALVES: gl.constexpr, PDL: gl.constexpr, STAGES: gl.constexpr):
    # grid: (P,) with P <= N / 16: program i takes row blocks i, i + P, i + 2P, ... (16 rows each, the plain
    # epilogue), its warps splitting K as `_int4_mma_gemv_kernel`'s one-block programs do, with the same order of
    # sums (its bits). A warp's pairs in flight run on across row blocks: a block's last K iteration asks for the
    # next block's first STAGES pairs, so their latency overlaps this block's cross-warp sum and store, and a
    # program waits for its first loads once (the fixed part of a program, 43-48% of an mma GEMV's warp samples,
    # docs/kernel-log.md 2026-12-07 21:30).
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 1, 32, 1], [1, WARPS, 1, 1], [3, 2, 1, 0])
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [1, W, 32]
    LJ: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4)))  # [4] along j
    LO: gl.constexpr = gl.SliceLayout(1, L4)  # [1, 32, 4]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    row_blocks = N // 16
    warp = gl.expand_dims(gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0),
                          2)  # [1, W, 1]
    lane = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0),
                          1)  # [1, 1, 32]
    j = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=LJ), 0), 1), 2)  # [1, 1, 1, 4]
    g = lane // 4
    t = lane % 4
    kcs = K // 64
    pairs = kcs // 2
    iters = gl.cdiv(pairs, STAGES * WARPS)
    xw = x_ptr.to(gl.pointer_type(gl.int32))
    xw4 = gl.expand_dims(xw + gl.minimum(g, M - 1) * (stride_xm // 2) + 8 * t, 3) + j  # [1, 1, 32, 4]: x's row g
    xw4_h = gl.expand_dims(xw + gl.minimum(g + 8, M - 1) * (stride_xm // 2) + 8 * t, 3) + j  # row g + 8
    ob = gl.expand_dims(gl.expand_dims(gl.arange(0, 1, layout=gl.SliceLayout(1, gl.SliceLayout(2, LO))), 1), 2)
    ol = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LO))), 0), 2)
    oc = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LO))), 0), 1)
    om = 2 * (ol % 4) + oc % 2  # [1, 32, 4] x's row (B's column) of each accumulator
    rows = pid * 16 + g  # [1, 1, 32] this program's first row block (the grid is at most N / 16 programs)
    pw4 = pw_ptr + gl.expand_dims((pid * kcs * 32 + lane) * 4, 3) + j  # [1, 1, 32, 4]
    a, b, c, d = _first_pairs(pw4, s_ptr, z_ptr, warp, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS, WARPS,
                              STAGES)
    s_end = (gl.expand_dims(rows, 3) * 0 + j).to(gl.float32)  # [1, 1, 32, 4]; per channel: the block's scales
    if PER_CHANNEL:
        s_end = gl.where(j < 2, gl.expand_dims(gl.load(s_ptr + rows).to(gl.float32), 3),
                         gl.expand_dims(gl.load(s_ptr + rows + 8).to(gl.float32), 3))
    if PDL:
        _wait_for_producer()
    a, b, c, d = _first_x(a, b, c, d, xw4, xw4_h, warp, pairs, HALVES, WARPS, STAGES)
    if PDL:
        _release_dependents()
    for tile in range(pid, row_blocks, nprog):
        tot = gl.zeros([1, WARPS, 32, 4], gl.float32, L4)
        tot_h = gl.zeros([1, WARPS, 32, 4], gl.float32, L4)
        p = warp
        for _ in range(0, iters - 1):  # every K iteration but the last: reloads within this block
            tot, tot_h, a, b, c, d = _iteration(tot, tot_h, a, b, c, d, j, pw4, xw4, xw4_h, s_ptr, z_ptr,
                                                p + STAGES * WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL,
                                                HAS_ZEROS, HALVES, WARPS, STAGES)
            p += STAGES * WARPS
        # the last K iteration: its reloads are the next row block's first pairs (past the last block, the last
        # block again: read, never used)
        nb_next = gl.minimum(tile + nprog, row_blocks - 1)
        rows_next = nb_next * 16 + g
        pw4_next = pw_ptr + gl.expand_dims((nb_next * kcs * 32 + lane) * 4, 3) + j
        tot, tot_h, a, b, c, d = _iteration(tot, tot_h, a, b, c, d, j, pw4_next, xw4, xw4_h, s_ptr, z_ptr, warp,
                                            pairs, rows_next, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS, HALVES, WARPS,
                                            STAGES)
        if PER_CHANNEL:
            tot = tot * s_end
            tot_h = tot_h * s_end
            s_end = gl.where(j < 2, gl.expand_dims(gl.load(s_ptr + rows_next).to(gl.float32), 3),
                             gl.expand_dims(gl.load(s_ptr + rows_next + 8).to(gl.float32), 3))
        onb = ob + tile  # [1, 1, 1] this row block
        orow = onb * 16 + ol // 4 + 8 * (oc // 2)  # [1, 32, 4] output row of each accumulator
        live = onb < row_blocks
        _store_rows(y_ptr, y_ptr, y_ptr, y_ptr, gl.sum(tot, axis=1), om, orow, onb, live, M, N, stride_ym, 0, 0,
                    0.0, 0.0, 0.0, 0, False, False, True, 0, 0)
        if HALVES == 2:
            _store_rows(y_ptr, y_ptr, y_ptr, y_ptr, gl.sum(tot_h, axis=1), om + 8, orow, onb, live, M, N,
                        stride_ym, 0, 0, 0.0, 0.0, 0.0, 0, False, False, True, 8, 0)
        rows = rows_next
        pw4 = pw4_next


class Persistent:
    """One weight's launch of the persistent kernel: fragment-ordered words made once; at most `programs` programs
    an SM, as few as take the same row blocks a program."""

    def __init__(self, w: Int4Weight, warps: int, stages: int, programs: int, sms: int):
        self.w, self.words = w, pack_fragments(w.qweight, w.in_features)
        n, k = w.out_features, w.in_features
        each = -(-(n // 16) // (programs * sms))  # row blocks a program, at most `programs` programs an SM
        self.grid = (-(-(n // 16) // each),)  # as few programs as give each that many: none does one more than most
        per_channel = w.group_size >= k
        self.consts = dict(GROUP_PAIRS=1 if per_channel else w.group_size // PAIR, PER_CHANNEL=per_channel,
                           HAS_ZEROS=w.zeros is not None, WARPS=warps, STAGES=stages)
        self.warps = warps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        m, n, k = x.shape[0], w.out_features, w.in_features
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        pdl = pdl_on(x.device)
        _persistent_mma_gemv_kernel[self.grid](
            x, self.words, w.scales, w.zeros if w.zeros is not None else w.scales, y, m, n, k, x.stride(0),
            y.stride(0), HALVES=1 if m <= 8 else 2, PDL=pdl, num_warps=self.warps, launch_pdl=pdl, **self.consts)
        return y


def inspect(warps: int = 4, stages: int = 2, halves: int = 1, per_channel: bool = False) -> dict:
    """The kernel compiled for sm_90 offline (no GPU; run without TRITON_INTERPRET): registers a thread, spill
    instructions, HMMAs in all (a K iteration's inside the block loop and the peeled last one's) and barriers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile
    from triton.experimental.gluon._runtime import GluonASTSource

    from reproductions.kernels.inspect_ptx import registers, sass_ops

    names = ["x_ptr", "pw_ptr", "s_ptr", "z_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym"]
    types = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16"] + ["i32"] * 5
    consts = dict(GROUP_PAIRS=1, PER_CHANNEL=per_channel, HAS_ZEROS=True, WARPS=warps, HALVES=halves, PDL=True,
                  STAGES=stages)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name != "M"}
    sig = {**dict(zip(names, types, strict=True)), **{c: "constexpr" for c in consts}}
    kernel = compile(GluonASTSource(_persistent_mma_gemv_kernel, sig, consts, attrs),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": True})
    ops = sass_ops(kernel.asm["cubin"])
    return {"registers": registers(kernel.asm["cubin"]), "spills": sum(op.startswith(("STL", "LDL")) for op in ops),
            "hmma": sum(op.startswith("HMMA") for op in ops), "barriers": sum(op.startswith("BAR") for op in ops)}


def check(n: int, k: int, group: int | None, m: int, warps: int, stages: int, programs: int, sms: int,
          gen: torch.Generator) -> dict:
    """Whether the persistent kernel gives the one-block kernel's bits, and its error against float64."""
    w = random_int4(n, k, group, "cuda", gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    y = Persistent(w, warps, stages, programs, sms)(x)
    base = int4_matmul(x, w, config=mma_blocks(warps, 1, stages))
    ref = int4_matmul_reference(x.double(), w).double()
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    return {"n": n, "k": k, "group": group, "m": m, "warps": warps, "stages": stages, "programs": programs,
            "same_bits": bool(torch.equal(y, base)), "err": err}


def time_case(n: int, k: int, m: int, arms: list[tuple[int, int, int]], sms: int, gen: torch.Generator) -> dict:
    case = Case(f"{n}x{k}", n, k, m, 128)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    ws, wb = weight_rotation(case, gen, "cuda")
    out = {"n": n, "k": k, "m": m, "copies": len(ws), "row_blocks": n // 16}
    out["choice"] = graph_us(lambda i: (lambda: int4_matmul(x, ws[i % len(ws)])), n * k // 2, "cuda")
    for warps, stages in sorted({(a[0], a[1]) for a in arms}):
        cfg = mma_blocks(warps, 1, stages)
        out[f"mma_w{warps}_s{stages}"] = graph_us(lambda i, c=cfg: (lambda: int4_matmul(x, ws[i % len(ws)], config=c)),
                                                  n * k // 2, "cuda")
    for warps, stages, programs in arms:
        launches = [Persistent(w, warps, stages, programs, sms) for w in ws]
        out[f"persist_w{warps}_s{stages}_p{programs}"] = graph_us(
            lambda i, ls=launches: (lambda: ls[i % len(ls)](x)), n * k // 2, "cuda")
        del launches
    out["bf16"] = graph_us(lambda i: (lambda: F.linear(x, wb[i % len(wb)])), 2 * n * k, "cuda")
    out["copy"] = copy_graph_us(bytes_moved_int4(ws[0], m), "cuda")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="*", type=shape_arg, default=[parse_shape(s) for s in SHAPES])
    ap.add_argument("--m", nargs="*", type=int, default=[1, 16])
    ap.add_argument("--arms", nargs="*", type=arm, default=[arm(a) for a in ARMS],
                    help="WARPSxSTAGESxPROGRAMS: warps, pairs in flight a warp, persistent programs an SM")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="stop starting new shapes after this long")
    args = ap.parse_args(argv)
    shapes = args.shapes
    if cuda_missing("persist_probe"):
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    checks = []
    for n, k, g in ((256, 4096, 128), (400, 1536, 256), (208, 3584, None), (4224, 512, 128)):
        for m in (1, 5, 16):
            for warps, stages in sorted({(a[0], a[1]) for a in args.arms}):
                for programs in (1, 2):  # a grid of a third or two thirds of the row blocks: 2-4 blocks a program
                    checks.append(check(n, k, g, m, warps, stages, programs, max(1, n // 16 // 3), gen))
    bad = [c for c in checks if not c["same_bits"]]
    print(f"checks: {len(checks) - len(bad)} of {len(checks)} give the one-block kernel's bits; worst error "
          f"{max(c['err'] for c in checks):.2e}", flush=True)
    for c in bad:
        print("DIFFERENT BITS", json.dumps(c), flush=True)
    arms = args.arms
    rows = []
    for m in args.m:
        for n, k in shapes:
            if time.time() - t0 > args.max_seconds:
                break
            r = time_case(n, k, m, arms, sms, gen)
            print(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items()}), flush=True)
            rows.append(r)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                            "triton": triton.__version__, "checks": checks, "timings": rows,
                                            "seconds": time.time() - t0}, indent=1))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
