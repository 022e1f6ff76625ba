"""Environment capture for run records, and the one place NVML is opened.

Everything a reader needs to cite or re-run a measurement: git sha + dirty flag, date, python and
library versions, CUDA runtime, GPU name / driver / clocks / power limit / temperature (NVML),
seeds, model checkpoint hashes, prompt hashes (lm-evaluation-harness practice).

NVML is reached through a backend object with pynvml's names (`nvmlInit`,
`nvmlDeviceGetHandleByIndex`, ...): the `pynvml` module itself (package nvidia-ml-py) in
production, a fake in CPU tests.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "capture_environment",
    "checkpoint_hash",
    "gpu_state",
    "host_launch_us",
    "load_nvml",
    "module_hash",
    "nvml_device_state",
    "text_hash",
    "utc_now",
]

_VERSIONED_PACKAGES = (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "scipy", "nvidia-ml-py",
)


def utc_now() -> str:
    """ISO-8601 UTC timestamp with microseconds."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


# -- NVML ---------------------------------------------------------------------------------------------


def load_nvml(nvml: Any = None) -> tuple[Any | None, str]:
    """Initialised NVML backend, or (None, reason saying what is missing)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        nvml.nvmlInit()
    except Exception as err:  # pynvml raises NVMLError subclasses; a fake may raise anything
        return None, f"NVML could not initialise ({type(err).__name__}: {err}); NVIDIA driver missing?"
    return nvml, "NVML initialised"


def _read(fn: Any, *args: Any) -> tuple[Any, str | None]:
    try:
        value = fn(*args)
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"
    return (value.decode() if isinstance(value, bytes) else value), None


def gpu_state(nvml: Any, handle: Any) -> dict[str, Any]:
    """Power limit, SM / memory clocks and temperature now; a field NVML refuses is None plus an error."""
    state: dict[str, Any] = {}
    errors: dict[str, str] = {}
    probes = {
        "power_limit_w": (nvml.nvmlDeviceGetEnforcedPowerLimit, (handle,), 1e-3),
        "sm_clock_mhz": (nvml.nvmlDeviceGetClockInfo, (handle, nvml.NVML_CLOCK_SM), 1.0),
        "mem_clock_mhz": (nvml.nvmlDeviceGetClockInfo, (handle, nvml.NVML_CLOCK_MEM), 1.0),
        "temperature_c": (nvml.nvmlDeviceGetTemperature, (handle, nvml.NVML_TEMPERATURE_GPU), 1.0),
    }
    for key, (fn, args, scale) in probes.items():
        value, err = _read(fn, *args)
        state[key] = None if value is None else float(value) * scale
        if err is not None:
            errors[key] = err
    if errors:
        state["errors"] = errors
    return state


def nvml_device_state(device_index: int = 0, nvml: Any = None) -> dict[str, Any]:
    """GPU identity and state for a record; `{"unavailable": reason}` without NVML or the device."""
    lib, reason = load_nvml(nvml)
    if lib is None:
        return {"unavailable": reason}
    handle, err = _read(lib.nvmlDeviceGetHandleByIndex, device_index)
    if handle is None:
        return {"unavailable": f"no GPU at index {device_index}: {err}"}
    name, _ = _read(lib.nvmlDeviceGetName, handle)
    driver, _ = _read(lib.nvmlSystemGetDriverVersion)
    return {"index": device_index, "name": name, "driver": driver, **gpu_state(lib, handle)}


# -- hashes ---------------------------------------------------------------------------------------------


def text_hash(text: str) -> str:
    """sha256 of a prompt's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def checkpoint_hash(path: str | os.PathLike[str]) -> str:
    """sha256 of a checkpoint file, or over (relative name, content sha256) of every file in a directory."""
    root = Path(path)
    if root.is_file():
        return _file_sha256(root)
    if not root.is_dir():
        raise ValueError(f"checkpoint path {root} does not exist")
    outer = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        outer.update(f"{file.relative_to(root).as_posix()}\0{_file_sha256(file)}\n".encode())
    return outer.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def module_hash(module: Any) -> str:
    """sha256 over a torch module's state dict (names, dtypes, shapes, bytes): for models built in code."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _model_entry(name: str, model: Any) -> dict[str, Any]:
    if isinstance(model, (str, os.PathLike)):
        if Path(model).exists():
            return {"name": name, "source": str(model), "checkpoint_sha256": checkpoint_hash(model)}
        return {
            "name": name,
            "source": str(model),
            "checkpoint_sha256": None,
            "hash_unavailable": f"{model} is not a local path (hub id?): pass the local checkpoint to hash",
        }
    if hasattr(model, "state_dict"):
        source = f"in-code {type(model).__name__}"
        return {"name": name, "source": source, "checkpoint_sha256": module_hash(model)}
    raise ValueError(f"model {name!r} must be a path, a hub id or a torch module, got {type(model).__name__}")


# -- software -------------------------------------------------------------------------------------------


def _package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for pkg in _VERSIONED_PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions


SOURCE_COMMIT_ENV = "SDSIE_SOURCE_COMMIT"


def git_state(repo: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """HEAD sha and whether tracked files differ from it (untracked files are not counted).

    A working tree copied onto another machine can carry a stale .git: its HEAD is then an older commit and the
    tree shows as dirty against it. Whoever makes the copy can name the commit it came from in the environment
    variable SDSIE_SOURCE_COMMIT; it is recorded beside the copy's own view as `declared_commit`."""
    declared = os.environ.get(SOURCE_COMMIT_ENV) or None
    cwd = Path(repo) if repo is not None else Path(__file__).resolve().parent
    try:
        sha = _git(["rev-parse", "HEAD"], cwd)
        porcelain = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    except (OSError, subprocess.SubprocessError) as err:
        state: dict[str, Any] = {"sha": None, "dirty": None, "unavailable": f"git failed: {err}"}
    else:
        changed = porcelain.splitlines()
        state = {"sha": sha, "dirty": bool(changed), "dirty_files": changed[:50]}
    if declared is not None:
        state["declared_commit"] = declared
    return state


