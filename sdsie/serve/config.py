"""The server's settings: one frozen dataclass, checked on construction."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from sdsie.clutch import SEED_CLUTCHES, ClutchConfig
from sdsie.decoding import DecodeConfig

__all__ = ["ServeConfig", "log_to_stderr", "parse_clutch"]

KV_CACHES = ("dynamic", "static")
DTYPES = ("float32", "float16", "bfloat16")
INT4_PRESETS = ("group", "per-channel")  # min-max schemes: AWQ needs calibration data a server does not have


def log_to_stderr() -> None:
    """The package's INFO lines (what --int4 quantized, dynamo's recompile limit) on stderr beside uvicorn's, in the
    process that loads the models; other libraries' loggers stay as they are."""
    logger = logging.getLogger("sdsie")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.__stderr__)  # the process's own stream, never a replaced one
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def parse_clutch(text: str) -> ClutchConfig | None:
    """'production' or 'tuned' (the seed's settings), 'off' (None), or 'LOW,HIGH[,ALPHA]' thresholds in bits."""
    if text in SEED_CLUTCHES:
        return SEED_CLUTCHES[text]
    if text == "off":
        return None
    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3):
        raise ValueError(f"clutch must be one of {', '.join([*SEED_CLUTCHES, 'off'])} or LOW,HIGH[,ALPHA] in bits, "
                         f"got {text!r}")
    return ClutchConfig(theta_low=values[0], theta_high=values[1], **({"alpha": values[2]} if len(values) == 3 else {}))


@dataclass(frozen=True)
class ServeConfig:
    """What `sdsie serve` runs and how it answers.

    scout None: no speculation. clutch None ('off'): the scout, if any, drafts K in every cycle (fixed-K).
    gear: names of linear layers to gate to INT4 (sdsie.quant.gated.gate_model; needs a clutch), gear_layers:
    which decoder layers (None: all). int4: quantize the target's decoder linears and LM head to INT4 with this
    min-max preset at load, q/k/v and gate/up fused, and with fuse_norms its norms and residual adds in the INT4
    launches (sdsie.quant.quantize_for_decode). compile: a torch.compile backend for the target's decode step
    (sdsie.decoding.DecodeCompiled; needs the static cache); compile_prefill: prompts too, one graph for every
    length. prefill_graphs: replay prompts as CUDA graphs, padded to the engine's prefill sizes
    (DecodeConfig.prefill_graphs; needs cuda_graphs): the prefill launches nothing from the host.
    warm_up: cache lengths (positions: a request's prompt plus max_tokens, rounded up to 256) to run once at load,
    before the server takes requests, so their compilations and graph captures are not a client's wait (twice
    with prefill_graphs: `sdsie.decoding.warm_up_runs`).
    max_tokens: the most a request may ask for.
    context: positions one request may fill, prompt plus max_tokens (None: the target's max_position_embeddings).
    queue_size: requests that may wait behind the running one; one more is answered 503 with Retry-After.
    chat_template: Jinja text that replaces the tokenizer's own (None: keep the tokenizer's, if it has one).
    energy: measure each request's GPU energy where NVML and CUDA are present.
    """

    target: str
    scout: str | None = None
    tokenizer: str | None = None
    model_name: str | None = None
    clutch: ClutchConfig | None = None
    gear: tuple[str, ...] = ()
    gear_layers: tuple[int, ...] | None = None
    int4: str | None = None
    fuse_norms: bool = True
    compile: str | None = None
    compile_prefill: bool = False
    prefill_graphs: bool = False
    warm_up: tuple[int, ...] = ()
    kv_cache: str = "dynamic"
    cuda_graphs: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_tokens: int = 512
    context: int | None = None
    queue_size: int = 16
    chat_template: str | None = None
    energy: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.cuda_graphs and self.kv_cache != "static":
            raise ValueError("cuda_graphs needs kv_cache='static' (a graph replays fixed cache addresses)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.gear and self.clutch is None:
            raise ValueError("gear needs a clutch to drive it: pass clutch (production, tuned or thresholds)")
        if self.int4 is not None and self.int4 not in INT4_PRESETS:
            raise ValueError(f"int4 must be one of {INT4_PRESETS} (min-max; AWQ needs calibration data), got "
                             f"{self.int4!r}")
        if self.int4 is not None and self.fuse_norms and self.dtype == "float16":
            raise ValueError("fuse_norms carries the norms' partial sums of squares in the model's dtype, which "
                             "float16's range cannot hold: serve bfloat16 or float32, or pass fuse_norms=False")
        if self.int4 is not None and self.gear:
            raise ValueError("int4 quantizes every linear of the target, gear gates some of them between bf16 and "
                             "INT4: pass one of them")
        if self.compile is not None and (not isinstance(self.compile, str) or not self.compile):
            raise ValueError(f"compile must be a torch.compile backend name, got {self.compile!r}")
        if self.compile_prefill and self.compile is None:
            raise ValueError("compile_prefill compiles the prompt's forward beside the decode step: it needs compile")
        if self.prefill_graphs and not self.cuda_graphs:
            raise ValueError("prefill_graphs replays the prompt's forward as a CUDA graph: it needs cuda_graphs")
        if self.compile is not None and self.kv_cache != "static":
            raise ValueError("compile needs kv_cache='static' (a dynamic cache changes shape every token, a "
                             "recompilation a token)")
        if self.clutch is not None and self.scout is None and not self.gear:
            raise ValueError("a clutch with neither a scout nor a gear gates nothing: pass scout and/or gear")
        for name, low in (("max_tokens", 1), ("queue_size", 1), ("port", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 2 for n in self.warm_up):
            raise ValueError(f"warm_up must be cache lengths of at least 2 positions, got {self.warm_up!r}")
        if self.port > 65535:
            raise ValueError(f"port must be at most 65535, got {self.port}")
        if self.context is not None and (not isinstance(self.context, int) or self.context < 2):
            raise ValueError(f"context must be an integer >= 2, got {self.context!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")

    def decode_config(self, max_new_tokens: int, **request: Any) -> DecodeConfig:
        """The DecodeConfig of a run this server makes (a request's, or the warm-up's): its cache and graphs, and
        the request's own fields (sampling, eos_token_id)."""
        return DecodeConfig(max_new_tokens=max_new_tokens, kv_cache=self.kv_cache, cuda_graphs=self.cuda_graphs,
                            prefill_graphs=self.prefill_graphs, **request)

    def context_of(self, target: Any) -> int:
        """Positions one request may fill on `target`: `context`, else its config's max_position_embeddings (0 where
        it has none)."""
        return self.context or int(getattr(target.config, "max_position_embeddings", 0) or 0)

    @property
    def served_name(self) -> str:
        """The model id clients name: model_name, else the target's folder or hub id."""
        return self.model_name or self.target.rstrip("/").rsplit("/", 1)[-1]
