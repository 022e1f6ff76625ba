"""The server benchmark: its measurement loop on fake sides and a fake clock (pairing, interleaving, budget cuts,
interrupts, token checks), and its CPU dry run, a `sdsie serve` child process on the committed stand-in pair against
direct generate() writing one record (timings are recorded, never asserted)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from reproductions import serve_bench
from reproductions.serve_bench import (
    FIRST_WARMUP_GUESS_S,
    REPO,
    SUITE,
    Budget,
    DirectRun,
    Sides,
    StreamedRun,
    WholeAnswer,
    build_record,
    child_env,
    main,
    measure,
    parser,
    serve_config,
    server_command,
)
from sdsie.serve.cli import config_from_args, configure
from sdsie.stats import paired_speedup

TOKENS = [5, 6, 7, 8]


class FakeSides:
    """Direct runs take 1 s and server runs 2 s of a fake clock (warm-up: 2 s per prompt, a timed pair 3 s); the
    n-th streamed request reports a total of 1 + n/10 s, 0.5 s of it outside the engine."""

    def __init__(self, bad_decisions_at: int | None = None, interrupt_at: int | None = None,
                 bad_direct_at: int | None = None, bad_whole_for: str | None = None, compile_s: float = 0.0) -> None:
        self.t, self.calls, self.streams = 0.0, [], 0
        self.bad_decisions_at, self.interrupt_at = bad_decisions_at, interrupt_at
        self.bad_direct_at, self.bad_whole_for = bad_direct_at, bad_whole_for
        self.compile_s = compile_s  # added to the first direct run: the run's compilations

    def clock(self) -> float:
        return self.t

    def direct(self, pid: str) -> DirectRun:
        self.t += 1.0 + (self.compile_s if not self.calls else 0.0)
        self.calls.append(("direct", pid))
        bad = len([c for c in self.calls if c[0] == "direct"]) == self.bad_direct_at
        return DirectRun([*TOKENS[:2], 0, *TOKENS[3:]] if bad else list(TOKENS), "FSF", 0.5, 0.01)

    def whole(self, pid: str) -> WholeAnswer:
        self.t += 1.0
        self.calls.append(("whole", pid))
        return WholeAnswer(TOKENS[:1] if pid == self.bad_whole_for else list(TOKENS), "text")

    def streamed(self, pid: str) -> StreamedRun:
        self.streams += 1
        if self.streams == self.interrupt_at:
            raise KeyboardInterrupt("SIGTERM")
        self.t += 2.0
        self.calls.append(("streamed", pid))
        total = 1.0 + self.streams / 10
        decisions = "FFF" if self.streams == self.bad_decisions_at else "FSF"
        return StreamedRun(0.02 * self.streams, total, "text",
                           {"completion_tokens": len(TOKENS), "sdsie": {"decisions": decisions,
                                                                        "seconds": total - 0.5, "energy_j": None}})

    def sides(self) -> Sides:
        return Sides(self.direct, self.whole, self.streamed)


def _args(*extra: str):
    return parser().parse_args(["--preset", "cpu", "--device", "cpu", *extra])


def _record(fake: FakeSides, m, *extra: str):
    return build_record(_args(*extra), m, {}, "fake pair", "fake")


def test_pairs_interleave_alternating_and_the_record_pairs_them_by_prompt_and_trial(capsys) -> None:
    fake = FakeSides()
    m = measure(["a", "b"], fake.sides(), 3, Budget(None, fake.clock))
    assert m.cut is None and m.pairs == 6 and m.warmed == ["a", "b"] and m.mismatches == [] and m.checked == 2 + 12
    timed = [c for c in fake.calls[4:] if c[0] != "whole"]
    assert fake.calls[:4] == [("direct", "a"), ("whole", "a"), ("direct", "b"), ("whole", "b")]  # warm-up first
    assert [c[0] for c in timed[:4]] == ["direct", "streamed"] * 2  # trial 1: direct first
    assert [c[0] for c in timed[4:8]] == ["streamed", "direct"] * 2  # trial 2: the server first
    record = _record(fake, m, "--trials", "3")
    s, mt = record.samples, record.metrics
    assert record.complete and record.config["cut"] is None and record.conditions["trials"] == 3
    assert s["direct|a|tokens_per_s"] == [8.0] * 3  # 4 tokens in 0.5 s
    assert s["server|a|tokens_per_s"] == pytest.approx([4 / 1.1, 4 / 1.3, 4 / 1.5])  # streams 1, 3, 5
    ratios = [(4 / (1 + n / 10)) / 8 for n in (1, 3, 5, 2, 4, 6)]  # prompt a's trials, then b's
    assert s["tok_s_ratio"] == pytest.approx(ratios)
    median, low, high = paired_speedup(ratios)
    assert (mt["serve.tok_s_ratio_median"], mt["serve.tok_s_ratio_ci_low"], mt["serve.tok_s_ratio_ci_high"]) == (
        pytest.approx(median), pytest.approx(low), pytest.approx(high))
    assert (mt["serve.tok_s_ratio_min"], mt["serve.tok_s_ratio_max"]) == (pytest.approx(min(ratios)),
                                                                          pytest.approx(max(ratios)))
    assert mt["serve.a.tok_s_ratio_median"] == pytest.approx(ratios[1])
    assert s["server_http_overhead_s"] == pytest.approx([0.5] * 6) and mt["serve.http_overhead_s_median"] == 0.5
    assert mt["serve.server_engine_tok_s_median"] == pytest.approx(statistics.median(
        [4 / (0.5 + n / 10) for n in range(1, 7)]))
    ttft = [0.02 * n for n in (1, 3, 5, 2, 4, 6)]
    assert mt["serve.ttft_s_median"] == pytest.approx(statistics.median(ttft))
    assert mt["serve.ttft_s_median"] < mt["serve.ttft_s_p90"] <= max(ttft)
    assert mt["serve.tokens_identical"] is True and "serve.server_j_per_token_median" not in mt  # no reading, no 0
    assert record.config["graphs"] == {"direct": False, "server": False} and record.config["pairs"] == 6
    assert "trial 3/3 done (6 pairs)" in capsys.readouterr().out  # progress, for a log cut short


def test_prompt_graphs_warm_each_prompt_twice_so_no_timed_pair_captures_a_graph() -> None:
    """With prompt graphs each prompt's warm-up runs both sides twice (`warm_up_runs`: the second is the capture
    where a cache's first prompt runs eagerly, else a replay), and both rounds' tokens are compared."""
    fake = FakeSides()
    m = measure(["a", "b"], fake.sides(), 1, Budget(None, fake.clock), warm_rounds=2)
    assert fake.calls[:8] == [("direct", "a"), ("whole", "a")] * 2 + [("direct", "b"), ("whole", "b")] * 2
    assert m.warmed == ["a", "b"] and m.pairs == 2 and m.checked == 2 * 3 + 2 * 2 and m.mismatches == []
    assert [c for c in fake.calls[8:] if c[0] != "whole"] == [("direct", "a"), ("streamed", "a"), ("direct", "b"),
                                                              ("streamed", "b")]
    fake = FakeSides(bad_direct_at=2)  # the second round's direct run (the graphed prompt) gives other tokens
    m = measure(["a"], fake.sides(), 1, Budget(None, fake.clock), warm_rounds=2)
    assert m.mismatches[:2] == ["a warm-up: server token ids differ from direct generate() from position 2",
                                "a warm-up round 2: direct tokens differ from round 1's from position 2"]
    with pytest.raises(ValueError, match="warm_rounds must be >= 1"):
        measure(["a"], fake.sides(), 1, Budget(None, fake.clock), warm_rounds=0)


def test_both_sides_get_the_same_decoding_form_and_prompt_graphs_need_cuda_graphs(tmp_path: Path) -> None:
    """The server's command, read by `sdsie serve`'s own parser, gives the ServeConfig the direct side builds: the
    same target form and the same DecodeConfig for its runs (kv cache, CUDA graphs, prompt graphs)."""
    p = argparse.ArgumentParser()
    configure(p)
    for extra in ([], ["--cuda-graphs"], ["--cuda-graphs", "--prefill-graphs", "--int4", "group", "--compile",
                                         "--compile-prefill"]):
        a = parser().parse_args(["--device", "cuda", "--kv-cache", "static", "--clutch", "off", *extra])
        cmd = server_command(tmp_path, a, 8123)
        assert cmd[1:4] == ["-m", "sdsie.cli", "serve"]
        served, direct = config_from_args(p.parse_args(cmd[4:])), serve_config(tmp_path, a)
        assert served.decode_config(7) == direct.decode_config(7)
        runs = direct.decode_config(7)
        assert (runs.kv_cache, runs.cuda_graphs, runs.prefill_graphs) == (
            "static", "--cuda-graphs" in extra, "--prefill-graphs" in extra)
        assert (served.target, served.int4, served.compile, served.compile_prefill, served.device, served.dtype) == (
            direct.target, direct.int4, direct.compile, direct.compile_prefill, direct.device, direct.dtype)
    with pytest.raises(SystemExit, match="--prefill-graphs is an option of --cuda-graphs"):
        main(["--device", "cpu", "--kv-cache", "static", "--prefill-graphs"])


def test_budget_stops_before_a_pair_that_would_overrun_and_the_record_keeps_what_completed(monkeypatch) -> None:
    """Warm-ups take 2 s (the first guessed at 3 s); pairs take 3 s, each estimated at 1.5x the longest so far (the
    first at 1.5x the longest warm-up): with 16 s, pairs start at 4, 7 and 10 s, and the one due at 13 s (4.5 s
    needed, 3 left) does not."""
    monkeypatch.setattr(serve_bench, "FIRST_WARMUP_GUESS_S", 3.0)
    fake = FakeSides()
    m = measure(["a", "b"], fake.sides(), 3, Budget(16, fake.clock, reserve=0))
    assert m.pairs == 3 and m.cut.startswith("budget: trial 2 stopped before b")
    record = _record(fake, m, "--trials", "3", "--max-seconds", "16")
    assert not record.complete and record.config["cut"] == m.cut and record.config["pairs"] == 3
    assert record.conditions["trials"] == 2 and record.config["trials_requested"] == 3
    assert len(record.samples["direct|a|tokens_per_s"]) == 2 and len(record.samples["server|b|tokens_per_s"]) == 1
    assert len(record.samples["tok_s_ratio"]) == 3 and record.metrics["serve.tokens_identical"] is True


def test_a_warm_up_the_budget_cuts_leaves_the_prompts_warmed_before_it_to_be_timed(monkeypatch) -> None:
    """Prompt graphs: a's warm-up is 2 rounds of 2 s, so b's is estimated at 1.5 x 4 = 6 s and 5 are left at 4 s;
    a's pairs are estimated from its last round (a replay), 1.5 x 2 = 3 s: one pair (3 s) runs, the next does not."""
    monkeypatch.setattr(serve_bench, "FIRST_WARMUP_GUESS_S", 3.0)
    fake = FakeSides()
    m = measure(["a", "b"], fake.sides(), 3, Budget(9, fake.clock, reserve=0), warm_rounds=2)
    assert m.warmed == ["a"] and m.pairs == 1 and ("direct", "b") not in fake.calls
    assert m.cut == ("budget: warm-up stopped before b (5 s left, 6 s needed); "
                     "budget: trial 2 stopped before a (2 s left, 4.5 s needed)")
    record = _record(fake, m, "--trials", "3", "--max-seconds", "9")
    assert not record.complete and record.config["timed_prompts"] == ["a"] and record.config["pairs"] == 1
    assert record.samples["server|a|tokens_per_s"] and record.metrics["serve.tokens_identical"] is True
    fake = FakeSides(interrupt_at=1)  # an interrupt after the cut keeps both reasons
    m = measure(["a", "b"], fake.sides(), 3, Budget(9, fake.clock, reserve=0), warm_rounds=2)
    assert m.cut == "budget: warm-up stopped before b (5 s left, 6 s needed); interrupted (SIGTERM) after 0 pairs"


