"""Int4Linear, quantize_model, GatedLinear and gate_model on tiny Llama models (fp32).

On CPU the kernel runs under TRITON_INTERPRET=1 (slow), so shapes are tiny. Tests that take
`kernel_device` run on the GPU when one is present (marked `gpu` by conftest).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import sdsie.kernels
from sdsie.int4_format import Int4Weight, pack_int4
from sdsie.kernels import int4_matmul_reference, kernel_calls
from sdsie.quant.calibrate import QuantConfig, calibrate
from sdsie.quant.gated import GatedLinear, GearState, gate_model
from sdsie.quant.linear import Int4Linear, quantize_model, select_linears

VOCAB = 64


def tiny_llama(seed: int = 0, bias: bool = False, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        mlp_bias=bias,
        attention_bias=bias,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(cfg).to(device).eval()


def _ids(device: torch.device | str = "cpu", seed: int = 1, length: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=gen).to(device)  # [B, S]


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits  # [B, S, V]


def _linear(n: int, k: int, seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def _representable_linear(n: int, k: int, seed: int) -> nn.Linear:
    """A linear whose weights are exactly INT4 (per channel, every row spans codes 0..15)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    codes[:, 0], codes[:, 1] = 0, 15
    scales = 2.0 ** torch.randint(-4, 0, (1, n), generator=gen).float()  # [G=1, N]
    zeros = torch.randint(0, 16, (1, n), generator=gen).float()
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data = Int4Weight(pack_int4(codes), scales, zeros, k, k).dequantize(torch.float32)
    return lin


