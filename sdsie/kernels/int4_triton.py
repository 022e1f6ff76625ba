"""The INT4 kernels in Triton: y = x @ dequant(W).T with W packed 4-bit (uint8, two codes a byte along K; see
`sdsie.int4_format`), dequantized on chip, accumulated in fp32, written in x's dtype (fp16, bf16 or fp32).

Device code only; `sdsie.kernels.int4_gemm` launches it (and the Gluon tensor-core GEMV of `sdsie.kernels.int4_mma`,
which takes bf16 x at M <= 8 on sm_90+), with the configuration `sdsie.kernels.int4_config` picks. Every kernel here
runs under Triton's interpreter too, which is how the CPU tests check each configuration the choice can return.

* `_int4_gemv_kernel` (M == 1, and small M: one program per 1, 2 or 4 rows and N tile, the rows sharing each
  loaded weight tile): no `tl.dot` (it would pad M to 16); multiply elementwise and reduce once with `tl.sum`.
  The zero-point is folded out of the inner loop:
      sum_k (q_k - z) * s * x_k = s * (sum_k q_k x_k - z * sum_k x_k)      (per group)
  and codes become exact floats by bit tricks (no int->float conversion), so the inner loop is a
  shift per two codes, one LOP3 and one FMA per code (v3, docs/kernel-log.md).
* `_int4_gemm_kernel` (M > 1): the even and odd nibbles are two `tl.dot`s against the even and
  odd columns of x, with the same zero-point folding per group.
* `_int4_gemm_planes_kernel` (small M, `Int4KernelConfig.swap_ab`): the dequantized weights as the left operand of
  a Hopper wgmma (y^T = W x^T), so x pads only to 16 columns; the low and high nibbles of one loaded byte tile are
  two dots, dequantized in the wgmma's registers by inline PTX on a GPU and by the same bit operations in Triton
  ops under the interpreter. (A kernel whose codes went through shared memory ran slower: docs/kernel-log.md.)
* `_int4_dequant_kernel` (prompts): unpacks the weight to x's dtype for one cuBLAS matmul.

The GEMV and the tl.dot kernels split K across programs when the N grid alone cannot fill the GPU. Partial sums go
to an fp32 workspace; the last program to finish a tile (counted with an atomic semaphore that it resets afterwards)
reduces them and writes y: one launch, no zero-initialised buffer.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from sdsie.int4_format import SYMMETRIC_ZERO
from sdsie.kernels.device import grid_dependency

assert SYMMETRIC_ZERO == 8  # the dequant kernel hard-codes the symmetric zero-point


@triton.jit
def _codes_f32(q):
    """INT4 codes (int32 in [0, 15]) to exact fp32 without an I2F conversion: OR the code into the
    mantissa of 2**23 and subtract 2**23. Conversions run at a quarter of the FMA rate on Hopper and
    were the v1 GEMV's bottleneck (docs/kernel-log.md)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _codes_16(b, DOT_DTYPE: tl.constexpr):
    """Low/high nibbles of uint8 bytes as 16 + q in fp16/bf16 (exact), built with integer ops only.

    16 + q lies in [16, 32) where fp16 steps by 2**-6 and bf16 by 2**-3, so q is shifted into the
    mantissa of 16.0 (fp16 0x4C00, bf16 0x4180). The +16 is folded out with sum(x) by the caller."""
    b16 = b.to(tl.int16)
    if DOT_DTYPE == tl.float16:
        lo = ((b16 & 0xF) << 6) | 0x4C00
        hi = ((b16 & 0xF0) << 2) | 0x4C00
    else:
        lo = ((b16 & 0xF) << 3) | 0x4180
        hi = ((b16 & 0xF0) >> 1) | 0x4180
    return lo.to(DOT_DTYPE, bitcast=True), hi.to(DOT_DTYPE, bitcast=True)


