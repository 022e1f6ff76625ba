"""Does one decode step of the stand-in target repeat bit for bit? Eager forwards and CUDA-graph replays, compared.

Answered: yes. On the H200 every arm repeated bit for bit: one step's eager forwards, graph replays and prefills, and
whole graphed runs' tokens and caches (telemetry/raw/replay_probe_20261130T2214_h200.json,
replay_probe_20261201T0006_h200.json; docs/log.md).

    python -m research.standin.replay_probe --preset gpu --replays 200 --out replay_probe.json

Some decode records saw graphed plain decoding pick a different token at one bf16 near-tie
(`code-bst-module`, position 46, gap 0.0625) in some trials and not others, while eager plain decoding repeated in
every trial. This probe looks for the step that does not repeat, without the trained weights (none travel to the
GPU machine; a rebuild costs about five minutes): a bit-level difference shows on any weights of the same shapes,
since it is the kernels, not the values, that decide whether a result repeats.

On a target of the preset's shape (random weights, bf16) it prefills a prompt into a static cache, decodes a few
tokens, then repeats one 1-token forward from the same cache state:

* `eager`: the forward run eagerly, `--replays` times (`eager_stale`: with stale values scribbled, as below);
* `graph`: the forward captured once as a CUDA graph (as the engine captures it), replayed `--replays` times;
* `graph_stale`: the same graph, with random values written into every cache position past the step's between
  replays (what another run's leftovers or a rejected draft leave there; the causal mask must hide them);
* `graph_traced`: a second capture with forward hooks that keep every submodule's output, so a replay that differs
  names the first module (in execution order) whose output differed;
* `prefill`: the eager prefill of the prompt into a static cache, repeated (logits and the cache it writes);
* `engine_*`: whole greedy runs through `sdsie.decoding.generate` over a static cache (eager and graphed plain, and
  graphed plain interleaved with graphed fixed-K5 on the same target, as the decode suite runs them), compared by
  their tokens and bit for bit by every key and value the run left in the cache: with random weights the top
  logits are rarely close enough for a token to flip, the cache shows any difference in any step.

The first H200 run (`telemetry/raw/replay_probe_20261130T2214_h200.json`) predates the prefill arm and the engine
arms' cache comparison: it compared whole runs by their tokens only. The second
(`replay_probe_20261201T0006_h200.json`) ran every arm.

Each arm reports how many of its repeats differ from its first (0 everywhere: the step repeats). Eager arms also run
without CUDA (the graph arms are then reported as not run, with the reason).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.engine import STATIC_LEN_BUCKET
from sdsie.decoding.model_io import StaticKV, forward
from sdsie.standin import PRESETS, StandinConfig, build_model
from sdsie.telemetry.env import capture_environment


def random_target(config: StandinConfig, seed: int, device: str, dtype: torch.dtype) -> nn.Module:
    """The recipe's target (`sdsie.standin.build_model` on config.target), with seeded random weights and no
    special-token ids."""
    torch.manual_seed(seed)
    no_specials = types.SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return build_model(config.target, config, no_specials).to(device=device, dtype=dtype).eval()


class OutputTrace:
    """Forward hooks keeping each submodule's latest output tensor (under a graph capture: the tensor each replay
    rewrites in place). `snapshot` copies them, in the order the modules ran."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name: str) -> Callable:
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor):
                self.outputs.pop(name, None)  # re-insert: dict order is the order the modules last ran
                self.outputs[name] = out
        return hook

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.outputs.items()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def differing(first: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical, in `first`'s order (the modules' execution order)."""
    return [name for name, t in first.items() if not torch.equal(t, other[name])]


def repeat_step(step: Callable[[], dict[str, torch.Tensor]], replays: int,
                between: Callable[[int], None] | None = None) -> dict:
    """Run `step` replays times (calling between(i) before each repeat after the first); count the repeats whose
    outputs differ from the first run's, and per output name how often it differed."""
    if replays < 2:
        raise ValueError(f"repeat_step needs at least 2 replays to compare, got {replays}")
    first = step()
    counts = {name: 0 for name in first}
    differ = 0
    for i in range(1, replays):
        if between is not None:
            between(i)
        names = differing(first, step())
        differ += bool(names)
        for name in names:
            counts[name] += 1
    order = list(first)
    first_module = next((name for name in order if counts[name]), None)
    return {"replays": replays, "differing_replays": differ, "first_differing_output": first_module,
            "differing_outputs": {name: n for name, n in counts.items() if n}}


