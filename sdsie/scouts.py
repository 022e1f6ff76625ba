"""Scouts for real targets, built by committed, deterministic recipes.

A layer-subset scout (self-speculation, as in LayerSkip and Draft & Verify) runs a chosen subset of the target's
decoder layers, in order, then the target's own final norm and LM head: every weight shared, nothing new, and the
tokenizer shared by construction. On SmolLM2-135M-Instruct (30 narrow layers) the subsets tried agree with the
target's greedy token too rarely to draft (`python -m reproductions.real.scout_search` prints the table), so the
committed scout adds one trained layer:

    adapter scout = the target's first `frozen_layers` layers (shared) -> one new decoder layer -> the target's final
                    norm and LM head (shared)

The new layer starts as a copy of target layer `frozen_layers` and is trained by self-distillation: the target
decodes greedy replies to the recipe's training prompts (held out: none is a seed prompt), and the layer learns the
target's next-token distribution at every position of prompt and reply (cross-entropy against the target's softmax,
restricted to the union of the target's top-`top_k_vocab` tokens over the data so the head's cost stays small; full
batch, AdamW). Only the new layer's weights are the scout's own; `save_adapter` / `load_scout` store them alone
(bf16 safetensors, a few MB) with the recipe's and the target's hashes, and take the shared parts from the target.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "SMOLLM2_SCOUT",
    "BuildInfo",
    "ScoutRecipe",
    "active_parameters",
    "adapter_scout",
    "build_scout",
    "layer_subset_scout",
    "load_scout",
    "new_parameters",
    "save_adapter",
]


@dataclass(frozen=True)
class ScoutRecipe:
    """An adapter scout: the target's first `frozen_layers` layers, then one layer trained as described above."""

    name: str
    frozen_layers: int
    train_prompts: tuple[str, ...]
    reply_tokens: int = 96  # greedy tokens the target writes per training prompt (stopping at EOS)
    steps: int = 150
    lr: float = 2e-3
    top_k_vocab: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.frozen_layers, int) or self.frozen_layers < 0:
            raise ValueError(f"frozen_layers must be an integer >= 0, got {self.frozen_layers!r}")
        if not self.train_prompts or not all(isinstance(p, str) and p for p in self.train_prompts):
            raise ValueError("train_prompts must be a non-empty tuple of non-empty strings")
        for name in ("reply_tokens", "steps", "top_k_vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")

    def digest(self) -> str:
        """sha256 of the recipe's fields: a stored adapter is used only for the recipe that built it."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()


@dataclass
class BuildInfo:
    """What building a scout took: training tokens, seconds per phase, and the final training loss (nats)."""

    tokens: int
    generate_seconds: float
    train_seconds: float
    losses: list[float] = field(default_factory=list)


# --- layer subsets ---------------------------------------------------------------------------------------


def layer_subset_scout(target: nn.Module, layers: Sequence[int], extra: Sequence[nn.Module] = ()) -> nn.Module:
    """A causal LM that runs `layers` of `target` (a Llama-style HF model: model.layers, model.norm, lm_head) in that
    order, then the decoder layers in `extra`, then the target's final norm and head. Parameters of the target's
    layers, norm, embedding and head are the target's own tensors (shared, not copied)."""
    stack = _decoder_layers(target)
    n = len(stack)
    if isinstance(layers, (str, bytes)) or (not layers and not extra):
        raise ValueError(f"a layer-subset scout needs layer indices or extra layers, got {layers!r}")
    if any(not isinstance(i, int) or isinstance(i, bool) or not -n <= i < n for i in layers):
        raise ValueError(f"layer indices must be integers in [-{n}, {n}) for a target of {n} layers, got {layers!r}")
    chosen = [i % n for i in layers]
    if chosen != sorted(set(chosen)):
        raise ValueError(f"layer indices must be distinct and ascending, got {layers!r} (resolved {chosen})")
    scout = copy.copy(target)  # shallow copies: new module objects where they differ, the target's tensors inside
    scout._modules = dict(target._modules)
    inner = copy.copy(target.model)
    inner._modules = dict(target.model._modules)
    kept = [_renumbered(stack[index], slot) for slot, index in enumerate(chosen)]
    kept += [_renumbered(layer, len(chosen) + j) for j, layer in enumerate(extra)]
    inner._modules["layers"] = nn.ModuleList(kept)
    scout._modules["model"] = inner
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None) is not None:
        types = list(config.layer_types)
        config.layer_types = [types[i] for i in chosen] + [types[min(len(chosen), n - 1)]] * len(extra)
    scout.config = config
    inner.config = config
    return scout.eval()


