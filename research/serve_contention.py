"""Is the server's engine slower than a direct generate() without a GPU in the loop, and does running the engine in
a process of its own remove that? A synthetic engine on the real server stack separates it from CUDA.

Here `generate` is replaced by a loop that, per token, holds the interpreter lock for --hold-us of Python (the host's
share of a graphed step: clutch, launch, bookkeeping) while the device's --step-ms start, then waits for them with the
lock released, calling on_tokens and on_wait as the engine does (--send-at: where on_wait comes). Direct: that
loop alone in this process. Server: `sdsie serve`'s app (uvicorn) in this process over either engine (--engines):
`thread`, the in-process Engine on a thread beside the event loop; `process`, EngineProcess, whose spawned child
installs the same loop through `child_init` (install_fake) before it loads the committed stand-in. Streamed requests
come from a client in a child process (so the client does not take this process's lock); the engine's own time comes
from usage.sdsie.seconds. Each repeat starts a server per engine, in alternating order, between direct runs.

    python -m research.serve_contention [--hold-us 100 --step-ms 1.7 --tokens 128 --requests 12 --repeats 5 \
        --send-at wait,cycle-end]

Answer (this project's shared 2-core CPU; telemetry/raw/serve_contention_onwait_cpu.json, 5 repeats, engine tokens/s
over direct, median (min-max)): where the engine sends each step's text matters more than where it runs. Sent from
generate's on_wait (after the next launch, while the device computes): thread 0.973 (0.965-0.984), process 0.958
(0.923-0.970). Sent straight after each step: thread 0.945 (0.910-0.984), process 0.906 (0.797-0.932). The H200
records (docs/serving.md) agree: the thread engine with on_wait runs at 0.98-0.99 of direct, the process one lower.
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CLIENT = r"""
import json, sys, time, httpx
url, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
with httpx.Client(timeout=120) as c:
    for i in range(n):
        body = {"model": "standin", "prompt": "hello", "max_tokens": tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        t0, first, usage, chunks = time.perf_counter(), None, None, 0
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    usage = d["usage"]
                elif d["choices"] and d["choices"][0].get("text"):
                    chunks += 1
                    first = first or time.perf_counter()
        out.append({"wall_s": time.perf_counter() - t0, "ttft_s": first - t0, "chunks": chunks,
                    "engine_s": usage["sdsie"]["seconds"], "tokens": usage["completion_tokens"]})
print(json.dumps(out))
"""


def fake_generate(hold_us: float, step_s: float, vocab: int, send_at: str = "wait"):
    """A stand-in for sdsie.decoding.generate with the host/device split of a graphed decode step: the host launches
    (hold_us of Python holding the lock), the device then computes for step_s while the host may go on, and the host
    waits for it with the lock released (a CUDA synchronize). send_at "wait" calls on_wait where generate does,
    after the launch and before the wait; "cycle-end" calls it straight after on_tokens, as if the server emitted
    each step's text from on_tokens."""
    from sdsie.decoding.engine import CycleRecord, DecodeStats, GenerationResult

    def generate(model, prompt_ids, config, scout=None, clutch=None, gear=None, on_tokens=None, on_wait=None):
        tokens: list[int] = []
        stop = "max_new_tokens"
        for i in range(config.max_new_tokens):
            t_end = time.perf_counter() + hold_us * 1e-6
            while time.perf_counter() < t_end:  # Python holding the lock, as the host's launch work does
                pass
            device_done = time.perf_counter() + step_s  # the device computes from the launch on
            if on_wait is not None and send_at == "wait":
                on_wait()
            time.sleep(max(0.0, device_done - time.perf_counter()))  # the host waits, the lock released
            tok = 3 + (7 * i) % (vocab - 3)
            tokens.append(tok)
            if on_tokens is not None and on_tokens([tok]):
                stop = "stopped"
                break
            if on_wait is not None and send_at == "cycle-end":
                on_wait()
        n = len(tokens)
        stats = DecodeStats(new_tokens=n, cycles=n, target_forwards=n + 1)
        cycles = [CycleRecord(None, 0, 0, 1, 0.0, None, None, 0.0)] * n
        return GenerationResult(tokens, stop, stats, cycles)

    return generate


def install_fake(hold_us: float, step_s: float, vocab: int, send_at: str = "wait") -> None:
    """The engine process's child_init: the server's engine calls the synthetic generate."""
    from sdsie.serve import worker

    worker.generate = fake_generate(hold_us, step_s, vocab, send_at)


def _spread(rows: list[dict], key: str) -> dict[str, float]:
    values = [r[key] for r in rows]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hold-us", type=float, default=100.0, help="Python per token holding the lock")
    p.add_argument("--step-ms", type=float, default=1.7, help="wait per token with the lock released")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3, help="server runs per engine, each between direct runs")
    p.add_argument("--engines", default="thread,process", help="thread (in this process), process (its own), or both")
    p.add_argument("--send-at", default="wait", help="where the engine sends each step's text: wait (generate's "
                   "on_wait, as Engine.run does), cycle-end (straight after on_tokens), or both")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    engines = a.engines.split(",")
    if not engines or any(e not in ("thread", "process") for e in engines):
        p.error(f"--engines takes thread, process or both, got {a.engines!r}")
    sends = a.send_at.split(",")
    if not sends or any(x not in ("wait", "cycle-end") for x in sends):
        p.error(f"--send-at takes wait, cycle-end or both, got {a.send_at!r}")
    variants = [(e, x) for e in engines for x in sends]

    import uvicorn

    from sdsie.decoding import DecodeConfig
    from sdsie.serve import worker
    from sdsie.serve.app import create_app
    from sdsie.serve.config import ServeConfig
    from sdsie.serve.process import EngineProcess
    from sdsie.standin import COMMITTED_CPU_DIR, load_standin_pair

    target, _, tokenizer = load_standin_pair(COMMITTED_CPU_DIR)
    gen = fake_generate(a.hold_us, a.step_ms * 1e-3, tokenizer.vocab_size)  # direct: no hooks, send_at moot
    config = ServeConfig(target=str(COMMITTED_CPU_DIR / "target"), tokenizer=str(COMMITTED_CPU_DIR / "tokenizer"),
                         model_name="standin", energy=False, context=100_000, max_tokens=max(a.tokens, 512))

    def direct() -> float:
        t0 = time.perf_counter()
        gen(target, [1], DecodeConfig(max_new_tokens=a.tokens))
        return a.tokens / (time.perf_counter() - t0)

    results: dict = {"hold_us": a.hold_us, "step_ms": a.step_ms, "tokens": a.tokens, "requests": a.requests,
                     "runs": []}
    for repeat in range(a.repeats):
        for kind, send_at in variants if repeat % 2 == 0 else variants[::-1]:  # the order alternates
            if kind == "thread":
                worker.generate = fake_generate(a.hold_us, a.step_ms * 1e-3, tokenizer.vocab_size, send_at)
                engine: worker.Front = worker.Engine(target, tokenizer, config)
            else:  # the child installs its own generate
                init = functools.partial(install_fake, a.hold_us, a.step_ms * 1e-3, tokenizer.vocab_size, send_at)
                engine = EngineProcess(config, child_init=init)
                engine.start()  # before the server: its load is not in the timed runs
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port,
                                                   log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            while not server.started:
                time.sleep(0.05)
            try:
                direct_before = [direct() for _ in range(a.requests // 2)]
                client = subprocess.run([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(a.requests),
                                         str(a.tokens)], capture_output=True, text=True, check=True)
                direct_after = [direct() for _ in range(a.requests - a.requests // 2)]
            finally:
                server.should_exit = True
                thread.join(10)
                engine.stop()
            runs = json.loads(client.stdout)
            d = statistics.median(direct_before + direct_after)
            engine_tok_s = statistics.median(r["tokens"] / r["engine_s"] for r in runs)
            server_tok_s = statistics.median(r["tokens"] / r["wall_s"] for r in runs)
            row = {"engine": f"{kind}/{send_at}", "repeat": repeat, "direct_tok_s": d,
                   "server_engine_tok_s": engine_tok_s, "server_tok_s": server_tok_s,
                   "engine_over_direct": engine_tok_s / d, "server_over_direct": server_tok_s / d,
                   "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs),
                   "chunks_per_request": statistics.median(r["chunks"] for r in runs)}
            results["runs"].append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    results["summary"] = {kind: {key: _spread([r for r in results["runs"] if r["engine"] == kind], key)
                                 for key in ("engine_over_direct", "server_over_direct", "ttft_ms")}
                          for kind in (f"{e}/{x}" for e, x in variants)}
    print(json.dumps(results["summary"]), flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
