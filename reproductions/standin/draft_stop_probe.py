"""What ending a cycle's drafting on the scout's confidence (DecodeConfig.draft_stop_prob) would buy, before a GPU
run: fixed-K speculation on a stand-in pair with and without the stop, counted (drafts, kept drafts, scout and
target forwards, tokens), and priced with a decode record's graphed forward times.

    python -m reproductions.standin.draft_stop_probe --out telemetry/raw/draft_stop_probe.json

Counts come from real decodes (lossless, so every variant emits the plain loop's tokens). Times are a model: a
scout step and a target step at the record's GPU times, a verify of d drafts interpolated linearly between the
1-token step and the (K+1)-token verify, and `--sync-ms` per draft made with the stop on (the rule's host sync,
which the graphed loop otherwise does not pay; it reads every draft but a full cycle's last, so this bounds it).
The default pair is the committed CPU pair, whose acceptance is not the gpu pair's: the result is a prediction to
test on the H200, not a measurement of it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sdsie.decoding import DecodeConfig, generate
from sdsie.standin import FAMILIES, load_prompts, load_standin

DEFAULT_RECORD = Path("telemetry/20261130T220336005311Z-dc91eea8_decode_standin.json")


@dataclass(frozen=True)
class ForwardMs:
    """Graphed GPU times of one forward, in ms (a decode record's config.forward_ms_graphs)."""

    target_step: float
    target_verify: float  # K + 1 tokens
    scout_step: float
    k: int

    def verify(self, drafts: int) -> float:
        return self.target_step + (self.target_verify - self.target_step) * drafts / self.k


def forward_ms(record: Path) -> ForwardMs:
    f = json.loads(record.read_text())["config"]["forward_ms_graphs"]
    return ForwardMs(f["target_step_gpu_ms"], f["target_verify_gpu_ms"], f["scout_step_gpu_ms"], int(f["k"]))


def model_ms(drafts: list[int], ms: ForwardMs, sync_ms: float, stop: float | None) -> float:
    """Modelled decode time of cycles drafting drafts[i] tokens each: scout steps, a verify per cycle, and with the
    stop on a sync per draft (the rule reads every draft but a full cycle's last: an upper bound)."""
    per_draft = ms.scout_step + (sync_ms if stop is not None else 0.0)
    return sum(d * per_draft + ms.verify(d) for d in drafts)


def run(pair: str, k: int, max_new: int, stops: list[float | None], schedules: list[str], ms: ForwardMs,
        sync_ms: float, device: str = "cpu") -> dict:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target, scout, tokenizer = load_standin(pair, device, dtype)
    prompts = [(p.id, p.family, tokenizer(p.text, return_tensors="pt").input_ids[0].to(device))
               for p in load_prompts()]
    out: dict = {"pair": pair, "device": device, "dtype": str(dtype), "k": k, "max_new_tokens": max_new,
                 "forward_ms": ms.__dict__, "sync_ms": sync_ms, "variants": {}}
    plain = {pid: generate(target, ids, DecodeConfig(max_new_tokens=max_new)).tokens for pid, _, ids in prompts}
    for schedule in schedules:
        for stop in stops:
            name = f"{schedule}_stop{stop}"
            fams: dict[str, dict] = {f: {"drafted": 0, "accepted": 0, "tokens": 0, "plain_ms": 0.0, "model_ms": 0.0,
                                         "draft_stops": 0} for f in FAMILIES}
            for pid, fam, ids in prompts:
                cfg = DecodeConfig(max_new_tokens=max_new, k_draft=k, k_schedule=schedule, draft_stop_prob=stop)
                r = generate(target, ids, cfg, scout=scout)
                if r.tokens != plain[pid]:
                    raise AssertionError(f"{name} on {pid} changed the tokens: the engine is not lossless")
                f = fams[fam]
                f["drafted"] += r.stats.drafted
                f["accepted"] += r.stats.accepted
                f["draft_stops"] += r.stats.draft_stops
                f["tokens"] += len(r.tokens)
                f["plain_ms"] += len(r.tokens) * ms.target_step
                f["model_ms"] += model_ms([c.k for c in r.cycles], ms, sync_ms, stop)
            for f in fams.values():
                f["acceptance"] = f["accepted"] / f["drafted"] if f["drafted"] else None
                f["model_speedup_vs_plain"] = f["plain_ms"] / f["model_ms"]
            out["variants"][name] = fams
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="cpu", help="stand-in preset (cpu: the committed pair; gpu: cached or built)")
    p.add_argument("--device", default="cpu", help="cuda runs the pair in bf16 (the counts need no timing)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stops", type=float, nargs="*", default=[0.2, 0.4, 0.6])
    p.add_argument("--record", type=Path, default=DEFAULT_RECORD, help="decode record with forward_ms_graphs")
    p.add_argument("--sync-ms", type=float, default=0.03, help="modelled host sync per probability read")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.k < 2:
        p.error("--k must be at least 2: with one draft a cycle has nothing to stop")
    if not all(0.0 < t <= 1.0 for t in a.stops):
        p.error(f"--stops {a.stops}: each threshold must be a probability in (0, 1]")
    if a.sync_ms < 0 or a.max_new_tokens < 1:
        p.error(f"--sync-ms must be >= 0 and --max-new-tokens >= 1, got {a.sync_ms} and {a.max_new_tokens}")
    torch.manual_seed(0)
    res = run(a.pair, a.k, a.max_new_tokens, [None, *a.stops], ["constant", "adaptive"], forward_ms(a.record),
              a.sync_ms, a.device)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    for name, fams in res["variants"].items():
        print(name, " ".join(f"{fam}: acc {f['acceptance']:.2f} drafts {f['drafted']} "
                             f"x{f['model_speedup_vs_plain']:.3f}" for fam, f in fams.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
