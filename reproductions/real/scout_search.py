"""How well layer subsets of SmolLM2-135M-Instruct draft for it: teacher-forced greedy agreement with the target.

    python -m reproductions.real.scout_search [--tokens 96] [--threads N]

For the seed's code and physics prompts, the target's greedy reply (`--tokens`) is decoded once; each candidate scout
(sdsie.scouts.layer_subset_scout, or the committed adapter scout) then reads prompt + reply in one forward, and the
share of reply positions where its argmax equals the target's is printed. Agreement bounds a chain's acceptance from
above only loosely (a chain stops at its first miss), but a subset that rarely agrees cannot draft.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from reproductions.real.suite import load_prompts, load_real_pair
from sdsie.decoding import DecodeConfig, generate
from sdsie.scouts import layer_subset_scout

SUBSETS: dict[str, tuple[int, ...]] = {
    "first 8 + last": (*range(8), 29),
    "first 15 + last": (*range(15), 29),
    "even layers": tuple(range(0, 30, 2)),
    "every third + last": (*range(0, 30, 3), 29),
    "first 6 + last 6": (*range(6), *range(24, 30)),
    "first 10 + last 10": (*range(10), *range(20, 30)),
    "first 20": tuple(range(20)),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproductions.real.scout_search", description=__doc__)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pair = load_real_pair()
    ids = pair.prompt_ids([p for p in load_prompts() if p.id in ("code", "physics")])
    sequences = {}
    for family, prompt in ids.items():
        reply = generate(pair.target, prompt, DecodeConfig(max_new_tokens=args.tokens)).tokens
        sequences[family] = (torch.tensor([prompt + reply]), len(prompt))
    scouts = {name: layer_subset_scout(pair.target, layers) for name, layers in SUBSETS.items()}
    scouts[f"adapter ({pair.scout_recipe.name})"] = pair.scout
    print("| scout | layers run | " + " | ".join(sequences) + " |\n|---|---|" + "---|" * len(sequences))
    with torch.inference_mode():
        greedy = {f: pair.target(x).logits[0, p - 1 : -1].argmax(-1) for f, (x, p) in sequences.items()}
        for name, scout in scouts.items():
            cells = [f"{100 * float((scout(x).logits[0, p - 1 : -1].argmax(-1) == greedy[f]).float().mean()):.1f}%"
                     for f, (x, p) in sequences.items()]
            print(f"| {name} | {scout.config.num_hidden_layers} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
