"""The end-to-end decode suite's CPU dry run (tiny configurations): every requested (model, prompt, variant) gets a
row, the bytes each variant reads follow its layers, the compiled gated gears and the HF peer run (HF compiling its
forward), a run cut by its budget or by SIGTERM still writes its record, marked incomplete with the rows it ran, and
the record loads. Off CUDA the suite runs the INT4 kernel's float64 reference (the interpreter takes seconds per GEMV;
the kernel has its own tests) and torch's CPU tinygemm: the dry run checks the suite's plumbing."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import pytest
import torch

import reproductions.decode_e2e as e2e
from reproductions.decode_e2e import Budget, build_model, kernel_category, main
from sdsie.decoding import DecodeCompiled, prompt_compile_kwargs
from sdsie.telemetry.records import load_record

# every stage of the model's transformations, each compiled kind once (dynamo's eager backend: seconds on CPU)
VARIANTS = ["bf16", "gated_full", "gated_int4", "gated_int4_compiled", "int4", "int4_compiled", "tinygemm",
            "hf_tinygemm_compiled"]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")


def _argv(out: Path, *extra: str) -> list[str]:
    return ["--device", "cpu", "--tiny", "--out", str(out), "--models", "llama3.1-8b", "--trials", "1",
            "--new-tokens", "3", *extra]


@CPU_ONLY
def test_the_dry_run_measures_every_requested_variant_and_writes_a_record(tmp_path: Path):
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", *VARIANTS)) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["complete"] is True and doc["config"]["cut"] is None
    assert doc["config"]["int4_kernel"] == "float64 reference"
    rows = {r["variant"]: r for r in doc["results"]}
    assert list(rows) == VARIANTS
    assert all("error" not in r and r["new_tokens"] == 3 for r in rows.values()), rows
    assert rows["hf_tinygemm_compiled"]["hf_compiled"] is True  # HF compiled its forward, not an eager fallback
    for v in VARIANTS[:-1]:  # each step after the first launched ahead (the gated clutch is pinned), none dropped
        r = rows[v]
        assert (r["steps_launched_ahead"], r["steps_dropped"], r["decode_steps"]) == (1, 0, 2), (v, r)
    assert "steps_launched_ahead" not in rows["hf_tinygemm_compiled"]
    read = {v: rows[v]["bytes_per_token"] for v in VARIANTS if v != "hf_tinygemm_compiled"}
    assert read["bf16"] == read["gated_full"]  # the gated layers' INT4 halves stay unread at the bf16 gear
    assert read["gated_int4"] == read["gated_int4_compiled"] == read["int4"] == read["int4_compiled"] < read["bf16"] / 2
    assert read["tinygemm"] < read["bf16"] / 2
    assert rows["hf_tinygemm_compiled"]["bytes_per_token"] == read["tinygemm"]  # the same model under HF's generate
    summary = {r["variant"]: r for r in doc["summary"]}
    assert summary["bf16"]["speedup_vs_baseline"] == 1.0 and summary["int4"]["speedup_vs_baseline"] > 0
    assert "speedup_vs_baseline" not in summary["int4_compiled"]  # its baseline, bf16_compiled, did not run
    (record_path,) = [p for p in tmp_path.glob("*_decode_e2e.json")]
    record = load_record(record_path)
    assert record.suite == "decode_e2e" and record.complete is True and record.conditions["trials"] == 1
    assert record.metrics["llama3.1-8b.p6.int4.decode_tok_s_median"] > 0
    assert record.config["rows_run"] == [f"llama3.1-8b.p6.{v}" for v in VARIANTS]


@CPU_ONLY
def test_a_2048_token_prompt_decodes_eagerly_compiled_and_through_hf(tmp_path: Path):
    variants = ["bf16", "bf16_compiled", "gated_full_compiled", "hf_tinygemm_compiled"]
    assert main(_argv(tmp_path, "--prompt-lens", "2048", "--variants", *variants, "--no-record")) == 0
    rows = json.loads((tmp_path / "decode_e2e.json").read_text())["results"]
    assert [(r["prompt_len"], r["variant"]) for r in rows] == [(2048, v) for v in variants]
    assert all("error" not in r and r["new_tokens"] == 3 for r in rows), rows


@CPU_ONLY
def test_attention_split_kv_runs_the_engines_variants_through_the_split_kv_kernel(tmp_path: Path, monkeypatch):
    """--attention split_kv reaches the engine's decode steps (the kernel under the interpreter) and the record."""
    import importlib

    module = importlib.import_module("sdsie.kernels.decode_attention")
    calls = []
    real = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", "bf16", "--attention", "split_kv", "--no-record",
                      "--no-profile", "--no-energy")) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["config"]["attention"] == doc["config"]["attention_run"] == "split_kv"
    assert "error" not in doc["results"][0] and calls


