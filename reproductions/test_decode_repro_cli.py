"""The decoding reproduction's command line, dry-run on CPU with the committed stand-in pair: the suite-size
flags reach the records they size, and bad sizes are refused before anything runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from reproductions.decode_repro import SEED_FIDELITY_TOKENS, _parser, main


def _records(out: Path) -> dict[str, dict]:
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    return {r["suite"]: r for r in records}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run (kernels under TRITON_INTERPRET) is for "
                    "GPU-less machines; a GPU process may already hold the kernels compiled for CUDA")
def test_dry_run_sizes_each_suite_from_its_flags(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what main() sets for --device cpu, undone after the test
    argv = ["--preset", "cpu", "--device", "cpu", "--out", str(tmp_path), "--one-per-family",
            "--trials", "1", "--max-new-tokens", "4", "--grid-trials", "2", "--grid-tokens", "3",
            "--gear-trials", "2", "--skip", "fidelity", "near_ties", "entropy_sync"]
    assert main(argv) == 0
    records = _records(tmp_path)
    assert sorted(records) == ["decode_standin", "resolution_gear_usage", "threshold_grid"]
    decode, grid, gear = records["decode_standin"], records["threshold_grid"], records["resolution_gear_usage"]
    assert decode["config"]["trials"] == 1 and decode["config"]["max_new_tokens"] == 4
    assert grid["config"]["trials_per_cell"] == 2 and grid["config"]["max_new_tokens"] == 3
    assert grid["config"]["cuda_graphs"] is False  # eager unless --grid-graphs
    assert grid["metrics"]["grid.trials"] == 18 * 3 * 2  # configurations x one prompt per family x trials
    assert gear["config"]["trials"] == 2 and gear["config"]["max_new_tokens"] == 4
    prompts = len(decode["environment"]["prompts"])
    assert prompts == 3
    # the conditions name this build of the pair, from the hashes of the loaded weights
    assert all(m["checkpoint_sha256"] for m in decode["environment"]["models"])
    assert "(cpu preset, build " in decode["conditions"]["model"]
    # greedy identity: per variant, with raw per-run evidence and a report of every divergence
    assert {"fixed_k5.fidelity_pct", "hf_assisted.fidelity_pct", "fidelity_pct"} <= set(decode["metrics"])
    identity = [k for k in decode["samples"] if k.endswith("|identical_to_plain")]
    assert len(identity) == 4 * prompts  # fixed_k5, two gated, hf_assisted on every prompt
    assert isinstance(decode["config"]["mismatches"], list)
    for f in ("code", "physics", "poem"):  # the plain runs' per-token entropy, where the clutch thresholds sit
        p10, p50, p90 = (decode["metrics"][f"{f}.entropy_bits_p{q}"] for q in (10, 50, 90))
        assert 0 <= p10 <= p50 <= p90
    costs = decode["config"]["forward_ms"]  # what a cycle is made of, to model the speedup from
    assert costs["target_step_ms"] > 0 and costs["scout_step_ms"] > 0 and costs["target_verify_ms"] > 0
    assert costs["scout_cost_ratio"] == pytest.approx(costs["scout_step_ms"] / costs["target_step_ms"])
    assert all(len(v) == 2 for k, v in gear["samples"].items() if k.endswith("|tokens_per_s"))  # 2 trials each


def test_suite_sizes_default_to_the_seed_and_the_main_record():
    a = _parser().parse_args([])
    assert (a.trials, a.grid_trials, a.fidelity_tokens) == (5, 3, SEED_FIDELITY_TOKENS)
    assert a.grid_tokens is None and a.gear_trials is None  # grid: min(--max-new-tokens, 96); gear: --trials
    assert a.grid_graphs is False


@pytest.mark.parametrize("flag", ["--trials", "--max-new-tokens", "--grid-trials", "--grid-tokens",
                                  "--fidelity-tokens", "--gear-trials"])
def test_non_positive_suite_sizes_are_refused(flag: str, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args([flag, "0"])
    assert exc.value.code == 2
    assert "must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_the_energy_window_takes_zero_to_disable_and_refuses_negative_or_nan(value: str, capsys):
    from reproductions.decode_repro import ENERGY_WINDOW_S

    assert _parser().parse_args([]).energy_window_s == ENERGY_WINDOW_S
    assert _parser().parse_args(["--energy-window-s", "0"]).energy_window_s == 0.0
    with pytest.raises(SystemExit):
        _parser().parse_args(["--energy-window-s", value])
    assert f"must be a number >= 0, got {value}" in capsys.readouterr().err


def test_warm_up_runs_every_variant_on_every_prompt():
    """Warm-up is excluded from timing and covers each prompt's new shapes, not only the first prompt's."""
    import torch

    from reproductions.decode_repro import warm_up

    calls = []
    fns = {name: (lambda ids, name=name: calls.append((name, ids.numel()))) for name in ("plain", "fixed_k5")}
    prompts = {"a": ("code", torch.zeros(3)), "b": ("poem", torch.zeros(5))}
    warm_up(fns, prompts)
    assert sorted(calls) == sorted((n, k) for n in fns for k in (3, 5))


def test_cuda_graph_variants_are_refused_off_a_gpu_and_the_env_switch_is_checked(monkeypatch):
    from reproductions.decode_repro import graphs_from_env

    for flag in ("--cuda-graphs", "--grid-graphs"):
        with pytest.raises(SystemExit, match="--cuda-graphs and --grid-graphs need --device cuda"):
            main(["--preset", "cpu", "--device", "cpu", flag, "--trials", "1", "--max-new-tokens", "2"])
    monkeypatch.delenv("SDSIE_CUDA_GRAPHS", raising=False)
    assert graphs_from_env() is False
    monkeypatch.setenv("SDSIE_CUDA_GRAPHS", "1")
    assert graphs_from_env() is True
    monkeypatch.setenv("SDSIE_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="SDSIE_CUDA_GRAPHS must be 0 or 1, got 'yes'"):
        graphs_from_env()


@pytest.mark.parametrize("graphs", [False, True])
def test_the_grid_runs_its_loops_as_asked(monkeypatch, graphs):
    """--grid-graphs must change what the grid runs: every loop on a static cache with replayed graphs."""
    import sdsie.decoding
    from reproductions.decode_repro import run_grid

    seen = []

    def stop(*args, config, **kwargs):
        seen.append(config)
        raise RuntimeError("stop after the sweep is configured")

    monkeypatch.setattr(sdsie.decoding, "sweep", stop)
    with pytest.raises(RuntimeError, match="stop after"):
        run_grid(None, None, {"p": ("code", torch.zeros(3))}, max_new=8, trials=1, graphs=graphs)
    assert (seen[0].cuda_graphs, seen[0].kv_cache) == ((True, "static") if graphs else (False, "dynamic"))


def _what_runs(monkeypatch, names: tuple[str, ...]) -> dict:
    """The (DecodeConfig, clutch) each named graphed variant hands to the engine, caught at its `generate` call."""
    import reproductions.decode_repro as dr

    class _Seen(Exception):
        def __init__(self, config, clutch):
            self.config, self.clutch = config, clutch

    def fake_generate(target, ids, config, scout=None, clutch=None):
        raise _Seen(config, clutch)

    monkeypatch.setattr(dr, "generate", fake_generate)
    fns = dr.variants(None, object(), dr.DecodeConfig(max_new_tokens=4), graphs=True)
    seen = {}
    for name in names:
        with pytest.raises(_Seen) as exc:
            fns[name](torch.zeros(3, dtype=torch.long))
        seen[name] = exc.value
    return seen


def test_the_unpadded_variant_differs_from_gated_tuned_graphs_only_in_the_catch_up(monkeypatch):
    """The padded catch-up's A/B: both arms the tuned clutch on graphs, one with pad_scout_catchup off."""
    import reproductions.decode_repro as dr

    seen = _what_runs(monkeypatch, ("gated_tuned_graphs", dr.UNPADDED))
    padded, unpadded = seen["gated_tuned_graphs"], seen[dr.UNPADDED]
    assert (padded.config.pad_scout_catchup, unpadded.config.pad_scout_catchup) == (True, False)
    assert dataclasses.replace(unpadded.config, pad_scout_catchup=True) == padded.config
    assert padded.clutch.config == unpadded.clutch.config == dr.TUNED
    assert dr.BASELINE[dr.UNPADDED] == "plain_graphs"


