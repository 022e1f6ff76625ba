"""The fragment-order tensor-core GEMV (`sdsie.kernels.int4_mma`).

On the CPU: the packed words decode, lane by lane as the PTX ISA lays out m16n8k16's fragments, to the reference
product (`emulate_fragments`, the kernel's CPU twin); the choice of configuration; the kernel compiles for sm_90
(Triton's bundled ptxas, no GPU). On a GPU (`gpu`): the kernel itself against the float64 reference, through
`int4_matmul`, and under CUDA-graph capture.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sdsie.int4_format import Int4Weight
from sdsie.kernels import (
    Int4KernelConfig,
    compose_epilogue,
    int4_matmul,
    int4_matmul_reference,
    int4_silu_mul,
    norm_stream_width,
    row_squares,
)
from sdsie.kernels.int4_config import (
    MMA_BLOCK_CONFIGS,
    MMA_CONFIGS,
    mma_blocks,
    mma_config,
    mma_stages,
    select_config_with_source,
)
from sdsie.kernels.int4_gemm import _FUSED_PLANS, _kept_for, _plans_of
from sdsie.kernels.int4_mma import (
    NORM_MAX_M,
    NORM_REGISTER_CAPS,
    _int4_mma_gemv_kernel,
    emulate_fragments,
    gate_up_order,
    mma_consts,
    pack_fragments,
)
from tests.test_int4_codegen import compiled_offline
from tests.test_int4_kernel import EPS, TINY, assert_close_to_reference, make_weight, tolerance

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("group", [128, 256, None])
@pytest.mark.parametrize("symmetric", [False, True])
def test_fragment_words_decode_to_the_reference_product(group, symmetric):
    """Every code lands where the kernel's A registers read it, and x's words where its B registers read them:
    the emulated mma over the packed words gives the reference product (fp64, so any misplaced code shows)."""
    gen = torch.Generator().manual_seed(hash((group, symmetric)) % 2**31)
    for m, n, k in ((1, 16, 128), (3, 48, 256), (8, 32, 384)):
        w = make_weight(n, k, group, symmetric, 0.02, torch.device("cpu"), gen, scale_dtype=torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        y = emulate_fragments(x, pack_fragments(w.qweight, k), w)
        ref = int4_matmul_reference(x.double(), w)
        torch.testing.assert_close(y.double(), ref.double(), rtol=1e-6, atol=1e-6)


def silu_mul_reference(x: torch.Tensor, w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up in float64 from the reference product of a fused [gate; up] weight, and each element's
    tolerance: the sums' (`tolerance`) carried through silu(g) * u (|silu'| <= 1.1), plus the output's rounding."""
    ref = int4_matmul_reference(x, w).double()
    tol = tolerance(x, w, ref, x.dtype)
    half = w.out_features // 2
    g, u, tg, tu = ref[:, :half], ref[:, half:], tol[:, :half], tol[:, half:]
    out = torch.nn.functional.silu(g) * u
    return out, 1.1 * u.abs() * tg + torch.nn.functional.silu(g).abs() * tu + EPS[x.dtype] * out.abs() + TINY[x.dtype]


