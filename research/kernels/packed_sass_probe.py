"""Can Triton ops alone give the GEMV packed bf16x2 arithmetic (half the FMAs per code)? Compile toy K loops for sm_90
offline and count their SASS per code.

    python -m research.kernels.packed_sass_probe

A prediction in docs/kernel-log.md: FFMA and LOP3 are 62% of what the tuned GEMV
executes, and only packed arithmetic halves them. The toy loops below do the GEMV's inner product on [BN, BC] int32
word tiles (8 codes per word) the packed way: one and-or per two codes puts 16 + q of codes i and i + 4 into the
two bf16 halves of a register (`_code_pairs_16`, gemm_sass_probe's words extraction), one bf16x2
subtraction of 16 + z leaves q - z exactly, and bf16x2 multiply-adds sum a word's eight products in four packed
steps before one conversion to fp32 per pair. Two forms:

* `join`: the halves `_code_pairs_16` splits off as bf16 tensors, joined into a [BN, BC, 2] tensor, so that
  Triton's layout holds each pair in one thread (it then emits bf16x2 instructions for the pair);
* `halves`: the words loaded as int16 halves [BN, 2 BC], each half's nibbles extracted with 16-bit ops.

Neither is the GEMV; both exist to count instructions. Numerics differ from the GEMV's (bf16 products and 8-code
partial sums instead of fp32 FMAs).
"""

from __future__ import annotations

import collections

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from reproductions.kernels.gemm_sass_probe import _code_pairs_16
from reproductions.kernels.inspect_ptx import sass_loop


@triton.jit
def _pair(w, i: tl.constexpr, magic, zp):
    """Codes i and i + 4 of words w [BN, BC] as q - z in bf16, [BN, BC, 2]: the words swap kernel's extraction
    (16 + q per half, `_code_pairs_16`), joined, less zp = 16 + z [BN, 1, 1]."""
    lo, hi = _code_pairs_16(w, i, magic, tl.bfloat16)
    return tl.join(lo, hi) - zp


@triton.jit
def _join_loop(w_ptr, x_ptr, y_ptr, z_ptr, magic, BN: tl.constexpr, BC: tl.constexpr):
    offs_n = tl.arange(0, BN)
    offs_c = tl.arange(0, BC)
    acc = tl.zeros([BN, BC], tl.float32)
    zp = tl.load(z_ptr + offs_n).to(tl.bfloat16)[:, None, None]
    for it in range(0, 64):
        w = tl.load(w_ptr + it * BN * BC + offs_n[:, None] * BC + offs_c[None, :])  # [BN, BC] int32
        xt = tl.load(x_ptr + it * BC * 8 + offs_c[:, None] * 8 + tl.arange(0, 8)[None, :])  # [BC, 8] bf16
        xb0, xb1 = tl.split(tl.reshape(xt, [BC, 2, 2, 2]))  # [c, h, a, b] -> b: k = 8c + 4h + 2a + b
        x0, x2 = tl.split(tl.permute(xb0, (0, 2, 1)))  # [c, h] pairs (x[8c + i], x[8c + i + 4])
        x1, x3 = tl.split(tl.permute(xb1, (0, 2, 1)))
        s = _pair(w, 0, magic, zp) * x0[None]
        s = tl.fma(_pair(w, 1, magic, zp), x1[None], s)
        s = tl.fma(_pair(w, 2, magic, zp), x2[None], s)
        s = tl.fma(_pair(w, 3, magic, zp), x3[None], s)
        acc += tl.sum(s.to(tl.float32), axis=2)
    tl.store(y_ptr + offs_n, tl.sum(acc, 1))


@triton.jit
def _half_codes(h, i: tl.constexpr, zp):
    if i > 0:
        t = h >> (4 * i)
    else:
        t = h
    return ((t & 0x000F) | 0x4300).to(tl.bfloat16, bitcast=True) - zp


@triton.jit
def _halves_loop(w_ptr, x_ptr, y_ptr, z_ptr, magic, BN: tl.constexpr, BC: tl.constexpr):
    offs_n = tl.arange(0, BN)
    offs_h = tl.arange(0, 2 * BC)
    acc = tl.zeros([BN, 2 * BC], tl.float32)
    zp = tl.load(z_ptr + offs_n).to(tl.bfloat16)[:, None]
    for it in range(0, 64):
        h = tl.load(w_ptr + it * BN * 2 * BC + offs_n[:, None] * 2 * BC + offs_h[None, :])  # [BN, 2 BC] int16
        base = x_ptr + it * 2 * BC * 4 + offs_h * 4  # x arranged per half: nibble i of half j at 4 j + i
        s = _half_codes(h, 0, zp) * tl.load(base)[None, :]
        s = tl.fma(_half_codes(h, 1, zp), tl.load(base + 1)[None, :], s)
        s = tl.fma(_half_codes(h, 2, zp), tl.load(base + 2)[None, :], s)
        s = tl.fma(_half_codes(h, 3, zp), tl.load(base + 3)[None, :], s)
        acc += s.to(tl.float32)
    tl.store(y_ptr + offs_n, tl.sum(acc, 1))


FORMS = {"join": (_join_loop, "*i32"), "halves": (_halves_loop, "*i16")}


def count(form: str, block_n: int = 128, block_cols: int = 32, num_warps: int = 4) -> dict:
    """SASS instructions per code in the form's K loop, and its most frequent opcodes."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {sorted(FORMS)}, got {form!r}")
    fn, w_type = FORMS[form]
    sig = {"w_ptr": w_type, "x_ptr": "*bf16", "y_ptr": "*fp32", "z_ptr": "*fp32", "magic": "i32",
           "BN": "constexpr", "BC": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    kernel = compile(ASTSource(fn, sig, {"BN": block_n, "BC": block_cols}, attrs), target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": num_warps})
    loop = sass_loop(kernel.asm["cubin"])
    codes = block_n * block_cols * 8 / (32 * num_warps)
    ops = collections.Counter(line.split()[0] for line in loop)
    return {"form": form, "sass_per_code": len(loop) / codes,
            "per_code": {op: n / codes for op, n in ops.most_common()}}


def main() -> None:
    for form in FORMS:
        r = count(form)
        top = ", ".join(f"{op} {v:.2f}" for op, v in list(r["per_code"].items())[:10])
        print(f"{form}: {r['sass_per_code']:.2f} SASS per code ({top})")


if __name__ == "__main__":
    main()
