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

--ceiling KERNEL_RECORD asks how far speed alone can take it: each decode's GEMVs at the graphed copy time of their
bytes, shape by shape (M = 1, group 128, from a `kernel_shapes` record of the same GPU), the rest of its token as
profiled. It prints that token's tok/s, its J/token against bf16's at elasticities 0, -0.5 and -1, the elasticity
the bar needs, and where the record measured idle power, the J/token there with the energy above idle a token as
measured (docs/kernel-log.md, 2026-12-07 05:20 and 05:40).

--per-byte splits each decode's energy above the card's idle power by the bytes a token reads (the record's copy
rate over its bytes bound): nJ a byte read, where a variant that does more work a byte spends more (docs/kernel-log.md,
2026-12-07 07:40). Only records that measured idle power have the figure.

    python -m research.energy_per_token [--records telemetry] [--gpu "NVIDIA H200"] [--bar 0.40]
    python -m research.energy_per_token --ceiling 590ad92b [--variant int4_norms_compiled]
    python -m research.energy_per_token --per-byte [--gpu "NVIDIA H200"]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from reproductions.decode_e2e import MODELS
from sdsie.telemetry.records import short_id

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


def decode_linears(model: str) -> list[tuple[int, int, int]]:
    """(N, K, launches a token) of the INT4 decode's GEMVs in its fused form (q/k/v and gate/up each one weight, the
    LM head quantized), from `decode_e2e.MODELS`."""
    c = MODELS[model]
    h, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head = h // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head
    return [(qkv, h, layers), (h, h, layers), (2 * f, h, layers), (h, f, layers), (c["vocab_size"], h, 1)]


def copy_times(kernel_doc: dict, m: int = 1, group: str = "128") -> dict[tuple[int, int], float]:
    """Graphed copy time (us) of each shape's INT4 bytes in a `kernel_shapes` record, by (N, K)."""
    out = {}
    for name, shape in kernel_doc["config"]["shapes"].items():
        sample = kernel_doc["samples"].get(f"{name}|m{m}|g{group}|copy")
        if sample:
            out[(shape["n"], shape["k"])] = float(sample[0])
    return out


def copy_ceiling(doc: dict, model: str, prompt: int, variant: str, copies: dict[tuple[int, int], float],
                 bar: float) -> dict:
    """One decode variant with its GEMVs at their copies' time and the rest of its token as profiled: tok/s there,
    J/token against bf16's at elasticities 0, -0.5 and -1 from the measured point, and the elasticity that meets
    the bar (None where the measured point meets it)."""
    m = doc["metrics"]
    at = f"{model}.p{prompt}.{variant}."
    missing = [(n, k) for n, k, _ in decode_linears(model) if (n, k) not in copies]
    if missing:
        raise ValueError(f"the kernel record has no M = 1 copy time for {model}'s shapes {missing}")
    gemv_copy = sum(count * copies[(n, k)] for n, k, count in decode_linears(model))
    gemv = m[at + "per_token.gemv_gemm.busy_us"]
    rest = m[at + "per_token.busy_us"] - gemv + m[at + "per_token.outside_us"]
    tok_s, j = m[at + "decode_tok_s_median"], m[at + "j_per_token_decode"]
    base = m[f"{model}.p{prompt}.{BASELINE}.j_per_token_decode"]
    tok_s_copy = 1e6 / (gemv_copy + rest)
    speed = tok_s_copy / tok_s
    vs_bf16 = {e: j * speed ** e / base for e in (0.0, -0.5, -1.0)}
    met = j <= bar * base
    need = None if met else math.log(bar * base / j) / math.log(speed)
    # Were the energy above idle a token fixed (the same work), the time saved would save idle power x time only:
    # the idle power at which that alone meets the bar.
    idle_need = None if met else (j - bar * base) / (1 / tok_s - 1 / tok_s_copy)
    # Where the record measured the card's idle power: the J/token there with the energy above idle a token fixed.
    above, idle_w = m.get(at + "j_per_token_decode_above_idle"), m.get(at + "idle_power_w")
    fixed_work = None if above is None or idle_w is None else (above + idle_w / tok_s_copy) / base
    return {"model": model, "prompt": prompt, "variant": variant, "tok_s": tok_s, "gemv_us": gemv,
            "gemv_copy_us": gemv_copy, "rest_us": rest, "tok_s_copy": tok_s_copy, "vs_bf16": vs_bf16,
            "j_vs_bf16": j / base, "elasticity_needed": need, "idle_w_needed": idle_need,
            "vs_bf16_fixed_work": fixed_work}


