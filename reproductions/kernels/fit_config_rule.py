"""Fit the INT4 kernel's configuration rule to an exhaustive shape sweep and score it on model families held out.

Reads a `shape_bench --sweep` JSON (every candidate configuration's graphed, L2-cold time on each decoder shape) and,
per kernel family (one-row GEMV programs from the M = 1 cases, planes from the M = 16 cases):

1. picks a short list of candidates greedily (each added where it most lowers the geometric mean of the list's best
   time over the exhaustive best),
2. fits their costs, linear in the shape's arithmetic (`sdsie.kernels.int4_config.rule_features`: kilobytes the busiest
   SM reads, the chain of K tiles), by non-negative least squares on relative error,
3. scores the rule leave-one-model-family-out: both steps rerun without a family, then that family's shapes are chosen
   for by the rule fitted without them.

It prints per held-out family the rule's time over the exhaustive best, and per (M, group) the geometric-mean speedup
over bf16 and the count of shapes faster than tinygemm for: the shipped choice the sweep ran beside (`sdsie`), the
rule held out, the rule fitted on everything (in sample), and a tuned table holding each shape's sweep best.

    python -m reproductions.kernels.fit_config_rule                      # tables
    python -m reproductions.kernels.fit_config_rule --emit               # the fitted RULE_FAMILIES, as Python
    python -m reproductions.kernels.fit_config_rule --write-table sdsie/kernels/tuned_configs.json \
        --data telemetry/raw/shape_fit_choice_sweep_m1_to_m16_h200.json   # each case's pick (best_table)
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from reproductions.kernels.int4_bench import config_name
from sdsie.kernels import Int4KernelConfig
from sdsie.kernels.device import DEFAULT_SMS
from sdsie.kernels.int4_config import (
    GEMV_MAX_M,
    MMA_M1_PROGRAMS_AN_SM_DEFAULT,
    RuleFamily,
    RuleTerm,
    mma_config,
    mma_m1_programs_an_sm,
    rule_choice,
    rule_features,
    tuned_key,
)
from sdsie.kernels.int4_tune import CORRECT_REL_ERROR, choice_configs
from sdsie.stats import geomean

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "telemetry/raw/shape_sweep_m1_m16_h200.json"
# the sweeps of the choice's own candidates (mma GEMV included) over the fitted shapes that the shipped table's
# entries come from (best_table with KEEP_WITHIN), one a GPU model
TABLE_DATA = tuple(Path(__file__).resolve().parents[2] / "telemetry/raw" / name for name in (
    "shape_fit_choice_sweep_m1_to_m16_h200.json", "shape_fit_choice_sweep_m1_to_m16_h100.json"))
# A table entry keeps the configuration the choice ran in the sweep unless another candidate was faster by more than
# this: the same configuration timed twice in one run differs by up to 9% on large shapes (the sdsie arm against its
# own sweep timing, shape_fit_choice_sweep_m1_to_m16_h200.json), so smaller wins are not evidence.
KEEP_WITHIN = 0.03
CORRECT = CORRECT_REL_ERROR  # a configuration's result counts when its relative error is under this
TARGET = 1 / 0.9  # a held-out shape should run at >= 90% of its exhaustive best's speed


@dataclass(frozen=True)
class FamilySpec:
    """How one kernel family's rule is fitted: from the cases at `fit_m`, serving M <= max_m, `size` candidates,
    and the shared constants of `rule_features` (chosen by scanning the held-out score over spread in {1, 1.5, 2} and
    programs_per_sm in {1, 2, 4, 8}: docs/kernel-log.md, 2026-12-03)."""

    fit_m: int
    max_m: int
    size: int
    spread: float
    programs_per_sm: int


SPECS = (FamilySpec(fit_m=1, max_m=GEMV_MAX_M, size=6, spread=1.0, programs_per_sm=2),
         FamilySpec(fit_m=16, max_m=16, size=6, spread=1.5, programs_per_sm=2))


def model_family(shape: str) -> str:
    """The model family of a shape named model.layer: the model without its size (Qwen2.5-7B.down -> Qwen2.5)."""
    return re.sub(r"-\d+(\.\d+)?B$", "", shape.rsplit(".", 1)[0])


@dataclass(frozen=True)
class Case:
    family: str  # model family of the shape's first listing (model_family)
    shape: str
    n: int
    k: int
    m: int
    group: str  # "128" or "pc"
    times: dict[str, float]  # correct sweep configurations' graphed us
    bf16: float
    sdsie: float  # the shipped choice the sweep ran beside
    tinygemm: float | None
    choice: str | None = None  # that choice's sweep name

    @property
    def group_size(self) -> int:
        return self.k if self.group == "pc" else int(self.group)

    @property
    def best(self) -> float:
        return min(self.times.values())


def load(path: Path) -> tuple[list[Case], dict[str, Int4KernelConfig], dict]:
    """The sweep's cases, its configurations by sweep name, and its meta block."""
    raw = json.loads(Path(path).read_text())
    configs = {name: Int4KernelConfig(**fields) for name, fields in raw["meta"]["sweep_configs"].items()}
    cases = []
    for c in raw["cases"]:
        sw = c.get("sweep", {})
        times = {n: t for n, t in sw.get("graph_us", {}).items() if sw["errors"][n] < CORRECT}
        if not times:
            continue
        g = c["graph_us"]
        cases.append(Case(model_family(c["shape"]), c["shape"], c["n"], c["k"], c["m"], c["group"], times, g["bf16"],
                          g["sdsie"], g.get("tinygemm"), c.get("sdsie_config")))
    return cases, configs, raw["meta"]


