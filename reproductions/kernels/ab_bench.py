"""This tree's INT4 kernel against another version of it, side by side in one run on one GPU.

    git show REV:sdsie/kernels/int4_gemm.py > .ab/base_int4_gemm.py
    git show REV:sdsie/kernels/int4_triton.py > .ab/base_int4_triton.py    # where REV has the Triton kernels apart
    python -m reproductions.kernels.ab_bench --baseline .ab/base_int4_gemm.py \
        [--baseline-kernels .ab/base_int4_triton.py] --out OUT.json

The baseline is the launcher of REV; where REV keeps its Triton kernels in `int4_triton.py`, --baseline-kernels
names REV's copy of that file, whose kernels the baseline launcher then runs (without it, the baseline launches this
tree's kernels, and only the launchers differ).

Both versions launch the configuration this tree selects for each case (the installed tuned table), on the
same weights and x. Per case: the time under CUDA graphs (a rotation of L2-cold weight copies, no host time),
the eager do_bench median (L2 flushed), and each version's relative error against the float64 reference, with
bf16 F.linear beside them for scale. The versions alternate in every measurement, so drift hits both.
A kernel change is kept on this evidence only; the claims' numbers come from the suite (int4_bench.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from reproductions.kernels.int4_bench import (
    LLAMA_SHAPES,
    Case,
    bench,
    cuda_missing,
    graph_us,
    weight_rotation,
)
from sdsie.kernels import int4_matmul, int4_matmul_reference, select_config
from sdsie.kernels.int4_tune import rel_error
from sdsie.telemetry.records import write_raw

AB_CASES = [(m, g) for m, g in ((1, 128), (1, None), (2, 128))]  # (M, group): batch 1 both layouts, and M = 2


# the launcher's names for what it takes from sdsie/kernels/int4_triton.py
KERNEL_NAMES = ("CODE_MAGIC", "_int4_dequant_kernel", "_int4_gemm_kernel", "_int4_gemm_planes_kernel",
                "_int4_gemv_kernel")


def _import_copy(path: Path, name: str, what: str) -> ModuleType:
    if not path.is_file():
        raise FileNotFoundError(f"baseline {what} {path} does not exist (git show REV:sdsie/kernels/...)")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def load_baseline(path: Path, kernels: Path | None = None) -> ModuleType:
    """Import a copy of sdsie/kernels/int4_gemm.py from another revision under its own module name; with `kernels`,
    a copy of that revision's sdsie/kernels/int4_triton.py, whose kernels the copy then launches."""
    mod = _import_copy(path, "sdsie_int4_gemm_baseline", "launcher")
    if not hasattr(mod, "int4_matmul"):
        raise ImportError(f"{path} has no int4_matmul: not a version of sdsie/kernels/int4_gemm.py")
    if kernels is not None:
        dev = _import_copy(kernels, "sdsie_int4_triton_baseline", "kernels")
        missing = [n for n in KERNEL_NAMES if not hasattr(dev, n)]
        if missing:
            raise ImportError(f"{kernels} lacks {missing}: not a version of sdsie/kernels/int4_triton.py")
        for n in KERNEL_NAMES:  # the launcher looks them up as its globals at each launch
            setattr(mod, n, getattr(dev, n))
    return mod


def ab_case(case: Case, base: ModuleType, gen: torch.Generator, device: str) -> dict:
    # the suite's rotation (int4_bench.weight_rotation): with fewer copies, 4 bf16 copies of the small
    # shapes fit in L2 and make bf16 look fast there (kv_1024x4096: 5.9 against the suite's 7.0 us)
    ws, wb = weight_rotation(case, gen, device)
    w = ws[0]
    x = torch.randn(case.m, case.k, generator=gen).to(torch.bfloat16).to(device)
    cfg = select_config(case.m, case.n, case.k, torch.device(device), w.group_size)
    new = lambda w_: int4_matmul(x, w_, config=cfg)  # noqa: E731
    old = lambda w_: base.int4_matmul(x, w_, config=base.Int4KernelConfig(**asdict(cfg)))  # noqa: E731
    ref = int4_matmul_reference(x, w)
    out: dict = {"case": asdict(case), "config": asdict(cfg),
                 "errors": {"new": rel_error(new(w), ref), "base": rel_error(old(w), ref)}}
    graph: dict[str, list[float]] = {"new": [], "base": [], "bf16": []}
    eager: dict[str, list[float]] = {"new": [], "base": [], "bf16": []}
    for _ in range(3):  # alternate the versions: new, base, bf16, new, base, bf16, ...
        graph["new"].append(graph_us(lambda i: (lambda: new(ws[i % len(ws)])), case.n * case.k // 2, device))
        graph["base"].append(graph_us(lambda i: (lambda: old(ws[i % len(ws)])), case.n * case.k // 2, device))
        graph["bf16"].append(graph_us(lambda i: (lambda: F.linear(x, wb[i % len(wb)])), 2 * case.n * case.k,
                                      device))
        eager["new"].append(statistics.median(bench(lambda: new(w), rep_ms=50)))
        eager["base"].append(statistics.median(bench(lambda: old(w), rep_ms=50)))
        eager["bf16"].append(statistics.median(bench(lambda: F.linear(x, wb[0]), rep_ms=50)))
    out["graph_us"] = graph
    out["eager_us"] = eager
    med = {k: statistics.median(v) for k, v in graph.items()}
    out["graph_new_over_base"] = med["base"] / med["new"]  # > 1: the new kernel is faster
    out["graph_speedup_vs_bf16"] = {"new": med["bf16"] / med["new"], "base": med["bf16"] / med["base"]}
    emed = {k: statistics.median(v) for k, v in eager.items()}
    out["eager_new_over_base"] = emed["base"] / emed["new"]
    out["eager_speedup_vs_bf16"] = {"new": emed["bf16"] / emed["new"], "base": emed["bf16"] / emed["base"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, required=True, help="a copy of sdsie/kernels/int4_gemm.py to compare")
    p.add_argument("--baseline-kernels", type=Path, default=None,
                   help="that revision's copy of sdsie/kernels/int4_triton.py, whose kernels the baseline launches")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="*", default=list(LLAMA_SHAPES), choices=list(LLAMA_SHAPES))
    p.add_argument("--m", type=int, nargs="+", metavar="M",
                   help="time these M at group 128 instead of AB_CASES (M = 1 both layouts, and M = 2)")
    a = p.parse_args(argv)
    if a.m is not None and any(m < 1 for m in a.m):
        p.error(f"--m {a.m}: every M must be >= 1")
    cases = AB_CASES if a.m is None else [(m, 128) for m in a.m]
    if cuda_missing("ab_bench"):
        return 2
    base = load_baseline(a.baseline, a.baseline_kernels)
    gen = torch.Generator().manual_seed(0)
    results = []
    for shape in a.shapes:
        n, k = LLAMA_SHAPES[shape]
        for m, g in cases:
            r = ab_case(Case(shape, n, k, m, g), base, gen, "cuda")
            results.append(r)
            gm = {v: statistics.median(t) for v, t in r["graph_us"].items()}
            print(f"{shape:22s} m={m} g={g} graph new={gm['new']:.1f} base={gm['base']:.1f} bf16={gm['bf16']:.1f}us "
                  f"x{r['graph_new_over_base']:.3f} | eager x{r['eager_new_over_base']:.3f} | err new "
                  f"{r['errors']['new']:.2e} base {r['errors']['base']:.2e}", flush=True)
    write_raw(a.out, {"baseline": str(a.baseline), "baseline_kernels": a.baseline_kernels and str(a.baseline_kernels),
                      "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