@CPU_ONLY
def test_the_record_names_the_attention_that_ran_for_the_default(tmp_path: Path, monkeypatch):
    """The default asks for "auto", which on a CPU runs SDPA: the record says both, and the kernel never runs."""
    import importlib

    module = importlib.import_module("sdsie.kernels.decode_attention")
    monkeypatch.setattr(module, "_launch", lambda *a, **k: pytest.fail("auto ran the split-KV kernel on a CPU"))
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", "bf16", "--no-record", "--no-profile",
                      "--no-energy")) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert (doc["config"]["attention"], doc["config"]["attention_run"]) == ("auto", "sdpa")
    assert "error" not in doc["results"][0]


@pytest.mark.parametrize("flag, expected", [((), True), (("--no-launch-ahead",), False)])
def test_launch_ahead_reaches_the_engine_and_the_record(tmp_path: Path, monkeypatch, flag, expected):
    """The engine's rows run with DecodeConfig.launch_ahead as asked (on by default), and the record says which."""
    import reproductions.decode_e2e as e2e

    seen = []
    real = e2e.generate
    monkeypatch.setattr(e2e, "generate", lambda model, prompt, cfg, **kw: seen.append(cfg.launch_ahead)
                        or real(model, prompt, cfg, **kw))
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", "bf16", "--no-record", "--no-profile",
                      "--no-energy", *flag)) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["config"]["launch_ahead"] is expected and seen and set(seen) == {expected}


@CPU_ONLY
@pytest.mark.parametrize("layout", ["fused", "unfused"])
def test_the_gated_variants_run_the_asked_layout(tmp_path: Path, monkeypatch, layout: str):
    """Fused by default: the gated model's q/k/v and gate/up are one GatedLinear each, as the INT4 model's are one
    Int4Linear, so its INT4 gear decodes the INT4 variant's tokens; unfused keeps int4_unfused possible."""
    import reproductions.decode_e2e as e2e
    from sdsie.quant.fuse import FusedMLP

    fused_when_gated: dict[bool, set] = {}
    real = e2e.generate

    def spy(model, prompt, cfg, **kw):
        has_fused = any(isinstance(m, FusedMLP) for m in model.modules())
        fused_when_gated.setdefault(kw.get("gear") is not None, set()).add(has_fused)
        return real(model, prompt, cfg, **kw)

    monkeypatch.setattr(e2e, "generate", spy)
    variants = ["gated_int4", "gated_int4_compiled", *(["int4_unfused"] if layout == "unfused" else []), "int4",
                "int4_compiled"]
    extra = ("--gated-layout", layout) if layout == "unfused" else ()
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", *variants, *extra, "--no-record", "--no-profile",
                      "--no-energy")) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    rows = {r["variant"]: r for r in doc["results"]}
    assert doc["config"]["gated_layout"] == layout and list(rows) == variants
    assert fused_when_gated == {True: {layout == "fused"}, False: {False, True} if layout == "unfused" else {True}}
    if layout == "fused":  # the same INT4 layers, the same reference kernel, compiled or not: the same greedy tokens
        assert len({rows[v]["tokens_sha256"] for v in variants}) == 1, rows