def energy_per_byte(doc: dict, record: str) -> list[dict]:
    """Each variant of a decode_e2e record with its energy above idle a token: GB read a token (copy rate / bytes
    bound), J above idle a token, nJ a byte, W above idle, and GB/s reached. A record without idle power or without
    its copy rate gives none."""
    metrics = doc["metrics"]
    copy_gbs = doc["config"].get("copy_rate_gbs")
    if not copy_gbs:
        return []
    out = []
    for key in sorted(metrics):
        got = re.fullmatch(r"(.+)\.p(\d+)\.([a-z0-9_]+)\.j_per_token_decode_above_idle", key)
        if got is None:
            continue
        at = f"{got[1]}.p{got[2]}.{got[3]}"
        missing = [k for k in (f"{at}.bound_tok_s", f"{at}.decode_tok_s_median") if k not in metrics]
        if missing:
            raise ValueError(f"decode_e2e record {record}: {key} has no {' or '.join(missing)} beside it")
        gb = copy_gbs / metrics[f"{at}.bound_tok_s"]
        j, tok_s = metrics[key], metrics[f"{at}.decode_tok_s_median"]
        out.append(dict(record=record, gpu=doc["environment"]["gpu"]["name"], model=got[1], prompt=int(got[2]),
                        variant=got[3], gb=gb, j=j, nj_per_byte=j / gb, watts=j * tok_s, gbs=gb * tok_s))
    return out


