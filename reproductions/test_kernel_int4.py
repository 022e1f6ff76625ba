"""GPU reproduction of the INT4 kernel claims: latency, bandwidth, bytes moved, power/energy.

Writes one run record under telemetry/; the claims gate (`sdsie claims check`) judges it.
This test fails only if the kernel computes wrong results during the performance run or the
suite cannot run; whether the numbers hold is the claims gate's verdict, from the record.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.gpu
@pytest.mark.benchmark
def test_int4_kernel_suite(tmp_path: Path):
    from reproductions.kernels.int4_bench import run_suite

    summary = run_suite(tmp_path, sweep=False, energy=True, write_record=True)
    worst = max(row["max_rel_err"] for row in summary["table"])
    assert worst < 2e-2, f"a kernel produced wrong results during the performance run (rel err {worst:.3e})"
    assert Path(summary["record"]).exists()


def test_the_kernel_record_names_the_tuned_table_it_ran_on(tmp_path: Path, monkeypatch):
    """The suite record's config.tuned_table says which table chose the configurations: the shipped one, or the one
    $SDSIE_TUNED_CONFIGS names (gpu_run.sh after a sweep), with the sha256 of its bytes, and the local tuned cache
    when one was read. Paths are the repository's where the file lies in it, else the file's name: no machine's."""
    import hashlib

    from reproductions.kernels.int4_bench import tuned_table_provenance
    from sdsie.kernels.int4_config import SHIPPED_TUNED_PATH

    monkeypatch.delenv("SDSIE_TUNED_CONFIGS", raising=False)
    monkeypatch.setenv("SDSIE_INT4_CACHE", "off")
    shipped = tuned_table_provenance()
    assert shipped == {"path": "sdsie/kernels/tuned_configs.json", "shipped": True,
                       "sha256": hashlib.sha256(SHIPPED_TUNED_PATH.read_bytes()).hexdigest(), "local_cache": None}
    swept = tmp_path / "tuned_configs.json"
    swept.write_text("{}")
    monkeypatch.setenv("SDSIE_TUNED_CONFIGS", str(swept))
    assert tuned_table_provenance() == {"path": "tuned_configs.json", "shipped": False,
                                        "sha256": hashlib.sha256(b"{}").hexdigest(), "local_cache": None}
    local = tmp_path / "int4_tuned.json"  # the local cache `sdsie tune-int4` writes, read first by the choice
    monkeypatch.setenv("SDSIE_INT4_CACHE", str(local))
    assert tuned_table_provenance()["local_cache"] is None  # named but absent: nothing read
    local.write_text('{"format": "sdsie-int4-tuned-v1", "devices": {}}')
    assert tuned_table_provenance()["local_cache"] == {"path": "int4_tuned.json",
                                                       "sha256": hashlib.sha256(local.read_bytes()).hexdigest()}


def test_the_shape_table_lists_each_decoder_shape_once_with_every_model_that_has_it_and_untuned_shapes_first():
    from reproductions.kernels.int4_bench import LLAMA_SHAPES
    from reproductions.kernels.shape_bench import shape_table

    shapes = shape_table()
    by_nk = {(s.n, s.k): s for s in shapes}
    assert len(by_nk) == len(shapes) == 30
    assert set(by_nk[(4096, 4096)].aliases) == {"Llama-3.1-8B.q_o", "Llama-2-7B.q_k_v_o", "Mistral-7B.q_o"}
    assert by_nk[(28672, 4096)].aliases == ("Llama-3.1-8B.gate_up_fused",)
    assert by_nk[(28672, 3584)].aliases == ("Gemma-2-9B.gate_up_fused",)
    for nk in [(3584, 18944), (152064, 3584), (4608, 3584), (37888, 3584), (256000, 3584), (8192, 3584),
               (11008, 4096), (4096, 11008), (32000, 4096), (256, 1536), (1536, 8960)]:
        assert nk in by_nk
    tuned = [s.tuned for s in shapes]
    assert tuned == sorted(tuned) and sum(tuned) == len(LLAMA_SHAPES)  # the tuned five run last


def test_shape_bench_runs_m1_first_then_16_and_its_parts_split_the_shapes():
    from reproductions.kernels.shape_bench import output_name, plan_cases, shape_table

    shapes = shape_table()
    cases = plan_cases(shapes, [4, 16, 1, 2], ["128", "pc"])
    assert [c.m for c in cases[:: 2 * len(shapes)]] == [1, 16, 2, 4]
    assert (cases[0].shape, cases[0].group, cases[1].group) == (shapes[0], "128", "pc")
    parts = [{c.shape for c in plan_cases(shapes, [1], ["128"], (i, 3))} for i in (1, 2, 3)]
    assert set.union(*parts) == set(shapes) and sum(map(len, parts)) == len(shapes)
    assert output_name(True, [16, 1], (2, 3)) == "shape_bench.sweep.m1-16.part2of3.json"


