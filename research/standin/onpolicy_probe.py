"""Does distilling the scout on the target's own continuations raise agreement over distilling on the corpus?

Answered: at this scale, no clear gain: greedy agreement 0.896 on corpus windows, 0.908 on the target's greedy
continuations, 0.881 on its samples (telemetry/raw/onpolicy_probe_20261130T1408_cpu.json; docs/log.md).

    python -m research.standin.onpolicy_probe [--steps 200] [--out telemetry/raw/onpolicy_probe_cpu.json]

A CPU probe at the committed CPU pair's scale, for the lever speculation on the stand-in pair is short of (draft
acceptance). The GPU recipe's scout is an early exit of the target (its embeddings, first layers and final norm)
distilled with KL(target || scout) on corpus windows: off-policy, on text the target did not write. Greedy speculative
decoding only ever asks the scout to predict the target's own greedy continuation. So this trains the same early exit of
the committed CPU target (1 of its 4 layers) for the same steps, learning rate and batch, in three ways:

* corpus: windows of the training corpus (the GPU recipe's way);
* greedy: the target's greedy continuations of corpus prefixes (on-policy for greedy decoding);
* sampled: the target's samples at temperature 1 from the same prefixes;

and measures, on the fixed prompts, greedy agreement (the scout's argmax against the target's greedy
continuation, as the recipe's manifest does) and the acceptance of fixed-K speculative decoding (K = 4). The
untrained early exit is the floor. Everything runs on one CPU thread with fixed seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch

from sdsie.decoding import DecodeConfig, generate
from sdsie.standin import (
    ModelShape,
    ScoutPhaseConfig,
    batches,
    distill_scout,
    encode_documents,
    get_preset,
    greedy_agreement,
    load_corpus,
    load_prompts,
    load_standin,
    scout_from_target,
)
from sdsie.telemetry.records import write_raw

PREFIX = 32  # corpus tokens each generated window continues


@torch.no_grad()
def target_windows(target, stream: torch.Tensor, context: int, batch: int, n: int, sample: bool, seed: int):
    """n batches [batch, context + 1]: a corpus prefix of PREFIX tokens, then the target's continuation."""
    out = []
    gen = torch.Generator().manual_seed(seed)
    for prefix in batches(stream, PREFIX - 1, batch, n, seed):  # [B, PREFIX]
        if sample:
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        seq = target.generate(input_ids=prefix, attention_mask=torch.ones_like(prefix), do_sample=sample,
                              temperature=1.0 if sample else None, top_k=0 if sample else None,
                              top_p=1.0 if sample else None, max_new_tokens=context + 1 - PREFIX,
                              min_new_tokens=context + 1 - PREFIX, pad_token_id=0)
        out.append(seq[:, : context + 1])
    return out


def acceptance(target, scout, tokenizer, prompts, n_new: int) -> dict[str, float]:
    """Fixed-K (K = 4) acceptance per family: drafted tokens accepted, pooled over the family's prompts."""
    acc: dict[str, list[int]] = {}
    for p in prompts:
        ids = tokenizer(p.text, return_tensors="pt").input_ids[0].tolist()
        stats = generate(target, ids, DecodeConfig(max_new_tokens=n_new, k_draft=4), scout=scout).stats
        a = acc.setdefault(p.family, [0, 0])
        a[0] += stats.accepted
        a[1] += stats.drafted
    return {fam: a / d if d else 0.0 for fam, (a, d) in acc.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.steps < 2 or a.lr <= 0:
        p.error(f"--steps must be >= 2 (the target writes steps // 2 batches) and --lr > 0, got {a.steps}, {a.lr}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = get_preset("cpu")
    t = base.target
    config = dataclasses.replace(  # an early exit of the target: 1 of its 4 layers, its width
        base, scout=ModelShape(n_layers=1, hidden=t.hidden, n_heads=t.n_heads, intermediate=t.intermediate),
        scout_phase=ScoutPhaseConfig(steps=a.steps, lr=a.lr, warmup_steps=a.steps // 20, init_from_target=True))
    target, _, tokenizer = load_standin("cpu")
    corpus = load_corpus(config.corpus)
    stream = encode_documents(tokenizer, [f.text for f in corpus.train])
    prompts = load_prompts()
    n_new = config.agreement_tokens
    bsz, ctx = config.train.batch_size, config.context
    sources = {
        "corpus": lambda: list(batches(stream, ctx, bsz, a.steps, config.seed + 2)),
        "greedy": lambda: target_windows(target, stream, ctx, bsz, a.steps // 2, False, config.seed + 3),
        "sampled": lambda: target_windows(target, stream, ctx, bsz, a.steps // 2, True, config.seed + 4),
    }
    results: dict = {"config": {"steps": a.steps, "lr": a.lr, "batch": bsz, "context": ctx, "prefix": PREFIX,
                                "scout": dataclasses.asdict(config.scout), "n_new": n_new, "k_draft": 4}}
    untrained = scout_from_target(target, config, tokenizer).eval()
    results["untrained"] = {"greedy_agreement": greedy_agreement(target, untrained, tokenizer, prompts, n_new),
                            "acceptance_k4": acceptance(target, untrained, tokenizer, prompts, n_new)}
    for name, make in sources.items():
        t0 = time.perf_counter()
        windows = make()
        t_data = time.perf_counter() - t0
        torch.manual_seed(0)
        scout = scout_from_target(target, config, tokenizer)
        # the recipe's scout phase (pure KL against the frozen target) on these windows, cycled to a.steps batches
        phase = distill_scout(target, scout, stream, config, torch.device("cpu"),
                              windows=itertools.islice(itertools.cycle(windows), a.steps))
        results[name] = {"data_seconds": round(t_data, 1), "train_seconds": round(time.perf_counter() - t0 - t_data, 1),
                         "kl_history": [(h["step"], h["scout_kl"]) for h in phase.loss_history],
                         "greedy_agreement": greedy_agreement(target, scout, tokenizer, prompts, n_new),
                         "acceptance_k4": acceptance(target, scout, tokenizer, prompts, n_new)}
        print(name, json.dumps({k: results[name][k] for k in ("greedy_agreement", "acceptance_k4")})[:400],
              flush=True)
    summary = {name: {"agreement": round(r["greedy_agreement"]["overall"], 3),
                      "by_family": {f: round(v, 3) for f, v in r["greedy_agreement"]["by_family"].items()},
                      "acceptance_k4": {f: round(v, 3) for f, v in r["acceptance_k4"].items()}}
               for name, r in results.items() if name != "config"}
    results["summary"] = summary
    print(json.dumps(summary, indent=1))
    if a.out:
        write_raw(a.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
