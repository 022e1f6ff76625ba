"""Split-KV ("flash-decoding") attention for a one-token step of a grouped-query model.

`decode_attention(q, k, v, mask, scale)` computes what `F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
scale=scale)` does for the query packed the way `sdsie.decoding.model_io` packs a decode step (each key/value head's
query heads as its query rows): q [B, H_kv, G, D], k and v [B, H_kv, S, D], mask additive (0 attended, -inf not; or
boolean, True attended) and broadcastable to [B, 1, 1, S]. SDPA's fused kernel gives that call B * H_kv programs,
each scanning all S positions (8 programs for Llama-3.1-8B at batch 1, on a 132-SM GPU); here the S axis is cut
into `num_splits` chunks of whole BLOCK_N tiles:

  (a) `_attention_split_kernel`, grid (B * H_kv, num_splits): one key/value head and one chunk per program; all G
      query rows of the head at once (padded to 16 rows for tl.dot), an online softmax over the chunk's tiles
      (running max m, sum l, accumulator acc, fp32), written to fp32 scratch. A chunk whose positions are all masked
      leaves m = -inf, l = 0, acc = 0 (the exponent's base is taken as 0 there, so no -inf - -inf). With one
      chunk the program writes acc / l itself, and (b) is not launched.
  (b) `_attention_reduce_kernel`, grid (B * H_kv, G): out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s in
      q's dtype. A row with every position masked gives 0, as SDPA does (torch's math and CPU paths return 0 for
      such rows). (Combining in (a) instead, by each head's last program on an atomic count, took longer on the
      H200: 6.5 us a layer against 3.2 + 1.5 at 256 positions, docs/log.md.)

The kernels' names carry "attention" so that profiles (reproductions/decode_e2e.py) count them as attention.

`split_rule` picks num_splits from the shape alone (aims at PROGRAMS_PER_SM programs per SM, a chunk of at least one
tile, at most MAX_SPLITS), and the software pipeline's depth: a program asks for up to MAX_TILES_IN_FLIGHT of its
chunk's K and V tiles ahead (num_stages - 1 tiles in shared memory, within the device's shared memory), and for
each tile's mask during the tile before. Nothing waits on the device: a call runs inside CUDA graph capture; its
scratch comes from torch.empty per call.

Entry points: eager callers call `decode_attention`, which launches the kernels directly; under torch.compile it
calls the custom op `sdsie::decode_attention` (`torch.compiler.is_compiling()` picks), whose fake implementation
gives the output's shape and dtype so the call is one node of a compiled graph. The direct path skips the
dispatcher's host time in front of every launch, which an eager (ungraphed) batch-1 step pays per layer, as the
INT4 launcher does (`sdsie.kernels.ops`).

Runs on CUDA, and on a CPU only under the Triton interpreter (TRITON_INTERPRET=1); elsewhere it raises
RuntimeError and a caller keeps SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sdsie.kernels.device import (
    DEFAULT_SHARED_MEMORY,
    DEFAULT_SMS,
    grid_dependency,
    interpreting,
    kernel_runs_on,
    pdl_on,
    shared_memory,
    sm_count,
)

__all__ = ["DEFAULT_SMS", "MAX_SPLITS", "MAX_TILES_IN_FLIGHT", "PROGRAMS_PER_SM", "SplitPlan", "decode_attention",
           "split_rule"]

BLOCK_N = 64  # positions per tile: K and V tiles of 64 x 128 bf16 (16 KB each) at D = 128
PROGRAMS_PER_SM = 1  # split programs aimed at per SM: the fastest of 1-32 splits on the H200 (docs/log.md)
MAX_SPLITS = 64  # the reduce kernel holds every split's [D] partial of one row at once
# K + V tiles a program asks for ahead: 2 (depth 3; 64 KB at BLOCK_N 64, D 128, bf16) was the fastest of depths 2-6
# at the rule's split count at 2,304 and 8,448 positions on an H100, 4-6 up to 1.15x slower (docs/kernel-log.md,
# 2026-12-06)
MAX_TILES_IN_FLIGHT = 2
# warps a split program runs: of 1, 2, 4 and 8, none was faster than 4 on both models and all three lengths at the
# rule's split counts on an H100, and a tile's time is near inversely proportional to the warps up to 4
# (docs/kernel-log.md, 2026-12-06)
NUM_WARPS = 4
SHARED_RESERVE = 16384  # shared bytes beside the tile ring (q, p, layout conversions: 6 KB at D 128)
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class SplitPlan:
    """How the S axis is cut: `num_splits` chunks of `chunk` positions (a multiple of block_n; the last may be
    shorter), each program's loop pipelined `num_stages` deep (num_stages - 1 K + V tiles requested ahead)."""

    num_splits: int
    chunk: int
    block_n: int
    num_stages: int


