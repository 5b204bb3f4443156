from __future__ import annotations

import pytest

from fsm_runner import MemoryJournal, SqliteJournal


@pytest.fixture(params=["memory", "sqlite"])
def journal(request, tmp_path):
    """Every journal implementation, fresh for each test (SQLite in a real file)."""
    j = MemoryJournal() if request.param == "memory" else SqliteJournal(tmp_path / "journal.db")
    yield j
    j.close()


@pytest.fixture
def sqlite_journal(tmp_path):
    j = SqliteJournal(tmp_path / "journal.db")
    yield j
    j.close()


@pytest.fixture
def in_tmp_path(tmp_path, monkeypatch):
    """Run in tmp_path: apps built by `--app` factories open ./fsm-runner.db, not in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def journal_path(tmp_path):
    """Where a CLI test's journal lives."""
    return tmp_path / "journal.db"


@pytest.fixture
def invoke(journal_path):
    """Run `fsm-runner --journal JOURNAL ARGS...` through click's CliRunner."""
    from click.testing import CliRunner

    from fsm_runner.cli import cli

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(cli, ["--journal", str(journal_path), *args], catch_exceptions=False)

    return invoke
