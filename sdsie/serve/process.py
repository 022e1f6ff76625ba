"""The engine in its own process: `sdsie serve --engine-process`.

The child (multiprocessing's spawn context) loads the models from the config's paths with `Engine.load`, owns the
GPU, and runs one job at a time through `Engine.run`, so its decode loop has an interpreter to itself; the server's
process (event loop, HTTP, streaming) never loads the weights. One Pipe joins them:

    parent -> child   ("job", id, GenerationRequest, cancelled)   ("cancel", id)   ("stop",)
    child -> parent   ("ready", Limits, energy) or ("error", "Type: message")  ("event", Delta | Done | Failed)
                      ("add", RequestStats, outcome)  ("count", outcome)   (the parent's Metrics)

The parent keeps the bounded FIFO queue, busy, Retry-After and the metrics, and sends the next job when the child
reports the last one's Done or Failed. A cancelled job reaches the child as a message that its `cancelled` flag
reads with `conn.poll()` when generate's hook asks, between cycles, with no thread of its own. A child that exits
fails its request with a 500 naming the exit, every later request with a 503, and GET /health answers 503: the
server does not restart it (a supervisor restarts the server).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from sdsie.serve.config import ServeConfig, log_to_stderr
from sdsie.serve.metrics import Metrics
from sdsie.serve.protocol import APIError
from sdsie.serve.worker import Done, Engine, Failed, Front, Job

__all__ = ["EngineProcess", "EngineStartError"]

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine's process did not become ready; the message carries the child's error."""


# Seconds a warm-up length may add to the child's start: a compiled decode step and prefill of Llama-3.1-8B's size
# took 127 s with a cold compiler cache on an H100 (docs/serving.md)
WARM_UP_S = 600.0


