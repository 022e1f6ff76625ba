"""Probe for choosing the `gpu` stand-in preset: which corpus and scout make speculation pay on one GPU.

Answered: its comparison chose the gpu preset's scout, an early exit of the target distilled against it
(sdsie.standin.PRESETS['gpu'] and the reasons beside it; docs/log.md).

Trains one target on a candidate corpus (with the joint scout), then several scouts against that
target, and for each scout measures what the preset is chosen by: validation loss, teacher-forced
argmax agreement on held-out files, greedy agreement on the prompts, the batch-1 step-cost ratio
scout/target, and fixed-K5 speculative decoding speed against plain decoding with the project's
engine (`sdsie.decoding.generate`, 128 new tokens per prompt, greedy, outputs checked identical).
One trial, no energy: a selection probe, not a reproduction record.

    python -m research.standin.gpu_probe [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses as dc
import json
import time
from pathlib import Path

import torch

from sdsie import standin as S
from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.model_io import sync_device

K = 5
NEW_TOKENS = 128


def step_seconds(model, n: int = 64) -> float:
    """Mean wall time of one batch-1 cached decode step (after 8 warm-up steps)."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 16, dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        nxt = ids[:, -1:]
        for i in range(n + 8):
            if i == 8:
                sync_device(device)
                t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        sync_device(device)
    return (time.perf_counter() - t0) / n


def decode_speed(target, scout, tok, prompts) -> dict:
    """Per prompt: plain and fixed-K5 decode tokens/s, speedup, acceptance, identical output."""
    res = {}
    for p in prompts:
        ids = tok(p.text).input_ids
        generate(target, ids, DecodeConfig(max_new_tokens=16))  # warm-up
        generate(target, ids, DecodeConfig(max_new_tokens=16, k_draft=K), scout=scout)
        plain = generate(target, ids, DecodeConfig(max_new_tokens=NEW_TOKENS))
        spec = generate(target, ids, DecodeConfig(max_new_tokens=NEW_TOKENS, k_draft=K), scout=scout)
        res[p.id] = {
            "family": p.family,
            "plain_tok_s": plain.stats.decode_tokens_per_s,
            "k5_tok_s": spec.stats.decode_tokens_per_s,
            "speedup": spec.stats.decode_tokens_per_s / plain.stats.decode_tokens_per_s,
            "acceptance": spec.stats.acceptance_rate,
            "identical": plain.tokens == spec.tokens,
        }
    by_family = {}
    for fam in S.FAMILIES:
        rows = [r for r in res.values() if r["family"] == fam]
        by_family[fam] = {k: sum(r[k] for r in rows) / len(rows) for k in ("speedup", "acceptance")}
    return {"by_prompt": res, "by_family": by_family}


def measure(name, target, scout, data, config, tok, prompts, phases) -> dict:
    t0 = time.perf_counter()
    metrics = S.evaluate_pair(target, scout, tok, data.val_stream, config)
    row = {
        "scout": name,
        "scout_params": S.n_params(scout),
        "val_loss": metrics["validation_loss_nats"],
        "val_argmax_agreement": metrics["validation_argmax_agreement"],
        "greedy_agreement": metrics["greedy_agreement"]["by_family"],
        "step_cost_ratio": step_seconds(scout) / step_seconds(target),
        "decode": decode_speed(target, scout, tok, prompts),
        "train_seconds": {k: round(v.seconds, 1) for k, v in phases.items()},
    }
    row["eval_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: v for k, v in row.items() if k != "decode"}), "decode", row["decode"]["by_family"], flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--max-mb", type=float, default=48.0)
    parser.add_argument("--smoke", action="store_true", help="a tiny configuration on the CPU, to check the script")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    torch.set_float32_matmul_precision("high")
    base = S.PRESETS["gpu"]
    if args.smoke:
        base = dc.replace(
            S.PRESETS["cpu"],
            target=S.ModelShape(4, 64, 2, 128),
            train=dc.replace(S.PRESETS["cpu"].train, steps=4, batch_size=2, warmup_steps=1),
            eval_tokens=256,
            agreement_tokens=4,
        )
    corpus = dc.replace(
        base.corpus, include_site_packages=True, max_bytes=int(args.max_mb * 1e6), max_file_bytes=262_144
    )
    config = dc.replace(base, corpus=corpus)
    global NEW_TOKENS
    NEW_TOKENS = 8 if args.smoke else NEW_TOKENS
    steps = 3 if args.smoke else 300
    t0 = time.perf_counter()
    data = S.prepare_data(config)
    print("data", round(time.perf_counter() - t0, 1), "s", S._corpus_summary(data), flush=True)
    tok, prompts = data.tokenizer, S.load_prompts()
    rows = []

    target, scout, phases = S.train_models(config, data, device)
    rows.append(measure("joint-2x256", target, scout, data, config, tok, prompts, phases))

    variants = {
        "after-init-2x512": dc.replace(
            config,
            scout=dc.replace(config.target, n_layers=2),
            scout_phase=S.ScoutPhaseConfig(
                steps=steps, lr=1e-3, warmup_steps=1 if args.smoke else 20, init_from_target=True
            ),
        ),
        "after-init-1x512": dc.replace(
            config,
            scout=dc.replace(config.target, n_layers=1),
            scout_phase=S.ScoutPhaseConfig(
                steps=steps, lr=1e-3, warmup_steps=1 if args.smoke else 20, init_from_target=True
            ),
        ),
        "joint-2x256+after": dc.replace(
            config, scout_phase=S.ScoutPhaseConfig(steps=steps, lr=1e-3, warmup_steps=1 if args.smoke else 20)
        ),
    }
    for name, cfg in variants.items():
        torch.manual_seed(cfg.seed + 1)
        if cfg.scout_phase.init_from_target:
            s2 = S.scout_from_target(target, cfg, tok)
        else:
            s2 = copy.deepcopy(scout)
        ph = {"scout": S.distill_scout(target, s2, data.train_stream, cfg, device)}
        rows.append(measure(name, target, s2, data, cfg, tok, prompts, ph))

    result = {
        "corpus": S._corpus_summary(data),
        "corpus_hash": data.corpus_hash,
        "rows": rows,
        "target_params": S.n_params(target),
        "versions": S._versions(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