@triton.jit
def _byte_cols(k0, BLOCK_KB: tl.constexpr):
    """The BLOCK_KB byte columns of the K tile starting at code k0 (a multiple of 2 * BLOCK_KB): [BKB]."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_KB)
    return tl.max_contiguous(tl.multiple_of(offs_b, BLOCK_KB), BLOCK_KB)


@triton.jit
def _load_bytes(qw_ptr, offs_n, offs_b, N, KB, stride_qn, EVEN: tl.constexpr):
    """A [BN, BKB] tile of packed bytes (two codes each) at byte columns offs_b; past N or KB they read 0, and
    EVEN (whole tiles) loads without masks."""
    if EVEN:
        return tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_b[None, :], eviction_policy="evict_first")
    mask = (offs_n[:, None] < N) & (offs_b[None, :] < KB)
    ptrs = qw_ptr + offs_n[:, None] * stride_qn + offs_b[None, :]
    return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")  # [BN, BKB] uint8


CODE_LO: tl.constexpr = tl.constexpr(256.0)  # the float a pair's low code is OR-ed into (_code_pair_f32) ...
CODE_HI: tl.constexpr = tl.constexpr(16.0)  # ... and its high code; the callers subtract both with sums of x


@triton.jit
def _code_pair_f32(w, SHIFT: tl.constexpr, magic_lo, magic_hi):
    """The two codes at bits [SHIFT, SHIFT + 8) of int32 words w as exact fp32 (CODE_LO + q_lo, CODE_HI + q_hi).

    One shift puts the pair at bits 15..22; one and-or per code then drops each nibble into a float's
    mantissa: bits 15..18 of 256.0 (0x43800000, ulp 2**-15) step by 1, and so do bits 19..22 of 16.0
    (0x41800000, ulp 2**-19). So a code costs half a shift, one LOP3 and its FMA; the caller removes
    the offsets per tile with sums of x (v3, docs/kernel-log.md). No int->float conversion, which ran
    at a quarter rate in v1. (Bits 16..23 would spare the pair there its shift, but bit 23 is the exponent's
    lowest: a high nibble there is not linear in its float; tests/test_int4_kernel.py checks every byte at every
    position.) magic_lo and magic_hi are those bit patterns (CODE_MAGIC), passed as run-time arguments."""
    if SHIFT <= 15:
        t = w << (15 - SHIFT)
    else:
        t = w >> (SHIFT - 15)
    lo = ((t & 0x00078000) | magic_lo).to(tl.float32, bitcast=True)
    hi = ((t & 0x00780000) | magic_hi).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _split8(xt, BC: tl.constexpr):
    """x tile [BC, 8] (column c holds x[8c .. 8c + 7]) -> its eight [BC] columns, code positions 0..7.

    Three levels of tl.split (register moves within a thread): the tile is read with contiguous vector
    loads instead of eight stride-8 gathers."""
    ev, od = tl.split(tl.reshape(xt, [BC, 4, 2]))  # positions (0, 2, 4, 6) and (1, 3, 5, 7)
    e04, e26 = tl.split(tl.reshape(ev, [BC, 2, 2]))
    o15, o37 = tl.split(tl.reshape(od, [BC, 2, 2]))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _load_words(qw_ptr, offs_n, n_mask, c0, NCOLS, stride_qn, BLOCK_COLS: tl.constexpr, EVEN: tl.constexpr):
    """A [BN, BLOCK_COLS] tile of int32 words (8 codes each) starting at word column c0."""
    offs_c = c0 + tl.arange(0, BLOCK_COLS)  # [BC]
    offs_c = tl.max_contiguous(tl.multiple_of(offs_c, BLOCK_COLS), BLOCK_COLS)
    ptrs = qw_ptr + offs_n[:, None] * stride_qn + offs_c[None, :]
    if EVEN:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs, mask=n_mask[:, None] & (offs_c[None, :] < NCOLS), other=0, eviction_policy="evict_first")


@triton.jit
def _x_gather(x_row, kw, i: tl.constexpr, K, stride_xk, EVEN: tl.constexpr):
    """x at k = kw + i for words starting at kw [BC4], loaded straight into the words' layout."""
    if EVEN:
        return tl.load(x_row + (kw + i) * stride_xk).to(tl.float32)
    return tl.load(x_row + (kw + i) * stride_xk, mask=kw + i < K, other=0.0).to(tl.float32)


@triton.jit
def _word_gathers(x_row, kw, K, stride_xk, EVEN: tl.constexpr):
    """x at the 8 codes of the words starting at k = kw [BC4], as eight stride-32 gathers: [BC4] each."""
    return (_x_gather(x_row, kw, 0, K, stride_xk, EVEN), _x_gather(x_row, kw, 1, K, stride_xk, EVEN),
            _x_gather(x_row, kw, 2, K, stride_xk, EVEN), _x_gather(x_row, kw, 3, K, stride_xk, EVEN),
            _x_gather(x_row, kw, 4, K, stride_xk, EVEN), _x_gather(x_row, kw, 5, K, stride_xk, EVEN),
            _x_gather(x_row, kw, 6, K, stride_xk, EVEN), _x_gather(x_row, kw, 7, K, stride_xk, EVEN))


@triton.jit
def _run_x(x_row, kw, K, stride_xk, BC4: tl.constexpr, EVEN: tl.constexpr, X_TILE: tl.constexpr):
    """x at the 32 codes of the runs of four words starting at k = kw [BC4]: four words' eight [BC4] vectors.

    X_TILE: one contiguous [BC4, 32] tile split in registers (vector loads; the split goes through shared memory
    and barriers); else stride-32 gathers (scalar loads, no barrier)."""
    if X_TILE:
        offs_k = kw[:, None] + tl.arange(0, 32)[None, :]  # [BC4, 32]
        if EVEN:
            xt = tl.load(x_row + offs_k * stride_xk).to(tl.float32)
        else:
            xt = tl.load(x_row + offs_k * stride_xk, mask=offs_k < K, other=0.0).to(tl.float32)  # [BC4, 32]
        # k = kw + 16 a + 8 b + j: word 2 a + b, code j
        lo, hi = tl.split(tl.permute(tl.reshape(xt, [BC4, 2, 2, 8]), (0, 3, 1, 2)))  # b = 0, 1: [BC4, 8, 2]
        xa0b0, xa1b0 = tl.split(lo)  # words 0, 2: [BC4, 8]
        xa0b1, xa1b1 = tl.split(hi)  # words 1, 3
        return _split8(xa0b0, BC4), _split8(xa0b1, BC4), _split8(xa1b0, BC4), _split8(xa1b1, BC4)
    return (_word_gathers(x_row, kw, K, stride_xk, EVEN), _word_gathers(x_row, kw + 8, K, stride_xk, EVEN),
            _word_gathers(x_row, kw + 16, K, stride_xk, EVEN), _word_gathers(x_row, kw + 24, K, stride_xk, EVEN))


@triton.jit
def _word_fma(w, xw, prod, magic_lo, magic_hi):
    """prod + sum_j c_j x_j over the 8 codes of words w [BN, BC4] (as CODE_LO + q or CODE_HI + q), x at
    those codes xw (eight [BC4])."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xw
    c0, c1 = _code_pair_f32(w, 0, magic_lo, magic_hi)
    prod = tl.fma(c1, x1[None, :], tl.fma(c0, x0[None, :], prod))
    c2, c3 = _code_pair_f32(w, 8, magic_lo, magic_hi)
    prod = tl.fma(c3, x3[None, :], tl.fma(c2, x2[None, :], prod))
    c4, c5 = _code_pair_f32(w, 16, magic_lo, magic_hi)
    prod = tl.fma(c5, x5[None, :], tl.fma(c4, x4[None, :], prod))
    c6, c7 = _code_pair_f32(w, 24, magic_lo, magic_hi)
    return tl.fma(c7, x7[None, :], tl.fma(c6, x6[None, :], prod))


@triton.jit
def _x_even_odd_sums(xw):
    """Sums of x over a word's even and odd code positions (the offsets CODE_LO and CODE_HI): [BC4] each."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xw
    return x0 + x2 + x4 + x6, x1 + x3 + x5 + x7


