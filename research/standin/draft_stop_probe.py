"""What ending a cycle's drafting on the scout's confidence (DecodeConfig.draft_stop_prob) would buy, before a GPU
run: fixed-K speculation on a stand-in pair with and without the stop, counted (drafts, kept drafts, scout and
target forwards, tokens), and priced with a decode record's graphed forward times.

Answered on the committed CPU pair: no threshold from 0.01 to 0.6 beat the adaptive schedule without the stop on any
family (telemetry/raw/draft_stop_probe_20261201T0520_cpu.json; docs/log.md). The gpu pair's count (`--pair gpu --device
cuda`) has not been run.

    python -m research.standin.draft_stop_probe --out telemetry/raw/draft_stop_probe.json

Counts come from real decodes. The engine is lossless up to floating-point near-ties: in bf16 the (K+1)-token verify
and the 1-token plain step run other kernels, so where the target's top two logits (nearly) tie the argmax can flip
and a variant's tokens leave the plain loop's. Each such divergence is reported (out["mismatches"]: variant, prompt,
first differing position, and, teacher-forced along the plain output, the target's top-1 minus top-2 logit gap and
the variant token's deficit against the plain token), and the run raises only where the divergence is no near-tie
(gap or deficit above `--near-tie-gap`, or a length difference): a real losslessness bug. A run that diverged at a
near-tie still counts its drafts, kept drafts, stops and tokens: it is a real decode of the same prompt, one that
took the other branch of the tie, and dropping it would bias the families' counts toward prompts without ties.

Times are a model: a scout step and a target step at the record's GPU times, a verify of d drafts interpolated
linearly between the 1-token step and the (K+1)-token verify, and `--sync-ms` per draft made with the stop on (the
rule's host sync, which the graphed loop otherwise does not pay; it reads every draft but a full cycle's last, so
this bounds it). The default pair is the committed CPU pair, whose acceptance is not the gpu pair's: the result is
a prediction to test on the H200, not a measurement of it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from reproductions.decode_repro import divergence_point, gap_at
from sdsie.decoding import DecodeConfig, GenerationResult, generate
from sdsie.standin import FAMILIES, load_prompts, load_standin

DEFAULT_RECORD = Path("telemetry/20261130T220336005311Z-dc91eea8_decode_standin.json")
# Largest top-2 logit gap (and variant-token deficit) a divergence may have to count as a near-tie: the flips the
# decode records found were at gaps of 0.0 and 0.0625 (one bf16 step at logits in [8, 16)); this allows two steps.
NEAR_TIE_GAP = 0.125


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


def divergence(target: nn.Module, ids: torch.Tensor, plain: list[int], tokens: list[int]) -> dict | None:
    """Where tokens first leave plain (None if they never do), with the target's top-2 gap and the variant token's
    deficit there, from single-token logits teacher-forced along plain (decode_repro's measurement)."""
    point = divergence_point(plain, tokens)
    if point is None:
        return None
    return {**point, **gap_at(target, ids, plain, point["position"], point["variant_token"])}


def is_near_tie(mismatch: dict, tol: float) -> bool:
    """A divergence floating point can explain: the plain path's top two logits within tol, and the variant's token
    within tol of the plain token (a length difference, with no gap to measure, never is)."""
    gap, deficit = mismatch["plain_gap"], mismatch["variant_token_deficit"]
    return gap is not None and deficit is not None and gap <= tol and deficit <= tol


def check_lossless(name: str, pid: str, mismatch: dict, tol: float) -> None:
    if not is_near_tie(mismatch, tol):
        raise AssertionError(
            f"{name} on {pid} changed the tokens at position {mismatch['position']} (plain "
            f"{mismatch['plain_token']}, variant {mismatch['variant_token']}) where the target's top-2 logit gap is "
            f"{mismatch['plain_gap']} and the variant token's deficit {mismatch['variant_token_deficit']}: "
            f"not a near-tie (tolerance {tol}), so the engine is not lossless")


def add_counts(f: dict, r: GenerationResult, ms: ForwardMs, sync_ms: float, stop: float | None) -> None:
    f["drafted"] += r.stats.drafted
    f["accepted"] += r.stats.accepted
    f["draft_stops"] += r.stats.draft_stops
    f["tokens"] += len(r.tokens)
    f["plain_ms"] += len(r.tokens) * ms.target_step
    f["model_ms"] += model_ms([c.k for c in r.cycles], ms, sync_ms, stop)


def run(pair: str, k: int, max_new: int, stops: list[float | None], schedules: list[str], ms: ForwardMs,
        sync_ms: float, device: str = "cpu", near_tie_gap: float = NEAR_TIE_GAP) -> dict:
    """Every (schedule, stop) variant on every prompt, counted per family. Raises AssertionError on a divergence
    from plain decoding that is no near-tie (see is_near_tie); near-tie divergences go to out["mismatches"]."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target, scout, tokenizer = load_standin(pair, device, dtype)
    prompts = [(p.id, p.family, tokenizer(p.text, return_tensors="pt").input_ids[0].to(device))
               for p in load_prompts()]
    out: dict = {"pair": pair, "device": device, "dtype": str(dtype), "k": k, "max_new_tokens": max_new,
                 "forward_ms": ms.__dict__, "sync_ms": sync_ms, "near_tie_gap": near_tie_gap, "variants": {},
                 "mismatches": []}
    plain = {pid: generate(target, ids, DecodeConfig(max_new_tokens=max_new)).tokens for pid, _, ids in prompts}
    for schedule in schedules:
        for stop in stops:
            name = f"{schedule}_stop{stop}"
            fams: dict[str, dict] = {f: {"drafted": 0, "accepted": 0, "tokens": 0, "plain_ms": 0.0, "model_ms": 0.0,
                                         "draft_stops": 0} for f in FAMILIES}
            for pid, fam, ids in prompts:
                cfg = DecodeConfig(max_new_tokens=max_new, k_draft=k, k_schedule=schedule, draft_stop_prob=stop)
                r = generate(target, ids, cfg, scout=scout)
                mismatch = divergence(target, ids, plain[pid], r.tokens)
                if mismatch is not None:
                    check_lossless(name, pid, mismatch, near_tie_gap)
                    out["mismatches"].append({"variant": name, "prompt": pid, "family": fam, **mismatch})
                add_counts(fams[fam], r, ms, sync_ms, stop)
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
    p.add_argument("--near-tie-gap", type=float, default=NEAR_TIE_GAP,
                   help="largest top-2 logit gap at which a divergence from plain decoding is reported, not raised")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.k < 2:
        p.error("--k must be at least 2: with one draft a cycle has nothing to stop")
    if not all(0.0 < t <= 1.0 for t in a.stops):
        p.error(f"--stops {a.stops}: each threshold must be a probability in (0, 1]")
    if a.sync_ms < 0 or a.max_new_tokens < 1 or a.near_tie_gap < 0:
        p.error(f"--sync-ms and --near-tie-gap must be >= 0 and --max-new-tokens >= 1, got {a.sync_ms}, "
                f"{a.near_tie_gap} and {a.max_new_tokens}")
    torch.manual_seed(0)
    res = run(a.pair, a.k, a.max_new_tokens, [None, *a.stops], ["constant", "adaptive"], forward_ms(a.record),
              a.sync_ms, a.device, a.near_tie_gap)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    for name, fams in res["variants"].items():
        print(name, " ".join(f"{fam}: acc {f['acceptance']:.2f} drafts {f['drafted']} "
                             f"x{f['model_speedup_vs_plain']:.3f}" for fam, f in fams.items()))
    for m in res["mismatches"]:
        print(f"near-tie divergence: {m['variant']} on {m['prompt']} @{m['position']} (plain {m['plain_token']}, "
              f"variant {m['variant_token']}) gap {m['plain_gap']:.4f} deficit {m['variant_token_deficit']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
