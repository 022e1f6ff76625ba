"""Tree speculation: the tree's layout, tree attention against plain causal forwards, greedy tree verification, the
kept path's cache compaction, and the engine's tree cycles (lossless, honest counters, clear errors)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, SamplingConfig, generate
from sdsie.decoding.model_io import StaticKV, compact_cache, forward, new_cache
from sdsie.decoding.tree import TreeLayout, check_widths, greedy_tree_verify, tree_forward, tree_mask
from sdsie.models import perturbed_copy, tiny_llama

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, seed=0)
SCOUTS = {
    "random": tiny_llama(vocab_size=VOCAB, seed=1),
    "self": copy.deepcopy(TARGET),
    "perturbed": perturbed_copy(TARGET, noise=0.02, seed=1),
}
PROMPT = [3, 17, 5, 42, 8, 11]


def test_layout_numbers_nodes_breadth_first_grouped_by_parent():
    t = TreeLayout((2, 3))
    assert t.level_sizes == (2, 6) and t.nodes == 8 and t.max_depth == 2
    assert t.parent == (0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert t.depth == (0, 1, 1, 2, 2, 2, 2, 2, 2)
    assert t.level(1) == slice(1, 3) and t.level(2) == slice(3, 9)
    vis = t.visible()
    assert vis[7].nonzero().flatten().tolist() == [0, 2, 7]  # node 7: root, its parent 2, itself
    assert vis[0].nonzero().flatten().tolist() == [0]
    chain = TreeLayout((1, 1, 1))
    assert chain.parent == (0, 0, 1, 2) and chain.visible().equal(torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("bad", [(), (2, 0), [2, 2], (2, True), (64, 64)])
def test_bad_widths_are_refused_with_the_reason(bad):
    with pytest.raises(ValueError, match="tree widths"):
        check_widths(bad)


def _path_logits(model, prefix: list[int], path: list[int]) -> torch.Tensor:
    """Logits of a plain causal forward over prefix + path, at the path's positions (the root is prefix[-1])."""
    ids = torch.tensor([prefix + path])
    return model(input_ids=ids, use_cache=False).logits[0, len(prefix) - 1 :]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_tree_forward_gives_each_node_the_logits_of_its_own_root_path(kind, attention):
    """Every node's logits equal a causal forward over the prefix and the node's ancestors: the tree mask shows a
    node its ancestors only, at the position ids of their depths, whatever its slot in the cache (the eager attention
    takes it additive, sdpa boolean)."""
    model = copy.deepcopy(TARGET)
    model.config._attn_implementation = attention
    layout = TreeLayout((3, 2))
    tree = layout.to("cpu")
    prefix = PROMPT[:-1]
    drafts = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[: layout.nodes]  # [N]
    tokens = torch.tensor([PROMPT[-1], *drafts])  # [1 + N]: the root, then the nodes
    with torch.inference_mode():
        cache = new_cache(model) if kind == "dynamic" else StaticKV(model, 32)
        forward(model, torch.tensor(prefix), cache, last_only=True)
        base = len(prefix)
        start = torch.tensor(base)
        logits = tree_forward(model, cache, tokens, start, tree.visible, tree.depth + start)
        for node in range(1 + layout.nodes):
            path = [int(tokens[j]) for j in tree.visible[node].nonzero().flatten()]  # root first, breadth first
            want = _path_logits(model, prefix, path)[-1]
            torch.testing.assert_close(logits[node], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("width", "start"), [(12, 3), (12, 0), (9, 5), (20, 11)])
def test_the_tree_mask_shows_the_prefix_then_the_visible_block_and_nothing_after(width, start):
    visible = torch.rand(4, 4, generator=torch.Generator().manual_seed(start)) > 0.5  # [S, L]
    mask = tree_mask(width, torch.tensor(start), visible)[0, 0]  # [S, width]
    want = torch.zeros(4, width, dtype=torch.bool)
    want[:, :start] = True
    want[:, start : start + 4] = visible[:, : width - start]
    assert mask.shape == (4, width) and mask.equal(want)


def test_tree_forward_refuses_mismatched_shapes_with_the_reason():
    tree = TreeLayout((2,)).to("cpu")
    with torch.inference_mode(), pytest.raises(ValueError, match=r"3 tokens need visible \[3, L\] bool"):
        tree_forward(TARGET, new_cache(TARGET), torch.tensor([1, 2, 3]), torch.tensor(0), tree.visible[:2],
                     tree.depth)


