"""INT4 kernel reproduction suite (GPU): latency, bandwidth, bytes moved, power and energy.

Everything is measured side by side in one process: cuBLAS bf16 (`F.linear`), torch's tinygemm
INT4 (`torch.ops.aten._weight_int4pack_mm`, the same quantized weights) and our Triton kernel.
Latency is `triton.testing.do_bench` with L2 flushed between calls (raw samples kept, medians
reported). Power and energy come from NVML windows of back-to-back calls long enough for the
energy counter, rotating over enough weight copies that nothing is served from L2.

Run: `python -m reproductions.kernels.int4_bench [--out DIR] [--sweep]` or through
`pytest reproductions/test_kernel_int4.py -m gpu`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sdsie.int4_format import Int4Weight, pack_int4
from sdsie.kernels import Int4KernelConfig, candidate_configs, int4_matmul, int4_matmul_reference, select_config
from sdsie.kernels.int4_config import parse_shape
from sdsie.kernels.int4_tune import CORRECT_REL_ERROR, choice_configs, config_name, fits, rel_error
from sdsie.stats import geomean
from sdsie.telemetry.energy import calls_to_fill
from sdsie.telemetry.timing import graph_us, l2_busting_copies

# Llama-3.1-8B linear shapes, N x K (out x in)
LLAMA_SHAPES: dict[str, tuple[int, int]] = {
    "qkv_o_4096x4096": (4096, 4096),
    "kv_1024x4096": (1024, 4096),
    "gate_up_14336x4096": (14336, 4096),
    "down_4096x14336": (4096, 14336),
    "lm_head_128256x4096": (128256, 4096),
}
M_VALUES = (1, 2, 4, 8, 16)
GROUPS = (128, None)  # None = per output channel
CLAIM_IDS = ["kernel-bandwidth-reduction", "kernel-latency", "kernel-latency-us", "kernel-power"]


def shape_dims(text: str) -> tuple[int, int] | None:
    """(N, K) of a name of LLAMA_SHAPES or of NxK (`parse_shape`); None for anything else."""
    if text in LLAMA_SHAPES:
        return LLAMA_SHAPES[text]
    try:
        return parse_shape(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Case:
    shape: str
    n: int
    k: int
    m: int
    group: int | None


def random_int4(n: int, k: int, group: int | None, device: str, gen: torch.Generator) -> Int4Weight:
    """Asymmetric INT4 weights with bf16 scales/zero-points (the layout real checkpoints get)."""
    g = k if group is None else group
    groups = -(-k // g)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(groups, n, generator=gen) + 0.5) * 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(torch.bfloat16)
    return Int4Weight(pack_int4(q).to(device), scales.to(device), zeros.to(device), k, g)


def bytes_moved_int4(w: Int4Weight, m: int, act_bytes: int = 2) -> int:
    """Bytes a GEMV/GEMM must move at least: packed weights, scales, zero-points, x and y."""
    return w.nbytes() + m * w.in_features * act_bytes + m * w.out_features * act_bytes


def bytes_moved_bf16(n: int, k: int, m: int) -> int:
    return 2 * n * k + 2 * m * k + 2 * m * n


def tinygemm_pack(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same weights in tinygemm's format; None if this torch has no tinygemm for them.

    tinygemm dequantizes as (q - 8) * s + b; ours is (q - z) * s, so b = (8 - z) * s.
    """
    if w.group_size not in (32, 64, 128, 256) or w.zeros is None:
        return None
    q = w.codes().to(torch.int32)  # [N, K]
    packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # tinygemm: high nibble = even k
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8.contiguous(), 8)
    s = w.scales.to(torch.bfloat16)
    b = ((8.0 - w.zeros.float()) * w.scales.float()).to(torch.bfloat16)
    scales_and_zeros = torch.stack([s, b], dim=-1).contiguous()  # [G, N, 2]
    return packed, scales_and_zeros


