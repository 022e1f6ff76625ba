"""GPU reproduction of the decoding claims on the offline stand-in pair (or the seed's models).

One process, one pair, variants interleaved per trial (plain, fixed-K5, gated at the seed's
production and tuned thresholds, HF assisted generation as the peer baseline), warm-up runs
excluded, one NVML energy window per run, greedy outputs checked against plain decoding during
the performance runs; after the trials, the graphed loops' energy over windows of back-to-back runs
(`energy_windows`: a graphed run is too short for the energy counter). Then the threshold grid,
decision determinism and the Resolution Gear fidelity table, and the gear's INT4 usage, throughput
and power. Each suite writes one run record under telemetry/; a record declares the registry claims
(reproductions/claims.toml) whose test nodes its suite serves and whose metrics it holds, so ids are
never kept by hand here.

    python -m reproductions.decode_repro [--trials 5] [--max-new-tokens 128] [--out telemetry]

The GPU tests (reproductions/test_speculative_gpu.py, test_gated_gpu.py, test_resolution_gear_gpu.py)
call the same suite functions: `decode_record`, `grid_record`, `fidelity_record`, `gear_record`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import hashlib
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from reproductions.args import non_negative_float, positive_int
from sdsie.claims import load_registry, missing_inputs
from sdsie.clutch import PRODUCTION, SEED_CLUTCHES, TUNED, ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, generate, near_tie_report
from sdsie.decoding.model_io import StaticKV, cache_length, crop_cache, forward, new_cache, sync_device
from sdsie.decoding.near_tie import decode_logits
from sdsie.decoding.tree import check_widths
from sdsie.kernels.rmsnorm import fuse_rmsnorm
from sdsie.models import compiled_copy
from sdsie.stats import bootstrap_median_ci, paired_ratios, paired_speedup  # noqa: F401 (also exported here)
from sdsie.telemetry.energy import EnergyMeter, EnergyMeterError, calls_to_fill
from sdsie.telemetry.env import host_launch_us, per_op_us
from sdsie.telemetry.records import RunRecord, capture_environment, write_record
from sdsie.telemetry.timing import cuda_event_ms

FAMILY_LABEL = {"verse": "poem", "prose": "physics", "code": "code"}  # seed README names
K = 5
DEFAULT_TREE_WIDTHS = (4, 3, 3)  # the tree_graphs variant's tree (TREE, below): the tree probe's best on code
DEFAULT_WIDE_TREE_WIDTHS = (6, 4, 4)  # tree_graphs_wide's (TREE_WIDE): the probe's best of at most 127 nodes
REGISTRY = Path(__file__).resolve().parent / "claims.toml"
_NODE = "reproductions/{}.py::{}"
# Registry test nodes each suite serves: a record declares the claims of these nodes whose inputs it holds.
DECODE_TESTS = (_NODE.format("test_speculative_gpu", "test_fixed_k5"),
                _NODE.format("test_speculative_gpu", "test_plain_decode_throughput"),
                _NODE.format("test_gated_gpu", "test_gated_tuned"),
                _NODE.format("test_gated_gpu", "test_gated_production"))
DECODE_ALSO = ("gated-decisions-bit-identical",)  # portable; its registry test is the CPU re-measurement
GRID_TESTS = (_NODE.format("test_gated_gpu", "test_threshold_grid"),)
FIDELITY_TESTS = (_NODE.format("test_resolution_gear_gpu", "test_fidelity_by_gated_layers"),)
GEAR_TESTS = (_NODE.format("test_resolution_gear_gpu", "test_int4_usage_throughput_power"),)
SEED_FIDELITY_TOKENS = 250  # the seed's fidelity table generated 250 tokens per prompt


def declared_claims(tests: Iterable[str], metrics: Mapping[str, Any], samples: Mapping[str, Any],
                    also: Iterable[str] = ()) -> list[str]:
    """Claim ids for a record: the registry claims of `tests` (plus `also`) whose inputs the record holds.

    A claim whose metric the run could not compute (e.g. acceptance when the clutch never speculated)
    is printed, not declared: the gate then lists it as unmeasured instead of failing on a gap.
    """
    tests, also = set(tests), set(also)
    ids = []
    for claim in load_registry(REGISTRY).claims.values():
        if not claim.measurable or (claim.test not in tests and claim.id not in also):
            continue
        lacks = missing_inputs(claim, metrics, samples)
        if lacks:
            print(f"not measured by this run: {claim.id} (lacks {', '.join(lacks)})", flush=True)
        else:
            ids.append(claim.id)
    return ids


@dataclass
class Run:
    variant: str
    family: str
    trial: int
    tokens: list[int]
    seconds: float
    energy_j: float | None
    stats: dict = field(default_factory=dict)
    decisions: str = ""


Outcome = tuple[list[int], dict, str]  # tokens, stats, decisions


def timed(fn: Callable[[], Outcome], meter: EnergyMeter | None) -> tuple[list[int], float, float | None, dict, str]:
    """Run once inside an energy window; wall time between synchronized edges."""
    win = meter.start() if meter else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync_device(device)
    t0 = time.perf_counter()
    tokens, stats, decisions = fn()
    sync_device(device)
    seconds = time.perf_counter() - t0
    energy = None
    if meter:
        try:
            energy = meter.stop(win, tokens=len(tokens)).energy_j
        except Exception as err:  # a too-short window is reported as missing energy, never as 0 J
            print(f"energy window rejected: {err}")
    return tokens, seconds, energy, stats, decisions


def variants(target, scout, cfg: DecodeConfig, graphs: bool = False,
             tree_widths: tuple[int, ...] = DEFAULT_TREE_WIDTHS,
             wide_tree_widths: tuple[int, ...] = DEFAULT_WIDE_TREE_WIDTHS,
             ) -> dict[str, Callable[[torch.Tensor], tuple[list[int], dict, str]]]:
    """The decode suite's variants (VARIANTS) as functions of a prompt's ids; graphs adds the GRAPHED ones, this
    engine's loops on a static cache with replayed CUDA graphs. Eager host dispatch makes the eager loops' times
    noisy; graphed, a gated run that never engages is timed closely enough to tell its cost against plain_graphs."""
    def ours(config: DecodeConfig, scout_=None, clutch: ClutchConfig | None = None, keep_entropy: bool = False):
        """This engine's loop under `config` (a scout: speculation; a clutch: gated); keep_entropy records the
        entropy (bits) behind each token, what a clutch reads (the eager plain runs keep it)."""
        def fn(ids):
            r = generate(target, ids, config, scout=scout_, clutch=EntropyClutch(clutch) if clutch else None)
            stats = r.stats.to_dict()
            if keep_entropy:
                stats["entropy_bits"] = [r.prefill_entropy] + [c.entropy for c in r.cycles]
            return r.tokens, stats, r.decisions
        return fn

    def hf_assisted(ids):
        out = target.generate(ids[None, :], assistant_model=scout, max_new_tokens=cfg.max_new_tokens,
                              min_new_tokens=cfg.max_new_tokens, do_sample=False, num_assistant_tokens=K)
        return out[0, ids.numel():].tolist(), {}, ""

    def hf_generate(ids):
        out = target.generate(ids[None, :], max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens,
                              do_sample=False)
        return out[0, ids.numel():].tolist(), {}, ""

    @functools.cache
    def fused_scout():  # a copy of the scout with one kernel a norm, made on first use
        fused = copy.deepcopy(scout)
        fuse_rmsnorm(fused)
        return fused

    @functools.cache
    def compiled_scout():  # a compiled copy of the scout, made on first use
        return compiled_copy(scout)

    scouts = {None: lambda: None, "plain": lambda: scout, "fused": fused_scout, "compiled": compiled_scout}
    widths = {"tree_widths": tree_widths, "wide_tree_widths": wide_tree_widths}

    def config_of(v: Variant) -> DecodeConfig:
        if not v.graphs:
            return cfg if v.k is None else DecodeConfig(max_new_tokens=cfg.max_new_tokens, k_draft=v.k)
        return DecodeConfig(max_new_tokens=cfg.max_new_tokens, k_draft=v.k, kv_cache="static", cuda_graphs=True,
                            pad_scout_catchup=v.pad, k_schedule=v.schedule,
                            tree_widths=widths[v.tree] if v.tree else None)

    def clutch_of(v: Variant) -> ClutchConfig | None:
        if v.clutch is None:
            return None
        clutch = SEED_CLUTCHES[v.clutch]
        return dataclasses.replace(clutch, k_draft=len(widths[v.tree])) if v.tree else clutch  # a tree: its depth

    def fn_of(v: Variant) -> Callable[[torch.Tensor], Outcome]:
        if v.runner != "engine":
            return {"hf_assisted": hf_assisted, "hf_generate": hf_generate}[v.runner]
        config, clutch, scout_of = config_of(v), clutch_of(v), scouts[v.scout]
        return lambda ids: ours(config, scout_of(), clutch, v.keep_entropy)(ids)

    return {v.name: fn_of(v) for v in VARIANTS if graphs or not v.graphs}


def warm_up(fns: Mapping[str, Callable[[torch.Tensor], Any]], prompts: Mapping[str, tuple[str, torch.Tensor]]) -> None:
    """One untimed run of every variant on every prompt: a prompt's first run pays for its new shapes
    (on the H200 a cold first trial ran at less than half the speed of the later ones)."""
    for _family, ids in prompts.values():
        for fn in fns.values():
            fn(ids)


def run_order(names: list[str], trial: int, prompt_index: int, seed: int = 0) -> list[str]:
    """The variants in a seeded order of their own for each (trial, prompt): in a fixed order plain always ran
    first, after the previous prompt's HF runs, so any drift within a group (clocks, allocator, host caches)
    fell on the same variants every time. The order is recorded per run (stats["slot"])."""
    order = list(names)
    random.Random(f"{seed}:{trial}:{prompt_index}").shuffle(order)
    return order


def select_variants(fns: dict[str, Any], only: Iterable[str] | None) -> dict[str, Any]:
    """The variants named in `only` (all when None). Every ratio needs its baseline, so plain must be among them,
    and plain_graphs too when a graphed loop is; an unknown name is an error naming the known ones."""
    if only is None:
        return fns
    only = list(dict.fromkeys(only))
    unknown = [v for v in only if v not in fns]
    if unknown:
        raise ValueError(f"unknown decode variants {unknown}; this run has {sorted(fns)} (graph variants need "
                         "--cuda-graphs)")
    needed = {"plain"} | {BASELINE[v] for v in only if v in BASELINE}
    if needed - set(only):
        raise ValueError(f"variants {only} lack the baselines their ratios need: add {sorted(needed - set(only))}")
    return {v: fns[v] for v in fns if v in only}


def run_decode_suite(target, scout, prompts: dict[str, tuple[str, torch.Tensor]], trials: int, max_new: int,
                     meter: EnergyMeter | None, graphs: bool = False, only: Iterable[str] | None = None,
                     energy_window_s: float = 0.0, tree_widths: tuple[int, ...] = DEFAULT_TREE_WIDTHS,
                     wide_tree_widths: tuple[int, ...] = DEFAULT_WIDE_TREE_WIDTHS,
                     ) -> tuple[list[Run], list[EnergyWindowRun]]:
    """The timed trials (interleaved, seeded order per trial and prompt), then, with a meter and energy_window_s > 0,
    the graphed loops' energy windows (energy_windows)."""
    cfg = DecodeConfig(max_new_tokens=max_new)
    fns = select_variants(variants(target, scout, cfg, graphs, tree_widths, wide_tree_widths), only)
    runs: list[Run] = []
    start = time.perf_counter()
    warm_up(fns, prompts)
    print(f"decode suite: warm-up done at {time.perf_counter() - start:.0f} s", flush=True)
    for trial in range(trials):
        for p_index, (pid, (family, ids)) in enumerate(prompts.items()):
            for slot, name in enumerate(run_order(list(fns), trial, p_index)):  # interleaved, seeded order
                fn = fns[name]
                tokens, sec, energy, stats, dec = timed(lambda fn=fn, ids=ids: fn(ids), meter)
                runs.append(Run(name, family, trial, tokens, sec, energy, stats, dec))
                runs[-1].stats.update(prompt=pid, slot=slot)
        print(f"decode suite: trial {trial} done at {time.perf_counter() - start:.0f} s", flush=True)
    windows = energy_windows(fns, prompts, runs, meter, energy_window_s) if meter and energy_window_s > 0 else []
    if windows:
        print(f"decode suite: {len(windows)} energy windows done at {time.perf_counter() - start:.0f} s", flush=True)
    return runs, windows


