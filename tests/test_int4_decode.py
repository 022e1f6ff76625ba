"""Decoding models with INT4 layers: a quantized or gated LM head, and static caches (with their graphs) captured
again after the model's modules are swapped in place."""

from __future__ import annotations

import copy

import pytest
import torch

import sdsie.decoding.engine as engine
from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.model_io import module_fingerprint
from sdsie.models import tiny_llama, vocab_size
from sdsie.quant import GatedLinear, Int4Linear, gate_model, quantize_model

VOCAB = 64
BASE = tiny_llama(vocab_size=VOCAB, seed=0)
PROMPT = [1, 5, 9, 4]
STATIC = DecodeConfig(max_new_tokens=6, kv_cache="static")


def _greedy_by_hand(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full forwards, no cache: what any cache must reproduce."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.cpu_kernels
def test_a_quantized_lm_head_gives_the_vocabulary_and_decodes():
    model = copy.deepcopy(BASE)
    quantize_model(model, "lm_head")
    assert isinstance(model.lm_head, Int4Linear) and vocab_size(model) == VOCAB
    out = generate(model, PROMPT, DecodeConfig(max_new_tokens=4))
    assert out.tokens == _greedy_by_hand(model, PROMPT, 4)
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, 64\)"):
        generate(model, [VOCAB], DecodeConfig(max_new_tokens=1))


@pytest.mark.cpu_kernels
def test_a_gated_lm_head_gives_the_vocabulary_and_decodes_at_both_gears():
    model = copy.deepcopy(BASE)
    gear = gate_model(model, "lm_head")
    assert isinstance(model.lm_head, GatedLinear) and vocab_size(model) == VOCAB
    clutch = EntropyClutch(ClutchConfig(theta_low=1.8, theta_high=2.4, alpha=0.5))
    out = generate(model, PROMPT, DecodeConfig(max_new_tokens=6), clutch=clutch, gear=gear)
    assert len(out.tokens) == 6
    assert {c.gear_int4 for c in out.cycles} == {True, False} and gear.int4_calls > 0 and gear.full_calls > 0


def test_vocab_size_refuses_a_model_without_an_output_embedding():
    with pytest.raises(ValueError, match="has no output embedding"):
        vocab_size(torch.nn.Linear(2, 2))


def test_the_fingerprint_follows_module_swaps_and_storages_not_values():
    model = copy.deepcopy(BASE)
    before = module_fingerprint(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # new values in the same storage: a replay reads them
    assert module_fingerprint(model) == before
    model.lm_head.weight.data = model.lm_head.weight.data.clone()  # same values, another storage
    moved = module_fingerprint(model)
    assert moved != before
    quantize_model(model, "mlp.down_proj", layers=[0])
    assert module_fingerprint(model) != moved


@pytest.mark.cpu_kernels
def test_static_caches_are_built_again_after_quantize_model_swaps_the_modules():
    """A static run, quantize_model in place (LM head and one layer), a second static run: the second gets new
    caches (under CUDA graphs the old ones hold graphs captured on the freed modules) and decodes the quantized
    model; a run with nothing swapped reuses its caches."""
    model = copy.deepcopy(BASE)
    first = generate(model, PROMPT, STATIC)
    old = dict(engine._STATIC[model])
    again = generate(model, PROMPT, STATIC)
    assert engine._STATIC[model] == old and again.tokens == first.tokens  # nothing swapped: the same caches
    quantize_model(model, ["lm_head", "mlp.down_proj"], layers=[0, 1])
    second = generate(model, PROMPT, STATIC)
    fresh = engine._STATIC[model]
    assert fresh and not any(kv is old_kv for kv in fresh.values() for old_kv in old.values())
    assert second.tokens == _greedy_by_hand(model, PROMPT, 6)


@pytest.mark.gpu
def test_graphed_decoding_survives_quantize_model_in_place():
    """On a GPU: graphs captured on the bf16 model, quantize_model in place (every decoder linear and the LM head),
    graphed decoding again: the tokens of the same quantized model decoded eagerly (the replay must not read the
    freed bf16 weights)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = copy.deepcopy(BASE).to("cuda", torch.bfloat16)
    graphs = DecodeConfig(max_new_tokens=24, kv_cache="static", cuda_graphs=True)
    generate(model, PROMPT, graphs)
    quantize_model(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
    torch.cuda.empty_cache()
    replayed = generate(model, PROMPT, graphs)
    eager = generate(model, PROMPT, DecodeConfig(max_new_tokens=24, kv_cache="static"))
    assert replayed.tokens == eager.tokens
