"""The decoder's RMS norms and residual adds in the INT4 projections' launches.

A pre-norm decoder layer (Llama, Qwen2, Mistral) runs, per token, `h + attn(norm1(h))` then `h' + mlp(norm2(h'))`.
Compiled, each add and the norm after it is one small kernel of its own: two a layer, beside four GEMVs (64 of a
Llama-3.1-8B token's 308 kernels; busy time in docs/kernel-log.md). Both move into the projections:

* the norm's gain g is folded into the columns of the linears that read the norm (`fold_norm_gains`: W <- W diag(g),
  g <- 1, on the float model, before quantizing), and those linears scale each output row by
  rsqrt(mean(h^2) + eps) themselves (`Int4Linear.norm_eps`: the mma kernel reads h's row once more from L2);
* the residual add moves into the epilogue of the projection before it (o_proj, down_proj: `Int4Linear(x,
  residual=h)`), so the residual stream is what those launches write.

`fuse_norms` then rewires each layer (`NormFusedLayer`) and the final norm (into the LM head); `unfuse_norms` undoes
it. The result computes the same function up to rounding: rs * (W diag(g)) h against W (g * bf16(rs * h)), and one
rounding of each projection's output before its residual add, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from sdsie.quant.fuse import FusedMLP, FusedProjection
from sdsie.quant.linear import Int4Linear

__all__ = ["DeferredProjection", "NormFusedLayer", "NormFusion", "fold_norm_gains", "fuse_norms", "unfuse_norms"]

QKV = ("q_proj", "k_proj", "v_proj")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _decoder_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of each pre-norm decoder layer: a module with input_layernorm, self_attn,
    post_attention_layernorm and mlp (and no other norm: Gemma's pre/post feed-forward norms are refused)."""
    for name, module in model.named_modules():
        if isinstance(module, NormFusedLayer):
            continue
        if all(isinstance(getattr(module, part, None), nn.Module) for part in _LAYER_PARTS):
            extra = [n for n, _ in module.named_children() if n.endswith("norm") and n not in _LAYER_PARTS]
            if extra:
                raise ValueError(f"{name}: a decoder layer with norms {extra} besides input_layernorm and "
                                 "post_attention_layernorm is not a pre-norm layer fuse_norms knows")
            yield name, module


