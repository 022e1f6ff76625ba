"""Do the decoder's norms in the INT4 projections cost fidelity on a real checkpoint, and would folding the norms'
gains into the weights before quantizing?

SmolLM2-135M-Instruct (the real pair's target, CPU fp32) is quantized whole (every decoder linear and the LM head,
min-max groups of `--group` codes) four ways: as it is; the same INT4 weights with the norms fused into the
projections (`fuse_norms`: the gain multiplies the stream, the weights are untouched); with each norm's gain folded
into the columns of the linears that read it before quantizing (W diag(g), the gain then 1: the other way to take the
norm out of its kernel); and with the final norm's gain alone folded. Each continues the real prompts' fp32 greedy
continuation (teacher-forced, one forward a prompt); per variant: top-1 agreement with fp32's next token, and mean
KL(fp32 || INT4) in nats, over the continuation. The INT4 layers run the kernel's float64 reference (the CPU has no
mma kernel; the fused variant composes its epilogues as every non-mma path does). Answer recorded in docs/log.md and
telemetry/raw/norm_fold_fidelity_smollm2_cpu.json.

    python -m research.norm_fold_fidelity --out telemetry/raw/norm_fold_fidelity_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from reproductions.decode_e2e import LINEARS, int4_kernel
from reproductions.real.suite import load_prompts, load_real_pair, prompts_hash
from sdsie.quant import QuantConfig, fuse_norms, fuse_projections, quantize_model
from sdsie.quant.norms import _decoder_layers, _final_norm, _readers


def continuation_stats(model: torch.nn.Module, ids: torch.Tensor, start: int, ref_logp: torch.Tensor) -> dict:
    """Top-1 agreement with the reference's next token and mean KL(ref || model) over positions start-1 .. end-2."""
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, start - 1 : -1].double(), -1)  # [T, V]
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return {"top1": (logp.argmax(-1) == ref_logp.argmax(-1)).double().mean().item(), "kl": kl.mean().item(),
            "kl_max": kl.max().item()}


@torch.no_grad()
def fold_gains(model: torch.nn.Module, layers: bool = True) -> None:
    """Each RMS norm's gain into the columns of the linears that read it (q/k/v, gate/up, unless not `layers`; the
    final norm's into the LM head, untied from the embedding), the gain set to 1: the same function, other weights to
    quantize."""
    pairs = []
    for _, layer in _decoder_layers(model) if layers else ():
        attn_readers, mlp_readers = _readers(layer)
        pairs += [(layer.input_layernorm, attn_readers), (layer.post_attention_layernorm, mlp_readers)]
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    pairs.append((getattr(*_final_norm(model)), [head]))
    for norm, readers in pairs:
        for r in readers:
            r.weight.mul_(norm.weight.to(r.weight.dtype))
        norm.weight.fill_(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--group", type=int, default=64)
    a = p.parse_args(argv)
    pair = load_real_pair(with_scout=False)
    base = pair.target
    prompts = load_prompts()
    cases = []
    for pid, prompt_ids in pair.prompt_ids(prompts).items():
        ids = torch.tensor([prompt_ids])
        out = base.generate(ids, max_new_tokens=a.new_tokens, do_sample=False)
        with torch.no_grad():
            ref = torch.log_softmax(base(out).logits[0, ids.shape[1] - 1 : -1].double(), -1)
        cases.append((pid, out, ids.shape[1], ref))
    cfg = QuantConfig(group_size=a.group)
    plain = copy.deepcopy(base)
    quantize_model(plain, LINEARS, cfg)
    fuse_projections(plain)
    fused = copy.deepcopy(plain)
    fuse_norms(fused)
    folded, final_folded = copy.deepcopy(base), copy.deepcopy(base)
    fold_gains(folded)
    fold_gains(final_folded, layers=False)
    for model in (folded, final_folded):
        quantize_model(model, LINEARS, cfg)
        fuse_projections(model)
    rows = []
    with int4_kernel(torch.device("cpu")):
        for pid, out, start, ref in cases:
            row = {"prompt": pid, "tokens": out.shape[1] - start}
            for name, model in (("int4", plain), ("int4_fused_norms", fused), ("int4_gains_folded", folded),
                                ("int4_final_gain_folded", final_folded)):
                row[name] = continuation_stats(model, out, start, ref)
            rows.append(row)
            print(json.dumps(row), flush=True)
    gains = torch.cat([layer.weight.detach().float() for _, layer in base.named_modules()
                       if type(layer).__name__.endswith("RMSNorm")])
    doc = {"question": __doc__.splitlines()[0], "norm_gain_range": [gains.min().item(), gains.max().item()],
           "checkpoint_sha256": pair.checkpoint_sha256, "prompts_hash": prompts_hash(prompts), "group_size": a.group,
           "linears": LINEARS, "new_tokens": a.new_tokens, "dtype": "float32", "int4_kernel": "float64 reference",
           "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
