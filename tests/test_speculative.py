"""Fixed-K speculative decoding: lossless (greedy token-identical, sampling identical in distribution),
honest counters, exact EOS and budget handling, clear errors."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sdsie.decoding.engine as engine
from sdsie.decoding import (
    DecodeConfig,
    SamplingConfig,
    generate,
    greedy_verify,
    logits_to_probs,
    make_generator,
    rejection_verify,
    sample,
)
from sdsie.models import perturbed_copy, tiny_llama

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, seed=0)
SCOUTS = {
    "random": tiny_llama(vocab_size=VOCAB, seed=1),  # unrelated weights: almost nothing accepted
    "self": copy.deepcopy(TARGET),  # the target's own weights: everything accepted
    "perturbed": perturbed_copy(TARGET, noise=0.02, seed=1),  # mixed
}



@contextmanager
def count_forwards(*models: torch.nn.Module) -> Iterator[list[int]]:
    """Counts top-level forward calls per model, independently of the engine's own counters."""
    counts = [0] * len(models)
    handles = []
    for i, model in enumerate(models):

        def hook(*_: object, i: int = i) -> None:
            counts[i] += 1

        handles.append(model.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def plain(prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    return generate(TARGET, prompt, DecodeConfig(max_new_tokens=max_new, eos_token_id=eos)).tokens


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)


# ------------------------------------------------------------------------------------------------
# Greedy: token-identical to the plain loop, for any K and length, with all three scouts


@pytest.mark.parametrize("scout_name", list(SCOUTS))
@given(prompt=prompts, k=st.integers(1, 8), max_new=st.integers(1, 20))
def test_greedy_speculation_equals_plain_loop(scout_name: str, prompt: list[int], k: int, max_new: int) -> None:
    scout = SCOUTS[scout_name]
    with count_forwards(TARGET, scout) as counts:
        result = generate(TARGET, prompt, DecodeConfig(max_new_tokens=max_new, k_draft=k), scout=scout)
    assert result.tokens == plain(prompt, max_new)
    s = result.stats
    assert s.new_tokens == len(result.tokens) == max_new
    assert counts == [s.target_forwards, s.scout_forwards]
    assert s.target_forwards == s.cycles + 1
    assert s.scout_forwards == s.drafted == sum(c.k for c in result.cycles)
    produced = 1  # the prefill's token
    for c in result.cycles:  # K drafts per cycle, fewer only where the budget has no room for them
        assert c.k == min(k, max_new - produced - 1)
        produced += c.emitted
    if scout_name == "self":
        assert s.accepted == s.drafted


@pytest.mark.parametrize("k", range(1, 9))
def test_self_scout_accepts_everything(k: int) -> None:
    cycles = 3
    config = DecodeConfig(max_new_tokens=1 + cycles * (k + 1), k_draft=k)
    s = generate(TARGET, [3, 14, 15], config, scout=SCOUTS["self"]).stats
    assert s.acceptance_rate == 1.0
    assert s.cycles == s.speculate_cycles == cycles and s.mean_accepted_length == k
    assert s.target_forwards == cycles + 1  # versus 1 + cycles * (k + 1) for the plain loop


def test_acceptance_spans_nothing_mixed_everything() -> None:
    config = DecodeConfig(max_new_tokens=60, k_draft=4)
    rate = {n: generate(TARGET, [7, 1, 22], config, scout=s).stats.acceptance_rate for n, s in SCOUTS.items()}
    assert rate["self"] == 1.0
    assert rate["random"] < 0.1
    assert 0.2 < rate["perturbed"] < 0.8


def test_default_k_is_5() -> None:
    result = generate(TARGET, [1, 2, 3], DecodeConfig(max_new_tokens=20), scout=SCOUTS["perturbed"])
    assert max(c.k for c in result.cycles) == 5


def test_scout_catches_up_in_its_first_draft_forward() -> None:
    prompt = [9, 8, 7, 6]
    result = generate(TARGET, prompt, DecodeConfig(max_new_tokens=13, k_draft=3), scout=SCOUTS["random"])
    # First cycle: the scout reads the prompt (4 tokens) and `last` in one forward: 4 catch-up tokens. Later
    # cycles: its cache lags only when everything was accepted, and a random scout is almost always rejected.
    assert result.stats.scout_catchup_tokens >= len(prompt)
    assert result.stats.scout_forwards == result.stats.drafted


# ------------------------------------------------------------------------------------------------
# EOS and the token budget


def test_eos_inside_an_accepted_draft_stops_exactly_there() -> None:
    prompt, k = [2, 7, 18], 5
    free = plain(prompt, 40)
    # Token j = 3 is the third draft of the first cycle (token 0 comes from the prefill).
    j = next(j for j in range(1, 6) if free[j] not in free[:j])
    result = generate(
        TARGET, prompt, DecodeConfig(max_new_tokens=40, k_draft=k, eos_token_id=free[j]), scout=SCOUTS["self"]
    )
    assert result.tokens == free[: j + 1]
    assert result.stop_reason == "eos"
    (cycle,) = result.cycles
    assert cycle.accepted == k and cycle.emitted == j  # accepted past EOS, emitted up to it


@given(prompt=prompts, k=st.integers(1, 8), max_new=st.integers(1, 12), pick=st.integers(0, 11))
def test_eos_anywhere_matches_plain(prompt: list[int], k: int, max_new: int, pick: int) -> None:
    eos = plain(prompt, 12)[pick]
    result = generate(
        TARGET, prompt, DecodeConfig(max_new_tokens=max_new, k_draft=k, eos_token_id=eos), scout=SCOUTS["perturbed"]
    )
    assert result.tokens == plain(prompt, max_new, eos)
    assert len(result.tokens) <= max_new


# ------------------------------------------------------------------------------------------------
# The verification step functions


def test_greedy_verify_counts_the_matching_prefix_and_takes_the_next_row() -> None:
    logits = torch.full((4, 6), -1.0)  # [K+1, V], K = 3
    for row, token in enumerate([2, 5, 1, 4]):
        logits[row, token] = 1.0
    cases = {(2, 5, 1): (3, 4), (2, 5, 0): (2, 1), (3, 5, 1): (0, 2), (2, 0, 1): (1, 5)}
    for drafts, expected in cases.items():
        n, nxt = greedy_verify(logits, torch.tensor(drafts))
        assert (n.item(), nxt.item()) == expected


def test_verify_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="K\\+1"):
        greedy_verify(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="q has shape"):
        rejection_verify(torch.rand(3, 5), torch.rand(2, 4), torch.zeros(2, dtype=torch.long), torch.Generator())


