"""Split-KV decode attention (`sdsie.kernels.decode_attention`) against scaled_dot_product_attention, on the GPU or
the CPU under TRITON_INTERPRET=1; its split rule; the `sdsie::decode_attention` op under opcheck and torch.compile;
the GPU bench's CPU dry run.

Reference: SDPA on the inputs upcast to float64. Tolerance: |out - ref| <= c * eps(dtype) * (max|v| + |ref|). In
bf16 the kernel rounds the probabilities to bf16 before the P @ V product (as SDPA's fused kernels do), which moves
the output by at most eps/2 * max|v|, and rounds the output once (eps/2 * |ref|): c = 1. In fp32 the dots are IEEE
fp32 and only summation order differs: c = 16, far below what a lost tile or a misplaced mask gives (>= 1e-2 here).
"""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from sdsie.kernels.decode_attention import MAX_SPLITS, PROGRAMS_PER_SM, SplitPlan, decode_attention, split_rule

da = importlib.import_module("sdsie.kernels.decode_attention")  # the module (the package exports its function)
TOL = {torch.float32: 16 * 2.0**-23, torch.bfloat16: 2.0**-7}


def _qkv(b: int, h_kv: int, g: int, s: int, d: int, dtype: torch.dtype, device: torch.device,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(dtype).to(device)
                 for shape in ((b, h_kv, g, d), (b, h_kv, s, d), (b, h_kv, s, d)))


