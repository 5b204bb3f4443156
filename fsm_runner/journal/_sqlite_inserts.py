"""SQLite INSERTs with their NULLs written into the SQL, not bound: :func:`insert_rows`.

Binding ``None`` costs the ``sqlite3`` module an adaptation lookup (~3k instructions, an
``AttributeError`` formatted and dropped); a new run's rows hold ten or so. Moved out of
:mod:`~fsm_runner.journal._sqlite_writes` (its size), unchanged.
"""

from __future__ import annotations

import itertools
import operator
import re
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LIMIT_VARIABLE_NUMBER", "insert_row", "insert_rows"]

#: An INSERT's SQL and which of its parameters it binds, by the statement and which of its
#: values are NULL (see :func:`insert_rows`).
_null_free: dict[tuple[str, tuple[bool, ...]], tuple[str, Callable[[Sequence[Any]], Any]]] = {}
_NONES = (None,) * 64  # more than any row's values


def insert_rows(cursor: sqlite3.Cursor, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """``executemany(sql, rows)``, in order, with each NULL written into the SQL, not bound.

    Binding ``None`` costs the ``sqlite3`` module an adaptation lookup (~3k instructions, an
    ``AttributeError`` formatted and dropped); a new run's rows hold ten or so. So the rows go
    in runs of one pattern of NULLs each, by a statement with ``NULL`` in those places.
    """
    patterns = [tuple(map(operator.is_, row, _NONES)) for row in rows]
    for pattern, group in itertools.groupby(zip(patterns, rows, strict=True), _first):
        null_free, bound = _statement(sql, pattern)
        cursor.executemany(null_free, [bound(row) for _, row in group])


def insert_row(cursor: sqlite3.Cursor, sql: str, row: tuple[Any, ...]) -> None:
    """:func:`insert_rows` of one row, by ``execute`` (which sets ``lastrowid``)."""
    null_free, bound = _statement(sql, tuple(map(operator.is_, row, _NONES)))
    cursor.execute(null_free, bound(row))


def _statement(sql: str, pattern: tuple[bool, ...]) -> tuple[str, Callable[[Sequence[Any]], Any]]:
    statement = _null_free.get((sql, pattern))
    if statement is None:
        statement = _null_free[sql, pattern] = _without_nulls(sql, pattern)
    return statement


_first = operator.itemgetter(0)
LIMIT_VARIABLE_NUMBER = 9  # sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER (Python 3.11+)


def _without_nulls(
    sql: str, pattern: tuple[bool, ...]
) -> tuple[str, Callable[[Sequence[Any]], Any]]:
    """``sql`` (one ``VALUES`` row of ``?``) with ``NULL`` where ``pattern`` is true."""
    head, values = sql.split(" VALUES ", maxsplit=1)
    if values.count("?") != len(pattern):  # pragma: no cover - a caller's mistake
        raise ValueError(f"{len(pattern)} values for {values.count('?')} parameters")
    marks = iter(["NULL" if null else "?" for null in pattern])
    null_free = head + " VALUES " + re.sub(r"\?", lambda _: next(marks), values)
    kept = [at for at, null in enumerate(pattern) if not null]
    pick = operator.itemgetter(*kept)
    if len(kept) == 1:  # pragma: no cover - every row here has two values or more
        return null_free, lambda row: (pick(row),)
    return null_free, pick