def test_the_adaptive_variants_differ_from_their_constant_twins_only_in_the_schedule(monkeypatch):
    import reproductions.decode_repro as dr

    constants = ("fixed_k5_graphs", "gated_tuned_graphs")
    seen = _what_runs(monkeypatch, (*dr.ADAPTIVE, *constants))
    for adaptive, constant in zip(dr.ADAPTIVE, constants, strict=True):
        a, c = seen[adaptive], seen[constant]
        assert (a.config.k_schedule, c.config.k_schedule) == ("adaptive", "constant")
        assert dataclasses.replace(a.config, k_schedule="constant") == c.config
        assert (a.clutch is None) == (c.clutch is None)
        assert dr.BASELINE[adaptive] == "plain_graphs"


def test_the_long_adaptive_variant_is_adaptive_k5_with_a_higher_ceiling(monkeypatch):
    import reproductions.decode_repro as dr

    seen = _what_runs(monkeypatch, (dr.LONG_ADAPTIVE, "fixed_k5_graphs_adaptive"))
    long, k5 = seen[dr.LONG_ADAPTIVE].config, seen["fixed_k5_graphs_adaptive"].config
    assert (long.k_draft, k5.k_draft) == (dr.LONG_K, 5) and dr.LONG_K > 5
    assert dataclasses.replace(long, k_draft=5) == k5
    assert dr.BASELINE[dr.LONG_ADAPTIVE] == "plain_graphs"