@CPU_ONLY
def test_a_profile_that_fails_leaves_the_rows_timings_and_says_why(tmp_path: Path, monkeypatch):
    import reproductions.decode_e2e as e2e

    def broken(run, device):
        raise RuntimeError("profiler unavailable under this graph")

    monkeypatch.setattr(e2e, "profile_kernels", broken)
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", "bf16", "--no-record", "--no-energy")) == 0
    (row,) = json.loads((tmp_path / "decode_e2e.json").read_text())["results"]
    assert "error" not in row and row["decode_tok_s_median"] > 0 and "per_token" not in row
    assert row["profile_error"] == "RuntimeError: profiler unavailable under this graph"


def test_int4_unfused_beside_a_fused_gated_variant_is_refused_by_name(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(tmp_path, "--variants", "gated_int4", "int4_unfused"))
    assert exit_info.value.code == 2 and "--gated-layout unfused" in capsys.readouterr().err


@CPU_ONLY
def test_the_norm_fused_rows_run_gated_and_not_and_leave_the_later_rows_unfused(tmp_path: Path, monkeypatch):
    """gated_norms_* (fuse_norms over GatedLinear, both gears) and int4_norms_*: each runs on a model whose norms
    are fused, and the rows after them (tinygemm) on one whose norms are back."""
    import reproductions.decode_e2e as e2e
    from sdsie.quant.norms import NormFusedLayer

    fused_in: dict[str, bool] = {}
    real = e2e.generate

    def spy(model, prompt, cfg, **kw):
        fused_in.setdefault(spy.variant, any(isinstance(m, NormFusedLayer) for m in model.modules()))
        return real(model, prompt, cfg, **kw)

    real_measure = e2e.measure

    def tagged(variant, *args, **kw):
        spy.variant = variant.name
        return real_measure(variant, *args, **kw)

    monkeypatch.setattr(e2e, "generate", spy)
    monkeypatch.setattr(e2e, "measure", tagged)
    variants = ["gated_norms_full_compiled", "gated_norms_int4_compiled", "int4_norms", "int4_norms_compiled",
                "tinygemm"]
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", *variants, "--no-record", "--no-profile",
                      "--no-energy")) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "decode_e2e.json").read_text())["results"]}
    assert list(rows) == variants and all(len(r["decode_tok_s"]) == 1 for r in rows.values())
    assert fused_in == {**dict.fromkeys(variants[:4], True), "tinygemm": False}
    assert "gated_norms_int4_compiled" not in e2e.DEFAULT_VARIANTS
    with pytest.raises(SystemExit):
        main(_argv(tmp_path, "--variants", "gated_norms_int4_compiled", "--gated-layout", "unfused"))


def test_time_outside_kernels_is_wall_time_per_token_less_busy_gpu_time():
    from reproductions.decode_e2e import outside_kernels_us, summarize, table

    assert outside_kernels_us(400.0, 2300.0) == pytest.approx(200.0)  # 2,500 us a token, 2,300 of them in kernels
    assert outside_kernels_us(None, 2300.0) is None
    busy = {"gemv_gemm.busy_us": 1800.0, "attention.busy_us": 200.0, "other.busy_us": 300.0}
    row = {"model": "m", "prompt_len": 32, "variant": "int4", "decode_tok_s_median": 400.0, "e2e_tok_s_median": 390.0,
           "j_per_token": 1.0, "j_per_token_decode": 0.9, "j_per_token_decode_diff": 0.85, "share_of_bound": 0.4,
           "per_token": {"kernels": 400.0, "gpu_us": 3100.0, "busy_us": 2300.0, "outside_us": 200.0, **busy}}
    (summary,) = summarize([row])
    assert summary["outside_us_per_token"] == 200.0
    cells = table([summary]).splitlines()[-1].split(" | ")
    assert cells[6:11] == ["0.900 / 0.850", "400", "1800 / 200 / 300", "3100", "200"]  # both decode J/token figures