def _tail_mask(b: int, s: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [B, 1, 1, S]: the last `hidden` positions masked (a static cache's unfilled slots)."""
    mask = torch.zeros(b, 1, 1, s, dtype=dtype)
    mask[..., s - hidden:] = float("-inf")
    return mask.to(device)


def _check(q, k, v, mask, scale, **kw) -> torch.Tensor:
    out = decode_attention(q, k, v, mask, scale, **kw)
    m64 = mask.double() if mask is not None and mask.dtype != torch.bool else mask
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m64, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    bound = TOL[q.dtype] * (v.double().abs().max() + ref.abs())
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} over bound {bound.min().item():.3g}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h_kv", [1, 2])
@pytest.mark.parametrize("g", [1, 4, 7])
def test_it_matches_sdpa_over_a_cache_with_unfilled_slots(kernel_device, g, h_kv, d, dtype):
    """S = 100 (not a multiple of the 32-position tile), its last 23 slots masked; the split rule's count (4)."""
    q, k, v = _qkv(1, h_kv, g, 100, d, dtype, kernel_device, seed=g + 10 * h_kv + d)
    _check(q, k, v, _tail_mask(1, 100, 23, dtype, kernel_device), 1 / math.sqrt(d), block_n=32)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("s", [16, 57, 129])
def test_forced_splits_and_scattered_masks_match_sdpa(kernel_device, s, num_splits):
    """Batch 2, each row with its own scattered mask; 16-position tiles, so 1, 2 and 5 splits are whole chunks of one
    or more tiles, the last one partial where S is not a multiple of 16."""
    q, k, v = _qkv(2, 2, 4, s, 64, torch.float32, kernel_device, seed=s)
    gen = torch.Generator().manual_seed(s + 1)
    keep = torch.rand(2, 1, 1, s, generator=gen) < 0.6
    keep[..., 0] = True
    mask = torch.zeros(2, 1, 1, s).masked_fill(~keep, float("-inf")).to(kernel_device)
    _check(q, k, v, mask, 0.2, num_splits=num_splits, block_n=16)


def test_a_fully_masked_chunk_and_a_fully_masked_row(kernel_device):
    """Four splits of 32: the first two chunks entirely masked (their max stays -inf, no NaN); in batch row 1 every
    position masked, where SDPA gives 0."""
    q, k, v = _qkv(2, 2, 7, 128, 64, torch.float32, kernel_device, seed=3)
    mask = torch.zeros(2, 1, 1, 128)
    mask[0, ..., :64] = float("-inf")
    mask[1] = float("-inf")
    out = _check(q, k, v, mask.to(kernel_device), 0.125, num_splits=4, block_n=32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not out.isnan().any()


def test_one_chunk_writes_the_output_and_launches_no_reduction(kernel_device, monkeypatch):
    """num_splits 1: the split program normalizes and writes the output itself; the reducing kernel is not
    launched (two chunks launch it)."""
    launched = []
    real = da._attention_reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(da, "_attention_reduce_kernel", Spy())
    q, k, v = _qkv(2, 3, 7, 111, 64, torch.float32, kernel_device, seed=21)
    mask = _tail_mask(2, 111, 9, torch.float32, kernel_device)
    _check(q, k, v, mask, 0.125, num_splits=1, block_n=16)
    assert launched == []
    _check(q, k, v, mask, 0.125, num_splits=2, block_n=16)
    assert launched == [(6, 7)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU")
def test_a_graph_replays_the_combine_with_new_queries():
    """A captured call of 12 chunks of 3 tiles (Llama-3.1-8B's shape after 2,048 tokens: the split and the reducing
    kernels) replayed with new queries and keys matches SDPA each time."""
    q, k, v = _qkv(1, 8, 4, 2304, 128, torch.bfloat16, torch.device("cuda"), seed=5)
    mask = _tail_mask(1, 2304, 100, torch.bfloat16, q.device)
    _check(q, k, v, mask, 0.125)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, mask, 0.125)
    for seed in range(3):
        q2, k2, v2 = _qkv(1, 8, 4, 2304, 128, torch.bfloat16, q.device, seed=100 + seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.125)
        bound = TOL[q.dtype] * (v.double().abs().max() + ref.abs())
        assert ((out.double() - ref).abs() <= bound).all(), seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pipeline depth is a GPU compilation knob")
@pytest.mark.parametrize("num_stages", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("num_splits", [1, 4, 12])
@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
def test_every_pipeline_depth_matches_sdpa(num_stages, num_splits, mask_kind):
    """Llama-3.1-8B's decode shape after 2,048 tokens at each depth the rule or a forced call can ask for: chunks of
    3 to 36 tiles, rings of 1 to 5 tiles ahead (the prologue's masked loads past a short chunk included), and the
    mask's tiles loaded a tile ahead, additive and boolean, with holes across tile and chunk boundaries."""
    q, k, v = _qkv(1, 8, 4, 2304, 128, torch.bfloat16, torch.device("cuda"), seed=num_stages)
    keep = torch.rand(1, 1, 1, 2304, generator=torch.Generator().manual_seed(num_splits)) > 0.3
    keep[..., 2204:] = False  # the unfilled tail
    keep[..., 180:200] = False  # a hole across the tiles at 192 (a chunk's edge at 12 splits)
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    _check(q, k, v, mask.to(device=q.device, dtype=torch.bool if mask_kind == "bool" else q.dtype), 0.125,
           num_splits=num_splits, num_stages=num_stages)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the warp count is a GPU compilation knob")
@pytest.mark.parametrize("num_warps", [1, 2, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 4, 12])
def test_every_warp_count_matches_sdpa(num_warps, num_splits):
    """Llama-3.1-8B's and Qwen2.5-7B's decode shapes after 2,048 tokens (G 4 and 7, padded to 16 rows) with a split
    program's tile spread over 1 to 8 warps, at chunks of 3 to 36 tiles."""
    for h_kv, g in ((8, 4), (4, 7)):
        q, k, v = _qkv(1, h_kv, g, 2304, 128, torch.bfloat16, torch.device("cuda"), seed=num_warps)
        _check(q, k, v, _tail_mask(1, 2304, 100, torch.bfloat16, q.device), 0.125, num_splits=num_splits,
               num_warps=num_warps)


def test_a_slice_of_a_static_cache_and_a_strided_query(kernel_device):
    """k and v as one layer's slice of a [L, 2, B, H_kv, S_max, D] cache cut to S (non-contiguous, offset), and the
    query packed from [B, 1, H, D] as model_io packs it (and once with a last-dim stride of 2, copied)."""
    b, h_kv, g, s_max, s, d = 2, 2, 4, 96, 70, 64
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(3, 2, b, h_kv, s_max, d, generator=gen).to(kernel_device)
    k, v = cache[1, 0, :, :, :s], cache[1, 1, :, :, :s]
    assert not k.is_contiguous() and k.stride(-1) == 1
    query = torch.randn(b, 1, h_kv * g, d, generator=gen).to(kernel_device).transpose(1, 2)  # HF's [B, H, 1, D]
    q = query.reshape(b, h_kv, g, d)
    mask = _tail_mask(b, s, 9, torch.float32, kernel_device)
    _check(q, k, v, mask, 0.125, block_n=16)
    wide = torch.randn(b, h_kv, g, 2 * d, generator=gen).to(kernel_device)[..., ::2]
    _check(wide, k, v, mask, 0.125, num_splits=3, block_n=16)


@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "flat", "batch_broadcast", "bf16_mask"])
def test_mask_forms_and_the_default_scale(kernel_device, mask_kind, num_splits):
    """No mask, a boolean one (True attended), one of shape [S], one of [1, 1, 1, S] over batch 2, and a bf16
    additive mask beside fp32 inputs; scale None is 1 / sqrt(D). The rule's one tile a chunk, and one chunk of three
    tiles (each tile's mask loaded during the tile before)."""
    q, k, v = _qkv(2, 1, 3, 40, 16, torch.float32, kernel_device, seed=7)
    keep = torch.arange(40) % 3 != 1
    mask = {"none": None, "bool": keep.to(kernel_device),
            "flat": torch.zeros(40).masked_fill(~keep, float("-inf")).to(kernel_device),
            "batch_broadcast": _tail_mask(1, 40, 11, torch.float32, kernel_device),
            "bf16_mask": _tail_mask(2, 40, 11, torch.bfloat16, kernel_device)}[mask_kind]
    out = decode_attention(q, k, v, mask, None, num_splits=num_splits, block_n=16)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    if m64 is not None:  # SDPA's CPU path indexes a 1-D mask's dim -2: the reference gets it as [1, 1, 1, S]
        m64 = m64.reshape((1,) * (4 - m64.dim()) + tuple(m64.shape))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m64)
    assert (out.double() - ref).abs().max() <= TOL[torch.float32] * (v.abs().max() + 1)


