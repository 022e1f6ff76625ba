"""Attention over the static cache (model_io's static sdpa): a one-token forward of a grouped-query model attends over
the cache as it is, eagerly and in the graph torch.compile hands its backend, with one fused attention op per layer,
no per-query-head copy of the cache and the mask made additive once per forward; the scores are those of HF's
repeated keys and values."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.decomposition import select_decomp_table

from sdsie.decoding import DecodeConfig, generate, run_attention
from sdsie.decoding.model_io import StaticKV, _static_sdpa_attention, forward
from sdsie.models import compiled_copy, tiny_llama

aten = torch.ops.aten
FUSED_SDPA = {  # sdpa's backends by SDPBackend value, on each device; MATH (0) is the matmul + softmax decomposition
    ("cpu", 1): aten._scaled_dot_product_flash_attention_for_cpu.default,
    ("cuda", 1): aten._scaled_dot_product_flash_attention.default,
    ("cuda", 2): aten._scaled_dot_product_efficient_attention.default,
    ("cuda", 3): aten._scaled_dot_product_cudnn_attention.default,
}
LAYERS, CACHE = 2, 48  # a cache length no other dimension of the model has


def _decode_step_graph(device: str, dtype: torch.dtype) -> tuple[torch.fx.GraphModule, torch.nn.Module]:
    """The aten graph inductor receives for a one-token forward over a static cache (inductor's decompositions
    applied by AOT autograd; the graph then runs as it is)."""
    torch._dynamo.reset()  # a code cache left by another test's compile would skip this capture
    model = tiny_llama(vocab_size=64, num_layers=LAYERS, seed=0, dtype=dtype).to(device)
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def keep(graph: torch.fx.GraphModule, inputs: list) -> object:
            graphs.append(graph)
            return graph
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, decompositions=select_decomp_table())

    compiled = torch.compile(model, backend=capture, fullgraph=True)
    with torch.inference_mode():
        kv = StaticKV(model, max_len=CACHE)
        forward(model, torch.tensor([1, 5, 9, 4], device=device), kv, last_only=True)  # the prefill, eager
        forward(compiled, torch.tensor([7], device=device), kv, last_only=True)
    torch._dynamo.reset()
    (graph,) = graphs
    return graph, model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_compiled_decode_step_attends_over_the_cache_without_copying_it(device: str):
    """One fused sdpa op per layer (no matmul + softmax decomposition); no tensor over the cache's positions larger
    than one layer's keys (HF's repeat to every query head copies each layer's keys and values, the group size times
    larger); the mask is made additive once, not in every layer. The fused op is the backend eager sdpa picks for
    the same inputs (on CUDA, given a mask: efficient attention or cuDNN, never flash)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    graph, model = _decode_step_graph(device, dtype)
    config = model.config
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    packed = torch.zeros(1, kv_heads, heads // kv_heads, dim, device=device, dtype=dtype)
    keys = torch.zeros(1, kv_heads, CACHE, dim, device=device, dtype=dtype)
    eager_choice = torch._fused_sdp_choice(packed, keys, keys, torch.zeros(1, 1, 1, CACHE, device=device, dtype=dtype))
    sdpa = [n.target for n in calls if "scaled_dot_product" in str(n.target)]
    assert sdpa == [FUSED_SDPA[device, eager_choice]] * LAYERS, (sdpa, eager_choice)
    # No softmax, and no batched matmul over the cache's positions (the rotary table's outer product is a bmm on
    # CUDA, where inductor does not decompose it; it does not touch the cache).
    over_positions = [n for n in calls if n.target == aten.bmm.default
                      and any(CACHE in a.meta["val"].shape for a in n.args if isinstance(a, torch.fx.Node))]
    assert not [n for n in calls if n.target == aten._softmax.default] and not over_positions, over_positions
    layer_keys = kv_heads * CACHE * dim
    over_cache = {n.name: tuple(n.meta["val"].shape) for n in calls
                  if isinstance(n.meta.get("val"), torch.Tensor) and CACHE in n.meta["val"].shape}
    assert over_cache and all(torch.Size(s).numel() <= layer_keys for s in over_cache.values()), over_cache
    # the additive mask is one op of the forward (sdsie::additive_mask), which every layer reads
    assert sum(n.target == torch.ops.sdsie.additive_mask.default for n in calls) == 1
    assert not [n for n in calls if n.target == aten.where.self]


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("split_kv", marks=pytest.mark.cpu_kernels)])
def test_inductor_builds_the_mask_in_one_kernel_for_all_layers(attention: str):
    """Inductor inlines a pointwise mask into each kernel that feeds a layer's attention op, so without the
    additive_mask op every layer computed the causal comparison (`le`) again, one more kernel per layer on a GPU.
    With it, one kernel of the compiled decode step makes the comparison."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = tiny_llama(vocab_size=64, num_layers=LAYERS, seed=0, dtype=torch.float32)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    with torch.inference_mode():
        kv = StaticKV(model, max_len=CACHE, attention=attention)
        forward(model, torch.tensor([1, 5, 9, 4]), kv, last_only=True)
        _, code = run_and_get_code(lambda: forward(compiled, torch.tensor([7]), kv, last_only=True))
    torch._dynamo.reset()
    source = "\n".join(code)
    kernels = re.findall(r"^(\w+) = async_compile\.\w+\(", source, flags=re.MULTILINE)  # each distinct kernel once
    comparing = [k for k in kernels if "_le_" in k]
    launches = sum(len(re.findall(rf"^\s+{k}\(", source, flags=re.MULTILINE)) for k in comparing)  # one per call
    assert len(comparing) == 1 and launches == 1, (comparing, launches)


def test_packed_heads_give_the_scores_of_repeated_keys_and_values():
    """A one-token query of 4 heads over 2 key/value heads with an additive mask over a cache of 10 positions: the
    packed attention equals sdpa over keys and values repeated to every query head, per head, in HF's layout."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, s, 8, generator=gen) for h, s in ((4, 1), (2, 10), (2, 10)))
    visible = torch.arange(10) < 6
    mask = torch.where(visible, 0.0, float("-inf")).view(1, 1, 1, 10)

    class Attention(torch.nn.Module):
        num_key_value_groups = 2

    out, _ = _static_sdpa_attention(Attention(), q, k, v, mask, scaling=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=visible.view(1, 1, 1, 10), scale=0.5)
    assert out.shape == (1, 1, 4, 8)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_static_decoding_with_packed_heads_keeps_the_dynamic_caches_tokens():
    """Greedy decoding over the static cache (packed decode steps, additive mask) and over the dynamic cache (HF's
    own sdpa) give the same tokens on the grouped-query tiny Llama, eagerly and with the decode traced by dynamo."""
    model = tiny_llama(vocab_size=64, num_layers=LAYERS, seed=0)
    prompt = [1, 5, 9, 4, 7]
    dynamic = generate(model, prompt, DecodeConfig(max_new_tokens=24)).tokens
    static = generate(model, prompt, DecodeConfig(max_new_tokens=24, kv_cache="static")).tokens
    traced = compiled_copy(model, backend="eager")
    try:
        compiled = generate(traced, prompt, DecodeConfig(max_new_tokens=24, kv_cache="static")).tokens
    finally:
        torch._dynamo.reset()
    assert static == dynamic == compiled


