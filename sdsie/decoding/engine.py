"""The one generation engine: plain decoding, fixed-K speculation, and entropy-gated speculation
and precision, all through one cycle function.

    generate(target, prompt)                          plain loop (prefill, then one token per cycle)
    generate(target, prompt, scout=scout)             fixed-K speculative decoding
    generate(target, prompt, scout=s, clutch=c)       the clutch picks, per cycle, K drafts or a plain step
    generate(target, prompt, clutch=c, gear=g)        the clutch sets g.int4 before each target forward
    generate(target, prompt, scout=s, clutch=c, gear=g)   both, from the same clutch
    DecodeConfig(tree_widths=(w1, ..., wD))           speculate cycles draft a static tree instead of a chain

A cycle with K drafts: the scout drafts d1..dK, the target verifies [last, d1..dK] in one forward,
and the next token comes from those logits at row n_accepted. K = 0 is a plain decoding step, so
the plain loop is this same code with the scout switched off, not a separate implementation.

KV caches are HF `DynamicCache`s, cropped after each verification. The target's cache always holds
every token before `last`. The scout's cache may lag behind (it does not run during fallback steps,
and its K-th draft is never fed back): the first draft forward of a speculate cycle feeds all the
tokens it is missing together with `last`, in one forward pass, so catching up costs no extra pass.

A tree cycle (`tree_widths`, greedy only; sdsie.decoding.tree) drafts the scout's top w_1 tokens, their top w_2
each, and so on, one scout forward per depth with tree attention, and the target verifies all nodes in one forward;
the kept path's keys and values are then moved to the slots after `last` (`compact_cache`), so the target's cache
again holds exactly the kept tokens. The scout's tree positions are dropped: its next cycle catches up on the path.
After the scout's catch-up forward, a cycle's device work is one function (TreeStep), replayed as one CUDA graph
under cuda_graphs.

Each cycle reads the device once (`_wait`): accepted count, emitted tokens and the entropy of
every verification row come back together. The clutch reads those entropies (target logits that
were computed anyway): no extra forward and no extra synchronization. In a run without a scout every
cycle is a plain step whose input is already on the device, so each step is launched before the previous
one is read (DecodeConfig.launch_ahead) and the device does not wait on the host between steps; with a
clutch, wherever that read cannot flip it.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from sdsie.clutch import EntropyClutch
from sdsie.decoding.model_io import (
    DECODE_ATTENTIONS,
    HostRead,
    StaticKV,
    cache_length,
    check_prompt,
    crop_cache,
    forward,
    model_device,
    module_fingerprint,
    new_cache,
    sync_device,
)
from sdsie.decoding.sampling import GREEDY, SamplingConfig, logits_to_probs, make_generator, select_token
from sdsie.decoding.tree import TreeLayout, TreeStep, check_widths
from sdsie.decoding.verify import greedy_accept, rejection_verify
from sdsie.entropy import argmax_entropy, entropy
from sdsie.kernels.device import kernel_runs_on
from sdsie.models import check_vocab, vocab_size

__all__ = ["K_SCHEDULES", "CycleRecord", "DecodeConfig", "DecodeStats", "Gear", "GenerationResult", "generate",
           "next_draft_length", "run_attention", "warm_up_runs"]

DEFAULT_K = 5
# "constant": K drafts in every speculate cycle. "adaptive": HF assisted generation's "heuristic" schedule, bounded
# by K: after a speculate cycle whose drafts were all kept the draft length grows by 2 (at most K), after any
# rejection it shrinks by 1 (at least 1), and it carries over fallback stretches (next_draft_length).
K_SCHEDULES = ("constant", "adaptive")


class Gear(Protocol):
    """Anything with a boolean `int4` attribute (sdsie.quant.gated.GearState, or a test double)."""

    int4: bool


@dataclass(frozen=True)
class DecodeConfig:
    """max_new_tokens counts generated tokens (the prefill's token included).

    k_draft: draft length for fixed-K speculation (default 5). With a clutch, K comes from the clutch
    (`clutch.k`); k_draft may then be left None or must equal `clutch.config.k_draft`.
    int4_when_engaged: gear mapping; True = engaged -> INT4, disengaged -> full precision.
    timing: synchronize the device at every cycle boundary so per-cycle times are exact.
    kv_cache: "dynamic" (HF DynamicCache, cropped after a rejection) or "static" (preallocated, rolled back
    by a device-side counter: `model_io.StaticKV`).
    cuda_graphs: capture and replay the 1-token and (K+1)-token forwards (needs kv_cache="static" and CUDA;
    with a gear, the target gets one graph per precision). A replay runs no Python: counters kept inside the
    model (GearState.int4_calls / full_calls, kernel_calls()) count captures, not replays; the per-cycle
    CycleRecord.gear_int4 stays exact.
    pad_scout_catchup: under cuda_graphs, pad the scout's catch-up forwards to one of SCOUT_PAD_SIZES and replay
    them (False: run them eagerly, as before; for A/B runs).
    prefill_graphs: under cuda_graphs, pad each prompt to one of PREFILL_SIZES and replay a graph of that size (one
    per size, captured on its first use), so a prefill launches nothing from the host (a cache whose layers its
    configuration cannot describe runs its first prompt eagerly, to build them: StaticKV). A DecodeCompiled model's
    compiled prompt replays inductor's kernels as plain launches (DecodeCompiled). The padding is compute spent on
    no token (at most half the forward below 256 tokens); a prompt over 2,048 tokens runs eagerly. The prompt's
    logits are the same computation as an unpadded forward's, up to the kernels' floating-point order for another
    size.
    k_schedule: "constant" (K drafts every speculate cycle) or "adaptive" (K_SCHEDULES: the draft length moves
    between 1 and K with the previous cycle's acceptance). Under cuda_graphs an adaptive run captures a verify
    graph for every draft length 1..K. Any schedule is lossless: only how many drafts are verified changes.
    draft_stop_prob: stop a cycle's drafting after a draft the scout gave a probability below this (the greedy
    scout's softmax, or the warped distribution it sampled from), even before the schedule's length; that draft
    is still verified. HF assisted generation's assistant_confidence_threshold (default 0.4 there), held fixed
    here where HF re-fits it during a run. Each draft then costs a host sync to read the probability, and under
    cuda_graphs every verify length 1..K is captured. None: drafts follow the schedule alone.
    tree_widths: draft a static tree of these widths per depth in every speculate cycle instead of a chain of K
    (sdsie.decoding.tree; greedy sampling, the constant schedule, no draft_stop_prob). Its depth plays K's part:
    k_draft, and a clutch's k_draft, must be None or equal it, and CycleRecord.k counts depths, not nodes. Near the
    end of a run the tree is cut to the depths the budget leaves. Under cuda_graphs a tree cycle is one graph replay
    after the scout's catch-up forward (sdsie.decoding.tree.TreeStep).
    attention: a one-token step's attention over a static cache: "sdpa" (torch's fused kernel, one program per
    key/value head over the whole cache), "split_kv" (sdsie.kernels.decode_attention: the cache's positions split
    across programs; CUDA, or the Triton interpreter; needs kv_cache="static") or "auto" (the default): split_kv
    for a static cache under cuda_graphs on CUDA, sdpa otherwise (`run_attention`).
    launch_ahead: where a plain step is to be followed by another (always without a scout; while the clutch is out
    with one), launch the next step before waiting for this one's answer (its token is already on the device), so
    the device runs step after step while the host reads. With a clutch, only where no entropy the read can bring
    flips it (EntropyClutch.may_flip): the step runs in the clutch's state before the read. Should the read flip it
    anyway, or end the run (EOS, on_tokens stopping it), the step is dropped (DecodeStats.ahead_dropped). Tokens,
    entropies, decisions, gears and the one host read per cycle are unchanged. False: launch after the read (for
    A/B runs). timing=True launches after the read.
    """

    max_new_tokens: int = 64
    sampling: SamplingConfig = GREEDY
    k_draft: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    int4_when_engaged: bool = True
    timing: bool = False
    kv_cache: str = "dynamic"
    cuda_graphs: bool = False
    pad_scout_catchup: bool = True
    prefill_graphs: bool = False
    k_schedule: str = "constant"
    draft_stop_prob: float | None = None
    tree_widths: tuple[int, ...] | None = None
    attention: str = "auto"
    launch_ahead: bool = True

    def __post_init__(self) -> None:
        if self.tree_widths is not None:
            self._check_tree()
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.kv_cache not in ("dynamic", "static"):
            raise ValueError(f"kv_cache must be 'dynamic' or 'static', got {self.kv_cache!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.launch_ahead, bool):
            raise ValueError(f"launch_ahead must be a bool, got {self.launch_ahead!r}")
        if not isinstance(self.pad_scout_catchup, bool):
            raise ValueError(f"pad_scout_catchup must be a bool, got {self.pad_scout_catchup!r}")
        if not isinstance(self.prefill_graphs, bool):
            raise ValueError(f"prefill_graphs must be a bool, got {self.prefill_graphs!r}")
        if self.prefill_graphs and not self.cuda_graphs:
            raise ValueError("prefill_graphs needs cuda_graphs=True (it replays the prompt's forward as a graph)")
        if self.k_schedule not in K_SCHEDULES:
            raise ValueError(f"k_schedule must be one of {K_SCHEDULES}, got {self.k_schedule!r}")
        if self.draft_stop_prob is not None and (
            isinstance(self.draft_stop_prob, bool) or not isinstance(self.draft_stop_prob, (int, float))
            or not 0.0 < self.draft_stop_prob <= 1.0
        ):
            raise ValueError(f"draft_stop_prob must be a probability in (0, 1], got {self.draft_stop_prob!r}")
        if self.attention not in ("auto", *DECODE_ATTENTIONS):
            raise ValueError(f"attention must be one of {('auto', *DECODE_ATTENTIONS)}, got {self.attention!r}")
        if self.attention == "split_kv" and self.kv_cache != "static":
            raise ValueError(f"attention={self.attention!r} needs kv_cache='static' (it attends over a static cache)")
        if self.cuda_graphs and self.kv_cache != "static":
            raise ValueError("cuda_graphs needs kv_cache='static' (a graph replays fixed cache addresses)")
        if self.k_draft is not None and (
            not isinstance(self.k_draft, int) or isinstance(self.k_draft, bool) or self.k_draft < 1
        ):
            raise ValueError(f"k_draft (K) must be an integer >= 1, got {self.k_draft!r}")

    def _check_tree(self) -> None:
        widths = tuple(self.tree_widths) if isinstance(self.tree_widths, list) else self.tree_widths
        object.__setattr__(self, "tree_widths", check_widths(widths))
        clashes = [name for name, bad in (("sampling (greedy only)", not self.sampling.greedy),
                                          ("k_schedule='adaptive'", self.k_schedule != "constant"),
                                          ("draft_stop_prob", self.draft_stop_prob is not None)) if bad]
        if clashes:
            raise ValueError(f"tree_widths cannot be combined with {', '.join(clashes)}: tree verification here is "
                             "greedy over a fixed tree")
        if self.k_draft is not None and self.k_draft != len(self.tree_widths):
            raise ValueError(f"k_draft={self.k_draft} but tree_widths={self.tree_widths} has depth "
                             f"{len(self.tree_widths)}: with a tree, leave k_draft None")

    @property
    def eos_ids(self) -> frozenset[int]:
        if self.eos_token_id is None:
            return frozenset()
        if isinstance(self.eos_token_id, int):
            return frozenset({self.eos_token_id})
        return frozenset(self.eos_token_id)


@dataclass(frozen=True)
class CycleRecord:
    """One cycle. engaged: the clutch state that decided it (None without a clutch); k: drafts made
    (0 = plain step; fewer than the schedule asked where draft_stop_prob stopped the scout); accepted:
    drafts kept; emitted: tokens appended; entropy: bits of the target distribution behind the last
    emitted token; ema: clutch EMA after this cycle; gear_int4: the gear during this cycle's target
    forward (None without a gear); seconds: wall time of the cycle."""

    engaged: bool | None
    k: int
    accepted: int
    emitted: int
    entropy: float
    ema: float | None
    gear_int4: bool | None
    seconds: float

    @property
    def speculated(self) -> bool:
        return self.k > 0


@dataclass
class DecodeStats:
    """Counters for one run. scout_forwards are draft forwards only (the catch-up tokens ride along in
    the first draft forward of a cycle and are counted in scout_catchup_tokens)."""

    new_tokens: int = 0
    cycles: int = 0
    speculate_cycles: int = 0
    engaged_cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0  # forwards run: a launched-ahead step that was dropped counts too
    ahead_launched: int = 0  # plain steps launched before the read of the step before (DecodeConfig.launch_ahead)
    ahead_dropped: int = 0  # of those, dropped: the run ended, or the clutch flipped under them
    scout_forwards: int = 0
    scout_catchup_tokens: int = 0
    draft_stops: int = 0  # speculate cycles whose drafting draft_stop_prob ended before the schedule's length
    tree_nodes: int = 0  # nodes drafted by tree cycles (drafted counts their depths)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Drafts accepted per speculate cycle (the bonus/corrected token not included)."""
        return self.accepted / self.speculate_cycles if self.speculate_cycles else None

    @property
    def fallback_fraction(self) -> float:
        """Fraction of decode cycles that did not speculate."""
        return 1.0 - self.speculate_cycles / self.cycles if self.cycles else 0.0

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        """End to end: all new tokens over prefill + decode time."""
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Steady state: tokens produced by decode cycles over decode time (the prefill token excluded)."""
        return (self.new_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        derived = (
            "acceptance_rate",
            "mean_accepted_length",
            "fallback_fraction",
            "tokens_per_s",
            "decode_tokens_per_s",
        )
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    stop_reason: str  # "eos", "max_new_tokens", or "stopped" (on_tokens asked to stop)
    stats: DecodeStats
    cycles: list[CycleRecord] = field(default_factory=list)
    prefill_entropy: float = float("nan")
    prefill_gear_int4: bool | None = None

    @property
    def step_seconds(self) -> list[float]:
        """Wall time per decode cycle (exact with DecodeConfig(timing=True))."""
        return [c.seconds for c in self.cycles]

    @property
    def decisions(self) -> str:
        """One letter per cycle: S = speculated, F = plain/fallback step."""
        return "".join("S" if c.speculated else "F" for c in self.cycles)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "stop_reason": self.stop_reason,
            "stats": self.stats.to_dict(),
            "decisions": self.decisions,
            "cycles": [asdict(c) for c in self.cycles],
            "prefill_entropy": self.prefill_entropy,
            "prefill_gear_int4": self.prefill_gear_int4,
        }


ENTROPY_SLACK_BITS = 0.01  # above log2(V): what fp32 rounding may add to a computed entropy


# ----------------------------------------------------------------------------------------------------
# Run state and one cycle


@dataclass
class _Run:
    target: nn.Module
    scout: nn.Module | None
    config: DecodeConfig
    generator: torch.Generator | None
    ids: torch.Tensor  # [P + max_new_tokens] on device: prompt then generated tokens
    length: int  # valid entries of ids; ids[length - 1] is `last`, not yet in the target cache
    target_cache: Any
    scout_cache: Any | None
    gear: Gear | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    k_next: int = 0  # drafts for the next speculate cycle (K; the adaptive schedule moves it)
    trees: dict[int, TreeStep] = field(default_factory=dict)  # tree_widths cut to each depth, built on first use
    on_wait: Callable[[], None] | None = None  # generate's on_wait: called before each cycle's host read

    @property
    def last(self) -> torch.Tensor:  # [1]
        return self.ids[self.length - 1 : self.length]


def _draft(run: _Run, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scout drafts up to k tokens after `last` -> (drafts [d], q [d, V] or None when greedy); d < k only where
    config.draft_stop_prob ended the drafting (_draft_prob)."""
    assert run.scout is not None and run.scout_cache is not None
    feed = run.ids[cache_length(run.scout_cache) : run.length]  # [F]: tokens the scout missed, then last
    run.stats.scout_catchup_tokens += feed.numel() - 1
    stop = run.config.draft_stop_prob
    tokens, probs = [], []
    for i in range(k):
        logits = forward(run.scout, feed, run.scout_cache, last_only=True)[-1]  # [V]
        token, prob = select_token(logits, run.config.sampling, run.generator)
        tokens.append(token)
        probs.append(prob)
        feed = token[None]
        if stop is not None and i < k - 1 and _draft_prob(logits, token, prob) < stop:
            run.stats.draft_stops += 1
            break
    run.stats.scout_forwards += len(tokens)
    q = None if run.config.sampling.greedy else torch.stack(probs)
    return torch.stack(tokens), q


def _draft_prob(logits: torch.Tensor, token: torch.Tensor, prob: torch.Tensor | None) -> float:
    """The scout's probability of its draft on the host (a device sync): from the distribution it sampled from
    (prob [V]), or greedy from the softmax of its logits [V]."""
    p = prob if prob is not None else torch.softmax(logits.float(), dim=-1)
    return float(p[token])


def _verify(run: _Run, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None):
    """logits: [K+1, V] at [last, d1..dK] -> (n_accepted, next_token, entropy bits [K+1]), all on device; a greedy
    run takes its argmax and entropy in one pass (argmax_entropy)."""
    if run.config.sampling.greedy:
        tokens, bits = argmax_entropy(logits)  # [K+1], [K+1]
        return (*greedy_accept(tokens, drafts), bits)
    assert run.generator is not None
    p = logits_to_probs(logits, run.config.sampling)  # [K+1, V]
    q = q if q is not None else p[:0]
    return (*rejection_verify(p, q, drafts, run.generator), entropy(logits))


def _cycle(run: _Run, k: int) -> tuple[list[int], list[float], int, int]:
    """One decode cycle with up to k drafts (k = 0: a plain step). Returns (emitted tokens, entropy per
    emitted token, n_accepted, drafts made); caches are left holding exactly the kept tokens before the new
    last."""
    if k > 0 and run.config.tree_widths is not None:
        return _tree_cycle(run, _tree_step(run, k))
    return _settle(run, _launch(run, k))


@dataclass
class _Launched:
    """A chain cycle whose device work is launched and whose answer is on its way to the host."""

    k: int  # drafts made
    drafts: torch.Tensor  # [k]
    next_token: torch.Tensor  # 0-d
    read: HostRead  # [n_accepted, drafts, next_token], then the entropies [k + 1]


def _launch(run: _Run, k: int) -> _Launched:
    """A chain cycle's device work, up to the start of its host read. A plain step (k = 0) knows where its token goes
    without the read: it writes it after `last` and advances run.length now, so the next plain step can be launched
    before this one is read (_loop's launch-ahead)."""
    device = run.ids.device
    if k > 0:
        drafts, q = _draft(run, k)  # [d], [d, V] | None
        k = drafts.numel()
    else:
        drafts, q = torch.empty(0, dtype=torch.long, device=device), None
    precision = run.gear.int4 if run.gear is not None else None  # a graphed cache keeps one graph per precision
    logits = forward(run.target, torch.cat([run.last, drafts]), run.target_cache, False, precision)  # [k+1, V]
    run.stats.target_forwards += 1
    n_acc, next_token, bits = _verify(run, logits, drafts, q)  # bits: [k+1]
    read = HostRead(torch.cat([n_acc[None], drafts, next_token[None]]), bits)
    if k == 0:
        run.ids[run.length : run.length + 1] = next_token[None]  # device to device
        run.length += 1
    return _Launched(k, drafts, next_token, read)


def _settle(run: _Run, launched: _Launched) -> tuple[list[int], list[float], int, int]:
    """Wait for a launched cycle's answer; for a speculate cycle, crop both caches to the kept tokens and write them
    after `last`. Returns _cycle's tuple."""
    ints, floats = _wait(run, launched.read)
    n, k = ints[0], launched.k
    if k > 0:
        assert run.scout_cache is not None
        crop_cache(run.target_cache, run.length + n)
        crop_cache(run.scout_cache, run.length + min(n, k - 1))
        run.ids[run.length : run.length + n + 1] = torch.cat([launched.drafts[:n], launched.next_token[None]])
        run.length += n + 1
    return ints[1 : 1 + n] + [ints[-1]], floats[: n + 1], n, k


def _tree_step(run: _Run, depth: int) -> TreeStep:
    """The tree cycle for config.tree_widths cut to `depth` levels (the budget's cap near a run's end). It is kept with
    the target's cache and the scout's (`_TREE_STEPS`): static caches, and their graphs, are reused across runs, so a
    graphed tree cycle is captured once per (target cache, scout cache, tree), not once per run, also when runs with
    two scouts of the same tree take turns on one target cache."""
    if depth not in run.trees:
        assert run.config.tree_widths is not None and run.scout is not None
        widths = run.config.tree_widths[:depth]
        # dynamic caches are new each run, static ones are not
        by_scout = _TREE_STEPS.setdefault(run.target_cache, weakref.WeakKeyDictionary())
        steps = by_scout.setdefault(run.scout_cache, {})
        step = steps.get(widths)
        if step is None or not step.serves(run.target, run.scout, run.scout_cache):
            step = steps[widths] = TreeStep(TreeLayout(widths), run.target, run.scout, run.target_cache,
                                            run.scout_cache, graphs=run.config.cuda_graphs)
        run.trees[depth] = step
    return run.trees[depth]


def _tree_cycle(run: _Run, step: TreeStep) -> tuple[list[int], list[float], int, int]:
    """A speculate cycle over a static tree: _cycle's contract, with k the tree's depth.

    The scout's catch-up forward (the tokens it missed, then last) gives depth 1; TreeStep does the rest on the
    device (the deeper levels, the verify, the kept path's compaction); one host read; both caches cropped to the kept
    tokens (the scout to `last`: its next cycle catches up on the path). On static caches a catch-up of at most
    depth + 1 tokens (every cycle's but the first, unless plain cycles came between) is folded into the step, padded
    (TreeStep.catch_up): under graphs the cycle is then one replay; pad_scout_catchup=False keeps it separate."""
    assert run.scout is not None and run.scout_cache is not None
    feed = run.ids[cache_length(run.scout_cache) : run.length]  # [F]: tokens the scout missed, then last
    run.stats.scout_catchup_tokens += feed.numel() - 1
    root = run.length - 1  # last's slot in the target's cache and its position id
    precision = run.gear.int4 if run.gear is not None else None
    if run.config.pad_scout_catchup and step.can_catch_up(feed.numel()):  # the catch-up folded into the step
        ints_d, bits_d = step.catch_up(feed, root, precision)  # [2 + D], [1 + D]
    else:  # a longer catch-up (the first cycle, or after plain cycles), or dynamic caches
        first = forward(run.scout, feed, run.scout_cache, last_only=True)  # [1, V]
        ints_d, bits_d = step(first, run.last, root, precision)
    step.advance()
    run.stats.scout_forwards += step.layout.max_depth
    run.stats.target_forwards += 1
    run.stats.tree_nodes += step.layout.nodes
    ints, floats = _wait(run, HostRead(ints_d, bits_d))
    n = ints[0]
    crop_cache(run.target_cache, root + 1 + n)
    crop_cache(run.scout_cache, root + 1)
    run.ids[run.length : run.length + n] = ints_d[1 : 1 + n]  # device to device: the path, then the target's token
    run.ids[run.length + n] = ints_d[-1]
    run.length += n + 1
    return ints[1 : 1 + n] + [ints[-1]], floats[: n + 1], n, step.layout.max_depth


# ----------------------------------------------------------------------------------------------------
# The engine


def generate(
    target: nn.Module,
    prompt_ids: torch.Tensor | Sequence[int],
    config: DecodeConfig | None = None,
    scout: nn.Module | None = None,
    clutch: EntropyClutch | None = None,
    gear: Gear | None = None,
    on_cycle: Callable[[CycleRecord], None] | None = None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    on_wait: Callable[[], None] | None = None,
) -> GenerationResult:
    """Generate up to config.max_new_tokens after prompt_ids (batch 1).

    Speculation is on when a scout is given (fixed K without a clutch, gated with one); precision
    gating is on when a gear is given (it needs a clutch). Neither: the plain loop.

    The clutch is reset at the start (its state is per run) and updated once per generated token with
    the entropy of the target distribution that token came from. Each cycle's decision is the clutch
    state at the cycle's start; the gear is set from it before the target's forward (the prefill's
    gear comes from `initial_engaged`). on_cycle, if given, is called with each CycleRecord.
    on_tokens, if given, is called with the tokens the prefill and then each cycle appended (a streaming
    server's hook); a true return ends the run after that step, stop_reason "stopped" (unless it ended anyway).
    on_wait, if given, is called in each cycle (the prefill's too) once its work is launched, just before the host
    waits for the device's answer: work that need not lengthen the cycle goes there. A server sends the text of the
    previous cycle from it, so that the event loop it wakes takes the interpreter lock while the device computes
    rather than while the host launches (docs/serving.md).
    """
    config = config if config is not None else DecodeConfig()
    device = model_device(target)
    prompt = check_prompt(prompt_ids, vocab_size(target), device)  # [P]
    k_engaged = _check_setup(target, scout, clutch, gear, config, device)
    run = _start(target, scout, prompt, config, k_engaged, gear)
    run.on_wait = on_wait
    if clutch is not None:
        clutch.reset()

    with torch.inference_mode():
        return _loop(run, prompt.numel(), k_engaged, clutch, gear, on_cycle, on_tokens)


def _loop(
    run: _Run,
    prompt_len: int,
    k_engaged: int,
    clutch: EntropyClutch | None,
    gear: Gear | None,
    on_cycle: Callable[[CycleRecord], None] | None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
) -> GenerationResult:
    config, stats, eos = run.config, run.stats, run.config.eos_ids
    device = run.ids.device
    tokens: list[int] = []

    prefill_gear = _set_gear(gear, clutch, config)
    sync_device(device)
    t0 = time.perf_counter()
    first, h0 = _prefill(run, prompt_len)
    tokens.append(first)
    stats.prefill_seconds = time.perf_counter() - t0
    if clutch is not None:
        clutch.update(h0)
    result = GenerationResult(
        tokens, "eos" if first in eos else "max_new_tokens", stats, prefill_entropy=h0, prefill_gear_int4=prefill_gear
    )
    _tokens_hook(on_tokens, [first], result)

    # A plain step's input is the previous step's token, already on the device: where the next cycle is a plain step
    # too (every cycle without a scout; with one, while the clutch is out), launch it before waiting for this one, so
    # the device does not idle while the host reads a token and launches the next step (a graphed INT4 Llama-3.1-8B
    # decode on the H200: 412 tok/s against 392 launching after the read, docs/log.md). With a clutch, only where the
    # read cannot flip it (EntropyClutch.may_flip): a wrong guess would cost a whole dropped forward, and on real text
    # the clutch engages after fallback stretches of 10-40 steps (SmolLM2 and its scout, docs/log.md), about where
    # that loses what the host's turn saves.
    ahead_ok = config.launch_ahead and not config.timing
    ahead: _Launched | None = None  # the next plain step, launched before this cycle's read
    # the largest entropy a read can bring (a V-way distribution's, with slack for rounding): a step is launched
    # ahead only where no entropy up to it flips the clutch, so a guess is never wasted; the drop below stays the
    # guarantee
    max_bits = math.log2(vocab_size(run.target)) + ENTROPY_SLACK_BITS
    while result.stop_reason == "max_new_tokens" and len(tokens) < config.max_new_tokens:
        t_start = time.perf_counter()
        engaged = clutch.engaged if clutch is not None else None
        k = _draft_length(run, engaged, produced=len(tokens))
        gear_int4 = _set_gear(gear, clutch, config)
        if ahead_ok and k == 0:
            launched = ahead or _launch(run, 0)
            ahead_plan = _plan(run, clutch, gear, config, produced=len(tokens) + 1)  # the next cycle, as things stand
            if (len(tokens) + 2 <= config.max_new_tokens and ahead_plan[0] == 0
                    and (clutch is None or not clutch.may_flip(max_bits))):
                ahead = _launch(run, 0)  # in this cycle's gear
                stats.ahead_launched += 1
            else:
                ahead = None
            emitted, bits, n, k = _settle(run, launched)
        else:
            emitted, bits, n, k = _cycle(run, k)  # k: the drafts made
        if k > 0 and config.k_schedule == "adaptive":
            run.k_next = next_draft_length(run.k_next, k, n, k_engaged)
        emitted, bits = _truncate_at_eos(emitted, bits, eos)
        tokens.extend(emitted)  # the cycle wrote them into run.ids on the device and moved run.length past them
        if clutch is not None:
            for h in bits:  # one EMA update per emitted token, from logits already computed
                clutch.update(h)
        if ahead is not None and _plan(run, clutch, gear, config, produced=len(tokens)) != ahead_plan:
            _drop_ahead(run)  # launched in the state the clutch has just left: the next cycle runs in the new one
            ahead = None
        if emitted[-1] in eos:
            result.stop_reason = "eos"
        if config.timing:
            sync_device(device)
        record = CycleRecord(
            engaged=engaged,
            k=k,
            accepted=n,
            emitted=len(emitted),
            entropy=bits[-1],
            ema=clutch.ema if clutch is not None else None,
            gear_int4=gear_int4,
            seconds=time.perf_counter() - t_start,
        )
        _count(stats, record)
        result.cycles.append(record)
        if on_cycle is not None:
            on_cycle(record)
        _tokens_hook(on_tokens, emitted, result)

    if ahead is not None:  # a step launched past the run's end (EOS, or on_tokens stopped it)
        _drop_ahead(run)
    sync_device(device)
    stats.decode_seconds = sum(c.seconds for c in result.cycles)
    stats.new_tokens = len(tokens)
    return result


def _drop_ahead(run: _Run) -> None:
    """Undo a launched-ahead plain step, which wrote its token after `last` and its position into the cache: both
    are dropped (its forward stays counted in target_forwards)."""
    run.length -= 1
    crop_cache(run.target_cache, run.length - 1)
    run.stats.ahead_dropped += 1


def _tokens_hook(on_tokens: Callable[[list[int]], bool | None] | None, emitted: list[int],
                 result: GenerationResult) -> None:
    if on_tokens is not None and on_tokens(list(emitted)) and result.stop_reason == "max_new_tokens":
        result.stop_reason = "stopped"


def _draft_length(run: _Run, engaged: bool | None, produced: int) -> int:
    """The drafts for this cycle: run.k_next for a speculate cycle (every cycle without a clutch, engaged ones with
    it; K unless the adaptive schedule moved it), 0 for a plain step; capped so that the drafts plus the bonus token
    never pass max_new_tokens."""
    speculate = run.scout is not None and engaged is not False
    return min(run.k_next if speculate else 0, run.config.max_new_tokens - produced - 1)


def next_draft_length(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """The adaptive schedule's next draft length after a speculate cycle that drafted `drafted` tokens (k, or fewer
    where the budget cut it) and kept `accepted`: k + 2 if every draft was kept, else k - 1, within [1, k_max]."""
    if not 1 <= k <= k_max or not 0 <= accepted <= drafted:
        raise ValueError(f"draft lengths out of range: k={k}, drafted={drafted}, accepted={accepted}, k_max={k_max}")
    return min(k + 2, k_max) if accepted == drafted else max(1, k - 1)


def _wait(run: _Run, read: HostRead) -> tuple[list[int], list[float]]:
    """The cycle's one host read, with run.on_wait called first: the cycle's work is launched, so on a GPU what
    on_wait does overlaps the device's work instead of lengthening the cycle."""
    if run.on_wait is not None:
        run.on_wait()
    return read.wait()


def _prefill(run: _Run, prompt_len: int) -> tuple[int, float]:
    """Target reads the prompt; the first new token is a plain step from its last logits."""
    prompt = run.ids[:prompt_len]
    precision = run.gear.int4 if run.gear is not None else None  # a graphed prompt: one graph per precision too
    logits = forward(run.target, prompt, run.target_cache, True, precision)  # [1, V]
    run.stats.target_forwards += 1
    _, token, bits = _verify(run, logits, prompt[:0], None)
    ints, floats = _wait(run, HostRead(token[None], bits))
    run.ids[prompt_len] = token
    run.length = prompt_len + 1
    return ints[0], floats[0]


def _truncate_at_eos(emitted: list[int], bits: list[float], eos: frozenset[int]) -> tuple[list[int], list[float]]:
    for i, token in enumerate(emitted):
        if token in eos:
            return emitted[: i + 1], bits[: i + 1]
    return emitted, bits


def _count(stats: DecodeStats, record: CycleRecord) -> None:
    stats.cycles += 1
    stats.engaged_cycles += int(bool(record.engaged))
    if record.speculated:
        stats.speculate_cycles += 1
        stats.drafted += record.k
        stats.accepted += record.accepted


def _gear_for(clutch: EntropyClutch, config: DecodeConfig) -> bool:
    """The gear (int4 or not) the clutch's state asks for."""
    return clutch.engaged == config.int4_when_engaged


def _plan(run: _Run, clutch: EntropyClutch | None, gear: Gear | None, config: DecodeConfig,
          produced: int) -> tuple[int, bool | None]:
    """What the clutch's present state makes of a cycle after `produced` tokens: its drafts and its gear. A step
    launched ahead is kept only where the read before it leaves this unchanged."""
    engaged = clutch.engaged if clutch is not None else None
    gear_int4 = _gear_for(clutch, config) if gear is not None and clutch is not None else None
    return _draft_length(run, engaged, produced), gear_int4


def _set_gear(gear: Gear | None, clutch: EntropyClutch | None, config: DecodeConfig) -> bool | None:
    """Set the gear from the clutch state before a target forward; returns the gear used."""
    if gear is None or clutch is None:
        return None
    gear.int4 = _gear_for(clutch, config)
    return gear.int4


# ----------------------------------------------------------------------------------------------------
# Setup and input checks


def _start(
    target: nn.Module, scout: nn.Module | None, prompt: torch.Tensor, config: DecodeConfig, k: int, gear: Gear | None
) -> _Run:
    device = prompt.device
    ids = torch.empty(prompt.numel() + config.max_new_tokens, dtype=torch.long, device=device)  # [P + N]
    ids[: prompt.numel()] = prompt
    generator = None if config.sampling.greedy else make_generator(config.sampling, device)
    room = ids.numel() + (TreeLayout(config.tree_widths).nodes if config.tree_widths is not None else 0)
    return _Run(
        target,
        scout,
        config,
        generator,
        ids,
        prompt.numel(),
        _kv(target, "target", config, room, _verify_sizes(config, k), prefill_sizes=_prefill_sizes(config)),
        _kv(scout, "scout", config, room, (1,), _scout_pad_sizes(config), _prefill_sizes(config))
        if scout is not None else None,
        gear,
        k_next=k,
    )


# Static caches outlive a call, as gpt-fast sets its caches up once: a model's StaticKV (and the graphs
# captured on it) is reused by later runs of the same role, length bucket and graph sizes, emptied first,
# as long as the model's module tree and tensor storages are those the graphs were captured on (_FINGERPRINTS).
_STATIC: weakref.WeakKeyDictionary[nn.Module, dict[tuple, StaticKV]] = weakref.WeakKeyDictionary()
_FINGERPRINTS: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
# Tree cycles of a target cache, by scout cache, then by tree widths (their graphs live and die with the caches).
# Keyed by the scout's cache too: two scouts of one tree taking turns on a target cache (decode_repro's interleaved
# tree_graphs and tree_graphs_fused_scout) each keep their step, instead of replacing the other's and capturing its
# graph again every run (record e56b57e3: 0.68x instead of up to 1.96x over plain).
_TREE_STEPS: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], TreeStep]]] = (
    weakref.WeakKeyDictionary())
