"""Energy meter: arithmetic and every failure path, driven by a fake NVML; one real-GPU check."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdsie.telemetry.energy import (
    BACKEND_COUNTER,
    BACKEND_POLLING,
    EnergyMeter,
    EnergyMeterError,
    EnergyUnavailable,
    WindowTooShortError,
    calls_to_fill,
    integrate_power,
)
from sdsie.telemetry.fake_nvml import NVML_ERROR_UNKNOWN, FakeNvml, FakeNvmlError


class FakeClock:
    """Time that moves only when the test says so; `sleep` advances it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Device:
    """A fake GPU drawing `watts` (settable), integrated into an mJ counter on the fake clock."""

    def __init__(self, clock: FakeClock, watts: float) -> None:
        self.clock, self.watts = clock, watts
        self.energy_mj, self._last_t = 1_000_000.0, clock.t  # counter is cumulative since driver load

    def counter(self) -> float:
        self.energy_mj += self.watts * (self.clock.t - self._last_t) * 1000.0
        self._last_t = self.clock.t
        return self.energy_mj

    def power_mw(self) -> float:
        return self.watts * 1000.0


def counter_meter(watts: float = 250.0, **kwargs) -> tuple[EnergyMeter, FakeClock, Device, FakeNvml]:
    clock = FakeClock()
    device = Device(clock, watts)
    nvml = FakeNvml(energy_mj=device.counter, power_mw=device.power_mw, **kwargs)
    meter = EnergyMeter(nvml=nvml, sync=lambda: nvml.events.append("sync"), clock=clock, sleep=clock.advance)
    return meter, clock, device, nvml


def test_counter_window_energy_power_and_j_per_token() -> None:
    meter, clock, _, _ = counter_meter(watts=250.0)
    assert meter.backend == BACKEND_COUNTER
    window = meter.start()
    clock.advance(2.0)
    result = meter.stop(window, tokens=100)
    assert result.backend == BACKEND_COUNTER
    assert result.duration_s == 2.0
    assert result.energy_j == pytest.approx(500.0)
    assert result.mean_power_w == pytest.approx(250.0)
    assert result.j_per_token == pytest.approx(5.0)
    assert result.idle is None and result.net_energy_j is None
    assert result.power_samples is None


def test_device_is_synchronized_before_each_counter_read() -> None:
    meter, clock, _, nvml = counter_meter()
    nvml.events.clear()  # drop the backend probe
    with meter.window() as w:
        clock.advance(1.0)
        w.tokens = 10
    assert nvml.events == ["sync", "energy", "sync", "energy"]
    assert w.result is not None and w.result.j_per_token == pytest.approx(25.0)


def test_edge_states_record_power_limit_clocks_and_temperature() -> None:
    meter, clock, _, nvml = counter_meter(temperature_c=40)
    window = meter.start()
    nvml.temperature_c, nvml.clocks[nvml.NVML_CLOCK_SM] = 67, 1755
    clock.advance(1.0)
    result = meter.stop(window)
    assert result.start_state["power_limit_w"] == pytest.approx(700.0)
    assert (result.start_state["temperature_c"], result.end_state["temperature_c"]) == (40.0, 67.0)
    assert (result.start_state["sm_clock_mhz"], result.end_state["sm_clock_mhz"]) == (1980.0, 1755.0)
    assert result.end_state["mem_clock_mhz"] == 3201.0


def test_a_window_without_snapshots_reads_energy_alone() -> None:
    """snapshot=False (a server's per-request window): the same energy, no state queries, empty edge states."""
    meter, clock, _, nvml = counter_meter(watts=100.0)
    queried: list[str] = []

    def counted(name: str):
        real = getattr(nvml, name)
        return lambda *a: queried.append(name) or real(*a)

    for name in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature", "nvmlDeviceGetEnforcedPowerLimit"):
        setattr(nvml, name, counted(name))
    window = meter.start(snapshot=False)
    clock.advance(1.0)
    result = meter.stop(window, tokens=10, snapshot=False)
    assert result.energy_j == pytest.approx(100.0) and result.start_state == {} == result.end_state
    assert queried == []
    meter.start()  # with its snapshot, the same meter queries the state
    assert queried


def test_a_window_opened_without_sync_reads_at_once_and_closes_synchronized() -> None:
    meter, clock, _, nvml = counter_meter(watts=100.0)
    window = meter.start(snapshot=False, sync=False)
    assert "sync" not in nvml.events
    clock.advance(1.0)
    assert meter.stop(window, tokens=10, snapshot=False).energy_j == pytest.approx(100.0)
    assert nvml.events.count("sync") == 1


