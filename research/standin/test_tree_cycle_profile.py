"""tree_cycle_profile's split, on a CPU (host clocks for the device's): its wrapping leaves the engine as it was and
decodes what the engine decodes, and the parts it reports add up to the wall time it measured."""

from __future__ import annotations

import pytest
import torch

import sdsie.decoding.engine as engine
from research.standin.tree_cycle_profile import PARTS, engine_as, fixed_ms, split
from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.model_io import StaticKV
from sdsie.decoding.tree import TreeStep
from sdsie.models import perturbed_copy, tiny_llama

TARGET = tiny_llama(vocab_size=64, seed=0)
SCOUT = perturbed_copy(TARGET, noise=0.02, seed=1)
IDS = torch.tensor([3, 17, 5, 42, 8, 11])


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("widths", [None, (3, 2)])
def test_split_counts_every_cycle_restores_the_engine_and_its_parts_add_up(widths, separate):
    def state():
        return (engine.forward, TreeStep.__call__, TreeStep.catch_up, TreeStep.can_catch_up, engine._wait,
                StaticKV._consolidate)

    originals = state()
    cfg = DecodeConfig(max_new_tokens=16, kv_cache="static", tree_widths=widths)
    with engine_as(separate=separate, per_layer=separate):
        row = split(TARGET, SCOUT, IDS, cfg, runs=2)
        kv = engine._STATIC[TARGET]
        assert all((c.kv is None) == separate for c in kv.values())  # per-layer tensors, or one
    assert state() == originals and TARGET not in engine._STATIC
    plain = generate(TARGET, IDS, cfg, scout=SCOUT if widths else None)
    assert row["cycles"] == len(plain.cycles) and row["tokens"] == 16
    assert row["accepted_per_cycle"] == sum(c.accepted for c in plain.cycles) / len(plain.cycles)
    assert (row["tree_step_host_ms"] > 0) == bool(widths) and row["forward_host_ms"] > 0
    if widths:  # folded, only the first cycle (which reads the prompt) runs the scout's catch-up on its own
        calls = len(plain.cycles) + 1 if separate else 2  # + the target's prefill
        assert row["forward_calls"] == calls
    parts = sum(row[f"{p}_host_ms"] for p in PARTS)
    assert row["other_host_ms"] >= 0 and parts + row["other_host_ms"] == pytest.approx(row["wall_ms_per_cycle"])


def test_fixed_ms_is_the_intercept_of_wall_time_over_cycles():
    long, short = {"cycles": 40, "wall_ms_per_cycle": 3.0 + 10.0 / 40}, {"cycles": 10, "wall_ms_per_cycle": 4.0}
    assert fixed_ms(long, short) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="two cycle counts"):
        fixed_ms(long, long)


def test_the_script_runs_end_to_end_as_a_cpu_dry_run(tmp_path):
    """Every loop of a GPU call (plain, and each tree three ways) runs and lands in the JSON, fixed cost included."""
    import json

    from research.standin.tree_cycle_profile import main

    out = tmp_path / "p.json"
    assert main(["--device", "cpu", "--tokens", "8", "--runs", "1", "--widths", "2,2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    names = ("plain_graphs", "tree_graphs_2x2", "tree_graphs_2x2_separate", "tree_graphs_2x2_as_4f850b1f",
             "tree_graphs_2x2_fused_scout")
    assert set(got) >= set(names)
    for name in names:
        assert got[name]["tokens"] == 8 and got[name]["fixed_ms_per_run"] is not None
    assert got["tree_graphs_2x2"]["forward_calls"] < got["tree_graphs_2x2_separate"]["forward_calls"]


def test_compiled_scout_adds_a_loop_with_a_compiled_copy_and_only_selects_loops(tmp_path, monkeypatch):
    """--compiled-scout times each tree with a copy of the scout compiled in place (Module.compile, recorded here
    instead of compiling: inductor on two CPU cores takes a minute), and --only keeps the loops it names."""
    import json

    import research.standin.tree_cycle_profile as profile

    compiled: list[torch.nn.Module] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    out = tmp_path / "p.json"
    names = ["plain_graphs", "tree_graphs_2x2_compiled_scout"]
    assert profile.main(["--device", "cpu", "--tokens", "8", "--runs", "1", "--widths", "2,2", "--compiled-scout",
                         "--only", *names, "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [k for k, v in got.items() if isinstance(v, dict)] == names and got[names[1]]["tokens"] == 8
    assert len(compiled) == 1 and compiled[0].config.num_hidden_layers == 2  # a copy of the gpu preset's scout


def test_only_names_a_loop_that_does_not_exist_and_is_refused(tmp_path):
    from research.standin.tree_cycle_profile import main

    with pytest.raises(SystemExit, match="no loop named tree_graphs_2x2_compiled_scout"):
        main(["--device", "cpu", "--widths", "2,2", "--only", "tree_graphs_2x2_compiled_scout",
              "--out", str(tmp_path / "p.json")])
