"""Tune the INT4 kernel's configuration on your own GPU and shapes, once, and keep the result per GPU model.

The built-in choice (`select_config`: the mma GEMV's rule, the shipped table, the fitted rule) was fitted and tuned on
an H200. On another GPU, or a shape far from the fitted ones, `tune` times every configuration that choice can return
for the shape (`case_candidates`) under CUDA graphs with L2-cold weights (`sdsie.telemetry.timing.graph_us`, the
timer the kernel's sweeps rank by), checks each result against the float64 reference, and writes the fastest per
(M bucket, N, K, group) to the local tuned cache (`tuned_cache_path`, `$SDSIE_INT4_CACHE`). `select_config` reads that
cache first, so the tuned shape then runs at the exhaustive best of the choice's own candidates.

Tuning is explicit (`sdsie tune-int4`, its options in `sdsie.cli`; or `tune` / `tune_model` from Python): nothing
tunes inside a decode. A case costs a Triton compile of each of its 10-34 candidates (about a second each on a cold
Triton cache, read back from disk in later processes) and one graphed timing of each. Entries are keyed by the GPU's
name, the M bucket, N, K and the group; `select_config` takes an mma entry only for bf16 x the mma kernel can read.

    sdsie tune-int4 --shape 4096x4096 --shape 28672x4096 --gate-up 28672x4096 --m 1 2 4 8 --group 128
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from sdsie.int4_format import Int4Weight, pack_int4
from sdsie.kernels.device import kernel_runs_on
from sdsie.kernels.int4_config import (
    _LARGE_M_CONFIG,
    MMA_CONFIGS,
    MMA_SPREAD_STAGES,
    TUNED_CACHE_FORMAT,
    TUNED_M,
    Int4KernelConfig,
    candidate_configs,
    device_name,
    mma_blocks,
    read_tuned_cache,
    select_config_with_source,
    tuned_cache_path,
    tuned_key,
)
from sdsie.kernels.int4_gemm import _plans_of, int4_matmul, int4_silu_mul, refresh_choice, silu_mul_halves
from sdsie.kernels.int4_mma import mma_supported
from sdsie.kernels.reference import int4_matmul_reference
from sdsie.stats import geomean

__all__ = ["CORRECT_REL_ERROR", "CaseResult", "TuneCase", "case_candidates", "choice_configs", "config_from_name",
           "config_name", "fits", "meta_int4", "model_cases", "rel_error", "tune", "tune_model", "write_tuned"]

CORRECT_REL_ERROR = 2e-2  # a configuration's result counts when its relative error to the reference is under this
GEMV_SWEEP_M = (1, 2)  # the one-row GEMV kernel is timed at these M; the tl.dot kernels at M >= 2
MULTI_ROW_SWEEP_M = (2, 4, 8)  # GEMV programs of 2 or 4 rows

# (make_call, bytes per call) -> microseconds a call; make_call(i) is a call on the i-th weight copy
Timer = Callable[[Callable[[int], Callable[[], object]], int], float]


def config_name(cfg: Int4KernelConfig) -> str:
    """A sweep's key for one configuration: int4[rows,BN,BK,sSPLIT,wWARPS(,pSTAGES)(,gather)(,swap)(,rREGS)(,mma)].
    (Older raw sweeps also name ',planes', a flag that swap_ab replaced: docs/kernel-log.md.)"""
    return (f"int4[{cfg.block_m},{cfg.block_n},{cfg.block_k},s{cfg.split_k},w{cfg.num_warps}"
            f"{'' if cfg.num_stages == 2 else f',p{cfg.num_stages}'}{'' if cfg.x_tile else ',gather'}"
            f"{',swap' if cfg.swap_ab else ''}{'' if cfg.max_registers is None else f',r{cfg.max_registers}'}"
            f"{',mma' if cfg.mma else ''}]")


def config_from_name(name: str) -> Int4KernelConfig:
    """`config_name`'s inverse: 'int4[1,128,256,s2,w4,p4]' or the same without 'int4[' and ']' -> Int4KernelConfig
    (num_stages 2, x tiled, no cap by default). ValueError naming the part it cannot read."""
    text = name[5:-1] if name.startswith("int4[") and name.endswith("]") else name
    parts = text.split(",")
    if len(parts) < 5 or not parts[3].startswith("s") or not parts[4].startswith("w"):
        raise ValueError(f"config {name!r}: expected ROWS,BN,BK,sSPLIT,wWARPS[,pSTAGES][,gather][,swap][,rREGS][,mma]")
    kw: dict = {}
    for part in parts[5:]:
        if part in ("gather", "swap", "mma"):
            kw[{"gather": "x_tile", "swap": "swap_ab", "mma": "mma"}[part]] = part != "gather"
        elif part[:1] in ("p", "r") and part[1:].isdigit():
            kw["num_stages" if part[0] == "p" else "max_registers"] = int(part[1:])
        else:
            raise ValueError(f"config {name!r}: unknown part {part!r}")
    return Int4KernelConfig(int(parts[0]), int(parts[1]), int(parts[2]), split_k=int(parts[3][1:]),
                            num_warps=int(parts[4][1:]), **kw)


def choice_configs() -> list[Int4KernelConfig]:
    """Every configuration `select_config` can return at M <= 16: the rule's terms and the tuned tables' entries
    (`candidate_configs`, less the prompt tile it runs only when named) and the mma GEMV's three (`MMA_CONFIGS`, and
    4 warps with 4 pairs in flight, `mma_stages`). A sweep of these per shape is the exhaustive best of the choice's
    own candidates."""
    return [c for c in candidate_configs() if c != _LARGE_M_CONFIG] + list(MMA_CONFIGS.values()) + [
        mma_blocks(4, 1, MMA_SPREAD_STAGES)]


def fits(cfg: Int4KernelConfig, m: int) -> bool:
    """Whether a sweep times `cfg` at this M: one-row GEMV configs at GEMV_SWEEP_M, GEMV programs of several rows
    at M in MULTI_ROW_SWEEP_M, the tl.dot configs (planes included) at M >= 2, the mma GEMV at M <= 16 (more than 2
    pairs in flight at M <= 8: at M = 9-16 they leave 2 programs an SM, `mma_stages`). Planes, timed
    at M = 1, lost all 20 cases to the GEMV, by 15-67% (kernel_sweep_20261130T2332_planes_m1_m16_h200.json,
    kernel_sweep_20261201T0134_xwords_h200.json), so a sweep spends no GPU time on it there."""
    if cfg.mma:
        return m <= (16 if cfg.num_stages == 2 else 8)
    if cfg.block_m == 1:
        return m in GEMV_SWEEP_M
    if cfg.gemv:
        return m in MULTI_ROW_SWEEP_M
    return m >= 2


@dataclass(frozen=True)
class TuneCase:
    """One shape to tune: x [m, k] times a weight of n rows, groups of `group_size` codes along K (>= k: per
    channel); `gate_up`: a fused [gate; up] weight whose layer asks for silu(gate) * up (`int4_silu_mul`)."""

    m: int
    n: int
    k: int
    group_size: int
    gate_up: bool = False

    def __post_init__(self) -> None:
        if self.m not in TUNED_M:
            raise ValueError(f"TuneCase: M = {self.m} is not a tuned bucket {TUNED_M} (an entry for bucket b serves "
                             f"the M above the bucket below it up to b)")
        if self.n < 1 or self.k < 1 or self.group_size < 1:
            raise ValueError(f"TuneCase: N, K and group_size must be >= 1, got {(self.n, self.k, self.group_size)}")
        if self.gate_up and self.n % 2:
            raise ValueError(f"TuneCase: a fused [gate; up] weight has an even N, got N = {self.n}")

    @property
    def key(self) -> str:
        return tuned_key(self.m, self.n, self.k, min(self.group_size, self.k))


@dataclass
class CaseResult:
    """What tuning one case found: each candidate's graphed time (us) and relative error, the failures, the pick and
    the built-in choice it replaces (its time is the same run's)."""

    case: TuneCase
    device: str
    builtin: str  # config_name of select_config's choice before tuning
    builtin_source: str  # "mma", "table", "rule" or "tuned"
    times_us: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    best: Int4KernelConfig | None = None
    seconds: float = 0.0

    @property
    def best_us(self) -> float | None:
        return None if self.best is None else self.times_us[config_name(self.best)]

    @property
    def builtin_us(self) -> float | None:
        return self.times_us.get(self.builtin)

    def as_dict(self) -> dict:
        return {"case": asdict(self.case), "key": self.case.key, "device": self.device, "builtin": self.builtin,
                "builtin_source": self.builtin_source, "builtin_us": self.builtin_us,
                "best": None if self.best is None else config_name(self.best), "best_us": self.best_us,
                "times_us": self.times_us, "errors": self.errors, "failed": self.failed,
                "seconds": round(self.seconds, 2)}


TABLE_SOURCES = ("table", "tuned")  # built-in picks a tuned table served: measured on the shape, not predicted


def _builtin_over_best(results: Iterable[CaseResult]) -> dict:
    """How many of the cases with both times the built-in choice was within 90% of the best's speed (its time at
    most 1 / 0.9 of the best's: the kernel issue's held-out bar), and the geomean and worst of built-in over best."""
    ratios = [r.builtin_us / r.best_us for r in results if r.best_us is not None and r.builtin_us is not None]
    return {"compared": len(ratios), "builtin_within_90pct_of_best": sum(x <= 1 / 0.9 for x in ratios),
            "builtin_over_best_geomean": geomean(ratios) if ratios else None,
            "builtin_over_best_max": max(ratios, default=None)}


def summarize(results: Sequence[CaseResult]) -> dict:
    """A run's figures: `_builtin_over_best` over its cases, the same over the cases no tuned table served
    (`held_out`, `TABLE_SOURCES`: only those test the choice on a shape it has not measured), and the seconds the
    cases took (the first-use cost of tuning them)."""
    secs = sorted(r.seconds for r in results)
    return {"cases": len(results), **_builtin_over_best(results),
            "held_out": _builtin_over_best(r for r in results if r.builtin_source not in TABLE_SOURCES),
            "seconds_total": round(sum(secs), 1), "seconds_median": secs[len(secs) // 2] if secs else None}


def case_candidates(case: TuneCase, device: torch.device) -> list[Int4KernelConfig]:
    """The configurations a tune times for `case` on `device`: those of `choice_configs` that `fits` M, the mma ones
    only where bf16 x on this device could run them, and the built-in choice itself (always, first-listed where it
    is not among them)."""
    x = torch.empty(case.m, case.k, dtype=torch.bfloat16, device=device)
    meta = _weight_like(case, "meta")
    mma_ok = device.type == "cuda" and mma_supported(x, meta)
    out = [c for c in choice_configs() if fits(c, case.m) and (not c.mma or mma_ok)]
    builtin, _ = _builtin_choice(case, device)
    return out if builtin in out else [builtin, *out]


def _builtin_choice(case: TuneCase, device: torch.device) -> tuple[Int4KernelConfig, str]:
    """select_config's pick for the case's bf16 x, and its source."""
    return select_config_with_source(case.m, case.n, case.k, device, case.group_size)


def _weight_like(case: TuneCase, device: str | torch.device, gen: torch.Generator | None = None) -> Int4Weight:
    """A random asymmetric INT4 weight of the case's shape (bf16 scales and zero-points): what is read, not its
    values, decides the time."""
    n, k, g = case.n, case.k, min(case.group_size, case.k)
    groups = -(-k // g)
    if str(device) == "meta":
        return meta_int4(n, k, g)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8, device=device)
    scales = ((torch.rand(groups, n, generator=gen, device=device) + 0.5) * 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, device=device).to(torch.bfloat16)
    return Int4Weight(pack_int4(q), scales, zeros, k, g)


def meta_int4(n: int, k: int, group_size: int) -> Int4Weight:
    """An Int4Weight of this shape on the meta device (no memory): enough to plan a launch or ask who takes it."""
    groups = -(-k // group_size)
    return Int4Weight(torch.empty(n, -(-k // 2), dtype=torch.uint8, device="meta"),
                      torch.empty(groups, n, dtype=torch.bfloat16, device="meta"),
                      torch.empty(groups, n, dtype=torch.bfloat16, device="meta"), k, group_size)


def _default_timer(device: torch.device) -> tuple[Timer, Callable[[int], int]]:
    """(timer, copies for a weight of that many bytes): graphed and L2-cold on CUDA; on a CPU (the interpreter: a
    dry run of the procedure, not a measurement) the wall clock of one call on one copy."""
    if device.type == "cuda":
        from sdsie.telemetry.timing import graph_us, l2_busting_copies

        return (lambda make_call, nbytes: graph_us(make_call, nbytes, str(device)),
                lambda nbytes: l2_busting_copies(str(device), nbytes))

    def wall(make_call: Callable[[int], Callable[[], object]], nbytes: int) -> float:
        fn = make_call(0)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    return wall, lambda nbytes: 1


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64: the measure CORRECT_REL_ERROR bounds."""
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def tune_case(case: TuneCase, device: torch.device, timer: Timer | None = None,
              copies: Callable[[int], int] | None = None, seed: int = 0) -> CaseResult:
    """Time and check every candidate of one case (`case_candidates`); the fastest correct one is `best`."""
    t0 = time.monotonic()
    default_timer, default_copies = _default_timer(device)
    timer, copies = timer or default_timer, copies or default_copies
    builtin, source = _builtin_choice(case, device)
    result = CaseResult(case, device_name(device), config_name(builtin), source)
    gen = torch.Generator(device=device).manual_seed(seed)
    w = _weight_like(case, device, gen)
    ws = [w] + [Int4Weight(w.qweight.clone(), w.scales.clone(), w.zeros.clone(), w.in_features, w.group_size)
                for _ in range(copies(case.n * case.k // 2) - 1)]
    x = torch.randn(case.m, case.k, generator=gen, device=device).to(torch.bfloat16)
    ref = int4_matmul_reference(x, w)  # [M, N] float64
    if case.gate_up:
        ref = silu_mul_halves(ref)
    op = int4_silu_mul if case.gate_up else int4_matmul
    candidates = case_candidates(case, device)
    for cfg in candidates:
        name = config_name(cfg)
        try:
            err = rel_error(op(x, w, config=cfg), ref)
            result.errors[name] = err
            if not err < CORRECT_REL_ERROR:  # NaN counts as wrong
                result.failed[name] = f"relative error {err:.3g} against the reference (bound {CORRECT_REL_ERROR})"
                continue
            result.times_us[name] = timer(lambda i, cfg=cfg: (lambda: op(x, ws[i % len(ws)], config=cfg)),
                                          case.n * case.k // 2)
        except Exception as err:  # out of resources on this GPU, say: recorded, the other candidates go on
            result.failed[name] = f"{type(err).__name__}: {str(err)[:300]}"
        finally:
            for wi in ws:  # split-K workspaces and mma fragments add up over the candidates
                _plans_of(wi).clear()
    timed = {n: us for n, us in result.times_us.items() if math.isfinite(us)}
    if timed:
        result.best = {config_name(c): c for c in candidates}[min(timed, key=timed.get)]
    result.seconds = time.monotonic() - t0
    return result


def write_tuned(results: Sequence[CaseResult], path: Path | None = None) -> Path:
    """Merge the results' picks into the tuned cache (`tuned_cache_path()` unless `path`): each case's entry under
    its device's name, replacing any entry of the same key, with its evidence (the best and the built-in times).
    Other devices' and other keys' entries stay. Then `refresh_choice`, so this process uses them at once."""
    path = path if path is not None else tuned_cache_path()
    if path is None:
        raise ValueError("the INT4 tuned cache is off (SDSIE_INT4_CACHE=off): name a path to write to")
    doc = read_tuned_cache(path)
    for r in results:
        if r.best is None:
            continue
        entry = doc["devices"].setdefault(r.device, {"configs": {}, "evidence": {}})
        entry["configs"][r.case.key] = asdict(r.best)
        entry.setdefault("evidence", {})[r.case.key] = {
            "best_us": r.best_us, "builtin": r.builtin, "builtin_source": r.builtin_source,
            "builtin_us": r.builtin_us, "candidates": len(r.times_us), "gate_up": r.case.gate_up,
            "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc["format"] = TUNED_CACHE_FORMAT
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    refresh_choice()
    return path


def tune(cases: Iterable[TuneCase], device: torch.device | str = "cuda", *, timer: Timer | None = None,
         copies: Callable[[int], int] | None = None, write: bool = True, path: Path | None = None,
         seed: int = 0, progress: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Tune each case (`tune_case`) and, with `write`, keep the picks in the tuned cache (`write_tuned`). Cases
    that differ only in `gate_up` share a key: the last one tuned wins."""
    device = torch.device(device)
    if not kernel_runs_on(device):
        raise ValueError(f"tune: Triton kernels do not run on {device} here: a CPU runs them only under the "
                         f"interpreter (TRITON_INTERPRET=1, set before Python starts), where times mean nothing")
    results = []
    for case in dict.fromkeys(cases):
        results.append(tune_case(case, device, timer, copies, seed))
        if progress is not None:
            progress(results[-1])
    if write:
        write_tuned(results, path)
    return results


def model_cases(model: nn.Module, m_values: Sequence[int] = TUNED_M) -> list[TuneCase]:
    """The cases of every INT4 layer of `model` (`Int4Linear`, also inside `GatedLinear`), each shape once, at each M
    of `m_values`; a fused [gate; up] projection whose MLP takes silu(gate) * up from it is tuned as `int4_silu_mul`."""
    from sdsie.quant.fuse import FusedMLP
    from sdsie.quant.linear import Int4Linear

    projections = [mod.gate_up_proj for mod in model.modules() if isinstance(mod, FusedMLP) and mod.silu_in_projection]
    gate_up = {id(getattr(p, "quantized", p)) for p in projections}  # a GatedLinear's INT4 layer, or the layer
    shapes = {}
    for mod in model.modules():
        if isinstance(mod, Int4Linear):
            shapes.setdefault((mod.out_features, mod.in_features, mod.group_size), id(mod) in gate_up)
    if not shapes:
        raise ValueError(f"model_cases: {type(model).__name__} has no Int4Linear layer (quantize_model or gate_model "
                         f"first)")
    return [TuneCase(m, n, k, g, fused) for (n, k, g), fused in shapes.items() for m in m_values]


def tune_model(model: nn.Module, m_values: Sequence[int] = TUNED_M, **kwargs) -> list[CaseResult]:
    """`tune` every INT4 layer shape of `model` (`model_cases`) on the device its weights are on."""
    device = next((b.device for b in model.buffers() if b.dtype == torch.uint8), None)
    if device is None:
        raise ValueError(f"tune_model: {type(model).__name__} has no packed INT4 weights")
    return tune(model_cases(model, m_values), device, **kwargs)


# --- the command: sdsie tune-int4 (its options: sdsie.cli) ---------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    shapes = [(n, k, False) for n, k in args.shape] + [(n, k, True) for n, k in args.gate_up]
    if not shapes:
        print("sdsie tune-int4: name at least one --shape or --gate-up NxK", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sdsie tune-int4: no CUDA GPU here (torch.cuda.is_available() is False); --device cpu is a dry run",
              file=sys.stderr)
        return 2
    try:
        cases = [TuneCase(m, n, k, k if g is None else g, fused) for n, k, fused in shapes for g in args.group
                 for m in args.m]
    except ValueError as err:
        print(f"sdsie tune-int4: {err}", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            names = [config_name(cfg) for cfg in case_candidates(c, device)]
            print(f"{c.key}{' gate_up' if c.gate_up else ''}: {len(names)} candidates: {' '.join(names)}")
        return 0
    if not kernel_runs_on(device):
        print("sdsie tune-int4: --device cpu runs the kernels only under Triton's interpreter: set TRITON_INTERPRET=1 "
              "(a dry run; its times mean nothing)", file=sys.stderr)
        return 2

    done: list[CaseResult] = []

    def show(r: CaseResult) -> None:  # each case as it ends; --out is rewritten then, so a stopped run keeps its cases
        best = "none correct" if r.best is None else f"{config_name(r.best)} {r.best_us:.1f} us"
        builtin = "-" if r.builtin_us is None else f"{r.builtin_us:.1f} us"
        print(f"{r.case.key}{' gate_up' if r.case.gate_up else ''}: best {best}; built-in {r.builtin} "
              f"({r.builtin_source}) {builtin}; {len(r.times_us)} timed, {len(r.failed)} failed, {r.seconds:.1f} s",
              flush=True)
        done.append(r)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"device": device_name(device), "torch": torch.__version__,
                                            "planned_cases": len(cases), "summary": summarize(done),
                                            "results": [d.as_dict() for d in done]}, indent=1) + "\n")

    results = tune(cases, device, write=False, progress=show)
    s = summarize(results)
    if s["compared"]:
        print(f"{s['cases']} cases: the built-in choice within 90% of the best's speed on "
              f"{s['builtin_within_90pct_of_best']} of {s['compared']} (its time over the best's: geomean "
              f"{s['builtin_over_best_geomean']:.3f}, worst {s['builtin_over_best_max']:.3f}); tuning took "
              f"{s['seconds_total']} s, {s['seconds_median']:.1f} s a case (median)")
        h = s["held_out"]
        if h["compared"]:
            print(f"held out (no tuned table served the choice): within 90% on {h['builtin_within_90pct_of_best']} "
                  f"of {h['compared']} (geomean {h['builtin_over_best_geomean']:.3f}, worst "
                  f"{h['builtin_over_best_max']:.3f})")
        else:
            print("held out: none (a tuned table served every case, so this run tests no prediction)")
    if args.write:
        print(f"wrote {write_tuned(results, args.cache)}")
    return 0 if all(r.best is not None for r in results) else 1

