"""INT4 GEMV for M <= 16 on the tensor cores, weights stored in mma fragment order (a Gluon kernel, GPU only).

Why: the CUDA-core GEMV of `int4_triton` issues about 3.4 instructions per code (an FMA, a LOP3 and their share of
shifts, x conversions and addressing) and is issue-bound on the mid-size decoder shapes (docs/kernel-log.md). Here
one `mma.sync.m16n8k16` takes 256 codes of a warp, and a thread's eight codes for it arrive as one 32-bit word whose
nibbles are already where the A fragment wants them (Marlin's offline repacking): three shifts, four LOP3s (code
-> bf16 128 + q, exact), four bf16x2 subtractions of 128 + z (exact) and one mma, 1.5 instructions a code; with the
group scales, x's loads and addressing the compiled loop issues 2.1 (sm_90, docs/kernel-log.md).
x fills the B operand's 8 columns (its rows, M <= 8; M <= 16 runs a second mma on the same A registers, which the
choice takes where the grid fits one wave, `int4_config.mma_config`); products are exact and
accumulate in fp32, and each group's sum is scaled in fp32, so the numerics match the CUDA-core kernel's.

Fragment order (`pack_fragments`): for row block nb (16 rows) and K chunk kc (64 codes), lane l = 4g + t holds four
words, one per k16 block j. Within a chunk the K order is permuted (both operands alike, so the dot is unchanged):
the mma's logical column 2t + e + 8h of block j is the real column 2 (8t + 2j + h) + e, so lane t's B fragments for
the chunk's four blocks are x's words 8t .. 8t + 7: two 16-byte loads. Word (nb, kc, l, j) holds the code of row
16 nb + g + 8 r, real column 64 kc + 16 t + 4 j + 2 h + e in nibble r + 2 h + 4 e, so `(w >> 4 i) & 0x000F000F`
is the A register a_i = (row g + 8 (i % 2), logical columns 2t + 8 (i // 2) + {0, 1}).

SILU_MUL (`int4_silu_mul`, M <= 8): for a fused [gate; up] weight packed with its rows in `gate_up_order`, a lane's
c0, c1 and c2, c3 are one channel's gate and up, and the epilogue writes silu(gate) * up in fp32 from the sums: the
gated MLP's activation without a kernel of its own.

The decoder's RMS norm and residual add (`sdsie.quant.fuse_norms`, M <= 8 for the norm): RESIDUAL adds r to the
rounded product and OUT_GAIN writes the sum times the next norm's gain beside it, then the sum's partial sums of
squares over each row block; NORM_ROWS scales each row's sums by rsqrt(mean(h^2) + eps), the mean from those partial
sums where NORM_SQUARES (4 bytes a program reads for every 32 of h), else from h read whole once more by every
program (from L2, while its first weights are in flight).

The Gluon kernel compiles only for an NVIDIA GPU (sm_80 or newer for mma.sync, sm_90 for bf16x2 subtraction);
`emulate_fragments` is its CPU twin: the same products, lane by lane, from the same words, as the PTX ISA defines
the fragments.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sdsie.int4_format import SYMMETRIC_ZERO, Int4Weight, unpack_int4
from sdsie.kernels.int4_config import MMA_STAGES

__all__ = ["pack_fragments", "emulate_fragments", "gate_up_order", "mma_consts", "mma_supported", "norm_layout",
           "MMA_MAX_M", "NORM_MAX_M", "NORM_REGISTER_CAPS", "PAIR", "SQUARE_BLOCK"]

SQUARE_BLOCK = 16  # values of h a partial sum of squares covers: one row block of the producer's output
SQUARES_A_STEP = 128  # partial sums of squares a warp reads a step in `_warp_factor`: 4 a lane
MMA_MAX_M = 16  # x's rows fill the B operand's 8 columns, twice (two mmas on the same A registers)
CHUNK = 64  # codes of K per chunk: four k16 blocks, one 16-byte load a thread
PAIR = 2 * CHUNK  # codes of K a warp takes at a time: the smallest group the kernel scales by
SYMMETRIC_ZERO_F = gl.constexpr(float(SYMMETRIC_ZERO))
SQUARES_A_STEP_C = gl.constexpr(SQUARES_A_STEP)
_SHIFTS = torch.tensor([4 * (r + 2 * h + 4 * e) for r in range(2) for h in range(2) for e in range(2)])


def pack_fragments(qweight: torch.Tensor, k: int, rows_at_a_time: int = 4096) -> torch.Tensor:
    """uint8 [N, K/2] codes (`sdsie.int4_format`) -> int32 [N/16, K/64, 32, 4] words in fragment order, on
    qweight's device; `rows_at_a_time` rows at a time (the int64 temporaries are 24 bytes a code)."""
    n = qweight.shape[0]
    if n % 16 or k % CHUNK or qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(f"fragment order needs uint8 [N, K/2] codes with N % 16 == 0 and K % {CHUNK} == 0, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}, K={k}")
    step = max(16, rows_at_a_time // 16 * 16)
    if n > step:
        return torch.cat([pack_fragments(qweight[r:r + step], k, step) for r in range(0, n, step)])
    q = unpack_int4(qweight, k).to(torch.int64)  # [N, K]
    # rows 16 nb + 8 r + g, columns 64 kc + 16 t + 4 j + 2 h + e
    q = q.view(n // 16, 2, 8, k // CHUNK, 4, 4, 2, 2)  # (nb, r, g, kc, t, j, h, e)
    q = q.permute(0, 3, 2, 4, 5, 1, 6, 7).reshape(n // 16, k // CHUNK, 8, 4, 4, 8)  # (nb, kc, g, t, j, r h e)
    words = (q << _SHIFTS.to(q.device)).sum(-1)  # [NB, KC, 8, 4, 4]
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).reshape(n // 16, k // CHUNK, 32, 4).contiguous()


def gate_up_order(n: int) -> torch.Tensor:
    """Row order of a fused [gate; up] weight (gate channels 0 .. N/2 - 1, then up's) for the SILU_MUL epilogue:
    row block b holds gate channels 8b .. 8b + 7, then up's same eight, so a lane's c0, c1 (row g) and c2, c3 (row
    g + 8) are one channel's gate and up. int64 [N]: the source row of each packed row."""
    if n % 16:
        raise ValueError(f"gate_up_order: a fused [gate; up] weight needs N % 16 == 0, got N = {n}")
    gate = 8 * torch.arange(n // 16)[:, None] + torch.arange(8)  # [N/16, 8]
    return torch.stack([gate, gate + n // 2], 1).reshape(-1)


def emulate_fragments(x: torch.Tensor, words: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """y [M, N] fp32 from fragment-ordered words, decoded as the PTX ISA lays out m16n8k16's A and B fragments.

    Independent of `pack_fragments`' index formula: a_i comes from nibbles (i, i + 4) and holds row g + 8 (i % 2),
    logical columns 2t + 8 (i // 2) + e; B's b_h for block j is x's word 8t + 2j + h of the chunk (logical rows
    2t + 8h + e). The sum over the logical columns of a block is the mma's; groups are scaled after."""
    nb, kc = words.shape[:2]
    m, k = x.shape
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    w64 = words.to(torch.int64) & 0xFFFFFFFF  # [NB, KC, 32, 4]
    codes = torch.zeros(nb * 16, kc * CHUNK, dtype=torch.int64)
    for j in range(4):
        for i in range(4):
            for e in range(2):
                nib = (w64[:, :, :, j] >> (4 * (i + 4 * e))) & 0xF  # [NB, KC, 32]
                row = g + 8 * (i % 2)  # [32] row within the block
                logical = 2 * t + 8 * (i // 2) + e  # logical column within block j
                h, te = logical // 8, logical % 8  # B: logical rows 2t + 8h + e come from word 8t + 2j + h
                word = 8 * (te // 2) + 2 * j + h
                real = 2 * word + te % 2  # real column within the chunk
                rows = (torch.arange(nb)[:, None, None] * 16 + row[None, None, :])
                cols = (torch.arange(kc)[None, :, None] * CHUNK + real[None, None, :])
                codes[rows.expand(nb, kc, 32), cols.expand(nb, kc, 32)] = nib
    gsz = w.group_size
    s = w.scales.float().repeat_interleave(gsz, 0)[:k].T  # [N, K]
    z = (w.zeros.float().repeat_interleave(gsz, 0)[:k].T if w.zeros is not None
         else torch.full_like(s, float(SYMMETRIC_ZERO)))
    deq = (codes[:, :k].double() - z.double()) * s.double()
    return (x.double() @ deq.T).float()


def mma_supported(x: torch.Tensor, w: Int4Weight) -> bool:
    """Whether the kernel takes this call (`int4_matmul` launches it, with an mma configuration): CUDA sm_90+, bf16
    x [M <= 16, K] with unit stride and 16-byte aligned rows, N % 16 == 0, K % 128 == 0, groups a multiple of 128 codes
    (or per channel)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and 1 <= x.shape[0] <= MMA_MAX_M):
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    n, k = w.out_features, w.in_features
    g = w.group_size
    aligned = x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    return n % 16 == 0 and k % PAIR == 0 and (g >= k or g % PAIR == 0) and aligned


def _mma_ptx(halves: int) -> str:
    """One chunk of one row block: per k16 block j, the word's codes to four bf16x2 A registers (LOP3: 128 + q, exact;
    bf16x2 subtraction of 128 + z, exact) and one m16n8k16 per 8 columns of B (x's rows 0-7, and 8-15 for halves 2).
    Operands, pack 4: outputs $0-$3 (c0..c3 of rows 0-7) [and $4-$7 (rows 8-15)], then the inputs in order: words,
    xa, xb [, xa, xb of rows 8-15], zg, zg8, acc [, acc of rows 8-15], four registers each."""
    o = 4 * halves  # first input operand
    words, xa = o, o + 4
    zg, zg8 = o + 8 * halves + 4, o + 8 * halves + 8
    acc = zg8 + 4
    lines = ["{", ".reg .b32 a0, a1, a2, a3, s;", ".reg .f32 c<8>;"]
    lines += [f"mov.f32 c{i}, ${acc + i};" for i in range(4 * halves)]
    for j in range(4):
        w = f"${words + j}"
        lines += [f"lop3.b32 a0, {w}, 0x000F000F, 0x43004300, 0xea;",
                  f"shr.u32 s, {w}, 4;", "lop3.b32 a1, s, 0x000F000F, 0x43004300, 0xea;",
                  f"shr.u32 s, {w}, 8;", "lop3.b32 a2, s, 0x000F000F, 0x43004300, 0xea;",
                  f"shr.u32 s, {w}, 12;", "lop3.b32 a3, s, 0x000F000F, 0x43004300, 0xea;",
                  f"sub.rn.bf16x2 a0, a0, ${zg};", f"sub.rn.bf16x2 a1, a1, ${zg8};",
                  f"sub.rn.bf16x2 a2, a2, ${zg};", f"sub.rn.bf16x2 a3, a3, ${zg8};"]
        for h in range(halves):  # B: block j's x words 8t + 2j, 8t + 2j + 1 (xa holds 8t .. 8t + 3, xb 8t + 4 ..)
            b0 = xa + 8 * h + 2 * j
            c = ", ".join(f"c{4 * h + i}" for i in range(4))
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}}}, {{a0, a1, a2, a3}}, "
                         f"{{${b0}, ${b0 + 1}}}, {{{c}}};")
    lines += [f"mov.f32 ${i}, c{i};" for i in range(4 * halves)] + ["}"]
    return "\n".join(lines)


_MMA_PTX = gl.constexpr(_mma_ptx(1))
_MMA16_PTX = gl.constexpr(_mma_ptx(2))


@gluon.jit
def _chunk_mma(words, xa, xb, xa_h, xb_h, zg, zg8, acc, acc_h, HALVES: gl.constexpr):
    """One chunk (four k16 blocks) of each row block: acc [B, W, 32, 4] (c0..c3 per lane) += the chunk's products
    with x's rows 0-7 (x [1, W, 32, 4], broadcast over the blocks), and (HALVES 2) acc_h with rows 8-15 from the same
    dequantized registers."""
    if HALVES == 1:
        acc = gl.inline_asm_elementwise(
            _MMA_PTX, "=f,=f,=f,=f," + "r," * 20 + "f,f,f,f", [words, xa, xb, zg, zg8, acc],
            dtype=gl.float32, is_pure=True, pack=4)
    else:
        acc, acc_h = gl.inline_asm_elementwise(
            _MMA16_PTX, "=f," * 8 + "r," * 28 + "f," * 7 + "f", [words, xa, xb, xa_h, xb_h, zg, zg8, acc, acc_h],
            dtype=(gl.float32, gl.float32), is_pure=True, pack=4)
    return acc, acc_h


@gluon.jit
def _wait_for_producer():
    """griddepcontrol.wait: under programmatic dependent launch, block until the kernel before has finished and its
    writes are visible (at once without that launch)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_dependents():
    """griddepcontrol.launch_dependents: the next kernel, launched programmatically, may start its programs once
    every program of this grid has passed here (they wait for this grid's end before reading what it writes)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _zero_splat(z, HAS_ZEROS: gl.constexpr):
    """bf16x2 bits of (128 + z, 128 + z) for z [B, W, 32]: the offset the code registers carry, as one subtrahend,
    [B, W, 32, 1]."""
    if not HAS_ZEROS:
        z = gl.full(z.shape, SYMMETRIC_ZERO_F, gl.float32, z.type.layout)
    v = (z + 128.0).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return gl.expand_dims(v | (v << 16), 3)


@gluon.jit
def _x_loads(xw4, xw4_h, p, pairs, HALVES: gl.constexpr):
    """x's words for one pair of chunks of each warp (pair p [1, W, 1], clamped to the last): xa, xb of both chunks
    [1, W, 32, 4] for x's rows 0-7, then for rows 8-15 (HALVES 2; else the same tensors again, unused). A thread's B
    fragments for a chunk are x's words 8t .. 8t + 7 of its row: two 16-byte loads, shared by the program's row
    blocks."""
    kc = gl.expand_dims(2 * gl.minimum(p, pairs - 1), 3)  # [1, W, 1, 1] first chunk of the pair
    xa0 = gl.load(xw4 + kc * 32)
    xb0 = gl.load(xw4 + kc * 32 + 4)
    xa1 = gl.load(xw4 + kc * 32 + 32)
    xb1 = gl.load(xw4 + kc * 32 + 36)
    if HALVES == 2:
        ha0 = gl.load(xw4_h + kc * 32)
        hb0 = gl.load(xw4_h + kc * 32 + 4)
        ha1 = gl.load(xw4_h + kc * 32 + 32)
        hb1 = gl.load(xw4_h + kc * 32 + 36)
    else:
        ha0, hb0, ha1, hb1 = xa0, xb0, xa1, xb1
    return xa0, xb0, xa1, xb1, ha0, hb0, ha1, hb1


@gluon.jit
def _wsz_loads(pw4, s_ptr, z_ptr, p, pairs, rows, N, GROUP_PAIRS: gl.constexpr, PER_CHANNEL: gl.constexpr,
               HAS_ZEROS: gl.constexpr):
    """One pair of chunks (128 codes of K) of each warp and row block: the weight words of both chunks
    [B, W, 32, 4], the pair's weight on the sum [B, W, 32] for rows g and g + 8 (grouped: its group's scales; per
    channel: 1) and the zero-points. p [1, W, 1]: each warp's pair; rows [B, 1, 32]. A pair past K reads the last
    pair again with weight 0: the loads carry no mask, so ptxas may issue them as early as it likes."""
    live = p < pairs  # [1, W, 1]
    p = gl.minimum(p, pairs - 1)
    kc = gl.expand_dims(2 * p, 3)  # [1, W, 1, 1] first chunk of the pair
    w0 = gl.load(pw4 + kc * 128)
    w1 = gl.load(pw4 + kc * 128 + 128)
    if PER_CHANNEL:
        grp = p * 0
    else:
        grp = p // GROUP_PAIRS
    if PER_CHANNEL:
        s_g = gl.where(live, 1.0, 0.0) + (rows * 0).to(gl.float32)  # [B, W, 32]
        s_g8 = s_g
    else:
        s_g = gl.where(live, gl.load(s_ptr + grp * N + rows).to(gl.float32), 0.0)  # [B, W, 32]
        s_g8 = gl.where(live, gl.load(s_ptr + grp * N + rows + 8).to(gl.float32), 0.0)
    if HAS_ZEROS:
        z_g = gl.load(z_ptr + grp * N + rows).to(gl.float32)
        z_g8 = gl.load(z_ptr + grp * N + rows + 8).to(gl.float32)
    else:
        z_g = s_g
        z_g8 = s_g8
    return w0, w1, s_g, s_g8, z_g, z_g8


@gluon.jit
def _pair_loads(pw4, xw4, xw4_h, s_ptr, z_ptr, p, pairs, rows, N, GROUP_PAIRS: gl.constexpr,
                PER_CHANNEL: gl.constexpr, HAS_ZEROS: gl.constexpr, HALVES: gl.constexpr):
    """`_wsz_loads` and `_x_loads` of one pair, as one tuple: (w0, w1, s_g, s_g8, z_g, z_g8, the 8 x tensors)."""
    return _wsz_loads(pw4, s_ptr, z_ptr, p, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS) + _x_loads(
        xw4, xw4_h, p, pairs, HALVES)


@gluon.jit
def _pair_mma(tot, tot_h, buf, j, HAS_ZEROS: gl.constexpr, HALVES: gl.constexpr):
    """tot [B, W, 32, 4] (and tot_h, x's rows 8-15) += one pair's products (buf: `_pair_loads`), weighted by rows g
    (c0, c1) and g + 8 (c2, c3): the group's scale, or per channel 1 (the scale comes at the end) and 0 for a pair
    past K. x's registers [1, W, 32, 4] serve every row block (the asm broadcasts them)."""
    w0, w1, s_g, s_g8, z_g, z_g8, xa0, xb0, xa1, xb1, ha0, hb0, ha1, hb1 = buf
    zg = _zero_splat(z_g, HAS_ZEROS)
    zg8 = _zero_splat(z_g8, HAS_ZEROS)
    part, part_h = _chunk_mma(w0, xa0, xb0, ha0, hb0, zg, zg8, gl.zeros_like(tot), gl.zeros_like(tot), HALVES)
    part, part_h = _chunk_mma(w1, xa1, xb1, ha1, hb1, zg, zg8, part, part_h, HALVES)
    scale = gl.where(j < 2, gl.expand_dims(s_g, 3), gl.expand_dims(s_g8, 3))
    if HALVES == 2:
        tot_h = tot_h + scale * part_h
    return tot + scale * part, tot_h


@gluon.jit
def _first_pairs(pw4, s_ptr, z_ptr, warp, pairs, rows, N, GROUP_PAIRS: gl.constexpr, PER_CHANNEL: gl.constexpr,
                 HAS_ZEROS: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr):
    """`_wsz_loads` of a warp's first STAGES pairs of a row block (buffers a, b, c, d; c and d repeat a and b below
    3 and 4 stages, unused)."""
    a = _wsz_loads(pw4, s_ptr, z_ptr, warp, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS)
    b = _wsz_loads(pw4, s_ptr, z_ptr, warp + WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS)
    c = a
    d = b
    if STAGES >= 3:
        c = _wsz_loads(pw4, s_ptr, z_ptr, warp + 2 * WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS)
    if STAGES == 4:
        d = _wsz_loads(pw4, s_ptr, z_ptr, warp + 3 * WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS)
    return a, b, c, d


@gluon.jit
def _first_x(a, b, c, d, xw4, xw4_h, warp, pairs, HALVES: gl.constexpr, WARPS: gl.constexpr,
             STAGES: gl.constexpr):
    """The buffers of `_first_pairs` with x's words of the same pairs added (after a programmatic launch's wait)."""
    a = a + _x_loads(xw4, xw4_h, warp, pairs, HALVES)
    b = b + _x_loads(xw4, xw4_h, warp + WARPS, pairs, HALVES)
    if STAGES >= 3:
        c = c + _x_loads(xw4, xw4_h, warp + 2 * WARPS, pairs, HALVES)
    if STAGES == 4:
        d = d + _x_loads(xw4, xw4_h, warp + 3 * WARPS, pairs, HALVES)
    return a, b, c, d


@gluon.jit
def _iteration(tot, tot_h, a, b, c, d, j, pw4, xw4, xw4_h, s_ptr, z_ptr, q, pairs, rows, N,
               GROUP_PAIRS: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZEROS: gl.constexpr,
               HALVES: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr):
    """One K iteration of a warp: each buffer's mmas, then its reload, pairs q, q + WARPS, ... of the row block at
    pw4 and rows (the next iteration's, or another block's first)."""
    tot, tot_h = _pair_mma(tot, tot_h, a, j, HAS_ZEROS, HALVES)
    a = _pair_loads(pw4, xw4, xw4_h, s_ptr, z_ptr, q, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS, HALVES)
    tot, tot_h = _pair_mma(tot, tot_h, b, j, HAS_ZEROS, HALVES)
    b = _pair_loads(pw4, xw4, xw4_h, s_ptr, z_ptr, q + WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS,
                    HALVES)
    if STAGES >= 3:
        tot, tot_h = _pair_mma(tot, tot_h, c, j, HAS_ZEROS, HALVES)
        c = _pair_loads(pw4, xw4, xw4_h, s_ptr, z_ptr, q + 2 * WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL,
                        HAS_ZEROS, HALVES)
    if STAGES == 4:
        tot, tot_h = _pair_mma(tot, tot_h, d, j, HAS_ZEROS, HALVES)
        d = _pair_loads(pw4, xw4, xw4_h, s_ptr, z_ptr, q + 3 * WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL,
                        HAS_ZEROS, HALVES)
    return tot, tot_h, a, b, c, d


@gluon.jit
def _row_squares(x_ptr, M, K, stride_xm, NORM_ROWS: gl.constexpr, NORM_PER: gl.constexpr,
                 NORM_STEPS: gl.constexpr, WARPS: gl.constexpr):
    """Each thread's share of sum(x[r]^2) (x: the norm's stream h) for rows r < NORM_ROWS (0 past M):
    [NORM_ROWS, 32 WARPS] fp32, one column a thread (a thread reads NORM_PER contiguous values a step, all its loads
    issued at once); the epilogue sums the columns."""
    LV: gl.constexpr = gl.BlockedLayout([1, NORM_PER], [32, 1], [WARPS, 1], [1, 0])  # [32 W, NORM_PER]
    LP: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])  # [NORM_ROWS, 32 W]
    vk = (gl.expand_dims(gl.arange(0, 32 * WARPS, layout=gl.SliceLayout(1, LV)), 1) * NORM_PER
          + gl.expand_dims(gl.arange(0, NORM_PER, layout=gl.SliceLayout(0, LV)), 0))  # [32 W, NORM_PER]
    pr = gl.expand_dims(gl.arange(0, NORM_ROWS, layout=gl.SliceLayout(1, LP)), 1)  # [NORM_ROWS, 1]
    sums = gl.zeros([NORM_ROWS, 32 * WARPS], gl.float32, LP)
    for r in gl.static_range(NORM_ROWS):
        part = gl.zeros([32 * WARPS], gl.float32, gl.SliceLayout(1, LV))
        for step in gl.static_range(NORM_STEPS):
            kk = step * (32 * WARPS * NORM_PER) + vk
            v = gl.load(x_ptr + r * stride_xm + kk, mask=(kk < K) & (r < M), other=0.0).to(gl.float32)
            part += gl.sum(v * v, axis=1)
        part = gl.convert_layout(part, gl.SliceLayout(0, LP))
        sums = gl.where(pr == r, gl.expand_dims(part, 0), sums)
    return sums


@gluon.jit
def _warp_factor(sq_ptr, M, K, stride_sm, eps, lane, j, NORM_ROWS: gl.constexpr, NORM_STEPS: gl.constexpr):
    """rsqrt(mean(h^2) + eps) for x's row of each accumulator ([1, 1, 32, 4], as tot's c0..c3 of a lane) from h's
    partial sums of squares sq [M, 2 K / 16], which every warp reads whole (4 values a lane a step, NORM_STEPS steps)
    and sums by shuffles: the factor then scales each warp's sums before they meet, and no cross-warp step of its
    own is needed."""
    n = 2 * (K // 16)
    idx = gl.expand_dims(lane * 4, 3) + j  # [1, 1, 32, 4]
    om4 = gl.expand_dims(2 * (lane % 4), 3) + j % 2  # [1, 1, 32, 4]: x's row of c0..c3
    f = (idx * 0).to(gl.float32)
    for r in gl.static_range(NORM_ROWS):
        part = (idx * 0).to(gl.float32)
        for step in gl.static_range(NORM_STEPS):
            kk = step * SQUARES_A_STEP_C + idx
            part += gl.load(sq_ptr + r * stride_sm + kk, mask=(kk < n) & (r < M), other=0.0).to(gl.float32)
        s = gl.sum(gl.sum(part, axis=3, keep_dims=True), axis=2, keep_dims=True)  # [1, 1, 1, 1]
        f = gl.where(om4 == r, 1.0 / gl.sqrt(s / K + eps), f)
    return f


@gluon.jit
def _row_factor(rs, om, NORM_ROWS: gl.constexpr):
    """rs [NORM_ROWS] (each thread holds all) at x's row om (any shape): where(om == r, rs[r])."""
    nr = gl.arange(0, NORM_ROWS, layout=rs.type.layout)
    f = (om * 0).to(gl.float32)
    for r in gl.static_range(NORM_ROWS):
        f = gl.where(om == r, gl.sum(gl.where(nr == r, rs, 0.0), axis=0), f)
    return f


@gluon.jit
def _store_squares(q_ptr, y, om, onb, live, M, stride_qm, ROW0: gl.constexpr, SQUARE_ROWS: gl.constexpr):
    """For x's rows r = ROW0 .. ROW0 + 7 below SQUARE_ROWS: s = sum(y^2) over each row block's 16 output rows (y
    [B, 32, 4] as stored, om its x rows), stored at q_ptr + r stride_qm + 2 row block (onb [B, 1, 1]) as two values of
    y's dtype, s rounded and what the rounding left, whose sum is s to 2^-16 of it: the next norm's partial sums of
    squares, which its reader adds up instead of reading y's row whole (`SQUARE_BLOCK`)."""
    v = y.to(gl.float32)
    v = v * v
    for i in gl.static_range(8):
        if ROW0 + i < SQUARE_ROWS:
            s = gl.sum(gl.sum(gl.where(om == ROW0 + i, v, 0.0), axis=2, keep_dims=True), axis=1,
                       keep_dims=True)  # [B, 1, 1]
            hi = s.to(q_ptr.dtype.element_ty)
            lo = (s - hi.to(gl.float32)).to(q_ptr.dtype.element_ty)
            at = q_ptr + (ROW0 + i) * stride_qm + 2 * onb
            gl.store(at, hi, mask=(ROW0 + i < M) & live)
            gl.store(at + 1, lo, mask=(ROW0 + i < M) & live)


@gluon.jit
def _store_rows(y_ptr, r_ptr, g_ptr, q_ptr, y, om, orow, onb, live, M, N, stride_ym, stride_rm, stride_qm, rs, r, g,
                NORM_ROWS: gl.constexpr, RESIDUAL: gl.constexpr, OUT_GAIN: gl.constexpr, PRELOADED: gl.constexpr,
                ROW0: gl.constexpr, SQUARE_ROWS: gl.constexpr):
    """y [B, 32, 4] fp32 sums of x's rows om at output rows orow (row blocks onb [B, 1, 1], `live` where below N):
    scaled by the row's rs (NORM_ROWS > 0), rounded to y's dtype, plus the residual's element r (RESIDUAL; the sum in
    fp32, rounded once more), stored; with OUT_GAIN, also y * g rounded, N columns further on (g: the next norm's
    gain at orow, applied to the stream it reads), and the partial sums of squares at q_ptr (`_store_squares`; ROW0:
    om's first row, 0 or 8). PRELOADED: r and g were loaded before the main loop (see the kernel), else they are
    read here."""
    mask = (om < M) & live
    if NORM_ROWS > 0:
        y = y * _row_factor(rs, om, NORM_ROWS)
    y = y.to(y_ptr.dtype.element_ty)
    if RESIDUAL:
        if not PRELOADED:
            r = gl.load(r_ptr + om * stride_rm + orow, mask=mask, other=0.0)
        y = (y.to(gl.float32) + r.to(gl.float32)).to(y_ptr.dtype.element_ty)
    gl.store(y_ptr + om * stride_ym + orow, y, mask=mask)
    if OUT_GAIN:
        if not PRELOADED:
            g = gl.load(g_ptr + orow, mask=mask, other=0.0)
        gl.store(y_ptr + om * stride_ym + N + orow, (y.to(gl.float32) * g.to(gl.float32)).to(y_ptr.dtype.element_ty),
                 mask=mask)
        _store_squares(q_ptr, y, om, onb, live, M, stride_qm, ROW0, SQUARE_ROWS)


@gluon.jit
def _int4_mma_gemv_kernel(x_ptr, pw_ptr, s_ptr, z_ptr, y_ptr, r_ptr, h_ptr, g_ptr, sq_ptr, M, N, K, stride_xm,
                          stride_ym, stride_rm, stride_hm, stride_sm, eps,
                          GROUP_PAIRS: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZEROS: gl.constexpr,
                          WARPS: gl.constexpr, HALVES: gl.constexpr, BLOCKS: gl.constexpr, SILU_MUL: gl.constexpr,
                          PDL: gl.constexpr, STAGES: gl.constexpr, NORM_ROWS: gl.constexpr, NORM_PER: gl.constexpr,
                          NORM_STEPS: gl.constexpr, RESIDUAL: gl.constexpr, OUT_GAIN: gl.constexpr,
                          NORM_SQUARES: gl.constexpr, SQUARE_ROWS: gl.constexpr):
    # grid: (cdiv(N / 16, BLOCKS),): BLOCKS row blocks (16 rows each) a program; its WARPS warps take every WARPS-th
    # pair of chunks (128 codes) of K, each keeping STAGES pairs in flight (reloaded STAGES pairs ahead once an
    # iteration's mmas are issued), and their sums meet in one cross-warp reduction. A warp's x registers for a pair
    # serve all BLOCKS blocks: x's bytes read a program fall by BLOCKS against the weights' (at M = 16 one block reads
    # 4 bytes of x a byte of weights). The last program's blocks past N / 16 repeat the last block and store nothing.
    # GROUP_PAIRS: pairs per group (group_size / 128); PER_CHANNEL: one scale a row, applied at the end.
    # HALVES: 1 for M <= 8 (x's rows fill B's 8 columns), 2 for M <= 16 (a second mma on the same A registers).
    # SILU_MUL (HALVES 1): rows in `gate_up_order`; y [M, N/2] = silu(gate) * up, computed in fp32 from the sums.
    # NORM_ROWS (> 0, a power of 2 >= M): an RMS norm after the product: each sum is scaled by
    # rsqrt(mean(h[m]^2) + eps) (before silu * up), h [M, K] the stream whose gained copy x is (x = h * gain). Every
    # program reads h's rows whole for it, from L2, after the weights' first loads are asked for; the threads' shares
    # meet in the epilogue. NORM_SQUARES: instead of h, its producer's partial sums of squares sq [M, K / 8] (one a
    # 16-value block of h, as two values of x's dtype, `_store_squares`) are read whole by every warp and added up by
    # shuffles, and each warp's sums are scaled before they meet (`_warp_factor`): no cross-warp step of its own.
    # RESIDUAL (not with SILU_MUL): y = r + the product rounded to y's dtype, as a linear followed by an add.
    # OUT_GAIN: y [M, 2N + N / 8] holds that sum, N columns on the sum times g [N] (the gained copy a norm reads),
    # then its sums of squares over each row block (`_store_squares`, the next norm's NORM_SQUARES) for x's rows
    # r < SQUARE_ROWS.
    L4: gl.constexpr = gl.BlockedLayout([BLOCKS, 1, 1, 4], [1, 1, 32, 1], [1, WARPS, 1, 1], [3, 2, 1, 0])
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [B, W, 32]
    LJ: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4)))  # [4] along j
    nb0 = gl.program_id(0) * BLOCKS
    row_blocks = N // 16
    blk = gl.expand_dims(gl.expand_dims(gl.arange(0, BLOCKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))), 1),
                         2)  # [B, 1, 1]
    warp = gl.expand_dims(gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0),
                          2)  # [1, W, 1]
    lane = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0),
                          1)  # [1, 1, 32]
    j = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=LJ), 0), 1), 2)  # [1, 1, 1, 4]
    g = lane // 4
    t = lane % 4
    nb = gl.minimum(nb0 + blk, row_blocks - 1)  # [B, 1, 1] each block's row block (the last one repeated past N)
    rows = nb * 16 + g  # [B, 1, 32] row of c0, c1 (c2, c3: rows + 8)
    kcs = K // 64
    pairs = kcs // 2
    xw = x_ptr.to(gl.pointer_type(gl.int32))
    xw4 = gl.expand_dims(xw + gl.minimum(g, M - 1) * (stride_xm // 2) + 8 * t, 3) + j  # [1, 1, 32, 4]: x's row g
    xw4_h = gl.expand_dims(xw + gl.minimum(g + 8, M - 1) * (stride_xm // 2) + 8 * t, 3) + j  # row g + 8
    pw4 = pw_ptr + gl.expand_dims((nb * kcs * 32 + lane) * 4, 3) + j  # [B, 1, 32, 4]
    tot = gl.zeros([BLOCKS, WARPS, 32, 4], gl.float32, L4)
    tot_h = gl.zeros([BLOCKS, WARPS, 32, 4], gl.float32, L4)
    # STAGES pairs in flight a warp (buffers a, b, c, d): each is reloaded (pair + STAGES W) into the registers its
    # mmas free. ptxas interleaves the pairs' mma chains and issues all of an iteration's reloads after its last
    # HMMA (offline sm_90, pinned in tests/test_int4_mma.py), so a warp waits once an iteration for its loads' whole
    # latency and then for its chain of dependent mmas. More stages keep more bytes in flight a warp where few
    # programs share an SM (short K a warp, or fewer programs than SM slots), at the cost of registers
    # (docs/kernel-log.md).
    # PDL (programmatic dependent launch): the weights, scales and zero-points of the first STAGES pairs are asked
    # for before the wait for the kernel that writes x, so their latency overlaps that kernel's end
    a, b, c, d = _first_pairs(pw4, s_ptr, z_ptr, warp, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS, WARPS,
                              STAGES)
    if PER_CHANNEL:  # one scale a row, applied once at the end
        s_end = gl.where(j < 2, gl.expand_dims(gl.load(s_ptr + rows).to(gl.float32), 3),
                         gl.expand_dims(gl.load(s_ptr + rows + 8).to(gl.float32), 3))
    # The output's indices, and the residual's and the gain's elements for the epilogue, before the loop: loaded
    # after it, their two latencies came one after the other at every program's end (a standalone o_proj or
    # down_proj launch 0.2-0.9 us slower on an H100, docs/kernel-log.md). A thread holds B x 4 of each through it.
    # With HALVES 2 (M 9-16) both are read at the end: held through the loop, they take that kernel from 128
    # registers to 138-156 (offline sm_90 compile), a program fewer an SM.
    LO: gl.constexpr = gl.SliceLayout(1, L4)  # [B, 32, 4]
    ob = gl.expand_dims(gl.expand_dims(gl.arange(0, BLOCKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LO))), 1),
                        2)  # [B, 1, 1]
    ol = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LO))), 0),
                        2)  # [1, 32, 1]
    oc = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LO))), 0),
                        1)  # [1, 1, 4]
    onb = nb0 + ob  # [B, 1, 1]
    live = onb < row_blocks
    om = 2 * (ol % 4) + oc % 2  # [1, 32, 4] x's row (B's column) of each accumulator
    orow = onb * 16 + ol // 4 + 8 * (oc // 2)  # [B, 32, 4] output row of each accumulator
    g_out = 0.0
    if OUT_GAIN and HALVES == 1:  # the next norm's gain, a weight: asked for before the wait
        g_out = gl.load(g_ptr + orow, mask=(orow < N) & live, other=0.0)
    if PDL:
        _wait_for_producer()
    r = 0.0
    if RESIDUAL and HALVES == 1:  # the residual, the producer's output: after the wait
        r = gl.load(r_ptr + om * stride_rm + orow, mask=(om < M) & live, other=0.0)
    a, b, c, d = _first_x(a, b, c, d, xw4, xw4_h, warp, pairs, HALVES, WARPS, STAGES)
    EPI_ROWS: gl.constexpr = 0 if NORM_SQUARES else NORM_ROWS  # rows the epilogue scales (NORM_SQUARES: tot is)
    if NORM_SQUARES:
        fac = _warp_factor(sq_ptr, M, K, stride_sm, eps, lane, j, NORM_ROWS, NORM_STEPS)  # [1, 1, 32, 4]
    if EPI_ROWS > 0:
        squares = _row_squares(h_ptr, M, K, stride_hm, NORM_ROWS, NORM_PER, NORM_STEPS, WARPS)
    if PDL:
        _release_dependents()
    p = warp
    for _ in range(0, gl.cdiv(pairs, STAGES * WARPS)):
        tot, tot_h, a, b, c, d = _iteration(tot, tot_h, a, b, c, d, j, pw4, xw4, xw4_h, s_ptr, z_ptr,
                                            p + STAGES * WARPS, pairs, rows, N, GROUP_PAIRS, PER_CHANNEL, HAS_ZEROS,
                                            HALVES, WARPS, STAGES)
        p += STAGES * WARPS
    if PER_CHANNEL:
        tot = tot * s_end
        tot_h = tot_h * s_end
    if NORM_SQUARES:
        tot = tot * fac
    rs = eps  # unused without EPI_ROWS
    if EPI_ROWS > 0:
        rs = 1.0 / gl.sqrt(gl.sum(squares, axis=1) / K + eps)  # [NORM_ROWS]
    if SILU_MUL:
        # a lane's c0, c1: gate of channel 8 nb + g for x's rows 2t, 2t + 1; c2, c3: up of the same (exact
        # extractions: each sums one value and three zeros)
        y4 = gl.sum(tot, axis=1)  # [B, 32, 4]
        ch = onb * 8 + ol // 4  # [B, 32, 1]
        for e in gl.static_range(2):
            gate = gl.sum(gl.where(oc == e, y4, 0.0), axis=2, keep_dims=True)  # [B, 32, 1]
            up = gl.sum(gl.where(oc == e + 2, y4, 0.0), axis=2, keep_dims=True)
            me = 2 * (ol % 4) + e  # [1, 32, 1]
            if EPI_ROWS > 0:
                f = _row_factor(rs, me, NORM_ROWS)
                gate = gate * f
                up = up * f
            out = gate / (1.0 + gl.exp(-gate)) * up
            gl.store(y_ptr + me * stride_ym + ch, out.to(y_ptr.dtype.element_ty), mask=(me < M) & live)
    else:
        yq = y_ptr + 2 * N  # OUT_GAIN: the partial sums of squares after [y, y * g]
        _store_rows(y_ptr, r_ptr, g_ptr, yq, gl.sum(tot, axis=1), om, orow, onb, live, M, N, stride_ym, stride_rm,
                    stride_ym, rs, r, g_out, EPI_ROWS, RESIDUAL, OUT_GAIN, HALVES == 1, 0, SQUARE_ROWS)
        if HALVES == 2:
            _store_rows(y_ptr, r_ptr, g_ptr, yq, gl.sum(tot_h, axis=1), om + 8, orow, onb, live, M, N, stride_ym,
                        stride_rm, stride_ym, rs, r, g_out, EPI_ROWS, RESIDUAL, OUT_GAIN, False, 8, SQUARE_ROWS)


