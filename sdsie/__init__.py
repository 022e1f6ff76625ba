"""SDSIE: energy-proportional LLM decoding, and the package that re-measures every claim about it.

The public API: `generate` with a `DecodeConfig` (plain, speculative, gated decoding), the entropy clutch
(`EntropyClutch`, `ClutchConfig`), INT4 layers (`quantize_model`, `gate_model`, `int4_matmul`) and the NVML
`EnergyMeter`.
"""

from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, GenerationResult, generate
from sdsie.entropy import entropy
from sdsie.kernels import int4_matmul
from sdsie.quant import GatedLinear, GearState, Int4Linear, QuantConfig, gate_model, quantize_model
from sdsie.telemetry import EnergyMeter

__all__ = [
    "ClutchConfig",
    "DecodeConfig",
    "EnergyMeter",
    "EntropyClutch",
    "GatedLinear",
    "GearState",
    "GenerationResult",
    "Int4Linear",
    "QuantConfig",
    "entropy",
    "gate_model",
    "generate",
    "int4_matmul",
    "quantize_model",
]
__version__ = "0.1.0"