def test_a_head_dim_below_the_tile_is_padded(kernel_device):
    """D = 8 (the tiny test Llama's) and D = 24 (not a power of two): padded to the dot's 16 or 32 columns."""
    for d in (8, 24):
        q, k, v = _qkv(1, 2, 2, 33, d, torch.float32, kernel_device, seed=d)
        _check(q, k, v, _tail_mask(1, 33, 5, torch.float32, kernel_device), 0.3, block_n=16)


@pytest.mark.parametrize("case,match", [
    ("per_head_mask", "per-head or per-query-row mask"),
    ("mask_length", "does not broadcast"),
    ("kv_shape", "k and v must both be"),
    ("dtype", "share one dtype"),
    ("head_dim", "head dim D = 512"),
    ("kv_stride", "last-dim stride of 1"),
    ("int_mask", "floating .additive. or bool"),
    ("rank", "must be 4-D"),
    ("block_n", "block_n must be a power of two"),
    ("num_warps", "num_warps must be 1, 2, 4, 8 or 16"),
    ("devices", "several devices"),
])
def test_bad_inputs_are_refused_by_name(case, match):
    q, k, v = _qkv(1, 2, 4, 20, 16, torch.float32, torch.device("cpu"))
    mask, kw = torch.zeros(1, 1, 1, 20), {}
    if case == "per_head_mask":
        mask = torch.zeros(1, 2, 4, 20)
    elif case == "mask_length":
        mask = torch.zeros(1, 1, 1, 19)
    elif case == "kv_shape":
        v = v[:, :, :19]
    elif case == "dtype":
        k = k.double()
    elif case == "head_dim":
        q, k, v = _qkv(1, 1, 1, 4, 512, torch.float32, torch.device("cpu"))
        mask = None
    elif case == "kv_stride":
        k = torch.randn(1, 2, 20, 32)[..., ::2]
    elif case == "int_mask":
        mask = torch.zeros(1, 1, 1, 20, dtype=torch.int32)
    elif case == "rank":
        q = q[0]
    elif case == "block_n":
        kw = {"block_n": 24}
    elif case == "num_warps":
        kw = {"num_warps": 3}
    elif case == "devices":
        mask = mask.to("meta")
    with pytest.raises(ValueError, match=match):
        decode_attention(q, k, v, mask, 0.25, **kw)