def test_later_warm_ups_are_estimated_without_the_first_ones_compilation(capsys) -> None:
    """The first warm-up (2 rounds of 2 s, and 100 s of compilation) is not the next one's estimate: b's is 1.5 x 2
    rounds x a's last round = 6 s, and c's 1.5 x b's 4 s = 6 s, so with 125 s all three are warmed (at 112 s) and
    timed (1.5 x 104 s would have stopped the warm-up after a). With one round, a round is the whole warm-up,
    compilation included."""
    fake = FakeSides(compile_s=100.0)
    m = measure(["a", "b", "c"], fake.sides(), 1, Budget(125, fake.clock, reserve=0), warm_rounds=2)
    assert m.cut is None and m.warmed == ["a", "b", "c"] and m.pairs == 3
    assert m.samples["warmup_s"] == [104.0, 4.0, 4.0]  # each round's seconds per side say where the 100 s went
    assert m.samples["warmup_direct_s"] == [101.0] + [1.0] * 5 and m.samples["warmup_server_s"] == [1.0] * 6
    assert "warm-up a: 4 tokens, 104.0 s (direct 101.0 + 1.0 s, server 1.0 + 1.0 s)" in capsys.readouterr().out
    assert serve_bench._warm_up_estimate([104.0, 4.0], [2.0, 2.0], 2) == 6.0
    assert serve_bench._warm_up_estimate([104.0], [2.0], 2) == 6.0
    assert serve_bench._warm_up_estimate([102.0], [102.0], 1) == 153.0
    assert serve_bench._warm_up_estimate([], [], 2) == FIRST_WARMUP_GUESS_S


