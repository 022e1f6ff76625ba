"""README's results section, generated from the committed run records (never typed by hand).

    python -m reproductions.readme_results            print the section
    python -m reproductions.readme_results --write    rewrite it in README.md
    python -m reproductions.readme_results --check    fail if README.md differs (run by `nox -s claims`)

Kernel medians are recomputed from the records' raw do_bench samples.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from sdsie.clutch import SEED_CLUTCHES
from sdsie.telemetry.records import RunRecord, load_records

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SHAPES = {  # N, K
    "qkv_o_4096x4096": (4096, 4096),
    "kv_1024x4096": (1024, 4096),
    "gate_up_14336x4096": (14336, 4096),
    "down_4096x14336": (4096, 14336),
    "lm_head_128256x4096": (128256, 4096),
}
FAMILIES = ("code", "physics", "poem")
KERNEL_TARGET = 3.0  # issue 4: M = 1 geometric-mean speedup over bf16 on the five Llama shapes


def newest(records: list[RunRecord], suite: str,
           variants: tuple[str, ...] | Callable[[RunRecord], bool] = ()) -> RunRecord | None:
    """The newest record of a suite; with `variants`, the newest whose run decoded all of them (a `--variants`
    subset run does not replace the full table, it adds its own), or, given a predicate, the newest it accepts."""
    def fits(r: RunRecord) -> bool:
        if callable(variants):
            return variants(r)
        return set(variants) <= set(r.config.get("variants", variants))

    rs = [r for r in records if r.suite == suite and fits(r)]
    return max(rs, key=lambda r: r.created) if rs else None


MAIN_DECODE = ("plain", "fixed_k5", "gated_production", "gated_tuned", "hf_assisted", "hf_generate")
K_SWEEP = ("plain_graphs", "fixed_k2_graphs", "fixed_k3_graphs", "fixed_k5_graphs")
GATED_GRAPHS = ("plain_graphs", "gated_production_graphs", "gated_tuned_graphs")
ADAPTIVE_PAIRS = (("fixed_k5_graphs", "fixed_k5_graphs_adaptive"),  # (constant K = 5, adaptive)
                  ("gated_tuned_graphs", "gated_tuned_graphs_adaptive"))
ADAPTIVE_RUN = ("plain_graphs", *(v for pair in ADAPTIVE_PAIRS for v in pair))
LONG_ADAPTIVE_RUN = ("plain_graphs", "fixed_k5_graphs", "fixed_k5_graphs_adaptive", "fixed_k8_graphs_adaptive")


def tree_run(rec: RunRecord) -> bool:
    """A decode that ran graphed plain decoding and a tree in every speculate cycle (decode_repro.TREES)."""
    from reproductions.decode_repro import TREES

    ran = set(rec.config.get("variants", ()))
    return "plain_graphs" in ran and bool(ran & set(TREES))


GATED_BOUND = 0.99  # issue 8: gated speculation never more than 1% slower than plain on the high-entropy family


def _int4_bytes(n: int, k: int, group: int | None, m: int) -> int:
    groups = -(-k // (group or k))
    return n * ((k + 1) // 2) + 2 * 2 * groups * n + 2 * m * k + 2 * m * n  # codes, bf16 scales+zeros, x, y


def kernel_section(rec: RunRecord) -> list[str]:
    med = {key: statistics.median(v) for key, v in rec.samples.items()}
    copy = rec.metrics["copy_bandwidth_gbs"]
    lines = [
        f"INT4 GEMV/GEMM vs cuBLAS bf16 and torch's tinygemm INT4 on the {rec.conditions['hardware']}, bf16 "
        f"activations, median `do_bench` with L2 flushed (record `{rec.source.name}`; copy bandwidth "
        f"{copy:.0f} GB/s):",
        "",
    ]
    mt = rec.metrics
    per_case_graphs = any(key.startswith("graph_us.") for key in mt)  # records from session 8 on
    lines += ["| N x K | M | group | bf16 us | INT4 us | speedup | % of copy BW | tinygemm us |"
              + (" graphed bf16 / INT4 us |" if per_case_graphs else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|" if per_case_graphs else "")]
    for shape, (n, k) in SHAPES.items():
        for m, g in [(1, "g128"), (1, "gNone"), (4, "g128"), (16, "g128")]:
            key = f"{shape}|m{m}|{g}"
            if f"{key}|int4" not in med:
                continue
            bf16, int4 = med[f"{key}|bf16"], med[f"{key}|int4"]
            group = None if g == "gNone" else 128
            pct = 100 * _int4_bytes(n, k, group, m) / (int4 * 1e-6) / 1e9 / copy
            tg = med.get(f"{key}|tinygemm")
            gb, gi = (mt.get(f"graph_us.{shape}.m{m}.g{group}.{name}") for name in ("bf16", "int4"))
            graphed = "-" if gb is None or gi is None else f"{gb:.1f} / {gi:.1f}"
            row = (f"| {n}x{k} | {m} | {group or 'channel'} | {bf16:.1f} | {int4:.1f} | {bf16 / int4:.2f}x | "
                   f"{pct:.0f}% | {'-' if tg is None else f'{tg:.1f}'} |")
            lines.append(row + (f" {graphed} |" if per_case_graphs else ""))
    verdict = "met" if mt["m1_g128_geomean_speedup"] >= KERNEL_TARGET else "**not met**"
    lines += [
        "",
        f"M=1 geometric-mean speedup over bf16: {mt['m1_g128_geomean_speedup']:.2f}x (group 128), "
        f"{mt['m1_gNone_geomean_speedup']:.2f}x (per channel); target {KERNEL_TARGET:.1f}x (group 128): {verdict}. "
        f"Bytes moved vs bf16: -{mt['m1_g128_bytes_reduction_pct_min']:.1f}% to "
        f"-{mt['m1_g128_bytes_reduction_pct_max']:.1f}% (group 128).",
    ]
    if "m1_g128_geomean_speedup_graph" in mt:
        lines.append(
            f"Under CUDA graphs (no host time; each call reads weights not in L2), M=1 geometric-mean speedup over "
            f"bf16: {mt['m1_g128_geomean_speedup_graph']:.2f}x (group 128), "
            f"{mt['m1_gNone_geomean_speedup_graph']:.2f}x (per channel).")
    for shape in ("down_4096x14336", "lm_head_128256x4096"):
        p, e = mt.get(f"power_change_pct_{shape}"), mt.get(f"energy_per_call_change_pct_{shape}")
        if p is not None:
            lines.append(f"Power at M=1, {shape}: INT4 {p:+.1f}% vs bf16, energy per call {e:+.1f}%.")
    return lines


def entropy_section(rec: RunRecord) -> list[str]:
    mt = rec.metrics
    return [
        f"Entropy at vocabulary 128256 ({rec.conditions['hardware']}, record `{rec.source.name}`): "
        f"{mt['no_sync_us']:.1f} us per call without a host sync, {mt['sync_us']:.1f} us with `.item()`: "
        f"sync cost {mt['sync_cost_us']:.1f} us ({mt['sync_cost_pct']:+.1f}%).",
    ]


def decode_section(rec: RunRecord) -> list[str]:
    mt = rec.metrics
    cfg = rec.config
    lines = [
        f"Decoding on the offline stand-in pair ({rec.conditions['model']}, {rec.conditions['hardware']}, "
        f"{cfg['trials']} interleaved trials, {cfg['max_new_tokens']} new tokens, record `{rec.source.name}`). "
        "Speedups are tokens/s over the plain loop on the same prompt; J/token from NVML windows:",
        "",
        "| family | plain tok/s | fixed-K5 | K5 acceptance | K5 J/token | gated tuned (fallback) | "
        "gated production (fallback) | HF assisted | HF generate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        if f"{f}.plain_tokens_per_s" not in mt:
            continue

        def pct(key: str) -> str:
            v = mt.get(key)
            return "-" if v is None else f"{v:.0f}%"

        lines.append(
            f"| {f} | {mt[f'{f}.plain_tokens_per_s']:.1f} | {mt[f'fixed_k5.{f}.speedup']:.2f}x | "
            f"{pct(f'fixed_k5.{f}.acceptance_pct')} | {-mt.get(f'fixed_k5.{f}.j_per_token_reduction_pct', 0):+.0f}% | "
            f"{mt[f'gated_tuned.{f}.speedup']:.2f}x ({pct(f'gated_tuned.{f}.fallback_pct')}) | "
            f"{mt[f'gated_production.{f}.speedup']:.2f}x ({pct(f'gated_production.{f}.fallback_pct')}) | "
            f"{mt[f'hf_assisted.{f}.speedup']:.2f}x | {mt[f'hf_generate.{f}.speedup']:.2f}x |"
        )
    nt = cfg.get("near_ties")
    if nt is None:
        ties = "bf16 near-tie check: not run in this record."
    else:
        ties = (f"bf16 batched verification vs single-token decoding on the code prompt: {nt.get('mismatch_count')} "
                f"argmax mismatch(es) in {nt.get('compared')} positions "
                f"(top-2 gaps {[m['single_gap'] for m in nt.get('mismatches', [])]}).")
    lines += [
        "",
        identity_line(rec)
        + f" Decision sequences identical across trials: {'yes' if mt['decisions_identical_across_trials'] else 'no'}. "
        + ties,
    ]
    lines += per_prompt_lines(rec)
    graphs = graphs_line(rec)
    if graphs:
        lines.append(graphs)
    if "code.entropy_bits_p50" in mt:  # records since the suite kept the plain runs' entropies
        q = "; ".join(f"{f} {mt[f'{f}.entropy_bits_p10']:.2f} / {mt[f'{f}.entropy_bits_p50']:.2f} / "
                      f"{mt[f'{f}.entropy_bits_p90']:.2f}" for f in FAMILIES if f"{f}.entropy_bits_p50" in mt)
        lines.append(f"Per-token entropy of plain decoding, bits, p10 / p50 / p90: {q}. The clutch engages when an "
                     "EMA of it falls below theta_low (production 0.55, tuned 0.15).")
    plain = [v for k, vs in rec.samples.items() if k.startswith("plain|") and k.endswith("|tokens_per_s") for v in vs]
    if plain:
        lines.append(f"Plain decoding over all its runs: {min(plain):.1f} to {max(plain):.1f} tok/s "
                     f"(median {statistics.median(plain):.1f}), the spread every ratio above sits in.")
    return lines


def k_sweep_section(rec: RunRecord) -> list[str]:
    """Fixed K = 2, 3, 5 under CUDA graphs against graphed plain decoding (paired by prompt and trial, 95% bootstrap
    interval), with acceptance, and the forwards' GPU time where the record measured it."""
    mt = rec.metrics
    ks = [int(v[len("fixed_k"):-len("_graphs")]) for v in K_SWEEP[1:]]
    lines = [f"Draft length under CUDA graphs ({rec.conditions['model']}, {rec.config['trials']} trials, record "
             f"`{rec.source.name}`): tokens/s over graphed plain decoding, paired by prompt and trial (median, 95% "
             "bootstrap interval), and the share of drafted tokens accepted:", "",
             "| family | plain graphs tok/s | " + " | ".join(f"K={k}" for k in ks) + " | acceptance K="
             + "/".join(map(str, ks)) + " |", "|---|---|" + "---|" * len(ks) + "---|"]
    for f in FAMILIES:
        if f"plain_graphs.{f}.tokens_per_s" not in mt:
            continue
        cells = []
        for k in ks:
            key = f"fixed_k{k}_graphs.{f}.paired_speedup_vs_plain_graphs"
            cells.append(f"{mt[key]:.2f}x ({mt[key + '_ci_low']:.2f}-{mt[key + '_ci_high']:.2f})" if key in mt else "-")
        acc = "/".join(f"{mt[f'fixed_k{k}_graphs.{f}.acceptance_pct']:.0f}%"
                       if f"fixed_k{k}_graphs.{f}.acceptance_pct" in mt else "-" for k in ks)
        lines.append(f"| {f} | {mt[f'plain_graphs.{f}.tokens_per_s']:.0f} | " + " | ".join(cells) + f" | {acc} |")
    fg = rec.config.get("forward_ms_graphs") or {}
    if "target_step_gpu_ms" in fg:
        lines += ["", f"Forwards on the graphed static cache, GPU time from CUDA events (wall): target step "
                      f"{fg['target_step_gpu_ms']:.3f} ms ({fg['target_step_ms']:.3f}), verify of K+1 = "
                      f"{fg['k'] + 1:.0f} tokens {fg['target_verify_gpu_ms']:.3f} ms ({fg['target_verify_ms']:.3f}), "
                      f"scout step {fg['scout_step_gpu_ms']:.3f} ms ({fg['scout_step_ms']:.3f}): a scout step costs "
                      f"{fg['scout_cost_ratio_gpu']:.3f} target steps."]
    return lines


