"""Where the engine's eager prefill spends its time at the 7-8B shapes: bf16 against INT4 (every decoder linear and
the LM head quantized at group 128, q/k/v and gate/up fused, as decode_e2e's int4 rows), at prompts of 32 and 2,048
tokens. Per (model, variant, prompt): the engine's prefill seconds (generate with one new token, static cache,
graphs: the decode_e2e setting), a bare HF forward's seconds over the same prompt, and one profiled prefill's GPU
kernels by name and host ops by self CPU time. The answer is in docs/log.md; the raw file in telemetry/raw/.

    python -m research.prefill_probe --out telemetry/raw/prefill_probe_h200.json [--models llama3.1-8b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from reproductions.decode_e2e import GROUP_SIZE, LINEARS, build_model, kernel_times
from sdsie.decoding import DecodeConfig, generate
from sdsie.quant import QuantConfig, fuse_projections, quantize_model
from sdsie.telemetry.records import capture_environment


def engine_prefill_s(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    cfg = DecodeConfig(max_new_tokens=1, kv_cache="static", cuda_graphs=True)
    return generate(model, prompt, cfg).stats.prefill_seconds


def bare_forward_s(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    """One HF forward over the prompt without a cache, logits of the last position only, synchronized both ends."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=prompt[None], use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def profiled(model: torch.nn.Module, prompt: torch.Tensor, top: int = 25) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine_prefill_s(model, prompt)
        torch.cuda.synchronize()
    kernels = kernel_times(prof)
    host = [{"name": a.key, "calls": a.count, "self_cpu_us": a.self_cpu_time_total, "cpu_us": a.cpu_time_total}
            for a in prof.key_averages()]
    return {
        "gpu_us": sum(us for _, us, _ in kernels.values()),
        "busy_us": sum(busy for _, _, busy in kernels.values()),
        "kernels": sum(n for n, _, _ in kernels.values()),
        "top_kernels": [{"name": k, "launches": n, "us": us, "busy_us": busy}
                        for k, (n, us, busy) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]],
        "top_host_self": sorted(host, key=lambda h: -h["self_cpu_us"])[:top],
        "top_host_total": sorted(host, key=lambda h: -h["cpu_us"])[:top],
    }


def measure(model: torch.nn.Module, prompt: torch.Tensor, reps: int) -> dict[str, Any]:
    for _ in range(2):
        engine_prefill_s(model, prompt)
        bare_forward_s(model, prompt)
    engine = [engine_prefill_s(model, prompt) for _ in range(reps)]
    bare = [bare_forward_s(model, prompt) for _ in range(reps)]
    return {"engine_prefill_ms": statistics.median(engine) * 1e3, "engine_prefill_ms_all": [s * 1e3 for s in engine],
            "bare_forward_ms": statistics.median(bare) * 1e3, "bare_forward_ms_all": [s * 1e3 for s in bare],
            "profile": profiled(model, prompt)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", nargs="+", default=["llama3.1-8b"])
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[32, 2048])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_probe needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    doc: dict[str, Any] = {"suite": "prefill_probe", "environment": capture_environment(), "rows": []}
    for name in args.models:
        model = build_model(name, False, device, torch.bfloat16)
        gen = torch.Generator().manual_seed(0)
        for variant in ("bf16", "int4"):
            if variant == "int4":
                quantize_model(model, LINEARS, QuantConfig(group_size=GROUP_SIZE))
                fuse_projections(model)
            for plen in args.prompt_lens:
                prompt = torch.randint(3, model.config.vocab_size, (plen,), generator=gen).to(device)
                row = {"model": name, "variant": variant, "prompt_len": plen, **measure(model, prompt, args.reps)}
                doc["rows"].append(row)
                print(f"{name} {variant} P={plen}: engine {row['engine_prefill_ms']:.1f} ms, bare "
                      f"{row['bare_forward_ms']:.1f} ms, GPU {row['profile']['gpu_us'] / 1e3:.1f} ms in "
                      f"{row['profile']['kernels']} kernels", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(doc, indent=1, default=str))
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