def tv_bound(support: int, n: int, delta: float = 1e-6) -> float:
    """With probability >= 1 - delta, TV(empirical of n i.i.d. draws, truth) <= this bound:
    E||p^ - p||_1 <= sum_i sqrt(p_i / n) <= sqrt(support / n), and by McDiarmid (one draw moves the L1
    norm by <= 2/n) it exceeds its mean by more than sqrt(2 ln(1/delta) / n) with probability <= delta."""
    return 0.5 * (math.sqrt(support / n) + math.sqrt(2 * math.log(1 / delta) / n))


def tv(tokens: torch.Tensor, truth: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=truth.numel()).double()
    return 0.5 * (counts / counts.sum() - truth.double()).abs().sum().item()


# Target p (K+1 = 3 rows) and scout q (K = 2 rows) on V = 8, far apart on purpose: q puts mass where p has
# none (those drafts must always be rejected) and p has mass q never drafts (only the residual reaches it).
P = torch.tensor(
    [
        [0.40, 0.20, 0.15, 0.10, 0.10, 0.05, 0.00, 0.00],
        [0.05, 0.05, 0.10, 0.10, 0.20, 0.50, 0.00, 0.00],
        [0.125] * 8,
    ]
)
Q = torch.tensor(
    [
        [0.05, 0.05, 0.10, 0.10, 0.20, 0.00, 0.30, 0.20],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10, 0.00, 0.00],
    ]
)
N_STEP = 40_000