@pytest.mark.parametrize("group, symmetric", [(128, False), (None, True)])
def test_gate_up_order_puts_one_channels_gate_and_up_in_one_lane(group, symmetric):
    """Packed in `gate_up_order`, row g of block b is gate channel 8b + g and row g + 8 its up: the emulated sums
    (CPU twin) of those rows, taken as the epilogue takes them, give silu(gate) * up of the weight as stored."""
    gen = torch.Generator().manual_seed(11)
    n, k = 64, 256
    w = make_weight(n, k, group, symmetric, 0.02, torch.device("cpu"), gen, scale_dtype=torch.bfloat16)
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    order = gate_up_order(n)
    assert sorted(order.tolist()) == list(range(n))
    zeros = None if w.zeros is None else w.zeros[:, order].contiguous()
    wo = Int4Weight(w.qweight[order], w.scales[:, order].contiguous(), zeros, k, w.group_size)
    sums = emulate_fragments(x, pack_fragments(wo.qweight, k), wo).double().view(3, n // 16, 2, 8)
    y = (torch.nn.functional.silu(sums[:, :, 0]) * sums[:, :, 1]).reshape(3, n // 2)
    ref, _ = silu_mul_reference(x, w)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        gate_up_order(40)


def test_silu_mul_off_the_mma_path_is_the_product_then_torchs_silu(kernel_device):
    """fp16 x (the mma kernel takes bf16 only), on the GPU as under the interpreter."""
    gen = torch.Generator().manual_seed(12)
    w = make_weight(64, 256, 128, False, 0.02, kernel_device, gen, scale_dtype=torch.float16)
    for m in (1, 5, 20):
        x = torch.randn(m, 256, generator=gen).to(torch.float16).to(kernel_device)
        gate, up = int4_matmul(x, w).split(32, dim=-1)
        assert torch.equal(int4_silu_mul(x, w), torch.nn.functional.silu(gate) * up)
    assert int4_silu_mul(x.view(4, 5, 256), w).shape == (4, 5, 32)
    with pytest.raises(ValueError, match="mma configuration needs M <= 8"):
        int4_silu_mul(x[:1], w, config=MMA_CONFIGS[4])
    odd = make_weight(33, 256, 128, False, 0.02, kernel_device, gen)
    with pytest.raises(ValueError, match="even N"):
        int4_silu_mul(x, odd)


def test_pack_fragments_in_row_slices_equals_one_piece():
    gen = torch.Generator().manual_seed(3)
    w = make_weight(80, 256, 128, False, 0.02, torch.device("cpu"), gen)
    assert torch.equal(pack_fragments(w.qweight, 256, rows_at_a_time=16), pack_fragments(w.qweight, 256))
    assert pack_fragments(w.qweight, 256).shape == (5, 4, 32, 4)


@pytest.mark.parametrize("n, k", [(24, 128), (32, 96)])
def test_pack_fragments_refuses_shapes_it_cannot_tile(n, k):
    w = make_weight(n, k, None, False, 0.02, torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0"):
        pack_fragments(w.qweight, k)


def test_mma_config_follows_its_rule_on_programs_warps_and_lm_heads():
    assert mma_config(1, 4096, 4096, 128) == MMA_CONFIGS[4]
    assert mma_config(2, 4096, 14336, 128) == MMA_CONFIGS[8]  # K >= 2N, K >= 4096, 256 programs fit at 2 a SM
    assert mma_config(1, 5120, 13824, 128) == mma_blocks(4, 1, 4)  # 320 programs of 8 warps overflow 264 slots
    assert mma_config(4, 1024, 3072, 128) == MMA_CONFIGS[4]  # K < 4096: 8 warps get too little K each
    assert mma_config(1, 3584, 4096, 4096) == MMA_CONFIGS[4]  # per channel
    assert mma_config(8, 4096, 4096, 128) == MMA_CONFIGS[4]
    # programs at M <= 2: N / 16 at least half the SMs at M = 1, a quarter at M = 2
    assert mma_config(1, 1024, 4096, 128) is None  # 64 programs < 66
    assert mma_config(1, 1056, 4096, 128) == MMA_CONFIGS[8]
    assert mma_config(1, 1056, 4096, 128, sms=144) is None  # the threshold scales with the GPU's SMs
    # an H100's threshold at M = 1: 1.5 programs an SM (198 on 132 SMs); M = 2 keeps a quarter
    assert mma_config(1, 3152, 8192, 128, m1_programs_an_sm=1.5) is None  # 197 programs
    assert mma_config(1, 3168, 8192, 128, m1_programs_an_sm=1.5) == MMA_CONFIGS[8]  # 198
    assert mma_config(2, 2560, 2048, 128, m1_programs_an_sm=1.5) == MMA_CONFIGS[4]
    assert mma_config(2, 1024, 4096, 128) == MMA_CONFIGS[8]
    assert mma_config(2, 512, 3584, 128) is None  # 32 programs < 33
    assert mma_config(4, 256, 1536, 128) == MMA_CONFIGS[4]  # every N from three rows
    # LM heads: K >= 3072 at any M, a shorter K never
    assert mma_config(1, 128256, 4096, 128) == MMA_CONFIGS[4]
    assert mma_config(1, 128256, 3072, 128) == MMA_CONFIGS[4]
    assert mma_config(2, 256000, 2304, 128) is None
    assert mma_config(4, 151936, 1536, 128) is None
    # M = 9-16: 4 warps where the N / 16 programs fit in one wave at 4 an SM, else the planes kernel
    assert mma_config(9, 4096, 4096, 128) == mma_config(16, 8448, 3584, 4096) == MMA_CONFIGS[4]  # 528 programs
    assert mma_config(16, 8464, 3584, 128) is None  # 529
    assert mma_config(16, 8464, 3584, 128, sms=144) == MMA_CONFIGS[4]
    assert mma_config(12, 4096, 14336, 128) == MMA_CONFIGS[4]  # no 8 warps past M = 8
    # 4 pairs in flight a warp where 2-3 programs of 4 warps share an SM (264 < N / 16 <= 396), at M <= 8
    four = mma_blocks(4, 1, 4)
    assert mma_config(1, 6144, 4096, 128) == mma_config(8, 4608, 3584, 4096) == four
    assert mma_config(1, 4240, 4096, 128) == mma_config(2, 6336, 4096, 128) == four  # 265 and 396 programs
    assert mma_config(1, 4224, 4096, 128) == mma_config(4, 6352, 4096, 128) == MMA_CONFIGS[4]  # 264 and 397
    assert mma_config(1, 4240, 4096, 128, sms=144) == MMA_CONFIGS[4]  # the band scales with the GPU's SMs
    assert mma_config(12, 6144, 4096, 128) == MMA_CONFIGS[4]  # M = 9-16: 4 pairs leave 2 programs an SM
    assert mma_stages(1, 6144, 8) == 2  # 8 warps: 2 programs an SM already
    for m, n, k, g in ((17, 4096, 4096, 128), (1, 4096, 4096, 64), (1, 4096, 4032, 4032), (1, 4104, 4096, 128)):
        assert mma_config(m, n, k, g) is None, (m, n, k, g)


def test_on_sm90_the_table_comes_first_then_mma_config_then_the_rule(monkeypatch):
    """The CUDA branch of the choice, on a stand-in device (no GPU needed): a shape the table holds runs its entry;
    an mma entry serves bf16 x on sm_90 only; other shapes take `mma_config`'s rule on sm_90, else the rule. A
    larger M bucket's entry serves a smaller M only where the mma rule declines (here: fp16 x)."""
    import sdsie.kernels.int4_config as ig

    gemv = Int4KernelConfig(1, 32, 1024, num_stages=3)
    planes = Int4KernelConfig(16, 128, 128, split_k=4, num_stages=4, swap_ab=True)
    table = {"m1|4096|4096|128": gemv, "m1|4096|14336|128": MMA_CONFIGS[4], "m16|4608|3584|128": planes}
    capability = {"major": 9}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (capability["major"], 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(ig, "_tuned_table", lambda: {"Fake GPU": table})
    monkeypatch.setattr(ig, "sm_count", lambda device: 132)
    ig._select_config.cache_clear()
    try:
        assert ig._select_config(1, 4096, 4096, "cuda", 0, 128) == (gemv, "table")  # measured beats mma's rule
        assert ig._select_config(1, 4096, 14336, "cuda", 0, 128) == (MMA_CONFIGS[4], "table")
        assert ig._select_config(1, 4096, 14336, "cuda", 0, 128, False)[1] == "rule"  # not bf16 x: no mma entry
        assert ig._select_config(1, 3584, 14336, "cuda", 0, 128) == (MMA_CONFIGS[8], "mma")  # no entry
        assert ig._select_config(12, 4096, 4096, "cuda", 0, 128) == (MMA_CONFIGS[4], "mma")  # one wave: 256 programs
        assert ig._select_config(12, 14336, 4096, "cuda", 0, 128)[1] == "rule"  # 896 programs: planes
        assert ig._select_config(1, 1024, 4096, "cuda", 0, 128)[1] == "rule"
        assert ig._select_config(1, 3584, 14336, "cuda", 0, 128, False)[1] == "rule"
        assert ig._select_config(4, 4608, 3584, "cuda", 0, 128) == (mma_blocks(4, 1, 4), "mma")  # no m4 entry
        assert ig._select_config(4, 4608, 3584, "cuda", 0, 128, False) == (planes, "table")  # lent by m16
        assert ig._select_config(16, 4608, 3584, "cuda", 0, 128) == (planes, "table")
        capability["major"] = 8
        ig._select_config.cache_clear()
        assert ig._select_config(1, 4096, 14336, "cuda", 0, 128)[1] == "rule"
        assert ig._select_config(1, 3584, 14336, "cuda", 0, 128)[1] == "rule"
    finally:
        ig._select_config.cache_clear()


def test_an_h100_leaves_m1_shapes_of_fewer_than_1_5_programs_an_sm_to_the_cuda_core_gemv(monkeypatch):
    """`MMA_M1_PROGRAMS_AN_SM` by the GPU's name: on an H100 the CUDA-core GEMV is faster at M = 1 below 1.5 programs
    an SM (N / 16 = 96-192), so the choice takes the rule there; any other sm_90 GPU keeps half the SMs (the H200's
    threshold). M = 2 and larger grids are unchanged."""
    import sdsie.kernels.int4_config as ig

    name = {"gpu": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name["gpu"])
    monkeypatch.setattr(ig, "_tuned_table", lambda: {})
    monkeypatch.setattr(ig, "sm_count", lambda device: 132)
    monkeypatch.setattr(ig, "_local_table", lambda: {})
    ig._select_config.cache_clear()
    try:
        assert ig.MMA_M1_PROGRAMS_AN_SM[name["gpu"]] == 1.5
        assert ig._select_config(1, 2560, 2048, "cuda", 0, 128) == (ig.rule_config(1, 2560, 2048, 128, 132), "rule")
        assert ig._select_config(1, 3072, 8192, "cuda", 0, 8192)[1] == "rule"  # 192 programs, per channel
        assert ig._select_config(1, 3584, 4096, "cuda", 0, 128) == (MMA_CONFIGS[4], "mma")  # 224 programs
        assert ig._select_config(2, 2560, 2048, "cuda", 0, 128) == (MMA_CONFIGS[4], "mma")
        name["gpu"] = "NVIDIA H200"
        ig._select_config.cache_clear()
        assert ig._select_config(1, 2560, 2048, "cuda", 0, 128) == (MMA_CONFIGS[4], "mma")
    finally:
        ig._select_config.cache_clear()


def test_off_gpu_the_choice_is_never_mma():
    cfg, source = select_config_with_source(1, 4096, 4096, torch.device("cpu"), 128)
    assert not cfg.mma and source in ("table", "rule")


def test_an_mma_configuration_is_one_tile_of_one_two_or_four_row_blocks():
    with pytest.raises(ValueError, match="block_m 8, block_n one of"):
        Int4KernelConfig(1, 16, 128, mma=True)
    with pytest.raises(ValueError, match=r"block_n one of \(16, 32, 64\)"):
        Int4KernelConfig(8, 48, 128, mma=True)
    with pytest.raises(ValueError, match="4 or 8 warps"):
        Int4KernelConfig(8, 16, 128, num_warps=2, mma=True)
    assert mma_blocks(4) is MMA_CONFIGS[4] and mma_blocks(8, 4) == Int4KernelConfig(8, 64, 128, num_warps=8, mma=True)
    assert len(MMA_BLOCK_CONFIGS) == 4
    with pytest.raises(ValueError, match="3 row blocks"):
        mma_blocks(4, 3)
    with pytest.raises(ValueError, match="2 warps and 1 row blocks"):
        mma_blocks(2)


def test_an_mma_configuration_keeps_two_to_four_pairs_in_flight_a_warp():
    """num_stages names the pairs of chunks a warp has in flight (2, 3 or 4), in its name and its launch's STAGES;
    other counts are refused when the configuration is made."""
    from sdsie.kernels import int4_gemm
    from sdsie.kernels.int4_tune import config_name

    assert mma_blocks(4, 1, 2) is MMA_CONFIGS[4]
    three = mma_blocks(8, 1, 3)
    assert three == Int4KernelConfig(8, 16, 128, num_warps=8, num_stages=3, mma=True)
    assert config_name(three) == "int4[8,16,128,s1,w8,p3,mma]"
    assert mma_blocks(4, 2, 4).block_n == 32 and mma_blocks(4, 2, 4).num_stages == 4
    for stages in (1, 5):
        with pytest.raises(ValueError, match=r"\(2, 3, 4\) pairs in flight a warp"):
            Int4KernelConfig(8, 16, 128, num_stages=stages, mma=True)
    w = make_weight(32, 256, 128, False, 0.02, torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"\(2, 3, 4\) pairs in flight a warp, got 5"):
        mma_consts(w, 4, 1, stages=5)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int4_gemm, "mma_supported", lambda x, w: True)
        mp.setattr(int4_gemm, "_fragments", lambda w, gate_up: (w.qweight, w.scales, w.zeros))
        assert int4_gemm._plan(x, w, three).consts["STAGES"] == 3
        assert int4_gemm._plan(x, w, MMA_CONFIGS[4]).consts["STAGES"] == 2


def test_a_plan_of_several_row_blocks_launches_one_program_per_blocks(monkeypatch):
    """The grid covers N / 16 row blocks, `blocks` a program, the last program's spare blocks included (N = 80:
    five blocks, three programs of two); the kernel learns the count as BLOCKS. (Planned with the GPU-only checks
    stubbed: a CPU cannot run the kernel, only plan it.)"""
    from sdsie.kernels import int4_gemm

    w = make_weight(80, 256, 128, False, 0.02, torch.device("cpu"), torch.Generator().manual_seed(0))
    monkeypatch.setattr(int4_gemm, "mma_supported", lambda x, w: True)
    monkeypatch.setattr(int4_gemm, "_fragments", lambda w, gate_up: (w.qweight, w.scales, w.zeros))
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    for blocks, programs in ((1, 5), (2, 3), (4, 2)):
        plan = int4_gemm._plan(x, w, mma_blocks(4, blocks))
        assert plan.grid[0] == programs and plan.consts["BLOCKS"] == blocks and plan.consts["HALVES"] == 2


VARIANTS = [(pc, hz, 1, False) for pc, hz in itertools.product([False, True], [False, True])] + [
    (False, True, 2, False), (False, True, 1, True)]


def inspect_offline(args: str) -> dict:
    """`inspect_mma(<args>)` compiled for sm_90 offline (the test run interprets kernels)."""
    return compiled_offline("from reproductions.kernels.inspect_ptx import inspect_mma", f"inspect_mma({args})",
                            "the mma GEMV")


@pytest.mark.parametrize("per_channel, has_zeros, halves, silu_mul", VARIANTS)
def test_the_kernel_compiles_for_sm90_to_eight_mmas_a_pair(per_channel, has_zeros, halves, silu_mul):
    """Offline (no GPU; a subprocess, as the test run interprets kernels): every variant compiles; the two-pair loop
    issues 16 HMMA per half of B's columns (4 per 64-code chunk, 2 chunks a pair), loads each chunk's weights and x's
    words in 16-byte loads, spills nothing, and stays near 2.1-2.4 SASS a code (the CUDA-core GEMV: 3.4,
    docs/kernel-log.md)."""
    r = inspect_offline(f"{per_channel}, {has_zeros}, 4, {halves}, {silu_mul}")
    assert r["sass_ops"].get("HMMA.16816.F32.BF16") == 16 * halves, r
    assert r["sass_ops"].get("LDG.E.128") == 4 + 8 * halves, r  # per pair: 2 weight chunks, 4 of x's words a half
    assert r["local_mem"] == 0
    assert r["sass_loop_per_code"] < 2.6, r
    assert r["registers"] <= (128 if halves == 2 else 96), r  # 5 programs of 4 warps an SM at one half, 4 at two


@pytest.mark.parametrize("halves, blocks", [(1, 4), (2, 2)])
def test_row_blocks_share_x_loads_and_multiply_the_mmas(halves, blocks):
    """Offline sm_90: with `blocks` row blocks a program, the loop issues blocks x the HMMA and weight loads of one
    block but x's loads once (4 of 16 bytes a pair and half, shared by the blocks), spills nothing, and stays under
    the one-block loop's bound of 2.6 SASS a code (the loop covers blocks x 128 codes a thread)."""
    r = inspect_offline(f"halves={halves}, blocks={blocks}")
    assert r["sass_ops"].get("HMMA.16816.F32.BF16") == 16 * halves * blocks, r
    assert r["sass_ops"].get("LDG.E.128") == 4 * blocks + 8 * halves, r
    assert r["spill_instructions"] == 0 and r["local_mem"] == 0, r
    assert r["sass_loop_per_code"] / blocks < 2.6, r


@pytest.mark.parametrize("halves, stages, most_registers", [(1, 3, 128), (1, 4, 168), (2, 3, 184)])
def test_more_stages_keep_more_pairs_in_flight_for_registers(halves, stages, most_registers):
    """Offline sm_90: with `stages` pairs in flight a warp the loop covers that many pairs, with their HMMAs and
    16-byte loads (weights: 2 a pair; x: 4 a pair and half), spills nothing, keeps the two-stage loop's 2.1-2.4 SASS
    a code, and holds at most `most_registers` a thread (M <= 8: 128 fits 4 programs of 4 warps an SM, 168 fits 3;
    M = 9-16 at 3 stages: 2)."""
    r = inspect_offline(f"halves={halves}, stages={stages}")
    assert r["sass_ops"].get("HMMA.16816.F32.BF16") == 8 * halves * stages, r
    assert r["sass_ops"].get("LDG.E.128") == (2 + 4 * halves) * stages, r
    assert r["spill_instructions"] == 0 and r["local_mem"] == 0, r
    assert r["sass_loop_per_code"] < 2.6, r
    assert r["registers"] <= most_registers, r


def test_a_register_cap_fits_a_sixth_program_an_sm_at_the_cost_of_two_spills():
    """Offline sm_90: uncapped, the kernel holds 96 registers a thread at M <= 8 (5 programs of 4 warps an SM);
    capped at 80 (`Int4KernelConfig.max_registers`) it fits 6, with 2 spill instructions and the same loop (its HMMA
    and 16-byte loads). (At M = 9-16 it holds 128, 4 programs: the compile test above pins that.)"""
    free = inspect_offline("halves=1")
    capped = inspect_offline("halves=1, max_registers=80")
    assert capped["registers"] <= 80 < free["registers"], (free["registers"], capped["registers"])
    assert 65536 // (capped["registers"] * 128) > 65536 // (free["registers"] * 128)  # programs of 4 warps an SM
    assert free["spill_instructions"] == 0 and capped["spill_instructions"] <= 2
    for op in ("HMMA.16816.F32.BF16", "LDG.E.128"):
        assert capped["sass_ops"][op] == free["sass_ops"][op], op


def test_an_mma_configuration_takes_a_register_cap_and_launches_with_it(monkeypatch):
    """`max_registers` on an mma configuration is validated as on the others and reaches the launch's options
    (maxnreg), so a sweep or the tuned cache can name it. (The plan is built with the GPU-only checks stubbed: a CPU
    cannot run the kernel, only plan it.)"""
    import dataclasses

    from sdsie.kernels import int4_gemm
    from sdsie.kernels.int4_tune import config_name

    capped = dataclasses.replace(MMA_CONFIGS[4], max_registers=80)
    assert capped.mma and capped != MMA_CONFIGS[4] and config_name(capped) == "int4[8,16,128,s1,w4,r80,mma]"
    with pytest.raises(ValueError, match="max_registers"):
        dataclasses.replace(MMA_CONFIGS[4], max_registers=81)
    w = make_weight(32, 256, 128, False, 0.02, torch.device("cpu"), torch.Generator().manual_seed(0))
    monkeypatch.setattr(int4_gemm, "mma_supported", lambda x, w: True)
    monkeypatch.setattr(int4_gemm, "_fragments", lambda w, gate_up: (w.qweight, w.scales, w.zeros))
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert int4_gemm._plan(x, w, capped).options["maxnreg"] == 80
    assert "maxnreg" not in int4_gemm._plan(x, w, MMA_CONFIGS[4]).options


def test_the_norm_and_residual_epilogues_leave_the_loop_and_the_cap_keeps_the_registers():
    """Offline sm_90, M = 1: the norm's pre-pass and the residual, gained-copy and squares epilogue leave the loop's
    HMMA and 16-byte loads as they are; uncapped, the norm over h grows the four-warp two-stage kernel past its 96
    registers (5 programs an SM to 4), and `NORM_REGISTER_CAPS`' cap holds it at 96 without a spill, the loop within
    2.2 SASS a code; the norm over the producer's partial sums of squares keeps 96 uncapped, and as each warp sums
    them itself, the plain launch's barriers (the norm over h adds a cross-warp sum's)."""
    cap = NORM_REGISTER_CAPS[(4, 1, 2, 1, 1)]
    free, normed, capped, residual, squares = compiled_offline(
        "from reproductions.kernels.inspect_ptx import inspect_mma",
        f"[inspect_mma(), inspect_mma(norm_rows=1), inspect_mma(norm_rows=1, max_registers={cap}), "
        "inspect_mma(residual=True, out_gain=True), inspect_mma(norm_rows=1, norm_squares=True)]", "the mma GEMV")
    for r in (normed, capped, residual, squares):
        for op in ("HMMA.16816.F32.BF16", "LDG.E.128"):
            assert r["sass_ops"][op] == free["sass_ops"][op], (op, r)
    assert free["registers"] == cap < normed["registers"]
    assert capped["registers"] <= cap and capped["spill_instructions"] == 0 and capped["local_mem"] == 0
    assert capped["sass_loop_per_code"] < 2.2 and residual["registers"] == free["registers"]
    assert squares["registers"] == free["registers"] and squares["spill_instructions"] == 0
    assert squares["barriers"] == free["barriers"] < normed["barriers"]


def test_the_loop_issues_the_next_loads_after_its_last_mma_and_chains_eight():
    """Offline sm_90, the plain launch with PDL at 2 and 4 pairs in flight and at M = 9-16: ptxas interleaves the
    pairs' mma chains and issues every 16-byte load of the next iteration after this one's last HMMA, so a warp's
    iteration is its loads' latency and then its longest chain of dependent mmas, 8 (a pair's two chunks of four
    k16 blocks into one accumulator): the chain is time a warp has nothing in flight (docs/kernel-log.md)."""
    two, four, sixteen = compiled_offline(
        "from reproductions.kernels.inspect_ptx import inspect_mma",
        "[inspect_mma(pdl=True), inspect_mma(pdl=True, stages=4), inspect_mma(pdl=True, halves=2)]", "the mma GEMV")
    for r in (two, four, sixteen):
        assert r["loop_loads_before_last_mma"] == 0 and r["sass_ops"]["LDG.E.128"] > 0, r
        assert r["hmma_chain"] == 8, r


def test_the_chain_counter_follows_accumulators_and_forgets_overwritten_ones():
    """`hmma_chain` on hand-written SASS: two interleaved chains of 3 and 2, a chain broken by a move into its
    accumulator, and a zero-started mma (RZ) counting 1."""
    from reproductions.kernels.inspect_ptx import hmma_chain

    sass = ["HMMA.16816.F32.BF16 R8, R0, R4, RZ", "HMMA.16816.F32.BF16 R12, R0, R4, RZ",
            "HMMA.16816.F32.BF16 R8, R0, R6, R8", "HMMA.16816.F32.BF16 R12, R0, R6, R12",
            "HMMA.16816.F32.BF16 R8, R2, R6, R8", "MOV R12, R3", "HMMA.16816.F32.BF16 R12, R2, R6, R12"]
    assert hmma_chain(sass) == 3
    assert hmma_chain(sass[:2]) == 1 and hmma_chain([]) == 0
    assert hmma_chain(sass[1::2] + ["HMMA.16816.F32.BF16 R12, R2, R6, R12"]) == 2  # the move broke R12's chain
    assert hmma_chain(sass[1:4:2] + ["HMMA.16816.F32.BF16 R12, R2, R6, R12"]) == 3


def test_the_residual_and_gain_are_read_before_the_loop_at_m_8_or_less():
    """Offline sm_90 SASS of the residual and gained-copy epilogue, launched as a programmatic dependent: at M <= 8
    the gain's loads come before griddepcontrol.wait (ACQBULK), the residual's after it and before the loop, and no
    load follows the first store, so a program's end waits for no load; the registers stay those of the launch
    without the epilogue. At M 9-16 (two halves) they are read at the end, where holding them would cost registers."""
    plain, epilogue, plain16, epilogue16 = compiled_offline(
        "from reproductions.kernels.inspect_ptx import inspect_mma",
        "[inspect_mma(pdl=True), inspect_mma(pdl=True, residual=True, out_gain=True), inspect_mma(pdl=True, halves=2), "
        "inspect_mma(pdl=True, halves=2, residual=True, out_gain=True)]", "the mma GEMV")
    order = epilogue["memory_order"]
    first_store = next(i for i, op in enumerate(order) if op.startswith("STG"))
    assert not any(op.startswith("LDG") for op in order[first_store:]), order
    wait = order.index("ACQBULK")
    assert order[:wait].count("LDG.E.U16") > plain["memory_order"][:plain["memory_order"].index("ACQBULK")].count(
        "LDG.E.U16")  # the gain's
    assert epilogue["registers"] == plain["registers"] and epilogue["spill_instructions"] == 0
    order16 = epilogue16["memory_order"]
    assert any(op.startswith("LDG") for op in order16[next(i for i, op in enumerate(order16) if op.startswith("STG")):])
    assert epilogue16["registers"] <= plain16["registers"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the mma kernel needs an sm_90+ GPU")
@pytest.mark.parametrize("m, cap", [(1, 80), (4, 80), (8, 72), (16, 128)])
def test_a_register_cap_changes_no_bit_of_the_result(m, cap):
    """A cap changes where ptxas keeps values, not the arithmetic: capped and uncapped give the same bits, and both
    are within the kernel's tolerance of the float64 reference."""
    import dataclasses

    gen = torch.Generator().manual_seed(m)
    w = make_weight(4096, 3584, 128, False, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
    x = torch.randn(m, 3584, generator=gen).to(torch.bfloat16).cuda()
    free = int4_matmul(x, w, config=MMA_CONFIGS[4])
    capped = int4_matmul(x, w, config=dataclasses.replace(MMA_CONFIGS[4], max_registers=cap))
    assert torch.equal(free, capped)
    assert_close_to_reference(capped, x, w)


@pytest.mark.parametrize("pdl", [False, True])
def test_a_programmatic_launch_asks_for_the_weights_before_it_waits_for_x(pdl):
    """Offline sm_90 SASS: launched as a programmatic dependent, the kernel issues the first two pairs' weight loads
    (4 of 16 bytes), then griddepcontrol.wait (ACQBULK), then x's 8 loads, then launch_dependents (PREEXIT), once
    each; the loop is the plain kernel's. Without PDL neither instruction is there."""
    r = inspect_offline(f"pdl={pdl}")
    order = r["load_order"]
    if pdl:
        assert order.count("ACQBULK") == 1 and order.count("PREEXIT") == 1, order
        wait, release = order.index("ACQBULK"), order.index("PREEXIT")
        assert order[:wait] == ["LDG.E.128"] * 4, order  # the weights of pairs a and b
        assert order[wait + 1:release] == ["LDG.E.128"] * 8, order  # x's words of both pairs
    else:
        assert "ACQBULK" not in order and "PREEXIT" not in order, order
    assert r["sass_ops"].get("HMMA.16816.F32.BF16") == 16 and r["local_mem"] == 0, r


def test_programmatic_launch_is_on_by_default_for_cuda_only_and_remakes_plans(monkeypatch):
    """The switch: on by default; never for a CPU tensor or under the interpreter; a plan is keyed on it, so a
    change takes effect on the next call, with the same output (on a CPU machine the interpreter's plans, which
    ignore it, show the key)."""
    from sdsie.kernels import device

    assert device.programmatic_launch()
    assert not device.pdl_on(torch.device("cpu"))
    if torch.cuda.is_available():
        where, dtype = torch.device("cuda"), torch.bfloat16
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        where, dtype = torch.device("cpu"), torch.float32
    gen = torch.Generator().manual_seed(0)
    w = make_weight(32, 256, 128, False, 0.02, where, gen)
    x = torch.randn(1, 256, generator=gen).to(dtype).to(where)
    try:
        y_on = int4_matmul(x, w)
        device.set_programmatic_launch(False)
        assert not device.programmatic_launch()
        y_off = int4_matmul(x, w)
    finally:
        device.set_programmatic_launch(True)
    assert torch.equal(y_on, y_off)
    assert {key[5] for key in _plans_of(w)} == {True, False}


def test_pdl_is_decided_by_the_switch_the_device_and_its_capability(monkeypatch):
    """pdl_on: the switch on, a CUDA device of sm_90 or newer, not interpreted; anything else launches plainly. A
    switch value that is not a bool is refused, not read as truthy."""
    from sdsie.kernels import device

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for major, expected in ((9, True), (10, True), (8, False)):
        device._sm90.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, major=major: (major, 0))
        assert device.pdl_on(cuda) is expected, major
    device._sm90.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    try:
        device.set_programmatic_launch(False)
        assert not device.pdl_on(cuda)
        device.set_programmatic_launch(True)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not device.pdl_on(cuda)
        with pytest.raises(TypeError, match="True or False"):
            device.set_programmatic_launch("false")
        assert device.programmatic_launch()
    finally:
        device.set_programmatic_launch(True)
        device._sm90.cache_clear()


gpu90 = pytest.mark.skipif(not HAS_SM90, reason="the mma kernel needs an sm_90+ GPU")


@pytest.mark.gpu
@gpu90
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("group", [128, 256, None])
@pytest.mark.parametrize("symmetric", [False, True])
def test_the_kernel_matches_the_reference(warps, group, symmetric):
    """M of 1-16 (one and two halves of B's columns), K both a multiple and not of 128 x warps (a warp's spare pairs
    add nothing), per channel and grouped, through int4_matmul with the configuration named; every output element
    written."""
    gen = torch.Generator().manual_seed(hash((warps, group, symmetric)) % 2**31)
    cfg = MMA_CONFIGS[warps]
    for m, n, k in ((1, 16, 128), (3, 64, 640), (5, 256, 4096), (8, 48, 1536), (2, 4096, 3584), (9, 32, 256),
                    (13, 4096, 1024), (16, 80, 3584)):
        w = make_weight(n, k, group, symmetric, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert_close_to_reference(int4_matmul(x, w, config=cfg, out=out), x, w)


def assert_same_bits(cfg: Int4KernelConfig, base: Int4KernelConfig, cases, group, symmetric, gen) -> None:
    """For each (M, N, K) of `cases`: `cfg` gives the bits of `base` on a random weight (every output element
    written), within the kernel's tolerance of the float64 reference, and through the silu * up epilogue where
    M <= 8 and N / 2 holds whole row blocks."""
    for m, n, k in cases:
        w = make_weight(n, k, group, symmetric, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = int4_matmul(x, w, config=cfg, out=out)
        assert torch.equal(y, int4_matmul(x, w, config=base)), (m, n, k)
        assert_close_to_reference(y, x, w)
        if m <= 8 and n % 32 == 0:
            assert torch.equal(int4_silu_mul(x, w, config=cfg), int4_silu_mul(x, w, config=base)), (m, n, k)


@pytest.mark.gpu
@gpu90
@pytest.mark.parametrize("warps, blocks", [(4, 2), (8, 2), (4, 4), (8, 4)])
@pytest.mark.parametrize("group, symmetric", [(128, False), (256, True), (None, False)])
def test_several_row_blocks_a_program_give_the_bits_of_one(warps, blocks, group, symmetric):
    """Row blocks that share a program's x registers compute each block as a program of one does: the same bits,
    for N a multiple of the blocks and not (the last program's spare blocks store nothing), at M = 1-16 (4 blocks:
    M <= 8), and through the silu * up epilogue; within the kernel's tolerance of the float64 reference."""
    gen = torch.Generator().manual_seed(hash((warps, blocks, group, symmetric)) % 2**31)
    cases = ((1, 16, 128), (3, 80, 640), (5, 4096, 3584), (8, 208, 1536), (2, 28672, 512), (9, 48, 256),
             (13, 4096, 1024), (16, 14336, 4096), (16, 80, 3584))
    assert_same_bits(mma_blocks(warps, blocks), MMA_CONFIGS[warps], [c for c in cases if blocks < 4 or c[0] <= 8],
                     group, symmetric, gen)


@pytest.mark.gpu
@gpu90
@pytest.mark.parametrize("warps, stages", [(4, 3), (4, 4), (8, 3), (8, 4)])
@pytest.mark.parametrize("group, symmetric", [(128, False), (256, True), (None, False)])
def test_more_pairs_in_flight_give_the_bits_of_two(warps, stages, group, symmetric):
    """3 or 4 pairs in flight a warp add each warp's pairs in the order 2 do, and a spare pair (past K) adds 0:
    the same bits at M = 1-16, K a multiple of stages x warps pairs and not, and through the silu * up epilogue;
    within the kernel's tolerance of the float64 reference."""
    gen = torch.Generator().manual_seed(hash((warps, stages, group, symmetric)) % 2**31)
    cases = ((1, 16, 128), (3, 80, 640), (5, 4096, 3584), (8, 208, 1536), (1, 4096, 14336), (9, 48, 256),
             (13, 4096, 1024), (16, 512, 4096), (16, 80, 3584))
    assert_same_bits(mma_blocks(warps, 1, stages), MMA_CONFIGS[warps], cases, group, symmetric, gen)


@pytest.mark.gpu
@gpu90
def test_bf16_x_takes_the_mma_kernel_and_other_x_do_not():
    gen = torch.Generator().manual_seed(5)
    w = make_weight(4096, 1024, 128, False, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
    for dtype, mma in ((torch.bfloat16, True), (torch.float16, False), (torch.float32, False)):
        x = torch.randn(1, 1024, generator=gen).to(dtype).cuda()
        assert_close_to_reference(int4_matmul(x, w), x, w)
        plan = next(p for key, p in _plans_of(w).items() if key[1] == dtype)
        assert (plan.kernel is _int4_mma_gemv_kernel) is mma, dtype
        if mma:
            assert plan.consts == mma_consts(w, 4, 1, pdl=True)  # programmatic launch: on by default
            assert plan.options["launch_pdl"] is True


@pytest.mark.gpu
@gpu90
def test_graph_replay_after_a_first_call_and_a_clear_error_before_one():
    gen = torch.Generator().manual_seed(9)
    w = make_weight(4096, 512, 128, False, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
    x = torch.randn(2, 512, generator=gen).to(torch.bfloat16).cuda()
    eager = int4_matmul(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int4_matmul(x, w)
    x.copy_(torch.randn(2, 512, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(y, x, w)
    assert not torch.equal(y, eager)
    fresh = Int4Weight(w.qweight.clone(), w.scales, w.zeros, w.in_features, w.group_size)
    with pytest.raises(RuntimeError, match="run the call once before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            int4_matmul(x, fresh)


@pytest.mark.gpu
@gpu90
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("group, symmetric", [(128, False), (256, True), (None, False)])
def test_the_silu_mul_epilogue_matches_the_reference(warps, group, symmetric):
    """silu(gate) * up from one launch, M of 1-8, against the float64 product of the weight as stored; then the
    automatic choice takes the epilogue for bf16 and composes for fp16 and at M = 9-16, and a graph replays it."""
    gen = torch.Generator().manual_seed(hash((warps, group, symmetric)) % 2**31)
    for m, n, k in ((1, 32, 128), (3, 96, 640), (5, 512, 4096), (8, 8192, 1024), (2, 28672, 512)):
        w = make_weight(n, k, group, symmetric, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        y = int4_silu_mul(x, w, config=MMA_CONFIGS[warps])
        ref, tol = silu_mul_reference(x, w)
        assert y.shape == (m, n // 2) and torch.isfinite(y).all()
        worst = ((y.double() - ref).abs() - tol).max().item()
        assert worst <= 0, (m, n, k, worst)
    x12 = torch.randn(12, k, generator=gen).to(torch.bfloat16).cuda()  # M = 9-16: the mma GEMV, then torch
    gate, up = int4_matmul(x12, w, config=MMA_CONFIGS[warps]).split(n // 2, dim=-1)
    assert torch.equal(int4_silu_mul(x12, w, config=MMA_CONFIGS[warps]), torch.nn.functional.silu(gate) * up)
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16).cuda()
    w = make_weight(8192, 512, 128, False, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
    y = int4_silu_mul(x, w)
    gate, up = int4_matmul(x.half(), w).split(4096, dim=-1)
    assert torch.equal(int4_silu_mul(x.half(), w), torch.nn.functional.silu(gate) * up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = int4_silu_mul(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
    ref, tol = silu_mul_reference(x, w)
    assert ((y.double() - ref).abs() - tol).max().item() <= 0


def epilogue_reference(x: torch.Tensor, w: Int4Weight, norm_eps: float | None, residual: torch.Tensor | None,
                       norm_source: torch.Tensor | None = None,
                       squares: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (x @ W.T) * rsqrt(mean(h^2) + eps) (+ residual), h = norm_source else x, and each element's
    tolerance: the product's (`tolerance`) scaled with it, fp32's rsqrt (and, where the norm reads h's partial sums
    of squares as bf16 pairs, `squares`, their 2^-16 of the sum: 2^-17 of rs), the rounding of the scaled product
    and, with a residual, of the sum."""
    ref = int4_matmul_reference(x, w).double()
    tol = tolerance(x, w, ref, x.dtype)
    if norm_eps is not None:
        h = x if norm_source is None else norm_source
        rs = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + norm_eps)  # [M, 1]
        ref, tol = ref * rs, tol * rs + (2.0**-20 + (2.0**-17 if squares else 0.0)) * (ref * rs).abs()
    tol = tol + EPS[x.dtype] * ref.abs() + TINY[x.dtype]
    if residual is not None:
        ref = ref + residual.double()
        tol = tol + EPS[x.dtype] * ref.abs()
    return ref, tol


EPILOGUE_CASES = ((1, 16, 128), (1, 6144, 4096), (2, 4096, 3584), (3, 80, 640), (4, 28672, 512), (5, 256, 4096),
                  (8, 48, 1536), (9, 32, 256), (13, 4096, 1024), (16, 80, 3584))


@pytest.mark.gpu
@gpu90
@pytest.mark.parametrize("warps, blocks, stages", [(4, 1, 2), (8, 1, 2), (4, 2, 2), (4, 1, 4), (8, 1, 3)])
@pytest.mark.parametrize("group, symmetric", [(128, False), (256, True), (None, False)])
def test_the_norm_and_residual_epilogues_match_the_reference(warps, blocks, stages, group, symmetric):
    """An RMS norm after the product (of x's rows, or of a stream h whose gained copy x is, from h or from h's
    partial sums of squares; M <= 8, above composed), a residual added (read at a row stride of 2N), the output's
    gained copy and partial sums of squares beside it, and their mixes, from one mma launch at M = 1-16 (two row
    blocks a program: M <= 8), K a multiple of the pre-pass's step and not (3584, 640): within the float64
    reference's tolerance, every output element written, the squares' pairs summing to torch's `row_squares` of
    the output; the residual alone gives the bits of the product plus the residual in torch."""
    gen = torch.Generator().manual_seed(hash((warps, blocks, stages, group, symmetric)) % 2**31)
    cfg = mma_blocks(warps, blocks, stages)
    for m, n, k in EPILOGUE_CASES:
        if blocks > 1 and m > 8:
            continue
        w = make_weight(n, k, group, symmetric, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
        x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16).cuda()
        stream = compose_epilogue(x, x, out_gain=(torch.rand(k, generator=gen) + 0.5).cuda())  # [h, h * g, squares]
        h, hg, sq = stream[:, :k], stream[:, k:2 * k], stream[:, 2 * k:]  # views, as a fused layer reads them
        r = torch.randn(m, 2 * n, generator=gen).to(torch.bfloat16).cuda()[:, :n]  # row stride 2N
        gain = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16).cuda()
        for norm_eps, source, squares, residual, out_gain in (
                (1e-5, None, None, None, None), (None, None, None, r, None), (1e-6, h, None, r, None),
                (1e-5, h, None, None, None), (1e-5, h, sq, None, None), (1e-6, h, sq, r, gain),
                (None, None, None, r, gain)):
            xin = x if source is None else hg
            y = int4_matmul(xin, w, config=cfg, norm_eps=norm_eps, norm_source=source, residual=residual,
                            out_gain=out_gain, norm_squares=squares)
            plan = next(iter(_kept_for(_FUSED_PLANS, w).values()))
            if norm_eps is not None and m > NORM_MAX_M:
                assert plan is None  # composed: the mma product, then torch
            else:
                assert plan is not None and plan.kernel is _int4_mma_gemv_kernel
                assert (plan.consts["NORM_ROWS"] > 0) is (norm_eps is not None) and plan.consts["RESIDUAL"] is (
                    residual is not None) and plan.consts["OUT_GAIN"] is (out_gain is not None)
                assert plan.consts["NORM_SQUARES"] is (squares is not None)
            _kept_for(_FUSED_PLANS, w).clear()
            ref, tol = epilogue_reference(xin, w, norm_eps, residual, source, squares is not None)
            assert y.shape == (m, n if out_gain is None else norm_stream_width(n)) and torch.isfinite(y).all()
            worst = ((y[:, :n].double() - ref).abs() - tol).max().item()
            assert worst <= 0, (m, n, k, norm_eps, squares is not None, residual is not None, worst)
            if out_gain is not None:
                assert torch.equal(y[:, n:2 * n], (y[:, :n].float() * gain.float()).to(y.dtype))
                got = y[:, 2 * n:].double().view(m, -1, 2).sum(-1)  # [M, N / 16]: each pair's sum
                want = row_squares(y[:, :n]).double().view(m, -1, 2).sum(-1)
                assert ((got - want).abs() <= 2.0**-15 * want).all(), (m, n, k, (got - want).abs().max().item())
        assert torch.equal(int4_matmul(x, w, config=cfg, residual=r), int4_matmul(x, w, config=cfg) + r)
        _kept_for(_FUSED_PLANS, w).clear()


@pytest.mark.gpu
@gpu90
@pytest.mark.parametrize("group", [128, None])
def test_the_norm_before_silu_mul_and_under_a_graph(group):
    """The folded norm scales gate and up before silu * up (M = 1-8), from x or from x's partial sums of squares,
    against the float64 reference; the automatic choice takes the fused launches for bf16 (the four-warp two-stage
    plan capped at 96 registers), composes for fp16, and a CUDA graph replays the fused launches on new inputs."""
    gen = torch.Generator().manual_seed(11)
    for m, n, k in ((1, 28672, 4096), (3, 96, 640), (8, 512, 3584)):
        w = make_weight(n, k, group, False, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
        x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16).cuda()
        for squares in (None, row_squares(x)):
            y = int4_silu_mul(x, w, config=MMA_CONFIGS[4], norm_eps=1e-5, norm_squares=squares)
            ref, tol = epilogue_reference(x, w, 1e-5, None, squares=squares is not None)
            half = n // 2
            g, u, tg, tu = ref[:, :half], ref[:, half:], tol[:, :half], tol[:, half:]
            out = torch.nn.functional.silu(g) * u
            bound = (1.1 * u.abs() * tg + torch.nn.functional.silu(g).abs() * tu + EPS[x.dtype] * out.abs()
                     + TINY[x.dtype])
            assert ((y.double() - out).abs() - bound).max().item() <= 0, (m, n, k, squares is not None)
    w = make_weight(6144, 4096, group, False, 0.02, torch.device("cuda"), gen, scale_dtype=torch.bfloat16)
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16).cuda()
    r = torch.randn(1, 6144, generator=gen).to(torch.bfloat16).cuda()
    y = int4_matmul(x, w, norm_eps=1e-5, residual=r)
    plan = next(iter(_kept_for(_FUSED_PLANS, w).values()))
    assert plan.kernel is _int4_mma_gemv_kernel and plan.consts["NORM_ROWS"] == 1
    cap = NORM_REGISTER_CAPS.get((plan.consts["WARPS"], 1, plan.consts["STAGES"], plan.consts["BLOCKS"], 1))
    assert plan.options.get("maxnreg") == cap
    half = int4_matmul(x.half(), w, norm_eps=1e-5, residual=r.half())
    assert torch.equal(half, compose_epilogue(int4_matmul(x.half(), w), x.half(), 1e-5, r.half()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = int4_matmul(x, w, norm_eps=1e-5, residual=r)
    x.copy_(torch.randn(1, 4096, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(yg, y)
    assert torch.equal(yg, int4_matmul(x, w, norm_eps=1e-5, residual=r))