def paired_cell(rec: RunRecord, variant: str, family: str, prompts: list[str]) -> tuple[float, float, float] | None:
    """`variant`'s tokens/s over graphed plain decoding paired by prompt and trial (median, 95% interval): the record's
    own metrics where it has them, else recomputed from its samples (records before the paired metrics)."""
    from sdsie.stats import paired_ratios, paired_speedup

    key = f"{variant}.{family}.paired_speedup_vs_plain_graphs"
    if key in rec.metrics:
        return rec.metrics[key], rec.metrics[key + "_ci_low"], rec.metrics[key + "_ci_high"]
    return paired_speedup(paired_ratios(rec.samples, variant, "plain_graphs", prompts))


def _prompts_by_family() -> dict[str, list[str]]:
    from reproductions.decode_repro import FAMILY_LABEL
    from sdsie.standin import load_prompts

    by_family: dict[str, list[str]] = {}
    for pr in load_prompts():
        by_family.setdefault(FAMILY_LABEL.get(pr.family, pr.family), []).append(pr.id)
    return by_family


def gated_graphs_section(rec: RunRecord) -> list[str]:
    """Chain-gated speculation (gated_production_graphs, gated_tuned_graphs) against plain decoding under CUDA graphs,
    with issue 8's bound, the clutch's host cost, the padded catch-up's A/B and the graphed loops' identity."""
    lines = _gated_lines(rec, {mode: f"gated_{mode}_graphs" for mode in SEED_CLUTCHES},
                         "Gated speculation against plain decoding")
    high = _high_entropy_family(rec)
    if high is None:  # _gated_lines said why the bound is not judged
        return lines
    mt = rec.metrics
    cu = rec.environment.get("clutch_update_us")
    if cu is not None:
        token_us = 1e6 / mt[f"plain_graphs.{high}.tokens_per_s"]
        lines.append(f"Where the clutch never engages, the gated loop runs plain decoding's GPU work plus one clutch "
                     f"update per token on the host: {cu['median']:.2f} us on this run's host, "
                     f"{100 * cu['median'] / token_us:.2f}% of a graphed plain token on {high} ({token_us:.0f} us).")
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in mt]
    lines += catch_up_lines(rec, fams, _prompts_by_family())
    graphed_identity = graphed_identity_line(rec)
    if graphed_identity:
        lines += ["", graphed_identity]
    return lines


