"""Hardware counters of one matmul launch (M = 1 unless the target names M) under Nsight Compute: why the INT4 GEMV
overlaps so little, and what holds the small-M planes kernel.

Answered: the stall reasons, issue activity and occupancy it read are in docs/kernel-log.md
(telemetry/raw/ncu_20261130T2011_h200.json, ncu_20261130T2011b_h200.json); the mma GEMV's L2 and L1 traffic at M = 1,
8 and 16 in ncu_mma_m1_m16_h100.json.

The kernel log's two-ceiling model (docs/kernel-log.md) found the mid shapes' graphed M = 1 times at or above the sum of
their SASS issue time and their bytes' copy time. This probe reads what the counters say about one launch: the warp
stall reasons (WarpStateStats), issue activity (SchedulerStats), DRAM throughput (MemoryWorkloadAnalysis, SpeedOfLight),
L2 and L1 bytes and throughput, achieved occupancy, and how evenly the SMs were kept busy (sm__cycles_active min / avg /
max).

    run      one process per target, under ncu: builds the weights, warms the call up (compilation, workspaces),
             then profiles exactly one call between cudaProfilerStart and cudaProfilerStop
             (ncu --profile-from-start off). TARGET is KIND:SHAPE:GROUP[:mM][:CONFIG], KIND one of int4, bf16,
             tinygemm; SHAPE a name of LLAMA_SHAPES or NxK; GROUP 128 or pc; M the rows of x (1 to 16, default 1);
             CONFIG an int4 config_name without brackets (1,128,256,s2,w4,p4; 16,256,128,s4,w4,p3,swap for the
             planes kernel; 8,16,128,s1,w8,mma for the mma GEMV). Or
             attention:MODEL:S[:nN]: one split-KV decode attention call (`decode_attention_bench`'s case: MODEL
             llama-3.1-8b or qwen2.5-7b, S cache positions, the last 100 masked; N forced splits, else the rule's).
    summarize  ncu's raw CSV pages (--csv --page raw), one per target, into one JSON of the metrics read here.

    ncu --clock-control none --profile-from-start off --csv --page raw --section ... \
        python3 -m research.kernels.ncu_probe run int4:gate_up_14336x4096:128 > gate_up.csv
    python3 -m research.kernels.ncu_probe summarize --out telemetry/raw/ncu_20261130T2011_h200.json *.csv
research/kernels/ncu_run.sh runs the set of targets profiled there.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from reproductions.kernels.int4_bench import LLAMA_SHAPES, cuda_missing, random_int4, shape_dims, tinygemm_pack
from sdsie.kernels import int4_matmul
from sdsie.kernels.int4_tune import config_from_name
from sdsie.telemetry.records import write_raw

KINDS = ("int4", "bf16", "tinygemm")
WARMUP_CALLS = 3
# Metrics kept per launch (exact raw names), besides every warp stall ratio (STALL_PATTERN).
METRICS = {
    "duration_ns": "gpu__time_duration.sum",
    "dram_bytes_read": "dram__bytes_read.sum",
    "dram_bytes_write": "dram__bytes_write.sum",
    "dram_pct_of_peak": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warp_cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
    "registers_per_thread": "launch__registers_per_thread",
    "shared_mem_per_block": "launch__shared_mem_per_block",
    "grid_size": "launch__grid_size",
    "block_size": "launch__block_size",
    "waves_per_sm": "launch__waves_per_multiprocessor",
    "sm_cycles_active_min": "sm__cycles_active.min",
    "sm_cycles_active_avg": "sm__cycles_active.avg",
    "sm_cycles_active_max": "sm__cycles_active.max",
    "elapsed_cycles": "sm__cycles_elapsed.max",
    "instructions": "smsp__inst_executed.sum",
    "l2_bytes": "lts__t_bytes.sum",  # every request L2 served (DRAM's bytes pass through it too)
    "l2_pct_of_peak": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1_bytes": "l1tex__t_bytes.sum",
    "l1_pct_of_peak": "l1tex__throughput.avg.pct_of_peak_sustained_active",
}
# METRICS that ncu_run.sh asks for by name (--metrics) beside its sections: raw counters no section is sure to report
EXTRA_METRICS = tuple(METRICS[key] for key in (
    "sm_cycles_active_min", "sm_cycles_active_avg", "sm_cycles_active_max", "elapsed_cycles", "dram_bytes_read",
    "dram_bytes_write", "instructions", "l2_bytes", "l2_pct_of_peak", "l1_bytes", "l1_pct_of_peak"))
STALL_PATTERN = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def parse_attention_target(target: str) -> tuple[str, int, int | None]:
    """attention:MODEL:S[:nN] -> (model, S, forced split count or None)."""
    from research.kernels.decode_attention_bench import MODELS as ATTENTION_MODELS

    fields = target.split(":")
    ok = (3 <= len(fields) <= 4 and fields[1] in ATTENTION_MODELS and fields[2].isdigit() and int(fields[2]) > 0
          and (len(fields) == 3 or re.fullmatch(r"n[1-9]\d*", fields[3]) is not None))
    if not ok:
        raise ValueError(f"target {target!r}: expected attention:MODEL:S[:nN] with MODEL in "
                         f"{sorted(ATTENTION_MODELS)}, S and N positive")
    return fields[1], int(fields[2]), int(fields[3][1:]) if len(fields) == 4 else None


def parse_target(target: str) -> tuple[str, str, str, int, str | None]:
    """KIND:SHAPE:GROUP[:mM][:CONFIG] -> (kind, shape, group, M, config text or None); M is 1 unless given, SHAPE a
    name of LLAMA_SHAPES or NxK (any decoder shape: 1536x8960)."""
    fields = target.split(":")
    if not 3 <= len(fields) <= 5 or fields[0] not in KINDS or shape_dims(fields[1]) is None:
        raise ValueError(f"target {target!r}: expected KIND:SHAPE:GROUP[:mM][:CONFIG] with KIND in {KINDS} and SHAPE "
                         f"one of {sorted(LLAMA_SHAPES)} or NxK")
    kind, shape, group_text, rest = fields[0], fields[1], fields[2], fields[3:]
    if group_text not in ("128", "pc"):
        raise ValueError(f"target {target!r}: GROUP must be 128 or pc, got {group_text!r}")
    m = 1
    if rest and re.fullmatch(r"m\d+", rest[0]):
        m = int(rest.pop(0)[1:])
        if not 1 <= m <= 16:
            raise ValueError(f"target {target!r}: M must be 1..16, got {m}")
    if len(rest) > 1:
        raise ValueError(f"target {target!r}: expected KIND:SHAPE:GROUP[:mM][:CONFIG], with M before CONFIG")
    config = rest[0] if rest else None
    if config is not None and kind != "int4":
        raise ValueError(f"target {target!r}: only int4 takes a CONFIG")
    return kind, shape, group_text, m, config


def make_call(target: str, device: str) -> Callable[[], object]:
    """The call TARGET names (M rows, 1 unless given), on fresh random weights (group-128 or per-channel INT4; bf16
    of the shape); or one decode attention call (q, K, V and mask as decode_attention_bench builds them)."""
    if target.startswith("attention:"):
        from research.kernels.decode_attention_bench import HIDDEN_TAIL, make_case
        from research.kernels.decode_attention_bench import MODELS as ATTENTION_MODELS
        from sdsie.kernels.decode_attention import decode_attention

        model, seq_len, splits = parse_attention_target(target)
        h_kv, groups, dim = ATTENTION_MODELS[model]
        q, k, v, mask = make_case(h_kv, groups, dim, seq_len, min(HIDDEN_TAIL, seq_len - 1), torch.bfloat16, device,
                                  torch.Generator().manual_seed(0))
        return lambda: decode_attention(q, k, v, mask, dim**-0.5, num_splits=splits)
    kind, shape, group_text, m, config_text = parse_target(target)
    n, k = shape_dims(shape)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    if kind == "bf16":
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device)
        return lambda: F.linear(x, w)
    w4 = random_int4(n, k, None if group_text == "pc" else 128, device, gen)
    if kind == "tinygemm":
        pack = tinygemm_pack(w4)
        if pack is None:
            raise ValueError(f"target {target!r}: tinygemm has no per-channel layout here")
        return lambda: torch.ops.aten._weight_int4pack_mm(x, pack[0], 128, pack[1])
    config = config_from_name(config_text) if config_text is not None else None
    return lambda: int4_matmul(x, w4, config=config)


def run(target: str) -> None:
    call = make_call(target, "cuda")
    for _ in range(WARMUP_CALLS):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def read_raw_csv(path: Path) -> list[dict[str, str]]:
    """ncu --csv --page raw: a header row of metric names, a row of units, then one row per kernel launch. ncu's
    own log lines (==PROF== ...) and the program's stdout come before the header."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f"{path}: no ncu raw CSV header (a line starting with \"ID\"); did ncu profile a kernel?")
    rows = list(csv.reader(lines[start:]))
    header, launches = rows[0], rows[2:]
    if not launches:
        raise ValueError(f"{path}: the CSV holds no kernel launch")
    return [dict(zip(header, r, strict=True)) for r in launches]


