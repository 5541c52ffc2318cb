"""The ``session-gate`` console script (``session_gate.cli:main``): ``sim`` goes to the twin's
Python CLI by import, everything else to the Rust command line inside the extension."""

from __future__ import annotations

import sys

import pytest
from session_gate import cli


@pytest.fixture
def fake_twin(tmp_path, monkeypatch):
    """A module with the twin's ``main(argv)`` shape, importable by name."""
    (tmp_path / "fake_twin_cli.py").write_text(
        "calls = []\ndef main(argv):\n    calls.append(list(argv))\n    return 3\n"
    )
    (tmp_path / "broken_twin_cli.py").write_text("import no_such_dependency_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("fake_twin_cli", "broken_twin_cli"):
        sys.modules.pop(name, None)


def test_sim_runs_the_twins_main_with_the_remaining_arguments(fake_twin, monkeypatch):
    monkeypatch.setattr(cli, "_SIM_MODULE", "fake_twin_cli")
    assert cli.main(["sim", "tune", "--profile", "cpu-tiny"]) == 3
    assert sys.modules["fake_twin_cli"].calls == [["tune", "--profile", "cpu-tiny"]]


def test_a_missing_twin_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_SIM_MODULE", "session_gate.no_such_twin.__main__")
    assert cli.main(["sim", "--help"]) == 2
    err = capsys.readouterr().err
    assert "replica twin is not in this installation" in err
    assert "session_gate.no_such_twin.__main__" in err


def test_a_twin_that_fails_to_import_shows_its_own_error(fake_twin, monkeypatch):
    monkeypatch.setattr(cli, "_SIM_MODULE", "broken_twin_cli")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_anywhere"):
        cli.main(["sim"])


def test_everything_else_is_the_rust_command_line(capfd):
    assert cli.main(["proxy", "--help"]) == 0
    out = capfd.readouterr().out
    assert "--replica" in out and "--default-max-tokens" in out
    assert cli.main(["proxy"]) == 2  # no replica: clap's usage error code
    assert "replica" in capfd.readouterr().err
    assert cli.main(["proxy", "--replica", "ftp://x"]) == 2
    assert "must start with http://" in capfd.readouterr().err
    assert cli.main(["--version"]) == 0
    assert capfd.readouterr().out.startswith("session-gate ")
