"""The stand-in's determinism switch and its check, on CPU (the GPU run is what the check is for)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import sdsie.standin as S
from reproductions.standin.determinism_check import check, shortened


def test_deterministic_mode_is_strict_inside_and_restored_after(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with S._deterministic(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn_only keeps atomic attention
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() == before
    with S._deterministic(False):
        assert torch.are_deterministic_algorithms_enabled() == before


def test_the_recipe_setting_decides_the_mode_training_runs_in(monkeypatch) -> None:
    """train_reproducibly (what builds call) trains under deterministic kernels exactly when the recipe says so."""
    seen = []
    monkeypatch.setattr(S, "train_models", lambda *a: seen.append(torch.are_deterministic_algorithms_enabled()))
    before = torch.are_deterministic_algorithms_enabled()
    for det in (True, False):
        cfg = shortened(S.PRESETS["cpu"], 2, 2, deterministic=det)
        S.train_reproducibly(cfg, None, torch.device("cpu"))
    assert seen == [True, before] and torch.are_deterministic_algorithms_enabled() == before


def test_gather_nll_equals_nll_loss_with_its_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 7, generator=gen, requires_grad=True)
    y = torch.randint(0, 7, (12,), generator=gen)
    ref = F.nll_loss(F.log_softmax(logits, -1), y)
    (g_ref,) = torch.autograd.grad(ref, logits)
    with S._deterministic(True):
        got = S._nll(F.log_softmax(logits, -1), y)
        (g_got,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(g_got, g_ref)


def test_gpu_preset_is_deterministic_and_shortened_keeps_the_recipe_valid() -> None:
    gpu = S.PRESETS["gpu"]
    assert gpu.train.deterministic
    short = shortened(gpu, 3, 2, deterministic=False)
    assert (short.train.steps, short.scout_phase.steps) == (3, 2)
    assert short.train.warmup_steps < 3 and short.scout_phase.warmup_steps < 2
    assert not short.train.deterministic and (short.target, short.scout) == (gpu.target, gpu.scout)


@pytest.mark.slow
def test_check_reports_identical_cpu_runs() -> None:
    result = check("cpu", target_steps=2, scout_steps=2, both_modes=False, device=torch.device("cpu"))
    assert result["data"]["identical"] and result["repeats"]
    (mode,) = result["modes"].values()
    first, second = mode["runs"]
    assert first["target_sha256"] == second["target_sha256"] and len(first["target_sha256"]) == 64