STATIC_LEN_BUCKET = 256  # positions: a static cache's length is rounded up to a multiple of this


def static_cache_length(positions: int) -> int:
    """The length of the static cache a run filling `positions` positions gets: rounded up to STATIC_LEN_BUCKET, so
    nearby lengths share one cache shape (one compiled step, one set of graphs)."""
    return -(-positions // STATIC_LEN_BUCKET) * STATIC_LEN_BUCKET
# Under graphs, the scout's catch-up forwards (the tokens it skipped: 2 after a fully accepted draft, up to a
# whole fallback stretch after the clutch re-engages) are padded to these sizes and replayed, not run eagerly.
# On the H200 an eager forward of the stand-in scout took 2.3 ms, a graphed step 0.23 ms (record d2f2400a).
SCOUT_PAD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)


# DecodeConfig.prefill_graphs pads a prompt to one of these sizes. Up to 48 in steps of 16: an INT4 prefill of up to
# 48 rows runs the small-M kernels 16 rows at a time, and 49 or more unpacks the weights (sdsie.kernels.int4_gemm),
# so 33-48 tokens padded to 64 would change paths. Then about 1.5x apart to 256 and every multiple of 256 to 2,048:
# a static cache's length is a multiple of 256 (static_cache_length), so every prompt up to 2,048 has a size that
# fits its cache.
PREFILL_SIZES = (16, 32, 48, 64, 96, 128, 192, *range(256, 2049, 256))