def _final_norm(model: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """(owner, attribute, head) of the norm before the LM head: the base model's `norm` (the module holding the
    decoder `layers`), with the model's output embeddings; None where either is missing."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    for module in model.modules():
        if isinstance(getattr(module, "layers", None), nn.ModuleList) and isinstance(getattr(module, "norm", None),
                                                                                   nn.Module):
            return module, "norm", head
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
        mlp_readers = [mlp.gate_up_proj]
    else:
        mlp_readers = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj")]
    return attn_readers, mlp_readers


@torch.no_grad()
def _fold(norm: nn.Module, readers: list[nn.Module], name: str) -> None:
    if not all(isinstance(r, nn.Linear) for r in readers):
        kinds = sorted({type(r).__name__ for r in readers})
        raise ValueError(f"{name}: the norm's readers are {kinds}; fold_norm_gains folds into nn.Linear weights, "
                         "before quantizing")
    _eps(norm, name)
    g = norm.weight.detach().float()
    for r in readers:
        r.weight.copy_((r.weight.float() * g.to(r.weight.device)).to(r.weight.dtype))
    norm.weight.fill_(1.0)


def fold_norm_gains(model: nn.Module) -> int:
    """Fold each decoder RMS norm's gain into the linears that read it (q/k/v and gate/up; the final norm's into the
    LM head, untied from the input embedding where they shared a weight), setting the gain to 1: the same function up
    to rounding, and the form `fuse_norms` needs. On the float model, before quantizing; returns the norms folded."""
    count = 0
    for name, layer in list(_decoder_layers(model)):
        attn_readers, mlp_readers = _readers(layer)
        _fold(layer.input_layernorm, attn_readers, f"{name}.input_layernorm")
        _fold(layer.post_attention_layernorm, mlp_readers, f"{name}.post_attention_layernorm")
        count += 2
    final = _final_norm(model)
    if final is not None:
        owner, attr, head = final
        inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if inputs is not None and isinstance(head, nn.Linear) and head.weight is inputs.weight:
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
            if hasattr(model.config, "tie_word_embeddings"):
                model.config.tie_word_embeddings = False
        _fold(getattr(owner, attr), [head], "final norm")
        count += 1
    if not count:
        raise ValueError(f"fold_norm_gains: {type(model).__name__} has no pre-norm decoder layer (input_layernorm, "
                         "self_attn, post_attention_layernorm, mlp)")
    return count


class DeferredProjection(nn.Module):
    """In an attention's o_proj slot: returns its input, so the layer applies `linear` with the residual itself."""

    def __init__(self, linear: Int4Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class NormFusedLayer(nn.Module):
    """A pre-norm decoder layer whose norms live in its projections (`fuse_norms`): h -> h + attn(norm1(h)) ->
    that + mlp(norm2(that)), in five launches besides the attention's own (q/k/v, o with the residual, gate/up,
    down with the residual)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        # hidden_states: the residual stream [B, S, H]; the keyword arguments are the model's for its layers
        attn = self.layer.self_attn
        out, _ = attn(hidden_states=hidden_states, **kwargs)  # [B, S, heads * head_dim]: o_proj deferred
        h = attn.o_proj.linear(out, residual=hidden_states)
        return self.layer.mlp(h, residual=h)


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
    """What fuse_norms rewired: the decoder layers' names, and whether the final norm went into the LM head."""

    layers: list[str]
    final: bool


def _check_int4(readers: list[nn.Module], what: str) -> None:
    for r in readers:
        if not isinstance(r, Int4Linear):
            raise ValueError(f"{what}: fuse_norms needs Int4Linear projections, got {type(r).__name__}")
        if r.input_scale is not None:
            raise ValueError(f"{what}: an AWQ input scale is applied before the norm fuse_norms folds; use a min-max "
                             "scheme")


def _check_unit(norm: nn.Module, name: str) -> float:
    eps = _eps(norm, name)
    if not bool((norm.weight == 1).all()):
        raise ValueError(f"{name}: its gain is not 1; fold_norm_gains before quantizing, then fuse_norms")
    return eps


def fuse_norms(model: nn.Module) -> NormFusion:
    """Move each pre-norm decoder layer's RMS norms and residual adds into its INT4 projections, and the final norm
    into the LM head (see the module docstring), in place.

    Needs: gains folded (`fold_norm_gains`, before quantizing), the projections `Int4Linear` without an AWQ input
    scale, q/k/v either separate or fused, and the MLP fused (`fuse_projections`). ValueError naming the first layer
    that falls short, before anything changes."""
    plan = []
    for name, layer in _decoder_layers(model):
        eps1 = _check_unit(layer.input_layernorm, f"{name}.input_layernorm")
        eps2 = _check_unit(layer.post_attention_layernorm, f"{name}.post_attention_layernorm")
        attn_readers, mlp_readers = _readers(layer)
        if not isinstance(layer.mlp, FusedMLP):
            raise ValueError(f"{name}.mlp: fuse_norms needs the MLP fused (fuse_projections), got "
                             f"{type(layer.mlp).__name__}")
        _check_int4(attn_readers + [layer.self_attn.o_proj], f"{name}.self_attn")
        _check_int4(mlp_readers + [layer.mlp.down_proj], f"{name}.mlp")
        plan.append((name, layer, eps1, eps2, attn_readers, mlp_readers))
    if not plan:
        raise ValueError(f"fuse_norms: {type(model).__name__} has no pre-norm decoder layer to fuse")
    final = _final_norm(model)
    final_eps = None
    if final is not None and isinstance(final[2], Int4Linear):
        owner, attr, head = final
        final_eps = _check_unit(getattr(owner, attr), "final norm")
        _check_int4([head], "lm_head")
    for name, layer, eps1, eps2, attn_readers, mlp_readers in plan:
        for r in attn_readers:
            r.norm_eps = eps1
        for r in mlp_readers:
            r.norm_eps = eps2
        layer.self_attn.o_proj = DeferredProjection(layer.self_attn.o_proj)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.ModuleList):
            parent[int(child)] = NormFusedLayer(layer)
        else:
            setattr(parent, child, NormFusedLayer(layer))
    if final_eps is not None:
        owner, attr, head = final
        head.norm_eps = final_eps
        setattr(owner, attr, FoldedNorm(getattr(owner, attr)))
    return NormFusion([name for name, *_ in plan], final_eps is not None)


def unfuse_norms(model: nn.Module) -> int:
    """Undo `fuse_norms` in place (the gains stay folded, at 1); returns the layers restored."""
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
                if isinstance(head, Int4Linear):
                    head.norm_eps = None
    return count
