"""GPU energy over a window of work, the Zeus way (its measurement windows and idle baseline).

Backends, chosen once when the meter is built and recorded in every result:

    nvml_energy_counter  nvmlDeviceGetTotalEnergyConsumption (mJ since driver load) read at both
                         edges of the window, each edge after a device synchronization.
    nvml_power_polling   only where the counter is unsupported: a background thread samples
                         nvmlDeviceGetPowerUsage (mW) and the samples, including one at each edge,
                         are integrated with the trapezoid rule.

Refusals (an error, never a number): a window shorter than `min_window_s` (default: the
counter's ~100 ms update period), a counter that did not advance (that is "no reading", not
0 J), a counter that went backwards (wrap or driver reset), any NVML error inside the window.

Gross energy is what is measured. An idle baseline (`measure_idle`) is measured separately and
reported beside it: `idle_energy_j = idle power x window duration`, `net = gross - idle`.
J/token = gross window energy / tokens generated in that window.

    meter = EnergyMeter()                       # EnergyUnavailable(reason) without NVML / GPU
    meter.measure_idle(5.0)
    with meter.window() as w:
        tokens = generate(...)
        w.tokens = tokens
    w.result.j_per_token, w.result.to_metrics("decode.")
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sdsie.telemetry.env import gpu_state, load_nvml

__all__ = [
    "BACKEND_COUNTER",
    "BACKEND_POLLING",
    "COUNTER_UPDATE_PERIOD_S",
    "EnergyMeter",
    "EnergyMeterError",
    "EnergyUnavailable",
    "EnergyWindow",
    "IdleBaseline",
    "OpenWindow",
    "WindowTooShortError",
    "calls_to_fill",
    "integrate_power",
]

BACKEND_COUNTER = "nvml_energy_counter"
BACKEND_POLLING = "nvml_power_polling"
COUNTER_UPDATE_PERIOD_S = 0.1  # NVML's energy counter / power sensor refresh (~100 ms)
_NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED


class EnergyUnavailable(RuntimeError):
    """No energy backend on this machine; the message says what is missing."""


class EnergyMeterError(RuntimeError):
    """A window produced no trustworthy reading; the message says why."""


class WindowTooShortError(EnergyMeterError):
    """The window is shorter than the counter's update period: its reading would be noise or 0 J."""


@dataclass(frozen=True)
class IdleBaseline:
    """Idle draw of the device, measured with the meter's own backend over an empty window."""

    power_w: float
    duration_s: float
    energy_j: float
    backend: str
    method: str = "device synchronized, no work submitted, energy over the window / its duration"


