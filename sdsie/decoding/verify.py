"""Verification of a scout's draft against the target's logits for `[last, d1..dK]`.

Both rules return `(n_accepted, next_token)`: the drafts `d1..d_n` are kept and `next_token`
is taken from the same verification logits at row `n` (the corrected token after a rejection,
the bonus token after full acceptance), so no separate resync pass is needed (as in gpt-fast
and HF assisted generation). With K = 0 both rules reduce to one plain decoding step: that is
how the plain loop and speculation share one code path.

Everything stays on the device; leading batch dimensions are allowed (the tests use them to
draw many samples at once; the engine uses none).
"""

from __future__ import annotations

import torch

from sdsie.decoding.sampling import sample

__all__ = ["greedy_accept", "greedy_verify", "rejection_verify"]


def greedy_verify(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of drafts that equals the target's argmax.

    target_logits: [..., K+1, V]; drafts: [..., K] -> (n_accepted [...], next_token [...]).
    """
    _check_shapes(target_logits, drafts)
    return greedy_accept(target_logits.argmax(dim=-1), drafts)


def greedy_accept(target_tokens: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_verify from the target's argmax tokens [..., K+1] (computed beside the entropy by the engine)."""
    if target_tokens.shape[:-1] != drafts.shape[:-1] or target_tokens.shape[-1] != drafts.shape[-1] + 1:
        raise ValueError(f"greedy_accept needs target tokens [..., K+1] and drafts [..., K]; got "
                         f"{tuple(target_tokens.shape)} and {tuple(drafts.shape)}")
    matches = drafts == target_tokens[..., :-1]  # [..., K]
    n_accepted = _leading_true(matches)  # [...]
    next_token = target_tokens.gather(-1, n_accepted.unsqueeze(-1)).squeeze(-1)
    return n_accepted, next_token


def rejection_verify(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, alg. 1; Chen et al. 2023).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection resample from
    normalize((p_i - q_i)+); after K acceptances draw the bonus token from p_K. The emitted tokens
    are then distributed exactly as tokens sampled from p one at a time.

    p: [..., K+1, V] target probabilities at [last, d1..dK]; q: [..., K, V] scout probabilities the
    drafts were drawn from; drafts: [..., K] -> (n_accepted [...], next_token [...]).
    """
    _check_shapes(p, drafts)
    k = drafts.shape[-1]
    if q.shape != p[..., :k, :].shape:
        raise ValueError(f"rejection_verify: q has shape {tuple(q.shape)}, expected {tuple(p[..., :k, :].shape)}")
    p_draft = p[..., :k, :].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [..., K]
    q_draft = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [..., K]
    u = torch.rand(q_draft.shape, generator=generator, device=q_draft.device)  # [..., K] in [0, 1)
    accepted = u * q_draft < p_draft  # P = min(1, p/q)
    n_accepted = _leading_true(accepted)  # [...]
    residual = (p[..., :k, :] - q).clamp_min(0.0)  # [..., K, V]
    # Where p == q the residual is empty; rejection there has probability 0, but keep the row a
    # valid distribution so a draw from it is always defined.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[..., :k, :])
    candidates = torch.cat([residual, p[..., k:, :]], dim=-2)  # [..., K+1, V]
    drawn = sample(candidates, generator)  # [..., K+1]: one candidate per possible stopping row
    next_token = drawn.gather(-1, n_accepted.unsqueeze(-1)).squeeze(-1)
    return n_accepted, next_token


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of leading True entries along the last dim. mask: [..., K] -> [...] int64."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def _check_shapes(target: torch.Tensor, drafts: torch.Tensor) -> None:
    if target.dim() < 2 or target.shape[-2] != drafts.shape[-1] + 1 or target.shape[:-2] != drafts.shape[:-1]:
        raise ValueError(
            f"verification needs target [..., K+1, V] and drafts [..., K]; got {tuple(target.shape)} "
            f"and {tuple(drafts.shape)}"
        )
