"""Does the stand-in recipe repeat bit for bit on this machine? Train a shortened recipe twice, compare weights.

Answered: on the H200 the deterministic runs repeated bit for bit and the default ones did not
(telemetry/raw/standin_determinism_20261130T1201_h200.json; docs/log.md). The gpu recipe trains deterministically since.

    python -m research.standin.determinism_check --preset gpu --out determinism.json

The tokenizer and token streams are prepared twice and compared (hash of the tokenizer's JSON and of both
streams). Then the recipe's training (target phase, then scout phase), cut to --target-steps and --scout-steps,
runs twice with the preset's determinism setting and, with --both-modes, twice more with it flipped: what the
setting buys is then measured on the same machine, not assumed. Each run reports the weight hash of both
models (`sdsie.telemetry.env.module_hash`), its seconds per step and its last losses. Exit status 0 when the
preset's own setting repeated (identical hashes), else 1.

Short runs see every kernel of the full recipe (same shapes, same phases), so a kernel that does not repeat
shows within a few steps; the learning-rate schedule is shortened with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from sdsie.standin import PRESETS, StandinConfig, default_device, prepare_data, train_reproducibly
from sdsie.telemetry.env import module_hash


def shortened(config: StandinConfig, target_steps: int, scout_steps: int, deterministic: bool) -> StandinConfig:
    """The preset with fewer steps (warmups scaled into range) and the given determinism setting."""
    warmup = min(config.train.warmup_steps, target_steps - 1)
    train = dataclasses.replace(config.train, steps=target_steps, warmup_steps=warmup,
                                log_every=max(target_steps, scout_steps), deterministic=deterministic)
    scout_phase = config.scout_phase
    if scout_phase is not None:
        scout_phase = dataclasses.replace(scout_phase, steps=scout_steps,
                                          warmup_steps=min(scout_phase.warmup_steps, scout_steps - 1))
    return dataclasses.replace(config, train=train, scout_phase=scout_phase)


def data_fingerprint(data) -> str:
    h = hashlib.sha256(data.tokenizer.backend_tokenizer.to_str().encode())
    for stream in (data.train_stream, data.val_stream):
        h.update(stream.numpy().tobytes())
    return h.hexdigest()


def one_run(config: StandinConfig, data, device: torch.device) -> dict:
    t0 = time.perf_counter()
    target, scout, phases = train_reproducibly(config, data, device)
    return {
        "target_sha256": module_hash(target),
        "scout_sha256": module_hash(scout),
        "seconds": round(time.perf_counter() - t0, 2),
        "seconds_per_step": {name: round(r.seconds / max(1, r.steps_completed), 4) for name, r in phases.items()},
        "last_losses": {name: r.loss_history[-1] for name, r in phases.items() if r.loss_history},
    }


def check(preset: str, target_steps: int, scout_steps: int, both_modes: bool, device: torch.device) -> dict:
    base = PRESETS[preset]
    t0 = time.perf_counter()
    first = prepare_data(base)
    t_data = time.perf_counter() - t0
    second = prepare_data(base)
    fingerprints = [data_fingerprint(first), data_fingerprint(second)]
    modes = [base.train.deterministic] + ([not base.train.deterministic] if both_modes else [])
    runs = {}
    for det in modes:
        cfg = shortened(base, target_steps, scout_steps, det)
        pair = [one_run(cfg, first, device) for _ in range(2)]
        same = all(pair[0][k] == pair[1][k] for k in ("target_sha256", "scout_sha256"))
        runs["deterministic" if det else "default"] = {"runs": pair, "identical": same}
        print(f"deterministic={det}: identical={same} {[r['seconds'] for r in pair]} s", flush=True)
    own = "deterministic" if base.train.deterministic else "default"
    return {
        "preset": preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "target_steps": target_steps,
        "scout_steps": scout_steps,
        "data": {"identical": fingerprints[0] == fingerprints[1], "sha256": fingerprints, "seconds": round(t_data, 2)},
        "modes": runs,
        "preset_setting": own,
        "repeats": runs[own]["identical"] and fingerprints[0] == fingerprints[1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.standin.determinism_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    p.add_argument("--target-steps", type=int, default=40)
    p.add_argument("--scout-steps", type=int, default=20)
    p.add_argument("--both-modes", action="store_true", help="also run twice with the determinism setting flipped")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.target_steps < 2 or args.scout_steps < 2:
        p.error("--target-steps and --scout-steps must be >= 2")
    device = torch.device(args.device) if args.device else default_device()
    result = check(args.preset, args.target_steps, args.scout_steps, args.both_modes, device)
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if result["repeats"] else 1


if __name__ == "__main__":
    sys.exit(main())
