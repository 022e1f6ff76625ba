"""Save and load packed INT4 weights through safetensors, exactly.

File layout: for each weight named `name`, the tensors `name.qweight`, `name.scales` and (only when
asymmetric) `name.zeros`; the safetensors metadata key `sdsie.int4` holds JSON
`{"version": 1, "weights": {name: {"in_features": K, "group_size": g, "symmetric": bool}}}`.
A single weight is stored under the name `weight`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sdsie.int4_format import Int4Weight

__all__ = ["save_int4_weights", "load_int4_weights", "save_int4_weight", "load_int4_weight"]

METADATA_KEY = "sdsie.int4"
FORMAT_VERSION = 1
SINGLE_NAME = "weight"


def _weight_tensors(name: str, w: Int4Weight) -> dict[str, torch.Tensor]:
    tensors = {f"{name}.qweight": w.qweight, f"{name}.scales": w.scales}
    if w.zeros is not None:
        tensors[f"{name}.zeros"] = w.zeros
    return {key: t.detach().contiguous().cpu() for key, t in tensors.items()}


def save_int4_weights(path: str | Path, weights: Mapping[str, Int4Weight]) -> None:
    """Write a dict of INT4 weights to one safetensors file (tensors are copied to the CPU)."""
    if not weights:
        raise ValueError("save_int4_weights needs at least one weight")
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}
    for name, w in weights.items():
        if not isinstance(w, Int4Weight):
            raise ValueError(f"weight {name!r} is a {type(w).__name__}, not an Int4Weight")
        if not name or name.endswith((".qweight", ".scales", ".zeros")):
            raise ValueError(f"weight name {name!r} is empty or ends with a reserved tensor suffix")
        tensors.update(_weight_tensors(name, w))
        meta[name] = {"in_features": w.in_features, "group_size": w.group_size, "symmetric": w.symmetric}
    header = {METADATA_KEY: json.dumps({"version": FORMAT_VERSION, "weights": meta}, sort_keys=True)}
    save_file(tensors, str(path), metadata=header)


def _read_metadata(path: str | Path, handle) -> dict[str, dict]:
    raw = (handle.metadata() or {}).get(METADATA_KEY)
    if raw is None:
        raise ValueError(f"{path} has no '{METADATA_KEY}' metadata: not written by save_int4_weights")
    meta = json.loads(raw)
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} has INT4 format version {meta.get('version')!r}, expected {FORMAT_VERSION}")
    return meta["weights"]


def _read_tensor(path: str | Path, handle, keys: set[str], key: str, device: str) -> torch.Tensor:
    if key not in keys:
        raise ValueError(f"{path} is missing tensor {key!r}")
    return handle.get_tensor(key).to(device)


def load_int4_weights(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Int4Weight]:
    """Read every INT4 weight of a file written by `save_int4_weights`."""
    weights: dict[str, Int4Weight] = {}
    with safe_open(str(path), framework="pt") as handle:
        meta = _read_metadata(path, handle)
        keys = set(handle.keys())
        for name, info in meta.items():
            parts = ["qweight", "scales"] + ([] if info["symmetric"] else ["zeros"])
            t = {part: _read_tensor(path, handle, keys, f"{name}.{part}", str(device)) for part in parts}
            k, g = int(info["in_features"]), int(info["group_size"])
            weights[name] = Int4Weight(t["qweight"], t["scales"], t.get("zeros"), k, g)
    return weights


def save_int4_weight(path: str | Path, weight: Int4Weight) -> None:
    """Write one INT4 weight (stored under the name `weight`)."""
    save_int4_weights(path, {SINGLE_NAME: weight})


def load_int4_weight(path: str | Path, device: str | torch.device = "cpu") -> Int4Weight:
    """Read the single INT4 weight of a file written by `save_int4_weight`."""
    weights = load_int4_weights(path, device)
    if len(weights) != 1:
        names = sorted(weights)
        raise ValueError(f"{path} holds {len(weights)} INT4 weights ({names}); use load_int4_weights")
    return next(iter(weights.values()))
