"""Triton INT4 weight-only GEMV/GEMM: y = x @ dequant(W).T with weights packed 4-bit in memory.

Weights stay packed (uint8, two codes per byte along K) in global memory and are dequantized
on chip; see `sdsie.quant.format` for the layout. Accumulation is fp32; the output dtype
equals the activation dtype (fp16, bf16 or fp32).

Two kernels, one launcher (`int4_matmul`):

* `_int4_gemv_kernel` (M == 1): no `tl.dot` (it would pad M to 16); multiply and reduce with
  `tl.sum`. The zero-point is folded out of the inner loop:
      sum_k (q_k - z) * s * x_k = s * (sum_k q_k x_k - z * sum_k x_k)      (per group)
  so the inner loop is int->float conversion and FMAs only.
* `_int4_gemm_kernel` (M > 1): the even and odd nibbles are two `tl.dot`s against the even and
  odd columns of x, with the same zero-point folding per group.

Both split K across programs when the N grid alone cannot fill the GPU. Partial sums go to an
fp32 workspace; the last program to finish a tile (counted with an atomic semaphore that it
resets afterwards) reduces them and writes y: one launch, no zero-initialised buffer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sdsie.quant.format import SYMMETRIC_ZERO, Int4Weight

__all__ = ["Int4KernelConfig", "int4_matmul", "select_config", "candidate_configs", "kernel_calls"]

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_codes(qw_ptr, offs_n, k0, N, KB, stride_qn, BLOCK_KB: tl.constexpr):
    """Load a [BLOCK_N, BLOCK_KB] byte tile and split it into low/high nibbles (fp32)."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_KB)  # [BKB] byte columns
    mask = (offs_n[:, None] < N) & (offs_b[None, :] < KB)
    ptrs = qw_ptr + offs_n[:, None] * stride_qn + offs_b[None, :]
    b = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")  # [BN, BKB] uint8
    lo = (b & 0xF).to(tl.float32)  # codes of even k
    hi = (b >> 4).to(tl.float32)  # codes of odd k
    return lo, hi


