"""Shared test configuration.

- Without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1), set here before
  any kernel module is imported. With CUDA they compile for the GPU.
- Hypothesis profiles: `ci` (bounded, the default without a GPU) and `thorough` (the default
  with one). Override with SDSIE_HYPOTHESIS_PROFILE.
- Tests that take the `kernel_device` fixture run on the GPU when one is present and are then
  marked `gpu` (so `pytest -m gpu` selects them): the same test functions, not a copied suite.
- The local INT4 tuned cache is off (SDSIE_INT4_CACHE=off) unless the environment names one.
- The run header names the CPU (`cpu_state`): fp32 results differ between CPUs in their low bits.
- Tests marked `cpu_kernels` run a CPU model through Triton kernels, which a CPU runs only under the
  interpreter: on a GPU host (no interpreter) they are skipped with that reason; the GPU suite runs the kernels.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The INT4 configuration choice reads a local tuned cache first (`sdsie tune-int4`); the suite judges the shipped
# choice, so it reads none unless a run names one.
os.environ.setdefault("SDSIE_INT4_CACHE", "off")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("SDSIE_HYPOTHESIS_PROFILE", "thorough" if HAS_CUDA else "ci"))

NO_CUDA_REASON = "needs a CUDA GPU: torch.cuda.is_available() is False on this machine"
NO_INTERPRETER_REASON = ("a CPU model through Triton kernels, which run on a CPU only under TRITON_INTERPRET=1 (set "
                         "for the CPU suite); with CUDA the GPU tests run the kernels")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HAS_CUDA and "kernel_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not HAS_CUDA and "kernel_device" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=NO_CUDA_REASON))
        if "cpu_kernels" in item.keywords and os.environ.get("TRITON_INTERPRET", "0") != "1":
            item.add_marker(pytest.mark.skip(reason=NO_INTERPRETER_REASON))


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where Triton kernels run: the GPU if present, else the CPU under TRITON_INTERPRET=1."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_report_header(config: pytest.Config) -> str:
    """The CPU at the head of every run: fp32 results of the CPU suites differ between CPUs in their low bits."""
    from sdsie.telemetry.env import cpu_state

    return "cpu: " + ", ".join(f"{k}={v}" for k, v in cpu_state().items())
