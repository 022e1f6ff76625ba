"""End-to-end batch-1 decode of 7-8B model shapes: bf16 against INT4 (sdsie's kernel and torch's tinygemm), eager
and compiled, under the engine's static cache and CUDA graphs, with tok/s, J/token, kernels and GPU time per token
by category, and the share of the bytes-per-token bound.

Models are built from the published Llama-3.1-8B and Qwen2.5-7B configurations with random weights (speed does not
depend on their values; rotary settings stay at the library's default), in bf16, on the GPU. Each model is built
once and taken through its variants in this order, each variant reusing the previous one's modules:

    bf16                 nn.Linear layers, the engine's static cache and graphs
    bf16_compiled        the same, the decode step compiled by torch.compile (inductor) and captured in the graphs
    gated_full           every decoder linear and the LM head as GatedLinear, q/k/v and gate/up fused
                         (fuse_projections: each gear's weights concatenated), the gear pinned to bf16 by the clutch
    gated_int4           ... pinned to INT4 (one graph per precision, as in gated decoding)
    gated_*_compiled     the two gears with the compiled decode step
    gated_norms_*_compiled  ... with each layer's norms and residual adds in its gated projections (fuse_norms: the
                         INT4 gear in the kernel's epilogues, the full one in torch; not in the default list)
    int4_unfused         the gated layers' INT4 halves alone (sdsie kernel), q/k/v and gate/up separate (needs
                         --gated-layout unfused where a gated variant runs too; not in the default list)
    int4                 ... q/k/v and gate/up fused (fuse_projections)
    int4_compiled        ... with the compiled decode step
    int4_norms           ... with each layer's RMS norms and residual adds in its INT4 projections (fuse_norms), the
                         final norm in the LM head
    int4_norms_compiled  ... with the compiled decode step
    tinygemm             the same INT4 weights through torch.ops.aten._weight_int4pack_mm, fused likewise
    tinygemm_compiled    ... with the compiled decode step
    hf_tinygemm_compiled HF generate() with a static cache and its own torch.compile, over the tinygemm model

Timing: the engine's prefill and decode seconds (device synchronized at both ends); tok/s is decode tokens over
decode time (medians over trials), end-to-end tok/s beside it. HF's generate() has no separate prefill time: its
row's tok/s (and share of the bound) counts the prefill in; its profile is a full run less a one-token run, as the
engine's. Energy: one NVML window per variant of back-to-back runs filling --energy-window-s, J per generated token
(prefill included), and a second window of prefill-only runs that prices the prefill, for J per decoded token
without it (`j_per_token_decode`, decode_energy); a third window of runs a quarter as long, differenced with the
whole runs, gives the same without pricing the prefill apart (`j_per_token_decode_diff`). The card's idle power,
measured before the first row, is recorded (`idle_power_w`), and each decoded token's energy above it
(`j_per_token_decode_above_idle`, the first two windows less idle power times their length): the share of the
energy that the decode's work, not its time, costs. Kernels:
torch.profiler over a full run minus a prefill-only run, per decode token, by category (GEMV/GEMM, attention,
other): launches, summed kernel durations (`us`) and busy time (`busy_us`: each kernel's time not covered by a
kernel that started before it, `busy_times`); and the wall time a token spends outside kernels
(`per_token.outside_us`: 1 / tok/s less the busy time). The two times differ under PDL, where a kernel starts early
and waits for the one before inside its own span: summed durations then count that wait twice (more than the wall
time a token: Llama-3.1-8B INT4, 2,752 us summed at 538 tok/s, record `ce7b760c`); busy time gives it to the kernel
that works through it.
Bound: the bytes a decode token reads (every weight but the input embedding, plus the KV cache at the run's mean
position) at the measured copy rate.

Compilation: the decode step is compiled with static shapes (dynamic=False), so each prompt length gets its own graph
(as gpt-fast's decode step), not a dynamic-shape recompilation after the first length (GatedLinear leaves its call
counters alone while dynamo traces, so a gated step compiles once). The prefill runs eagerly; --compile-prefill
compiles it separately with a dynamic length (dynamic=True, as gpt-fast's --compile_prefill), one graph for every
prompt length, and the record's config says which (`compile_prefill`). An eager prefill is host-bound at short
prompts: 28 ms (bf16) and 52 ms (INT4) for 8 and 13 ms of GPU work at 32 tokens of Llama-3.1-8B on the H200
(telemetry/raw/prefill_probe_eager_h200.json). The compiled INT4 prefill is host-bound too: 29.8 ms at 32 tokens of
Llama-3.1-8B with fused norms on an H100, 6.0 ms of it busy GPU (telemetry/raw/
decode_e2e_prefill_composed_llama_p32_h100.json), where bf16's takes 10.3. Each profiled row keeps its one-token
run's kernels and host calls (`prefill_profile`: launches and busy GPU time by category, the prefill's wall time
outside them, and the host's time in the INT4 ops, the compiled graphs and the driver's launches). --prefill-graphs
replays the engine's prompts as CUDA graphs (DecodeConfig.prefill_graphs), padded to the engine's prefill sizes;
the record's config says which (`prefill_graphs`). The INT4 prefill at 32 tokens then takes 10.3 ms on an H100, 9.4 ms
of it busy GPU (telemetry/raw/decode_e2e_prefill_graphs_llama_p32_h100.json), and 6.5 ms compiled with
--compile-prefill (telemetry/raw/decode_e2e_compiled_prompt_graphs_llama_p32_h100.json). The HF peer
compiles its own forward (inductor, HF's defaults) on CUDA; off CUDA it is told to compile with --compile-backend, and
its row says whether HF did (`hf_compiled`).

Attention: --attention picks the engine's one-token attention over its static cache (DecodeConfig.attention; the
HF peer keeps its own). The default, auto, is the split-KV kernel under graphs on CUDA and SDPA otherwise; the
record's config names what was asked (`attention`) and what ran (`attention_run`). Steps launch ahead of the host's
read of the step before (DecodeConfig.launch_ahead: the engine's rows have no scout, and the gated rows' pinned clutch
cannot flip); --no-launch-ahead turns that off for an A/B, and the record's config says which (`launch_ahead`). Each
engine row gives its last trial's steps launched ahead, those dropped, and its decode steps (`steps_launched_ahead`,
`steps_dropped`, `decode_steps`).

Run (GPU): python -m reproductions.decode_e2e --out DIR [--models ...] [--prompt-lens ...] [--variants ...]
           [--max-seconds S] [--attention auto|sdpa|split_kv] [--no-launch-ahead]
Dry run (CPU, tiny configuration): python -m reproductions.decode_e2e --device cpu --tiny --out DIR
Off CUDA the INT4 layers run the kernel's float64 reference (Triton's interpreter takes seconds per GEMV; the dry run
checks the suite's plumbing, the kernel has its own tests), tinygemm runs torch's CPU kernel, and dynamo traces with
the eager backend; the config records each.

Writes DIR/decode_e2e.json after every row (model, prompt length, variant) and a run record at the end, also when the
run is cut: --max-seconds starts no row that its estimate (the longest row of its kind so far, or ROW_ESTIMATE_S on
CUDA) would carry past the limit, and SIGTERM (`timeout`'s signal) stops the run after the current row's device work.
A cut run's record has complete=false and lists the rows it ran (config.rows_run) and why it stopped (config.cut).
Exit status: 0 every requested row ran (a row that cannot run on this device says why); 2 the run was cut (partial
record written); 3 it ran to the end but some row raised (its error is in its row).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

import sdsie.kernels
import sdsie.kernels.ops
from reproductions.args import key_value
from reproductions.kernels.int4_bench import tuned_table_provenance
from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeCompiled, DecodeConfig, DecodeStats, generate, prompt_compile_kwargs, run_attention
from sdsie.decoding.model_io import DECODE_ATTENTIONS, sync_device
from sdsie.kernels import int4_matmul_reference
from sdsie.kernels.device import set_programmatic_launch
from sdsie.quant import (
    GatedLinear,
    Int4Linear,
    QuantConfig,
    fuse_norms,
    fuse_projections,
    gate_model,
    unfuse_norms,
)
from sdsie.quant.linear import replace_module
from sdsie.telemetry.energy import EnergyMeter, EnergyUnavailable, EnergyWindow, calls_to_fill
from sdsie.telemetry.records import RunRecord, capture_environment, write_record

SUITE = "decode_e2e"
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
GROUP_SIZE = 128

# The published configurations' sizes (Hugging Face config.json of meta-llama/Llama-3.1-8B and Qwen/Qwen2.5-7B).
MODELS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5),
    "qwen2.5-7b": dict(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6),
}
TINY: dict[str, dict[str, Any]] = {
    "llama3.1-8b": dict(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5),
    "qwen2.5-7b": dict(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6),
}
VARIANTS = ("bf16", "bf16_compiled", "gated_full", "gated_int4", "gated_full_compiled", "gated_int4_compiled",
            "gated_norms_full_compiled", "gated_norms_int4_compiled", "int4_unfused", "int4", "int4_compiled",
            "int4_norms", "int4_norms_compiled", "tinygemm", "tinygemm_compiled", "hf_tinygemm_compiled")
NORMS = frozenset({"int4_norms", "int4_norms_compiled"})
GATED = frozenset(v for v in VARIANTS if v.startswith("gated_"))
GATED_NORMS = frozenset({"gated_norms_full_compiled", "gated_norms_int4_compiled"})
# int4_unfused is an A/B of fusion: it needs the gated layers unfused, so it is run only when named; the gated rows
# with fused norms are run only when named too (two more compiled rows a model)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "int4_unfused" and v not in GATED_NORMS)
BASELINE = {"bf16": "bf16", "int4": "bf16", "tinygemm": "bf16", "int4_unfused": "bf16", "gated_full": "bf16",
            "gated_int4": "bf16", "bf16_compiled": "bf16_compiled", "int4_compiled": "bf16_compiled",
            "tinygemm_compiled": "bf16_compiled", "gated_full_compiled": "bf16_compiled",
            "gated_int4_compiled": "bf16_compiled", "hf_tinygemm_compiled": "bf16_compiled",
            "int4_norms": "bf16", "int4_norms_compiled": "bf16_compiled",
            "gated_norms_full_compiled": "bf16_compiled", "gated_norms_int4_compiled": "bf16_compiled"}
# Gears pinned by the clutch: an entropy EMA never below 0 keeps it out (bf16), never above 1e9 bits keeps it in
PIN_FULL = ClutchConfig(theta_low=0.0, theta_high=0.0, alpha=1.0, initial_engaged=False)
PIN_INT4 = ClutchConfig(theta_low=1e9, theta_high=1e9, alpha=1.0, initial_engaged=True)
COMPILED = frozenset(v for v in VARIANTS if v.endswith("_compiled"))
# Seconds one row (model, prompt, variant) takes on an H200 at the 8B shapes with 3 trials and 3 s energy windows,
# before the run has timed a row of the kind: eager rows took 23-29 s and compiled ones 37-52 s at 32-token prompts
# (telemetry/raw/decode_e2e_llama_qwen_p32_h200.json); a compilation from a cold cache takes longer, HF's own more.
CATEGORIES = ("gemv_gemm", "attention", "other")  # kernel_category's kinds, in the tables' order
ROW_ESTIMATE_S = {"eager": 35.0, "compiled": 90.0, "hf": 150.0}


# --- models ---------------------------------------------------------------------------------------------------------


def build_model(name: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A random-weight causal LM of the named configuration, built on `device` in `dtype` directly."""
    spec = dict((TINY if tiny else MODELS)[name])
    family = spec.pop("family")
    if family == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    else:
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model
    config = Config(**spec, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, attention_bias=family == "qwen2")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = Model(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


class TinygemmLinear(nn.Module):
    """A linear through torch's tinygemm INT4 kernel (`aten._weight_int4pack_mm`), from an Int4Linear's weights; on
    CPU, torch's CPU kernel of the same format (`aten._weight_int4pack_mm_for_cpu`), for the dry run."""

    def __init__(self, layer: Int4Linear) -> None:
        super().__init__()
        from reproductions.kernels.int4_bench import tinygemm_pack

        if layer.input_scale is not None:
            raise ValueError("tinygemm takes no AWQ input scale")
        w = layer.int4_weight
        self.cpu = w.qweight.device.type == "cpu"
        packed = _tinygemm_pack_cpu(w, layer.scales.dtype) if self.cpu else tinygemm_pack(w)
        if packed is None:
            raise ValueError(f"tinygemm cannot take group size {layer.group_size} or symmetric weights")
        self.register_buffer("packed", packed[0])
        self.register_buffer("scales_and_zeros", packed[1])
        self.register_buffer("bias", layer.bias)
        self.in_features, self.out_features, self.group_size = layer.in_features, layer.out_features, layer.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu if self.cpu else torch.ops.aten._weight_int4pack_mm
        y = mm(x.reshape(-1, self.in_features), self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _tinygemm_pack_cpu(w: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weights in the format of torch's CPU tinygemm: codes [N, K] as int32, scales and (8 - z) * s in `dtype`."""
    if w.group_size not in (32, 64, 128, 256) or w.zeros is None:
        return None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes().to(torch.int32).contiguous(), 8)
    offsets = (8.0 - w.zeros.float()) * w.scales.float()
    return packed, torch.stack([w.scales.to(dtype), offsets.to(dtype)], dim=-1).contiguous()  # [G, N, 2]


def ungate(model: nn.Module) -> None:
    """Each GatedLinear becomes its INT4 layer alone (the bf16 weights are freed)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, GatedLinear):
            replace_module(model, name, module.quantized)


def to_tinygemm(model: nn.Module) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, Int4Linear):
            replace_module(model, name, TinygemmLinear(module))


# --- measurements ---------------------------------------------------------------------------------------------------


def weight_bytes(model: nn.Module, skip: Callable[[str], bool] = lambda name: False) -> int:
    """Bytes of every parameter and buffer a decode token reads: all but the input embedding (one row of it is read)
    and those under modules `skip` names."""
    embed = model.get_input_embeddings().weight
    total = 0
    for named in (model.named_parameters(), model.named_buffers()):
        for name, t in named:
            if t is not embed and not skip(name):
                total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(config: Any, position: float, dtype_bytes: int = 2) -> float:
    """KV cache bytes one decode token reads at `position`: keys and values of every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * position * dtype_bytes


def copy_rate_gbs(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    from reproductions.kernels.int4_bench import copy_bandwidth_gbs

    return copy_bandwidth_gbs(str(device))


def kernel_category(name: str) -> str:
    """GEMV/GEMM, attention or other. Inductor's generated kernels (triton_poi_/triton_red_/triton_per_ fused ...) are
    named after every op they fuse, the GEMMs and attention whose inputs or outputs they touch included, but compute
    elementwise ops and reductions only: other."""
    low = name.lower()
    if low.startswith(("triton_poi_", "triton_red_", "triton_per_")):
        return "other"
    if any(s in low for s in ("flash", "fmha", "attention", "attn", "sdpa")):
        return "attention"
    if any(s in low for s in ("int4", "gemv", "gemm", "xmma", "cutlass", "nvjet", "tinygemm", "matmul", "splitk",
                              "cublas", "sm90_", "sm80_")):
        return "gemv_gemm"
    return "other"


def profile_kernels(run: Callable[[], Any], device: torch.device,
                    host: bool = False) -> tuple[dict[str, float], dict[str, list]] | None:
    """Kernel launches, summed GPU microseconds and busy microseconds of one call of `run`, by category, and by
    kernel name ({name: [launches, us, busy_us]}); with `host`, the host's time in the calls `host_times` names too
    (`host.<name>.calls`, `host.<name>.us`: the CPU side is profiled as well, which slows it). None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if host else [])]
    with profile(activities=activities) as prof:
        run()
        sync_device(device)
    names = kernel_times(prof)
    out = {f"{cat}.{what}": 0.0 for cat in CATEGORIES for what in ("kernels", "us", "busy_us")}
    for name, (launches, us, busy) in names.items():
        cat = kernel_category(name)
        out[f"{cat}.kernels"] += launches
        out[f"{cat}.us"] += us
        out[f"{cat}.busy_us"] += busy
    if host:
        for name, (calls, us) in host_times(prof).items():
            out[f"host.{name}.calls"], out[f"host.{name}.us"] = calls, us
    return out, names


# Host calls a prefill's profile times: the INT4 ops, the compiled graphs' calls, and the driver's kernel launches
HOST_CALLS = ("sdsie::", "Torch-Compiled Region", "cudaLaunchKernel", "cuLaunchKernel")


def host_times(prof: Any) -> dict[str, list]:
    """A finished profile's host events whose names start with one of HOST_CALLS, by that prefix: {prefix or op
    name: [calls, summed microseconds]} (each sdsie op by its own name; nested calls count in each)."""
    out: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        prefix = next((p for p in HOST_CALLS if e.name.startswith(p)), None)
        if prefix is None:
            continue
        entry = out.setdefault(e.name if prefix == "sdsie::" else prefix, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    return out


def prefill_profile(one_token: dict[str, float], prefill_s: float) -> dict[str, float]:
    """A one-token run's kernels (its prefill and first token): launches, summed and busy GPU microseconds by
    category, and the prefill's wall microseconds outside busy kernels (`outside_us`, from the row's median prefill
    time; 0 for HF rows, whose prefill is not timed apart, so None there). Says whether a prefill is host-bound."""
    out = dict(one_token)
    out["kernels"] = sum(one_token[f"{c}.kernels"] for c in CATEGORIES)
    out["gpu_us"] = sum(one_token[f"{c}.us"] for c in CATEGORIES)
    out["busy_us"] = sum(one_token[f"{c}.busy_us"] for c in CATEGORIES)
    out["outside_us"] = prefill_s * 1e6 - out["busy_us"] if prefill_s > 0 else None
    return out


def busy_times(spans: list[tuple[str, float, float]]) -> list[float]:
    """Each span's time (name, start, end) not covered by a span that started before it (ties: the one listed
    first), in the spans' order. The times add up to the union of the spans, so nothing is counted twice.

    Why: under PDL a kernel is launched while the one before still runs and waits for it inside its own span (its
    `gdc_wait`), so the earliest-started of the kernels running at a moment is the one at work; the later ones are
    waiting. Work a kernel does before its wait (a weight prefetch) is counted as the earlier kernel's."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][1], i))
    busy = [0.0] * len(spans)
    covered_to = float("-inf")  # the latest end of the spans that started earlier: they cover [start, covered_to]
    for i in order:
        _, start, end = spans[i]
        if end < start:
            raise ValueError(f"busy_times: span {spans[i]} ends before it starts")
        busy[i] = max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return busy


