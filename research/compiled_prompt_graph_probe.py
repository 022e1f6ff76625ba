"""Why a compiled model's prompt replayed as a CUDA graph gave tokens that differ between identical runs (H100,
docs/log.md 2026-12-06 14:45), where the eager model's prompt graph does not. Two suspects: kernels launched as
programmatic dependents (inductor's `triton.enable_pdl` and the INT4 kernels' own) starting before what they read
is written, and the dynamic-length prompt graph traced before the cache's first consolidation.

Per arm, one INT4 model (every linear quantized, norms fused: `quantize_for_decode`), `runs` identical graphed
decodes after two warm-up runs (the first initializes the cache, the second captures the prompt's graph), the
prompt padded to the engine's prefill sizes as `DecodeConfig.prefill_graphs` pads it (that option refuses compiled
models, so the probe turns the padding on beneath it). Arms: the compiled prompt with programmatic launch on and
off, the eager prompt beside a compiled decode step (the form the engine also refuses, not yet run on a GPU), and
the eager model (the reference: its prompt graph is GPU-tested). Each arm's distinct token lists are counted and
compared with the eager model's. The answer goes to docs/log.md, the raw file to telemetry/raw/.

    python -m research.compiled_prompt_graph_probe --model tiny --out telemetry/raw/compiled_prompt_graph_tiny.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import sdsie.decoding.engine as engine
from sdsie.decoding import DecodeCompiled, DecodeConfig, generate
from sdsie.kernels.device import set_programmatic_launch
from sdsie.quant import quantize_for_decode
from sdsie.telemetry.records import capture_environment

ARMS = ("eager", "compiled_prompt_pdl", "compiled_prompt_no_pdl", "compiled_step_eager_prompt")


def build(name: str) -> torch.nn.Module:
    if name == "tiny":
        from sdsie.models import tiny_llama

        model = tiny_llama(vocab_size=256, hidden_size=256, num_layers=2, seed=0)
    else:
        from reproductions.decode_e2e import build_model

        model = build_model(name, False, torch.device("cuda"), torch.bfloat16)
    quantize_for_decode(model)
    return model.to("cuda", torch.bfloat16)


def arm_tokens(model: torch.nn.Module, arm: str, prompt: list[int], new_tokens: int, runs: int) -> list[list[int]]:
    """`runs` decodes of the arm after two warm-up runs, the prompt graphed and padded."""
    pdl = arm != "compiled_prompt_no_pdl"
    set_programmatic_launch(pdl)
    torch._dynamo.reset()
    options = {"combo_kernels": True, "triton.enable_pdl": pdl}
    if arm == "eager":
        target = model
    else:
        target = DecodeCompiled(model, arm != "compiled_step_eager_prompt", options=options)
    cfg = DecodeConfig(max_new_tokens=new_tokens, kv_cache="static", cuda_graphs=True)
    return [generate(target, prompt, cfg).tokens for _ in range(2 + runs)][2:]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one is a prefix), else None."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="tiny", help="tiny, or a decode_e2e model name (llama3.1-8b, qwen2.5-7b)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    args = p.parse_args(argv)
    engine._prefill_sizes = lambda config: engine.PREFILL_SIZES if config.cuda_graphs else ()
    model = build(args.model)
    prompt = [1 + (7 * i) % 200 for i in range(args.prompt_len)]
    result: dict[str, Any] = {"model": args.model, "runs": args.runs, "new_tokens": args.new_tokens,
                              "prompt_len": args.prompt_len, "arms": {}}
    reference = None
    for arm in args.arms:
        try:  # one model for every arm: a compiled arm wraps it, and each wrapper gets caches of its own
            tokens = arm_tokens(model, arm, prompt, args.new_tokens, args.runs)
        except Exception as err:  # an arm that cannot run is reported, the others still run
            result["arms"][arm] = {"error": f"{type(err).__name__}: {err}"[:500]}
            continue
        distinct = sorted({tuple(t) for t in tokens})
        reference = tokens[0] if arm == "eager" else reference
        result["arms"][arm] = {"distinct_runs": len(distinct),
                               "runs_equal_eager": None if reference is None else sum(t == reference for t in tokens),
                               "first_divergence": [first_difference(t, tokens[0]) for t in tokens]}
        print(arm, result["arms"][arm], flush=True)
    result["environment"] = capture_environment()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
