"""Why a compiled model's prompt replayed as a CUDA graph gave tokens that differ between identical runs (H100,
docs/log.md 2026-12-06 14:45), where the eager model's prompt graph does not. The answer (16:15): inductor's kernels
launched as programmatic dependents (`triton.enable_pdl`) in the compiled prompt; `DecodeCompiled` now compiles the
prompt without them. The probe keeps the failing form as an arm (the prompt recompiled with them on), so the kernel
at fault can be looked for.

Per arm, one INT4 model (every linear quantized, norms fused: `quantize_for_decode`), `runs` identical decodes under
CUDA graphs after two warm-up runs (the first initializes the cache, the second captures the prompt's graph). A
graphed arm pads its prompt as `DecodeConfig.prefill_graphs` pads it (the probe turns the padding on beneath the
option); its `_ungraphed` twin runs the same model's prompt as it is, which is the reference: at a prompt length
that is a prefill size the two run the same kernels, so a correct graph gives the twin's tokens. Arms:

    compiled_prompt                    compiled step and prompt, programmatic launch on everywhere (the fault)
    compiled_prompt_ungraphed          the same, the prompt run without a graph
    compiled_prompt_no_pdl             programmatic launch off everywhere (inductor's and the INT4 kernels')
    compiled_prompt_plain              DecodeCompiled as it is: the prompt's inductor kernels launched plainly
    compiled_prompt_pointwise          the failing form, programmatic launch only for the prompt's pointwise kernels
    compiled_prompt_reduction          the same, only for its reductions (with the other, a bisection)
    compiled_step[_ungraphed]          compiled step, eager prompt
    eager                              eager model, prompt graphed (GPU-tested)

Every run's tokens are kept, and each arm says how many distinct token lists it gave and which arms' first run
it equals. The answer goes to docs/log.md, the raw file to telemetry/raw/.

    python -m research.compiled_prompt_graph_probe --model tiny --out telemetry/raw/compiled_prompt_graph_tiny.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch

import sdsie.decoding.engine as engine
from research.inductor_pdl_code import programmatic_launch_only_for
from sdsie.decoding import DecodeCompiled, DecodeConfig, generate
from sdsie.kernels.device import set_programmatic_launch
from sdsie.quant import quantize_for_decode
from sdsie.telemetry.records import capture_environment

# name: (compiled step, compiled prompt, prompt graphed, programmatic launch, which of the prompt's inductor kernels
# launch as programmatic dependents: None, or a kind of research.inductor_pdl_code.KINDS)
ARMS: dict[str, tuple[bool, bool, bool, bool, str | None]] = {
    "compiled_prompt": (True, True, True, True, "all"),
    "compiled_prompt_ungraphed": (True, True, False, True, "all"),
    "compiled_prompt_no_pdl": (True, True, True, False, None),
    "compiled_prompt_plain": (True, True, True, True, None),
    "compiled_prompt_pointwise": (True, True, True, True, "pointwise"),
    "compiled_prompt_reduction": (True, True, True, True, "reduction"),
    "compiled_step": (True, False, True, True, None),
    "compiled_step_ungraphed": (True, False, False, True, None),
    "eager": (False, False, True, True, None),
}


def build(name: str, device: torch.device) -> torch.nn.Module:
    if name == "tiny":
        from sdsie.models import tiny_llama

        model = tiny_llama(vocab_size=256, hidden_size=256, num_layers=2, seed=0).to(device, torch.bfloat16)
    else:
        from reproductions.decode_e2e import build_model

        model = build_model(name, False, device, torch.bfloat16)
    quantize_for_decode(model)
    return model


def arm_tokens(model: torch.nn.Module, arm: str, prompt: list[int], new_tokens: int, runs: int) -> list[list[int]]:
    """`runs` decodes of the arm after two warm-up runs."""
    step, prompt_compiled, graphed, pdl, prompt_kind = ARMS[arm]
    set_programmatic_launch(pdl)
    torch._dynamo.reset()
    engine._prefill_sizes = lambda config: engine.PREFILL_SIZES if config.cuda_graphs and graphed else ()
    options = {"combo_kernels": True, "triton.enable_pdl": pdl}
    target = DecodeCompiled(model, prompt_compiled, options=options) if step else model
    if prompt_kind is not None:  # DecodeCompiled compiles the prompt with them off: the failing form, compiled again
        target._prefill = (torch.compile(model, dynamic=True, options=options),)
    cfg = DecodeConfig(max_new_tokens=new_tokens, kv_cache="static", cuda_graphs=True)
    restricted = prompt_kind in ("pointwise", "reduction")  # compiles happen in the first two runs
    with programmatic_launch_only_for(prompt_kind) if restricted else contextlib.nullcontext():
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
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = p.parse_args(argv)
    model = build(args.model, torch.device("cuda"))
    prompt = [1 + (7 * i) % 200 for i in range(args.prompt_len)]
    result: dict[str, Any] = {"model": args.model, "runs": args.runs, "new_tokens": args.new_tokens,
                              "prompt_len": args.prompt_len, "environment": capture_environment(), "arms": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    firsts: dict[str, list[int]] = {}
    for arm in args.arms:
        start = time.perf_counter()
        try:  # one model for every arm: a compiled arm wraps it, and each wrapper gets caches of its own
            tokens = arm_tokens(model, arm, prompt, args.new_tokens, args.runs)
        except Exception as err:  # an arm that cannot run is reported, the others still run
            result["arms"][arm] = {"error": f"{type(err).__name__}: {err}"[:500]}
            out.write_text(json.dumps(result, indent=1))
            continue
        firsts[arm] = tokens[0]
        result["arms"][arm] = {
            "seconds": round(time.perf_counter() - start, 1),
            "distinct_runs": len({tuple(t) for t in tokens}),
            "first_divergence": [first_difference(t, tokens[0]) for t in tokens],
            "first_run_equals": [a for a, t in firsts.items() if a != arm and t == tokens[0]],
            "tokens": tokens,
        }
        print(arm, {k: v for k, v in result["arms"][arm].items() if k != "tokens"}, flush=True)
        out.write_text(json.dumps(result, indent=1))  # after every arm: a cut call keeps the arms it ran


if __name__ == "__main__":
    main()
