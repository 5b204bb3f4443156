"""A new SQLite journal is made in one step, as every migration applied in order would make it.

``fsm_runner/journal/_schema_new.py`` holds the current schema's objects, dumped by
``python -m tests.schema_dump`` from a database every migration was applied to; a new journal
is created from it (a dozen statements, no sqlite-utils import) while an existing one is
migrated as before. These tests keep the dump equal to the migrations.
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fsm_runner import SqliteJournal
from fsm_runner.journal import _schema, _schema_new
from fsm_runner.journal._sqlite_check import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    code_objects,
    schema_problems,
    schema_shapes,
)
from tests import schema_dump

ROOT = Path(__file__).resolve().parents[1]


def master(conn: sqlite3.Connection) -> list[tuple[str, str, str, str | None]]:
    """The schema objects in order (SQLite makes ``sqlite_sequence`` where it needs it first)."""
    return conn.execute(
        "SELECT type, name, tbl_name, sql FROM sqlite_master"
        " WHERE name != 'sqlite_sequence' ORDER BY rowid"
    ).fetchall()


def test_the_dump_is_what_the_migrations_make_now():
    assert Path(_schema_new.__file__).read_text() == schema_dump.render(), (
        "fsm_runner/journal/_schema_new.py is stale: run `python -m tests.schema_dump`"
    )
    assert _schema_new.SCHEMA_VERSION == SCHEMA_VERSION
    assert APPLICATION_ID == _schema_new.APPLICATION_ID


def test_a_new_journal_has_every_object_and_row_a_migrated_one_has(tmp_path):
    path = tmp_path / "new.db"
    SqliteJournal(path).close()
    migrated = schema_dump.migrated()
    made = sqlite3.connect(path)
    try:
        assert master(made) == master(migrated)
        assert schema_shapes(made) == schema_shapes(migrated)
        assert code_objects(made) == code_objects(migrated)
        assert schema_problems(made) == []
        meta = "SELECT key, value FROM meta WHERE key != 'schema_version' ORDER BY key"
        assert made.execute(meta).fetchall() == migrated.execute(meta).fetchall()
        assert made.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )
        assert made.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
        names = "SELECT migration_set, name FROM _sqlite_migrations ORDER BY id"
        assert made.execute(names).fetchall() == migrated.execute(names).fetchall()
        # So a later migration applies on top of a journal made from the dump, and none twice.
        db = _schema.database(made)
        assert _schema.unknown_migrations(db) == set()
        assert not list(_schema._migrations.pending(db))  # private: the migrations' own list
    finally:
        made.close()
        migrated.close()


def test_making_a_journal_does_not_import_sqlite_utils(tmp_path):
    code = (
        "import sys\n"
        "from fsm_runner import Engine, SqliteJournal\n"
        f"with SqliteJournal({str(tmp_path / 'j.db')!r}) as journal:\n"
        "    journal.runs()\n"
        "assert 'sqlite_utils' not in sys.modules, 'sqlite_utils imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("round_", range(10))  # a race: each round a new file, raced anew
def test_one_new_file_opened_by_many_at_once_is_made_once(tmp_path, round_):
    # (An opener that read the file's id before another made the journal, and its tables
    # after, took it for a foreign database: the id is now read again after the tables.)
    path = tmp_path / "raced.db"
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def open_it() -> None:
        start.wait()
        try:
            SqliteJournal(path).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        count = conn.execute("SELECT count(*) FROM _sqlite_migrations").fetchone()[0]
        assert count == len(_schema_new.MIGRATIONS)
