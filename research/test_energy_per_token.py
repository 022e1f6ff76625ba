"""The energy-per-token probe's arithmetic (research/energy_per_token.py)."""

from __future__ import annotations

import json
import math

import pytest

from research.energy_per_token import Row, elasticity, energy_per_byte, pair_table, record_rows, speed_for_bar


def row(variant: str, tok_s: float, j: float) -> Row:
    return Row("r1", "GPU", "llama3.1-8b", 32, variant, tok_s, j)


def test_elasticity_is_zero_when_power_follows_speed_and_minus_one_when_power_stays():
    slow = row("gated_int4_compiled", 400.0, 1.2)
    assert elasticity(slow, row("int4_compiled", 600.0, 1.2)) == 0.0  # the same J/token: power x 1.5
    assert math.isclose(elasticity(slow, row("int4_compiled", 600.0, 0.8)), -1.0)  # the same power, 480 W
    with pytest.raises(ValueError, match="same speed"):
        elasticity(slow, row("int4_compiled", 400.0, 1.0))


def test_the_speed_for_the_bar_follows_the_elasticity_and_is_none_where_speed_cannot_help():
    base = row("bf16_compiled", 200.0, 2.5)  # the bar at 0.40x: 1.0 J/token
    fast = row("int4_compiled", 500.0, 1.25)
    assert math.isclose(speed_for_bar(fast, base, 0.40, -1.0), 625.0)  # power held: J falls as the time
    assert math.isclose(speed_for_bar(fast, base, 0.40, -0.5), 500.0 * 0.8 ** -2)
    assert speed_for_bar(fast, base, 0.40, 0.0) is None
    assert speed_for_bar(row("int4_compiled", 500.0, 0.9), base, 0.40, 0.0) == 500.0  # met already


def test_rows_come_from_the_records_metrics_and_pairs_need_a_tenth_apart_in_speed():
    m = {}
    for variant, tok_s, j in (("bf16_compiled", 200.0, 2.5), ("gated_int4_compiled", 400.0, 1.2),
                              ("int4_compiled", 600.0, 1.1), ("int4_norms_compiled", 610.0, 1.12)):
        m[f"llama3.1-8b.p32.{variant}.decode_tok_s_median"] = tok_s
        m[f"llama3.1-8b.p32.{variant}.j_per_token_decode"] = j
    m["llama3.1-8b.p32.tinygemm_compiled.decode_tok_s_median"] = 350.0  # no J/token: not a row
    rows = record_rows({"environment": {"gpu": {"name": "GPU"}}, "metrics": m}, "r1")
    assert [(r.model, r.prompt, r.variant) for r in rows] == [
        ("llama3.1-8b", 32, v) for v in ("bf16_compiled", "gated_int4_compiled", "int4_compiled",
                                         "int4_norms_compiled")]
    assert math.isclose(rows[2].watts, 660.0)
    pairs = pair_table(rows, 0.40)
    assert [(p["slow"].variant, p["fast"].variant) for p in pairs] == [("gated_int4_compiled", "int4_compiled")]
    assert math.isclose(pairs[0]["elasticity"], math.log(1.1 / 1.2) / math.log(1.5))


def test_the_decode_linears_are_the_fused_forms_shapes():
    from research.energy_per_token import decode_linears

    assert decode_linears("llama3.1-8b") == [(6144, 4096, 32), (4096, 4096, 32), (28672, 4096, 32),
                                             (4096, 14336, 32), (128256, 4096, 1)]
    assert decode_linears("qwen2.5-7b")[0] == (4608, 3584, 28)


def test_the_copy_ceiling_puts_each_gemv_at_its_copy_time_and_keeps_the_rest():
    from research.energy_per_token import copy_ceiling, decode_linears

    copies = {(n, k): 10.0 for n, k, _ in decode_linears("llama3.1-8b")}  # 4 x 32 + 1 launches: 1290 us
    at = "llama3.1-8b.p32.int4_norms_compiled."
    m = {at + "per_token.gemv_gemm.busy_us": 1790.0, at + "per_token.busy_us": 1990.0,
         at + "per_token.outside_us": 10.0, at + "decode_tok_s_median": 500.0, at + "j_per_token_decode": 1.2,
         "llama3.1-8b.p32.bf16_compiled.j_per_token_decode": 2.5}
    c = copy_ceiling({"metrics": m}, "llama3.1-8b", 32, "int4_norms_compiled", copies, 0.40)
    assert math.isclose(c["gemv_copy_us"], 1290.0) and math.isclose(c["rest_us"], 210.0)
    assert math.isclose(c["tok_s_copy"], 1e6 / 1500.0)  # 2000 us a token -> 1500: 4/3 the speed
    assert math.isclose(c["vs_bf16"][0.0], 1.2 / 2.5)
    assert math.isclose(c["vs_bf16"][-1.0], 1.2 * 0.75 / 2.5)  # power held: J/token falls as the time
    assert math.isclose(c["elasticity_needed"], math.log(1.0 / 1.2) / math.log(4 / 3))
    with pytest.raises(ValueError, match="no M = 1 copy time"):
        copy_ceiling({"metrics": m}, "llama3.1-8b", 32, "int4_norms_compiled", {}, 0.40)