def _assert_fp32_rounding_close(y: torch.Tensor, exact: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - exact| <= 2 K eps32 (|x| @ |W|.T): the worst-case gap between two fp32 summation orders."""
    k = x.shape[-1]
    bound = 2 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T)
    gap = (y.double() - exact.double()).abs()
    assert (gap <= bound).all(), float((gap - bound).max())


# --- Int4Linear ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "shape"),
    [(QuantConfig(), (3, 40)), (QuantConfig("minmax", 32, True), (2, 3, 72)), (QuantConfig("minmax", 32), (72,))],
)
def test_int4_linear_matches_reference_and_keeps_bias(
    kernel_device: torch.device, cfg: QuantConfig, shape: tuple[int, ...]
) -> None:
    k = shape[-1]
    lin = _linear(24, k, seed=0).to(kernel_device)
    q = Int4Linear.from_linear(lin, cfg)
    assert torch.equal(q.bias, lin.bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    y = q(x)
    assert y.shape == (*shape[:-1], 24) and y.dtype == x.dtype
    expected = int4_matmul_reference(x, q.int4_weight) + lin.bias.double()
    _assert_fp32_rounding_close(y, expected, x, q.effective_weight())


def test_int4_linear_applies_awq_input_scale(kernel_device: torch.device) -> None:
    lin = _linear(16, 64, seed=2).to(kernel_device)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3)).to(kernel_device)
    x[:, [5, 40]] *= 30
    q = Int4Linear.from_linear(lin, QuantConfig("awq", 32), act_samples=x)
    assert q.input_scale is not None
    expected = int4_matmul_reference(x * q.input_scale, q.int4_weight) + lin.bias.double()
    _assert_fp32_rounding_close(q(x), expected, x, q.effective_weight())
    # the layer is x @ W_eff.T with the multiplier folded into the weight, up to fp32 rounding
    _assert_fp32_rounding_close(q(x), x.double() @ q.effective_weight().T + lin.bias.double(), x, q.effective_weight())


def test_int4_linear_forward_launches_the_kernel_once(kernel_device: torch.device) -> None:
    q = Int4Linear.from_linear(_linear(8, 32, seed=0).to(kernel_device))
    before = kernel_calls()
    q(torch.randn(2, 32, device=kernel_device))
    assert kernel_calls() == before + 1


def test_int4_linear_on_representable_weights_is_the_float_layer(kernel_device: torch.device) -> None:
    lin = _representable_linear(16, 40, seed=4).to(kernel_device)
    q = Int4Linear.from_linear(lin)
    assert torch.equal(q.effective_weight(torch.float32), lin.weight)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(5)).to(kernel_device)
    _assert_fp32_rounding_close(q(x), lin(x), x, lin.weight)


def test_int4_linear_state_dict_round_trip_and_dtype_move(kernel_device: torch.device) -> None:
    lin = _linear(8, 64, seed=6).to(kernel_device)
    q = Int4Linear.from_linear(lin, QuantConfig("minmax", 32))
    assert set(q.state_dict()) == {"qweight", "scales", "zeros", "bias"}
    other = Int4Linear.from_linear(_linear(8, 64, seed=7).to(kernel_device), QuantConfig("minmax", 32))
    other.load_state_dict(q.state_dict())
    x = torch.randn(3, 64, device=kernel_device)
    assert torch.equal(other(x), q(x))
    q.to(torch.bfloat16)
    assert q.int4_weight.scales is q.scales and q.scales.dtype == torch.bfloat16
    assert q(x.bfloat16()).dtype == torch.bfloat16


def test_int4_linear_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="expects an nn.Linear"):
        Int4Linear.from_linear(nn.Conv1d(4, 4, 1))
    w = calibrate(torch.randn(8, 32)).weight
    with pytest.raises(ValueError, match=r"bias must have shape \[N\]"):
        Int4Linear(w, bias=torch.zeros(7))
    with pytest.raises(ValueError, match=r"input_scale must have shape \[K\]"):
        Int4Linear(w, input_scale=torch.ones(31))
    with pytest.raises(ValueError, match="x has K=16"):
        Int4Linear(w)(torch.randn(2, 16))


# --- quantize_model -----------------------------------------------------------------------------


def _dequantized_copy(model: nn.Module, quantized: nn.Module) -> nn.Module:
    """`model` with each replaced linear's weight set to the quantized layer's effective weight."""
    ref = copy.deepcopy(model)
    for name, mod in quantized.named_modules():
        if isinstance(mod, Int4Linear):
            ref.get_submodule(name).weight.data = mod.effective_weight(torch.float32)
    return ref


def test_quantize_model_replaces_targets_and_computes_the_dequantized_model(kernel_device: torch.device) -> None:
    model = tiny_llama(bias=True, device=kernel_device)
    quantized = copy.deepcopy(model)
    report = quantize_model(quantized, "mlp.down_proj", QuantConfig("minmax", 32))
    assert report.names == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    for name, mod in quantized.named_modules():
        assert isinstance(mod, Int4Linear) == (name in report.names)
    assert all(rep.weight_sqnr_db > 10 for rep in report.layers)
    assert "model.layers.1.mlp.down_proj" in report.table()
    ids = _ids(kernel_device)
    y_q, y_ref = _logits(quantized, ids), _logits(_dequantized_copy(model, quantized), ids)
    torch.testing.assert_close(y_q, y_ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(y_q, _logits(model, ids))  # the weights really changed


def test_quantize_model_replaces_each_layer_before_calibrating_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """So each original weight can be freed as it goes: the memory held stays near the original model's."""
    import sdsie.quant.linear as linear_module

    model = tiny_llama()
    seen: list[int] = []

    def counting(weight, *args, **kwargs):
        seen.append(sum(isinstance(m, Int4Linear) for m in model.modules()))
        return calibrate(weight, *args, **kwargs)

    monkeypatch.setattr(linear_module, "calibrate", counting)
    report = quantize_model(model, ["q_proj", "down_proj"], QuantConfig("minmax", 32))
    assert seen == list(range(len(report.names))) == [0, 1, 2, 3]


def test_quantize_model_by_layer_index_and_several_patterns() -> None:
    model = tiny_llama()
    report = quantize_model(model, ["mlp.down_proj", "self_attn.o_proj"], layers=[1])
    assert report.names == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.Linear)
    assert isinstance(model.model.layers[1].self_attn.o_proj, Int4Linear)


def test_quantize_model_awq_uses_captured_activations(kernel_device: torch.device) -> None:
    model = tiny_llama(device=kernel_device)
    calib = _ids(kernel_device, length=12)
    report = quantize_model(model, "mlp.down_proj", QuantConfig("awq", 32), calibration_inputs=calib)
    assert all(rep.alpha is not None and rep.output_sqnr_db is not None for rep in report.layers)
    assert torch.isfinite(_logits(model, _ids(kernel_device))).all()