@triton.jit
def _gemv_words_tile(raw, x_row, k0, K, stride_xk, magic_lo, magic_hi, BLOCK_COLS: tl.constexpr,
                     EVEN: tl.constexpr, X_TILE: tl.constexpr):
    """sum_j q_j x_j over runs of four words (32 codes, one group: groups are powers of two >= 32) of one word
    tile raw [BN, BC]; returns prod [BN, BC / 4] and xcol [BC / 4] (the sum of x over each run's codes).

    A thread holds four consecutive words of a row (16-byte loads), so the reshape and splits below are register
    renames, and one FMA chain runs over a run's 32 codes: the scale and zero-point terms (_accumulate) are paid
    once per 32 codes, not once per word (docs/kernel-log.md, the run fold)."""
    BN: tl.constexpr = raw.shape[0]
    BC4: tl.constexpr = BLOCK_COLS // 4
    ev, od = tl.split(tl.reshape(raw, [BN, BC4, 2, 2]))  # words 4c + (0, 2) and 4c + (1, 3)
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)  # [BN, BC4] each
    kw = k0 + tl.arange(0, BC4) * 32  # [BC4] first code of each run
    xw0, xw1, xw2, xw3 = _run_x(x_row, kw, K, stride_xk, BC4, EVEN, X_TILE)
    e0, o0 = _x_even_odd_sums(xw0)
    e1, o1 = _x_even_odd_sums(xw1)
    e2, o2 = _x_even_odd_sums(xw2)
    e3, o3 = _x_even_odd_sums(xw3)
    x_even = (e0 + e1) + (e2 + e3)  # [BC4]
    x_odd = (o0 + o1) + (o2 + o3)
    prod = tl.broadcast_to(-(x_even * CODE_LO + x_odd * CODE_HI)[None, :], [BN, BC4])  # the codes' offsets
    prod = _word_fma(w0, xw0, prod, magic_lo, magic_hi)
    prod = _word_fma(w1, xw1, prod, magic_lo, magic_hi)
    prod = _word_fma(w2, xw2, prod, magic_lo, magic_hi)
    prod = _word_fma(w3, xw3, prod, magic_lo, magic_hi)
    return prod, x_even + x_odd


@triton.jit
def _gemv_bytes_tile(qw_ptr, x_row, offs_n, n_mask, k0, K, NCOLS, stride_qn, stride_xk, magic_lo, magic_hi,
                     BLOCK_COLS: tl.constexpr):
    """Bytes path (K not a multiple of 8): sum_j q_j x_j over each byte's two codes, prod [BN, BC], and
    xcol [BC]."""
    offs_c = k0 // 2 + tl.arange(0, BLOCK_COLS)  # [BC]
    mask = n_mask[:, None] & (offs_c[None, :] < NCOLS)
    raw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_c[None, :], mask=mask, other=0,
                  eviction_policy="evict_first").to(tl.int32)  # [BN, BC]
    kc = offs_c * 2  # [BC] first k of each byte
    xe = tl.load(x_row + kc * stride_xk, mask=kc < K, other=0.0).to(tl.float32)  # [BC]
    xo = tl.load(x_row + (kc + 1) * stride_xk, mask=kc + 1 < K, other=0.0).to(tl.float32)
    lo, hi = _code_pair_f32(raw, 0, magic_lo, magic_hi)
    prod = tl.fma(hi, xo[None, :], tl.fma(lo, xe[None, :], -(xe * CODE_LO + xo * CODE_HI)[None, :]))
    return prod, xe + xo