def kernel_times(prof: Any) -> dict[str, list]:
    """A finished torch.profiler profile's GPU kernels (and copies) by name: {name: [launches, summed microseconds,
    busy microseconds (`busy_times`)]}."""
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    names: dict[str, list] = {}
    for (name, start, end), busy in zip(spans, busy_times(spans), strict=True):
        entry = names.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += end - start
        entry[2] += busy
    return names


def top_kernels(full: dict[str, list], prefill: dict[str, list], steps: int, n: int = 30) -> list[dict[str, Any]]:
    """The n kernels with the most busy GPU time per decode token (a full run minus a prefill-only run), with their
    category, launches and summed time per token: what each category is made of."""
    rows = []
    for name, (launches, us, busy) in full.items():
        before = prefill.get(name, [0, 0.0, 0.0])
        rows.append({"name": name, "category": kernel_category(name), "per_token": (launches - before[0]) / steps,
                     "us_per_token": (us - before[1]) / steps, "busy_us_per_token": (busy - before[2]) / steps})
    return sorted(rows, key=lambda r: -r["busy_us_per_token"])[:n]


@dataclass
class Variant:
    name: str
    model: nn.Module
    gear: Any = None  # GearState for the gated variants
    clutch: ClutchConfig | None = None
    hf: bool = False  # HF generate() instead of the engine
    hf_compile: Any = None  # HF's CompileConfig for its generate (None: HF's default, which compiles on CUDA)
    read_skip: Callable[[str], bool] = field(default=lambda name: False)
    attention: str = "auto"  # DecodeConfig.attention of the engine's runs (--attention)
    launch_ahead: bool = True  # DecodeConfig.launch_ahead of the engine's runs (--no-launch-ahead)
    prefill_graphs: bool = False  # DecodeConfig.prefill_graphs of the engine's graphed runs (--prefill-graphs)


