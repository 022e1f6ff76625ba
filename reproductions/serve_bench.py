"""Server overhead: `sdsie serve` tokens/s against direct `generate()` on the same prompts, and time to first token.

The server runs as its own process (`python -m sdsie.cli serve`), as a deployment would, on the stand-in pair's
folders; this process loads the same folders for the direct runs. The two take turns on the device, never at
once, interleaved per prompt and trial (the order alternating between trials). Each request is greedy with a
fixed length (ignore_eos), so both sides generate the same tokens: the untimed warm-up checks that token for
token (non-streamed, return_token_ids) and also captures any CUDA graphs on both sides.

Per timed run: direct tokens/s = tokens / wall time of generate(); server tokens/s = tokens / (request sent ->
`data: [DONE]`), streamed, parsed as raw SSE by httpx; time to first token = request sent -> the first chunk with
text; the server's own engine time (usage.sdsie.seconds) separates HTTP and queueing from decoding. One record,
suite `serve_overhead`.

    python -m reproductions.serve_bench --preset gpu --device cuda --dtype bfloat16 --kv-cache static \\
        --cuda-graphs --max-tokens 128 --trials 5 --out telemetry
    python -m reproductions.serve_bench --preset cpu --device cpu --trials 1 --max-tokens 4 --one-per-family \\
        --threads 1 --out /tmp/serve_bench                                          (the CPU dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdsie.clutch import EntropyClutch
from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.model_io import sync_device
from sdsie.serve.config import DTYPES, KV_CACHES, parse_clutch
from sdsie.telemetry.records import RunRecord, capture_environment, write_record

REPO = Path(__file__).resolve().parents[1]
SUITE = "serve_overhead"
HEALTH_TIMEOUT_S = 300.0  # model loading on a cold machine


@dataclass
class Timed:
    direct_tok_s: float
    direct_first_token_s: float
    server_tok_s: float
    server_ttft_s: float
    server_engine_tok_s: float
    server_energy_j: float | None
    tokens: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair_dir(preset: str, device: str) -> Path:
    from sdsie.standin import COMMITTED_CPU_DIR, ensure_standin, get_preset

    return COMMITTED_CPU_DIR if preset == "cpu" else ensure_standin(get_preset(preset), torch.device(device))


class Server:
    """`sdsie serve` in a child process, on a free port of 127.0.0.1; stopped on exit."""

    def __init__(self, pair: Path, a: argparse.Namespace, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sdsie.cli", "serve", "--target", str(pair / "target"), "--scout",
               str(pair / "scout"), "--tokenizer", str(pair / "tokenizer"), "--clutch", a.clutch, "--device",
               a.device, "--dtype", a.dtype, "--kv-cache", a.kv_cache, "--port", str(self.port), "--model-name",
               "standin", "--max-tokens", str(a.max_tokens)]
        cmd += ["--cuda-graphs"] if a.cuda_graphs else []
        cmd += ["--threads", str(a.threads)] if a.threads else []
        self.log = log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, http: Any) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if http.get(f"{self.url}/health").status_code == 200:
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health in {HEALTH_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _request(ids: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    body = {"model": "standin", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return {**body, "stream_options": {"include_usage": True}} if stream else {**body, "return_token_ids": True}


def _streamed(http: Any, url: str, ids: list[int], max_tokens: int) -> tuple[float, float, dict[str, Any]]:
    """(time to first text, total seconds, usage) of one streamed request."""
    t0 = time.perf_counter()
    ttft, usage = None, None
    with http.stream("POST", f"{url}/v1/completions", json=_request(ids, max_tokens, True)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    total = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("the stream carried no usage chunk")
    return (ttft if ttft is not None else total), total, usage


def run(a: argparse.Namespace) -> RunRecord:
    import httpx

    from reproductions.decode_repro import pair_build_id
    from sdsie.models import load_pair
    from sdsie.standin import load_prompts, prompts_hash

    if a.threads:
        torch.set_num_threads(a.threads)
    pair_dir = _pair_dir(a.preset, a.device)
    dtype = getattr(torch, a.dtype)
    pair = load_pair(pair_dir / "target", pair_dir / "scout", dtype, a.device, tokenizer=pair_dir / "tokenizer")
    prompts = list(load_prompts())
    if a.one_per_family:
        prompts = [next(p for p in prompts if p.family == f) for f in dict.fromkeys(p.family for p in prompts)]
    ids = {p.id: list(pair.tokenizer.encode(p.text)) for p in prompts}
    clutch = parse_clutch(a.clutch)
    config = DecodeConfig(max_new_tokens=a.max_tokens, kv_cache=a.kv_cache, cuda_graphs=a.cuda_graphs)
    device = torch.device(a.device)

    def direct(prompt: list[int]):
        sync_device(device)
        t0 = time.perf_counter()
        r = generate(pair.target, prompt, config, scout=pair.scout,
                     clutch=EntropyClutch(clutch) if clutch is not None else None)
        sync_device(device)
        return r, time.perf_counter() - t0

    log = Path(tempfile.mkdtemp(prefix="serve_bench_")) / "server.log"
    server = Server(pair_dir, a, log)
    runs: dict[str, list[Timed]] = {p.id: [] for p in prompts}
    mismatches: list[str] = []
    try:
        with httpx.Client(timeout=600) as http:
            server.wait_ready(http)
            for p in prompts:  # warm-up, untimed: graphs captured on both sides, tokens compared
                ref, _ = direct(ids[p.id])
                answer = http.post(f"{server.url}/v1/completions", json=_request(ids[p.id], a.max_tokens, False))
                answer.raise_for_status()
                if answer.json()["choices"][0]["token_ids"] != ref.tokens:
                    mismatches.append(p.id)
            for trial in range(a.trials):
                for p in prompts:
                    first, second = ("direct", "server") if trial % 2 == 0 else ("server", "direct")
                    out: dict[str, Any] = {}
                    for side in (first, second):
                        if side == "direct":
                            out["direct"] = direct(ids[p.id])
                        else:
                            out["server"] = _streamed(http, server.url, ids[p.id], a.max_tokens)
                    (r, seconds), (ttft, total, usage) = out["direct"], out["server"]
                    n = usage["completion_tokens"]
                    runs[p.id].append(Timed(len(r.tokens) / seconds, r.stats.prefill_seconds, n / total, ttft,
                                            n / usage["sdsie"]["seconds"], usage["sdsie"]["energy_j"], n))
                print(f"serve_bench: trial {trial + 1}/{a.trials} done", flush=True)
    finally:
        server.stop()
    return _record(a, runs, mismatches, pair, ids, pair_build_id, prompts_hash())


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _record(a: argparse.Namespace, runs: dict[str, list[Timed]], mismatches: list[str], pair: Any,
            ids: dict[str, list[int]], pair_build_id: Any, prompts_digest: str) -> RunRecord:
    every = [t for ts in runs.values() for t in ts]
    ratio = [t.server_tok_s / t.direct_tok_s for t in every]
    ttft = [t.server_ttft_s for t in every]
    samples = {"direct_tok_s": [t.direct_tok_s for t in every], "server_tok_s": [t.server_tok_s for t in every],
               "tok_s_ratio": ratio, "server_ttft_s": ttft,
               "direct_first_token_s": [t.direct_first_token_s for t in every],
               "server_engine_tok_s": [t.server_engine_tok_s for t in every]}
    for pid, ts in runs.items():
        samples[f"{pid}|tok_s_ratio"] = [t.server_tok_s / t.direct_tok_s for t in ts]
    energy = [t.server_energy_j / t.tokens for t in every if t.server_energy_j is not None]
    metrics: dict[str, float | bool] = {
        "serve.direct_tok_s_median": _median(samples["direct_tok_s"]),
        "serve.server_tok_s_median": _median(samples["server_tok_s"]),
        "serve.server_engine_tok_s_median": _median(samples["server_engine_tok_s"]),
        "serve.tok_s_ratio_median": _median(ratio),
        "serve.tok_s_ratio_min": min(ratio),
        "serve.ttft_s_median": _median(ttft),
        "serve.ttft_s_max": max(ttft),
        "serve.direct_first_token_s_median": _median(samples["direct_first_token_s"]),
        "serve.tokens_identical": not mismatches,
    }
    if energy:  # only requests whose window gave a reading; none: no energy metric at all
        samples["server_j_per_token"] = energy
        metrics["serve.server_j_per_token_median"] = _median(energy)
    env = capture_environment(models={"target": pair.target, "scout": pair.scout},
                              prompts={pid: pair.tokenizer.decode(v) for pid, v in ids.items()})
    env["prompts_hash"] = prompts_digest
    hardware = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu (dry run)"
    config = {k: getattr(a, k) for k in ("preset", "device", "dtype", "kv_cache", "cuda_graphs", "clutch",
                                         "max_tokens", "trials", "one_per_family", "threads")}
    config.update(prompts=list(ids), mismatched_prompts=mismatches, transport="HTTP/1.1 SSE, server in a child "
                  "process, client httpx in this process", order="interleaved per prompt, alternating per trial")
    return RunRecord(claim_ids=[], suite=SUITE, config=config, samples=samples, metrics=metrics, environment=env,
                     conditions={"model": f"sdsie stand-in pair ({a.preset} preset, build "
                                          f"{pair_build_id(env['models'])}), {a.dtype}",
                                 "hardware": hardware, "trials": a.trials})


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpu", help="stand-in preset (cpu: the committed pair, for a dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kv-cache", choices=KV_CACHES, default="dynamic")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--clutch", default="production", help="production, tuned, off or LOW,HIGH[,ALPHA]")
    p.add_argument("--max-tokens", type=_positive, default=128, help="tokens per request (eos ignored)")
    p.add_argument("--trials", type=_positive, default=5)
    p.add_argument("--one-per-family", action="store_true", help="the first prompt of each family only")
    p.add_argument("--threads", type=_positive, default=None, help="torch CPU threads, here and in the server")
    p.add_argument("--out", type=Path, default=Path("telemetry"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    parse_clutch(a.clutch)  # refused before anything loads
    if a.cuda_graphs and (a.kv_cache != "static" or not a.device.startswith("cuda")):
        raise SystemExit("--cuda-graphs needs --kv-cache static and --device cuda")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("serve_bench: --device cuda but torch.cuda.is_available() is False")
        return 2
    record = run(a)
    path = write_record(record, a.out)
    print(f"record: {path}")
    for key, value in sorted(record.metrics.items()):
        print(f"  {key} = {value:.4g}" if not isinstance(value, bool) else f"  {key} = {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