def gated_tree_section(rec: RunRecord) -> list[str]:
    """Tree-gated speculation (decode_repro's GATED_TREES: the clutch picks a tree cycle or a plain step) against plain
    decoding under CUDA graphs, with issue 8's bound; beside the always-on tree when the run decoded it."""
    from reproductions.decode_repro import GATED_TREES, TREE_COMPILED

    widths = ",".join(map(str, rec.config.get("tree_widths") or ()))
    lines = _gated_lines(rec, GATED_TREES, f"Gated tree speculation (the clutch picks, per cycle, a {widths} tree with "
                                           "the compiled scout, its K the tree's depth, or a plain step)")
    mt, by_family = rec.metrics, _prompts_by_family()
    always = [f"{f} {_cell(c)}" for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in mt
              for c in [paired_cell(rec, TREE_COMPILED, f, by_family[f])] if c is not None]
    if always:
        lines += ["", f"The same tree in every cycle (`{TREE_COMPILED}`), in the same run: " + "; ".join(always) + "."]
    return lines


def _high_entropy_family(rec: RunRecord) -> str | None:
    """The family of highest median target entropy (plain runs' entropy_bits), None where a family lacks it."""
    mt = rec.metrics
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in mt]
    if not fams or any(f"{f}.entropy_bits_p50" not in mt for f in fams):
        return None
    return max(fams, key=lambda f: mt[f"{f}.entropy_bits_p50"])


