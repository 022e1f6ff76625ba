"""The static KV cache (and its CUDA-graph replay): the same tokens, cycles and decisions as the dynamic
cache for plain, fixed-K and gated decoding, rollback by the device-side counter, and clear refusals."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.model_io import StaticKV, cache_length, crop_cache, forward
from sdsie.kernels.rmsnorm import fuse_rmsnorm
from sdsie.models import perturbed_copy, tiny_llama
from sdsie.quant.gated import gate_model

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, seed=0)
SCOUT = perturbed_copy(TARGET, noise=0.05, seed=2)  # accepts some drafts and rejects others
MIXED = ClutchConfig(theta_low=1.8, theta_high=2.4, alpha=0.5)  # engages and falls back on this pair


def _run(kv_cache: str, prompt: list[int], max_new: int, k: int | None, clutch: ClutchConfig | None, eos=None,
         schedule: str = "constant", stop: float | None = None):
    cfg = DecodeConfig(max_new_tokens=max_new, kv_cache=kv_cache, eos_token_id=eos,
                       k_draft=None if clutch else k, k_schedule=schedule, draft_stop_prob=stop)
    scout = SCOUT if (k or clutch) else None
    return generate(TARGET, prompt, cfg, scout=scout, clutch=EntropyClutch(clutch) if clutch else None)


@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), max_new=st.integers(1, 24),
       k=st.sampled_from([None, 1, 3, 5, 8]), gated=st.booleans(), eos=st.sampled_from([None, 2, 7]),
       schedule=st.sampled_from(["constant", "adaptive"]), stop=st.sampled_from([None, 0.5]))
def test_static_cache_reproduces_the_dynamic_cache(prompt, max_new, k, gated, eos, schedule, stop):
    clutch = ClutchConfig(MIXED.theta_low, MIXED.theta_high, MIXED.alpha, k_draft=k or 5) if gated else None
    a = _run("dynamic", prompt, max_new, k, clutch, eos, schedule, stop)
    b = _run("static", prompt, max_new, k, clutch, eos, schedule, stop)
    assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
    assert a.decisions == b.decisions
    assert [(c.k, c.accepted) for c in a.cycles] == [(c.k, c.accepted) for c in b.cycles]
    assert a.stats.scout_catchup_tokens == b.stats.scout_catchup_tokens


def test_gated_run_exercises_rollback_and_catch_up():
    """The property above is not vacuous: this pair rejects drafts (rollback) and the clutch falls back
    (the scout then catches up several tokens in one forward)."""
    r = _run("static", [1, 5, 9, 4], 60, None, ClutchConfig(MIXED.theta_low, MIXED.theta_high, MIXED.alpha))
    assert "S" in r.decisions and "F" in r.decisions
    assert r.stats.accepted < r.stats.drafted and r.stats.scout_catchup_tokens > 0


def test_static_kv_rolls_back_and_overwrites_stale_positions():
    ids = torch.tensor([1, 5, 9, 4, 7, 3])
    with torch.inference_mode():
        ref = TARGET(input_ids=ids[None]).logits[0]
        kv = StaticKV(TARGET, max_len=16)
        head = forward(TARGET, ids[:4], kv, last_only=False)
        forward(TARGET, torch.tensor([11, 12, 13]), kv, last_only=False)  # rejected drafts
        assert cache_length(kv) == 7
        crop_cache(kv, 4)
        tail = forward(TARGET, ids[4:], kv, last_only=False)
    assert cache_length(kv) == 6
    torch.testing.assert_close(torch.cat([head, tail]), ref, rtol=1e-5, atol=1e-5)


def test_static_kv_crops_counters_created_under_inference_mode():
    """On CUDA, HF creates a layer's position counter in its first forward, inside the engine's inference_mode;
    the next run crops the reused cache outside it. Updating an inference tensor there must not fail (the
    H200 refused it before the crop ran under inference_mode)."""
    kv = StaticKV(TARGET, max_len=16)
    with torch.inference_mode():
        forward(TARGET, torch.tensor([1, 5, 9, 4]), kv, last_only=False)
        counters = [torch.full((), 4, dtype=torch.long) for _ in kv.cache.layers]  # as CUDA creates them
    for layer, counter in zip(kv.cache.layers, counters, strict=True):
        layer.cumulative_length = counter
    assert all(layer.cumulative_length.is_inference() for layer in kv.cache.layers)
    kv.crop(1)
    assert cache_length(kv) == 1
    assert [int(layer.cumulative_length) for layer in kv.cache.layers] == [1] * len(kv.cache.layers)


def _counter_adds(fn) -> int:
    """In-place adds on 0-d int64 tensors (position counters) while fn runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        adds = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            target = args[0] if args else None
            if (func is torch.ops.aten.add_.Tensor or func is torch.ops.aten.add_.Scalar) and isinstance(
                    target, torch.Tensor) and target.dim() == 0 and target.dtype == torch.long:
                Count.adds += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.adds


