"""Build the SmolLM2-135M-Instruct scout's adapter layer (sdsie.scouts.SMOLLM2_SCOUT) and store it.

    python -m reproductions.real.build_scout [--out reproductions/real/smollm2_scout.safetensors] [--threads N]

Prints the scout's parameter counts, the build's time and its training loss. CPU fp32, like the suite.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from reproductions.real.suite import SCOUT_FILE
from sdsie.models import dequantized_folder, load_model, load_tokenizer, smollm2_gguf
from sdsie.scouts import SMOLLM2_SCOUT, active_parameters, build_scout, new_parameters, save_adapter
from sdsie.telemetry.env import checkpoint_hash


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproductions.real.build_scout", description=__doc__)
    parser.add_argument("--out", default=str(SCOUT_FILE), help="where the adapter goes")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gguf = smollm2_gguf()
    folder = dequantized_folder(gguf)
    target = load_model(folder, torch.float32, "cpu")
    tokenizer = load_tokenizer(folder)
    scout, info = build_scout(target, tokenizer, SMOLLM2_SCOUT)
    path = save_adapter(scout, SMOLLM2_SCOUT, args.out, checkpoint_hash(gguf), info)
    print(f"scout {SMOLLM2_SCOUT.name}: {new_parameters(scout, target)} new parameters, "
          f"{active_parameters(scout)} read per forward (target: {active_parameters(target)}); "
          f"{info.tokens} training tokens, generated in {info.generate_seconds:.0f} s, trained in "
          f"{info.train_seconds:.0f} s ({torch.get_num_threads()} threads); loss {info.losses[0]:.3f} -> "
          f"{info.losses[-1]:.3f} nats; wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
