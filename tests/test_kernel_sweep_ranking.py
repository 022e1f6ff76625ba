"""The kernel sweep's choice of tuned configurations (reproductions/kernels/int4_bench.py), on synthetic
timings: it ranks by graphed time where measured, and never picks a configuration that computed wrongly."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from reproductions.kernels.int4_bench import best_configs, summarize
from sdsie.kernels import Int4KernelConfig

A = Int4KernelConfig(1, 256, 128, split_k=4)
B = Int4KernelConfig(1, 64, 128, split_k=4, num_warps=2)
C = Int4KernelConfig(1, 128, 256, split_k=8)


def _result(median_us: dict, errors: dict, graph_us: dict | None = None) -> dict:
    r = {"case": {"shape": "kv", "n": 1024, "k": 4096, "m": 1, "group": 128},
         "configs": {"A": asdict(A), "B": asdict(B), "C": asdict(C)}, "median_us": median_us, "errors": errors}
    if graph_us is not None:
        r["graph_us_by_config"] = graph_us
    return r


def test_graphed_time_decides_over_host_bound_eager_medians():
    # eager medians of a tiny shape measure host time: A looks fastest there, B is fastest on the GPU
    r = _result({"A": 20.9, "B": 21.5, "C": 23.0}, {"A": 3e-3, "B": 3e-3, "C": 3e-3},
                graph_us={"A": 12.4, "B": 5.0, "C": 6.1})
    assert best_configs([r], "GPU")["GPU"]["m1|1024|4096|128"] == asdict(B)


def test_eager_medians_rank_when_no_graphed_time_and_wrong_results_never_win():
    r = _result({"A": 20.9, "B": 21.5, "C": 23.0}, {"A": 0.5, "B": 3e-3, "C": 3e-3})
    assert best_configs([r], "GPU")["GPU"]["m1|1024|4096|128"] == asdict(B)  # A is fastest but wrong


def test_a_sweep_result_summarizes_and_keeps_its_per_config_graph_times_apart():
    """A sweep's per-configuration graphed times must not be read as a record's bf16/INT4 graphed pair: reading them
    so crashes `summarize` (KeyError 'bf16') after the sweep has written its table."""
    r = _result({"A": 20.9, "B": 21.5, "C": 23.0, "bf16": 10.8, "int4": 19.0},
                {"A": 3e-3, "B": 3e-3, "C": 3e-3, "bf16": 0.0, "int4": 3e-3},
                graph_us={"A": 12.4, "B": 5.0, "C": 6.1})
    r.update(speedup_vs_bf16=10.8 / 19.0, int4_pct_of_copy=3.0, bytes_reduction_pct=73.4)
    s = summarize([r], [], copy_gbs=4200.0)
    assert s["m1_g128_geomean_speedup"] == 10.8 / 19.0
    assert not any(k.endswith("_graph") for k in s)  # no record-style graphed pair in a sweep
    assert best_configs([r], "GPU")["GPU"]["m1|1024|4096|128"] == asdict(B)


def test_sweep_times_each_kernel_at_the_rows_it_serves():
    from reproductions.kernels.int4_bench import SWEEP_M, fits, sweep_configs
    from sdsie.kernels import Int4KernelConfig

    def ms(cfg):
        return [m for m in SWEEP_M if fits(cfg, m)]

    assert ms(Int4KernelConfig(1, 128, 256)) == [1, 2]
    assert ms(Int4KernelConfig(2, 128, 256)) == ms(Int4KernelConfig(4, 64, 256)) == [2, 4, 8]
    assert ms(Int4KernelConfig(16, 64, 128)) == [2, 4, 8, 16]
    assert ms(Int4KernelConfig(16, 256, 128, swap_ab=True)) == [2, 4, 8, 16]  # planes lost every M = 1 case
    assert {c.block_m for c in sweep_configs()} == {1, 2, 4, 16}  # multi-row GEMV programs are swept


def test_host_times_summarize_per_variant_over_the_m1_shapes():
    """The record's host microseconds per eager call are the median over M = 1 shapes, per variant; a variant
    timed on no shape (tinygemm absent) gets no metric rather than a made-up one."""
    rows = []
    for host in ({"bf16": 6.0, "int4": 18.0}, {"bf16": 8.0, "int4": 30.0}, {"bf16": 7.0, "int4": 20.0}):
        r = _result({"bf16": 10.0, "int4": 12.0}, {"bf16": 0.0, "int4": 3e-3})
        r.update(speedup_vs_bf16=10 / 12, int4_pct_of_copy=3.0, bytes_reduction_pct=73.4, host_us=host)
        rows.append(r)
    s = summarize(rows, [], copy_gbs=4200.0)
    assert s["m1_g128_host_us_bf16_median"] == 7.0 and s["m1_g128_host_us_int4_median"] == 20.0
    assert "m1_g128_host_us_tinygemm_median" not in s


def test_sweep_names_keep_pipelined_and_register_prefetch_configs_apart():
    """Each swept configuration has its own key (a collision would file one config's times under another's)."""
    from reproductions.kernels.int4_bench import config_name, sweep_configs

    cfgs = sweep_configs()
    assert len({config_name(c) for c in cfgs}) == len(cfgs)
    pipelined = [c for c in cfgs if c.gemv and c.num_stages >= 3]
    assert pipelined and any(c.block_m > 1 for c in pipelined)
    twin = Int4KernelConfig(1, 128, 256, split_k=1, num_warps=4)
    assert twin in cfgs and config_name(twin) != config_name(Int4KernelConfig(1, 128, 256, num_stages=3))


def test_the_register_cap_set_names_every_cap_apart():
    from reproductions.kernels.int4_bench import REGISTER_CAPS, SWEEP_SETS, config_name

    cfgs = SWEEP_SETS["regcap"]()
    assert len({config_name(c) for c in cfgs}) == len(cfgs)
    assert {c.max_registers for c in cfgs} == set(REGISTER_CAPS)
    assert config_name(Int4KernelConfig(1, 64, 512, num_stages=3, max_registers=96)) == "int4[1,64,512,s1,w4,p3,r96]"


def test_inspect_ptx_config_specs():
    """The offline PTX tool's config spec: [rRr]BNxBKxWARPS[xSPLIT][pSTAGES][g] -> (bn, bk, split, warps, x_tile,
    rows, stages)."""
    from reproductions.kernels.inspect_ptx import _parse

    assert _parse("128x256x4") == (128, 256, 1, 4, True, 1, 2)
    assert _parse("r4r64x256x2x8p3g") == (64, 256, 8, 2, False, 4, 3)
    assert _parse("256x128x4p4") == (256, 128, 1, 4, True, 1, 4)
    for bad in ("128x256", "128x256x4q", "r2128x256x4"):
        with pytest.raises(ValueError, match="is not"):
            _parse(bad)


def test_ab_bench_loads_another_kernel_version_beside_this_one(tmp_path):
    """The A/B bench imports a copy of int4_gemm.py under its own name (its dataclasses and plans apart from this
    tree's), and names the problem when the file is missing or is not a kernel module."""
    from pathlib import Path

    import pytest

    from reproductions.kernels.ab_bench import load_baseline
    from sdsie.kernels import int4_gemm

    copy = tmp_path / "base_int4_gemm.py"
    copy.write_text(Path(int4_gemm.__file__).read_text())
    base = load_baseline(copy)
    assert base.int4_matmul is not int4_gemm.int4_matmul and base._PLANS is not int4_gemm._PLANS
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_baseline(tmp_path / "missing.py")
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    with pytest.raises(ImportError, match="no int4_matmul"):
        load_baseline(other)


def test_ab_bench_runs_the_baseline_launcher_on_the_baseline_revisions_kernels(tmp_path):
    """Where a revision keeps its Triton kernels in int4_triton.py, the baseline launcher launches that revision's
    kernels (a copy named by --baseline-kernels), not this tree's; a file without them is refused by name."""
    from pathlib import Path

    import pytest
    import torch

    from reproductions.kernels.ab_bench import KERNEL_NAMES, load_baseline
    from reproductions.kernels.int4_bench import random_int4
    from sdsie.kernels import int4_gemm, int4_matmul, int4_triton

    launcher, kernels = tmp_path / "base_int4_gemm.py", tmp_path / "base_int4_triton.py"
    launcher.write_text(Path(int4_gemm.__file__).read_text())
    kernels.write_text(Path(int4_triton.__file__).read_text())
    base = load_baseline(launcher, kernels)
    for name in KERNEL_NAMES:
        assert getattr(base, name) is not getattr(int4_triton, name) or name == "CODE_MAGIC", name
        assert getattr(base, name) is getattr(__import__("sys").modules["sdsie_int4_triton_baseline"], name)
    w = random_int4(64, 256, 128, "cpu", torch.Generator().manual_seed(0))
    x = torch.randn(1, 256)
    assert torch.equal(base.int4_matmul(x, w), int4_matmul(x, w))  # the same source: the same bits
    (tmp_path / "other.py").write_text("x = 1\n")
    with pytest.raises(ImportError, match="not a version of sdsie/kernels/int4_triton.py"):
        load_baseline(launcher, tmp_path / "other.py")


def test_ab_bench_runs_the_baseline_launcher_on_the_baseline_revisions_mma_gemv(tmp_path, monkeypatch):
    """--baseline-mma: the baseline launcher takes the tensor-core GEMV's kernel, constexpr arguments and fragment
    packing from a copy of another revision's int4_mma.py, so the launch it plans and the words it packs are that
    copy's; a file without them is refused by name."""
    from pathlib import Path

    import pytest
    import torch

    from reproductions.kernels.ab_bench import MMA_NAMES, load_baseline
    from reproductions.kernels.int4_bench import random_int4
    from sdsie.kernels import int4_gemm, int4_mma

    launcher, mma = tmp_path / "base_int4_gemm.py", tmp_path / "base_int4_mma.py"
    launcher.write_text(Path(int4_gemm.__file__).read_text())
    # a variant whose packing differs: the baseline must pack with it, this tree with its own
    mma.write_text(Path(int4_mma.__file__).read_text() + "\n_pack = pack_fragments\n"
                   "def pack_fragments(qweight, k, rows_at_a_time=4096):\n"
                   "    return _pack(qweight, k, rows_at_a_time) + 1\n")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no CUDA
    base = load_baseline(launcher, mma=mma)
    variant = __import__("sys").modules["sdsie_int4_mma_baseline"]
    for name in MMA_NAMES:
        assert getattr(base, name) is getattr(variant, name), name
    assert base._int4_mma_gemv_kernel is not int4_gemm._int4_mma_gemv_kernel
    w = random_int4(32, 256, 128, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(base._fragments(w)[0], int4_gemm._fragments(w)[0] + 1)
    (tmp_path / "other.py").write_text("x = 1\n")
    with pytest.raises(ImportError, match="not a version of sdsie/kernels/int4_mma.py"):
        load_baseline(launcher, mma=tmp_path / "other.py")


def test_ab_bench_takes_shapes_by_name_or_as_n_by_k_and_names_a_bad_one(tmp_path, capsys):
    """--shapes takes the Llama shapes' names or NxK (a Qwen or fused shape); anything else is refused by name before
    anything is imported or timed."""
    import pytest

    from reproductions.kernels.ab_bench import LLAMA_SHAPES, ab_shape, main, shape_dims

    assert ab_shape("kv_1024x4096") == "kv_1024x4096" and ab_shape("4608x3584") == "4608x3584"
    assert shape_dims("kv_1024x4096") == LLAMA_SHAPES["kv_1024x4096"] and shape_dims("4608x3584") == (4608, 3584)
    for bad in ("4608", "0x3584", "4608x", "qkv"):
        with pytest.raises(SystemExit) as exc:
            main(["--baseline", str(tmp_path / "base.py"), "--out", str(tmp_path / "ab.json"), "--shapes", bad])
        assert exc.value.code == 2
        assert f"{bad!r} is neither a shape name" in capsys.readouterr().err


def test_ab_bench_refuses_a_row_count_below_one(tmp_path, capsys):
    """--m names the rows to compare at group 128; M < 1 is refused before anything is timed or imported."""
    import pytest

    from reproductions.kernels.ab_bench import main

    with pytest.raises(SystemExit) as exc:
        main(["--baseline", str(tmp_path / "base.py"), "--out", str(tmp_path / "ab.json"), "--m", "4", "0"])
    assert exc.value.code == 2
    assert "every M must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "ab.json").exists()


def test_host_overhead_stubs_reach_the_compiled_fast_path(tmp_path, monkeypatch):
    """The host-time tool times the kernel module's own launch path: with its kernels stubbed, the first call
    builds the plan and keeps the stub as the compiled kernel, and later calls go through the fast path (the stub's
    run), launching nothing."""
    import types
    from pathlib import Path

    import torch
    import triton

    from reproductions.kernels import host_overhead
    from reproductions.kernels.ab_bench import load_baseline
    from reproductions.kernels.int4_bench import random_int4
    from sdsie.kernels import int4_gemm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a GPU host: the module keeps compiled kernels
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(get_current_stream=lambda i: 0))
    copy = tmp_path / "int4_gemm_copy.py"
    copy.write_text(Path(int4_gemm.__file__).read_text())
    mod = load_baseline(copy)
    host_overhead.stub_kernels(mod)
    runs = []
    monkeypatch.setattr(host_overhead._StubCompiled, "run", lambda self, *args: runs.append(len(args)))
    w = random_int4(64, 512, 128, "cpu", torch.Generator().manual_seed(0))
    x = torch.randn(1, 512).to(torch.bfloat16)
    cfg = mod.Int4KernelConfig(1, 32, 256, split_k=2)
    for _ in range(3):
        mod.int4_matmul(x, w, config=cfg)
    (plan,) = mod._plans_of(w).values()
    assert isinstance(plan.compiled, host_overhead._StubCompiled) and len(runs) == 2


def test_a_sweep_keeps_a_configuration_slower_than_its_timing_window():
    """A call longer than the sweep's window gives do_bench one sample; the spread takes it (a sweep must not
    crash there), and no samples at all is an error."""
    from reproductions.kernels.int4_bench import spread

    assert spread([7484.4]) == {"min": 7484.4, "p10": 7484.4, "p90": 7484.4, "n": 1}
    many = spread([float(v) for v in range(1, 101)])
    assert many["min"] == 1.0 and 10.0 <= many["p10"] <= 11.0 and 90.0 <= many["p90"] <= 91.0 and many["n"] == 100
    with pytest.raises(ValueError, match="no timing samples"):
        spread([])


def test_a_focused_sweep_times_the_named_configurations_beside_the_incumbent():
    from reproductions.kernels.int4_bench import config_name, focus_configs, sweep_configs, with_incumbent

    everything = sweep_configs()
    swap = focus_configs(everything, ["swap"])  # the planes kernel's configurations
    assert swap and all(c.swap_ab for c in swap)
    assert len(swap) == sum(c.swap_ab for c in everything)
    gather = focus_configs(everything, ["gather"])
    assert gather and all(not c.x_tile for c in gather)
    both = set(gather) & set(swap)  # planes with x's two strided gathers instead of its words
    assert both and both == set(focus_configs(everything, ["gather,swap"])) and both < set(gather)
    assert focus_configs(everything, None) == everything
    with pytest.raises(ValueError, match="matches no sweep configuration"):
        focus_configs(everything, ["no-such-kernel"])
    incumbent = Int4KernelConfig(2, 128, 256, split_k=4, num_stages=3)  # a GEMV-rows choice the filter drops
    assert config_name(incumbent) not in {config_name(c) for c in swap}
    assert with_incumbent(swap, incumbent) == [incumbent, *swap]
    assert with_incumbent(swap, swap[1]) == swap  # already timed: not twice


def test_a_focused_sweep_replaces_only_the_keys_it_measured():
    from reproductions.kernels.int4_bench import merge_tuned

    installed = {"GPU": {"m1|1024|4096|128": asdict(A), "m16|1024|4096|128": asdict(B)}, "Other": {"k": asdict(C)}}
    merged = merge_tuned(installed, {"GPU": {"m16|1024|4096|128": asdict(C), "m8|1024|4096|128": asdict(C)}})
    assert merged == {"GPU": {"m1|1024|4096|128": asdict(A), "m16|1024|4096|128": asdict(C),
                              "m8|1024|4096|128": asdict(C)}, "Other": {"k": asdict(C)}}
    assert installed["GPU"]["m16|1024|4096|128"] == asdict(B)  # the installed table itself is left alone


@pytest.mark.parametrize("argv, message", [(["--only", "swap"], "need --sweep"), (["--sweep", "--m", "3"], "tunes M")])
def test_focus_flags_are_checked(argv, message, capsys):
    from reproductions.kernels.int4_bench import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_each_cases_graphed_times_reach_the_record_and_the_readme_table():
    """A record keeps every case's graphed bf16/INT4 times as metrics; README's kernel table shows them in a column
    when the record has them, and judges the 3x target from the number, not a fixed string."""
    from types import SimpleNamespace

    from reproductions.readme_results import kernel_section

    r = _result({"bf16": 10.0, "int4": 12.0}, {"bf16": 0.0, "int4": 3e-3})
    r["case"] = {"shape": "kv_1024x4096", "n": 1024, "k": 4096, "m": 1, "group": 128}
    r.update(speedup_vs_bf16=10 / 12, int4_pct_of_copy=3.0, bytes_reduction_pct=73.4,
             graph_us={"int4": 5.3, "bf16": 6.9, "tinygemm": 4.7})
    s = summarize([r], [], copy_gbs=4200.0)
    assert s["graph_us.kv_1024x4096.m1.g128.int4"] == 5.3 and s["graph_us.kv_1024x4096.m1.g128.bf16"] == 6.9

    def rec(metrics: dict) -> SimpleNamespace:
        return SimpleNamespace(samples={"kv_1024x4096|m1|g128|bf16": [6.9], "kv_1024x4096|m1|g128|int4": [2.0]},
                               metrics={"copy_bandwidth_gbs": 4200.0, "m1_gNone_geomean_speedup": 1.0,
                                        "m1_g128_bytes_reduction_pct_min": 73.3,
                                        "m1_g128_bytes_reduction_pct_max": 73.4, **metrics},
                               conditions={"hardware": "GPU"}, source=SimpleNamespace(name="r.json"))

    with_graphs = "\n".join(kernel_section(rec({"m1_g128_geomean_speedup": 3.45, **{
        k: v for k, v in s.items() if k.startswith("graph_us.")}})))
    assert "| 1024x4096 | 1 | 128 | 6.9 | 2.0 | 3.45x |" in with_graphs and "| 6.9 / 5.3 |" in with_graphs
    assert "target 3.0x (group 128): met" in with_graphs
    without = "\n".join(kernel_section(rec({"m1_g128_geomean_speedup": 1.84})))
    assert "graphed bf16 / INT4" not in without and "target 3.0x (group 128): **not met**" in without


def test_the_graphed_copy_percentage_takes_the_worst_large_shape_and_ignores_small_ones():
    """m1_g128_min_pct_copy_large_graph: a same-bytes graphed copy's time over INT4's, on the three large shapes."""
    results = []
    for shape, n, k, copy_us, int4_us in (("gate_up_14336x4096", 14336, 4096, 9.0, 15.0),
                                          ("lm_head_128256x4096", 128256, 4096, 70.0, 95.0),
                                          ("kv_1024x4096", 1024, 4096, 4.0, 16.0)):  # small: not counted
        r = _result({"bf16": 30.0, "int4": int4_us}, {"bf16": 0.0, "int4": 3e-3})
        r["case"] = {"shape": shape, "n": n, "k": k, "m": 1, "group": 128}
        r.update(speedup_vs_bf16=2.0, int4_pct_of_copy=50.0, bytes_reduction_pct=73.4,
                 graph_us={"int4": int4_us, "bf16": 30.0, "copy": copy_us})
        results.append(r)
    s = summarize(results, [], copy_gbs=4200.0)
    assert s["m1_g128_min_pct_copy_large_graph"] == pytest.approx(60.0)
    assert s["graph_us.gate_up_14336x4096.m1.g128.copy"] == 9.0
    results[0]["graph_us"].pop("copy")  # a record without copies (an older record) has no such metric
    results[1]["graph_us"].pop("copy")
    assert "m1_g128_min_pct_copy_large_graph" not in summarize(results, [], copy_gbs=4200.0)


def test_graphed_copies_are_sized_in_whole_4k_blocks():
    """Graphed copies of sizes not a multiple of 4 KiB take a slower path (docs/kernel-log.md); the floor copies round
    up."""
    from reproductions.kernels.int4_bench import COPY_ALIGN, copy_half_bytes

    assert COPY_ALIGN == 4096
    assert copy_half_bytes(2 * 139674880) == 139677696  # the M = 1 LM head's bytes: 256-byte multiple -> next 4 KiB
    assert copy_half_bytes(2 * 141660160) == 141660160  # already a 4 KiB multiple (M = 16): unchanged
    assert copy_half_bytes(1) == COPY_ALIGN
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        copy_half_bytes(0)


def test_the_gpu_tools_say_when_there_is_no_cuda_device(monkeypatch, capsys):
    import torch

    from reproductions.kernels.int4_bench import cuda_missing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_missing("ab_bench") is True
    assert "ab_bench needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_missing("ab_bench") is False and capsys.readouterr().err == ""


def test_ab_bench_times_a_configuration_change_on_this_tree(capsys):
    """--config fixes both arms' configuration and --new-config FIELD=VALUE changes the new arm's only; a field
    that does not exist, a value that is not true/false/none/an integer, a change that makes no configuration, and
    a run with neither a baseline nor a change are refused by name."""
    import argparse

    import pytest

    from reproductions.kernels.ab_bench import arm_configs, config_override, main
    from reproductions.kernels.int4_bench import Case
    from sdsie.kernels.int4_config import Int4KernelConfig, mma_blocks
    from sdsie.kernels.int4_tune import config_from_name

    assert config_override("num_stages=4") == ("num_stages", 4)
    assert config_override("mma=True") == ("mma", True) and config_override("max_registers=none") == (
        "max_registers", None)
    with pytest.raises(argparse.ArgumentTypeError, match="'stages' is not a field of Int4KernelConfig"):
        config_override("stages=4")
    with pytest.raises(argparse.ArgumentTypeError, match="--new-config takes KEY=VALUE"):
        config_override("num_stages")
    with pytest.raises(argparse.ArgumentTypeError, match="must be true, false, none or an integer"):
        config_override("num_stages=four")

    case = Case("4608x3584", 4608, 3584, 16, 128)
    base = config_from_name("int4[8,16,128,s1,w4,mma]")
    new, old = arm_configs(case, "cpu", 128, base, {"num_stages": 4})
    assert old == base == mma_blocks(4) and new == mma_blocks(4, 1, 4)
    chosen = arm_configs(case, "cpu", 128, None, {})  # no --config: the case's own choice, unchanged
    assert chosen[0] == chosen[1] and isinstance(chosen[0], Int4KernelConfig) and not chosen[0].mma
    with pytest.raises(ValueError, match=r"--new-config \{'num_stages': 5\} on int4\[8,16,128,s1,w4,mma\] "
                                         r"\(4608x3584, M = 16\)"):
        arm_configs(case, "cpu", 128, base, {"num_stages": 5})
    with pytest.raises(SystemExit):  # neither --baseline nor --new-config: nothing to compare
        main(["--out", "x.json"])
    assert "name a change with --new-config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--baseline-mma", "m.py", "--new-config", "num_stages=4", "--out", "x.json"])
    assert "go with --baseline" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a configuration name it cannot read: its own message, not argparse's
        main(["--config", "int4[8,16,128,s1,w4,mma,fast]", "--new-config", "num_stages=4", "--out", "x.json"])
    assert "unknown part 'fast'" in capsys.readouterr().err