def test_greedy_tree_verify_keeps_the_path_of_the_targets_argmax():
    tree = TreeLayout((2, 2)).to("cpu")  # nodes: 1, 2 (depth 1); 3, 4 under 1; 5, 6 under 2
    greedy = torch.tensor([9, 7, 8, 5, 1, 2, 3])  # the target's argmax at each node
    tokens = torch.tensor([0, 4, 9, 6, 6, 8, 0])  # root; node 2 holds 9 = argmax at root; node 5 holds 8 = at 2
    v = greedy_tree_verify(greedy, tokens, tree)
    assert int(v.accepted) == 2 and v.path.tolist() == [2, 5] and int(v.next_token) == greedy[5]
    tokens[5] = 1  # depth 2 fails: only node 2 is kept, the bonus is the argmax at 2
    v = greedy_tree_verify(greedy, tokens, tree)
    assert int(v.accepted) == 1 and v.path.tolist() == [2, 0] and int(v.next_token) == 8
    tokens[2] = 1  # nothing kept: the bonus is the argmax at the root
    v = greedy_tree_verify(greedy, tokens, tree)
    assert int(v.accepted) == 0 and v.path.tolist() == [0, 0] and int(v.next_token) == 9
    tokens[:] = torch.tensor([0, 4, 4, 7, 7, 8, 8])  # a node whose token matches under a rejected parent is not kept
    assert int(greedy_tree_verify(greedy, tokens, tree).accepted) == 0


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_compaction_moves_the_path_and_leaves_the_prefix(kind):
    with torch.inference_mode():
        cache = new_cache(TARGET) if kind == "dynamic" else StaticKV(TARGET, 16)
        forward(TARGET, torch.tensor(PROMPT + [1, 2, 3, 4]), cache, last_only=True)
        layers = cache.cache.layers if kind == "static" else cache.layers
        before = [layer.keys.clone() for layer in layers]
        compact_cache(cache, torch.tensor([7, 9]), torch.tensor([6, 7]))  # overlapping: 7 is read before written
        for old, layer in zip(before, layers, strict=True):
            assert layer.keys[:, :, 6].equal(old[:, :, 7]) and layer.keys[:, :, 7].equal(old[:, :, 9])
            assert layer.keys[:, :, :6].equal(old[:, :, :6])
        with pytest.raises(ValueError, match="one shape"):
            compact_cache(cache, torch.tensor([1, 2]), torch.tensor([1]))
    if kind == "static":  # one tensor behind every layer, so the move above was one index_select and one index_copy
        assert cache.kv is not None and cache.kv.shape[:2] == (len(layers), 2)
        assert all(layer.keys.data_ptr() == cache.kv[i, 0].data_ptr() for i, layer in enumerate(layers))


def test_a_static_cache_consolidated_after_its_prefill_decodes_as_one_that_is_not(monkeypatch):
    """StaticKV puts its layers' keys and values into one tensor after the first forward; a tree run on it equals one
    on per-layer tensors, token for token and cycle for cycle (the compaction is the same move)."""
    runs = []
    for consolidate in (True, False):
        if not consolidate:
            monkeypatch.setattr(StaticKV, "_consolidate", lambda self: None)
        model = copy.deepcopy(TARGET)  # a cache of its own (static caches are kept per model)
        cfg = DecodeConfig(max_new_tokens=30, tree_widths=(3, 2, 2), kv_cache="static")
        runs.append(generate(model, PROMPT, cfg, scout=SCOUTS["perturbed"]))
    assert runs[0].tokens == runs[1].tokens == plain(30)
    assert [(c.k, c.accepted) for c in runs[0].cycles] == [(c.k, c.accepted) for c in runs[1].cycles]
    assert sum(c.accepted for c in runs[0].cycles) > 0  # paths were moved


def plain(max_new: int, eos: int | None = None) -> list[int]:
    return generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=max_new, eos_token_id=eos)).tokens