class Run(NamedTuple):
    """One decode: its new tokens, prefill and decode seconds, the new token ids, and the engine's stats (None for
    HF's generate())."""

    tokens: int
    prefill_s: float
    decode_s: float
    ids: list[int]
    stats: DecodeStats | None = None


def _run_once(v: Variant, prompt: torch.Tensor, new_tokens: int, graphs: bool) -> Run:
    """One decode of the variant: the engine's generate(), or HF's for the HF peer."""
    if v.hf:
        return _hf_run(v.model, prompt, new_tokens, v.hf_compile)
    cfg = DecodeConfig(max_new_tokens=new_tokens, kv_cache="static", cuda_graphs=graphs, attention=v.attention,
                       launch_ahead=v.launch_ahead, prefill_graphs=graphs and v.prefill_graphs)
    clutch = EntropyClutch(v.clutch) if v.clutch is not None else None
    r = generate(v.model, prompt, cfg, clutch=clutch, gear=v.gear)
    return Run(len(r.tokens), r.stats.prefill_seconds, r.stats.decode_seconds, [int(t) for t in r.tokens], r.stats)


def _hf_run(model: nn.Module, prompt: torch.Tensor, new_tokens: int,
            compile_config: Any = None) -> Run:
    """HF generate with a static cache (HF compiles its forward for it); the prefill is not separated: 0 s."""
    ids = prompt[None]
    extra = {} if compile_config is None else {"compile_config": compile_config}
    sync_device(prompt.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                             eos_token_id=None, pad_token_id=0, **extra)
    sync_device(prompt.device)
    return Run(out.shape[1] - ids.shape[1], 0.0, time.perf_counter() - t0, out[0, ids.shape[1]:].tolist())


