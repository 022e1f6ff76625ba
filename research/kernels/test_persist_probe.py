"""The persistent mma GEMV probe on a CPU: its arguments are checked before anything runs, and its kernel compiles
for sm_90 offline to the loop it describes (its bits and speed are the GPU run's)."""

from __future__ import annotations

import pytest

from reproductions.kernels.inspect_ptx import compiled_offline
from research.kernels.persist_probe import arm, main


def test_arms_and_shapes_are_refused_by_name_before_anything_runs(tmp_path, capsys):
    assert arm("4x2x3") == (4, 2, 3) and arm("8x4x1") == (8, 4, 1)
    for bad in ("4x2", "6x2x1", "4x5x1", "4x2x0", "axbxc"):
        with pytest.raises(SystemExit) as exc:
            main(["--out", str(tmp_path / "p.json"), "--arms", bad])
        assert exc.value.code == 2 and repr(bad) in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "p.json"), "--shapes", "4096x4096", "4096by14336"])
    assert exc.value.code == 2 and "'4096by14336'" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_the_kernel_compiles_for_sm90_without_spills_to_a_peeled_last_iteration():
    """Offline sm_90: a K iteration's 8 HMMAs a pair (16 rows of B twice at M = 9-16) appear twice, in the loop
    within a row block and in the peeled last iteration that asks for the next block's pairs; no spills."""
    got = compiled_offline("import json; from research.kernels.persist_probe import inspect; print(json.dumps("
                           "[inspect(), inspect(stages=4), inspect(warps=8), inspect(halves=2), "
                           "inspect(per_channel=True)]))", "the persistent mma GEMV")
    assert [r["hmma"] for r in got] == [32, 64, 32, 64, 32]
    assert all(r["spills"] == 0 for r in got)
    assert [r["registers"] for r in got] == [128, 242, 122, 168, 86]
