"""What the kernel target's own timer allows: the INT4 kernel's bytes moved by a copy and by a read-only reduction.

The kernel's target is a 3.0x geometric mean over bf16 at M = 1 and 75% of the copy bandwidth on the three largest
shapes, both timed by `triton.testing.do_bench` with L2 flushed before every call: one eager call, its launch latency
and ramp included. This probe asks how far a kernel that did nothing but move its bytes would get under that timer. Per
Llama shape and M, side by side in one process, each timed eagerly (`int4_bench.bench`, raw samples kept) and under
CUDA graphs (`int4_bench.graph_us`, L2-cold rotation):

  bf16   F.linear with the bf16 weights (the target's denominator)
  int4   the shipped kernel (int4_matmul, its tuned entry)
  copy   a device-to-device copy moving the INT4 call's bytes (read + write, as the copy bandwidth counts them)
  read   a sum over the INT4 call's bytes (read-only, as the kernel's weight stream is)

`summarize` turns the medians into ceilings: bf16 over the faster of copy and read per shape, and their geometric
mean at M = 1 (what the 3.0x target would be against a kernel as fast as moving its bytes), and the share of the
measured copy bandwidth (a 1 GiB copy, as the suite computes it) that moving the bytes reaches per shape.

    python -m research.kernels.ceiling_probe --out telemetry/raw/ceiling_probe_h200.json

Its answer (a copy of the INT4 bytes reaches 2.93x, 59-60% of the copy bandwidth; telemetry/raw/
ceiling_probe_20261202T0805_h200.json) is in docs/kernel-log.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from reproductions.kernels.int4_bench import (
    COPY_ALIGN,
    LARGE,
    LLAMA_SHAPES,
    M_VALUES,
    Case,
    bench,
    bytes_moved_int4,
    copy_bandwidth_gbs,
    copy_buffers,
    copy_half_bytes,
    copy_time_us,
    cuda_missing,
    graph_us,
    l2_busting_copies,
    weight_rotation,
)
from sdsie.kernels import int4_matmul
from sdsie.stats import geomean
from sdsie.telemetry.records import write_raw

ARMS = ("bf16", "int4", "copy", "read")


def read_buffers(nbytes: int, device: str) -> list[torch.Tensor]:
    """int32 buffers of `nbytes` (rounded up to 4 KiB like the copies), enough to cover > 4x L2 when rotated."""
    words = -(-nbytes // COPY_ALIGN) * COPY_ALIGN // 4
    return [torch.randint(-(2**30), 2**30, (words,), dtype=torch.int32, device=device)
            for _ in range(l2_busting_copies(device, 4 * words))]


def probe_case(case: Case, gen: torch.Generator, device: str, rep_ms: int) -> dict:
    """Eager do_bench samples and graphed per-call times of the four arms for one case."""
    x = torch.randn(case.m, case.k, generator=gen).to(torch.bfloat16).to(device)
    ws, wb = weight_rotation(case, gen, device)
    nbytes = bytes_moved_int4(ws[0], case.m)
    srcs, dst = copy_buffers(copy_half_bytes(nbytes), device)
    reads = read_buffers(nbytes, device)
    eager = {"bf16": lambda: F.linear(x, wb[0]), "int4": lambda: int4_matmul(x, ws[0]),
             "copy": lambda: dst.copy_(srcs[0]), "read": lambda: reads[0].sum()}
    out: dict = {"case": case.__dict__, "bytes_int4": nbytes, "eager_samples_us": {}, "eager_us": {}, "graph_us": {}}
    for arm, fn in eager.items():
        samples = bench(fn, rep_ms)
        out["eager_samples_us"][arm] = samples
        out["eager_us"][arm] = statistics.median(samples)
    out["graph_us"]["bf16"] = graph_us(lambda i: (lambda: F.linear(x, wb[i % len(wb)])), 2 * case.n * case.k, device)
    out["graph_us"]["int4"] = graph_us(lambda i: (lambda: int4_matmul(x, ws[i % len(ws)])), case.n * case.k // 2,
                                       device)
    out["graph_us"]["copy"] = copy_time_us(srcs, dst, device)
    out["graph_us"]["read"] = graph_us(lambda i: (lambda: reads[i % len(reads)].sum()), 4 * reads[0].numel(), device)
    return out


def summarize(cases: list[dict], copy_gbs: float) -> dict[str, float]:
    """Per case and timer: bf16 over int4 (measured) and over the faster of copy and read (the ceiling), and the
    percent of copy_gbs that moving the INT4 bytes reaches; at M = 1, the geometric means over the shapes."""
    s: dict[str, float] = {"copy_bandwidth_gbs": copy_gbs}
    for timer in ("eager", "graph"):
        by_m: dict[int, list[tuple[float, float]]] = {}
        for c in cases:
            t = c[f"{timer}_us"]
            floor = min(t["copy"], t["read"])
            key = f"{timer}.{c['case']['shape']}.m{c['case']['m']}"
            s[f"{key}.speedup"] = t["bf16"] / t["int4"]
            s[f"{key}.ceiling_speedup"] = t["bf16"] / floor
            s[f"{key}.ceiling_pct_of_copy"] = 100.0 * c["bytes_int4"] / (floor * 1e-6) / 1e9 / copy_gbs
            s[f"{key}.int4_pct_of_copy"] = 100.0 * c["bytes_int4"] / (t["int4"] * 1e-6) / 1e9 / copy_gbs
            by_m.setdefault(c["case"]["m"], []).append((s[f"{key}.speedup"], s[f"{key}.ceiling_speedup"]))
        for m, pairs in by_m.items():
            if len(pairs) == len(LLAMA_SHAPES):  # the geomean is over every shape or not at all
                s[f"{timer}.m{m}.geomean_speedup"] = geomean([p[0] for p in pairs])
                s[f"{timer}.m{m}.geomean_ceiling_speedup"] = geomean([p[1] for p in pairs])
        large = [s[f"{timer}.{shape}.m1.ceiling_pct_of_copy"] for shape in LARGE if f"{timer}.{shape}.m1.speedup" in s]
        if len(large) == len(LARGE):
            s[f"{timer}.m1.min_ceiling_pct_of_copy_large"] = min(large)
    return s


def _window_ms(text: str) -> int:
    value = int(text)
    if not 10 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be 10-1000 ms, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16], choices=M_VALUES, help="the suite's M values")
    p.add_argument("--rep-ms", type=_window_ms, default=100, help="do_bench's timing window per arm, 10-1000 ms")
    a = p.parse_args(argv)
    if cuda_missing("ceiling_probe"):
        return 2
    gen = torch.Generator().manual_seed(0)
    copy_gbs = copy_bandwidth_gbs("cuda")
    cases = []
    for m in a.m:
        for shape, (n, k) in LLAMA_SHAPES.items():
            r = probe_case(Case(shape, n, k, m, 128), gen, "cuda", a.rep_ms)
            print(f"{shape} m={m}: " + " ".join(f"{arm} {r['eager_us'][arm]:.1f}/{r['graph_us'][arm]:.1f}"
                                                 for arm in ARMS) + " us (eager/graphed)", flush=True)
            cases.append(r)
    summary = summarize(cases, copy_gbs)
    for key, value in sorted(summary.items()):
        if key.count(".") <= 2 or "large" in key:
            print(f"  {key} = {value:.3f}")
    write_raw(a.out, {"summary": summary, "cases": cases, "device": torch.cuda.get_device_name()})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