def test_the_tree_variant_is_graphed_plain_with_the_asked_tree_and_its_widths_are_checked(monkeypatch, capsys):
    import reproductions.decode_repro as dr

    seen = _what_runs(monkeypatch, (dr.TREE, dr.TREE_WIDE, "plain_graphs"))
    tree, wide, plain = seen[dr.TREE], seen[dr.TREE_WIDE], seen["plain_graphs"]
    assert dr.TREE_FUSED in dr.GRAPHED and dr.BASELINE[dr.TREE_FUSED] == "plain_graphs"
    assert tree.config.tree_widths == dr.DEFAULT_TREE_WIDTHS and tree.clutch is None
    assert wide.config.tree_widths == dr.DEFAULT_WIDE_TREE_WIDTHS != dr.DEFAULT_TREE_WIDTHS and wide.clutch is None
    assert dataclasses.replace(tree.config, tree_widths=None) == plain.config
    assert dataclasses.replace(wide.config, tree_widths=None) == plain.config
    for v in dr.TREES:
        assert dr.BASELINE[v] == "plain_graphs" and v in dr.COMPARED
    args = _parser().parse_args(["--tree-widths", "8,2,1", "--wide-tree-widths", "6,4,4"])
    assert (args.tree_widths, args.wide_tree_widths) == ((8, 2, 1), (6, 4, 4))
    for flag in ("--tree-widths", "--wide-tree-widths"):
        for bad in ("8,0", "a,2", "64,64"):
            with pytest.raises(SystemExit):
                _parser().parse_args([flag, bad])
            assert flag in capsys.readouterr().err


def _scouts_seen(monkeypatch, variant: str) -> tuple[torch.nn.Module, list[tuple[object, torch.nn.Module]]]:
    """Run `variant` twice, then tree_graphs, through decode_repro.variants with a generate that only records its
    (config, scout) -> (the scout handed to variants, the three (config, scout) pairs)."""
    import reproductions.decode_repro as dr
    from sdsie.models import tiny_llama

    seen = []

    def fake_generate(target, ids, config, scout=None, clutch=None):
        seen.append((config, scout))
        raise RuntimeError("seen")

    monkeypatch.setattr(dr, "generate", fake_generate)
    scout = tiny_llama(vocab_size=64, seed=1)
    fns = dr.variants(None, scout, dr.DecodeConfig(max_new_tokens=4), graphs=True)
    for name in (variant, variant, dr.TREE):
        with pytest.raises(RuntimeError, match="seen"):
            fns[name](torch.zeros(3, dtype=torch.long))
    return scout, seen


def test_the_fused_scout_variant_runs_the_tree_with_a_fused_copy_of_the_scout(monkeypatch):
    """tree_graphs_fused_scout is tree_graphs' config with a copy of the scout whose RMSNorms are FusedRMSNorm; the
    scout handed to the other variants is left as it was, and the copy is made once."""
    import reproductions.decode_repro as dr
    from sdsie.kernels.rmsnorm import FusedRMSNorm

    scout, seen = _scouts_seen(monkeypatch, dr.TREE_FUSED)
    (fused_cfg, fused_1), (_, fused_2), (tree_cfg, plain_scout) = seen
    assert fused_cfg == tree_cfg and fused_1 is fused_2 and plain_scout is scout
    assert any(isinstance(m, FusedRMSNorm) for m in fused_1.modules())
    assert not any(isinstance(m, FusedRMSNorm) for m in scout.modules())