def _renumbered(layer: nn.Module, slot: int) -> nn.Module:
    """A shallow copy of a decoder layer whose attention writes KV cache entry `slot` (parameters shared)."""
    copy_ = copy.copy(layer)
    copy_._modules = dict(layer._modules)
    attention = copy.copy(layer.self_attn)
    attention.layer_idx = slot
    copy_._modules["self_attn"] = attention
    return copy_


def _decoder_layers(target: nn.Module) -> nn.ModuleList:
    stack = getattr(getattr(target, "model", None), "layers", None)
    if not isinstance(stack, nn.ModuleList) or getattr(target, "lm_head", None) is None:
        raise ValueError(f"{type(target).__name__} is not a Llama-style causal LM (model.layers and lm_head)")
    return stack


def adapter_scout(target: nn.Module, frozen_layers: int, adapter: nn.Module) -> nn.Module:
    """The target's first `frozen_layers` layers, then `adapter` (one decoder layer), then its norm and head."""
    return layer_subset_scout(target, tuple(range(frozen_layers)), extra=(adapter,))


def new_parameters(scout: nn.Module, target: nn.Module) -> int:
    """Parameters of `scout` that are not the target's own tensors."""
    ids = {id(p) for p in target.parameters()}
    return sum(p.numel() for p in scout.parameters() if id(p) not in ids)


