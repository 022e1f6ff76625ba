"""This tree's INT4 kernel against another version of it, side by side in one run on one GPU.

    git show REV:sdsie/kernels/int4_gemm.py > .ab/base_int4_gemm.py
    git show REV:sdsie/kernels/int4_triton.py > .ab/base_int4_triton.py    # where REV has the Triton kernels apart
    python -m reproductions.kernels.ab_bench --baseline .ab/base_int4_gemm.py \
        [--baseline-kernels .ab/base_int4_triton.py] --out OUT.json

The baseline is the launcher of REV; where REV keeps its Triton kernels in `int4_triton.py`, --baseline-kernels
names REV's copy of that file, whose kernels the baseline launcher then runs (without it, the baseline launches this
tree's kernels, and only the launchers differ). --baseline-mma does the same for the tensor-core GEMV
(`int4_mma.py`: its kernel, its constexpr arguments and its fragment packing), so a change to that kernel alone is
timed against REV's interleaved in one process:

    git show main:sdsie/kernels/int4_gemm.py > .ab/base_int4_gemm.py
    git show main:sdsie/kernels/int4_mma.py > .ab/base_int4_mma.py
    python -m reproductions.kernels.ab_bench --baseline .ab/base_int4_gemm.py --baseline-mma .ab/base_int4_mma.py \
        --m 1 4 16 --out OUT.json

Both versions launch the configuration this tree selects for each case (the installed tuned table), on the
same weights and x. Per case: the time under CUDA graphs (a rotation of L2-cold weight copies, no host time),
the eager do_bench median (L2 flushed), and each version's relative error against the float64 reference, with
bf16 F.linear beside them for scale. The versions alternate in every measurement, so drift hits both.
A kernel change is kept on this evidence only; the claims' numbers come from the suite (int4_bench.py).

A configuration change is timed the same way without a baseline file: --config names the configuration both arms
run (else each case's own choice), and --new-config FIELD=VALUE changes it for the new arm only:

    python -m reproductions.kernels.ab_bench --config "int4[8,16,128,s1,w4,mma]" --new-config num_stages=4 \
        --shapes 4608x3584 --m 1 16 --out OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from reproductions.args import key_value
from reproductions.kernels.int4_bench import (
    LLAMA_SHAPES,
    Case,
    bench,
    cuda_missing,
    graph_us,
    shape_dims,
    weight_rotation,
)
from sdsie.kernels import int4_gemm, int4_matmul, int4_matmul_reference, select_config
from sdsie.kernels.int4_config import Int4KernelConfig
from sdsie.kernels.int4_tune import config_from_name, config_name, rel_error
from sdsie.telemetry.records import write_raw

AB_CASES = [(m, g) for m, g in ((1, 128), (1, None), (2, 128))]  # (M, group): batch 1 both layouts, and M = 2


# the launcher's names for what it takes from sdsie/kernels/int4_triton.py
KERNEL_NAMES = ("CODE_MAGIC", "_int4_dequant_kernel", "_int4_gemm_kernel", "_int4_gemm_planes_kernel",
                "_int4_gemv_kernel")
# ... and from sdsie/kernels/int4_mma.py
MMA_NAMES = ("NORM_MAX_M", "NORM_REGISTER_CAPS", "SQUARE_BLOCK", "_int4_mma_gemv_kernel", "gate_up_order",
             "mma_consts", "mma_supported", "pack_fragments")


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


def load_baseline(path: Path, kernels: Path | None = None, mma: Path | None = None) -> ModuleType:
    """Import a copy of sdsie/kernels/int4_gemm.py from another revision under its own module name; with `kernels`,
    a copy of that revision's sdsie/kernels/int4_triton.py, and with `mma`, of its sdsie/kernels/int4_mma.py, whose
    kernels (and, for the mma GEMV, constexpr arguments and fragment packing) the copy then launches."""
    mod = _import_copy(path, "sdsie_int4_gemm_baseline", "launcher")
    if not hasattr(mod, "int4_matmul"):
        raise ImportError(f"{path} has no int4_matmul: not a version of sdsie/kernels/int4_gemm.py")
    for copy, name, names in ((kernels, "int4_triton", KERNEL_NAMES), (mma, "int4_mma", MMA_NAMES)):
        if copy is None:
            continue
        dev = _import_copy(copy, f"sdsie_{name}_baseline", f"{name} kernels")
        missing = [n for n in names if not hasattr(dev, n)]
        if missing:
            raise ImportError(f"{copy} lacks {missing}: not a version of sdsie/kernels/{name}.py")
        for n in names:  # the launcher looks them up as its globals at each launch
            setattr(mod, n, getattr(dev, n))
    return mod


def ab_shape(text: str) -> str:
    """--shapes' argument: a name of LLAMA_SHAPES, or NxK (`shape_dims`); anything else is refused by name."""
    if shape_dims(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a shape name ({', '.join(LLAMA_SHAPES)}) nor NxK")
    return text


def config_override(text: str) -> tuple[str, bool | int | None]:
    """--new-config's argument: FIELD=VALUE for a field of Int4KernelConfig, VALUE true/false, an integer or none
    (`key_value`); anything else is refused by name."""
    field, value = key_value(text, "--new-config")
    fields = sorted(f.name for f in dataclasses.fields(Int4KernelConfig))
    if field not in fields:
        raise argparse.ArgumentTypeError(f"--new-config {text!r}: {field!r} is not a field of Int4KernelConfig "
                                         f"({', '.join(fields)})")
    if isinstance(value, str):
        if value.lower() != "none":
            raise argparse.ArgumentTypeError(f"--new-config {text!r}: VALUE must be true, false, none or an integer")
        return field, None
    return field, value


def ab_config(text: str) -> Int4KernelConfig:
    """--config's argument: a configuration as a sweep names it (`config_from_name`); its error names the part it
    cannot read."""
    try:
        return config_from_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def arm_configs(case: Case, device: str, group_size: int, config: Int4KernelConfig | None,
                overrides: dict) -> tuple[Int4KernelConfig, Int4KernelConfig]:
    """(new arm's, base arm's) configuration: `config`, else the case's own choice, with `overrides` applied to the
    new arm's (ValueError naming the case where the result is not a configuration)."""
    cfg = config if config is not None else select_config(case.m, case.n, case.k, torch.device(device), group_size)
    try:
        return dataclasses.replace(cfg, **overrides), cfg
    except ValueError as err:
        raise ValueError(f"--new-config {overrides} on {config_name(cfg)} ({case.shape}, M = {case.m}): "
                         f"{err}") from None


def ab_case(case: Case, base: ModuleType, gen: torch.Generator, device: str, config: Int4KernelConfig | None = None,
            overrides: dict | None = None) -> dict:
    # the suite's rotation (int4_bench.weight_rotation): with fewer copies, 4 bf16 copies of the small
    # shapes fit in L2 and make bf16 look fast there (kv_1024x4096: 5.9 against the suite's 7.0 us)
    ws, wb = weight_rotation(case, gen, device)
    w = ws[0]
    x = torch.randn(case.m, case.k, generator=gen).to(torch.bfloat16).to(device)
    cfg, base_cfg = arm_configs(case, device, w.group_size, config, overrides or {})
    new = lambda w_: int4_matmul(x, w_, config=cfg)  # noqa: E731
    old = lambda w_: base.int4_matmul(x, w_, config=base.Int4KernelConfig(**asdict(base_cfg)))  # noqa: E731
    ref = int4_matmul_reference(x, w)
    out: dict = {"case": asdict(case), "config": asdict(cfg), "base_config": asdict(base_cfg),
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
    p.add_argument("--baseline", type=Path, default=None,
                   help="a copy of sdsie/kernels/int4_gemm.py to compare (without it: this tree's, for --new-config)")
    p.add_argument("--baseline-kernels", type=Path, default=None,
                   help="that revision's copy of sdsie/kernels/int4_triton.py, whose kernels the baseline launches")
    p.add_argument("--baseline-mma", type=Path, default=None,
                   help="that revision's copy of sdsie/kernels/int4_mma.py, whose tensor-core GEMV the baseline runs")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="*", type=ab_shape, default=list(LLAMA_SHAPES), metavar="NAME|NxK",
                   help=f"shapes by name ({', '.join(LLAMA_SHAPES)}) or as NxK (out x in features)")
    p.add_argument("--m", type=int, nargs="+", metavar="M",
                   help="time these M at group 128 instead of AB_CASES (M = 1 both layouts, and M = 2)")
    p.add_argument("--config", type=ab_config, default=None, metavar="NAME",
                   help="the configuration both arms run, as a sweep names it (else each case's own choice)")
    p.add_argument("--new-config", type=config_override, action="append", default=[], metavar="FIELD=VALUE",
                   help="a change to the new arm's configuration (repeatable)")
    a = p.parse_args(argv)
    if a.baseline is None and not a.new_config:
        p.error("without --baseline the two arms are this tree's: name a change with --new-config")
    if (a.baseline_kernels or a.baseline_mma) and a.baseline is None:
        p.error("--baseline-kernels and --baseline-mma go with --baseline")
    if a.m is not None and any(m < 1 for m in a.m):
        p.error(f"--m {a.m}: every M must be >= 1")
    cases = AB_CASES if a.m is None else [(m, 128) for m in a.m]
    if cuda_missing("ab_bench"):
        return 2
    base = int4_gemm if a.baseline is None else load_baseline(a.baseline, a.baseline_kernels, a.baseline_mma)
    overrides = dict(a.new_config)
    gen = torch.Generator().manual_seed(0)
    todo = [(shape, m, g) for shape in a.shapes for m, g in cases]
    head = {"baseline": a.baseline and str(a.baseline), "config": a.config and config_name(a.config),
            "new_config": overrides, "baseline_kernels": a.baseline_kernels and str(a.baseline_kernels),
            "baseline_mma": a.baseline_mma and str(a.baseline_mma), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "planned_cases": len(todo)}
    results = []
    for shape, m, g in todo:
        n, k = shape_dims(shape)
        r = ab_case(Case(shape, n, k, m, g), base, gen, "cuda", a.config, overrides)
        results.append(r)
        # rewritten after every case: a run stopped by its time limit keeps the cases it finished
        write_raw(a.out, {**head, "complete": len(results) == len(todo), "results": results})
        gm = {v: statistics.median(t) for v, t in r["graph_us"].items()}
        print(f"{shape:22s} m={m} g={g} graph new={gm['new']:.2f} base={gm['base']:.2f} bf16={gm['bf16']:.2f}us "
              f"x{r['graph_new_over_base']:.3f} | eager x{r['eager_new_over_base']:.3f} | err new "
              f"{r['errors']['new']:.2e} base {r['errors']['base']:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