@pytest.mark.parametrize("scout", sorted(SCOUTS))
@pytest.mark.parametrize("widths", [(1,), (3,), (2, 2), (4, 2, 1), (1, 1, 1, 1), (6, 4, 4)])  # (6, 4, 4): 127 nodes
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_tree_speculation_emits_the_plain_greedy_tokens(scout, widths, kind):
    cfg = DecodeConfig(max_new_tokens=23, tree_widths=widths, kv_cache=kind)
    r = generate(TARGET, PROMPT, cfg, scout=SCOUTS[scout])
    assert r.tokens == plain(23)
    s = r.stats
    assert s.new_tokens == 23 and sum(c.emitted for c in r.cycles) == 22
    assert all(c.emitted == c.accepted + 1 and 0 <= c.accepted <= c.k <= len(widths) for c in r.cycles)
    assert s.tree_nodes == sum(TreeLayout(widths[: c.k]).nodes for c in r.cycles if c.k)
    assert s.target_forwards == 1 + len(r.cycles)
    if scout == "self":  # the target drafting for itself: every depth kept (but where the budget cuts the tree)
        assert all(c.accepted == c.k for c in r.cycles)


@pytest.mark.cpu_kernels
def test_tree_speculation_over_a_static_cache_with_split_kv_attention_emits_the_plain_greedy_tokens():
    """Under attention="split_kv" (the default for a graphed static cache on CUDA; here the kernel under the
    interpreter) the tree's multi-token forwards keep their boolean tree mask and go to sdpa; the catch-up and
    one-token steps take the kernel."""
    cfg = DecodeConfig(max_new_tokens=12, tree_widths=(3, 2), kv_cache="static", attention="split_kv")
    target, scout = copy.deepcopy(TARGET), copy.deepcopy(SCOUTS["perturbed"])  # their own caches, not the shared ones
    assert generate(target, PROMPT, cfg, scout=scout).tokens == plain(12)


def test_a_chain_shaped_tree_keeps_what_fixed_k_keeps():
    """Widths (1, 1, 1) are the K = 3 chain: the same cycles, the same kept drafts, the same tokens."""
    scout = SCOUTS["perturbed"]
    tree = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=30, tree_widths=(1, 1, 1)), scout=scout)
    chain = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=30, k_draft=3), scout=scout)
    assert tree.tokens == chain.tokens
    assert [(c.k, c.accepted) for c in tree.cycles] == [(c.k, c.accepted) for c in chain.cycles]


def test_a_wider_tree_keeps_at_least_what_its_chain_keeps_per_cycle():
    """The top-1 chain is a branch of every tree of the same depth: from the same position a tree keeps at least the
    chain's drafts, so over a run it needs no more cycles."""
    scout = SCOUTS["random"]
    chain = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=40, tree_widths=(1, 1)), scout=scout)
    wide = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=40, tree_widths=(8, 4)), scout=scout)
    assert wide.tokens == chain.tokens
    assert wide.stats.accepted > chain.stats.accepted and len(wide.cycles) < len(chain.cycles)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_eos_and_the_budget_end_a_tree_run_exactly(kind):
    ref = plain(40)
    eos = ref[12]
    r = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=40, tree_widths=(3, 3), eos_token_id=eos, kv_cache=kind),
                 scout=SCOUTS["self"])
    assert r.tokens == plain(40, eos=eos) and r.stop_reason == "eos" and r.tokens[-1] == eos
    for n in (1, 2, 3, 4):  # budgets shorter than a full cycle cut the tree's depth
        assert generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=n, tree_widths=(2, 2, 2), kv_cache=kind),
                        scout=SCOUTS["self"]).tokens == ref[:n]


@pytest.mark.parametrize("kind", ["dynamic", "static"])  # static: fallback cycles leave the scout behind, so the
def test_a_clutch_gates_tree_cycles(kind):  # cycle after one runs its catch-up apart, the next ones fold it
    clutch = EntropyClutch(ClutchConfig(theta_low=1.2, theta_high=2.0, alpha=0.5, k_draft=2))
    r = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=30, tree_widths=(3, 2), kv_cache=kind),
                 scout=SCOUTS["perturbed"], clutch=clutch)
    assert r.tokens == plain(30)
    assert all((c.k > 0) == bool(c.engaged) for c in r.cycles)
    assert 0 < r.stats.speculate_cycles < len(r.cycles)  # the clutch both engaged and fell back in this run
    with pytest.raises(ValueError, match="give the clutch k_draft=2"):
        generate(TARGET, PROMPT, DecodeConfig(tree_widths=(3, 2)), scout=SCOUTS["self"], clutch=EntropyClutch())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sampling": SamplingConfig(temperature=1.0, seed=0)}, "greedy only"),
    ({"k_schedule": "adaptive"}, "adaptive"),
    ({"draft_stop_prob": 0.4}, "draft_stop_prob"),
    ({"k_draft": 3}, "leave k_draft None"),
])
def test_tree_config_clashes_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodeConfig(tree_widths=(2, 2), **kwargs)


