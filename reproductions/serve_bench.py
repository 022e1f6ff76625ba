"""Server overhead: `sdsie serve` tokens/s against direct `generate()` on the same prompts, and time to first token.

The server runs as its own process (`python -m sdsie.cli serve`, inheriting this process's environment), as a
deployment would, on the stand-in pair's folders; this process loads the same folders for the direct runs. Both
sides run the same decoding configuration (kv cache, CUDA graphs or not, clutch). They take turns on the device,
never at once, interleaved per prompt and trial (the order alternating between trials). Each request is greedy with
a fixed length (ignore_eos), so both sides generate the same tokens: the untimed warm-up checks that token for token
(non-streamed, return_token_ids) and captures any CUDA graphs on both sides; every timed pair checks it again (the
direct run's tokens, the streamed text, the clutch's decisions and the token count).

Per timed pair: direct tokens/s = tokens / wall time of generate(); server tokens/s = tokens / (request sent ->
`data: [DONE]`), streamed, parsed as raw SSE by httpx; time to first token = request sent -> the first chunk with
text; the server's engine time (usage.sdsie.seconds) gives its engine tokens/s, and the rest of the request's time
is HTTP, queueing and streaming (http overhead). The ratio server / direct is paired per prompt and trial
(sdsie.stats.paired_ratios). One record, suite `serve_overhead`.

--model NAME serves, instead of the pair, the end-to-end suite's random-weight configuration of that model (saved to
a temporary folder with a word-level tokenizer, no scout, --clutch off), the prompts being the stand-in tokenizer's
ids of the same texts. --int4 PRESET, --compile [BACKEND] and --compile-prefill give both sides the server's form
(`sdsie.serve.worker.prepare_target`, the function the server applies to its copy); --prefill-graphs replays the
prompts as CUDA graphs on both sides (DecodeConfig.prefill_graphs), so the time to first token is the graphed one.

--max-seconds bounds the whole run from its start, pair build included: a warm-up or timed pair that would end past
it (less a reserve for stopping the server and writing) is not started, and the record keeps what completed,
marked incomplete (`complete: false`, config.cut saying where). After the first prompt's warm-up, which pays the
compilations, a warm-up is estimated from its last round (`_warm_up_estimate`). A warm-up cut so leaves the prompts
warmed before it to their timed pairs, the first of which is estimated from the longest last warm-up round (with
prompt graphs, a replay that captures nothing). SIGTERM and SIGINT end a run the same way; so does an error while
measuring (config.failed, exit status 1), with the server's log at --server-log.

    python -u -m reproductions.serve_bench --preset gpu --device cuda --dtype bfloat16 --kv-cache static \\
        --cuda-graphs --max-tokens 128 --trials 10 --max-seconds 450 --out telemetry
    python -u -m reproductions.serve_bench --model llama3.1-8b --device cuda --dtype bfloat16 --kv-cache static \\
        --cuda-graphs --clutch off --int4 group --compile --max-tokens 128 --trials 3 --one-per-family --out DIR
    python -m reproductions.serve_bench --preset cpu --device cpu --trials 1 --max-tokens 4 --one-per-family \\
        --threads 1 --out /tmp/serve_bench                                          (the CPU dry run)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reproductions.args import positive_float, positive_int
from reproductions.decode_e2e import MODELS
from sdsie.clutch import EntropyClutch
from sdsie.decoding import generate, warm_up_runs
from sdsie.decoding.model_io import sync_device
from sdsie.serve.config import DTYPES, INT4_PRESETS, KV_CACHES, ServeConfig, parse_clutch
from sdsie.stats import paired_ratios, paired_speedup
from sdsie.telemetry.records import RunRecord, capture_environment, write_record

REPO = Path(__file__).resolve().parents[1]
SUITE = "serve_overhead"
TARGET_RATIO = 0.95  # server tokens/s over direct that the server aims for on the GPU stand-in pair under graphs
HEALTH_TIMEOUT_S = 300.0  # model loading on a cold machine
RESERVE_S = 15.0  # kept back from --max-seconds: stopping the server (at most 10 s) and writing the record
FIRST_WARMUP_GUESS_S = 20.0  # before any warm-up has run: a prompt's first runs capture graphs on both sides
ESTIMATE_MARGIN = 1.5  # the next step is assumed to take this times the longest such step so far


class Budget:
    """Wall-clock budget in seconds from construction (None: unbounded); clock injectable for tests."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic,
                 reserve: float = RESERVE_S) -> None:
        self.seconds, self.clock, self.reserve = seconds, clock, reserve
        self.t0 = clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        """Seconds left before the reserve; inf when unbounded."""
        return math.inf if self.seconds is None else self.seconds - self.reserve - self.elapsed()

    def fits(self, estimate: float) -> bool:
        return estimate <= self.left()

    def say(self, message: str) -> None:
        print(f"serve_bench [{self.elapsed():6.1f} s] {message}", flush=True)


