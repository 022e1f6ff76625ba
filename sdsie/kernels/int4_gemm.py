"""The INT4 launcher: `int4_matmul(x, w)`, y = x @ dequant(W).T with W packed 4-bit, for any M.

One launcher serves every INT4 layer (`int4_silu_mul` is the same for a fused [gate; up] weight, with silu(gate) * up
in the mma kernel's epilogue where that kernel takes the call). Which kernel a call runs, by M:

* M <= ROW_SLICE (decode steps, chains' and small trees' verifications): the configuration `sdsie.kernels.
  int4_config` picks: the Gluon tensor-core GEMV (`sdsie.kernels.int4_mma`, bf16 x at M <= 16 on sm_90+), or one of
  the Triton kernels of `sdsie.kernels.int4_triton` (the CUDA-core GEMV, the planes wgmma kernel, the tl.dot GEMM).
* M = ROW_SLICE + 1 .. DEQUANT_MIN_M - 1 (short prompts, wide tree verifications): ROW_SLICE rows at a time through
  that choice (`_row_slices`).
* M >= DEQUANT_MIN_M (prompts): the weight unpacked to x's dtype (`_int4_dequant_kernel`) for one cuBLAS matmul. At
  that many rows the matmul leans on arithmetic, where cuBLAS's tensor-core GEMM leads, and the unpack costs 2.5
  bytes a weight once per call.

`int4_matmul` keeps a launch plan per (weight object, M, x layout, config) and, after the first call, hands arguments
straight to the compiled kernel (host time before a launch is latency at batch 1).
"""
from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from sdsie.int4_format import Int4Weight
from sdsie.kernels.device import interpreting, pdl_on, programmatic_launch
from sdsie.kernels.int4_config import (
    Int4KernelConfig,
    _k_tiling,
    _local_table,
    _select_config,
    select_config,
)
from sdsie.kernels.int4_mma import (
    NORM_MAX_M,
    NORM_REGISTER_CAPS,
    SQUARE_BLOCK,
    _int4_mma_gemv_kernel,
    gate_up_order,
    mma_consts,
    mma_supported,
    pack_fragments,
)
from sdsie.kernels.int4_triton import (
    CODE_MAGIC,
    _int4_dequant_kernel,
    _int4_gemm_kernel,
    _int4_gemm_planes_kernel,
    _int4_gemv_kernel,
)

__all__ = ["int4_matmul", "int4_silu_mul", "silu_mul_halves", "compose_epilogue", "epilogue_max_m", "int4_dequantize",
           "check_squares_dtype", "kernel_calls", "norm_factor", "norm_stream_width", "refresh_choice", "row_squares",
           "squares_width", "DEQUANT_MIN_M", "ROW_SLICE"]

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# M >= DEQUANT_MIN_M (a prompt's rows) unpacks the weight and runs one cuBLAS matmul (`_dequant_matmul`): on the H200
# at M = 17-2048 it beats the bytes tl.dot kernel below 1.7-27x on the 7-8B shapes (telemetry/raw/
# prefill_paths_h200.json, docs/kernel-log.md). That kernel (`int4_config._LARGE_M_CONFIG`) runs only when a call
# names it; M <= 16 takes the configuration `select_config` picks, and M = 17 .. DEQUANT_MIN_M - 1 runs
# ROW_SLICE rows at a time through that choice (`_row_slices`). The bound is a prediction from two records, not yet
# timed side by side: on the six 7-8B shapes both time, two 16-row calls (graphed, shape_table_mma_m1_to_m16_h200.json)
# take 19.6-81 us where the unpack path at M = 32 took 66.9-464 (eager do_bench, prefill_paths_h200.json), 2.1x-5.7x
# longer; at M = 64 four calls against the unpack path's M = 64 leave 1.09x (Qwen2.5-7B down), too thin a margin
# across two timers, so slices stop at three (docs/kernel-log.md).
ROW_SLICE = 16  # the largest M the small-M kernels and their configuration choice take
DEQUANT_MIN_M = 3 * ROW_SLICE + 1
# Weights unpacked at a time (512 MiB in bf16: every 7-8B decoder linear in one piece); a larger weight (an LM head)
# goes in slices of a multiple of 256 rows, so each slice's matmul keeps cuBLAS's aligned kernels (an odd N does not).
DEQUANT_CHUNK = 1 << 28


def refresh_choice() -> None:
    """Forget every memoized choice: the tuned cache is read again and each weight's next call without a named
    configuration chooses again (its launch plans for a named configuration stay). CUDA graphs already captured keep
    the launches they recorded."""
    _local_table.cache_clear()
    _select_config.cache_clear()
    for store in (_PLANS, _GATE_UP_PLANS):
        for plans in store.values():
            for key in [key for key in plans if key[-1] is None]:
                del plans[key]


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


_interpreting = interpreting  # a module attribute: a test sets it to keep the compiled kernel, as on a GPU


def kernel_calls() -> int:
    """How many times the INT4 kernel has been launched in this process (for gate-acts tests)."""
    return _CALLS["n"]


