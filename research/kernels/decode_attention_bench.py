"""Does split-KV attention (`sdsie.kernels.decode_attention`) take a one-token decode step's attention near the time
its keys and values take to read, where SDPA on the packed query does not?

A graphed, compiled batch-1 decode of a Llama-3.1-8B-shaped model after a 2,048-token prompt spends 1,633 us of GPU
time per token in attention (docs/log.md, GPU time per decode token by category): 51 us per layer, where the
layer's K and V in a 2,304-position static cache are 9.4 MB, 2.2 us at the 4.25 TB/s copy rate.
`model_io._static_sdpa_attention` packs the step's query heads onto their key/value head and calls SDPA with an
additive mask over the whole static cache, whose fused kernel runs B * H_kv programs (8 for Llama, 4 for
Qwen2.5-7B) on a 132-SM GPU.

Per model shape (Llama-3.1-8B: H_kv 8, G 4, D 128; Qwen2.5-7B: H_kv 4, G 7, D 128), batch 1, bf16, at S in
{256, 2304, 8448} cache positions with the last 100 masked (a static cache's unfilled slots), each arm is timed
  - with triton.testing.do_bench (L2 flushed before each call; host launch time included where it is the longer),
  - under a CUDA graph (`int4_bench.graph_us`: calls cycling over K/V copies covering > 4x L2, replayed; per call),
and checked against a float64 reference (max abs error). Arms:
  sdpa_packed   F.scaled_dot_product_attention on the packed query [B, H_kv, G, D] with the mask (model_io's call)
  sdpa_gqa      the same over the unpacked query [B, H, 1, D] with enable_gqa=True
  split_kv      decode_attention with its split rule; split_kv_bn32 / _bn128 other tile lengths; split_kv_half /
                _double half and twice the rule's split count, split_kv_n{1..32} forced counts (the rule's
                alternatives, for tuning it); with --stages D ..., split_kv_s{D} and split_kv_n{N}_s{D}: the rule's
                and each forced count at each forced pipeline depth; with --warps W ..., split_kv_w{W},
                split_kv_double_w{W}, split_kv_quad_w{W} and split_kv_n1_w{W}: the rule's, twice and four times its
                split count, and one split, with a split program of W warps
  split_kv_previous  with --previous FILE: that version of the module's decode_attention
K and V bytes read per call and the rate they imply (TB/s) sit beside each time.

Run on the H200:
    python -m research.kernels.decode_attention_bench --out $OUT/decode_attention_h200.json
CPU dry run (the Triton interpreter, tiny shapes, no timing), which tests/test_decode_attention.py runs:
    TRITON_INTERPRET=1 python -m research.kernels.decode_attention_bench --tiny --device cpu --out /tmp/da.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

MODELS: dict[str, tuple[int, int, int]] = {"llama-3.1-8b": (8, 4, 128), "qwen2.5-7b": (4, 7, 128)}  # H_kv, G, D
SEQ_LENS = (256, 2304, 8448)
HIDDEN_TAIL = 100
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)  # forced split counts, to fit the rule
TINY_MODELS: dict[str, tuple[int, int, int]] = {"tiny-llama-shaped": (2, 4, 64), "tiny-qwen-shaped": (1, 7, 64)}
TINY_SEQ_LENS = (48, 80)


def make_case(h_kv: int, groups: int, dim: int, seq_len: int, hidden: int, dtype: torch.dtype, device: str,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, H_kv, G, D], k and v [1, H_kv, S, D], and an additive mask [1, 1, 1, S] hiding the last `hidden`."""
    q = torch.randn(1, h_kv, groups, dim, generator=gen).to(dtype).to(device)
    k = torch.randn(1, h_kv, seq_len, dim, generator=gen).to(dtype).to(device)
    v = torch.randn(1, h_kv, seq_len, dim, generator=gen).to(dtype).to(device)
    mask = torch.zeros(1, 1, 1, seq_len, dtype=dtype, device=device)
    mask[..., seq_len - hidden:] = float("-inf")
    return q, k, v, mask


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in float64."""
    scores = q.double() @ k.double().transpose(-1, -2) * scale + mask.double()
    return torch.softmax(scores, dim=-1) @ v.double()


Arm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def load_previous(path: Path) -> Arm:
    """`decode_attention` of another version of the module (a file), as an arm: side by side in one run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_attention_previous", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--previous {path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return lambda q, k, v, mask, scale: module.decode_attention(q, k, v, mask, scale)


