"""Fidelity sweep of precision gating (sdsie.fidelity) on a tiny fp32 Llama.

The INT4 kernel runs under TRITON_INTERPRET=1 on CPU (~0.1 s a launch), so sweeps here are
small: few prompts, few tokens, and only the cells each property needs.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from sdsie.fidelity import ALL, FidelityConfig, compare_tokens, fidelity_main, fidelity_sweep
from sdsie.int4_format import Int4Weight, pack_int4
from sdsie.models import tiny_llama
from sdsie.quant.gated import GatedLinear, gate_model

pytestmark = pytest.mark.fidelity

PROMPTS = {"p0": [1, 5, 9, 3], "p1": [1, 7, 7, 20, 4]}


@torch.no_grad()
def _logits(model: nn.Module) -> torch.Tensor:
    return model(torch.tensor([PROMPTS["p0"]])).logits  # [1, S, V]


def _make_down_proj_representable(model: nn.Module, group: int, seed: int = 0) -> None:
    """Set every mlp.down_proj to INT4-exact weights that min-max recovers exactly per channel and
    per group: one scale and zero-point per row, and codes 0 and 15 in every group of `group`."""
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        lin = layer.mlp.down_proj
        n, k = lin.weight.shape
        codes = torch.randint(0, 16, (n, k), generator=gen)
        codes[:, 0::group], codes[:, 1::group] = 0, 15
        scales = torch.full((1, n), 2.0**-4)  # [G=1, N]
        zeros = torch.randint(0, 16, (1, n), generator=gen).float()
        exact = Int4Weight(pack_int4(codes), scales, zeros, k, k).dequantize(torch.float32)
        lin.weight.data = exact.to(lin.weight.device)


# --- the sweep ----------------------------------------------------------------------------------


def test_zero_gated_layers_match_the_baseline_exactly_and_restore_the_model() -> None:
    model = tiny_llama()
    before = _logits(model)
    cfg = FidelityConfig(schemes=("per-channel",), layer_counts=(0,), group_size=32, max_new_tokens=5)
    result = fidelity_sweep(model, PROMPTS, cfg)
    (cell,) = result.cells
    assert (cell.n_layers, cell.modules, cell.int4_calls) == (0, [], 0)
    for p in cell.prompts:
        assert (p.match_pct, p.first_divergence) == (100.0, None)
        assert p.gated_tokens == p.baseline_tokens and len(p.baseline_tokens) == 5
    assert not any(isinstance(m, GatedLinear) for m in model.modules())
    assert torch.equal(_logits(model), before)
    metrics = result.metrics()
    assert metrics["fidelity.layers_0.p1.match_pct"] == metrics["fidelity.per-channel.layers_0.p1.match_pct"] == 100.0
    assert metrics["fidelity.layers_0.p1.first_divergence"] == 5.0  # no divergence: reported as the length
    assert "| per-channel | 0 | - | 100.0%, no divergence | 100.0%, no divergence |" in result.table()


def test_exactly_representable_weights_match_the_baseline_for_every_scheme(kernel_device: torch.device) -> None:
    model = tiny_llama().to(kernel_device)
    _make_down_proj_representable(model, group=32)
    cfg = FidelityConfig(layer_counts=(ALL,), group_size=32, max_new_tokens=4)
    result = fidelity_sweep(model, {"p0": PROMPTS["p0"]}, cfg)
    assert [c.scheme for c in result.cells] == ["per-channel", "group", "awq"]
    for cell in result.cells:
        assert cell.n_layers == 2 and cell.layers == [0, 1]
        assert cell.int4_calls == 2 * 4  # both layers ran INT4 in every forward: the gear acted
        assert all(s == float("inf") for s in cell.layer_sqnr_db)
        (p,) = cell.prompts
        assert (p.match_pct, p.first_divergence) == (100.0, None), (cell.scheme, p)


def test_groupwise_sqnr_at_least_per_channel_and_the_gear_acts(kernel_device: torch.device) -> None:
    model = tiny_llama(seed=3).to(kernel_device)
    cfg = FidelityConfig(schemes=("per-channel", "group"), layer_counts=(ALL,), group_size=32, max_new_tokens=2)
    per_channel, group = fidelity_sweep(model, {"p0": PROMPTS["p0"]}, cfg).cells
    assert per_channel.modules == group.modules == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    for pc, g in zip(per_channel.layer_sqnr_db, group.layer_sqnr_db, strict=True):
        assert g >= pc, (g, pc)
    assert per_channel.int4_calls == group.int4_calls == 2 * 2


def test_layer_counts_beyond_the_model_are_rejected() -> None:
    with pytest.raises(ValueError, match="cannot gate 4 layers: the model has 2"):
        fidelity_sweep(tiny_llama(), PROMPTS, FidelityConfig(layer_counts=(4,), max_new_tokens=1))


def test_sweep_rejects_a_gated_model_and_no_prompts() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        fidelity_sweep(tiny_llama(), {}, FidelityConfig(layer_counts=(0,)))
    gated = tiny_llama()
    gate_model(gated, "mlp.down_proj")
    with pytest.raises(ValueError, match="already has GatedLinear layers"):
        fidelity_sweep(gated, PROMPTS, FidelityConfig(layer_counts=(0,)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schemes": ("gptq",)}, "schemes must be a non-empty subset"),
        ({"schemes": ()}, "schemes must be a non-empty subset"),
        ({"layer_counts": (-1,)}, "ints >= 0 or 'all'"),
        ({"layer_counts": ("most",)}, "ints >= 0 or 'all'"),
        ({"layer_counts": ()}, "must not be empty"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FidelityConfig(**kwargs)


# --- token comparison ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("baseline", "gated", "expected"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], (100.0, None)),
        ([1, 2, 3, 4], [1, 9, 3, 4], (75.0, 1)),
        ([1, 2, 3, 4], [5, 6, 7, 8], (0.0, 0)),
        ([1, 2, 3, 4], [1, 2], (50.0, 2)),  # the gated run stopped early (EOS)
        ([1, 2], [1, 2, 3, 4], (50.0, 2)),
    ],
)
def test_compare_tokens(baseline: list[int], gated: list[int], expected: tuple[float, int | None]) -> None:
    assert compare_tokens(baseline, gated) == expected


def test_compare_tokens_rejects_empty() -> None:
    with pytest.raises(ValueError, match="both token sequences are empty"):
        compare_tokens([], [])


# --- command line -------------------------------------------------------------------------------


def _save_tiny_model_with_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    fast.save_pretrained(path)
    tiny_llama().save_pretrained(path)


def test_fidelity_main_prints_the_table_and_writes_json(tmp_path, capsys: pytest.CaptureFixture) -> None:
    _save_tiny_model_with_tokenizer(tmp_path / "model")
    out = tmp_path / "fidelity.json"
    argv = ["--model", str(tmp_path / "model"), "--prompt", "poem=w1 w2 w3", "--prompt", "code=w9 w8"]
    argv += ["--layers", "0", "--schemes", "per-channel", "--max-new-tokens", "4", "--dtype", "fp32"]
    argv += ["--device", "cpu", "--json", str(out)]
    assert fidelity_main(argv) == 0
    printed = capsys.readouterr().out
    assert "| per-channel | 0 | - | 100.0%, no divergence | 100.0%, no divergence |" in printed
    saved = json.loads(out.read_text())
    assert [p["prompt"] for p in saved["cells"][0]["prompts"]] == ["poem", "code"]
    assert saved["cells"][0]["prompts"][0]["match_pct"] == 100.0


def test_fidelity_main_rejects_missing_prompts(tmp_path) -> None:
    with pytest.raises(ValueError, match="give prompts"):
        fidelity_main(["--model", str(tmp_path)])
