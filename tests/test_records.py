"""Run records: schema, atomic unique writes, and loud failure on corrupt / partial / edited files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pytest
import torch

from sdsie.telemetry import env as env_mod
from sdsie.telemetry.records import (
    PARTIAL_SUFFIX,
    RecordError,
    RunRecord,
    capture_environment,
    gzip_record,
    load_record,
    load_records,
    newest_record,
    records_for_claim,
    short_id,
    write_record,
)


def make_record(**overrides: object) -> RunRecord:
    fields = dict(
        claim_ids=["kernel.bandwidth_reduction"],
        suite="kernel_bandwidth",
        config={"shape": [4096, 14336], "group_size": 128},
        samples={"latency_us": [76.1, 76.5, 77.0]},
        metrics={"bandwidth_reduction_pct": 72.5, "fidelity_ok": True},
        environment={"git": {"sha": "abc", "dirty": False}},
        conditions={"model": "Llama-3.1-8B-Instruct", "hardware": "NVIDIA H200", "trials": 3},
    )
    fields.update(overrides)
    return RunRecord(**fields)  # type: ignore[arg-type]


def test_round_trip_preserves_every_field(tmp_path: Path) -> None:
    record = make_record()
    path = write_record(record, tmp_path)
    loaded = load_record(path)
    assert loaded == record
    assert loaded.source == path
    assert loaded.metric("bandwidth_reduction_pct") == 72.5
    with pytest.raises(KeyError, match="no metric 'nope'"):
        loaded.metric("nope")


def test_a_records_short_id_is_the_hex_its_file_name_carries_after_the_timestamp(tmp_path: Path) -> None:
    """The id the docs cite: 8 hex digits after the timestamp, the same from the record and from its file's name."""
    record = make_record()
    path = write_record(record, tmp_path)
    short = short_id(record.record_id)
    assert len(short) == 8 and int(short, 16) >= 0 and record.record_id.endswith("-" + short)
    assert short_id(path.name.split("_", 1)[0]) == short
    assert short_id("20261207T082852633850Z-ec14f873") == "ec14f873"


def test_writes_are_unique_and_never_overwrite(tmp_path: Path) -> None:
    paths = {write_record(make_record(), tmp_path) for _ in range(20)}
    assert len(paths) == 20
    record = make_record()
    write_record(record, tmp_path)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        write_record(record, tmp_path)  # same record id -> same name
    assert sorted(tmp_path.iterdir()) == before
    assert not list(tmp_path.glob(f"*{PARTIAL_SUFFIX}")), "temp files must not be left behind"


def test_a_gzipped_record_loads_as_the_plain_one_and_a_copy_of_either_is_refused(tmp_path: Path) -> None:
    """`gzip_record` replaces a record's file by its gzip (the same bytes whenever it runs); `load_records` reads
    it, and refuses a folder where one record id sits in two files. A damaged gzip is named, not skipped."""
    record = make_record()
    plain = write_record(record, tmp_path)
    text = plain.read_bytes()
    packed = gzip_record(plain)
    assert packed.name == plain.name + ".gz" and not plain.exists()
    assert load_record(packed) == record and [r.record_id for r in load_records(tmp_path)] == [record.record_id]
    again = gzip_record(write_record(record, tmp_path / "again"))
    assert again.read_bytes() == packed.read_bytes()
    plain.write_bytes(text)  # the plain file back beside its gzip
    with pytest.raises(RecordError, match=f"record id {record.record_id} is also in"):
        load_records(tmp_path)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        gzip_record(plain)
    plain.unlink()
    packed.write_bytes(packed.read_bytes()[:40])
    with pytest.raises(RecordError, match="unreadable"):
        load_records(tmp_path)
    with pytest.raises(ValueError, match="takes a record's .json file"):
        gzip_record(packed)