def test_a_tree_needs_a_scout_and_a_list_of_widths_is_taken():
    with pytest.raises(ValueError, match="pass scout="):
        generate(TARGET, PROMPT, DecodeConfig(tree_widths=(2,)))
    assert DecodeConfig(tree_widths=[2, 1]).tree_widths == (2, 1)


def test_a_static_tree_cycle_is_kept_across_runs_and_scouts_taking_turns_each_keep_their_own():
    """On a static cache the engine keeps each tree's TreeStep with the target's cache and the scout's (its graphs are
    captured once per tree and scout, not per run); a run with another scout on the same target cache gets its own
    step, and the first scout's step survives it (interleaved variants with two scouts of one tree had replaced each
    other's step, so every run captured its graph again); no step keeps a model alive."""
    import dataclasses
    import gc
    import weakref

    import sdsie.decoding.engine as engine

    target = copy.deepcopy(TARGET)
    cfg = DecodeConfig(max_new_tokens=20, kv_cache="static", tree_widths=(3, 2))

    def step_of(target: torch.nn.Module, scout: torch.nn.Module) -> object:
        (cache,) = [c for (role, *_), c in engine._STATIC[target].items() if role == "target"]
        (scout_cache,) = [c for (role, *_), c in engine._STATIC[scout].items() if role == "scout"]
        return engine._TREE_STEPS[cache][scout_cache][(3, 2)]

    first = generate(target, PROMPT, cfg, scout=SCOUTS["perturbed"])
    step = step_of(target, SCOUTS["perturbed"])
    again = generate(target, PROMPT, cfg, scout=SCOUTS["perturbed"])
    assert step_of(target, SCOUTS["perturbed"]) is step and first.tokens == again.tokens == plain(20)
    other = generate(target, PROMPT, cfg, scout=SCOUTS["random"])
    other_step = step_of(target, SCOUTS["random"])
    assert other_step is not step and other.tokens == plain(20)
    back = generate(target, PROMPT, cfg, scout=SCOUTS["perturbed"])  # the turn back finds its step as it left it
    assert step_of(target, SCOUTS["perturbed"]) is step and step_of(target, SCOUTS["random"]) is other_step
    assert back.tokens == plain(20)
    (cache,) = [c for (role, *_), c in engine._STATIC[target].items() if role == "target"]
    alive = weakref.ref(target), weakref.ref(cache)
    del target, cache, step, other_step
    gc.collect()
    assert all(ref() is None for ref in alive)
    before = len(engine._TREE_STEPS)  # dynamic caches are new each run: their steps go with them
    generate(TARGET, PROMPT, dataclasses.replace(cfg, kv_cache="dynamic"), scout=SCOUTS["perturbed"])
    gc.collect()
    assert len(engine._TREE_STEPS) == before


def test_a_tree_cycle_without_room_in_a_static_cache_is_refused_before_it_runs():
    from sdsie.decoding.tree import TreeStep

    scout = SCOUTS["perturbed"]
    with torch.inference_mode():
        tc, sc = StaticKV(TARGET, 8), StaticKV(scout, 8)
        forward(TARGET, torch.tensor(PROMPT[:-1]), tc, last_only=True)  # 5 positions: the root goes at slot 5
        first = forward(scout, torch.tensor(PROMPT), sc, last_only=True)  # [1, V]
        step = TreeStep(TreeLayout((2, 2)), TARGET, scout, tc, sc, graphs=False)  # the target would need 5 + 7
        before = [layer.keys.clone() for layer in tc.cache.layers]
        with pytest.raises(ValueError, match="cannot add 7 to 5"):
            step(first, torch.tensor(PROMPT[-1:]), len(PROMPT) - 1)
        assert tc.length == 5 and all(b.equal(layer.keys) for b, layer in zip(before, tc.cache.layers, strict=True))