def test_the_prefill_profile_sums_a_one_token_runs_categories_and_prices_the_host_time():
    from reproductions.decode_e2e import CATEGORIES, prefill_profile

    one = {f"{c}.{w}": v for c, (k, us, busy) in zip(CATEGORIES, ((260, 9000.0, 7000.0), (32, 400.0, 400.0),
                                                                   (300, 2000.0, 1600.0)), strict=True)
           for w, v in (("kernels", k), ("us", us), ("busy_us", busy))}
    out = prefill_profile(one, prefill_s=0.031)
    assert (out["kernels"], out["gpu_us"], out["busy_us"]) == (592, 11400.0, 9000.0)
    assert out["outside_us"] == pytest.approx(22000.0)  # 31 ms of wall, 9 ms of it busy on the GPU
    assert out["gemv_gemm.busy_us"] == 7000.0
    assert prefill_profile(one, prefill_s=0.0)["outside_us"] is None  # HF rows: no prefill time of their own


def test_a_run_out_of_time_writes_an_incomplete_record(tmp_path: Path):
    assert main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--max-seconds", "0"]) == 2
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["complete"] is False and doc["results"] == [] and doc["config"]["cut"].startswith("--max-seconds 0")
    (record_path,) = tmp_path.glob("*_decode_e2e.json")
    record = load_record(record_path)
    assert record.complete is False and record.config["rows_run"] == []


@CPU_ONLY
def test_a_run_stopped_by_sigterm_keeps_its_finished_rows_in_an_incomplete_record(tmp_path: Path, monkeypatch):
    """SIGTERM (what `timeout` sends) arriving during the second row: the first row is in the JSON and the record,
    both marked incomplete with the rows run and the reason, and the exit status says the run was cut."""
    measure = e2e.measure
    calls = []

    def measure_then_stop(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return measure(*args, **kwargs)

    monkeypatch.setattr(e2e, "measure", measure_then_stop)
    previous = signal.getsignal(signal.SIGTERM)
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", "bf16", "gated_full", "int4")) == 2
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is the suite's only while it runs
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["complete"] is False and doc["config"]["cut"].startswith("SIGTERM")
    assert [r["variant"] for r in doc["results"]] == ["bf16"]
    (record_path,) = tmp_path.glob("*_decode_e2e.json")
    record = load_record(record_path)
    assert record.complete is False and record.config["rows_run"] == ["llama3.1-8b.p6.bf16"]
    assert record.metrics["llama3.1-8b.p6.bf16.decode_tok_s_median"] > 0


def test_the_budget_starts_a_row_only_if_its_estimate_ends_within_the_limit():
    """Before a kind has run, its default estimate counts; after, its longest row so far."""
    now = [0.0]
    budget = Budget(100.0, {"compiled": 90.0}, clock=lambda: now[0])
    now[0] = 5.0
    assert budget.fits("compiled") and budget.fits("eager")  # 5 + 90 and 5 + 0 end within 100
    now[0] = 20.0
    assert not budget.fits("compiled") and budget.fits("eager")
    budget.took("eager", 70.0)
    assert budget.fits("eager")  # 20 + 70
    now[0] = 31.0
    assert not budget.fits("eager")
    assert Budget(None).fits("compiled")


def test_the_tiny_models_are_built_in_the_asked_dtype_and_compiled_wrappers_keep_the_engines_view():
    model = build_model("qwen2.5-7b", tiny=True, device=torch.device("cpu"), dtype=torch.float32)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v bias
    wrapped = DecodeCompiled(model, backend="eager")
    assert wrapped.config is model.config and wrapped.get_output_embeddings() is model.lm_head
    assert [n for n, _ in wrapped.named_children()] == ["model"]


@pytest.mark.parametrize("compile_prefill", [True, False])
def test_compiled_wrappers_send_one_token_to_the_static_step_and_prompts_to_the_dynamic_prefill(
        monkeypatch, compile_prefill: bool):
    calls = []

    def fake_compile(model, **kw):
        return lambda **inputs: calls.append((kw["dynamic"], inputs["input_ids"].shape[-1])) or model(**inputs)

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = build_model("llama3.1-8b", tiny=True, device=torch.device("cpu"), dtype=torch.float32)
    wrapped = DecodeCompiled(model, compile_prefill)
    for n in (5, 1, 7):
        wrapped(input_ids=torch.ones(1, n, dtype=torch.long))
    assert calls == ([(True, 5), (False, 1), (True, 7)] if compile_prefill else [(False, 1)])


@CPU_ONLY
@pytest.mark.parametrize(("flag", "variant", "expected"), [((), "bf16_compiled", (False, False)),
                                                          (("--compile-prefill",), "bf16_compiled", (True, False)),
                                                          (("--prefill-graphs",), "bf16", (False, True)),
                                                          (("--compile-prefill", "--prefill-graphs"), "bf16_compiled",
                                                           (True, True))])
def test_the_record_says_whether_the_prefill_was_compiled_or_graphed(tmp_path: Path, flag: tuple, variant: str,
                                                                     expected: tuple):
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", variant, "--no-record", "--no-profile",
                      "--no-energy", *flag)) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert (doc["config"]["compile_prefill"], doc["config"]["prefill_graphs"]) == expected
    assert doc["config"]["prefill_inductor_options"] is None  # the CPU dry run compiles with the eager backend
    assert all("error" not in r for r in doc["results"]), doc["results"]


