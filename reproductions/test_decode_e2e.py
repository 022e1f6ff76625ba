"""The end-to-end decode suite's CPU dry run (tiny configurations): every requested (model, prompt, variant) gets a
row, the bytes each variant reads follow its layers, tinygemm is skipped with its reason off CUDA, a cut run says so,
and the record loads. The INT4 kernel is replaced by its float64 reference here (the interpreter takes seconds per
GEMV; the kernel has its own tests): the dry run checks the suite's plumbing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import sdsie.kernels
import sdsie.kernels.ops
from reproductions.decode_e2e import DecodeCompiled, build_model, kernel_category, main
from sdsie.kernels import int4_matmul_reference
from sdsie.telemetry.records import load_record


@pytest.fixture
def reference_kernel(monkeypatch):
    def reference(x, w, *args, **kwargs):
        return int4_matmul_reference(x, w).to(x.dtype)

    monkeypatch.setattr(sdsie.kernels, "int4_matmul", reference)
    monkeypatch.setattr(sdsie.kernels.ops, "int4_matmul", reference)


VARIANTS = ["bf16", "gated_full", "gated_int4", "int4", "int4_compiled", "tinygemm"]  # one compile: seconds on CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")
def test_the_dry_run_measures_every_requested_variant_and_writes_a_record(tmp_path: Path, reference_kernel):
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--models", "llama3.1-8b", "--prompt-lens", "6",
            "--trials", "1", "--new-tokens", "3", "--variants", *VARIANTS]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["complete"] is True
    rows = {r["variant"]: r for r in doc["results"]}
    assert list(rows) == VARIANTS
    assert rows["tinygemm"]["error"] == "skipped: needs CUDA"
    measured = [v for v in VARIANTS if v != "tinygemm"]
    assert all("error" not in rows[v] and rows[v]["new_tokens"] == 3 for v in measured), rows
    read = {v: rows[v]["bytes_per_token"] for v in measured}
    assert read["bf16"] == read["gated_full"]  # the gated layers' INT4 halves stay unread at the bf16 gear
    assert read["gated_int4"] == read["int4"] == read["int4_compiled"] < read["bf16"] / 2  # fused: the same bytes
    summary = {r["variant"]: r for r in doc["summary"]}
    assert summary["bf16"]["speedup_vs_baseline"] == 1.0 and summary["int4"]["speedup_vs_baseline"] > 0
    assert "speedup_vs_baseline" not in summary["int4_compiled"]  # its baseline, bf16_compiled, did not run
    (record_path,) = [p for p in tmp_path.glob("*_decode_e2e.json")]
    record = load_record(record_path)
    assert record.suite == "decode_e2e" and record.complete is True and record.conditions["trials"] == 1
    assert record.metrics["llama3.1-8b.p6.int4.decode_tok_s_median"] > 0


def test_a_run_out_of_time_is_marked_incomplete(tmp_path: Path):
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--max-seconds", "0", "--no-record"]
    assert main(argv) == 2
    doc = json.loads((tmp_path / "decode_e2e.json").read_text())
    assert doc["complete"] is False and doc["results"] == []


def test_the_tiny_models_are_built_in_the_asked_dtype_and_compiled_wrappers_keep_the_engines_view():
    model = build_model("qwen2.5-7b", tiny=True, device=torch.device("cpu"), dtype=torch.float32)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v bias
    wrapped = DecodeCompiled(model, backend="eager")
    assert wrapped.config is model.config and wrapped.get_output_embeddings() is model.lm_head
    assert [n for n, _ in wrapped.named_children()] == ["model"]


@pytest.mark.parametrize(("name", "category"), [
    ("_int4_gemv_kernel", "gemv_gemm"), ("void tinygemm_m16n8k16_chunk_kernel<...>", "gemv_gemm"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemv_gemm"), ("pytorch_flash::flash_fwd_splitkv_kernel", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other"),
])
def test_kernels_are_sorted_into_the_three_categories(name: str, category: str):
    assert kernel_category(name) == category
