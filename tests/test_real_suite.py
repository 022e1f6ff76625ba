"""The real-pair suite's bookkeeping (reproductions.real.suite) on tiny models: no checkpoint needed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from reproductions.real.suite import (
    RealPair,
    decode_metrics,
    engaged_share,
    entropy_trace,
    load_prompts,
    markdown_tables,
    percentile,
    prompts_hash,
    speculation_runs,
)
from sdsie.clutch import SEED_CLUTCHES, EntropyClutch
from sdsie.decoding import DecodeConfig, generate
from sdsie.models import perturbed_copy, tiny_llama
from sdsie.scouts import SMOLLM2_SCOUT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

STANDIN_PROMPTS = Path(__file__).parents[1] / "reproductions" / "standin" / "prompts.toml"


def test_prompts_are_the_seeds_three_instructions() -> None:
    prompts = load_prompts()
    assert [p.id for p in prompts] == ["poem", "physics", "code"]
    # the same seed wording the stand-in suite quotes for its instruction prompts
    entries = tomllib.loads(STANDIN_PROMPTS.read_text())["prompt"]
    family = {"verse": "poem", "prose": "physics", "code": "code"}
    standin = {family[e["family"]]: e["text"] for e in entries if e["id"].endswith("-instruction")}
    assert {p.id: p.text for p in prompts} == standin


def test_prompts_hash_changes_with_any_text() -> None:
    prompts = load_prompts()
    changed = [dataclasses.replace(prompts[0], text=prompts[0].text + " ")] + prompts[1:]
    assert prompts_hash(prompts) == prompts_hash(load_prompts())
    assert prompts_hash(changed) != prompts_hash(prompts)


def test_engaged_share_follows_the_clutch_token_by_token() -> None:
    trace = [2.0, 0.1, 0.1, 0.1, 3.0, 3.0, 0.1, 0.1]
    for setting, config in SEED_CLUTCHES.items():
        clutch = EntropyClutch(config)
        expected = sum(clutch.update(h) for h in trace) / len(trace)
        assert engaged_share(trace, setting) == expected
    assert engaged_share([0.0] * 4, "tuned") == 1.0 and engaged_share([5.0] * 4, "production") == 0.0


def test_percentile_interpolates() -> None:
    assert percentile([0.0, 1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([0.0, 10.0], 10) == pytest.approx(1.0)


def _tiny_pair() -> RealPair:
    target = tiny_llama(num_layers=2, seed=5)
    scout = perturbed_copy(target, 0.05, seed=1)
    return RealPair(target, scout, None, Path("tiny.gguf"), "0" * 64, "1" * 64, SMOLLM2_SCOUT, frozenset({2}))


def test_entropy_trace_is_one_entropy_per_plain_token_and_refuses_speculative_runs() -> None:
    pair = _tiny_pair()
    plain = generate(pair.target, [1, 5, 9], DecodeConfig(max_new_tokens=10))
    trace = entropy_trace(plain)
    assert len(trace) == len(plain.tokens) and trace[0] == plain.prefill_entropy
    spec = generate(pair.target, [1, 5, 9], DecodeConfig(max_new_tokens=10, k_draft=3), scout=pair.scout)
    with pytest.raises(ValueError, match="plain run"):
        entropy_trace(spec)


def test_speculation_runs_and_metrics_on_a_tiny_pair() -> None:
    pair = _tiny_pair()
    runs = speculation_runs(pair, [1, 5, 9], 20)
    assert set(runs) == {"plain", "fixed_k2", "fixed_k3", "fixed_k5", "tree", "gated_production", "gated_tuned"}
    m = decode_metrics("code", runs)
    for name in runs:
        if name != "plain":
            assert m[f"{name}.code.identical"] is True
            assert m[f"{name}.code.tokens_per_forward"] == (runs[name].stats.new_tokens - 1) / len(runs[name].cycles)
    k5 = runs["fixed_k5"].stats
    assert m["fixed_k5.code.acceptance"] == k5.accepted / k5.drafted
    assert m["gated_tuned.code.scout_forwards_match"] is True
    assert m["gated_tuned.code.fallback_share"] == runs["gated_tuned"].stats.fallback_fraction
    assert m["entropy.code.p10"] <= m["entropy.code.p50"] <= m["entropy.code.p90"]
    families = ("code",)
    text = markdown_tables(m, None, families)
    assert "| code | 20 |" in text and "| fixed_k5 | " in text and "NOT identical" not in text


def test_markdown_tables_flags_a_non_identical_run_and_renders_fidelity() -> None:
    pair = _tiny_pair()
    m = decode_metrics("code", speculation_runs(pair, [1, 5, 9], 8, only=("fixed_k2",)))
    m["fixed_k2.code.identical"] = False
    fidelity = {"fidelity.per-channel.layers_1.code.match_pct": 100.0,
                "fidelity.per-channel.layers_1.code.first_divergence": 250.0,
                "fidelity.group.layers_2.code.match_pct": 12.5, "fidelity.group.layers_2.code.first_divergence": 7.0}
    text = markdown_tables(m, fidelity, ("code",))
    assert "NOT identical" in text and "| fixed_k3 | - |" in text
    assert "| per-channel | 1 | 100.0%, no divergence |" in text and "| group | 2 | 12.5%, diverges at 7 |" in text


def test_dense_int4_matches_the_kernel_on_cpu_and_restores_it() -> None:
    from reproductions.real.suite import dense_int4
    from sdsie.quant.calibrate import preset
    from sdsie.quant.linear import Int4Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 32, bias=True)
    quantized = Int4Linear.from_linear(linear, preset("awq", 64), act_samples=torch.randn(16, 256))
    x = torch.randn(3, 256)
    kernel = quantized(x)  # the Triton kernel (interpreted on a CPU)
    with dense_int4():
        dense = quantized(x)
    torch.testing.assert_close(dense, kernel, rtol=1e-5, atol=1e-5)
    assert not torch.equal(dense, linear(x))  # it is the INT4 layer, not the float one
    assert "dense_int4" not in Int4Linear.forward.__qualname__  # the kernel path is back