def bench(fn: Callable[[], object], rep_ms: int = 200) -> list[float]:
    """Raw do_bench samples in microseconds (L2 flushed before every call)."""
    from triton.testing import do_bench

    times_ms = do_bench(fn, warmup=max(10, rep_ms // 8), rep=rep_ms, return_mode="all")
    return [t * 1e3 for t in times_ms]


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    us = statistics.median(bench(lambda: dst.copy_(src)))
    return 2 * nbytes / (us * 1e-6) / 1e9  # read + write


def spread(samples: list[float]) -> dict:
    """min, p10, p90 and count of timing samples. One sample (a call longer than the timing window) is its own p10
    and p90: a sweep keeps that configuration's figures rather than failing on it."""
    if not samples:
        raise ValueError("spread: no timing samples")
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else samples * 9
    return {"min": min(samples), "p10": q[0], "p90": q[-1], "n": len(samples)}


def latency_case(case: Case, gen: torch.Generator, device: str, copy_gbs: float,
                 configs: list[Int4KernelConfig] | None = None, rep_ms: int = 200, keep_samples: bool = True,
                 graphed: bool = False) -> dict:
    """Median latencies of bf16, tinygemm and our kernel (auto config, or each of `configs`); with `graphed`,
    each config is also timed under CUDA graphs (`graph_us_by_config`), which is what a sweep ranks by.
    (`graph_us`, a record's bf16/tinygemm/INT4 graphed times, is `graph_case`'s.)"""
    w = random_int4(case.n, case.k, case.group, device, gen)
    w_bf16 = w.dequantize(torch.float32).to(torch.bfloat16)  # [N, K], the same weights in bf16
    x = torch.randn(case.m, case.k, generator=gen).to(torch.bfloat16).to(device)
    ref = int4_matmul_reference(x, w)
    out: dict = {"case": asdict(case), "samples_us": {}, "spread_us": {}, "median_us": {}, "errors": {}}

    def record(name: str, fn: Callable[[], torch.Tensor]) -> None:
        y = fn()  # outputs are checked during performance runs, not only in tests
        out["errors"][name] = rel_error(y, ref)
        samples = bench(fn, rep_ms)
        out["median_us"][name] = statistics.median(samples)
        if keep_samples:
            out["samples_us"][name] = samples
        else:  # a sweep keeps the spread, not thousands of raw samples per configuration
            out["spread_us"][name] = spread(samples)
        if name != "bf16" and out["median_us"][name] > 4 * out["median_us"].get("bf16", float("inf")):
            print(f"slow: {name} {out['median_us'][name]:.1f} us on {case}", flush=True)

    record("bf16", lambda: F.linear(x, w_bf16))
    try:
        tg = tinygemm_pack(w)
        if tg is not None:
            packed, sz = tg
            record("tinygemm", lambda: torch.ops.aten._weight_int4pack_mm(x, packed, w.group_size, sz))
    except RuntimeError as err:  # a torch without tinygemm for this GPU/shape: say so in the record
        out["tinygemm_error"] = str(err)[:300]
    # the weight's group picks the tuned entry, as in int4_matmul (without it a lookup reads the per-channel key and
    # a record would name the heuristic's config for every grouped M > 1 case, not the one that ran)
    out["auto_config"] = asdict(select_config(case.m, case.n, case.k, x.device, case.group))
    record("int4", lambda: int4_matmul(x, w))
    out["configs"] = {}
    if graphed and configs:  # weight copies to rotate through, > 4x L2 in all (see graph_us)
        rotation = [w] + [random_int4(case.n, case.k, case.group, device, gen)
                          for _ in range(l2_busting_copies(device, case.n * case.k // 2) - 1)]
    for cfg in configs or []:
        if not fits(cfg, case.m):
            continue
        name = config_name(cfg)
        out["configs"][name] = asdict(cfg)
        record(name, lambda cfg=cfg: int4_matmul(x, w, config=cfg))
        if graphed:  # what a graphed decode step gets: the kernel alone, weights not in L2
            out.setdefault("graph_us_by_config", {})[name] = graph_us(
                lambda i, cfg=cfg: (lambda: int4_matmul(x, rotation[i % len(rotation)], config=cfg)),
                case.n * case.k // 2, device)
    moved = bytes_moved_int4(w, case.m)
    out["bytes_int4"] = moved
    out["bytes_bf16"] = bytes_moved_bf16(case.n, case.k, case.m)
    out["bytes_reduction_pct"] = 100.0 * (1 - moved / out["bytes_bf16"])
    med = out["median_us"]
    out["speedup_vs_bf16"] = med["bf16"] / med["int4"]
    out["int4_bandwidth_gbs"] = moved / (med["int4"] * 1e-6) / 1e9
    out["int4_pct_of_copy"] = 100.0 * out["int4_bandwidth_gbs"] / copy_gbs
    out["bf16_bandwidth_gbs"] = out["bytes_bf16"] / (med["bf16"] * 1e-6) / 1e9
    if "tinygemm" in med:
        out["speedup_vs_tinygemm"] = med["tinygemm"] / med["int4"]
    return out


def weight_rotation(case: Case, gen: torch.Generator, device: str) -> tuple[list[Int4Weight], list[torch.Tensor]]:
    """INT4 weight copies covering > 4x L2 (graph_us cycles through them so none is read from L2), and bf16
    copies of the same shape (as many, at most 16: each is 4x the bytes)."""
    n, k = case.n, case.k
    copies = l2_busting_copies(device, n * k // 2)
    ws = [random_int4(n, k, case.group, device, gen) for _ in range(copies)]
    wb = [torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device) for _ in range(min(copies, 16))]
    return ws, wb


def graph_case(case: Case, gen: torch.Generator, device: str) -> dict:
    """bf16, tinygemm and INT4 per-call times under CUDA graphs (no host overhead), L2-cold weights."""
    n, k, m = case.n, case.k, case.m
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    ws, wb = weight_rotation(case, gen, device)
    out = {"int4": graph_us(lambda i: (lambda: int4_matmul(x, ws[i % len(ws)])), n * k // 2, device)}
    out["bf16"] = graph_us(lambda i: (lambda: F.linear(x, wb[i % len(wb)])), 2 * n * k, device)
    out["copy"] = copy_graph_us(bytes_moved_int4(ws[0], m), device)
    try:
        packs = [tinygemm_pack(w) for w in ws[:32]]
        if packs[0] is not None:
            out["tinygemm"] = graph_us(lambda i: (lambda: torch.ops.aten._weight_int4pack_mm(
                x, packs[i % len(packs)][0], case.group, packs[i % len(packs)][1])), n * k // 2, device)
    except RuntimeError as err:
        out["tinygemm_error"] = str(err)[:200]
    return out


COPY_ALIGN = 4096  # bytes: a graphed device-to-device copy of another size takes a slower path (docs/kernel-log.md)


def cuda_missing(tool: str) -> bool:
    """True, after saying so on stderr, when this machine has no CUDA device: the GPU tools then exit with 2."""
    if torch.cuda.is_available():
        return False
    print(f"{tool} needs a CUDA GPU; torch.cuda.is_available() is False", file=sys.stderr)
    return True


def copy_half_bytes(nbytes: int) -> int:
    """The size of each buffer of a copy moving `nbytes` (read + write), rounded up to a multiple of COPY_ALIGN.
    On the H200 the graphed copies whose size is a multiple of 4 KiB run at ~4 TB/s and those that are not (the
    M = 1 cases, 256-2048-byte multiples) 1.3-1.5x slower, allocation ruled out by graph_floor_probe: the memcpy's
    own path, not the memory's rate (docs/kernel-log.md). The rounding adds under 4 KiB."""
    if nbytes < 1:
        raise ValueError(f"copy_half_bytes: a copy must move at least 1 byte, got {nbytes}")
    return -(-max(1, nbytes // 2) // COPY_ALIGN) * COPY_ALIGN


def copy_buffers(half: int, device: str, max_copies: int = 64) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Source buffers of `half` random bytes, enough to cover > 4x L2 (at most `max_copies`), and one destination: a
    copy moves 2 * half."""
    srcs = [torch.empty(half, dtype=torch.uint8, device=device).random_(0, 255)
            for _ in range(l2_busting_copies(device, half, hi=max_copies))]
    return srcs, torch.empty(half, dtype=torch.uint8, device=device)


def copy_time_us(srcs: list[torch.Tensor], dst: torch.Tensor, device: str, reps: int = 20) -> float:
    """Graphed per-call time of dst.copy_(src), cycling over srcs (L2-cold)."""
    return graph_us(lambda i: (lambda: dst.copy_(srcs[i % len(srcs)])), dst.numel(), device, reps,
                    max_copies=len(srcs))


def copy_graph_us(nbytes: int, device: str, reps: int = 20, max_copies: int = 64) -> float:
    """Graphed per-call time of a device-to-device copy moving `nbytes` (read + write, as copy_bandwidth_gbs
    counts them; the size rounded up to COPY_ALIGN), L2-cold like the matmuls beside it: 100% of copy bandwidth for
    a call of that many bytes under the same timer, its per-kernel floor included, which a 1 GiB copy's rate leaves
    out for small shapes."""
    return copy_time_us(*copy_buffers(copy_half_bytes(nbytes), device, max_copies), device, reps)


def host_us_per_call(fn: Callable[[], object], calls: int = 200, reps: int = 5) -> float:
    """Host time to enqueue one call: `calls` back-to-back launches with no synchronization inside, median over
    `reps`. At batch 1 the kernels are shorter than this, so it is the rate a host-bound caller gets, and the
    time do_bench counts whenever it exceeds the cache flush in front of the call (docs/kernel-log.md, v2)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_case(case: Case, gen: torch.Generator, device: str) -> dict[str, float]:
    """Host microseconds per eager call: bf16 F.linear, tinygemm and int4_matmul on the same x."""
    x = torch.randn(case.m, case.k, generator=gen).to(torch.bfloat16).to(device)
    w = random_int4(case.n, case.k, case.group, device, gen)
    wb = torch.randn(case.n, case.k, generator=gen).to(torch.bfloat16).to(device)
    out = {"bf16": host_us_per_call(lambda: F.linear(x, wb)), "int4": host_us_per_call(lambda: int4_matmul(x, w))}
    try:
        tg = tinygemm_pack(w)
        if tg is not None:
            out["tinygemm"] = host_us_per_call(lambda: torch.ops.aten._weight_int4pack_mm(x, tg[0], case.group, tg[1]))
    except RuntimeError:
        pass  # latency_case already records why tinygemm cannot run here
    return out


def energy_case(n: int, k: int, device: str, gen: torch.Generator, meter, window_s: float = 1.5) -> dict:
    """Power and energy per call for bf16 vs INT4 at M=1, interleaved, L2-busting weight rotation."""
    ws = [random_int4(n, k, 128, device, gen) for _ in range(l2_busting_copies(device, n * k // 2, lo=1))]
    wb = [torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device)
          for _ in range(l2_busting_copies(device, 2 * n * k, lo=1, hi=16))]
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(device)
    variants = {"bf16": lambda i: F.linear(x, wb[i % len(wb)]), "int4": lambda i: int4_matmul(x, ws[i % len(ws)])}
    result: dict = {"n": n, "k": k, "trials": {}}
    for _trial in range(3):  # interleave variants; back-to-back trials drift with heat
        for name, fn in variants.items():
            # calibrate the number of calls to fill the window
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(200):
                fn(i)
            torch.cuda.synchronize()
            per_call = (time.perf_counter() - t0) / 200
            calls = calls_to_fill(per_call, window_s, minimum=200)
            win = meter.start()
            for i in range(calls):
                fn(i)
            res = meter.stop(win)
            result["trials"].setdefault(name, []).append(
                {"calls": calls, "energy_j": res.energy_j, "duration_s": res.duration_s,
                 "mean_power_w": res.mean_power_w, "uj_per_call": 1e6 * res.energy_j / calls,
                 "us_per_call": 1e6 * res.duration_s / calls, "backend": res.backend,
                 "start_state": res.start_state, "end_state": res.end_state}
            )
    for name, trials in result["trials"].items():
        result[f"{name}_power_w"] = statistics.median(t["mean_power_w"] for t in trials)
        result[f"{name}_uj_per_call"] = statistics.median(t["uj_per_call"] for t in trials)
    result["power_change_pct"] = 100.0 * (result["int4_power_w"] / result["bf16_power_w"] - 1)
    result["energy_per_call_change_pct"] = 100.0 * (result["int4_uj_per_call"] / result["bf16_uj_per_call"] - 1)
    return result


# Tuned buckets timed by --sweep. M = 8 is one: the untuned heuristic ran it at 0.43-0.83x of bf16 (record
# 22f3a099); K+1 = 6-token verification forwards land in that bucket.
SWEEP_M = (1, 2, 4, 8, 16)


# (block_n, block_k, split_k, num_warps) of the wide programs (sweep_configs), all one-row, num_stages 1
WIDE_PROGRAMS = ((8, 4096, 1, 16), (16, 4096, 1, 16), (4, 4096, 1, 8), (8, 2048, 1, 8), (8, 2048, 2, 8),
                 (16, 2048, 1, 8), (8, 1024, 4, 4), (16, 1024, 4, 4))


def sweep_configs() -> list[Int4KernelConfig]:
    """A wider grid than the shipped candidates, for tuning runs (--sweep). Kept to ~70 configurations:
    every one is compiled per specialization, and compilation dominates a sweep."""
    cfgs = [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=4)
            for bn, bk in ((64, 256), (128, 128), (128, 256), (256, 128), (256, 256)) for sk in (1, 2, 4, 8)]
    cfgs += [Int4KernelConfig(1, bn, 256, split_k=sk, num_warps=8) for bn in (128, 256) for sk in (1, 2, 4)]
    cfgs += [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=2)
             for bn, bk in ((32, 256), (64, 128), (64, 256)) for sk in (2, 4, 8)]
    # Word tiles through Triton's cp.async pipeline, 2-3 tiles in flight: offline PTX 4.60-4.66 loop
    # instructions per code and 2 barriers per tile, against 4.87 and 6 with the one-tile register prefetch.
    # (The x-gather variant at M = 1 lost to the tile on all 10 M = 1 cases of kernel_sweep_v3_h200.json: out.)
    cfgs += [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=4, num_stages=3)
             for bn, bk in ((64, 256), (128, 256), (256, 128)) for sk in (1, 2, 4, 8)]
    cfgs += [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=4, num_stages=4)
             for bn, bk, sk in ((128, 256, 1), (128, 256, 2), (256, 128, 1))]
    cfgs += [Int4KernelConfig(1, 256, 256, split_k=1, num_warps=8, num_stages=3)]
    # More K splits for the small shapes: at split 8 the 1024x4096 GEMV is 128 programs of two tiles and
    # took 5.3 us graphed where a graphed copy of its bytes took 2.0-2.3 us and tinygemm 4.7; split 16 or 32 gives each
    # program one tile (more loads in flight, a shorter chain before the partial sums), at the cost of more partials.
    cfgs += [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=w)
             for bn, bk, w in ((32, 256, 2), (64, 256, 2), (64, 256, 4), (128, 256, 4), (64, 128, 2), (128, 128, 4))
             for sk in (16, 32) if not (bk == 256 and sk == 32)]
    # The K tile split across warps (docs/kernel-log.md): BK 512 at BN 64 and BK 1024 at BN 32
    # keep the tuned loop's 256 codes and 32 x values per thread (offline SASS 3.65 and 3.93 per code against 3.57,
    # 4 and 26 barriers per tile against 2) with two and four warps along K instead of all four along N, so a program
    # covers the same bytes per tile with fewer rows: gate_up fills 224 programs without a K split (no partial sums,
    # no semaphore), the LM head 2004. BN 128 BK 512 with 8 warps is the tuned loop with twice the warps.
    cfgs += [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=4, num_stages=p)
             for bn, bk in ((64, 512), (32, 1024)) for sk in (1, 2, 4) for p in (3, 4)]
    cfgs += [Int4KernelConfig(1, 128, 512, split_k=sk, num_warps=8, num_stages=4) for sk in (1, 2)]
    # Wide programs for the latency-bound small shapes. Every one-row configuration above gives a thread
    # 256 codes: on 1024x4096 that is 512 warps for 528 schedulers, each running a chain of about 1,000 instructions,
    # and then (split 16) a semaphore epilogue. Here 8-16 warps share one program's K range, a thread holds 64-128
    # codes and the program reduces across its warps, with no K split or a short one: more warps and shorter chains,
    # paid for in instructions, since a thread's x conversions now serve 1-2 rows (offline SASS 4.2-6.5 per code
    # against 3.4-3.9). num_stages 1 names the family; its loop is the register-prefetch one (stages <= 2).
    cfgs += [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=w, num_stages=1) for bn, bk, sk, w in WIDE_PROGRAMS]
    cfgs += [Int4KernelConfig(16, bn, bk, split_k=sk, num_warps=4)
             for bn in (64, 128) for bk in (64, 128) for sk in (1, 4)]
    cfgs += [Int4KernelConfig(16, 32, 128, split_k=4, num_warps=4)]
    # GEMV programs of 2 and 4 rows: offline PTX counts 3.24 and 2.44 loop instructions per code and
    # row against 4.84 for one row, and one weight stream per program instead of one per row
    cfgs += [Int4KernelConfig(rows, bn, bk, split_k=sk, num_warps=4)
             for rows in (2, 4) for bn, bk in ((128, 256), (256, 128)) for sk in (1, 4)]
    cfgs += [Int4KernelConfig(rows, 64, 256, split_k=sk, num_warps=2) for rows in (2, 4) for sk in (4, 8)]
    cfgs += [Int4KernelConfig(4, 128, 256, split_k=sk, num_warps=4, x_tile=False) for sk in (1, 4)]
    cfgs += [Int4KernelConfig(rows, 128, 256, split_k=sk, num_warps=4, num_stages=3)
             for rows in (2, 4) for sk in (1, 4)]
    # Weights as the wgmma's left operand (swap_ab: the planes kernel, faster than a words kernel and its one_dot
    # form, docs/kernel-log.md): the weights' bytes as they are stored, low and high nibbles two dots per tile
    # against x's even and odd columns, dequantized in the wgmma's register layout by inline PTX (no round trip of the
    # codes through shared memory). Offline 2.6-3.3 SASS per code for all 16 rows (one_dot: 3.5-4.1); BN 512 with 8
    # warps is the leanest, BN 256 with 4 warps spills a few registers. Timed at M = 1 too: 16 rows cost it no more.
    cfgs += [Int4KernelConfig(16, bn, 128, split_k=sk, num_warps=w, num_stages=3, swap_ab=True)
             for bn, w, splits in ((128, 4, (1, 4, 8, 16)), (256, 8, (1, 4, 8)), (512, 8, (1, 4, 8)), (256, 4, (4,)))
             for sk in splits]
    cfgs += [Int4KernelConfig(16, 256, 128, split_k=sk, num_warps=8, num_stages=4, swap_ab=True)
             for sk in (1, 4)]
    # The first planes sweep (M = 1 and 16) picked BN 128-256 with 4 warps, 167-255 registers a thread: the register
    # operand of a [BN, 64]-byte tile's two dots alone is BN / 2 registers. BK 64 halves it (gemm_sass_probe: 122
    # registers at BN 128 with 4 warps, 128 at BN 256 with 8, so 16 warps an SM instead of 8-12) for 3.6-3.9 SASS per
    # code instead of 3.0-3.3; BN 64 at BK 128 keeps 95 registers (20 warps) at 4.8.
    cfgs += [Int4KernelConfig(16, 128, 64, split_k=sk, num_warps=4, num_stages=p, swap_ab=True)
             for sk in (4, 8, 16) for p in (3, 4)]
    cfgs += [Int4KernelConfig(16, 256, 64, split_k=sk, num_warps=8, num_stages=4, swap_ab=True)
             for sk in (1, 4, 8)]
    cfgs += [Int4KernelConfig(16, 64, 128, split_k=sk, num_warps=4, num_stages=3, swap_ab=True)
             for sk in (8, 16)]
    # x's pairs read as int32 words through cp.async (X_WORDS) took the loop's last global loads off its
    # critical path and its spills with them (BN 256, 4 warps: 2.6 SASS per code, no local memory), so a fourth
    # stage may now pay where a tile waited on x before.
    cfgs += [Int4KernelConfig(16, bn, 128, split_k=sk, num_warps=4, num_stages=4, swap_ab=True)
             for bn, splits in ((64, (8, 16)), (128, (4, 8)), (256, (4,))) for sk in splits]
    # ... but beside the kernel without them in one run (ab_20261201T0148_xwords_h200.json) 1024x4096 at M = 4 was 4%
    # slower with the words, on a tile whose programs run two K tiles each: the gathers again (x_tile=False), for a
    # sweep to judge.
    cfgs += [Int4KernelConfig(16, 64, 128, split_k=sk, num_warps=4, num_stages=3, x_tile=False, swap_ab=True)
             for sk in (8, 16)]
    return cfgs


REGISTER_CAPS = (None, 128, 96, 80, 64)  # ptxas register caps (Int4KernelConfig.max_registers) a regcap sweep tries


def register_cap_configs() -> list[Int4KernelConfig]:
    """The register-cap sweep: the one-row GEMV configurations the M = 1 table and rule use, and more-parallel ones
    (K splits, BN 64), each at every cap in REGISTER_CAPS; two-row GEMV and planes configurations for M = 2 at three.
    The M = 1 GEMV holds 160 registers a thread, so an SM runs at most 12 of its warps, and under Nsight Compute it
    issued on half its cycles for lack of warps (docs/kernel-log.md); a cap buys warps with spills. No cap (None) is
    timed beside each so the comparison is within one run."""
    one_row = [Int4KernelConfig(1, bn, bk, split_k=sk, num_warps=w, num_stages=p)
               for bn, bk, sk, w, p in ((32, 1024, 1, 4, 3), (64, 512, 1, 4, 3), (128, 256, 1, 4, 3),
                                        (128, 256, 4, 4, 3), (8, 2048, 1, 8, 1), (128, 256, 2, 4, 4),
                                        (64, 256, 2, 4, 3), (64, 256, 4, 4, 3))]
    two_rows = [Int4KernelConfig(2, 128, 256, split_k=sk, num_warps=4, num_stages=3) for sk in (1, 4)]
    planes = [Int4KernelConfig(16, bn, 128, split_k=sk, num_warps=4, num_stages=p, swap_ab=True)
              for bn, sk, p in ((128, 4, 4), (128, 1, 3), (64, 8, 3), (256, 4, 3))]
    cfgs = [dataclasses.replace(c, max_registers=r) for c in one_row for r in REGISTER_CAPS]
    cfgs += [dataclasses.replace(c, max_registers=r) for c in two_rows + planes for r in REGISTER_CAPS[:3]]
    return cfgs


# --sweep-set: which configurations a sweep times
SWEEP_SETS = {"full": sweep_configs, "regcap": register_cap_configs, "choice": choice_configs}


def focus_configs(configs: list[Int4KernelConfig], only: list[str] | None) -> list[Int4KernelConfig]:
    """The configurations whose sweep names (config_name) contain one of `only` (all when None)."""
    if only is None:
        return configs
    kept = [c for c in configs if any(s in config_name(c) for s in only)]
    if not kept:
        raise ValueError(f"--only {only} matches no sweep configuration (names look like {config_name(configs[0])})")
    return kept


def with_incumbent(configs: list[Int4KernelConfig], incumbent: Int4KernelConfig) -> list[Int4KernelConfig]:
    """`configs` plus the configuration the installed table or heuristic picks for the case, timed beside them:
    a focused sweep must beat what users get now, measured in the same run, before it replaces it."""
    return configs if incumbent in configs else [incumbent, *configs]


def merge_tuned(installed: dict, swept: dict) -> dict:
    """The installed table ({device: {key: config}}) with the swept keys replaced: a focused sweep (--m, --only)
    measures some cases only, and the others keep their earlier sweep's choice."""
    merged = {dev: dict(table) for dev, table in installed.items()}
    for dev, table in swept.items():
        merged.setdefault(dev, {}).update(table)
    return merged


def run_suite(out_dir: Path, sweep: bool = False, energy: bool = True, write_record: bool = True,
              sweep_m: tuple[int, ...] = SWEEP_M, only: list[str] | None = None) -> dict:
    """The record suite, or with `sweep` the tuning sweep: every sweep configuration at every SWEEP_M case,
    or a focused one (`sweep_m`, `only`) whose cases are timed beside their incumbent configuration and whose
    table is merged into the installed one."""
    from sdsie.kernels.int4_config import tuned_path
    from sdsie.telemetry.energy import EnergyMeter
    from sdsie.telemetry.records import RunRecord, capture_environment
    from sdsie.telemetry.records import write_record as write

    device = "cuda"
    gen = torch.Generator().manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(device)
    focused = sweep and (only is not None or tuple(sweep_m) != SWEEP_M)
    configs = focus_configs(sweep_configs(), only) if sweep else []
    cases = [Case(s, n, k, m, g) for s, (n, k) in LLAMA_SHAPES.items() for g in GROUPS for m in M_VALUES
             if (m == 1 or g == 128) and (m in sweep_m or not sweep)]
    results = []
    for c in cases:
        if sweep:
            timed = with_incumbent(configs, select_config(c.m, c.n, c.k, torch.device(device), c.group)) \
                if focused else configs
            r = latency_case(c, gen, device, copy_gbs, timed, rep_ms=10, keep_samples=False, graphed=True)
        else:  # the record times what a user gets: the automatic choice
            r = latency_case(c, gen, device, copy_gbs, rep_ms=50)
        results.append(r)
        print(f"{c.shape:22s} m={c.m:2d} g={c.group} bf16={r['median_us']['bf16']:8.1f}us "
              f"int4={r['median_us']['int4']:8.1f}us x{r['speedup_vs_bf16']:.2f} "
              f"{r['int4_pct_of_copy']:.0f}%copy tg={r['median_us'].get('tinygemm', float('nan')):.1f}",
              flush=True)
    if not sweep:
        for r in results:
            c = Case(**r["case"])
            if c.m in (1, 16):
                r["graph_us"] = graph_case(c, gen, device)
                times = " ".join(f"{k}={v:.1f}us" for k, v in r["graph_us"].items() if isinstance(v, float))
                print(f"graph {c.shape:22s} m={c.m:2d} g={c.group} {times}", flush=True)
            if c.m == 1:
                r["host_us"] = host_case(c, gen, device)
                times = " ".join(f"{k}={v:.1f}us" for k, v in r["host_us"].items())
                print(f"host  {c.shape:22s} m={c.m:2d} g={c.group} {times}", flush=True)
    energy_results = []
    ok, why = EnergyMeter.available()
    if energy and ok:
        meter = EnergyMeter()
        meter.measure_idle(2.0)
        for shape in ("down_4096x14336", "lm_head_128256x4096"):
            n, k = LLAMA_SHAPES[shape]
            e = energy_case(n, k, device, gen, meter)
            e["shape"] = shape
            e["idle_power_w"] = meter.idle.power_w if meter.idle else None
            energy_results.append(e)
            print(f"energy {shape}: bf16 {e['bf16_power_w']:.0f} W {e['bf16_uj_per_call']:.1f} uJ/call, "
                  f"int4 {e['int4_power_w']:.0f} W {e['int4_uj_per_call']:.1f} uJ/call", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    if sweep:  # written first: a later failure must not lose the measurements
        table = best_configs(results)
        if focused:
            installed = tuned_path()
            table = merge_tuned(json.loads(installed.read_text()) if installed.exists() else {}, table)
        (out_dir / "tuned_configs.json").write_text(json.dumps(table, indent=1, sort_keys=True))
        (out_dir / "kernel_sweep.json").write_text(json.dumps({"results": results}))
    summary = summarize(results, energy_results, copy_gbs)
    if sweep:
        summary["tuned"] = table
    summary["energy_skipped"] = None if (energy and ok) else why
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}, indent=1))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernel_sweep.json" if sweep else out_dir / "kernel_suite.json").write_text(
        json.dumps({"results": results, "energy": energy_results, "summary": summary}))
    if write_record and not sweep:
        rec = RunRecord(
            claim_ids=CLAIM_IDS if energy_results else [c for c in CLAIM_IDS if c != "kernel-power"],
            suite="kernel_int4",
            config={"shapes": LLAMA_SHAPES, "m_values": list(M_VALUES), "groups": [str(g) for g in GROUPS],
                    "dtype": "bfloat16", "timer": "triton.testing.do_bench, L2 flushed, median",
                    "candidate_configs": [asdict(c) for c in candidate_configs()],
                    "tuned_table": tuned_table_provenance()},
            samples={f"{r['case']['shape']}|m{r['case']['m']}|g{r['case']['group']}|{name}": s
                     for r in results for name, s in r["samples_us"].items()},
            metrics=flat_metrics(summary),
            environment=capture_environment(),
            conditions={"model": "Llama-3.1-8B linear shapes (random weights)",
                        "hardware": torch.cuda.get_device_name(), "trials": 1},
        )
        path = write(rec, "telemetry")
        summary["record"] = str(path)
        print("record:", path)
    return summary


def _record_path(path: Path) -> str:
    """A file's name as a record keeps it: relative to the repository where it lies inside it, else its name alone
    (the sha256 beside it identifies the bytes; a record holds no machine's paths)."""
    root = Path(__file__).resolve().parents[2]
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return path.name


def tuned_table_provenance() -> dict:
    """Which tuned tables the run's automatic choices came from: the shipped one (or $SDSIE_TUNED_CONFIGS when
    gpu_run.sh runs on a table its sweep just wrote) and the sha256 of its bytes (null when there is none), and the
    local tuned cache `sdsie tune-int4` writes, which the choice reads first (`local_cache`: null when off or
    absent). Paths as `_record_path` gives them."""
    from sdsie.kernels.int4_config import SHIPPED_TUNED_PATH, tuned_cache_path, tuned_path

    path = tuned_path()
    local = tuned_cache_path()
    return {"path": _record_path(path), "shipped": path == SHIPPED_TUNED_PATH,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None,
            "local_cache": ({"path": _record_path(local), "sha256": hashlib.sha256(local.read_bytes()).hexdigest()}
                            if local is not None and local.exists() else None)}


def best_configs(results: list[dict], device_name: str | None = None) -> dict:
    """{device: {tuned_key: config}} from a sweep: the fastest correct configuration per case."""
    from sdsie.kernels.int4_config import tuned_key

    table = {}
    for r in results:
        c = r["case"]
        # graphed time where measured: eager medians of tiny shapes measure host time, and picked a config
        # 2.5x slower than the heuristic's for kv_1024x4096 (docs/kernel-log.md, v3 run 4)
        times = r.get("graph_us_by_config") or r["median_us"]
        timed = [(times[name], name) for name in r.get("configs", {})
                 if r["errors"][name] < CORRECT_REL_ERROR and name in times]
        if not timed:
            continue
        best = min(timed)[1]
        g = c["group"] if c["group"] is not None else c["k"]
        table[tuned_key(c["m"], c["n"], c["k"], g)] = r["configs"][best]
    return {device_name or torch.cuda.get_device_name(): table}


LARGE = ("gate_up_14336x4096", "down_4096x14336", "lm_head_128256x4096")  # the copy-bandwidth target's shapes


def summarize(results: list[dict], energy: list[dict], copy_gbs: float) -> dict:
    def pick(m: int, g: int | None) -> list[dict]:
        return [r for r in results if r["case"]["m"] == m and r["case"]["group"] == g]

    s: dict = {"copy_bandwidth_gbs": copy_gbs, "table": []}
    for r in results:
        c = r["case"]
        s["table"].append({
            "shape": c["shape"], "m": c["m"], "group": c["group"], "bf16_us": r["median_us"]["bf16"],
            "int4_us": r["median_us"]["int4"], "speedup": r["speedup_vs_bf16"],
            "pct_copy": r["int4_pct_of_copy"], "tinygemm_us": r["median_us"].get("tinygemm"),
            "bytes_reduction_pct": r["bytes_reduction_pct"], "max_rel_err": max(r["errors"].values()),
        })
    for g in GROUPS:
        m1 = pick(1, g)
        if not m1:  # a partial run (or a test) may time one group only
            continue
        s[f"m1_g{g}_geomean_speedup"] = geomean([r["speedup_vs_bf16"] for r in m1])
        big = [r for r in m1 if r["case"]["shape"] in LARGE]
        if big:
            s[f"m1_g{g}_min_pct_copy_large"] = min(r["int4_pct_of_copy"] for r in big)
        tg = [r["speedup_vs_tinygemm"] for r in m1 if "speedup_vs_tinygemm" in r]
        if tg:
            s[f"m1_g{g}_min_speedup_vs_tinygemm"] = min(tg)
        s[f"m1_g{g}_bytes_reduction_pct_min"] = min(r["bytes_reduction_pct"] for r in m1)
        s[f"m1_g{g}_bytes_reduction_pct_max"] = max(r["bytes_reduction_pct"] for r in m1)
    for m in M_VALUES[1:]:
        if pick(m, 128):  # a sweep times a subset of M
            s[f"m{m}_g128_min_speedup"] = min(r["speedup_vs_bf16"] for r in pick(m, 128))
    for g in GROUPS:
        graphed = [r["graph_us"] for r in pick(1, g) if "graph_us" in r]
        if graphed:
            s[f"m1_g{g}_geomean_speedup_graph"] = geomean([gu["bf16"] / gu["int4"] for gu in graphed])
        big = [r["graph_us"] for r in pick(1, g) if "copy" in r.get("graph_us", {}) and r["case"]["shape"] in LARGE]
        if big:  # graphed INT4 against a graphed copy of the same bytes
            s[f"m1_g{g}_min_pct_copy_large_graph"] = min(100.0 * gu["copy"] / gu["int4"] for gu in big)
    for r in results:  # each case's graphed times, so a reader can judge a case without its eager host time
        c = r["case"]
        for name, us in r.get("graph_us", {}).items():
            if isinstance(us, float):
                s[f"graph_us.{c['shape']}.m{c['m']}.g{c['group']}.{name}"] = us
    for g in GROUPS:
        hosts = [r["host_us"] for r in pick(1, g) if "host_us" in r]
        for name in ("bf16", "tinygemm", "int4"):
            vals = [h[name] for h in hosts if name in h]
            if vals:
                s[f"m1_g{g}_host_us_{name}_median"] = statistics.median(vals)
    for e in energy:
        s[f"power_change_pct_{e['shape']}"] = e["power_change_pct"]
        s[f"energy_per_call_change_pct_{e['shape']}"] = e["energy_per_call_change_pct"]
    return s


def flat_metrics(summary: dict) -> dict[str, float]:
    return {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("telemetry/raw"))
    p.add_argument("--sweep", action="store_true", help="time a wide config grid (tuning), write no record")
    p.add_argument("--no-energy", action="store_true")
    p.add_argument("--m", type=int, nargs="+", default=list(SWEEP_M), metavar="M",
                   help="with --sweep: these M only (a focused sweep: the incumbent timed beside, table merged)")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                   help="with --sweep: the configurations whose names contain TEXT (e.g. swap, gather)")
    a = p.parse_args(argv)
    if not a.sweep and (a.only is not None or tuple(a.m) != SWEEP_M):
        p.error("--m and --only focus a sweep: they need --sweep")
    if bad := sorted(set(a.m) - set(SWEEP_M)):
        p.error(f"--m {bad}: the sweep tunes M in {list(SWEEP_M)}")
    if cuda_missing("int4_bench"):
        return 2
    run_suite(a.out, sweep=a.sweep, energy=not a.no_energy, sweep_m=tuple(sorted(set(a.m))), only=a.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