def test_ab_bench_keeps_every_finished_case_when_a_later_one_is_stopped(tmp_path, monkeypatch):
    """The A/B file is rewritten after every case, so a run stopped by its time limit (a device call's timeout)
    keeps the cases it finished, and says it is incomplete."""
    import json

    from reproductions.kernels import ab_bench

    done = []

    def fake_case(case, base, gen, device, config=None, overrides=None):
        if done:
            raise KeyboardInterrupt  # stands for the timeout's signal during the second case
        done.append(case)
        t = {"new": [1.0], "base": [2.0], "bf16": [4.0]}
        return {"case": {"shape": case.shape, "m": case.m}, "graph_us": t, "graph_new_over_base": 2.0,
                "eager_new_over_base": 2.0, "errors": {"new": 1e-3, "base": 1e-3}}

    monkeypatch.setattr(ab_bench, "cuda_missing", lambda name: False)
    monkeypatch.setattr(ab_bench, "ab_case", fake_case)
    monkeypatch.setattr(ab_bench.torch.cuda, "get_device_name", lambda *a: "test GPU")
    out = tmp_path / "ab.json"
    with pytest.raises(KeyboardInterrupt):
        ab_bench.main(["--out", str(out), "--shapes", "4608x3584", "1024x4096", "--m", "1",
                       "--new-config", "num_stages=4"])
    saved = json.loads(out.read_text())
    assert saved["planned_cases"] == 2 and saved["complete"] is False
    assert [r["case"]["shape"] for r in saved["results"]] == ["4608x3584"]
    assert saved["new_config"] == {"num_stages": 4} and saved["device"] == "test GPU"


