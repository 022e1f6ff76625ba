"""The batch-1 engine behind the server: a bounded FIFO queue and one worker thread that runs each request
through `sdsie.decoding.generate`, where the clutch decides per cycle whether the scout drafts and which
gear the target runs in. `sdsie serve` runs this Engine on a thread of its own process; with --engine-process the
same Engine runs inside a child process (sdsie.serve.process).

Per request: a fresh clutch (generate also resets it), the gear's counters zeroed, caches new (dynamic) or
emptied (static: generate crops a reused cache to 0). Each step's tokens reach generate's on_tokens hook,
which turns them into text and ends the run at the next cycle boundary when the request is cancelled (its client
went away) or a stop string appeared; the text reaches the request's `emit` from the on_wait hook of the cycle after,
once that cycle's work is launched (and at the end).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from sdsie.clutch import EntropyClutch
from sdsie.decoding import DecodeConfig, GenerationResult, generate, warm_up_runs
from sdsie.models import eos_ids, render_chat, vocab_size
from sdsie.serve.config import ServeConfig
from sdsie.serve.metrics import Metrics, RequestStats
from sdsie.serve.protocol import APIError, GenerationRequest, Limits
from sdsie.serve.text import TextStream

__all__ = ["Delta", "Done", "Engine", "Failed", "Flag", "Front", "Job", "prepare_target"]

log = logging.getLogger(__name__)
# A warm-up request: a prompt of more rows than any INT4 kernel takes an epilogue at, so it compiles the prefill graph
# most prompts take (`Int4Linear._composed` guards on the row count), then a few decode cycles past the graph capture.
WARM_UP_PROMPT = 32
WARM_UP_CYCLES = 4


def _stop_after(cycles: int) -> Callable[[list[int]], bool]:
    """An on_tokens hook that stops a run once it has emitted the prefill's token and `cycles` decode cycles."""
    calls = itertools.count(1)
    return lambda tokens: next(calls) > cycles


@dataclass(frozen=True)
class Delta:
    """Text released after one step (possibly empty: held back) and the tokens that step appended."""

    text: str
    tokens: list[int]


@dataclass(frozen=True)
class Done:
    """The end of a request: the text still held back, why it ended, usage, every generated token."""

    text: str
    finish_reason: str  # "stop" (eos or a stop string), "length", or "cancelled"
    usage: dict[str, Any]
    token_ids: list[int]


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


