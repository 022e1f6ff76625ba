"""Model I/O for decoding: one forward over a KV cache, cache rollback, the per-cycle host read, input checks.

Works with any HF causal LM that accepts `past_key_values` and `logits_to_keep` (transformers >= 4.45).

Two cache kinds. A `DynamicCache` (the default) grows with each forward and is cropped after a rejected
draft. A `StaticKV` preallocates the whole sequence (HF `StaticCache`) and rolls back by resetting each
layer's position counter on the device; positions past the counter hold stale keys that the causal mask
never lets a later query see, and the next forward overwrites them. A static cache is what CUDA graphs need:
with `cuda_graphs`, the forward of each token count the engine repeats (1 and K + 1) is captured once and
replayed, so a decode step costs one graph launch instead of one host dispatch per kernel (gpt-fast's
approach); other counts (a scout's catch-up) can be padded to a few captured sizes (`pad_sizes`). On the
H200 the stand-in's plain decoding ran at 99.9 and 64.2 tok/s (median) on two machines of the same GPU
(records 81adafc6, af6c76f9), which points at the host's dispatch; the records now measure it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "HostRead",
    "StaticKV",
    "compact_cache",
    "cache_length",
    "check_prompt",
    "crop_cache",
    "forward",
    "model_device",
    "module_fingerprint",
    "new_cache",
    "sync_device",
    "to_host",
]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor  # [1, S] static input
    logits: torch.Tensor  # [S or 1, V] static output, overwritten by each replay
    keep: torch.Tensor | None = None  # [1] static input: the position whose logits a padded prefill returns


class StaticKV:
    """A preallocated KV cache for one model and one sequence, its length kept on the host (no sync).

    cuda_graphs: capture the forward of each (token count, last_only, variant) with a token count in
    `graph_sizes` on first use and replay it after (CUDA only). `variant` names any state outside the inputs
    that changes which kernels run (the gear's precision): each value gets its own graph. A replay overwrites
    the previous replay's logits: consume them before the next forward of the same size, as the cycle does.

    pad_sizes: a forward of n tokens after the prefill whose n is not in `graph_sizes` runs as the smallest of
    these sizes that is >= n and fits: the ids padded at the end, every position's logits computed, the cache
    cut back to the n real positions (the padding's keys are stale positions, as after a rollback). Under
    cuda_graphs each padded size is one more graph, so a scout catching up on the tokens it skipped while the
    clutch was out replays one graph instead of dispatching an eager forward. The real positions' logits are
    the same computation as an n-token forward's, up to the kernels' floating-point order for another size.

    prefill_sizes: a prompt's forward (into an empty cache, last position's logits) runs as the smallest of these
    sizes that is >= its length and fits, the ids padded at the end and the logits taken at the prompt's last
    position; under cuda_graphs, one graph per size, so a prefill launches no kernels from the host. HF's layers
    must exist before a graph captures them: they are set up at construction (`_initialize_layers`), and where the
    configuration cannot say their shape, by the cache's first forward, which then runs eagerly (padded all the
    same, so a compiled model traces one form of prompt forward). A prompt longer than every size that fits runs as
    it is, and so does every prompt of a cache with other than plain static layers (a sliding window's padding
    could push real positions out of it).
    """

    def __init__(self, model: nn.Module, max_len: int, cuda_graphs: bool = False,
                 graph_sizes: Sequence[int] = (), pad_sizes: Sequence[int] = (), attention: str = "sdpa",
                 prefill_sizes: Sequence[int] = ()) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        if max_len < 1:
            raise ValueError(f"StaticKV: max_len must be >= 1, got {max_len}")
        if any(not isinstance(s, int) or s < 2 for s in pad_sizes):
            raise ValueError(f"StaticKV: pad_sizes must be integers >= 2, got {list(pad_sizes)}")
        if any(not isinstance(s, int) or s < 1 for s in prefill_sizes):
            raise ValueError(f"StaticKV: prefill_sizes must be integers >= 1, got {list(prefill_sizes)}")
        if attention not in DECODE_ATTENTIONS:
            raise ValueError(f"StaticKV: attention must be one of {DECODE_ATTENTIONS}, got {attention!r}")
        device = model_device(model)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs needs the model on a CUDA device, got {device}")
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.max_len = max_len
        self.length = 0
        self.cuda_graphs = cuda_graphs
        self.attention = attention  # a one-token forward's attention (_static_attention)
        self.graph_sizes = frozenset(graph_sizes)
        self.pad_sizes = tuple(sorted(set(pad_sizes)))
        plain = all(type(layer) is StaticLayer for layer in self.cache.layers)
        self.prefill_sizes = tuple(sorted(set(prefill_sizes))) if plain else ()
        self._graphs: dict[tuple, _Graph] = {}  # (n, last_only, variant), or ("prefill", size, variant)
        self._pool: Any = None
        self.kv: torch.Tensor | None = None  # [L, 2, B, H, S, D] behind every layer's keys and values (_consolidate)
        self.counter: torch.Tensor | None = None  # every layer's position counter, one tensor (_consolidate)
        self._consolidated = False
        if plain and _initialize_layers(self.cache, model):
            self._consolidate()  # before any forward: a compiled prompt traces the cache's one and only form

    def forward(self, model: nn.Module, ids: torch.Tensor, last_only: bool, variant: Hashable = None) -> torch.Tensor:
        """ids: [S] -> logits [S, V] (or [1, V] with last_only), written at positions length..length+S-1."""
        n = ids.numel()
        if self.length + n > self.max_len:
            raise ValueError(f"StaticKV holds {self.max_len} positions: cannot add {n} to {self.length}")
        prefill = self._prefill_size(n, last_only)
        if prefill is not None:
            return self._padded_prefill(model, ids, prefill, variant)
        padded = self._padded_size(n)
        if padded is None:
            logits = self._run(model, ids, last_only, variant)
            self.length += n
            self._consolidate()  # after the first forward, which initializes HF's layers, before any graph
            return logits
        start = self.length
        ids_padded = torch.zeros(padded, dtype=ids.dtype, device=ids.device)  # [padded]: ids, then token 0
        ids_padded[:n] = ids
        logits = self._run(model, ids_padded, False, variant)  # [padded, V]
        self.length = start + padded
        self.crop(start + n)  # the padding's positions become stale, as after a rejected draft
        return logits[n - 1 : n] if last_only else logits[:n]

    def _consolidate(self) -> None:
        """Put every layer's keys and values into one [L, 2, B, H, S, D] tensor (`kv`) and make them its views, so a
        tree cycle's compaction (compact_cache) moves a position of all layers in one index_select and one index_copy,
        not two of each per layer (on the H200 a cycle of the gpu stand-in pair spent 64 small kernels there). Done
        once, as soon as HF's layers exist (at construction, or after the first forward where they are built
        lazily) and before any graph captures the layers' tensors; left as is when the layers' shapes differ."""
        layers = self.cache.layers
        if self._consolidated or not all(getattr(layer, "is_initialized", False) for layer in layers):
            return
        self._consolidated = True  # tried once: a model whose layers differ is not re-checked at every forward
        tensors = [t for layer in layers for t in (layer.keys, layer.values)]
        if any(t.shape != tensors[0].shape or t.dtype != tensors[0].dtype for t in tensors):
            return
        self.kv = torch.stack([torch.stack([layer.keys, layer.values]) for layer in layers])
        for i, layer in enumerate(layers):
            layer.keys, layer.values = self.kv[i, 0], self.kv[i, 1]
        self._share_counter()

    def _share_counter(self) -> None:
        """Give every layer one position counter (`counter`), advanced once per forward (`model_forward`) instead of
        by each layer's update: HF's StaticLayer adds to its own counter, one kernel per layer and forward, which
        inductor does not fuse across layers (32 of a graphed Llama-3.1-8B token's 474 kernels on the H200). All
        layers hold the same positions (the caller writes and crops them together), so one counter says the same.
        Plain StaticLayers only (a sliding-window layer keeps HF's update)."""
        from transformers.cache_utils import StaticLayer

        layers = self.cache.layers
        if not all(type(layer) is StaticLayer for layer in layers):
            return
        self.counter = layers[0].cumulative_length
        for layer in layers:
            layer.cumulative_length = self.counter
            layer.update = functools.partial(_write_at_counter, layer)  # this layer's instance only

    def _padded_size(self, n: int) -> int | None:
        """The size an n-token forward is padded to, or None to run it as it is (the prefill, exact graph sizes,
        no pad size that is large enough and fits)."""
        if self.length == 0 or n in self.graph_sizes:
            return None
        return next((s for s in self.pad_sizes if s >= n and self.length + s <= self.max_len), None)

    def _prefill_size(self, n: int, last_only: bool) -> int | None:
        """The size a prompt of n tokens runs as (`prefill_sizes`), or None to run it as it is: not a prompt (the
        cache holds positions, or every position's logits are asked for), no size that is large enough and fits."""
        if self.length or not last_only:
            return None
        return next((s for s in self.prefill_sizes if s >= n and s <= self.max_len), None)

    def _padded_prefill(self, model: nn.Module, ids: torch.Tensor, size: int, variant: Hashable) -> torch.Tensor:
        """The prompt ids [n] as a forward of `size` tokens: ids, then token 0; logits [1, V] at position n - 1,
        the padding's positions left stale (as after a rejected draft). Causal attention keeps the padding out of
        every real position's keys, values and logits."""
        n = ids.numel()
        if self.cuda_graphs and self._consolidated:
            g = self._graphs.get(("prefill", size, variant)) or self._capture(model, size, True, variant, prefill=True)
            g.ids[0, :n].copy_(ids)
            g.ids[0, n:].zero_()
            g.keep.fill_(n - 1)
            g.graph.replay()
            logits = g.logits
        else:
            padded = torch.zeros((1, size), dtype=ids.dtype, device=ids.device)  # [1, size]: ids, then token 0
            padded[0, :n] = ids
            keep = torch.full((1,), n - 1, dtype=torch.long, device=ids.device)
            with _static_attention(model, self.attention):
                logits = self.model_forward(model, padded, True, keep=keep)
        self.length = size
        self._consolidate()  # after the cache's first forward (see _consolidate)
        self.crop(n)
        return logits

    def _run(self, model: nn.Module, ids: torch.Tensor, last_only: bool, variant: Hashable) -> torch.Tensor:
        """One forward of ids [S] at the cache's position: a graph replay for a graphed size, else eager."""
        n = ids.numel()
        graphed = n in self.graph_sizes or n in self.pad_sizes
        if self.cuda_graphs and graphed and self.length > 0:  # the prefill runs eagerly
            g = self._graphs.get((n, last_only, variant)) or self._capture(model, n, last_only, variant)
            g.ids.copy_(ids[None])
            g.graph.replay()
            return g.logits
        with _static_attention(model, self.attention):
            return self.model_forward(model, ids[None], last_only)

    def model_forward(self, model: nn.Module, ids: torch.Tensor, last_only: bool, mask: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`_hf_forward` over this cache (ids [1, S]; mask and positions: a tree forward's; keep: a padded prefill's
        position), then the shared counter advanced by S once for all layers (device work; the host's `length` is
        the caller's to move)."""
        logits = _hf_forward(model, ids, self.cache, last_only, mask, positions, keep)
        if self.counter is not None:
            self.counter.add_(ids.shape[-1])
        return logits

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise RuntimeError(f"cache holds {self.length} positions, cannot crop to {length}")
        if length < self.length:  # every cycle crops the target; a cycle that accepted everything launches nothing
            self.set_device_length(length)
            self.length = length

    def set_device_length(self, length: int | torch.Tensor) -> None:
        """Move the device-side length (every layer's counter, where HF's next forward writes) to `length`: a host
        int (a crop), or a 0-d device tensor, device work alone, so a CUDA graph can hold it (a tree cycle's padded
        catch-up cuts the cache back to its real tokens this way). The host's `length` is the caller's to match."""
        # On CUDA, HF initializes a layer lazily in its first forward, which the engine runs under
        # inference_mode: the counter is then an inference tensor, which only inference mode may update
        # (the H200 refused the next run's crop(0) without this).
        # One multi-tensor kernel (pair) for all layers, not a fill per layer: every speculative cycle crops the
        # target, and after the cycle's host read each launch here is time the GPU sits idle.
        counters = list({id(layer.cumulative_length): layer.cumulative_length for layer in self.cache.layers
                         if getattr(layer, "is_initialized", False)}.values())  # one where the layers share it
        if not counters:
            return
        with torch.inference_mode():
            if isinstance(length, torch.Tensor):
                torch._foreach_copy_(counters, [length] * len(counters))
                return
            torch._foreach_zero_(counters)  # an int: no host-to-device copy
            if length:
                torch._foreach_add_(counters, length)

    def _capture(self, model: nn.Module, n: int, last_only: bool, variant: Hashable, prefill: bool = False) -> _Graph:
        """Capture the n-token forward (capture_graph: the garbage written at positions length..length+n-1 is
        overwritten by the first replay); `prefill`: a padded prefill's, its logits at the position in `keep`."""
        device = model_device(model)
        ids = torch.zeros((1, n), dtype=torch.long, device=device)
        keep = torch.full((1,), n - 1, dtype=torch.long, device=device) if prefill else None

        def run() -> torch.Tensor:
            with _static_attention(model, self.attention):
                return self.model_forward(model, ids, last_only, keep=keep)

        what = f"a {n}-token {'prefill' if prefill else 'forward'} of {type(model).__name__}"
        graph, logits = capture_graph(run, [self], what)
        key = ("prefill", n, variant) if prefill else (n, last_only, variant)
        self._graphs[key] = _Graph(graph, ids, logits, keep)
        return self._graphs[key]


def _initialize_layers(cache: Any, model: nn.Module) -> bool:
    """Allocate a static cache's layers from the model's configuration (HF's `early_initialization`: batch 1, the
    key/value heads and head size, the embeddings' dtype) rather than in its first forward, so the cache has its
    final form (`_consolidate`) before anything is traced: a prompt compiled with `DecodeCompiled(compile_prefill)`
    against the lazily built layers compiles once more on the next prompt, which sees the consolidated ones (a
    second inductor compilation at 7-8B sizes). False, layers left to the first forward, where the configuration
    does not give one head shape for keys and values (no head count or head size, or separate key and value sizes)
    or the model no input embeddings to take the dtype from."""
    config = model.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else None)
    if not hasattr(cache, "early_initialization") or not hasattr(model, "get_input_embeddings") or not head_dim or any(
            getattr(config, name, None) is not None for name in ("qk_head_dim", "v_head_dim")):
        return False
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dtype = model.get_input_embeddings().weight.dtype
    cache.early_initialization(batch_size=1, num_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                               device=model_device(model))
    return True


def _write_at_counter(layer: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                      **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """HF StaticLayer.update (transformers 5.x) without its counter's advance: key_states and value_states
    [B, H, S, D] written at positions counter..counter + S - 1 of an initialized layer. StaticKV.model_forward
    advances the counter the layers share, once per forward."""
    positions = torch.arange(key_states.shape[-2], device=layer.keys.device) + layer.cumulative_length
    layer.keys.index_copy_(2, positions, key_states)
    layer.values.index_copy_(2, positions, value_states)
    return layer.keys, layer.values


T = TypeVar("T")


def capture_graph(fn: Callable[[], T], caches: Sequence[StaticKV], what: str) -> tuple[Any, T]:
    """fn's device work as a CUDA graph -> (graph, fn's outputs: the graph's static outputs). Two warm-up runs on a
    side stream, then the capture, in caches[0]'s memory pool. Every cache's device length is restored after each
    run (a capture records the counters' advance, it does not run it), so what a run writes past a cache's length
    is overwritten by the first replay. `what` names the work in the error a failed capture raises: never a silent
    fallback to eager."""
    def reset() -> None:
        for cache in caches:
            cache.set_device_length(cache.length)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            reset()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    owner = caches[0]
    if owner._pool is None:
        owner._pool = torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.graph(graph, pool=owner._pool):
            out = fn()
    except Exception as err:  # name what was captured; never fall back silently
        raise RuntimeError(f"CUDA graph capture of {what} failed ({err!r}); decode with cuda_graphs=False") from err
    reset()
    return graph, out


def _hf_forward(model: nn.Module, ids: torch.Tensor, cache: Any, last_only: bool, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """ids: [1, S] -> logits [S, V] (or [1, V]). mask [1, 1, S, kv] and positions [1, S]: a tree forward's. keep
    [1]: the position whose logits a last_only forward returns, where the last is padding."""
    extra = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
    to_keep = keep if keep is not None and last_only else (1 if last_only else 0)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=to_keep, **extra)
    return out.logits[0]


def _attention_mask(model: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """A boolean 4D mask (True: attend) in the form the model's attention takes it: HF passes a 4D mask through
    unchanged, so it must already be sdpa's boolean or eager's additive one."""
    impl = model.config._attn_implementation
    if impl in ("sdpa", STATIC_SDPA, STATIC_SPLIT_KV):  # the split-KV one sends multi-token forwards to sdpa
        return mask
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    raise ValueError(f"tree attention supports the sdpa and eager attention implementations, not {impl!r}")


STATIC_SDPA = "sdsie_static_sdpa"
STATIC_SPLIT_KV = "sdsie_static_split_kv"
DECODE_ATTENTIONS = ("sdpa", "split_kv")  # DecodeConfig.attention: a one-token step's attention over a static cache


@contextmanager
def _static_attention(model: nn.Module, attention: str = "sdpa") -> Iterator[None]:
    """HF's sdpa over the static cache, with three changes that leave every attention score as it was:

    - The causal mask is always built on the device. For a multi-token forward over a static cache, HF's sdpa mask
      asks on the host whether the mask can be skipped (`q_offset == 0` on the cache's device-side counter): a device
      sync, which a CUDA graph capture cannot contain. The mask it then builds is the same.
    - The mask is made additive (0 / -inf, the model's dtype) once per forward, not by sdpa in every layer: the same
      values sdpa's own conversion of a boolean mask gives.
    - A one-token forward of a grouped-query model packs its query heads onto their key/value heads
      (`_static_sdpa_attention`), so attention reads the cache as it is instead of a copy of it per query head.

    attention="split_kv" sends a one-token forward's attention to `sdsie.kernels.decode_attention` instead of torch's
    sdpa (`_static_split_kv_attention`): the cache's positions split across many programs, where sdpa's fused kernel
    runs one program per key/value head over the whole cache. Models on another attention implementation are left as
    they are.
    """
    config = model.config
    if config._attn_implementation != "sdpa":
        yield
        return
    _register_static_sdpa()
    config._attn_implementation = STATIC_SPLIT_KV if attention == "split_kv" else STATIC_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def _static_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """HF's sdpa mask without the host-side skip question, as an additive mask in the model's dtype: built once per
    forward, where sdpa would convert a boolean one in every layer (a kernel per layer eagerly, and under inductor
    one more input to lay out for every attention call)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    dtype = kwargs.get("dtype")
    if mask is None or mask.dtype != torch.bool or dtype is None or not dtype.is_floating_point:
        return mask
    if torch.compiler.is_compiling():
        return additive_mask(mask, dtype)
    return _additive(mask, dtype)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attended, -inf elsewhere: what scaled_dot_product_attention makes of a boolean mask itself."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), float("-inf"))


@torch.library.custom_op("sdsie::additive_mask", mutates_args=())
def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_additive` as an op, for compiled forwards: inductor inlines a pointwise mask into each consumer that reads
    it, and a layer's attention op is one, so every layer recomputed the mask in a kernel of its own (32 a Llama-3.1-8B
    token). An op's output is one tensor, computed once per forward, that every layer reads."""
    return _additive(mask, dtype)


@additive_mask.register_fake
def _(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(mask.shape, dtype=dtype, device=mask.device)


def _static_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention, but a one-token forward of a grouped-query model (query [B, H, 1, D], keys and values
    [B, H_kv, S, D]) packs each group's query heads as the query rows of its key/value head ([B, H_kv, H / H_kv, D]):
    every head attends over the same positions, so the scores are the same, and the cache is read as it is.

    HF's sdpa repeats the keys and values to every query head whenever a mask is passed (the fused kernels take no
    mask with grouped heads): under a static cache, a copy of the whole cache per layer and token, in every step.
    transformers 5.25 packs the heads this way in its eager decode but not while torch.compile traces it (earlier
    versions may not at all), so a compiled decode step copies the cache. Other forwards go to HF's sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, _, dim = query.shape
    groups = heads // key.shape[1]
    if not _one_token_step(query, key, dropout, kwargs) or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    packed = query.reshape(batch, heads // groups, groups, dim)
    mask = attention_mask
    if mask is not None and mask.dim() == 4 and mask.shape[1] != 1:  # a per-head mask follows its heads
        mask = mask.reshape(mask.shape[0], heads // groups, groups, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)  # [B, H_kv, H / H_kv, Dv]
    return out.reshape(batch, 1, heads, value.shape[-1]), None  # HF's layout: [B, S, H, Dv]


def _one_token_step(query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict[str, Any]) -> bool:
    """A one-token forward whose query heads group evenly onto the key/value heads, with nothing but a mask added to
    the scores: the step both static attentions pack."""
    heads, kv_heads = query.shape[1], key.shape[1]
    return (query.shape[2] == 1 and heads % kv_heads == 0 and not dropout and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))


def _static_split_kv_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                               is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`_static_sdpa_attention`, with a one-token step's packed query ([B, H_kv, H / H_kv, D]) attending through
    `decode_attention`, the split-KV kernel (which refuses a device it does not run on); its mask must be one row
    shared by every head ([B or 1, 1, 1, S]). Any other forward goes to `_static_sdpa_attention`."""
    from sdsie.kernels.decode_attention import decode_attention

    batch, heads, _, dim = query.shape
    mask = attention_mask
    shared_mask = mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1)
    if not (_one_token_step(query, key, dropout, kwargs) and shared_mask):
        return _static_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    packed = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    out = decode_attention(packed, key, value, mask, scaling)  # [B, H_kv, H / H_kv, Dv]
    return out.reshape(batch, 1, heads, value.shape[-1]), None  # HF's layout: [B, S, H, Dv]


@functools.cache
def _register_static_sdpa() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(STATIC_SDPA, _static_sdpa_attention)
    AttentionMaskInterface.register(STATIC_SDPA, _static_sdpa_mask)
    AttentionInterface.register(STATIC_SPLIT_KV, _static_split_kv_attention)
    AttentionMaskInterface.register(STATIC_SPLIT_KV, _static_sdpa_mask)


def new_cache(model: nn.Module) -> Any:
    """An empty HF DynamicCache for `model`."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 takes no config
        return DynamicCache()


def forward(model: nn.Module, ids: torch.Tensor, cache: Any, last_only: bool, variant: Hashable = None) -> torch.Tensor:
    """ids: [S] -> logits [S, V] (or [1, V] with last_only), appending S positions to `cache`.
    variant: for a graphed StaticKV, the state that selects the graph (see StaticKV).
    Tree forwards (tokens attending as a token tree): sdsie.decoding.tree.tree_forward."""
    if isinstance(cache, StaticKV):
        return cache.forward(model, ids, last_only, variant)
    return _hf_forward(model, ids[None], cache, last_only)


def compact_cache(cache: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move cache positions src [n] to dst [n] in every layer (a tree's kept path to the slots after its root).
    Reads all of src before writing, so the two may overlap; device-side indices, no host sync."""
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"compact_cache needs src and dst of one shape [n], got {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if isinstance(cache, StaticKV) and cache.kv is not None:  # all layers at once: [L, 2, B, H, S, D]
        cache.kv.index_copy_(4, dst, cache.kv.index_select(4, src))
        return
    for layer in cache.cache.layers if isinstance(cache, StaticKV) else cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:  # a layer not yet initialized
            continue
        for t in (layer.keys, layer.values):  # [B, H, S, D]
            t.index_copy_(2, dst, t.index_select(2, src))


def cache_length(cache: Any) -> int:
    """Positions held, read on the host (a StaticKV keeps its own count; no device sync)."""
    return cache.length if isinstance(cache, StaticKV) else cache.get_seq_length()


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions. Uses the negative form (remove a count), valid across HF versions."""
    if isinstance(cache, StaticKV):
        cache.crop(length)
        return
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} positions, cannot crop up to {length}")
    if excess > 0:
        cache.crop(-excess)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostRead:
    """A cycle's one device->host read of ints [A] and floats [B] in a single transfer (float64 holds both), started
    when made and waited for by `wait`. On CUDA the copy goes to pinned host memory behind an event, so device work
    launched between the two (the next plain step, launched ahead) runs before the host waits and does not delay it."""

    def __init__(self, ints: torch.Tensor, floats: torch.Tensor) -> None:
        both = torch.cat([ints.double(), floats.double()])  # [A + B]
        self._ints = ints.numel()
        self._event: Any = None
        if both.is_cuda:
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = both

    def wait(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        return [int(x) for x in values[: self._ints]], values[self._ints :]


def to_host(ints: torch.Tensor, floats: torch.Tensor) -> tuple[list[int], list[float]]:
    """A device->host read of ints [A] and floats [B], waited for at once (HostRead)."""
    return HostRead(ints, floats).wait()


def module_fingerprint(model: nn.Module) -> tuple:
    """What a CUDA graph captured on `model` depends on: each submodule's name and class, and each parameter's and
    buffer's name, address, shape and dtype. Swapping a module (quantize_model, gate_model, fuse_rmsnorm) or a
    tensor's storage changes it; writing new values into the same storage does not (a replay reads them). Cheap
    enough for once per run: one walk of the module tree, no device work."""
    modules = tuple((name, type(module)) for name, module in model.named_modules())
    tensors = tuple((name, t.data_ptr(), tuple(t.shape), t.dtype, t.device)
                    for named in (model.named_parameters(), model.named_buffers()) for name, t in named)
    return modules, tensors


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_prompt(prompt_ids: torch.Tensor | Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[S] or [1, S] token ids in [0, vocab) -> [S] int64 on device; ValueError otherwise."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt.dim() == 2:
        if prompt.shape[0] != 1:
            raise ValueError(f"decoding is batch 1; got a batch of {prompt.shape[0]} prompts")
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise ValueError(f"prompt_ids must be [S] or [1, S], got shape {tuple(prompt.shape)}")
    if prompt.numel() == 0:
        raise ValueError("prompt_ids is empty: at least one token is needed to condition on")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompt_ids must lie in [0, {vocab}), got values in [{lo}, {hi}]")
    return prompt.to(device)
