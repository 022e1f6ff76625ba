"""The `sdsie` command: the claims gate end to end on planted records, pinning, and subcommand registration."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from sdsie import cli
from sdsie.telemetry.records import PARTIAL_SUFFIX, RunRecord, write_record

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "reproductions" / "claims.toml"


def kernel_record(metrics: dict, hardware: str = "NVIDIA H200", claim_ids: list[str] | None = None,
                  samples: dict | None = None) -> RunRecord:
    return RunRecord(
        claim_ids=claim_ids or ["kernel-bandwidth-reduction"], suite="kernel_int4", config={},
        samples=samples or {"down_4096x14336|m1|g128|int4": [20.0 + 0.1 * i for i in range(12)]},
        metrics=metrics, environment={"git": {"sha": "abc", "dirty": False}},
        conditions={"model": "Llama-3.1-8B linear shapes (random weights)", "hardware": hardware, "trials": 1},
    )


def check(records: Path, *extra: str, registry: Path = REGISTRY) -> int:
    return cli.main(["claims", "check", "--records", str(records), "--registry", str(registry),
                     "--root", str(ROOT), *extra])


def test_gate_passes_with_no_records_and_lists_them_unmeasured(tmp_path: Path, capsys) -> None:
    assert check(tmp_path) == 0
    out = capsys.readouterr().out
    assert "vs seed: unmeasured" in out and "kernel-bandwidth-reduction" in out and "claims gate passed" in out
    assert "Of 72 seed claims, 0 are consistent" in out


def test_gate_fails_on_a_planted_drifted_record(tmp_path: Path, capsys) -> None:
    write_record(kernel_record({"m1_g128_bytes_reduction_pct_min": 73.40}), tmp_path)
    assert check(tmp_path) == 0
    assert "vs seed: consistent" in capsys.readouterr().out
    planted = write_record(kernel_record({"m1_g128_bytes_reduction_pct_min": 80.0}), tmp_path)  # newest wins
    assert check(tmp_path) == 1  # a portable claim contradicted fails the gate
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("FAIL"))
    assert "kernel-bandwidth-reduction" in line and "seed 71.9-73.4 %" in line and "measured 80" in line
    assert "vs seed: contradicted" in line
    assert str(planted) in out and "claims gate FAILED" in out


@pytest.mark.parametrize("damage", ["truncate", "partial-file"])
def test_gate_fails_on_corrupt_or_partial_records_naming_the_file(tmp_path: Path, capsys, damage: str) -> None:
    path = write_record(kernel_record({"m1_g128_bytes_reduction_pct_min": 73.40}), tmp_path)
    if damage == "truncate":
        path.write_text(path.read_text()[:100])
        bad = path
    else:
        bad = tmp_path / f".x.json.0000{PARTIAL_SUFFIX}"
        bad.write_text("{")
    assert check(tmp_path) == 1
    assert str(bad) in capsys.readouterr().err


def test_gate_fails_on_incomplete_run_and_unknown_claim(tmp_path: Path, capsys) -> None:
    rec = kernel_record({"m1_g128_bytes_reduction_pct_min": 73.40})
    rec.complete = False
    write_record(rec, tmp_path)
    assert check(tmp_path) == 1
    assert "vs reference: invalid" in capsys.readouterr().out
    other = tmp_path / "other"
    write_record(kernel_record({"x": 1.0}, claim_ids=["no-such-claim"]), other)
    assert check(other) == 1
    assert "unknown claim ids ['no-such-claim']" in capsys.readouterr().out


def test_strict_fails_on_unmeasured_and_bad_registry_fails(tmp_path: Path, capsys) -> None:
    assert check(tmp_path, "--strict") == 1
    bad = tmp_path / "claims.toml"
    bad.write_text("schema_version = 1\n[[claim]]\nid = 'x'\n")
    assert check(tmp_path, registry=bad) == 1
    assert str(bad) in capsys.readouterr().err


def test_pin_prints_a_reference_that_the_gate_then_uses(tmp_path: Path, capsys) -> None:
    gpu = "NVIDIA A100 (no reference pinned)"  # the committed registry pins H200 references
    rec = kernel_record({"m1_g128_geomean_speedup": 2.5}, hardware=gpu, claim_ids=["kernel-latency"])  # -60%
    path = write_record(rec, tmp_path / "telemetry")
    assert check(tmp_path / "telemetry") == 0
    out = capsys.readouterr().out  # another GPU, no reference pinned for it: shown, not gated
    assert "vs seed: not comparable" in out and "vs reference: no reference" in out
    assert cli.main(["claims", "pin", str(path), "--registry", str(REGISTRY)]) == 0
    block = capsys.readouterr().out
    assert block.startswith("[[reference]]") and "[reference.values]\nkernel-latency = " in block
    assert f'record = "{rec.record_id}"' in block  # timing claims keep the raw-sample baseline
    registry = tmp_path / "claims.toml"
    shutil.copy(REGISTRY, registry)
    with registry.open("a") as fh:
        fh.write("\n" + block)
    assert check(tmp_path / "telemetry", registry=registry) == 0
    out = capsys.readouterr().out
    assert "kernel-latency" in out and "vs reference: stable" in out
    slower = kernel_record({"m1_g128_geomean_speedup": 1.6}, hardware=gpu, claim_ids=["kernel-latency"],
                           samples={"down_4096x14336|m1|g128|int4": [30.0 + 0.1 * i for i in range(12)]})
    write_record(slower, tmp_path / "telemetry")
    assert check(tmp_path / "telemetry", registry=registry) == 1
    assert "Mann-Whitney" in capsys.readouterr().out


def test_list_prints_both_judgments_with_conditions(capsys) -> None:
    assert cli.main(["claims", "list", "--registry", str(REGISTRY), "--records", str(ROOT / "telemetry")]) == 0
    out = capsys.readouterr().out
    assert "spec-k5-energy-reduction" in out and "32.6-60.3" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("gated-tuned-code-throughput"))
    assert "vs seed: not comparable | vs reference: stable" in line
    assert "seed conditions: Llama-3.1-8B-Instruct target + unnamed scout / GPU not named" in out
    assert "record conditions: sdsie stand-in pair" in out and "Of 72 seed claims" in out


def test_subcommands_register_simply(capsys) -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        print(f"ran {args.n}")
        return 3

    cli.register(cli.Subcommand("echo-test", "a test command", configure, run))
    try:
        assert cli.main(["echo-test", "--n", "7"]) == 3
        assert "ran 7" in capsys.readouterr().out
        with pytest.raises(ValueError, match="already registered"):
            cli.register(cli.Subcommand("echo-test", "again", configure, run))
    finally:
        del cli.SUBCOMMANDS["echo-test"]
    with pytest.raises(SystemExit) as info:
        cli.main(["no-such-command"])
    assert info.value.code == 2


def test_fidelity_subcommand_passes_its_options_through(capsys):
    """`sdsie fidelity` reaches sdsie.fidelity's own parser with every option intact."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["fidelity", "--help"])
    assert exc.value.code == 0
    assert "--model" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["fidelity", "--layers", "1"])  # --model is required by the fidelity parser
    assert exc.value.code == 2
    assert "--model" in capsys.readouterr().err
