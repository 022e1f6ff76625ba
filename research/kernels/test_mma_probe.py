"""The mma probe's arguments: a register cap the configuration would refuse, or epilogue timings at an M whose launch
has no norm epilogue, stop the run before it times anything."""

from __future__ import annotations

import pytest

from research.kernels.mma_probe import main


def test_a_register_cap_that_is_not_a_multiple_of_eight_is_refused_up_front(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "probe.json"), "--max-registers", "80", "81"])
    assert exc.value.code == 2
    assert "--max-registers 81" in capsys.readouterr().err and not (tmp_path / "probe.json").exists()


def test_epilogue_timings_past_m_8_are_refused_up_front(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "probe.json"), "--epilogues", "--m", "1", "16"])
    assert exc.value.code == 2
    assert "--epilogues" in capsys.readouterr().err and not (tmp_path / "probe.json").exists()


def test_a_shape_that_is_not_nxk_is_refused_by_name_up_front(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "probe.json"), "--shapes", "4096x4096", "4096by14336"])
    assert exc.value.code == 2
    assert "'4096by14336'" in capsys.readouterr().err and not (tmp_path / "probe.json").exists()
