"""Inductor's Triton code for a compiled INT4 prompt (or step) with programmatic-launch code generation forced on,
generated on a CPU: where each kernel waits (`gdc_wait`) and lets the next one start (`gdc_launch_dependents`)
against its loads and stores. It reads the code only: kernels are not compiled or run (the call fails at the first
kernel, after inductor has generated them all).

The GPU's lowering differs in places (attention, reduction splits, the INT4 op's fused epilogues at M = 1), so this
shows the form of inductor's waits, not the GPU's exact kernels (docs/log.md 2026-12-06 16:45).

    TRITON_INTERPRET=1 python -m research.inductor_pdl_code --form prompt --widths llama
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator

import sympy
import torch
import torch._inductor.config as inductor_config
import torch.utils._triton as torch_triton
from torch._inductor import async_compile
from torch._inductor.codegen import triton as triton_codegen

from sdsie.decoding.model_io import StaticKV
from sdsie.quant import quantize_for_decode

MARKS = re.compile(r"gdc_wait|gdc_launch_dependents|tl\.load|tl\.store|^\s*def |for r0")
KINDS = ("all", "pointwise", "reduction")


def kernel_kind(kernel: object) -> str:
    """"reduction" where the kernel (or any kernel of a combo kernel) reduces, else "pointwise"."""
    kernels = getattr(kernel, "sub_kernels", None) or [kernel]
    return "reduction" if any(k.features.is_reduction() for k in kernels) else "pointwise"


@contextlib.contextmanager
def programmatic_launch_only_for(kind: str, on_gpu: bool = True) -> Iterator[None]:
    """Inside, inductor generates programmatic launch (where `triton.enable_pdl` asks for it) only for kernels of
    `kind` in graphs with a dynamic length (a compiled prompt's); a static graph's kernels (a decode step's) and, for
    "all", every kernel keep inductor's own rule. Inductor's caches are off inside: a cached graph would carry
    another kind's code. on_gpu=False: as on an sm_90 GPU, on any device (to read code)."""
    from torch._inductor.virtualized import V

    own = triton_codegen.TritonKernel.__dict__["_enable_pdl_codegen"]

    def enabled() -> bool:
        if not (own.__func__() if on_gpu else inductor_config.triton.enable_pdl):
            return False
        if kind == "all" or not any(isinstance(v, sympy.Expr) for v in V.graph.graph_inputs.values()):
            return True  # no size taken as an input: a static graph
        return kernel_kind(V.kernel) == kind

    triton_codegen.TritonKernel._enable_pdl_codegen = staticmethod(enabled)
    try:
        with inductor_config.patch(force_disable_caches=True):
            yield
    finally:
        triton_codegen.TritonKernel._enable_pdl_codegen = own


def build(widths: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sdsie.models import tiny_llama

    if widths == "tiny":
        return tiny_llama(vocab_size=256, hidden_size=256, num_layers=2, seed=0)
    torch.manual_seed(0)  # Llama-3.1-8B's widths, two layers, a smaller vocabulary
    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                        tie_word_embeddings=False)).eval()


def kernel_sources(model: torch.nn.Module, form: str, kind: str = "all") -> dict[str, str]:
    """Each Triton kernel inductor generates for one compiled forward of `form` ("prompt": 32 tokens, a dynamic
    length, logits at one position; "step": one token), on a cache already set up as the engine sets it up; `kind`:
    the prompt's kernels that get programmatic launch (programmatic_launch_only_for)."""
    sources: dict[str, str] = {}
    inductor_config.cpu_backend = "triton"
    inductor_config.combo_kernels = True
    inductor_config.triton.enable_pdl = True
    inductor_config.compile_threads = 1
    torch_triton.triton_hash_with_backend = lambda: "0" * 64  # no Triton driver on a CPU
    async_compile.AsyncCompile.triton = lambda self, name, source, device_str="cuda": sources.setdefault(name, source)
    kv = StaticKV(model, 256)
    with torch.no_grad():
        kv.forward(model, torch.arange(1, 17), True)  # the cache's first forward, then its consolidation
    quantize_for_decode(model)
    n = 1 if form == "step" else 32
    compiled = torch.compile(model, dynamic=form == "prompt")
    with torch.no_grad(), programmatic_launch_only_for(kind, on_gpu=False):
        try:
            kv.model_forward(compiled, torch.arange(1, n + 1)[None], True,
                             keep=None if form == "step" else torch.tensor([n - 1]))
        except Exception:  # the first (uncompiled) kernel's call: every kernel's source is in by then
            pass
    return sources


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--form", choices=("prompt", "step"), default="prompt")
    p.add_argument("--widths", choices=("tiny", "llama"), default="tiny")
    p.add_argument("--kind", choices=KINDS, default="all", help="the prompt's kernels that get programmatic launch")
    args = p.parse_args(argv)
    for name, source in kernel_sources(build(args.widths), args.form, args.kind).items():
        print(f"== {name}")
        print("\n".join(line[:150] for line in source.splitlines() if MARKS.search(line)))


if __name__ == "__main__":
    main()
