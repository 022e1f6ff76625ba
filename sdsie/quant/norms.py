"""The decoder's RMS norms and residual adds in the INT4 projections' launches.

A pre-norm decoder layer (Llama, Qwen2, Mistral) runs, per token, `h + attn(norm1(h))` then `h' + mlp(norm2(h'))`.
Compiled, each add and the norm after it is one small kernel of its own: two a layer beside four GEMVs (61 of an INT4
Llama-3.1-8B token's 308 kernels, docs/kernel-log.md 2026-12-06 07:05). `fuse_norms` moves both into the projections:

* the residual add goes into the epilogue of the projection before it (o_proj, down_proj), which also writes the sum
  times the next norm's gain g beside it, and the sum's partial sums of squares over blocks of 16 values: the stream
  between the projections is [h, h * g, row_squares(h)] ([..., norm_stream_width(H)], `sdsie.kernels.int4_matmul`);
* the projections that read a norm (q/k/v, gate/up, the LM head) multiply h * g by their weights and scale each
  output row by rsqrt(mean(h^2) + eps) (`Int4Linear.norm_eps`), the mean from those partial sums: a program of the
  mma kernel reads 4 bytes of them where it would read 32 of h.

The weights are not touched: rs * (W (g * h)) is the norm's output times W, rounded differently from
W (g * bf16(rs * h)). The first layer makes its stream from the embedding in torch. `unfuse_norms` undoes it.
float16 models are refused: the stream holds the sums of squares in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from sdsie.kernels import check_squares_dtype, compose_epilogue
from sdsie.quant.fuse import FusedMLP, FusedProjection
from sdsie.quant.gated import GatedLinear
from sdsie.quant.linear import Int4Linear

__all__ = ["DeferredProjection", "FoldedNorm", "NormFusedLayer", "NormFusion", "fuse_norms", "unfuse_norms"]

QKV = ("q_proj", "k_proj", "v_proj")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _decoder_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of each pre-norm decoder layer: a module with input_layernorm, self_attn,
    post_attention_layernorm and mlp (and no other norm: Gemma's pre/post feed-forward norms are refused)."""
    for name, module in model.named_modules():
        if all(isinstance(getattr(module, part, None), nn.Module) for part in _LAYER_PARTS):
            extra = [n for n, _ in module.named_children() if n.endswith("norm") and n not in _LAYER_PARTS]
            if extra:
                raise ValueError(f"{name}: a decoder layer with norms {extra} besides input_layernorm and "
                                 "post_attention_layernorm is not a pre-norm layer fuse_norms knows")
            yield name, module


def _final_norm(model: nn.Module) -> tuple[nn.Module, str] | None:
    """(owner, attribute) of the norm before the LM head: the `norm` of the module holding the decoder `layers`."""
    for module in model.modules():
        if isinstance(getattr(module, "layers", None), nn.ModuleList) and isinstance(getattr(module, "norm", None),
                                                                                   nn.Module):
            return module, "norm"
    return None


def _eps(norm: nn.Module, name: str) -> float:
    """The RMS norm's epsilon, after checking on a probe that `norm` computes weight * x * rsqrt(mean(x^2) + eps)
    (HF's LlamaRMSNorm and kin, sdsie's FusedRMSNorm); ValueError for anything else (Gemma's (1 + weight) norm, a
    LayerNorm)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"{name}: {type(norm).__name__} is not an RMS norm with a weight and an epsilon")
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, weight.shape[0], generator=gen) * 3).to(weight.device, weight.dtype)
    with torch.no_grad():
        got = norm(x).float()
        xf = x.float()
        want = weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + float(eps))
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
        raise ValueError(f"{name}: {type(norm).__name__} does not compute weight * x * rsqrt(mean(x^2) + eps)")
    return float(eps)


def _readers(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The linears that read each of the layer's norms: (q/k/v or the fused qkv, gate/up or the fused gate_up)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = getattr(attn, "qkv_proj", None)
    attn_readers = [qkv.linear] if isinstance(qkv, FusedProjection) else [getattr(attn, p, None) for p in QKV]
    if isinstance(mlp, FusedMLP):
        return attn_readers, [mlp.gate_up_proj]
    return attn_readers, [getattr(mlp, p, None) for p in ("gate_proj", "up_proj")]


def _gain(norm: nn.Module) -> torch.Tensor:
    return norm.weight.detach()


class DeferredProjection(nn.Module):
    """In an attention's o_proj slot: returns its input, so the layer applies `linear` with the residual itself."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class NormFusedLayer(nn.Module):
    """A pre-norm decoder layer whose norms and residual adds live in its projections (`fuse_norms`): the stream in
    and out is [h, h * g, row_squares(h)] ([B, S, norm_stream_width(H)]; the first layer takes the embedding's h
    alone, [B, S, H]), g being the gain of the norm that reads it."""

    def __init__(self, layer: nn.Module, next_gain: torch.Tensor, first: bool) -> None:
        super().__init__()
        self.layer = layer
        self.first = first
        # [H]: this layer's first norm's gain, which only the first layer applies itself (later layers receive
        # h * gain from the layer before)
        self.register_buffer("gain", _gain(layer.input_layernorm) if first else None, persistent=False)
        self.register_buffer("mlp_gain", _gain(layer.post_attention_layernorm), persistent=False)
        self.register_buffer("next_gain", next_gain, persistent=False)  # [H]: the norm after this layer

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        # hidden_states: [B, S, W] = [h, h * gain, row_squares(h)], W = norm_stream_width(H) (the first layer: h
        # [B, S, H]); the keyword arguments are the model's for its layers
        width = self.mlp_gain.shape[0]  # H
        if self.first:
            h = hidden_states
            stream = compose_epilogue(h, h, out_gain=self.gain)  # [B, S, W]
        else:
            stream = hidden_states
            h = stream[..., :width]
        attn = self.layer.self_attn
        out, _ = attn(hidden_states=stream, **kwargs)  # [B, S, heads * head_dim]: q/k/v read the stream
        mid = attn.o_proj.linear(out, residual=h, out_gain=self.mlp_gain)  # [B, S, W]
        return self.layer.mlp(mid, residual=mid[..., :width], out_gain=self.next_gain)