def test_the_record_gives_the_compiled_prompts_inductor_options():
    """On a GPU the record's `prefill_inductor_options` are the step's with programmatic launch off, as DecodeCompiled
    compiles the prompt."""
    args = argparse.Namespace(compile_backend=None, inductor_options=[("combo_kernels", True),
                                                                      ("triton.enable_pdl", True)])
    assert e2e._compile_kwargs(args) == {"options": {"combo_kernels": True, "triton.enable_pdl": True}}
    assert prompt_compile_kwargs(e2e._compile_kwargs(args))["options"] == {"combo_kernels": True,
                                                                           "triton.enable_pdl": False}


@pytest.mark.parametrize(("name", "category"), [
    ("_int4_gemv_kernel", "gemv_gemm"), ("void tinygemm_m16n8k16_chunk_kernel<...>", "gemv_gemm"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemv_gemm"), ("pytorch_flash::flash_fwd_splitkv_kernel", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other"),
    ("triton_red_fused__to_copy_add_int4_mm_mean_mul_pow_rsqrt_14", "other"),  # RMSNorm after an INT4 GEMV
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_add_arange_bmm_cat_cos_6", "other"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128", "attention"),
])
def test_kernels_are_sorted_into_the_three_categories(name: str, category: str):
    assert kernel_category(name) == category


def _span(name: str, start: float, end: float, device=torch.autograd.DeviceType.CUDA):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_kernel_times_counts_launches_sums_durations_and_busy_time_by_name_and_skips_host_events():
    from types import SimpleNamespace

    from reproductions.decode_e2e import kernel_times

    events = [_span("gemv", 0.0, 2.0), _span("norm", 1.0, 3.5),  # the norm waits on the gemv from 1 to 2
              _span("gemv", 4.0, 7.0), _span("aten::mm", 0.0, 9.0, torch.autograd.DeviceType.CPU)]
    assert kernel_times(SimpleNamespace(events=lambda: events)) == {"gemv": [2, 5.0, 5.0], "norm": [1, 2.5, 1.5]}


def test_host_times_sums_the_named_host_calls_and_skips_the_rest():
    from types import SimpleNamespace

    from reproductions.decode_e2e import host_times

    cpu = torch.autograd.DeviceType.CPU
    events = [_span("Torch-Compiled Region: 1/0", 0.0, 30.0, cpu), _span("sdsie::int4_mm", 1.0, 41.0, cpu),
              _span("cuLaunchKernelEx", 2.0, 7.0, cpu), _span("sdsie::int4_mm", 50.0, 60.0, cpu),
              _span("cudaLaunchKernel", 61.0, 64.0, cpu), _span("aten::mm", 0.0, 9.0, cpu),
              _span("sdsie::int4_mm", 0.0, 5.0)]  # a device event of that name is not host time
    assert host_times(SimpleNamespace(events=lambda: events)) == {
        "Torch-Compiled Region": [1, 30.0], "sdsie::int4_mm": [2, 50.0], "cuLaunchKernel": [1, 5.0],
        "cudaLaunchKernel": [1, 3.0]}


