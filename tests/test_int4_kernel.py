"""Property tests of the Triton INT4 kernel against the float64 reference.

These run on the CPU under TRITON_INTERPRET=1 in CI, and the same functions run on the GPU
when one is present (the `kernel_device` fixture marks them `gpu` there).

The reference dequantizes the *unpacked integer codes* (sdsie.kernels.reference), so these
tests measure kernel error only, never quantization error.

Tolerance, elementwise, stated once:
    |y - ref| <= eps(dtype) * |ref| + tiny(dtype) + 2**-20 * sqrt(K) * mag,   mag = |x| @ (16 * s_full).T
The first term is the rounding of the output to its dtype (half an ulp, doubled for margin), the
second the same below the normal range (fp16 subnormals are spaced 2**-24);
the second bounds fp32 accumulation, which grows with sqrt(K) for random-signed terms; 16 * s
bounds |(q - z) * s| and the folded form s * (sum q x - z sum x).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given
from hypothesis import strategies as st

from reproductions.kernels.int4_bench import WIDE_PROGRAMS
from sdsie.int4_format import Int4Weight, pack_int4
from sdsie.kernels import (
    Int4KernelConfig,
    candidate_configs,
    int4_gemm,
    int4_matmul,
    int4_matmul_reference,
    kernel_calls,
)
from sdsie.kernels.int4_config import tuned_key, tuned_lookup
from sdsie.kernels.int4_gemm import DEQUANT_MIN_M, ROW_SLICE, _plan_key, _plans_of, int4_dequantize
from sdsie.kernels.int4_triton import CODE_HI, CODE_LO, CODE_MAGIC, _code_pair_f32

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# absolute rounding floor: fp16's subnormal spacing is 2**-24 (bf16/fp32 share fp32's exponent range)
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
# sizes that are 1, primes, and non-multiples of every block size the kernel uses
DIM_SIZES = st.sampled_from([1, 2, 3, 7, 13, 31, 33, 64, 97, 127, 129, 200, 257])
K_SIZES = st.sampled_from([1, 2, 3, 11, 31, 32, 33, 64, 100, 127, 128, 129, 255, 256, 300, 513])
M_SIZES = st.sampled_from([1, 1, 2, 3, 5, 16, 17])
GROUPS = st.sampled_from([32, 64, 128, None])  # None = per output channel


def make_weight(
    n: int, k: int, group: int | None, symmetric: bool, scale_mag: float, device: torch.device,
    gen: torch.Generator, scale_dtype: torch.dtype = torch.float32,
) -> Int4Weight:
    g = k if group is None or group >= k else group
    n_groups = -(-k // g)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n_groups, n, generator=gen) + 0.05) * scale_mag
    zeros = None if symmetric else torch.randint(0, 16, (n_groups, n), generator=gen).float()
    return Int4Weight(
        pack_int4(q).to(device),
        scales.to(scale_dtype).to(device),
        None if zeros is None else zeros.to(scale_dtype).to(device),
        k,
        g,
    )


def tolerance(x: torch.Tensor, w: Int4Weight, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k = w.in_features
    col_group = torch.arange(k, device=w.scales.device) // w.group_size
    s_full = w.scales.double()[col_group].T.to(x.device)  # [N, K]
    mag = x.double().abs() @ (16.0 * s_full).T
    return EPS[dtype] * ref.abs() + TINY[dtype] + 2.0**-20 * math.sqrt(k) * mag


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, w: Int4Weight, unpacked: bool = False) -> None:
    """y within `tolerance` of the reference; `unpacked`: within `dequant_tolerance` (the M >= DEQUANT_MIN_M path
    rounds each weight to x's dtype before the matmul)."""
    ref = int4_matmul_reference(x, w)
    assert y.dtype == x.dtype, f"output dtype {y.dtype} != activation dtype {x.dtype}"
    assert y.shape == ref.shape
    assert torch.isfinite(y).all(), "non-finite output for finite inputs"
    err = (y.double() - ref).abs()
    tol = dequant_tolerance(x, w, ref) if unpacked else tolerance(x, w, ref, x.dtype)
    worst = (err - tol).max().item() if err.numel() else -1.0
    assert worst <= 0, f"max err {err.max().item():.3e} exceeds tolerance (worst excess {worst:.3e})"


@given(
    m=M_SIZES, n=DIM_SIZES, k=K_SIZES, group=GROUPS, symmetric=st.booleans(),
    dtype=st.sampled_from(DTYPES), scale_mag=st.sampled_from([1e-3, 0.05, 1.0, 30.0]),
    seed=st.integers(0, 2**31 - 1),
)
@example(m=1, n=1, k=1, group=None, symmetric=False, dtype=torch.float32, scale_mag=1.0, seed=0)
@example(m=17, n=257, k=13, group=None, symmetric=True, dtype=torch.bfloat16, scale_mag=1.0, seed=1)
def test_kernel_matches_reference(kernel_device, m, n, k, group, symmetric, dtype, scale_mag, seed):
    gen = torch.Generator().manual_seed(seed)
    w = make_weight(n, k, group, symmetric, scale_mag / math.sqrt(k), kernel_device, gen, scale_dtype=dtype)
    x = torch.randn(m, k, generator=gen).to(dtype).to(kernel_device)
    # poison the output: every element must be written by the kernel
    out = torch.full((m, n), float("nan"), dtype=dtype, device=kernel_device)
    y = int4_matmul(x, w, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close_to_reference(y, x, w, unpacked=m >= DEQUANT_MIN_M)


GATHER = Int4KernelConfig(1, 64, 256, split_k=2, num_warps=2, x_tile=False)  # the sweep's x-gather variant
PIPELINED = Int4KernelConfig(1, 64, 256, split_k=2, num_warps=4, num_stages=3)  # word tiles through cp.async


def _interpreter_distinct(configs: tuple[Int4KernelConfig, ...]) -> tuple[Int4KernelConfig, ...]:
    """On a GPU every configuration; under the interpreter, which runs no warps and no software pipeline, one per
    code path: warps and pipeline depth drop out, except the GEMV's register prefetch (stages <= 2) against its
    pipelined loop (>= 3), and the planes kernel's warps, which decide whether it reads the scales as words."""
    if torch.cuda.is_available():
        return configs
    seen: dict[tuple, Int4KernelConfig] = {}
    for c in configs:
        seen.setdefault((c.block_m, c.block_n, c.block_k, c.split_k, c.x_tile, c.swap_ab,
                         c.gemv and c.num_stages <= 2, c.swap_ab and c.num_warps), c)
    return tuple(seen.values())


@pytest.mark.parametrize("config", _interpreter_distinct(candidate_configs() + (GATHER, PIPELINED)), ids=str)
@pytest.mark.parametrize("group", [32, 128, None])
def test_every_candidate_config(kernel_device, config: Int4KernelConfig, group):
    """Every configuration the selector can pick (split-K paths included) is correct (under the interpreter, every
    distinct code path among them)."""
    gen = torch.Generator().manual_seed(hash((config, group)) % 2**31)
    m = 1 if config.block_m == 1 else 5  # GEMV configs also serve small M: see test_gemv_rows
    # bytes path (K % 8 != 0), masked words path, and the unmasked (EVEN) words path: N a multiple of
    # block_n, K a whole number of block_k tiles per split
    shapes = [(37, 300), (130, 1031)]
    if config.gemv or config.swap_ab:  # the words (GEMV) or planes paths, masked and unmasked (EVEN)
        shapes += [(40, 296), (2 * config.block_n, 2 * config.block_k * config.split_k)]
    for n, k in shapes:
        w = make_weight(n, k, group, symmetric=False, scale_mag=0.02, device=kernel_device, gen=gen,
                        scale_dtype=torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(kernel_device)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=kernel_device)
        assert_close_to_reference(int4_matmul(x, w, config=config, out=out), x, w)


ROW_CONFIGS = (Int4KernelConfig(2, 32, 256, split_k=2, num_warps=2), Int4KernelConfig(4, 64, 128, num_warps=4),
               Int4KernelConfig(4, 16, 256, split_k=4, num_warps=2, x_tile=False),
               Int4KernelConfig(2, 32, 128, split_k=2, num_warps=2, num_stages=4))


@pytest.mark.parametrize("config", ROW_CONFIGS, ids=str)
@pytest.mark.parametrize("group", [128, None])
def test_gemv_programs_of_several_rows(kernel_device, config: Int4KernelConfig, group):
    """A GEMV program of 2 or 4 rows shares each weight tile among them: every row is correct for M below, at and
    above the row count (rows past M masked), on the words, bytes and unmasked (EVEN) paths, with split K."""
    gen = torch.Generator().manual_seed(hash((config, group)) % 2**31)
    rows = config.block_m
    cases = [(rows + 1, 37, 300),  # bytes path; the second program has one row, the rest masked
             (1, 40, 296),  # masked words path, one row in a program of several
             (rows, 2 * config.block_n, 2 * config.block_k * config.split_k)]  # unmasked (EVEN) words path
    for m, n, k in cases:
        w = make_weight(n, k, group, symmetric=False, scale_mag=0.02, device=kernel_device, gen=gen,
                        scale_dtype=torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(kernel_device)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=kernel_device)
        assert_close_to_reference(int4_matmul(x, w, config=config, out=out), x, w)


def test_rows_per_program_set_the_grid_and_the_kernel(kernel_device):
    """block_m 2 or 4 acts: the launch runs cdiv(M, rows) GEMV programs with ROWS = rows, not one per row."""
    gen = torch.Generator().manual_seed(11)
    w = make_weight(40, 296, 128, False, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
    x = torch.randn(5, 296, generator=gen).to(torch.bfloat16).to(kernel_device)
    for rows in (1, 2, 4):
        cfg = Int4KernelConfig(rows, 32, 128)
        assert_close_to_reference(int4_matmul(x, w, config=cfg), x, w)
        plan = next(p for key, p in _plans_of(w).items() if key[-1] == cfg)
        assert plan.grid[0] == -(-5 // rows) and plan.consts["ROWS"] == rows



def test_the_gemv_reads_words_only_when_its_k_tile_holds_whole_runs_of_four(kernel_device):
    """The GEMV's word path sums runs of four words (32 codes): a K tile of 16 codes cannot hold one, so that
    configuration reads bytes (PER_COL 2) even though K is a multiple of 8; BK 32 reads words (PER_COL 8). Both
    are correct, with masks (K = 96 is not a multiple of 64) and without."""
    gen = torch.Generator().manual_seed(13)
    for k in (64, 96):
        w = make_weight(24, k, 32, False, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(kernel_device)
        for block_k, per_col in ((16, 2), (32, 8), (64, 8)):
            cfg = Int4KernelConfig(1, 32, block_k)
            assert_close_to_reference(int4_matmul(x, w, config=cfg), x, w)
            plan = next(p for key, p in _plans_of(w).items() if key[-1] == cfg)
            assert plan.consts["PER_COL"] == per_col, (k, block_k)

PLANES = (Int4KernelConfig(16, 32, 128, split_k=2, num_stages=3, swap_ab=True),
          Int4KernelConfig(16, 64, 128, num_warps=4, num_stages=3, swap_ab=True))


@pytest.mark.parametrize("config", PLANES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_planes_serves_any_rows_and_groups_and_falls_back_for_fp32_on_a_gpu(kernel_device, dtype, config):
    """The planes kernel reads the stored bytes, so it serves every row K (odd included, where the pad nibble meets
    x = 0) and every group of >= BLOCK_K codes; a group smaller than the tile clamps BLOCK_K to it. Symmetric and
    asymmetric weights, M = 1 (15 of 16 rows masked), M at and past 16, the masked and unmasked (EVEN) paths, split
    K whose last split overshoots K. fp32 activations on a GPU take the bytes tl.dot kernel (no fp32 register-operand
    dot on sm_90); under the interpreter they run the planes kernel's fp32 dot."""
    gen = torch.Generator().manual_seed(31)
    cases = [(40, 296, 128, False), (37, 301, None, True), (64, 512, 32, False), (64, 512, None, False),
             (2 * config.block_n, 2 * 128 * config.split_k, 128, True), (48, 300, 64, False)]
    for n, k, group, symmetric in cases:
        w = make_weight(n, k, group, symmetric, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
        for m in (1, 16, 17):
            x = torch.randn(m, k, generator=gen).to(dtype).to(kernel_device)
            out = torch.full((m, n), float("nan"), dtype=dtype, device=kernel_device)
            assert_close_to_reference(int4_matmul(x, w, config=config, out=out), x, w)
        plan = next(p for key, p in _plans_of(w).items() if key[-1] == config)
        fallback = dtype == torch.float32 and kernel_device.type == "cuda"
        name = getattr(plan.kernel, "fn", plan.kernel).__name__
        assert name == ("_int4_gemm_kernel" if fallback else "_int4_gemm_planes_kernel"), (n, k, group)
        if not fallback:  # inline PTX on a GPU, Triton ops under the interpreter; EVEN only for whole tiles
            assert plan.consts["ASM"] is (kernel_device.type == "cuda")
            assert plan.consts["EVEN"] is (n % config.block_n == 0 and k % plan.consts["BLOCK_K"] == 0
                                           and plan.ints[-1] * plan.split_k == k)


def _run_planes_ptx(ptx: str, pair: int) -> tuple[int, int]:
    """Execute the planes kernel's inline PTX on one 16-bit operand $2: the four instructions it uses, as PTX
    defines them (prmt.b32 default mode; lop3's immediate is the truth table over 0xF0, 0xCC, 0xAA)."""
    import re

    m32 = 0xFFFFFFFF
    regs = {"$2": pair}

    def val(tok: str) -> int:
        return int(tok, 16) if tok.startswith("0x") else int(tok) if tok.isdigit() else regs[tok]

    for line in ptx.splitlines():
        ins = re.match(r"\s*([a-z0-9.]+)\s+(.*);", line)
        if ins is None or ins.group(1) == ".reg":
            continue
        op, args = ins.group(1), [a.strip() for a in ins.group(2).split(",")]
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "cvt.u32.u16":
            regs[d] = src[0] & 0xFFFF
        elif op == "prmt.b32":
            pool = (src[0] & m32) | ((src[1] & m32) << 32)
            regs[d] = sum(((pool >> (8 * ((src[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "lop3.b32":
            a, b, c, lut = src
            regs[d] = sum(((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i
                          for i in range(32))
        elif op == "shr.u32":
            regs[d] = (src[0] & m32) >> src[1]
        else:
            raise AssertionError(f"the planes PTX uses {op}, which this emulator does not define")
    return regs["$0"], regs["$1"]


@triton.jit
def _code_pairs_probe(w_ptr, out_ptr, magic_lo, magic_hi, BLOCK: tl.constexpr):
    """Each int32 word's eight codes through _code_pair_f32, at the four pair positions: out [BLOCK, 8] fp32."""
    offs = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs)
    c0, c1 = _code_pair_f32(w, 0, magic_lo, magic_hi)
    c2, c3 = _code_pair_f32(w, 8, magic_lo, magic_hi)
    c4, c5 = _code_pair_f32(w, 16, magic_lo, magic_hi)
    c6, c7 = _code_pair_f32(w, 24, magic_lo, magic_hi)
    tl.store(out_ptr + offs * 8 + 0, c0)
    tl.store(out_ptr + offs * 8 + 1, c1)
    tl.store(out_ptr + offs * 8 + 2, c2)
    tl.store(out_ptr + offs * 8 + 3, c3)
    tl.store(out_ptr + offs * 8 + 4, c4)
    tl.store(out_ptr + offs * 8 + 5, c5)
    tl.store(out_ptr + offs * 8 + 6, c6)
    tl.store(out_ptr + offs * 8 + 7, c7)


def test_the_gemv_code_pairs_are_exact_at_every_position(kernel_device):
    """The GEMV turns a word's codes into floats with one shift per pair and one and-or per code (_code_pair_f32):
    every byte value at every pair position of a word, sign bit set included, gives exactly CODE_LO + its low
    nibble and CODE_HI + its high nibble, the offsets the kernel subtracts with sums of x. (A pair left at bits
    16..23 to save its shift fails here: bit 23 is a float's lowest exponent bit.)"""
    b = torch.arange(256, dtype=torch.int64)
    # word i holds byte i at bits 0..7, byte (i + 85) % 256 at 8..15, (i + 170) % 256 at 16..23, 255 - i at 24..31
    bytes_ = torch.stack([b, (b + 85) % 256, (b + 170) % 256, 255 - b], dim=1)  # [256, 4]
    words = (bytes_ << torch.tensor([0, 8, 16, 24])).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(kernel_device)
    out = torch.empty((256, 8), dtype=torch.float32, device=kernel_device)
    _code_pairs_probe[(1,)](words, out, *CODE_MAGIC, BLOCK=256)
    lo, hi = bytes_ & 0xF, bytes_ >> 4  # [256, 4] each
    want = torch.stack([CODE_LO.value + lo, CODE_HI.value + hi], dim=2).reshape(256, 8).float()  # codes 2p, 2p + 1
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_planes_ptx_gives_the_bits_of_the_interpreter_path(dtype):
    """The GPU's planes dequantization is inline PTX, which the interpreter cannot run; CI checks its bits here
    instead: for every pair of bytes (element 0 in the low byte, as Triton packs them), the two results hold the
    low and high nibbles ORed into BIAS's mantissa, element 0 in the low half, as _byte_planes' Triton ops give."""
    from sdsie.kernels.int4_triton import _PLANES_PTX_BF16, _PLANES_PTX_FP16

    ptx, magic = (_PLANES_PTX_FP16.value, 0x6400) if dtype == torch.float16 else (_PLANES_PTX_BF16.value, 0x4300)
    bias = torch.tensor([magic], dtype=torch.int16).view(dtype).item()
    assert bias == (1024.0 if dtype == torch.float16 else 128.0)
    for pair in range(1 << 16):
        b0, b1 = pair & 0xFF, pair >> 8
        lo, hi = _run_planes_ptx(ptx, pair)
        assert lo == ((b0 & 0xF) | magic) | (((b1 & 0xF) | magic) << 16), hex(pair)
        assert hi == ((b0 >> 4) | magic) | (((b1 >> 4) | magic) << 16), hex(pair)
    codes = torch.tensor([magic | q for q in range(16)], dtype=torch.int16).view(dtype).float()
    assert codes.tolist() == [bias + q for q in range(16)]  # exact: BIAS + q


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_planes_reads_x_as_words_only_where_its_pairs_are_aligned(kernel_device, dtype):
    """The planes kernel reads x's (even, odd) pairs as int32 words (X_WORDS) when K is even and x's rows are
    contiguous with an even row stride and 16-byte aligned; an x offset by one element, a transposed view or an
    odd row stride take the two strided gathers, and so does a configuration with x_tile=False. Both are correct
    on the masked and unmasked (EVEN) paths."""
    gen = torch.Generator().manual_seed(37)
    config = PLANES[0]
    for n, k in [(40, 296), (2 * config.block_n, 2 * 128 * config.split_k)]:
        w = make_weight(n, k, 128, False, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
        base = torch.randn(5, k + 2, generator=gen).to(dtype).to(kernel_device)
        cases = {"contiguous": (base[:, :k].contiguous(), True),
                 "one element in": (base[:, 1:k + 1], False),  # data 2 bytes past an aligned address
                 "odd row stride": (torch.randn(5, k + 1, generator=gen).to(dtype).to(kernel_device)[:, :k], False),
                 "transposed": (base[:, :k].t().contiguous().t(), False)}  # stride along K is 5
        for name, (x, words) in cases.items():
            out = torch.full((x.shape[0], n), float("nan"), dtype=dtype, device=kernel_device)
            assert_close_to_reference(int4_matmul(x, w, config=config, out=out), x, w)
            assert _plans_of(w)[_plan_key(x, config)].consts["X_WORDS"] is words, (name, n, k)
        gathers = Int4KernelConfig(**{**asdict(config), "x_tile": False})  # the configuration asks for the gathers
        x = cases["contiguous"][0]
        assert_close_to_reference(int4_matmul(x, w, config=gathers), x, w)
        assert _plans_of(w)[_plan_key(x, gathers)].consts["X_WORDS"] is False


def test_planes_reads_scales_as_words_only_on_wgmma_tiles_whose_threads_hold_under_a_word(kernel_device):
    """SZ_WORDS: the planes kernel reads a group's 16-bit scales and zero-points as int32 words (the scales a word
    per row, the zero-points two rows a word) where a thread's share of the tile's 2-byte values is under the 4
    bytes cp.async takes (BN < 64 x warps), on wgmma tiles (BN >= 64), for N even and 4-byte aligned tensors; fp32
    scales, an odd N, a scales tensor 2 bytes off a word, BN 32 and BN 256 with 4 warps take the 2-byte loads.
    Every case is correct, symmetric and not, masked and EVEN."""
    gen = torch.Generator().manual_seed(41)
    bn64 = Int4KernelConfig(16, 64, 128, split_k=2, num_warps=4, num_stages=3, swap_ab=True)
    bn256 = Int4KernelConfig(16, 256, 128, num_warps=4, num_stages=3, swap_ab=True)
    bn256w8 = Int4KernelConfig(16, 256, 128, num_warps=8, num_stages=3, swap_ab=True)

    def off_a_word(t: torch.Tensor) -> torch.Tensor:  # the same values, stored 2 bytes past a 4-byte boundary
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    for symmetric in (False, True):
        for n, k in [(128, 512), (40, 296)]:
            w = make_weight(n, k, 128, symmetric, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
            fp32 = Int4Weight(w.qweight, w.scales.float(), None if symmetric else w.zeros.float(), k, w.group_size)
            shifted = Int4Weight(w.qweight, off_a_word(w.scales), None if symmetric else off_a_word(w.zeros), k,
                                 w.group_size)
            odd = make_weight(n - 1, k, 128, symmetric, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
            cases = [(w, bn64, True), (w, PLANES[0], False), (w, bn256, False), (w, bn256w8, True),
                     (fp32, bn64, False), (shifted, bn64, False), (odd, bn64, False)]
            for weight, config, pairs in cases:
                x = torch.randn(5, k, generator=gen).to(torch.bfloat16).to(kernel_device)
                out = torch.full((5, weight.out_features), float("nan"), dtype=torch.bfloat16, device=kernel_device)
                assert_close_to_reference(int4_matmul(x, weight, config=config, out=out), x, weight)
                plan = next(p for key, p in _plans_of(weight).items() if key[-1] == config)
                assert plan.consts["SZ_WORDS"] is pairs, (symmetric, n, k, config, weight.scales.dtype)


def test_swap_ab_config_validation():
    """swap_ab runs the planes kernel, whose dots take block_k / 2 >= 16 codes: any tl.dot tile (block_k >= 32)."""
    assert Int4KernelConfig(16, 64, 32, swap_ab=True).block_k == 32
    with pytest.raises(ValueError, match="block_k >= 32"):
        Int4KernelConfig(16, 64, 16, swap_ab=True)
    with pytest.raises(ValueError, match="swap_ab is a tl.dot layout"):
        Int4KernelConfig(4, 64, 128, swap_ab=True)


def test_the_rule_takes_planes_up_to_m16_and_the_launch_runs_it(kernel_device):
    """Without a tuned entry, M <= 2 gets a GEMV configuration, M in 3..16 a planes configuration, M = 17 the bytes
    tl.dot kernel; an automatic call at M = 12 launches the planes kernel and is correct (fp16 x: on sm_90 the mma
    GEMV, bf16 only, takes this shape's bf16 calls at M <= 16)."""
    from sdsie.kernels import select_config

    cpu = torch.device("cpu")
    assert [select_config(m, 4096, 4096, cpu, 128).swap_ab for m in (3, 16, 17)] == [True, True, False]
    assert all(select_config(m, 4096, 4096, cpu, 128).gemv for m in (1, 2))
    gen = torch.Generator().manual_seed(29)
    w = make_weight(64, 256, 128, False, 0.02, kernel_device, gen, scale_dtype=torch.float16)
    x = torch.randn(12, 256, generator=gen).to(torch.float16).to(kernel_device)
    assert_close_to_reference(int4_matmul(x, w), x, w)
    (plan,) = _plans_of(w).values()
    assert getattr(plan.kernel, "fn", plan.kernel).__name__ == "_int4_gemm_planes_kernel"


def test_register_cap_validation_and_launch(kernel_device):
    """max_registers is None or a multiple of 8 in [24, 255]; it reaches Triton's options only on a GPU (maxnreg), and
    a capped configuration computes what the uncapped one does."""
    from sdsie.kernels.int4_gemm import _launch_options

    for bad in (0, 20, 100, 256, 96.0):
        with pytest.raises(ValueError, match="max_registers"):
            Int4KernelConfig(1, 32, 256, max_registers=bad)
    capped = Int4KernelConfig(1, 32, 256, num_stages=3, max_registers=96)
    assert _launch_options(capped, False).get("maxnreg") == (96 if kernel_device.type == "cuda" else None)
    assert "maxnreg" not in _launch_options(Int4KernelConfig(1, 32, 256), False)
    gen = torch.Generator().manual_seed(37)
    w = make_weight(64, 512, 128, False, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16).to(kernel_device)
    assert_close_to_reference(int4_matmul(x, w, config=capped), x, w)


def test_gemv_rows_config_validation():
    assert Int4KernelConfig(2, 32, 256).gemv and Int4KernelConfig(4, 64, 128).gemv
    assert not Int4KernelConfig(16, 64, 128).gemv
    with pytest.raises(ValueError, match="GEMV row count"):
        Int4KernelConfig(8, 64, 128)


@pytest.mark.parametrize("m", [2, 3])
def test_gemv_rows(kernel_device, m):
    """The GEMV kernel takes M > 1 too (one program per row; split K keeps one semaphore per row tile)."""
    gen = torch.Generator().manual_seed(m)
    for cfg in (Int4KernelConfig(1, 32, 256), Int4KernelConfig(1, 16, 256, split_k=4, num_warps=2)):
        w = make_weight(48, 1024, 128, False, 0.02, kernel_device, gen, scale_dtype=torch.bfloat16)
        x = torch.randn(m, 1024, generator=gen).to(torch.bfloat16).to(kernel_device)
        assert_close_to_reference(int4_matmul(x, w, config=cfg), x, w)


def test_split_k_semaphore_resets_between_calls(kernel_device):
    """Back-to-back split-K launches reuse the semaphore buffer: it must come back zeroed."""
    gen = torch.Generator().manual_seed(7)
    cfg = next(c for c in candidate_configs() if c.block_m == 1 and c.split_k > 1)
    w = make_weight(64, 1024, 128, False, 0.02, kernel_device, gen)
    workspaces = []
    for _ in range(3):
        x = torch.randn(1, 1024, generator=gen).to(kernel_device)
        assert_close_to_reference(int4_matmul(x, w, config=cfg), x, w)
        (plan,) = _plans_of(w).values()
        workspaces.append(plan.workspace)
    # the partials' workspace is allocated once per plan (host time per launch), and every call still correct
    assert workspaces[0] is not None and all(ws is workspaces[0] for ws in workspaces)


def test_leading_dims_and_non_contiguous_x(kernel_device):
    gen = torch.Generator().manual_seed(3)
    w = make_weight(29, 96, 32, False, 0.05, kernel_device, gen)
    base = torch.randn(2, 3, 192, generator=gen).to(kernel_device)
    x = base[..., ::2]  # [2, 3, 96], stride 2 along K
    assert not x.is_contiguous()
    y = int4_matmul(x, w)
    assert y.shape == (2, 3, 29)
    assert_close_to_reference(y, x, w)
    xt = torch.randn(96, 4, generator=gen).to(kernel_device).T  # [4, 96], column-major
    assert_close_to_reference(int4_matmul(xt, w), xt, w)


def test_batch_rows_match_single_row_calls(kernel_device):
    """Row i of a batched call equals the single-row call within tolerance (M=1 runs the GEMV
    kernel, M>1 the dot kernel: different summation orders, so not bitwise); two batches of the
    same size that share a row give that row bitwise identically (rows never interact)."""
    gen = torch.Generator().manual_seed(11)
    w = make_weight(70, 257, 64, False, 0.05, kernel_device, gen)
    x = torch.randn(6, 257, generator=gen).to(kernel_device)
    y = int4_matmul(x, w)
    for i in range(x.shape[0]):
        yi = int4_matmul(x[i : i + 1], w)
        ref = int4_matmul_reference(x[i : i + 1], w)
        tol = tolerance(x[i : i + 1], w, ref, torch.float32)
        assert ((y[i : i + 1].double() - yi.double()).abs() <= 2 * tol).all()
    x2 = x.clone()
    x2[1:] = torch.randn(5, 257, generator=gen).to(kernel_device)
    assert torch.equal(int4_matmul(x2, w)[0], y[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_exactly_representable_weights_reproduce_float_matmul(kernel_device, dtype):
    """The seed's self-test: weights exactly representable in INT4 give the float matmul, to
    the dtype's rounding."""
    gen = torch.Generator().manual_seed(5)
    n, k, g = 48, 160, 32
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen).float()
    s = 2.0 ** torch.randint(-6, -2, (k // g, n), generator=gen).float()  # powers of two: exact
    w_float = (q.double() - z.double()[torch.arange(k) // g].T) * s.double()[torch.arange(k) // g].T  # [N, K]
    w = Int4Weight(pack_int4(q).to(kernel_device), s.to(kernel_device), z.to(kernel_device), k, g)
    x = torch.randn(3, k, generator=gen).to(dtype).to(kernel_device)
    y = int4_matmul(x, w)
    exact = x.double() @ w_float.to(kernel_device).T
    assert torch.allclose(w.dequantize().cpu(), w_float), "weights were not exactly representable"
    bound = EPS[dtype] * exact.abs() + 2.0**-20 * math.sqrt(k) * (x.double().abs() @ w_float.abs().to(kernel_device).T)
    assert ((y.double() - exact).abs() <= bound).all()


def test_partial_last_group(kernel_device):
    """K not a multiple of the group size: the last group is partial (the documented format)."""
    gen = torch.Generator().manual_seed(9)
    w = make_weight(40, 100, 32, False, 0.05, kernel_device, gen)  # groups of 32, 32, 32, 4
    assert w.n_groups == 4
    for m in (1, 3):
        x = torch.randn(m, 100, generator=gen).to(kernel_device)
        assert_close_to_reference(int4_matmul(x, w), x, w)


def test_empty_input(kernel_device):
    gen = torch.Generator().manual_seed(0)
    w = make_weight(8, 64, 32, False, 0.1, kernel_device, gen)
    before = kernel_calls()
    y = int4_matmul(torch.empty(0, 64, device=kernel_device), w)
    assert y.shape == (0, 8)
    y3 = int4_matmul(torch.empty(2, 0, 64, device=kernel_device), w)
    assert y3.shape == (2, 0, 8)
    assert kernel_calls() == before, "an empty input must not launch the kernel"


def test_kernel_calls_counts_launches(kernel_device):
    gen = torch.Generator().manual_seed(0)
    w = make_weight(8, 64, 32, False, 0.1, kernel_device, gen)
    before = kernel_calls()
    int4_matmul(torch.randn(1, 64).to(kernel_device), w)
    int4_matmul(torch.randn(4, 64).to(kernel_device), w)
    assert kernel_calls() == before + 2


def test_cpu_tensors_outside_the_interpreter_get_a_clear_error(monkeypatch):
    """On a GPU host (kernels compiled, no interpreter) Triton refuses CPU pointers with a message naming no remedy;
    int4_matmul says what to do. The compiled kernel is stood in for by one that refuses as Triton does."""
    from sdsie.kernels import int4_gemm

    real = int4_gemm._int4_gemv_kernel

    class Refusing:
        fn = getattr(real, "fn", real)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
            return launch

    monkeypatch.setattr(int4_gemm, "_int4_gemv_kernel", Refusing())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = make_weight(8, 64, 32, False, 0.1, torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="CPU tensors run only under the Triton interpreter"):
        int4_matmul(torch.randn(1, 64), w)


def test_invalid_inputs_raise_clear_errors(kernel_device):
    gen = torch.Generator().manual_seed(0)
    w = make_weight(8, 64, 32, False, 0.1, kernel_device, gen)
    with pytest.raises(ValueError, match="K=63"):
        int4_matmul(torch.randn(1, 63, device=kernel_device), w)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        int4_matmul(torch.randn(1, 64, dtype=torch.float64, device=kernel_device), w)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        int4_matmul(torch.ones(1, 64, dtype=torch.int32, device=kernel_device), w)
    with pytest.raises(ValueError, match="Int4Weight"):
        int4_matmul(torch.randn(1, 64, device=kernel_device), torch.zeros(8, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        Int4Weight(w.qweight.to(torch.int8), w.scales, w.zeros, 64, 32)
    with pytest.raises(ValueError, match=r"ceil\(K/2\)"):
        Int4Weight(w.qweight[:, :31], w.scales, w.zeros, 64, 32)
    with pytest.raises(ValueError, match="group_size 48"):
        Int4Weight(w.qweight, w.scales, w.zeros, 64, 48)
    with pytest.raises(ValueError, match="out must be"):
        int4_matmul(torch.randn(2, 64, device=kernel_device), w, out=torch.empty(2, 9, device=kernel_device))
    with pytest.raises(ValueError, match="power of two"):
        Int4KernelConfig(1, 24, 256)
    with pytest.raises(ValueError, match="x_tile must be a bool"):
        Int4KernelConfig(1, 32, 256, x_tile=1)
    with pytest.raises(ValueError, match="swap_ab must be a bool"):
        Int4KernelConfig(16, 32, 256, swap_ab=1)
    with pytest.raises(ValueError, match="swap_ab is a tl.dot layout"):
        Int4KernelConfig(2, 32, 256, swap_ab=True)
    with pytest.raises(ValueError, match="M=17 is outside the tuned buckets"):
        tuned_key(17, 8, 64, 32)
    with pytest.raises(ValueError, match="M=0 is outside"):
        tuned_key(0, 8, 64, 32)
    assert [tuned_key(m, 8, 64, 32).split("|")[0] for m in (1, 2, 3, 5, 16)] == ["m1", "m2", "m4", "m8", "m16"]


def test_tuned_lookup_falls_back_to_the_nearest_larger_tuned_bucket_of_the_same_shape_and_kernel_family():
    """An M bucket the sweep did not tune uses the configuration tuned for more rows on that shape (correct
    for fewer rows), never one tuned for fewer rows or for another shape or group, and never across the GEMV (M <= 2)
    and planes (M in 3..16) families; none left: None. Without lending, M's own bucket only."""
    m1, m2, m4, m16, other = (Int4KernelConfig(1, 64, 256, split_k=s) for s in (1, 2, 4, 8, 16))
    table = {"m1|8|64|32": m1, "m4|8|64|32": m4, "m16|8|64|32": m16, "m16|16|64|32": other, "m16|8|64|pc": other}
    assert tuned_lookup(table, 1, 8, 64, 32) is m1
    assert tuned_lookup(table, 2, 8, 64, 32) is None  # m2 missing: the rule's GEMV, not the m4 planes entry
    assert tuned_lookup({**table, "m2|8|64|32": m2}, 1, 8, 64, 32) is m1
    assert tuned_lookup({"m2|8|64|32": m2}, 1, 8, 64, 32) is m2  # m1 missing -> m2, the same family
    assert tuned_lookup(table, 3, 8, 64, 32) is m4
    assert tuned_lookup(table, 8, 8, 64, 32) is m16  # m8 missing -> m16
    assert tuned_lookup(table, 16, 8, 64, 32) is m16
    assert tuned_lookup(table, 8, 8, 64, 64) is other  # group >= K is "pc"
    assert tuned_lookup(table, 8, 32, 64, 32) is None  # no entry for this shape in any bucket >= m8
    assert tuned_lookup(table, 8, 8, 64, 32, lend=False) is None  # m8 missing, and no lending
    assert tuned_lookup(table, 16, 8, 64, 32, lend=False) is m16
    assert tuned_lookup({"m1|8|64|32": m1}, 2, 8, 64, 32) is None


def test_dispatch_on_a_gpu_takes_the_fallback_bucket(monkeypatch):
    """select_config's CUDA branch, for x the tensor-core GEMV does not take, uses tuned_lookup: M = 8 with only an
    M = 16 entry runs that entry, and a shape with no entry falls to the rule; the source says which. (The table and
    device name are stand-ins; no GPU needed.)"""
    import sdsie.kernels.int4_config as ig

    m16 = Int4KernelConfig(16, 128, 64, split_k=2, num_warps=8)  # in no heuristic list
    table = {"m16|4096|4096|128": m16}
    monkeypatch.setattr(ig, "_tuned_table", lambda: {"Fake GPU": table})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(ig, "sm_count", lambda device: 132)
    ig._select_config.cache_clear()
    try:
        # allow_mma=False: the choice for x the tensor-core GEMV does not take (tests/test_int4_mma.py has the rest)
        assert ig._select_config(8, 4096, 4096, "cuda", 0, 128, False) == (m16, "table")
        chosen = ig._select_config(8, 1024, 4096, "cuda", 0, 128, False)  # no entry for this shape
        table.clear()
        ig._select_config.cache_clear()
        assert chosen == ig._select_config(8, 1024, 4096, "cuda", 0, 128, False) == (
            ig.rule_config(8, 1024, 4096, 128, 132), "rule")
        assert ig._select_config(8, 4096, 4096, "cuda", 0, 128, False)[0] != m16  # and without the m16 entry, too
    finally:
        ig._select_config.cache_clear()


def test_launch_plans_follow_specialization_and_die_with_the_weight(kernel_device):
    """One plan per (M, x dtype/strides/alignment, config) on a weight; a misaligned x or another M gets
    its own plan (Triton specializes on them), results stay exact, and plans leave with the weight."""
    import copy
    import gc

    from sdsie.kernels import int4_gemm

    gen = torch.Generator().manual_seed(11)
    w = make_weight(40, 256, 64, False, 0.05, kernel_device, gen)
    buf = torch.randn(3 * 256 + 1, generator=gen).to(kernel_device)
    aligned, shifted = buf[:256].view(1, 256), buf[1:257].view(1, 256)  # 4-byte offset: not 16-aligned
    for x in (aligned, aligned, shifted, buf[:768].view(3, 256)):
        assert_close_to_reference(int4_matmul(x, w), x, w)
    plans = int4_gemm._PLANS[id(w)]
    assert len(plans) == 3, f"expected plans for M=1 aligned, M=1 misaligned and M=3, got {list(plans)}"
    assert {key[0] for key in plans} == {1, 3} and {key[4] for key in plans} == {True, False}
    w2 = copy.deepcopy(w)  # plans are not part of the weight: a copy starts without any
    assert id(w2) not in int4_gemm._PLANS
    assert_close_to_reference(int4_matmul(aligned, w2), aligned, w2)
    key = id(w)
    del w, plans
    gc.collect()
    assert key not in int4_gemm._PLANS


def test_launch_plans_follow_reassigned_weight_tensors(kernel_device):
    """Int4Weight is mutable: a plan built for its old tensors must not be reused after qweight, scales or
    zeros are reassigned (a stale plan would silently multiply by the old weights)."""
    gen = torch.Generator().manual_seed(12)
    w = make_weight(40, 256, 64, False, 0.05, kernel_device, gen)
    other = make_weight(40, 256, 64, False, 0.05, kernel_device, gen)
    x = torch.randn(1, 256, generator=gen).to(kernel_device)
    assert_close_to_reference(int4_matmul(x, w), x, w)  # builds the plan
    for field in ("qweight", "scales", "zeros"):
        setattr(w, field, getattr(other, field))
        assert_close_to_reference(int4_matmul(x, w), x, w)
    w.zeros = None  # now symmetric: the zero-point pointer changes meaning
    assert_close_to_reference(int4_matmul(x, w), x, w)


BY_HAND = Int4KernelConfig(1, 64, 256, split_k=2, num_warps=2)  # x tile, next weight tile prefetched in registers


@pytest.mark.parametrize(("const", "expected"), [
    ("X_TILE", {BY_HAND: True, GATHER: False}),  # x as one tile split in registers, or eight gathers
    ("STAGES", {BY_HAND: 2, PIPELINED: 3}),  # >= 3: weight loads left to Triton's cp.async pipeliner
])
def test_config_choices_reach_the_gemv(kernel_device, const, expected):
    """Int4KernelConfig.x_tile and .num_stages set the GEMV's X_TILE and STAGES constexprs, and every choice gives
    the reference's result."""
    from sdsie.kernels import int4_gemm

    gen = torch.Generator().manual_seed(17)
    w = make_weight(128, 1024, 128, False, 0.05, kernel_device, gen)
    x = torch.randn(1, 1024, generator=gen).to(kernel_device)
    for cfg in expected:
        assert_close_to_reference(int4_matmul(x, w, config=cfg), x, w)
    assert {key[-1]: plan.consts[const] for key, plan in int4_gemm._PLANS[id(w)].items()} == expected


class _RecordingKernel:
    """Stands in for a compiled Triton kernel on CPU: the first launch runs the interpreter and returns a fake
    CompiledKernel whose `run` (the launcher `int4_matmul` calls from then on) binds the flat argument tuple it
    gets to the kernel's parameters by position and runs the interpreter again. So the GPU-only fast path, which
    hands Triton's launcher one positional tuple per call, is checked for argument order and content."""

    def __init__(self, kernel):
        self.kernel, self.fn, self.fast_launches = kernel, kernel.fn, 0

    def __getitem__(self, grid):
        def first_launch(*args, num_warps=None, num_stages=None, **consts):
            self.kernel[grid](*args, **consts)
            return self

        return first_launch

    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, gx, gy, gz, stream, function, packed_metadata, meta, enter, exit, *values):
        from sdsie.kernels.int4_gemm import _constexpr_names

        names = _constexpr_names(self.kernel)
        n_runtime = len(values) - len(names)
        self.kernel[(gx, gy, gz)](*values[:n_runtime], **dict(zip(names, values[n_runtime:], strict=True)))
        self.fast_launches += 1


@pytest.mark.parametrize("config", [Int4KernelConfig(1, 32, 128, split_k=2, num_stages=3),
                                    Int4KernelConfig(2, 32, 128), Int4KernelConfig(16, 32, 64, split_k=2),
                                    Int4KernelConfig(16, 32, 128, split_k=2, swap_ab=True),
                                    Int4KernelConfig(16, 32, 128, swap_ab=True)], ids=str)
def test_the_compiled_fast_path_passes_every_argument_in_order(kernel_device, monkeypatch, config):
    if kernel_device.type == "cuda":  # it replaces the GPU driver with a stub; on a GPU every other test runs the path
        pytest.skip("a CPU stand-in for the compiled launch path: on a GPU every kernel test takes the real one")
    import types

    import triton

    from sdsie.kernels import int4_gemm

    gen = torch.Generator().manual_seed(19)
    w = make_weight(64, 512, 128, False, 0.05, kernel_device, gen)
    recorders = {name: _RecordingKernel(getattr(int4_gemm, name))
                 for name in ("_int4_gemv_kernel", "_int4_gemm_kernel", "_int4_gemm_planes_kernel")}
    for name, rec in recorders.items():
        monkeypatch.setattr(int4_gemm, name, rec)
    monkeypatch.setattr(int4_gemm, "_interpreting", lambda: False)  # keep the "compiled" kernel, as on a GPU
    # no GPU driver here: the fast path only asks the active driver for the current stream
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(get_current_stream=lambda index: 0))
    m = 3 if config.block_m > 1 else 1
    for trial in range(3):  # the first call compiles (interprets); the others take the fast path
        x = torch.randn(m, 512, generator=gen).to(kernel_device)
        out = torch.full((m, 64), float("nan"), device=kernel_device) if trial == 2 else None
        assert_close_to_reference(int4_matmul(x, w, config=config, out=out), x, w)
    kernel = recorders["_int4_gemv_kernel" if config.gemv else
                       "_int4_gemm_planes_kernel" if config.swap_ab else "_int4_gemm_kernel"]
    assert kernel.fast_launches == 2


# K tiles of several groups, split across warps (sweep candidates of reproductions/kernels/int4_bench.py)
WIDE_K = (Int4KernelConfig(1, 64, 512, split_k=2, num_warps=4, num_stages=4),
          Int4KernelConfig(1, 32, 1024, split_k=1, num_warps=4, num_stages=3),
          Int4KernelConfig(1, 128, 512, split_k=2, num_warps=8, num_stages=4))
# and the wide programs: 8-16 warps along one program's K range, 64-128 codes a thread. The interpreter takes
# 1-2 s a case, so CPU runs take three of the eight (one K tile, a split tile, several tiles a split); a GPU all.
_WIDE_CPU = ((4, 4096, 1, 8), (8, 2048, 2, 8), (16, 1024, 4, 4))
assert set(_WIDE_CPU) <= set(WIDE_PROGRAMS), "the CPU sample must come from the sweep's family"
WIDE_K += tuple(Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=w, num_stages=1) for bn, bk, sk, w in WIDE_PROGRAMS
                if torch.cuda.is_available() or (bn, bk, sk, w) in _WIDE_CPU)


@pytest.mark.parametrize("config", WIDE_K, ids=str)
@pytest.mark.parametrize("group", [32, 128, None])
def test_k_tiles_of_several_groups_split_across_warps(kernel_device, config: Int4KernelConfig, group):
    gen = torch.Generator().manual_seed(hash((config, group)) % 2**31)
    for n, k in ((40, 296), (2 * config.block_n, 2 * config.block_k * config.split_k)):  # masked, unmasked words
        w = make_weight(n, k, group, symmetric=False, scale_mag=0.02, device=kernel_device, gen=gen,
                        scale_dtype=torch.bfloat16)
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(kernel_device)
        assert_close_to_reference(int4_matmul(x, w, config=config), x, w)


def test_sdsie_tuned_configs_points_the_selector_at_another_table(tmp_path, monkeypatch):
    """$SDSIE_TUNED_CONFIGS replaces the shipped table (gpu_run.sh runs its tests and suite on a table its sweep just
    wrote); a path that is not a file is an error naming the variable, not a silent fall back to the shipped one."""
    from sdsie.kernels import int4_config

    cfg = Int4KernelConfig(1, 64, 256, split_k=4, num_warps=2)
    table = tmp_path / "tuned_configs.json"
    table.write_text(json.dumps({"Some GPU": {tuned_key(1, 4096, 4096, 128): asdict(cfg)}}))
    int4_config._tuned_table.cache_clear()
    try:
        monkeypatch.setenv("SDSIE_TUNED_CONFIGS", str(table))
        assert int4_config.tuned_path() == table
        assert int4_config._tuned_table() == {"Some GPU": {tuned_key(1, 4096, 4096, 128): cfg}}
        int4_config._tuned_table.cache_clear()
        monkeypatch.setenv("SDSIE_TUNED_CONFIGS", str(tmp_path / "missing.json"))
        with pytest.raises(FileNotFoundError, match="SDSIE_TUNED_CONFIGS"):
            int4_config._tuned_table()
        monkeypatch.delenv("SDSIE_TUNED_CONFIGS")
        assert int4_config.tuned_path() == int4_config.SHIPPED_TUNED_PATH
    finally:
        int4_config._tuned_table.cache_clear()  # the next caller reads the shipped table again


def dequant_tolerance(x: torch.Tensor, w: Int4Weight, ref: torch.Tensor) -> torch.Tensor:
    """The prompt path's bound: each weight rounded once to x's dtype (one ulp: the interpreter's cast truncates),
    then the matmul's own rounding, as `tolerance` states it."""
    wd = w.dequantize(torch.float64).to(x.device)
    return 2 * EPS[x.dtype] * (x.double().abs() @ wd.abs().T) + tolerance(x, w, ref, x.dtype)


@given(m=st.sampled_from([DEQUANT_MIN_M, DEQUANT_MIN_M + 1, 64, 100]), n=DIM_SIZES, k=K_SIZES, group=GROUPS,
       symmetric=st.booleans(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
@example(m=DEQUANT_MIN_M, n=33, k=255, group=32, symmetric=False, dtype=torch.bfloat16, seed=0)  # odd K: a pad column
def test_prompt_rows_unpack_the_weight_and_match_the_reference(kernel_device, m, n, k, group, symmetric, dtype, seed):
    """M >= DEQUANT_MIN_M unpacks the weight (one launch counted) and multiplies through torch."""
    gen = torch.Generator().manual_seed(seed)
    w = make_weight(n, k, group, symmetric, 1.0 / math.sqrt(k), kernel_device, gen, scale_dtype=dtype)
    x = torch.randn(m, k, generator=gen).to(dtype).to(kernel_device)
    calls = kernel_calls()
    out = torch.full((m, n), float("nan"), dtype=dtype, device=kernel_device)
    y = int4_matmul(x, w, out=out)
    assert kernel_calls() == calls + 1 and y.data_ptr() == out.data_ptr()
    ref = int4_matmul_reference(x, w)
    assert torch.isfinite(y).all()
    excess = ((y.double() - ref).abs() - dequant_tolerance(x, w, ref)).max().item()
    assert excess <= 0, f"worst excess over the tolerance {excess:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "group", "symmetric"), [(64, 32, True), (255, None, False), (256, 128, False)])
def test_dequantize_gives_each_weight_rounded_once(kernel_device, dtype, k, group, symmetric):
    """int4_dequantize equals (code - zero) * scale within one ulp of the dtype, for every row slice."""
    gen = torch.Generator().manual_seed(k)
    w = make_weight(37, k, group, symmetric, 0.3, kernel_device, gen, scale_dtype=dtype)
    ref = w.dequantize(torch.float64)
    for rows in (slice(None), slice(5, 30), slice(36, 37), slice(10, 10)):
        got = int4_dequantize(w, dtype, rows)
        assert got.shape == ref[rows].shape and got.dtype == dtype
        assert ((got.double() - ref[rows]).abs() <= 2 * EPS[dtype] * ref[rows].abs() + TINY[dtype]).all()
    with pytest.raises(ValueError, match="contiguous slice"):
        int4_dequantize(w, dtype, slice(0, 10, 2))
    with pytest.raises(ValueError, match="dtype"):
        int4_dequantize(w, torch.int8)


def test_the_unpack_path_takes_m_from_dequant_min_m_and_only_without_a_named_config(kernel_device, monkeypatch):
    """M = DEQUANT_MIN_M - 1 runs a kernel configuration, M = DEQUANT_MIN_M unpacks, and a named config always runs
    that configuration."""
    unpacked: list[int] = []
    real = int4_gemm._dequant_matmul
    monkeypatch.setattr(int4_gemm, "_dequant_matmul", lambda x2, w, y: (unpacked.append(x2.shape[0]), real(x2, w, y)))
    gen = torch.Generator().manual_seed(5)
    w = make_weight(40, 64, 32, False, 0.1, kernel_device, gen)
    for m in (DEQUANT_MIN_M - 1, DEQUANT_MIN_M):
        int4_matmul(torch.randn(m, 64, generator=gen).to(kernel_device), w)
    int4_matmul(torch.randn(DEQUANT_MIN_M, 64, generator=gen).to(kernel_device), w, Int4KernelConfig(16, 32, 64))
    assert unpacked == [DEQUANT_MIN_M]


@pytest.mark.parametrize("m", [ROW_SLICE + 1, 2 * ROW_SLICE, DEQUANT_MIN_M - 1])
def test_rows_between_the_small_m_kernels_and_the_unpack_path_run_row_slice_at_a_time(kernel_device, monkeypatch, m):
    """M = ROW_SLICE + 1 .. DEQUANT_MIN_M - 1 is ROW_SLICE-row calls of the small-M choice (one launch each, no
    unpack): the same bits as those calls made one by one, within the kernels' tolerance of the reference."""
    monkeypatch.setattr(int4_gemm, "_dequant_matmul", lambda *a: pytest.fail("the unpack path ran"))
    gen = torch.Generator().manual_seed(m)
    w = make_weight(40, 64, 32, False, 0.1, kernel_device, gen)
    x = torch.randn(m, 64, generator=gen).to(kernel_device)
    calls = kernel_calls()
    y = int4_matmul(x, w, out=torch.full((m, 40), float("nan"), device=kernel_device))
    assert kernel_calls() == calls + -(-m // ROW_SLICE)
    one_by_one = torch.cat([int4_matmul(x[r:r + ROW_SLICE], w) for r in range(0, m, ROW_SLICE)])
    assert torch.equal(y, one_by_one)
    assert_close_to_reference(y, x, w)


def test_prompt_rows_unpack_a_large_weight_in_slices(kernel_device, monkeypatch):
    """A weight over DEQUANT_CHUNK weights is unpacked a slice of rows at a time; every output column is written."""
    monkeypatch.setattr(int4_gemm, "DEQUANT_CHUNK", 300 * 64)  # slices of 256 rows at K = 64: N = 600 takes 3
    gen = torch.Generator().manual_seed(3)
    w = make_weight(600, 64, 32, False, 0.1, kernel_device, gen)
    x = torch.randn(DEQUANT_MIN_M, 64, generator=gen).to(kernel_device)
    y = int4_matmul(x, w, out=torch.full((DEQUANT_MIN_M, 600), float("nan"), device=kernel_device))
    ref = int4_matmul_reference(x, w)
    assert ((y.double() - ref).abs() <= dequant_tolerance(x, w, ref)).all()