def greedy_candidates(cases: list[Case], size: int) -> list[str]:
    """`size` sweep names, each added where it most lowers the geometric mean over `cases` of the list's best time
    over the exhaustive best (a name missing on a case counts as never chosen there)."""
    names = sorted(set().union(*(c.times for c in cases)))
    logs = {n: np.array([math.log(c.times.get(n, math.inf) / c.best) for c in cases]) for n in names}
    chosen: list[str] = []
    floor = np.full(len(cases), math.inf)
    for _ in range(min(size, len(names))):
        best = min((n for n in names if n not in chosen), key=lambda n: (np.minimum(floor, logs[n]).sum(), n))
        chosen.append(best)
        floor = np.minimum(floor, logs[best])
    return chosen


def fit_family(spec: FamilySpec, cases: list[Case], configs: dict[str, Int4KernelConfig], sms: int) -> RuleFamily:
    """The family's candidates and costs fitted on `cases` (those at spec.fit_m): per candidate per_kb and fixed_us,
    a shared per_tile_us, non-negative, least squares on the relative error of every (case, candidate) time."""
    from scipy.optimize import nnls

    mine = [c for c in cases if c.m == spec.fit_m]
    names = greedy_candidates(mine, spec.size)
    width = 2 * len(names) + 1
    rows, ones = [], []
    for j, name in enumerate(names):
        for c in mine:
            if name not in c.times:
                continue
            kb, chain = rule_features(configs[name], c.m, c.n, c.k, c.group_size, sms, spec.spread,
                                      spec.programs_per_sm)
            row = np.zeros(width)
            row[j], row[len(names) + j], row[-1] = kb, 1.0, chain
            rows.append(row / c.times[name])
            ones.append(1.0)
    sol, _ = nnls(np.array(rows), np.array(ones))
    terms = tuple(RuleTerm(configs[n], float(sol[j]), float(sol[len(names) + j])) for j, n in enumerate(names))
    return RuleFamily(spec.max_m, spec.spread, spec.programs_per_sm, float(sol[-1]), terms)


def fit_rule(cases: list[Case], configs: dict[str, Int4KernelConfig], sms: int,
             specs: tuple[FamilySpec, ...] = SPECS) -> tuple[RuleFamily, ...]:
    return tuple(fit_family(s, cases, configs, sms) for s in specs)


def rule_time(rule: tuple[RuleFamily, ...], case: Case, sms: int) -> tuple[str, float]:
    """The rule's configuration for the case (its family is the one fitted at the case's M) and its sweep time."""
    family = next(f for f in rule if case.m <= f.max_m)
    name = config_name(rule_choice(family, case.m, case.n, case.k, case.group_size, sms))
    return name, case.times.get(name, math.inf)


def held_out(cases: list[Case], configs: dict[str, Int4KernelConfig], sms: int,
             specs: tuple[FamilySpec, ...] = SPECS) -> dict[tuple, tuple[str, float]]:
    """Per case (family, shape, m, group): the configuration and time of the rule fitted without its model family."""
    out = {}
    for fam in sorted({c.family for c in cases}):
        rule = fit_rule([c for c in cases if c.family != fam], configs, sms, specs)
        for c in cases:
            if c.family == fam:
                out[(c.family, c.shape, c.m, c.group)] = rule_time(rule, c, sms)
    return out


def _key(c: Case) -> tuple:
    return (c.family, c.shape, c.m, c.group)