def test_write_creates_directory_and_load_orders_by_creation(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "telemetry"
    older = make_record(created="2026-01-01T00:00:00+00:00")
    newer = make_record(created="2026-02-01T00:00:00+00:00")
    write_record(newer, out)
    write_record(older, out)
    loaded = load_records(out)
    assert [r.created for r in loaded] == [older.created, newer.created]
    assert records_for_claim(loaded, "kernel.bandwidth_reduction") == loaded
    assert records_for_claim(loaded, "other") == []


def test_the_newest_record_of_a_suite_is_the_latest_created_that_the_filter_accepts() -> None:
    old = make_record(created="2026-01-01T00:00:00+00:00", config={"variants": ["plain", "tree"]})
    new = make_record(created="2026-02-01T00:00:00+00:00", config={"variants": ["plain"]})
    other = make_record(created="2026-03-01T00:00:00+00:00", suite="decode_standin")
    records = [new, other, old]
    assert newest_record(records, "kernel_bandwidth") is new
    assert newest_record(records) is other
    assert newest_record(records, "kernel_bandwidth", lambda r: "tree" in r.config["variants"]) is old
    assert newest_record(records, "kernel_bandwidth", lambda r: False) is None
    assert newest_record([], "kernel_bandwidth") is None


def test_missing_directory_means_no_records(tmp_path: Path) -> None:
    assert load_records(tmp_path / "absent") == []


def test_subdirectories_hold_other_artifacts_not_records(tmp_path: Path) -> None:
    record = make_record()
    write_record(record, tmp_path)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "kernel_suite.json").write_text('{"results": []}')
    (tmp_path / "notes.txt").write_text("not a record")
    assert load_records(tmp_path) == [record]


def _written(tmp_path: Path) -> Path:
    return write_record(make_record(), tmp_path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda text: text[: len(text) // 2], "corrupt or truncated JSON"),
        (lambda text: "", "empty file"),
        (lambda text: "[1, 2]", "top level must be a JSON object"),
        (lambda text: text.replace("72.5", "99.9"), "digest mismatch"),
        (lambda text: text.replace("72.5", "NaN"), "non-finite constant NaN"),
    ],
    ids=["truncated", "empty", "not-object", "edited", "nan"],
)
def test_damaged_record_raises_naming_the_file(tmp_path: Path, mutate, message: str) -> None:
    path = _written(tmp_path)
    path.write_text(mutate(path.read_text()))
    with pytest.raises(RecordError, match=message) as info:
        load_records(tmp_path)
    assert info.value.path == path
    assert str(path) in str(info.value)


def test_missing_field_is_reported_as_partial(tmp_path: Path) -> None:
    path = _written(tmp_path)
    data = json.loads(path.read_text())
    del data["samples"]
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"missing fields \['samples'\]"):
        load_record(path)


def test_unknown_field_and_future_schema_are_rejected(tmp_path: Path) -> None:
    path = _written(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "surprise": 1}))
    with pytest.raises(RecordError, match="unknown fields"):
        load_record(path)
    path.write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(RecordError, match="schema_version 99 is not supported"):
        load_record(path)


def test_leftover_partial_write_fails_loading(tmp_path: Path) -> None:
    _written(tmp_path)
    (tmp_path / f".x.json.abcd{PARTIAL_SUFFIX}").write_text("{")
    with pytest.raises(RecordError, match="interrupted write"):
        load_records(tmp_path)