def number(text: str) -> float | str:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def summarize_launch(row: dict[str, str]) -> dict:
    """The METRICS and every warp stall ratio of one launch; a metric ncu did not report is named as missing."""
    out: dict = {"kernel": row.get("Kernel Name", "?"),
                 "missing": [name for name in METRICS.values() if name not in row]}
    out.update({key: number(row[name]) for key, name in METRICS.items() if name in row})
    stalls = {m.group(1): number(v) for name, v in row.items() if (m := STALL_PATTERN.match(name))}
    out["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1] if isinstance(kv[1], float) else 0))
    if isinstance(out.get("duration_ns"), float):
        moved = out.get("dram_bytes_read", 0.0) + out.get("dram_bytes_write", 0.0)
        out["dram_tb_per_s"] = moved / out["duration_ns"] / 1e3
    if isinstance(out.get("sm_cycles_active_max"), float) and out.get("sm_cycles_active_avg"):
        out["sm_active_max_over_avg"] = out["sm_cycles_active_max"] / out["sm_cycles_active_avg"]
    return out


def read_source_csv(path: Path) -> list[dict[str, str]]:
    """ncu --page source --print-source sass --csv: one row per SASS instruction, after a header starting "Address"."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f"{path}: no source-page header (a line starting with \"Address\")")
    rows = list(csv.reader(lines[start:]))
    header = rows[0]
    return [dict(zip(header, r, strict=False)) for r in rows[1:] if len(r) >= len(header) - 1]


def _opcode(sass: str) -> str:
    words = sass.split()
    words = words[1:] if words and words[0].startswith("@") else words  # predicate
    return words[0].split(".")[0] if words else "?"


def _shares(counter: dict[str, float], total: float, top: int) -> dict[str, float]:
    ranked = sorted(counter.items(), key=lambda kv: -kv[1])[:top]
    return {k: round(100 * v / total, 1) for k, v in ranked if v}


def summarize_source(path: Path, top: int = 20) -> dict:
    """Where one kernel's warps spent their sampled time: stall reasons (% of all samples), samples and executed
    instructions by opcode, and three segments told apart by execution count (the K loop is the run of instructions
    executed at least half as often as the most executed one; before it the prologue, after it the epilogue)."""
    rows = read_source_csv(path)
    samples = [float(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows]
    executed = [float(r["Instructions Executed"] or 0) for r in rows]
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total, total_exec = sum(samples), sum(executed)
    if not total or not total_exec:
        raise ValueError(f"{path}: no warp samples or executed instructions")
    hot = [i for i, e in enumerate(executed) if e >= 0.5 * max(executed)]
    segments = {"prologue": range(0, hot[0]), "loop": range(hot[0], hot[-1] + 1),
                "epilogue": range(hot[-1] + 1, len(rows))}

    def stalls(idx) -> dict[str, float]:
        acc: dict[str, float] = {}
        for i in idx:
            for c in stall_cols:
                acc[c[6:]] = acc.get(c[6:], 0.0) + float(rows[i][c] or 0)
        return _shares(acc, total, 8)

    by_op: dict[str, float] = {}
    exec_op: dict[str, float] = {}
    for r, s, e in zip(rows, samples, executed, strict=True):
        op = _opcode(r["Source"])
        by_op[op] = by_op.get(op, 0.0) + s
        exec_op[op] = exec_op.get(op, 0.0) + e
    ranked = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    return {
        "instructions": len(rows), "samples": total, "stalls_pct": stalls(range(len(rows))),
        "segments": {name: {"instructions": len(idx),
                            "samples_pct": round(100 * sum(samples[i] for i in idx) / total, 1),
                            "stalls_pct": stalls(idx)} for name, idx in segments.items()},
        "samples_by_opcode_pct": _shares(by_op, total, 14),
        "executed_by_opcode_pct": _shares(exec_op, total_exec, 14),
        "top_instructions": [{"sass": rows[i]["Source"].strip(), "samples": samples[i], "executed": executed[i],
                              "stalls": {c[6:]: float(rows[i][c]) for c in stall_cols if float(rows[i][c] or 0) > 0}}
                             for i in ranked],
    }


def summarize(paths: list[Path]) -> dict:
    """{target file stem: [launch summaries]} for the CSV files given."""
    return {p.stem: [summarize_launch(r) for r in read_raw_csv(p)] for p in paths}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile one call of TARGET (start under ncu --profile-from-start off)")
    r.add_argument("target")
    s = sub.add_parser("summarize", help="ncu raw CSVs -> one JSON")
    s.add_argument("csv", nargs="+", type=Path)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--source", type=Path, default=None, help="a source-page CSV (ncu_run.sh SOURCE_TARGET) to add")
    s.add_argument("--source-target", default=None, help="the target the source page profiled")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        if cuda_missing("ncu_probe run"):
            return 2
        run(args.target)
        return 0
    payload = {"probe": "ncu_probe", "launches": summarize(args.csv), "extra_metrics": list(EXTRA_METRICS)}
    if args.source is not None:
        payload["source_page"] = {"target": args.source_target, **summarize_source(args.source)}
    write_raw(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
