"""Load a target/scout pair and check that they can work together; tiny stand-in models for CPU tests.

Speculation needs the scout's token ids to mean what the target's mean: the same logits width
(vocabulary size) and the same tokenizer mapping. `check_compatible` refuses anything else with
an error that names both models.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelPair",
    "check_compatible",
    "check_vocab",
    "load_model",
    "load_tokenizer",
    "load_pair",
    "perturbed_copy",
    "tiny_llama",
    "vocab_size",
]


@dataclass
class ModelPair:
    target: nn.Module
    scout: nn.Module
    tokenizer: Any  # the target's tokenizer (checked to map tokens exactly as the scout's does)
    target_name: str
    scout_name: str


def load_pair(
    target: str | os.PathLike,
    scout: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: str | os.PathLike | None = None,
) -> ModelPair:
    """Load target and scout (HF hub ids or local save_pretrained folders) in eval mode, then check
    that they share one vocabulary. Each model's tokenizer is read from its own folder, or from
    `tokenizer` (one folder or id for both) when given."""
    target_model = load_model(target, dtype, device)
    scout_model = load_model(scout, dtype, device)
    tok_target = load_tokenizer(tokenizer if tokenizer is not None else target)
    tok_scout = tok_target if tokenizer is not None else load_tokenizer(scout)
    check_compatible(target_model, scout_model, tok_target, tok_scout, names=(str(target), str(scout)))
    return ModelPair(target_model, scout_model, tok_target, str(target), str(scout))


def load_model(name: str | os.PathLike, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """One causal LM in eval mode; a clear error naming `name` when it cannot be found."""
    from transformers import AutoModelForCausalLM

    return _from_pretrained(AutoModelForCausalLM, "model", name, dtype=dtype).to(device).eval()


def load_tokenizer(name: str | os.PathLike) -> Any:
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, "tokenizer", name)


def _from_pretrained(auto: Any, what: str, name: str | os.PathLike, **kwargs: Any) -> Any:
    name = str(name)
    if _looks_like_path(name) and not Path(name).expanduser().is_dir():
        raise FileNotFoundError(
            f"{what} path {name!r} does not exist or is not a directory (expected a save_pretrained folder)"
        )
    try:
        return auto.from_pretrained(str(Path(name).expanduser()) if _looks_like_path(name) else name, **kwargs)
    except (OSError, ValueError) as err:  # hub unreachable, unknown id, files missing from a folder
        raise OSError(
            f"could not load {what} from {name!r}: not a complete local folder, and the Hugging Face hub "
            f"could not provide it (no network here? use a local path or a cached id). Cause: {err}"
        ) from err


def _looks_like_path(name: str) -> bool:
    """Hub ids look like 'org/model'; anything rooted, relative, or deeper is a local path."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def vocab_size(model: nn.Module) -> int:
    """Width of the model's logits: the output embedding's rows, or its `out_features` where it keeps no float
    weight (an `Int4Linear` or `GatedLinear` head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    width = getattr(head, "out_features", None)
    if isinstance(width, int):
        return width
    raise ValueError(f"{type(model).__name__} has no output embedding; is it a causal LM?")


def check_vocab(target: nn.Module, scout: nn.Module, names: tuple[str, str] = ("target", "scout")) -> None:
    """Same logits width, else ValueError naming both."""
    vt, vs = vocab_size(target), vocab_size(scout)
    if vt != vs:
        raise ValueError(
            f"vocabulary mismatch: {names[0]} ({type(target).__name__}) has {vt} logits, "
            f"{names[1]} ({type(scout).__name__}) has {vs}; speculation needs one shared vocabulary"
        )


def check_compatible(
    target: nn.Module,
    scout: nn.Module,
    tok_target: Any,
    tok_scout: Any,
    names: tuple[str, str] = ("target", "scout"),
) -> None:
    """Same vocabulary size and the same token <-> id mapping (and special tokens), else ValueError."""
    check_vocab(target, scout, names)
    vocab_t, vocab_s = tok_target.get_vocab(), tok_scout.get_vocab()
    if vocab_t != vocab_s:
        differing = sorted(set(vocab_t.items()) ^ set(vocab_s.items()))[:5]
        raise ValueError(
            f"tokenizer mismatch: {names[0]} ({len(vocab_t)} entries) and {names[1]} ({len(vocab_s)} entries) "
            f"map tokens to ids differently, e.g. {differing}"
        )
    for attr in ("eos_token_id", "bos_token_id"):
        a, b = getattr(tok_target, attr, None), getattr(tok_scout, attr, None)
        if a != b:
            raise ValueError(f"tokenizer mismatch: {names[0]} {attr}={a}, {names[1]} {attr}={b}")


def tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    init_std: float = 0.6,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A small random LlamaForCausalLM for CPU tests (no download). init_std > HF's 0.02 so logits are
    peaked and entropy varies from token to token, as it does in a trained model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def perturbed_copy(model: nn.Module, noise: float, seed: int = 0) -> nn.Module:
    """A copy of `model` with every floating parameter p replaced by p + noise * std(p) * N(0, 1)."""
    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            if param.is_floating_point() and param.numel() > 1:
                jitter = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.add_((noise * param.float().std() * jitter).to(param.dtype))
    return clone.eval()


def compiled_copy(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """A copy of `model` whose calls run through torch.compile (inductor fuses its norms, RoPE and SiLU into few
    kernels), for a scout: it serves speculation alone, so kernels it saves shorten a speculative cycle and not plain
    decoding's step. Compiled in place (Module.compile), so the engine's caches and tree steps, keyed on the module,
    take it like any model. It compiles on its first calls of each shape; under CUDA graphs those are the capture's
    warm-up runs, and the capture then records inductor's kernels like any others. compile_kwargs go to
    torch.compile (e.g. backend="eager": dynamo's tracing alone, as the CPU tests take it)."""
    compiled = copy.deepcopy(model)
    compiled.compile(**compile_kwargs)
    return compiled


def render_chat(tokenizer: Any, messages: Any, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` ([{"role": str, "content": str}, ...]) through the tokenizer's chat template.
    ValueError when the tokenizer has no chat template or a message is malformed."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat template: set tokenizer.chat_template")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role' and a string 'content'")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template writes its own special tokens


def eos_ids(tokenizer: Any, model: nn.Module | None = None) -> frozenset[int]:
    """Every token id that ends a generation: the tokenizer's eos_token_id and the model's generation config's."""
    found: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None)]
    if model is not None:
        sources.append(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    for ids in sources:
        found.update([ids] if isinstance(ids, int) else list(ids or ()))
    return frozenset(found)
