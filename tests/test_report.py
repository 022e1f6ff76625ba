"""Reproduction report: built only from records; every figure drawn from data or skipped with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdsie import cli
from sdsie.claims import evaluate, load_registry
from sdsie.report import FIGURES, build_report, citation_text
from sdsie.telemetry.records import RunRecord, load_records, write_record

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "reproductions" / "claims.toml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make(claim_ids: list[str], metrics: dict, samples: dict, config: dict | None = None,
         complete: bool = True) -> RunRecord:
    return RunRecord(claim_ids=claim_ids, suite="figdata", config=config or {}, samples=samples, metrics=metrics,
                     environment={"git": {"sha": "0123456789abcdef", "dirty": True},
                                  "gpu": {"name": "Fake H200", "driver": "999"}, "packages": {"torch": "2.x"}},
                     conditions={"model": "standin", "hardware": "Fake H200", "trials": 5}, complete=complete)


def figure_records() -> list[RunRecord]:
    trace = [0.2 + (i % 7) * 0.1 for i in range(60)]
    return [
        make([], {}, {"entropy_bits": trace, "k": [5.0 if h < 0.5 else 0.0 for h in trace]},
             {"theta_low": 0.15, "theta_high": 0.70}),
        make([], {"j_per_token.code": 1.2, "j_per_token.verse": 2.5, "j_per_token_baseline.code": 2.0,
                  "j_per_token_baseline.verse": 2.6}, {"n": [1.0]}),
        make([], {}, {"sweep.threshold": [0.3, 0.1, 0.2], "sweep.engagement_pct": [40.0, 5.0, 20.0],
                      "sweep.tokens_per_s": [120.0, 90.0, 100.0]}),
        make([], {}, {"fidelity.layers": [1.0, 2.0, 4.0, 32.0], "fidelity.match_pct.code": [100.0, 7.6, 10.4, 9.2],
                      "fidelity.match_pct.verse": [100.0, 7.2, 2.8, 3.6]}),
        make(["kernel-bandwidth-reduction"], {"m1_g128_bytes_reduction_pct_min": 73.4}, {"n": [1.0]}),
    ]


def report_for(tmp_path: Path, records: list[RunRecord]):
    tele = tmp_path / "telemetry"
    for r in records:
        write_record(r, tele)
    loaded = load_records(tele)
    registry = load_registry(REGISTRY)
    return build_report(registry, loaded, evaluate(registry, loaded), tmp_path / "reports", ROOT), loaded


def test_report_draws_every_figure_from_records_and_lists_raw_paths(tmp_path: Path) -> None:
    report, loaded = report_for(tmp_path, figure_records())
    assert [f.name for f in report.figures] == [spec.name for spec in FIGURES]
    for fig in report.figures:
        assert fig.skipped is None and fig.path is not None
        assert fig.path.read_bytes()[:8] == PNG_MAGIC
    md = report.markdown.read_text()
    for r in loaded:
        assert str(r.source) in md or r.source.name in md
    assert "| vs seed | vs our reference |" in md and "| consistent | - (portable) |" in md
    assert "How to cite" in md and "CITATION.cff" in md and "reproduced" not in md.lower()
    data = json.loads(report.json.read_text())
    claim = next(c for c in data["claims"] if c["id"] == "kernel-bandwidth-reduction")
    assert claim["vs_seed"]["verdict"] == "consistent" and claim["measured"] == 73.4 and claim["portable"]
    assert claim["vs_reference"]["verdict"] == "no reference"
    assert claim["record"].endswith(".json") and claim["environment"]["gpu"] == "Fake H200"
    assert claim["record_conditions"]["model"] == "standin" and claim["record_conditions"]["hardware"] == "Fake H200"
    assert claim["seed_conditions"]["model"] == "Llama-3.1-8B linear shapes (random weights)"
    unmeasured = next(c for c in data["claims"] if c["id"] == "kernel-power")
    assert unmeasured["vs_seed"]["verdict"] == "unmeasured" and unmeasured["measured"] is None
    assert unmeasured["vs_reference"] is None
    assert data["seed_summary"].startswith("Of 72 seed claims, 1 is consistent")
    assert len(data["records"]) == len(loaded)


def test_figures_without_data_are_skipped_with_the_reason(tmp_path: Path) -> None:
    partial_trace = make([], {}, {"entropy_bits": [1.0, 2.0], "k": [0.0, 5.0]}, complete=False)
    mismatched = make([], {}, {"entropy_bits": [1.0, 2.0], "k": [0.0]})
    report, _ = report_for(tmp_path, [partial_trace, mismatched])
    assert all(f.path is None for f in report.figures)
    trace = next(f for f in report.figures if f.name == "entropy_trace")
    assert 'no complete record holds samples "entropy_bits" and "k"' in trace.skipped
    md = report.markdown.read_text()
    assert "Entropy trace with the k(t) panel: skipped, no complete record holds" in md
    assert not list((tmp_path / "reports" / "figures").glob("*.png"))


def test_citation_text_reads_citation_cff(tmp_path: Path) -> None:
    text = citation_text(ROOT / "CITATION.cff")
    assert "version 0.1.0" in text and "CITATION.cff" in text and "git sha" in text
    assert "No CITATION.cff" in citation_text(tmp_path / "CITATION.cff")


def test_report_command_writes_markdown_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tele = tmp_path / "telemetry"
    write_record(figure_records()[0], tele)
    out = tmp_path / "out"
    code = cli.main(["report", "--records", str(tele), "--registry", str(REGISTRY), "--out", str(out),
                     "--root", str(ROOT)])
    assert code == 0
    assert (out / "report.md").is_file() and (out / "report.json").is_file()
    assert (out / "figures" / "entropy_trace.png").is_file()
    assert "figure j_per_token: skipped" in capsys.readouterr().out


def test_report_builds_from_the_committed_records(tmp_path: Path) -> None:
    """The committed H200 records (pinned references, exact-valued claims included) make a report whose
    JSON carries every claim with both judgments; exact expectations stay plain values, bands become pairs."""
    out = tmp_path / "out"
    code = cli.main(["report", "--records", str(ROOT / "telemetry"), "--registry", str(REGISTRY), "--out", str(out),
                     "--root", str(ROOT)])
    assert code == 0
    data = json.loads((out / "report.json").read_text())
    claims = {c["id"]: c for c in data["claims"]}
    assert claims["kernel-bandwidth-reduction"]["vs_seed"]["verdict"] == "consistent"
    assert isinstance(claims["kernel-bandwidth-reduction"]["vs_seed"]["expected"], list)
    exact = [c for c in claims.values() if c["kind"] == "exact" and c["vs_reference"]
             and c["vs_reference"]["expected"] is not None]
    assert exact and all(not isinstance(c["vs_reference"]["expected"], list) for c in exact)
    code = claims["gated-tuned-code-throughput"]  # one entry per claim id: the last conditions judged
    assert code["vs_seed"]["verdict"] == "not comparable" and code["vs_reference"]["verdict"] == "stable"
    assert "reproduced" not in (out / "report.md").read_text().lower()