def outside_kernels_us(decode_tok_s: float | None, busy_us: float) -> float | None:
    """Wall time a decode token spends outside kernels: 1 / tok/s (the untraced trials' median) less the profiled run's
    busy GPU time (`busy_times`). Under graphs this is mostly the host's turn between steps (the read, the next
    launch), which the engine's launch-ahead overlaps with the device (docs/log.md)."""
    return 1e6 / decode_tok_s - busy_us if decode_tok_s else None


DIFF_MIN_TOKENS = 8  # runs this long or longer also get the differenced decode energy (`decode_energy`)


def _energy_of_runs(v: Variant, prompt: torch.Tensor, graphs: bool, meter: EnergyMeter, window_s: float,
                    new_tokens: int) -> tuple[EnergyWindow, int]:
    """One window of back-to-back runs of `new_tokens` tokens filling `window_s` (timed twice first to size it):
    the window and its run count."""
    timed = [_run_once(v, prompt, new_tokens, graphs) for _ in range(2)]
    n_runs = calls_to_fill(min(r.prefill_s + r.decode_s for r in timed), window_s)
    window = meter.start()
    for _ in range(n_runs):
        _run_once(v, prompt, new_tokens, graphs)
    return meter.stop(window, tokens=n_runs * new_tokens), n_runs


def decode_energy(v: Variant, prompt: torch.Tensor, graphs: bool, meter: EnergyMeter, window_s: float,
                  runs: EnergyWindow, run_count: int, new_tokens: int) -> dict[str, Any]:
    """J a decoded token without the prefill's share (`runs`: the window of `run_count` whole runs). The J/token of
    the whole runs counts the prefill, which for an eager INT4 prefill is a large share. Two estimates:

    - `j_per_token_decode`: a window of runs that stop at the first token (the prefill and its one token) prices the
      prefill, and (J a run - J a prefill) / (new tokens - 1) is a decode step's energy. It assumes a prefill draws
      the same power back to back as inside a run, after a decode. Where the meter has an idle baseline, the same
      difference of both windows' energy less idle power over their time: `j_per_token_decode_above_idle`.
    - `j_per_token_decode_diff` (new tokens >= 8): a window of runs of a quarter as many tokens, differenced with the
      whole runs, (J a run - J a short run) / (new tokens - short tokens). Every prefill then follows a decode in
      both windows, so the assumption above is not needed; where the two estimates differ, it did not hold."""
    if run_count < 1:
        raise ValueError(f"decode_energy: the runs' window must hold at least one run, got run_count={run_count}")
    if new_tokens < 2:
        return {}
    w, n_runs = _energy_of_runs(v, prompt, graphs, meter, window_s, 1)
    prefill_j = w.energy_j / n_runs
    out = {"prefill_j": prefill_j, "prefill_energy_window_s": w.duration_s, "prefill_energy_runs": n_runs,
           "j_per_token_decode": (runs.energy_j / run_count - prefill_j) / (new_tokens - 1)}
    if runs.net_energy_j is not None and w.net_energy_j is not None:
        out["j_per_token_decode_above_idle"] = (runs.net_energy_j / run_count - w.net_energy_j / n_runs) / (
            new_tokens - 1)
    if new_tokens >= DIFF_MIN_TOKENS:
        short = new_tokens // 4
        ws, n_short = _energy_of_runs(v, prompt, graphs, meter, window_s, short)
        out.update(decode_diff_short_tokens=short, decode_diff_energy_window_s=ws.duration_s,
                   decode_diff_energy_runs=n_short,
                   j_per_token_decode_diff=(runs.energy_j / run_count - ws.energy_j / n_short) / (new_tokens - short))
    return out