def test_static_kv_layers_share_one_counter_advanced_once_per_forward():
    """HF's StaticLayer advances its own counter in each layer's update (one kernel per layer and forward); from
    the cache's construction every layer holds the cache's one counter and a forward advances it once, by its token
    count, the first forward included."""
    assert TARGET.config.num_hidden_layers > 1
    kv = StaticKV(TARGET, max_len=16)
    assert kv.counter is not None and all(layer.cumulative_length is kv.counter for layer in kv.cache.layers)
    with torch.inference_mode():
        assert _counter_adds(lambda: forward(TARGET, torch.tensor([1, 5, 9]), kv, last_only=True)) == 1
        assert _counter_adds(lambda: forward(TARGET, torch.tensor([4, 7]), kv, last_only=True)) == 1
        assert int(kv.counter) == cache_length(kv) == 5
        crop_cache(kv, 4)
        assert int(kv.counter) == 4
        assert _counter_adds(lambda: forward(TARGET, torch.tensor([2]), kv, last_only=True)) == 1
    assert int(kv.counter) == cache_length(kv) == 5


def test_a_cache_builds_its_layers_from_the_configuration_or_else_in_its_first_forward(monkeypatch):
    """The layers are allocated at construction with the configuration's key/value heads and head size; a
    configuration that does not say them (or says separate key and value sizes) leaves them to the first forward,
    after which the cache is consolidated all the same and decodes the same tokens."""
    import types

    import sdsie.decoding.model_io as model_io

    kv = StaticKV(TARGET, max_len=16)
    cfg = TARGET.config
    keys = kv.cache.layers[0].keys
    assert keys.shape == (1, cfg.num_key_value_heads, 16, cfg.hidden_size // cfg.num_attention_heads)
    assert keys.dtype == TARGET.get_input_embeddings().weight.dtype and kv.kv is not None
    bare = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64), get_input_embeddings=None)
    assert not model_io._initialize_layers(kv.cache, bare)  # no head count
    mla = types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=4, hidden_size=64, qk_head_dim=24),
                                get_input_embeddings=None)
    assert not model_io._initialize_layers(kv.cache, mla)  # separate key and value sizes
    monkeypatch.setattr(model_io, "_initialize_layers", lambda cache, model: False)
    lazy = StaticKV(TARGET, max_len=16)
    assert lazy.kv is None and not getattr(lazy.cache.layers[0], "is_initialized", False)
    ids = torch.tensor([1, 5, 9, 4])
    with torch.inference_mode():
        early_logits, lazy_logits = (forward(TARGET, ids, c, last_only=True) for c in (kv, lazy))
    assert lazy.kv is not None and torch.equal(early_logits, lazy_logits)


def test_static_kv_refuses_overflow_and_bad_crops():
    kv = StaticKV(TARGET, max_len=4)
    with torch.inference_mode():
        forward(TARGET, torch.tensor([1, 2, 3]), kv, last_only=True)
        with pytest.raises(ValueError, match="holds 4 positions: cannot add 2 to 3"):
            forward(TARGET, torch.tensor([4, 5]), kv, last_only=True)
    with pytest.raises(RuntimeError, match="cannot crop to 5"):
        crop_cache(kv, 5)
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        StaticKV(TARGET, max_len=0)


