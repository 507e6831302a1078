"""A short run of scripts/crashloop.py: kill -9 under load, nothing lost or doubled."""

from __future__ import annotations

import pytest

from scripts import crashloop

pytestmark = pytest.mark.timeout(240)


def test_crash_loop_loses_and_duplicates_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    code = crashloop.main(["--iterations", "4", "--seed", "7", "--home", str(tmp_path)])
    out = capsys.readouterr().out
    assert "lost=0 duplicated=0 corrupted=0 unexpected_replies=0" in out, out
    assert "kills=4" in out
    accepted = int(out.split("accepted=")[1].split()[0])
    assert accepted > 20, out  # the load really ran
    assert code == 0
