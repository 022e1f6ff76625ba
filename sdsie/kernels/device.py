"""Where the package's Triton kernels run: on CUDA, and on a CPU only under Triton's interpreter (TRITON_INTERPRET=1,
how the CI tests run them); elsewhere callers keep their torch path. And how they launch there: as programmatic
dependents (PDL) on sm_90+."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["DEFAULT_SHARED_MEMORY", "DEFAULT_SMS", "grid_dependency", "interpreting", "kernel_runs_on",
           "programmatic_launch", "set_programmatic_launch", "pdl_on", "shared_memory", "sm_count"]

# On by default: Llama-3.1-8B's INT4 decode on an H200 runs 537.6 tok/s with it and 494.8 without (records 296e3593,
# 0a719e2c), with every GEMV output bit for bit the same (docs/kernel-log.md, 2026-12-04 20:00)
_PDL = {"on": True}


def interpreting() -> bool:
    """Triton runs kernels in its interpreter (read at every call: tests set and clear it)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()


# An H200's SM count: what the kernels' launch rules assume where no CUDA device gives one (the interpreter), so CPU
# tests take the same paths as the GPU the rules were fitted on
DEFAULT_SMS = 132


def sm_count(device: torch.device) -> int:
    """The SMs the launch rules plan for on `device`: the CUDA device's, else DEFAULT_SMS."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


# An H100's or H200's shared memory a program may ask for (opt-in, bytes): what the launch rules assume where no CUDA
# device gives one
DEFAULT_SHARED_MEMORY = 232448


def shared_memory(device: torch.device) -> int:
    """The shared memory (bytes) one program may use on `device` (Triton's own limit for a launch), else
    DEFAULT_SHARED_MEMORY."""
    if device.type == "cuda":
        return _shared_memory(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_SHARED_MEMORY


@functools.cache
def _shared_memory(index: int) -> int:
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def set_programmatic_launch(enabled: bool) -> None:
    """Launch the INT4 kernels (mma GEMV, Triton GEMV, planes and bytes GEMMs) and the decode attention as
    programmatic dependents (PDL, sm_90+; on by default; INT4 plans made after the call follow it). Their programs
    may start while the kernel before them ends, and wait for it (griddepcontrol.wait) only before reading what it
    wrote; the GEMVs ask for their first weights before that wait (the Triton GEMV where it prefetches into
    registers), and each lets the kernel after it start once all its programs are running. Under a CUDA graph the launch
    is a programmatic edge; without a programmatic producer the wait returns at once.

    Kernel profiles change meaning with it: a kernel's time includes its wait for the one before, so per-kernel
    times overlap and sum to more than the wall time."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_programmatic_launch takes True or False, got {enabled!r}")
    _PDL["on"] = enabled


def programmatic_launch() -> bool:
    """Whether kernels launch as programmatic dependents where they can (`set_programmatic_launch`)."""
    return _PDL["on"]


def pdl_on(device: torch.device) -> bool:
    """Programmatic launch for a kernel on `device`: switched on, a CUDA device of sm_90 or newer, not interpreted."""
    return _PDL["on"] and device.type == "cuda" and not interpreting() and _sm90(
        device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm90(index: int) -> bool:
    """sm_90 or newer (memoized: asked on every attention launch)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """In a Triton kernel launched as a programmatic dependent (`pdl_on`): wait until the kernel before has finished
    and its writes are visible (griddepcontrol.wait; at once without a programmatic producer), then let the kernel
    after launch (launch_dependents), which waits in turn before touching memory. Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