def test_busy_time_gives_overlap_to_the_kernel_that_started_first_and_adds_up_to_the_union():
    from reproductions.decode_e2e import busy_times

    # a PDL chain: each kernel starts before the one before it ends; a gap; then one kernel inside another's span
    spans = [("a", 0.0, 10.0), ("b", 8.0, 12.0), ("c", 11.0, 20.0), ("d", 25.0, 30.0), ("e", 26.0, 28.0)]
    assert busy_times(spans) == [10.0, 2.0, 8.0, 5.0, 0.0]
    assert sum(busy_times(spans)) == 10.0 + 2.0 + 8.0 + 5.0  # the union: [0, 20] and [25, 30]
    assert busy_times(list(reversed(spans))) == [0.0, 5.0, 8.0, 2.0, 10.0]  # by start time, not by list order
    assert busy_times([("x", 1.0, 2.0), ("y", 1.0, 3.0)]) == [1.0, 1.0]  # a tie: the one listed first owns it
    with pytest.raises(ValueError, match="ends before it starts"):
        busy_times([("x", 2.0, 1.0)])


def test_the_split_kv_attention_kernels_are_profiled_as_attention():
    """The profile names a Triton kernel by its function's name: both split-KV kernels must land in attention."""
    import importlib

    da = importlib.import_module("sdsie.kernels.decode_attention")  # the package exports its function by that name
    names = [da._attention_split_kernel.fn.__name__, da._attention_reduce_kernel.fn.__name__]
    assert [kernel_category(n) for n in names] == ["attention", "attention"], names


def test_inductor_options_reach_every_compiled_variant_and_the_record(tmp_path: Path, monkeypatch):
    seen = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw.get("options")) or real(model, **kw))
    assert main(_argv(tmp_path, "--prompt-lens", "6", "--variants", "bf16_compiled", "--no-record", "--no-profile",
                      "--no-energy", "--compile-prefill", "--inductor-option", "combo_kernels=true",
                      "--inductor-option", "combo_kernel_max_num_nodes=4")) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["config"]["inductor_options"] == {"combo_kernels": True, "combo_kernel_max_num_nodes": 4}
    assert seen == [{"combo_kernels": True, "combo_kernel_max_num_nodes": 4}] * 2  # the decode step, the prefill
    with pytest.raises(SystemExit):
        main(_argv(tmp_path, "--inductor-option", "combo_kernels"))


def _joule_meter(monkeypatch, joules_of_run):
    """A meter that counts joules only, and `_run_once` patched to add joules_of_run(tokens, the last run's tokens)
    to it a run: (the meter, the runs' token counts in order). Each window lasts 1 s."""
    from reproductions import decode_e2e
    from sdsie.telemetry.energy import EnergyWindow

    state = {"j": 0.0, "calls": [128]}  # as if a whole run came just before

    def run_once(v, prompt, new_tokens, graphs):
        state["j"] += joules_of_run(new_tokens, state["calls"][-1])
        state["calls"].append(new_tokens)
        return decode_e2e.Run(new_tokens, 0.01, 0.002 * (new_tokens - 1), [0] * new_tokens)

    class Meter:
        def start(self):
            return state["j"]

        def stop(self, start, tokens=None):
            return EnergyWindow("fake", 1.0, state["j"] - start, tokens, None, {}, {})

    monkeypatch.setattr(decode_e2e, "_run_once", run_once)
    return Meter(), state["calls"]