def scores(cases: list[Case], configs: dict[str, Int4KernelConfig], sms: int) -> dict:
    """Held-out and in-sample results: per case, per held-out family and per (M, group)."""
    out_rule = held_out(cases, configs, sms)
    full = fit_rule(cases, configs, sms)
    per_case = []
    for c in cases:
        name, t = out_rule[_key(c)]
        in_name, t_in = rule_time(full, c, sms)
        per_case.append({"family": c.family, "shape": c.shape, "n": c.n, "k": c.k, "m": c.m, "group": c.group,
                         "best": min(c.times, key=c.times.get), "best_us": c.best, "held_out": name,
                         "held_out_us": t, "held_out_over_best": t / c.best, "in_sample": in_name,
                         "in_sample_over_best": t_in / c.best, "sdsie_over_best": c.sdsie / c.best})
    families = {}
    for fam in sorted({c.family for c in cases}):
        rs = [p["held_out_over_best"] for p in per_case if p["family"] == fam]
        families[fam] = {"cases": len(rs), "geomean_over_best": geomean(rs), "max_over_best": max(rs),
                         "within_target": sum(r <= TARGET for r in rs)}
    groups = {}
    for m, g in sorted({(c.m, c.group) for c in cases}):
        cs = [(c, p) for c, p in zip(cases, per_case, strict=True) if c.m == m and c.group == g]
        arms = {"sdsie": [c.sdsie for c, _ in cs], "rule_held_out": [p["held_out_us"] for _, p in cs],
                "rule_in_sample": [c.best * p["in_sample_over_best"] for c, p in cs],
                "table_best": [c.best for c, _ in cs]}
        row = {"shapes": len(cs)}
        for arm, ts in arms.items():
            row[f"{arm}_geomean_speedup"] = geomean([c.bf16 / t for (c, _), t in zip(cs, ts, strict=True)])
            tg = [(c.tinygemm, t) for (c, _), t in zip(cs, ts, strict=True) if c.tinygemm is not None]
            if tg:
                row[f"{arm}_beats_tinygemm"] = f"{sum(t < ref for ref, t in tg)}/{len(tg)}"
        if any(c.tinygemm is not None for c, _ in cs):
            row["tinygemm_geomean_speedup"] = geomean([c.bf16 / c.tinygemm for c, _ in cs if c.tinygemm])
        rs = [p["held_out_over_best"] for _, p in cs]
        row["held_out_max_over_best"] = max(rs)
        row["held_out_within_target"] = f"{sum(r <= TARGET for r in rs)}/{len(rs)}"
        groups[f"m{m}.g{g}"] = row
    return {"per_case": per_case, "families": families, "groups": groups}


def choice_only(configs: dict[str, Int4KernelConfig]) -> dict[str, Int4KernelConfig]:
    """The swept configurations the choice can return (`choice_configs`): the candidates of a table entry."""
    choice = set(choice_configs())
    return {name: cfg for name, cfg in configs.items() if cfg in choice}


def best_table(cases: list[Case], configs: dict[str, Int4KernelConfig], keep_within: float = 0.0,
               sms: int = DEFAULT_SMS, m1_programs_an_sm: float = MMA_M1_PROGRAMS_AN_SM_DEFAULT
               ) -> dict[str, Int4KernelConfig]:
    """{tuned_key: the sweep's fastest correct configuration among `configs`} for each case; with `keep_within` > 0,
    the configuration the choice ran instead where its sweep time is within that fraction of the fastest.

    No entry where the mma GEMV's rule (`mma_config`, on a GPU of `sms` SMs and its M = 1 threshold) takes the case
    and the sweep did not time its pick: the entry would stand, measured, against a candidate it was never measured
    beside (the H200's sweep times the mma GEMV at M <= 8 only)."""
    out = {}
    for c in cases:
        times = {n: t for n, t in c.times.items() if n in configs}
        rule = mma_config(c.m, c.n, c.k, c.group_size, sms, m1_programs_an_sm)
        if not times or (rule is not None and config_name(rule) not in times):
            continue
        pick = min(times, key=times.get)
        if keep_within > 0 and c.choice in times and times[c.choice] <= times[pick] * (1 + keep_within):
            pick = c.choice
        out[tuned_key(c.m, c.n, c.k, c.group_size)] = configs[pick]
    return out


def write_table(path: Path, device: str, table: dict[str, Int4KernelConfig], covered: set[str]) -> None:
    """Write `table` into the tuned table at `path` under `device`: the keys in `covered` (the sweep's cases) are
    the table's to set or to clear; the device's other entries stay."""
    raw = json.loads(path.read_text()) if path.exists() else {}
    entries = {key: v for key, v in raw.get(device, {}).items() if key not in covered}
    entries.update({key: asdict(cfg) for key, cfg in table.items()})
    raw[device] = dict(sorted(entries.items()))
    path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")