def _per_family(runs: list[Run], variant: str, family: str) -> list[Run]:
    return [r for r in runs if r.variant == variant and r.family == family]


def _tps(rs: list[Run]) -> float:
    return statistics.median(len(r.tokens) / r.seconds for r in rs)


def _jpt(rs: list[Run]) -> float | None:
    vals = [r.energy_j / len(r.tokens) for r in rs if r.energy_j is not None]
    return statistics.median(vals) if vals else None


# The decode suite's variants, one row each (rows built in a loop: one row per K or per clutch setting). `variants`
# hands each row's DecodeConfig, scout and clutch to the engine; run_order shuffles them in this order per trial and
# prompt. The eager rows always run, the graphed ones with --cuda-graphs. What each measured: docs/log.md.
SHORTER_K = (2, 3)  # chains shorter than the seed's K = 5: cheaper cycles at this pair's acceptance
LONG_K = 8  # the adaptive schedule's higher ceiling
UNPADDED = "gated_tuned_graphs_unpadded"
LONG_ADAPTIVE = f"fixed_k{LONG_K}_graphs_adaptive"
TREE, TREE_WIDE = "tree_graphs", "tree_graphs_wide"
TREE_FUSED, TREE_COMPILED = "tree_graphs_fused_scout", "tree_graphs_compiled_scout"
GATED_TREES = {mode: f"gated_{mode}_tree_graphs_compiled_scout" for mode in SEED_CLUTCHES}  # clutch setting -> variant


@dataclass(frozen=True)
class Variant:
    """One decode variant: what `variants` runs for it."""

    name: str
    runner: str = "engine"  # "engine" (sdsie.decoding.generate), or the HF peer: "hf_assisted", "hf_generate"
    k: int | None = None  # a fixed draft length (None: plain decoding, a tree, or the clutch's own K)
    scout: str | None = None  # None (no speculation), "plain", "fused" (its RMSNorms one kernel each), "compiled"
    clutch: str | None = None  # a SEED_CLUTCHES setting gating speculation
    graphs: bool = False  # a static cache with replayed CUDA graphs; greedy reference plain_graphs
    schedule: str = "constant"  # DecodeConfig.k_schedule
    pad: bool = True  # DecodeConfig.pad_scout_catchup
    tree: str | None = None  # the record config key holding the widths of the static tree it drafts
    keep_entropy: bool = False  # keep the entropy (bits) behind each token, what a clutch reads


