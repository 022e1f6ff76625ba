"""The one-pass argmax and entropy kernel (`sdsie.kernels.logit_stats`) against torch's argmax and
`sdsie.entropy.entropy`, on the GPU or the CPU under TRITON_INTERPRET=1, and the engine's use of it.

The argmax must be torch's exactly (first index of the max, first NaN where there is one). The entropy differs from
the reference only by fp32 summation order: both sum the same exp(x - max) terms, so the tolerance is a few fp32 ulps
of the row's largest term, |log2 s| + |t / s| (here 1e-5 bits at V <= 5,000); a chunk lost or counted twice moves it
by far more (>= 1e-3 bits in these rows).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdsie.decoding.engine as engine
from sdsie.decoding import DecodeConfig, generate
from sdsie.entropy import argmax_entropy, entropy
from sdsie.kernels.logit_stats import logit_stats
from sdsie.models import perturbed_copy, tiny_llama

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int, scale: float = 4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)


def _check(x: torch.Tensor, block_v: int) -> None:
    tokens, bits = logit_stats(x, block_v=block_v)
    ref_tokens, ref_bits = x.argmax(dim=-1), entropy(x)
    assert tokens.dtype == torch.int64 and bits.dtype == torch.float32
    assert tokens.shape == ref_tokens.shape and bits.shape == ref_bits.shape
    assert torch.equal(tokens.cpu(), ref_tokens.cpu())
    torch.testing.assert_close(bits.cpu(), ref_bits.cpu(), rtol=1e-5, atol=1e-5, equal_nan=True)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 5000), dtype=st.sampled_from(DTYPES),
       block_v=st.sampled_from([16, 256, 1024, 4096]), seed=st.integers(0, 2**16), masked=st.booleans(),
       tie=st.booleans())
def test_argmax_and_entropy_match_torch(kernel_device, rows, vocab, dtype, block_v, seed, masked, tie):
    x = _logits(rows, vocab, dtype, seed)
    if masked:  # masked vocabulary: -inf entries have probability 0
        x[:, ::3] = float("-inf")
        x[:, -1] = 0.0  # one finite entry per row at least
    if tie and vocab > 1:  # the max twice: the first index wins, as in torch
        x[:, 0] = x.max(dim=-1).values
    _check(x.to(kernel_device), block_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_rows_follow_torch(kernel_device, dtype):
    vocab = 300
    x = _logits(5, vocab, dtype, seed=1)
    x[0] = float("-inf")  # no distribution: NaN entropy, argmax 0
    x[1, 37], x[1, 250] = float("nan"), float("nan")  # torch's argmax: the first NaN; entropy NaN
    x[2] = 0.0  # uniform: log2(V) bits, argmax 0
    x[3] = float("-inf")
    x[3, 299] = 5.0  # one-hot at the last index, in the last chunk: exactly 0 bits
    tokens, bits = logit_stats(x.to(kernel_device), block_v=64)
    assert tokens.tolist()[:4] == [0, 37, 0, 299]
    assert torch.isnan(bits[0]) and torch.isnan(bits[1])
    assert bits[2].item() == pytest.approx(torch.log2(torch.tensor(float(vocab))).item(), abs=1e-5)
    assert bits[3].item() == 0.0
    _check(x.to(kernel_device), block_v=64)


def test_leading_dims_and_strided_rows(kernel_device):
    x = _logits(6, 2000, torch.bfloat16, seed=2).reshape(2, 3, 2000)
    _check(x.to(kernel_device), block_v=512)
    wide = _logits(4, 3000, torch.float32, seed=3).to(kernel_device)
    _check(wide[:, :2500], block_v=512)  # rows with a stride longer than V
    _check(wide[::2], block_v=1024)  # every other row


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(2, 0), "non-empty last"),
    (torch.zeros(()), "non-empty last"),
    (torch.zeros(2, 8, dtype=torch.float64), "must be one of"),
    (torch.zeros(2, 8, dtype=torch.int32), "must be one of"),
])
def test_bad_logits_are_refused(kernel_device, bad, match):
    with pytest.raises(ValueError, match=match):
        logit_stats(bad.to(kernel_device))


def test_bad_block_is_refused(kernel_device):
    with pytest.raises(ValueError, match="power of two"):
        logit_stats(torch.zeros(1, 8, device=kernel_device), block_v=100)


def test_off_cuda_argmax_entropy_is_torchs():
    x = _logits(3, 500, torch.float32, seed=4)
    tokens, bits = argmax_entropy(x)
    assert torch.equal(tokens, x.argmax(-1)) and torch.equal(bits, entropy(x))


def test_the_engine_takes_argmax_entropys_answer(kernel_device, monkeypatch):
    """Greedy cycles (plain and speculative) take their tokens and entropies from argmax_entropy: with the kernel put
    in its place (the interpreter on a CPU) a run gives the same tokens and entropies as with torch, and with a
    stand-in whose argmax is off by one the run follows the stand-in."""
    target = tiny_llama(vocab_size=64, seed=0)
    scout = perturbed_copy(target, noise=0.02, seed=1).to(kernel_device)
    target = target.to(kernel_device)
    config = DecodeConfig(max_new_tokens=12, k_draft=3)
    runs = {}
    for name, fn in (("torch", argmax_entropy), ("kernel", lambda x: logit_stats(x.float()))):
        monkeypatch.setattr(engine, "argmax_entropy", fn)
        runs[name] = [generate(target, [5, 9, 3], config, scout=s) for s in (None, scout)]
    for torch_run, kernel_run in zip(runs["torch"], runs["kernel"], strict=True):
        assert kernel_run.tokens == torch_run.tokens
        assert kernel_run.prefill_entropy == pytest.approx(torch_run.prefill_entropy, abs=1e-5)
        assert [c.entropy for c in kernel_run.cycles] == pytest.approx([c.entropy for c in torch_run.cycles],
                                                                       abs=1e-5)
    shifted = lambda x: ((x.argmax(-1) + 1) % x.shape[-1], entropy(x))  # noqa: E731
    monkeypatch.setattr(engine, "argmax_entropy", shifted)
    first = generate(target, [5, 9, 3], DecodeConfig(max_new_tokens=1)).tokens[0]
    with torch.inference_mode():
        expected = (int(target(torch.tensor([[5, 9, 3]], device=kernel_device)).logits[0, -1].argmax()) + 1) % 64
    assert first == expected