@triton.jit
def _param_pairs(p_ptr, g, offs_p, mask_p, N, BLOCK_N: tl.constexpr):
    """One 16-bit parameter (scales or zero-points, [G, N]) of group g for the rows 2p and 2p + 1 of offs_p
    [BN / 2], read as one int32 word per pair, -> [BN] in row order."""
    words = tl.load(p_ptr.to(tl.pointer_type(tl.int32)) + g * (N // 2) + offs_p, mask=mask_p, other=0)  # [BN / 2]
    DTYPE: tl.constexpr = p_ptr.dtype.element_ty
    even = words.to(tl.int16).to(DTYPE, bitcast=True)  # row 2p: the word's low half (little-endian)
    odd = (words >> 16).to(tl.int16).to(DTYPE, bitcast=True)  # row 2p + 1
    return tl.reshape(tl.join(even, odd), [BLOCK_N])  # [BN / 2, 2] -> [BN]: row 2p + j


@triton.jit
def _param_row_words(p_ptr, g, offs_n, mask, N):
    """One 16-bit parameter ([G, N]) of group g for rows offs_n [BN]: each row reads the int32 word holding its
    pair (rows 2p and 2p + 1 read the same word) and keeps its half. No layout change, unlike _param_pairs."""
    words = tl.load(p_ptr.to(tl.pointer_type(tl.int32)) + g * (N // 2) + offs_n // 2, mask=mask, other=0)  # [BN]
    half = (words >> ((offs_n % 2) * 16)).to(tl.int16)  # row 2p: the low half (little-endian), 2p + 1: the high
    return half.to(p_ptr.dtype.element_ty, bitcast=True)


PLAIN: tl.constexpr = tl.constexpr(0)  # _group_param's forms: a 2-byte (or 4-byte) load per value
PAIRS: tl.constexpr = tl.constexpr(1)  # an int32 word per row pair, offs the [BN / 2] pairs (_param_pairs)
ROW_WORDS: tl.constexpr = tl.constexpr(2)  # an int32 word per row (_param_row_words)


@triton.jit
def _group_param(p_ptr, g, offs, mask, N, FORM: tl.constexpr, BLOCK_N: tl.constexpr):
    """One parameter ([G, N]) of group index/indices g as fp32, at offs (broadcast against g) in one of three
    forms: PLAIN, PAIRS or ROW_WORDS (16-bit parameters, N even, 4-byte aligned tensors)."""
    if FORM == PAIRS:
        v = _param_pairs(p_ptr, g, offs, mask, N, BLOCK_N)
    elif FORM == ROW_WORDS:
        v = _param_row_words(p_ptr, g, offs, mask, N)
    else:
        v = tl.load(p_ptr + g * N + offs, mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _load_group_params(s_ptr, z_ptr, g, offs_n, mask, N, HAS_ZEROS: tl.constexpr, offs_p=None, p_mask=None,
                       BLOCK_N: tl.constexpr = 1):
    """Scales and zero-points for group index/indices g (broadcast against offs_n), as fp32.

    Given the tile's row pairs offs_p [BN / 2] and their mask (16-bit parameters, N even, 4-byte aligned tensors),
    they are read as int32 words, so a thread's share of a [BN] tile is a whole 4-byte word and the pipeliner can
    stage it through cp.async (2 bytes cannot be; below BN 64 x warps every K tile of the planes kernel waited on
    these loads under ncu: docs/kernel-log.md). The scales, which multiply the accumulator, read a word per row
    (ROW_WORDS: no layout change). The zero-points, which meet the wgmma's register operand, read a word per pair
    (PAIRS): offline (sm_90, BN 64) a word per row there moved two dequantized weight tiles through shared memory,
    and pairs for the scales too cost two more barriers a tile (docs/kernel-log.md)."""
    WORDS: tl.constexpr = offs_p is not None
    s = _group_param(s_ptr, g, offs_n, mask, N, ROW_WORDS if WORDS else PLAIN, BLOCK_N)
    if HAS_ZEROS:
        if WORDS:
            z = _group_param(z_ptr, g, offs_p, p_mask, N, PAIRS, BLOCK_N)
        else:
            z = _group_param(z_ptr, g, offs_n, mask, N, PLAIN, BLOCK_N)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)
    return s, z


@triton.jit
def _store_or_reduce(acc, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_ym, pid_m, pid_n, pid_k,
                     num_n_tiles, SPLIT_K: tl.constexpr):
    """Write acc [BM, BN] to y, or (split K) to the workspace, the last split reducing all of them."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # ws: [SPLIT_K, M, N] fp32
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the semaphore is released
        lock = lock_ptr + pid_m * num_n_tiles + pid_n
        arrived = tl.atomic_add(lock, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(acc.shape, tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                     total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock, 0)  # leave the semaphore zeroed for the next launch


@triton.jit
def _tile_group_params(s_ptr, z_ptr, k0, offs_n, n_mask, N, G, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, COL_CODES: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Scales s and s * z for a tile starting at column k0, shaped to multiply a [BN, BC] product tile whose columns
    cover COL_CODES codes each (BC = BLOCK_K // COL_CODES): [BN, 1] when the tile lies in one group, [BN, BC] when it
    spans BLOCK_K // GROUP groups."""
    # one return for both shapes: Triton checks every return of a function against the others
    if BLOCK_K <= GROUP:
        s, z = _load_group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask, N, HAS_ZEROS)  # [BN]
        s_t = s[:, None]
        sz_t = (s * z)[:, None]
    else:
        TG: tl.constexpr = BLOCK_K // GROUP
        GC: tl.constexpr = GROUP // COL_CODES
        BLOCK_COLS: tl.constexpr = BLOCK_K // COL_CODES
        g = k0 // GROUP + tl.arange(0, TG)  # [TG]
        gmask = n_mask[:, None] & (g[None, :] < G)
        s, z = _load_group_params(s_ptr, z_ptr, g[None, :], offs_n[:, None], gmask, N, HAS_ZEROS)  # [BN, TG]
        s_t = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, TG, GC]), [BLOCK_N, BLOCK_COLS])
        sz_t = tl.reshape(tl.broadcast_to((s * z)[:, :, None], [BLOCK_N, TG, GC]), [BLOCK_N, BLOCK_COLS])
    return s_t, sz_t


@triton.jit
def _row_tile(raw, qw_ptr, x_row, offs_n, n_mask, k0, K, NCOLS, stride_qn, stride_xk, magic_lo, magic_hi,
              BLOCK_COLS: tl.constexpr,
              PER_COL: tl.constexpr, EVEN: tl.constexpr, X_TILE: tl.constexpr):
    """One row's product tile and its x column sums: [BN, BC / 4] and [BC / 4] for words (from the loaded tile raw,
    runs of four words summed), [BN, BC] and [BC] for bytes (loaded here).

    Called once per row of a program on the same raw tile: the codes' bit extraction is the same pure arithmetic on
    the same values for every row, left to the compiler to compute once (reproductions/kernels/inspect_ptx.py
    counts the instructions per code and row)."""
    # one return: Triton checks every return against the others, and the two paths' tiles differ in width
    if PER_COL == 8:
        prod, xcol = _gemv_words_tile(raw, x_row, k0, K, stride_xk, magic_lo, magic_hi, BLOCK_COLS, EVEN, X_TILE)
    else:
        prod, xcol = _gemv_bytes_tile(qw_ptr, x_row, offs_n, n_mask, k0, K, NCOLS, stride_qn, stride_xk, magic_lo,
                                      magic_hi, BLOCK_COLS)
    return prod, xcol


