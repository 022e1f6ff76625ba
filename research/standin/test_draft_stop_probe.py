"""The draft-stop probe's price model, a short run on the committed CPU pair, and its handling of divergences."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch

from research.standin import draft_stop_probe as probe
from research.standin.draft_stop_probe import (
    DEFAULT_RECORD,
    NEAR_TIE_GAP,
    ForwardMs,
    forward_ms,
    main,
    model_ms,
    run,
)
from sdsie.decoding import DecodeConfig, GenerationResult, decode_logits, generate
from sdsie.standin import load_prompts, load_standin

MS = ForwardMs(target_step=1.0, target_verify=2.0, scout_step=0.25, k=4)
MAX_NEW = 8
POS = 3  # where a tampered speculative run leaves the plain tokens


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
    res = run("cpu", 4, MAX_NEW, [None, 0.5], ["constant"], MS, sync_ms=0.0)
    assert res["mismatches"] == [] and res["near_tie_gap"] == NEAR_TIE_GAP
    off, on = res["variants"]["constant_stopNone"], res["variants"]["constant_stop0.5"]
    assert set(off) == {"verse", "prose", "code"}
    for fam in off:
        assert off[fam]["tokens"] == on[fam]["tokens"] > 0  # run() raises if a variant changed a token
        assert on[fam]["drafted"] <= off[fam]["drafted"] and off[fam]["draft_stops"] == 0
        assert on[fam]["model_ms"] > 0 and off[fam]["model_speedup_vs_plain"] > 0


@pytest.mark.parametrize("args", [["--k", "1"], ["--sync-ms", "-1"], ["--max-new-tokens", "0"], ["--stops", "1.5"],
                                  ["--near-tie-gap", "-0.1"]])
def test_bad_arguments_are_refused_with_their_name(args, tmp_path):
    with pytest.raises(SystemExit) as err:
        main([*args, "--out", str(tmp_path / "o.json")])
    assert err.value.code == 2 and not (tmp_path / "o.json").exists()


# Divergences: a speculative run's tokens swapped at POS on the first prompt, measured against the plain path's logits.


@dataclasses.dataclass(frozen=True)
class PlainPath:
    prompt: str
    ids: torch.Tensor
    tokens: list[int]
    row: torch.Tensor  # the target's single-token logits predicting tokens[POS]


@pytest.fixture(scope="module")
def path() -> PlainPath:
    target, _, tokenizer = load_standin("cpu")
    prompt = load_prompts()[0]
    ids = tokenizer(prompt.text, return_tensors="pt").input_ids[0]
    tokens = generate(target, ids, DecodeConfig(max_new_tokens=MAX_NEW)).tokens
    row = decode_logits(target, ids, tokens[: POS + 1], chunk=1)[POS - 1]  # row j predicts tokens[j + 1]
    assert int(row.argmax()) == tokens[POS]  # the plain loop took the argmax there
    return PlainPath(prompt.id, ids, tokens, row)


def tamper(monkeypatch: pytest.MonkeyPatch, path: PlainPath, token: int) -> None:
    """Make the probe's speculative runs on path's prompt emit `token` at POS (the plain loop's runs untouched)."""
    real: Callable[..., GenerationResult] = probe.generate

    def fake(target, ids, config, scout=None, **kw) -> GenerationResult:
        r = real(target, ids, config, scout=scout, **kw)
        if scout is None or not torch.equal(ids, path.ids):
            return r
        assert r.tokens[:POS] == path.tokens[:POS]
        return dataclasses.replace(r, tokens=[*r.tokens[:POS], token, *r.tokens[POS + 1 :]])

    monkeypatch.setattr(probe, "generate", fake)


def short_run(near_tie_gap: float = NEAR_TIE_GAP) -> dict:
    return run("cpu", 4, MAX_NEW, [None], ["constant"], MS, sync_ms=0.0, near_tie_gap=near_tie_gap)


def test_a_divergence_that_is_no_near_tie_raises_with_variant_prompt_position_and_gap(monkeypatch, path):
    worst = int(path.row.argmin())
    assert float(path.row[path.tokens[POS]] - path.row[worst]) > NEAR_TIE_GAP  # a real bug, not floating point
    tamper(monkeypatch, path, worst)
    with pytest.raises(AssertionError, match=rf"constant_stopNone on {path.prompt} changed the tokens at position "
                                             rf"{POS} .*top-2 logit gap is .*not a near-tie"):
        short_run()


def test_a_near_tie_divergence_is_recorded_its_decode_counted_and_a_tighter_tolerance_raises(monkeypatch, path):
    top = path.row.topk(2)
    gap = float(top.values[0] - top.values[1])
    assert gap > 0  # else no tolerance below it could raise
    clean = short_run()
    tamper(monkeypatch, path, int(top.indices[1]))  # the runner-up, as a flipped tie emits
    res = short_run(near_tie_gap=gap * 1.01 + 1e-6)
    [m] = res["mismatches"]
    assert (m["variant"], m["prompt"], m["position"]) == ("constant_stopNone", path.prompt, POS)
    assert (m["plain_token"], m["variant_token"]) == (path.tokens[POS], int(top.indices[1]))
    assert m["plain_gap"] == pytest.approx(gap, abs=1e-5) and m["variant_token_deficit"] == pytest.approx(gap, abs=1e-5)
    assert m["variant_token_rank"] == 1
    assert res["variants"] == clean["variants"]  # the diverged run still counts (one token swapped, same length)
    with pytest.raises(AssertionError, match=f"position {POS}"):
        short_run(near_tie_gap=gap / 2)


def test_main_prints_and_writes_the_mismatches(monkeypatch, path, tmp_path, capsys):
    top = path.row.topk(2)
    tamper(monkeypatch, path, int(top.indices[1]))
    gap = float(top.values[0] - top.values[1])
    out = tmp_path / "o.json"
    assert main(["--k", "4", "--max-new-tokens", str(MAX_NEW), "--stops", "0.5", "--sync-ms", "0",
                 "--near-tie-gap", str(gap * 1.01 + 1e-6), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {m["variant"] for m in res["mismatches"]} == {f"{s}_stop{t}" for s in ("constant", "adaptive")
                                                          for t in (None, 0.5)}
    assert capsys.readouterr().out.count("near-tie divergence: ") == 4
