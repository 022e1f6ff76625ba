"""Does the INT4 decode's energy per token fall with its speed?

The decode J/token bar (at most 0.40x bf16's) was read as a speed target at constant power: 625 tok/s on
Llama-3.1-8B at the fused form's 613 W (docs/kernel-log.md, 2026-12-06 20:40). That holds only if power stays put as
the decode gets faster. The `decode_e2e` records answer it without a GPU: each ran several variants in one process,
on one card, minutes apart, so within a record a faster variant's power can be set against a slower one's. For each
pair of variants in one record (model, prompt) this prints both speeds and powers, and the elasticity of decode
J/token in speed, d ln J / d ln (tok/s): 0 where energy per token is fixed whatever the speed (power follows the
speed), -1 where power is fixed (energy per token falls as the time). From the elasticity it gives the speed at
which the faster variant would reach the bar, were the elasticity to hold. Pairs less than MIN_SPEED_RATIO apart in
speed are left out: their elasticity is the ratio of two differences inside the runs' spread. The answer is in
docs/kernel-log.md (2026-12-07 03:30).

    python -m research.energy_per_token [--records telemetry] [--gpu "NVIDIA H200"] [--bar 0.40]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

METRIC = re.compile(r"^(?P<model>.+)\.p(?P<prompt>\d+)\.(?P<variant>[a-z0-9_]+)\.(?P<key>decode_tok_s_median|"
                    r"j_per_token_decode)$")
BASELINE = "bf16_compiled"
# (slower, faster) pairs: the same INT4 kernel on unfused (gated_int4) and fused q/k/v and gate/up, without and with
# the norms in its launches, and tinygemm's kernel against sdsie's on the same fused model.
PAIRS = (("gated_int4_compiled", "int4_compiled"), ("int4_compiled", "int4_norms_compiled"),
         ("tinygemm_compiled", "int4_compiled"))
MIN_SPEED_RATIO = 1.10  # bf16's decode J/token moved 10% between records of one card (2.28-2.51 J, Llama-3.1-8B)


@dataclass(frozen=True)
class Row:
    """One variant of one record: decode tok/s, decode J/token, and their product, the decode's mean power."""

    record: str
    gpu: str
    model: str
    prompt: int
    variant: str
    tok_s: float
    j_per_token: float

    @property
    def watts(self) -> float:
        return self.tok_s * self.j_per_token


def record_rows(doc: dict, record: str) -> list[Row]:
    """The variants of one decode_e2e record that have both decode tok/s and decode J/token."""
    gpu = doc["environment"]["gpu"]["name"]
    found: dict[tuple[str, int, str], dict[str, float]] = {}
    for key, value in doc["metrics"].items():
        m = METRIC.match(key)
        if m is not None:
            found.setdefault((m["model"], int(m["prompt"]), m["variant"]), {})[m["key"]] = float(value)
    return [Row(record, gpu, model, prompt, variant, v["decode_tok_s_median"], v["j_per_token_decode"])
            for (model, prompt, variant), v in sorted(found.items()) if len(v) == 2]


def elasticity(slow: Row, fast: Row) -> float:
    """d ln(J/token) / d ln(tok/s) between two variants of one record."""
    if slow.tok_s == fast.tok_s:
        raise ValueError(f"{slow.variant} and {fast.variant} run at the same speed: no elasticity")
    return math.log(fast.j_per_token / slow.j_per_token) / math.log(fast.tok_s / slow.tok_s)


def speed_for_bar(fast: Row, baseline: Row, bar: float, e: float) -> float | None:
    """tok/s at which `fast` would reach bar x the baseline's J/token if its J/token kept elasticity e in speed;
    None where e >= 0 (no speed lowers its energy per token)."""
    target = bar * baseline.j_per_token
    if fast.j_per_token <= target:
        return fast.tok_s
    if e >= 0:
        return None
    return fast.tok_s * (target / fast.j_per_token) ** (1 / e)


def pair_table(rows: list[Row], bar: float) -> list[dict]:
    """Each PAIRS pair found in one (record, model, prompt), with the baseline of the same group."""
    groups: dict[tuple[str, str, int], dict[str, Row]] = {}
    for r in rows:
        groups.setdefault((r.record, r.model, r.prompt), {})[r.variant] = r
    out = []
    for (record, model, prompt), by in sorted(groups.items()):
        for slow_name, fast_name in PAIRS:
            if slow_name not in by or fast_name not in by:
                continue
            slow, fast = by[slow_name], by[fast_name]
            if fast.tok_s < MIN_SPEED_RATIO * slow.tok_s:
                continue
            e = elasticity(slow, fast)
            base = by.get(BASELINE)
            out.append({"record": record, "gpu": fast.gpu, "model": model, "prompt": prompt, "slow": slow, "fast": fast,
                        "elasticity": e, "bar_tok_s": None if base is None else speed_for_bar(fast, base, bar, e),
                        "baseline": base})
    return out


def load(records: Path) -> list[Row]:
    rows = []
    for path in sorted(records.glob("*_decode_e2e.json")):
        rows += record_rows(json.loads(path.read_text()), path.name.split("-")[1].split("_")[0])
    if not rows:
        raise SystemExit(f"no decode_e2e record with decode tok/s and J/token under {records}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=Path, default=Path("telemetry"))
    ap.add_argument("--gpu", default=None, help="only records of this GPU name (e.g. 'NVIDIA H200')")
    ap.add_argument("--bar", type=float, default=0.40, help="decode J/token against bf16's to reach")
    a = ap.parse_args(argv)
    rows = [r for r in load(a.records) if a.gpu is None or r.gpu == a.gpu]
    print("| GPU | model | prompt | slower variant: tok/s, W, J/token | faster variant: tok/s, W, J/token | "
          f"elasticity of J/token in speed | tok/s for {a.bar:.2f}x bf16's J/token at that elasticity | record |")
    print("|---|---|---|---|---|---|---|---|")
    for p in pair_table(rows, a.bar):
        s, f = p["slow"], p["fast"]
        need = p["bar_tok_s"]
        need_s = "-" if p["baseline"] is None else ("none" if need is None else f"{need:.0f}")
        print(f"| {p['gpu']} | {p['model']} | {p['prompt']} | {s.variant}: {s.tok_s:.1f}, {s.watts:.0f}, "
              f"{s.j_per_token:.3f} | {f.variant}: {f.tok_s:.1f}, {f.watts:.0f}, {f.j_per_token:.3f} | "
              f"{p['elasticity']:+.2f} | {need_s} | `{p['record']}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