@triton.jit
def _accumulate(acc, xs, prod, xcol, s_t, sz_t, PER_CHANNEL: tl.constexpr):
    """acc += s * (prod - z * xcol) per group (elementwise: a per-tile tl.sum(xcol) would cost a CTA-wide
    reduction, with barriers, every tile); per channel the scale waits for the epilogue."""
    if PER_CHANNEL:
        return acc + prod, xs + xcol
    return tl.fma(s_t, prod, tl.fma(-sz_t, xcol[None, :], acc)), xs


@triton.jit
def _row_out(acc, xs, s_ptr, z_ptr, offs_n, n_mask, N, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """A row's outputs [BN] from its accumulator (per channel: s * (sum q x - z sum x))."""
    out = tl.sum(acc, axis=1)  # [BN]
    if PER_CHANNEL:
        s, z = _load_group_params(s_ptr, z_ptr, 0, offs_n, n_mask, N, HAS_ZEROS)
        out = s * (out - z * tl.sum(xs, axis=0))
    return out


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, NCOLS, G, k_per_split,
    stride_xm, stride_xk, stride_qn, stride_ym, magic_lo, magic_hi,
    GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PER_COL: tl.constexpr,
    EVEN: tl.constexpr, X_TILE: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (cdiv(M, ROWS), cdiv(N, BLOCK_N), SPLIT_K); one program = BLOCK_N outputs of ROWS rows (1, 2 or 4) over
    # one K split. Each weight tile is loaded and its codes extracted once for the program's rows. Row tiles are
    # the fastest grid axis, so at small M the programs sharing a weight tile run together and all but the first
    # read it from L2. Rows past M (M not a multiple of ROWS) read row M - 1's x and are masked at the store.
    # qw is viewed as int32 words (PER_COL = 8 codes per column) or bytes (PER_COL = 2).
    # EVEN: N % BLOCK_N == 0 and every split covers whole BLOCK_K tiles of K (no masks needed).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BLOCK_COLS: tl.constexpr = BLOCK_K // PER_COL
    # codes per accumulator column: words are summed in runs of four (32 codes, _gemv_words_tile), bytes one by one
    ACC_CODES: tl.constexpr = 32 if PER_COL == 8 else PER_COL
    ACC_COLS: tl.constexpr = BLOCK_K // ACC_CODES
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    row0 = pid_m * ROWS
    x0 = x_ptr + row0 * stride_xm
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # magic_lo, magic_hi: the float bit patterns codes are OR-ed into (CODE_LO and CODE_HI, CODE_MAGIC; see
    # _code_pair_f32), passed as run-time arguments. As compile-time constants ptxas split every and-or into two
    # LOP3s (one LOP3 takes one immediate); held in registers, and + or is one LOP3 per code (sm_90 SASS,
    # docs/kernel-log.md). Both are arguments: one derived from the other was rematerialized per use.

    # Per group, sum_k (q - z) s x = s * (sum_k q x - z sum_k x): the zero-point leaves the inner loop.
    # Accumulate elementwise and reduce across threads once at the end, not every iteration.
    acc0 = tl.zeros([BLOCK_N, ACC_COLS], tl.float32)  # scaled (or, per channel, raw) products, row 0
    xs0 = tl.zeros([ACC_COLS], tl.float32)  # per channel only: sum of x, row 0
    if ROWS >= 2:
        x1 = x_ptr + tl.minimum(row0 + 1, M - 1) * stride_xm
        acc1 = tl.zeros([BLOCK_N, ACC_COLS], tl.float32)
        xs1 = tl.zeros([ACC_COLS], tl.float32)
    if ROWS >= 4:
        x2 = x_ptr + tl.minimum(row0 + 2, M - 1) * stride_xm
        x3 = x_ptr + tl.minimum(row0 + 3, M - 1) * stride_xm
        acc2 = tl.zeros([BLOCK_N, ACC_COLS], tl.float32)
        xs2 = tl.zeros([ACC_COLS], tl.float32)
        acc3 = tl.zeros([BLOCK_N, ACC_COLS], tl.float32)
        xs3 = tl.zeros([ACC_COLS], tl.float32)
    # Word tiles in flight: STAGES <= 2 keeps the next tile in registers (prefetched by hand while this one is
    # multiplied); STAGES >= 3 leaves the loads in the loop for Triton's pipeliner, which keeps STAGES - 1 tiles in
    # flight through shared memory (cp.async) without holding them in registers.
    PIPELINED: tl.constexpr = PER_COL == 8 and STAGES >= 3
    raw = tl.zeros([BLOCK_N, BLOCK_COLS], tl.int32)  # the bytes path loads its own tiles
    if PER_COL == 8 and not PIPELINED:
        raw = _load_words(qw_ptr, offs_n, n_mask, k_begin // 8, NCOLS, stride_qn, BLOCK_COLS, EVEN)
    # PDL (programmatic dependent launch): x and y belong to the kernels around this one, the weights to no kernel,
    # so the first weight tile is asked for (register prefetch only) before the wait for the kernel before; the
    # pipeliner's cp.async prologue would also take x tiles, so the pipelined loop waits first. Then the kernel after
    # may launch: it waits in turn for this one to finish.
    grid_dependency(PDL)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES if PIPELINED else 1):
        if PIPELINED:
            raw = _load_words(qw_ptr, offs_n, n_mask, k0 // 8, NCOLS, stride_qn, BLOCK_COLS, EVEN)
        elif PER_COL == 8:
            nxt = _load_words(qw_ptr, offs_n, n_mask & (k0 + BLOCK_K < k_end), (k0 + BLOCK_K) // 8, NCOLS,
                              stride_qn, BLOCK_COLS, False)
        s_t = 1.0
        sz_t = 0.0
        if not PER_CHANNEL:
            s_t, sz_t = _tile_group_params(s_ptr, z_ptr, k0, offs_n, n_mask, N, G, GROUP, BLOCK_N, BLOCK_K, ACC_CODES,
                                           HAS_ZEROS)
        prod, xcol = _row_tile(raw, qw_ptr, x0, offs_n, n_mask, k0, K, NCOLS, stride_qn, stride_xk, magic_lo,
                               magic_hi, BLOCK_COLS, PER_COL, EVEN, X_TILE)
        acc0, xs0 = _accumulate(acc0, xs0, prod, xcol, s_t, sz_t, PER_CHANNEL)
        if ROWS >= 2:
            prod, xcol = _row_tile(raw, qw_ptr, x1, offs_n, n_mask, k0, K, NCOLS, stride_qn, stride_xk,
                                   magic_lo, magic_hi, BLOCK_COLS, PER_COL, EVEN, X_TILE)
            acc1, xs1 = _accumulate(acc1, xs1, prod, xcol, s_t, sz_t, PER_CHANNEL)
        if ROWS >= 4:
            prod, xcol = _row_tile(raw, qw_ptr, x2, offs_n, n_mask, k0, K, NCOLS, stride_qn, stride_xk,
                                   magic_lo, magic_hi, BLOCK_COLS, PER_COL, EVEN, X_TILE)
            acc2, xs2 = _accumulate(acc2, xs2, prod, xcol, s_t, sz_t, PER_CHANNEL)
            prod, xcol = _row_tile(raw, qw_ptr, x3, offs_n, n_mask, k0, K, NCOLS, stride_qn, stride_xk,
                                   magic_lo, magic_hi, BLOCK_COLS, PER_COL, EVEN, X_TILE)
            acc3, xs3 = _accumulate(acc3, xs3, prod, xcol, s_t, sz_t, PER_CHANNEL)
        if PER_COL == 8 and not PIPELINED:
            raw = nxt

    out0 = _row_out(acc0, xs0, s_ptr, z_ptr, offs_n, n_mask, N, PER_CHANNEL, HAS_ZEROS)  # [BN]
    if ROWS == 1:
        out = out0[None, :]  # [1, BN]
    if ROWS == 2:
        out1 = _row_out(acc1, xs1, s_ptr, z_ptr, offs_n, n_mask, N, PER_CHANNEL, HAS_ZEROS)
        out = tl.trans(tl.join(out0, out1))  # [2, BN]
    if ROWS == 4:
        out1 = _row_out(acc1, xs1, s_ptr, z_ptr, offs_n, n_mask, N, PER_CHANNEL, HAS_ZEROS)
        out2 = _row_out(acc2, xs2, s_ptr, z_ptr, offs_n, n_mask, N, PER_CHANNEL, HAS_ZEROS)
        out3 = _row_out(acc3, xs3, s_ptr, z_ptr, offs_n, n_mask, N, PER_CHANNEL, HAS_ZEROS)
        # join(join(r0, r2), join(r1, r3))[n, i, j] is row 2 i + j: row-major [BN, 4] holds rows 0..3 in order
        both = tl.join(tl.join(out0, out2), tl.join(out1, out3))  # [BN, 2, 2]
        out = tl.trans(tl.reshape(both, [BLOCK_N, 4]))  # [4, BN]

    offs_m = row0 + tl.arange(0, ROWS)
    _store_or_reduce(out, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_ym,
                     pid_m, pid_n, pid_k, tl.num_programs(1), SPLIT_K)


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, KB, G, k_per_split,
    stride_xm, stride_xk, stride_qn, stride_ym,
    GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_IEEE: tl.constexpr, IS_FP32: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M)); BLOCK_K <= GROUP unless PER_CHANNEL
    grid_dependency(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    BLOCK_KB: tl.constexpr = BLOCK_K // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = k_begin + k_per_split  # may overshoot K in the last split: loads are masked
    dot_dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    qx = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # per-channel only
    xs = tl.zeros([BLOCK_M], tl.float32)  # per-channel only
    for k0 in range(k_begin, k_end, BLOCK_K):
        b = _load_bytes(qw_ptr, offs_n, _byte_cols(k0, BLOCK_KB), N, KB, stride_qn, False)  # [BN, BKB]
        ke = k0 + 2 * tl.arange(0, BLOCK_KB)  # [BKB] even columns
        x_base = x_ptr + offs_m[:, None] * stride_xm
        m_mask = offs_m[:, None] < M
        xe = tl.load(x_base + ke[None, :] * stride_xk, mask=m_mask & (ke[None, :] < K), other=0.0)
        xo = tl.load(x_base + (ke[None, :] + 1) * stride_xk, mask=m_mask & (ke[None, :] + 1 < K), other=0.0)
        xsum = tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=1)  # [BM]
        if IS_FP32:  # exact codes q (offset 0), fp32 IEEE dot
            bi = b.to(tl.int32)
            lo = _codes_f32(bi & 0xF)
            hi = _codes_f32(bi >> 4)
            part = tl.dot(xe, tl.trans(lo), input_precision="ieee")
            part = tl.dot(xo, tl.trans(hi), part, input_precision="ieee")  # [BM, BN]
        else:  # 16 + q in the activation dtype
            lo, hi = _codes_16(b, dot_dtype)
            if DOT_IEEE:  # the interpreter's bf16 dot is broken: same codes, fp32 dot
                part = tl.dot(xe.to(tl.float32), tl.trans(lo.to(tl.float32)), input_precision="ieee")
                part = tl.dot(xo.to(tl.float32), tl.trans(hi.to(tl.float32)), part, input_precision="ieee")
            else:
                part = tl.dot(xe, tl.trans(lo))
                part = tl.dot(xo, tl.trans(hi), part)  # [BM, BN]
            part = part - 16.0 * xsum[:, None]  # fold out the +16 of the codes
        if PER_CHANNEL:
            qx += part
            xs += xsum
        else:
            s, z = _load_group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask & (k0 < K), N, HAS_ZEROS)
            acc += s[None, :] * (part - z[None, :] * xsum[:, None])
    if PER_CHANNEL:
        s, z = _load_group_params(s_ptr, z_ptr, 0, offs_n, n_mask, N, HAS_ZEROS)
        acc = s[None, :] * (qx - z[None, :] * xs[:, None])

    _store_or_reduce(acc, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_ym,
                     pid_m, pid_n, pid_k, tl.num_programs(0), SPLIT_K)


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr,
    N, KB, stride_qn, stride_sg, stride_wn,
    GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    """W[n, k] = (code - zero) * scale, computed in fp32, into w [N, 2 * KB] of w's dtype (a pad column past an odd
    K). grid: (cdiv(N, BLOCK_N), cdiv(KB, BLOCK_KB)); a tile's 2 * BLOCK_KB codes lie in one group."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_b = pid_b * BLOCK_KB + tl.arange(0, BLOCK_KB)  # [BKB] byte columns
    n_mask = offs_n < N
    b = _load_bytes(qw_ptr, offs_n, offs_b, N, KB, stride_qn, False).to(tl.int32)  # [BN, BKB]
    if PER_CHANNEL:
        g = 0
    else:
        g = (pid_b * 2 * BLOCK_KB) // GROUP
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]  # [BN, 1]
    if HAS_ZEROS:
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    else:
        z = 8.0  # SYMMETRIC_ZERO
    lo = ((b & 0xF).to(tl.float32) - z) * s
    hi = ((b >> 4).to(tl.float32) - z) * s
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * BLOCK_KB))  # codes 2j, 2j + 1 side by side, as in the bytes
    offs_k = pid_b * 2 * BLOCK_KB + tl.arange(0, 2 * BLOCK_KB)
    mask = n_mask[:, None] & (offs_k[None, :] < 2 * KB)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


def _byte_planes_ptx(magic: int) -> str:
    """Two bytes (one 16-bit operand) -> their low and high nibbles ORed into the mantissa of `magic`'s two halves."""
    # PRMT spreads the two bytes into the halves of a register; one LOP3 per pair ORs each half's low nibble into
    # the magic's mantissa; one shift brings the high nibbles down for the second LOP3. Both results are register
    # pairs in the order the wgmma takes them: nothing to repack (docs/kernel-log.md, planes kernel).
    return f"""{{
    .reg .b32 t, u;
    cvt.u32.u16 t, $2;
    prmt.b32 t, t, 0, 0x4140;
    lop3.b32 $0, t, 0x000F000F, {magic:#010x}, 0xea;
    shr.u32 u, t, 4;
    lop3.b32 $1, u, 0x000F000F, {magic:#010x}, 0xea;
    }}"""