class EngineProcess(Front):
    """Engine's interface (submit, start, stop, queued, busy, metrics, limits, tokenizer, render_chat, retry_after,
    config, failure) over an Engine in a child process. The tokenizer loads here, the models only in the child;
    `limits` exist once `start()` returned.

    threads: torch CPU threads in the child (None: torch's choice). child_init: a picklable callable (a module-level
    function or a functools.partial of one) the child calls before it loads the models, e.g. to install a
    synthetic generate for a benchmark. start_timeout: seconds the child may take to load and warm up (None: 900,
    and WARM_UP_S more for each of config.warm_up's lengths).
    """

    def __init__(self, config: ServeConfig, threads: int | None = None, child_init: Callable[[], Any] | None = None,
                 start_timeout: float | None = None) -> None:
        from sdsie.models import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer or config.target)
        if config.chat_template is not None:
            tokenizer.chat_template = config.chat_template
        super().__init__(tokenizer, config, Metrics(gear=bool(config.gear)))
        if start_timeout is None:
            start_timeout = 900.0 + WARM_UP_S * len(config.warm_up)
        self.threads, self.child_init, self.start_timeout = threads, child_init, start_timeout
        self._process: Any = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._current: tuple[int, Job] | None = None
        self._ids = itertools.count()
        self._failure: str | None = None

    @property
    def running(self) -> bool:
        return self._process is not None

    @property
    def failure(self) -> str | None:
        if self._failure is None and self._process is not None and not self._process.is_alive():
            self._failure = f"the engine process exited (exit code {self._process.exitcode})"
        return self._failure

    # -- the child's life ------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the child and wait until it has loaded the models; EngineStartError with its error otherwise."""
        if self._process is not None:
            raise RuntimeError("the engine is already running")
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=_child_main, args=(child_conn, self.config, self.threads, self.child_init),
                              name="sdsie-engine", daemon=True)
        process.start()
        child_conn.close()
        deadline = time.monotonic() + self.start_timeout
        try:
            while not conn.poll(0.1):
                if not process.is_alive():
                    raise EngineStartError(f"the engine process exited (exit code {process.exitcode}) before it was "
                                           "ready; its output above says why")
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine process was not ready after {self.start_timeout:.0f} s")
            message = conn.recv()
        except (EngineStartError, EOFError, OSError) as err:
            _end(process, 0)
            conn.close()
            if isinstance(err, EngineStartError):
                raise
            raise EngineStartError(f"the engine process exited (exit code {process.exitcode}) before it was "
                                   "ready") from None
        if message[0] != "ready":
            _end(process, 10)
            conn.close()
            raise EngineStartError(f"the engine process failed to load the models: {message[1]}")
        _, self.limits, self.metrics.energy = message
        self._process, self._conn, self._failure = process, conn, None
        self._stopping.clear()
        self._thread = threading.Thread(target=self._dispatch, name="sdsie-engine-pipe", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the running request at its next cycle, refuse what waits, end the child (killed after `timeout`)."""
        self._stopping.set()
        self._refuse_waiting("the server is shutting down")
        self._send(("stop",))
        if self._process is not None:
            _end(self._process, timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    # -- the queue -------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        failure = self.failure
        if failure is not None:
            self.metrics.count("failed")
            raise APIError(503, f"the server cannot generate: {failure}", type="server_error",
                           code="engine_unavailable")
        job.on_cancel = lambda: self._cancel(job)
        super().submit(job)

    def _cancel(self, job: Job) -> None:
        with self._send_lock:
            current = self._current
            if current is not None and current[1] is job and self._conn is not None:
                _quiet_send(self._conn, ("cancel", current[0]))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if self._conn is not None:
                _quiet_send(self._conn, message)

    def _dispatch(self) -> None:
        """Send each queued job to the child and relay what it answers, until stopped or the child is gone."""
        conn = self._conn
        assert conn is not None
        while not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if self._stopping.is_set():
                job.emit(Failed("the server is shutting down"))
                return
            self._busy.set()
            try:
                with self._send_lock:  # a cancel sent after this reaches the child after the job
                    job_id = next(self._ids)
                    self._current = (job_id, job)
                    _quiet_send(conn, ("job", job_id, job.request, job.cancelled.is_set()))
                if not self._relay(conn, job):
                    self._child_gone(job)
                    return
            finally:
                with self._send_lock:
                    self._current = None
                self._busy.clear()

    def _relay(self, conn: Connection, job: Job) -> bool:
        """Pass the child's messages on until the job's Done or Failed; False when the child is gone."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return False
            kind = message[0]
            if kind == "event":
                job.emit(message[1])
                if isinstance(message[1], (Done, Failed)):
                    return True
            elif kind == "add":
                self.metrics.add(message[1], message[2])
                self._timed(message[1].seconds)
            elif kind == "count":
                self.metrics.count(message[1])

    def _child_gone(self, job: Job) -> None:
        process = self._process
        if process is not None:
            process.join(1.0)
        code = None if process is None else process.exitcode
        self._failure = f"the engine process exited (exit code {code})"
        if not self._stopping.is_set():
            log.error("%s during a request", self._failure)
        self.metrics.count("failed")
        job.emit(Failed(f"generation failed: {self._failure} during this request"))
        self._refuse_waiting(f"the server cannot generate: {self._failure}")


def _quiet_send(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):  # the child is gone: the relay finds out and says so
        pass


def _end(process: Any, timeout: float) -> None:
    process.join(timeout)
    if process.is_alive():
        log.warning("the engine process did not stop within %.0f s: killed", timeout)
        process.kill()
        process.join(5)


# -- the child -----------------------------------------------------------------------------------


class _PipeFlag:
    """A job's `cancelled` in the child: set by a ("cancel", id) or ("stop",) on the pipe, read between cycles."""

    def __init__(self, conn: Connection, job_id: int, cancelled: bool) -> None:
        self.conn, self.job_id, self.cancelled, self.stop = conn, job_id, cancelled, False

    def set(self) -> None:
        self.cancelled = True

    def is_set(self) -> bool:
        while not self.cancelled and self.conn.poll():
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone: end the run and the process
                message = ("stop",)
            if message[0] == "stop":
                self.cancelled = self.stop = True
            elif message == ("cancel", self.job_id):
                self.cancelled = True
        return self.cancelled


class _MetricsRelay:
    """Engine.run's metrics calls, sent to the parent's Metrics."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def add(self, stats: Any, outcome: str = "ok") -> None:
        self.conn.send(("add", stats, outcome))

    def count(self, outcome: str) -> None:
        self.conn.send(("count", outcome))


def _child_main(conn: Connection, config: ServeConfig, threads: int | None,
                child_init: Callable[[], Any] | None) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops this process
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        if child_init is not None:
            child_init()
        log_to_stderr()
        engine = Engine.load(config)
    except BaseException as err:
        traceback.print_exc()  # the whole story to the server's log; the parent's error gets the last line
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    engine.metrics = _MetricsRelay(conn)  # type: ignore[assignment]
    conn.send(("ready", engine.limits, engine.meter is not None))

    def emit(event: Any) -> None:
        conn.send(("event", event))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        if message[0] == "job":
            _, job_id, request, cancelled = message
            flag = _PipeFlag(conn, job_id, cancelled)
            try:
                engine.run(Job(request, emit, flag))
            except (BrokenPipeError, EOFError, OSError):  # the parent is gone
                return
            if flag.stop:
                return
        # ("cancel", id) of a job that has already finished: nothing to do
