"""The tree probe's simulation and price, and its chain against the engine on the committed CPU pair."""

from __future__ import annotations

import json

import pytest

from research.standin.tree_probe import (
    Times,
    cycle_ms,
    kept_run,
    level_sizes,
    main,
    price,
    profiles,
    simulate,
    target_ranks,
)
from sdsie.decoding import DecodeConfig, generate
from sdsie.standin import load_prompts, load_standin

TIMES = Times(target={1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0}, scout={1: 0.1, 2: 0.1, 4: 0.12, 8: 0.15, 16: 0.2})


def test_a_cycle_keeps_the_run_of_ranks_inside_the_widths_and_leaves_the_last_token_to_a_bonus():
    ranks = [0, 1, 0, 3, 0, 0]
    assert kept_run(ranks, 0, (1, 1, 1)) == 1  # rank 1 at depth 2 is outside width 1
    assert kept_run(ranks, 0, (2, 2, 2)) == 3
    assert kept_run(ranks, 0, (2, 2, 2, 2)) == 3  # rank 3 at depth 4
    assert kept_run(ranks, 4, (8, 8, 8)) == 1  # position 5 is the last token: the bonus
    assert simulate(ranks, (1, 1)) == [1, 1, 1]  # each cycle stops at the next rank over 0: 2 + 2 + 2 tokens
    assert sum(a + 1 for a in simulate(ranks, (4, 4, 4))) == len(ranks)


def test_tree_sizes_and_profiles_respect_the_node_budget():
    assert level_sizes((4, 2, 1)) == (4, 8, 8)
    trees = profiles(max_depth=3, max_nodes=10, choices=(1, 2, 4))
    assert (1,) in trees and (4, 1) in trees and (2, 2, 1) in trees and (4, 2) not in trees  # 4 + 8 > 10
    assert all(sum(level_sizes(t)) <= 10 and list(t) == sorted(t, reverse=True) for t in trees)


def test_a_cycle_is_priced_as_its_scout_levels_and_one_verify_of_every_node():
    # (2, 2): scout reads 1 then 2 nodes; the verify reads 1 + 2 + 4 = 7 tokens, priced at the 8-token time
    assert cycle_ms((2, 2), TIMES, 0.0) == pytest.approx(0.1 + 0.1 + 1.4)
    res = price([1, 1], (2, 2), TIMES, overhead_ms=0.5)
    assert res["tokens"] == 4 and res["model_speedup"] == pytest.approx(4 * 1.5 / (2 * (1.6 + 0.5)))
    with pytest.raises(ValueError, match="no forward time measured for 17 tokens"):
        TIMES.target_ms(17)


def test_the_chain_keeps_what_the_engine_keeps_on_the_cpu_pair():
    target, scout, tok = load_standin("cpu")
    n_new, k = 24, 3
    for prompt in load_prompts()[:3]:
        ids = tok(prompt.text, return_tensors="pt").input_ids  # [1, P]
        ranks = target_ranks(target, scout, ids, n_new)
        assert len(ranks) == n_new and min(ranks) >= 0
        r = generate(target, ids[0], DecodeConfig(max_new_tokens=n_new, k_draft=k), scout=scout)
        # the engine's first token is the prefill's plain step; its cycles start at the second
        assert [c.accepted for c in r.cycles] == simulate(ranks[1:], (1,) * k)


def test_a_short_run_writes_every_family_and_refuses_bad_arguments(tmp_path):
    out = tmp_path / "t.json"
    assert main(["--max-new-tokens", "12", "--max-depth", "2", "--max-nodes", "6", "--reps", "1",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["best"]) == {"verse", "prose", "code"} and res["chains"]["code"]["1"]["tokens"] > 0
    with pytest.raises(SystemExit) as err:
        main(["--max-nodes", "0", "--out", str(tmp_path / "x.json")])
    assert err.value.code == 2 and not (tmp_path / "x.json").exists()