def measure(v: Variant, prompt: torch.Tensor, new_tokens: int, trials: int, graphs: bool, meter: EnergyMeter | None,
            energy_window_s: float, copy_gbs: float | None, profile: bool) -> dict[str, Any]:
    device = prompt.device
    for _ in range(2 if graphs else 1):  # warm-up: compiles, captures the graphs (then replays them once)
        _run_once(v, prompt, new_tokens, graphs)
    runs = [_run_once(v, prompt, new_tokens, graphs) for _ in range(trials)]
    decode_tps = [(r.tokens - 1) / r.decode_s for r in runs if r.decode_s > 0]
    e2e_tps = [r.tokens / (r.prefill_s + r.decode_s) for r in runs]
    result: dict[str, Any] = {
        "new_tokens": runs[0].tokens,
        # greedy decoding: every trial's tokens alike. Equal digests mean equal tokens; unequal ones across
        # processes are not evidence of a kernel difference (bf16 rows of one setting differed between processes)
        "tokens_sha256": hashlib.sha256(json.dumps(runs[-1].ids).encode()).hexdigest()[:16],
        "tokens_same_every_trial": all(r.ids == runs[0].ids for r in runs),
        "decode_tok_s": decode_tps,
        "e2e_tok_s": e2e_tps,
        "decode_tok_s_median": statistics.median(decode_tps) if decode_tps else None,
        "e2e_tok_s_median": statistics.median(e2e_tps),
        "prefill_s_median": statistics.median(r.prefill_s for r in runs),
    }
    stats = runs[-1].stats  # the last trial's: launch-ahead follows the clutch's states, the same every trial
    if stats is not None:  # steps launched before the previous read, of the decode steps after the first
        result.update(steps_launched_ahead=stats.ahead_launched, steps_dropped=stats.ahead_dropped,
                      decode_steps=stats.cycles)
    if meter is not None:
        per_run = statistics.median(r.prefill_s + r.decode_s for r in runs)
        n_runs = calls_to_fill(per_run, energy_window_s)
        window = meter.start()
        tokens = sum(_run_once(v, prompt, new_tokens, graphs).tokens for _ in range(n_runs))
        w = meter.stop(window, tokens=tokens)
        result.update(j_per_token=w.j_per_token, energy_window_s=w.duration_s, energy_runs=n_runs,
                      mean_power_w=w.mean_power_w)
        if w.idle is not None:
            result["idle_power_w"] = w.idle.power_w
        result.update(decode_energy(v, prompt, graphs, meter, energy_window_s, w, n_runs, result["new_tokens"]))
    if profile:
        try:
            full = profile_kernels(lambda: _run_once(v, prompt, new_tokens, graphs), device)
            prefill = profile_kernels(lambda: _run_once(v, prompt, 1, graphs), device, host=True)
        except RuntimeError as err:  # the row's timings stand without its profile; the record says why
            full = prefill = None
            result["profile_error"] = f"{type(err).__name__}: {err}"[:500]
        if full is not None and prefill is not None:
            steps = max(result["new_tokens"] - 1, 1)
            (full, full_names), (prefill, prefill_names) = full, prefill
            per_token = {k: (full[k] - prefill[k]) / steps for k in full}
            per_token["kernels"] = sum(per_token[f"{c}.kernels"] for c in CATEGORIES)
            per_token["gpu_us"] = sum(per_token[f"{c}.us"] for c in CATEGORIES)
            per_token["busy_us"] = sum(per_token[f"{c}.busy_us"] for c in CATEGORIES)
            per_token["outside_us"] = outside_kernels_us(result["decode_tok_s_median"], per_token["busy_us"])
            result["per_token"] = per_token
            result["top_kernels"] = top_kernels(full_names, prefill_names, steps)
            result["prefill_profile"] = prefill_profile(prefill, result["prefill_s_median"])
    if v.hf:
        result["hf_compiled"] = getattr(v.model, "_compiled_call", None) is not None  # HF compiles silently or not
    target = v.model.model if isinstance(v.model, DecodeCompiled) else v.model
    read = weight_bytes(target, v.read_skip) + kv_bytes_per_token(target.config, prompt.numel() + new_tokens / 2)
    result["bytes_per_token"] = read
    if copy_gbs is not None and result["decode_tok_s_median"]:
        bound = copy_gbs * 1e9 / read
        result.update(bound_tok_s=bound, share_of_bound=result["decode_tok_s_median"] / bound)
    return result


# --- the suite ------------------------------------------------------------------------------------------------------


def row_kind(variant: str) -> str:
    return "hf" if variant.startswith("hf_") else "compiled" if variant in COMPILED else "eager"


