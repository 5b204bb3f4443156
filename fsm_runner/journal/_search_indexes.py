"""The indexes a journal's searches are served by (``journal.search_indexes``).

A search index holds one :class:`~fsm_runner.journal.search.SearchKey` of every run: its start
time, or the JSON value at a path of its input or context. It is named ``search:`` and the key
(``search:input.order.id``), so the journal lists its own by name, and a search by the key names
the index's expression in its SQL, so the database's planner reads the index by itself; nothing
else in the journal knows of it. Adding one is an operator's choice, as a console's search
attributes are declared first: each costs a write to every run that sets its value (a start's,
an input's; a context's at each step that changes it), and a build over every stored run.

SQLite: ``CREATE INDEX`` inside one write transaction (writers wait for the build: ~1 s for
100,000 runs). PostgreSQL: ``CREATE INDEX CONCURRENTLY`` (writers go on meanwhile), over the
JSON text decoded by :data:`~fsm_runner.journal.search.POSTGRES_DECODE`, a function made in the
journal's schema with the first index; its start times are always indexed (``runs_created_at``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fsm_runner.exceptions import JournalError
from fsm_runner.journal.search import (
    POSTGRES_DECODE,
    JsonMatch,
    SearchKey,
    postgres_json_match,
    search_index_sql,
)

if TYPE_CHECKING:
    import sqlite3

    from fsm_runner.journal._postgres_connection import Connection, PostgresConnection
    from fsm_runner.journal._sqlite_connections import SqliteConnections

__all__ = ["MemorySearchIndexes", "PostgresSearchIndexes", "SqliteSearchIndexes"]

_PREFIX = "search:"


def _key(key: SearchKey | str) -> SearchKey:
    return key if isinstance(key, SearchKey) else SearchKey.parse(key)


def _keys(names: Iterable[str]) -> list[SearchKey]:
    """The keys of the indexes named ``search:KEY`` (a name that is no key is not ours)."""
    found = []
    for name in names:
        with contextlib.suppress(ValueError):
            found.append(SearchKey.parse(name.removeprefix(_PREFIX)))
    return found


class SqliteSearchIndexes:
    """A SQLite journal's search indexes: indexes of ``run_rows`` named ``search:KEY``.

    Only an index with the SQL ``add`` writes for its key is one (``check`` reports another
    index of the journal's tables, whatever its name).
    """

    def __init__(self, connections: SqliteConnections) -> None:
        self._connections = connections

    def indexed(self) -> list[SearchKey]:
        """The keys the journal's search indexes serve, by name."""
        _, rows = self._connections.select(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'run_rows'"
            " AND substr(name, 1, 7) = ? ORDER BY name",
            [_PREFIX],
            damaged=True,
        )
        found = {str(name): sql for name, sql in rows}
        return [key for key in _keys(found) if found.get(key.index_name) == search_index_sql(key)]

    def serves(self, key: SearchKey | str) -> bool:
        """Whether a search index serves ``key`` (one read of the schema)."""
        key = _key(key)
        _, rows = self._connections.select(_SQLITE_INDEX, [key.index_name], damaged=True)
        return bool(rows) and rows[0][0] == search_index_sql(key)

    def add(self, key: SearchKey | str) -> bool:
        """Index ``key`` of every run; ``False`` if an index already serves it.

        Built in one write transaction: the journal's writers wait for it.

        Raises:
            JournalError: an index of that name exists that is not the key's (made by hand).
        """
        key = _key(key)

        def work(conn: sqlite3.Connection) -> bool:
            found = conn.execute(_SQLITE_INDEX, (key.index_name,)).fetchone()
            if found is None:
                conn.execute(search_index_sql(key))
                return True
            if found[0] != search_index_sql(key):
                raise JournalError(
                    f"has an index named {key.index_name} that is not the search index of"
                    f" {key} (made by hand?); drop it first ('fsm-runner index drop {key}')",
                    path=self._connections.location,
                )
            return False

        return self._connections.writing(work)

    def drop(self, key: SearchKey | str) -> bool:
        """Drop the index named for ``key`` (whatever it holds); ``False`` if there was none."""
        key = _key(key)

        def work(conn: sqlite3.Connection) -> bool:
            if conn.execute(_SQLITE_INDEX, (key.index_name,)).fetchone() is None:
                return False
            conn.execute(f'DROP INDEX "{key.index_name}"')
            return True

        return self._connections.writing(work)


#: The SQL of the index of that name, if there is one.
_SQLITE_INDEX = "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = ?"


#: The function a PostgreSQL journal's search indexes decode JSON text with; ``NULL`` for text
#: ``jsonb`` refuses (a ``\\u0000`` escape), where a cast would refuse the run's write. Text
#: without that escape is cast at once; the rest inside a block that catches the refusal (a
#: subtransaction: so not ``PARALLEL SAFE``, which a parallel index build would refuse).
_DECODE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION {POSTGRES_DECODE}(document text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT AS $$
BEGIN
    IF strpos(document, '\\u0000') = 0 THEN
        RETURN document::jsonb;
    END IF;
    BEGIN
        RETURN document::jsonb;
    EXCEPTION WHEN data_exception THEN
        RETURN NULL;
    END;
END
$$"""

#: The valid indexes named ``search:KEY`` of the journal's schema (one being built, or left
#: by a build that failed, is not valid: it serves no search yet).
_PG_INDEXES = (
    "SELECT c.relname FROM pg_index AS i"
    " JOIN pg_class AS c ON c.oid = i.indexrelid"
    " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
    " WHERE n.nspname = current_schema() AND substr(c.relname, 1, 7) = %s"
    " AND (%s::text IS NULL OR c.relname = %s) AND i.indisvalid = %s"
    " ORDER BY c.relname"
)


class PostgresSearchIndexes:
    """A PostgreSQL journal's search indexes: indexes of ``runs`` named ``search:KEY``."""

    def __init__(self, connection: PostgresConnection) -> None:
        self._connection = connection

    def indexed(self) -> list[SearchKey]:
        """The keys the journal's search indexes serve, by name.

        Not ``created_at``: ``runs_created_at`` serves it, always.
        """
        _, rows = self._connection.select(_PG_INDEXES, [_PREFIX, None, None, True])
        return _keys(str(name) for (name,) in rows)

    def serves(self, key: SearchKey | str) -> bool:
        """Whether an index serves ``key`` (``created_at``: always)."""
        key = _key(key)
        if key.field == "created_at":
            return True
        name = key.index_name
        _, rows = self._connection.select(_PG_INDEXES, [_PREFIX, name, name, True])
        return bool(rows)

    def json_match(self, match: JsonMatch) -> tuple[str, list[Any]]:
        """The SQL condition of ``match``: on the expression of its search index, if any.

        (Without one, the column cast to ``jsonb``: the decoding function costs a call a row.)
        """
        decode = POSTGRES_DECODE if self.serves(match.key) else None
        return postgres_json_match(match, decode=decode)

    def add(self, key: SearchKey | str) -> bool:
        """Index ``key`` of every run; ``False`` if an index already serves it.

        ``CREATE INDEX CONCURRENTLY``: the journal's writers go on while it is built. A build
        cut off (a lost connection) leaves an index that is not valid; the next ``add`` drops
        it and builds it again. Then ``ANALYZE runs``, so the planner knows the values.
        """
        key = _key(key)
        if key.field == "created_at":
            return False  # runs_created_at
        name = key.index_name

        def work(conn: Connection) -> bool:
            found = conn.execute(_PG_INDEXES, [_PREFIX, name, name, True]).fetchall()
            if found:
                return False
            conn.execute(_DECODE_FUNCTION)
            conn.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')  # a failed build's
            expression = key.postgres_expression(POSTGRES_DECODE)
            conn.execute(f'CREATE INDEX CONCURRENTLY "{name}" ON runs ({expression})')
            # The statistics of the index's expression: without them the planner guesses 0.5 %
            # of the runs match a value, and walks the listing's order instead, decoding each
            # run's JSON until the page is full (a rare value: every run, 1.3 s of 1,000,000).
            conn.execute("ANALYZE runs")
            return True

        return self._connection.writing(work)

    def drop(self, key: SearchKey | str) -> bool:
        """Drop the index of ``key``; ``False`` if there was none."""
        key = _key(key)
        if key.field == "created_at":
            return False
        name = key.index_name

        def work(conn: Connection) -> bool:
            found = conn.execute(_PG_INDEXES, [_PREFIX, name, name, True]).fetchall()
            conn.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
            return bool(found)

        return self._connection.writing(work)


class MemorySearchIndexes:
    """A memory journal's: its searches read its runs in memory; the keys added are kept."""

    def __init__(self) -> None:
        self._keys: set[SearchKey] = set()
        self._lock = threading.Lock()

    def indexed(self) -> list[SearchKey]:
        """The keys added, by name."""
        with self._lock:
            return sorted(self._keys, key=lambda key: key.index_name)

    def serves(self, key: SearchKey | str) -> bool:
        """``True``: every search of a memory journal reads its runs in memory."""
        _key(key)
        return True

    def add(self, key: SearchKey | str) -> bool:
        """Keep ``key``; ``False`` if it was kept already."""
        key = _key(key)
        with self._lock:
            if key in self._keys:
                return False
            self._keys.add(key)
            return True

    def drop(self, key: SearchKey | str) -> bool:
        """Forget ``key``; ``False`` if it was not kept."""
        key = _key(key)
        with self._lock:
            if key not in self._keys:
                return False
            self._keys.discard(key)
            return True
