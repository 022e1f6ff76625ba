"""`DecodeCompiled`: a model whose decode step runs through torch.compile, as gpt-fast compiles its decode step.

The engine captures the compiled step in its CUDA graphs like any forward, so inductor's fused kernels (norms, RoPE,
residual adds, SiLU) replay with no host work. Prompts (and speculative verification's multi-token forwards) run
eagerly unless `compile_prefill`, which compiles them once more with a dynamic length, inductor's kernels launched
plainly there (see `DecodeCompiled`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DecodeCompiled", "inductor_options", "prompt_compile_kwargs"]


def inductor_options(device: torch.device) -> dict[str, bool]:
    """Inductor's options for a decode step on `device`, those of the end-to-end suite's standing records: combo
    kernels (the rotary and cache kernels of q, k and v as one launch: 374 -> 308 kernels a Llama-3.1-8B INT4 token,
    docs/log.md 2026-12-04) and, on sm_90+, programmatic dependent launch of its kernels (docs/kernel-log.md,
    2026-12-04 20:00). None on a CPU."""
    from sdsie.kernels.device import pdl_on

    if device.type != "cuda":
        return {}
    return {"combo_kernels": True, **({"triton.enable_pdl": True} if pdl_on(device) else {})}


def prompt_compile_kwargs(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The prompt's torch.compile arguments: the step's with a dynamic length and, where inductor compiles,
    `triton.enable_pdl` off (see DecodeCompiled). torch.compile takes a mode or options, not both, so a mode becomes
    its options."""
    kwargs = {**compile_kwargs, "dynamic": True}
    if kwargs.get("backend", "inductor") != "inductor":
        return kwargs
    mode = kwargs.pop("mode", None)
    options = torch._inductor.list_mode_options(mode, True) if mode is not None else kwargs.get("options") or {}
    kwargs["options"] = {**options, "triton.enable_pdl": False}
    return kwargs


class DecodeCompiled(nn.Module):
    """`model` whose one-token forwards (the decode step) run through torch.compile with static shapes, and whose
    longer forwards run through a second compilation with a dynamic length (one graph for every prompt length) where
    compile_prefill is set, otherwise eagerly. compile_kwargs go to torch.compile (backend, mode, options); `dynamic`
    defaults to False for the step: a graph per shape, never a dynamic-shape one.

    Each new shape (a static cache's length) compiles on its first call; under CUDA graphs those calls are the
    capture's warm-up runs.

    The prompt's compilation never launches inductor's kernels as programmatic dependents (`triton.enable_pdl` off
    whatever compile_kwargs say): an INT4 Llama-3.1-8B prompt compiled with them and replayed as a CUDA graph gave
    five different token lists in five identical H100 runs, and one without them (docs/log.md 2026-12-06 16:15).
    The INT4 kernels keep theirs, as beside an eager model's kernels, where they wait for whatever ran before."""

    def __init__(self, model: nn.Module, compile_prefill: bool = False, **compile_kwargs: Any) -> None:
        super().__init__()
        self.model = model
        compile_kwargs.setdefault("dynamic", False)
        self._step = (torch.compile(model, **compile_kwargs),)  # a tuple: the module is registered once, above
        self._prefill = (torch.compile(model, **prompt_compile_kwargs(compile_kwargs)),) if compile_prefill else None

    @property
    def config(self) -> Any:
        return self.model.config

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        if input_ids.shape[-1] == 1:
            run = self._step[0]
        else:
            run = self._prefill[0] if self._prefill is not None else self.model
        return run(input_ids=input_ids, **kwargs)