def _gated_lines(rec: RunRecord, loops: dict[str, str], title: str) -> list[str]:
    """The table of gated loops ({clutch setting: variant}) against graphed plain decoding, paired by prompt and trial
    (median, 95% bootstrap interval, fallback share), and the bound the issue sets on the family of highest median
    entropy (where the clutch should stay out of the way)."""
    mt = rec.metrics
    by_family = _prompts_by_family()
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in mt]
    lines = [f"{title}, both under CUDA graphs ({rec.conditions['model']}, {rec.config['trials']} interleaved trials, "
             f"record `{rec.source.name}`): tokens/s ratio paired by prompt and trial (median, 95% bootstrap "
             "interval), and the share of cycles the clutch fell back:", "",
             "| family | p50 entropy (bits) | plain graphs tok/s | " + " | ".join(loops) + " |",
             "|---|---|---|" + "---|" * len(loops)]
    paired: dict[tuple[str, str], tuple[float, float, float] | None] = {}
    for f in fams:
        cells = []
        for mode, v in loops.items():
            got = paired[f, mode] = paired_cell(rec, v, f, by_family[f])
            fb = mt.get(f"{v}.{f}.fallback_pct")
            cells.append("-" if got is None else f"{got[0]:.3f}x ({got[1]:.3f}-{got[2]:.3f}), "
                         + (f"{fb:.0f}% fallback" if fb is not None else "fallback -"))
        lines.append(f"| {f} | {mt.get(f'{f}.entropy_bits_p50', float('nan')):.2f} | "
                     f"{mt[f'plain_graphs.{f}.tokens_per_s']:.0f} | " + " | ".join(cells) + " |")
    high = _high_entropy_family(rec)
    if high is None:
        return [*lines, "", "Issue 8's bound is not judged here: the record lacks a family's median entropy, so which "
                            "family is the high-entropy one is not known."]
    verdicts = [f"at the {mode} clutch {bound_verdict(paired[high, mode])}" for mode in loops
                if paired[high, mode] is not None]
    if verdicts:
        lines += ["", f"Issue 8's bound (gated never more than 1% slower than plain on the high-entropy family, here "
                      f"{high}): " + "; ".join(verdicts) + "."]
    return lines


def _cell(got: tuple[float, float, float] | None) -> str:
    return "-" if got is None else f"{got[0]:.3f}x ({got[1]:.3f}-{got[2]:.3f})"


def adaptive_section(rec: RunRecord) -> list[str]:
    """The adaptive draft length against a constant K = 5, both under CUDA graphs: each over graphed plain decoding,
    and adaptive over constant directly, paired by prompt and trial; per prompt where the two differ most."""
    from sdsie.stats import paired_ratios, paired_speedup

    mt = rec.metrics
    by_family = _prompts_by_family()
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in mt]
    lines = [f"The adaptive draft length (`DecodeConfig(k_schedule=\"adaptive\")`: K - 1 after a rejection, K + 2 "
             f"after a fully kept draft, within 1..5) against a constant K = 5, all under CUDA graphs "
             f"({rec.conditions['model']}, {rec.config['trials']} interleaved trials, record `{rec.source.name}`). "
             "Tokens/s ratios paired by prompt and trial (median, 95% bootstrap interval), with the share of drafted "
             "tokens accepted:", "",
             "| family | fixed-K5 | fixed-K5 adaptive | adaptive / constant | acceptance K5 / adaptive | gated tuned | "
             "gated tuned adaptive | adaptive / constant |", "|---|---|---|---|---|---|---|---|"]
    for f in fams:
        cells = []
        for const, adapt in ADAPTIVE_PAIRS:
            cells += [_cell(paired_cell(rec, const, f, by_family[f])), _cell(paired_cell(rec, adapt, f, by_family[f])),
                      _cell(paired_speedup(paired_ratios(rec.samples, adapt, const, by_family[f])))]
            if const.startswith("fixed"):
                acc = [mt.get(f"{v}.{f}.acceptance_pct") for v in (const, adapt)]
                cells.append("/".join("-" if a is None else f"{a:.0f}%" for a in acc))
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    per_prompt = []
    for const, adapt in ADAPTIVE_PAIRS:
        for pr in (pr for f in fams for pr in by_family[f]):
            got = paired_speedup(paired_ratios(rec.samples, adapt, const, [pr]))
            if got is not None and not got[1] <= 1.0 <= got[2]:  # the interval excludes no change
                per_prompt.append(f"{adapt} on {pr} {_cell(got)}")
    if per_prompt:
        lines += ["", "Prompts where adaptive and constant K differ (the paired interval excludes 1): "
                  + "; ".join(per_prompt) + "."]
    return lines


