"""Graphed gated decoding with the scout's catch-up padded and replayed, against the same loop with it eager.

Answered: padded and replayed, a catch-up of 2-120 tokens took 0.19-0.22 ms against 1.44-1.49 ms eager
(telemetry/raw/catchup_ab_20261130T1725_h200.json; docs/log.md). decode_repro's gated_tuned_graphs_unpadded variant
measures the same A/B in whole decodes.

    python -m research.catchup_ab [--preset cpu] [--trials 5] [--max-new-tokens 128] [--out FILE.json]

An A/B of one engine change (commit 4209cfb): under CUDA graphs the scout's catch-up forwards (the tokens it
skipped while the clutch was out, or 2 after a fully accepted draft) were eager forwards; now they are padded to
one of `engine.SCOUT_PAD_SIZES` and replayed (`DecodeConfig.pad_scout_catchup` switches it). Both arms run on
one GPU in one process, interleaved per trial and prompt, on the stand-in pair of `--preset` (the committed CPU
pair loads in seconds; `gpu` builds or loads the gpu pair). Per arm and clutch: tokens/s paired by prompt and
trial, catch-up tokens, and whether the tokens and decisions of the two arms agree (they must: padding changes
only which kernels run the scout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from reproductions.decode_repro import load_setup
from sdsie.clutch import SEED_CLUTCHES, ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.model_io import sync_device
from sdsie.stats import bootstrap_median_ci


def run_arm(s, ids: torch.Tensor, clutch, max_new: int, padded: bool) -> tuple[list[int], str, float, int]:
    """One graphed gated run -> (tokens, decisions, tokens/s, scout catch-up tokens)."""
    cfg = DecodeConfig(max_new_tokens=max_new, kv_cache="static", cuda_graphs=True, pad_scout_catchup=padded)
    r = generate(s.target, ids, cfg, scout=s.scout, clutch=EntropyClutch(clutch))
    return r.tokens, r.decisions, r.stats.tokens_per_s, r.stats.scout_catchup_tokens


def catchup_forward_ms(model, sizes: tuple[int, ...] = (2, 5, 17, 60, 120), prefix: int = 64,
                       reps: int = 20) -> dict[str, dict[str, float]]:
    """Wall time of one catch-up forward of F tokens after a `prefix`-token prefill, eager against padded and
    replayed, on one scout (medians of `reps`, each synchronized: host dispatch included, which is the point)."""
    import time

    from sdsie.decoding.engine import SCOUT_PAD_SIZES
    from sdsie.decoding.model_io import StaticKV, forward

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prefix + max(sizes),), generator=gen).to(device)
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        kvs = {"eager": StaticKV(model, 512, cuda_graphs=True, graph_sizes=(1,)),
               "padded": StaticKV(model, 512, cuda_graphs=True, graph_sizes=(1,), pad_sizes=SCOUT_PAD_SIZES)}
        for kv in kvs.values():
            forward(model, ids[:prefix], kv, last_only=True)
        for f in sizes:
            times: dict[str, list[float]] = {name: [] for name in kvs}
            last = {}
            for rep in range(reps + 2):  # 2 warm-up reps: the padded arm captures its graph there
                for name, kv in kvs.items():
                    sync_device(device)
                    t0 = time.perf_counter()
                    logits = forward(model, ids[prefix : prefix + f], kv, last_only=True)
                    sync_device(device)
                    if rep >= 2:
                        times[name].append((time.perf_counter() - t0) * 1e3)
                    last[name] = int(logits[-1].argmax())
                    kv.crop(prefix)
            out[str(f)] = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
            out[str(f)]["same_argmax"] = float(last["eager"] == last["padded"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--low", type=float, default=4.0, help="a third clutch's theta_low (4/5 switches on the cpu pair)")
    p.add_argument("--high", type=float, default=5.0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("catchup_ab needs a CUDA GPU (CUDA graphs)", file=sys.stderr)
        return 2
    s = load_setup(a.preset, "cuda")
    forward_ms = catchup_forward_ms(s.scout)
    print(json.dumps(forward_ms), flush=True)
    clutches = {**SEED_CLUTCHES, "switching": ClutchConfig(a.low, a.high, 0.5)}
    runs: dict[tuple[str, str, str], list[tuple]] = {}
    for trial in range(-1, a.trials):  # trial -1 warms up: captures every graph both arms use
        for pid, (_family, ids) in s.prompts.items():
            for name, clutch in clutches.items():
                for padded in ((False, True) if trial % 2 else (True, False)):
                    out = run_arm(s, ids, clutch, a.max_new_tokens, padded)
                    if trial >= 0:
                        runs.setdefault((name, pid, "padded" if padded else "eager"), []).append(out)
    result: dict = {"preset": a.preset, "trials": a.trials, "max_new_tokens": a.max_new_tokens,
                    "model": s.conditions["model"], "hardware": s.conditions["hardware"],
                    "catchup_forward_ms": forward_ms, "switching": [a.low, a.high], "clutches": {}}
    for name in clutches:
        ratios, same, catchup = [], True, {"padded": 0, "eager": 0}
        for pid in s.prompts:
            pad, eag = runs[(name, pid, "padded")], runs[(name, pid, "eager")]
            ratios += [x[2] / y[2] for x, y in zip(pad, eag, strict=True)]
            same &= all(x[0] == y[0] and x[1] == y[1] for x, y in zip(pad, eag, strict=True))
            catchup["padded"] += pad[0][3]
            catchup["eager"] += eag[0][3]
        lo, hi = bootstrap_median_ci(ratios)
        result["clutches"][name] = {"padded_over_eager_median": statistics.median(ratios), "ci_low": lo, "ci_high": hi,
                                    "pairs": len(ratios), "tokens_and_decisions_identical": same,
                                                    "catchup_tokens_per_prompt_set": catchup}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
