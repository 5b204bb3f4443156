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
