"""Scouts for real targets (sdsie.scouts) on tiny random Llamas: layer subsets share the target's weights, the
adapter recipe trains one layer by self-distillation, and a stored adapter loads only for its recipe and target."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from sdsie.decoding import DecodeConfig, generate
from sdsie.models import tiny_llama
from sdsie.scouts import (
    ScoutRecipe,
    active_parameters,
    build_scout,
    layer_subset_scout,
    load_scout,
    new_parameters,
    save_adapter,
)

VOCAB = 64


def chat_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant"] + [f"w{i}" for i in range(6, VOCAB)]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}<s> assistant{% endif %}")
    return tok


def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.float()


RECIPE = ScoutRecipe("tiny", frozen_layers=1, train_prompts=("w7 w8 w9", "w10 w11"), reply_tokens=12, steps=15,
                     lr=1e-2, top_k_vocab=8)


def test_all_layers_in_order_is_the_target_and_shares_its_tensors() -> None:
    target = tiny_llama(num_layers=3, seed=2)
    scout = layer_subset_scout(target, (0, 1, 2))
    ids = [1, 5, 9, 33, 12]
    torch.testing.assert_close(logits_of(scout, ids), logits_of(target, ids), rtol=0, atol=0)
    assert new_parameters(scout, target) == 0
    assert [layer.self_attn.layer_idx for layer in target.model.layers] == [0, 1, 2]  # the target is untouched


def test_a_subset_skips_layers_and_decodes_losslessly_as_a_scout() -> None:
    target = tiny_llama(num_layers=3, seed=2)
    scout = layer_subset_scout(target, (0, -1))
    assert scout.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 3
    assert [layer.self_attn.layer_idx for layer in scout.model.layers] == [0, 1]
    assert scout.model.layers[1].mlp is target.model.layers[2].mlp
    assert not torch.equal(logits_of(scout, [1, 5, 9]), logits_of(target, [1, 5, 9]))
    plain = generate(target, [1, 5, 9], DecodeConfig(max_new_tokens=20))
    spec = generate(target, [1, 5, 9], DecodeConfig(max_new_tokens=20, k_draft=3), scout=scout)
    assert spec.tokens == plain.tokens and spec.stats.scout_forwards > 0


@pytest.mark.parametrize("layers", [(), (0, 0), (1, 0), (3,), (-4,), (0.5,), "01"])
def test_bad_layer_subsets_are_named(layers) -> None:
    with pytest.raises(ValueError, match="layer"):
        layer_subset_scout(tiny_llama(num_layers=3), layers)


def test_build_scout_trains_one_new_layer_and_leaves_the_target_alone() -> None:
    target = tiny_llama(num_layers=3, seed=2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    scout, info = build_scout(target, chat_tokenizer(), RECIPE)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    one_layer = sum(p.numel() for p in target.model.layers[1].parameters())
    assert new_parameters(scout, target) == one_layer
    assert active_parameters(scout) == active_parameters(target) - one_layer  # 1 shared + 1 new of 3 layers
    assert info.tokens > 0 and len(info.losses) == RECIPE.steps
    assert info.losses[-1] < info.losses[0]
    plain = generate(target, [1, 5, 9], DecodeConfig(max_new_tokens=16))
    spec = generate(target, [1, 5, 9], DecodeConfig(max_new_tokens=16, k_draft=4), scout=scout)
    assert spec.tokens == plain.tokens


def test_build_scout_is_deterministic() -> None:
    target = tiny_llama(num_layers=3, seed=2)
    a, _ = build_scout(target, chat_tokenizer(), dataclasses.replace(RECIPE, steps=3))
    b, _ = build_scout(target, chat_tokenizer(), dataclasses.replace(RECIPE, steps=3))
    torch.testing.assert_close(logits_of(a, [1, 5, 9]), logits_of(b, [1, 5, 9]), rtol=0, atol=0)


def test_stored_adapter_round_trips_and_refuses_another_recipe_or_target(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=3, seed=2)
    recipe_3 = dataclasses.replace(RECIPE, steps=3)
    scout, info = build_scout(target, chat_tokenizer(), recipe_3)
    path = save_adapter(scout, recipe_3, tmp_path / "a.safetensors", "ab" * 32, info)
    loaded = load_scout(target, recipe_3, path, "ab" * 32)
    # stored in bf16: the loaded layer is the trained one rounded to bf16
    torch.testing.assert_close(logits_of(loaded, [1, 5, 9]), logits_of(scout, [1, 5, 9]), rtol=0.05, atol=0.05)
    assert new_parameters(loaded, target) == new_parameters(scout, target)
    with pytest.raises(ValueError, match="another recipe"):
        load_scout(target, RECIPE, path, "ab" * 32)
    with pytest.raises(ValueError, match="built for checkpoint"):
        load_scout(target, recipe_3, path, "cd" * 32)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_scout(target, recipe_3, tmp_path / "missing.safetensors", "ab" * 32)


@pytest.mark.parametrize(("field", "value"), [("frozen_layers", -1), ("train_prompts", ()), ("steps", 0),
                                              ("lr", 0.0), ("top_k_vocab", 0)])
def test_bad_recipes_are_named(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(RECIPE, **{field: value})


def test_a_recipe_leaving_no_layer_to_copy_is_refused() -> None:
    with pytest.raises(ValueError, match="frozen_layers=3"):
        build_scout(tiny_llama(num_layers=3), chat_tokenizer(), dataclasses.replace(RECIPE, frozen_layers=3))