def test_decode_energy_takes_the_prefills_energy_out_of_a_tokens(monkeypatch):
    """A prefill-only window prices the prefill: with a prefill (and its token) of P joules and D joules for every
    later token, J a decoded token is D, where the whole run's J/token is (P + 127 D) / 128."""
    from reproductions import decode_e2e
    from sdsie.telemetry.energy import EnergyWindow

    prefill_j, step_j = 40.0, 0.5
    meter, calls = _joule_meter(monkeypatch, lambda tokens, last: prefill_j + (tokens - 1) * step_j)
    whole = EnergyWindow("fake", 1.0, prefill_j + 127 * step_j, 128, None, {}, {})  # one whole run
    out = decode_e2e.decode_energy(None, torch.zeros(3), False, meter, 0.5, whole, 1, 128)
    assert out["prefill_j"] == pytest.approx(prefill_j)
    assert out["j_per_token_decode"] == pytest.approx(step_j)
    assert out["j_per_token_decode_diff"] == pytest.approx(step_j) and out["decode_diff_short_tokens"] == 32
    # two timed runs before each window: prefill-only runs, then runs of a quarter of the tokens
    assert set(calls[1:]) == {1, 32} and out["prefill_energy_runs"] == calls.count(1) - 2
    assert out["decode_diff_energy_runs"] == calls.count(32) - 2
    assert decode_e2e.decode_energy(None, torch.zeros(3), False, meter, 0.5, whole, 1, 1) == {}
    with pytest.raises(ValueError, match="run_count=0"):
        decode_e2e.decode_energy(None, torch.zeros(3), False, meter, 0.5, whole, 0, 128)
    rows = decode_e2e.summarize([
        {"model": "m", "prompt_len": 32, "variant": "bf16_compiled", "j_per_token": 2.0, "j_per_token_decode": 1.6},
        {"model": "m", "prompt_len": 32, "variant": "int4_compiled", "j_per_token": 1.0, "j_per_token_decode": 0.6}])
    assert rows[1]["energy_vs_baseline"] == pytest.approx(0.5)
    assert rows[1]["decode_energy_vs_baseline"] == pytest.approx(0.375)


def test_the_differenced_decode_energy_holds_where_a_prefill_draws_more_after_a_decode(monkeypatch):
    """A prefill that follows a decode costs X joules more than one that follows a prefill (the card is still at its
    decode power): pricing it in a window of prefills alone under-counts it, so `j_per_token_decode` is off by
    X / 127; differencing whole runs with runs of 32 tokens, where every prefill follows a decode, gives D exactly.
    Runs shorter than DIFF_MIN_TOKENS get no differenced figure."""
    from reproductions import decode_e2e
    from sdsie.telemetry.energy import EnergyWindow

    prefill_j, extra_j, step_j = 40.0, 12.7, 0.5
    meter, _ = _joule_meter(monkeypatch, lambda tokens, last: prefill_j + (extra_j if last > 1 else 0.0)
                            + (tokens - 1) * step_j)
    whole = EnergyWindow("fake", 1.0, prefill_j + extra_j + 127 * step_j, 128, None, {}, {})  # one whole run
    out = decode_e2e.decode_energy(None, torch.zeros(3), False, meter, 0.5, whole, 1, 128)
    assert out["j_per_token_decode"] == pytest.approx(step_j + extra_j / 127, rel=1e-3)
    assert out["j_per_token_decode_diff"] == pytest.approx(step_j)
    short = decode_e2e.decode_energy(None, torch.zeros(3), False, meter, 0.5, whole, 1,
                                     decode_e2e.DIFF_MIN_TOKENS - 1)
    assert "j_per_token_decode" in short and "j_per_token_decode_diff" not in short
    rows = decode_e2e.summarize([
        {"model": "m", "prompt_len": 32, "variant": "bf16_compiled", "j_per_token_decode_diff": 2.0},
        {"model": "m", "prompt_len": 32, "variant": "int4_compiled", "j_per_token_decode_diff": 0.8}])
    assert rows[1]["decode_energy_diff_vs_baseline"] == pytest.approx(0.4)


@pytest.mark.parametrize(("graphs", "asked", "expected"), [(True, True, True), (True, False, False),
                                                           (False, True, False)])