VARIANTS = (
    Variant("plain", keep_entropy=True),  # the eager loops' greedy reference
    Variant("fixed_k5", k=K, scout="plain"),  # the seed's fixed-K speculation
    Variant("gated_production", scout="plain", clutch="production"),
    Variant("gated_tuned", scout="plain", clutch="tuned"),
    Variant("hf_assisted", runner="hf_assisted"),  # HF transformers on the same pair: the peer
    Variant("hf_generate", runner="hf_generate"),
    Variant("plain_graphs", graphs=True),  # the graphed loops' greedy reference
    Variant("fixed_k5_graphs", k=K, scout="plain", graphs=True),
    Variant("gated_production_graphs", scout="plain", clutch="production", graphs=True),
    Variant("gated_tuned_graphs", scout="plain", clutch="tuned", graphs=True),
    *(Variant(f"fixed_k{k}_graphs", k=k, scout="plain", graphs=True) for k in SHORTER_K),
    Variant(UNPADDED, scout="plain", clutch="tuned", graphs=True, pad=False),  # the scout's catch-up eager
    Variant("fixed_k5_graphs_adaptive", k=K, scout="plain", graphs=True, schedule="adaptive"),
    Variant("gated_tuned_graphs_adaptive", scout="plain", clutch="tuned", graphs=True, schedule="adaptive"),
    Variant(LONG_ADAPTIVE, k=LONG_K, scout="plain", graphs=True, schedule="adaptive"),
    Variant(TREE, scout="plain", graphs=True, tree="tree_widths"),  # --tree-widths
    Variant(TREE_WIDE, scout="plain", graphs=True, tree="wide_tree_widths"),  # --wide-tree-widths, beside TREE
    Variant(TREE_FUSED, scout="fused", graphs=True, tree="tree_widths"),
    Variant(TREE_COMPILED, scout="compiled", graphs=True, tree="tree_widths"),
    *(Variant(name, scout="compiled", clutch=mode, graphs=True, tree="tree_widths")  # the clutch's K: the depth
      for mode, name in GATED_TREES.items()),
)
# Variants whose greedy output must equal plain decoding's token for token: this package's engine.
OUR_SPECULATIVE = tuple(v.name for v in VARIANTS if v.runner == "engine" and v.scout and not v.graphs)
PEERS = tuple(v.name for v in VARIANTS if v.runner != "engine")
ADAPTIVE = tuple(v.name for v in VARIANTS if v.schedule == "adaptive" and v.k != LONG_K)
TREES = tuple(v.name for v in VARIANTS if v.tree and not v.clutch)  # every speculate cycle drafts the tree
# Each variant that decodes tree_widths or wide_tree_widths and the record config key holding its widths (one place:
# decode_record writes them, readme_results reads them back)
TREE_WIDTHS_KEY = {v.name: v.tree for v in VARIANTS if v.tree}
GRAPHED = tuple(v.name for v in VARIANTS if v.graphs)
# Checked and reported apart: HF assisted (a peer), the graphed speculative loops (against plain_graphs, the same
# static-cache kernels) and plain_graphs against plain (a static cache masks attention explicitly: other bf16 kernels).
COMPARED = (*OUR_SPECULATIVE, "hf_assisted", *GRAPHED)


# The greedy reference of each compared variant: a graphed loop runs the static-cache kernels of plain_graphs.
BASELINE = {v: "plain_graphs" for v in GRAPHED[1:]}


# The graphed loops' energy over windows of back-to-back runs. A graphed run of 128 tokens takes about 0.25 s, two or
# three updates of NVML's ~100 ms energy counter, so one run's J/token is quantized by tens of percent; a window of
# ENERGY_WINDOW_S spans about twenty updates. Eager runs last 1-3 s and keep their per-run windows.
ENERGY_WINDOW_S = 2.0


@dataclass
class EnergyWindowRun:
    variant: str
    prompt: str
    family: str
    runs: int  # back-to-back decodes of the prompt inside the window
    tokens: int
    seconds: float
    energy_j: float

    @property
    def j_per_token(self) -> float:
        return self.energy_j / self.tokens


def energy_windows(fns: Mapping[str, Callable[[torch.Tensor], Any]], prompts: Mapping[str, tuple[str, torch.Tensor]],
                   runs: list[Run], meter: EnergyMeter, window_s: float = ENERGY_WINDOW_S,
                   variants_: Iterable[str] = GRAPHED) -> list[EnergyWindowRun]:
    """After the timed trials: per prompt, each of `variants_` that ran decodes the prompt back to back inside one
    energy window of at least `window_s` (as many runs as its median timed run needs), in the seeded order of a trial
    after the last. A rejected window is reported and left out, never counted as 0 J."""
    out: list[EnergyWindowRun] = []
    names = [v for v in variants_ if v in fns]
    trial = 1 + max((r.trial for r in runs), default=-1)
    for p_index, (pid, (family, ids)) in enumerate(prompts.items()):
        for name in run_order(names, trial, p_index):
            timed_s = [r.seconds for r in runs if r.variant == name and r.stats.get("prompt") == pid]
            if not timed_s:
                continue
            n = calls_to_fill(statistics.median(timed_s), window_s)
            win = meter.start()
            t0 = time.perf_counter()
            tokens = sum(len(fns[name](ids)[0]) for _ in range(n))
            try:
                w = meter.stop(win, tokens=tokens)
            except EnergyMeterError as err:  # a window without a trustworthy reading: reported, never a number
                print(f"energy window rejected ({name}, {pid}): {err}")
                continue
            out.append(EnergyWindowRun(name, pid, family, n, tokens, time.perf_counter() - t0, w.energy_j))
    return out


def energy_window_metrics(windows: list[EnergyWindowRun]) -> dict[str, float]:
    """Per variant and family: J/token over the family's windows (their energy over their tokens), and its ratio to
    the baseline's (plain_graphs) over the same prompts."""
    m: dict[str, float] = {}
    by = {(w.variant, w.family): [] for w in windows}
    for w in windows:
        by[w.variant, w.family].append(w)
    for (variant, fam), ws in by.items():
        label = FAMILY_LABEL.get(fam, fam)
        m[f"{variant}.{label}.j_per_token_window"] = sum(w.energy_j for w in ws) / sum(w.tokens for w in ws)
    for variant, fam in by:
        label = FAMILY_LABEL.get(fam, fam)
        base = m.get(f"{BASELINE[variant]}.{label}.j_per_token_window") if variant in BASELINE else None
        if base is not None:
            m[f"{variant}.{label}.j_per_token_window_ratio"] = m[f"{variant}.{label}.j_per_token_window"] / base
    return m


def plain_twin(runs: list[Run], r: Run) -> Run:
    """The baseline run (BASELINE, else plain) of the same prompt and trial as r: its greedy reference."""
    base = BASELINE.get(r.variant, "plain")
    twin = next((p for p in runs if p.variant == base and p.trial == r.trial
                 and p.stats.get("prompt") == r.stats.get("prompt")), None)
    if twin is None:
        raise ValueError(f"no {base} run for prompt {r.stats.get('prompt')!r}, trial {r.trial}: {r.variant} has no "
                         "baseline to be compared with")
    return twin


