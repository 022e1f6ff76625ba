"""The energy-per-token probe's arithmetic (research/energy_per_token.py)."""

from __future__ import annotations

import math

import pytest

from research.energy_per_token import Row, elasticity, pair_table, record_rows, speed_for_bar


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
