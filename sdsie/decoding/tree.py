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
from dataclasses import dataclass, field

import torch

__all__ = ["MAX_TREE_NODES", "TreeLayout", "TreeVerdict", "check_widths", "greedy_tree_verify"]

MAX_TREE_NODES = 1024  # drafted nodes per cycle; a verify reads 1 + nodes tokens


def check_widths(widths: object) -> tuple[int, ...]:
    """A tree's widths per depth, validated: a non-empty tuple of integers >= 1, at most MAX_TREE_NODES nodes."""
    if not isinstance(widths, tuple) or not widths:
        raise ValueError(f"tree widths must be a non-empty tuple of integers >= 1 (one per depth), got {widths!r}")
    if any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
        raise ValueError(f"tree widths must be integers >= 1, got {widths!r}")
    nodes = sum(itertools.accumulate(widths, lambda a, b: a * b))
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
        sizes = tuple(itertools.accumulate(widths, lambda a, b: a * b))
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
        )


@dataclass(frozen=True)
class DeviceTree:
    layout: TreeLayout
    parent: torch.Tensor  # [1 + N] long
    depth: torch.Tensor  # [1 + N] long
    visible: torch.Tensor  # [1 + N, 1 + N] bool


@dataclass(frozen=True)
class TreeVerdict:
    """A greedy tree verification, all on the device (read with the cycle's one host transfer)."""

    accepted: torch.Tensor  # 0-d long: kept nodes (the path's length)
    path: torch.Tensor  # [D] long: the kept node at each depth, the root (0) past the path's end
    next_token: torch.Tensor  # 0-d long: the target's argmax at the path's end


def greedy_tree_verify(logits: torch.Tensor, tokens: torch.Tensor, tree: DeviceTree) -> TreeVerdict:
    """logits [1 + N, V]: the target at the root and every node; tokens [1 + N]: the root's token, then the drafts.

    A node is kept when every node on its way up (itself included, the root excluded) holds the target's argmax at
    its parent. Fixed-size device work, no host sync."""
    greedy = logits.argmax(dim=-1)  # [1 + N]
    ok = tokens == greedy[tree.parent]  # [1 + N]; the root's entry is never read
    ok[0] = True
    kept = ~(tree.visible & ~ok[None, :]).any(dim=-1)  # [1 + N]: no ancestor failed
    depths = torch.arange(1, tree.layout.max_depth + 1, device=logits.device)  # [D]
    at_depth = kept[None, :] & (tree.depth[None, :] == depths[:, None])  # [D, 1 + N]: at most one True per row
    has = at_depth.any(dim=-1)  # [D]
    path = torch.where(has, at_depth.int().argmax(dim=-1), 0)  # [D]
    accepted = has.sum()
    # the deepest kept node, or the root; gathered, since indexing by a 0-d CUDA tensor reads it to the host (a
    # sync that stalled every tree cycle until the verify forward finished)
    end = torch.cat([path.new_zeros(1), path]).gather(0, accepted[None])  # [1]
    return TreeVerdict(accepted, path, greedy.gather(0, end)[0])
