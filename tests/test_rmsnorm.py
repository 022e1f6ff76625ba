"""The fused RMSNorm kernel against HF's formula (on the GPU, or the CPU under TRITON_INTERPRET=1), and the swap
that puts it into a model.

Tolerance: the kernel takes HF's steps in HF's dtypes, and only the mean of squares is summed in another order; that
can move x * rsqrt(.) across a rounding boundary of x's dtype, so an output may differ by an ulp of the input and one
of the output dtype: |y - ref| <= 2 * (eps(x) + eps(y)) * |ref| + tiny.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sdsie.kernels.rmsnorm import FusedRMSNorm, fuse_rmsnorm, rms_norm, rms_norm_reference
from sdsie.models import tiny_llama

EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", ["same", torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 64), (17, 130), (1, 4, 512)])
def test_rms_norm_matches_hf_formula(kernel_device, dtype, w_dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(kernel_device)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype if w_dtype == "same" else w_dtype)
    w = w.to(kernel_device)
    y, ref = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    bound = 2 * (EPS[dtype] + EPS[ref.dtype]) * ref.double().abs() + 1e-30
    assert ((y.double() - ref.double()).abs() <= bound).all()


def test_rms_norm_takes_strided_rows_and_refuses_a_mismatched_weight(kernel_device):
    x = torch.randn(6, 16, device=kernel_device)[:, :8]  # rows of 8 at a stride of 16
    w = torch.ones(8, device=kernel_device)
    assert torch.allclose(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm(x, torch.ones(7, device=kernel_device), 1e-6)


def test_fuse_rmsnorm_swaps_every_norm_for_one_that_computes_what_it_replaced(kernel_device):
    """Every RMSNorm (two a layer, the final one) becomes a FusedRMSNorm over the same weight Parameter, and each, fed
    the input its original saw in a forward of the model, gives the original's output within the kernel's bound
    (above); a second call finds nothing left to swap; a model without norms is refused."""
    model = tiny_llama(vocab_size=64, seed=0).to(kernel_device)
    fused = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert fuse_rmsnorm(fused) == 2 * layers + 1
    swapped = {name: m for name, m in fused.named_modules() if isinstance(m, FusedRMSNorm)}
    originals = {name: m for name, m in model.named_modules() if name in swapped}
    assert len(swapped) == len(originals) == 2 * layers + 1 and fused.model.norm.weight is swapped["model.norm"].weight
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, (args[0], out)))
             for name, m in originals.items()]
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 17, 5, 42, 8, 11]], device=kernel_device))
        for h in hooks:
            h.remove()
        assert set(seen) == set(swapped)
        for name, (x, want) in seen.items():
            got = swapped[name](x)
            bound = 2 * (EPS[x.dtype] + EPS[want.dtype]) * want.double().abs() + 1e-30
            assert got.dtype == want.dtype and ((got.double() - want.double()).abs() <= bound).all(), name
    assert fuse_rmsnorm(fused) == 0
    with pytest.raises(ValueError, match="no RMSNorm"):
        fuse_rmsnorm(torch.nn.Linear(4, 4))


def test_a_tree_run_with_a_fused_scout_is_lossless():
    """The fused scout drafts (its norms on the Triton interpreter here); the target's tokens are plain decoding's."""
    from sdsie.decoding import DecodeConfig, generate
    from sdsie.models import perturbed_copy

    target = tiny_llama(vocab_size=64, seed=0)
    scout = perturbed_copy(target, noise=0.02, seed=1)
    fuse_rmsnorm(scout)
    prompt = [3, 17, 5, 42, 8, 11]
    plain = generate(target, prompt, DecodeConfig(max_new_tokens=24)).tokens
    r = generate(target, prompt, DecodeConfig(max_new_tokens=24, tree_widths=(3, 2), kv_cache="static"), scout=scout)
    assert r.tokens == plain and r.stats.accepted > 0
