"""The tl.dot (M >= 2) paths' loops in sm_90 SASS, offline: the package's two GEMM kernels and a words variant.

    python -m reproductions.kernels.gemm_sass_probe [--config BMxBNxBKxWARPS]

* package bytes: `_int4_gemm_kernel` unpacks bytes to bf16 one code at a time before its two `tl.dot`s, x the left
  operand.
* words variant (not in the package; NOTES.md, session 6): int32 words, two bf16 codes per LOP3 (nibbles i and
  i + 4, `_code_pairs_16`), eight K = BK/8 dots against x gathered at k = 8c + i, x still the left operand. It
  exists to count instructions and has never run on a GPU.
* package swap_ab: `_int4_gemm_swap_kernel`, the same words and dots with the operands swapped, so the weight
  tile is the left operand of a Hopper wgmma and stays in registers (session 7).

All compute the same group-wise dequantized product (the +16 folded out with the sum of x). Prints, per kernel,
SASS instructions per code a thread handles in the K loop, barriers, shared stores and MMA instructions per tile,
and whether the weight operand reaches the dot from registers (TTGIR).
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
from sdsie.kernels.int4_gemm import (
    _code_pairs_16,
    _int4_gemm_kernel,
    _int4_gemm_swap_kernel,
    _load_group_params,
)


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
            lo, hi = _code_pairs_16(w, i, magic, tl.bfloat16)
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
    # a wgmma whose left operand is a register tensor (dot_op layout), not a shared-memory descriptor
    a_regs = re.search(r"ttng\.warp_group_dot %\S+, %\S+, %\S+ .*: tensor<[^>]*#ttg\.dot_op<\{opIdx = 0",
                       kernel.asm["ttgir"]) is not None
    return {"sass_per_code": len(body) / codes_per_thread, "bar": ops["BAR"], "sts": ops["STS"],
            "hmma": ops["HMMA"], "hgmma": ops["HGMMA"], "left_operand_in_registers": a_regs}


KERNELS = ("package bytes", "words variant", "package swap_ab")
_COMMON = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr"]


def probe(bm: int, bn: int, bk: int, warps: int, kernels: tuple[str, ...] = KERNELS) -> dict[str, dict]:
    """Compile the named kernels (KERNELS) for sm_90 at one tile, group 128, and count their loops."""
    out = {}
    codes = bn * bk / (32 * warps)
    tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    if "package bytes" in kernels:
        names = _COMMON + ["ws_ptr", "lock_ptr", "M", "N", "K", "KB", "G", "k_per_split", "stride_xm", "stride_xk",
                           "stride_qn", "stride_ym"]
        k = _compile(_int4_gemm_kernel, names, ["*bf16", "*u8", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"]
                     + ["i32"] * 10, set(names) - {"M", "G", "stride_xk"},
                     {"GROUP": 128, "PER_CHANNEL": False, "HAS_ZEROS": True, **tiles, "SPLIT_K": 4,
                      "DOT_IEEE": False, "IS_FP32": False}, warps)
        out["package bytes"] = counts(k, codes)
    if "words variant" in kernels:
        names = _COMMON + ["M", "N", "K", "NCOLS", "stride_xm", "stride_xk", "stride_qn", "stride_ym", "magic"]
        k = _compile(_gemm_words_variant, names, ["*bf16", "*i32", "*bf16", "*bf16", "*bf16"] + ["i32"] * 9,
                     set(names) - {"M", "stride_xk", "magic"}, {"GROUP": 128, **tiles}, warps)
        out["words variant"] = counts(k, codes)
    if "package swap_ab" in kernels:
        names = _COMMON + ["ws_ptr", "lock_ptr", "M", "N", "K", "NCOLS", "G", "k_per_split", "stride_xm",
                           "stride_xk", "stride_qn", "stride_ym", "magic"]
        k = _compile(_int4_gemm_swap_kernel, names, ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"]
                     + ["i32"] * 11, set(names) - {"M", "G", "stride_xk", "magic"},
                     {"GROUP": 128, "PER_CHANNEL": False, "HAS_ZEROS": True, **tiles, "SPLIT_K": 4, "EVEN": True,
                      "DOT_IEEE": False, "STAGES": 3}, warps)
        out["package swap_ab"] = counts(k, codes)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="16x128x128x4", help="BMxBNxBKxWARPS")
    a = p.parse_args(argv)
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)", a.config)
    if m is None:
        p.error(f"--config {a.config!r} is not BMxBNxBKxWARPS, e.g. 16x128x128x4")
    for name, c in probe(*(int(v) for v in m.groups())).items():
        print(f"{name}: {c['sass_per_code']:.2f} SASS per code, {c['bar']} barriers, {c['sts']} shared stores, "
              f"{c['hmma']} HMMA + {c['hgmma']} HGMMA per tile"
              f"{', weights a wgmma left operand in registers' if c['left_operand_in_registers'] else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