class Flag(Protocol):
    """What a Job's `cancelled` is: a threading.Event, or in the engine's process a flag fed by its pipe."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...


@dataclass
class Job:
    """A request in the queue. emit is called from the worker thread with each Event; on_cancel (set by the engine
    that runs it elsewhere) is told when the job is cancelled."""

    request: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: Flag = field(default_factory=threading.Event)
    on_cancel: Callable[[], None] | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()


class Front:
    """The side of an engine the app talks to: the bounded FIFO queue, busy, Retry-After, the metrics, the tokenizer
    (prompts and chat templates). Engine runs the queue on a thread; EngineProcess in a child process."""

    config: ServeConfig
    limits: Limits

    def __init__(self, tokenizer: Any, config: ServeConfig, metrics: Metrics) -> None:
        self.tokenizer, self.config, self.metrics = tokenizer, config, metrics
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=config.queue_size)
        self._busy = threading.Event()
        self._stopping = threading.Event()
        self._mean_seconds = 1.0  # running mean of a request's engine time, for Retry-After

    @property
    def running(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve (GET /health answers 503 with it), or None."""
        return None

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_chat(self.tokenizer, messages, add_generation_prompt=True)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.metrics.count("queue_full")
            raise APIError(503, f"the server is busy: {self.config.queue_size} requests are already waiting; "
                                "retry after the time in Retry-After", type="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(self.retry_after())}) from None

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained one place: a running request's mean time, 1 to 60."""
        return max(1, min(60, math.ceil(self._mean_seconds)))

    def _timed(self, seconds: float) -> None:
        self._mean_seconds += 0.2 * (seconds - self._mean_seconds)

    def _refuse_waiting(self, message: str) -> None:
        """Answer every job still in the queue with Failed(message)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            job.cancel()
            job.emit(Failed(message))


def prepare_target(target: nn.Module, config: ServeConfig) -> nn.Module:
    """The target as config serves it: with `int4`, in its INT4 decode form in place (`quantize_for_decode` with
    that preset and `fuse_norms`); with `compile`, wrapped so its decode step runs compiled (`DecodeCompiled`, static
    shapes; inductor with `inductor_options`, those of the end-to-end suite's records; with `compile_prefill` the
    prompts' forward too, with a dynamic length). Each static cache length (prompt plus max_tokens, rounded up to
    STATIC_LEN_BUCKET positions) is a shape of its own, compiled on its first request; dynamo's recompile limit is
    raised to the count the context allows, so no length falls back to eager."""
    if config.int4 is not None:
        from sdsie.quant import preset, quantize_for_decode

        done = quantize_for_decode(target, preset(config.int4), norms=config.fuse_norms)
        log.info("target quantized (%s): %s", config.int4, done.describe())
    if config.compile is None:
        return target
    import torch
    import torch._dynamo

    from sdsie.decoding import DecodeCompiled, inductor_options
    from sdsie.decoding.engine import STATIC_LEN_BUCKET, static_cache_length

    lengths = static_cache_length(config.context_of(target)) // STATIC_LEN_BUCKET
    if torch._dynamo.config.recompile_limit < lengths:
        log.info("dynamo's recompile limit raised from %d to %d: one decode-step compilation per cache length",
                 torch._dynamo.config.recompile_limit, lengths)
        torch._dynamo.config.recompile_limit = lengths
    options = inductor_options(torch.device(config.device)) if config.compile == "inductor" else {}
    return DecodeCompiled(target, config.compile_prefill, backend=config.compile,
                          **({"options": options} if options else {}))


class Engine(Front):
    """Holds the models; `submit` queues a Job (APIError 503 when the queue is full); `start` runs the worker."""

    def __init__(self, target: nn.Module, tokenizer: Any, config: ServeConfig, scout: nn.Module | None = None,
                 gear: Any = None, meter: Any = None) -> None:
        if (config.scout is None) != (scout is None):
            raise ValueError("config.scout and the scout model must be given together")
        if bool(config.gear) != (gear is not None):
            raise ValueError("config.gear and the gear state must be given together")
        self.target, self.scout, self.gear, self.meter = target, scout, gear, meter
        context = config.context_of(target)
        if context < 2:
            raise ValueError("the target's config has no max_position_embeddings: set context")
        self.limits = Limits(config.served_name, config.max_tokens, context, vocab_size(target))
        self.eos = eos_ids(tokenizer, target)
        super().__init__(tokenizer, config, Metrics(gear=gear is not None, energy=meter is not None))
        self._thread: threading.Thread | None = None
        self._current: Job | None = None
        self._energy_thread: ThreadPoolExecutor | None = None  # opens energy windows (_open_energy)

    @classmethod
    def load(cls, config: ServeConfig) -> Engine:
        """Load the models config names, gate the target's gear layers or give it its INT4 and compiled form
        (`prepare_target`), open the energy meter where there is one."""
        import torch

        from sdsie.kernels.device import kernel_runs_on
        from sdsie.models import load_model, load_pair, load_tokenizer

        if config.int4 is not None and not kernel_runs_on(torch.device(config.device)):  # before any model loads
            raise ValueError(f"int4 runs the Triton INT4 kernel, which needs a CUDA device (or a CPU under "
                             f"TRITON_INTERPRET=1, seconds a token); got device {config.device!r}")
        dtype = getattr(torch, config.dtype)
        if config.scout is not None:
            pair = load_pair(config.target, config.scout, dtype, config.device, tokenizer=config.tokenizer)
            target, scout, tokenizer = pair.target, pair.scout, pair.tokenizer
        else:
            target, scout = load_model(config.target, dtype, config.device), None
            tokenizer = load_tokenizer(config.tokenizer or config.target)
        if config.chat_template is not None:
            tokenizer.chat_template = config.chat_template
        gear = None
        if config.gear:
            from sdsie.quant.gated import gate_model

            gear = gate_model(target, list(config.gear), layers=config.gear_layers)
        target = prepare_target(target, config)
        engine = cls(target, tokenizer, config, scout=scout, gear=gear, meter=_meter(config))
        engine.warm_up(config.warm_up)
        if config.compile is not None and not config.warm_up:
            log.warning("--compile without --warm-up: the first request at each cache length compiles its decode "
                        "step%s while it waits (minutes at 7-8B sizes, docs/serving.md)",
                        " and the prefill" if config.compile_prefill else "")
        return engine

    def warm_up(self, lengths: Sequence[int]) -> dict[int, float]:
        """Run one request of a few tokens at each static cache length in `lengths` (positions, as a request's prompt
        plus max_tokens: each rounds up to STATIC_LEN_BUCKET), as the served requests run (scout, clutch, gear), so
        the decode step's compilation and graph capture at that length, the compiled prefill and the kernels' first
        builds happen before serving. Seconds a length; the metrics count none of it. A length past the context is a
        ValueError."""
        from sdsie.decoding.engine import static_cache_length

        for n in lengths:
            if not 2 <= n <= self.limits.context:
                raise ValueError(f"warm_up: a cache length must be 2 to the context's {self.limits.context} "
                                 f"positions, got {n}")
        seconds: dict[int, float] = {}
        for n in lengths:
            prompt = [t % self.limits.vocab for t in range(1, min(WARM_UP_PROMPT, n // 2) + 1)]
            clutch = EntropyClutch(self.config.clutch) if self.config.clutch is not None else None
            config = self.config.decode_config(n - len(prompt))
            t0 = time.perf_counter()
            for _ in range(warm_up_runs(config)):
                generate(self.target, prompt, config, scout=self.scout, clutch=clutch, gear=self.gear,
                         on_tokens=_stop_after(WARM_UP_CYCLES))
            seconds[n] = time.perf_counter() - t0
            log.info("warm-up: cache length %d (%d positions) in %.1f s", n,
                     static_cache_length(n), seconds[n])
        if self.gear is not None:
            self.gear.reset_counters()
        return seconds

    # -- the worker ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._work, name="sdsie-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the running request at its next cycle, refuse what waits, stop the worker."""
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel()
        self._refuse_waiting("the server is shutting down")
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            self._busy.set()
            self._current = job
            try:
                self.run(job)
            finally:
                self._current = None
                self._busy.clear()

    # -- one request -------------------------------------------------------------------------------
    def decode_config(self, req: GenerationRequest) -> DecodeConfig:
        eos = None if req.ignore_eos or not self.eos else tuple(sorted(self.eos))
        return self.config.decode_config(req.max_tokens, sampling=req.sampling, eos_token_id=eos)

    def run(self, job: Job) -> None:
        """Generate for one job on this thread, emitting Deltas, then Done (or Failed)."""
        req = job.request
        if job.cancelled.is_set():  # its client left while it waited
            self.metrics.count("cancelled")
            job.emit(Done("", "cancelled", {}, []))
            return
        text = TextStream(self.tokenizer, req.stop)
        held: list[Delta] = []  # released text waits for the next cycle's launch (send_held)

        def on_tokens(tokens: list[int]) -> bool:
            piece = text.feed(tokens)
            if piece:  # an empty piece (text held back) would wake the event loop for nothing
                held.append(Delta(piece, tokens))
            return text.stopped or job.cancelled.is_set()

        def send_held() -> None:
            # Emitting wakes the event loop, which takes the interpreter lock at this thread's next release (any
            # torch call) for its whole step of streaming work: from generate's on_wait, while the device computes;
            # emitted straight from on_tokens, it would stretch the next cycle's launch (docs/serving.md).
            for delta in held:
                job.emit(delta)
            held.clear()

        clutch = EntropyClutch(self.config.clutch) if self.config.clutch is not None else None
        if self.gear is not None:
            self.gear.reset_counters()
        opening = self._open_energy()
        t0 = time.perf_counter()
        try:
            result = generate(self.target, list(req.prompt_ids), self.decode_config(req), scout=self.scout,
                              clutch=clutch, gear=self.gear, on_tokens=on_tokens, on_wait=send_held)
        except Exception as err:  # the engine keeps serving; the client gets a 500 naming the cause
            log.exception("generation failed")
            _abort(_opened(opening))
            self.metrics.count("failed")
            job.emit(Failed(f"generation failed: {type(err).__name__}: {err}"))
            return
        seconds = time.perf_counter() - t0
        send_held()
        self._timed(seconds)
        energy = self._close_energy(opening, len(result.tokens))
        cancelled = result.stop_reason == "stopped" and not text.stopped
        finish = "cancelled" if cancelled else "stop" if text.stopped or result.stop_reason == "eos" else "length"
        stats = request_stats(result, len(req.prompt_ids), seconds, energy)
        self.metrics.add(stats, "cancelled" if cancelled else "ok")
        job.emit(Done(text.finish(), finish, usage(result, stats), list(result.tokens)))

    # -- energy ------------------------------------------------------------------------------------
    def _open_energy(self) -> Future | None:
        """Open the request's window on the energy thread: an NVML counter read takes milliseconds (2.5 ms median on
        the H200, docs/serving.md), which then overlap the prefill instead of delaying it. No sync: the device is
        idle between requests."""
        if self.meter is None:
            return None
        if self._energy_thread is None:
            self._energy_thread = ThreadPoolExecutor(1, thread_name_prefix="sdsie-energy")
        return self._energy_thread.submit(self.meter.start, snapshot=False, sync=False)

    def _close_energy(self, opening: Future | None, tokens: int) -> float | None:
        window = _opened(opening)
        if window is None:
            return None
        try:
            return float(self.meter.stop(window, tokens, snapshot=False).energy_j)
        except Exception as err:  # too short a window, a counter that did not move: no reading (None), not 0 J
            _abort(window)
            log.debug("no energy reading: %s", err)
            return None


def request_stats(result: GenerationResult, prompt_tokens: int, seconds: float,
                  energy_j: float | None) -> RequestStats:
    gears = [result.prefill_gear_int4, *(c.gear_int4 for c in result.cycles)]
    s = result.stats
    return RequestStats(prompt_tokens=prompt_tokens, completion_tokens=len(result.tokens), seconds=seconds,
                        cycles=s.cycles, engaged_cycles=s.engaged_cycles, speculate_cycles=s.speculate_cycles,
                        drafted=s.drafted, accepted=s.accepted, target_forwards=s.target_forwards,
                        dropped_forwards=s.ahead_dropped, int4_target_forwards=sum(bool(g) for g in gears),
                        energy_j=energy_j)


def usage(result: GenerationResult, stats: RequestStats) -> dict[str, Any]:
    """OpenAI's token counts plus what the engine did (`sdsie`): gear share None without a gear, energy None
    without a reading."""
    s = result.stats
    has_gear = result.prefill_gear_int4 is not None
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "sdsie": {
            "cycles": s.cycles,
            "speculate_cycles": s.speculate_cycles,
            "engaged_cycles": s.engaged_cycles,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "scout_forwards": s.scout_forwards,
            "target_forwards": s.target_forwards,
            "dropped_forwards": s.ahead_dropped,
            "decisions": result.decisions,
            "gear_int4_share": stats.int4_target_forwards / (1 + s.cycles) if has_gear else None,
            "energy_j": stats.energy_j,
            "seconds": stats.seconds,
            "stop_reason": result.stop_reason,
        },
    }


def _opened(opening: Future | None) -> Any:
    """The window an _open_energy future opened, or None where none was (no meter, or the reading failed)."""
    if opening is None:
        return None
    try:
        return opening.result()
    except Exception as err:  # a failed reading is "no reading", never a failed request
        log.warning("energy window not opened: %s", err)
        return None


def _abort(window: Any) -> None:
    poller = getattr(window, "poller", None)
    if poller is not None:
        poller.abort()


def _meter(config: ServeConfig) -> Any:
    """An EnergyMeter on the serving GPU, or None (CPU, energy off, or no NVML: the reason is logged)."""
    import torch

    if not config.energy or torch.device(config.device).type != "cuda":
        return None
    from sdsie.telemetry.energy import EnergyMeter, EnergyUnavailable

    index = torch.device(config.device).index or 0
    try:
        return EnergyMeter(index)
    except EnergyUnavailable as err:
        log.warning("energy not measured: %s", err)
        return None
