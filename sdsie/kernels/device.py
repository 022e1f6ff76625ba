"""Where the package's Triton kernels run: on CUDA, and on a CPU only under Triton's interpreter (TRITON_INTERPRET=1,
how the CI tests run them). Elsewhere callers keep their torch path."""

from __future__ import annotations

import os

import torch

__all__ = ["interpreting", "kernel_runs_on", "programmatic_launch", "set_programmatic_launch", "pdl_on"]

_PDL = {"on": False}


def interpreting() -> bool:
    """Triton runs kernels in its interpreter (read at every call: tests set and clear it)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()


def set_programmatic_launch(enabled: bool) -> None:
    """Launch the mma GEMV and the decode attention as programmatic dependents (PDL, sm_90+; INT4 plans made after
    the call): their programs may start while the kernel before ends and wait for it (griddepcontrol.wait) only
    before reading what it wrote; the GEMV asks for its first weights before that wait. Under a CUDA graph the
    launch is a programmatic edge; without a programmatic producer the wait returns at once. Off by default."""
    _PDL["on"] = bool(enabled)


def programmatic_launch() -> bool:
    """Whether kernels launch as programmatic dependents where they can (`set_programmatic_launch`)."""
    return _PDL["on"]


def pdl_on(device: torch.device) -> bool:
    """Programmatic launch for a kernel on `device`: switched on, a CUDA device of sm_90 or newer, not interpreted."""
    return (_PDL["on"] and device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)
