"""The plain loop (the baseline every comparison uses), token selection, and the near-tie measurement."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdsie.decoding import (
    GREEDY,
    DecodeConfig,
    SamplingConfig,
    compare_logits,
    decode_logits,
    generate,
    logits_to_probs,
    make_generator,
    near_tie_report,
    sample,
    select_token,
)
from sdsie.models import tiny_llama

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, seed=0)



def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """transformers' own generate(): an independent implementation of greedy decoding."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else HF masks prompt tokens equal to pad_token_id
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


# ------------------------------------------------------------------------------------------------
# Greedy: equal to HF generate()


@given(prompt=prompts, max_new=st.integers(1, 24))
def test_greedy_equals_hf_generate(prompt: list[int], max_new: int) -> None:
    ours = generate(TARGET, prompt, DecodeConfig(max_new_tokens=max_new))
    assert ours.tokens == hf_greedy(TARGET, prompt, max_new, eos=None)
    assert len(ours.tokens) == max_new and ours.stop_reason == "max_new_tokens"


@given(prompt=prompts, pick=st.integers(0, 15))
def test_greedy_stops_at_eos_like_hf_generate(prompt: list[int], pick: int) -> None:
    free = generate(TARGET, prompt, DecodeConfig(max_new_tokens=16)).tokens
    eos = free[pick]  # a token the free run does produce, so the stop is exercised
    ours = generate(TARGET, prompt, DecodeConfig(max_new_tokens=16, eos_token_id=eos))
    assert ours.tokens == hf_greedy(TARGET, prompt, 16, eos=eos)
    assert ours.tokens == free[: free.index(eos) + 1]
    assert ours.stop_reason == "eos"


def test_eos_set_of_ids_stops_at_the_first_of_them() -> None:
    free = generate(TARGET, [4, 8, 15], DecodeConfig(max_new_tokens=20)).tokens
    eos_ids = (free[9], free[5])
    first = min(free.index(t) for t in eos_ids)
    stopped = generate(TARGET, [4, 8, 15], DecodeConfig(max_new_tokens=20, eos_token_id=eos_ids))
    assert stopped.tokens == free[: first + 1]


def test_batched_1xS_prompt_equals_flat_prompt() -> None:
    flat = generate(TARGET, [3, 1, 4, 1, 5], DecodeConfig(max_new_tokens=8)).tokens
    assert generate(TARGET, torch.tensor([[3, 1, 4, 1, 5]]), DecodeConfig(max_new_tokens=8)).tokens == flat


# ------------------------------------------------------------------------------------------------
# Stats, timing hooks


def test_plain_loop_counts_and_timings() -> None:
    seen = []
    result = generate(TARGET, [9, 2, 6], DecodeConfig(max_new_tokens=12, timing=True), on_cycle=seen.append)
    s = result.stats
    assert s.new_tokens == len(result.tokens) == 12
    assert s.cycles == len(result.cycles) == len(seen) == 11  # the first token comes from the prefill
    assert s.target_forwards == s.cycles + 1
    assert s.scout_forwards == s.drafted == s.speculate_cycles == 0
    assert s.acceptance_rate is None and s.fallback_fraction == 1.0
    assert seen == result.cycles
    assert all(c.k == 0 and c.emitted == 1 and c.engaged is None for c in result.cycles)
    assert len(result.step_seconds) == 11 and all(t > 0 for t in result.step_seconds)
    assert s.prefill_seconds > 0 and math.isclose(s.decode_seconds, sum(result.step_seconds))
    assert s.tokens_per_s == pytest.approx(12 / (s.prefill_seconds + s.decode_seconds))
    assert result.decisions == "F" * 11


def test_cycle_entropy_is_the_entropy_of_the_target_distribution() -> None:
    from sdsie.entropy import entropy

    prompt = [5, 6, 7]
    result = generate(TARGET, prompt, DecodeConfig(max_new_tokens=6))
    with torch.no_grad():
        logits = TARGET(input_ids=torch.tensor([prompt + result.tokens])).logits[0]  # [S, V]
    expected = entropy(logits[len(prompt) - 1 : -1]).tolist()  # rows that produced each new token
    got = [result.prefill_entropy] + [c.entropy for c in result.cycles]
    assert got == pytest.approx(expected, abs=1e-4)