class Budget:
    """--max-seconds: a row starts only if its estimate (the longest row of its kind so far; before any, the default
    estimate of its kind) ends within the limit, so a run cut by its budget still ends on its own and writes its
    record, rather than being killed mid-row by an outer limit."""

    def __init__(self, max_seconds: float | None, defaults: dict[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.t0, self.max_seconds = clock(), max_seconds
        self.defaults = defaults or {}
        self.longest: dict[str, float] = {}

    def fits(self, kind: str) -> bool:
        if self.max_seconds is None:
            return True
        estimate = self.longest.get(kind, self.defaults.get(kind, 0.0))
        return self.clock() - self.t0 + estimate <= self.max_seconds

    def took(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


class Stopped(BaseException):
    """SIGTERM arrived while rows ran: the run ends there and writes what it measured (a BaseException, so the rows'
    `except Exception` does not take it for a failed variant)."""


class SigtermStop:
    """While installed, SIGTERM stops the rows (raises Stopped) when `armed`, and is otherwise noted and ignored, so
    the JSON and the record of a stopped run are still written."""

    def __init__(self) -> None:
        self.armed = False
        self.received: str | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if self.armed:
            self.armed = False
            raise Stopped(self.received)

    @contextmanager
    def installed(self) -> Iterator[SigtermStop]:
        previous = signal.signal(signal.SIGTERM, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def int4_kernel(device: torch.device) -> Iterator[str]:
    """The INT4 kernel the run uses: the Triton kernel on CUDA; off CUDA its float64 reference (Triton's interpreter
    takes seconds per GEMV), put in place for the run and taken out after."""
    if device.type == "cuda":
        yield "triton"
        return

    def reference(x: torch.Tensor, w: Any, config: Any = None, out: Any = None, **epilogue: Any) -> torch.Tensor:
        # epilogue: int4_matmul's norm_eps, norm_source, residual, out_gain and norm_squares, composed as off the mma
        # kernel
        return sdsie.kernels.compose_epilogue(int4_matmul_reference(x, w).to(x.dtype), x, **epilogue)

    def silu_reference(x: torch.Tensor, w: Any, config: Any = None, **epilogue: Any) -> torch.Tensor:
        return sdsie.kernels.silu_mul_halves(reference(x, w, **epilogue))

    saved = (sdsie.kernels.int4_matmul, sdsie.kernels.ops.int4_matmul, sdsie.kernels.int4_silu_mul,
             sdsie.kernels.ops.int4_silu_mul)
    sdsie.kernels.int4_matmul = sdsie.kernels.ops.int4_matmul = reference
    sdsie.kernels.int4_silu_mul = sdsie.kernels.ops.int4_silu_mul = silu_reference
    try:
        yield "float64 reference"
    finally:
        (sdsie.kernels.int4_matmul, sdsie.kernels.ops.int4_matmul, sdsie.kernels.int4_silu_mul,
         sdsie.kernels.ops.int4_silu_mul) = saved


def _compile_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """torch.compile's arguments for the compiled variants' decode step (DecodeCompiled derives the prompt's)."""
    kwargs: dict[str, Any] = {"backend": args.compile_backend} if args.compile_backend else {}
    if args.inductor_options:
        kwargs["options"] = dict(args.inductor_options)
    return kwargs


def model_variants(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """Yield (variant name, Variant factory) in order, transforming one model between them; a stage no requested
    variant needs is skipped."""
    wanted = set(args.variants)
    compile_kwargs = _compile_kwargs(args)

    def compiled(m: nn.Module) -> DecodeCompiled:
        return DecodeCompiled(m, args.compile_prefill, **compile_kwargs)

    model = build_model(name, args.tiny, device, dtype)
    yield "bf16", lambda: Variant("bf16", model)
    yield "bf16_compiled", lambda: Variant("bf16_compiled", compiled(model))
    later = wanted - {"bf16", "bf16_compiled"}
    if not later:
        return
    torch._dynamo.reset()
    state = gate_model(model, LINEARS, QuantConfig(group_size=GROUP_SIZE))
    fused = args.gated_layout == "fused" and bool(wanted & GATED)
    if fused:
        fuse_projections(model)  # GatedLinear layers of one gear concatenate both gears' weights

    def not_int4(n: str) -> bool:
        return ".quantized." in n

    def not_full(n: str) -> bool:
        return ".full." in n

    yield "gated_full", lambda: Variant("gated_full", model, state, PIN_FULL, read_skip=not_int4)
    yield "gated_int4", lambda: Variant("gated_int4", model, state, PIN_INT4, read_skip=not_full)
    gated_compiled = compiled(model) if wanted & {"gated_full_compiled",
                                                                             "gated_int4_compiled"} else None
    yield "gated_full_compiled", lambda: Variant("gated_full_compiled", gated_compiled, state, PIN_FULL,
                                                 read_skip=not_int4)
    yield "gated_int4_compiled", lambda: Variant("gated_int4_compiled", gated_compiled, state, PIN_INT4,
                                                 read_skip=not_full)
    gated_compiled = None
    if wanted & GATED_NORMS:
        torch._dynamo.reset()
        fuse_norms(model)  # both gears read the [h, h * g, squares] stream
        normed = compiled(model)
        yield "gated_norms_full_compiled", lambda: Variant("gated_norms_full_compiled", normed, state, PIN_FULL,
                                                           read_skip=not_int4)
        yield "gated_norms_int4_compiled", lambda: Variant("gated_norms_int4_compiled", normed, state, PIN_INT4,
                                                           read_skip=not_full)
        normed = None
        torch._dynamo.reset()
        unfuse_norms(model)
    torch._dynamo.reset()
    ungate(model)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not fused:
        yield "int4_unfused", lambda: Variant("int4_unfused", model)
        fuse_projections(model)
    yield "int4", lambda: Variant("int4", model)
    yield "int4_compiled", lambda: Variant("int4_compiled", compiled(model))
    if wanted & NORMS:
        torch._dynamo.reset()
        fuse_norms(model)
        yield "int4_norms", lambda: Variant("int4_norms", model)
        yield "int4_norms_compiled", lambda: Variant("int4_norms_compiled", compiled(model))
        torch._dynamo.reset()
        unfuse_norms(model)
    if not wanted & {"tinygemm", "tinygemm_compiled", "hf_tinygemm_compiled"}:
        return
    torch._dynamo.reset()
    to_tinygemm(model)
    yield "tinygemm", lambda: Variant("tinygemm", model)
    yield "tinygemm_compiled", lambda: Variant("tinygemm_compiled", compiled(model))
    torch._dynamo.reset()
    yield "hf_tinygemm_compiled", lambda: Variant("hf_tinygemm_compiled", model, hf=True,
                                                  hf_compile=hf_compile_config(args, device))


def hf_compile_config(args: argparse.Namespace, device: torch.device) -> Any:
    """HF generate's own compilation: HF's default on CUDA (inductor, its CUDA graphs) unless --compile-backend names
    another backend; off CUDA, where HF compiles only when told to, the run's backend (no mode: the CPU dry run's
    eager backend takes none)."""
    if device.type == "cuda" and not args.compile_backend:
        return None
    from transformers import CompileConfig

    on_cuda = device.type == "cuda"
    config = CompileConfig(backend=args.compile_backend or "inductor", mode="reduce-overhead" if on_cuda else None)
    config._compile_all_devices = not on_cuda
    return config


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, prompt, variant), with speedups over its baseline (bf16 with the same compilation)."""
    rows = []
    by_key = {(r["model"], r["prompt_len"], r["variant"]): r for r in results if "error" not in r}
    for r in results:
        row = {k: r.get(k) for k in ("model", "prompt_len", "variant", "decode_tok_s_median", "e2e_tok_s_median",
                                     "j_per_token", "j_per_token_decode", "j_per_token_decode_diff",
                                     "share_of_bound", "error")}
        per_token = r.get("per_token") or {}
        row["kernels_per_token"] = per_token.get("kernels")
        row["gpu_us_per_token"] = per_token.get("gpu_us")
        row["busy_us_per_token"] = {c: per_token[f"{c}.busy_us"] for c in CATEGORIES if f"{c}.busy_us" in per_token}
        row["outside_us_per_token"] = per_token.get("outside_us")
        base = by_key.get((r["model"], r["prompt_len"], BASELINE.get(r["variant"], "bf16")))
        for key, out in (("decode_tok_s_median", "speedup_vs_baseline"), ("j_per_token", "energy_vs_baseline"),
                         ("j_per_token_decode", "decode_energy_vs_baseline"),
                         ("j_per_token_decode_diff", "decode_energy_diff_vs_baseline")):
            if base and r.get(key) and base.get(key):
                row[out] = r[key] / base[key]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | prompt | variant | tok/s | x baseline | J/token | J/token decode: prefill priced apart / "
             "differenced | kernels/token | busy GPU us/token: GEMV / attention / other | summed kernel us/token | "
             "us outside kernels | share of bound |", "|---" * 12 + "|"]

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['prompt_len']} | {r['variant']} | {r['error']} ||||||||")
            continue
        busy = r.get("busy_us_per_token") or {}
        split = " / ".join(f"{busy[c]:.0f}" for c in CATEGORIES) if len(busy) == len(CATEGORIES) else "-"
        lines.append(f"| {r['model']} | {r['prompt_len']} | {r['variant']} | {f(r['decode_tok_s_median'], '.1f')} | "
                     f"{f(r.get('speedup_vs_baseline'), '.2f')} | {f(r['j_per_token'], '.3f')} | "
                     f"{f(r.get('j_per_token_decode'), '.3f')} / {f(r.get('j_per_token_decode_diff'), '.3f')} | "
                     f"{f(r['kernels_per_token'], '.0f')} | {split} | "
                     f"{f(r['gpu_us_per_token'], '.0f')} | "
                     f"{f(r['outside_us_per_token'], '.0f')} | {f(r['share_of_bound'], '.0%')} |")
    return "\n".join(lines)


def run_suite(args: argparse.Namespace, stop: SigtermStop | None = None) -> dict[str, Any]:
    """Every requested (model, prompt length, variant) row, written to DIR/decode_e2e.json after each; the document's
    `complete` is False when --max-seconds or SIGTERM (with `stop` armed) cut the run, `config.cut` says which."""
    device = torch.device(args.device)
    # every compiled variant of a model recompiles the same HF forward (new modules, gears, cache sizes): past
    # dynamo's default limit of 8 it would fall back to eager silently
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = Budget(args.max_seconds, ROW_ESTIMATE_S if device.type == "cuda" else None)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meter, energy_reason = None, None
    if args.energy and device.type == "cuda":
        try:
            meter = EnergyMeter(device.index or 0)
            meter.measure_idle(min(5.0, args.energy_window_s))
        except EnergyUnavailable as err:
            energy_reason = str(err)
    else:
        energy_reason = "no energy on CPU" if device.type != "cuda" else "--no-energy"
    copy_gbs = copy_rate_gbs(device)
    new_tokens = args.new_tokens if args.new_tokens else (4 if args.tiny else 128)
    doc: dict[str, Any] = {
        "suite": SUITE,
        "config": {"models": args.models, "prompt_lens": args.prompt_lens, "variants": args.variants,
                   "new_tokens": new_tokens, "trials": args.trials, "tiny": args.tiny, "device": str(device),
                   "dtype": str(dtype), "group_size": GROUP_SIZE, "linears": LINEARS, "cuda_graphs": args.graphs,
                   "compile_backend": args.compile_backend or "inductor", "compile_dynamic": False,
                   "compile_prefill": args.compile_prefill, "prefill_graphs": args.prefill_graphs,
                   "energy_window_s": args.energy_window_s, "copy_rate_gbs": copy_gbs,
                   "energy": energy_reason or "nvml", "max_seconds": args.max_seconds,
                   "attention": args.attention, "launch_ahead": args.launch_ahead,
                   "inductor_options": dict(args.inductor_options), "pdl": args.pdl,
                   "prefill_inductor_options": prompt_compile_kwargs(_compile_kwargs(args)).get("options")
                   if args.compile_prefill else None,
                   "gated_layout": args.gated_layout,
                   "attention_run": run_attention(DecodeConfig(kv_cache="static", cuda_graphs=args.graphs,
                                                               attention=args.attention), device)},
        "results": [],
        "complete": False,
    }
    progress = out_dir / f"{SUITE}.json"

    def save() -> None:
        doc["summary"] = summarize(doc["results"])
        progress.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    cut: str | None = None
    with int4_kernel(device) as kernel:
        doc["config"]["int4_kernel"] = kernel
        doc["config"]["int4_tuned_tables"] = tuned_table_provenance()
        if stop is not None:
            stop.armed = True
        try:
            for name in args.models:
                cut = _model_rows(name, args, device, dtype, doc, budget, new_tokens, meter, copy_gbs, save)
                if cut:
                    break
        except Stopped as signal_name:
            cut = f"{signal_name}: stopped during the row after the last one written"
        finally:
            if stop is not None:
                stop.armed = False
    doc["complete"] = cut is None
    doc["config"]["cut"] = cut
    doc["config"]["rows_run"] = [f"{r['model']}.p{r['prompt_len']}.{r['variant']}" for r in doc["results"]]
    save()
    return doc


def _model_rows(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, doc: dict[str, Any],
                budget: Budget, new_tokens: int, meter: EnergyMeter | None, copy_gbs: float | None,
                save: Callable[[], None]) -> str | None:
    """One model's rows, appended to doc["results"]; returns why the budget cut them (None: all ran)."""
    gen = torch.Generator().manual_seed(0)
    vocab = (TINY if args.tiny else MODELS)[name]["vocab_size"]
    prompts = {p: torch.randint(3, vocab, (p,), generator=gen).to(device) for p in args.prompt_lens}
    t_build = time.monotonic()
    cut = None
    try:
        for variant, make in model_variants(name, args, device, dtype):
            if variant not in args.variants:
                continue
            for p, prompt in prompts.items():
                kind = row_kind(variant)
                if not budget.fits(kind):
                    cut = f"--max-seconds {args.max_seconds:g}: the next row ({name} P={p} {variant}) would end past it"
                    return cut
                row: dict[str, Any] = {"model": name, "prompt_len": p, "variant": variant}
                t0 = time.monotonic()
                try:
                    v = dataclasses.replace(make(), attention=args.attention, launch_ahead=args.launch_ahead,
                                            prefill_graphs=args.prefill_graphs)
                    row.update(measure(v, prompt, new_tokens, args.trials, args.graphs, meter,
                                       args.energy_window_s, copy_gbs, args.profile))
                except Exception as err:  # a variant that cannot run is reported, the others still run
                    row["error"] = f"{type(err).__name__}: {err}"[:500]
                row["seconds"] = time.monotonic() - t0
                budget.took(kind, row["seconds"])
                doc["results"].append(row)
                save()
                print(f"{name} P={p} {variant}: {row.get('decode_tok_s_median') or row.get('error')}", flush=True)
        return cut
    finally:
        doc.setdefault("model_seconds", {})[name] = time.monotonic() - t_build
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def record_of(doc: dict[str, Any], hardware: str) -> RunRecord:
    samples: dict[str, list[float]] = {}
    metrics: dict[str, float | bool] = {}
    for r in doc["results"]:
        key = f"{r['model']}.p{r['prompt_len']}.{r['variant']}"
        if "error" in r:
            continue
        samples[f"{key}.decode_tok_s"] = [float(x) for x in r["decode_tok_s"]]
        samples[f"{key}.e2e_tok_s"] = [float(x) for x in r["e2e_tok_s"]]
        for k in ("decode_tok_s_median", "e2e_tok_s_median", "prefill_s_median", "j_per_token",
                  "j_per_token_decode", "j_per_token_decode_above_idle", "j_per_token_decode_diff", "idle_power_w",
                  "prefill_j", "share_of_bound", "bound_tok_s"):
            if r.get(k) is not None:
                metrics[f"{key}.{k}"] = float(r[k])
        for k, v in (r.get("per_token") or {}).items():
            if v is not None:  # outside_us is None where no decode time was measured
                metrics[f"{key}.per_token.{k}"] = float(v)
        for k, v in (r.get("prefill_profile") or {}).items():
            if v is not None:
                metrics[f"{key}.prefill.{k}"] = float(v)
    for row in doc["summary"]:
        key = f"{row['model']}.p{row['prompt_len']}.{row['variant']}"
        for k in ("speedup_vs_baseline", "energy_vs_baseline", "decode_energy_vs_baseline",
                  "decode_energy_diff_vs_baseline"):
            if row.get(k) is not None:
                metrics[f"{key}.{k}"] = float(row[k])
    model = ",".join(f"{m}-config-random-weights" for m in doc["config"]["models"])
    return RunRecord(claim_ids=[], suite=SUITE, config=doc["config"], samples=samples, metrics=metrics,
                     environment=capture_environment(), complete=doc["complete"],
                     conditions={"model": model, "hardware": hardware, "trials": doc["config"]["trials"]})


def inductor_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE -> (key, value) for torch.compile's `options` (`key_value`: true/false as bools, integers as ints)."""
    return key_value(text, "--inductor-option")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="exit status: 0 every requested row ran; 2 cut by --max-seconds or SIGTERM "
                                       "(partial JSON and record written); 3 ran to the end but some row raised")
    p.add_argument("--out", required=True, help="directory for decode_e2e.json and the run record")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[32, 2048])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS,
                   help="default: every variant but int4_unfused")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (4 with --tiny)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no row whose estimate would end past this many seconds (the run then writes what it "
                        "measured, a record with complete=false, and exits 2)")
    p.add_argument("--energy-window-s", type=float, default=5.0)
    p.add_argument("--no-energy", dest="energy", action="store_false")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument("--attention", choices=("auto", *DECODE_ATTENTIONS), default="auto",
                   help="the engine's one-token attention over its static cache (DecodeConfig.attention)")
    p.add_argument("--no-launch-ahead", dest="launch_ahead", action="store_false",
                   help="launch each plain step after reading the previous one (DecodeConfig.launch_ahead=False)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; CPU: eager)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="compile the compiled variants' prefill too, with a dynamic length (default: eager prefill)")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="replay each prompt's forward as a CUDA graph, padded to the engine's prefill sizes "
                        "(DecodeConfig.prefill_graphs; the warm-up's second run captures it)")
    p.add_argument("--inductor-option", dest="inductor_options", action="append", type=inductor_option, default=[],
                   metavar="KEY=VALUE", help="a torch._inductor.config option for every compiled variant (repeat "
                                             "for more), e.g. combo_kernels=true")
    p.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="launch the mma GEMV and decode attention plainly, not as programmatic dependents "
                        "(sdsie.kernels.device.set_programmatic_launch; inductor's own PDL is "
                        "--inductor-option triton.enable_pdl=true)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configurations (CPU dry run)")
    p.add_argument("--no-record", dest="record", action="store_false")
    p.add_argument("--gated-layout", choices=("fused", "unfused"), default="fused",
                   help="the gated variants' q/k/v and gate/up: fused, as the INT4 variants run (default), or "
                        "separate layers")
    args = p.parse_args(argv)
    if args.gated_layout == "fused" and "int4_unfused" in args.variants and GATED & set(args.variants):
        p.error("int4_unfused runs the gated layers' INT4 halves unfused: with a gated variant, pass "
                "--gated-layout unfused")
    if args.gated_layout == "unfused" and GATED_NORMS & set(args.variants):
        p.error("the gated_norms variants need the MLP fused (fuse_norms): drop --gated-layout unfused")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("decode_e2e needs a CUDA GPU (or --device cpu --tiny for a dry run)")
    if device.type != "cuda":
        args.graphs = False  # CUDA graphs are CUDA's
        args.compile_backend = args.compile_backend or "eager"
    if args.trials < 1 or any(n < 2 for n in args.prompt_lens):
        raise SystemExit("--trials must be >= 1 and every --prompt-lens >= 2")
    set_programmatic_launch(args.pdl)
    with SigtermStop().installed() as stop:
        doc = run_suite(args, stop)
        print(table(doc["summary"]))
        if doc["config"]["cut"]:
            print(f"cut: {doc['config']['cut']}")
        if args.record:
            hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            path = write_record(record_of(doc, hardware), args.out)
            print(f"record: {path}")
    if not doc["complete"]:
        return 2
    return 3 if any(r.get("error") for r in doc["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