def test_interrupted_write_leaves_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_record(make_record(), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"samples": {"t": []}}, "non-empty list"),
        ({"samples": {"t": [1.0, float("nan")]}}, "non-finite"),
        ({"metrics": {"m": float("inf")}}, "finite number or bool"),
        ({"metrics": {"m": "fast"}}, "finite number or bool"),
        ({"conditions": {"model": "m", "hardware": "h"}}, "lack \\['trials'\\]"),
        ({"conditions": {"model": "m", "hardware": "h", "trials": 0}}, "trials must be an int >= 1"),
        ({"claim_ids": "kernel"}, "claim_ids must be a list"),
        ({"suite": "has space"}, "suite must match"),
        ({"config": {"f": object()}}, "config is not plain finite JSON"),
        ({"created": "2026-01-01T00:00:00"}, "time zone"),
        ({"complete": "yes"}, "complete must be a bool"),
    ],
)
def test_schema_violations_raise_value_error(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_record(**overrides)


# -- environment ---------------------------------------------------------------------------------


class FailingNvml:
    def nvmlInit(self) -> None:
        raise RuntimeError("NVML Shared Library Not Found")


def test_environment_without_gpu_says_what_is_missing(tmp_path: Path) -> None:
    env = capture_environment(prompts={"poem": "Write a poem."}, seeds=[1, 2], nvml=FailingNvml())
    assert "NVML could not initialise" in env["gpu"]["unavailable"]
    assert env["prompts"]["poem"] == env_mod.text_hash("Write a poem.")
    assert "Write a poem." not in json.dumps(env)
    assert env["seeds"] == {"0": 1, "1": 2}
    assert env["packages"]["torch"] == torch.__version__
    assert env["python"].count(".") == 2
    cpu = env["cpu"]  # CPU numerics depend on the CPU: the record names it
    assert cpu["model"] and cpu["machine"] == platform.machine() and cpu["logical_cpus"] == os.cpu_count()
    assert cpu["torch_isa"] == torch.backends.cpu.get_cpu_capability()
    assert cpu["torch_threads"] == torch.get_num_threads()


def test_environment_hashes_models_three_ways(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights-v1")
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    models = {"target": ckpt, "scout": module, "hub": "org/not-local"}
    env = capture_environment(models=models, nvml=FailingNvml())
    by_name = {m["name"]: m for m in env["models"]}
    assert by_name["target"]["checkpoint_sha256"] == env_mod.checkpoint_hash(ckpt)
    assert by_name["scout"]["checkpoint_sha256"] == env_mod.module_hash(module)
    assert by_name["hub"]["checkpoint_sha256"] is None
    assert "not a local path" in by_name["hub"]["hash_unavailable"]
    (ckpt / "model.safetensors").write_bytes(b"weights-v2")
    assert env_mod.checkpoint_hash(ckpt) != by_name["target"]["checkpoint_sha256"]
    with torch.no_grad():
        module.weight[0, 0] += 1
    assert env_mod.module_hash(module) != by_name["scout"]["checkpoint_sha256"]


def test_environment_rejects_bad_seeds_and_models() -> None:
    with pytest.raises(ValueError, match="seeds must be integers"):
        capture_environment(seeds={"a": 1.5}, nvml=FailingNvml())
    with pytest.raises(ValueError, match="must be a path"):
        capture_environment(models={"m": 3}, nvml=FailingNvml())


def test_git_state_reports_sha_and_dirty_flag(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    clean = env_mod.git_state(tmp_path)
    assert len(clean["sha"]) == 40 and clean["dirty"] is False
    (tmp_path / "f.txt").write_text("b")
    assert env_mod.git_state(tmp_path)["dirty"] is True
    assert env_mod.git_state(tmp_path / "missing")["sha"] is None
    assert "declared_commit" not in env_mod.git_state(tmp_path)


def test_a_copied_tree_records_the_commit_it_was_declared_to_come_from(tmp_path: Path, monkeypatch) -> None:
    """The GPU machine's copy of the tree carried a stale .git (some committed records name an old HEAD, dirty):
    the commit named in SDSIE_SOURCE_COMMIT is kept beside what the copy's git says, also where git fails."""
    monkeypatch.setenv(env_mod.SOURCE_COMMIT_ENV, "9558dd2")
    failed = env_mod.git_state(tmp_path / "missing")
    assert failed["sha"] is None and failed["declared_commit"] == "9558dd2"
    here = env_mod.git_state()  # this checkout: git answers, and the declared commit stands beside its sha
    assert here["declared_commit"] == "9558dd2" and (here["sha"] is None or len(here["sha"]) == 40)
    monkeypatch.setenv(env_mod.SOURCE_COMMIT_ENV, "")
    assert "declared_commit" not in env_mod.git_state(tmp_path / "missing")


def test_host_launch_cost_is_a_positive_ordered_spread() -> None:
    from sdsie.telemetry.env import host_launch_us

    cost = host_launch_us("cpu", launches=200, trials=3)
    assert 0 < cost["min"] <= cost["median"] <= cost["max"]
    assert (cost["launches"], cost["trials"]) == (200.0, 3.0)
    with pytest.raises(ValueError, match="launches and trials must be >= 1"):
        host_launch_us("cpu", launches=0)


def test_write_raw_creates_its_folder_and_round_trips(tmp_path):
    from sdsie.telemetry.records import write_raw

    path = write_raw(tmp_path / "raw" / "probe.json", {"median_us": {"this": 7.9}, "samples": [1, 2]})
    assert path == tmp_path / "raw" / "probe.json"
    assert json.loads(path.read_text()) == {"median_us": {"this": 7.9}, "samples": [1, 2]}
