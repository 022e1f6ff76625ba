"""The Nsight Compute probe's parsing (research/kernels/ncu_probe.py), on small CSVs shaped like ncu's pages:
targets and configurations are checked, and the summaries keep what the counters said."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch

from research.kernels.ncu_probe import (
    make_call,
    parse_attention_target,
    parse_target,
    read_raw_csv,
    summarize_launch,
    summarize_source,
)
from sdsie.kernels import Int4KernelConfig
from sdsie.kernels.int4_config import mma_blocks
from sdsie.kernels.int4_tune import config_from_name


def _csv(rows: list[list[str]]) -> str:
    buf = io.StringIO()
    csv.writer(buf, quoting=csv.QUOTE_ALL).writerows(rows)
    return buf.getvalue()


def test_config_names_parse_back_to_the_sweeps_configurations():
    assert config_from_name("1,128,256,s2,w4,p4") == Int4KernelConfig(1, 128, 256, split_k=2, num_warps=4, num_stages=4)
    assert config_from_name("16,128,128,s1,w4,p3,swap") == Int4KernelConfig(
        16, 128, 128, split_k=1, num_warps=4, num_stages=3, swap_ab=True)
    assert config_from_name("4,128,256,s1,w4,gather").x_tile is False
    assert config_from_name("8,32,128,s1,w4,mma") == mma_blocks(4, 2)


@pytest.mark.parametrize("text, message", [("1,128,256", "expected ROWS"), ("1,128,256,s2,w4,q9", "unknown part"),
                                           ("16,128,128,s1,w4,p3,swap,onedot", "unknown part")])
def test_bad_config_names_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        config_from_name(text)


def test_targets_name_their_rows_and_configuration():
    assert parse_target("int4:gate_up_14336x4096:128") == ("int4", "gate_up_14336x4096", "128", 1, None)
    assert parse_target("int4:gate_up_14336x4096:128:m16:16,256,128,s4,w4,p3,swap") == (
        "int4", "gate_up_14336x4096", "128", 16, "16,256,128,s4,w4,p3,swap")
    assert parse_target("bf16:down_4096x14336:pc:m4") == ("bf16", "down_4096x14336", "pc", 4, None)
    assert parse_target("int4:kv_1024x4096:pc:1,64,256,s16,w2") == ("int4", "kv_1024x4096", "pc", 1,
                                                                    "1,64,256,s16,w2")


def test_the_rows_a_target_names_reach_the_call():
    out = make_call("bf16:kv_1024x4096:128:m4", "cpu")()  # the smallest shape: bf16 weights build on the CPU
    assert out.shape == (4, 1024)
    assert make_call("bf16:kv_1024x4096:128", "cpu")().shape == (1, 1024)


def test_an_attention_target_names_its_case_and_reaches_the_kernel(kernel_device):
    assert parse_attention_target("attention:llama-3.1-8b:2304:n1") == ("llama-3.1-8b", 2304, 1)
    assert parse_attention_target("attention:qwen2.5-7b:256") == ("qwen2.5-7b", 256, None)
    out = make_call("attention:qwen2.5-7b:80:n2", kernel_device.type)()  # H_kv 4, G 7, D 128: the packed query's shape
    assert out.shape == (1, 4, 7, 128) and torch.isfinite(out).all()


@pytest.mark.parametrize("target", ["attention:gpt2:256", "attention:llama-3.1-8b:0", "attention:llama-3.1-8b:256:4",
                                    "attention:llama-3.1-8b:256:n0", "attention:llama-3.1-8b"])
def test_bad_attention_targets_are_refused(target):
    with pytest.raises(ValueError, match="attention:MODEL:S"):
        parse_attention_target(target)


@pytest.mark.parametrize("target, message", [
    ("int4:gate_up_14336x4096:128:m17", "M must be 1..16"),
    ("int4:gate_up_14336x4096:128:16,256,128,s4,w4,p3,swap:m16", "M before CONFIG"),
    ("fp8:gate_up_14336x4096:128", "KIND"),
    ("int4:gate_up:128", "SHAPE"),
    ("int4:gate_up_14336x4096:64", "GROUP must be 128 or pc"),
    ("bf16:gate_up_14336x4096:128:1,128,256,s2,w4", "only int4 takes a CONFIG"),
])
def test_bad_targets_are_refused(target, message):
    with pytest.raises(ValueError, match=message):
        make_call(target, "cpu")


def test_a_raw_page_keeps_metrics_stalls_and_derived_rates(tmp_path: Path):
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
              "sm__cycles_active.avg", "sm__cycles_active.max",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"]
    units = ["", "", "nsecond", "byte", "byte", "cycle", "cycle", "", ""]
    launch = ["0", "_int4_gemv_kernel", "10,000", "29000000", "1000000", "1000", "1200", "0.25", "1.75"]
    path = tmp_path / "t.csv"
    path.write_text("==PROF== Connected to process 1\n" + _csv([header, units, launch]))
    (row,) = read_raw_csv(path)
    s = summarize_launch(row)
    assert s["kernel"] == "_int4_gemv_kernel" and s["duration_ns"] == 10000.0
    assert s["dram_tb_per_s"] == pytest.approx(30e6 / 10000 / 1e3)  # bytes / ns = GB/s; / 1e3 = TB/s
    assert s["sm_active_max_over_avg"] == pytest.approx(1.2)
    assert list(s["stalls_per_issue"]) == ["long_scoreboard", "barrier"]  # largest first
    assert "launch__grid_size" in s["missing"]


def test_a_page_without_launches_is_an_error(tmp_path: Path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== No kernels were profiled.\n")
    with pytest.raises(ValueError, match="no ncu raw CSV header"):
        read_raw_csv(path)


def test_the_source_page_splits_prologue_loop_and_epilogue(tmp_path: Path):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
              "stall_long_sb", "stall_selected", "stall_barrier (Not Issued)"]
    body = [
        ["0x0", "LDC R1, c[0x0][0x28]", "2", "10", "0", "0", "2", "0"],  # prologue: once per warp
        ["0x10", "FFMA R2, R3, R4, R2", "6", "80", "0", "2", "4", "0"],  # loop: 8 iterations
        ["0x20", "@P0 LOP3.LUT R5, R6, 0xf, RZ, 0xc0, !PT", "4", "80", "0", "0", "4", "0"],
        ["0x30", "BAR.SYNC.DEFER_BLOCKING 0x0", "8", "10", "8", "0", "0", "8"],  # epilogue
    ]
    path = tmp_path / "src.csv"
    path.write_text('"Kernel Name","_int4_gemv_kernel",\n' + _csv([header, *body]))
    s = summarize_source(path)
    assert s["samples"] == 20.0
    assert {k: v["samples_pct"] for k, v in s["segments"].items()} == {"prologue": 10.0, "loop": 50.0,
                                                                       "epilogue": 40.0}
    assert s["stalls_pct"] == {"selected": 50.0, "barrier": 40.0, "long_sb": 10.0}
    assert s["executed_by_opcode_pct"] == {"FFMA": 44.4, "LOP3": 44.4, "LDC": 5.6, "BAR": 5.6}
    assert s["top_instructions"][0]["sass"].startswith("BAR.SYNC")