class FoldedNorm(nn.Module):
    """In the final norm's slot: returns its input (the LM head applies the norm); keeps the norm for
    `unfuse_norms`."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass
class NormFusion:
    """What fuse_norms rewired: the decoder layers' names."""

    layers: list[str]


def _check_int4(readers: list[nn.Module], what: str) -> None:
    for r in readers:
        if not isinstance(r, (Int4Linear, GatedLinear)):
            raise ValueError(f"{what}: fuse_norms needs Int4Linear (or GatedLinear) projections, got "
                             f"{type(r).__name__}")
        if (r.quantized if isinstance(r, GatedLinear) else r).input_scale is not None:
            raise ValueError(f"{what}: an AWQ input scale multiplies the norm's output, which fuse_norms no longer "
                             "forms; use a min-max scheme")


def fuse_norms(model: nn.Module) -> NormFusion:
    """Move each pre-norm decoder layer's RMS norms and residual adds, and the final norm, into the model's INT4
    projections (see the module docstring), in place.

    Needs every decoder linear and the LM head `Int4Linear` without an AWQ input scale, or `GatedLinear` of such an
    INT4 layer (both gears then apply the norm: the full one in torch), q/k/v separate or fused and the MLP fused
    (`fuse_projections`), in bfloat16 or float32. ValueError naming the first part that falls short, before anything
    changes. Module names change (`layers.{i}.layer...`, `o_proj.linear`): save or load weights before, or after
    `unfuse_norms`."""
    if any(isinstance(m, NormFusedLayer) for m in model.modules()):
        raise ValueError("fuse_norms: the model's norms are fused already")
    plan = []
    for name, layer in _decoder_layers(model):
        eps1 = _eps(layer.input_layernorm, f"{name}.input_layernorm")
        eps2 = _eps(layer.post_attention_layernorm, f"{name}.post_attention_layernorm")
        if not isinstance(layer.mlp, FusedMLP):
            raise ValueError(f"{name}.mlp: fuse_norms needs the MLP fused (fuse_projections), got "
                             f"{type(layer.mlp).__name__}")
        attn_readers, mlp_readers = _readers(layer)
        _check_int4(attn_readers + [layer.self_attn.o_proj], f"{name}.self_attn")
        _check_int4(mlp_readers + [layer.mlp.down_proj], f"{name}.mlp")
        plan.append((name, layer, eps1, eps2, attn_readers, mlp_readers))
    if not plan:
        raise ValueError(f"fuse_norms: {type(model).__name__} has no pre-norm decoder layer (input_layernorm, "
                         "self_attn, post_attention_layernorm, mlp)")
    final = _final_norm(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if final is None or head is None:
        raise ValueError(f"fuse_norms: {type(model).__name__} has no final norm before an output embedding")
    final_norm = getattr(*final)
    final_eps = _eps(final_norm, "final norm")
    check_squares_dtype(_gain(final_norm).dtype, "fuse_norms")
    _check_int4([head], "lm_head")
    for index, (name, layer, eps1, eps2, attn_readers, mlp_readers) in enumerate(plan):
        for r in attn_readers:
            r.norm_eps = eps1
        for r in mlp_readers:
            r.norm_eps = eps2
        layer.self_attn.o_proj = DeferredProjection(layer.self_attn.o_proj)
        following = plan[index + 1][1].input_layernorm if index + 1 < len(plan) else final_norm
        fused = NormFusedLayer(layer, _gain(following), first=index == 0)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.ModuleList):
            parent[int(child)] = fused
        else:
            setattr(parent, child, fused)
    head.norm_eps = final_eps
    setattr(*final, FoldedNorm(final_norm))
    return NormFusion([name for name, *_ in plan])


def unfuse_norms(model: nn.Module) -> int:
    """Undo `fuse_norms` in place; returns the layers restored."""
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, NormFusedLayer):
                layer = child.layer
                layer.self_attn.o_proj = layer.self_attn.o_proj.linear
                for r in sum(_readers(layer), []):
                    r.norm_eps = None
                if isinstance(parent, nn.ModuleList):
                    parent[int(child_name)] = layer
                else:
                    setattr(parent, child_name, layer)
                count += 1
            elif isinstance(child, FoldedNorm):
                setattr(parent, child_name, child.norm)
                head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
                if isinstance(head, (Int4Linear, GatedLinear)):
                    head.norm_eps = None
    return count