def arms(seq_len: int, batch_heads: int, sms: int, tiny: bool, previous: Path | None = None,
         stages: tuple[int, ...] = (), warps: tuple[int, ...] = ()) -> tuple[dict[str, Arm], dict[str, dict]]:
    """The arms, each a call (q, k, v, mask, scale) -> [B, H_kv, G, D], and the split-KV arms' plans."""
    from sdsie.kernels.decode_attention import BLOCK_N, NUM_WARPS, decode_attention, split_rule

    def sdpa_gqa(q, k, v, mask, scale):
        b, h_kv, g, d = q.shape
        out = F.scaled_dot_product_attention(q.reshape(b, h_kv * g, 1, d), k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=True)  # query head i on key/value head i // G: the packing
        return out.reshape(b, h_kv, g, d)

    table: dict[str, Arm] = {
        "sdpa_packed": lambda q, k, v, mask, scale: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                   scale=scale),
        "sdpa_gqa": sdpa_gqa,
    }
    if previous is not None:
        table["split_kv_previous"] = load_previous(previous)
    auto = split_rule(batch_heads, seq_len, BLOCK_N, sms=sms).num_splits
    def variant(block_n: int = BLOCK_N, splits: int | None = None, depth: int | None = None,
                warps: int = NUM_WARPS) -> tuple[int, int | None, int | None, int]:
        """(block_n, num_splits, num_stages, num_warps); None: the rule's."""
        return block_n, splits, depth, warps

    variants = {"split_kv": variant()}
    if not tiny:
        variants |= {"split_kv_bn32": variant(32), "split_kv_bn128": variant(128),
                     "split_kv_half": variant(splits=max(1, auto // 2)), "split_kv_double": variant(splits=2 * auto)}
        variants |= {f"split_kv_n{n}": variant(splits=n) for n in SWEEP_SPLITS}
    for depth in stages:
        variants[f"split_kv_s{depth}"] = variant(depth=depth)
        variants |= {f"split_kv_n{n}_s{depth}": variant(splits=n, depth=depth) for n in SWEEP_SPLITS}
    for w in warps:
        variants |= {f"split_kv_w{w}": variant(warps=w), f"split_kv_double_w{w}": variant(splits=2 * auto, warps=w),
                     f"split_kv_quad_w{w}": variant(splits=4 * auto, warps=w),
                     f"split_kv_n1_w{w}": variant(splits=1, warps=w)}
    plans = {}
    for name, (block_n, splits, depth, nw) in variants.items():
        plan = split_rule(batch_heads, seq_len, block_n, sms=sms, num_splits=splits, num_stages=depth)
        plans[name] = {"num_splits": plan.num_splits, "chunk": plan.chunk, "block_n": block_n,
                       "num_stages": plan.num_stages, "num_warps": nw, "programs": batch_heads * plan.num_splits}
        table[name] = (lambda bn, ns, st, w: lambda q, k, v, mask, scale: decode_attention(
            q, k, v, mask, scale, num_splits=ns, block_n=bn, num_stages=st, num_warps=w))(block_n, splits, depth, nw)
    return table, plans


def time_arm(fn: Arm, q: torch.Tensor, kvs: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
             scale: float, kv_bytes: int, device: str) -> dict:
    """do_bench median (us, L2 flushed) on the first K/V, and the graphed per-call time cycling over all of them."""
    from reproductions.kernels.int4_bench import bench
    from sdsie.telemetry.timing import graph_us

    k, v = kvs[0]
    samples = bench(lambda: fn(q, k, v, mask, scale), rep_ms=100)
    eager = statistics.median(samples)
    graphed = graph_us(lambda i: (lambda: fn(q, *kvs[i % len(kvs)], mask, scale)), kv_bytes, device)
    return {"do_bench_us": eager, "do_bench_n": len(samples), "graph_us": graphed,
            "do_bench_tbps": kv_bytes / (eager * 1e-6) / 1e12, "graph_tbps": kv_bytes / (graphed * 1e-6) / 1e12}


def run_case(model: str, h_kv: int, groups: int, dim: int, seq_len: int, hidden: int, device: str, tiny: bool,
             gen: torch.Generator, previous: Path | None = None, stages: tuple[int, ...] = (),
             warps: tuple[int, ...] = ()) -> dict:
    dtype = torch.bfloat16
    q, k, v, mask = make_case(h_kv, groups, dim, seq_len, hidden, dtype, device, gen)
    scale = 1.0 / math.sqrt(dim)
    ref = reference(q, k, v, mask, scale)
    kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    timed = device == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if timed else 132
    table, plans = arms(seq_len, h_kv, sms, tiny, previous, stages, warps)
    kvs = [(k, v)]
    if timed:
        from sdsie.telemetry.timing import l2_busting_copies

        kvs += [(torch.randn_like(k), torch.randn_like(v)) for _ in range(l2_busting_copies(device, kv_bytes) - 1)]
    out = {"model": model, "h_kv": h_kv, "g": groups, "d": dim, "s": seq_len, "hidden": hidden,
           "kv_bytes": kv_bytes, "arms": {}}
    for name, fn in table.items():
        row: dict = {"plan": plans[name]} if name in plans else {}
        try:
            y = fn(q, k, v, mask, scale)
            row["max_abs_err"] = float((y.double() - ref).abs().max())
            if timed:
                row |= time_arm(fn, q, kvs, mask, scale, kv_bytes, device)
        except (RuntimeError, TypeError, ValueError) as err:  # an arm this torch or device lacks: recorded
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        out["arms"][name] = row
        times = "" if "graph_us" not in row else f" do_bench {row['do_bench_us']:.1f} us graph {row['graph_us']:.1f} us"
        print(f"{model} S={seq_len} {name}: err {row.get('max_abs_err', row.get('error'))}{times}", flush=True)
    return out


def summarize(cases: list[dict]) -> dict[str, float]:
    """Per model and S, sdpa_packed's time over split_kv's (graphed and do_bench), where both were timed."""
    s = {}
    for c in cases:
        base, ours = c["arms"].get("sdpa_packed", {}), c["arms"].get("split_kv", {})
        for timer in ("graph_us", "do_bench_us"):
            if timer in base and timer in ours:
                s[f"{c['model']}.s{c['s']}.{timer.removesuffix('_us')}_speedup"] = base[timer] / ours[timer]
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    p.add_argument("--previous", type=Path, help="another version of sdsie/kernels/decode_attention.py, timed as the "
                                                  "arm split_kv_previous")
    p.add_argument("--stages", type=int, nargs="+", default=[], help="pipeline depths to force, each beside the "
                                                                       "rule's and the forced split counts")
    p.add_argument("--warps", type=int, nargs="+", default=[], help="warps a split program runs, each at the rule's, "
                                                                      "twice, four times its split count and one split")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    a = p.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (a fresh process)
    elif not torch.cuda.is_available():
        print("decode_attention_bench --device cuda needs a CUDA GPU; torch.cuda.is_available() is False",
              file=sys.stderr)
        return 2
    import triton

    from sdsie.telemetry.records import write_raw

    models = TINY_MODELS if a.tiny else {name: MODELS[name] for name in a.models}
    seq_lens = TINY_SEQ_LENS if a.tiny else tuple(a.seq_lens)
    gen = torch.Generator().manual_seed(0)
    cases = [run_case(name, h_kv, g, d, s, s // 4 if a.tiny else HIDDEN_TAIL, a.device, a.tiny, gen, a.previous,
                      tuple(a.stages), tuple(a.warps))
             for name, (h_kv, g, d) in models.items() for s in seq_lens]
    write_raw(a.out, {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter, untimed)",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16", "batch": 1,
        "command": "python -m research.kernels.decode_attention_bench " + " ".join(argv or sys.argv[1:]),
        "unit": "us per call; do_bench: median, L2 flushed; graph: int4_bench.graph_us (L2-cold K/V rotation)",
        "cases": cases, "summary": summarize(cases)})
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
