"""GPU reproduction of the decoding claims on the offline stand-in pair (or the seed's models).

One process, one pair, variants interleaved per trial (plain, fixed-K5, gated at the seed's
production and tuned thresholds, HF assisted generation as the peer baseline), warm-up runs
excluded, one NVML energy window per run, greedy outputs checked against plain decoding during
the performance runs. Then the threshold grid, decision determinism and the Resolution Gear
fidelity table. Each suite writes one run record under telemetry/.

    python -m reproductions.decode_repro [--trials 5] [--max-new-tokens 128] [--out telemetry]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sdsie.clutch import PRODUCTION, TUNED, ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, generate, near_tie_report
from sdsie.telemetry.energy import EnergyMeter
from sdsie.telemetry.records import RunRecord, capture_environment, write_record

FAMILY_LABEL = {"verse": "poem", "prose": "physics", "code": "code"}  # seed README names
K = 5


@dataclass
class Run:
    variant: str
    family: str
    trial: int
    tokens: list[int]
    seconds: float
    energy_j: float | None
    stats: dict = field(default_factory=dict)
    decisions: str = ""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


Outcome = tuple[list[int], dict, str]  # tokens, stats, decisions


def timed(fn: Callable[[], Outcome], meter: EnergyMeter | None) -> tuple[list[int], float, float | None, dict, str]:
    """Run once inside an energy window; wall time between synchronized edges."""
    win = meter.start() if meter else None
    _sync()
    t0 = time.perf_counter()
    tokens, stats, decisions = fn()
    _sync()
    seconds = time.perf_counter() - t0
    energy = None
    if meter:
        try:
            energy = meter.stop(win, tokens=len(tokens)).energy_j
        except Exception as err:  # a too-short window is reported as missing energy, never as 0 J
            print(f"energy window rejected: {err}")
    return tokens, seconds, energy, stats, decisions


def variants(target, scout, cfg: DecodeConfig) -> dict[str, Callable[[torch.Tensor], tuple[list[int], dict, str]]]:
    def ours(scout_=None, clutch: ClutchConfig | None = None):
        def fn(ids):
            r = generate(target, ids, cfg, scout=scout_, clutch=EntropyClutch(clutch) if clutch else None)
            return r.tokens, r.stats.to_dict(), r.decisions
        return fn

    def hf_assisted(ids):
        out = target.generate(ids[None, :], assistant_model=scout, max_new_tokens=cfg.max_new_tokens,
                              min_new_tokens=cfg.max_new_tokens, do_sample=False, num_assistant_tokens=K)
        return out[0, ids.numel():].tolist(), {}, ""

    def hf_plain(ids):
        out = target.generate(ids[None, :], max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens,
                              do_sample=False)
        return out[0, ids.numel():].tolist(), {}, ""

    fixed = DecodeConfig(max_new_tokens=cfg.max_new_tokens, k_draft=K)
    return {
        "plain": ours(),
        "fixed_k5": lambda ids: (lambda r: (r.tokens, r.stats.to_dict(), r.decisions))(
            generate(target, ids, fixed, scout=scout)),
        "gated_production": ours(scout, PRODUCTION),
        "gated_tuned": ours(scout, TUNED),
        "hf_assisted": hf_assisted,
        "hf_generate": hf_plain,
    }


def run_decode_suite(target, scout, prompts: dict[str, tuple[str, torch.Tensor]], trials: int, max_new: int,
                     meter: EnergyMeter | None) -> list[Run]:
    cfg = DecodeConfig(max_new_tokens=max_new)
    fns = variants(target, scout, cfg)
    runs: list[Run] = []
    for fn in fns.values():  # warm-up, excluded
        fn(next(iter(prompts.values()))[1])
    for trial in range(trials):
        for pid, (family, ids) in prompts.items():
            for name, fn in fns.items():  # interleaved
                tokens, sec, energy, stats, dec = timed(lambda fn=fn, ids=ids: fn(ids), meter)
                runs.append(Run(name, family, trial, tokens, sec, energy, stats, dec))
                runs[-1].stats["prompt"] = pid
        print(f"trial {trial} done", flush=True)
    return runs


def _per_family(runs: list[Run], variant: str, family: str) -> list[Run]:
    return [r for r in runs if r.variant == variant and r.family == family]


def _tps(rs: list[Run]) -> float:
    return statistics.median(len(r.tokens) / r.seconds for r in rs)


def _jpt(rs: list[Run]) -> float | None:
    vals = [r.energy_j / len(r.tokens) for r in rs if r.energy_j is not None]
    return statistics.median(vals) if vals else None


def decode_metrics(runs: list[Run]) -> dict[str, float]:
    m: dict[str, float] = {}
    families = sorted({r.family for r in runs})
    speedups, reductions = {}, {}
    identical = total = 0
    for fam in families:
        label = FAMILY_LABEL.get(fam, fam)
        plain = _per_family(runs, "plain", fam)
        base_tps, base_jpt = _tps(plain), _jpt(plain)
        m[f"{label}.plain_tokens_per_s"] = base_tps
        for variant in ("fixed_k5", "gated_production", "gated_tuned", "hf_assisted", "hf_generate"):
            rs = _per_family(runs, variant, fam)
            tps = _tps(rs)
            m[f"{variant}.{label}.tokens_per_s"] = tps
            m[f"{variant}.{label}.speedup"] = tps / base_tps
            jpt = _jpt(rs)
            if jpt is not None and base_jpt is not None:
                m[f"{variant}.{label}.j_per_token_reduction_pct"] = 100.0 * (1 - jpt / base_jpt)
            stats = [r.stats for r in rs if "cycles" in r.stats]
            if stats and stats[0].get("drafted"):
                acc = sum(s["accepted"] for s in stats) / max(1, sum(s["drafted"] for s in stats))
                m[f"{variant}.{label}.acceptance_pct"] = 100.0 * acc
            if stats:
                m[f"{variant}.{label}.fallback_pct"] = 100.0 * statistics.mean(s["fallback_fraction"] for s in stats)
            if variant.startswith(("fixed", "gated", "hf_assisted")):
                for r in rs:  # outputs checked during the performance runs
                    ref = next(p for p in plain
                               if p.trial == r.trial and p.stats.get("prompt") == r.stats.get("prompt"))
                    total += 1
                    identical += int(r.tokens == ref.tokens)
        speedups[label] = m[f"fixed_k5.{label}.speedup"]
        if f"fixed_k5.{label}.j_per_token_reduction_pct" in m:
            reductions[label] = m[f"fixed_k5.{label}.j_per_token_reduction_pct"]
        for mode in ("tuned", "production"):
            v = f"gated_{mode}"
            m[f"{mode}.{label}.throughput_change_pct"] = 100.0 * (m[f"{v}.{label}.speedup"] - 1)
            if f"{v}.{label}.j_per_token_reduction_pct" in m:
                m[f"{mode}.{label}.energy_reduction_pct"] = m[f"{v}.{label}.j_per_token_reduction_pct"]
            m[f"{mode}.{label}.fallback_pct"] = m.get(f"{v}.{label}.fallback_pct", float("nan"))
            if f"{v}.{label}.acceptance_pct" in m:
                m[f"{mode}.{label}.acceptance_pct"] = m[f"{v}.{label}.acceptance_pct"]
    best = max(speedups, key=speedups.get)
    m["speedup_max"] = speedups[best]
    m["acceptance_pct_at_max_speedup"] = m.get(f"fixed_k5.{best}.acceptance_pct", float("nan"))
    if reductions:
        m["j_per_token_reduction_pct_min"] = min(reductions.values())
        m["j_per_token_reduction_pct_max"] = max(reductions.values())
    m["fidelity_pct"] = 100.0 * identical / max(1, total)
    m["plain_tokens_per_s"] = statistics.median(len(r.tokens) / r.seconds for r in runs if r.variant == "plain")
    dec = {}
    for r in runs:
        if r.variant.startswith("gated"):
            dec.setdefault((r.variant, r.stats.get("prompt")), set()).add(r.decisions)
    m["decisions_identical_across_trials"] = float(all(len(v) == 1 for v in dec.values()))
    return {k: float(v) for k, v in m.items() if math.isfinite(v)}  # records refuse NaN: absent, not NaN


def run_grid(target, scout, prompts, max_new: int, trials: int = 2) -> dict[str, float]:
    """The seed's grid (6 threshold pairs x 3 alphas) on one prompt per family; throughput vs plain."""
    from sdsie.decoding import clutch_grid, sweep

    pairs = [(0.15, 0.70), (0.25, 0.85), (0.35, 1.0), (0.45, 1.1), (0.55, 1.25), (0.65, 1.4)]
    clutches = [c for lo, hi in pairs for c in clutch_grid([lo], [hi], [0.35, 0.5, 0.65])]
    fam_prompts = {}
    for _pid, (fam, ids) in prompts.items():
        fam_prompts.setdefault(fam, ids)
    order = list(fam_prompts)
    res = sweep(target, scout, [fam_prompts[f] for f in order], clutches, trials=trials,
                config=DecodeConfig(max_new_tokens=max_new, k_draft=K))
    data = res.to_dict()
    m: dict[str, float] = {"grid.trials": float(trials), "grid.configs": float(len(clutches))}
    entries = data["entries"]
    plain = next(e for e in entries if e["label"] == "plain")

    def tps(entry, idx):
        return statistics.median(r["tokens_per_s"] for r in entry["runs"] if r["prompt_index"] == idx)

    best_all, best_score = None, -1e9
    for e in entries:
        if e.get("clutch") is None:
            continue
        score = min(tps(e, i) / tps(plain, i) for i in range(len(order)))
        if score > best_score:
            best_all, best_score = e, score
    for i, fam in enumerate(order):
        label = FAMILY_LABEL.get(fam, fam)
        base = tps(plain, i)
        gated = [e for e in entries if e.get("clutch")]
        prod = next(e for e in gated if e["clutch"]["theta_low"] == 0.55 and e["clutch"]["alpha"] == 0.35)
        best = max(gated, key=lambda e, i=i: tps(e, i))
        m[f"grid.production.{label}.throughput_change_pct"] = 100 * (tps(prod, i) / base - 1)
        m[f"grid.best.{label}.throughput_change_pct"] = 100 * (tps(best, i) / base - 1)
        m[f"grid.best_over_all.{label}.throughput_change_pct"] = 100 * (tps(best_all, i) / base - 1)
    return m