def test_the_compiled_scout_variant_runs_the_tree_with_a_compiled_copy_of_the_scout(monkeypatch):
    """tree_graphs_compiled_scout is tree_graphs' config with a copy of the scout compiled in place (Module.compile,
    recorded here instead of compiling); the scout handed to the other variants is not compiled, and the copy is made
    once."""
    import reproductions.decode_repro as dr

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    scout, seen = _scouts_seen(monkeypatch, dr.TREE_COMPILED)
    (compiled_cfg, copy_1), (_, copy_2), (tree_cfg, plain_scout) = seen
    assert compiled_cfg == tree_cfg and copy_1 is copy_2 is not scout and plain_scout is scout
    assert compiled == [copy_1] and dr.TREE_COMPILED in dr.TREES


def test_each_tree_variant_decodes_the_widths_its_record_key_names(monkeypatch):
    """TREE_WIDTHS_KEY, which decode_record writes the widths by and readme_results reads them back by, names for every
    tree variant the widths it hands the engine; a record keeps a tree's widths only when a variant decoded them."""
    import reproductions.decode_repro as dr

    monkeypatch.setattr(dr, "fuse_rmsnorm", lambda model: None)  # the scout copies' transforms, not under test here
    monkeypatch.setattr(dr, "compiled_copy", lambda model: model)
    seen = _what_runs(monkeypatch, tuple(dr.TREE_WIDTHS_KEY))
    widths = {"tree_widths": dr.DEFAULT_TREE_WIDTHS, "wide_tree_widths": dr.DEFAULT_WIDE_TREE_WIDTHS}
    assert {v: seen[v].config.tree_widths for v in dr.TREE_WIDTHS_KEY} == {
        v: widths[k] for v, k in dr.TREE_WIDTHS_KEY.items()}
    assert set(dr.TREE_WIDTHS_KEY) == {*dr.TREES, *dr.GATED_TREES.values()}
    assert dr.tree_widths_config({"plain", dr.TREE_COMPILED}, (4, 3, 3), (6, 4, 4)) == {
        "tree_widths": [4, 3, 3], "wide_tree_widths": None}
    assert dr.tree_widths_config({dr.TREE_WIDE}, (4, 3, 3), (6, 4, 4)) == {
        "tree_widths": None, "wide_tree_widths": [6, 4, 4]}
    assert dr.tree_widths_config({"plain", "plain_graphs"}, (4, 3, 3), (6, 4, 4)) == {
        "tree_widths": None, "wide_tree_widths": None}


def test_the_gated_tree_variants_gate_the_compiled_scout_tree_with_the_seed_clutches_at_the_tree_depth(monkeypatch):
    """Each gated tree variant is tree_graphs_compiled_scout's config and compiled scout with a clutch: the seed's
    production or tuned thresholds and alpha, its K the tree's depth (the engine refuses any other); graphed plain is
    its baseline, and its decisions are kept like the chain-gated loops'."""
    import reproductions.decode_repro as dr
    from sdsie.models import tiny_llama

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    seen = {}

    def fake_generate(target, ids, config, scout=None, clutch=None):
        seen[len(seen)] = (config, scout, clutch)
        raise RuntimeError("seen")

    monkeypatch.setattr(dr, "generate", fake_generate)
    scout = tiny_llama(vocab_size=64, seed=1)
    fns = dr.variants(None, scout, dr.DecodeConfig(max_new_tokens=4), graphs=True, tree_widths=(4, 2))
    names = (dr.TREE_COMPILED, *dr.GATED_TREES.values())
    for name in names:
        with pytest.raises(RuntimeError, match="seen"):
            fns[name](torch.zeros(3, dtype=torch.long))
    (tree_cfg, tree_scout, no_clutch), *gated = (seen[i] for i in range(len(names)))
    assert no_clutch is None and len(compiled) == 1 and tree_scout is compiled[0] is not scout
    assert tree_cfg.tree_widths == (4, 2)
    for (cfg, scout_, clutch), mode in zip(gated, dr.GATED_TREES, strict=True):
        assert cfg == tree_cfg and scout_ is tree_scout
        assert clutch.config == dataclasses.replace({"production": dr.PRODUCTION, "tuned": dr.TUNED}[mode], k_draft=2)
    assert list(dr.GATED_TREES) == ["production", "tuned"]
    for v in dr.GATED_TREES.values():
        assert v.startswith("gated") and dr.BASELINE[v] == "plain_graphs" and v in dr.COMPARED