# ------------------------------------------------------------------------------------------------------------
# The measurement: warm-up, then interleaved timed pairs, with the budget checked before each step


@dataclass
class DirectRun:
    tokens: list[int]
    decisions: str
    seconds: float  # wall time of generate(), synchronized
    prefill_seconds: float


@dataclass
class WholeAnswer:
    token_ids: list[int]
    text: str


@dataclass
class StreamedRun:
    ttft: float  # request sent -> first chunk with text
    total: float  # request sent -> data: [DONE]
    text: str
    usage: dict[str, Any]


@dataclass
class Sides:
    """The bench's three ways to run a prompt (by id): direct generate(), the server non-streamed and streamed."""

    direct: Callable[[str], DirectRun]
    whole: Callable[[str], WholeAnswer]
    streamed: Callable[[str], StreamedRun]


@dataclass
class Measured:
    """Everything a run measured so far: complete or cut, a record can be written from it."""

    prompts: list[str]  # the prompts asked for
    warmed: list[str] = field(default_factory=list)  # warmed up, so timed
    samples: dict[str, list[float]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    checked: int = 0  # runs whose tokens were compared
    pairs: int = 0  # timed pairs completed
    cut: str | None = None  # why the run stopped early, each stop's reason in order; None: it completed
    failed: bool = False  # it stopped on an error (the command exits 1), not on the budget or a signal

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def check(self, ok: bool, what: str) -> None:
        self.checked += 1
        if not ok:
            self.mismatches.append(what)

    def stop(self, reason: str) -> None:
        """Record why a part of the run stopped early, after any earlier reason (a cut warm-up, then its trials)."""
        self.cut = reason if self.cut is None else f"{self.cut}; {reason}"


def measure(prompts: Sequence[str], sides: Sides, trials: int, budget: Budget, warm_rounds: int = 1) -> Measured:
    """Warm every prompt up on both sides (`warm_rounds` times each: `sdsie.decoding.warm_up_runs`, 2 with prompt
    graphs), then `trials` interleaved timed pairs per prompt, while the budget lasts. A warm-up the budget cuts
    leaves the prompts warmed before it to be timed: their warm-up (minutes where it compiles) is the run's dearest
    part. KeyboardInterrupt (SIGINT, and SIGTERM under main) ends it like the budget: what completed is kept."""
    if warm_rounds < 1:
        raise ValueError(f"warm_rounds must be >= 1 (each prompt's tokens are compared in its warm-up), got "
                         f"{warm_rounds}")
    m = Measured(list(prompts))
    reference: dict[str, tuple[DirectRun, WholeAnswer]] = {}
    last_rounds: list[float] = []  # each prompt's last warm-up round: with 2 rounds, a replay that captures nothing
    pairs: list[float] = []
    try:
        for pid in prompts:  # untimed: graphs captured on both sides, tokens compared
            estimate = _warm_up_estimate(m.samples.get("warmup_s", []), last_rounds, warm_rounds)
            if not budget.fits(estimate):
                m.stop(f"budget: warm-up stopped before {pid} ({budget.left():.0f} s left, {estimate:.0f} s needed)")
                break
            t0 = budget.clock()
            first: list[int] | None = None
            for r in range(warm_rounds):
                t_round = budget.clock()
                ref = sides.direct(pid)
                t_direct = budget.clock()
                whole = sides.whole(pid)
                m.add("warmup_direct_s", t_direct - t_round)  # each round's, per side: where a compilation lands
                m.add("warmup_server_s", budget.clock() - t_direct)
                m.check(whole.token_ids == ref.tokens, f"{pid} warm-up: server token ids differ from direct "
                        f"generate() from position {_first_difference(whole.token_ids, ref.tokens)}")
                if first is None:
                    first = ref.tokens
                else:  # a later round replays what the first captured (prompt graphs): the same tokens
                    m.check(ref.tokens == first, f"{pid} warm-up round {r + 1}: direct tokens differ from round 1's "
                            f"from position {_first_difference(ref.tokens, first)}")
            last_rounds.append(budget.clock() - t_round)
            m.add("warmup_s", budget.clock() - t0)
            reference[pid] = (ref, whole)
            m.warmed.append(pid)
            rounds = {side: " + ".join(f"{t:.1f}" for t in m.samples[f"warmup_{side}_s"][-warm_rounds:])
                      for side in ("direct", "server")}
            budget.say(f"warm-up {pid}: {len(ref.tokens)} tokens, {m.samples['warmup_s'][-1]:.1f} s "
                       f"(direct {rounds['direct']} s, server {rounds['server']} s)")
        stopped = False
        for trial in range(trials if m.warmed else 0):
            for pid in m.warmed:
                estimate = ESTIMATE_MARGIN * max(pairs or last_rounds)
                if not budget.fits(estimate):
                    m.stop(f"budget: trial {trial + 1} stopped before {pid} ({budget.left():.0f} s left, "
                           f"{estimate:.1f} s needed)")
                    stopped = True
                    break
                t0 = budget.clock()
                if trial % 2 == 0:
                    direct, streamed = sides.direct(pid), sides.streamed(pid)
                else:
                    streamed, direct = sides.streamed(pid), sides.direct(pid)
                pairs.append(budget.clock() - t0)
                _add_pair(m, pid, trial, direct, streamed, reference[pid])
            if stopped:
                break
            budget.say(f"trial {trial + 1}/{trials} done ({m.pairs} pairs)")
    except KeyboardInterrupt as stop:
        m.stop(f"interrupted ({stop or 'SIGINT'}) after {m.pairs} pairs")
    except Exception as err:  # e.g. a request the server failed: keep what completed, and say what broke
        traceback.print_exc()
        m.failed = True
        m.stop(f"failed after {m.pairs} pairs: {type(err).__name__}: {err}")
    if m.cut is not None:
        budget.say(f"cut: {m.cut}")
    return m


def _warm_up_estimate(warmups: list[float], last_rounds: list[float], warm_rounds: int) -> float:
    """The next prompt's warm-up, times ESTIMATE_MARGIN. Before any, FIRST_WARMUP_GUESS_S. The first prompt's
    warm-up pays the compilations and graph captures every prompt at its cache length shares (minutes at 7-8B
    sizes: 270 s for the served Llama-3.1-8B's first prompt on an H100; at the tiny size 25 s, later prompts 0.1 s
    and 0.2 s, docs/log.md), so after it alone the next is `warm_rounds` of its last round (with prompt graphs, a
    replay; with one round, the whole warm-up); after more, the longest later warm-up. A later prompt that compiles
    (a new cache length) runs past the estimate, and the outer limit's SIGTERM ends the run, keeping what
    completed."""
    if not warmups:
        return FIRST_WARMUP_GUESS_S
    later = warmups[1:] or [warm_rounds * last_rounds[0]]
    return ESTIMATE_MARGIN * max(later)


def _add_pair(m: Measured, pid: str, trial: int, direct: DirectRun, streamed: StreamedRun,
              reference: tuple[DirectRun, WholeAnswer]) -> None:
    ref, whole = reference
    n = streamed.usage["completion_tokens"]
    sdsie = streamed.usage["sdsie"]
    where = f"{pid} trial {trial + 1}"
    at = _first_difference(direct.tokens, ref.tokens)
    m.check(direct.tokens == ref.tokens, f"{where}: direct tokens differ from its warm-up from position {at}")
    m.check(n == len(direct.tokens) and streamed.text == whole.text and sdsie["decisions"] == direct.decisions,
            f"{where}: the streamed answer differs from direct generate() (tokens, text or clutch decisions)")
    engine_s = sdsie["seconds"]
    # appended together, so the two lists of a prompt pair up by trial (sdsie.stats.paired_ratios)
    m.add(f"direct|{pid}|tokens_per_s", len(direct.tokens) / direct.seconds)
    m.add(f"server|{pid}|tokens_per_s", n / streamed.total)
    m.add("direct_first_token_s", direct.prefill_seconds)
    m.add("server_ttft_s", streamed.ttft)
    m.add("server_engine_tok_s", n / engine_s)
    m.add("server_http_overhead_s", streamed.total - engine_s)
    if sdsie.get("energy_j") is not None:  # only requests whose window gave a reading: never 0 J for none
        m.add("server_j_per_token", sdsie["energy_j"] / n)
    m.pairs += 1


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where a and b differ (the shorter one's length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------------------------------------
# What a record holds


def _p90(xs: Sequence[float]) -> float:
    return float(statistics.quantiles(xs, n=10, method="inclusive")[-1]) if len(xs) > 1 else float(xs[0])


def summarize(m: Measured) -> tuple[dict[str, list[float]], dict[str, float | bool]]:
    """(samples, metrics) of a measurement, complete or cut; metrics only for what has samples."""
    samples = {k: list(v) for k, v in m.samples.items()}
    ratios = paired_ratios(samples, "server", "direct", m.warmed)
    metrics: dict[str, float | bool] = {}
    if m.checked:
        metrics["serve.tokens_identical"] = not m.mismatches
    if not ratios:
        return samples, metrics
    samples["tok_s_ratio"] = ratios  # prompt by prompt, trial order within each
    median, low, high = paired_speedup(ratios)
    side = {s: [v for p in m.warmed for v in samples.get(f"{s}|{p}|tokens_per_s", [])] for s in ("direct", "server")}
    metrics.update({
        "serve.tok_s_ratio_median": median,
        "serve.tok_s_ratio_ci_low": low,  # 95% bootstrap interval of the median
        "serve.tok_s_ratio_ci_high": high,
        "serve.tok_s_ratio_min": min(ratios),
        "serve.tok_s_ratio_max": max(ratios),
        "serve.direct_tok_s_median": statistics.median(side["direct"]),
        "serve.server_tok_s_median": statistics.median(side["server"]),
        "serve.server_engine_tok_s_median": statistics.median(samples["server_engine_tok_s"]),
        "serve.ttft_s_median": statistics.median(samples["server_ttft_s"]),
        "serve.ttft_s_p90": _p90(samples["server_ttft_s"]),
        "serve.http_overhead_s_median": statistics.median(samples["server_http_overhead_s"]),
        "serve.http_overhead_s_p90": _p90(samples["server_http_overhead_s"]),
        "serve.direct_first_token_s_median": statistics.median(samples["direct_first_token_s"]),
    })
    for pid in m.warmed:
        mine = paired_ratios(samples, "server", "direct", [pid])
        if mine:
            metrics[f"serve.{pid}.tok_s_ratio_median"] = statistics.median(mine)
    if samples.get("server_j_per_token"):
        metrics["serve.server_j_per_token_median"] = statistics.median(samples["server_j_per_token"])
    return samples, metrics


def build_record(a: argparse.Namespace, m: Measured, environment: dict[str, Any], model: str,
                 hardware: str) -> RunRecord:
    samples, metrics = summarize(m)
    done = max((len(samples.get(f"direct|{p}|tokens_per_s", [])) for p in m.warmed), default=0)
    config = {k: getattr(a, k) for k in ("preset", "model", "tiny", "int4", "compile", "compile_prefill", "device",
                                         "dtype", "kv_cache", "cuda_graphs", "prefill_graphs", "clutch", "max_tokens",
                                         "one_per_family", "threads", "max_seconds")}
    config.update(
        trials_requested=a.trials, prompts=m.prompts, timed_prompts=m.warmed, pairs=m.pairs, cut=m.cut,
        failed=m.failed, mismatched=m.mismatches, runs_compared=m.checked, target_ratio=TARGET_RATIO,
        graphs={"direct": a.cuda_graphs, "server": a.cuda_graphs},  # one decoding configuration on both sides
        server_energy=not a.no_energy,
        engine="process" if a.engine_process else "thread",
        transport="HTTP/1.1 SSE, server in a child process, its engine "
                  f"{'in a process of its own' if a.engine_process else 'on a thread of the server'}, client httpx "
                  "in this process",
        order="warm-up per prompt on both sides; then interleaved per prompt, the order alternating per trial",
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))  # the child inherits it
    return RunRecord(claim_ids=[], suite=SUITE, config=config, samples=samples, metrics=metrics,
                     environment=environment, complete=m.cut is None,
                     conditions={"model": model, "hardware": hardware, "trials": max(done, 1)})


# ------------------------------------------------------------------------------------------------------------
# The two sides on real models


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """This process's environment for the server, with the repository first on PYTHONPATH and output unbuffered."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def server_command(pair: Path, a: argparse.Namespace, port: int) -> list[str]:
    """`sdsie serve`'s command line for the pair's folders in the decoding form `a` asks of both sides."""
    cmd = [sys.executable, "-m", "sdsie.cli", "serve", "--target", str(pair / "target"), "--tokenizer",
           str(pair / "tokenizer"), "--clutch", a.clutch, "--device", a.device, "--dtype", a.dtype, "--kv-cache",
           a.kv_cache, "--port", str(port), "--model-name", "standin", "--max-tokens", str(a.max_tokens)]
    cmd += ["--scout", str(pair / "scout")] if (pair / "scout").is_dir() else []
    cmd += ["--int4", a.int4] if a.int4 else []
    cmd += ["--compile", a.compile] if a.compile else []
    cmd += ["--compile-prefill"] if a.compile_prefill else []
    cmd += ["--cuda-graphs"] if a.cuda_graphs else []
    cmd += ["--prefill-graphs"] if a.prefill_graphs else []
    cmd += ["--threads", str(a.threads)] if a.threads else []
    cmd += ["--no-energy"] if a.no_energy else []
    cmd += ["--engine-process"] if a.engine_process else []
    return cmd


def serve_config(pair: Path, a: argparse.Namespace) -> ServeConfig:
    """The server's settings that the direct side shares: the target's form (`prepare_target`) and its runs'
    DecodeConfig (`ServeConfig.decode_config`), as `server_command` passes them to `sdsie serve`."""
    return ServeConfig(target=str(pair / "target"), int4=a.int4, compile=a.compile, compile_prefill=a.compile_prefill,
                       kv_cache=a.kv_cache, cuda_graphs=a.cuda_graphs, prefill_graphs=a.prefill_graphs,
                       device=a.device, dtype=a.dtype)


class Server:
    """`sdsie serve` in a child process, on a free port of 127.0.0.1; stopped on exit."""

    def __init__(self, pair: Path, a: argparse.Namespace, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = server_command(pair, a, self.port)
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, http: Any, timeout: float) -> bool:
        """True once /health answers 200; False after `timeout` s. Raises if the server exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if http.get(f"{self.url}/health").status_code == 200:
                    return True
            except Exception:  # not listening yet
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _request(ids: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    body = {"model": "standin", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return {**body, "stream_options": {"include_usage": True}} if stream else {**body, "return_token_ids": True}


def _streamed(http: Any, url: str, ids: list[int], max_tokens: int) -> StreamedRun:
    t0 = time.perf_counter()
    ttft, usage, pieces = None, None, []
    with http.stream("POST", f"{url}/v1/completions", json=_request(ids, max_tokens, True)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed mid-stream: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                pieces.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    total = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("the stream carried no usage chunk")
    return StreamedRun(ttft if ttft is not None else total, total, "".join(pieces), usage)


def random_model_folder(name: str, tiny: bool, a: argparse.Namespace, out: Path) -> Path:
    """A random-weight model of the end-to-end suite's `name` configuration saved as out/target (save_pretrained),
    beside out/tokenizer, a word-level tokenizer naming each id ("w17"), so any id decodes; no scout. Both sides load
    the folder: the model as built differs from the model as loaded (its rotary buffers are computed in another
    dtype), and that changes greedy tokens on random weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from reproductions.decode_e2e import build_model

    model = build_model(name, tiny, torch.device(a.device), getattr(torch, a.dtype))
    model.save_pretrained(out / "target")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(model.config.vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {f"{role}_token": f"w{getattr(model.config, f'{role}_token_id')}" for role in ("bos", "eos", "pad")}
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", **special).save_pretrained(out / "tokenizer")
    return out


def _pair_dir(preset: str, device: str) -> Path:
    from sdsie.standin import COMMITTED_CPU_DIR, ensure_standin, get_preset

    return COMMITTED_CPU_DIR if preset == "cpu" else ensure_standin(get_preset(preset), torch.device(device))


def run(a: argparse.Namespace, budget: Budget) -> RunRecord:
    import httpx

    from reproductions.decode_repro import pair_build_id
    from sdsie.models import ModelPair, load_model, load_pair, load_tokenizer
    from sdsie.serve.worker import prepare_target
    from sdsie.standin import load_prompts, prompts_hash

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    scratch = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    if a.model:
        budget.say(f"{a.model}{' (tiny)' if a.tiny else ''} with random weights: building and saving its folder")
        pair_dir = random_model_folder(a.model, a.tiny, a, scratch / "model")
        gc.collect()  # the model as built
        pair = ModelPair(load_model(pair_dir / "target", getattr(torch, a.dtype), a.device), None,
                         load_tokenizer(pair_dir / "tokenizer"), a.model, "")  # no scout
    else:
        budget.say(f"stand-in pair ({a.preset} preset): loading, or building on a cache miss")
        pair_dir = _pair_dir(a.preset, a.device)
    serving = serve_config(pair_dir, a)
    if a.model:  # prepared before the server starts: two 7-8B models quantizing at once do not fit one GPU
        target = prepare_target(pair.target, serving)  # what the server does to its copy
    if device.type == "cuda":
        torch.cuda.empty_cache()  # a build (or a quantization) in this process leaves its memory cached
    log = a.server_log or scratch / "server.log"
    server = Server(pair_dir, a, log)  # starts loading while this process loads the same folders
    budget.say(f"models at {pair_dir.name}; server starting on {server.url} (log: {log})")
    try:
        if not a.model:
            pair = load_pair(pair_dir / "target", pair_dir / "scout", getattr(torch, a.dtype), a.device,
                             tokenizer=pair_dir / "tokenizer")
            # the server's form on a copy: the pair's own target stays as loaded, its hash names the build
            target = prepare_target(copy.deepcopy(pair.target), serving)
        prompts = list(load_prompts())
        if a.one_per_family:
            prompts = [next(p for p in prompts if p.family == f) for f in dict.fromkeys(p.family for p in prompts)]
        # a random model's prompts: the stand-in tokenizer's ids (all below 2,048), modulo a tiny model's vocabulary
        words = load_tokenizer(_pair_dir("cpu", "cpu") / "tokenizer") if a.model else pair.tokenizer
        vocab = pair.target.config.vocab_size
        ids = {p.id: [i % vocab for i in words.encode(p.text)] for p in prompts}
        clutch = parse_clutch(a.clutch)
        config = serving.decode_config(a.max_tokens)

        def direct(pid: str) -> DirectRun:
            sync_device(device)
            t0 = time.perf_counter()
            r = generate(target, ids[pid], config, scout=pair.scout,
                         clutch=EntropyClutch(clutch) if clutch is not None else None)
            sync_device(device)
            return DirectRun(list(r.tokens), r.decisions, time.perf_counter() - t0, r.stats.prefill_seconds)

        with httpx.Client(timeout=600) as http:
            def whole(pid: str) -> WholeAnswer:
                answer = http.post(f"{server.url}/v1/completions", json=_request(ids[pid], a.max_tokens, False))
                answer.raise_for_status()
                choice = answer.json()["choices"][0]
                return WholeAnswer(choice["token_ids"], choice["text"])

            if server.wait_ready(http, max(0.0, min(HEALTH_TIMEOUT_S, budget.left()))):
                budget.say("server ready; warm-up")
                measured = measure(list(ids), Sides(direct, whole, lambda pid: _streamed(
                    http, server.url, ids[pid], a.max_tokens)), a.trials, budget, warm_up_runs(config))
            else:
                measured = Measured(list(ids), cut=f"budget: the server was not ready after {budget.elapsed():.0f} s")
                budget.say(f"cut: {measured.cut}")
    finally:
        server.stop()
    models = {} if a.model else {"target": pair.target, "scout": pair.scout}  # a random model: its config and seed
    env = capture_environment(models=models, prompts={pid: words.decode(v) for pid, v in ids.items()})
    env["prompts_hash"] = prompts_hash()
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    if a.model:
        model = f"{a.model} configuration{' (tiny)' if a.tiny else ''}, random weights, {a.dtype}"
    else:
        model = f"sdsie stand-in pair ({a.preset} preset, build {pair_build_id(env['models'])}), {a.dtype}"
    forms = ([f"INT4 {a.int4}"] if a.int4 else []) + ([f"decode step compiled ({a.compile})"] if a.compile else [])
    forms += ["prefill compiled"] if a.compile_prefill else []
    forms += ["prompts graphed"] if a.prefill_graphs else []
    model += "".join(f", {form}" for form in forms)
    return build_record(a, measured, env, model, hardware)


# ------------------------------------------------------------------------------------------------------------
# Command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpu", help="stand-in preset (cpu: the committed pair, for a dry run)")
    p.add_argument("--model", default=None, choices=sorted(MODELS),
                   help="instead of the stand-in pair: this configuration of the end-to-end suite with random "
                        "weights, saved to a temporary folder with a word-level tokenizer; no scout (--clutch off)")
    p.add_argument("--tiny", action="store_true", help="with --model: its tiny configuration (the CPU dry run)")
    p.add_argument("--int4", choices=INT4_PRESETS, default=None,
                   help="both sides: the target in its INT4 decode form (sdsie serve --int4)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="both sides: the target's decode step compiled (sdsie serve --compile)")
    p.add_argument("--compile-prefill", action="store_true", help="both sides: the prompts' forward compiled too")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kv-cache", choices=KV_CACHES, default="dynamic")
    p.add_argument("--cuda-graphs", action="store_true", help="on both sides")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="with --cuda-graphs, on both sides: each prompt replayed as a CUDA graph, padded to the "
                        "engine's prefill sizes (sdsie serve --prefill-graphs)")
    p.add_argument("--clutch", default="production", help="production, tuned, off or LOW,HIGH[,ALPHA]")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per request (eos ignored)")
    p.add_argument("--trials", type=positive_int, default=5)
    p.add_argument("--one-per-family", action="store_true", help="the first prompt of each family only")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads, here and in the server")
    p.add_argument("--max-seconds", type=positive_float, default=None,
                   help="wall-clock budget of the whole run, pair build included; cut runs write an incomplete record")
    p.add_argument("--no-energy", action="store_true", help="the server does not measure energy with NVML")
    p.add_argument("--engine-process", action="store_true",
                   help="the server runs its engine in a process of its own (default: on a thread of its process)")
    p.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temp file)")
    p.add_argument("--out", type=Path, default=Path("telemetry"))
    return p


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    budget = Budget(None)
    a = parser().parse_args(argv)
    parse_clutch(a.clutch)  # refused before anything loads
    if a.model and a.clutch != "off":
        raise SystemExit("--model serves a target without a scout: pass --clutch off")
    if a.tiny and not a.model:
        raise SystemExit("--tiny is an option of --model")
    if a.compile and a.kv_cache != "static":
        raise SystemExit("--compile needs --kv-cache static")
    if a.compile_prefill and not a.compile:
        raise SystemExit("--compile-prefill is an option of --compile")
    if a.cuda_graphs and (a.kv_cache != "static" or not a.device.startswith("cuda")):
        raise SystemExit("--cuda-graphs needs --kv-cache static and --device cuda")
    if a.prefill_graphs and not a.cuda_graphs:
        raise SystemExit("--prefill-graphs is an option of --cuda-graphs")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("serve_bench: --device cuda but torch.cuda.is_available() is False")
        return 2
    budget.seconds = a.max_seconds
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the pair build's progress
    for quiet in ("httpx", "httpcore"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        record = run(a, budget)
    finally:
        signal.signal(signal.SIGTERM, previous)
    path = write_record(record, a.out)
    budget.say(f"record: {path}" + ("" if record.complete else f" (incomplete: {record.config['cut']})"))
    for key, value in sorted(record.metrics.items()):
        print(f"  {key} = {value:.4g}" if not isinstance(value, bool) else f"  {key} = {value}", flush=True)
    return 1 if record.config["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
