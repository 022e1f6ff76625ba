"""The replay probe (research/standin/replay_probe.py) finds a step that does not repeat, and names where."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from research.standin.replay_probe import (
    OutputTrace,
    engine_arm,
    main,
    prefill_arm,
    random_target,
    repeat_step,
    scribble_stale,
    step_arm,
)
from sdsie.standin import PRESETS, ModelShape


def test_repeat_step_counts_differing_repeats_and_names_the_first_output_that_differed():
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        n = float(calls["n"])
        return {"a": torch.ones(3), "b": torch.full((3,), n % 2), "c": torch.full((2,), n)}

    r = repeat_step(step, 5)
    # run 1 is the reference; b differs on even calls (2, 4), c on every repeat
    assert r["differing_replays"] == 4
    assert r["first_differing_output"] == "b"
    assert r["differing_outputs"] == {"b": 2, "c": 4}


def test_repeat_step_reports_a_step_that_repeats():
    r = repeat_step(lambda: {"x": torch.arange(4.0)}, 3)
    assert r["differing_replays"] == 0 and r["first_differing_output"] is None and r["differing_outputs"] == {}
    with pytest.raises(ValueError, match="at least 2 replays"):
        repeat_step(lambda: {}, 1)


def test_output_trace_locates_the_module_that_does_not_repeat():
    """A dropout left in training mode is the one non-repeating module: the trace names it, not the layers after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.ReLU())
    model[1].train()
    x = torch.randn(2, 8)
    trace = OutputTrace(model)

    def step():
        model(x)
        return trace.snapshot()

    r = repeat_step(step, 4)
    assert r["first_differing_output"] == "1" and r["differing_replays"] == 3
    assert "0" not in r["differing_outputs"]  # the layer before the dropout repeats
    assert list(trace.outputs) == ["0", "1", "2", "3"]  # execution order
    kept = dict(trace.outputs)
    trace.remove()
    model(x)
    assert all(trace.outputs[name] is t for name, t in kept.items())  # removed hooks record nothing more


TINY_SHAPE = ModelShape(n_layers=2, hidden=32, n_heads=2, intermediate=64)
TINY = dataclasses.replace(PRESETS["cpu"], target=TINY_SHAPE, scout=TINY_SHAPE)  # the cpu recipe, a smaller target


def test_an_eager_step_repeats_with_stale_cache_positions_scribbled():
    model = random_target(TINY, 0, "cpu", torch.bfloat16)
    prompt = torch.tensor([3, 1, 4, 1, 5, 9])
    traced = step_arm(model, prompt, warm_tokens=3, replays=3, graphs=False, stale=True, trace=True)
    assert traced["cache_length"] == 9 and traced["differing_replays"] == 0
    assert traced["traced"] and traced["stale_scribbled"]
    assert not any(m._forward_hooks for m in model.modules())  # the arm removes its hooks


def test_prefill_and_whole_runs_repeat_bit_for_bit_on_the_cpu():
    model = random_target(TINY, 0, "cpu", torch.bfloat16)
    prompt = torch.tensor([3, 1, 4, 1, 5, 9])
    pre = prefill_arm(model, prompt, replays=3)
    assert pre["differing_replays"] == 0 and pre["prompt_len"] == 6
    runs = engine_arm(model, prompt, runs=3, max_new=6, graphs=False, interleave_k=3)
    assert runs["differing_replays"] == 0 and runs["interleaved_k"] == 3
    from sdsie.decoding.engine import _STATIC

    assert any(key[0] == "target" and key[3] == (1, 4) for key in _STATIC[model])  # the K = 3 runs did run


def test_whole_runs_that_do_not_repeat_are_caught_by_their_cache():
    """Attention dropout left on makes every run differ: the comparison of the caches the runs leave names the
    layers whose keys and values changed (the second layer's keys come from the first layer's randomized output)."""
    model = random_target(TINY, 0, "cpu", torch.float32)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    r = engine_arm(model, torch.tensor([3, 1, 4, 1, 5, 9]), runs=3, max_new=6, graphs=False)
    assert r["differing_replays"] == 2
    assert "layer1.keys" in r["differing_outputs"] and r["first_differing_output"] != "tokens"


def test_scribbling_changes_every_stale_position_and_nothing_before_them():
    model = random_target(TINY, 0, "cpu", torch.float32)
    from sdsie.decoding.model_io import StaticKV, forward

    with torch.inference_mode():
        kv = StaticKV(model, 16)
        forward(model, torch.tensor([3, 1, 4, 1, 5]), kv, last_only=True)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in kv.cache.layers]
        scribble_stale(kv, 6, torch.Generator().manual_seed(0))
    for (k0, v0), layer in zip(before, kv.cache.layers, strict=True):
        for old, new in ((k0, layer.keys), (v0, layer.values)):
            assert torch.equal(old[..., :6, :], new[..., :6, :])
            assert (old[..., 6:, :] != new[..., 6:, :]).all()


@pytest.mark.parametrize("flag", ["--replays", "--runs"])
def test_the_cli_refuses_fewer_than_two_repeats_before_running_any_arm(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--device", "cpu", flag, "1", "--out", str(tmp_path / "probe.json")])
    assert err.value.code == 2 and f"{flag} must be at least 2" in capsys.readouterr().err
    assert not (tmp_path / "probe.json").exists()