def _prefill_sizes(config: DecodeConfig) -> tuple[int, ...]:
    return PREFILL_SIZES if config.cuda_graphs and config.prefill_graphs else ()


def warm_up_runs(config: DecodeConfig) -> int:
    """Runs of one prompt on a fresh cache before a run of it launches nothing new: 2 with prefill graphs (where a
    cache's layers cannot be set up from the configuration, its first prompt runs eagerly to set them up and the
    second captures its size's graph; elsewhere the first captures and the second replays), else 1."""
    return 2 if _prefill_sizes(config) else 1


def _verify_sizes(config: DecodeConfig, k: int) -> tuple[int, ...]:
    """The target's forward sizes a run repeats: 1 (plain steps) and K + 1, or every 2..K + 1 when the adaptive
    schedule or draft_stop_prob can draft any length up to K."""
    if not k or config.tree_widths is not None:  # a tree cycle is graphed whole, by TreeStep
        return (1,)
    any_length = config.k_schedule == "adaptive" or config.draft_stop_prob is not None
    return (1, *range(2, k + 2)) if any_length else (1, k + 1)


def _scout_pad_sizes(config: DecodeConfig) -> tuple[int, ...]:
    """Padding buys nothing without graphs (an eager forward of n tokens is already one dispatch)."""
    return SCOUT_PAD_SIZES if config.cuda_graphs and config.pad_scout_catchup else ()