def idle_powers(records: Path, gpu: str) -> list[float]:
    """Idle power (W) of `gpu` in every record that measured it (decode_standin's config, decode_e2e's rows)."""
    out = []
    for path in sorted(records.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("environment", {}).get("gpu", {}).get("name") != gpu:
            continue
        found = [v for k, v in doc.get("metrics", {}).items() if k.endswith(".idle_power_w")][:1]
        out += found or ([doc["config"]["idle_power_w"]] if "idle_power_w" in doc.get("config", {}) else [])
    return out


def decode_records(records: Path) -> Iterator[tuple[str, dict]]:
    """(short id, document) of every decode_e2e record under `records`, oldest first (the file name is the record's
    id, then its suite)."""
    for path in sorted(records.glob("*_decode_e2e.json")):
        yield short_id(path.name.split("_", 1)[0]), json.loads(path.read_text())


def load(records: Path) -> list[Row]:
    rows = []
    for record, doc in decode_records(records):
        rows += record_rows(doc, record)
    if not rows:
        raise SystemExit(f"no decode_e2e record with decode tok/s and J/token under {records}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=Path, default=Path("telemetry"))
    ap.add_argument("--gpu", default=None, help="only records of this GPU name (e.g. 'NVIDIA H200')")
    ap.add_argument("--bar", type=float, default=0.40, help="decode J/token against bf16's to reach")
    ap.add_argument("--ceiling", metavar="KERNEL_RECORD", default=None,
                    help="id of a kernel_shapes record: each decode with its GEMVs at their copies' time")
    ap.add_argument("--variant", default="int4_norms_compiled", help="with --ceiling: the INT4 variant")
    ap.add_argument("--per-byte", action="store_true", help="each decode's energy above idle a byte it reads")
    a = ap.parse_args(argv)
    if a.per_byte:
        return print_per_byte(a.records, a.gpu)
    if a.ceiling is not None:
        return print_ceiling(a.records, a.ceiling, a.variant, a.gpu, a.bar)
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


def print_per_byte(records: Path, gpu: str | None) -> int:
    """The --per-byte table: every decode_e2e variant with its energy above idle (`energy_per_byte`), on `gpu` if
    named; the records that give none are counted below it."""
    print("| GPU | model | prompt | variant | GB a token | J above idle a token | nJ a byte | W above idle | "
          "GB/s reached | record |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    left_out = []
    for record, doc in decode_records(records):
        if gpu is not None and doc["environment"]["gpu"]["name"] != gpu:
            continue
        rows = energy_per_byte(doc, record)
        if not rows:
            left_out.append(record)
        for r in rows:
            print(f"| {r['gpu']} | {r['model']} | {r['prompt']} | {r['variant']} | {r['gb']:.2f} | {r['j']:.3f} | "
                  f"{r['nj_per_byte']:.3f} | {r['watts']:.0f} | {r['gbs']:.0f} | `{r['record']}` |")
    if left_out:
        print(f"\nleft out, no idle power or copy rate: {len(left_out)} records ({', '.join(left_out[:3])}"
              f"{', ...' if len(left_out) > 3 else ''})")
    return 0


def print_ceiling(records: Path, kernel_record: str, variant: str, gpu: str | None, bar: float) -> int:
    """The --ceiling table: every decode_e2e row of `variant` on the kernel record's GPU, through `copy_ceiling`."""
    found = sorted(records.glob(f"*-{kernel_record}_kernel_shapes.json*"))
    if not found:
        raise SystemExit(f"no kernel_shapes record {kernel_record} under {records}")
    kernel_doc = json.loads(found[0].read_text())
    kernel_gpu = kernel_doc["environment"]["gpu"]["name"]
    if gpu is not None and gpu != kernel_gpu:
        raise SystemExit(f"kernel_shapes record {kernel_record} ran on {kernel_gpu}, not {gpu}")
    copies = copy_times(kernel_doc)
    print(f"| model | prompt | {variant}: tok/s | GEMV us a token: profiled, at their copies | rest us | "
          "tok/s with the GEMVs at their copies | J/token x bf16: measured; there at elasticity 0, -0.5, -1 | "
          f"elasticity for {bar:.2f}x | idle W for {bar:.2f}x, the energy above idle a token fixed | "
          "J/token x bf16 there, the energy above idle a token fixed at the record's idle power | record |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    left_out: dict[str, list[str]] = {}
    for record, doc in decode_records(records):
        if doc["environment"]["gpu"]["name"] != kernel_gpu:
            left_out.setdefault(f"records of another GPU than {kernel_gpu}", []).append(record)
            continue
        for key in sorted(doc["metrics"]):
            got = re.fullmatch(rf"(.+)\.p(\d+)\.{re.escape(variant)}\.decode_tok_s_median", key)
            if got is None:
                continue
            at = f"{got[1]}.p{got[2]}"
            if f"{at}.{variant}.per_token.gemv_gemm.busy_us" not in doc["metrics"]:
                left_out.setdefault("no busy-time profile", []).append(f"{record} {at}")
                continue
            if f"{at}.{BASELINE}.j_per_token_decode" not in doc["metrics"]:
                left_out.setdefault(f"no {BASELINE} J/token", []).append(f"{record} {at}")
                continue
            c = copy_ceiling(doc, got[1], int(got[2]), variant, copies, bar)
            need = "met" if c["elasticity_needed"] is None else f"{c['elasticity_needed']:+.2f}"
            idle = "met" if c["idle_w_needed"] is None else f"{c['idle_w_needed']:.0f}"
            v = c["vs_bf16"]
            print(f"| {c['model']} | {c['prompt']} | {c['tok_s']:.1f} | {c['gemv_us']:.0f}, {c['gemv_copy_us']:.0f} | "
                  f"{c['rest_us']:.0f} | {c['tok_s_copy']:.0f} | {c['j_vs_bf16']:.3f}; {v[0.0]:.3f}, {v[-0.5]:.3f}, "
                  f"{v[-1.0]:.3f} | {need} | {idle} | "
                  f"{'-' if c['vs_bf16_fixed_work'] is None else format(c['vs_bf16_fixed_work'], '.3f')} | "
                  f"`{record}`, `{kernel_record}` |")
    idle_w = idle_powers(records, kernel_gpu)
    if idle_w:
        print(f"\n{kernel_gpu} idle power in the records: {min(idle_w):.0f}-{max(idle_w):.0f} W "
              f"({len(idle_w)} records)")
    for reason, rows in left_out.items():
        print(f"\nleft out, {reason}: {len(rows)} rows ({', '.join(rows[:3])}{', ...' if len(rows) > 3 else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