def test_a_variant_graphs_its_prefill_only_when_asked_and_graphed(monkeypatch, graphs: bool, asked: bool,
                                                                  expected: bool):
    seen = []

    def fake_generate(model, prompt, cfg, **kw):
        seen.append(cfg.prefill_graphs)
        raise StopIteration

    monkeypatch.setattr(e2e, "generate", fake_generate)
    v = e2e.Variant("bf16", torch.nn.Identity(), prefill_graphs=asked)
    with pytest.raises(StopIteration):
        e2e._run_once(v, torch.tensor([1, 2]), 4, graphs)
    assert seen == [expected]


def test_decode_energy_above_idle_takes_idle_power_over_each_windows_time_out(monkeypatch):
    """With the meter's idle baseline, each window's energy less idle power times its length: a card idling at 100 W
    that runs a prefill of 0.01 s at 300 W and decode steps of 0.002 s at 500 W spends 0.8 J a decoded token above
    idle (1.0 J in all); without a baseline no above-idle figure is made."""
    from reproductions import decode_e2e
    from sdsie.telemetry.energy import EnergyWindow, IdleBaseline

    idle_w, clock = 100.0, {"t": 0.0, "j": 0.0}

    def run_once(v, prompt, new_tokens, graphs):
        clock["t"] += 0.01 + 0.002 * (new_tokens - 1)
        clock["j"] += 300.0 * 0.01 + 500.0 * 0.002 * (new_tokens - 1)
        return decode_e2e.Run(new_tokens, 0.01, 0.002 * (new_tokens - 1), [0] * new_tokens)

    class Meter:
        def __init__(self, idle):
            self.idle = idle

        def start(self):
            return dict(clock)

        def stop(self, start, tokens=None):
            return EnergyWindow("fake", clock["t"] - start["t"], clock["j"] - start["j"], tokens, self.idle, {}, {})

    monkeypatch.setattr(decode_e2e, "_run_once", run_once)
    run_j, run_s = 300.0 * 0.01 + 500.0 * 0.002 * 127, 0.01 + 0.002 * 127
    idle = IdleBaseline(power_w=idle_w, duration_s=5.0, energy_j=500.0, backend="fake")
    meter = Meter(idle)
    whole = EnergyWindow("fake", 2 * run_s, 2 * run_j, 256, idle, {}, {})  # two whole runs
    out = decode_e2e.decode_energy(None, torch.zeros(3), False, meter, 0.5, whole, 2, 128)
    assert out["j_per_token_decode"] == pytest.approx(1.0)
    assert out["j_per_token_decode_above_idle"] == pytest.approx(0.8)
    bare_window = EnergyWindow("fake", 2 * run_s, 2 * run_j, 256, None, {}, {})
    bare = decode_e2e.decode_energy(None, torch.zeros(3), False, Meter(None), 0.5, bare_window, 2, 128)
    assert bare["j_per_token_decode"] == pytest.approx(1.0) and "j_per_token_decode_above_idle" not in bare
    # the suite's row and record carry both, through measure()
    model = build_model("llama3.1-8b", tiny=True, device=torch.device("cpu"), dtype=torch.float32)
    row = decode_e2e.measure(decode_e2e.Variant("bf16", model), torch.zeros(3, dtype=torch.long), 128, 1, False,
                             meter, 0.5, None, False)
    assert row["idle_power_w"] == idle_w and row["j_per_token_decode_above_idle"] == pytest.approx(0.8)
    row.update(model="llama3.1-8b", prompt_len=3, variant="bf16")
    doc = {"results": [row], "summary": decode_e2e.summarize([row]), "complete": True,
           "config": {"models": ["llama3.1-8b"], "trials": 1}}
    metrics = decode_e2e.record_of(doc, "cpu").metrics
    assert metrics["llama3.1-8b.p3.bf16.j_per_token_decode_above_idle"] == pytest.approx(0.8)
    assert metrics["llama3.1-8b.p3.bf16.idle_power_w"] == idle_w