def test_state_field_nvml_refuses_is_none_with_reason_not_a_failed_window() -> None:
    refusal = FakeNvmlError(3, "Not Supported")
    meter, clock, _, _ = counter_meter(fail={"nvmlDeviceGetTemperature": refusal})
    window = meter.start()
    clock.advance(1.0)
    result = meter.stop(window)
    assert result.start_state["temperature_c"] is None
    assert "Not Supported" in result.start_state["errors"]["temperature_c"]


def test_idle_baseline_is_reported_beside_gross_energy() -> None:
    meter, clock, device, _ = counter_meter(watts=100.0)
    idle = meter.measure_idle(5.0)
    assert idle.power_w == pytest.approx(100.0) and idle.duration_s == 5.0
    assert idle.energy_j == pytest.approx(500.0) and idle.backend == BACKEND_COUNTER
    device.watts = 300.0
    window = meter.start()
    clock.advance(2.0)
    result = meter.stop(window, tokens=40)
    assert result.energy_j == pytest.approx(600.0)  # gross stays gross
    assert result.idle_energy_j == pytest.approx(200.0)
    assert result.net_energy_j == pytest.approx(400.0)
    metrics = result.to_metrics("decode.")
    assert metrics == pytest.approx({
        "decode.energy_j": 600.0, "decode.duration_s": 2.0, "decode.mean_power_w": 300.0,
        "decode.j_per_token": 15.0, "decode.idle_power_w": 100.0, "decode.idle_energy_j": 200.0,
        "decode.net_energy_j": 400.0,
    })
    assert result.to_dict()["idle"]["power_w"] == pytest.approx(100.0)


def test_window_shorter_than_counter_update_period_is_refused() -> None:
    meter, clock, _, _ = counter_meter()
    window = meter.start()
    clock.advance(0.05)
    with pytest.raises(WindowTooShortError, match=r"50\.0 ms is shorter than 100 ms"):
        meter.stop(window)
    with pytest.raises(WindowTooShortError, match="idle window"):
        meter.measure_idle(0.01)


def test_counter_that_does_not_advance_is_no_reading_not_zero_joules() -> None:
    meter, clock, device, _ = counter_meter(watts=0.0)
    window = meter.start()
    clock.advance(1.0)
    with pytest.raises(EnergyMeterError, match="no energy registered .* no reading"):
        meter.stop(window)


def test_counter_decrease_wrap_or_reset_discards_the_window() -> None:
    clock = FakeClock()
    readings = iter([5_000, 9_000_000, 1_000])  # probe, start, end (reset between)
    meter = EnergyMeter(nvml=FakeNvml(energy_mj=readings), sync=lambda: None, clock=clock)
    window = meter.start()
    clock.advance(1.0)
    with pytest.raises(EnergyMeterError, match=r"went backwards \(9000000 -> 1000 mJ\)"):
        meter.stop(window)


def test_nvml_error_inside_window_raises_naming_nvml() -> None:
    meter, clock, _, nvml = counter_meter()
    window = meter.start()
    clock.advance(1.0)
    nvml.fail["nvmlDeviceGetTotalEnergyConsumption"] = FakeNvmlError(NVML_ERROR_UNKNOWN, "GPU is lost")
    with pytest.raises(EnergyMeterError, match="NVML energy counter read failed: .*GPU is lost"):
        meter.stop(window)


def test_bad_token_count_is_rejected() -> None:
    meter, clock, _, _ = counter_meter()
    window = meter.start()
    clock.advance(1.0)
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        meter.stop(window, tokens=0)


# -- polling fallback ------------------------------------------------------------------------------


def polling_meter(power_w, clock: FakeClock, **fail) -> EnergyMeter:
    nvml = FakeNvml(energy_mj=None, power_mw=lambda: power_w(clock.t) * 1000.0, fail=fail or None)
    return EnergyMeter(nvml=nvml, sync=lambda: None, clock=clock, poll_interval_s=0.0005)


def _run_fake_seconds(clock: FakeClock, seconds: float, steps: int = 20) -> None:
    for _ in range(steps):  # real sleeps let the poller thread sample between fake-clock steps
        clock.advance(seconds / steps)
        time.sleep(0.002)