def emit(rule: tuple[RuleFamily, ...]) -> str:
    """RULE_FAMILIES as Python source (sdsie/kernels/int4_config.py)."""
    def cfg(c: Int4KernelConfig) -> str:
        d = Int4KernelConfig(c.block_m, c.block_n, c.block_k)
        extra = [f"{f}={getattr(c, f)!r}" for f in ("split_k", "num_warps", "num_stages", "x_tile", "swap_ab")
                 if getattr(c, f) != getattr(d, f)]
        return f"Int4KernelConfig({c.block_m}, {c.block_n}, {c.block_k}{''.join(', ' + e for e in extra)})"

    lines = ["RULE_FAMILIES: tuple[RuleFamily, ...] = ("]
    for f in rule:
        lines.append(f"    RuleFamily({f.max_m}, {f.spread!r}, {f.programs_per_sm}, {f.per_tile_us:.6g}, (")
        lines += [f"        RuleTerm({cfg(t.config)}, {t.per_kb:.6g}, {t.fixed_us:.6g})," for t in f.terms]
        lines.append("    )),")
    lines.append(")")
    return "\n".join(lines)


def print_tables(s: dict) -> None:
    print(f"held out, per model family: the rule's time over the exhaustive best (target <= {TARGET:.2f}x)")
    print(f"  {'family':14s} {'cases':>5s} {'geomean':>8s} {'max':>6s} {'<= target':>9s}")
    for fam, r in s["families"].items():
        print(f"  {fam:14s} {r['cases']:5d} {r['geomean_over_best']:8.3f} {r['max_over_best']:6.3f} "
              f"{r['within_target']:5d}/{r['cases']}")
    print("\nper M and group: geomean speedup over bf16 (shapes faster than tinygemm)")
    arms = ("sdsie", "rule_held_out", "rule_in_sample", "table_best")
    print(f"  {'case':9s} {'shapes':>6s} " + " ".join(f"{a:>20s}" for a in arms) + f" {'tinygemm':>9s} "
          f"{'held-out max':>12s} {'<= target':>9s}")
    for key, r in s["groups"].items():
        cells = []
        for a in arms:
            tg = r.get(f"{a}_beats_tinygemm")
            cells.append(f"{r[f'{a}_geomean_speedup']:.2f}x" + (f" ({tg})" if tg else ""))
        tgm = r.get("tinygemm_geomean_speedup")
        print(f"  {key:9s} {r['shapes']:6d} " + " ".join(f"{c:>20s}" for c in cells)
              + f" {(f'{tgm:.2f}x' if tgm else '-'):>9s} {r['held_out_max_over_best']:12.3f} "
              f"{r['held_out_within_target']:>9s}")
    print("\nheld-out cases over the target:")
    for p in s["per_case"]:
        if p["held_out_over_best"] > TARGET:
            print(f"  m{p['m']:<2d} g{p['group']:3s} {p['n']}x{p['k']} ({p['shape']}): {p['held_out']} "
                  f"{p['held_out_over_best']:.3f}x best {p['best']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a shape_bench --sweep JSON")
    p.add_argument("--emit", action="store_true", help="print the rule fitted on every case, as Python")
    p.add_argument("--write-table", type=Path, default=None, metavar="PATH",
                   help="merge each case's pick (best_table) into this tuned_configs.json under the sweep's device")
    p.add_argument("--keep-within", type=float, default=KEEP_WITHIN,
                   help=f"with --write-table: keep the choice the sweep ran where it is within this fraction of the "
                        f"best (default {KEEP_WITHIN}; 0: always the best)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the scores as JSON")
    a = p.parse_args(argv)
    if not 0 <= a.keep_within < 1:
        p.error(f"--keep-within takes a fraction in [0, 1), got {a.keep_within}")
    cases, configs, meta = load(a.data)
    sms = meta.get("sms") or DEFAULT_SMS
    if a.emit:
        print(emit(fit_rule(cases, configs, sms)))
        return 0
    if a.write_table is not None:
        table = best_table(cases, choice_only(configs), a.keep_within, sms, mma_m1_programs_an_sm(meta["device"]))
        write_table(a.write_table, meta["device"], table, {tuned_key(c.m, c.n, c.k, c.group_size) for c in cases})
        print(f"wrote {len(table)} entries of {len(cases)} cases into {a.write_table} under {meta['device']!r}")
        return 0
    s = scores(cases, configs, sms)
    print_tables(s)
    if a.json is not None:
        a.json.write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