def test_to_dict_is_json_serialisable() -> None:
    import json

    result = generate(TARGET, [1, 2], DecodeConfig(max_new_tokens=3))
    assert json.loads(json.dumps(result.to_dict()))["tokens"] == result.tokens


# ------------------------------------------------------------------------------------------------
# Sampling


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    def run(seed: int) -> list[int]:
        config = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, seed=seed))
        return generate(TARGET, [11, 12], config).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)


def tv_bound(support: int, n: int, delta: float = 1e-6) -> float:
    """With probability >= 1 - delta, TV(empirical of n draws, truth) <= this (E||p^-p||_1 <= sqrt(V/n), plus
    McDiarmid's bounded-difference deviation sqrt(2 ln(1/delta) / n) on the L1 norm; TV = L1 / 2)."""
    return 0.5 * (math.sqrt(support / n) + math.sqrt(2 * math.log(1 / delta) / n))


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten(), minlength=vocab).double() / tokens.numel()


def test_sample_draws_from_the_given_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 40_000
    draws = sample(probs.expand(n, -1), make_generator(SamplingConfig(temperature=1.0, seed=1), torch.device("cpu")))
    tv = 0.5 * (empirical(draws, 6) - probs.double()).abs().sum()
    assert tv < tv_bound(5, n)
    assert (draws != 5).all()  # zero probability is never drawn


def test_sample_accepts_unnormalised_weights() -> None:
    gen = make_generator(SamplingConfig(temperature=1.0, seed=2), torch.device("cpu"))
    n = 20_000
    draws = sample(torch.tensor([3.0, 1.0]).expand(n, -1), gen)
    assert abs(empirical(draws, 2)[0].item() - 0.75) < tv_bound(2, n)


def test_temperature_top_k_top_p() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    cooled = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(cooled, torch.softmax(logits / 0.5, -1))
    top2 = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all()
    torch.testing.assert_close(top2[:2], torch.softmax(logits[:2], -1))
    full = torch.softmax(logits, -1)  # [0.56, 0.21, 0.13, 0.08, 0.03]
    # top_p = 0.7: 0.56 < 0.7, 0.56 + 0.21 >= 0.7 -> keep exactly the first two
    nucleus = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert (nucleus[2:] == 0).all() and (nucleus[:2] > 0).all()
    # top_p smaller than the top token's mass keeps the top token alone
    assert logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.1)).tolist() == [1.0, 0, 0, 0, 0]
    assert full[0] > 0.1


def test_greedy_select_is_argmax_with_first_index_ties() -> None:
    token, probs = select_token(torch.tensor([0.0, 3.0, 3.0, 1.0]), SamplingConfig(), None)
    assert token.item() == 1 and probs is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


# ------------------------------------------------------------------------------------------------
# Launch-ahead: each plain step launched before the previous one is read


def _stopper(after: int):
    """An on_tokens hook that asks to stop once it has been called more than `after` times."""
    calls = []
    return lambda emitted: calls.append(emitted) or len(calls) > after


def _outcome(result) -> tuple:
    return result.tokens, result.stop_reason, result.prefill_entropy, [c.entropy for c in result.cycles], \
        result.stats.cycles


@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), max_new=st.integers(1, 12),
       eos=st.sampled_from([None, 3, 11, 40]), stop_after=st.sampled_from([None, 1, 4]),
       kv_cache=st.sampled_from(["dynamic", "static"]), greedy=st.booleans())
def test_launch_ahead_changes_no_token_entropy_or_cache(prompt, max_new, eos, stop_after, kv_cache, greedy):
    """The same tokens, entropies and stop reason with and without launch-ahead, including runs that EOS or
    on_tokens end while a step is in flight; that step's position is dropped, so the cache holds what it holds
    without launch-ahead (checked by a second run on the reused static cache). The dropped step did run: it is one
    more target forward."""
    sampling = GREEDY if greedy else SamplingConfig(temperature=0.9, seed=5)
    runs = []
    for ahead in (False, True):
        config = DecodeConfig(max_new_tokens=max_new, eos_token_id=eos, kv_cache=kv_cache, sampling=sampling,
                              launch_ahead=ahead)
        stop = None if stop_after is None else _stopper(stop_after)
        first = generate(TARGET, prompt, config, on_tokens=stop)
        again = generate(TARGET, prompt, config)
        runs.append((_outcome(first), _outcome(again), first.stats.target_forwards, again.stats.target_forwards))
    (plain, plain_again, plain_fw, plain_again_fw), (ahead, ahead_again, ahead_fw, ahead_again_fw) = runs
    assert (plain, plain_again) == (ahead, ahead_again)
    for outcome, before, after in ((plain, plain_fw, ahead_fw), (plain_again, plain_again_fw, ahead_again_fw)):
        # a cycle that ends the run (EOS or a stop) before the budget had launched the next step
        dropped = outcome[1] != "max_new_tokens" and outcome[4] > 0 and len(outcome[0]) < max_new
        assert after - before == int(dropped)