def active_parameters(model: nn.Module) -> int:
    """Parameters a forward reads (a tied embedding and head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --- building ----------------------------------------------------------------------------------------------


def build_scout(target: nn.Module, tokenizer: Any, recipe: ScoutRecipe) -> tuple[nn.Module, BuildInfo]:
    """Train the recipe's adapter layer on the target's own greedy replies (module docstring); the target is left
    unchanged. Deterministic for a given machine and thread count (fixed data, full batch, seeded init)."""
    from sdsie.decoding import DecodeConfig, generate
    from sdsie.models import eos_ids, render_chat

    stack = _decoder_layers(target)
    if recipe.frozen_layers >= len(stack):
        raise ValueError(f"frozen_layers={recipe.frozen_layers} leaves no target layer to start the adapter from "
                         f"(the target has {len(stack)})")
    t0 = time.perf_counter()
    eos = tuple(sorted(eos_ids(tokenizer, target)))
    sequences = []
    for text in recipe.train_prompts:
        ids = render_chat(tokenizer, [{"role": "user", "content": text}])
        reply = generate(target, ids, DecodeConfig(max_new_tokens=recipe.reply_tokens, eos_token_id=eos)).tokens
        sequences.append(ids + reply)
    t1 = time.perf_counter()
    adapter, losses = _train_adapter(target, sequences, recipe)
    info = BuildInfo(sum(map(len, sequences)), t1 - t0, time.perf_counter() - t1, losses)
    return adapter_scout(target, recipe.frozen_layers, adapter), info


def _train_adapter(target: nn.Module, sequences: list[list[int]], recipe: ScoutRecipe) -> tuple[nn.Module, list[float]]:
    device = next(target.parameters()).device
    n = recipe.frozen_layers
    with torch.no_grad():
        data = []
        for seq in sequences:
            out = target(torch.tensor([seq], device=device), output_hidden_states=True)
            data.append((out.hidden_states[n][0].float(), out.logits[0].float()))  # layer n's input [T, H], [T, V]
        vocab = torch.unique(torch.cat([logits.topk(recipe.top_k_vocab, -1).indices.reshape(-1) for _, logits in data]))
        soft = [torch.softmax(logits[:, vocab], -1) for _, logits in data]  # [T, V'] targets
        head = target.lm_head.weight[vocab].detach().float()  # [V', H]
    adapter = copy.deepcopy(_decoder_layers(target)[n]).float().train()
    adapter.self_attn.layer_idx = 0
    for p in adapter.parameters():
        p.requires_grad_(True)
    norm, rotary = target.model.norm, target.model.rotary_emb
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=recipe.lr, weight_decay=0.0)
    losses = []
    try:
        for _ in range(recipe.steps):
            optimizer.zero_grad()
            total = 0.0
            for (hidden, _), target_p in zip(data, soft, strict=True):
                z = norm(_layer_forward(adapter, rotary, hidden)).float() @ head.T  # [T, V']
                loss = -(target_p * torch.log_softmax(z, -1)).sum(-1).mean() / len(data)
                loss.backward()
                total += float(loss.detach())
            optimizer.step()
            losses.append(total)
    finally:
        torch.random.set_rng_state(generator_state)
    for p in adapter.parameters():
        p.requires_grad_(False)
    return adapter.to(next(target.parameters()).dtype).eval(), losses


def _layer_forward(layer: nn.Module, rotary: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """One decoder layer over a whole sequence [T, H] with causal attention, no cache."""
    length = hidden.shape[0]
    positions = torch.arange(length, device=hidden.device)[None]
    mask = torch.full((length, length), float("-inf"), device=hidden.device).triu(1)[None, None]
    out = layer(hidden[None], attention_mask=mask, position_ids=positions,
                position_embeddings=rotary(hidden[None], positions))
    return (out[0] if isinstance(out, tuple) else out)[0]


# --- storing the adapter ------------------------------------------------------------------------------------


def save_adapter(scout: nn.Module, recipe: ScoutRecipe, path: str | Path, target_sha256: str,
                 info: BuildInfo | None = None) -> Path:
    """The scout's own layer alone, in bf16 safetensors, with the recipe's digest and the target checkpoint's sha256."""
    from safetensors.torch import save_file

    adapter = _decoder_layers(scout)[recipe.frozen_layers]
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in adapter.state_dict().items()}
    meta = {"recipe": recipe.digest(), "target_sha256": target_sha256, "recipe_name": recipe.name}
    if info is not None:
        meta["build"] = json.dumps({"tokens": info.tokens, "generate_seconds": round(info.generate_seconds, 1),
                                    "train_seconds": round(info.train_seconds, 1),
                                    "final_loss": round(info.losses[-1], 4) if info.losses else None})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_scout(target: nn.Module, recipe: ScoutRecipe, path: str | Path, target_sha256: str) -> nn.Module:
    """An adapter scout from a stored adapter (save_adapter), refused when it was built by another recipe or for
    another checkpoint."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"scout adapter {str(path)!r} does not exist (build it: python -m "
                                "reproductions.real.build_scout)")
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata() or {}
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 (safe_open has no iterator)
    if meta.get("recipe") != recipe.digest():
        raise ValueError(f"scout adapter {path} was built by another recipe ({meta.get('recipe_name')!r}, "
                         f"digest {str(meta.get('recipe'))[:12]}), not {recipe.name!r} ({recipe.digest()[:12]})")
    if meta.get("target_sha256") != target_sha256:
        raise ValueError(f"scout adapter {path} was built for checkpoint {str(meta.get('target_sha256'))[:12]}, "
                         f"not {target_sha256[:12]}")
    template = _decoder_layers(target)[recipe.frozen_layers]
    adapter = copy.deepcopy(template)
    dtype = next(template.parameters()).dtype
    adapter.load_state_dict({name: t.to(dtype) for name, t in tensors.items()})
    return adapter_scout(target, recipe.frozen_layers, adapter.to(next(target.parameters()).device).eval())


# The committed recipe for SmolLM2-135M-Instruct (30 layers). Training prompts: four per seed family (poem, physics,
# code), none of them a seed prompt; the seed's prompts are what the scout is evaluated on.
SMOLLM2_SCOUT = ScoutRecipe(
    name="smollm2-135m-adapter",
    frozen_layers=8,
    train_prompts=(
        "Write a sonnet in English about the sea at night.",
        "Write a short poem in English about autumn leaves.",
        "Write a ballad in English about a lighthouse keeper.",
        "Write a villanelle in English about time.",
        "Explain how a transistor works.",
        "Explain the physics of heat dissipation in computer chips.",
        "Explain how DRAM refresh works.",
        "Explain why cache memory speeds up a processor.",
        "Write a Python implementation of a linked list with type annotations.",
        "Write a Python implementation of a stack with type annotations.",
        "Write a Python function that merges two sorted lists, with type annotations.",
        "Write a Python implementation of a priority queue with type annotations.",
    ),
)
