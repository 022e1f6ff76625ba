"""Model I/O for decoding: one forward over a KV cache, cache rollback, the per-cycle host read, input checks.

Works with any HF causal LM that accepts `past_key_values` and `logits_to_keep` (transformers >= 4.45).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["check_prompt", "crop_cache", "forward", "model_device", "new_cache", "sync_device", "to_host"]


def new_cache(model: nn.Module) -> Any:
    """An empty HF DynamicCache for `model`."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 takes no config
        return DynamicCache()


def forward(model: nn.Module, ids: torch.Tensor, cache: Any, last_only: bool) -> torch.Tensor:
    """ids: [S] -> logits [S, V] (or [1, V] with last_only), appending S positions to `cache`."""
    out = model(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
    return out.logits[0]


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions. Uses the negative form (remove a count), valid across HF versions."""
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} positions, cannot crop up to {length}")
    if excess > 0:
        cache.crop(-excess)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_host(ints: torch.Tensor, floats: torch.Tensor) -> tuple[list[int], list[float]]:
    """A cycle's one device->host read: ints [A] and floats [B] in a single transfer (float64 holds both)."""
    both = torch.cat([ints.double(), floats.double()]).tolist()
    return [int(x) for x in both[: ints.numel()]], both[ints.numel() :]


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_prompt(prompt_ids: torch.Tensor | Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[S] or [1, S] token ids in [0, vocab) -> [S] int64 on device; ValueError otherwise."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt.dim() == 2:
        if prompt.shape[0] != 1:
            raise ValueError(f"decoding is batch 1; got a batch of {prompt.shape[0]} prompts")
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise ValueError(f"prompt_ids must be [S] or [1, S], got shape {tuple(prompt.shape)}")
    if prompt.numel() == 0:
        raise ValueError("prompt_ids is empty: at least one token is needed to condition on")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompt_ids must lie in [0, {vocab}), got values in [{lo}, {hi}]")
    return prompt.to(device)