def test_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv(1, 1, 1, 8, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        decode_attention(q, k, v)


def test_the_split_rule_at_the_decode_shapes():
    """About one program per SM of 132, whole 64-position tiles, at most 64 splits, no empty chunk; a pipeline as
    deep as the chunk's tiles, at most 2 tiles (32 KB each at D 128, bf16) ahead."""
    assert split_rule(8, 2304) == SplitPlan(12, 192, 64, 3)  # Llama-3.1-8B after 2,048 tokens: 17 wanted, 3 tiles
    assert split_rule(4, 2304) == SplitPlan(18, 128, 64, 3)  # Qwen2.5-7B: 33 wanted, 2 tiles each
    assert split_rule(8, 8448) == SplitPlan(17, 512, 64, 3)  # 132 tiles: 8 a chunk, 2 of them ahead
    assert split_rule(4, 8448) == SplitPlan(33, 256, 64, 3)
    assert split_rule(8, 256) == SplitPlan(4, 64, 64, 2)  # as many splits as tiles: nothing to pipeline
    assert split_rule(1, 10) == SplitPlan(1, 64, 64, 2)
    assert split_rule(400, 100_000) == SplitPlan(1, 100_032, 64, 3)  # enough heads for every SM: no split
    assert split_rule(8, 2304, sms=16) == SplitPlan(2, 1152, 64, 3)  # a smaller GPU: fewer splits
    assert split_rule(1, 100, 16, num_splits=2) == SplitPlan(2, 64, 16, 3)  # 7 tiles: 4 + 3
    assert split_rule(1, 100, 16, num_splits=50) == SplitPlan(7, 16, 16, 2)  # forced past the tiles: one each
    for bad in ({"batch_heads": 0}, {"seq_len": 0}, {"block_n": 0}, {"num_splits": 0}, {"sms": 0},
                {"head_dim": 0}, {"max_in_flight": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            split_rule(**({"batch_heads": 8, "seq_len": 64} | bad))


def test_the_pipeline_depth_fits_the_shared_memory_it_is_given():
    """Stages of one K and one V tile each: a smaller shared memory, a wider head or fp32 tiles leave fewer of them
    (at least one); a forced depth outside what fits, or a tile that fits nowhere, is refused by name."""
    assert split_rule(1, 4096, num_splits=1, max_in_flight=4).num_stages == 5  # 4 stages of 32 KB
    assert split_rule(1, 4096, num_splits=1, max_in_flight=4, shared=100 * 1024).num_stages == 3  # (100 - 16) KB: 2
    assert split_rule(1, 4096, num_splits=1, head_dim=256, elem_bytes=4).num_stages == 2  # one 128 KB stage
    assert split_rule(1, 4096, num_splits=1, num_stages=6).num_stages == 6  # 160 KB of a 227 KB program
    for forced in (1, 8):
        with pytest.raises(ValueError, match="num_stages must be in"):
            split_rule(1, 4096, num_splits=1, num_stages=forced)
    with pytest.raises(ValueError, match="does not fit"):
        split_rule(1, 4096, head_dim=256, elem_bytes=4, shared=100 * 1024)


@given(st.integers(1, 64), st.integers(1, 20_000), st.sampled_from([16, 32, 64, 128]), st.integers(1, 200))
def test_split_rule_invariants(batch_heads, seq_len, block_n, sms):
    """Chunks are whole tiles and cover S with none empty; the count never exceeds the tiles or MAX_SPLITS, and is
    more than half of min(tiles, wanted), the programs aimed at (PROGRAMS_PER_SM per SM) spread over the heads."""
    plan = split_rule(batch_heads, seq_len, block_n, sms=sms)
    tiles = -(-seq_len // block_n)
    wanted = min(tiles, MAX_SPLITS, -(-PROGRAMS_PER_SM * sms // batch_heads))
    assert plan.chunk % block_n == 0 and plan.block_n == block_n
    assert plan.num_splits * plan.chunk >= seq_len > (plan.num_splits - 1) * plan.chunk
    assert 1 <= plan.num_splits <= wanted and (2 * plan.num_splits > wanted or plan.num_splits == wanted == 1)
    assert plan.num_stages == 1 + min(plan.chunk // block_n, da.MAX_TILES_IN_FLIGHT)  # 2 tiles of <= 64 KB fit


def test_the_op_passes_opcheck_and_is_the_kernel(kernel_device):
    q, k, v = _qkv(1, 2, 3, 40, 16, torch.float32, kernel_device, seed=11)
    mask = _tail_mask(1, 40, 6, torch.float32, kernel_device)
    for args in ((q, k, v, mask, 0.25, 2), (q, k, v, None, None, None)):
        torch.library.opcheck(torch.ops.sdsie.decode_attention.default, args)
        assert torch.equal(torch.ops.sdsie.decode_attention(*args), decode_attention(*args))


def test_a_compiled_call_traces_the_op_without_a_graph_break(kernel_device):
    """fullgraph=True: a break (Dynamo tracing into the launcher) is an error; the compiled call gives eager's
    output."""
    q, k, v = _qkv(1, 2, 4, 48, 16, torch.float32, kernel_device, seed=13)
    mask = _tail_mask(1, 48, 10, torch.float32, kernel_device)

    def step(q, k, v, mask):
        return decode_attention(q * 0.5, k, v, mask, 0.25).sum(-1)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, mask), step(q, k, v, mask))
    torch._dynamo.reset()


def test_the_gpu_benchs_dry_run_writes_every_arm_with_small_errors(kernel_device, tmp_path):
    """The bench's --tiny run: every case has the SDPA arms and split_kv within bf16 error of float64."""
    from research.kernels.decode_attention_bench import TINY_MODELS, TINY_SEQ_LENS, main

    out = tmp_path / "da.json"
    assert main(["--tiny", "--device", kernel_device.type, "--stages", "3", "--warps", "2", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == len(TINY_MODELS) * len(TINY_SEQ_LENS)
    for c in cases:
        assert {"sdpa_packed", "sdpa_gqa", "split_kv", "split_kv_s3", "split_kv_n4_s3", "split_kv_w2",
                "split_kv_n1_w2"} <= set(c["arms"])
        assert c["arms"]["split_kv_n4_s3"]["plan"]["num_stages"] == 3
        assert c["arms"]["split_kv_n1_w2"]["plan"]["num_warps"] == 2
        assert c["arms"]["split_kv_n1_w2"]["plan"]["num_splits"] == 1
        assert c["kv_bytes"] == 2 * c["h_kv"] * c["s"] * c["d"] * 2
        for arm in c["arms"].values():
            assert 0 <= arm["max_abs_err"] < 2.0**-5, arm


SM90_COMPILE = r"""
import inspect, json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from sdsie.kernels.decode_attention import _attention_reduce_kernel, _attention_split_kernel

def build(kernel, ptrs, consts, stages=3, div16=()):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "fp32" if n == "scale" else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": stages})

ptrs = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "mask_ptr", "out_ptr"), "*bf16"),
        **dict.fromkeys(("acc_ptr", "m_ptr", "l_ptr"), "*fp32")}
consts = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_G": 16, "BLOCK_N": 64, "HAS_MASK": True, "MASK_BOOL": False,
          "DOT_FP32": False}
split = build(_attention_split_kernel, ptrs, {**consts, "SPLIT": True, "PDL": True})
single = build(_attention_split_kernel, ptrs, {**consts, "SPLIT": False, "PDL": True})
reduce = build(_attention_reduce_kernel, ptrs, {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SPLITS": 64, "PDL": True})
plain = [build(_attention_split_kernel, ptrs, {**consts, "SPLIT": True, "PDL": False}),
         build(_attention_reduce_kernel, ptrs, {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SPLITS": 64, "PDL": False})]
ptx = split.asm["ptx"]
# what a launch at the decode shape specializes: 16-byte aligned pointers, strides and lengths multiples of 16
div16 = [*ptrs, "stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh", "stride_vs",
         "S", "CHUNK"]
ring = {}  # num_stages -> (the K and V copies issued into the ring, shared bytes)
for stages in (2, 4, 5):
    deep = build(_attention_split_kernel, ptrs, {**consts, "SPLIT": True, "PDL": True}, stages, div16)
    ring[stages] = [deep.asm["ttgir"].count("ttg.async_copy_global_to_local"), deep.metadata.shared]
forms = {}  # mask form -> (K and V async copies, plain loads inside the tile loop, local-memory accesses)
for form, has_mask, mask_bool in (("additive", True, False), ("bool", True, True), ("none", False, False)):
    kernel = build(_attention_split_kernel, {**ptrs, "mask_ptr": "*i1" if mask_bool else "*bf16"},
                   {**consts, "HAS_MASK": has_mask, "MASK_BOOL": mask_bool, "SPLIT": True, "PDL": True}, 3, div16)
    ir = kernel.asm["ttgir"]
    loop = ir[ir.index("scf.for"):ir.index("scf.yield")]
    yielded = ir[ir.index("scf.yield"):].split("\n")[0].split(":")[0]
    loads = re.findall(r"(%[\w.]+) = tt.load ", loop)  # the loop's plain loads, by name
    forms[form] = [ir.count("ttg.async_copy_global_to_local"), len(loads),
                   sum(re.search(re.escape(name) + r"\b", yielded) is not None for name in loads),
                   kernel.asm["ptx"].count("ld.local") + kernel.asm["ptx"].count("st.local")]
grid_dep = lambda k: [k.asm["ptx"].count("griddepcontrol.wait"), k.asm["ptx"].count("griddepcontrol.launch_dependents")]
print(json.dumps({"mma_bf16": ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
                  "local": sum(k.asm["ptx"].count(op) for k in (split, single, reduce)
                               for op in ("ld.local", "st.local")),
                  "shared": max(split.metadata.shared, single.metadata.shared),
                  "grid_dep_pdl": [grid_dep(k) for k in (split, single, reduce)],
                  "grid_dep_plain": [grid_dep(k) for k in plain], "ring": ring, "forms": forms}))
"""


def test_the_gpu_path_compiles_for_sm90_with_bf16_tensor_core_products_and_no_spills():
    """The interpreter runs the products in fp32 (its bf16 dot is wrong), so the GPU's own path, bf16 operands on the
    tensor cores, is compiled here offline (Triton's bundled ptxas; no GPU) for the Llama/Qwen decode shape (D 128,
    G padded to 16, 64-position tiles), split and one chunk: scores and P @ V as bf16 MMAs, nothing in local memory,
    and the programmatic launch's wait and release where PDL asks for them."""
    from reproductions.kernels.inspect_ptx import compiled_offline

    r = compiled_offline(SM90_COMPILE, "the decode attention kernels")
    assert r["mma_bf16"] > 0 and r["local"] == 0 and 0 < r["shared"] <= 64 * 1024, r
    # PDL (the default on sm_90+): each kernel waits for its producer and releases its dependents once; without it,
    # neither instruction is there
    assert r["grid_dep_pdl"] == [[1, 1]] * 3 and r["grid_dep_plain"] == [[0, 0]] * 2, r
    # the depth split_rule asks for is the ring that compiles: 2 * num_stages async copies of K and V (the prologue's
    # num_stages - 1 tiles, the loop's one), num_stages - 1 stages of 32 KB, within an H200's shared memory
    for stages, (copies, shared) in r["ring"].items():
        assert copies == 2 * int(stages), r["ring"]
        assert (int(stages) - 1) * da.tile_bytes(64, 128, 2) < shared <= da.DEFAULT_SHARED_MEMORY, r["ring"]
    # each mask form keeps K and V in the ring (6 copies at depth 3); inside the loop the one plain load is the next
    # tile's mask (none without a mask), yielded to the next iteration rather than waited on in its own, and nothing
    # spills
    assert r["forms"] == {"additive": [6, 1, 1, 0], "bool": [6, 1, 1, 0], "none": [6, 0, 0, 0]}, r["forms"]