def test_a_tree_cycles_device_work_makes_no_tensor_from_a_host_value():
    """TreeStep.body is captured as one CUDA graph, and a capture refuses any host-to-device copy: a tensor made from a
    host value (a Python scalar written into a tensor, torch.tensor(...)) is one. On a CPU such an op shows as
    aten.lift_fresh; there must be none (the H200 refuses an `ok[0] = True` in the verify this way)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sdsie.decoding.tree import TreeStep

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    scout = SCOUTS["perturbed"]
    with torch.inference_mode():
        tc, sc = StaticKV(TARGET, 64), StaticKV(scout, 64)
        forward(TARGET, torch.tensor(PROMPT[:-1]), tc, last_only=True)
        forward(scout, torch.tensor(PROMPT[:-2]), sc, last_only=True)  # the scout two tokens behind
        step = TreeStep(TreeLayout((3, 2, 2)), TARGET, scout, tc, sc, graphs=False)
        feed, n, r = step._padded(torch.tensor(PROMPT[-2:]), len(PROMPT) - 1)  # what a folded catch-up reads
        with Ops() as ops:
            ints, _bits = step.body_catching_up(feed, n, r)  # the catch-up, then body
    assert "aten.index_copy_.default" in ops.seen and ints.numel() == 2 + 3  # it ran: the compaction, the path
    assert [op for op in ops.seen if "lift_fresh" in op] == []


def test_a_static_tree_cycle_folds_the_scouts_catch_up_into_its_step_and_stays_lossless():
    """On static caches every cycle whose catch-up fits (all but the first, which reads the prompt) runs it inside
    the tree step (TreeStep.catch_up: one graph under cuda_graphs); with pad_scout_catchup=False none does. Both
    emit the plain greedy tokens, and the cycles keep the same drafts (the padded forward's logits at the root are
    the same computation here, fp32)."""
    from sdsie.decoding.tree import TreeStep

    calls = {"catch_up": 0, "after": 0}
    folded, after = TreeStep.catch_up, TreeStep.__call__

    def count(name, fn):
        def inner(self, *args, **kwargs):
            calls[name] += 1
            return fn(self, *args, **kwargs)
        return inner

    runs = {}
    try:
        TreeStep.catch_up, TreeStep.__call__ = count("catch_up", folded), count("after", after)
        for pad in (True, False):
            calls.update(catch_up=0, after=0)
            cfg = DecodeConfig(max_new_tokens=30, tree_widths=(3, 2, 2), kv_cache="static", pad_scout_catchup=pad)
            runs[pad] = generate(TARGET, PROMPT, cfg, scout=SCOUTS["perturbed"]), dict(calls)
    finally:
        TreeStep.catch_up, TreeStep.__call__ = folded, after
    (r_fold, c_fold), (r_sep, c_sep) = runs[True], runs[False]
    assert r_fold.tokens == r_sep.tokens == plain(30)
    assert [(c.k, c.accepted) for c in r_fold.cycles] == [(c.k, c.accepted) for c in r_sep.cycles]
    assert c_fold == {"catch_up": len(r_fold.cycles) - 1, "after": 1} and len(r_fold.cycles) > 3
    assert c_sep == {"catch_up": 0, "after": len(r_sep.cycles)}


def test_a_folded_catch_up_refuses_a_feed_it_cannot_take():
    from sdsie.decoding.tree import TreeStep

    scout = SCOUTS["perturbed"]
    with torch.inference_mode():
        tc, sc = StaticKV(TARGET, 64), StaticKV(scout, 64)
        forward(TARGET, torch.tensor(PROMPT[:-1]), tc, last_only=True)
        forward(scout, torch.tensor(PROMPT[:-2]), sc, last_only=True)
        step = TreeStep(TreeLayout((2, 2)), TARGET, scout, tc, sc, graphs=False)
        assert step.catch_up_size == 3 and step.can_catch_up(2) and not step.can_catch_up(4)
        with pytest.raises(ValueError, match="takes 1..3 tokens"):
            step.catch_up(torch.tensor(PROMPT[:4]), len(PROMPT) - 1)
        with pytest.raises(ValueError, match="do not end at the root's position 4"):
            step.catch_up(torch.tensor(PROMPT[-2:]), len(PROMPT) - 2)
        assert sc.length == len(PROMPT) - 2  # nothing moved


def test_every_tree_cycle_runs_the_scout_once_per_depth_and_a_gear_follows_the_clutch():
    """The decisions act: real scout forwards (counted by a hook) are the speculate cycles' depths, no scout forward
    runs in a fallback cycle, and the gear's precision before each target forward is the one the cycle records
    (launching after each read, so each target forward is its cycle's; tests/test_engine.py checks launching
    ahead)."""
    from dataclasses import dataclass as _dataclass

    @_dataclass
    class FakeGear:
        int4: bool = False

    scout, gear = SCOUTS["perturbed"], FakeGear()
    scout_calls, seen = [0], []
    handles = [scout.register_forward_hook(lambda *_: scout_calls.__setitem__(0, scout_calls[0] + 1)),
               TARGET.register_forward_pre_hook(lambda *_: seen.append(gear.int4))]
    clutch = EntropyClutch(ClutchConfig(theta_low=1.2, theta_high=2.0, alpha=0.5, k_draft=2))
    try:
        r = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=30, tree_widths=(3, 2), launch_ahead=False),
                     scout=scout, clutch=clutch, gear=gear)
    finally:
        for h in handles:
            h.remove()
    assert r.tokens == plain(30)
    assert scout_calls[0] == r.stats.scout_forwards == sum(c.k for c in r.cycles) == 2 * r.stats.speculate_cycles
    assert seen == [r.prefill_gear_int4] + [c.gear_int4 for c in r.cycles] and set(seen) == {True, False}
    assert all(c.gear_int4 == bool(c.engaged) for c in r.cycles)


def test_a_tree_run_with_a_compiled_scout_is_lossless():
    """A scout copy compiled in place (sdsie.models.compiled_copy; dynamo's tracing with the eager backend here, as
    inductor takes about a minute on two cores) drafts through the engine's tree forwards, masks and static caches
    (the graphed path's; a dynamic cache retraces as it grows, 28 s here), and the tokens are plain decoding's; the
    scout it copied is left uncompiled."""
    from sdsie.models import compiled_copy

    scout = SCOUTS["perturbed"]
    compiled = compiled_copy(scout, backend="eager")
    cfg = DecodeConfig(max_new_tokens=20, kv_cache="static", tree_widths=(3, 2))
    for _ in range(2):  # the second run reuses what the first traced (and, on a static cache, its tree step)
        assert generate(TARGET, PROMPT, cfg, scout=compiled).tokens == plain(20)
    assert compiled is not scout and compiled._compiled_call_impl is not None and scout._compiled_call_impl is None
    # gated (decode_repro's gated tree variants): plain steps leave the compiled scout behind, so its catch-ups come
    # in lengths the always-on tree never feeds it
    clutch = EntropyClutch(ClutchConfig(theta_low=1.2, theta_high=2.0, alpha=0.5, k_draft=2))
    r = generate(TARGET, PROMPT, dataclasses.replace(cfg, max_new_tokens=30), scout=compiled, clutch=clutch)
    assert r.tokens == plain(30) and 0 < r.stats.speculate_cycles < len(r.cycles)
    assert r.stats.scout_catchup_tokens > r.stats.speculate_cycles  # some catch-up spanned plain steps


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["always", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_tree_cycles_with_an_inductor_compiled_scout_decode_as_its_eager_runs(dtype, gated):
    """On a GPU: a scout compiled by inductor (compiled_copy, decode_repro's tree_graphs_compiled_scout and, gated by a
    clutch, its gated tree variants) inside tree cycles captured as one CUDA graph gives the tokens and cycles of the
    same scout run without graphs; in fp32 those are plain decoding's. Gated, the scout's catch-ups after plain steps
    are padded and replayed graphs of the compiled scout."""
    from sdsie.models import compiled_copy

    target = copy.deepcopy(TARGET).to("cuda", dtype)
    scout = compiled_copy(copy.deepcopy(SCOUTS["perturbed"]).to("cuda", dtype))
    plain = generate(target, PROMPT, DecodeConfig(max_new_tokens=48)).tokens
    clutch = ClutchConfig(theta_low=1.2, theta_high=2.0, alpha=0.5, k_draft=3) if gated else None
    runs = [generate(target, PROMPT, DecodeConfig(max_new_tokens=48, kv_cache="static", cuda_graphs=graphs,
                                                  tree_widths=(4, 2, 1)), scout=scout,
                     clutch=EntropyClutch(clutch) if clutch else None) for graphs in (False, True)]
    eager, replayed = runs
    assert eager.tokens == replayed.tokens and replayed.stats.tree_nodes > 0
    assert [(c.k, c.accepted) for c in eager.cycles] == [(c.k, c.accepted) for c in replayed.cycles]
    if gated:
        assert 0 < replayed.stats.speculate_cycles < len(replayed.cycles)
    if dtype == torch.float32:
        assert replayed.tokens == plain