def test_unsupported_counter_falls_back_to_power_polling_with_trapezoid_integral() -> None:
    clock = FakeClock()
    meter = polling_meter(lambda t: 100.0 + 50.0 * t, clock)  # linear ramp: trapezoid is exact
    assert meter.backend == BACKEND_POLLING
    ok, reason = EnergyMeter.available(nvml=FakeNvml(energy_mj=None, power_mw=1.0))
    assert ok and "polling" in reason
    window = meter.start()
    _run_fake_seconds(clock, 2.0)
    result = meter.stop(window, tokens=3)
    assert result.backend == BACKEND_POLLING
    assert result.energy_j == pytest.approx(100.0 * 2.0 + 25.0 * 2.0**2)
    assert result.power_samples is not None and result.power_samples > 2


def test_polling_error_inside_window_is_raised_not_skipped() -> None:
    clock = FakeClock()
    calls = {"n": 0}

    def flaky(t: float) -> float:
        calls["n"] += 1
        if calls["n"] > 3:
            raise FakeNvmlError(NVML_ERROR_UNKNOWN, "power sensor vanished")
        return 200.0

    meter = polling_meter(flaky, clock)
    window = meter.start()
    _run_fake_seconds(clock, 1.0)
    with pytest.raises(EnergyMeterError, match="power polling failed inside the window.*vanished"):
        meter.stop(window)


# -- availability ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nvml", "reason"),
    [
        (FakeNvml(energy_mj=1.0, fail={"nvmlInit": FakeNvmlError(9, "Driver Not Loaded")}), "Driver Not Loaded"),
        (FakeNvml(energy_mj=1.0, devices=0), "no GPU at NVML index 0"),
        (FakeNvml(energy_mj=None, power_mw=None), "neither the NVML energy counter nor power usage"),
        (FakeNvml(energy_mj=1.0, fail={"nvmlDeviceGetTotalEnergyConsumption": FakeNvmlError(999, "Unknown")}),
         "NVML energy counter failed"),
    ],
    ids=["no-driver", "no-device", "nothing-readable", "counter-error"],
)
def test_unavailable_backends_give_a_reason(nvml: FakeNvml, reason: str) -> None:
    ok, why = EnergyMeter.available(nvml=nvml)
    assert not ok and reason in why
    with pytest.raises(EnergyUnavailable, match=reason):
        EnergyMeter(nvml=nvml)


def test_this_machine_reports_availability_honestly() -> None:
    ok, reason = EnergyMeter.available()
    assert reason
    if not ok:
        with pytest.raises(EnergyUnavailable, match="NVML|pynvml|GPU"):
            EnergyMeter()


def test_invalid_meter_settings_raise() -> None:
    with pytest.raises(ValueError, match="min_window_s"):
        EnergyMeter(nvml=FakeNvml(energy_mj=1.0), min_window_s=0)


# -- integration -------------------------------------------------------------------------------


@given(
    st.lists(st.floats(0.0, 10.0), min_size=2, max_size=30),
    st.floats(0.0, 1000.0),
    st.floats(-50.0, 50.0),
)
def test_trapezoid_is_exact_for_linear_power(raw_times: list[float], p0: float, slope: float) -> None:
    times = sorted(raw_times)
    watts = [p0 + slope * t for t in times]
    t0, t1 = times[0], times[-1]
    exact = p0 * (t1 - t0) + slope * (t1**2 - t0**2) / 2
    assert integrate_power(times, watts) == pytest.approx(exact, rel=1e-9, abs=1e-6)


def test_integrate_power_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        integrate_power([0.0], [1.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        integrate_power([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 timestamps but 3"):
        integrate_power([0.0, 1.0], [1.0, 1.0, 1.0])


@pytest.mark.gpu
def test_real_gpu_window_reads_plausible_energy() -> None:
    ok, reason = EnergyMeter.available()
    if not ok:
        pytest.skip(f"no NVML energy backend: {reason}")
    meter = EnergyMeter()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    window = meter.start()
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:
        a = (a @ a).clamp_(-1, 1)
    result = meter.stop(window)
    assert result.duration_s >= 0.5
    assert 30.0 < result.mean_power_w < 2000.0, result.to_dict()
    assert result.end_state["power_limit_w"] is not None


def test_calls_to_fill_cover_the_window_and_refuse_nonsense():
    assert calls_to_fill(0.25, 2.0) == 8 and calls_to_fill(0.3, 2.0) == 7 and calls_to_fill(3.0, 2.0) == 1
    assert calls_to_fill(1e-5, 1.5, minimum=200) == 150_000 and calls_to_fill(0.1, 1.5, minimum=200) == 200
    with pytest.raises(ValueError, match="must be > 0"):
        calls_to_fill(0.0, 2.0)
    with pytest.raises(ValueError, match="minimum must be >= 1"):
        calls_to_fill(0.1, 2.0, minimum=0)