def _prepared_cache(model: nn.Module, prompt: torch.Tensor, warm_tokens: int, graphs: bool) -> tuple[StaticKV, int]:
    """A static cache holding the prompt (an eager prefill) and warm_tokens greedy tokens (with graphs: the first
    captures the 1-token graph, as the engine's first step does, and the rest replay it); its length."""
    kv = StaticKV(model, STATIC_LEN_BUCKET, cuda_graphs=graphs, graph_sizes=(1,) if graphs else ())
    logits = forward(model, prompt, kv, last_only=True)
    for _ in range(warm_tokens):
        logits = forward(model, logits[-1].argmax()[None], kv, last_only=True)
    return kv, kv.length


def scribble_stale(kv: StaticKV, start: int, gen: torch.Generator) -> None:
    """Random values (scale 8) in every layer's keys and values at positions start and after: what another run's
    leftovers or a rejected draft leave there, which the causal mask must keep from any later forward."""
    for layer in kv.cache.layers:
        for buf in (layer.keys, layer.values):
            tail = buf[..., start:, :]
            tail.copy_(torch.randn(tail.shape, generator=gen, device=tail.device) * 8)


def step_arm(model: nn.Module, prompt: torch.Tensor, warm_tokens: int, replays: int, graphs: bool,
             stale: bool = False, trace: bool = False) -> dict:
    """One 1-token forward from a fixed cache state, repeated: eagerly or as replays of one captured graph.
    trace: hooks registered before the capture keep every submodule's output (see OutputTrace)."""
    token = torch.tensor([7], device=prompt.device)
    tracer = OutputTrace(model) if trace else None
    gen = torch.Generator(device=prompt.device).manual_seed(1)
    try:
        with torch.inference_mode():
            kv, length = _prepared_cache(model, prompt, warm_tokens, graphs)

            def step() -> dict[str, torch.Tensor]:
                kv.crop(length)
                logits = forward(model, token, kv, last_only=True)
                out = tracer.snapshot() if tracer else {}
                out["logits"] = logits.detach().clone()
                return out

            result = repeat_step(step, replays, (lambda _i: scribble_stale(kv, length + 1, gen)) if stale else None)
    finally:
        if tracer:
            tracer.remove()
    return {**result, "cache_length": length, "graphed": graphs, "stale_scribbled": stale, "traced": trace}


def cache_contents(kv: StaticKV) -> dict[str, torch.Tensor]:
    """Every layer's keys and values at the positions the cache holds, copied: they depend on every forward that
    wrote them, so comparing them bit for bit checks every step of a run, not only the tokens it chose."""
    out = {}
    for i, layer in enumerate(kv.cache.layers):
        out[f"layer{i}.keys"] = layer.keys[..., : kv.length, :].clone()
        out[f"layer{i}.values"] = layer.values[..., : kv.length, :].clone()
    return out


def prefill_arm(model: nn.Module, prompt: torch.Tensor, replays: int) -> dict:
    """The eager prefill into a static cache (every graphed run starts with one), repeated: logits and cache."""
    with torch.inference_mode():
        kv = StaticKV(model, STATIC_LEN_BUCKET)

        def step() -> dict[str, torch.Tensor]:
            kv.crop(0)
            logits = forward(model, prompt, kv, last_only=False)
            return {"logits": logits.clone(), **cache_contents(kv)}

        return {**repeat_step(step, replays), "prompt_len": prompt.numel()}


