"""The decode suite's greedy-identity accounting, on CPU: per-variant fidelity (HF assisted never pooled
with this package's variants), raw per-run evidence, and a logit-gap report for every divergence."""

from __future__ import annotations

import pytest
import torch

from reproductions.decode_repro import (
    Run,
    fidelity_metrics,
    first_divergence,
    identity_samples,
    mismatch_report,
)
from sdsie.decoding import DecodeConfig, generate
from sdsie.models import tiny_llama


def _run(variant: str, tokens: list[int], trial: int = 0, prompt: str = "p") -> Run:
    return Run(variant, "code", trial, tokens, 1.0, None, {"prompt": prompt})


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([5], [6], 0),
])
def test_first_divergence(a, b, expected):
    assert first_divergence(a, b) == expected


def test_fidelity_is_per_variant_and_ours_excludes_hf_assisted():
    runs = []
    for trial in range(2):
        runs += [_run("plain", [1, 2, 3], trial), _run("fixed_k5", [1, 2, 3], trial),
                 _run("gated_tuned", [1, 2, 3], trial), _run("hf_assisted", [1, 2, 4], trial)]
    runs.append(_run("gated_production", [1, 2, 3], 0))
    runs.append(_run("gated_production", [7, 2, 3], 1))  # one of our runs differs
    m = fidelity_metrics(runs)
    assert m["hf_assisted.fidelity_pct"] == 0.0
    assert m["fixed_k5.fidelity_pct"] == 100.0 and m["gated_production.fidelity_pct"] == 50.0
    assert m["fidelity_pct"] == pytest.approx(100.0 * 5 / 6)  # fixed 2 + tuned 2 + production 1 of 6; HF apart
    assert m["plain_identical_across_trials"] == 1.0
    samples = identity_samples(runs)
    assert samples["gated_production|p|identical_to_plain"] == [1.0, 0.0]
    assert samples["hf_assisted|p|identical_to_plain"] == [0.0, 0.0]
    assert "plain|p|identical_to_plain" not in samples


def test_plain_that_changes_between_trials_is_flagged():
    runs = [_run("plain", [1, 2], 0), _run("plain", [1, 3], 1)]
    assert fidelity_metrics(runs)["plain_identical_across_trials"] == 0.0


