"""Host time of `int4_matmul`'s launch path per call, on any machine: the compiled kernel is a stub, so what is
timed is the Python in front of Triton's launcher (checks, launch-plan lookup, argument packing, y's allocation).

    python -m reproductions.kernels.host_overhead [--baseline OTHER_int4_gemm.py] [--out OUT.json]

At batch 1 this time is latency whenever the host, not the GPU, is the slower side (do_bench counts it when it
exceeds the cache flush in front of each call: docs/kernel-log.md). With --baseline, another version
of sdsie/kernels/int4_gemm.py (`git show REV:sdsie/kernels/int4_gemm.py`) is timed beside this tree's, alternating.
The launcher's own C code and the driver call are not included; on the GPU the kernel suite's `host_us` holds the
whole enqueue time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types
from pathlib import Path

import torch
import triton

from sdsie.kernels import Int4KernelConfig
from sdsie.kernels import int4_gemm as this_version
from sdsie.telemetry.env import cpu_state
from sdsie.telemetry.records import write_raw


class _StubCompiled:
    """What `int4_matmul` keeps after a first launch on a GPU, minus the GPU: `run` accepts the arguments."""

    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        return None


class _StubKernel:
    """Stands in for one of a kernel module's @triton.jit kernels: launching it returns a `_StubCompiled`, so the
    module's own first-launch path builds and keeps its launch plan exactly as on a GPU, and every later call
    takes its compiled fast path up to the launcher."""

    def __init__(self, kernel):
        self.fn = kernel.fn  # the module reads the kernel's parameters (constexpr names) from it

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _StubCompiled()


def stub_kernels(mod) -> None:
    """Replace `mod`'s GEMV and GEMM kernels with stubs (mod: a version of sdsie/kernels/int4_gemm.py)."""
    for name in ("_int4_gemv_kernel", "_int4_gemm_kernel"):
        setattr(mod, name, _StubKernel(getattr(mod, name)))


def per_call_us(fn, calls: int = 20000, reps: int = 7) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="another version of sdsie/kernels/int4_gemm.py to time beside")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    from reproductions.kernels.ab_bench import load_baseline
    from reproductions.kernels.int4_bench import random_int4

    versions = {"this": this_version}
    if a.baseline:
        versions["base"] = load_baseline(a.baseline)
    # the fast path asks the active driver for the current stream: a stand-in where no GPU driver is active
    triton.runtime.driver._active = types.SimpleNamespace(get_current_stream=lambda index: 0)
    gen = torch.Generator().manual_seed(0)
    cfg = Int4KernelConfig(1, 64, 256, split_k=8)  # a split-K GEMV, as the small Llama shapes get on the H200
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16)
    calls = {}
    for name, mod in versions.items():
        w = random_int4(1024, 4096, 128, "cpu", gen)
        mod_cfg = mod.Int4KernelConfig(**vars(cfg))  # each version's own config class
        stub_kernels(mod)
        calls[name] = (lambda mod=mod, w=w, c=mod_cfg: mod.int4_matmul(x, w, config=c))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(3):  # alternate the versions
        for name, fn in calls.items():
            samples[name] += per_call_us(fn)
    result = {"host": cpu_state(), "python": platform.python_version(),
              "torch": torch.__version__, "config": vars(cfg), "samples_us": samples,
              "median_us": {k: statistics.median(v) for k, v in samples.items()}}
    if "base" in samples:
        result["base_over_this"] = result["median_us"]["base"] / result["median_us"]["this"]
    print(json.dumps({k: v for k, v in result.items() if k != "samples_us"}, indent=1))
    if a.out:
        write_raw(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
