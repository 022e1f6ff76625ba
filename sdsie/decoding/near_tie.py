"""Batched verification vs single-token decoding: where (and by how little) their argmax differs.

In bf16 on a GPU, a target forward over K+1 tokens runs other GEMM kernels than a one-token decode
step, so the logits differ in the last bits and a near-tie can flip (HF #39421, vLLM #54928). That
makes greedy speculation differ from the plain loop at those positions, never elsewhere. This module
measures it: every mismatch with the top-2 logit gap that made it possible. It hides nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from sdsie.decoding.model_io import check_prompt, forward, model_device, new_cache
from sdsie.models import vocab_size

__all__ = ["Mismatch", "NearTieReport", "compare_logits", "decode_logits", "near_tie_report"]


@dataclass(frozen=True)
class Mismatch:
    position: int  # index into the compared rows
    single_token: int
    batched_token: int
    single_gap: float  # top-1 minus top-2 logit, single-token path
    batched_gap: float  # top-1 minus top-2 logit, batched path


@dataclass
class NearTieReport:
    compared: int
    max_abs_logit_diff: float
    mismatches: list[Mismatch] = field(default_factory=list)
    min_gap: float = float("nan")  # smallest single-path top-2 gap over all compared rows

    @property
    def mismatch_count(self) -> int:
        return len(self.mismatches)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mismatch_count": self.mismatch_count}


def decode_logits(
    model: nn.Module, prompt_ids: torch.Tensor | Sequence[int], continuation: Sequence[int], chunk: int
) -> torch.Tensor:
    """Teacher-forced logits predicting continuation[1:], fed `chunk` tokens per forward after one prefill.

    chunk = 1 is the plain loop's single-token decoding; chunk = K + 1 is speculative verification of
    [last, d1..dK]. Returns [len(continuation) - 1, V] in fp32.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if len(continuation) < 2:
        raise ValueError("continuation needs at least 2 tokens (the first one comes from the prefill)")
    device = model_device(model)
    prompt = check_prompt(prompt_ids, vocab_size(model), device)  # [P]
    feed = torch.as_tensor(list(continuation[:-1]), dtype=torch.long, device=device)  # [C-1]
    cache = new_cache(model)
    rows = []
    with torch.inference_mode():
        forward(model, prompt, cache, last_only=True)
        for start in range(0, feed.numel(), chunk):
            rows.append(forward(model, feed[start : start + chunk], cache, last_only=False).float())
    return torch.cat(rows)  # [C-1, V]


def compare_logits(single: torch.Tensor, batched: torch.Tensor) -> NearTieReport:
    """single, batched: [N, V] logits for the same N positions -> argmax mismatches and top-2 gaps."""
    if single.shape != batched.shape or single.dim() != 2 or single.shape[-1] < 2:
        raise ValueError(
            f"need two [N, V>=2] logit tensors of one shape, got {tuple(single.shape)} and {tuple(batched.shape)}"
        )
    single, batched = single.float(), batched.float()
    top_s, top_b = single.topk(2, dim=-1), batched.topk(2, dim=-1)  # values/indices [N, 2]
    gap_s = (top_s.values[:, 0] - top_s.values[:, 1]).tolist()
    gap_b = (top_b.values[:, 0] - top_b.values[:, 1]).tolist()
    tok_s, tok_b = top_s.indices[:, 0].tolist(), top_b.indices[:, 0].tolist()
    mismatches = [
        Mismatch(i, tok_s[i], tok_b[i], gap_s[i], gap_b[i]) for i in range(len(tok_s)) if tok_s[i] != tok_b[i]
    ]
    return NearTieReport(
        compared=single.shape[0],
        max_abs_logit_diff=float((single - batched).abs().max()) if single.numel() else 0.0,
        mismatches=mismatches,
        min_gap=min(gap_s) if gap_s else float("nan"),
    )


def near_tie_report(
    model: nn.Module, prompt_ids: torch.Tensor | Sequence[int], continuation: Sequence[int], k_draft: int = 5
) -> NearTieReport:
    """Compare single-token decoding with (k_draft + 1)-token verification forwards on one sequence
    (e.g. the plain loop's greedy output): mismatch count and the top-2 gap at each mismatch."""
    if k_draft < 1:
        raise ValueError(f"k_draft must be >= 1, got {k_draft}")
    single = decode_logits(model, prompt_ids, continuation, chunk=1)
    batched = decode_logits(model, prompt_ids, continuation, chunk=k_draft + 1)
    return compare_logits(single, batched)
