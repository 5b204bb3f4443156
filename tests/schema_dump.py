"""Writes ``fsm_runner/journal/_schema_new.py``: a new SQLite journal's schema, dumped.

Usage (from the repository root, after adding a migration)::

    python -m tests.schema_dump

Every migration of :mod:`fsm_runner.journal._schema` is applied to an empty in-memory
database, and its schema objects (SQLite's own aside), in the order SQLite holds them, its
``meta`` rows and the migrations' names are written out as the module that creates a new
journal in one step. ``tests/test_new_journal.py`` fails while the module differs from what
this writes.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from fsm_runner.journal import _schema
from fsm_runner.journal._sqlite_check import APPLICATION_ID, SCHEMA_VERSION

TARGET = Path(_schema.__file__).with_name("_schema_new.py")

HEADER = '''\
"""A new SQLite journal's schema in one step: the objects every migration leaves, in order.

Written by ``python -m tests.schema_dump`` from a database every migration of
:mod:`._schema` was applied to (do not edit by hand: add a migration, then run it);
``tests/test_new_journal.py`` keeps the two equal. A new journal made here costs a
dozen statements instead of the migrations' hundreds, and opens without importing
sqlite-utils (~0.1 s): every first ``fsm-runner demo``, every test's journal. A journal
that exists is migrated as before.
"""

from __future__ import annotations

import datetime as dt
import sqlite3

__all__ = ["SCHEMA_VERSION", "create"]

'''

FOOTER = '''

def create(conn: sqlite3.Connection) -> None:
    """Make the schema on ``conn``, an empty database, inside the caller's transaction."""
    for statement in STATEMENTS:
        conn.execute(statement)
    conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", META)
    applied = str(dt.datetime.now(dt.timezone.utc))
    conn.executemany(
        "INSERT INTO _sqlite_migrations (migration_set, name, applied_at) VALUES (?, ?, ?)",
        [("fsm_runner", name, applied) for name in MIGRATIONS],
    )
'''


def migrated() -> sqlite3.Connection:
    """An in-memory database with every migration applied, as the migrations leave it."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    _schema.migrate(_schema.database(conn))
    return conn


def render() -> str:
    """The module's text."""
    conn = migrated()
    try:
        statements = [
            sql
            for (sql,) in conn.execute(
                "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL"
                " AND name NOT LIKE 'sqlite^_%' ESCAPE '^' ORDER BY rowid"
            )
        ]
        meta = conn.execute("SELECT key, value FROM meta ORDER BY rowid").fetchall()
        names = [
            name for (name,) in conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id")
        ]
    finally:
        conn.close()
    lines = [HEADER, f"#: The schema version these objects are.\nSCHEMA_VERSION = {SCHEMA_VERSION}"]
    lines.append(
        f"#: ``PRAGMA application_id`` (set by the caller).\nAPPLICATION_ID = 0x{APPLICATION_ID:08X}"
    )
    lines.append("#: The migrations these objects are the result of, in order.\nMIGRATIONS = (")
    lines += [f"    {json.dumps(name)}," for name in names]
    lines.append(")\n#: The ``meta`` rows the migrations write.\nMETA = (")
    lines += [f"    ({json.dumps(key)}, {json.dumps(value)})," for key, value in meta]
    lines.append(")\n#: The schema objects, in the order SQLite holds them.\nSTATEMENTS = (")
    for sql in statements:
        assert '"""' not in sql, sql
        assert "\\" not in sql, sql
        lines.append(f'    """{sql}""",')
    lines.append(")")
    return "\n".join(lines) + "\n" + FOOTER


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
