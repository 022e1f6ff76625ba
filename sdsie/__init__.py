"""SDSIE: energy-proportional LLM decoding, and the package that re-measures every claim about it."""

from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.entropy import entropy

__all__ = ["ClutchConfig", "EntropyClutch", "entropy"]
__version__ = "0.1.0"