def long_adaptive_section(rec: RunRecord) -> list[str]:
    """Constant K = 5, adaptive with ceiling 5 and adaptive with ceiling 8 over graphed plain decoding, and each
    adaptive ceiling's ratio to the one before it (adaptive 5 / constant 5, adaptive 8 / adaptive 5), paired by
    prompt and trial."""
    from sdsie.stats import paired_ratios, paired_speedup

    by_family = _prompts_by_family()
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in rec.metrics]
    const, a5, a8 = LONG_ADAPTIVE_RUN[1:]
    lines = [f"The adaptive schedule's ceiling, K = 5 against K = 8, under CUDA graphs ({rec.conditions['model']}, "
             f"{rec.config['trials']} interleaved trials, record `{rec.source.name}`), paired by prompt and trial "
             "(median, 95% bootstrap interval):", "",
             "| family | constant K5 | adaptive K5 | adaptive K8 | adaptive K5 / constant K5 | "
             "adaptive K8 / adaptive K5 |",
             "|---|---|---|---|---|---|"]
    for f in fams:
        cells = [_cell(paired_cell(rec, v, f, by_family[f])) for v in (const, a5, a8)]
        cells += [_cell(paired_speedup(paired_ratios(rec.samples, a, b, by_family[f]))) for a, b in ((a5, const),
                                                                                                    (a8, a5))]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return lines


def tree_section(rec: RunRecord, records: list[RunRecord] = ()) -> list[str]:
    """Static-tree speculation (decode_repro's tree variants, TREES) beside the adaptive chain, each over graphed plain
    decoding paired by prompt and trial, with acceptance, tokens per cycle, J/token over energy windows, and issue 8's
    2.0x target on code judged on the best tree's interval; then greedy identity with graphed plain decoding and every
    divergence's logit gap."""
    from reproductions.decode_repro import TREE_COMPILED, TREE_FUSED, TREE_WIDTHS_KEY, TREES

    mt = rec.metrics
    by_family = _prompts_by_family()
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in mt]
    widths = {v: rec.config.get(TREE_WIDTHS_KEY[v]) for v in TREES}  # the gated trees have a section of their own
    trees = {v: w for v, w in widths.items() if w and v in rec.config.get("variants", ())}  # the trees it decoded
    chain = "fixed_k5_graphs_adaptive"
    scouts = {TREE_FUSED: ", fused scout norms", TREE_COMPILED: ", compiled scout"}
    names = {v: f"tree {','.join(map(str, w))}" + scouts.get(v, "") for v, w in trees.items()} | {
        chain: "adaptive K5 chain"}
    beside = ("beside the adaptive K = 5 chain" if any(paired_cell(rec, chain, f, by_family[f]) for f in fams)
              else "the adaptive K = 5 chain not decoded in this run")
    lines = ["Static-tree speculation (`DecodeConfig(tree_widths=(w1, ..., wD))`: the scout's top w1 tokens, then its "
             f"top-w below each node at each depth, all verified in one target forward), {beside}, "
             f"all under CUDA graphs ({rec.conditions['model']}, {rec.config['trials']} interleaved trials, "
             f"record `{rec.source.name}`). Tokens/s over graphed plain decoding paired by prompt and trial (median, "
             "95% bootstrap interval); acceptance is the share of drafted depths kept; tokens/cycle is derived as "
             "1 + depth x acceptance; J/token over energy windows against graphed plain's:", "",
             "| family | plain graphs tok/s | loop | speedup | acceptance | tokens/cycle | J/token |",
             "|---|---|---|---|---|---|---|"]
    for f in fams:
        for v, name in names.items():
            cell = paired_cell(rec, v, f, by_family[f])
            if cell is None:
                continue
            acc = mt.get(f"{v}.{f}.acceptance_pct")
            depth = len(trees[v]) if v in trees else None
            per_cycle = f"{1 + depth * acc / 100:.2f}" if acc is not None and depth else "-"
            j = mt.get(f"{v}.{f}.j_per_token_window_ratio")
            lines.append(f"| {f} | {mt[f'plain_graphs.{f}.tokens_per_s']:.0f} | {name} | "
                         f"{_cell(cell)} | "
                         + ("-" if acc is None else f"{acc:.0f}%") + f" | {per_cycle} | "
                         + ("-" if j is None else f"{j:.3f}x") + " |")
    cells = {v: paired_cell(rec, v, "code", by_family["code"]) for v in trees} if "code" in fams else {}
    cells = {v: c for v, c in cells.items() if c is not None}
    if cells:
        best = max(cells, key=lambda v: cells[v][1])  # the tree whose interval's low end is highest
        code = cells[best]
        met = "**met**" if code[1] >= 2.0 else "**not met**"
        lines += ["", f"Issue 8's target of 2.0x on code: {met} by the best tree, {names[best]} ({code[0]:.3f}x, "
                      f"interval {code[1]:.3f}-{code[2]:.3f}); its J/token target (40% lower): "
                  + ("**met**" if (mt.get(f"{best}.code.j_per_token_window_ratio") or 1.0) <= 0.6 else "**not met**")
                  + "."]
        lines += replication_lines(rec, records, best, names[best])
    graphed_identity = graphed_identity_line(rec)
    if graphed_identity:
        lines += ["", graphed_identity]
    return lines