def _git(args: list[str], cwd: Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=20)
    return done.stdout.strip()


def _torch_state() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"available": False}
    state: dict[str, Any] = {"cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        state["device_name"] = torch.cuda.get_device_name(idx)
        state["device_capability"] = list(torch.cuda.get_device_capability(idx))
        state["device_count"] = torch.cuda.device_count()
    return state


def cpu_state() -> dict[str, Any]:
    """The host CPU as it bears on CPU numerics: model name, torch's kernel ISA and thread count. fp32 results of
    the CPU suites differ between CPUs in their low bits (docs/log.md, 2026-12-07), so a record says which one."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass  # not Linux: platform's name stands
    state: dict[str, Any] = {"model": model, "machine": platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        import torch
    except ImportError:
        return state
    state["torch_isa"] = torch.backends.cpu.get_cpu_capability()
    state["torch_threads"] = torch.get_num_threads()
    return state


def per_op_us(loop: Callable[[], None], ops: int, trials: int) -> dict[str, float]:
    """Host microseconds per operation: `loop` performs `ops` operations (and whatever sync it needs); it is timed
    `trials` times -> median, min and max per operation, and the trial count."""
    if ops < 1 or trials < 1:
        raise ValueError(f"ops and trials must be >= 1, got {ops}, {trials}")
    per_op = []
    for _ in range(trials):
        t0 = time.perf_counter()
        loop()
        per_op.append((time.perf_counter() - t0) / ops * 1e6)
    per_op.sort()
    return {"median": per_op[len(per_op) // 2], "min": per_op[0], "max": per_op[-1], "trials": float(trials)}


def host_launch_us(device: Any = "cuda", launches: int = 2000, trials: int = 5) -> dict[str, float]:
    """Host cost of one tiny op launch on `device`, in us: median and spread over `trials` timed loops.

    Each loop launches `launches` one-element in-place adds back to back and synchronizes once, so the
    time is mostly the host's submission cost (a one-element add is far shorter on the GPU than a launch).
    It says how fast the machine's host is: plain decoding of the stand-in pair, a small model, ran at 99.9
    and 64.2 tok/s (medians, records 81adafc6 and af6c76f9) on two machines of one GPU kind.
    """
    import torch

    if launches < 1 or trials < 1:
        raise ValueError(f"launches and trials must be >= 1, got {launches}, {trials}")
    device = torch.device(device)
    x = torch.zeros(1, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def loop() -> None:
        for _ in range(launches):
            x.add_(1)
        sync()

    for _ in range(launches // 10 + 1):  # warm-up: the op's first launch pays for its setup
        x.add_(1)
    sync()
    return {**per_op_us(loop, launches, trials), "launches": float(launches)}


def _named(kind: str, values: Mapping[str, Any] | Sequence[Any] | None) -> dict[str, Any]:
    if values is None:
        return {}
    if isinstance(values, Mapping):
        return {str(k): v for k, v in values.items()}
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{kind} must be a mapping or a sequence of items, not a single string")
    return {str(i): v for i, v in enumerate(values)}


def _seed_map(seeds: Mapping[str, int] | Sequence[int] | int | None) -> dict[str, int]:
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        return {"seed": seeds}
    seed_map = _named("seeds", seeds)
    bad = {k: v for k, v in seed_map.items() if not isinstance(v, int) or isinstance(v, bool)}
    if bad:
        raise ValueError(f"seeds must be integers, got {bad!r}")
    return seed_map


def capture_environment(
    models: Mapping[str, Any] | None = None,
    prompts: Mapping[str, str] | Sequence[str] | None = None,
    seeds: Mapping[str, int] | Sequence[int] | int | None = None,
    device_index: int = 0,
    repo: str | os.PathLike[str] | None = None,
    nvml: Any = None,
) -> dict[str, Any]:
    """The `environment` dict of a run record.

    models:  name -> local checkpoint path (content-hashed), hub id (kept, with the reason it is not
             hashed) or torch module (state dict hashed).
    prompts: name -> text, or a list of texts; only their sha256 is stored.
    seeds:   an int, a list or a mapping of named seeds.
    GPU fields come from NVML; without it `gpu.unavailable` says what is missing.
    """
    prompt_map = _named("prompts", prompts)
    if any(not isinstance(p, str) for p in prompt_map.values()):
        raise ValueError("prompts must be strings")
    return {
        "date": utc_now(),
        "git": git_state(repo),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_state(),
        "packages": _package_versions(),
        "torch": _torch_state(),
        "gpu": nvml_device_state(device_index, nvml),
        "seeds": _seed_map(seeds),
        "models": [_model_entry(name, m) for name, m in _named("models", models).items()],
        "prompts": {name: text_hash(text) for name, text in prompt_map.items()},
    }
