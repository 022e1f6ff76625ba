"""The tl.dot (M >= 4) path's loop in sm_90 SASS, offline: the package's GEMM kernel against a words variant.

    python -m reproductions.kernels.gemm_sass_probe [--config BMxBNxBKxWARPS]

The package's `_int4_gemm_kernel` unpacks bytes to bf16 one code at a time before its two `tl.dot`s. The variant
here (not in the package; NOTES.md, session 6) reads int32 words and builds two bf16 codes per LOP3: nibbles i and
i + 4 of a word, shifted to bits 3..6 of each 16-bit half and OR-ed into 16.0 (0x4180), then eight K = BK/8 dots
against x gathered at k = 8c + i. It computes the same group-wise dequantized product (the +16 folded out with the
sum of x) and exists to count instructions; it has never run on a GPU. Prints SASS instructions per code a thread
handles in the K loop, barriers and shared stores per tile, for both.
"""

from __future__ import annotations

import argparse
import collections
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from reproductions.kernels.inspect_ptx import sass_loop
from sdsie.kernels.int4_gemm import _int4_gemm_kernel, _load_group_params


@triton.jit
def _pair16(w, i: tl.constexpr, magic):
    """Nibbles i and i + 4 of each int32 word as two bf16 tensors holding 16 + q (low and high halves)."""
    if i == 0:
        t = w << 3
    else:
        t = w >> (4 * i - 3)
    pair = (t & 0x00780078) | magic
    lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _x_at(x_ptr, offs_m, m_mask, kc, i: tl.constexpr, stride_xm, stride_xk):
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + (kc[None, :] + i) * stride_xk, mask=m_mask)


@triton.jit
def _gemm_words_variant(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, NCOLS, stride_xm, stride_xk, stride_qn,
                        stride_ym, magic, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    BC: tl.constexpr = BLOCK_K // 8
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m[:, None] < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=3):
        offs_c = k0 // 8 + tl.arange(0, BC)
        w = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_c[None, :])  # [BN, BC] int32
        kc = offs_c * 8
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        xsum = tl.zeros([BLOCK_M], tl.float32)
        for i in tl.static_range(4):
            lo, hi = _pair16(w, i, magic)
            xl = _x_at(x_ptr, offs_m, m_mask, kc, i, stride_xm, stride_xk)
            xh = _x_at(x_ptr, offs_m, m_mask, kc, i + 4, stride_xm, stride_xk)
            part = tl.dot(xl, tl.trans(lo), part)
            part = tl.dot(xh, tl.trans(hi), part)
            xsum += tl.sum(xl.to(tl.float32) + xh.to(tl.float32), axis=1)
        part = part - 16.0 * xsum[:, None]
        s, z = _load_group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask, N, True)
        acc += s[None, :] * (part - z[None, :] * xsum[:, None])
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(tl.bfloat16), mask=m_mask)


def _compile(fn, names, types, div16, consts, num_warps):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in div16}
    sig = {**dict(zip(names, types, strict=True)), **{k: "constexpr" for k in consts}}
    return compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps, "num_stages": 3})


def counts(kernel, codes_per_thread: float) -> dict[str, float]:
    body = sass_loop(kernel.asm["cubin"])
    ops = collections.Counter(op.split()[0].split(".")[0] for op in body)
    return {"sass_per_code": len(body) / codes_per_thread, "bar": ops["BAR"], "sts": ops["STS"],
            "hmma": ops["HMMA"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="16x128x128x4", help="BMxBNxBKxWARPS")
    a = p.parse_args(argv)
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)", a.config)
    if m is None:
        p.error(f"--config {a.config!r} is not BMxBNxBKxWARPS, e.g. 16x128x128x4")
    bm, bn, bk, warps = (int(v) for v in m.groups())
    common = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr"]
    ptr_types = ["*bf16", "*u8", "*bf16", "*bf16", "*bf16"]
    names = common + ["ws_ptr", "lock_ptr", "M", "N", "K", "KB", "G", "k_per_split", "stride_xm", "stride_xk",
                      "stride_qn", "stride_ym"]
    package = _compile(_int4_gemm_kernel, names, ptr_types + ["*fp32", "*i32"] + ["i32"] * 10,
                       set(names) - {"M", "G", "stride_xk"},
                       {"GROUP": 128, "PER_CHANNEL": False, "HAS_ZEROS": True, "BLOCK_M": bm, "BLOCK_N": bn,
                        "BLOCK_K": bk, "SPLIT_K": 4, "DOT_IEEE": False, "IS_FP32": False}, warps)
    names = common + ["M", "N", "K", "NCOLS", "stride_xm", "stride_xk", "stride_qn", "stride_ym", "magic"]
    variant = _compile(_gemm_words_variant, names, ["*bf16", "*i32", "*bf16", "*bf16", "*bf16"] + ["i32"] * 9,
                       set(names) - {"M", "stride_xk"},
                       {"GROUP": 128, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, warps)
    codes = bn * bk / (32 * warps)
    for name, kernel in (("package (bytes, one code at a time)", package), ("words variant", variant)):
        c = counts(kernel, codes)
        print(f"{name}: {c['sass_per_code']:.2f} SASS per code, {c['bar']} barriers, {c['sts']} shared stores, "
              f"{c['hmma']} HMMA per tile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