def replication_lines(rec: RunRecord, records: list[RunRecord], variant: str, name: str) -> list[str]:
    """Every record that decoded `variant` with `rec`'s widths, oldest first, and its paired ratio on code: each run
    on its own (none is pooled or picked), so a replication shows beside the run it repeats."""
    from reproductions.decode_repro import TREE_WIDTHS_KEY

    key = TREE_WIDTHS_KEY[variant]
    same = sorted((r for r in records if r.suite == rec.suite and variant in r.config.get("variants", ())
                   and r.config.get(key) == rec.config.get(key)), key=lambda r: r.created)
    by_family = _prompts_by_family()
    cells = [f"`{r.source.name}` ({r.config['trials']} trials) "
             f"{_cell(paired_cell(r, variant, 'code', by_family['code']))}" for r in same]
    if len(cells) < 2:
        return []
    return ["", f"Every run of the {name} on code, oldest first, each paired against graphed plain decoding in its own "
                "run: " + "; ".join(cells) + "."]


def energy_window_section(rec: RunRecord) -> list[str]:
    """The graphed loops' J/token over windows of back-to-back runs (decode_repro.energy_windows), against graphed
    plain decoding on the same prompts; nothing for a record without them."""
    mt = rec.metrics
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.j_per_token_window" in mt]
    if not fams:
        return []
    variants = sorted({k.split(".")[0] for k in mt if k.endswith(".j_per_token_window_ratio")})
    lines = [f"Energy of the graphed loops over windows of back-to-back runs of at least "
             f"{rec.config.get('energy_window_s')} s per variant and prompt (record `{rec.source.name}`): J/token, "
             "and its ratio to graphed plain decoding's on the same prompts (below 1: less energy per token):", "",
             "| family | plain graphs J/token | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for f in fams:
        cells = [f"{mt[f'{v}.{f}.j_per_token_window_ratio']:.3f}x" if f"{v}.{f}.j_per_token_window_ratio" in mt
                 else "-" for v in variants]
        lines.append(f"| {f} | {mt[f'plain_graphs.{f}.j_per_token_window']:.4f} | " + " | ".join(cells) + " |")
    return lines


def bound_verdict(got: tuple[float, float, float]) -> str:
    """Issue 8's 1% bound judged from a paired ratio's (median, interval low, interval high)."""
    if got[1] >= GATED_BOUND:
        return f"**met** (the interval's low end is {got[1]:.3f})"
    if got[2] < GATED_BOUND:
        return f"**missed** ({got[0]:.3f}x: the whole interval lies below {GATED_BOUND})"
    if got[2] < 1.0:
        return (f"**not established** ({got[0]:.3f}x: slower than plain, by {100 * (1 - got[2]):.1f}-"
                f"{100 * (1 - got[1]):.1f}% over the interval, which straddles the bound)")
    return (f"**not established** (the median is {got[0]:.3f}, but the interval reaches {got[1]:.3f}, so this "
            f"resolution cannot tell a 1% cost from none)")


def graphed_identity_line(rec: RunRecord) -> str | None:
    """Greedy identity of the graphed loops with graphed plain decoding of the same trial (and of graphed plain with
    eager plain), and every divergence with its plain top-2 logit gap and the trials it happened in."""
    from reproductions.decode_repro import GRAPHED

    mt = rec.metrics
    parts = [f"{v} {mt[f'{v}.fidelity_pct']:.1f}%" for v in GRAPHED if f"{v}.fidelity_pct" in mt]
    if not parts:
        return None
    gaps = [m for m in rec.config.get("mismatches", []) if m["variant"] in GRAPHED]
    where = "; ".join(f"{m['variant']} {m['prompt']} @{m['position']} gap "
                      + (f"{m['plain_gap']:.4f}" if m["plain_gap"] is not None else "- (length)")
                      + f" in trial(s) {','.join(str(t) for t in m['trials'])}" for m in gaps)
    return ("Greedy token identity of the graphed loops with graphed plain decoding of the same prompt and trial "
            f"(plain_graphs: with eager plain), % of runs: {', '.join(parts)}. "
            + (f"Divergences (variant, prompt, position, plain top-2 logit gap): {where}." if gaps else
               "No divergence."))


def catch_up_lines(rec: RunRecord, fams: list[str], by_family: dict[str, list[str]]) -> list[str]:
    """The tuned clutch with the scout's catch-up padded and replayed (the default) against the same clutch with it
    eager, paired run by run, on each prompt where the clutch engaged (elsewhere the scout never catches up)."""
    from reproductions.decode_repro import UNPADDED
    from sdsie.stats import paired_ratios, paired_speedup

    decisions = rec.config.get("decisions", {})
    cells = []
    for pr in (pr for f in fams for pr in by_family[f]):
        engaged = any("S" in d for k, d in decisions.items() if k.startswith(f"gated_tuned_graphs|{pr}|"))
        if not engaged or f"{UNPADDED}|{pr}|tokens_per_s" not in rec.samples:
            continue
        ratio = {(a, b): paired_speedup(paired_ratios(rec.samples, a, b, [pr]))
                 for a, b in (("gated_tuned_graphs", UNPADDED), ("gated_tuned_graphs", "plain_graphs"),
                              (UNPADDED, "plain_graphs"))}
        if None in ratio.values():
            continue
        (r, lo, hi), padded, eager = ratio.values()
        cells.append(f"{pr} {r:.3f}x ({lo:.3f}-{hi:.3f}); against plain graphs {padded[0]:.3f}x "
                     f"({padded[1]:.3f}-{padded[2]:.3f}) padded, {eager[0]:.3f}x ({eager[1]:.3f}-{eager[2]:.3f}) eager")
    if not cells:
        return []
    return ["", "The tuned clutch's scout catch-up padded to a captured size and replayed, over the same clutch with "
                f"an eager catch-up (`{UNPADDED}`), paired by trial on each prompt where the clutch engaged: "
                + "; ".join(cells) + "."]


def graphs_line(rec: RunRecord) -> str | None:
    """Tokens/s of the CUDA-graph variants per family, against the eager plain loop and against each other; None
    for a record without them."""
    mt = rec.metrics
    fams = [f for f in FAMILIES if f"plain_graphs.{f}.tokens_per_s" in mt and f"fixed_k5_graphs.{f}.tokens_per_s" in mt]
    if not fams:
        return None
    per = "; ".join(f"{f} {mt[f'plain_graphs.{f}.tokens_per_s']:.0f} tok/s ({mt[f'plain_graphs.{f}.speedup']:.1f}x the "
                    f"eager plain loop) and {mt[f'fixed_k5_graphs.{f}.tokens_per_s']:.0f} tok/s "
                    f"({mt[f'fixed_k5_graphs.{f}.speedup_vs_plain_graphs']:.2f}x plain with graphs)" for f in fams)
    line = ("With a static KV cache and CUDA graphs (`DecodeConfig(kv_cache=\"static\", cuda_graphs=True)`), plain "
            f"decoding and fixed-K5: {per}.")
    gated = []
    for mode in ("production", "tuned"):
        keys = {f: f"gated_{mode}_graphs.{f}.speedup_vs_plain_graphs" for f in fams}
        if all(k in mt for k in keys.values()):
            gated.append(f"{mode} " + ", ".join(f"{f} {mt[k]:.3f}x" for f, k in keys.items()))
    if gated:
        line += (" Gated speculation with graphs, tokens/s over plain with graphs (what the clutch costs where it "
                 f"rarely engages, timed without the eager loop's host noise): {'; '.join(gated)}.")
        paired = gated_paired_cells(rec)
        if paired:
            line += (" Paired with the graphed plain run of the same prompt and trial, median and 95% bootstrap "
                     f"interval: {paired}.")
    return line


def gated_paired_cells(rec: RunRecord) -> str:
    """Each gated graph loop's paired ratio to plain_graphs per family, with its interval, from raw samples."""
    by_family = _prompts_by_family()
    cells = []
    for mode in ("production", "tuned"):
        parts = []
        for fam in FAMILIES:
            got = paired_cell(rec, f"gated_{mode}_graphs", fam, by_family[fam])
            if got is not None:
                parts.append(f"{fam} {got[0]:.3f}x ({got[1]:.3f}-{got[2]:.3f})")
        if parts:
            cells.append(f"{mode} " + ", ".join(parts))
    return "; ".join(cells)


def per_prompt_lines(rec: RunRecord) -> list[str]:
    """Fixed-K5 and HF assisted speedup per prompt (median tok/s over median plain tok/s, from raw samples):
    a family's median pools prompts on which the scout agrees very differently."""
    def med(variant: str, prompt: str) -> float | None:
        vals = rec.samples.get(f"{variant}|{prompt}|tokens_per_s")
        return statistics.median(vals) if vals else None

    prompts = sorted({k.split("|")[1] for k in rec.samples if k.startswith("plain|") and k.endswith("|tokens_per_s")})
    cells = []
    for pr in prompts:
        base, k5, hf = med("plain", pr), med("fixed_k5", pr), med("hf_assisted", pr)
        if base and k5:
            cells.append(f"{pr} {k5 / base:.2f}x" + (f" (HF assisted {hf / base:.2f}x)" if hf else ""))
    return ["", "Fixed-K5 speedup per prompt: " + "; ".join(cells) + "."] if len(cells) > 1 else []


def identity_line(rec: RunRecord) -> str:
    """Greedy identity with plain decoding: per variant where the record has it, else the pooled figure it has."""
    mt = rec.metrics
    if "fixed_k5.fidelity_pct" not in mt:  # records before per-variant accounting pooled HF assisted with ours
        return (f"Greedy token identity with plain decoding, pooled over fixed-K5, both gated variants and HF "
                f"assisted generation: {mt['fidelity_pct']:.1f}% of runs (this record keeps no per-variant or "
                f"per-run identity, so it does not say which runs differed).")
    parts = ", ".join(f"{v.replace('_', ' ')} {mt[f'{v}.fidelity_pct']:.0f}%"
                      for v in ("fixed_k5", "gated_production", "gated_tuned", "hf_assisted")
                      if f"{v}.fidelity_pct" in mt)
    gaps = [(m["variant"], m["prompt"], m["position"], m["plain_gap"]) for m in rec.config.get("mismatches", [])]
    where = ("; divergences (variant, prompt, position, plain top-2 logit gap): "
             + "; ".join(f"{v} {p} @{i} gap {g:.3f}" if g is not None else f"{v} {p} @{i} (length)"
                         for v, p, i, g in gaps)) if gaps else "; no divergence"
    return f"Greedy token identity with plain decoding, % of runs: {parts}{where}."


def fidelity_section(rec: RunRecord) -> list[str]:
    return [
        f"Resolution Gear fidelity: greedy tokens matching full precision when `mlp.down_proj` of 1, 2, 4 or all "
        f"layers runs in INT4, per calibration scheme ({rec.conditions['model']}, {rec.conditions['hardware']}, "
        f"{rec.config['max_new_tokens']} tokens per prompt, record `{rec.source.name}`):",
        "",
        *rec.config["table"].strip().splitlines(),
    ]


def gear_section(rec: RunRecord) -> list[str]:
    mt = rec.metrics
    parts = [f"{f}: INT4 on {mt[f'gear.{f}.int4_usage_pct']:.0f}% of tokens, "
             f"tok/s {mt[f'gear.{f}.throughput_change_pct']:+.1f}%, power {mt[f'gear.{f}.power_change_pct']:+.1f}%"
             for f in FAMILIES if f"gear.{f}.int4_usage_pct" in mt]
    return [f"Resolution Gear usage at the production clutch ({rec.config['trials']} trials, "
            f"{rec.config['max_new_tokens']} tokens, record `{rec.source.name}`): " + "; ".join(parts) + "."]


def grid_section(rec: RunRecord) -> list[str]:
    mt = rec.metrics
    if mt.get("grid.trials_per_cell", 0) < 3:  # the seed's N; fewer is not a measurement of a threshold map
        return [f"Threshold grid: the newest record (`{rec.source.name}`) has {mt.get('grid.trials_per_cell', 0):.0f} "
                "trial(s) per cell, fewer than the seed's 3; not reported."]
    rows = [f"| {f} | {mt[f'grid.production.{f}.throughput_change_pct']:+.1f}% | "
            f"{mt[f'grid.tuned.{f}.throughput_change_pct']:+.1f}% | "
            f"{mt[f'grid.best.{f}.throughput_change_pct']:+.1f}% |"
            for f in FAMILIES if f"grid.production.{f}.throughput_change_pct" in mt]
    loops = "loops under CUDA graphs" if rec.config.get("cuda_graphs") else "eager loops"
    return [f"Threshold grid ({mt['grid.configs']:.0f} settings x {mt['grid.trials_per_cell']:.0f} trials, {loops}, "
            f"one prompt per family, record `{rec.source.name}`), tok/s vs plain decoding:", "",
            "| family | production | tuned | best setting |", "|---|---|---|---|", *rows]


def render(records_dir: Path = Path("telemetry")) -> str:
    from reproductions.decode_repro import GATED_TREES

    records = load_records(records_dir)
    out = [BEGIN, "", "_Generated by `python -m reproductions.readme_results --write` from `telemetry/`._", ""]
    # (suite, section, variants its record must have decoded, optional: left out while no record has it)
    sections = (("kernel_int4", kernel_section, (), False), ("entropy_overhead", entropy_section, (), False),
                ("decode_standin", decode_section, MAIN_DECODE, False),
                ("decode_standin", k_sweep_section, K_SWEEP, True),
                ("decode_standin", gated_graphs_section, GATED_GRAPHS, True),
                ("decode_standin", adaptive_section, ADAPTIVE_RUN, True),
                ("decode_standin", long_adaptive_section, LONG_ADAPTIVE_RUN, True),
                ("decode_standin", energy_window_section, ("plain_graphs", "gated_production_graphs"), True),
                ("decode_standin", functools.partial(tree_section, records=records), tree_run, True),
                ("decode_standin", gated_tree_section, ("plain_graphs", *GATED_TREES.values()), True),
                ("resolution_gear_fidelity", fidelity_section, (), False),
                ("resolution_gear_usage", gear_section, (), False), ("threshold_grid", grid_section, (), False))
    for suite, fn, variants, optional in sections:
        rec = newest(records, suite, variants)
        if rec is None and optional:
            continue
        lines = fn(rec) if rec else [f"No `{suite}` record yet: run `nox -s gpu_repro` on a GPU."]
        if lines:  # a section with nothing to show for this record (energy windows before they existed) is left out
            out += [*lines, ""]
    out.append(END)
    return "\n".join(out)


def _replace(readme: str, section: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md lacks the {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + section + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    a = p.parse_args(argv)
    section = render()
    if not (a.write or a.check):
        print(section)
        return 0
    readme = a.readme.read_text()
    updated = _replace(readme, section)
    if a.write:
        a.readme.write_text(updated)
        return 0
    if updated != readme:
        print("README.md's results section is stale: run `python -m reproductions.readme_results --write`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