def _check_inputs(x: torch.Tensor, w: Int4Weight) -> None:
    # The weight was validated when it was built (Int4Weight.__post_init__); re-validating it here on
    # every call would add host time in front of every launch.
    if not isinstance(w, Int4Weight):
        raise ValueError(f"int4_matmul expects an Int4Weight, got {type(w).__name__}")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"int4_matmul: activations must be fp16, bf16 or fp32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("int4_matmul: x must have at least one dimension [..., K]")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"int4_matmul: x has K={x.shape[-1]} but the weight has in_features={w.in_features}")
    if x.device != w.qweight.device:
        raise ValueError(f"int4_matmul: x is on {x.device} but the weight is on {w.qweight.device}")


@dataclass
class _Plan:
    """Everything about a launch that depends only on (weight, M, x's dtype/strides/alignment, config).

    Built on the first call and kept per weight object (see `_plans_of`). On a GPU the first launch returns
    Triton's compiled kernel; later calls hand the arguments straight to its launcher, skipping Triton's
    per-call binding and specialization (the key below pins every value Triton specializes on), which
    on the H200 host cost ~20 us in front of every GEMV (docs/kernel-log.md, v3)."""

    kernel: triton.runtime.JITFunction
    grid: tuple[int, int, int]
    qw: torch.Tensor  # qweight, or its int32 view for the GEMV words path
    zeros: torch.Tensor  # zero-points, or the scales as a dummy pointer when symmetric
    ints: tuple[int, ...]  # M, N, K, NCOLS, G, k_per_split
    consts: dict  # constexpr arguments, in the kernel's parameter order
    options: dict  # num_warps, num_stages
    split_k: int
    lock_slots: int
    sources: tuple  # (qweight, scales, zeros) it was built from: Int4Weight is mutable, so a call checks them
    extra: tuple = ()  # GEMV: CODE_MAGIC; mma: the residual's, h's and the squares' row strides, the norm's eps
    compiled: object | None = None  # triton CompiledKernel after the first launch (never under the interpreter)
    workspace: torch.Tensor | None = None  # split K: [SPLIT_K, M, N] fp32 partials, allocated once per plan
    before_y: tuple = ()  # after the first launch: the compiled kernel's arguments between x and y ...
    after_y: tuple = ()  # ... and after y (constexpr values included), fixed for the plan
    scales: torch.Tensor | None = None  # the scales the kernel reads where not the weight's own (rows reordered)

    def built_from(self, w: Int4Weight) -> bool:
        q, s, z = self.sources
        return q is w.qweight and s is w.scales and z is w.zeros


@functools.cache
def _constexpr_names(kernel) -> tuple[str, ...]:
    """The kernel's constexpr parameters in order (also for the interpreter's wrapped function)."""
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters.values()
    return tuple(p.name for p in params if "constexpr" in str(p.annotation))