def draw_step(verifier, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """N independent verification steps; returns the first two emitted tokens (second: -1 when only one)."""
    gen = make_generator(SamplingConfig(temperature=1.0, seed=seed), torch.device("cpu"))
    drafts = sample(Q.expand(N_STEP, -1, -1), gen)  # [N, K]
    n, nxt = verifier(P.expand(N_STEP, -1, -1), Q.expand(N_STEP, -1, -1), drafts, gen)  # [N], [N]
    first = torch.where(n >= 1, drafts[:, 0], nxt)
    second = torch.where(n >= 2, drafts[:, 1], torch.where(n == 1, nxt, torch.full_like(nxt, -1)))
    return first, second


def always_accept(p, q, drafts, gen):
    """Negative control: a verifier that keeps every draft (then draws the bonus token from p)."""
    k = drafts.shape[-1]
    return torch.full(drafts.shape[:-1], k), sample(p[..., k, :], gen)


def test_rejection_step_emits_the_target_distribution() -> None:
    first, second = draw_step(rejection_verify)
    assert tv(first, P[0]) < tv_bound(6, N_STEP)  # P[0] has 6 nonzero entries
    reached = second[second >= 0]  # the second token exists when d1 was accepted; it must follow P[1]
    assert reached.numel() > 5_000
    assert tv(reached, P[1]) < tv_bound(6, reached.numel())
    # P(accept d1) = sum min(p, q) = 1 - TV(p, q)
    rate = (second >= 0).double().mean().item()
    expected_rate = torch.minimum(P[0], Q[0]).sum().item()
    assert abs(rate - expected_rate) < math.sqrt(math.log(2 / 1e-6) / (2 * N_STEP))  # Hoeffding


def test_always_accept_negative_control_fails_the_same_check() -> None:
    first, _ = draw_step(always_accept)
    assert tv(first, P[0]) > tv_bound(6, N_STEP)


def test_rejection_step_is_seeded() -> None:
    a, b, c = draw_step(rejection_verify, 3), draw_step(rejection_verify, 3), draw_step(rejection_verify, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_identical_scout_is_always_accepted_under_sampling() -> None:
    gen = make_generator(SamplingConfig(temperature=1.0, seed=0), torch.device("cpu"))
    drafts = sample(P[:2].expand(1000, -1, -1), gen)
    n, _ = rejection_verify(P.expand(1000, -1, -1), P[:2].expand(1000, -1, -1), drafts, gen)
    assert (n == 2).all()


# ------------------------------------------------------------------------------------------------
# Sampling end to end: the joint law of the first three generated tokens is the target's


SMALL = tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=5)
SMALL_SCOUT = perturbed_copy(SMALL, noise=0.1, seed=2)
TOP3 = SamplingConfig(temperature=1.0, top_k=3, seed=None)
E2E_PROMPT = [12, 40, 3]
N_E2E = 300


def exact_first_three(model: torch.nn.Module, prompt: list[int], config: SamplingConfig) -> dict[tuple, float]:
    """P(t1, t2, t3) under plain sampling, enumerated over the top-k support with teacher forcing."""
    with torch.no_grad():
        p1 = logits_to_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], config)
        law = {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = logits_to_probs(model(input_ids=torch.tensor([prompt + [t1]])).logits[0, -1], config)
            pairs = [[t1, t2] for t2 in p2.nonzero().flatten().tolist()]
            p3 = logits_to_probs(model(input_ids=torch.tensor([prompt + pair for pair in pairs])).logits[:, -1], config)
            for pair, row in zip(pairs, p3, strict=True):
                for t3 in row.nonzero().flatten().tolist():
                    law[(*pair, t3)] = (p1[t1] * p2[pair[1]] * row[t3]).item()
    return law


def e2e_tv(law: dict[tuple, float]) -> float:
    # t1 from the prefill; t2 from a K = 1 cycle (the draft or the residual draw); t3 the bonus token after an
    # acceptance, else a plain step.
    config = DecodeConfig(max_new_tokens=3, k_draft=1, sampling=TOP3)
    counts: dict[tuple, int] = {}
    for _ in range(N_E2E):
        key = tuple(generate(SMALL, E2E_PROMPT, config, scout=SMALL_SCOUT).tokens[:3])
        counts[key] = counts.get(key, 0) + 1
    support = set(law) | set(counts)
    return 0.5 * sum(abs(counts.get(x, 0) / N_E2E - law.get(x, 0.0)) for x in support)


def test_speculative_sampling_matches_the_target_law_end_to_end() -> None:
    law = exact_first_three(SMALL, E2E_PROMPT, TOP3)
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-5) and len(law) == 27
    torch.manual_seed(0)  # seed=None draws the generator's seed from torch's global RNG
    assert e2e_tv(law) < tv_bound(27, N_E2E, delta=1e-3)