def identity(runs: list[Run]) -> dict[tuple[str, Any], list[float]]:
    """(variant, prompt) -> 1.0 / 0.0 per run in trial order: its tokens equal its baseline twin's."""
    out: dict[tuple[str, Any], list[float]] = {}
    for r in sorted((r for r in runs if r.variant in COMPARED), key=lambda r: r.trial):
        out.setdefault((r.variant, r.stats.get("prompt")), []).append(float(r.tokens == plain_twin(runs, r).tokens))
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def fidelity_metrics(runs: list[Run]) -> dict[str, float]:
    """Greedy token identity with the plain run of the same prompt and trial, in % of runs.

    fidelity_pct: this package's speculative variants together (the lossless claim); <variant>.fidelity_pct
    for each compared variant, HF assisted generation included (a peer's output, never pooled with ours).
    """
    m: dict[str, float] = {}
    same = identity(runs)
    ours = [v for (variant, _), vs in same.items() if variant in OUR_SPECULATIVE for v in vs]
    if ours:
        m["fidelity_pct"] = 100.0 * statistics.mean(ours)
    for variant in COMPARED:
        vals = [v for (name, _), vs in same.items() if name == variant for v in vs]
        if vals:
            m[f"{variant}.fidelity_pct"] = 100.0 * statistics.mean(vals)
    plain_outputs: dict[Any, set[tuple[int, ...]]] = {}
    for r in runs:
        if r.variant == "plain":
            plain_outputs.setdefault(r.stats.get("prompt"), set()).add(tuple(r.tokens))
    if plain_outputs:  # plain greedy decoding itself repeats exactly (else no comparison above is meaningful)
        m["plain_identical_across_trials"] = float(all(len(v) == 1 for v in plain_outputs.values()))
    return m


def identity_samples(runs: list[Run]) -> dict[str, list[float]]:
    """Raw per-run evidence: 1.0 where a run's tokens equal its plain twin's, per variant|prompt, trial order."""
    return {f"{variant}|{prompt}|identical_to_plain": vals for (variant, prompt), vals in identity(runs).items()}


def mismatch_report(target, runs: list[Run], prompts: Mapping[str, tuple[str, torch.Tensor]]) -> list[dict]:
    """Every distinct divergence from plain decoding, with the logit gap that allowed it.

    For each (variant, prompt, position, tokens) where a compared run's output first differs from its
    plain twin: the trials it happened in, and, from the target's single-token logits along the plain
    output (the plain loop's own path, teacher-forced), the top-1 minus top-2 gap and how far the
    variant's token trailed the plain token. A bf16 near-tie shows as a gap of a few hundredths; a large
    deficit means the variant did not follow the target's argmax.
    """
    found: dict[tuple, dict] = {}
    plain_of: dict[tuple, list[int]] = {}  # the plain output each divergence is measured along
    for r in runs:
        if r.variant not in COMPARED:
            continue
        ref = plain_twin(runs, r)
        point = divergence_point(ref.tokens, r.tokens)
        if point is None:
            continue
        pid = r.stats.get("prompt")
        key = (r.variant, pid, *point.values())
        entry = found.setdefault(key, {"variant": r.variant, "prompt": pid, **point, "trials": []})
        entry["trials"].append(r.trial)
        plain_of.setdefault(key, ref.tokens)
    for key, entry in found.items():
        ids = prompts[entry["prompt"]][1]
        entry.update(gap_at(target, ids, plain_of[key], entry["position"], entry["variant_token"]))
    return sorted(found.values(), key=lambda e: (e["variant"], e["prompt"], e["position"]))


def divergence_point(plain: list[int], tokens: list[int]) -> dict | None:
    """Where tokens first leave plain: position, plain_token and variant_token (None past either's end); None if
    they never do."""
    i = first_divergence(plain, tokens)
    if i is None:
        return None
    return {"position": i, "plain_token": plain[i] if i < len(plain) else None,
            "variant_token": tokens[i] if i < len(tokens) else None}


def gap_at(target, ids: torch.Tensor, plain: list[int], i: int, other: int | None) -> dict:
    """The plain path's logits predicting plain[i]: top-2 gap, and the deficit of `other` against plain[i]."""
    if i >= len(plain):
        return {"plain_gap": None, "variant_token_deficit": None, "variant_token_rank": None}
    if i == 0:  # the prefill's token: one forward over the prompt
        with torch.inference_mode():
            row = forward(target, ids, new_cache(target), last_only=True)[-1].float()
    else:
        row = decode_logits(target, ids, plain[: i + 1], chunk=1)[i - 1]  # row j predicts plain[j + 1]
    top = row.topk(2)
    out = {"plain_gap": float(top.values[0] - top.values[1])}
    if other is None:
        return {**out, "variant_token_deficit": None, "variant_token_rank": None}
    return {**out, "variant_token_deficit": float(row[plain[i]] - row[other]),
            "variant_token_rank": int((row > row[other]).sum())}


def run_ratios(runs: list[Run], variant: str, family: str) -> list[float]:
    """paired_ratios over Run objects: each run of `variant` in `family` against its BASELINE (else plain) run of
    the same prompt and trial (`plain_twin`)."""
    return [(len(r.tokens) / r.seconds) / (len(t.tokens) / t.seconds)
            for r in _per_family(runs, variant, family) for t in [plain_twin(runs, r)]]