def run_attention(config: DecodeConfig, device: torch.device) -> str:
    """The one-token attention a run with `config` on `device` uses: "auto" is "split_kv" for a static cache under
    CUDA graphs on CUDA and "sdpa" otherwise. Under graphs the split kernel's host launch cost is paid once, at
    capture, and its graphed call is 2-13x faster than the packed SDPA call at 256-8,448 cache positions on the H200
    (docs/kernel-log.md, 2026-12-04 later); an ungraphed step pays that launch cost in every layer."""
    if config.attention != "auto":
        return config.attention
    graphed = config.kv_cache == "static" and config.cuda_graphs and device.type == "cuda"
    return "split_kv" if graphed else "sdpa"


def _kv(model: nn.Module, role: str, config: DecodeConfig, max_len: int, graph_sizes: tuple[int, ...],
        pad_sizes: tuple[int, ...] = (), prefill_sizes: tuple[int, ...] = ()) -> Any:
    """The cache config.kv_cache asks for; a static one holds every position this run can write.
    role keeps the target's and the scout's caches apart even when one module plays both."""
    if config.kv_cache == "dynamic":
        return new_cache(model)
    max_len = static_cache_length(max_len)
    attention = run_attention(config, model_device(model))
    key = (role, max_len, config.cuda_graphs, graph_sizes, pad_sizes, prefill_sizes, model_device(model),
           next(model.parameters()).dtype, attention)
    fingerprint = module_fingerprint(model)
    if _FINGERPRINTS.get(model) != fingerprint:
        # modules or storages were swapped since the caches' graphs were captured (e.g. quantize_model in place):
        # replaying them would read freed weights, so every cache of the model, its graphs and tree steps, goes
        _STATIC.pop(model, None)
        _FINGERPRINTS[model] = fingerprint
    caches = _STATIC.setdefault(model, {})
    kv = caches.get(key)
    if kv is None:
        kv = caches[key] = StaticKV(model, max_len, cuda_graphs=config.cuda_graphs, graph_sizes=graph_sizes,
                                    pad_sizes=pad_sizes, attention=attention, prefill_sizes=prefill_sizes)
    else:
        kv.crop(0)
    return kv