def test_end_to_end_negative_control_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    law = exact_first_three(SMALL, E2E_PROMPT, TOP3)
    monkeypatch.setattr(engine, "rejection_verify", always_accept)
    torch.manual_seed(0)
    assert e2e_tv(law) > tv_bound(27, N_E2E, delta=1e-3)


def test_seeded_speculative_sampling_is_reproducible() -> None:
    def run(seed: int) -> list[int]:
        config = DecodeConfig(max_new_tokens=24, k_draft=3, sampling=SamplingConfig(temperature=1.0, seed=seed))
        return generate(TARGET, [5, 5, 5], config, scout=SCOUTS["perturbed"]).tokens

    assert run(11) == run(11)
    assert run(11) != run(12)


# ------------------------------------------------------------------------------------------------
# Bad input


def test_k_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="K"):
        generate(TARGET, [1, 2], DecodeConfig(max_new_tokens=4, k_draft=0), scout=SCOUTS["perturbed"])


def test_vocabulary_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary mismatch.*64.*48"):
        generate(TARGET, [1, 2], DecodeConfig(max_new_tokens=4), scout=tiny_llama(vocab_size=48))


@pytest.mark.parametrize("prompt, match", [([], "empty"), (torch.ones(3, 4, dtype=torch.long), "batch")])
def test_bad_prompt_is_refused_with_a_scout(prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(TARGET, prompt, DecodeConfig(max_new_tokens=4), scout=SCOUTS["perturbed"])


# ------------------------------------------------------------------------------------------------
# The adaptive draft-length schedule (DecodeConfig.k_schedule="adaptive")


def test_next_draft_length_grows_by_two_on_full_acceptance_and_shrinks_by_one_otherwise() -> None:
    assert engine.next_draft_length(3, 3, 3, 5) == 5
    assert engine.next_draft_length(4, 4, 4, 5) == 5  # capped at K
    assert engine.next_draft_length(5, 5, 4, 5) == 4
    assert engine.next_draft_length(1, 1, 0, 5) == 1  # never below 1
    assert engine.next_draft_length(4, 2, 2, 5) == 5  # a budget-cut cycle whose drafts were all kept
    with pytest.raises(ValueError, match="draft lengths out of range"):
        engine.next_draft_length(6, 6, 6, 5)
    with pytest.raises(ValueError, match="draft lengths out of range"):
        engine.next_draft_length(2, 2, 3, 5)


def test_an_unknown_k_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match=r"k_schedule must be one of \('constant', 'adaptive'\), got 'hf'"):
        DecodeConfig(k_schedule="hf")


@pytest.mark.parametrize("scout_name", list(SCOUTS))
@given(prompt=prompts, k=st.integers(1, 8), max_new=st.integers(1, 20))
def test_adaptive_speculation_equals_plain_loop_and_follows_its_schedule(
    scout_name: str, prompt: list[int], k: int, max_new: int
) -> None:
    scout = SCOUTS[scout_name]
    config = DecodeConfig(max_new_tokens=max_new, k_draft=k, k_schedule="adaptive")
    with count_forwards(TARGET, scout) as counts:
        result = generate(TARGET, prompt, config, scout=scout)
    assert result.tokens == plain(prompt, max_new)
    assert counts == [result.stats.target_forwards, result.stats.scout_forwards]
    expected, produced = k, 1
    for c in result.cycles:  # each cycle drafts the schedule's length, cut only by the budget
        assert c.k == min(expected, max_new - produced - 1)
        if c.k:
            expected = engine.next_draft_length(expected, c.k, c.accepted, k)
        produced += c.emitted


def test_adaptive_schedule_stays_at_k_when_everything_is_kept_and_falls_to_one_when_nothing_is() -> None:
    config = DecodeConfig(max_new_tokens=40, k_draft=5, k_schedule="adaptive")
    kept = generate(TARGET, [3, 14, 15], config, scout=SCOUTS["self"])
    assert {c.k for c in kept.cycles[:-1]} == {5}  # the last cycle may be cut by the budget
    rejected = generate(TARGET, [3, 14, 15], config, scout=SCOUTS["random"])
    ks = [c.k for c in rejected.cycles]
    assert ks[:5] == [5, 4, 3, 2, 1] and max(ks[5:]) <= 3  # one kept draft at k = 1 lifts it to 3 at most
    constant = generate(TARGET, [3, 14, 15], DecodeConfig(max_new_tokens=40, k_draft=5), scout=SCOUTS["random"])
    assert constant.stats.drafted > rejected.stats.drafted  # the schedule drafts less where drafts are rejected


