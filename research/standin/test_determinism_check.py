"""The stand-in's determinism switch and its check, on CPU (the GPU run is what the check is for)."""

from __future__ import annotations

import pytest
import torch

import sdsie.standin as S
from research.standin.determinism_check import check, shortened


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