@dataclass(frozen=True)
class EnergyWindow:
    """Energy of one window of work. `energy_j` is gross (nothing subtracted)."""

    backend: str
    duration_s: float
    energy_j: float
    tokens: int | None
    idle: IdleBaseline | None
    start_state: dict[str, Any]
    end_state: dict[str, Any]
    power_samples: int | None = None  # polling backend only

    @property
    def mean_power_w(self) -> float:
        return self.energy_j / self.duration_s

    @property
    def idle_energy_j(self) -> float | None:
        return None if self.idle is None else self.idle.power_w * self.duration_s

    @property
    def net_energy_j(self) -> float | None:
        idle = self.idle_energy_j
        return None if idle is None else self.energy_j - idle

    @property
    def j_per_token(self) -> float | None:
        return None if self.tokens is None else self.energy_j / self.tokens

    def to_metrics(self, prefix: str = "energy.") -> dict[str, float]:
        """Flat numeric metrics for a run record (only the values that exist)."""
        values = {
            "energy_j": self.energy_j,
            "duration_s": self.duration_s,
            "mean_power_w": self.mean_power_w,
            "j_per_token": self.j_per_token,
            "idle_power_w": None if self.idle is None else self.idle.power_w,
            "idle_energy_j": self.idle_energy_j,
            "net_energy_j": self.net_energy_j,
        }
        return {f"{prefix}{k}": float(v) for k, v in values.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        """Everything, including edge states, for a record's config or environment."""
        return {**asdict(self), "mean_power_w": self.mean_power_w, "j_per_token": self.j_per_token,
                "idle_energy_j": self.idle_energy_j, "net_energy_j": self.net_energy_j}


def calls_to_fill(seconds_per_call: float, window_s: float, minimum: int = 1) -> int:
    """Back-to-back calls of `seconds_per_call` each that fill a window of at least `window_s` (at least `minimum`):
    work too short for the counter's update period is measured over many calls in one window, not one call each."""
    if not seconds_per_call > 0 or not window_s > 0:
        raise ValueError(f"calls_to_fill: seconds_per_call and window_s must be > 0, got {seconds_per_call}, "
                         f"{window_s}")
    if minimum < 1:
        raise ValueError(f"calls_to_fill: minimum must be >= 1, got {minimum}")
    return max(minimum, math.ceil(window_s / seconds_per_call))


def integrate_power(times_s: Sequence[float], watts: Sequence[float]) -> float:
    """Trapezoid integral of power samples, in joules. Needs >= 2 samples and non-decreasing times."""
    if len(times_s) != len(watts):
        raise ValueError(f"{len(times_s)} timestamps but {len(watts)} power samples")
    if len(times_s) < 2:
        raise ValueError(f"need at least 2 power samples to integrate, got {len(times_s)}")
    steps = range(len(times_s) - 1)
    if any(times_s[i + 1] < times_s[i] for i in steps):
        raise ValueError("power sample timestamps must be non-decreasing")
    return sum((times_s[i + 1] - times_s[i]) * (watts[i] + watts[i + 1]) / 2 for i in steps)


@dataclass
class OpenWindow:
    """A started window; pass it to `EnergyMeter.stop`. `tokens` may be set before stopping."""

    t0: float
    start_state: dict[str, Any]
    energy_mj: int | None = None
    poller: _PowerPoller | None = None
    tokens: int | None = None
    result: EnergyWindow | None = field(default=None, repr=False)


class _PowerPoller:
    """Background thread sampling power (W) every `interval_s` until stopped."""

    def __init__(self, read_w: Callable[[], float], clock: Callable[[], float], interval_s: float) -> None:
        self._read_w, self._clock, self._interval = read_w, clock, interval_s
        self.times: list[float] = []
        self.watts: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sdsie-power-poller", daemon=True)

    def sample(self) -> None:
        watts = self._read_w()
        with self._lock:
            self.times.append(self._clock())
            self.watts.append(watts)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sample()
            except BaseException as err:  # surfaced by finish(); a silent gap would bias the integral
                self._error = err
                return

    def abort(self) -> None:
        self._stop.set()
        self._thread.join()

    def finish(self) -> tuple[list[float], list[float]]:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise EnergyMeterError(f"power polling failed inside the window: {_describe(self._error)}")
        self.sample()
        return self.times, self.watts


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _default_sync(device_index: int) -> Callable[[], None]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return lambda: None
    if not torch.cuda.is_available():
        return lambda: None
    return lambda: torch.cuda.synchronize(device_index)


class EnergyMeter:
    """NVML energy over windows of GPU work; see the module docstring.

    `nvml`, `sync`, `clock` and `sleep` are injectable (tests drive the meter with a fake NVML).
    `sync` defaults to `torch.cuda.synchronize(device_index)`; pass your own where NVML and CUDA
    number devices differently (CUDA_VISIBLE_DEVICES).
    """

    def __init__(
        self,
        device_index: int = 0,
        *,
        nvml: Any = None,
        sync: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        min_window_s: float = COUNTER_UPDATE_PERIOD_S,
        poll_interval_s: float = 0.01,
    ) -> None:
        if not min_window_s > 0:
            raise ValueError(f"min_window_s must be > 0, got {min_window_s!r}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self.device_index = device_index
        self.min_window_s = min_window_s
        self.poll_interval_s = poll_interval_s
        self._sync = sync if sync is not None else _default_sync(device_index)
        self._clock, self._sleep = clock, sleep
        self._nvml, self._handle = _open_device(nvml, device_index)
        self.backend, self.backend_reason = _choose_backend(self._nvml, self._handle)
        self.idle: IdleBaseline | None = None

    @staticmethod
    def available(device_index: int = 0, nvml: Any = None) -> tuple[bool, str]:
        """(True, backend description) or (False, what is missing), without raising."""
        try:
            lib, handle = _open_device(nvml, device_index)
            backend, reason = _choose_backend(lib, handle)
        except EnergyUnavailable as err:
            return False, str(err)
        return True, f"{backend}: {reason}"

    # -- windows -------------------------------------------------------------------------------
    def start(self, snapshot: bool = True, sync: bool = True) -> OpenWindow:
        """Synchronize the device and open a window at this edge. snapshot=False skips the GPU state read (clocks,
        temperature: several NVML queries) where a window's energy is all that is wanted, as per server request.
        sync=False reads at once, for a caller that knows no earlier work is in flight (a server between requests)
        and opens the window from another thread while the window's work is being launched."""
        if sync:
            self._sync()
        state = self._state() if snapshot else {}
        if self.backend == BACKEND_COUNTER:
            energy = self._counter_mj()
            return OpenWindow(t0=self._clock(), start_state=state, energy_mj=energy)
        poller = _PowerPoller(self._power_w, self._clock, self.poll_interval_s)
        try:
            poller.start()
        except Exception as err:
            raise EnergyMeterError(f"power reading failed at window start: {_describe(err)}") from err
        return OpenWindow(t0=poller.times[0], start_state=state, poller=poller)

    def stop(self, window: OpenWindow, tokens: int | None = None, snapshot: bool = True) -> EnergyWindow:
        """Synchronize the device, close `window` and return its energy (raises on no reading); snapshot as in
        start."""
        tokens = window.tokens if tokens is None else tokens
        _check_tokens(tokens)
        self._sync()
        if window.poller is not None:
            times, watts = _finish_poller(window.poller)
            t1, energy_j, n_samples = times[-1], integrate_power(times, watts), len(times)
        else:
            assert window.energy_mj is not None
            e1, t1 = self._counter_mj(), self._clock()
            energy_j, n_samples = _counter_delta_j(window.energy_mj, e1), None
        duration = t1 - window.t0
        self._check_duration(duration)
        if energy_j <= 0:
            raise EnergyMeterError(f"no energy registered over {duration:.3f} s ({self.backend}): no reading")
        result = EnergyWindow(self.backend, duration, energy_j, tokens, self.idle,
                              window.start_state, self._state() if snapshot else {}, n_samples)
        window.result = result
        return result

    @contextlib.contextmanager
    def window(self, tokens: int | None = None) -> Iterator[OpenWindow]:
        """`with meter.window() as w: ...; w.tokens = n` then read `w.result`."""
        open_window = self.start()
        open_window.tokens = tokens
        try:
            yield open_window
        except BaseException:
            if open_window.poller is not None:
                open_window.poller.abort()
            raise
        self.stop(open_window)

    def measure_idle(self, duration_s: float = 5.0) -> IdleBaseline:
        """Idle power over an empty synchronized window; stored and reported beside later windows."""
        if duration_s < self.min_window_s:
            raise WindowTooShortError(f"idle window {duration_s} s is shorter than {self.min_window_s} s")
        window = self.start()
        self._sleep(duration_s)
        w = self.stop(window)
        self.idle = IdleBaseline(power_w=w.mean_power_w, duration_s=w.duration_s, energy_j=w.energy_j,
                                 backend=w.backend)
        return self.idle

    # -- NVML reads ------------------------------------------------------------------------------
    def _counter_mj(self) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as err:
            raise EnergyMeterError(f"NVML energy counter read failed: {_describe(err)}") from err

    def _power_w(self) -> float:
        return float(self._nvml.nvmlDeviceGetPowerUsage(self._handle)) / 1000.0

    def _state(self) -> dict[str, Any]:
        return {"t": time.time(), **gpu_state(self._nvml, self._handle)}

    def _check_duration(self, duration: float) -> None:
        if duration < self.min_window_s:
            raise WindowTooShortError(
                f"window of {duration * 1e3:.1f} ms is shorter than {self.min_window_s * 1e3:.0f} ms "
                f"(NVML updates about every {COUNTER_UPDATE_PERIOD_S * 1e3:.0f} ms): "
                "measure more tokens or repetitions per window"
            )


def _finish_poller(poller: _PowerPoller) -> tuple[list[float], list[float]]:
    try:
        return poller.finish()
    except EnergyMeterError:
        raise
    except Exception as err:
        raise EnergyMeterError(f"power reading failed at window end: {_describe(err)}") from err


def _counter_delta_j(e0_mj: int, e1_mj: int) -> float:
    if e1_mj < e0_mj:
        raise EnergyMeterError(
            f"NVML energy counter went backwards ({e0_mj} -> {e1_mj} mJ): wrap or driver reset, window discarded"
        )
    return (e1_mj - e0_mj) / 1000.0


def _check_tokens(tokens: int | None) -> None:
    if tokens is None:
        return
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1 (J/token is undefined otherwise), got {tokens!r}")


def _open_device(nvml: Any, device_index: int) -> tuple[Any, Any]:
    lib, reason = load_nvml(nvml)
    if lib is None:
        raise EnergyUnavailable(reason)
    try:
        handle = lib.nvmlDeviceGetHandleByIndex(device_index)
    except Exception as err:
        raise EnergyUnavailable(f"no GPU at NVML index {device_index}: {_describe(err)}") from None
    return lib, handle


def _not_supported(nvml: Any, err: BaseException) -> bool:
    code = getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", _NVML_ERROR_NOT_SUPPORTED)
    return getattr(err, "value", None) == code


def _choose_backend(nvml: Any, handle: Any) -> tuple[str, str]:
    try:
        nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return BACKEND_COUNTER, "total-energy counter supported"
    except Exception as err:
        if not _not_supported(nvml, err):
            raise EnergyUnavailable(f"NVML energy counter failed: {_describe(err)}") from None
    try:
        nvml.nvmlDeviceGetPowerUsage(handle)
    except Exception as err:
        raise EnergyUnavailable(
            f"neither the NVML energy counter nor power usage is readable: {_describe(err)}"
        ) from None
    return BACKEND_POLLING, "energy counter not supported on this GPU; polling power usage"
