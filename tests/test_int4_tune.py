"""`sdsie tune-int4` (`sdsie.kernels.int4_tune`): tuning times the choice's own candidates for a shape, keeps the
fastest correct one per GPU model in the local cache, and `select_config` then takes it before its other sources.
Under the interpreter the times are the wall clock's, so the tests that check the pick give the tuner a timer of
their own."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from sdsie import cli
from sdsie.int4_format import Int4Weight, pack_int4
from sdsie.kernels import int4_config, int4_gemm, int4_matmul, int4_matmul_reference
from sdsie.kernels import int4_tune as tu
from sdsie.kernels.int4_config import select_config_with_source
from sdsie.kernels.int4_gemm import _plans_of
from sdsie.models import tiny_llama
from sdsie.quant import QuantConfig, fuse_projections, gate_model, quantize_model

N, K = 64, 256


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh tuned cache for the test, forgotten again after it."""
    path = tmp_path / "int4_tuned.json"
    monkeypatch.setenv(int4_config.TUNED_CACHE_ENV, str(path))
    int4_gemm.refresh_choice()
    yield path
    monkeypatch.setenv(int4_config.TUNED_CACHE_ENV, "off")
    int4_gemm.refresh_choice()


def _timer_favouring(name: str, monkeypatch):
    """A timer under which the configuration called `name` is the fastest (10 us) and every other takes 20 us; it
    runs the call it is given and records the configuration that call named."""
    timed, last = [], {}
    real = tu.int4_matmul

    def recording(x, w, config=None):
        last["config"] = config
        return real(x, w, config=config)

    monkeypatch.setattr(tu, "int4_matmul", recording)

    def timer(make_call, nbytes):
        make_call(0)()
        timed.append(tu.config_name(last["config"]))
        return 10.0 if timed[-1] == name else 20.0

    return timer, timed


