"""The tl.dot (M >= 2) paths' loops in sm_90 SASS, offline: the package's two GEMM kernels and a words variant.

    python -m reproductions.kernels.gemm_sass_probe [--config BMxBNxBKxWARPS]

* package bytes: `_int4_gemm_kernel` unpacks bytes to bf16 one code at a time before its two `tl.dot`s, x the left
  operand.
* words variant (not in the package; docs/kernel-log.md): int32 words, two bf16 codes per LOP3 (nibbles i and
  i + 4, `_code_pairs_16` below), eight K = BK/8 dots against x gathered at k = 8c + i, x still the left operand.
  It exists to count instructions and has never run on a GPU. (A swap_ab words kernel that put the same words and
  dots on a wgmma's left side, and its one_dot form that joined them into one dot, both paid a round trip of the
  codes through shared memory, which the hoist check below shows; the planes kernel replaced both. Their counts are
  in docs/kernel-log.md.)
* package planes: `_int4_gemm_planes_kernel` (`Int4KernelConfig.swap_ab`), weights on the wgmma's left
  as bytes: the low and high nibbles of one loaded byte tile are two dots against x's even and odd columns, each an
  elementwise function of the tile, dequantized in inline PTX (two bytes per call) in the wgmma's register layout.
  "package planes, Triton ops" compiles the same kernel with the interpreter's dequantization (Triton ops, ASM off),
  "package planes, x gathers" with x's two strided gathers instead of its words (X_WORDS off), and
  "package planes, 2-byte scales" with the scales and zero-points loaded as 2-byte values instead of int32 words
  (SZ_WORDS off). "package planes" sets every flag as the host does for 16-bit, aligned tensors; the
  host leaves SZ_WORDS off at BN 256 with 4 warps and at BN 32, which the probe does not.

All compute the same group-wise dequantized product (the +16 folded out with the sum of x). The probe prints first
whether Triton 3.6 keeps a dequantized tile out of shared memory when one loaded tile feeds one wgmma, and when it
feeds two. Then, per kernel: SASS instructions per code a thread handles in the K loop, barriers, shared stores and
MMA instructions per tile, whether a wgmma takes its left operand from registers, how many dequantized weight
tiles go through shared memory per K tile (TTGIR), spill instructions and registers a thread (cuobjdump).
"""

from __future__ import annotations

import argparse
import collections
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from reproductions.kernels.inspect_ptx import global_memory_order, registers, sass_loop
from sdsie.kernels.int4_triton import _int4_gemm_kernel, _int4_gemm_planes_kernel, _load_group_params