# ------------------------------------------------------------------------------------------------
# The scout's confidence ends its drafting (DecodeConfig.draft_stop_prob)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, True, "0.4", float("nan")])
def test_a_draft_stop_prob_outside_zero_to_one_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="draft_stop_prob must be a probability in"):
        DecodeConfig(draft_stop_prob=bad)  # type: ignore[arg-type]


def test_draft_prob_reads_the_drafts_probability_greedy_and_sampled() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0])
    assert engine._draft_prob(logits, torch.tensor(1), None) == pytest.approx(torch.softmax(logits, 0)[1].item())
    q = torch.tensor([0.1, 0.2, 0.7])  # sampling: the warped distribution the draft was sampled from
    assert engine._draft_prob(logits, torch.tensor(2), q) == pytest.approx(0.7)


@contextmanager
def logged_draft_probs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Every probability _draft_prob hands the stop rule, in order."""
    seen: list[float] = []
    real = engine._draft_prob

    def spy(*args: object) -> float:
        p = real(*args)  # type: ignore[arg-type]
        seen.append(p)
        return p

    monkeypatch.setattr(engine, "_draft_prob", spy)
    yield seen


@pytest.mark.parametrize("scout_name", list(SCOUTS))
@given(prompt=prompts, k=st.integers(1, 6), max_new=st.integers(1, 20),
       stop=st.sampled_from([0.05, 0.3, 0.6, 0.95, 1.0]), schedule=st.sampled_from(["constant", "adaptive"]))
def test_confidence_stopped_speculation_equals_plain_loop_and_stops_where_the_scout_doubts(
    scout_name: str, prompt: list[int], k: int, max_new: int, stop: float, schedule: str
) -> None:
    """Lossless for any threshold and schedule; each speculate cycle drafts the schedule's length unless a draft
    before the last fell below the threshold, and then stops right after that draft (HF's ConfidenceCriteria)."""
    scout = SCOUTS[scout_name]
    config = DecodeConfig(max_new_tokens=max_new, k_draft=k, k_schedule=schedule, draft_stop_prob=stop)
    with pytest.MonkeyPatch.context() as m, logged_draft_probs(m) as seen, count_forwards(TARGET, scout) as counts:
        result = generate(TARGET, prompt, config, scout=scout)
    assert result.tokens == plain(prompt, max_new)
    assert counts == [result.stats.target_forwards, result.stats.scout_forwards]
    expected, produced, read, stops = k, 1, 0, 0
    for c in result.cycles:
        asked = min(expected, max_new - produced - 1)
        if asked:
            probs = seen[read : read + min(c.k, asked - 1)]  # the rule reads every draft but a cycle's last
            read += len(probs)
            assert all(p >= stop for p in probs[: c.k - 1])
            if c.k < asked:
                assert probs[-1] < stop
                stops += 1
            else:
                assert c.k == asked
            if schedule == "adaptive":
                expected = engine.next_draft_length(expected, c.k, c.accepted, k)
        produced += c.emitted
    assert read == len(seen) and stops == result.stats.draft_stops


def test_a_threshold_of_one_drafts_one_token_a_cycle_and_drafts_less_than_without_it() -> None:
    """No draft reaches probability 1 with these scouts, so every speculate cycle stops after its first draft;
    with the target's own weights as the scout everything is still kept."""
    base = DecodeConfig(max_new_tokens=30, k_draft=5)
    for name in ("self", "perturbed"):
        stopped = generate(TARGET, [3, 14, 15], DecodeConfig(max_new_tokens=30, k_draft=5, draft_stop_prob=1.0),
                           scout=SCOUTS[name])
        assert {c.k for c in stopped.cycles if c.speculated} == {1}
        full = generate(TARGET, [3, 14, 15], base, scout=SCOUTS[name])
        assert stopped.tokens == full.tokens and stopped.stats.drafted < full.stats.drafted
        # every speculate cycle stopped early, but a last one the budget had already cut to one draft
        spec = stopped.stats.speculate_cycles
        assert spec > 0 and stopped.stats.draft_stops in (spec, spec - 1)
