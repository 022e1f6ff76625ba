"""Where the package's Triton kernels run: on CUDA, and on a CPU only under Triton's interpreter (TRITON_INTERPRET=1,
how the CI tests run them). Elsewhere callers keep their torch path."""

from __future__ import annotations

import os

import torch

__all__ = ["interpreting", "kernel_runs_on"]


def interpreting() -> bool:
    """Triton runs kernels in its interpreter (read at every call: tests set and clear it)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()