def test_budget_too_short_for_a_warm_up_writes_a_record_with_nothing_measured() -> None:
    fake = FakeSides()
    m = measure(["a"], fake.sides(), 2, Budget(FIRST_WARMUP_GUESS_S - 1, fake.clock, reserve=0))
    assert fake.calls == [] and m.warmed == [] and m.cut.startswith("budget: warm-up stopped before a")
    record = _record(fake, m)
    assert not record.complete and record.samples == {} and record.metrics == {}  # no comparison: no identity claim
    assert record.conditions["trials"] == 1 and record.config["pairs"] == 0


def test_an_interrupt_keeps_the_pairs_that_completed() -> None:
    fake = FakeSides(interrupt_at=2)
    m = measure(["a", "b"], fake.sides(), 2, Budget(None, fake.clock))
    assert m.pairs == 1 and m.cut == "interrupted (SIGTERM) after 1 pairs" and not m.failed
    assert m.samples["server|a|tokens_per_s"] and "server|b|tokens_per_s" not in m.samples


def test_an_error_while_measuring_keeps_the_pairs_that_completed_and_says_what_broke(capsys) -> None:
    fake = FakeSides()
    streamed = fake.streamed

    def failing(pid: str) -> StreamedRun:
        if fake.streams == 2:
            raise RuntimeError("the server failed mid-stream: boom")
        return streamed(pid)

    m = measure(["a"], Sides(fake.direct, fake.whole, failing), 5, Budget(None, fake.clock))
    assert m.failed and m.pairs == 2
    assert m.cut == "failed after 2 pairs: RuntimeError: the server failed mid-stream: boom"
    record = _record(fake, m)
    assert not record.complete and record.config["failed"] and len(record.samples["tok_s_ratio"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_answers_that_differ_are_named_and_fail_the_identity_metric() -> None:
    fake = FakeSides(bad_decisions_at=3, bad_direct_at=6, bad_whole_for="b")  # streamed a and direct b of trial 2
    m = measure(["a", "b"], fake.sides(), 2, Budget(None, fake.clock))
    assert m.pairs == 4 and m.mismatches == [
        "b warm-up: server token ids differ from direct generate() from position 1",
        "a trial 2: the streamed answer differs from direct generate() (tokens, text or clutch decisions)",
        "b trial 2: direct tokens differ from its warm-up from position 2"]
    record = _record(fake, m)
    assert record.metrics["serve.tokens_identical"] is False and record.config["mismatched"] == m.mismatches


def test_budget_counts_from_its_start_less_the_reserve() -> None:
    now = [100.0]
    budget = Budget(60, lambda: now[0], reserve=15)
    now[0] = 130.0
    assert budget.elapsed() == 30 and budget.left() == 15 and budget.fits(15) and not budget.fits(15.1)
    assert Budget(None).left() == float("inf")


def test_the_server_inherits_this_environment_with_the_repository_on_its_path(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.setenv("SDSIE_CACHE", "/somewhere")
    env = child_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/opt/site"] and env["SDSIE_CACHE"] == "/somewhere"
    assert env["PYTHONUNBUFFERED"] == "1" and {k: v for k, v in env.items() if k not in (
        "PYTHONPATH", "PYTHONUNBUFFERED")} == {k: v for k, v in os.environ.items() if k not in (
            "PYTHONPATH", "PYTHONUNBUFFERED")}


def test_bad_options_are_refused_before_anything_loads() -> None:
    for bad in (["--trials", "0"], ["--max-seconds", "0"], ["--max-seconds", "-5"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
    with pytest.raises(SystemExit, match="--cuda-graphs needs"):
        main(["--device", "cpu", "--cuda-graphs"])
    with pytest.raises(ValueError, match="clutch must be"):
        main(["--device", "cpu", "--clutch", "fast"])


SITECUSTOMIZE = """\
import os, sys
sys.modules["openai"] = None  # the GPU machine has no openai package: importing it here fails the run
with open(os.path.join(os.environ["SERVE_BENCH_MARKS"], str(os.getpid())), "w") as fh:
    fh.write(" ".join(sys.orig_argv))
"""


def _dry_run(tmp_path: Path, argv: list[str]) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    """serve_bench run as a command (its server a child of it) with openai unimportable in both processes: (the
    finished process, each process's command line, the records' folder). Asserts it exited 0."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    site, marks, out = tmp_path / "site", tmp_path / "marks", tmp_path / "out"
    site.mkdir(), marks.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "SERVE_BENCH_MARKS": str(marks)}
    done = subprocess.run([sys.executable, "-m", "reproductions.serve_bench", *argv, "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, [p.read_text() for p in marks.iterdir()], out


@pytest.mark.slow  # two processes start and load the pair: about 15 s on two idle cores
def test_dry_run_writes_one_record_with_identical_tokens_without_openai(tmp_path: Path) -> None:
    done, commands, out = _dry_run(tmp_path, [
        "--preset", "cpu", "--device", "cpu", "--trials", "2", "--max-tokens", "3", "--one-per-family", "--threads",
        "1", "--clutch", "6.5,7.0,0.5", "--max-seconds", "300", "--server-log", str(tmp_path / "server.log")])
    assert any("sdsie.cli serve" in c for c in commands)  # the server saw this environment's PYTHONPATH
    for line in ("server ready; warm-up", "warm-up code-instruction: 3 tokens", "trial 2/2 done (6 pairs)", "record:"):
        assert line in done.stdout
    (path,) = out.glob("*.json")
    record = json.loads(path.read_text())
    assert record["suite"] == SUITE and record["conditions"]["hardware"] == "cpu (dry run)" and record["complete"]
    assert record["conditions"]["trials"] == 2 and "(cpu preset, build " in record["conditions"]["model"]
    config, metrics, samples = record["config"], record["metrics"], record["samples"]
    assert metrics["serve.tokens_identical"] is True and config["mismatched"] == [] and config["cut"] is None
    assert config["failed"] is False and config["max_seconds"] == 300
    assert config["runs_compared"] == 3 + 2 * 2 * 3 and config["pairs"] == 6
    prompts = config["prompts"]
    assert len(prompts) == 3 and config["timed_prompts"] == prompts  # one per family
    for p in prompts:
        assert len(samples[f"direct|{p}|tokens_per_s"]) == len(samples[f"server|{p}|tokens_per_s"]) == 2
        assert metrics[f"serve.{p}.tok_s_ratio_median"] > 0
    for key in ("tok_s_ratio", "server_ttft_s", "server_engine_tok_s", "server_http_overhead_s",
                "direct_first_token_s"):
        assert len(samples[key]) == 2 * 3 and all(v > 0 for v in samples[key])
    for key in ("direct_tok_s_median", "server_tok_s_median", "server_engine_tok_s_median", "tok_s_ratio_median",
                "ttft_s_median", "ttft_s_p90", "http_overhead_s_median"):
        assert metrics[f"serve.{key}"] > 0
    assert "serve.server_j_per_token_median" not in metrics  # no NVML here: no energy figure, never 0
    assert config["graphs"] == {"direct": False, "server": False}


@pytest.mark.slow  # a tiny model built and saved, two processes, dynamo on both sides: about 20 s on two cores
def test_dry_run_of_a_random_model_compiled_on_both_sides(tmp_path: Path) -> None:
    """--model: the end-to-end suite's configuration (tiny here) with random weights, saved with a word-level
    tokenizer and served without a scout; --compile reaches the server's command and the direct side alike, and the
    two sides give the same tokens."""
    _, commands, out = _dry_run(tmp_path, [
        "--model", "llama3.1-8b", "--tiny", "--device", "cpu", "--clutch", "off", "--kv-cache", "static",
        "--compile", "eager", "--trials", "1", "--max-tokens", "3", "--one-per-family", "--threads", "1",
        "--max-seconds", "300"])
    (server,) = [c for c in commands if "sdsie.cli serve" in c]
    assert "--compile eager" in server and "--scout" not in server and "--int4" not in server
    (path,) = out.glob("*.json")
    record = json.loads(path.read_text())
    assert record["complete"] and record["metrics"]["serve.tokens_identical"] is True
    assert record["conditions"]["model"] == "llama3.1-8b configuration (tiny), random weights, float32, " \
                                           "decode step compiled (eager)"
    config = record["config"]
    assert (config["model"], config["tiny"], config["compile"], config["int4"]) == ("llama3.1-8b", True, "eager", None)
    assert config["pairs"] == 3 and record["environment"]["models"] == []
    with pytest.raises(SystemExit, match="pass --clutch off"):
        main(["--model", "llama3.1-8b", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--compile needs --kv-cache static"):
        main(["--device", "cpu", "--compile"])


@pytest.mark.parametrize(("flag", "value", "message"), [("--max-seconds", "0", "must be a number > 0, got 0"),
                                                         ("--max-seconds", "nan", "must be a number > 0, got nan"),
                                                         ("--trials", "0", "must be an integer >= 1, got 0")])
def test_bad_budgets_and_counts_are_refused_naming_the_rule(flag, value, message, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--preset", "cpu", flag, value])
    assert message in capsys.readouterr().err