def _fragments(w: Int4Weight, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The weight's codes in fragment order (`int4_mma.pack_fragments`), with the scales and zero-points in the same
    row order: made on first use and kept while the weight lives, beside its byte layout (which the other kernels
    read), as many bytes again as its codes. `gate_up`: rows in `gate_up_order` (the silu * up epilogue's)."""
    entry = _kept_for(_FRAGMENTS, w)
    kept = entry.get(gate_up)
    sources = (w.qweight, w.scales, w.zeros)
    if kept is None or any(a is not b for a, b in zip(kept[0], sources, strict=True)):  # first use, or replaced
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int4_matmul: an mma launch's weight is repacked on its first call, which cannot happen "
                               "inside CUDA-graph capture; run the call once before capturing")
        q, scales, zeros = sources
        if gate_up:
            order = gate_up_order(w.out_features).to(q.device)
            q, scales = q[order], scales[:, order].contiguous()
            zeros = None if zeros is None else zeros[:, order].contiguous()
        kept = entry[gate_up] = (sources, pack_fragments(q, w.in_features), scales, zeros)
    return kept[1:]


class _Epilogue(NamedTuple):
    """The mma kernel's epilogues of one call beyond storing y (see `int4_matmul`), with its tensors as 2-D rows:
    the norm's epsilon, its stream h [M, K] and h's partial sums of squares [M, 2 cdiv(K, 16)], the residual [M, N],
    the output gain [N]."""

    norm_eps: float | None = None
    h2: torch.Tensor | None = None
    r2: torch.Tensor | None = None
    gain: torch.Tensor | None = None
    sq2: torch.Tensor | None = None

    def key(self) -> tuple:
        """What a plan pins of it: the epsilon, which tensors are given, and the row strides it reads them by."""
        return (self.norm_eps, *(None if t is None else t.stride(0) for t in (self.h2, self.r2, self.sq2)),
                self.gain is not None)


NO_EPILOGUE = _Epilogue()


def _plan(x2: torch.Tensor, w: Int4Weight, cfg: Int4KernelConfig, gate_up: bool = False,
          ep: _Epilogue = NO_EPILOGUE) -> _Plan:
    """The launch of `cfg` for this x and weight; mma configurations only: `gate_up`, the fused [gate; up]
    weight's silu * up epilogue, y [M, N/2]; `ep`, the norm, residual and output-gain epilogues (see
    `int4_matmul`)."""
    m, k = x2.shape
    n = w.out_features
    pdl = pdl_on(x2.device)
    if cfg.mma:
        if not mma_supported(x2, w):
            raise ValueError(f"int4_matmul: the mma configuration needs CUDA sm_90+, bf16 x [M <= 16, K] with unit "
                             f"stride and 16-byte aligned rows, N % 16 == 0, K % 128 == 0 and groups of a multiple of "
                             f"128 codes or per channel; got x {x2.dtype} {tuple(x2.shape)} strides {x2.stride()} on "
                             f"{x2.device}, N={n}, group {w.group_size}")
        words, scales, zeros = _fragments(w, gate_up)
        options = {"num_warps": cfg.num_warps, "launch_pdl": pdl}
        if cfg.max_registers is not None:
            options["maxnreg"] = cfg.max_registers
        blocks = cfg.block_n // 16
        norm = ep.norm_eps is not None
        consts = mma_consts(w, cfg.num_warps, m, gate_up, pdl, blocks, cfg.num_stages, norm, ep.r2 is not None,
                            ep.gain is not None, ep.sq2 is not None)
        cap = NORM_REGISTER_CAPS.get((cfg.num_warps, consts["HALVES"], consts["STAGES"], blocks, consts["NORM_ROWS"]))
        if norm and cfg.max_registers is None and cap is not None:
            options["maxnreg"] = cap
        strides = tuple(0 if t is None else t.stride(0) for t in (ep.r2, ep.h2, ep.sq2))
        return _Plan(_int4_mma_gemv_kernel, (triton.cdiv(n // 16, blocks), 1, 1), words,
                     zeros if zeros is not None else scales, (m, n, k), consts, options, 1, 0,
                     (w.qweight, w.scales, w.zeros), (*strides, float(ep.norm_eps) if norm else 0.0), scales=scales)
    if gate_up or ep.key() != NO_EPILOGUE.key():
        raise ValueError("int4_matmul: silu * up, a norm, a residual and an output gain are epilogues of the mma "
                         "kernel only")
    per_channel = w.group_size >= k
    block_k, split_k, k_per_split = _k_tiling(cfg, k, w.group_size)
    n_tiles, m_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    consts = dict(
        GROUP=1 if per_channel else w.group_size,  # unused when PER_CHANNEL: no recompile per K
        PER_CHANNEL=per_channel,
        HAS_ZEROS=w.zeros is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PDL=pdl,
    )
    qw = w.qweight
    # Whole int32 words (8 codes) when rows allow it and the K tile holds whole runs of four words (the GEMV sums
    # runs of 32 codes: _gemv_words_tile), else bytes (2 codes)
    words = k % 8 == 0 and block_k % 32 == 0 and qw.is_contiguous() and qw.data_ptr() % 4 == 0
    # whole tiles only: N a multiple of block_n, the splits covering K exactly in block_k tiles (no masks needed)
    whole_tiles = n % cfg.block_n == 0 and k % block_k == 0 and k_per_split * split_k == k
    # Triton 3.6's interpreter computes bf16 tl.dot wrongly (garbage ~1e10 on a 16x16 product), so under
    # TRITON_INTERPRET the tl.dot kernels' operands go through an fp32 IEEE dot; on the GPU bf16/fp16 use the
    # tensor cores. Everything else in the kernels is the same code on both.
    dot_ieee = x2.dtype == torch.float32 or _interpreting()
    if cfg.gemv:
        qw = qw.view(torch.int32) if words else qw
        kernel, grid = _int4_gemv_kernel, (m_tiles, n_tiles, split_k)
        consts.update(PER_COL=8 if words else 2, EVEN=words and whole_tiles, X_TILE=cfg.x_tile, ROWS=cfg.block_m,
                      STAGES=cfg.num_stages)
        extra = CODE_MAGIC
    elif cfg.swap_ab and (x2.dtype != torch.float32 or x2.device.type != "cuda"):
        # Bytes as they are stored, any K. fp32 activations on a GPU run the bytes tl.dot kernel below with the same
        # tiles: an fp32 dot with a register left operand does not compile for sm_90 in Triton 3.6.
        kernel, grid = _int4_gemm_planes_kernel, (n_tiles, split_k, m_tiles)
        # x's pairs as int32 words: 16-bit x, K even, rows contiguous and 16-byte aligned (the plan key pins all four)
        x_words = (cfg.x_tile and x2.dtype != torch.float32 and k % 2 == 0 and x2.stride(1) == 1
                   and x2.stride(0) % 2 == 0 and x2.data_ptr() % 16 == 0)
        # the scales and zero-points as int32 words where a thread's share of a tile's 2-byte values is under the
        # 4 bytes cp.async takes (BN < 64 per warp; BN 256 with 4 warps already stages them, and the zero-points'
        # pair regrouping would only add 2 barriers a tile there), on wgmma tiles (BN >= 64: at BN 32, group 32,
        # with zero-points, the H200 gives wrong sums on every row: docs/kernel-log.md): 16-bit, N even, 4-byte aligned
        # (Int4Weight guarantees the zero-points share the scales' dtype and layout)
        sz_words = (64 <= cfg.block_n < 64 * cfg.num_warps and n % 2 == 0 and w.scales.element_size() == 2
                    and w.scales.data_ptr() % 4 == 0 and (w.zeros is None or w.zeros.data_ptr() % 4 == 0))
        consts.update(BLOCK_M=cfg.block_m, EVEN=whole_tiles, DOT_IEEE=dot_ieee, STAGES=cfg.num_stages,
                      ASM=x2.device.type == "cuda" and not _interpreting(), X_WORDS=x_words, SZ_WORDS=sz_words)
        extra = ()
    else:
        kernel, grid = _int4_gemm_kernel, (n_tiles, split_k, m_tiles)
        consts.update(BLOCK_M=cfg.block_m, DOT_IEEE=dot_ieee, IS_FP32=x2.dtype == torch.float32)
        extra = ()
    order = _constexpr_names(kernel)
    return _Plan(kernel, grid, qw, w.zeros if w.zeros is not None else w.scales,
                 (m, n, k, qw.shape[1], w.n_groups, k_per_split), {name: consts[name] for name in order},
                 _launch_options(cfg, pdl), split_k, n_tiles * m_tiles,
                 (w.qweight, w.scales, w.zeros), extra)


def _launch_options(cfg: Int4KernelConfig, pdl: bool) -> dict:
    """Triton's compile options for `cfg` (maxnreg only when capped: the interpreter takes no such option), launched
    as a programmatic dependent where `pdl`."""
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    if cfg.max_registers is not None and not _interpreting():
        options["maxnreg"] = cfg.max_registers
    return options


_PLANS: dict[int, dict] = {}  # id(weight) -> {key: _Plan}
_FRAGMENTS: dict[int, dict] = {}  # id(weight) -> {gate_up: (sources, words in fragment order, scales, zeros)}
_GATE_UP_PLANS: dict[int, dict] = {}  # id(weight) -> {key: _Plan, or None where silu * up is composed}


def _kept_for(store: dict[int, dict], w: Int4Weight) -> dict:
    """The dict `store` keeps for one weight object: outside it (deepcopy of a model must not copy compiled kernels or
    derived weights) and dropped when the weight is garbage-collected (before its id can be reused)."""
    entry = store.get(id(w))
    if entry is None:
        entry = store[id(w)] = {}
        weakref.finalize(w, store.pop, id(w), None)
    return entry


def _plan_key(x2: torch.Tensor, config: Int4KernelConfig | None) -> tuple:
    """Everything a plan depends on besides the weight: M (value), x's dtype, strides and 16-byte alignment, whether
    kernels launch as programmatic dependents, and the config asked for (None: the one select_config picks)."""
    return (x2.shape[0], x2.dtype, x2.stride(0), x2.stride(1), x2.data_ptr() % 16 == 0, programmatic_launch(), config)


def _plans_of(w: Int4Weight) -> dict:
    """The launch plans of one weight object."""
    return _kept_for(_PLANS, w)


def _launch(plan: _Plan, x2: torch.Tensor, w: Int4Weight, y: torch.Tensor, ep: _Epilogue = NO_EPILOGUE) -> None:
    """Run `plan` on x2, writing y; `ep`: the tensors of an mma plan's epilogues (their strides pinned by its key)."""
    compiled = plan.compiled
    mma = plan.kernel is _int4_mma_gemv_kernel
    # the mma kernel's r_ptr, h_ptr, g_ptr and sq_ptr: y where the plan reads none
    outs = (y, *(y if t is None else t for t in (ep.r2, ep.h2, ep.gain, ep.sq2))) if mma else (y,)
    # y, r, h, g and sq are the pointers the plan key does not pin: the compiled kernel assumed them 16-byte aligned
    if compiled is not None and all(t.data_ptr() % 16 == 0 for t in outs):
        # Every argument but the pointers is fixed for the plan (its key pins x's, r's and h's strides; y is
        # contiguous):
        # one tuple per call, no per-call stride reads, buffer lookups or constexpr packing.
        stream = triton.runtime.driver.active.get_current_stream(x2.device.index)
        values = (x2, *plan.before_y, *outs, *plan.after_y)
        hook = triton.knobs.runtime.launch_enter_hook
        meta = None if hook is None else compiled.launch_metadata(plan.grid, stream, *values)
        compiled.run(*plan.grid, stream, compiled.function, compiled.packed_metadata, meta, hook,
                     triton.knobs.runtime.launch_exit_hook, *values)
        return
    m, n = plan.ints[0], plan.ints[1]
    if plan.split_k > 1:
        # Kept with the plan (launches on one weight share a stream, as the semaphore buffer already requires):
        # an allocation per call is host time in front of every launch at batch 1.
        ws = plan.workspace
        if ws is None:
            ws = plan.workspace = torch.empty((plan.split_k, m, n), dtype=torch.float32, device=x2.device)
        locks = _SCRATCH.lock_buffer(x2.device, plan.lock_slots)
    else:
        ws = locks = plan.qw  # unused by the kernel without split K: any fixed pointer
    # y's row stride is N: y is a contiguous [M, N] (for M = 1 the stride is never used)
    scales = w.scales if plan.scales is None else plan.scales
    if mma:
        # y: [M, N], [M, N/2] (silu * up), [M, norm_stream_width(N)] (out_gain)
        after_y = (*plan.ints, x2.stride(0), y.shape[1], *plan.extra)
    else:
        after_y = (ws, locks, *plan.ints, x2.stride(0), x2.stride(1), plan.qw.stride(0), n, *plan.extra)
    try:
        result = plan.kernel[plan.grid](x2, plan.qw, scales, plan.zeros, *outs, *after_y, **plan.consts,
                                        **plan.options)
    except Exception as err:  # checked here, off the per-call fast path: Triton's own message names no remedy
        if x2.device.type == "cpu" and not _interpreting():
            raise ValueError("int4_matmul: CPU tensors run only under the Triton interpreter (TRITON_INTERPRET=1, "
                             "set before triton is imported); on a GPU machine move the model and inputs to the GPU"
                             ) from err
        raise
    if not _interpreting() and all(t.data_ptr() % 16 == 0 for t in outs) and hasattr(result, "run"):
        plan.before_y = (plan.qw, scales, plan.zeros)
        plan.after_y = (*after_y, *plan.consts.values())
        plan.compiled = result


def int4_dequantize(w: Int4Weight, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
    """The weight's rows `rows` (step 1) unpacked to `dtype`: [n, K], computed on the weight's device by
    `_int4_dequant_kernel` (the fp32 (code - zero) * scale, rounded once to `dtype`)."""
    if dtype not in _ACT_DTYPES:
        raise ValueError(f"int4_dequantize: dtype must be fp16, bf16 or fp32, got {dtype}")
    r0, r1, step = rows.indices(w.out_features)
    if step != 1:
        raise ValueError(f"int4_dequantize: rows must be a contiguous slice, got step {step}")
    n, k, kb = max(r1 - r0, 0), w.in_features, w.qweight.shape[1]
    out = torch.empty((n, 2 * kb), dtype=dtype, device=w.qweight.device)  # a pad column past an odd K
    if n == 0 or k == 0:
        return out[:, :k]
    per_channel = w.group_size >= k
    block_kb = 64 if per_channel else min(64, w.group_size // 2)  # a tile's codes within one group
    block_n = 32
    scales = w.scales[:, r0:r1]
    zeros = scales if w.zeros is None else w.zeros[:, r0:r1]
    grid = (triton.cdiv(n, block_n), triton.cdiv(kb, block_kb))
    _int4_dequant_kernel[grid](w.qweight[r0:r1], scales, zeros, out, n, kb, w.qweight.stride(0), scales.stride(0),
                               out.stride(0), GROUP=1 if per_channel else w.group_size, PER_CHANNEL=per_channel,
                               HAS_ZEROS=w.zeros is not None, BLOCK_N=block_n, BLOCK_KB=block_kb)
    return out[:, :k]


def _row_slices(x2: torch.Tensor, w: Int4Weight, y: torch.Tensor) -> None:
    """y [M, N] = x2 [M, K] @ dequant(W).T, ROW_SLICE rows at a time through `int4_matmul`'s small-M choice (each
    slice's own M picks its configuration; the last slice takes the remainder)."""
    for r0 in range(0, x2.shape[0], ROW_SLICE):
        int4_matmul(x2[r0 : r0 + ROW_SLICE], w, out=y[r0 : r0 + ROW_SLICE])


def _dequant_matmul(x2: torch.Tensor, w: Int4Weight, y: torch.Tensor) -> None:
    """y [M, N] = x2 [M, K] @ dequant(W).T through cuBLAS, unpacking at most DEQUANT_CHUNK weights at a time."""
    n, k = w.out_features, w.in_features
    rows = max(256, DEQUANT_CHUNK // max(k, 1) // 256 * 256)
    if rows >= n:
        torch.mm(x2, int4_dequantize(w, x2.dtype).T, out=y)
        return
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        y[:, r0:r1] = x2 @ int4_dequantize(w, x2.dtype, slice(r0, r1)).T


def _rows(t: torch.Tensor | None, x: torch.Tensor, width: int, what: str) -> torch.Tensor | None:
    """`t` [..., width] (x's leading dims, dtype and device) as 2-D rows [M, width] with a unit last stride (a view
    where it can be); ValueError naming what differs."""
    if t is None:
        return None
    want = (*x.shape[:-1], width)
    if tuple(t.shape) != want or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"int4_matmul: {what} must be a {x.dtype} tensor of shape {want} on {x.device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _epilogue_of(x: torch.Tensor, n: int, norm_eps: float | None, norm_source: torch.Tensor | None,
                 residual: torch.Tensor | None, out_gain: torch.Tensor | None,
                 norm_squares: torch.Tensor | None = None) -> _Epilogue:
    if (norm_source is not None or norm_squares is not None) and norm_eps is None:
        raise ValueError("int4_matmul: norm_source and norm_squares are the stream of a norm: give norm_eps with them")
    if norm_eps is not None and not 0.0 <= norm_eps < float("inf"):  # rsqrt(mean + eps): a negative eps can reach 0
        raise ValueError(f"int4_matmul: norm_eps must be a finite number >= 0, got {norm_eps!r}")
    if out_gain is not None and (out_gain.shape != (n,) or out_gain.device != x.device):
        raise ValueError(f"int4_matmul: out_gain must be a tensor of shape ({n},) on {x.device}, got "
                         f"{tuple(out_gain.shape)} on {out_gain.device}")
    if out_gain is not None:
        check_squares_dtype(x.dtype, "int4_matmul: out_gain")
    source = x if norm_eps is not None and norm_source is None else norm_source  # the norm of x's own rows
    return _Epilogue(norm_eps, _rows(source, x, x.shape[-1], "norm_source"), _rows(residual, x, n, "residual"),
                     None if out_gain is None else out_gain.to(x.dtype).contiguous(),
                     _rows(norm_squares, x, squares_width(x.shape[-1]), "norm_squares"))


def squares_width(k: int) -> int:
    """Values a row of h's partial sums of squares takes: a (rounded, remainder) pair for each SQUARE_BLOCK values
    of h (the last block padded with zeros)."""
    return 2 * triton.cdiv(k, SQUARE_BLOCK)


def norm_stream_width(n: int) -> int:
    """The width of the stream a projection of N outputs writes with `out_gain`: [h, h * g, h's partial sums of
    squares]."""
    return 2 * n + squares_width(n)


def check_squares_dtype(dtype: torch.dtype, what: str) -> None:
    """ValueError naming `what` for a float16 stream: its range cannot hold the partial sums of squares."""
    if dtype == torch.float16:
        raise ValueError(f"{what}: the norm stream holds partial sums of squares in its dtype, which float16's range "
                         "cannot hold; use bfloat16 or float32")


def row_squares(h: torch.Tensor) -> torch.Tensor:
    """h [..., K] -> the partial sums of squares [..., squares_width(K)] in h's dtype that the mma kernel's
    out_gain epilogue writes: per SQUARE_BLOCK values, s = sum(h^2) in fp32 as the pair (s rounded to h's dtype,
    what that rounding left, rounded), whose sum holds s to twice the dtype's precision (bf16: to 2^-16 of s). A
    norm reading them sums the row: 4 bytes of bf16 for 32 of h."""
    check_squares_dtype(h.dtype, "row_squares")
    hf = h.float()
    pad = -h.shape[-1] % SQUARE_BLOCK
    if pad:
        hf = torch.nn.functional.pad(hf, (0, pad))
    s = hf.square().unflatten(-1, (-1, SQUARE_BLOCK)).sum(-1)  # [..., cdiv(K, 16)] fp32
    hi = s.to(h.dtype)
    return torch.stack([hi, (s - hi.float()).to(h.dtype)], dim=-1).flatten(-2)


def norm_factor(h: torch.Tensor, norm_eps: float, squares: torch.Tensor | None = None) -> torch.Tensor:
    """rsqrt(mean(h^2) + eps) per row, fp32 [..., 1]: from h's partial sums of squares [..., squares_width(K)] where
    given (as the mma kernel reads them; h then gives K alone), else from h [..., K]."""
    if squares is None:
        return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + norm_eps)
    k = h.shape[-1]
    return torch.rsqrt(squares.float().sum(-1, keepdim=True) / k + norm_eps)


def epilogue_max_m(gate_up: bool = False, norm: bool = False) -> int:
    """The most rows for which a launch can take an epilogue (the mma GEMV's): silu * up at M <= 8, the norm at
    M <= NORM_MAX_M, a residual or an output gain at M <= ROW_SLICE. Above it every path composes the epilogue from
    torch ops (`compose_epilogue`)."""
    return min(8 if gate_up else ROW_SLICE, NORM_MAX_M if norm else ROW_SLICE)


def compose_epilogue(y: torch.Tensor, x: torch.Tensor, norm_eps: float | None = None,
                     residual: torch.Tensor | None = None, norm_source: torch.Tensor | None = None,
                     out_gain: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                     norm_squares: torch.Tensor | None = None) -> torch.Tensor:
    """What the mma kernel's epilogues compute, from torch ops on y [..., N] (the product x [..., K] @ W.T, already
    in x's dtype): y * rsqrt(mean(h^2) + eps) per row (h: `norm_source`, else x; from `norm_squares` where given,
    `norm_factor`), rounded to y's dtype, plus a layer's `bias` [N] (which the kernel leaves to torch), plus
    `residual`; with `out_gain`, the stream [that, that * out_gain, its `row_squares`] along the last dim."""
    if norm_eps is not None:
        y = (y.float() * norm_factor(x if norm_source is None else norm_source, norm_eps, norm_squares)).to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    if residual is not None:
        y = y + residual
    if out_gain is not None:
        y = torch.cat([y, (y.float() * out_gain.float()).to(y.dtype), row_squares(y)], dim=-1)
    return y


def int4_matmul(
    x: torch.Tensor, w: Int4Weight, config: Int4KernelConfig | None = None, out: torch.Tensor | None = None, *,
    norm_eps: float | None = None, norm_source: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    out_gain: torch.Tensor | None = None, norm_squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W).T for x [..., K]; returns [..., N] in x's dtype (fp32 accumulation).

    The decoder's RMS norm and residual add in the projections' launches (`sdsie.quant.fuse_norms`): `norm_eps`,
    y = (x @ W.T) * rsqrt(mean(h^2, -1) + eps) per row, h = `norm_source` [..., K] (else x), x being h times the
    norm's gain (so y is the norm's output times W), the mean from `norm_squares` [..., squares_width(K)] where
    given (h's partial sums of squares, `row_squares`, which its producer wrote: the kernel then reads those instead
    of h's row); `residual` [..., N] (x's dtype): y = residual + the product rounded to x's dtype, a linear followed
    by an add; `out_gain` [N]: the output is the next norm's stream [..., norm_stream_width(N)], y, y * out_gain,
    then `row_squares(y)` (not for float16, whose range cannot hold them). These are the mma kernel's epilogues
    where that kernel takes the call (one launch; the norm at M <= 8); every other path computes the product, then
    the same in torch ops (`compose_epilogue`).

    `config` overrides the automatic choice (tests use it to cover every candidate). Without one, M >= DEQUANT_MIN_M
    unpacks the weight to x's dtype (at most DEQUANT_CHUNK weights at a time, a temporary of that size) and runs
    one cuBLAS matmul, and M = ROW_SLICE + 1 .. DEQUANT_MIN_M - 1 runs ROW_SLICE rows at a time through the small-M
    kernels.
    `out`, if given, is a contiguous [M, N] (M = prod of leading dims) tensor of x's dtype to write.
    Empty inputs (any leading dim 0) return an empty [..., N] without launching.
    Launches on one weight are meant for one stream at a time (split K reuses a semaphore buffer).
    First-use cost: choosing a configuration is arithmetic (or a lookup in the local tuned cache that `sdsie
    tune-int4` writes ahead of time; nothing tunes here), memoized per shape; the first launch of each
    configuration (and of the unpack kernel, per group layout and dtype) compiles it with Triton's JIT, which takes
    seconds on a cold Triton cache and is read back from that disk cache in later processes. A decode pays it in its
    first steps, or during CUDA-graph capture; warm up once per shape and M to keep it out of timed or served tokens.
    On sm_90+, bf16 calls of M <= 16 that `mma_config` takes run the tensor-core GEMV (`sdsie.kernels.int4_mma`): the
    first such call on a weight repacks it to fragment order (torch ops on the GPU), which then stays beside the
    weight's bytes, as many bytes again as its codes; that first call cannot happen inside CUDA-graph capture.
    """
    _check_inputs(x, w)
    n, k = w.out_features, w.in_features
    if any(a is not None for a in (norm_eps, residual, out_gain, norm_source, norm_squares)):
        return _fused_matmul(x, w, config, out, _epilogue_of(x, n, norm_eps, norm_source, residual, out_gain,
                                                             norm_squares))
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, k)  # [M, K]; copies only when x cannot be viewed so (strides handled)
    m = x2.shape[0]
    if out is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"int4_matmul: out must be a contiguous {x.dtype} tensor of shape {(m, n)} on {x.device}")
    else:
        y = out
    if m == 0 or n == 0:
        return y if flat else y.reshape(*x.shape[:-1], n)
    # Everything Triton specializes on: M (value), x's dtype, strides and 16-byte alignment, the config (None:
    # the one select_config picks, fixed for M on this weight); the weight's tensors, N, K and the group are
    # fixed for the object the plans live on.
    if config is None and m > ROW_SLICE:
        if m >= DEQUANT_MIN_M:
            _dequant_matmul(x2, w, y)
            _CALLS["n"] += 1
        else:
            _row_slices(x2, w, y)  # counts its own launches
        return y if flat else y.reshape(*x.shape[:-1], n)
    key = _plan_key(x2, config)
    plans = _plans_of(w)
    plan = plans.get(key)
    if plan is None or not plan.built_from(w):
        cfg = config or select_config(m, n, k, x.device, w.group_size)
        if config is None and cfg.mma and not mma_supported(x2, w):  # fp16 or fp32 x, or x's rows misaligned
            cfg = select_config(m, n, k, x.device, w.group_size, allow_mma=False)
        plan = plans[key] = _plan(x2, w, cfg)
    _launch(plan, x2, w, y)
    _CALLS["n"] += 1
    return y if flat else y.reshape(*x.shape[:-1], n)


def _mma_plan(x2: torch.Tensor, w: Int4Weight, config: Int4KernelConfig | None, store: dict, key: tuple,
              gate_up: bool = False, ep: _Epilogue = NO_EPILOGUE) -> _Plan | None:
    """The mma plan of an epilogue only that kernel has (silu * up, a norm, a residual, an output gain), kept in `store`
    under `key`; None (decided once) where another kernel takes the call and the epilogue is composed."""
    plan = store.get(key)
    if key in store and (plan is None or plan.built_from(w)):
        return plan
    plan = None
    m = x2.shape[0]
    most = epilogue_max_m(gate_up, ep.norm_eps is not None)  # beyond: composed
    if 1 <= m <= most and x2.is_cuda and (config is None or config.mma):
        cfg = config or select_config(m, w.out_features, w.in_features, x2.device, w.group_size)
        if cfg.mma and mma_supported(x2, w):
            plan = _plan(x2, w, cfg, gate_up, ep)
    if plan is None and config is not None and config.mma and m <= most:
        what = "int4_silu_mul" if gate_up else "int4_matmul"
        raise ValueError(f"{what}: the mma configuration needs M <= {most} and what "
                         f"int4_matmul's mma launch needs; got x {x2.dtype} {tuple(x2.shape)} on {x2.device}, "
                         f"N={w.out_features}")
    store[key] = plan
    return plan


_FUSED_PLANS: dict[int, dict] = {}  # id(weight) -> {key: _Plan, or None where the norm/residual is composed}


def _fused_matmul(x: torch.Tensor, w: Int4Weight, config: Int4KernelConfig | None, out: torch.Tensor | None,
                  ep: _Epilogue) -> torch.Tensor:
    """`int4_matmul` with epilogues: one mma launch where that kernel takes the call."""
    if out is not None:
        raise ValueError("int4_matmul: out is not taken with a norm, a residual or an output gain (the output is a "
                         "new tensor)")
    n, k = w.out_features, w.in_features
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    m = x2.shape[0]
    width = norm_stream_width(n) if ep.gain is not None else n
    key = (*_plan_key(x2, config), *ep.key())
    plan = None if m == 0 or n == 0 else _mma_plan(x2, w, config, _kept_for(_FUSED_PLANS, w), key, ep=ep)
    if plan is None:
        y = compose_epilogue(int4_matmul(x2, w, config), x2, ep.norm_eps, ep.r2, ep.h2, ep.gain, norm_squares=ep.sq2)
    else:
        y = torch.empty((m, width), dtype=x.dtype, device=x.device)
        _launch(plan, x2, w, y, ep)
        _CALLS["n"] += 1
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], width)


def silu_mul_halves(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [gate; up] output y [..., N] (gate the first N/2), in y's dtype: the composed form
    of what `int4_silu_mul`'s epilogue computes, for every path that does not run it."""
    gate, up = y.split(y.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def int4_silu_mul(x: torch.Tensor, w: Int4Weight, config: Int4KernelConfig | None = None, *,
                  norm_eps: float | None = None, norm_source: torch.Tensor | None = None,
                  norm_squares: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for a fused [gate; up] weight (rows 0 .. N/2 - 1 the gate's, then the up's), x [..., K] ->
    [..., N/2] in x's dtype: a gated MLP's activation in the projection's launch.

    Where `int4_matmul` would run the mma kernel at M <= 8 (or `config` names an mma configuration), one launch whose
    epilogue takes silu(gate) * up in fp32 from the fp32 sums (its first call on a weight keeps a copy of the codes
    in `gate_up_order`); elsewhere (M = 9-16 included) `int4_matmul` with `config`, then torch's silu and product in
    x's dtype. `norm_eps`, `norm_source`, `norm_squares`: the RMS norm after the product, before silu (as
    `int4_matmul`'s)."""
    _check_inputs(x, w)
    n, k = w.out_features, w.in_features
    if n % 2:
        raise ValueError(f"int4_silu_mul: a fused [gate; up] weight has an even N, got N = {n}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    ep = _epilogue_of(x, n, norm_eps, norm_source, None, None, norm_squares)
    key = (*_plan_key(x2, config), *ep.key())
    plan = _mma_plan(x2, w, config, _kept_for(_GATE_UP_PLANS, w), key, gate_up=True, ep=ep)
    if plan is None:
        return silu_mul_halves(int4_matmul(x, w, config, norm_eps=norm_eps, norm_source=norm_source,
                                           norm_squares=norm_squares))
    y = torch.empty((m, n // 2), dtype=x.dtype, device=x.device)
    _launch(plan, x2, w, y, ep)
    _CALLS["n"] += 1
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n // 2)