def test_mismatch_report_gives_the_plain_paths_gap_at_each_divergence():
    target = tiny_llama(seed=3)
    prompt = torch.tensor([1, 5, 9, 4])
    plain = generate(target, prompt, DecodeConfig(max_new_tokens=8)).tokens
    # a variant that took the plain path's runner-up at position 3, then went its own way
    with torch.inference_mode():
        logits = target(torch.tensor([[*prompt.tolist(), *plain[:3]]])).logits[0, -1].float()
    runner_up = int(logits.topk(2).indices[1])
    other = plain[:3] + [runner_up] + plain[4:]
    runs = [_run("plain", plain, 0), _run("fixed_k5", other, 0), _run("plain", plain, 1), _run("fixed_k5", other, 1),
            _run("hf_assisted", plain, 0), _run("hf_assisted", plain, 1)]
    report = mismatch_report(target, runs, {"p": ("code", prompt)})
    assert len(report) == 1  # one distinct divergence, seen in both trials
    (entry,) = report
    assert (entry["variant"], entry["position"], entry["trials"]) == ("fixed_k5", 3, [0, 1])
    assert (entry["plain_token"], entry["variant_token"]) == (plain[3], runner_up)
    top = logits.topk(2).values
    assert entry["plain_gap"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert entry["variant_token_deficit"] == pytest.approx(entry["plain_gap"], abs=1e-4)  # it was the runner-up
    assert entry["variant_token_rank"] == 1


def test_mismatch_at_the_first_token_uses_the_prefill_logits():
    target = tiny_llama(seed=4)
    prompt = torch.tensor([3, 7])
    plain = generate(target, prompt, DecodeConfig(max_new_tokens=3)).tokens
    other = [(plain[0] + 1) % 64, *plain[1:]]
    runs = [_run("plain", plain), _run("gated_tuned", other)]
    (entry,) = mismatch_report(target, runs, {"p": ("code", prompt)})
    assert entry["position"] == 0 and entry["variant_token_deficit"] > 0
    assert mismatch_report(target, [_run("plain", plain), _run("gated_tuned", plain)], {"p": ("code", prompt)}) == []


def test_graphed_variants_get_speedups_against_eager_and_graphed_plain():
    from reproductions.decode_repro import decode_metrics

    tps = {"plain": 50.0, "fixed_k5": 80.0, "gated_production": 50.0, "gated_tuned": 50.0, "hf_assisted": 40.0,
           "hf_generate": 45.0, "plain_graphs": 200.0, "fixed_k5_graphs": 500.0, "gated_production_graphs": 198.0,
           "gated_tuned_graphs": 204.0, "fixed_k2_graphs": 300.0}
    runs = [Run(v, "code", t, [1, 2, 3, 4], 4 / rate, None, {"prompt": "p"})
            for t in range(3) for v, rate in tps.items()]
    runs.append(Run("gated_tuned_graphs", "code", 3, [1, 2, 3, 5], 4 / 204.0, None, {"prompt": "p"}))
    runs += [Run(v, "code", 3, [1, 2, 3, 4], 4 / tps[v], None, {"prompt": "p"}) for v in ("plain", "plain_graphs")]
    m = decode_metrics(runs)
    assert m["plain_graphs.code.speedup"] == pytest.approx(4.0)  # against eager plain
    assert m["fixed_k5_graphs.code.speedup"] == pytest.approx(10.0)
    assert m["fixed_k5_graphs.code.speedup_vs_plain_graphs"] == pytest.approx(2.5)
    assert m["gated_production_graphs.code.speedup_vs_plain_graphs"] == pytest.approx(0.99)  # a 1% cost, resolved
    assert m["gated_tuned_graphs.code.speedup_vs_plain_graphs"] == pytest.approx(1.02)
    assert m["fixed_k2_graphs.code.speedup_vs_plain_graphs"] == pytest.approx(1.5)  # a shorter fixed draft
    assert "fixed_k3_graphs.code.tokens_per_s" not in m  # a variant that did not run is absent, not zero
    assert m["fixed_k5_graphs.fidelity_pct"] == 100.0 and m["plain_graphs.fidelity_pct"] == 100.0
    assert m["gated_tuned_graphs.fidelity_pct"] == 75.0  # checked against plain_graphs of its own trial
    assert "fixed_k5_graphs.code.speedup_vs_plain_graphs" not in decode_metrics(
        [r for r in runs if not r.variant.endswith("_graphs")])


def test_run_order_is_seeded_per_trial_and_prompt_and_covers_every_variant():
    from reproductions.decode_repro import run_order

    names = ["plain", "fixed_k5", "gated_production", "gated_tuned", "hf_assisted", "hf_generate"]
    orders = [run_order(names, t, p) for t in range(5) for p in range(3)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert run_order(names, 2, 1) == run_order(names, 2, 1)  # repeatable
    assert len({tuple(o) for o in orders}) > 5  # not one fixed order
    assert {o[0] for o in orders} != {"plain"}  # plain does not always run first


def _eager_runs(prompt: str) -> list[Run]:
    """One trial of every eager variant on one code prompt, in the suite's order (plain first)."""
    from reproductions.decode_repro import OUR_SPECULATIVE, PEERS

    return [Run(v, "code", 0, [1, 2], 0.1, None, {"prompt": prompt}) for v in ("plain", *OUR_SPECULATIVE, *PEERS)]


def test_entropy_quantiles_come_from_the_plain_runs_of_each_family():
    from reproductions.decode_repro import decode_metrics

    runs = _eager_runs("p")
    runs[0].stats["entropy_bits"] = [float(b) for b in range(10)]  # 0..9 bits, plain only
    runs[1].stats["entropy_bits"] = [100.0] * 10  # another variant's entropies are not read
    m = decode_metrics(runs)
    assert (m["code.entropy_bits_p10"], m["code.entropy_bits_p50"], m["code.entropy_bits_p90"]) == (1.0, 5.0, 9.0)


def test_assert_serves_accepts_a_record_that_holds_the_claims_and_names_what_is_missing():
    from pathlib import Path

    from reproductions.decode_repro import DECODE_TESTS, assert_serves
    from sdsie.telemetry.records import load_records, newest_record

    rec = newest_record(load_records(Path("telemetry")), "decode_standin")
    node = "reproductions/test_speculative_gpu.py::test_plain_decode_throughput"
    assert_serves(rec, DECODE_TESTS, node, ["e2e-throughput"])
    with pytest.raises(AssertionError, match="does not serve"):
        assert_serves(rec, DECODE_TESTS, node, ["spec-k5-speedup"])  # another node's claim
    rec.claim_ids = [c for c in rec.claim_ids if c != "e2e-throughput"]
    with pytest.raises(AssertionError, match="e2e-throughput: not declared"):
        assert_serves(rec, DECODE_TESTS, node, ["e2e-throughput"])


def test_readme_identity_line_per_variant_with_divergences_or_pooled_for_older_records():
    from types import SimpleNamespace

    from reproductions.readme_results import identity_line

    new = SimpleNamespace(metrics={"fidelity_pct": 100.0, "fixed_k5.fidelity_pct": 100.0,
                                   "hf_assisted.fidelity_pct": 80.0},
                          config={"mismatches": [{"variant": "hf_assisted", "prompt": "p", "position": 7,
                                                  "plain_gap": 0.0625}]})
    line = identity_line(new)
    assert "fixed k5 100%" in line and "hf assisted 80%" in line and "hf_assisted p @7 gap 0.062" in line
    old = SimpleNamespace(metrics={"fidelity_pct": 78.57}, config={})
    assert "pooled over fixed-K5" in identity_line(old) and "78.6%" in identity_line(old)


def test_readme_graphs_line_reads_the_graph_variants_or_is_absent():
    from types import SimpleNamespace

    from reproductions.readme_results import graphs_line

    mt = {"plain_graphs.code.tokens_per_s": 533.4, "plain_graphs.code.speedup": 5.98,
          "fixed_k5_graphs.code.tokens_per_s": 635.3, "fixed_k5_graphs.code.speedup_vs_plain_graphs": 1.191}
    line = graphs_line(SimpleNamespace(metrics=mt))
    assert "code 533 tok/s (6.0x the eager plain loop) and 635 tok/s (1.19x plain with graphs)" in line
    assert "physics" not in line and "Gated speculation" not in line  # a record without the gated graph loops
    gated = {**mt, "gated_production_graphs.code.speedup_vs_plain_graphs": 0.992,
             "gated_tuned_graphs.code.speedup_vs_plain_graphs": 0.983}
    assert "production code 0.992x; tuned code 0.983x" in graphs_line(SimpleNamespace(metrics=gated, samples={}))
    samples = {f"{v}|{pr}|tokens_per_s": [100.0 * f, 110.0 * f] for pr in ("code-bst-module", "code-instruction")
               for v, f in (("plain_graphs", 1.0), ("gated_production_graphs", 0.99))}
    line = graphs_line(SimpleNamespace(metrics=gated, samples=samples))
    assert "Paired with the graphed plain run" in line and "production code 0.990x (0.990-0.990)" in line
    assert graphs_line(SimpleNamespace(metrics={"plain_graphs.code.tokens_per_s": 533.4})) is None


def test_acceptance_counts_every_run_that_drafted_not_only_the_first():
    """A gated variant may draft on one prompt of a family and never on another: its acceptance is over all the
    family's drafts. Counting the first run only would leave gated_tuned's code acceptance out where the family's
    first run (code-instruction) drafted nothing while code-bst-module drafted."""
    from reproductions.decode_repro import decode_metrics

    runs = _eager_runs("p")
    runs += [Run("gated_tuned", "code", 0, [1, 2], 0.1, None, {"prompt": "q"}),
             Run("plain", "code", 0, [1, 2], 0.1, None, {"prompt": "q"})]
    for r in runs[1:4]:
        r.stats.update(cycles=4, drafted=0, accepted=0, fallback_fraction=1.0)
    runs[1].stats.update(drafted=10, accepted=4, fallback_fraction=0.0)
    runs[-2].stats.update(cycles=4, drafted=10, accepted=5, fallback_fraction=0.5)
    m = decode_metrics(runs)
    assert m["gated_tuned.code.acceptance_pct"] == 50.0 and m["tuned.code.acceptance_pct"] == 50.0
    assert m["fixed_k5.code.acceptance_pct"] == 40.0
    assert "gated_production.code.acceptance_pct" not in m  # nothing drafted: no rate, not 0%


def test_paired_speedups_cancel_drift_between_trials_and_carry_an_interval():
    """A variant 2% slower than plain in every trial while the host's speed doubles between trials: the paired
    median says 0.98 exactly, where a ratio of medians would follow the drift."""
    from reproductions.decode_repro import decode_metrics, run_ratios
    from sdsie.stats import bootstrap_median_ci, paired_ratios

    host = [40.0, 80.0, 45.0, 60.0, 75.0]  # plain tok/s per trial
    runs = []
    for t, speed in enumerate(host):
        runs += [Run("plain", "code", t, [1] * 10, 10 / speed, None, {"prompt": "p"}),
                 Run("plain_graphs", "code", t, [1] * 10, 10 / (10 * speed), None, {"prompt": "p"}),
                 Run("gated_tuned_graphs", "code", t, [1] * 10, 10 / (9.8 * speed), None, {"prompt": "p"})]
    assert run_ratios(runs, "gated_tuned_graphs", "code") == pytest.approx([0.98] * 5)
    m = decode_metrics([r for r in runs] + [Run(v, "code", t, [1] * 10, 1.0, None, {"prompt": "p"})
                                             for t in range(5) for v in ("fixed_k5", "gated_production",
                                                                         "gated_tuned", "hf_assisted", "hf_generate")])
    key = "gated_tuned_graphs.code.paired_speedup_vs_plain_graphs"
    assert m[key] == pytest.approx(0.98) and m[f"{key}_ci_low"] == pytest.approx(0.98)
    assert m["plain_graphs.code.paired_speedup"] == pytest.approx(10.0)  # against eager plain
    samples = {"a|p|tokens_per_s": [1.0, 2.0, 3.0], "b|p|tokens_per_s": [2.0, 2.0, 2.0]}
    assert paired_ratios(samples, "a", "b", ["p"]) == [0.5, 1.0, 1.5]
    with pytest.raises(ValueError, match="cannot pair by trial"):
        paired_ratios({**samples, "b|p|tokens_per_s": [2.0]}, "a", "b", ["p"])
    low, high = bootstrap_median_ci([0.9, 0.95, 1.0, 1.05, 1.1, 0.97, 1.02])
    assert low <= 1.0 <= high and low >= 0.9 and high <= 1.1
    assert (low, high) == bootstrap_median_ci([0.9, 0.95, 1.0, 1.05, 1.1, 0.97, 1.02])  # seeded
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_median_ci([])


def test_a_subset_of_variants_keeps_its_baselines_and_claims_only_what_it_measured():
    """--variants: a quick graphed K sweep runs without the eager speculative loops; its metrics hold what ran and
    nothing vacuous (no decision-determinism figure without a gated run)."""
    from reproductions.decode_repro import decode_metrics, select_variants

    fns = {v: None for v in ("plain", "fixed_k5", "gated_tuned", "plain_graphs", "fixed_k2_graphs")}
    assert list(select_variants(fns, ["plain", "plain_graphs", "fixed_k2_graphs"])) == [
        "plain", "plain_graphs", "fixed_k2_graphs"]
    assert select_variants(fns, None) is fns
    with pytest.raises(ValueError, match=r"lack the baselines their ratios need: add \['plain_graphs'\]"):
        select_variants(fns, ["plain", "fixed_k2_graphs"])
    with pytest.raises(ValueError, match=r"add \['plain'\]"):
        select_variants(fns, ["fixed_k5"])
    with pytest.raises(ValueError, match="unknown decode variants"):
        select_variants(fns, ["plain", "fixed_k9"])
    runs = [Run(v, "code", t, [1] * 8, 8 / rate, None, {"prompt": "p"})
            for t in range(3) for v, rate in (("plain", 40.0), ("plain_graphs", 400.0), ("fixed_k2_graphs", 520.0))]
    m = decode_metrics(runs)
    assert m["fixed_k2_graphs.code.speedup_vs_plain_graphs"] == pytest.approx(1.3)
    assert "speedup_max" not in m and "decisions_identical_across_trials" not in m
    assert not any(k.startswith(("fixed_k5.", "gated_", "hf_")) for k in m)


def test_forward_costs_on_a_static_cache_time_the_same_three_forwards():
    """forward_costs(graphs=True): the cycle's forwards on a static cache (replayed as CUDA graphs on a GPU, where
    CUDA events add their GPU time); on CPU the static cache runs eagerly and reports wall times only."""
    from reproductions.decode_repro import forward_costs

    target, scout = tiny_llama(seed=5), tiny_llama(seed=6)
    ids = torch.tensor([1, 5, 9, 4, 7])
    for graphs in (False, True):
        costs = forward_costs(target, scout, ids, k=3, reps=3, graphs=graphs)
        assert costs["target_step_ms"] > 0 and costs["target_verify_ms"] > 0 and costs["scout_step_ms"] > 0
        assert costs["scout_cost_ratio"] == pytest.approx(costs["scout_step_ms"] / costs["target_step_ms"])
        assert "target_step_gpu_ms" not in costs  # no CUDA events on a CPU


def test_readme_keeps_the_full_decode_table_and_adds_the_graphed_k_sweep_from_a_subset_run():
    """A `--variants` run (K = 2/3/5 under graphs) is newer than the full record: the main table stays on the newest
    record that decoded every main variant, and the K-sweep table comes from the newest record that has one."""
    from types import SimpleNamespace

    from reproductions.readme_results import K_SWEEP, MAIN_DECODE, k_sweep_section, newest

    h200 = {"hardware": "NVIDIA H200"}
    full = SimpleNamespace(suite="decode_standin", created="2026-11-30T11:00", record_id="full",
                           config={"variants": list(MAIN_DECODE)}, conditions=h200)
    subset = SimpleNamespace(suite="decode_standin", created="2026-11-30T13:00", record_id="subset",
                             config={"variants": list(K_SWEEP)}, conditions=h200)
    older = SimpleNamespace(suite="decode_standin", created="2026-11-30T06:00", record_id="older",
                            config={}, conditions=h200)  # before 'variants'
    assert newest([full, subset, older], "decode_standin", MAIN_DECODE) is full
    assert newest([full, subset, older], "decode_standin", K_SWEEP) is subset
    assert newest([full, subset, older], "decode_standin") is subset
    mt = {"plain_graphs.code.tokens_per_s": 520.0, "fixed_k2_graphs.code.acceptance_pct": 28.8,
          "fixed_k2_graphs.code.paired_speedup_vs_plain_graphs": 0.938,
          "fixed_k2_graphs.code.paired_speedup_vs_plain_graphs_ci_low": 0.852,
          "fixed_k2_graphs.code.paired_speedup_vs_plain_graphs_ci_high": 1.026}
    rec = SimpleNamespace(metrics=mt, config={"trials": 3}, conditions={"model": "pair"},
                          source=SimpleNamespace(name="r.json"))
    table = "\n".join(k_sweep_section(rec))
    assert "| code | 520 | 0.94x (0.85-1.03) | - | - | 29%/-/- |" in table and "physics" not in table
    assert "GPU time" not in table  # no forward_ms_graphs in this record


def test_readme_leaves_out_the_k_sweep_table_until_a_record_has_one(tmp_path):
    """The K-sweep table is optional: absent (no placeholder) while no record decoded those variants, present once
    one has; the required sections still say when their suite has no record."""
    import shutil
    from pathlib import Path

    from reproductions.readme_results import render

    telemetry = Path(__file__).resolve().parents[1] / "telemetry"
    shutil.copy(telemetry / "20261130T115423780472Z-8159141d_decode_standin.json", tmp_path)
    text = render(tmp_path)
    assert "Decoding on the offline stand-in pair" in text and "Draft length under CUDA graphs" not in text
    assert "No `kernel_int4` record yet" in text and text.count("No `decode_standin` record yet") == 0
    shutil.copy(telemetry / "20261130T131311725543Z-d2f2400a_decode_standin.json", tmp_path)
    text = render(tmp_path)
    assert "Draft length under CUDA graphs" in text and "8159141d" in text  # the full table stays on the full run


def test_the_bootstrap_interval_does_not_depend_on_the_order_of_its_values():
    """The record pairs runs in run order and the README in prompt order: the same ratios must give one interval."""
    from sdsie.stats import bootstrap_median_ci

    values = [1.073, 1.071, 1.056, 0.99, 1.071, 0.938, 1.061, 0.995, 1.023, 0.937]  # unsorted, the low end moves
    assert bootstrap_median_ci(values) == bootstrap_median_ci(values[::-1]) == bootstrap_median_ci(sorted(values))


def _gated_record(ratios_high: list[float], p50: dict[str, float]):
    from types import SimpleNamespace

    from reproductions.readme_results import _prompts_by_family

    samples, metrics = {}, {}
    for fam, prompts in _prompts_by_family().items():
        metrics[f"plain_graphs.{fam}.tokens_per_s"] = 500.0
        metrics[f"{fam}.entropy_bits_p50"] = p50[fam]
        for pr in prompts:
            samples[f"plain_graphs|{pr}|tokens_per_s"] = [500.0] * len(ratios_high)
            for mode in ("production", "tuned"):
                ratios = ratios_high if fam == max(p50, key=p50.get) else [1.0] * len(ratios_high)
                samples[f"gated_{mode}_graphs|{pr}|tokens_per_s"] = [500.0 * r for r in ratios]
    return SimpleNamespace(metrics=metrics, samples=samples, config={"trials": len(ratios_high)},
                           conditions={"model": "m", "hardware": "NVIDIA H200"}, source=SimpleNamespace(name="r.json"),
                           environment={})


@pytest.mark.parametrize("ratios, verdict", [([0.995, 1.0, 1.005, 0.998, 1.002], "**met**"),
                                             ([0.95, 0.96, 0.97, 0.955, 0.965], "**missed**"),
                                             ([0.97, 1.0, 1.03, 0.98, 1.02], "**not established** (the median"),
                                             ([0.95, 0.99, 0.995, 0.96, 0.985], "**not established** (0.985x: "
                                                                                 "slower than plain, by 0.8-4.5%")])
def test_the_gated_bound_is_judged_on_the_highest_entropy_family_by_its_interval(ratios, verdict):
    from reproductions.readme_results import gated_graphs_section

    text = "\n".join(gated_graphs_section(_gated_record(ratios, {"code": 1.9, "physics": 2.5, "poem": 2.0})))
    assert f"here physics): at the production clutch {verdict}" in text
    assert f"; at the tuned clutch {verdict}" in text
    assert "| code | 1.90 | 500 | 1.000x (1.000-1.000)" in text  # the other families pair at exactly 1.0


def test_the_gated_bound_is_not_judged_without_every_familys_entropy():
    from reproductions.readme_results import gated_graphs_section

    rec = _gated_record([0.95] * 5, {"code": 1.9, "physics": 2.5, "poem": 2.0})
    del rec.metrics["code.entropy_bits_p50"]
    text = "\n".join(gated_graphs_section(rec))
    assert "bound is not judged here" in text and "**missed**" not in text


def test_the_clutch_steps_host_cost_is_measured_and_set_against_a_graphed_token():
    from reproductions.decode_repro import clutch_update_us
    from reproductions.readme_results import gated_graphs_section

    cost = clutch_update_us(updates=2000, trials=3)
    assert 0 < cost["min"] <= cost["median"] <= cost["max"] and cost["updates"] == 2000
    with pytest.raises(ValueError, match="updates must be >= 1"):
        clutch_update_us(updates=0)
    with pytest.raises(ValueError, match="ops and trials must be >= 1"):
        clutch_update_us(trials=0)
    rec = _gated_record([1.0] * 5, {"code": 1.9, "physics": 2.5, "poem": 2.0})
    rec.environment = {"clutch_update_us": {"median": 1.6}}
    text = "\n".join(gated_graphs_section(rec))
    assert "1.60 us on this run's host, 0.08% of a graphed plain token on physics (2000 us)" in text


def test_the_catch_up_ab_is_reported_per_prompt_where_the_tuned_clutch_engaged():
    """Padded against eager catch-up, paired by trial, only on prompts whose tuned decisions hold a speculate cycle."""
    from reproductions.decode_repro import UNPADDED
    from reproductions.readme_results import _prompts_by_family, gated_graphs_section

    rec = _gated_record([1.0] * 4, {"code": 1.9, "physics": 2.5, "poem": 2.0})
    engaged, idle = _prompts_by_family()["physics"][:2]
    rec.config["decisions"] = {f"gated_tuned_graphs|{engaged}|{t}": "FFSFF" for t in range(4)}
    rec.config["decisions"] |= {f"gated_tuned_graphs|{idle}|{t}": "FFFFF" for t in range(4)}
    for pr in (engaged, idle):
        rec.samples[f"gated_tuned_graphs|{pr}|tokens_per_s"] = [472.5] * 4
        rec.samples[f"{UNPADDED}|{pr}|tokens_per_s"] = [450.0, 450.0, 450.0, 450.0]
    text = "\n".join(gated_graphs_section(rec))
    line = next(ln for ln in text.splitlines() if UNPADDED in ln)
    assert f"{engaged} 1.050x (1.050-1.050)" in line and idle not in line
    assert "against plain graphs 0.945x (0.945-0.945) padded, 0.900x (0.900-0.900) eager" in line
    rec.config["decisions"] = {}
    assert UNPADDED not in "\n".join(gated_graphs_section(rec))  # nothing engaged: no A/B line


def test_the_graphed_identity_line_names_each_divergence_with_its_gap_and_trials():
    from types import SimpleNamespace

    from reproductions.readme_results import graphed_identity_line

    rec = SimpleNamespace(metrics={"plain_graphs.fidelity_pct": 100.0, "fixed_k5_graphs.fidelity_pct": 95.0,
                                   "fixed_k5.fidelity_pct": 50.0},
                          config={"mismatches": [
                              {"variant": "fixed_k5_graphs", "prompt": "p", "position": 7, "plain_gap": 0.0625,
                               "trials": [1, 3]},
                              {"variant": "fixed_k5", "prompt": "q", "position": 2, "plain_gap": 0.0, "trials": [0]}]})
    line = graphed_identity_line(rec)
    assert "plain_graphs 100.0%, fixed_k5_graphs 95.0%." in line and "fixed_k5 50" not in line
    assert "fixed_k5_graphs p @7 gap 0.0625 in trial(s) 1,3." in line and " q @2" not in line  # eager: not here
    rec.config["mismatches"] = rec.config["mismatches"][1:]
    assert graphed_identity_line(rec).endswith("No divergence.")
    assert graphed_identity_line(SimpleNamespace(metrics={}, config={})) is None


def test_the_adaptive_table_pairs_each_schedule_with_plain_and_with_constant_k():
    """Adaptive over constant K = 5 paired by trial, beside each over graphed plain; a prompt is named only where the
    paired interval excludes no change."""
    from reproductions.readme_results import ADAPTIVE_PAIRS, _prompts_by_family, adaptive_section

    rec = _gated_record([1.0] * 4, {"code": 1.9, "physics": 2.5, "poem": 2.0})
    fast = _prompts_by_family()["code"][0]
    for fam, prompts in _prompts_by_family().items():
        for pr in prompts:
            for const, adapt in ADAPTIVE_PAIRS:
                rec.samples[f"{const}|{pr}|tokens_per_s"] = [400.0] * 4
                rec.samples[f"{adapt}|{pr}|tokens_per_s"] = [500.0 if pr == fast else 400.0] * 4
        rec.metrics |= {f"fixed_k5_graphs.{fam}.acceptance_pct": 14.0,
                        f"fixed_k5_graphs_adaptive.{fam}.acceptance_pct": 28.0}
    text = "\n".join(adaptive_section(rec))
    physics = next(ln for ln in text.splitlines() if ln.startswith("| physics |"))
    assert physics == ("| physics | 0.800x (0.800-0.800) | 0.800x (0.800-0.800) | 1.000x (1.000-1.000) | 14%/28% | "
                       "0.800x (0.800-0.800) | 0.800x (0.800-0.800) | 1.000x (1.000-1.000) |")
    differ = next(ln for ln in text.splitlines() if ln.startswith("Prompts where"))
    assert f"fixed_k5_graphs_adaptive on {fast} 1.250x (1.250-1.250)" in differ
    assert f"gated_tuned_graphs_adaptive on {fast} 1.250x" in differ and differ.count(" on ") == 2


def test_the_ceiling_table_pairs_each_adaptive_ceiling_with_the_one_before_it():
    from reproductions.readme_results import LONG_ADAPTIVE_RUN, _prompts_by_family, long_adaptive_section

    rec = _gated_record([1.0] * 3, {"code": 1.9, "physics": 2.5, "poem": 2.0})
    speeds = dict(zip(LONG_ADAPTIVE_RUN[1:], (400.0, 550.0, 500.0), strict=True))  # constant, adaptive 5, adaptive 8
    for prompts in _prompts_by_family().values():
        for pr in prompts:
            rec.samples |= {f"{v}|{pr}|tokens_per_s": [x] * 3 for v, x in speeds.items()}
    code = next(ln for ln in long_adaptive_section(rec) if ln.startswith("| code |"))
    assert code == ("| code | 0.800x (0.800-0.800) | 1.100x (1.100-1.100) | 1.000x (1.000-1.000) | "
                    "1.375x (1.375-1.375) | 0.909x (0.909-0.909) |")


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _window_meter(watts_by_variant: dict[str, float], clock: _Clock, state: dict):
    """A fake NVML counter integrating the watts of whichever variant last ran, on a clock the fake decodes move."""
    from sdsie.telemetry.energy import EnergyMeter
    from sdsie.telemetry.fake_nvml import FakeNvml

    def counter() -> float:
        state["mj"] += watts_by_variant.get(state["running"], 0.0) * (clock.t - state["t"]) * 1000.0
        state["t"] = clock.t
        return state["mj"]

    return EnergyMeter(nvml=FakeNvml(energy_mj=counter, power_mw=100_000.0), sync=lambda: None, clock=clock)


def test_energy_windows_run_each_graphed_loop_back_to_back_and_give_j_per_token_against_plain_graphs():
    """Each graphed variant decodes each prompt enough times to fill the window; J/token is the windows' energy over
    their tokens, and the ratio is against plain_graphs on the same prompts. Variants without timed runs are skipped."""
    from reproductions.decode_repro import Run, energy_window_metrics, energy_windows

    clock, state = _Clock(), {"mj": 1e6, "t": 0.0, "running": None}
    watts = {"plain_graphs": 300.0, "fixed_k5_graphs_adaptive": 330.0}
    secs = {"plain_graphs": 0.25, "fixed_k5_graphs_adaptive": 0.2}  # per decode of 10 tokens

    def decoder(name):
        def fn(ids):
            state["running"] = name
            clock.t += secs[name]
            return [1] * 10, {}, ""
        return fn

    fns = {v: decoder(v) for v in secs} | {"gated_tuned_graphs": decoder("plain_graphs")}
    prompts = {"code-a": ("code", None), "prose-a": ("prose", None)}
    runs = [Run(v, fam, 0, [1] * 10, secs[v], None, {"prompt": pid}) for v in secs for pid, (fam, _) in prompts.items()]
    windows = energy_windows(fns, prompts, runs, _window_meter(watts, clock, state), window_s=2.0)
    assert sorted((w.variant, w.prompt, w.runs, w.tokens) for w in windows) == [
        ("fixed_k5_graphs_adaptive", "code-a", 10, 100), ("fixed_k5_graphs_adaptive", "prose-a", 10, 100),
        ("plain_graphs", "code-a", 8, 80), ("plain_graphs", "prose-a", 8, 80)]  # gated: no timed runs, no window
    m = energy_window_metrics(windows)
    assert m["plain_graphs.code.j_per_token_window"] == pytest.approx(300.0 * 0.25 / 10)  # 7.5 J per token
    assert m["fixed_k5_graphs_adaptive.physics.j_per_token_window"] == pytest.approx(330.0 * 0.2 / 10)
    assert m["fixed_k5_graphs_adaptive.code.j_per_token_window_ratio"] == pytest.approx(6.6 / 7.5)
    assert "plain_graphs.code.j_per_token_window_ratio" not in m  # the baseline has no ratio to itself


def test_a_rejected_energy_window_is_left_out_not_counted_as_zero(capsys):
    from reproductions.decode_repro import Run, energy_windows

    clock, state = _Clock(), {"mj": 1e6, "t": 0.0, "running": None}

    def fn(ids):  # draws nothing: the counter does not move
        clock.t += 0.5
        return [1] * 10, {}, ""

    runs = [Run("plain_graphs", "code", 0, [1] * 10, 0.5, None, {"prompt": "p"})]
    out = energy_windows({"plain_graphs": fn}, {"p": ("code", None)}, runs, _window_meter({}, clock, state), 1.0)
    assert out == [] and "energy window rejected (plain_graphs, p)" in capsys.readouterr().out


def test_the_energy_window_table_reads_the_ratios_and_is_absent_without_windows():
    from reproductions.readme_results import energy_window_section

    rec = _gated_record([1.0], {"code": 1.9, "physics": 2.5, "poem": 2.0})
    assert energy_window_section(rec) == []
    rec.config["energy_window_s"] = 2.0
    rec.metrics |= {"plain_graphs.code.j_per_token_window": 0.5,
                    "fixed_k5_graphs_adaptive.code.j_per_token_window": 0.45,
                    "fixed_k5_graphs_adaptive.code.j_per_token_window_ratio": 0.9}
    text = energy_window_section(rec)
    assert "at least 2.0 s" in text[0] and text[-1] == "| code | 0.5000 | 0.900x |"


def test_the_suite_measures_energy_windows_only_when_asked_and_only_for_graphed_loops(monkeypatch):
    """run_decode_suite's energy_window_s acts: 0 measures no window; > 0 gives each graphed loop one window per prompt
    of as many back-to-back decodes as fill it, while eager plain keeps only its per-run windows."""
    import reproductions.decode_repro as dr

    clock, state = _Clock(), {"mj": 1e6, "t": 0.0, "running": None}

    def decoder(name):
        def fn(ids):
            state["running"] = name
            clock.t += 0.25
            return [1] * 10, {}, ""
        return fn

    monkeypatch.setattr(dr, "variants", lambda *a, **k: {"plain": decoder("plain"),
                                                          "plain_graphs": decoder("plain_graphs")})
    monkeypatch.setattr(dr.time, "perf_counter", clock)  # the suite's run times on the fake clock
    meter = _window_meter({"plain": 100.0, "plain_graphs": 200.0}, clock, state)
    prompts = {"code-a": ("code", None), "prose-a": ("prose", None)}
    runs, windows = dr.run_decode_suite(None, None, prompts, 2, 10, meter, graphs=True, energy_window_s=0.0)
    assert len(runs) == 8 and windows == [] and all(r.energy_j == pytest.approx(r.seconds * (
        100.0 if r.variant == "plain" else 200.0)) for r in runs)
    runs, windows = dr.run_decode_suite(None, None, prompts, 2, 10, meter, graphs=True, energy_window_s=1.0)
    assert sorted((w.variant, w.prompt, w.runs, w.tokens) for w in windows) == [
        ("plain_graphs", "code-a", 4, 40), ("plain_graphs", "prose-a", 4, 40)]
    assert windows[0].energy_j == pytest.approx(200.0 * 1.0)


def test_the_readme_tree_table_judges_the_code_target_from_the_interval_and_keeps_the_energy_table(tmp_path):
    """The tree section reads the record's trees and their paired cells, one row per loop, and says 'met' only when
    the best tree's interval low end clears 2.0x (the best: the highest low end, whichever variant it is); a tree
    run does not displace the energy table of the run that decoded the gated loops."""
    import shutil
    from pathlib import Path
    from types import SimpleNamespace

    from reproductions.readme_results import render, tree_section

    def rec(low: float, wide_low: float | None = None):
        mt = {"plain_graphs.code.tokens_per_s": 520.0, "tree_graphs.code.acceptance_pct": 75.0,
              "tree_graphs.code.j_per_token_window_ratio": 0.55, "tree_graphs_wide.code.acceptance_pct": 80.0,
              "tree_graphs_wide.code.j_per_token_window_ratio": 0.65}
        cells = [("tree_graphs", 2.1, low), ("fixed_k5_graphs_adaptive", 1.07, 1.05)]
        if wide_low is not None:
            cells.append(("tree_graphs_wide", 2.2, wide_low))
        for v, med, lo in cells:
            key = f"{v}.code.paired_speedup_vs_plain_graphs"
            mt |= {key: med, f"{key}_ci_low": lo, f"{key}_ci_high": 2.3}
        config = {"trials": 5, "tree_widths": [4, 3, 3], "wide_tree_widths": [6, 4, 4] if wide_low else None,
                  "variants": ["plain_graphs", "fixed_k5_graphs_adaptive", "tree_graphs", "tree_graphs_fused_scout",
                               *(["tree_graphs_wide"] if wide_low else [])]}
        return SimpleNamespace(metrics=mt, config=config, conditions={"model": "pair"}, samples={},
                               source=SimpleNamespace(name="r.json"))

    table = "\n".join(tree_section(rec(2.02)))
    assert "| code | 520 | tree 4,3,3 | 2.100x (2.020-2.300) | 75% | 3.25 | 0.550x |" in table
    assert "| code | 520 | adaptive K5 chain | 1.070x (1.050-2.300) | - | - | - |" in table
    assert "6,4,4" not in table and "beside the adaptive K = 5 chain" in table
    assert "2.0x on code: **met** by the best tree, tree 4,3,3" in table and "(40% lower): **met**" in table
    assert "2.0x on code: **not met**" in "\n".join(tree_section(rec(1.98)))
    fused = rec(1.98)
    key = "tree_graphs_fused_scout.code.paired_speedup_vs_plain_graphs"
    fused.metrics |= {key: 2.05, f"{key}_ci_low": 2.001, f"{key}_ci_high": 2.1}
    fused_table = "\n".join(tree_section(fused))
    assert "| code | 520 | tree 4,3,3, fused scout norms | 2.050x (2.001-2.100) | - | - | - |" in fused_table
    assert "**met** by the best tree, tree 4,3,3, fused scout norms" in fused_table
    both = "\n".join(tree_section(rec(1.98, 2.01)))
    assert "| code | 520 | tree 6,4,4 | 2.200x (2.010-2.300) | 80% | 3.40 | 0.650x |" in both
    assert "**met** by the best tree, tree 6,4,4" in both and "(40% lower): **not met**" in both
    telemetry = Path(__file__).resolve().parents[1] / "telemetry"
    for name in ("20261130T220336005311Z-dc91eea8_decode_standin.json",
                 "20261201T224630876449Z-9d3c7d76_decode_standin.json"):
        shutil.copy(telemetry / name, tmp_path)
    text = render(tmp_path)
    assert "Static-tree speculation" in text and "9d3c7d76" in text
    energy = next(line for line in text.splitlines() if line.startswith("Energy of the graphed loops"))
    assert "dc91eea8" in energy


def _gated_tree_record(ratios_high: list[float], always: float):
    """_gated_record with the chain-gated loops' samples under the gated trees' names, and the always-on compiled tree
    at `always` times graphed plain on every prompt."""
    from reproductions.decode_repro import GATED_TREES, TREE_COMPILED

    rec = _gated_record(ratios_high, {"code": 1.9, "physics": 2.5, "poem": 2.0})
    for mode, v in GATED_TREES.items():
        rec.samples |= {k.replace(f"gated_{mode}_graphs|", f"{v}|"): x for k, x in list(rec.samples.items())
                        if k.startswith(f"gated_{mode}_graphs|")}
    rec.samples = {k: x for k, x in rec.samples.items() if not k.startswith(("gated_production_graphs|",
                                                                             "gated_tuned_graphs|"))}
    rec.samples |= {k.replace("plain_graphs|", f"{TREE_COMPILED}|"): [always * y for y in x]
                    for k, x in list(rec.samples.items()) if k.startswith("plain_graphs|")}
    rec.config |= {"tree_widths": [4, 3, 3],
                   "variants": ["plain", "plain_graphs", TREE_COMPILED, *GATED_TREES.values()]}
    return rec


def test_the_gated_tree_section_judges_issue_8s_bound_on_the_gated_trees():
    """The gated trees get the chain-gated loops' table and verdict (their own variants, not the chain's), and the
    always-on tree of the same run is set beside them."""
    from reproductions.decode_repro import GATED_TREES
    from reproductions.readme_results import gated_tree_section

    rec = _gated_tree_record([1.02, 1.03, 1.01, 1.04, 1.02], always=1.7)
    for key in [k for k in rec.samples if k.startswith(f"{GATED_TREES['tuned']}|")]:  # the tuned tree 10% slower
        rec.samples[key] = [0.9 * x for x in rec.samples[key]]
    text = "\n".join(gated_tree_section(rec))
    assert "| family | p50 entropy (bits) | plain graphs tok/s | production | tuned |" in text
    assert "a 4,3,3 tree with the compiled scout" in text
    assert "here physics): at the production clutch **met** (the interval's low end is 1.015)" in text
    assert "; at the tuned clutch **missed**" in text  # each column reads its own variant's runs
    assert "| code | 1.90 | 500 | 1.000x (1.000-1.000), fallback - | 0.900x (0.900-0.900), fallback - |" in text
    assert "(`tree_graphs_compiled_scout`), in the same run: code 1.700x (1.700-1.700); physics 1.700x" in text
    assert "gated_tuned_graphs" not in text


def test_a_tree_run_is_any_graphed_run_of_an_ungated_tree_and_each_replication_is_listed_on_its_own():
    """The tree table comes from the newest record with graphed plain and any always-on tree (the compiled-scout tree
    alone suffices); every record that decoded the best tree with the same widths is listed with its own interval,
    oldest first, and none with other widths."""
    from types import SimpleNamespace

    from reproductions.decode_repro import TREE_COMPILED
    from reproductions.readme_results import newest, replication_lines, tree_run

    first = _gated_tree_record([1.0] * 5, always=2.0)
    second = _gated_tree_record([1.0] * 10, always=1.9)
    other = _gated_tree_record([1.0] * 3, always=3.0)
    for rec, created, name, widths in ((first, "2026-12-02T05:00", "a.json", [4, 3, 3]),
                                       (second, "2026-12-02T09:00", "b.json", [4, 3, 3]),
                                       (other, "2026-12-02T08:00", "c.json", [5, 3])):
        rec.suite, rec.created, rec.source, rec.config["tree_widths"] = "decode_standin", created, \
            SimpleNamespace(name=name), widths
        rec.record_id = name
    gated_only = SimpleNamespace(suite="decode_standin", created="2026-12-02T10:00", record_id="gated_only",
                                 config={"variants": ["plain", "plain_graphs", "gated_tuned_graphs"]},
                                 conditions={"hardware": "NVIDIA H200"})
    records = [second, gated_only, first, other]
    assert tree_run(first) and not tree_run(gated_only)
    assert newest(records, "decode_standin", tree_run) is second
    line = "\n".join(replication_lines(second, records, TREE_COMPILED, "tree 4,3,3, compiled scout"))
    assert ("`a.json` (5 trials) 2.000x (2.000-2.000); `b.json` (10 trials) 1.900x (1.900-1.900).") in line
    assert "c.json" not in line
    assert replication_lines(other, records, TREE_COMPILED, "tree 5,3") == []  # one run: nothing to set beside
    from reproductions.readme_results import tree_section

    table = "\n".join(tree_section(second, records))  # the gated trees decoded the same widths: not rows here
    assert table.count("| code |") == 1 and "| code | 500 | tree 4,3,3, compiled scout | 1.900x" in table
    assert "`a.json` (5 trials) 2.000x" in table
