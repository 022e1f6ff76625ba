"""The server benchmark's CPU dry run: a `sdsie serve` child process on the committed stand-in pair against direct
generate(), one record with every sample (timings are recorded, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from reproductions.serve_bench import SUITE, main, parser  # noqa: E402


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the dry run sets one thread for this process too


@pytest.mark.slow  # a server process starts and loads the pair: about 15 s on two idle cores
def test_dry_run_writes_one_record_with_identical_tokens(tmp_path: Path, threads) -> None:
    argv = ["--preset", "cpu", "--device", "cpu", "--trials", "2", "--max-tokens", "3", "--one-per-family",
            "--threads", "1", "--clutch", "6.5,7.0,0.5", "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["suite"] == SUITE and record["conditions"]["hardware"] == "cpu (dry run)"
    assert record["conditions"]["trials"] == 2 and "(cpu preset, build " in record["conditions"]["model"]
    assert record["metrics"]["serve.tokens_identical"] is True and record["config"]["mismatched_prompts"] == []
    prompts = record["config"]["prompts"]
    assert len(prompts) == 3  # one per family
    for key in ("direct_tok_s", "server_tok_s", "tok_s_ratio", "server_ttft_s", "server_engine_tok_s"):
        assert len(record["samples"][key]) == 2 * 3 and all(v > 0 for v in record["samples"][key])
    assert all(len(record["samples"][f"{p}|tok_s_ratio"]) == 2 for p in prompts)
    assert "serve.server_j_per_token_median" not in record["metrics"]  # no NVML here: no energy figure, never 0
    ratio = record["samples"]["tok_s_ratio"]
    assert record["metrics"]["serve.tok_s_ratio_median"] == pytest.approx((sorted(ratio)[2] + sorted(ratio)[3]) / 2)


def test_bad_options_are_refused_before_anything_loads() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--trials", "0"])
    with pytest.raises(SystemExit, match="--cuda-graphs needs"):
        main(["--device", "cpu", "--cuda-graphs"])
    with pytest.raises(ValueError, match="clutch must be"):
        main(["--device", "cpu", "--clutch", "fast"])
