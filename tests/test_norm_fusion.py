"""The decoder's RMS norms and residual adds moved into the INT4 projections (`sdsie.quant.norms`).

On the CPU: fusing keeps the model's function up to rounding and `unfuse_norms` restores the modules; each
precondition is refused by name; the composed epilogue (every path but the mma kernel's) is the norm, the residual
and the gained copy in torch. On a GPU (`gpu`): a model's one-token and prompt forwards through the fused
launches against the same model unfused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from reproductions.decode_e2e import LINEARS, build_model
from sdsie.kernels import compose_epilogue, int4_matmul, int4_matmul_reference, norm_stream_width, row_squares
from sdsie.quant import (
    Int4Linear,
    QuantConfig,
    fuse_norms,
    fuse_projections,
    quantize_for_decode,
    quantize_model,
    unfuse_norms,
)
from sdsie.quant.norms import DeferredProjection, FoldedNorm, NormFusedLayer
from tests.test_int4_kernel import make_weight

FAMILIES = ("llama3.1-8b", "qwen2.5-7b")


def tiny(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The e2e suite's tiny configuration, with random norm gains (so folding them matters)."""
    model = build_model(name, True, torch.device(device), dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.5)
    return model


def quantized(model: nn.Module) -> nn.Module:
    quantize_model(model, LINEARS, QuantConfig(group_size=32))
    fuse_projections(model)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_norms_give_the_unfused_logits_and_unfusing_restores_the_modules(name):
    """Prompt and one-token forwards of the INT4 model (the CPU composes each epilogue) match the model with its
    norms as modules, within rounding; `unfuse_norms` gives back the same module tree and bits."""
    model = quantized(tiny(name))
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    plain = model(ids).logits
    tree = [(n, type(m)) for n, m in model.named_modules()]
    report = fuse_norms(model)
    assert len(report.layers) == model.config.num_hidden_layers
    assert all(isinstance(layer, NormFusedLayer) for layer in model.model.layers)
    assert isinstance(model.model.norm, FoldedNorm) and model.lm_head.norm_eps == model.config.rms_norm_eps
    assert isinstance(model.model.layers[0].layer.self_attn.o_proj, DeferredProjection)
    fused = model(ids).logits
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert unfuse_norms(model) == model.config.num_hidden_layers
    assert [(n, type(m)) for n, m in model.named_modules()] == tree
    assert torch.equal(model(ids).logits, plain)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_gated_model_fuses_its_norms_in_both_gears(name):
    """GatedLinear layers (gate_model, then fuse_projections) take the fused norms too: each gear's one-token and
    prompt logits match the same gear unfused within rounding (the full gear composes the norm, the bias, the
    residual and the gained copy in torch), and unfusing restores the modules."""
    from sdsie.quant import gate_model

    model = tiny(name)
    state = gate_model(model, LINEARS, QuantConfig(group_size=32))
    fuse_projections(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    plain = {}
    for gear in (False, True):
        state.int4 = gear
        plain[gear] = model(ids).logits
    tree = [(n, type(m)) for n, m in model.named_modules()]
    fuse_norms(model)
    assert model.lm_head.norm_eps == model.lm_head.quantized.norm_eps == model.config.rms_norm_eps
    for gear in (False, True):
        state.int4 = gear
        torch.testing.assert_close(model(ids).logits, plain[gear], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(ids[:, :1]).logits, plain[gear][:, :1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain[False], plain[True])  # the gears differ: each was compared with itself
    unfuse_norms(model)
    assert [(n, type(m)) for n, m in model.named_modules()] == tree and model.lm_head.norm_eps is None


def test_quantize_for_decode_is_the_recipe_in_one_call():
    """quantize_for_decode = quantize_model over DECODE_LINEARS, fuse_projections, fuse_norms (or not), bit for bit."""
    base = tiny("qwen2.5-7b")
    model, unnormed, recipe = (copy.deepcopy(base) for _ in range(3))
    fuse_norms(quantized(recipe))
    done = quantize_for_decode(model, QuantConfig(group_size=32))
    assert done.describe() == "8 linears INT4, 1 q/k/v and 1 gate/up fused, norms fused in 1 layer"
    ids = torch.randint(3, base.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model(ids).logits, recipe(ids).logits)
    assert quantize_for_decode(unnormed, QuantConfig(group_size=32), norms=False).norms is None
    assert not any(isinstance(m, NormFusedLayer) for m in unnormed.modules())
    with pytest.raises(ValueError, match="fused norms need a min-max scheme"):
        quantize_for_decode(copy.deepcopy(base), QuantConfig("awq", 32))


def test_each_precondition_is_refused_by_name():
    model = tiny("llama3.1-8b")
    quantize_model(model, LINEARS, QuantConfig(group_size=32))
    with pytest.raises(ValueError, match="MLP fused"):
        fuse_norms(model)  # fuse_projections not run
    model = tiny("llama3.1-8b")
    fuse_projections(model)  # bf16 projections, fused
    with pytest.raises(ValueError, match="Int4Linear"):
        fuse_norms(model)
    model = quantized(tiny("llama3.1-8b"))
    model.model.layers[0].self_attn.qkv_proj.linear.register_buffer("input_scale", torch.ones(64))
    with pytest.raises(ValueError, match="AWQ"):
        fuse_norms(model)
    model = quantized(tiny("llama3.1-8b"))
    fuse_norms(model)
    with pytest.raises(ValueError, match="fused already"):
        fuse_norms(model)
    with pytest.raises(ValueError, match="no pre-norm decoder layer"):
        fuse_norms(nn.Sequential(nn.Linear(4, 4)))


class OnePlusNorm(nn.Module):
    """Gemma's RMS norm: x * rsqrt(mean(x^2) + eps) * (1 + weight)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def test_a_norm_of_another_formula_is_refused():
    model = quantized(tiny("llama3.1-8b"))
    model.model.layers[0].input_layernorm = OnePlusNorm(model.config.hidden_size)
    with pytest.raises(ValueError, match="does not compute weight"):
        fuse_norms(model)


def test_a_float16_model_is_refused_before_anything_changes():
    """The stream holds the partial sums of squares in the model's dtype, which float16's range cannot: refused by
    name, the model untouched."""
    model = quantized(tiny("llama3.1-8b")).half()
    tree = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError, match="float16's range"):
        fuse_norms(model)
    assert [(n, type(m)) for n, m in model.named_modules()] == tree


def test_the_composed_epilogue_is_the_norm_the_residual_and_the_gained_copy():
    """Off the mma kernel: a layer with norm_eps reads the stream [h, h * g, row_squares(h)] and gives
    rs * ((h * g) @ W.T) (+ residual), rs from the stream's partial sums of squares; an output gain makes the next
    stream: the result, its gained copy and its partial sums of squares."""
    gen = torch.Generator().manual_seed(4)
    w = make_weight(48, 256, 128, False, 0.02, torch.device("cpu"), gen)
    h = torch.randn(3, 256, generator=gen) * 3
    g = torch.rand(256, generator=gen) + 0.5
    gain = torch.rand(48, generator=gen)
    r = torch.randn(3, 48, generator=gen)
    stream = compose_epilogue(h, h, out_gain=g)
    assert stream.shape == (3, norm_stream_width(256)) == (3, 2 * 256 + 32)
    assert torch.equal(stream[:, :256], h) and torch.equal(stream[:, 256:512], h * g)
    layer = Int4Linear(w)
    layer.norm_eps = 1e-5
    rs = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    want = int4_matmul_reference(h * g, w).double() * rs + r.double()
    y = layer(stream, residual=r, out_gain=gain)
    assert y.shape == (3, norm_stream_width(48)) == (3, 102)
    torch.testing.assert_close(y[:, :48].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[:, 48:96], y[:, :48] * gain)
    assert torch.equal(y[:, 96:], row_squares(y[:, :48]))
    # the norm is read from the squares: scaled by 4, they halve the product
    quartered = layer(torch.cat([stream[:, :512], 4 * stream[:, 512:]], -1))
    torch.testing.assert_close(quartered.double(), (want - r.double()) / 2, rtol=1e-4, atol=1e-4)
    assert torch.equal(int4_matmul(h * g, w, norm_eps=1e-5, norm_source=h, residual=r),
                       compose_epilogue(int4_matmul(h * g, w), h * g, 1e-5, r, h))
    b = torch.randn(48, generator=gen)  # a layer's bias comes after the norm, before the residual
    biased = Int4Linear(w, bias=b)
    biased.norm_eps = 1e-5
    torch.testing.assert_close(biased(stream, residual=r).double(), want + b.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        int4_matmul(h, w, residual=r[:, :40])
    with pytest.raises(ValueError, match="norm_squares must be"):
        int4_matmul(h, w, norm_eps=1e-5, norm_squares=stream[:, 512:-2])
    with pytest.raises(ValueError, match="out is not taken"):
        int4_matmul(h, w, out=torch.empty(3, 48), norm_eps=1e-5)
    with pytest.raises(ValueError, match="give norm_eps"):
        int4_matmul(h, w, norm_source=h)
    with pytest.raises(ValueError, match="give norm_eps"):
        int4_matmul(h, w, norm_squares=stream[:, 512:])
    for eps in (-1e-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="norm_eps must be a finite number >= 0"):
            int4_matmul(h, w, norm_eps=eps, norm_source=h)
    with pytest.raises(ValueError, match=r"reads the stream \[h, h \* gain, h's partial sums of squares\]"):
        layer(torch.cat([h, h * g], -1))
    with pytest.raises(ValueError, match="float16's range"):
        int4_matmul(h.half(), w, out_gain=gain.half())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_partial_sums_of_squares_are_pairs_that_sum_to_each_block(dtype):
    """row_squares: per 16 values (the last block padded with zeros), a (rounded, remainder) pair of the stream's
    dtype whose sum is the block's fp32 sum of squares to twice the dtype's precision (bf16: 2^-16 of it), so a norm
    that adds up a row's pairs gets mean(h^2) as from h itself."""
    gen = torch.Generator().manual_seed(6)
    h = (torch.randn(4, 200, generator=gen) * torch.logspace(-2, 2, 200)).to(dtype)  # K = 200: a padded block
    sq = row_squares(h)
    assert sq.shape == (4, 2 * 13) and sq.dtype == dtype
    hf = torch.nn.functional.pad(h.double(), (0, 8))
    blocks = hf.square().view(4, 13, 16).sum(-1)  # [4, 13]
    pairs = sq.double().view(4, 13, 2)
    rel = 2.0**-16 if dtype == torch.bfloat16 else 2.0**-19  # fp32: its own sum of 16 values
    assert ((pairs.sum(-1) - blocks).abs() <= rel * blocks + 1e-30).all()
    assert (pairs[..., 1].abs() <= 2.0**-7 * pairs[..., 0].abs()).all()  # the remainder is below the rounding's ulp
    if dtype == torch.bfloat16:
        assert (pairs[..., 1] != 0).any()  # bf16 loses bits the remainder keeps
    with pytest.raises(ValueError, match="float16's range"):
        row_squares(h.half())


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="the fused launches are the mma kernel's, which needs an sm_90+ GPU")
@pytest.mark.parametrize("name", FAMILIES)
def test_on_the_gpu_fused_norms_give_the_unfused_logits(name):
    """bf16 on the GPU: one-token and 5-token forwards (the fused mma launches) and a 40-token prompt (composed)
    match the same weights with the norms as modules, within bf16's rounding of the logits."""
    model = quantized(tiny(name, "cuda", torch.bfloat16))
    gen = torch.Generator().manual_seed(5)
    for length in (1, 5, 40):
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=gen).cuda()
        plain = model(ids).logits.float()
        fuse_norms(model)
        fused = model(ids).logits.float()
        unfuse_norms(model)
        scale = plain.abs().max().item()
        assert (fused - plain).abs().max().item() <= 0.05 * scale, (length, (fused - plain).abs().max().item(), scale)