def test_shape_bench_summary_sets_each_arm_against_bf16_and_sdsie_against_the_sweeps_best():
    import math

    from reproductions.kernels.shape_bench import summarize

    def rec(shape: str, bf16: float, sdsie: float, tinygemm: float, best: float) -> dict:
        return {"shape": shape, "m": 1, "group": "128", "sweep": {"best_us": best, "sdsie_over_best": sdsie / best},
                "graph_us": {"bf16": bf16, "sdsie": sdsie, "tinygemm": tinygemm, "copy": bf16 / 4}}

    s = summarize([rec("a", 40.0, 10.0, 20.0, 10.0), rec("b", 90.0, 30.0, 20.0, 20.0),
                   {**rec("c", 10.0, 5.0, 1.0, 5.0), "group": "pc"}])
    g = s["m1.g128"]
    assert g["shapes"] == 2 and g["sdsie_beats_tinygemm"] == "1/2"
    assert math.isclose(g["sdsie_geomean_speedup"], math.sqrt(4.0 * 3.0)) and g["sdsie_min_speedup"] == 3.0
    assert math.isclose(g["tinygemm_geomean_speedup"], math.sqrt(2.0 * 4.5)) and g["ceiling_geomean_speedup"] == 4.0
    assert math.isclose(g["sdsie_over_best_geomean"], math.sqrt(1.5)) and g["sdsie_over_best_max"] == 1.5
    assert g["sdsie_within_90pct_of_best"] == "1/2"  # 1.0 is within 1 / 0.9 of the best, 1.5 is not
    assert s["m1.gpc"]["shapes"] == 1


def test_the_choice_is_judged_by_its_own_configuration_timed_in_the_sweep():
    """Where the sweep timed the choice's configuration, that time (`choice_over_best`) judges it, not the sdsie arm
    timed earlier in the case; runs that predate the field keep the arm's."""
    from reproductions.kernels.shape_bench import judged, summarize

    arm_slow = {"shape": "a", "m": 1, "group": "128", "graph_us": {"bf16": 20.0, "sdsie": 12.0, "copy": 4.0},
                "sweep": {"best_us": 10.0, "sdsie_over_best": 1.2, "choice_us": 10.5, "choice_over_best": 1.05}}
    older = {**arm_slow, "shape": "b", "sweep": {"best_us": 10.0, "sdsie_over_best": 1.2}}
    assert judged(arm_slow) == 1.05 and judged(older) == 1.2
    s = summarize([arm_slow, older])["m1.g128"]
    assert s["sdsie_within_90pct_of_best"] == "1/2" and s["sdsie_over_best_max"] == 1.2