def test_host_overhead_names_the_cpu_it_timed(tmp_path, monkeypatch):
    """A host-time figure depends on the CPU: the tool's file names it as every record does (`cpu_state`: model
    from /proc/cpuinfo, torch's ISA and threads), not by platform.processor(), which is empty or a bare
    architecture on Linux."""
    import json
    import types

    import triton

    from reproductions.kernels import host_overhead
    from sdsie.kernels import int4_gemm
    from sdsie.telemetry.env import cpu_state

    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(get_current_stream=lambda i: 0))
    for name in ("_int4_gemv_kernel", "_int4_gemm_kernel"):  # main stubs the module's kernels: restore them after
        monkeypatch.setattr(int4_gemm, name, getattr(int4_gemm, name))
    monkeypatch.setattr(host_overhead, "per_call_us", lambda fn: (fn(), [1.0])[1])  # one call, not 140,000
    assert host_overhead.main(["--out", str(tmp_path / "host.json")]) == 0
    host = json.loads((tmp_path / "host.json").read_text())["host"]
    assert host == cpu_state() and host["model"]


def test_the_ncu_probe_takes_any_decoder_shape_and_names_a_bad_one():
    """The hardware-counter probe profiles shapes no name table holds (1536 x 8960, the Qwen2.5-1.5B down that the
    mma GEMV serves furthest from its copy), as the A/B bench does; a shape that is neither a name nor NxK is refused
    by name."""
    from research.kernels.ncu_probe import parse_target

    assert parse_target("int4:1536x8960:128:m16:8,16,128,s1,w8,mma") == ("int4", "1536x8960", "128", 16,
                                                                         "8,16,128,s1,w8,mma")
    assert parse_target("bf16:down_4096x14336:pc") == ("bf16", "down_4096x14336", "pc", 1, None)
    for bad in ("int4:1536by8960:128", "int4:0x4096:128"):
        with pytest.raises(ValueError, match="NxK"):
            parse_target(bad)
