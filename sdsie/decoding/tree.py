"""Static draft trees for greedy speculative decoding: the tree's layout, its attention, and its verification.

A tree of widths (w_1, ..., w_D) drafts, below the last kept token (the root), the scout's top w_1 tokens; below each
of those its top w_2; and so on to depth D: n_d = w_1 * ... * w_d nodes at depth d (SpecInfer's and Medusa's static
trees). Nodes are numbered breadth first, the root 0, each level's nodes grouped by parent in parent order, so node i
at depth d has the parent `first(d - 1) + (i - first(d)) // w_d`.

The target verifies the root and every node in one forward, each node attending to the committed prefix and to its
own ancestors (`TreeLayout.visible`), at the position id of its depth. Under greedy decoding a node is kept when its
token is the target's argmax at its parent and its parent is kept; siblings hold distinct tokens (a top-k), so at most
one node per depth is kept and the kept nodes form one path. The cycle emits the path's tokens and the target's argmax
at the path's end (the bonus), all of them the plain greedy loop's tokens. With every width 1 the tree is the chain of
fixed-K speculation.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sdsie.decoding.model_io import (
    StaticKV,
    _attention_mask,
    _hf_forward,
    _static_attention,
    capture_graph,
    compact_cache,
    model_device,
)
from sdsie.entropy import argmax_entropy

__all__ = ["MAX_TREE_NODES", "TreeLayout", "TreeStep", "TreeVerdict", "check_widths", "greedy_tree_verify",
           "level_sizes", "tree_forward", "tree_mask"]

MAX_TREE_NODES = 1024  # drafted nodes per cycle; a verify reads 1 + nodes tokens


def level_sizes(widths: tuple[int, ...]) -> tuple[int, ...]:
    """Nodes per depth of a static tree: n_d = w_1 * ... * w_d."""
    return tuple(itertools.accumulate(widths, lambda a, b: a * b))


def check_widths(widths: object) -> tuple[int, ...]:
    """A tree's widths per depth, validated: a non-empty tuple of integers >= 1, at most MAX_TREE_NODES nodes."""
    if not isinstance(widths, tuple) or not widths:
        raise ValueError(f"tree widths must be a non-empty tuple of integers >= 1 (one per depth), got {widths!r}")
    if any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
        raise ValueError(f"tree widths must be integers >= 1, got {widths!r}")
    nodes = sum(level_sizes(widths))
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"tree widths {widths} draft {nodes} nodes per cycle, more than {MAX_TREE_NODES}")
    return widths


