"""fuse_projections: q/k/v and gate/up as one linear each, for float, INT4 and gated layers of Llama and Qwen2
models. The fused INT4 weights are the unfused rows exactly; the model's logits equal the unfused model's up to the
kernels' summation order, and greedy decoding gives the same tokens with fewer kernel launches."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sdsie.decoding import DecodeConfig, generate
from sdsie.kernels import kernel_calls
from sdsie.models import tiny_llama
from sdsie.quant import GatedLinear, Int4Linear, QuantConfig, fuse_projections, gate_model, quantize_model
from sdsie.quant.fuse import FusedMLP, FusedProjection, ProjectionSlice, concat_linears

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
IDS = torch.tensor([[1, 5, 9, 4, 7, 3]])
CFG = QuantConfig("minmax", 32)


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    """Qwen2: q/k/v with a bias, unlike Llama."""
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-initializes biases: give q/k/v's biases values so that fusing them is tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.3)
    return model


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model(IDS.to(model.device), use_cache=False).logits


def _assert_rounding_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
def test_fused_int4_rows_are_the_unfused_rows_and_the_logits_the_unfused_logits(kernel_device, build):
    unfused = build(seed=0)
    quantize_model(unfused, ALL_LINEARS, CFG)
    unfused.to(kernel_device)
    fused = copy.deepcopy(unfused)
    report = fuse_projections(fused)
    assert len(report.qkv) == len(report.gate_up) == 2
    attn, unfused_attn = fused.model.layers[0].self_attn, unfused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, ProjectionSlice) and isinstance(attn.qkv_proj.linear, Int4Linear)
    rows = torch.cat([getattr(unfused_attn, p).int4_weight.dequantize() for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(attn.qkv_proj.linear.int4_weight.dequantize(), rows)
    mlp, unfused_mlp = fused.model.layers[0].mlp, unfused.model.layers[0].mlp
    assert isinstance(mlp, FusedMLP)
    rows = torch.cat([unfused_mlp.gate_proj.int4_weight.dequantize(), unfused_mlp.up_proj.int4_weight.dequantize()])
    assert torch.equal(mlp.gate_up_proj.int4_weight.dequantize(), rows)
    assert mlp.silu_in_projection  # silu(gate) * up from the projection's launch (Int4Linear.silu_mul)
    other = FusedMLP(mlp.gate_up_proj, mlp.down_proj, torch.nn.GELU(), mlp.intermediate)
    assert not other.silu_in_projection
    if unfused_attn.q_proj.bias is not None:
        assert torch.equal(attn.qkv_proj.linear.bias, torch.cat([unfused_attn.q_proj.bias, unfused_attn.k_proj.bias,
                                                                 unfused_attn.v_proj.bias]))

    before = kernel_calls()
    expected = _logits(unfused)
    unfused_calls, before = kernel_calls() - before, kernel_calls()
    got = _logits(fused)
    assert (unfused_calls, kernel_calls() - before) == (15, 9)  # per layer 7 -> 4 launches; the head 1
    _assert_rounding_close(got, expected)


def test_a_silu_mlp_over_int4_takes_silu_mul_from_the_projection_and_another_activation_does_not(monkeypatch):
    """The choice acts: with silu, FusedMLP.forward asks the INT4 projection for silu(gate) * up (the launch with the
    epilogue) and never for its plain output; with GELU it takes the plain output and applies GELU itself."""
    model = tiny_llama(seed=0)
    quantize_model(model, ["gate_proj", "up_proj"], CFG)
    fuse_projections(model, qkv=False)
    mlp = model.model.layers[0].mlp
    calls = []
    real_silu_mul, real_forward = Int4Linear.silu_mul, Int4Linear.forward
    monkeypatch.setattr(Int4Linear, "silu_mul", lambda self, x: calls.append("silu_mul") or real_silu_mul(self, x))
    monkeypatch.setattr(Int4Linear, "forward", lambda self, x: calls.append("forward") or real_forward(self, x))
    x = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = mlp(x)
        gate_up = mlp.gate_up_proj.int4_weight.dequantize().float() @ x.reshape(-1, x.shape[-1]).T  # [N, 6]
        half = gate_up.shape[0] // 2
        expected = mlp.down_proj((torch.nn.functional.silu(gate_up[:half]) * gate_up[half:]).T.reshape(2, 3, -1))
    assert calls == ["silu_mul"]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    calls.clear()
    gelu = FusedMLP(mlp.gate_up_proj, mlp.down_proj, torch.nn.GELU(), mlp.intermediate)
    with torch.no_grad():
        gelu(x)
    assert calls == ["forward"]


def test_a_fused_int4_model_decodes_the_unfused_models_tokens(kernel_device):
    """Through the engine's static cache (the slices see one input per forward): the prefill's token and one decode
    step's (GEMVs, slow under the interpreter)."""
    unfused = tiny_llama(seed=0)
    quantize_model(unfused, ALL_LINEARS, CFG)
    unfused.to(kernel_device)
    fused = copy.deepcopy(unfused)
    fuse_projections(fused)
    ids = IDS.to(kernel_device)
    tokens = generate(fused, ids[0], DecodeConfig(max_new_tokens=2, kv_cache="static")).tokens
    assert tokens == _greedy_by_hand(unfused, ids, 2)


