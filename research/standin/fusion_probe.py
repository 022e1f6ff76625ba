"""How much of a stand-in forward is kernel count? The gpu target's 1-token decode step, graphed as the engine runs
it, beside the same step compiled by torch.compile (inductor fuses the norms, RoPE and SiLU into few kernels).

Answered in part: the compiled step launches 310 kernels against the graphed step's 782; its step time is no valid
measurement of a fused step (telemetry/raw/fusion_probe_20261202T0016_h200.json; docs/log.md).

    python -m research.standin.fusion_probe --out $OUT/fusion_probe.json

tree_cycle_profile (telemetry/raw/tree_cycle_profile_20261202T0011_h200.json) counted 792 kernels per graphed plain
token, 1.47 ms of kernel time in a 2.06 ms step: every forward of this 91M-parameter pair is launch-bound. Random
weights (the kernels do not depend on them). The engine's step replays its CUDA graph on a StaticKV; the compiled one is
HF's forward on an HF StaticCache under mode="reduce-overhead" (inductor's kernels in its own CUDA graphs). Each is
timed with CUDA events over `--steps` consecutive steps after warm-up, and its kernels counted for one step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from research.standin.tree_cycle_profile import models
from sdsie.decoding.model_io import StaticKV, forward
from sdsie.telemetry.timing import cuda_event_ms


def step_ms(fn, steps: int, start: int) -> float:
    """CUDA-event time of `steps` consecutive calls fn(position), divided by steps (host launch included)."""
    positions = iter(range(start, start + steps))
    torch.cuda.synchronize()
    return cuda_event_ms(lambda: fn(next(positions)), calls=steps)


def kernel_count(fn, position: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(position)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fusion_probe needs a CUDA GPU")
    from transformers import StaticCache

    target, _scout, _vocab = models("cuda", torch.bfloat16)
    token = torch.tensor([[5]], device="cuda")
    out: dict = {"steps": a.steps, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    def make(forward):
        cache = StaticCache(config=target.config, max_cache_len=1024)

        def fn(pos: int):
            return forward(input_ids=token, past_key_values=cache, use_cache=True,
                           cache_position=torch.tensor([pos], device="cuda")).logits
        return fn

    kv = StaticKV(target, 1024, cuda_graphs=True, graph_sizes=(1,))  # the engine's graphed step
    forward(target, torch.arange(3, 11, device="cuda"), kv, True)  # an 8-token prefill, eager

    def graphed(pos: int):
        return forward(target, token[0], kv, False)

    for _ in range(3):
        graphed(0)
    out["graphed_ms"] = step_ms(graphed, a.steps, 0)
    out["graphed_kernels"] = kernel_count(graphed, 0)
    t0 = time.perf_counter()
    compiled = make(torch.compile(target.forward, mode="reduce-overhead"))
    for pos in range(8):
        compiled(pos)
    out["compile_s"] = time.perf_counter() - t0
    out["compiled_ms"] = step_ms(compiled, a.steps, 8)
    out["compiled_kernels"] = kernel_count(compiled, 8 + a.steps)
    print(json.dumps(out), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