def test_the_per_shape_table_prints_each_case_and_marks_choices_under_90pct_of_the_sweeps_best(tmp_path, capsys):
    import json

    from reproductions.kernels.shape_bench import main

    def rec(shape: str, sdsie: float, best: float | None, tinygemm: bool = True) -> dict:
        g = {"bf16": 20.0, "sdsie": sdsie, "copy": 4.0, **({"tinygemm": 12.0} if tinygemm else {})}
        r = {"shape": shape, "n": 4096, "k": 4096, "m": 1, "group": "128", "sdsie_config_source": "mma",
             "graph_us": g}
        if best is not None:
            r["sweep"] = {"best_us": best, "sdsie_over_best": sdsie / best}
        return r

    path = tmp_path / "run.json"
    cases = [rec("a", 8.0, 8.0), rec("b", 10.0, 8.0, tinygemm=False), rec("c", 5.0, None)]
    path.write_text(json.dumps({"cases": cases}))
    assert main(["table", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5 and lines[0].endswith("| sweep's best | choice over best |")
    assert lines[2] == "| a | 4096x4096 | 1 | 128 | 20.0 | 8.0 (mma) | 12.0 | 4.0 | 2.50x | 8.0 | 1.00 |"
    assert lines[3].endswith("| - | 4.0 | 2.00x | 8.0 | 1.25* |")  # 10 / 8 > 1 / 0.9: under 90% of the best
    assert lines[4].endswith("| 4.00x | - | - |")
    assert main(["table"]) == 2
    (tmp_path / "other.json").write_text(json.dumps({"results": []}))
    assert main(["table", str(tmp_path / "other.json")]) == 2
    assert "not a shape_bench run" in capsys.readouterr().err


def test_the_shape_set_option_picks_which_shapes_a_run_plans(tmp_path, capsys):
    from reproductions.kernels.shape_bench import main

    for shape_set, count in (("fit", 30), ("heldout", 29), ("heldout2", 42)):
        assert main(["--out", str(tmp_path), "--shape-set", shape_set, "--m", "1", "--groups", "128",
                     "--jobs", "0", "--estimate-only"]) == 0
        assert f"plan: {count} shapes" in capsys.readouterr().out


def test_the_held_out_shapes_are_none_of_the_fitted_ones_and_name_their_own_output():
    """--shape-set heldout: 29 shapes from five other models, none of the 30 the rule and table were fitted on;
    heldout2: 42 shapes from seven more, none of either set (the mma rule is fitted on both); each set's results go
    to a file of their own."""
    from reproductions.kernels.shape_bench import HELD_OUT_2_LINEARS, HELD_OUT_LINEARS, output_name, shape_table

    fit = {(s.n, s.k) for s in shape_table()}
    held = shape_table(HELD_OUT_LINEARS)
    assert len(held) == 29 and not fit & {(s.n, s.k) for s in held}
    assert not any(s.tuned for s in held)
    assert {a.rsplit(".", 1)[0] for s in held for a in s.aliases} == {"Llama-3.2-3B", "Qwen2.5-14B", "Mistral-Nemo-12B",
                                                                  "Phi-3-mini", "Gemma-2-2B"}
    held2 = shape_table(HELD_OUT_2_LINEARS)
    assert len(held2) == 42 and not (fit | {(s.n, s.k) for s in held}) & {(s.n, s.k) for s in held2}
    assert {a.rsplit(".", 1)[0] for s in held2 for a in s.aliases} == {
        "Llama-3.2-1B", "Qwen2.5-3B", "Qwen3-4B", "Qwen3-8B", "Gemma-2-27B", "Llama-3.1-70B", "Phi-3-medium"}
    assert output_name(True, [1, 2], (1, 1), sweep_set="choice", shape_set="heldout") == \
        "shape_bench.heldout.sweep.choice.m1-2.json"
    assert output_name(True, [1], (1, 1), sweep_set="choice", shape_set="heldout2") == \
        "shape_bench.heldout2.sweep.choice.m1.json"


def test_the_choice_sweep_holds_every_configuration_the_choice_returns_on_the_held_out_shapes():
    """The exhaustive sweep a held-out shape is judged against (`choice_configs`) contains what select_config picks
    there at every M and group: the mma GEMV's configuration where it applies, else the rule's (the tuned table has
    none of these shapes), and the mma configurations are timed at exactly the M the choice gives them."""
    from reproductions.kernels.int4_bench import choice_configs, fits
    from reproductions.kernels.shape_bench import HELD_OUT_2_LINEARS, HELD_OUT_LINEARS, shape_table
    from sdsie.kernels.int4_config import MMA_BLOCK_CONFIGS, MMA_CONFIGS, mma_blocks, mma_config, rule_config

    configs = choice_configs()
    assert set(MMA_CONFIGS.values()) <= set(configs)
    for s in shape_table(HELD_OUT_LINEARS + HELD_OUT_2_LINEARS):
        for m in (1, 2, 4, 8, 16):
            for group in (128, s.k):
                picked = mma_config(m, s.n, s.k, group) or rule_config(m, s.n, s.k, min(group, s.k), 132)
                assert picked in configs and fits(picked, m), (s.name, m, group, picked)
    assert all(fits(c, m) for c in MMA_CONFIGS.values() for m in range(1, 17))
    four = mma_blocks(4, 1, 4)  # 4 pairs in flight: the choice gives it at M <= 8 only, and a sweep times it there
    assert four in configs and fits(four, 8) and not fits(four, 9)
    assert not set(MMA_BLOCK_CONFIGS.values()) & set(configs)  # a configuration names them; the choice does not


@pytest.mark.parametrize("argv, named", [(["--part", "3/2"], "--part"), (["--device", "cpu"], "--tiny"),
                                         (["--m", "3"], "--m"), (["--shapes", "Nemotron"], "--shapes")])
def test_shape_bench_refuses_bad_arguments_by_name(argv, named, tmp_path, capsys):
    from reproductions.kernels.shape_bench import main

    with pytest.raises((SystemExit, ValueError)) as exc:
        main(["--out", str(tmp_path), *argv])
    said = capsys.readouterr().err if exc.type is SystemExit else str(exc.value)
    assert named in said and not list(tmp_path.iterdir())


def test_shape_bench_dry_run_times_every_arm_and_both_sweep_configurations_and_checks_them(tmp_path):
    """The CPU dry run (interpreter, one tiny shape, two configurations) goes through the GPU run's code: its JSON
    has every arm, the sweep's errors and best, and the progress block says it finished."""
    import json
    import os

    from reproductions.kernels.shape_bench import main

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the dry run needs the Triton interpreter (TRITON_INTERPRET=1, set on CPU-only machines)")
    assert main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--sweep", "--m", "1", "--groups", "128"]) == 0
    data = json.loads((tmp_path / "shape_bench.sweep.m1.json").read_text())
    assert data["progress"]["complete"] and data["progress"]["done_cases"] == 1
    (case,) = data["cases"]
    assert set(case["graph_us"]) == {"bf16", "sdsie", "copy"} and set(case["eager_us"]) == {"bf16", "sdsie"}
    sweep = case["sweep"]
    assert len(sweep["graph_us"]) == 2 and not sweep["failed"] and max(sweep["errors"].values()) < 2e-2
    assert sweep["best_us"] == min(sweep["graph_us"].values())
    assert sweep["sdsie_over_best"] == case["graph_us"]["sdsie"] / sweep["best_us"]
    assert sweep["choice_over_best"] == sweep.get("choice_us", case["graph_us"]["sdsie"]) / sweep["best_us"]
    assert case["errors"]["sdsie"] < 2e-2 and data["summary"]["m1.g128"]["shapes"] == 1


def test_shape_bench_summary_per_m_pools_both_groups_and_counts_where_each_choice_came_from():
    import math

    from reproductions.kernels.shape_bench import summarize

    def rec(group: str, sdsie: float, source: str, tinygemm: float | None = None) -> dict:
        g = {"bf16": 40.0, "sdsie": sdsie, "copy": 10.0}
        if tinygemm is not None:
            g["tinygemm"] = tinygemm
        return {"shape": "a", "m": 4, "group": group, "sdsie_config_source": source, "graph_us": g}

    s = summarize([rec("128", 10.0, "table", 20.0), rec("128", 40.0, "rule", 20.0), rec("pc", 20.0, "rule")])
    assert s["m4.g128"]["sources"] == {"rule": 1, "table": 1} and s["m4.gpc"]["sources"] == {"rule": 1}
    pooled = s["m4"]
    assert pooled["shapes"] == 3 and pooled["sources"] == {"rule": 2, "table": 1}
    assert math.isclose(pooled["sdsie_geomean_speedup"], (4.0 * 1.0 * 2.0) ** (1 / 3))
    assert pooled["sdsie_beats_tinygemm"] == "1/2" and math.isclose(pooled["sdsie_geomean_over_tinygemm"], 1.0)
    assert list(s) == ["m4", "m4.g128", "m4.gpc"]


def test_shape_bench_can_time_the_rule_alone_and_names_its_output_apart():
    from reproductions.kernels.shape_bench import Case, Shape, auto_config, output_name
    from sdsie.kernels.int4_config import rule_config

    shape = Shape("Qwen2.5-7B.down", 3584, 18944, ("Qwen2.5-7B.down",))
    cfg, source = auto_config(Case(shape, 1, "pc", "rule"), "cpu")
    assert source == "rule" and cfg == rule_config(1, 3584, 18944, 18944, 132)
    assert auto_config(Case(shape, 16, "128"), "cpu")[1] == "rule"  # no table off a GPU
    assert output_name(False, [1, 16], (1, 1), "rule") == "shape_bench.rule.m1-16.json"
    assert output_name(False, [1, 16], (1, 1)) == "shape_bench.m1-16.json"


def test_prefill_bench_dry_run_times_every_path_and_checks_the_int4_ones(tmp_path):
    """The CPU dry run (interpreter, one tiny shape) times bf16, the fused kernel, unpack + matmul, the row slices and
    the unpack alone at M below and at DEQUANT_MIN_M, and each INT4 path's output agrees with bf16 over the same
    weights."""
    import json
    import os

    from reproductions.kernels.prefill_bench import main
    from sdsie.kernels.int4_gemm import DEQUANT_MIN_M

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the dry run needs the Triton interpreter (TRITON_INTERPRET=1, set on CPU-only machines)")
    out = tmp_path / "prefill.json"
    assert main(["--out", str(out), "--device", "cpu", "--tiny", "--m", "17", str(DEQUANT_MIN_M)]) == 0
    data = json.loads(out.read_text())
    assert data["dequant_min_m"] == DEQUANT_MIN_M and [r["m"] for r in data["rows"]] == [17, DEQUANT_MIN_M]
    for row in data["rows"]:
        assert set(row["us"]) == {"bf16", "fused", "unpack_mm", "slices", "unpack_only"}
        assert all(v["median"] > 0 for v in row["us"].values())
        assert set(row["rel_err"]) == {"fused", "unpack_mm", "slices"} and max(row["rel_err"].values()) < 2e-2