@triton.jit
def _load_group_params(s_ptr, z_ptr, g, offs_n, mask, N, HAS_ZEROS: tl.constexpr):
    """Scales and zero-points for group index/indices g (broadcast against offs_n), as fp32."""
    s = tl.load(s_ptr + g * N + offs_n, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + g * N + offs_n, mask=mask, other=0.0).to(tl.float32)
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
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, KB, G, k_per_split,
    stride_xm, stride_xk, stride_qn, stride_ym,
    GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), SPLIT_K, M); one program = BLOCK_N outputs of one row over one K split
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    BLOCK_KB: tl.constexpr = BLOCK_K // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_j = tl.arange(0, BLOCK_KB)  # [BKB]
    x_row = x_ptr + pid_m * stride_xm
    k_begin = pid_k * k_per_split
    k_end = k_begin + k_per_split  # may overshoot K in the last split: loads are masked

    acc = tl.zeros([BLOCK_N], tl.float32)  # scaled partial dot products
    qx = tl.zeros([BLOCK_N], tl.float32)  # per-channel only: sum q*x before scaling
    xs = tl.zeros([1], tl.float32)  # per-channel only: sum x
    for k0 in range(k_begin, k_end, BLOCK_K):
        lo, hi = _load_codes(qw_ptr, offs_n, k0, N, KB, stride_qn, BLOCK_KB)
        ke = k0 + 2 * offs_j  # [BKB] even columns
        xe = tl.load(x_row + ke * stride_xk, mask=ke < K, other=0.0, eviction_policy="evict_last").to(tl.float32)
        xo = tl.load(x_row + (ke + 1) * stride_xk, mask=ke + 1 < K, other=0.0,
                     eviction_policy="evict_last").to(tl.float32)
        prod = lo * xe[None, :] + hi * xo[None, :]  # [BN, BKB]
        if PER_CHANNEL:
            qx += tl.sum(prod, axis=1)
            xs += tl.sum(xe + xo, axis=0)
        elif BLOCK_K <= GROUP:
            # the whole tile lies in one group
            s, z = _load_group_params(s_ptr, z_ptr, k0 // GROUP, offs_n, n_mask & (k0 < K), N, HAS_ZEROS)
            acc += s * (tl.sum(prod, axis=1) - z * tl.sum(xe + xo, axis=0))
        else:
            # the tile spans TG groups: reduce each group separately
            TG: tl.constexpr = BLOCK_K // GROUP
            part = tl.sum(tl.reshape(prod, [BLOCK_N, TG, GROUP // 2]), axis=2)  # [BN, TG]
            xg = tl.sum(tl.reshape(xe + xo, [TG, GROUP // 2]), axis=1)  # [TG]
            g = k0 // GROUP + tl.arange(0, TG)  # [TG]
            gmask = n_mask[:, None] & (g[None, :] < G)
            s, z = _load_group_params(s_ptr, z_ptr, g[None, :], offs_n[:, None], gmask, N, HAS_ZEROS)
            acc += tl.sum(s * (part - z * xg[None, :]), axis=1)
    if PER_CHANNEL:
        s, z = _load_group_params(s_ptr, z_ptr, 0, offs_n, n_mask, N, HAS_ZEROS)
        acc = s * (qx - z * xs)

    offs_m = pid_m + tl.arange(0, 1)
    _store_or_reduce(acc[None, :], y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_ym,
                     pid_m, pid_n, pid_k, tl.num_programs(0), SPLIT_K)


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, KB, G, k_per_split,
    stride_xm, stride_xk, stride_qn, stride_ym,
    GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_IEEE: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M)); BLOCK_K <= GROUP unless PER_CHANNEL
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    BLOCK_KB: tl.constexpr = BLOCK_K // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_j = tl.arange(0, BLOCK_KB)  # [BKB]
    k_begin = pid_k * k_per_split
    k_end = k_begin + k_per_split  # may overshoot K in the last split: loads are masked
    dot_dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    qx = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # per-channel only
    xs = tl.zeros([BLOCK_M], tl.float32)  # per-channel only
    for k0 in range(k_begin, k_end, BLOCK_K):
        lo, hi = _load_codes(qw_ptr, offs_n, k0, N, KB, stride_qn, BLOCK_KB)
        ke = k0 + 2 * offs_j  # [BKB]
        x_base = x_ptr + offs_m[:, None] * stride_xm
        m_mask = offs_m[:, None] < M
        xe = tl.load(x_base + ke[None, :] * stride_xk, mask=m_mask & (ke[None, :] < K), other=0.0)
        xo = tl.load(x_base + (ke[None, :] + 1) * stride_xk, mask=m_mask & (ke[None, :] + 1 < K), other=0.0)
        # codes 0..15 are exact in fp16/bf16; fp32 activations use an IEEE (not tf32) dot
        if DOT_IEEE:
            part = tl.dot(xe.to(tl.float32), tl.trans(lo), input_precision="ieee")
            part = tl.dot(xo.to(tl.float32), tl.trans(hi), part, input_precision="ieee")  # [BM, BN]
        else:
            part = tl.dot(xe, tl.trans(lo.to(dot_dtype)))
            part = tl.dot(xo, tl.trans(hi.to(dot_dtype)), part)  # [BM, BN]
        xsum = tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=1)  # [BM]
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


# ----------------------------------------------------------------------------------------------
# Host code
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int4KernelConfig:
    """Launch configuration. block_m == 1 selects the GEMV kernel (M == 1 only)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "split_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Int4KernelConfig.{name} must be a positive power of two, got {v}")
        if self.block_k < 2:
            raise ValueError(f"Int4KernelConfig.block_k must be >= 2 (two codes per byte), got {self.block_k}")
        if self.block_m > 1 and (self.block_m < 16 or self.block_k < 32 or self.block_n < 16):
            raise ValueError(f"GEMM configs need block_m >= 16, block_n >= 16, block_k >= 32 (tl.dot), got {self}")


# Configurations the selector can return (tests run every one of them). Tuned on an H200;
# see reproductions/kernels/NOTES.md for how each was chosen.
_GEMV_CONFIGS = (
    Int4KernelConfig(1, 32, 256, split_k=1, num_warps=4),
    Int4KernelConfig(1, 64, 256, split_k=1, num_warps=4),
    Int4KernelConfig(1, 16, 512, split_k=2, num_warps=4),
    Int4KernelConfig(1, 32, 512, split_k=4, num_warps=4),
    Int4KernelConfig(1, 16, 256, split_k=8, num_warps=2),
)
_GEMM_CONFIGS = (
    Int4KernelConfig(16, 64, 128, split_k=1, num_warps=4),
    Int4KernelConfig(16, 32, 128, split_k=4, num_warps=4),
    Int4KernelConfig(64, 64, 64, split_k=1, num_warps=4),
)


def candidate_configs() -> tuple[Int4KernelConfig, ...]:
    """Every configuration `select_config` can pick."""
    return _GEMV_CONFIGS + _GEMM_CONFIGS


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter has no SMs; pick as for an H200 so CPU tests cover the same paths


def select_config(m: int, n: int, k: int, device: torch.device) -> Int4KernelConfig:
    """Pick a launch configuration: enough programs to fill the GPU, fewest splits that do."""
    sms = _num_sms(device)
    if m == 1:
        cands = _GEMV_CONFIGS
    elif m <= 16:
        cands = _GEMM_CONFIGS[:2]
    else:
        cands = _GEMM_CONFIGS[2:]
    for cfg in cands:
        tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m) * cfg.split_k
        if tiles >= 2 * sms:
            return cfg
    return cands[-1]


class _Scratch:
    """Per-device semaphore buffer for split-K (zeroed once; kernels leave it zeroed)."""

    def __init__(self) -> None:
        self.locks: dict[torch.device, torch.Tensor] = {}

    def lock_buffer(self, device: torch.device, size: int) -> torch.Tensor:
        buf = self.locks.get(device)
        if buf is None or buf.numel() < size:
            buf = torch.zeros(max(size, 1 << 16), dtype=torch.int32, device=device)
            self.locks[device] = buf
        return buf


_SCRATCH = _Scratch()
_CALLS = {"n": 0}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_calls() -> int:
    """How many times the INT4 kernel has been launched in this process (for gate-acts tests)."""
    return _CALLS["n"]


def _check_inputs(x: torch.Tensor, w: Int4Weight) -> None:
    if not isinstance(w, Int4Weight):
        raise ValueError(f"int4_matmul expects an Int4Weight, got {type(w).__name__}")
    w.validate()
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"int4_matmul: activations must be fp16, bf16 or fp32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("int4_matmul: x must have at least one dimension [..., K]")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"int4_matmul: x has K={x.shape[-1]} but the weight has in_features={w.in_features}")
    if x.device != w.qweight.device:
        raise ValueError(f"int4_matmul: x is on {x.device} but the weight is on {w.qweight.device}")


def int4_matmul(
    x: torch.Tensor, w: Int4Weight, config: Int4KernelConfig | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ dequant(W).T for x [..., K]; returns [..., N] in x's dtype (fp32 accumulation).

    `config` overrides the automatic choice (tests use it to cover every candidate).
    `out`, if given, is a contiguous [M, N] (M = prod of leading dims) tensor of x's dtype to write.
    Empty inputs (any leading dim 0) return an empty [..., N] without launching.
    """
    _check_inputs(x, w)
    n, k = w.out_features, w.in_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, K]; copies only when x cannot be viewed so (strides handled)
    m = x2.shape[0]
    if out is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"int4_matmul: out must be a contiguous {x.dtype} tensor of shape {(m, n)} on {x.device}")
    else:
        y = out
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    cfg = config or select_config(m, n, k, x.device)
    if (cfg.block_m == 1) != (m == 1):
        raise ValueError(f"config {cfg} does not fit M={m}: block_m == 1 is the GEMV kernel for M == 1 only")
    per_channel = w.group_size >= k
    block_k = cfg.block_k
    if cfg.block_m > 1 and not per_channel:
        block_k = min(block_k, w.group_size)  # a GEMM tile never straddles two groups
    split_k = min(cfg.split_k, triton.next_power_of_2(triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.block_m))
    if split_k > 1:
        ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        locks = _SCRATCH.lock_buffer(x.device, grid[0] * grid[2])
    else:
        ws, locks = y, y  # unused by the kernel
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    common = dict(
        GROUP=1 if per_channel else w.group_size,  # unused when PER_CHANNEL: no recompile per K
        PER_CHANNEL=per_channel,
        HAS_ZEROS=w.zeros is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    args = (x2, w.qweight, w.scales, zeros, y, ws, locks, m, n, k, w.qweight.shape[1], w.n_groups, k_per_split,
            x2.stride(0), x2.stride(1), w.qweight.stride(0), y.stride(0))
    if cfg.block_m == 1:
        _int4_gemv_kernel[grid](*args, **common)
    else:
        # Triton 3.6's interpreter computes bf16 tl.dot wrongly (garbage ~1e10 on a 16x16 product), so
        # under TRITON_INTERPRET the operands go through an fp32 IEEE dot; on the GPU bf16/fp16 use
        # the tensor cores. Everything else in the kernel is the same code on both.
        dot_ieee = x.dtype == torch.float32 or _interpreting()
        _int4_gemm_kernel[grid](*args, BLOCK_M=cfg.block_m, DOT_IEEE=dot_ieee, **common)
    _CALLS["n"] += 1
    return y.reshape(*lead, n)


assert SYMMETRIC_ZERO == 8  # the kernels hard-code the symmetric zero-point