@dataclass(frozen=True)
class TreeLayout:
    """The fixed shape of a static tree (host side; `to(device)` gives its device tensors)."""

    widths: tuple[int, ...]
    level_sizes: tuple[int, ...] = field(init=False)  # n_1..n_D
    parent: tuple[int, ...] = field(init=False)  # [1 + N]: parent node of each node (the root's is 0)
    depth: tuple[int, ...] = field(init=False)  # [1 + N]

    def __post_init__(self) -> None:
        widths = check_widths(self.widths)
        sizes = level_sizes(widths)
        parent, depth = [0], [0]
        for d, (w, n) in enumerate(zip(widths, sizes, strict=True), start=1):
            above = self.first(d - 1, sizes)
            parent += [above + i // w for i in range(n)]
            depth += [d] * n
        object.__setattr__(self, "level_sizes", sizes)
        object.__setattr__(self, "parent", tuple(parent))
        object.__setattr__(self, "depth", tuple(depth))

    @property
    def max_depth(self) -> int:
        return len(self.widths)

    @property
    def nodes(self) -> int:
        """Drafted nodes (the root not counted)."""
        return sum(self.level_sizes)

    def first(self, d: int, sizes: tuple[int, ...] | None = None) -> int:
        """Index of depth d's first node (the root: 0)."""
        sizes = self.level_sizes if sizes is None else sizes
        return 0 if d == 0 else 1 + sum(sizes[: d - 1])

    def level(self, d: int) -> slice:
        """Node indices of depth d, 1 <= d <= D."""
        return slice(self.first(d), self.first(d) + self.level_sizes[d - 1])

    def visible(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1 + N, 1 + N] bool: row i marks node i's ancestors, the root included, and i itself."""
        n = 1 + self.nodes
        vis = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while True:
                vis[i, j] = True
                if j == 0:
                    break
                j = self.parent[j]
        return vis.to(device)

    def to(self, device: torch.device | str) -> DeviceTree:
        return DeviceTree(
            self,
            parent=torch.tensor(self.parent, device=device),
            depth=torch.tensor(self.depth, device=device),
            visible=self.visible(device),
            levels=torch.arange(1, self.max_depth + 1, device=device),
        )


@dataclass(frozen=True)
class DeviceTree:
    layout: TreeLayout
    parent: torch.Tensor  # [1 + N] long
    depth: torch.Tensor  # [1 + N] long
    visible: torch.Tensor  # [1 + N, 1 + N] bool
    levels: torch.Tensor  # [D] long: 1..D


@dataclass(frozen=True)
class TreeVerdict:
    """A greedy tree verification, all on the device (read with the cycle's one host transfer)."""

    accepted: torch.Tensor  # 0-d long: kept nodes (the path's length)
    path: torch.Tensor  # [D] long: the kept node at each depth, the root (0) past the path's end
    next_token: torch.Tensor  # 0-d long: the target's argmax at the path's end


def greedy_tree_verify(greedy: torch.Tensor, tokens: torch.Tensor, tree: DeviceTree) -> TreeVerdict:
    """greedy [1 + N]: the target's argmax at the root and every node; tokens [1 + N]: the root's token, then the
    drafts.

    A node is kept when every node on its way up (itself included, the root excluded) holds the target's argmax at
    its parent. Fixed-size device work, no host sync."""
    ok = (tokens == greedy[tree.parent]) | (tree.depth == 0)  # [1 + N]; the root counts as kept (no in-place write
    # of a host scalar: under graph capture that is a host-to-device copy, refused)
    kept = ~(tree.visible & ~ok[None, :]).any(dim=-1)  # [1 + N]: no ancestor failed
    at_depth = kept[None, :] & (tree.depth[None, :] == tree.levels[:, None])  # [D, 1 + N]: at most one True per row
    has = at_depth.any(dim=-1)  # [D]
    path = torch.where(has, at_depth.int().argmax(dim=-1), 0)  # [D]
    accepted = has.sum()
    # the deepest kept node, or the root; gathered, since indexing by a 0-d CUDA tensor reads it to the host (a sync;
    # removing it did not move the measured tree speed, records 87b7dacb and 9d3c7d76, but a graph cannot hold one)
    end = torch.cat([path.new_zeros(1), path]).gather(0, accepted[None])  # [1]
    return TreeVerdict(accepted, path, greedy.gather(0, end)[0])


# ----------------------------------------------------------------------------------------------------
# A tree cycle's device work: drafting below the root, the verify, the kept path's compaction


def tree_mask(width: int, start: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[1, 1, S, width] bool: every cache column before `start` (the committed prefix), then `visible` [S, L] over the
    columns start..start + L - 1, nothing after. start is a 0-d device tensor, so the mask is device work alone and a
    CUDA graph that builds it serves every root position."""
    cols = torch.arange(width, device=visible.device)  # [W]
    rel = cols - start  # [W]: column index inside the tree's span
    span = visible.shape[1]
    inside = (rel >= 0) & (rel < span)  # [W]
    vis = visible.index_select(1, rel.clamp(0, span - 1))  # [S, W]
    return ((cols < start)[None, :] | (inside[None, :] & vis))[None, None]


def tree_forward(model: nn.Module, cache: Any, ids: torch.Tensor, start: torch.Tensor, visible: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """ids [S] appended to `cache` (a StaticKV or an HF dynamic cache) as tree nodes -> logits [S, V]: each token
    attends to the cache before `start` and to the columns from `start` on that its row of visible [S, L] marks (its
    ancestors, itself included), at position ids `positions` [S]. start and positions are device tensors. A StaticKV's
    host length is not moved here (TreeStep's caller advances it): under a CUDA graph this runs at every replay."""
    n = ids.numel()
    if tuple(visible.shape[:1]) != (n,) or tuple(positions.shape) != (n,) or visible.dtype != torch.bool:
        raise ValueError(f"tree_forward: {n} tokens need visible [{n}, L] bool and positions [{n}], got "
                         f"{visible.dtype} {tuple(visible.shape)} and {tuple(positions.shape)}")
    if isinstance(cache, StaticKV):
        with _static_attention(model, cache.attention):
            mask = _attention_mask(model, tree_mask(cache.max_len, start, visible))
            return cache.model_forward(model, ids[None], False, mask, positions[None])
    mask = _attention_mask(model, tree_mask(cache.get_seq_length() + n, start, visible))
    return _hf_forward(model, ids[None], cache, False, mask, positions[None])


def _alive(ref: weakref.ref, role: str) -> Any:
    obj = ref()
    if obj is None:
        raise RuntimeError(f"this TreeStep's {role} no longer exists")
    return obj


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static inputs: (first [1, V], root [1], r) or, catching up, (feed [P], n, r)
    ints: torch.Tensor  # [2 + D] static output
    bits: torch.Tensor  # [1 + D] static output


class TreeStep:
    """One tree cycle's device work after the scout's catch-up forward, as one function of device tensors:
    (first [1, V]: the scout's logits at the root; root [1]; r: the root's position, 0-d) ->
    (ints [2 + D]: kept count, the path's tokens (the root's past its end), the target's next token;
    bits [1 + D]: the target's entropy at the root and along the path).

    It drafts each level from the scout's top-w (one scout forward per depth below the first, tree attention), verifies
    every node in one target forward, and moves the kept path's keys and values to the slots after the root. The
    scout cache is left r + 1 + (nodes above the last level) long and the target's r + 1 + nodes long on the device;
    `advance` moves a StaticKV's host length to match, and the caller crops both. With graphs (both caches StaticKV
    with cuda_graphs, on CUDA) the whole function is captured once per (tree, precision, way in) and replayed: a cycle
    is then three small input writes and one replay instead of every op launched from the host.

    `catch_up` folds the scout's catch-up forward into the same function (and graph): the tokens the scout has not
    read (the last cycle's kept path, then the new root), padded to `catch_up_size`, then the rest as above. The
    engine takes it whenever both caches are StaticKV and the feed fits (pad_scout_catchup, the default), so a graphed
    cycle is one replay; __call__ takes the scout's logits from a catch-up forward run before it."""

    def __init__(self, layout: TreeLayout, target: nn.Module, scout: nn.Module, target_cache: Any, scout_cache: Any,
                 graphs: bool) -> None:
        self.layout = layout
        self.tree = layout.to(model_device(target))
        # weak: the engine keeps a step in a dictionary keyed weakly by its target cache (engine._TREE_STEPS), and a
        # strong reference from there back to the cache or its models would keep them alive for good
        self._target, self._scout = weakref.ref(target), weakref.ref(scout)
        self._target_cache, self._scout_cache = weakref.ref(target_cache), weakref.ref(scout_cache)
        self.graphs = graphs
        self._captured: dict[Hashable, _Captured] = {}

    @property
    def target(self) -> nn.Module:
        return _alive(self._target, "target")

    @property
    def scout(self) -> nn.Module:
        return _alive(self._scout, "scout")

    @property
    def target_cache(self) -> Any:
        return _alive(self._target_cache, "target cache")

    @property
    def scout_cache(self) -> Any:
        return _alive(self._scout_cache, "scout cache")

    def serves(self, target: nn.Module, scout: nn.Module, scout_cache: Any) -> bool:
        """Whether this step's models and scout cache are these (a cache reused by another pair needs its own)."""
        return self._target() is target and self._scout() is scout and self._scout_cache() is scout_cache

    @property
    def scout_added(self) -> int:
        """Positions the scout's tree forwards append (every level but the last)."""
        return sum(self.layout.level_sizes[:-1])

    @property
    def target_added(self) -> int:
        return 1 + self.layout.nodes

    def body(self, first: torch.Tensor, root: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layout, tree = self.layout, self.tree
        tokens = [root, first.topk(layout.widths[0], dim=-1).indices.flatten()]  # root [1], depth 1 [n_1]
        for d in range(1, layout.max_depth):
            nodes = layout.level(d)  # depth d's nodes; the scout's cache holds depths 1..d-1 after the root
            logits = tree_forward(self.scout, self.scout_cache, tokens[-1], r + 1, tree.visible[nodes, 1 : nodes.stop],
                                  tree.depth[nodes] + r)  # [n_d, V]
            tokens.append(logits.topk(layout.widths[d], dim=-1).indices.flatten())  # [n_(d + 1)], grouped by parent
        drafted = torch.cat(tokens)  # [1 + N]
        logits = tree_forward(self.target, self.target_cache, drafted, r, tree.visible, tree.depth + r)  # [1 + N, V]
        greedy, bits = argmax_entropy(logits)  # [1 + N] each, one pass on CUDA
        verdict = greedy_tree_verify(greedy, drafted, tree)
        compact_cache(self.target_cache, r + verdict.path, r + tree.levels)
        rows = torch.cat([verdict.path.new_zeros(1), verdict.path])  # [1 + D]: the root, then the path
        ints = torch.cat([verdict.accepted[None], drafted[verdict.path], verdict.next_token[None]])  # [2 + D]
        return ints, bits[rows]

    @property
    def catch_up_size(self) -> int:
        """Tokens a folded catch-up forward reads (padded): a kept path of up to D tokens, then the new root."""
        return self.layout.max_depth + 1

    def body_catching_up(self, feed: torch.Tensor, n: torch.Tensor, r: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """feed [P]: the n tokens the scout has not read (the root last), then padding; the scout's StaticKV holds
        r + 1 - n positions. Its padded forward, the cache cut back to r + 1 on the device (the padding's positions
        become stale, as after a rejected draft), then body from the scout's logits at the root."""
        scout_kv = self.scout_cache
        with _static_attention(self.scout):
            logits = _hf_forward(self.scout, feed[None], scout_kv.cache, False)  # [P, V]
        scout_kv.set_device_length(r + 1)
        at_root = (n - 1)[None]  # [1]
        return self.body(logits.index_select(0, at_root), feed.index_select(0, at_root), r)

    def can_catch_up(self, n: int) -> bool:
        """Whether `catch_up` takes a feed of n tokens: both caches StaticKV and the padded forward fits."""
        scout, target = self.scout_cache, self.target_cache
        return (isinstance(scout, StaticKV) and isinstance(target, StaticKV) and 1 <= n <= self.catch_up_size
                and scout.length + self.catch_up_size <= scout.max_len)

    def __call__(self, first: torch.Tensor, root: torch.Tensor, r: int,
                 precision: Hashable = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run (or replay) the cycle's device work after the scout's catch-up; precision names the gear state the
        target runs in (one graph each). A StaticKV without room for the cycle's positions is refused before anything
        runs."""
        self._check_room()
        if not self.graphs:
            return self.body(first, root, torch.tensor(r, device=first.device))
        key = ("after catch-up", precision)
        c = self._captured.get(key)
        if c is None:
            c = self._capture(key, self.body, (first, root, torch.tensor(r, device=root.device)))
        c.inputs[0].copy_(first)
        c.inputs[1].copy_(root)
        c.inputs[2].fill_(r)
        c.graph.replay()
        return c.ints, c.bits

    def catch_up(self, feed: torch.Tensor, r: int, precision: Hashable = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The scout's catch-up over feed [n] (can_catch_up(n); the root, at position r, last) and the cycle, as one
        function of device tensors (one replay under graphs). Leaves the scout's host length at r + 1, as a separate
        catch-up forward would; `advance` then moves both caches past the tree."""
        n = feed.numel()
        if not self.can_catch_up(n):
            raise ValueError(f"a folded catch-up takes 1..{self.catch_up_size} tokens into a StaticKV with room for "
                             f"them, got {n}")
        scout_kv = self.scout_cache
        if scout_kv.length + n != r + 1:
            raise ValueError(f"the feed's {n} tokens after the scout's {scout_kv.length} do not end at the root's "
                             f"position {r}")
        self._check_room(scout_length=r + 1)  # the tree's positions come after the catch-up's real tokens
        if not self.graphs:
            out = self.body_catching_up(*self._padded(feed, r))
        else:  # the capture's warm-up runs restore the device length to the host's: move the host's after it
            key = ("catching up", precision)
            c = self._captured.get(key) or self._capture(key, self.body_catching_up, self._padded(feed, r))
            c.inputs[0][:n].copy_(feed)  # the padding: earlier feeds' tokens, any valid ids
            c.inputs[1].fill_(n)
            c.inputs[2].fill_(r)
            c.graph.replay()
            out = c.ints, c.bits
        scout_kv.length = r + 1
        return out

    def _padded(self, feed: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """body_catching_up's inputs: feed [n] padded with token 0 to [P], n and r as 0-d device tensors."""
        padded = torch.zeros(self.catch_up_size, dtype=feed.dtype, device=feed.device)  # [P]
        padded[: feed.numel()] = feed
        return padded, torch.tensor(feed.numel(), device=feed.device), torch.tensor(r, device=feed.device)

    def _check_room(self, scout_length: int | None = None) -> None:
        for cache, n in self._added():
            if not isinstance(cache, StaticKV):
                continue
            length = scout_length if scout_length is not None and cache is self.scout_cache else cache.length
            if length + n > cache.max_len:
                raise ValueError(f"StaticKV holds {cache.max_len} positions: a tree cycle {self.layout.widths} cannot "
                                 f"add {n} to {length}")

    def advance(self) -> None:
        """Move the StaticKV host lengths past what the cycle's forwards appended on the device."""
        for cache, n in self._added():
            if isinstance(cache, StaticKV):
                cache.length += n

    def _added(self) -> tuple[tuple[Any, int], ...]:
        return (self.scout_cache, self.scout_added), (self.target_cache, self.target_added)

    def _capture(self, key: Hashable, fn, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        """Capture fn on its own copies of the inputs (capture_graph, in the target cache's memory pool)."""
        caches = (self.target_cache, self.scout_cache)
        if not all(isinstance(c, StaticKV) and c.cuda_graphs for c in caches):
            raise ValueError("a graphed TreeStep needs both caches to be StaticKV with cuda_graphs")
        for model in (self.target, self.scout):
            if model.config._attn_implementation != "sdpa":  # the mask is built for sdpa inside the graph
                raise ValueError(f"graphed tree cycles need the sdpa attention implementation, not "
                                 f"{model.config._attn_implementation!r}; decode with cuda_graphs=False")
        static = tuple(t.clone() for t in inputs)
        graph, (ints, bits) = capture_graph(lambda: fn(*static), caches, f"a tree cycle {self.layout.widths}")
        self._captured[key] = _Captured(graph, static, ints, bits)
        return self._captured[key]