_PLANES_PTX_FP16 = tl.constexpr(_byte_planes_ptx(0x64006400))  # 1024.0 in both halves
_PLANES_PTX_BF16 = tl.constexpr(_byte_planes_ptx(0x43004300))  # 128.0 in both halves


@triton.jit
def _byte_planes_asm(b, CODE_DTYPE: tl.constexpr):
    """_byte_planes on a GPU in inline PTX: two bytes, four codes, per call."""
    PTX: tl.constexpr = _PLANES_PTX_FP16 if CODE_DTYPE == tl.float16 else _PLANES_PTX_BF16
    return tl.inline_asm_elementwise(asm=PTX, constraints="=r,=r,h", args=[b], dtype=(CODE_DTYPE.value,) * 2,
                                     is_pure=True, pack=2)


@triton.jit
def _byte_planes(b, CODE_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """uint8 bytes -> (low nibbles, high nibbles) as BIAS + q in fp16/bf16, exact: q ORed into the mantissa of
    BIAS = 1024.0 (fp16, 0x6400) or 128.0 (bf16, 0x4300), where the format steps by 1 (Marlin's trick). No shift for
    the low nibble. ASM (a GPU; the interpreter runs no inline PTX): the same bits, two codes per instruction."""
    if ASM:
        lo, hi = _byte_planes_asm(b, CODE_DTYPE)
    else:
        MAGIC: tl.constexpr = 0x6400 if CODE_DTYPE == tl.float16 else 0x4300
        b16 = b.to(tl.int16)
        lo = ((b16 & 0xF) | MAGIC).to(CODE_DTYPE, bitcast=True)
        hi = ((b16 >> 4) | MAGIC).to(CODE_DTYPE, bitcast=True)
    return lo, hi


@triton.jit
def _x_even_odd(x_ptr, offs_m, m_mask, offs_b, K, KB, stride_xm, stride_xk, CODE_DTYPE: tl.constexpr,
                EVEN: tl.constexpr, X_WORDS: tl.constexpr):
    """x's columns k = 2j and 2j + 1 for the byte columns j = offs_b [BKB]: two [BKB, BM] tiles, 0 past M and K."""
    if X_WORDS:  # word j of a row holds x[2j] in its low half, x[2j + 1] in its high half (little-endian)
        xw_ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + offs_m[None, :] * (stride_xm // 2) + offs_b[:, None]
        if EVEN:
            xw = tl.load(xw_ptrs, mask=m_mask[None, :], other=0)  # [BKB, BM] int32
        else:
            xw = tl.load(xw_ptrs, mask=m_mask[None, :] & (offs_b[:, None] < KB), other=0)
        xe = xw.to(tl.int16).to(CODE_DTYPE, bitcast=True)
        xo = (xw >> 16).to(tl.int16).to(CODE_DTYPE, bitcast=True)
    else:
        ke = 2 * offs_b  # [BKB] even k
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + ke[:, None] * stride_xk  # [BKB, BM]
        if EVEN:
            xe = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            xo = tl.load(x_ptrs + stride_xk, mask=m_mask[None, :], other=0.0)
        else:
            xe = tl.load(x_ptrs, mask=m_mask[None, :] & (ke[:, None] < K), other=0.0)
            xo = tl.load(x_ptrs + stride_xk, mask=m_mask[None, :] & (ke[:, None] + 1 < K), other=0.0)
    return xe, xo


@triton.jit
def _int4_gemm_planes_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, KB, G, k_per_split,
    stride_xm, stride_xk, stride_qn, stride_ym,
    GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr, DOT_IEEE: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, X_WORDS: tl.constexpr,
    SZ_WORDS: tl.constexpr, PDL: tl.constexpr,
):
    # Small M on the tensor cores with the operands swapped, so the weight tile fills the 64-row side of a Hopper
    # wgmma, which takes it from registers, and x pads only to BLOCK_M = 16 columns. The weights are taken as bytes:
    # y^T [BN, BM] = lo [BN, BK/2] @ x_even^T [BK/2, BM] + hi [BN, BK/2] @ x_odd^T [BK/2, BM], lo and hi the low and
    # high nibbles of one loaded byte tile (k = 2j and 2j + 1). Both planes are elementwise functions of that tile,
    # so Triton loads it from shared memory straight into the wgmma's register layout and dequantizes it there: no
    # dequantized tile goes through shared memory (a kernel whose one loaded word fed eight dots or a join paid that
    # round trip and ran slower: docs/kernel-log.md, planes kernel). Any K: bytes need no words.
    # grid: (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M)); BLOCK_K <= GROUP unless PER_CHANNEL.
    # EVEN: N % BLOCK_N == 0, K % BLOCK_K == 0 and the splits cover K exactly (no masks on the weights or x's K).
    # X_WORDS: K even, x's rows contiguous and even-strided, x 16-byte aligned (the words need 4 bytes; the host asks
    # for the 16 that the plan key pins): x's (even, odd) pairs are read as int32 words, one contiguous tile the
    # pipeliner stages through cp.async like the weights. Else x_even and x_odd are two strided 2-byte gathers,
    # which cp.async cannot take, so every K tile waited on them (ncu: docs/kernel-log.md).
    # SZ_WORDS (the host sets it for 16-bit scales and zero-points, N even, both 4-byte aligned, on wgmma tiles whose
    # threads would hold under 4 bytes of them): a group's values are read as int32 words of two rows each
    # (_load_group_params given the row pairs), which the pipeliner stages like the weights. Else 2-byte loads per row,
    # synchronous in every K tile below BN 64 x warps (the down_proj BN 64 tile's hottest wait under ncu:
    # docs/kernel-log.md).
    # PDL: wait first (the pipeliner's prologue issues x's tiles with the weights'), then let the next kernel launch
    grid_dependency(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    BKB: tl.constexpr = BLOCK_K // 2  # byte columns per tile
    CODE_DTYPE: tl.constexpr = tl.float16 if x_ptr.dtype.element_ty == tl.float16 else tl.bfloat16
    BIAS: tl.constexpr = 1024.0 if CODE_DTYPE == tl.float16 else 128.0  # _byte_planes' offset
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_p = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # [BN / 2] row pairs (SZ_WORDS)
    k_begin = pid_k * k_per_split

    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # sum (q - z) x, scaled per group (per channel: at the end)
    if PER_CHANNEL:
        s, z = _load_group_params(s_ptr, z_ptr, 0, offs_n, n_mask, N, HAS_ZEROS)  # [BN]
    for k0 in tl.range(k_begin, k_begin + k_per_split, BLOCK_K, num_stages=STAGES):
        offs_b = _byte_cols(k0, BKB)  # [BKB]
        # a partial tile: past N or K the bytes read 0, and so does x (K odd: the pad nibble meets x = 0)
        b = _load_bytes(qw_ptr, offs_n, offs_b, N, KB, stride_qn, EVEN)  # [BN, BKB] uint8
        xe, xo = _x_even_odd(x_ptr, offs_m, m_mask, offs_b, K, KB, stride_xm, stride_xk, CODE_DTYPE, EVEN, X_WORDS)
        if not PER_CHANNEL:
            if SZ_WORDS:
                s, z = _load_group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask & (k0 < K), N, HAS_ZEROS,
                                          offs_p, (2 * offs_p < N) & (k0 < K), BLOCK_N)  # [BN]
            else:
                s, z = _load_group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask & (k0 < K), N, HAS_ZEROS)  # [BN]
        lo, hi = _byte_planes(b, CODE_DTYPE, ASM)  # [BN, BKB] each, BIAS + q
        # (BIAS + q) - (BIAS + z) = q - z, exact in 16 bits for the format's integer zero-points
        if DOT_IEEE:  # the same exact values in fp32: Triton 3.6's interpreter gets bf16 subtraction and dots wrong
            off = (BIAS + z)[:, None]
            part = tl.dot(lo.to(tl.float32) - off, xe.to(tl.float32), input_precision="ieee")
            part = tl.dot(hi.to(tl.float32) - off, xo.to(tl.float32), part, input_precision="ieee")  # [BN, BM]
        else:
            off = (BIAS + z).to(CODE_DTYPE)[:, None]
            part = tl.dot(lo - off, xe)
            part = tl.dot(hi - off, xo, part)  # [BN, BM]
        if PER_CHANNEL:
            acc += part
        else:
            acc += s[:, None] * part
    if PER_CHANNEL:
        acc = s[:, None] * acc

    _store_or_reduce(tl.trans(acc), y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_ym,
                     pid_m, pid_n, pid_k, tl.num_programs(0), SPLIT_K)




# the fp32 bit patterns of CODE_LO and CODE_HI (0x43800000, 0x41800000): the GEMV's magic_lo, magic_hi arguments
CODE_MAGIC = tuple(struct.unpack("<I", struct.pack("<f", v.value))[0] for v in (CODE_LO, CODE_HI))