def near_ties(target, scout, prompts, max_new: int) -> dict:
    ids = next(ids for fam, ids in prompts.values() if fam == "code")
    continuation = generate(target, ids, DecodeConfig(max_new_tokens=max_new)).tokens
    return near_tie_report(target, ids, continuation, k_draft=K).to_dict()


def fidelity(target, prompts, max_new: int) -> tuple[dict[str, float], dict]:
    from sdsie.fidelity import FidelityConfig, fidelity_sweep

    fam_prompts = {}
    for _pid, (fam, ids) in prompts.items():
        fam_prompts.setdefault(FAMILY_LABEL.get(fam, fam), ids)
    res = fidelity_sweep(target, fam_prompts, FidelityConfig(max_new_tokens=max_new))
    return res.metrics(), {"table": res.table(), **res.to_dict()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("telemetry"))
    p.add_argument("--skip", nargs="*", default=[], choices=["grid", "fidelity", "near_ties"])
    p.add_argument("--preset", default="gpu", help="stand-in preset; 'cpu' with --device cpu is a dry run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--one-per-family", action="store_true", help="first prompt of each family only")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("decode_repro needs a CUDA GPU (torch.cuda.is_available() is False); the CPU-reproducible "
              "claims run in `nox -s claims`.")
        return 2
    from sdsie.standin import get_preset, load_prompts, load_standin, prompts_hash

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    target, scout, tok = load_standin(a.preset, a.device, dtype)
    print(f"stand-in ready in {time.perf_counter() - t0:.0f} s", flush=True)
    chosen = load_prompts()
    if a.one_per_family:
        chosen = [next(pr for pr in chosen if pr.family == f) for f in dict.fromkeys(pr.family for pr in chosen)]
    prompts = {pr.id: (pr.family, torch.tensor(tok(pr.text)["input_ids"], device=a.device)) for pr in chosen}
    env = capture_environment(models={"target": "sdsie stand-in gpu target", "scout": "sdsie stand-in gpu scout"},
                              prompts={pid: tok.decode(ids) for pid, (_f, ids) in prompts.items()}, seeds={"torch": 0})
    env["prompts_hash"] = prompts_hash()
    env["standin_recipe"] = get_preset(a.preset).name
    hardware = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (dry run)"
    cond = {"model": f"sdsie stand-in pair ({a.preset} preset), {str(dtype).split('.')[-1]}", "hardware": hardware,
            "trials": a.trials}
    ok, why = EnergyMeter.available()
    meter = EnergyMeter() if ok and a.device == "cuda" else None
    if meter:
        meter.measure_idle(2.0)
    else:
        print("energy not measured:", why)
    runs = run_decode_suite(target, scout, prompts, a.trials, a.max_new_tokens, meter)
    metrics = decode_metrics(runs)
    samples = {f"{r.variant}|{r.stats.get('prompt')}|tokens_per_s": [] for r in runs}
    for r in runs:
        samples[f"{r.variant}|{r.stats.get('prompt')}|tokens_per_s"].append(len(r.tokens) / r.seconds)
        if r.energy_j is not None:
            key = f"{r.variant}|{r.stats.get('prompt')}|j_per_token"
            samples.setdefault(key, []).append(r.energy_j / len(r.tokens))
    extra = {}
    if "near_ties" not in a.skip:
        try:
            extra["near_ties"] = near_ties(target, scout, prompts, a.max_new_tokens)
        except Exception as err:  # reported, not hidden
            extra["near_ties_error"] = repr(err)
    rec = RunRecord(
        claim_ids=["spec-k5-speedup", "spec-k5-acceptance", "spec-k5-fidelity", "spec-k5-energy-reduction",
                   "e2e-throughput", "gated-decisions-bit-identical"]
        + [f"gated-tuned-{f}-{k}" for f in ("code", "poem", "physics") for k in ("throughput", "energy", "fallback")]
        + ["gated-tuned-code-acceptance"],
        suite="decode_standin",
        config={"k": K, "max_new_tokens": a.max_new_tokens, "trials": a.trials,
                "idle_power_w": meter.idle.power_w if meter else None,
                "variants": ["plain", "fixed_k5", "gated_production", "gated_tuned", "hf_assisted", "hf_generate"],
                "production": PRODUCTION.__dict__, "tuned": TUNED.__dict__,
                "decisions": {f"{r.variant}|{r.stats.get('prompt')}|{r.trial}": r.decisions for r in runs
                              if r.variant.startswith("gated")}, **extra},
        samples=samples, metrics=metrics, environment=env, conditions=cond)
    print("record:", write_record(rec, a.out), flush=True)
    for k in sorted(metrics):
        if k.count(".") <= 1 or k.startswith(("fixed_k5", "hf_assisted")):
            print(f"  {k} = {metrics[k]:.3f}")
    if "grid" not in a.skip:
        gm = run_grid(target, scout, prompts, min(a.max_new_tokens, 96))
        rec = RunRecord(claim_ids=[c for c in ("grid-production-poem", "grid-best-poem") if c], suite="threshold_grid",
                        config={"k": K}, samples={}, metrics=gm, environment=env, conditions={**cond, "trials": 2})
        print("record:", write_record(rec, a.out), gm, flush=True)
    if "fidelity" not in a.skip:
        fm, fd = fidelity(target, prompts, a.max_new_tokens)
        rec = RunRecord(claim_ids=["resolution-gear-fidelity"], suite="resolution_gear_fidelity",
                        config={"table": fd["table"]}, samples={}, metrics=fm, environment=env,
                        conditions={**cond, "trials": 1})
        print("record:", write_record(rec, a.out), flush=True)
        print(fd["table"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