def padded(n: int) -> int:
    """A dot operand's extent as the kernels pad it: a power of two, at least 16 (tl.dot's least)."""
    return max(16, triton.next_power_of_2(n))


def tile_bytes(block_n: int, head_dim: int, elem_bytes: int) -> int:
    """Shared memory one stage of the ring holds: a K and a V tile of block_n positions (D padded as the kernel
    pads it)."""
    return 2 * block_n * padded(head_dim) * elem_bytes


def split_rule(batch_heads: int, seq_len: int, block_n: int = BLOCK_N, sms: int = DEFAULT_SMS,
               programs_per_sm: int = PROGRAMS_PER_SM, max_splits: int = MAX_SPLITS,
               num_splits: int | None = None, head_dim: int = 128, elem_bytes: int = 2,
               shared: int = DEFAULT_SHARED_MEMORY, max_in_flight: int = MAX_TILES_IN_FLIGHT,
               num_stages: int | None = None) -> SplitPlan:
    """The split of `seq_len` positions for `batch_heads` (B * H_kv) key/value heads: about sms * programs_per_sm
    programs in all, chunks of whole block_n tiles, no chunk empty, at most max_splits; and a pipeline as deep as
    the chunk's tiles, at most max_in_flight tiles ahead, within `shared` bytes of shared memory. `num_splits` and
    `num_stages` force those (still at most one chunk per tile). Pure arithmetic on the shape: no device query."""
    for name, val in (("batch_heads", batch_heads), ("seq_len", seq_len), ("block_n", block_n), ("sms", sms),
                      ("programs_per_sm", programs_per_sm), ("max_splits", max_splits), ("head_dim", head_dim),
                      ("elem_bytes", elem_bytes), ("max_in_flight", max_in_flight)):
        if val < 1:
            raise ValueError(f"split_rule: {name} must be >= 1, got {val}")
    tiles = -(-seq_len // block_n)
    if num_splits is None:
        want = max(1, -(-sms * programs_per_sm // batch_heads))
        num_splits = min(want, max_splits)
    elif num_splits < 1:
        raise ValueError(f"split_rule: num_splits must be >= 1, got {num_splits}")
    tiles_per_split = -(-tiles // min(num_splits, tiles))
    stage = tile_bytes(block_n, head_dim, elem_bytes)
    room = (shared - SHARED_RESERVE) // stage
    if room < 1:
        raise ValueError(f"split_rule: one K + V tile stage ({stage} bytes at block_n {block_n}, D {head_dim}) does "
                         f"not fit {shared} bytes of shared memory")
    if num_stages is None:
        num_stages = 1 + min(tiles_per_split, max_in_flight, room)
    elif not 2 <= num_stages <= room + 1:
        raise ValueError(f"split_rule: num_stages must be in [2, {room + 1}] ({room} stages of {stage} bytes fit "
                         f"{shared} bytes of shared memory), got {num_stages}")
    return SplitPlan(num_splits=-(-tiles // tiles_per_split), chunk=tiles_per_split * block_n, block_n=block_n,
                     num_stages=num_stages)


@triton.jit
def _mask_tile(mask_row, offs, end, stride_ms, MASK_BOOL: tl.constexpr):
    """The mask's values at positions `offs` of one row, as loaded (bytes for a boolean mask, compared at use); past
    `end`, not attended (0, or -inf)."""
    if MASK_BOOL:
        return tl.load(mask_row + offs * stride_ms, mask=offs < end, other=0)
    return tl.load(mask_row + offs * stride_ms, mask=offs < end, other=float("-inf"))


@triton.jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr, out_ptr,
                  stride_qb, stride_qh, stride_qg,
                  stride_kb, stride_kh, stride_ks,
                  stride_vb, stride_vh, stride_vs,
                  stride_mb, stride_ms,
                  H_KV, G, S, CHUNK, NUM_SPLITS, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr,
                  PDL: tl.constexpr):
    grid_dependency(PDL)  # q and the caches are the kernels' before: wait first, then let the next start
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H_KV).to(tl.int64)
    h = (bh % H_KV).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, S)
    # The mask's tiles are loaded a tile ahead, each consumed an iteration after its load is issued: too narrow for
    # the pipeliner's async copies, a mask load in its own iteration held every iteration for an L2 round trip
    # (about 1 us a tile on an H100, docs/kernel-log.md)
    mask_row = mask_ptr + b * stride_mb
    if MASK_BOOL:  # read as bytes, compared at use: an i1 load compares on arrival, in the iteration that issued it
        mask_row = mask_row.to(tl.pointer_type(tl.int8), bitcast=True)
    if HAS_MASK:
        mask_t = _mask_tile(mask_row, start + tl.arange(0, BLOCK_N), end, stride_ms, MASK_BOOL)
    else:
        mask_t = tl.zeros([BLOCK_N], dtype=tl.float32)  # never read
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)  # [BLOCK_N, D]
        # V's load issued beside K's: a chunk of one tile (the common case at 2-4 programs per SM) then waits on
        # memory once, not twice
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_ok, other=0.0)
        if HAS_MASK:  # the next tile's mask, in flight while this tile's products run
            mask_after = _mask_tile(mask_row, offs_n + BLOCK_N, end, stride_ms, MASK_BOOL)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [BLOCK_G, BLOCK_N], fp32
        if HAS_MASK:
            if MASK_BOOL:
                s = tl.where((mask_t != 0)[None, :], s, float("-inf"))
            else:
                s = s + mask_t.to(tl.float32)[None, :]
            mask_t = mask_after
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # every score so far masked: exp(-inf - 0) = 0
        alpha = tl.exp(m_i - base)
        p = tl.exp(s - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # the tensor cores' operand; under DOT_FP32 the same rounded values, in fp32
        if DOT_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if not SPLIT:  # one chunk: the program's sums are the head's
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # acc is 0 where l is: SDPA's 0 for a masked row
        tl.store(out_ptr + (bh * G + offs_g).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        return
    row = (bh * NUM_SPLITS + split).to(tl.int64) * G + offs_g  # scratch rows [B * H_kv, NUM_SPLITS, G]
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _attention_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, G, NUM_SPLITS,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    bh = tl.program_id(0)
    g = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    row = (bh * NUM_SPLITS + offs_s).to(tl.int64) * G + g  # [BLOCK_SPLITS]
    m = tl.load(m_ptr + row, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_ptr + row, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    base = tl.where(m_max == float("-inf"), 0.0, m_max)  # a row masked everywhere: every weight 0
    w = tl.exp(m - base)
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    num = tl.sum(acc * w[:, None], 0)  # [BLOCK_D]
    out = num / tl.where(denom > 0.0, denom, 1.0)  # num is 0 where denom is: SDPA's 0 for a fully masked row
    tl.store(out_ptr + (bh * G + g).to(tl.int64) * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _mask_4d(mask: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """`mask` as a [B, 1, 1, S] view (broadcast dims at stride 0); a per-head or per-row mask is refused."""
    if mask.dim() > 4:
        raise ValueError(f"decode_attention: mask of {mask.dim()} dims {tuple(mask.shape)}; at most 4 ([B, 1, 1, S])")
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    if shape[1] != 1 or shape[2] != 1:
        raise ValueError(f"decode_attention: a per-head or per-query-row mask {tuple(mask.shape)} is not supported; "
                         f"the mask must broadcast as [B or 1, 1, 1, S] = [{batch}, 1, 1, {seq_len}]")
    if shape[0] not in (1, batch) or shape[3] not in (1, seq_len):
        raise ValueError(f"decode_attention: mask {tuple(mask.shape)} does not broadcast to "
                         f"[{batch}, 1, 1, {seq_len}]")
    return mask.reshape(shape).expand(batch, 1, 1, seq_len)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """ValueError naming the first problem with the inputs (shapes, dtypes, devices, strides); shape-only, so the
    fake implementation runs it too."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"decode_attention: q, k, v must be 4-D ([B, H_kv, G, D], [B, H_kv, S, D] twice), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, groups, dim = q.shape
    if tuple(k.shape[:2]) != (batch, heads) or k.shape != v.shape or k.shape[3] != dim:
        raise ValueError(f"decode_attention: k and v must both be [B, H_kv, S, D] = [{batch}, {heads}, S, {dim}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if batch < 1 or heads < 1 or groups < 1 or k.shape[2] < 1:
        raise ValueError(f"decode_attention: empty input q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"decode_attention: head dim D = {dim}; supported up to {MAX_HEAD_DIM}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k, v must share one dtype of {_DTYPES}, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError(f"decode_attention: k and v need a last-dim stride of 1 (a cache slice's), got strides "
                         f"{k.stride()} and {v.stride()}")
    devices = {q.device, k.device, v.device} | ({mask.device} if mask is not None else set())
    if len(devices) != 1:
        raise ValueError(f"decode_attention: inputs on several devices {sorted(map(str, devices))}")
    if mask is not None:
        if not (mask.dtype.is_floating_point or mask.dtype == torch.bool):
            raise ValueError(f"decode_attention: mask must be floating (additive) or bool, got {mask.dtype}")
        _mask_4d(mask, batch, k.shape[2])


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
            num_splits: int | None = None, block_n: int = BLOCK_N, num_stages: int | None = None,
            num_warps: int = NUM_WARPS) -> torch.Tensor:
    check_inputs(q, k, v, mask)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"decode_attention: block_n must be a power of two >= 16, got {block_n}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"decode_attention: num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    if not kernel_runs_on(q.device):
        raise RuntimeError(f"decode_attention runs on CUDA, or on a CPU under TRITON_INTERPRET=1; got {q.device}")
    batch, heads, groups, dim = q.shape
    seq_len = k.shape[2]
    plan = split_rule(batch * heads, seq_len, block_n, sms=sm_count(q.device), num_splits=num_splits, head_dim=dim,
                      elem_bytes=q.element_size(), shared=shared_memory(q.device), num_stages=num_stages)
    if q.stride(3) != 1:
        q = q.contiguous()
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    out = torch.empty((batch, heads, groups, dim), dtype=q.dtype, device=q.device)
    split = plan.num_splits > 1
    if split:
        rows = batch * heads * plan.num_splits * groups
        acc = torch.empty((rows, dim), dtype=torch.float32, device=q.device)
        m = torch.empty(rows, dtype=torch.float32, device=q.device)
        l_sum = torch.empty(rows, dtype=torch.float32, device=q.device)
    else:
        acc = m = l_sum = out  # one chunk writes out itself: no scratch (placeholder pointers, never touched)
    if mask is None:
        mask_arg, stride_mb, stride_ms = q, 0, 0  # a placeholder pointer, never read
    else:
        mask_arg = _mask_4d(mask, batch, seq_len)
        stride_mb, stride_ms = mask_arg.stride(0), mask_arg.stride(3)
    block_d = padded(dim)
    # fp32 dots in IEEE for fp32 inputs (no tf32 rounding), and under the interpreter, whose bf16 dot is wrong in
    # Triton 3.6 (the operands are the same rounded values)
    dot_fp32 = q.dtype == torch.float32 or interpreting()
    pdl = pdl_on(q.device)
    _attention_split_kernel[(batch * heads, plan.num_splits)](
        q, k, v, mask_arg, acc, m, l_sum, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        stride_mb, stride_ms,
        heads, groups, seq_len, plan.chunk, plan.num_splits, scale,
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_G=padded(groups), BLOCK_N=plan.block_n,
        HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.bool,
        DOT_FP32=dot_fp32, SPLIT=split, PDL=pdl, num_warps=num_warps, num_stages=plan.num_stages, launch_pdl=pdl)
    if split:
        _attention_reduce_kernel[(batch * heads, groups)](
            acc, m, l_sum, out, groups, plan.num_splits,
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_SPLITS=max(2, triton.next_power_of_2(plan.num_splits)),
            PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


@torch.library.custom_op("sdsie::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float | None, num_splits: int | None = None) -> torch.Tensor:
    """`decode_attention` as a torch.library op: [B, H_kv, G, D] in q's dtype."""
    return _launch(q, k, v, mask, scale, num_splits)


@decode_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
      num_splits: int | None = None) -> torch.Tensor:
    check_inputs(q, k, v, mask)
    return q.new_empty(q.shape)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     scale: float | None = None, num_splits: int | None = None,
                     block_n: int = BLOCK_N, num_stages: int | None = None,
                     num_warps: int = NUM_WARPS) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q [B, H_kv, G, D], k and v [B, H_kv, S, D] (last-dim stride 1, any other
    strides), mask additive float or bool, broadcastable to [B, 1, 1, S] (None: every position attended); scale None
    is 1 / sqrt(D), as in SDPA. Returns [B, H_kv, G, D] in q's dtype. `num_splits` forces the number of chunks of
    S (else `split_rule`); `block_n`, `num_stages` and `num_warps` (eager calls only) the tile length, pipeline depth
    and a split program's warps."""
    if torch.compiler.is_compiling():
        if block_n != BLOCK_N or num_stages is not None or num_warps != NUM_WARPS:
            raise ValueError(f"decode_attention: block_n, num_stages and num_warps are eager-only knobs; compiled "
                             f"calls use {BLOCK_N}, split_rule's depth and {NUM_WARPS}")
        return decode_attention_op(q, k, v, mask, scale, num_splits)
    return _launch(q, k, v, mask, scale, num_splits, block_n, num_stages, num_warps)
