"""How far could drafting a tree instead of a chain take speculation on a stand-in pair? A probe, before building it.

Answered on the gpu pair: the best tree of at most 63 nodes on code is 4,3,3, modelled at 2.03x graphed plain
(telemetry/raw/tree_probe_20261201T2247_h200.json); the decodes that measured it are in docs/log.md.

    python -m research.standin.tree_probe --pair gpu --device cuda --out telemetry/raw/tree_probe.json

Under greedy verification a drafted node can only be kept if every node above it is the target's own greedy token.
So for a static tree (every node at depth d expands the scout's top w_d tokens), the tokens a cycle keeps follow from
one number per position: the rank, among the scout's logits, of the target's greedy token, with the scout reading
the target's greedy continuation (teacher-forced). A cycle starting at position t keeps the longest run
t, t + 1, ... whose ranks stay below w_1, w_2, ..., then emits the target's token after it (the bonus), as the engine
does. With every width 1 this is the fixed-K chain, which checks the simulation against the engine's acceptance.

Price: a cycle of a depth-D tree runs D scout forwards (level d reads the n_(d-1) nodes of the level above it, with
n_0 = 1: the last kept token) and one target forward over 1 + sum(n_d) tokens, each at the graphed GPU time this
probe measures for that token count on the same pair (a causal forward of that many tokens; a tree mask changes
the attention's mask, not the kernels launched). Plain decoding costs one 1-token target forward per token.
`--overhead-ms` adds the engine's host time per cycle to both (plain decoding pays it per token). Counts are exact
for the pair; the times are a model, and a tree the scout grows by its own probabilities (as EAGLE-2 does) can only
keep more per node than the static trees priced here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from sdsie.decoding.tree import level_sizes
from sdsie.standin import FAMILIES, greedy_continuation, load_prompts, load_standin
from sdsie.telemetry.timing import cuda_event_ms

Widths = tuple[int, ...]  # top-w per depth, depth 1 first


def target_ranks(target, scout, input_ids: torch.Tensor, n_new: int) -> list[int]:
    """input_ids [1, P] -> for each of the target's n_new greedy tokens, its rank among the scout's logits at that
    position (0: the scout's argmax), the scout reading the target's continuation."""
    with torch.inference_mode():
        seq = greedy_continuation(target, input_ids, n_new)  # [1, P + n_new]
        p = input_ids.shape[1]
        logits = scout(input_ids=seq[:, :-1], use_cache=False).logits[0, p - 1 :].float()  # [n_new, V]
        chosen = seq[0, p:]  # [n_new]
        picked = logits.gather(-1, chosen[:, None])  # [n_new, 1]
        return (logits > picked).sum(-1).tolist()


def kept_run(ranks: list[int], t: int, widths: Widths) -> int:
    """Drafts a cycle starting at position t keeps: the longest run of ranks below the widths, leaving the text's
    last token to a bonus (the engine drafts at most the tokens left but one)."""
    a = 0
    while a < len(widths) and t + a < len(ranks) - 1 and ranks[t + a] < widths[a]:
        a += 1
    return a


def simulate(ranks: list[int], widths: Widths) -> list[int]:
    """Drafts kept per cycle over a whole continuation; each cycle emits kept + 1 tokens."""
    kept, t = [], 0
    while t < len(ranks):
        a = kept_run(ranks, t, widths)
        kept.append(a)
        t += a + 1
    return kept


@dataclass(frozen=True)
class Times:
    """Graphed GPU ms of one forward by token count (sizes not measured use the next larger measured one)."""

    target: dict[int, float]
    scout: dict[int, float]

    @staticmethod
    def _at(table: dict[int, float], n: int) -> float:
        fits = [s for s in table if s >= n]
        if not fits:
            raise ValueError(f"no forward time measured for {n} tokens (largest: {max(table)})")
        return table[min(fits)]

    def target_ms(self, n: int) -> float:
        return self._at(self.target, n)

    def scout_ms(self, n: int) -> float:
        return self._at(self.scout, n)


def cycle_ms(widths: Widths, times: Times, overhead_ms: float) -> float:
    sizes = level_sizes(widths)
    scout = sum(times.scout_ms(n) for n in [1, *sizes[:-1]])
    return scout + times.target_ms(1 + sum(sizes)) + overhead_ms


def price(kept: list[int], widths: Widths, times: Times, overhead_ms: float) -> dict:
    tokens = sum(a + 1 for a in kept)
    spec = len(kept) * cycle_ms(widths, times, overhead_ms)
    plain = tokens * (times.target_ms(1) + overhead_ms)
    return {"tokens": tokens, "cycles": len(kept), "tokens_per_cycle": tokens / len(kept),
            "model_speedup": plain / spec}


def profiles(max_depth: int, max_nodes: int, choices: Widths = (1, 2, 3, 4, 6, 8)) -> list[Widths]:
    """Static trees with non-increasing widths, depth 1..max_depth, at most max_nodes drafted nodes."""
    out: list[Widths] = []

    def grow(prefix: Widths) -> None:
        if prefix:
            out.append(prefix)
        if len(prefix) == max_depth:
            return
        for w in choices:
            if prefix and w > prefix[-1]:
                continue
            cand = (*prefix, w)
            if sum(level_sizes(cand)) <= max_nodes:
                grow(cand)

    grow(())
    return out


def forward_times(model, sizes: list[int], reps: int, prefix: int = 64) -> dict[int, float]:
    """Median ms of one forward of n tokens after a prefix of `prefix` tokens, graphed on CUDA (the engine's
    StaticKV replay plus its rollback), eager elsewhere."""
    from sdsie.decoding.model_io import StaticKV, model_device

    device = model_device(model)
    cuda = device.type == "cuda"
    kv = StaticKV(model, prefix + max(sizes), cuda_graphs=cuda, graph_sizes=sizes)
    ids = torch.randint(0, model.config.vocab_size, (prefix + max(sizes),), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    out: dict[int, float] = {}
    with torch.inference_mode():
        kv.forward(model, ids[:prefix], last_only=True)  # prefill (eager)
        for n in sizes:
            samples = []
            for r in range(reps + 3):  # the first forward of a size captures it
                if cuda:
                    ms = cuda_event_ms(lambda n=n: kv.forward(model, ids[prefix : prefix + n], last_only=False))
                else:
                    import time

                    t0 = time.perf_counter()
                    kv.forward(model, ids[prefix : prefix + n], last_only=False)
                    ms = (time.perf_counter() - t0) * 1e3
                kv.crop(prefix)
                if r >= 3:
                    samples.append(ms)
            out[n] = statistics.median(samples)
    return out


def _pow2_upto(n: int) -> list[int]:
    return [2**i for i in range(int(math.log2(n)) + 1)]


def run(pair: str, device: str, n_new: int, max_depth: int, max_nodes: int, reps: int, overhead_ms: float) -> dict:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target, scout, tokenizer = load_standin(pair, device, dtype)
    ranks: dict[str, list[int]] = {}
    family: dict[str, str] = {}
    for p in load_prompts():
        ids = tokenizer(p.text, return_tensors="pt").input_ids.to(device)  # [1, P]
        ranks[p.id] = target_ranks(target, scout, ids, n_new)
        family[p.id] = p.family
    sizes = _pow2_upto(1 << math.ceil(math.log2(max_nodes + 1)))
    times = Times(forward_times(target, sizes, reps), forward_times(scout, sizes, reps))
    coverage = {
        fam: {w: sum(r < w for pid in ranks if family[pid] == fam for r in ranks[pid])
              / sum(len(ranks[pid]) for pid in ranks if family[pid] == fam) for w in (1, 2, 4, 8, 16)}
        for fam in FAMILIES
    }
    trees = profiles(max_depth, max_nodes)
    results: dict[str, dict[str, dict]] = {fam: {} for fam in FAMILIES}
    for widths in trees:
        for fam in FAMILIES:
            kept = [a for pid in ranks if family[pid] == fam for a in simulate(ranks[pid], widths)]
            results[fam][",".join(map(str, widths))] = price(kept, widths, times, overhead_ms)
    best = {fam: max(res.items(), key=lambda kv: kv[1]["model_speedup"]) for fam, res in results.items()}
    chains = {fam: {k: results[fam][",".join(["1"] * k)] for k in range(1, max_depth + 1)} for fam in FAMILIES}
    return {"pair": pair, "device": device, "dtype": str(dtype), "n_new_tokens": n_new, "max_depth": max_depth,
            "max_nodes": max_nodes, "overhead_ms": overhead_ms, "forward_ms": {"target": times.target,
            "scout": times.scout}, "ranks": ranks, "family": family, "coverage": coverage,
            "best": {fam: {"widths": w, **r} for fam, (w, r) in best.items()}, "chains": chains, "trees": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="cpu", help="stand-in preset (cpu: the committed pair; gpu: cached or built)")
    p.add_argument("--device", default="cpu", help="cuda: the pair in bf16, forwards timed as graph replays")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-depth", type=int, default=8)
    p.add_argument("--max-nodes", type=int, default=63, help="drafted nodes per tree (the verify reads 1 + this)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--overhead-ms", type=float, default=0.0, help="host time per cycle, paid per token by plain")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.max_new_tokens < 1 or a.max_depth < 1 or a.max_nodes < 1 or a.reps < 1 or a.overhead_ms < 0:
        p.error("--max-new-tokens, --max-depth, --max-nodes and --reps must be >= 1, --overhead-ms >= 0")
    torch.manual_seed(0)
    res = run(a.pair, a.device, a.max_new_tokens, a.max_depth, a.max_nodes, a.reps, a.overhead_ms)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print("forward ms target", {k: round(v, 3) for k, v in res["forward_ms"]["target"].items()})
    print("forward ms scout ", {k: round(v, 3) for k, v in res["forward_ms"]["scout"].items()})
    for fam in FAMILIES:
        cov = " ".join(f"top{w} {c:.2f}" for w, c in res["coverage"][fam].items())
        b = res["best"][fam]
        chain = max(res["chains"][fam].items(), key=lambda kv: kv[1]["model_speedup"])
        print(f"{fam}: {cov} | best chain K={chain[0]} x{chain[1]['model_speedup']:.3f} "
              f"({chain[1]['tokens_per_cycle']:.2f} tok/cycle) | best tree {b['widths']} x{b['model_speedup']:.3f} "
              f"({b['tokens_per_cycle']:.2f} tok/cycle)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