def test_launch_ahead_launches_each_step_before_the_previous_read(monkeypatch):
    """Without scout and gear, after the prefill's read the forwards run one step ahead of the reads: forward,
    forward, read, forward, read, ..., read; launch_ahead=False (or a scout) alternates forward and read."""
    import sdsie.decoding.engine as engine

    events: list[str] = []
    real_forward, real_wait = engine.forward, engine.HostRead.wait
    monkeypatch.setattr(engine, "forward", lambda *a, **kw: events.append("F") or real_forward(*a, **kw))
    monkeypatch.setattr(engine.HostRead, "wait", lambda self: events.append("R") or real_wait(self))
    tokens = {}
    for ahead in (True, False):
        events.clear()
        tokens[ahead] = generate(TARGET, [5, 9, 3], DecodeConfig(max_new_tokens=6, launch_ahead=ahead)).tokens
        pattern = "".join(events)
        assert pattern == ("FR" + "FFR" + "FR" * 3 + "R" if ahead else "FR" * 6), (ahead, pattern)
    assert tokens[True] == tokens[False]


# ------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "empty"),
        (torch.zeros(2, 3, dtype=torch.long), "batch"),
        (torch.zeros(1, 2, 3, dtype=torch.long), "shape"),
        ([1, VOCAB], "lie in"),
        ([-1, 3], "lie in"),
    ],
)
def test_bad_prompt(prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(TARGET, prompt, DecodeConfig(max_new_tokens=2))


@pytest.mark.parametrize("kwargs, match", [({"max_new_tokens": 0}, "max_new_tokens"), ({"k_draft": 0}, "K"),
                                           ({"launch_ahead": 1}, "launch_ahead")])
def test_bad_decode_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DecodeConfig(**kwargs)


# ------------------------------------------------------------------------------------------------
# Near-tie measurement (batched verification vs single-token decoding)


def test_decode_logits_match_a_full_forward_for_any_chunk() -> None:
    prompt, cont = [4, 9, 1], [7, 30, 2, 2, 41, 5, 63]
    with torch.no_grad():
        full = TARGET(input_ids=torch.tensor([prompt + cont])).logits[0, len(prompt) : -1]  # predicts cont[1:]
    # fp32, but cached/chunked attention sums in another order than one full pass: allow 1e-5 of the
    # logit scale (observed: ~4e-6 of it).
    atol = 1e-5 * full.abs().max().item()
    for chunk in (1, 3, 6):
        torch.testing.assert_close(decode_logits(TARGET, prompt, cont, chunk), full, rtol=0, atol=atol)


def test_near_tie_report_fp32_has_no_mismatch() -> None:
    prompt = [5, 17, 3]
    cont = generate(TARGET, prompt, DecodeConfig(max_new_tokens=30)).tokens
    report = near_tie_report(TARGET, prompt, cont, k_draft=5)
    assert report.compared == 29 and report.mismatch_count == 0
    assert report.max_abs_logit_diff < 1e-4 and report.min_gap > 0


def test_compare_logits_finds_a_flipped_near_tie_and_its_gap() -> None:
    single = torch.tensor([[1.0, 0.0, 0.5], [2.0, 1.999, 0.0], [0.0, 0.0, 3.0]])
    batched = single.clone()
    batched[1, 1] = 2.001  # flips row 1: the tie was 0.001 wide
    report = compare_logits(single, batched)
    assert report.mismatch_count == 1
    (m,) = report.mismatches
    assert (m.position, m.single_token, m.batched_token) == (1, 0, 1)
    assert m.single_gap == pytest.approx(0.001, abs=1e-6) and m.batched_gap == pytest.approx(0.001, abs=1e-6)
    assert report.max_abs_logit_diff == pytest.approx(0.002, abs=1e-6)


def test_compare_logits_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        compare_logits(torch.zeros(3, 4), torch.zeros(2, 4))