def _greedy_by_hand(model: torch.nn.Module, ids: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, -n:].tolist()


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
def test_fused_float_projections_give_the_float_models_logits(build):
    model = build(seed=1)
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    assert isinstance(fused.model.layers[1].self_attn.qkv_proj.linear, torch.nn.Linear)
    _assert_rounding_close(_logits(fused), _logits(model))
    cfg = DecodeConfig(max_new_tokens=6)
    assert generate(fused, IDS[0], cfg).tokens == generate(model, IDS[0], cfg).tokens


def test_fused_gated_layers_follow_the_gear(kernel_device):
    model = tiny_llama(seed=2)
    state = gate_model(model, ALL_LINEARS, CFG)
    model.to(kernel_device)
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    fused_state = fused.model.layers[0].mlp.gate_up_proj.state
    assert isinstance(fused.model.layers[0].mlp.gate_up_proj, GatedLinear)
    assert fused.model.layers[0].self_attn.qkv_proj.linear.state is fused_state
    for gear in (False, True):
        state.int4 = fused_state.int4 = gear
        _assert_rounding_close(_logits(fused), _logits(model))


def test_a_slice_called_on_another_input_computes_its_own_projection():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, n) for n in (4, 2, 2)]
    fused = FusedProjection(concat_linears(layers), [4, 2, 2])
    slices = [ProjectionSlice(fused, i, 8) for i in range(3)]
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(slices[0](x), layers[0](x))
        assert torch.allclose(slices[1](other), layers[1](other))  # not x: computed again, for `other`
        assert torch.allclose(slices[2](x), layers[2](x))  # x again: computed again
        y = torch.randn(3, 8)
        for i in range(3):
            assert torch.allclose(slices[i](y), layers[i](y))
        assert fused._parts is None  # all three parts of y taken: the fused output is dropped


def test_fusion_refuses_what_it_cannot_fuse():
    model = tiny_llama(seed=0)
    quantize_model(model, "q_proj", CFG)
    with pytest.raises(ValueError, match="different kinds"):
        fuse_projections(model, gate_up=False)
    awq = tiny_llama(seed=0)
    quantize_model(awq, ["gate_proj", "up_proj"], QuantConfig("awq", 32), calibration_inputs=IDS)
    with pytest.raises(ValueError, match="different AWQ input scales"):
        fuse_projections(awq, qkv=False)
    with pytest.raises(ValueError, match="no unfused"):
        fuse_projections(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="in_features"):
        concat_linears([torch.nn.Linear(2, 2), torch.nn.Linear(3, 2)])


@pytest.mark.gpu
def test_a_fused_int4_model_replays_its_graphs_to_the_eager_tokens():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_llama(seed=0).to("cuda", torch.bfloat16)
    quantize_model(model, ALL_LINEARS)
    fuse_projections(model)
    prompt = IDS[0].cuda()
    runs = [generate(model, prompt, DecodeConfig(max_new_tokens=32, kv_cache="static", cuda_graphs=graphs)).tokens
            for graphs in (False, True)]
    assert runs[0] == runs[1]
