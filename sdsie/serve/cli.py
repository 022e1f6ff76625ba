"""`sdsie serve ...`: the options, and the run that starts the engine (on a thread of this process, or with
--engine-process in a process of its own, which loads the models) and serves until interrupted.

Importing this module needs no serving packages; running it needs the `serve` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdsie.serve.config import DTYPES, INT4_PRESETS, KV_CACHES, ServeConfig, log_to_stderr, parse_clutch

__all__ = ["config_from_args", "configure", "run"]


def _clutch(text: str):  # -> ClutchConfig | None
    try:
        return parse_clutch(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: a save_pretrained folder or a hub id")
    p.add_argument("--scout", default=None, help="scout (draft) model sharing the target's vocabulary; "
                                                  "without one, no speculation")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: each model's own)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    p.add_argument("--clutch", type=_clutch, default="production", metavar="production|tuned|off|LOW,HIGH[,ALPHA]",
                   help="the entropy clutch gating the scout and the gear (default production; off: fixed-K "
                        "speculation with a scout)")
    p.add_argument("--gear", default="", metavar="LINEAR[,LINEAR...]",
                   help="gate these linear layers to INT4 when the clutch engages (e.g. mlp.down_proj; default none)")
    p.add_argument("--gear-layers", default=None, metavar="I[,I...]", help="decoder layers to gate (default all)")
    p.add_argument("--int4", choices=INT4_PRESETS, default=None,
                   help="quantize the target's decoder linears and LM head to INT4 at load (min-max, groups of 128 "
                        "or per channel), q/k/v and gate/up fused, norms in the INT4 launches (docs/int4.md)")
    p.add_argument("--no-fuse-norms", action="store_true",
                   help="with --int4: keep the RMS norms and residual adds as the model's own modules")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="compile the target's decode step with torch.compile (default backend inductor; needs "
                        "--kv-cache static; the first request of each length compiles)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="with --compile: compile the prompt's forward too, with a dynamic length (one graph for all)")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="with --cuda-graphs: replay each prompt's forward as a CUDA graph, "
                        "padded to one of the engine's prefill sizes (each size captures on its first use)")
    p.add_argument("--warm-up", type=int, nargs="+", default=(), metavar="POSITIONS",
                   help="run one short request at each of these cache lengths (a request's prompt plus max_tokens, "
                        "rounded up to 256) before the port opens, so their compilations, graph captures and "
                        "kernel builds happen at start, not in a client's request (minutes with --compile)")
    p.add_argument("--kv-cache", choices=KV_CACHES, default="dynamic")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs "
                                                              "(needs --kv-cache static and a CUDA device)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default cpu)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--max-tokens", type=int, default=512, help="the most tokens one request may ask for")
    p.add_argument("--context", type=int, default=None,
                   help="positions one request may fill, prompt plus max_tokens (default: the target's maximum)")
    p.add_argument("--queue-size", type=int, default=16, help="requests that may wait; one more gets 503")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="Jinja chat template replacing the tokenizer's (for tokenizers without one)")
    p.add_argument("--no-energy", action="store_true", help="do not measure energy with NVML")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's choice)")
    p.add_argument("--engine-process", action="store_true",
                   help="run the engine in a process of its own instead of on a thread of the server's process (the "
                        "decode then has an interpreter to itself; slower than the thread on a 2-core CPU and an H200: "
                        "docs/serving.md)")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    clutch = args.clutch if not isinstance(args.clutch, str) else parse_clutch(args.clutch)
    layers = None if args.gear_layers is None else tuple(int(i) for i in args.gear_layers.split(","))
    template = None if args.chat_template is None else args.chat_template.read_text()
    if args.no_fuse_norms and args.int4 is None:
        raise ValueError("--no-fuse-norms is an option of --int4")
    return ServeConfig(
        target=args.target, scout=args.scout, tokenizer=args.tokenizer, model_name=args.model_name,
        clutch=clutch if (args.scout is not None or args.gear) else None,
        gear=tuple(g for g in args.gear.split(",") if g), gear_layers=layers, int4=args.int4,
        fuse_norms=not args.no_fuse_norms, compile=args.compile,
        compile_prefill=args.compile_prefill, prefill_graphs=args.prefill_graphs, warm_up=tuple(args.warm_up),
        kv_cache=args.kv_cache, cuda_graphs=args.cuda_graphs, device=args.device, dtype=args.dtype, host=args.host,
        port=args.port, api_key=args.api_key, max_tokens=args.max_tokens, context=args.context,
        queue_size=args.queue_size, chat_template=template, energy=not args.no_energy)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as err:
        print(f"sdsie serve: {err}", file=sys.stderr)
        return 1
    log_to_stderr()
    try:
        from sdsie.serve.app import run_server
        from sdsie.serve.process import EngineProcess, EngineStartError
        from sdsie.serve.worker import Engine
    except ImportError as err:
        print(f"sdsie serve needs the serve extra (pip install 'sdsie[serve]'): {err}", file=sys.stderr)
        return 1
    try:
        if args.engine_process:
            engine: Engine | EngineProcess = EngineProcess(config, threads=args.threads)
            engine.start()  # the models load in the engine's process; a failure ends here, before the port opens
        else:
            if args.threads:
                import torch

                torch.set_num_threads(args.threads)
            engine = Engine.load(config)
    except (ValueError, OSError, EngineStartError) as err:
        print(f"sdsie serve: {err}", file=sys.stderr)
        return 1
    try:
        run_server(engine)
    finally:
        engine.stop()
    return 0
