"""INT4 weights: calibration, safetensors I/O, the INT4 / gated layers, q/k/v and gate/up fusion, and the decoder's
norms and residual adds moved into the INT4 projections.

The packed format itself (`Int4Weight`) lives in `sdsie.int4_format`, below both this package and the kernels,
and is re-exported here.
"""

from sdsie.int4_format import Int4Weight, pack_int4, unpack_int4
from sdsie.quant.calibrate import CalibratedWeight, LayerReport, QuantConfig, calibrate, layer_report, preset, sqnr_db
from sdsie.quant.decode import DECODE_LINEARS, Int4Decode, quantize_for_decode
from sdsie.quant.fuse import FusionReport, fuse_projections
from sdsie.quant.gated import GatedLinear, GearState, gate_model
from sdsie.quant.io import load_int4_weight, load_int4_weights, save_int4_weight, save_int4_weights
from sdsie.quant.linear import Int4Linear, QuantReport, quantize_model, select_linears
from sdsie.quant.norms import NormFusion, fuse_norms, unfuse_norms

__all__ = [
    "DECODE_LINEARS",
    "CalibratedWeight",
    "FusionReport",
    "GatedLinear",
    "GearState",
    "Int4Decode",
    "Int4Linear",
    "Int4Weight",
    "LayerReport",
    "NormFusion",
    "QuantConfig",
    "QuantReport",
    "calibrate",
    "fuse_norms",
    "fuse_projections",
    "gate_model",
    "layer_report",
    "load_int4_weight",
    "load_int4_weights",
    "pack_int4",
    "preset",
    "quantize_for_decode",
    "quantize_model",
    "save_int4_weight",
    "save_int4_weights",
    "select_linears",
    "sqnr_db",
    "unfuse_norms",
    "unpack_int4",
]
