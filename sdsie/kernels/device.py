"""Where the package's Triton kernels run: on CUDA, and on a CPU only under Triton's interpreter (TRITON_INTERPRET=1,
how the CI tests run them). Elsewhere callers keep their torch path."""

from __future__ import annotations

import os

import torch

__all__ = ["interpreting", "kernel_runs_on", "programmatic_launch", "set_programmatic_launch", "pdl_on",
           "preload_pairs", "launch_key"]

_PDL = {"on": False, "preload": 0}


def interpreting() -> bool:
    """Triton runs kernels in its interpreter (read at every call: tests set and clear it)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()


def set_programmatic_launch(enabled: bool, preload_pairs: int = 0) -> None:
    """Launch the mma GEMV and the decode attention as programmatic dependents (PDL, sm_90+; INT4 plans made after
    the call): their programs may start while the kernel before ends and wait for it (griddepcontrol.wait) only
    before reading what it wrote; the GEMV asks for its first weights before that wait. Under a CUDA graph the
    launch is a programmatic edge; without a programmatic producer the wait returns at once. Off by default.
    `preload_pairs`: before that wait, each of the GEMV's warps also asks L2 for this many more pairs of 128 codes
    (-1: its whole share of the row block)."""
    _PDL["on"] = bool(enabled)
    _PDL["preload"] = int(preload_pairs)


def launch_key() -> tuple[bool, int]:
    """The launch settings a kernel plan is made for (a plan keyed on them is remade when they change)."""
    return _PDL["on"], _PDL["preload"]


def preload_pairs() -> int:
    """The GEMV's L2 preload before its wait (`set_programmatic_launch`)."""
    return _PDL["preload"]


def programmatic_launch() -> bool:
    """Whether kernels launch as programmatic dependents where they can (`set_programmatic_launch`)."""
    return _PDL["on"]


def pdl_on(device: torch.device) -> bool:
    """Programmatic launch for a kernel on `device`: switched on, a CUDA device of sm_90 or newer, not interpreted."""
    return (_PDL["on"] and device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)
