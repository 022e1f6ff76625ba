"""Greedy token and entropy of each row of logits in one pass: what a decode cycle reads after its forward.

`logit_stats(logits)` -> (argmax [R] int64, entropy [R] fp32 in bits) for logits [R, V], the values of
`logits.argmax(-1)` and `sdsie.entropy.entropy(logits)`. In torch those are nine kernels over a one-row [1, V]
tensor (argmax, max, subtract, exp, sum, xlogy, sum, log2, addcdiv), and torch's one-row reductions use few
programs: on the H200 the Llama-3.1-8B vocabulary (V = 128,256) took 76 us of GPU time a decode token there
(telemetry/raw/decode_e2e_llama_split_kv_h200.json). Here two kernels:

  (a) `_stats_chunk_kernel`, grid (R, C): each program reads one chunk of BLOCK_V logits of a row in fp32 and writes
      its max m_c, the first index of that max, s_c = sum exp(x - m_c), t_c = sum exp(x - m_c) (x - m_c), and the
      first index of a NaN (or V where none).
  (b) `_stats_combine_kernel`, grid (R,): with M = max m_c and w_c = exp(m_c - M), s = sum w_c s_c and
      t = sum w_c (t_c + (m_c - M) s_c) = sum e log e for e = exp(x - M); entropy = (log s - t / s) / ln 2, the same
      formula as `entropy` (sdsie/entropy.py), with partial sums grouped by chunk.

Edge cases follow torch: the argmax is the first index of the largest value, a row with a NaN gives the first NaN's
index (torch orders NaN above every number) and NaN entropy; -inf entries are masked vocabulary (probability 0); a row
of -inf alone has no distribution: NaN entropy, argmax 0.

Runs on CUDA, and on a CPU under the Triton interpreter (TRITON_INTERPRET=1); `sdsie.entropy.argmax_entropy` picks
this kernel on CUDA and torch elsewhere.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sdsie.kernels.device import kernel_runs_on

__all__ = ["BLOCK_V", "logit_stats"]

BLOCK_V = 4096  # logits per chunk program: 32 programs a row at V = 128,256, each reading 8 KB of bf16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _stats_chunk_kernel(x_ptr, m_ptr, i_ptr, s_ptr, t_ptr, n_ptr, stride_r, V, C, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = offs < V
    x = tl.load(x_ptr + row * stride_r + offs, mask=inside, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, offs, V), axis=0)
    x = tl.where(is_nan, float("-inf"), x)  # the NaN is reported by index; the sums below skip it
    m = tl.max(x, axis=0)
    first_max = tl.min(tl.where(x == m, offs, V), axis=0)  # the first index of the max (V: no finite max)
    base = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf alone: e = 0 everywhere, no -inf - -inf
    d = x - base
    e = tl.exp(d)
    s = tl.sum(e, axis=0)
    t = tl.sum(e * tl.where(x == float("-inf"), 0.0, d), axis=0)  # masked entries: e = 0, and no 0 * -inf
    out = row * C + chunk
    tl.store(m_ptr + out, m)
    tl.store(i_ptr + out, first_max)
    tl.store(s_ptr + out, s)
    tl.store(t_ptr + out, t)
    tl.store(n_ptr + out, first_nan)


@triton.jit
def _stats_combine_kernel(m_ptr, i_ptr, s_ptr, t_ptr, n_ptr, tok_ptr, h_ptr, V, C, LOG2E, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    cs = tl.arange(0, BLOCK_C)
    inside = cs < C
    m = tl.load(m_ptr + row * C + cs, mask=inside, other=float("-inf"))  # [BLOCK_C]
    idx = tl.load(i_ptr + row * C + cs, mask=inside, other=V)
    s = tl.load(s_ptr + row * C + cs, mask=inside, other=0.0)
    t = tl.load(t_ptr + row * C + cs, mask=inside, other=0.0)
    first_nan = tl.min(tl.load(n_ptr + row * C + cs, mask=inside, other=V), axis=0)
    big = tl.max(m, axis=0)
    token = tl.min(tl.where(m == big, idx, V), axis=0)  # chunks are in index order: the first chunk's first max
    token = tl.where(token == V, 0, token)  # a row of -inf alone
    base = tl.where(big == float("-inf"), 0.0, big)
    some = s > 0.0  # a chunk of -inf alone has m = -inf and s = t = 0: it adds nothing
    shift = tl.where(some, m - base, 0.0)  # <= 0
    w = tl.where(some, tl.exp(shift), 0.0)
    total = tl.sum(w * s, axis=0)  # >= 1 where the row has a finite max
    elog = tl.sum(w * (t + shift * s), axis=0)  # sum e log e over the row, e = exp(x - M)
    safe = tl.where(total > 0.0, total, 1.0)
    h = (tl.log(safe) - elog / safe) * LOG2E
    h = tl.where(total > 0.0, h, float("nan"))  # a row of -inf alone: no distribution
    has_nan = first_nan < V
    tl.store(tok_ptr + row, tl.where(has_nan, first_nan, token).to(tl.int64))
    tl.store(h_ptr + row, tl.where(has_nan, float("nan"), h))


def logit_stats(logits: torch.Tensor, block_v: int = BLOCK_V) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (fp16, bf16 or fp32) -> (argmax [...] int64, entropy [...] fp32 in bits), two kernel launches
    and no host synchronization. block_v: logits per chunk program (a power of two)."""
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logit_stats: logits must be one of {_DTYPES}, got {logits.dtype}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logit_stats: logits need a non-empty last (vocabulary) dimension, got "
                         f"{tuple(logits.shape)}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"logit_stats: block_v must be a power of two >= 16, got {block_v}")
    if not kernel_runs_on(logits.device):
        raise RuntimeError(f"logit_stats runs on CUDA, or on a CPU under TRITON_INTERPRET=1; got {logits.device}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_rows = rows.shape[0]
    tokens = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    bits = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return tokens.reshape(lead), bits.reshape(lead)
    block = min(block_v, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    m, s, t = (torch.empty(n_rows * chunks, dtype=torch.float32, device=logits.device) for _ in range(3))
    idx, nan_at = (torch.empty(n_rows * chunks, dtype=torch.int32, device=logits.device) for _ in range(2))
    _stats_chunk_kernel[(n_rows, chunks)](rows, m, idx, s, t, nan_at, rows.stride(0), vocab, chunks, BLOCK_V=block,
                                         num_warps=8 if block >= 2048 else 4)
    _stats_combine_kernel[(n_rows,)](m, idx, s, t, nan_at, tokens, bits, vocab, chunks, _LOG2E,
                                     BLOCK_C=max(2, triton.next_power_of_2(chunks)), num_warps=1)
    return tokens.reshape(lead), bits.reshape(lead)
