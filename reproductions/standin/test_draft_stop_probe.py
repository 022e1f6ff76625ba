"""The draft-stop probe's price model and a short run on the committed CPU pair."""

from __future__ import annotations

import pytest

from reproductions.standin.draft_stop_probe import DEFAULT_RECORD, ForwardMs, forward_ms, main, model_ms, run

MS = ForwardMs(target_step=1.0, target_verify=2.0, scout_step=0.25, k=4)


def test_a_verify_is_priced_between_a_step_and_the_full_verify():
    assert MS.verify(0) == 1.0 and MS.verify(4) == 2.0 and MS.verify(2) == pytest.approx(1.5)


def test_model_ms_adds_scout_steps_a_verify_per_cycle_and_syncs_only_with_the_stop_on():
    drafts = [4, 1, 0]  # per cycle
    base = (4 * 0.25 + 2.0) + (0.25 + 1.25) + 1.0
    assert model_ms(drafts, MS, sync_ms=0.1, stop=None) == pytest.approx(base)
    assert model_ms(drafts, MS, sync_ms=0.1, stop=0.4) == pytest.approx(base + 5 * 0.1)


def test_the_default_record_holds_graphed_forward_times():
    ms = forward_ms(DEFAULT_RECORD)
    assert 0 < ms.scout_step < ms.target_step < ms.target_verify and ms.k == 5


def test_a_short_run_on_the_cpu_pair_is_lossless_and_the_stop_drafts_no_more():
    res = run("cpu", 4, 8, [None, 0.5], ["constant"], MS, sync_ms=0.0)
    off, on = res["variants"]["constant_stopNone"], res["variants"]["constant_stop0.5"]
    assert set(off) == {"verse", "prose", "code"}
    for fam in off:
        assert off[fam]["tokens"] == on[fam]["tokens"] > 0  # run() raises if a variant changed a token
        assert on[fam]["drafted"] <= off[fam]["drafted"] and off[fam]["draft_stops"] == 0
        assert on[fam]["model_ms"] > 0 and off[fam]["model_speedup_vs_plain"] > 0


@pytest.mark.parametrize("args", [["--k", "1"], ["--sync-ms", "-1"], ["--max-new-tokens", "0"], ["--stops", "1.5"]])
def test_bad_arguments_are_refused_with_their_name(args, tmp_path):
    with pytest.raises(SystemExit) as err:
        main([*args, "--out", str(tmp_path / "o.json")])
    assert err.value.code == 2 and not (tmp_path / "o.json").exists()