def norm_layout(k: int, warps: int) -> tuple[int, int]:
    """(NORM_PER, NORM_STEPS) of the RMS pre-pass over rows of K values with `warps` warps: a thread reads
    NORM_PER <= 32 contiguous values a step (four 16-byte loads at most), NORM_STEPS steps cover next_pow2(K)."""
    span = max(32 * warps, 1 << max(k - 1, 0).bit_length())  # next_pow2(K), at least one value a thread
    per = min(32, span // (32 * warps))
    return per, span // (32 * warps * per)


# A folded norm's pre-pass keeps its loads' registers live beside the first pairs in flight: uncapped, ptxas gives the
# four-warp two-stage one-block M <= 8 kernel 104-106 registers where it has 96 without the norm (4 programs of 4
# warps an SM instead of 5); capped at 96 it spills nothing and its loop issues one instruction more (offline sm_90
# compile, tests/test_int4_mma.py). Keyed by (WARPS, HALVES, STAGES, BLOCKS, NORM_ROWS): decode's M = 1, where the
# plans with more stages or blocks keep their counts with the norm.
NORM_REGISTER_CAPS = {(4, 1, 2, 1, 1): 96}
NORM_MAX_M = 8  # above, a program's pre-pass would read as many bytes of x as of weights (M = 16: 256 registers)


def mma_consts(w: Int4Weight, warps: int, m: int, silu_mul: bool = False, pdl: bool = False, blocks: int = 1,
               stages: int = 2, norm: bool = False, residual: bool = False, out_gain: bool = False,
               norm_squares: bool = False) -> dict:
    """The kernel's constexpr arguments for weight `w` and M rows of x, in its parameter order (`silu_mul`: the
    fused [gate; up] epilogue, M <= 8; `pdl`: launched as a programmatic dependent, see `_wait_for_producer`;
    `blocks`: 16-row blocks a program; `stages`: pairs of chunks in flight a warp, 2-4; `norm`: an RMS norm after
    the product, from h's partial sums of squares where `norm_squares`, else from h; `residual`: a residual added
    to the output; `out_gain`: the output's gained copy and its partial sums of squares beside it; neither with
    `silu_mul`)."""
    if stages not in MMA_STAGES:
        raise ValueError(f"the mma kernel keeps {MMA_STAGES} pairs in flight a warp, got {stages}")
    if silu_mul and m > 8:
        raise ValueError(f"the mma kernel's silu * up epilogue takes M <= 8, got M = {m}")
    if silu_mul and (residual or out_gain):
        raise ValueError("the mma kernel's silu * up epilogue adds no residual and writes no gained copy")
    if norm and m > NORM_MAX_M:
        raise ValueError(f"the mma kernel's folded norm takes M <= {NORM_MAX_M}, got M = {m}")
    if norm_squares and not norm:
        raise ValueError("the mma kernel reads partial sums of squares only for a norm")
    per_channel = w.group_size >= w.in_features
    if norm_squares:  # every warp reads a row's squares whole, SQUARES_A_STEP a step (`_warp_factor`)
        per, steps = 1, -(-2 * (w.in_features // SQUARE_BLOCK) // SQUARES_A_STEP)
    else:  # without a norm: one compiled variant
        per, steps = norm_layout(w.in_features, warps) if norm else (1, 1)
    rows = 1 << max(m - 1, 0).bit_length()  # next_pow2(M)
    return dict(GROUP_PAIRS=1 if per_channel else w.group_size // PAIR, PER_CHANNEL=per_channel,
                HAS_ZEROS=w.zeros is not None, WARPS=warps, HALVES=1 if m <= 8 else 2, BLOCKS=blocks,
                SILU_MUL=silu_mul, PDL=pdl, STAGES=stages, NORM_ROWS=rows if norm else 0,
                NORM_PER=per, NORM_STEPS=steps, RESIDUAL=residual, OUT_GAIN=out_gain, NORM_SQUARES=norm_squares,
                SQUARE_ROWS=rows if out_gain else 0)
