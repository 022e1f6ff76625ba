"""INT4 weights: the packed format, calibration, safetensors I/O, and the INT4 / gated layers.

`Int4Linear`, `quantize_model`, `GatedLinear`, `GearState` and `gate_model` are imported lazily:
they need the Triton kernel package, which itself imports `sdsie.quant.format`.
"""

from __future__ import annotations

import importlib
from typing import Any

from sdsie.quant.calibrate import CalibratedWeight, LayerReport, QuantConfig, calibrate, layer_report, preset, sqnr_db
from sdsie.quant.format import Int4Weight, pack_int4, unpack_int4
from sdsie.quant.io import load_int4_weight, load_int4_weights, save_int4_weight, save_int4_weights

_LAZY = {
    "Int4Linear": "sdsie.quant.linear",
    "QuantReport": "sdsie.quant.linear",
    "quantize_model": "sdsie.quant.linear",
    "select_linears": "sdsie.quant.linear",
    "GatedLinear": "sdsie.quant.gated",
    "GearState": "sdsie.quant.gated",
    "gate_model": "sdsie.quant.gated",
}

__all__ = [
    "CalibratedWeight",
    "Int4Weight",
    "LayerReport",
    "QuantConfig",
    "calibrate",
    "layer_report",
    "load_int4_weight",
    "load_int4_weights",
    "pack_int4",
    "preset",
    "save_int4_weight",
    "save_int4_weights",
    "sqnr_db",
    "unpack_int4",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sdsie.quant' has no attribute {name!r}")