def decode_metrics(runs: list[Run]) -> dict[str, float]:
    m: dict[str, float] = {}
    families = sorted({r.family for r in runs})
    speedups, reductions = {}, {}
    present = {r.variant for r in runs}
    graphed = [v for v in GRAPHED if v in present]
    for fam in families:
        label = FAMILY_LABEL.get(fam, fam)
        plain = _per_family(runs, "plain", fam)
        base_tps, base_jpt = _tps(plain), _jpt(plain)
        m[f"{label}.plain_tokens_per_s"] = base_tps
        bits = sorted(b for r in plain for b in r.stats.get("entropy_bits", []))
        if bits:  # where the clutch thresholds (bits, on an EMA of these) sit in this pair's distribution
            for q in (10, 50, 90):
                m[f"{label}.entropy_bits_p{q}"] = bits[min(len(bits) - 1, len(bits) * q // 100)]
        for variant in (v for v in (*OUR_SPECULATIVE, *PEERS, *graphed) if v in present):
            rs = _per_family(runs, variant, fam)
            tps = _tps(rs)
            m[f"{variant}.{label}.tokens_per_s"] = tps
            m[f"{variant}.{label}.speedup"] = tps / base_tps
            jpt = _jpt(rs)
            if jpt is not None and base_jpt is not None:
                m[f"{variant}.{label}.j_per_token_reduction_pct"] = 100.0 * (1 - jpt / base_jpt)
            stats = [r.stats for r in rs if "cycles" in r.stats]
            drafted = sum(s.get("drafted", 0) for s in stats)
            if drafted:  # over every run of the family that drafted (a gated run may draft on one prompt only)
                m[f"{variant}.{label}.acceptance_pct"] = 100.0 * sum(s["accepted"] for s in stats) / drafted
            if stats:
                m[f"{variant}.{label}.fallback_pct"] = 100.0 * statistics.mean(s["fallback_fraction"] for s in stats)
        for variant in (v for v in (*OUR_SPECULATIVE, *PEERS, *graphed) if v in present):  # paired, with intervals
            base = BASELINE.get(variant, "plain")
            paired = paired_speedup(run_ratios(runs, variant, fam))
            if paired is not None:
                key = f"{variant}.{label}.paired_speedup" + ("" if base == "plain" else f"_vs_{base}")
                m[key], m[f"{key}_ci_low"], m[f"{key}_ci_high"] = paired
        if "plain_graphs" in graphed:  # speculation's gain when both loops replay graphs (speedup: against eager plain)
            for v in graphed[1:]:
                m[f"{v}.{label}.speedup_vs_plain_graphs"] = (
                    m[f"{v}.{label}.tokens_per_s"] / m[f"plain_graphs.{label}.tokens_per_s"])
        if base_jpt is not None and _jpt(_per_family(runs, "fixed_k5", fam)) is not None:  # report figure
            m[f"j_per_token.{label}"] = _jpt(_per_family(runs, "fixed_k5", fam))
            m[f"j_per_token_baseline.{label}"] = base_jpt
        if "fixed_k5" in present:
            speedups[label] = m[f"fixed_k5.{label}.speedup"]
        if f"fixed_k5.{label}.j_per_token_reduction_pct" in m:
            reductions[label] = m[f"fixed_k5.{label}.j_per_token_reduction_pct"]
        for mode in (mode for mode in ("tuned", "production") if f"gated_{mode}" in present):
            v = f"gated_{mode}"
            m[f"{mode}.{label}.throughput_change_pct"] = 100.0 * (m[f"{v}.{label}.speedup"] - 1)
            if f"{v}.{label}.j_per_token_reduction_pct" in m:
                m[f"{mode}.{label}.energy_reduction_pct"] = m[f"{v}.{label}.j_per_token_reduction_pct"]
            m[f"{mode}.{label}.fallback_pct"] = m.get(f"{v}.{label}.fallback_pct", float("nan"))
            if f"{v}.{label}.acceptance_pct" in m:
                m[f"{mode}.{label}.acceptance_pct"] = m[f"{v}.{label}.acceptance_pct"]
    if speedups:
        best = max(speedups, key=speedups.get)
        m["speedup_max"] = speedups[best]
        m["acceptance_pct_at_max_speedup"] = m.get(f"fixed_k5.{best}.acceptance_pct", float("nan"))
    if reductions:
        m["j_per_token_reduction_pct_min"] = min(reductions.values())
        m["j_per_token_reduction_pct_max"] = max(reductions.values())
    m.update(fidelity_metrics(runs))
    m["plain_tokens_per_s"] = statistics.median(len(r.tokens) / r.seconds for r in runs if r.variant == "plain")
    dec = {}
    for r in runs:
        if r.variant.startswith("gated"):
            dec.setdefault((r.variant, r.stats.get("prompt")), set()).add(r.decisions)
    if dec:  # no gated run, no evidence: absent, never a vacuous 1.0
        m["decisions_identical_across_trials"] = float(all(len(v) == 1 for v in dec.values()))
    m.update(zero_engagement_deficit(runs, m))
    return {k: float(v) for k, v in m.items() if math.isfinite(v)}  # records refuse NaN: absent, not NaN


def zero_engagement_deficit(runs: list[Run], m: Mapping[str, float]) -> dict[str, float]:
    """% slower than plain of each gated (variant, family) whose runs never speculated: min and max.

    The seed's open 4-13% deficit "even with zero speculative engagement". Empty when every gated
    cell speculated at least once.
    """
    deficits = []
    for variant in ("gated_production", "gated_tuned"):
        for fam in sorted({r.family for r in runs}):
            rs = _per_family(runs, variant, fam)
            if rs and all(r.stats.get("speculate_cycles", 1) == 0 for r in rs):
                deficits.append(-100.0 * (m[f"{variant}.{FAMILY_LABEL.get(fam, fam)}.speedup"] - 1))
    if not deficits:
        return {}
    return {"zero_engagement_deficit_pct_min": min(deficits), "zero_engagement_deficit_pct_max": max(deficits),
            "zero_engagement_cells": float(len(deficits))}


def run_grid(target, scout, prompts, max_new: int, trials: int = 3, graphs: bool = False) -> dict[str, float]:
    """The seed's grid (6 threshold pairs x 3 alphas, N=3) on one prompt per family; throughput vs plain.
    With `graphs`, every loop (plain, fixed-K and gated) runs on a static cache with replayed CUDA graphs.

    grid.production.*: the seed's production point; grid.tuned.*: the seed's "best found" point
    (0.15/0.70, alpha 0.65); grid.best.*: the best point for that family alone (a deficit there means
    no configuration removes it); grid.best_over_all.*: the point this search picks (best worst-family
    ratio). grid.trials: gated runs in total (configurations x prompts x N), the seed's "144 trials".
    """
    from sdsie.decoding import clutch_grid, sweep

    pairs = [(0.15, 0.70), (0.25, 0.85), (0.35, 1.0), (0.45, 1.1), (0.55, 1.25), (0.65, 1.4)]
    clutches = [c for lo, hi in pairs for c in clutch_grid([lo], [hi], [0.35, 0.5, 0.65])]
    fam_prompts = {}
    for _pid, (fam, ids) in prompts.items():
        fam_prompts.setdefault(fam, ids)
    order = list(fam_prompts)
    config = DecodeConfig(max_new_tokens=max_new, k_draft=K, kv_cache="static" if graphs else "dynamic",
                          cuda_graphs=graphs)
    res = sweep(target, scout, [fam_prompts[f] for f in order], clutches, trials=trials, config=config)
    data = res.to_dict()
    m: dict[str, float] = {"grid.trials": float(len(clutches) * len(order) * trials),
                           "grid.trials_per_cell": float(trials), "grid.configs": float(len(clutches))}
    entries = data["entries"]
    plain = next(e for e in entries if e["label"] == "plain")

    def tps(entry, idx):
        return statistics.median(r["tokens_per_s"] for r in entry["runs"] if r["prompt_index"] == idx)

    best_all, best_score = None, -1e9
    for e in entries:
        if e.get("clutch") is None:
            continue
        score = min(tps(e, i) / tps(plain, i) for i in range(len(order)))
        if score > best_score:
            best_all, best_score = e, score
    for i, fam in enumerate(order):
        label = FAMILY_LABEL.get(fam, fam)
        base = tps(plain, i)
        gated = [e for e in entries if e.get("clutch")]
        prod = next(e for e in gated if e["clutch"]["theta_low"] == 0.55 and e["clutch"]["alpha"] == 0.35)
        tuned = next(e for e in gated if e["clutch"]["theta_low"] == 0.15 and e["clutch"]["alpha"] == 0.65)
        best = max(gated, key=lambda e, i=i: tps(e, i))
        m[f"grid.production.{label}.throughput_change_pct"] = 100 * (tps(prod, i) / base - 1)
        m[f"grid.tuned.{label}.throughput_change_pct"] = 100 * (tps(tuned, i) / base - 1)
        m[f"grid.best.{label}.throughput_change_pct"] = 100 * (tps(best, i) / base - 1)
        m[f"grid.best_over_all.{label}.throughput_change_pct"] = 100 * (tps(best_all, i) / base - 1)
    return m


def near_ties(target, scout, prompts, max_new: int) -> dict:
    ids = next(ids for fam, ids in prompts.values() if fam == "code")
    continuation = generate(target, ids, DecodeConfig(max_new_tokens=max_new)).tokens
    return near_tie_report(target, ids, continuation, k_draft=K).to_dict()


def fidelity(target, prompts, max_new: int) -> tuple[dict[str, float], dict]:
    from sdsie.fidelity import FidelityConfig, fidelity_sweep

    fam_prompts = {}
    for _pid, (fam, ids) in prompts.items():
        fam_prompts.setdefault(FAMILY_LABEL.get(fam, fam), ids)
    res = fidelity_sweep(target, fam_prompts, FidelityConfig(max_new_tokens=max_new))
    metrics = res.metrics()
    n_all = max(c.n_layers for c in res.cells)  # the "all" row (FidelityConfig.layer_counts ends with "all")
    for key, value in list(metrics.items()):  # the seed's "32 (all)" row: claims read fidelity.layers_all.*
        if key.startswith(f"fidelity.layers_{n_all}."):
            metrics[key.replace(f"layers_{n_all}.", "layers_all.", 1)] = value
    return metrics, {"table": res.table(), **res.to_dict()}


def record_problems(record: RunRecord, tests: Iterable[str], required: Iterable[str]) -> list[str]:
    """Why the gate could not judge `record` for the claims of `tests`: a `required` claim it does not
    declare, or a declared claim that is not in the registry or whose inputs the record lacks."""
    claims = load_registry(REGISTRY).claims
    problems = [f"{cid}: not declared by the record (not measured)" for cid in required if cid not in record.claim_ids]
    for cid in record.claim_ids:
        if cid not in claims:
            problems.append(f"{cid}: not in the registry")
        elif claims[cid].test in set(tests) and missing_inputs(claims[cid], record.metrics, record.samples):
            problems.append(f"{cid}: lacks {missing_inputs(claims[cid], record.metrics, record.samples)}")
    return problems


def assert_serves(record: RunRecord, tests: Iterable[str], node: str, required: Iterable[str]) -> None:
    """A GPU test's check: its `required` claims are the registry's for `node`, and `record` can be judged
    for each of them (declared, with its inputs)."""
    required = list(required)
    missing = set(required) - set(node_claims(node))
    assert not missing, f"{node} does not serve {sorted(missing)} in the registry"
    problems = record_problems(record, tests, required)
    assert not problems, "\n".join(problems)


def node_claims(test: str) -> list[str]:
    """The registry claims whose reproduction test is `test`."""
    return [c.id for c in load_registry(REGISTRY).claims.values() if c.test == test]


# --------------------------------------------------------------------------------------------------
# Resolution Gear: INT4 usage, throughput and power with every mlp.down_proj gated


def gear_runs(target, prompts, trials: int, max_new: int, meter: EnergyMeter | None,
              clutch: ClutchConfig = PRODUCTION) -> list[Run]:
    """Every `mlp.down_proj` gated (per-channel min-max INT4, the seed's calibration), the clutch driving
    the gear (engaged -> INT4), interleaved with the same gated model held at full precision."""
    from sdsie.quant.gated import gate_model

    model = copy.deepcopy(target)  # the caller's target stays ungated
    state = gate_model(model, "mlp.down_proj")
    cfg = DecodeConfig(max_new_tokens=max_new)

    def full(ids):
        state.int4 = False
        r = generate(model, ids, cfg)
        return r.tokens, {"int4_cycles": 0, "cycles": r.stats.cycles}, ""

    def gear(ids):
        r = generate(model, ids, cfg, clutch=EntropyClutch(clutch), gear=state)
        return r.tokens, {"int4_cycles": sum(bool(c.gear_int4) for c in r.cycles), "cycles": r.stats.cycles}, \
            r.decisions

    fns = {"gear_full": full, "gear_int4": gear}
    start = time.perf_counter()
    warm_up(fns, prompts)
    print(f"gear suite: warm-up done at {time.perf_counter() - start:.0f} s", flush=True)
    runs = []
    for trial in range(trials):
        for pid, (family, ids) in prompts.items():
            for name, fn in fns.items():
                tokens, sec, energy, stats, dec = timed(lambda fn=fn, ids=ids: fn(ids), meter)
                runs.append(Run(name, family, trial, tokens, sec, energy, {**stats, "prompt": pid}, dec))
        int4 = sum(r.stats["int4_cycles"] for r in runs if r.trial == trial)
        print(f"gear suite: trial {trial} done at {time.perf_counter() - start:.0f} s ({int4} INT4 cycles)", flush=True)
    return runs


def gear_metrics(runs: list[Run]) -> dict[str, float]:
    """gear.{family}.int4_usage_pct (decode cycles on INT4), throughput_change_pct and power_change_pct
    (median over runs of window energy / window time) against the same model at full precision."""
    m: dict[str, float] = {}
    for fam in sorted({r.family for r in runs}):
        label = FAMILY_LABEL.get(fam, fam)
        full, gear = _per_family(runs, "gear_full", fam), _per_family(runs, "gear_int4", fam)
        m[f"gear.{label}.int4_usage_pct"] = 100.0 * sum(r.stats["int4_cycles"] for r in gear) / max(
            1, sum(r.stats["cycles"] for r in gear))
        m[f"gear.{label}.throughput_change_pct"] = 100.0 * (_tps(gear) / _tps(full) - 1)
        watts = {name: [r.energy_j / r.seconds for r in rs if r.energy_j is not None]
                 for name, rs in (("full", full), ("gear", gear))}
        if watts["full"] and watts["gear"]:
            m[f"gear.{label}.power_change_pct"] = 100.0 * (
                statistics.median(watts["gear"]) / statistics.median(watts["full"]) - 1)
    return m


# --------------------------------------------------------------------------------------------------
# Suites as records


@dataclass
class Setup:
    """The loaded pair, the prompts and what every record of one run shares."""

    target: Any
    scout: Any
    prompts: dict[str, tuple[str, torch.Tensor]]  # prompt id -> (family, ids [S])
    device: str
    environment: dict
    conditions: dict  # model, hardware (trials set per suite)
    meter: EnergyMeter | None


def pair_build_id(models: list[dict]) -> str:
    """8 hex digits naming one build of the pair: a hash over both models' weight hashes.

    The gpu recipe trains with deterministic kernels, and its build repeats bit for bit on one GPU model, driver and
    library set (build 37a43dbc, twice on an H200). Another GPU, driver or library version may still train other
    weights, so a record's conditions name the build, and the claims gate judges a record only against references
    pinned on the same weights.
    """
    digests = sorted(f"{m['name']}:{m['checkpoint_sha256']}" for m in models)
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:8]


def clutch_update_us(config: ClutchConfig = PRODUCTION, updates: int = 20000, trials: int = 5) -> dict[str, float]:
    """Host time of one clutch step as the engine takes it (an update, then the state read at the next cycle), in
    us: median and spread over `trials` loops of `updates`. In fallback a gated loop does plain decoding's GPU work
    and this on the host, once per token, so this over the token time bounds what gating costs where it never
    engages."""
    if updates < 1:
        raise ValueError(f"updates must be >= 1, got {updates}")
    clutch = EntropyClutch(config)
    bits = [(i * 0.37) % 8.0 for i in range(updates)]  # entropies across both thresholds: flips and holds

    def loop() -> None:
        for h in bits:
            clutch.update(h)
            _ = clutch.engaged

    return {**per_op_us(loop, updates, trials), "updates": float(updates)}


def load_setup(preset: str = "gpu", device: str = "cuda", one_per_family: bool = False) -> Setup:
    """Load (or build) the stand-in pair and the prompts; an energy meter where NVML is available."""
    from sdsie.standin import get_preset, load_prompts, load_standin, prompts_hash, recipe_hash

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, scout, tok = load_standin(preset, device, dtype)
    print(f"stand-in ready in {time.perf_counter() - t0:.0f} s", flush=True)
    chosen = load_prompts()
    if one_per_family:
        chosen = [next(pr for pr in chosen if pr.family == f) for f in dict.fromkeys(pr.family for pr in chosen)]
    prompts = {pr.id: (pr.family, torch.tensor(tok(pr.text)["input_ids"], device=device)) for pr in chosen}
    # the loaded modules themselves: each entry's checkpoint_sha256 is then the hash of these very weights
    env = capture_environment(models={"target": target, "scout": scout},
                              prompts={pid: tok.decode(ids) for pid, (_f, ids) in prompts.items()}, seeds={"torch": 0})
    env["prompts_hash"] = prompts_hash()
    env["standin_recipe"] = get_preset(preset).name
    env["standin_recipe_hash"] = recipe_hash(get_preset(preset))  # which recipe built the pair, not only its name
    env["host_launch_us"] = host_launch_us(device)  # the host's speed: small-model decoding is bound by it
    env["clutch_update_us"] = clutch_update_us()  # what a gated loop adds per token where it never engages
    build = pair_build_id(env["models"])
    hardware = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    cond = {"model": f"sdsie stand-in pair ({preset} preset, build {build}), {str(dtype).split('.')[-1]}",
            "hardware": hardware}
    ok, why = EnergyMeter.available()
    meter = EnergyMeter() if ok and device == "cuda" else None
    if meter:
        meter.measure_idle(2.0)
    else:
        print("energy not measured:", why)
    return Setup(target, scout, prompts, device, env, cond, meter)


def _samples(runs: list[Run]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for r in runs:
        key = f"{r.variant}|{r.stats.get('prompt')}"
        samples.setdefault(f"{key}|tokens_per_s", []).append(len(r.tokens) / r.seconds)
        if r.energy_j is not None:
            samples.setdefault(f"{key}|j_per_token", []).append(r.energy_j / len(r.tokens))
    return samples


def entropy_sync_share(plain_tokens_per_s: float, device: str) -> dict[str, float]:
    """The entropy host sync (at the seed's vocabulary 128256) as a share of a plain decode step here."""
    from reproductions.entropy_overhead import measure

    sync = measure(torch.device(device))["metrics"]["sync_cost_us"]
    return {"entropy_sync_cost_us": sync, "sync_share_of_token_pct": 100.0 * sync * 1e-6 * plain_tokens_per_s}


def forward_costs(target, scout, ids: torch.Tensor, k: int = K, reps: int = 30,
                  graphs: bool = False) -> dict[str, float]:
    """Median wall time (ms, synchronized) of the forwards a decode cycle is made of, on one prompt's cache:
    a target step (1 token), a target verification (k + 1 tokens) and a scout step (1 token), and
    scout_cost_ratio = scout step / target step. With them a fixed-K cycle's cost is predictable:
    (verify + k * scout) against one target step per plain token.

    graphs: the same on a static cache, its forwards replayed as CUDA graphs on a GPU, plus each forward's GPU
    time between CUDA events there (`*_gpu_ms`): wall minus GPU is what the host adds to a replayed step."""
    def step_ms(model, n_tokens: int) -> tuple[float, float | None]:
        events = graphs and ids.is_cuda
        cache = (StaticKV(model, ids.numel() + k + 1, cuda_graphs=events, graph_sizes=(1, k + 1)) if graphs
                 else new_cache(model))
        with torch.inference_mode():
            forward(model, ids, cache, last_only=True)  # the prompt in the cache, as in decoding
            base = cache_length(cache)
            feed = ids[-1:].repeat(n_tokens)
            times, gpu = [], []
            for _ in range(reps + 3):  # the first 3 are warm-up (and, with graphs, the capture)
                sync_device(ids.device)
                t0 = time.perf_counter()
                if events:
                    gpu.append(cuda_event_ms(lambda: forward(model, feed, cache, last_only=n_tokens == 1)))
                else:
                    forward(model, feed, cache, last_only=n_tokens == 1)
                sync_device(ids.device)
                times.append(1e3 * (time.perf_counter() - t0))
                crop_cache(cache, base)
        return statistics.median(times[3:]), statistics.median(gpu[3:]) if gpu else None

    (target_ms, target_gpu), (verify_ms, verify_gpu), (scout_ms, scout_gpu) = (
        step_ms(target, 1), step_ms(target, k + 1), step_ms(scout, 1))
    out = {"target_step_ms": target_ms, "target_verify_ms": verify_ms, "scout_step_ms": scout_ms,
           "scout_cost_ratio": scout_ms / target_ms, "k": float(k), "reps": float(reps)}
    if target_gpu is not None:
        out |= {"target_step_gpu_ms": target_gpu, "target_verify_gpu_ms": verify_gpu, "scout_step_gpu_ms": scout_gpu,
                "scout_cost_ratio_gpu": scout_gpu / target_gpu}
    return out


def tree_widths_config(ran: Iterable[str], tree_widths: tuple[int, ...], wide_tree_widths: tuple[int, ...],
                       ) -> dict[str, list[int] | None]:
    """A record's tree_widths and wide_tree_widths: each the widths a variant that ran decoded with, else None."""
    keys = {TREE_WIDTHS_KEY[v] for v in ran if v in TREE_WIDTHS_KEY}
    return {key: list(widths) if key in keys else None
            for key, widths in (("tree_widths", tree_widths), ("wide_tree_widths", wide_tree_widths))}


def decode_record(s: Setup, trials: int = 5, max_new: int = 128, near_ties_check: bool = True,
                  entropy_sync: bool = True, graphs: bool = False, only: Iterable[str] | None = None,
                  energy_window_s: float = ENERGY_WINDOW_S,
                  tree_widths: tuple[int, ...] = DEFAULT_TREE_WIDTHS,
                  wide_tree_widths: tuple[int, ...] = DEFAULT_WIDE_TREE_WIDTHS) -> RunRecord:
    """Plain, fixed-K5, gated (production, tuned) and HF generate / assisted, interleaved: one record (`only`: a
    subset of the variants, their baselines included; the record then declares only the claims it holds)."""
    runs, windows = run_decode_suite(s.target, s.scout, s.prompts, trials, max_new, s.meter, graphs, only,
                                     energy_window_s, tree_widths, wide_tree_widths)
    metrics = {**decode_metrics(runs), **energy_window_metrics(windows)}
    if entropy_sync:
        metrics.update(entropy_sync_share(metrics["plain_tokens_per_s"], s.device))
    samples = {**_samples(runs), **identity_samples(runs)}
    for w in windows:
        samples.setdefault(f"{w.variant}|{w.prompt}|j_per_token_window", []).append(w.j_per_token)
    extra: dict[str, Any] = {"mismatches": mismatch_report(s.target, runs, s.prompts)}
    first_ids = next(iter(s.prompts.values()))[1]
    extra["forward_ms"] = forward_costs(s.target, s.scout, first_ids)
    if graphs:  # first run on a GPU pending: a failure is reported in the record and loses none of the runs
        try:
            extra["forward_ms_graphs"] = forward_costs(s.target, s.scout, first_ids, graphs=True)
        except Exception as err:  # reported, not hidden
            extra["forward_ms_graphs_error"] = repr(err)
    if near_ties_check:
        try:
            extra["near_ties"] = near_ties(s.target, s.scout, s.prompts, max_new)
        except Exception as err:  # reported, not hidden
            extra["near_ties_error"] = repr(err)
    config = {"k": K, "max_new_tokens": max_new, "trials": trials,
              "idle_power_w": s.meter.idle.power_w if s.meter and s.meter.idle else None,
              "variants": sorted({r.variant for r in runs}),
              **tree_widths_config({r.variant for r in runs}, tree_widths, wide_tree_widths),
              "production": PRODUCTION.__dict__, "tuned": TUNED.__dict__,
              "energy_window_s": energy_window_s if windows else None,
              "energy_windows": [asdict(w) for w in windows],
              "decisions": {f"{r.variant}|{r.stats.get('prompt')}|{r.trial}": r.decisions for r in runs
                            if r.variant.startswith("gated")}, **extra}
    return RunRecord(claim_ids=declared_claims(DECODE_TESTS, metrics, samples, DECODE_ALSO), suite="decode_standin",
                     config=config, samples=samples, metrics=metrics, environment=s.environment,
                     conditions={**s.conditions, "trials": trials})


def grid_record(s: Setup, max_new: int = 96, trials: int = 3, graphs: bool = False) -> RunRecord:
    metrics = run_grid(s.target, s.scout, s.prompts, max_new, trials, graphs)
    return RunRecord(claim_ids=declared_claims(GRID_TESTS, metrics, {}), suite="threshold_grid",
                     config={"k": K, "max_new_tokens": max_new, "trials_per_cell": trials, "cuda_graphs": graphs},
                     samples={},
                     metrics=metrics, environment=s.environment, conditions={**s.conditions, "trials": trials})


def fidelity_record(s: Setup, max_new: int = SEED_FIDELITY_TOKENS) -> tuple[RunRecord, str]:
    """The fidelity table (per calibration scheme x 1, 2, 4, all gated down_proj layers) and its markdown."""
    metrics, detail = fidelity(s.target, s.prompts, max_new)
    per_channel = [c for c in detail["cells"] if c["scheme"] == "per-channel"]  # the seed's scheme
    samples = {"fidelity.layers": [float(c["n_layers"]) for c in per_channel]}  # the report's figure
    for i, p in enumerate(per_channel[0]["prompts"] if per_channel else []):
        samples[f"fidelity.match_pct.{p['prompt']}"] = [c["prompts"][i]["match_pct"] for c in per_channel]
    rec = RunRecord(claim_ids=declared_claims(FIDELITY_TESTS, metrics, {}), suite="resolution_gear_fidelity",
                    config={"max_new_tokens": max_new, **detail}, samples=samples, metrics=metrics,
                    environment=s.environment, conditions={**s.conditions, "trials": 1})
    return rec, detail["table"]


def gear_record(s: Setup, trials: int = 5, max_new: int = 128, clutch: ClutchConfig = PRODUCTION) -> RunRecord:
    runs = gear_runs(s.target, s.prompts, trials, max_new, s.meter, clutch)
    metrics = gear_metrics(runs)
    samples = _samples(runs)
    config = {"max_new_tokens": max_new, "trials": trials, "clutch": clutch.__dict__, "targets": "mlp.down_proj",
              "calibration": "per-channel min-max, asymmetric", "gear": "engaged -> INT4",
              "decisions": {f"{r.stats['prompt']}|{r.trial}": r.decisions
                            for r in runs if r.variant == "gear_int4"}}
    return RunRecord(claim_ids=declared_claims(GEAR_TESTS, metrics, samples), suite="resolution_gear_usage",
                     config=config, samples=samples, metrics=metrics, environment=s.environment,
                     conditions={**s.conditions, "trials": trials})


# One GPU process runs the decode suite once for the four test nodes it serves (reproductions/test_*_gpu.py).


@functools.cache
def gpu_setup() -> Setup:
    return load_setup("gpu", "cuda")


def graphs_from_env() -> bool:
    """SDSIE_CUDA_GRAPHS: "1" adds the graph variants to the nox decode record, "0" or unset does not."""
    graphs = os.environ.get("SDSIE_CUDA_GRAPHS", "0")
    if graphs not in ("0", "1"):
        raise ValueError(f"SDSIE_CUDA_GRAPHS must be 0 or 1, got {graphs!r}")
    return graphs == "1"


@functools.cache
def gpu_decode_record(out: str = "telemetry") -> RunRecord:
    """The decode suite's record on the GPU stand-in pair, written once per process under `out`.
    SDSIE_CUDA_GRAPHS=1 adds the static-cache CUDA-graph variants (--cuda-graphs of the command line)."""
    rec = decode_record(gpu_setup(), graphs=graphs_from_env())
    rec.source = write_record(rec, out)
    print("record:", rec.source, flush=True)
    return rec


def _tree_widths(text: str) -> tuple[int, ...]:
    try:
        return check_widths(tuple(int(w) for w in text.split(",")))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from err


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=positive_int, default=5)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--out", type=Path, default=Path("telemetry"))
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["grid", "fidelity", "gear", "near_ties", "entropy_sync"])
    p.add_argument("--preset", default="gpu", help="stand-in preset; 'cpu' with --device cpu is a dry run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--one-per-family", action="store_true", help="first prompt of each family only")
    p.add_argument("--grid-trials", type=positive_int, default=3, help="trials per grid cell (the seed's N=3)")
    p.add_argument("--grid-tokens", type=positive_int, default=None,
                   help="tokens per grid run (default: --max-new-tokens, at most 96)")
    p.add_argument("--grid-graphs", action="store_true",
                   help="run the threshold grid's loops on a static cache with replayed CUDA graphs")
    p.add_argument("--fidelity-tokens", type=positive_int, default=SEED_FIDELITY_TOKENS,
                   help="tokens per fidelity run")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="add plain_graphs, fixed-K (K = 5 and SHORTER_K), the two gated loops, the tuned one with an "
                        "eager catch-up, fixed-K5 and tuned with the adaptive draft length and adaptive with K up to "
                        "8, the static trees (TREES) and the compiled-scout tree gated by both clutches (GATED_TREES) "
                        "(GRAPHED): this engine on a static cache with replayed CUDA graphs")
    p.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help="decode only these variants (with their baselines: plain, and plain_graphs for graphed "
                        "loops), e.g. a quick K sweep: plain plain_graphs fixed_k2_graphs fixed_k3_graphs "
                        "fixed_k5_graphs")
    p.add_argument("--gear-trials", type=positive_int, default=None,
                   help="trials of the gear suite (default: --trials)")
    p.add_argument("--tree-widths", type=_tree_widths, default=DEFAULT_TREE_WIDTHS, metavar="W1,W2,...",
                   help=f"the {TREE} variant's static tree: the scout's top-w tokens per node at each depth "
                        f"(default {','.join(map(str, DEFAULT_TREE_WIDTHS))})")
    p.add_argument("--wide-tree-widths", type=_tree_widths, default=DEFAULT_WIDE_TREE_WIDTHS, metavar="W1,W2,...",
                   help=f"the {TREE_WIDE} variant's static tree, a second tree beside {TREE} "
                        f"(default {','.join(map(str, DEFAULT_WIDE_TREE_WIDTHS))})")
    p.add_argument("--energy-window-s", type=non_negative_float, default=ENERGY_WINDOW_S,
                   help="after the trials, the graphed loops' J/token over windows of back-to-back runs this long "
                        "(0: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("decode_repro needs a CUDA GPU (torch.cuda.is_available() is False); the CPU-reproducible "
              "claims run in `nox -s claims`.")
        return 2
    if (a.cuda_graphs or a.grid_graphs) and a.device != "cuda":  # refused before anything loads
        raise SystemExit("--cuda-graphs and --grid-graphs need --device cuda")
    if a.device == "cpu":  # the dry run: Triton kernels (the gear's INT4 matmul) need the interpreter on a CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.perf_counter()
    s = load_setup(a.preset, a.device, a.one_per_family)

    def done(suite: str, rec: RunRecord) -> None:
        print(f"record: {write_record(rec, a.out)} ({suite} done at {time.perf_counter() - t0:.0f} s)", flush=True)

    rec = decode_record(s, a.trials, a.max_new_tokens, "near_ties" not in a.skip, "entropy_sync" not in a.skip,
                        a.cuda_graphs, a.variants, a.energy_window_s, a.tree_widths, a.wide_tree_widths)
    done("decode", rec)
    for k in sorted(rec.metrics):
        if k.count(".") <= 1 or k.startswith(("fixed_k5", "hf_assisted")):
            print(f"  {k} = {rec.metrics[k]:.3f}")
    if "grid" not in a.skip:
        rec = grid_record(s, a.grid_tokens or min(a.max_new_tokens, 96), a.grid_trials, a.grid_graphs)
        done("grid", rec)
        print(rec.metrics, flush=True)
    if "fidelity" not in a.skip:
        rec, table = fidelity_record(s, a.fidelity_tokens)
        done("fidelity", rec)
        print(table, flush=True)
    if "gear" not in a.skip:
        rec = gear_record(s, a.gear_trials or a.trials, a.max_new_tokens)
        done("gear", rec)
        print(rec.metrics, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