def _check_setup(
    target: nn.Module,
    scout: nn.Module | None,
    clutch: EntropyClutch | None,
    gear: Gear | None,
    config: DecodeConfig,
    device: torch.device,
) -> int:
    """Validate the combination of switches; returns K for an engaged (or ungated) speculate cycle."""
    if gear is not None and clutch is None:
        raise ValueError("a gear needs a clutch to drive it: pass clutch=EntropyClutch(...)")
    if gear is not None and not isinstance(getattr(gear, "int4", None), bool):
        raise ValueError(f"gear must have a bool attribute 'int4', got {type(gear).__name__}")
    if config.cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device, the target is on {device}")
    if config.attention == "split_kv" and not kernel_runs_on(device):
        raise ValueError(f"attention='split_kv' runs a Triton kernel: it needs a CUDA device (or TRITON_INTERPRET=1), "
                         f"the target is on {device}")
    if clutch is not None and scout is None and gear is None:
        raise ValueError("a clutch with neither a scout nor a gear would gate nothing; pass scout= and/or gear=")
    if scout is None:
        if config.tree_widths is not None:
            raise ValueError("tree_widths drafts with a scout: pass scout=")
        return 0
    check_vocab(target, scout)
    if model_device(scout) != device:
        raise ValueError(f"scout is on {model_device(scout)} but target is on {device}; put both on one device")
    if config.tree_widths is not None:
        depth = len(config.tree_widths)
        if clutch is not None and clutch.config.k_draft != depth:
            raise ValueError(f"the clutch's k_draft={clutch.config.k_draft} but tree_widths={config.tree_widths} has "
                             f"depth {depth}: give the clutch k_draft={depth}")
        return depth
    if clutch is None:
        return config.k_draft if config.k_draft is not None else DEFAULT_K
    if config.k_draft is not None and config.k_draft != clutch.config.k_draft:
        raise ValueError(
            f"K is ambiguous: DecodeConfig.k_draft={config.k_draft} but clutch.config.k_draft="
            f"{clutch.config.k_draft}; with a clutch, K comes from the clutch"
        )
    return clutch.config.k_draft
