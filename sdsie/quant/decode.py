"""`quantize_for_decode`: a model in the form its batch-1 decode runs fastest in, in one call.

Every decoder linear and the LM head become `Int4Linear` (`quantize_model`), q/k/v and gate/up are fused
(`fuse_projections`: one INT4 launch each, silu(gate) * up in the second's epilogue) and, with `norms`, each layer's
RMS norms and residual adds move into the INT4 launches (`fuse_norms`). This is the end-to-end suite's
`int4_norms` variant (docs/int4.md; compile its decode step with `sdsie.decoding.DecodeCompiled`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sdsie.quant.calibrate import QuantConfig, preset
from sdsie.quant.fuse import FusionReport, fuse_projections
from sdsie.quant.linear import QuantReport, quantize_model
from sdsie.quant.norms import NormFusion, fuse_norms

__all__ = ["DECODE_LINEARS", "Int4Decode", "quantize_for_decode"]

DECODE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@dataclass(frozen=True)
class Int4Decode:
    """What `quantize_for_decode` did: the calibration report, the fused projections, and the fused norms' layers
    (None where `norms` was off)."""

    quant: QuantReport
    fusion: FusionReport
    norms: NormFusion | None

    def describe(self) -> str:
        """One line for a log: layers quantized, projections fused, norms fused."""
        fused = 0 if self.norms is None else len(self.norms.layers)
        norms = "norms not fused" if self.norms is None else f"norms fused in {fused} layer{'s' * (fused != 1)}"
        return (f"{len(self.quant.layers)} linears INT4, {len(self.fusion.qkv)} q/k/v and {len(self.fusion.gate_up)} "
                f"gate/up fused, {norms}")


def quantize_for_decode(model: nn.Module, config: QuantConfig | None = None, *, norms: bool = True,
                        calibration_inputs: torch.Tensor | None = None) -> Int4Decode:
    """Quantize every decoder linear and the LM head (`DECODE_LINEARS`; min-max groups of 128 unless `config` says
    otherwise), fuse q/k/v and gate/up, and with `norms` fuse the norms and residual adds, in place.

    A model lacking any of those linears, or (with `norms`) whose layers `fuse_norms` refuses (another norm formula,
    extra norms, an AWQ config), is a ValueError naming it; `norms=False` keeps the norms as they are. Module names
    change with fused norms: save or load weights before."""
    config = preset("group") if config is None else config
    if norms and config.scheme != "minmax":
        raise ValueError(f"quantize_for_decode: fused norms need a min-max scheme (an AWQ input scale multiplies the "
                         f"norm's output), got {config.describe()}; pass norms=False")
    report = quantize_model(model, list(DECODE_LINEARS), config, calibration_inputs=calibration_inputs)
    fusion = fuse_projections(model)
    return Int4Decode(report, fusion, fuse_norms(model) if norms else None)