@pytest.mark.cpu_kernels
def test_split_kv_attention_decodes_the_tokens_of_sdpa_and_runs_the_kernel_once_per_layer_and_step(monkeypatch):
    """DecodeConfig(attention="split_kv") sends each one-token step's attention through the split-KV kernel (here
    under the Triton interpreter), one call per layer and step, and the multi-token forwards to sdpa: greedy tokens
    equal sdpa's, eagerly and traced by dynamo (the kernel as one custom op); the two choices keep separate caches."""
    module = importlib.import_module("sdsie.kernels.decode_attention")  # the package exports its function by that name
    calls = []
    real = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    model = tiny_llama(vocab_size=64, num_layers=LAYERS, seed=0)
    prompt, n = [1, 5, 9, 4, 7], 6
    sdpa = generate(model, prompt, DecodeConfig(max_new_tokens=n, kv_cache="static")).tokens
    split = generate(model, prompt, DecodeConfig(max_new_tokens=n, kv_cache="static", attention="split_kv")).tokens
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert calls and len(calls) == LAYERS * (n - 1)  # the prefill's forward is sdpa's; every decode step the kernel's
    assert all(tuple(c) == (1, kv_heads, heads // kv_heads, model.config.head_dim) for c in calls)
    traced = compiled_copy(model, backend="eager")
    try:
        compiled = generate(traced, prompt, DecodeConfig(max_new_tokens=n, kv_cache="static", attention="split_kv"))
    finally:
        torch._dynamo.reset()
    assert split == sdpa == compiled.tokens


def test_attention_choice_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="attention must be one of"):
        DecodeConfig(attention="flash")
    with pytest.raises(ValueError, match="needs kv_cache='static'"):
        DecodeConfig(attention="split_kv")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU the kernel does not run on: refused, not a silent sdpa
    with pytest.raises(ValueError, match="split_kv.*needs a CUDA device"):
        generate(tiny_llama(vocab_size=64, num_layers=1, seed=0), [1, 2],
                 DecodeConfig(max_new_tokens=2, kv_cache="static", attention="split_kv"))


def test_auto_attention_is_split_kv_only_for_a_graphed_static_cache_on_cuda():
    """The default, "auto": the split-KV kernel where its launch cost is paid once, at graph capture (a static cache
    under cuda_graphs on CUDA), SDPA elsewhere; an explicit choice is kept as it is."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert DecodeConfig().attention == "auto"
    assert run_attention(DecodeConfig(kv_cache="static", cuda_graphs=True), cuda) == "split_kv"
    assert run_attention(DecodeConfig(kv_cache="static"), cuda) == "sdpa"
    assert run_attention(DecodeConfig(), cuda) == "sdpa"  # a dynamic cache: HF's attention
    assert run_attention(DecodeConfig(kv_cache="static", cuda_graphs=True), cpu) == "sdpa"
    assert run_attention(DecodeConfig(kv_cache="static", cuda_graphs=True, attention="sdpa"), cuda) == "sdpa"
    assert run_attention(DecodeConfig(kv_cache="static", attention="split_kv"), cpu) == "split_kv"


def test_auto_attention_on_a_cpu_decodes_through_sdpa(monkeypatch):
    """A default static-cache decode on a CPU, even under the interpreter, never reaches the split-KV kernel."""
    module = importlib.import_module("sdsie.kernels.decode_attention")
    monkeypatch.setattr(module, "_launch", lambda *a, **k: pytest.fail("auto ran the split-KV kernel on a CPU"))
    model = tiny_llama(vocab_size=64, num_layers=LAYERS, seed=0)
    auto = generate(model, [1, 5, 9], DecodeConfig(max_new_tokens=4, kv_cache="static")).tokens
    sdpa = generate(model, [1, 5, 9], DecodeConfig(max_new_tokens=4, kv_cache="static", attention="sdpa")).tokens
    assert auto == sdpa


@pytest.mark.cpu_kernels
def test_the_engine_builds_its_static_cache_with_the_attention_run_attention_resolves(monkeypatch):
    """The resolved choice acts: with `run_attention` answering "split_kv" for the default config (as it does for a
    graphed static cache on CUDA), the one-token steps go through the kernel (here under the interpreter)."""
    import sdsie.decoding.engine as engine

    module = importlib.import_module("sdsie.kernels.decode_attention")
    calls = []
    real = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(engine, "run_attention", lambda config, device: "split_kv")
    model = tiny_llama(vocab_size=64, num_layers=LAYERS, seed=0)
    generate(model, [1, 5, 9], DecodeConfig(max_new_tokens=4, kv_cache="static"))
    assert len(calls) == LAYERS * 3