@triton.jit
def _code_pairs_16(w, i: tl.constexpr, magic, CODE_DTYPE: tl.constexpr):
    """Nibbles i and i + 4 of int32 words w (codes k = 8c + i and 8c + i + 4) as 16 + q in fp16/bf16: two tensors
    shaped like w, built with one shift and one and-or (LOP3, magic a run-time argument) per two codes.

    The shift drops nibble i into the mantissa of 16.0 in the low 16-bit half and nibble i + 4 into the high half
    (bf16: bits 3..6 of 0x4180, fp16: bits 6..9 of 0x4C00); the halves are then split off (PRMT in SASS). The
    caller folds the +16 out with the sum of x. (The extraction of a words swap kernel that is no longer in the
    package, kept here for the probes.)"""
    BASE: tl.constexpr = 6 if CODE_DTYPE == tl.float16 else 3  # mantissa bit where a code starts
    MASK: tl.constexpr = 0x03C003C0 if CODE_DTYPE == tl.float16 else 0x00780078
    if 4 * i <= BASE:
        t = w << (BASE - 4 * i)
    else:
        t = w >> (4 * i - BASE)
    pair = (t & MASK) | magic
    lo = pair.to(tl.int16).to(CODE_DTYPE, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(CODE_DTYPE, bitcast=True)
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


@triton.jit
def _hoist_probe(x_ptr, w_ptr, y_ptr, magic, DOTS: tl.constexpr):
    """One pipelined int32 tile dequantized to bf16 codes for DOTS (1 or 2) wgmmas of [128, 64] x [64, 16]."""
    offs_n = tl.arange(0, 128)
    offs_k = tl.arange(0, 64)
    offs_m = tl.arange(0, 16)
    acc = tl.zeros([128, 16], tl.float32)
    for k0 in tl.range(0, 4096, 64, num_stages=3):
        xt = tl.load(x_ptr + (k0 + offs_k)[:, None] * 16 + offs_m[None, :])
        w = tl.load(w_ptr + offs_n[:, None] * 4096 + k0 + offs_k[None, :])
        lo = (((w << 3) & 0x78) | magic).to(tl.int16).to(tl.bfloat16, bitcast=True)
        acc = tl.dot(lo, xt, acc)
        if DOTS == 2:
            hi = (((w >> 1) & 0x78) | magic).to(tl.int16).to(tl.bfloat16, bitcast=True)
            acc = tl.dot(hi, xt, acc)
    tl.store(y_ptr + offs_n[:, None] * 16 + offs_m[None, :], acc)


def hoist_check() -> dict[int, int]:
    """Dequantized weight tiles through shared memory per K tile when one loaded tile feeds 1 or 2 wgmmas."""
    names = ["x_ptr", "w_ptr", "y_ptr", "magic"]
    return {dots: counts(_compile(_hoist_probe, names, ["*bf16", "*i32", "*fp32", "i32"], {"x_ptr", "w_ptr", "y_ptr"},
                                  {"DOTS": dots}, 4), 1.0, 128)["weight_tiles_through_shared"] for dots in (1, 2)}


def _compile(fn, names, types, div16, consts, num_warps):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in div16}
    sig = {**dict(zip(names, types, strict=True)), **{k: "constexpr" for k in consts}}
    return compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps, "num_stages": 3})


def counts(kernel, codes_per_thread: float, block_n: int) -> dict:
    body = sass_loop(kernel.asm["cubin"])
    ops = collections.Counter(op.split()[0].split(".")[0] for op in body)
    ttgir = kernel.asm["ttgir"]
    # a wgmma whose left operand is a register tensor (dot_op layout), not a shared-memory descriptor
    a_regs = re.search(r"ttng\.warp_group_dot %\S+, %\S+, %\S+ .*: tensor<[^>]*#ttg\.dot_op<\{opIdx = 0",
                       ttgir) is not None
    # dequantized 16-bit weight tiles ([BN, ...]) stored to shared memory, a layout conversion on their way to a dot.
    # TTGIR names values after the Python variables: the kernels here call their x tiles x*, so those are left out.
    via_shared = len(re.findall(rf"%(?!x)\w+ = ttg\.local_alloc %\S+ : \(tensor<{block_n}x\d+x(?:bf16|f16)", ttgir))
    return {"sass_per_code": len(body) / codes_per_thread, "bar": ops["BAR"], "sts": ops["STS"],
            "ldg": ops["LDG"], "ldgsts": ops["LDGSTS"],
            "hmma": ops["HMMA"], "hgmma": ops["HGMMA"], "left_operand_in_registers": a_regs,
            "weight_tiles_through_shared": via_shared, "local_memory_ops": ops["LDL"] + ops["STL"],
            "registers": registers(kernel.asm["cubin"]), "memory_order": global_memory_order(kernel.asm["cubin"])}


KERNELS = ("package bytes", "words variant", "package planes", "package planes, Triton ops",
           "package planes, x gathers", "package planes, 2-byte scales")
# name -> (ASM: the GPU's inline PTX, X_WORDS: x's pairs as int32 words, SZ_WORDS: scales and zero-points as int32
# words)
_PLANES = {"package planes": (True, True, True), "package planes, Triton ops": (False, True, True),
           "package planes, x gathers": (True, False, True), "package planes, 2-byte scales": (True, True, False)}
_COMMON = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr"]