def test_cuda_graph_configurations_are_refused_with_their_reason():
    with pytest.raises(ValueError, match="kv_cache must be 'dynamic' or 'static'"):
        DecodeConfig(kv_cache="paged")
    with pytest.raises(ValueError, match="cuda_graphs needs kv_cache='static'"):
        DecodeConfig(cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be a bool, got 'yes'"):
        DecodeConfig(kv_cache="static", cuda_graphs="yes")
    graphs = DecodeConfig(kv_cache="static", cuda_graphs=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
            generate(TARGET, [1, 2], graphs)
        with pytest.raises(ValueError, match="needs the model on a CUDA device"):
            StaticKV(TARGET, 8, cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_decodes_the_same_tokens_as_eager(dtype, monkeypatch):
    """On a GPU: replaying the captured forwards gives the eager static path's tokens, cycles and decisions
    (the same kernels on the same inputs), for plain, fixed-K5 and gated decoding, the latter two also with the
    adaptive draft length (a verify graph per length) and with the scout's confidence ending its drafts
    (draft_stop_prob). The eager run pads the scout's catch-up as the graphed one
    does, so both run the same sizes."""
    import sdsie.decoding.engine as engine

    monkeypatch.setattr(engine, "_scout_pad_sizes", lambda config: engine.SCOUT_PAD_SIZES)
    target, scout = copy.deepcopy(TARGET).to("cuda", dtype), copy.deepcopy(SCOUT).to("cuda", dtype)
    prompt = [1, 5, 9, 4, 7]
    cases = [({}, "constant", None)] + [(kw, schedule, stop) for schedule in ("constant", "adaptive")
                                        for kw in ({"scout": scout}, {"scout": scout, "clutch": MIXED})
                                        for stop in (None, 0.4)]
    for kw, schedule, stop in cases:
        runs = []
        for graphs in (False, True):
            cfg = DecodeConfig(max_new_tokens=48, kv_cache="static", cuda_graphs=graphs, k_schedule=schedule,
                               draft_stop_prob=stop)
            clutch = EntropyClutch(kw["clutch"]) if "clutch" in kw else None
            runs.append(generate(target, prompt, cfg, scout=kw.get("scout"), clutch=clutch))
        eager, replayed = runs
        assert eager.tokens == replayed.tokens and eager.decisions == replayed.decisions
        assert [(c.k, c.accepted) for c in eager.cycles] == [(c.k, c.accepted) for c in replayed.cycles]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_of_tree_cycles_decodes_the_same_tokens_as_eager(dtype, monkeypatch):
    """On a GPU: a tree cycle replayed as one graph (TreeStep: the scout's catch-up folded in, the deeper scout levels,
    the verify, the kept path's compaction, its masks built on the device from the root's position) gives the eager
    static path's tokens and cycles, fixed and gated, and so do the cycle with a separate catch-up and the one with
    the scout's norms fused (Triton kernels captured in the graph); in fp32 both equal plain decoding's tokens."""
    import sdsie.decoding.engine as engine

    monkeypatch.setattr(engine, "_scout_pad_sizes", lambda config: engine.SCOUT_PAD_SIZES)
    target, scout = copy.deepcopy(TARGET).to("cuda", dtype), copy.deepcopy(SCOUT).to("cuda", dtype)
    prompt = [1, 5, 9, 4, 7]
    plain = generate(target, prompt, DecodeConfig(max_new_tokens=48)).tokens
    fused = copy.deepcopy(scout)  # the scout's norms as Triton kernels, inside the same graphs
    fuse_rmsnorm(fused)
    cases = [((3, 2), None, True, scout), ((4, 2, 1), None, True, scout), ((2, 2, 1, 1, 1), None, True, scout),
             ((3, 2), MIXED, True, scout), ((4, 2, 1), None, False, scout),  # False: the catch-up on its own
             ((4, 2, 1), None, True, fused)]
    for widths, clutch, fold, drafter in cases:
        runs = []
        for graphs in (False, True):
            cfg = DecodeConfig(max_new_tokens=48, kv_cache="static", cuda_graphs=graphs, tree_widths=widths,
                               pad_scout_catchup=fold)
            gate = EntropyClutch(dataclasses.replace(clutch, k_draft=len(widths))) if clutch else None
            runs.append(generate(target, prompt, cfg, scout=drafter, clutch=gate))
        eager, replayed = runs
        assert eager.tokens == replayed.tokens and eager.decisions == replayed.decisions, widths
        assert [(c.k, c.accepted) for c in eager.cycles] == [(c.k, c.accepted) for c in replayed.cycles]
        assert replayed.stats.tree_nodes > 0
        if dtype == torch.float32:
            assert replayed.tokens == plain, widths


@pytest.mark.gpu
def test_cuda_graphs_follow_the_gear_precision():
    """With a gear, the target's forward has one graph per precision: replays give the eager static path's
    tokens, decisions and per-cycle precision, and both precisions ran."""
    target = copy.deepcopy(TARGET).to("cuda", torch.bfloat16)
    gear = gate_model(target, "mlp.down_proj")
    runs = []
    for graphs in (False, True):
        cfg = DecodeConfig(max_new_tokens=48, kv_cache="static", cuda_graphs=graphs)
        runs.append(generate(target, [1, 5, 9, 4, 7], cfg, clutch=EntropyClutch(MIXED), gear=gear))
    eager, replayed = runs
    assert eager.tokens == replayed.tokens and eager.decisions == replayed.decisions
    assert [c.gear_int4 for c in eager.cycles] == [c.gear_int4 for c in replayed.cycles]
    assert {c.gear_int4 for c in replayed.cycles} == {True, False}


def test_static_caches_are_reused_across_runs_and_kept_apart_per_role():
    """A later run reuses the model's static cache (emptied), and a module used as both target and scout
    gets two caches: self-speculation on one module still equals plain decoding."""
    import sdsie.decoding.engine as engine

    model = copy.deepcopy(TARGET)
    cfg = DecodeConfig(max_new_tokens=20, kv_cache="static", k_draft=3)
    first = generate(model, [1, 5, 9], cfg, scout=model)
    caches = dict(engine._STATIC[model])
    assert sorted(role for role, *_ in caches) == ["scout", "target"]
    second = generate(model, [1, 5, 9], cfg, scout=model)
    assert engine._STATIC[model] == caches  # the same objects, reused
    plain = generate(model, [1, 5, 9], DecodeConfig(max_new_tokens=20)).tokens
    assert first.tokens == second.tokens == plain
    assert first.stats.accepted == first.stats.drafted  # the scout is the target: every draft accepted


def test_static_forwards_build_their_mask_on_the_device_and_restore_the_attention_setting():
    """Static-cache forwards run HF's sdpa with the mask-skip question (a host sync) removed; the model's
    own setting is back afterwards, and dynamic-cache forwards never see the swap."""
    from sdsie.decoding.model_io import STATIC_SDPA

    model = copy.deepcopy(TARGET)
    seen: list[str] = []
    handle = model.register_forward_pre_hook(lambda mod, args: seen.append(mod.config._attn_implementation))
    try:
        generate(model, [1, 5, 9], DecodeConfig(max_new_tokens=6, kv_cache="static"))
        static_seen, seen[:] = list(seen), []
        generate(model, [1, 5, 9], DecodeConfig(max_new_tokens=6))
    finally:
        handle.remove()
    assert static_seen and set(static_seen) == {STATIC_SDPA}
    assert set(seen) == {"sdpa"} and model.config._attn_implementation == "sdpa"


def test_a_padded_forward_gives_the_real_positions_logits_and_keeps_only_them():
    """A 3-token forward after the prefill runs as 4 (ids padded with token 0 at the end): it returns exactly the
    logits of the 3 real positions of that 4-token forward, the cache keeps 3, and the next forward is bit for bit
    what it is after the same 4-token forward cut back by hand. (Against an unpadded 3-token forward the logits
    differ in floating-point order only: another matmul size.)"""
    ids = torch.tensor([1, 5, 9, 4, 7, 3, 8])
    pad = torch.tensor([0])
    with torch.inference_mode():
        kv = StaticKV(TARGET, max_len=16, graph_sizes=(1,), pad_sizes=(4, 8))  # the scout's sizes in the engine
        by_hand = StaticKV(TARGET, max_len=16)
        forward(TARGET, ids[:2], kv, last_only=False)  # the prefill: never padded
        forward(TARGET, ids[:2], by_hand, last_only=False)
        assert kv._padded_size(3) == 4 and kv._padded_size(5) == 8 and kv._padded_size(9) is None
        mid = forward(TARGET, ids[2:5], kv, last_only=False)  # padded to 4
        want_mid = forward(TARGET, torch.cat([ids[2:5], pad]), by_hand, last_only=False)[:3]
        crop_cache(by_hand, 5)
        assert mid.shape[0] == 3 and cache_length(kv) == 5
        last = forward(TARGET, ids[5:7], kv, last_only=True)  # padded to 4, only the last real position returned
        want_last = forward(TARGET, torch.cat([ids[5:7], pad, pad]), by_hand, last_only=False)[1:2]
        crop_cache(by_hand, 7)
        assert last.shape[0] == 1 and cache_length(kv) == 7
        assert kv._padded_size(1) is None  # a graph size: never padded
        after = forward(TARGET, torch.tensor([2]), kv, last_only=True)
        want_after = forward(TARGET, torch.tensor([2]), by_hand, last_only=True)
    assert torch.equal(mid, want_mid) and torch.equal(last, want_last) and torch.equal(after, want_after)


def test_the_scout_pads_its_catch_up_only_under_graphs_and_when_asked():
    from sdsie.decoding.engine import SCOUT_PAD_SIZES, _scout_pad_sizes

    graphs = DecodeConfig(kv_cache="static", cuda_graphs=True)
    assert _scout_pad_sizes(graphs) == SCOUT_PAD_SIZES
    assert _scout_pad_sizes(DecodeConfig(kv_cache="static", cuda_graphs=True, pad_scout_catchup=False)) == ()
    assert _scout_pad_sizes(DecodeConfig(kv_cache="static")) == ()
    with pytest.raises(ValueError, match="pad_scout_catchup must be a bool, got 'no'"):
        DecodeConfig(pad_scout_catchup="no")


def test_padding_is_skipped_where_it_does_not_fit_and_bad_sizes_are_refused():
    with torch.inference_mode():
        kv = StaticKV(TARGET, max_len=8, pad_sizes=(8,))
        forward(TARGET, torch.tensor([1, 2, 3]), kv, last_only=True)
        assert kv._padded_size(2) is None  # 3 + 8 > 8: run unpadded
        forward(TARGET, torch.tensor([4, 5]), kv, last_only=True)
        assert cache_length(kv) == 5
    for bad in ([1], [0, 4], [2.5]):
        with pytest.raises(ValueError, match="pad_sizes must be integers >= 2"):
            StaticKV(TARGET, max_len=8, pad_sizes=bad)


def test_padded_scout_catch_up_decodes_as_the_dynamic_cache(monkeypatch):
    """The engine pads the scout's catch-up only under CUDA graphs; forced on here (eager, CPU), gated and fixed-K
    decoding keep the dynamic cache's tokens, decisions and accepted counts, and the padded path is taken."""
    import sdsie.decoding.engine as engine

    padded = []
    real = StaticKV._padded_size

    def spy(self, n):
        size = real(self, n)
        padded.append(size)
        return size

    monkeypatch.setattr(engine, "_scout_pad_sizes", lambda config: engine.SCOUT_PAD_SIZES)
    monkeypatch.setattr(StaticKV, "_padded_size", spy)
    for k, clutch in ((3, None), (None, MIXED)):
        a, b = _run("dynamic", [1, 5, 9, 4], 60, k, clutch), _run("static", [1, 5, 9, 4], 60, k, clutch)
        assert a.tokens == b.tokens and a.decisions == b.decisions
        assert [(c.k, c.accepted) for c in a.cycles] == [(c.k, c.accepted) for c in b.cycles]
    assert any(size is not None and size > 2 for size in padded)  # a catch-up of more than 2 tokens was padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_positions_leave_later_logits_bit_identical(dtype):
    """Positions past the counter (rejected drafts, another run's leftovers) must not reach a later forward at all:
    its logits equal a fresh cache's bit for bit, even when the stale keys and values are huge. (Graphed loops that
    share a target cache have flipped a near-tie in 3 of 10 trials on the H200, docs/log.md; on the CPU this holds.)"""
    model = copy.deepcopy(TARGET).to(dtype)
    ids = torch.tensor([1, 5, 9, 4, 7])
    with torch.inference_mode():
        fresh = StaticKV(model, 32)
        forward(model, ids, fresh, last_only=True)
        want = forward(model, torch.tensor([3]), fresh, last_only=True)
        stale = StaticKV(model, 32)
        forward(model, ids, stale, last_only=True)
        forward(model, torch.tensor([11, 12, 13, 14]), stale, last_only=False)  # rejected drafts
        for layer in stale.cache.layers:
            layer.keys[..., 9:, :] = 1e4
            layer.values[..., 9:, :] = -1e4
        crop_cache(stale, 5)
        got = forward(model, torch.tensor([3]), stale, last_only=True)
    assert torch.equal(got, want)


def test_the_adaptive_schedule_sizes_the_targets_verify_forwards_for_every_draft_length():
    import sdsie.decoding.engine as engine

    assert engine._verify_sizes(DecodeConfig(), 5) == (1, 6)
    assert engine._verify_sizes(DecodeConfig(k_schedule="adaptive"), 5) == (1, 2, 3, 4, 5, 6)
    assert engine._verify_sizes(DecodeConfig(k_schedule="adaptive"), 0) == (1,)  # no scout: plain steps only
    assert engine._verify_sizes(DecodeConfig(draft_stop_prob=0.4), 5) == (1, 2, 3, 4, 5, 6)  # stops: any length


def test_a_padded_prefill_gives_the_prompts_last_logits_and_keeps_only_its_positions():
    """A 5-token prompt runs as 8 (ids padded with token 0): it returns that 8-token forward's logits at position 4,
    the cache keeps 5, the next forward is bit for bit what it is after the same forward cut back by hand, and a
    reused cache's prompt gives the same logits again. Against an unpadded prompt the logits differ in
    floating-point order only (another matmul size)."""
    ids = torch.tensor([1, 5, 9, 4, 7])
    with torch.inference_mode():
        kv = StaticKV(TARGET, max_len=32, prefill_sizes=(4, 8, 16))
        by_hand, unpadded = StaticKV(TARGET, max_len=32), StaticKV(TARGET, max_len=32)
        assert (kv._prefill_size(5, True), kv._prefill_size(4, True), kv._prefill_size(17, True)) == (8, 4, None)
        assert kv._prefill_size(5, False) is None  # every position's logits asked for: not a prompt's forward
        first = forward(TARGET, ids, kv, last_only=True)
        want = forward(TARGET, torch.cat([ids, torch.zeros(3, dtype=torch.long)]), by_hand, last_only=False)[4:5]
        crop_cache(by_hand, 5)
        plain = forward(TARGET, ids, unpadded, last_only=True)
        assert first.shape == (1, VOCAB) and cache_length(kv) == 5
        assert kv._prefill_size(1, True) is None  # the cache holds positions: not a prompt
        after = forward(TARGET, torch.tensor([2]), kv, last_only=True)
        want_after = forward(TARGET, torch.tensor([2]), by_hand, last_only=True)
        kv.crop(0)  # a reused cache: its second prompt is padded too
        again = forward(TARGET, ids, kv, last_only=True)
    assert torch.equal(after, want_after) and torch.equal(again, first)
    torch.testing.assert_close(first, want, atol=1e-6, rtol=1e-6)  # the LM head on one row, not on all eight
    torch.testing.assert_close(first, plain, atol=1e-5, rtol=1e-5)


def test_a_prefill_is_padded_only_where_a_size_fits_and_bad_sizes_are_refused():
    with torch.inference_mode():
        kv = StaticKV(TARGET, max_len=6, prefill_sizes=(4, 8))
        assert kv._prefill_size(5, True) is None  # 8 > 6 positions: run unpadded
        forward(TARGET, torch.tensor([1, 2, 3, 4, 5]), kv, last_only=True)
        assert cache_length(kv) == 5
    for bad in ([0], [2.5]):
        with pytest.raises(ValueError, match="prefill_sizes must be integers >= 1"):
            StaticKV(TARGET, max_len=8, prefill_sizes=bad)


def test_a_sliding_window_cache_runs_its_prompts_unpadded():
    """Padding could push a prompt's real positions out of a sliding window: such a cache keeps no prefill sizes."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    model = MistralForCausalLM(cfg).eval()
    assert StaticKV(model, max_len=16, prefill_sizes=(8,)).prefill_sizes == ()
    assert StaticKV(TARGET, max_len=16, prefill_sizes=(8,)).prefill_sizes == (8,)


def test_prefill_sizes_fit_every_prompt_up_to_2048_and_keep_the_int4_paths():
    """Every prompt of up to 2,048 tokens has a prefill size that fits its static cache, and none of the sizes moves
    an INT4 prefill of up to 48 rows (16-row slices) onto the unpacking path (49 rows or more)."""
    from sdsie.decoding.engine import PREFILL_SIZES, _prefill_sizes, static_cache_length
    from sdsie.kernels.int4_gemm import DEQUANT_MIN_M, ROW_SLICE

    for n in range(1, 2049):
        size = next((s for s in PREFILL_SIZES if s >= n), None)
        assert size is not None and size <= static_cache_length(n + 1), n
        if n < DEQUANT_MIN_M:
            assert size < DEQUANT_MIN_M and size % ROW_SLICE == 0, n
    assert _prefill_sizes(DecodeConfig(kv_cache="static", cuda_graphs=True, prefill_graphs=True)) == PREFILL_SIZES
    assert _prefill_sizes(DecodeConfig(kv_cache="static", cuda_graphs=True)) == ()
    with pytest.raises(ValueError, match="prefill_graphs needs cuda_graphs=True"):
        DecodeConfig(kv_cache="static", prefill_graphs=True)
    with pytest.raises(ValueError, match="prefill_graphs must be a bool, got 1"):
        DecodeConfig(prefill_graphs=1)


def test_padded_prefills_decode_as_the_dynamic_cache(monkeypatch):
    """The engine pads prompts only under CUDA graphs; forced on here (eager, CPU), plain, fixed-K and gated decoding
    keep the dynamic cache's tokens, decisions and accepted counts (fixed-K twice: the second run on reused caches),
    and both the target's and the scout's first forwards were padded."""
    import sdsie.decoding.engine as engine

    sizes = []
    real = StaticKV._prefill_size

    def spy(self, n, last_only):
        size = real(self, n, last_only)
        sizes.append((n, size))
        return size

    monkeypatch.setattr(engine, "_prefill_sizes", lambda config: engine.PREFILL_SIZES)
    monkeypatch.setattr(StaticKV, "_prefill_size", spy)
    for k, clutch in ((None, None), (3, None), (None, MIXED), (3, None)):
        a, b = _run("dynamic", [1, 5, 9, 4, 2], 40, k, clutch), _run("static", [1, 5, 9, 4, 2], 40, k, clutch)
        assert a.tokens == b.tokens and a.decisions == b.decisions
        assert [(c.k, c.accepted) for c in a.cycles] == [(c.k, c.accepted) for c in b.cycles]
    assert sizes.count((5, 16)) == 4  # the target's prompts
    assert sizes.count((6, 16)) == 2  # the fixed-K scouts' first forwards: the prompt and the first token


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graphs_decode_as_the_eager_padded_prefill(dtype, monkeypatch):
    """On a GPU: prompts replayed as graphs (prefill_graphs; a cache's first prompt captures, later ones replay)
    give the tokens of the same padded prompts run eagerly, plain and fixed-K, at two prompt lengths; in fp32 both
    equal unpadded decoding's tokens. A gated target's prompt replays the graph of the gear's precision."""
    import sdsie.decoding.engine as engine

    target, scout = copy.deepcopy(TARGET).to("cuda", dtype), copy.deepcopy(SCOUT).to("cuda", dtype)
    plain_cfg = DecodeConfig(max_new_tokens=24, kv_cache="static", cuda_graphs=True)
    graphed_cfg = dataclasses.replace(plain_cfg, prefill_graphs=True)
    for prompt in ([1, 5, 9, 4, 7], list(range(1, 21))):
        for kw in ({}, {"scout": scout}):
            plain = generate(target, prompt, plain_cfg, **kw).tokens
            graphed = [generate(target, prompt, graphed_cfg, **kw).tokens for _ in range(2)]
            with monkeypatch.context() as m:  # the same padding, eagerly
                m.setattr(engine, "_prefill_sizes", lambda config: engine.PREFILL_SIZES)
                eager = generate(target, prompt, DecodeConfig(max_new_tokens=24, kv_cache="static"), **kw).tokens
            assert graphed[0] == graphed[1] == eager, (len(prompt), kw.keys())
            if dtype == torch.float32:
                assert graphed[1] == plain
    caches = engine._STATIC[target].values()
    assert {key[:2] for kv in caches for key in kv._graphs if key[0] == "prefill"} == {("prefill", 16),
                                                                                    ("prefill", 32)}
    gated = copy.deepcopy(TARGET).to("cuda", dtype)
    gear = gate_model(gated, "mlp.down_proj")
    for when in (True, False, True):  # the prompt's precision flips with int4_when_engaged: one graph for each
        kw = {"clutch": EntropyClutch(MIXED), "gear": gear}
        graphed = generate(gated, [1, 5, 9, 4, 7], dataclasses.replace(graphed_cfg, int4_when_engaged=when), **kw)
        with monkeypatch.context() as m:
            m.setattr(engine, "_prefill_sizes", lambda config: engine.PREFILL_SIZES)
            eager = generate(gated, [1, 5, 9, 4, 7], DecodeConfig(max_new_tokens=24, kv_cache="static",
                                                                   int4_when_engaged=when),
                             clutch=EntropyClutch(MIXED), gear=gear)
        assert graphed.tokens == eager.tokens and graphed.decisions == eager.decisions, when


def test_a_gated_prompt_runs_at_the_gears_precision_and_keys_its_graph_by_it(monkeypatch):
    """A graphed prompt replays the precision it was captured at, so the prefill names the gear's precision (the
    graph's variant), as the decode steps do: both precisions' prompts (int4_when_engaged either way) pass theirs."""
    import sdsie.decoding.engine as engine

    seen = []
    real = StaticKV._padded_prefill

    def spy(self, model, ids, size, variant):
        seen.append(variant)
        return real(self, model, ids, size, variant)

    monkeypatch.setattr(engine, "_prefill_sizes", lambda config: engine.PREFILL_SIZES)
    monkeypatch.setattr(StaticKV, "_padded_prefill", spy)
    target = copy.deepcopy(TARGET)
    gear = gate_model(target, "mlp.down_proj")
    gears = []
    for when in (True, False):
        cfg = DecodeConfig(max_new_tokens=8, kv_cache="static", int4_when_engaged=when)
        gears.append(generate(target, [1, 5, 9, 4], cfg, clutch=EntropyClutch(MIXED), gear=gear).prefill_gear_int4)
    assert seen == gears and set(gears) == {True, False}


def test_a_compiled_models_padded_prompt_decodes_as_the_eager_model(monkeypatch):
    """prefill_graphs takes a compiled model (DecodeCompiled, prompt compiled with a dynamic length): the engine's
    checks pass it, and its prompts padded as under graphs (forced on here, CPU) give the eager model's tokens."""
    import sdsie.decoding.engine as engine
    from sdsie.decoding import DecodeCompiled

    cfg = DecodeConfig(max_new_tokens=12, kv_cache="static", cuda_graphs=True, prefill_graphs=True)
    compiled = DecodeCompiled(copy.deepcopy(TARGET), True, backend="eager")
    assert engine._check_setup(compiled, None, None, None, cfg, torch.device("cuda")) == 0
    eager = generate(TARGET, [1, 5, 9, 4, 2], DecodeConfig(max_new_tokens=12, kv_cache="static")).tokens
    monkeypatch.setattr(engine, "_prefill_sizes", lambda config: engine.PREFILL_SIZES)
    padded = [generate(compiled, [1, 5, 9, 4, 2], DecodeConfig(max_new_tokens=12, kv_cache="static")).tokens
              for _ in range(2)]
    assert padded == [eager, eager]
    torch._dynamo.reset()


def test_a_compiled_prompt_compiles_once_across_runs():
    """A static cache's layers exist in their final, consolidated form before its first forward, so the prompt's
    compilation traced in the first run holds for the next: a second run of the prompt compiles nothing (a cache
    consolidated after its first forward cost the prompt a second compilation, minutes at 7-8B sizes)."""
    from sdsie.decoding import DecodeCompiled

    compiles = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(gm)
        return gm.forward

    compiled = DecodeCompiled(copy.deepcopy(TARGET), True, backend=backend)
    cfg = DecodeConfig(max_new_tokens=6, kv_cache="static")
    eager = generate(TARGET, [1, 5, 9, 4, 2], cfg).tokens
    counts = []
    for _ in range(3):
        assert generate(compiled, [1, 5, 9, 4, 2], cfg).tokens == eager
        counts.append(len(compiles))
    assert counts[0] >= 2 and counts == [counts[0]] * 3  # the prompt's and the step's, in the first run only
    torch._dynamo.reset()


@pytest.mark.parametrize("draft", [{"k_draft": 4}, {"tree_widths": (3, 2)}])
def test_a_compiled_prompts_function_verifies_drafts_losslessly(draft):
    """With compile_prefill every forward of more than one token (the prompt, a chain's K + 1 verification, a
    tree's) runs through the prompt's dynamic-length compilation: speculation on such a target keeps greedy
    decoding's tokens, and the verifications do go through it."""
    from sdsie.decoding import DecodeCompiled

    prompt = [1, 5, 9, 4, 2]
    plain = generate(TARGET, prompt, DecodeConfig(max_new_tokens=16, kv_cache="static")).tokens
    compiled = DecodeCompiled(copy.deepcopy(TARGET), True, backend="eager")
    lengths = []
    prefill = compiled._prefill[0]
    compiled._prefill = (lambda input_ids, **kw: lengths.append(input_ids.shape[-1]) or prefill(input_ids=input_ids,
                                                                                                   **kw),)
    result = generate(compiled, prompt, DecodeConfig(max_new_tokens=16, kv_cache="static", **draft), scout=SCOUT)
    assert result.tokens == plain
    assert lengths[0] == len(prompt) and len(lengths) > 1 and all(n > 1 for n in lengths)
    torch._dynamo.reset()


def test_warm_up_runs_are_two_only_where_prompts_replay_graphs():
    """With prefill_graphs, two: a cache whose layers its configuration cannot set up runs its first prompt
    eagerly and captures on the second; elsewhere the first captures and the second replays."""
    from sdsie.decoding import warm_up_runs

    assert warm_up_runs(DecodeConfig(kv_cache="static", cuda_graphs=True, prefill_graphs=True)) == 2
    assert warm_up_runs(DecodeConfig(kv_cache="static", cuda_graphs=True)) == 1
    assert warm_up_runs(DecodeConfig()) == 1
