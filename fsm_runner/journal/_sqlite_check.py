"""How a SQLite journal's schema objects are told from damaged or hand-edited ones.

Tables by their columns, keys and unique constraints; indexes by their columns; the view and
the triggers (fsm_runner's own SQL text) by a digest of their SQL. Compared with a new
journal's (:func:`expected_shapes`) by :meth:`SqliteJournal.schema_problems
<fsm_runner.journal.sqlite.SqliteJournal.schema_problems>`, and the code objects at every open.
"""

from __future__ import annotations

import functools
import hashlib
import sqlite3
from typing import Any

__all__ = [
    "CODE",
    "TABLES",
    "code_objects",
    "difference",
    "expected_shapes",
    "object_name",
    "schema_shapes",
]

#: The schema objects whose SQL is fsm_runner's own text — the ``runs`` view and the triggers —
#: by (type, name): their table, and a digest of their SQL with whitespace normalised, as the
#: current schema version has them. Checked at every open; a test keeps it equal to a new
#: journal's (a change of them is a new migration and a new schema version).
CODE: dict[tuple[str, str], tuple[str, str]] = {
    ("trigger", "transitions_fence"): ("transitions", "8fda0ea5177c86748a4c3748361f9e62"),
    ("view", "runs"): ("runs", "cc0c951c1f3d4f7ac3e42ba6c83e85fe"),
}
#: The journal's tables and its view: a trigger on one of them takes part in its writes.
TABLES = frozenset(
    {"_sqlite_migrations", "artifacts", "effects", "iterations", "meta", "run_rows", "runs",
     "specs", "transitions"}
)  # fmt: skip
#: A column's type affinity (SQLite's rules, section 3.1 of its datatype page), by substring.
_AFFINITIES = (("INT", "INTEGER"), ("CHAR", "TEXT"), ("CLOB", "TEXT"), ("TEXT", "TEXT"),
               ("BLOB", "BLOB"), ("REAL", "REAL"), ("FLOA", "REAL"), ("DOUB", "REAL"))  # fmt: skip


def _code_digest(sql: bytes | None) -> str:
    """A digest of a schema object's SQL, whitespace aside (read as bytes: it may be damaged)."""
    return hashlib.sha256(b" ".join((sql or b"").split())).hexdigest()[:32]


def code_objects(conn: sqlite3.Connection) -> dict[tuple[str, str], tuple[str, str]]:
    """The views and triggers of the main schema: (type, name) -> (table, SQL digest)."""
    rows = conn.execute(
        "SELECT CAST(type AS BLOB), CAST(name AS BLOB), CAST(tbl_name AS BLOB),"
        " CAST(sql AS BLOB) FROM main.sqlite_master WHERE type IN ('view', 'trigger')"
    ).fetchall()
    return {
        (object_name(kind), object_name(name)): (object_name(table), _code_digest(sql))
        for kind, name, table, sql in rows
    }


def object_name(raw: bytes | None) -> str:
    """A schema object's name as text (a damaged one shown with its bad bytes escaped)."""
    return (raw or b"").decode("utf-8", "backslashreplace")


def _affinity(declared: str) -> str:
    upper = declared.upper()
    for needle, affinity in _AFFINITIES:
        if needle in upper:
            return affinity
    return "BLOB" if not upper else "NUMERIC"


def schema_shapes(conn: sqlite3.Connection) -> dict[tuple[str, str], Any]:
    """Every schema object by (type, name), as much of it as tells a damaged one.

    Tables by their columns (name, type affinity, NOT NULL, default, key), foreign keys and
    unique constraints: the text sqlite-utils writes for them differs between its versions and
    after ``ALTER TABLE``, so their SQL is not compared. Indexes by table, uniqueness and
    columns; views and triggers by table and SQL (:func:`code_objects`). SQLite's own objects
    (``sqlite_*``) are not the journal's; sqlite-utils' ``_sqlite_migrations`` by name only.
    """
    shapes: dict[tuple[str, str], Any] = dict(code_objects(conn))
    rows = conn.execute(
        "SELECT type, name, tbl_name FROM main.sqlite_master"
        " WHERE type IN ('table', 'index') AND name NOT LIKE 'sqlite^_%' ESCAPE '^'"
    ).fetchall()
    for kind, name, table in rows:
        if kind == "index":
            shapes[kind, name] = (
                table,
                conn.execute(
                    'SELECT "unique", partial FROM pragma_index_list(?) WHERE name = ?',
                    (table, name),
                ).fetchone(),
                tuple(
                    row[0] for row in conn.execute("SELECT name FROM pragma_index_info(?)", (name,))
                ),
            )
        elif name == "_sqlite_migrations":
            shapes[kind, name] = ()
        else:
            shapes[kind, name] = _table_shape(conn, name)
    return shapes


def _table_shape(conn: sqlite3.Connection, table: str) -> tuple[Any, ...]:
    columns = tuple(
        (name, _affinity(declared), bool(notnull), default, pk)
        for name, declared, notnull, default, pk in conn.execute(
            'SELECT name, type, "notnull", dflt_value, pk FROM pragma_table_xinfo(?)', (table,)
        )
    )
    keys = tuple(
        sorted(
            conn.execute(
                'SELECT "table", "from", "to" FROM pragma_foreign_key_list(?)', (table,)
            ).fetchall()
        )
    )
    unique = tuple(
        sorted(
            tuple(row[0] for row in conn.execute("SELECT name FROM pragma_index_info(?)", (index,)))
            for (index,) in conn.execute(
                "SELECT name FROM pragma_index_list(?) WHERE origin = 'u'", (table,)
            )
        )
    )
    return columns, keys, unique


def difference(kind: str, found: Any, expected: Any) -> str:
    """Which columns of a table differ (for a table); nothing for other objects."""
    if kind != "table" or not found or not expected:
        return ""
    names = sorted({column[0] for column in set(found[0]) ^ set(expected[0])})
    return f" (columns {', '.join(names)})" if names else ""


@functools.cache
def expected_shapes() -> dict[tuple[str, str], Any]:
    """The schema objects of a new journal, as :func:`schema_shapes` sees them."""
    from fsm_runner.journal.sqlite import SqliteJournal  # noqa: PLC0415 - it imports this module

    with SqliteJournal(":memory:") as journal:
        return schema_shapes(journal._conn)