@pytest.mark.parametrize(
    ("targets", "layers", "match"),
    [
        ("mlp.gate", None, "'mlp.gate' matches no nn.Linear"),
        ("mlp", None, "'mlp' matches no nn.Linear"),
        ([], None, "targets must be one or more"),
        ("mlp.down_proj", [2], r"layer indices \[2\] match none"),
        ("lm_head", [0], r"layer indices \[0\] match none"),
        ("mlp.down_proj", [-1], "non-negative ints"),
        ("mlp.down_proj", [], "non-empty list"),
    ],
)
def test_target_selection_rejects_what_matches_nothing(targets, layers, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        select_linears(tiny_llama(), targets, layers)


def test_quantize_model_awq_needs_calibration_inputs() -> None:
    with pytest.raises(ValueError, match="needs calibration_inputs"):
        quantize_model(tiny_llama(), "mlp.down_proj", QuantConfig("awq"))


# --- GatedLinear and gate_model -----------------------------------------------------------------


def test_gate_model_shares_one_gear_state_and_starts_full_precision() -> None:
    model = tiny_llama()
    ids = _ids()
    original = _logits(model, ids)
    state = gate_model(model, "mlp.down_proj", QuantConfig("minmax", 32))
    gated = [mod for mod in model.modules() if isinstance(mod, GatedLinear)]
    assert len(gated) == 2 and all(mod.state is state for mod in gated)
    assert state.report.names == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert not state.int4
    assert torch.equal(_logits(model, ids), original)  # the full gear is the untouched original layer


def test_gears_differ_and_flipping_changes_the_next_forward(kernel_device: torch.device) -> None:
    model = tiny_llama(device=kernel_device)
    ids = _ids(kernel_device)
    quantized = copy.deepcopy(model)
    quantize_model(quantized, "mlp.down_proj", QuantConfig("minmax", 32))
    state = gate_model(model, "mlp.down_proj", QuantConfig("minmax", 32))

    full = _logits(model, ids)
    state.int4 = True
    int4 = _logits(model, ids)
    state.int4 = False
    full_again = _logits(model, ids)

    assert not torch.equal(full, int4)  # weights are not INT4-representable: the gears differ
    assert (full - int4).abs().max() > 1e-4
    assert torch.equal(int4, _logits(quantized, ids))  # the INT4 gear is the quantized model
    assert torch.equal(full_again, full)


def test_int4_gear_calls_the_kernel_and_counts(kernel_device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(device=kernel_device)
    state = gate_model(model, "mlp.down_proj")
    launches: list[tuple[int, ...]] = []
    real = sdsie.kernels.int4_matmul

    def counting(x, w, *args, **kwargs):
        launches.append(tuple(x.shape))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(sdsie.kernels, "int4_matmul", counting)
    ids = _ids(kernel_device)
    _logits(model, ids)
    assert (launches, state.full_calls, state.int4_calls) == ([], 2, 0)

    state.int4 = True
    before = kernel_calls()
    _logits(model, ids)
    _logits(model, ids)
    assert len(launches) == 4 and kernel_calls() == before + 4  # 2 gated layers x 2 forwards
    assert all(shape[-1] == 64 for shape in launches)  # down_proj inputs: intermediate size
    assert (state.full_calls, state.int4_calls) == (2, 4)
    state.reset_counters()
    assert (state.full_calls, state.int4_calls) == (0, 0)


def test_gear_switch_on_representable_weights_changes_nothing_but_the_path(kernel_device: torch.device) -> None:
    lin = _representable_linear(24, 64, seed=8).to(kernel_device)
    state = GearState()
    gated = GatedLinear(lin, Int4Linear.from_linear(lin), state)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(kernel_device)
    full = gated(x)
    state.int4 = True
    _assert_fp32_rounding_close(gated(x), full, x, lin.weight)
    assert (state.full_calls, state.int4_calls) == (1, 1)


def test_gated_linear_and_gate_model_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="full layer is 8x32 but the INT4 layer is 8x64"):
        GatedLinear(_linear(8, 32, seed=0), Int4Linear.from_linear(_linear(8, 64, seed=0)), GearState())
    model = tiny_llama()
    gate_model(model, "mlp.down_proj", layers=[0])
    with pytest.raises(ValueError, match="one GearState per model"):
        gate_model(model, "self_attn.o_proj")
