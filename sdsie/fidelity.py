"""Token-level fidelity of precision gating: INT4-gated greedy output vs the full-precision baseline.

The seed measured (Llama-3.1-8B, per-channel min-max, 250 tokens) that one INT4 `mlp.down_proj`
layer keeps greedy output intact on 2 of 3 prompts, and two or more collapse it, and left open
whether better calibration widens that range. `fidelity_sweep` answers it for any causal LM:
for each calibration scheme x number of gated layers, the gear is held at INT4 for the whole
generation and every prompt's greedy tokens are compared with the full-precision baseline.

Per prompt: `match_pct` = 100 x (positions where both runs emitted the same token) / (length of
the longer run); `first_divergence` = index of the first differing generated token (None when
identical). The first `n` target layers in ascending layer order are gated.

Each scheme calibrates every target layer once (AWQ on the full-precision activations of the
calibration ids), then each layer count installs that many `GatedLinear`s and restores the
original linears afterwards: the model is unchanged when the sweep returns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdsie.decoding.engine import DecodeConfig, generate
from sdsie.quant.calibrate import PRESETS, preset
from sdsie.quant.gated import GatedLinear, build_gated_layers
from sdsie.quant.linear import layer_index, replace_module, select_linears

__all__ = [
    "FidelityConfig",
    "PromptFidelity",
    "FidelityCell",
    "FidelityResult",
    "compare_tokens",
    "fidelity_sweep",
    "fidelity_main",
]

ALL = "all"


@dataclass(frozen=True)
class FidelityConfig:
    """What to sweep. layer_counts: ints >= 0 and/or "all" (every target layer)."""

    schemes: tuple[str, ...] = PRESETS  # "per-channel", "group", "awq" (sdsie.quant.calibrate.preset)
    layer_counts: tuple[int | str, ...] = (1, 2, 4, ALL)
    targets: tuple[str, ...] = ("mlp.down_proj",)
    group_size: int = 128  # for the "group" and "awq" schemes
    symmetric: bool = False
    max_new_tokens: int = 64
    eos_token_id: int | None = None  # None: always generate max_new_tokens

    def __post_init__(self) -> None:
        bad = [s for s in self.schemes if s not in PRESETS]
        if not self.schemes or bad:
            raise ValueError(f"schemes must be a non-empty subset of {PRESETS}, got {self.schemes!r}")
        for c in self.layer_counts:
            if c != ALL and (not isinstance(c, int) or isinstance(c, bool) or c < 0):
                raise ValueError(f"layer_counts entries must be ints >= 0 or {ALL!r}, got {c!r}")
        if not self.layer_counts:
            raise ValueError("layer_counts must not be empty")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")


@dataclass(frozen=True)
class PromptFidelity:
    prompt: str
    match_pct: float
    first_divergence: int | None  # None: token-identical
    baseline_tokens: list[int]
    gated_tokens: list[int]


@dataclass
class FidelityCell:
    """One (scheme, number of gated layers) point of the sweep."""

    scheme: str
    n_layers: int
    layers: list[int]  # gated decoder-layer indices
    modules: list[str]  # gated module names
    layer_sqnr_db: list[float]  # weight SQNR of each gated module
    int4_calls: int  # GatedLinear INT4 forwards during this cell: proof the gear acted
    prompts: list[PromptFidelity] = field(default_factory=list)

    @property
    def mean_match_pct(self) -> float:
        return sum(p.match_pct for p in self.prompts) / len(self.prompts)


@dataclass
class FidelityResult:
    config: FidelityConfig
    calibration: str  # where the AWQ calibration activations came from
    cells: list[FidelityCell]

    def table(self) -> str:
        """Markdown: one row per (scheme, layers gated), one column per prompt (match %, divergence)."""
        names = [p.prompt for p in self.cells[0].prompts]
        rows = [
            "| scheme | layers gated | mean weight SQNR (dB) | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for cell in self.cells:
            sqnr = "-" if not cell.layer_sqnr_db else f"{sum(cell.layer_sqnr_db) / len(cell.layer_sqnr_db):.2f}"
            cols = [_describe(p) for p in cell.prompts]
            rows.append(f"| {cell.scheme} | {cell.n_layers} | {sqnr} | " + " | ".join(cols) + " |")
        return "\n".join(rows)

    def metrics(self) -> dict[str, float]:
        """Flat metrics: fidelity.{scheme}.layers_{n}.{prompt}.match_pct / .first_divergence, and
        the per-channel scheme also without the scheme part (the seed's claims). No divergence is
        reported as the number of tokens generated (the seed's "never in 250 tokens")."""
        out: dict[str, float] = {}
        for cell in self.cells:
            for p in cell.prompts:
                div = len(p.baseline_tokens) if p.first_divergence is None else p.first_divergence
                for prefix in _metric_prefixes(cell):
                    out[f"{prefix}.{p.prompt}.match_pct"] = p.match_pct
                    out[f"{prefix}.{p.prompt}.first_divergence"] = float(div)
            for prefix in _metric_prefixes(cell):
                if cell.layer_sqnr_db:
                    out[f"{prefix}.mean_weight_sqnr_db"] = sum(cell.layer_sqnr_db) / len(cell.layer_sqnr_db)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "calibration": self.calibration,
            "cells": [asdict(c) for c in self.cells],
        }


def _metric_prefixes(cell: FidelityCell) -> list[str]:
    base = f"layers_{cell.n_layers}"
    prefixes = [f"fidelity.{cell.scheme}.{base}"]
    return prefixes + ([f"fidelity.{base}"] if cell.scheme == "per-channel" else [])


def _describe(p: PromptFidelity) -> str:
    where = "no divergence" if p.first_divergence is None else f"diverges at {p.first_divergence}"
    return f"{p.match_pct:.1f}%, {where}"


# --- comparison ---------------------------------------------------------------------------------


def compare_tokens(baseline: Sequence[int], gated: Sequence[int]) -> tuple[float, int | None]:
    """(match %, first divergence index or None) of two generated token sequences."""
    length = max(len(baseline), len(gated))
    if length == 0:
        raise ValueError("compare_tokens: both token sequences are empty")
    same = [a == b for a, b in zip(baseline, gated, strict=False)]
    match_pct = 100.0 * sum(same) / length
    if all(same) and len(baseline) == len(gated):
        return match_pct, None
    return match_pct, same.index(False) if False in same else len(same)


# --- the sweep ----------------------------------------------------------------------------------


def _greedy(model: nn.Module, prompt: torch.Tensor, config: FidelityConfig) -> list[int]:
    """The project's plain greedy loop (sdsie.decoding.generate, no scout, no clutch)."""
    decode = DecodeConfig(max_new_tokens=config.max_new_tokens, eos_token_id=config.eos_token_id)
    return generate(model, prompt, decode).tokens


def _layers_for_counts(model: nn.Module, config: FidelityConfig) -> dict[int, list[int]]:
    """Number of gated layers -> the decoder-layer indices gated (the first n, ascending)."""
    indices = sorted({layer_index(name) for name in select_linears(model, config.targets)} - {None})
    if not indices:
        raise ValueError(f"targets {config.targets} are not inside numbered layers ('layers.{{i}}.')")
    counts: dict[int, list[int]] = {}
    for c in config.layer_counts:
        n = len(indices) if c == ALL else c
        if n > len(indices):
            raise ValueError(f"cannot gate {n} layers: the model has {len(indices)} layers with {config.targets}")
        counts[n] = indices[:n]
    return counts


@contextlib.contextmanager
def _installed(model: nn.Module, gated: Mapping[str, GatedLinear]) -> Iterator[None]:
    """Swap the given GatedLinears into the model; restore the original linears on exit."""
    try:
        for name, module in gated.items():
            replace_module(model, name, module)
        yield
    finally:
        for name, module in gated.items():
            replace_module(model, name, module.full)


def _prompt_tensor(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # [P]
    if t.numel() == 0:
        raise ValueError("a prompt has no tokens")
    return t


def _calibration_ids(
    prompts: Mapping[str, torch.Tensor], calibration_ids: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, str]:
    """Token ids [1, T] whose activations calibrate the layers, and a description of their source."""
    if calibration_ids is not None:
        return torch.as_tensor(calibration_ids, dtype=torch.long).reshape(1, -1).to(device), "given calibration ids"
    return torch.cat(list(prompts.values()))[None].to(device), "the evaluated prompts (no calibration ids given)"


@torch.no_grad()
def fidelity_sweep(
    model: nn.Module,
    prompts: Mapping[str, Sequence[int] | torch.Tensor],
    config: FidelityConfig | None = None,
    calibration_ids: torch.Tensor | None = None,
) -> FidelityResult:
    """Greedy token match vs the full-precision baseline for every scheme x gated-layer count.

    prompts: name -> token ids. calibration_ids: token ids run once per scheme to capture layer
    inputs (AWQ fits on them, every scheme reports output SQNR); default: the prompts themselves.
    """
    cfg = config or FidelityConfig()
    if not prompts:
        raise ValueError("fidelity_sweep needs at least one prompt")
    if any(isinstance(m, GatedLinear) for m in model.modules()):
        raise ValueError("fidelity_sweep needs the full-precision model; this one already has GatedLinear layers")
    ids = {name: _prompt_tensor(p) for name, p in prompts.items()}
    counts = _layers_for_counts(model, cfg)
    device = next(model.parameters()).device
    calib, calib_desc = _calibration_ids(ids, calibration_ids, device)
    baseline = {name: _greedy(model, p, cfg) for name, p in ids.items()}
    cells: list[FidelityCell] = []
    for scheme in cfg.schemes:
        qcfg = preset(scheme, cfg.group_size, cfg.symmetric)
        state, gated = build_gated_layers(model, cfg.targets, qcfg, calibration_inputs=calib)
        sqnr = {r.name: r.weight_sqnr_db for r in state.report.layers}
        for n, layers in counts.items():
            chosen = {name: g for name, g in gated.items() if layer_index(name) in layers}
            cell = FidelityCell(scheme, n, layers, list(chosen), [sqnr[name] for name in chosen], 0)
            state.int4 = True
            state.reset_counters()
            with _installed(model, chosen):
                for name, p in ids.items():
                    tokens = _greedy(model, p, cfg)
                    match, div = compare_tokens(baseline[name], tokens)
                    cell.prompts.append(PromptFidelity(name, match, div, baseline[name], tokens))
            cell.int4_calls = state.int4_calls
            cells.append(cell)
    return FidelityResult(cfg, calib_desc, cells)


# --- command line -------------------------------------------------------------------------------


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parse_counts(text: str) -> tuple[int | str, ...]:
    out: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        if part == ALL:
            out.append(ALL)
        elif part.isdigit():
            out.append(int(part))
        else:
            raise ValueError(f"--layers takes comma-separated ints and/or 'all', got {part!r}")
    return tuple(out)


def _read_prompts(args: argparse.Namespace) -> dict[str, str]:
    prompts: dict[str, str] = {}
    for item in args.prompt or []:
        name, sep, text = item.partition("=")
        if not sep or not name or not text:
            raise ValueError(f"--prompt takes NAME=TEXT, got {item!r}")
        prompts[name] = text
    if args.prompts_file:
        import tomllib

        with open(args.prompts_file, "rb") as fh:
            for entry in tomllib.load(fh).get("prompt", []):
                prompts[entry["id"]] = entry["text"]
    if not prompts:
        raise ValueError("give prompts with --prompt NAME=TEXT or --prompts-file (TOML [[prompt]] id/text)")
    return prompts


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sdsie fidelity",
        description="Greedy token match of INT4-gated layers vs the full-precision model, per scheme and layer count.",
    )
    p.add_argument("--model", required=True, help="HF id or local save_pretrained folder")
    p.add_argument("--tokenizer", help="tokenizer id or folder (default: --model)")
    p.add_argument("--prompt", action="append", metavar="NAME=TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="TOML file of [[prompt]] tables with id and text")
    p.add_argument("--calibration-text", help="text whose activations calibrate AWQ (default: the prompts)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--layers", default="1,2,4,all", help="numbers of gated layers, e.g. 1,2,4,all")
    p.add_argument("--schemes", default=",".join(PRESETS), help=f"comma-separated subset of {PRESETS}")
    p.add_argument("--targets", default="mlp.down_proj", help="comma-separated linear name suffixes")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--symmetric", action="store_true")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the tokenizer's EOS (default: never)")
    p.add_argument("--json", help="write the full result (tokens included) to this JSON file")
    return p


def fidelity_main(argv: Sequence[str] | None = None) -> int:
    """`sdsie fidelity ...`: run the sweep, print the Markdown table, optionally write JSON."""
    from sdsie.models import load_model, load_tokenizer

    args = _parser().parse_args(argv)
    prompts = _read_prompts(args)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    model = load_model(args.model, _DTYPES[args.dtype], args.device)
    config = FidelityConfig(
        schemes=tuple(s.strip() for s in args.schemes.split(",")),
        layer_counts=_parse_counts(args.layers),
        targets=tuple(t.strip() for t in args.targets.split(",")),
        group_size=args.group_size,
        symmetric=args.symmetric,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id if args.stop_at_eos else None,
    )
    ids = {name: tokenizer(text)["input_ids"] for name, text in prompts.items()}
    calib = None if args.calibration_text is None else torch.tensor(tokenizer(args.calibration_text)["input_ids"])
    result = fidelity_sweep(model, ids, config, calib)
    print(f"model {args.model} ({args.dtype}, {args.device}); AWQ calibration: {result.calibration}")
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