def probe(bm: int, bn: int, bk: int, warps: int, kernels: tuple[str, ...] = KERNELS, pdl: bool = False,
          split_k: int = 4) -> dict[str, dict]:
    """Compile the named kernels (KERNELS) for sm_90 at one tile, group 128, `split_k` splits of K (the package
    kernels), as programmatic dependents where `pdl`, and count their loops."""
    out = {}
    codes = bn * bk / (32 * warps)
    tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    if "package bytes" in kernels:
        names = _COMMON + ["ws_ptr", "lock_ptr", "M", "N", "K", "KB", "G", "k_per_split", "stride_xm", "stride_xk",
                           "stride_qn", "stride_ym"]
        k = _compile(_int4_gemm_kernel, names, ["*bf16", "*u8", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"]
                     + ["i32"] * 10, set(names) - {"M", "G", "stride_xk"},
                     {"GROUP": 128, "PER_CHANNEL": False, "HAS_ZEROS": True, **tiles, "SPLIT_K": split_k,
                      "DOT_IEEE": False, "IS_FP32": False, "PDL": pdl}, warps)
        out["package bytes"] = counts(k, codes, bn)
    if "words variant" in kernels:
        names = _COMMON + ["M", "N", "K", "NCOLS", "stride_xm", "stride_xk", "stride_qn", "stride_ym", "magic"]
        k = _compile(_gemm_words_variant, names, ["*bf16", "*i32", "*bf16", "*bf16", "*bf16"] + ["i32"] * 9,
                     set(names) - {"M", "stride_xk", "magic"}, {"GROUP": 128, **tiles}, warps)
        out["words variant"] = counts(k, codes, bn)
    names = _COMMON + ["ws_ptr", "lock_ptr", "M", "N", "K", "KB", "G", "k_per_split", "stride_xm", "stride_xk",
                       "stride_qn", "stride_ym"]
    for name, (asm, x_words, sz_words) in _PLANES.items():
        if name in kernels:
            k = _compile(_int4_gemm_planes_kernel, names, ["*bf16", "*u8", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"]
                         + ["i32"] * 10, set(names) - {"M", "G", "stride_xk"},
                         {"GROUP": 128, "PER_CHANNEL": False, "HAS_ZEROS": True, **tiles, "SPLIT_K": split_k,
                          "EVEN": True, "DOT_IEEE": False, "STAGES": 3, "ASM": asm, "X_WORDS": x_words,
                          "SZ_WORDS": sz_words, "PDL": pdl}, warps)
            out[name] = counts(k, codes, bn)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="16x128x128x4", help="BMxBNxBKxWARPS")
    a = p.parse_args(argv)
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)", a.config)
    if m is None:
        p.error(f"--config {a.config!r} is not BMxBNxBKxWARPS, e.g. 16x128x128x4")
    tiles = hoist_check()
    print(f"one loaded int32 tile dequantized for 1 wgmma: {tiles[1]} dequantized tiles through shared memory; "
          f"for 2 wgmmas: {tiles[2]}")
    bm, bn, bk, warps = (int(v) for v in m.groups())
    kernels = KERNELS
    if bk < 128:  # its dots take BK / 8 codes, and a dot takes at least 16
        kernels = tuple(k for k in KERNELS if k != "words variant")
        print(f"words variant: not compiled at BK {bk} (its eight dots take BK / 8 < 16 codes)")
    for name, c in probe(bm, bn, bk, warps, kernels).items():
        print(f"{name}: {c['sass_per_code']:.2f} SASS per code, {c['bar']} barriers, {c['sts']} shared stores, "
              f"{c['hmma']} HMMA + {c['hgmma']} HGMMA, {c['ldg']} LDG + {c['ldgsts']} LDGSTS per tile"
              f"{', wgmma left operand from registers' if c['left_operand_in_registers'] else ''}, "
              f"{c['weight_tiles_through_shared']} dequantized weight tiles through shared memory per tile, "
              f"{c['local_memory_ops']} local-memory (spill) instructions, {c['registers']} registers a thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
