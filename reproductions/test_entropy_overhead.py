"""Entropy at vocabulary 128256 with and without one host sync per call (issue: foundation)."""

from __future__ import annotations

import pytest
import torch

from reproductions.entropy_overhead import CLAIM_IDS, VOCAB, measure
from sdsie.entropy import entropy

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def logits(request) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, VOCAB, generator=gen) * 4).to(torch.bfloat16).to(request.param)


@pytest.mark.benchmark
def test_entropy_no_sync(benchmark, logits):
    h = benchmark(entropy, logits)
    assert h.device == logits.device and h.shape == (1,)


@pytest.mark.benchmark
def test_entropy_with_item_sync(benchmark, logits):
    value = benchmark(lambda: entropy(logits).item())
    assert 0.0 < value < 17.0  # log2(128256) = 16.97 bits is the maximum


@pytest.mark.gpu
@pytest.mark.benchmark
def test_entropy_sync_overhead_record():
    """The GPU reproduction: interleaved trials, raw samples, one run record."""
    from sdsie.telemetry.records import RunRecord, capture_environment, write_record

    result = measure(torch.device("cuda"))
    rec = RunRecord(
        claim_ids=CLAIM_IDS, suite="entropy_overhead", config=result["config"], samples=result["samples"],
        metrics=result["metrics"], environment=capture_environment(),
        conditions={"model": "none (random logits, vocab 128256)", "hardware": torch.cuda.get_device_name(),
                    "trials": result["config"]["trials"]},
    )
    path = write_record(rec, "telemetry")
    print(path, result["metrics"])
    assert result["metrics"]["sync_us"] > 0 and result["metrics"]["no_sync_us"] > 0