def _weight(seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(K // 128, N, generator=gen) + 0.5) * 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (K // 128, N), generator=gen).to(torch.bfloat16)
    return Int4Weight(pack_int4(q), scales, zeros, K, 128)


def test_tuning_keeps_the_fastest_candidate_and_select_config_takes_it_first(cache, monkeypatch):
    case = tu.TuneCase(1, N, K, 128)
    cpu = torch.device("cpu")
    builtin, source = select_config_with_source(1, N, K, cpu, 128)
    assert source == "rule"
    candidates = tu.case_candidates(case, cpu)
    assert builtin in candidates and not any(c.mma for c in candidates)  # the CPU has no mma kernel
    assert all(c.block_m == 1 for c in candidates)  # M = 1 times only the one-row GEMVs (`fits`)
    favourite = next(c for c in candidates if c != builtin)
    w, x = _weight(), torch.randn(1, K).to(torch.bfloat16)
    launched = []  # the configuration of every launch plan int4_matmul builds
    real_plan = int4_gemm._plan
    monkeypatch.setattr(int4_gemm, "_plan", lambda x2, w_, cfg, *a, **kw: (launched.append(cfg),
                                                                           real_plan(x2, w_, cfg, *a, **kw))[1])
    int4_matmul(x, w)  # an automatic plan, chosen before tuning
    assert launched == [builtin] and any(key[-1] is None for key in _plans_of(w))

    timer, timed = _timer_favouring(tu.config_name(favourite), monkeypatch)
    [result] = tu.tune([case], cpu, timer=timer, copies=lambda nbytes: 1)

    assert sorted(timed) == sorted(tu.config_name(c) for c in candidates)  # each timed once
    assert result.best == favourite and result.best_us == 10.0 and result.builtin_us == 20.0
    assert result.builtin == tu.config_name(builtin) and result.builtin_source == "rule"
    assert all(err < tu.CORRECT_REL_ERROR for err in result.errors.values()) and not result.failed
    doc = json.loads(cache.read_text())
    entry = doc["devices"]["cpu"]
    assert int4_config.Int4KernelConfig(**entry["configs"][case.key]) == favourite
    assert entry["evidence"][case.key]["builtin_us"] == 20.0
    assert select_config_with_source(1, N, K, cpu, 128) == (favourite, "tuned")
    assert select_config_with_source(2, N, K, cpu, 128)[1] == "rule"  # M = 2 is another bucket, not tuned
    assert not any(key[-1] is None for key in _plans_of(w))  # the weight chooses again at its next call
    launched.clear()
    y = int4_matmul(x, w)
    assert launched == [favourite]  # the tuned entry is what runs, not only what select_config says
    torch.testing.assert_close(y.double(), int4_matmul_reference(x, w), rtol=2e-2, atol=2e-3)


def test_a_candidate_with_a_wrong_result_is_never_kept(cache, monkeypatch):
    case = tu.TuneCase(1, N, K, 128)
    cpu = torch.device("cpu")
    broken = tu.case_candidates(case, cpu)[-1]
    timer, timed = _timer_favouring(tu.config_name(broken), monkeypatch)
    recording = tu.int4_matmul

    def int4_matmul_broken_for_one(x, w, config=None):
        y = recording(x, w, config=config)
        return y * 3 if config == broken else y

    monkeypatch.setattr(tu, "int4_matmul", int4_matmul_broken_for_one)
    [result] = tu.tune([case], cpu, timer=timer, copies=lambda nbytes: 1)
    name = tu.config_name(broken)
    assert name in result.failed and "relative error" in result.failed[name] and name not in timed
    assert result.best is not None and result.best != broken


def test_the_summary_counts_the_builtin_choice_within_90pct_of_the_best_and_the_seconds():
    """The held-out bar, from a run's results: built-in time at most 1 / 0.9 of the best's; cases without a correct
    candidate or without the built-in's time are left out of the comparison, not counted as passing."""
    def result(builtin_us: float | None, best_us: float | None, seconds: float) -> tu.CaseResult:
        r = tu.CaseResult(tu.TuneCase(1, 64, 256, 128), "cpu", "int4[a]", "rule", seconds=seconds)
        if builtin_us is not None:
            r.times_us["int4[a]"] = builtin_us
        if best_us is not None:
            r.best = int4_config.MMA_CONFIGS[4]
            r.times_us[tu.config_name(r.best)] = best_us
        return r

    s = tu.summarize([result(10.0, 10.0, 1.0), result(12.0, 10.0, 2.0), result(11.0, 10.0, 4.0),
                      result(None, 10.0, 0.5), result(10.0, None, 0.5)])
    assert (s["cases"], s["compared"], s["builtin_within_90pct_of_best"]) == (5, 3, 2)  # 1.2 > 1 / 0.9
    assert math.isclose(s["builtin_over_best_geomean"], (1.0 * 1.2 * 1.1) ** (1 / 3))
    assert s["builtin_over_best_max"] == 1.2
    assert s["seconds_total"] == 8.0 and s["seconds_median"] == 1.0
    assert s["held_out"]["compared"] == 3  # every pick came from the rule
    assert tu.summarize([])["builtin_over_best_geomean"] is None


def test_the_summary_keeps_cases_a_table_served_out_of_the_held_out_figures():
    """A built-in pick read from a tuned table (shipped or local) was measured on that shape: its case tests no
    prediction, so the held-out figures leave it out while the run's figures keep it."""
    def result(source: str, builtin_us: float) -> tu.CaseResult:
        best = int4_config.MMA_CONFIGS[4]
        return tu.CaseResult(tu.TuneCase(1, 64, 256, 128), "cpu", "int4[a]", source,
                             {"int4[a]": builtin_us, tu.config_name(best): 10.0}, best=best)

    s = tu.summarize([result("table", 10.0), result("tuned", 10.0), result("mma", 12.0), result("rule", 10.5)])
    assert (s["compared"], s["builtin_within_90pct_of_best"]) == (4, 3)
    h = s["held_out"]
    assert (h["compared"], h["builtin_within_90pct_of_best"], h["builtin_over_best_max"]) == (2, 1, 1.2)
    assert math.isclose(h["builtin_over_best_geomean"], (1.2 * 1.05) ** 0.5)
    assert tu.summarize([result("table", 10.0)])["held_out"] == {
        "compared": 0, "builtin_within_90pct_of_best": 0, "builtin_over_best_geomean": None,
        "builtin_over_best_max": None}


def test_the_cache_merges_by_device_and_key(cache):
    cfg_a, cfg_b = int4_config.Int4KernelConfig(1, 32, 256), int4_config.Int4KernelConfig(1, 64, 256)
    cache.write_text(json.dumps({"format": int4_config.TUNED_CACHE_FORMAT, "devices": {
        "NVIDIA A100-SXM4-80GB": {"configs": {"m1|64|256|128": {"block_m": 1, "block_n": 16, "block_k": 256}}},
        "cpu": {"configs": {"m1|64|256|128": {"block_m": 1, "block_n": 16, "block_k": 256},
                            "m2|64|256|128": {"block_m": 1, "block_n": 16, "block_k": 256}}}}}))
    a = tu.CaseResult(tu.TuneCase(1, N, K, 128), "cpu", "x", "rule", {tu.config_name(cfg_a): 5.0}, best=cfg_a)
    b = tu.CaseResult(tu.TuneCase(4, N, K, 128), "cpu", "x", "rule", {tu.config_name(cfg_b): 6.0}, best=cfg_b)
    none = tu.CaseResult(tu.TuneCase(8, N, K, 128), "cpu", "x", "rule")  # nothing correct: no entry
    tu.write_tuned([a, b, none])
    devices = json.loads(cache.read_text())["devices"]
    assert devices["NVIDIA A100-SXM4-80GB"]["configs"]["m1|64|256|128"]["block_n"] == 16  # another GPU's: kept
    assert devices["cpu"]["configs"]["m1|64|256|128"]["block_n"] == 32  # the same key: replaced
    assert devices["cpu"]["configs"]["m2|64|256|128"]["block_n"] == 16  # another key: kept
    assert devices["cpu"]["configs"]["m4|64|256|128"]["block_n"] == 64
    assert "m8|64|256|128" not in devices["cpu"]["configs"]


def test_an_unreadable_cache_is_an_error_naming_it_and_off_reads_none(cache, monkeypatch):
    cache.write_text("{not json")
    with pytest.raises(ValueError, match="int4_tuned.json is not JSON"):
        select_config_with_source(1, N, K, torch.device("cpu"), 128)
    cache.write_text(json.dumps({"m1|64|256|128": {}}))  # the shipped table's shape, not the cache's
    int4_gemm.refresh_choice()
    with pytest.raises(ValueError, match="is not a sdsie-int4-tuned-v1 document"):
        select_config_with_source(1, N, K, torch.device("cpu"), 128)
    cache.write_text(json.dumps({"format": int4_config.TUNED_CACHE_FORMAT,
                                 "devices": {"cpu": {"configs": {"m1|64|256|128": {"block_m": 3}}}}}))
    int4_gemm.refresh_choice()
    with pytest.raises(ValueError, match="holds an entry that is not a configuration"):
        select_config_with_source(1, N, K, torch.device("cpu"), 128)
    monkeypatch.setenv(int4_config.TUNED_CACHE_ENV, "off")
    int4_gemm.refresh_choice()
    assert int4_config.tuned_cache_path() is None
    assert select_config_with_source(1, N, K, torch.device("cpu"), 128)[1] == "rule"
    with pytest.raises(ValueError, match="cache is off"):
        tu.write_tuned([])


def test_the_default_cache_lives_under_sdsie_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(int4_config.TUNED_CACHE_ENV)
    monkeypatch.setenv("SDSIE_CACHE", str(tmp_path))
    assert int4_config.tuned_cache_path() == tmp_path / "int4_tuned.json"


def test_tune_cases_are_buckets_and_a_fused_gate_up_has_an_even_n():
    with pytest.raises(ValueError, match="not a tuned bucket"):
        tu.TuneCase(3, N, K, 128)
    with pytest.raises(ValueError, match="even N"):
        tu.TuneCase(1, 63, K, 128, gate_up=True)
    assert tu.TuneCase(1, N, K, 4096).key == "m1|64|256|pc"


def test_model_cases_are_each_int4_shape_once_with_the_fused_gate_up_as_silu_mul():
    model = tiny_llama(seed=0)
    quantize_model(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                   QuantConfig("minmax", 32))
    fuse_projections(model)
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    cases = tu.model_cases(model, (1, 4))
    assert len(cases) == len(set(cases))
    shapes = {(c.n, c.k, c.gate_up) for c in cases}
    assert (2 * inter, hidden, True) in shapes and (hidden, inter, False) in shapes  # gate_up, down
    assert {c.m for c in cases} == {1, 4}
    with pytest.raises(ValueError, match="no Int4Linear"):
        tu.model_cases(tiny_llama(seed=0))


def test_model_cases_find_the_int4_layers_of_gated_ones():
    model = tiny_llama(seed=0)
    gate_model(model, ["gate_proj", "up_proj"], QuantConfig("minmax", 32))
    fuse_projections(model)
    cases = tu.model_cases(model, (1,))
    inter, hidden = model.config.intermediate_size, model.config.hidden_size
    assert [(c.n, c.k, c.gate_up) for c in cases] == [(2 * inter, hidden, True)]


def test_the_command_lists_cases_and_refuses_bad_input(capsys, cache):
    assert cli.TUNED_M == int4_config.TUNED_M
    assert cli.main(["tune-int4", "--shape", "64x256", "--gate-up", "128x256", "--m", "1", "4", "--device", "cpu",
                     "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["m1|64|256|128", "m4|64|256|128", "m1|128|256|128 gate_up",
                                                    "m4|128|256|128 gate_up"]
    assert not cache.exists()
    assert cli.main(["tune-int4", "--device", "cpu"]) == 2
    assert "at least one --shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["tune-int4", "--shape", "64by256"])
    assert "a shape is NxK" in capsys.readouterr().err
    assert cli.main(["tune-int4", "--gate-up", "63x256", "--device", "cpu", "--list"]) == 2
    assert "even N" in capsys.readouterr().err


def test_the_command_tunes_and_writes_the_cache_and_a_report(cache, tmp_path):
    out = tmp_path / "report.json"
    assert cli.main(["tune-int4", "--shape", "64x256", "--m", "4", "--group", "pc", "--device", "cpu", "--out",
                     str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["planned_cases"] == 1
    [result] = doc["results"]
    assert result["key"] == "m4|64|256|pc" and result["best"] in result["times_us"]
    assert result["best_us"] == min(result["times_us"].values())
    s = doc["summary"]
    assert (s["cases"], s["compared"]) == (1, 1) and s["builtin_over_best_max"] >= 1.0
    assert s["builtin_within_90pct_of_best"] == (s["builtin_over_best_max"] <= 1 / 0.9)
    configs = json.loads(cache.read_text())["devices"]["cpu"]["configs"]
    assert tu.config_name(int4_config.Int4KernelConfig(**configs["m4|64|256|pc"])) == result["best"]


def test_a_tune_on_the_kernel_device_with_its_own_timer_is_taken_and_correct(cache, kernel_device):
    """On a GPU: graphed, L2-cold times, the mma GEMV among the candidates on sm_90+; on the CPU the same procedure
    under the interpreter with wall-clock times."""
    case = tu.TuneCase(1, 128, 256, 128)
    candidates = tu.case_candidates(case, kernel_device)
    sm90 = kernel_device.type == "cuda" and torch.cuda.get_device_capability(kernel_device)[0] >= 9
    assert any(c.mma for c in candidates) == sm90
    [result] = tu.tune([case], kernel_device)
    assert not result.failed and set(result.times_us) == {tu.config_name(c) for c in candidates}
    assert result.best_us == min(result.times_us.values())
    assert select_config_with_source(1, 128, 256, kernel_device, 128) == (result.best, "tuned")
    gen = torch.Generator(device=kernel_device).manual_seed(1)
    w = tu._weight_like(case, kernel_device, gen)
    x = torch.randn(1, 256, generator=gen, device=kernel_device).to(torch.bfloat16)
    torch.testing.assert_close(int4_matmul(x, w).double(), int4_matmul_reference(x, w), rtol=2e-2, atol=2e-3)


def test_a_cpu_without_the_interpreter_is_refused_before_anything_runs(monkeypatch, capsys, cache):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tu.tune([tu.TuneCase(1, N, K, 128)], "cpu")
    assert cli.main(["tune-int4", "--shape", "64x256", "--device", "cpu"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    assert not cache.exists()


def test_config_names_read_back_to_the_configurations_they_name():
    """`config_from_name` inverts `config_name` over every configuration the choice can return, and over the flags
    sweeps name beside them (register caps, x gathers, row blocks), with or without the int4[...] wrapper; a name
    it cannot read is refused, naming the part."""
    import dataclasses

    from sdsie.kernels.int4_config import MMA_CONFIGS, mma_blocks

    extra = [dataclasses.replace(MMA_CONFIGS[4], max_registers=80), mma_blocks(8, 4, 3),
             int4_config.Int4KernelConfig(4, 128, 256, split_k=2, num_warps=8, num_stages=3, x_tile=False)]
    for cfg in tu.choice_configs() + extra:
        name = tu.config_name(cfg)
        assert tu.config_from_name(name) == cfg, name
        assert tu.config_from_name(name[5:-1]) == cfg, name
    for bad, message in [("1,128,256", "expected ROWS"), ("1,128,256,s2,w4,q9", "unknown part 'q9'"),
                         ("int4[8,16,128,s1,w4,rx,mma]", "unknown part 'rx'")]:
        with pytest.raises(ValueError, match=message):
            tu.config_from_name(bad)


def test_one_parser_reads_shapes_for_the_command_and_the_benches():
    from reproductions.kernels.int4_bench import LLAMA_SHAPES, shape_dims
    from sdsie.kernels.int4_config import parse_shape

    assert parse_shape("4096x14336") == (4096, 14336) and parse_shape(" 64X256 ") == (64, 256)
    for bad in ("4096", "4096x", "x4096", "0x64", "64x-1", "4096by4096", "4.5x2", "2x3x4"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_shape(bad)
        assert shape_dims(bad) is None
    assert shape_dims("kv_1024x4096") == LLAMA_SHAPES["kv_1024x4096"] == (1024, 4096)