def test_the_idle_power_the_bar_needs_when_only_time_is_saved():
    from research.energy_per_token import copy_ceiling, decode_linears

    copies = {(n, k): 10.0 for n, k, _ in decode_linears("llama3.1-8b")}
    at = "llama3.1-8b.p32.int4_compiled."
    m = {at + "per_token.gemv_gemm.busy_us": 1790.0, at + "per_token.busy_us": 1990.0,
         at + "per_token.outside_us": 10.0, at + "decode_tok_s_median": 500.0, at + "j_per_token_decode": 1.2,
         "llama3.1-8b.p32.bf16_compiled.j_per_token_decode": 2.5}
    c = copy_ceiling({"metrics": m}, "llama3.1-8b", 32, "int4_compiled", copies, 0.40)
    assert math.isclose(c["idle_w_needed"], 0.2 / 500e-6)  # 0.2 J over the bar, 500 us saved a token: 400 W
    assert c["vs_bf16_fixed_work"] is None  # no idle power in the record
    m[at + "j_per_token_decode_above_idle"], m[at + "idle_power_w"] = 0.96, 120.0  # 120 W x 2 ms = 0.24 J idle
    c = copy_ceiling({"metrics": m}, "llama3.1-8b", 32, "int4_compiled", copies, 0.40)
    assert math.isclose(c["vs_bf16_fixed_work"], (0.96 + 120.0 * 1.5e-3) / 2.5)  # 1.5 ms a token at the copies
    m[at + "j_per_token_decode"] = 0.9  # under the bar already
    c = copy_ceiling({"metrics": m}, "llama3.1-8b", 32, "int4_compiled", copies, 0.40)
    assert c["idle_w_needed"] is None and c["elasticity_needed"] is None


def test_idle_power_is_read_from_both_kinds_of_record_of_that_gpu_only(tmp_path):
    import json

    from research.energy_per_token import idle_powers

    gpu = {"environment": {"gpu": {"name": "H"}}}
    (tmp_path / "a_decode_standin.json").write_text(json.dumps({**gpu, "config": {"idle_power_w": 120.0}}))
    (tmp_path / "b_decode_e2e.json").write_text(json.dumps(
        {**gpu, "config": {}, "metrics": {"m.p32.bf16_compiled.idle_power_w": 125.0,
                                          "m.p32.int4.idle_power_w": 125.0}}))
    (tmp_path / "c_decode_standin.json").write_text(json.dumps(
        {"environment": {"gpu": {"name": "other"}}, "config": {"idle_power_w": 60.0}}))
    assert idle_powers(tmp_path, "H") == [120.0, 125.0]  # one figure a record


def test_energy_a_byte_is_the_energy_above_idle_over_the_bytes_a_token_reads():
    """GB a token = copy rate / bytes bound; a row without idle power, or a record without its copy rate, gives none."""
    m = {"m.p32.int4.j_per_token_decode_above_idle": 0.8, "m.p32.int4.bound_tok_s": 1000.0,
         "m.p32.int4.decode_tok_s_median": 500.0, "m.p32.bf16.bound_tok_s": 250.0,
         "m.p32.bf16.decode_tok_s_median": 200.0}
    doc = {"environment": {"gpu": {"name": "GPU"}}, "config": {"copy_rate_gbs": 4000.0}, "metrics": m}
    (r,) = energy_per_byte(doc, "r1")
    assert (r["variant"], r["prompt"]) == ("int4", 32)
    assert math.isclose(r["gb"], 4.0) and math.isclose(r["nj_per_byte"], 0.2)
    assert math.isclose(r["watts"], 400.0) and math.isclose(r["gbs"], 2000.0)
    assert energy_per_byte({**doc, "config": {}}, "r1") == []
    broken = {**doc, "metrics": {k: v for k, v in m.items() if k != "m.p32.int4.bound_tok_s"}}
    with pytest.raises(ValueError, match=r"record r1: m\.p32\.int4\.j_per_token_decode_above_idle has no "
                                         r"m\.p32\.int4\.bound_tok_s"):
        energy_per_byte(broken, "r1")


def test_the_per_byte_table_counts_the_records_it_cannot_price(tmp_path, capsys):
    """A record with idle power gives its rows; one without is named in the count below the table, not dropped
    silently; --gpu keeps other cards' records out of both."""
    from research.energy_per_token import print_per_byte

    m = {"m.p32.int4.j_per_token_decode_above_idle": 0.8, "m.p32.int4.bound_tok_s": 1000.0,
         "m.p32.int4.decode_tok_s_median": 500.0}
    for name, metrics, gpu in (("20260101T000000Z-aaaa1111", m, "GPU"), ("20260102T000000Z-bbbb2222", {}, "GPU"),
                               ("20260103T000000Z-cccc3333", {}, "Other")):
        doc = {"environment": {"gpu": {"name": gpu}}, "config": {"copy_rate_gbs": 4000.0}, "metrics": metrics}
        (tmp_path / f"{name}_decode_e2e.json").write_text(json.dumps(doc))
    assert print_per_byte(tmp_path, "GPU") == 0
    out = capsys.readouterr().out
    assert "| GPU | m | 32 | int4 | 4.00 | 0.800 | 0.200 | 400 | 2000 | `aaaa1111` |" in out
    assert "left out, no idle power or copy rate: 1 records (bbbb2222)" in out and "cccc3333" not in out