def plain_target_cache(target: nn.Module, graphs: bool) -> StaticKV:
    """The static cache the engine's plain loop used for `target` (the engine keeps it between runs, keyed by role,
    length bucket, graphs and graph sizes; the plain loop's sizes are (1,)). Private state, read by a diagnostic."""
    from sdsie.decoding.engine import _STATIC

    found = [kv for key, kv in _STATIC.get(target, {}).items() if key[0] == "target" and key[2] == graphs
             and key[3] == (1,)]
    if len(found) != 1:
        raise RuntimeError(f"expected one plain static cache for the target (graphs={graphs}), found {len(found)}")
    return found[0]


def engine_arm(target: nn.Module, prompt: torch.Tensor, runs: int, max_new: int, graphs: bool,
               interleave_k: int | None = None) -> dict:
    """Whole greedy plain runs over a static cache, repeated, compared by their tokens and by every position of the
    cache they leave (see cache_contents). With interleave_k, a fixed-K run on the same target (the scout is the
    target itself) goes before each plain run, as other variants do between the decode suite's runs."""
    cfg = DecodeConfig(max_new_tokens=max_new, kv_cache="static", cuda_graphs=graphs)
    other = None
    if interleave_k:
        other = DecodeConfig(max_new_tokens=max_new, k_draft=interleave_k, kv_cache="static", cuda_graphs=graphs)

    def step() -> dict[str, torch.Tensor]:
        if other is not None:
            generate(target, prompt, other, scout=target)
        tokens = generate(target, prompt, cfg).tokens
        return {"tokens": torch.tensor(tokens), **cache_contents(plain_target_cache(target, graphs))}

    with torch.inference_mode():
        result = repeat_step(step, runs)
    return {**result, "max_new_tokens": max_new, "graphed": graphs, "interleaved_k": interleave_k}


def run_probe(preset: str, replays: int, runs: int, device: str, seed: int = 0, warm_tokens: int = 40,
              prompt_len: int = 24, max_new: int = 128) -> dict:
    config = PRESETS[preset]
    model = random_target(config, seed, device, torch.bfloat16)
    rng = random.Random(seed)
    prompt = torch.tensor([rng.randrange(config.vocab_size) for _ in range(prompt_len)], device=device)
    arms: dict[str, dict] = {}
    t0 = time.perf_counter()
    arms["prefill"] = prefill_arm(model, prompt, replays)
    arms["eager"] = step_arm(model, prompt, warm_tokens, replays, graphs=False)
    arms["eager_stale"] = step_arm(model, prompt, warm_tokens, replays, graphs=False, stale=True)
    arms["engine_eager"] = engine_arm(model, prompt, runs, max_new, graphs=False)
    if device.startswith("cuda"):
        arms["graph"] = step_arm(model, prompt, warm_tokens, replays, graphs=True)
        arms["graph_stale"] = step_arm(model, prompt, warm_tokens, replays, graphs=True, stale=True)
        arms["graph_traced"] = step_arm(model, prompt, warm_tokens, replays, graphs=True, trace=True)
        arms["engine_graphs"] = engine_arm(model, prompt, runs, max_new, graphs=True)
        arms["engine_graphs_after_k5"] = engine_arm(model, prompt, runs, max_new, graphs=True, interleave_k=5)
    else:
        for name in ("graph", "graph_stale", "graph_traced", "engine_graphs", "engine_graphs_after_k5"):
            arms[name] = {"not_run": f"CUDA graphs need a CUDA device; this run used {device}"}
    return {"preset": preset, "target_shape": vars(config.target), "vocab_size": config.vocab_size,
            "dtype": "bfloat16", "weights": f"random, seed {seed}", "prompt_len": prompt_len,
            "warm_tokens": warm_tokens, "seconds": time.perf_counter() - t0, "arms": arms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--runs", type=int, default=20, help="whole decodes per engine arm")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    for flag, value in (("--replays", a.replays), ("--runs", a.runs)):
        if value < 2:  # each arm compares repeats with its first run; found before the arms run, not after
            p.error(f"{flag} must be at least 2 (a repeat to compare with the first run), got {value}")
    result = run_probe(a.preset, a.replays, a.runs, a.device, a.seed)
    result["environment"] = capture_environment()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    for name, arm in result["arms"].items():
        print(name, {k: v for k, v in arm.items() if k != "differing_outputs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
