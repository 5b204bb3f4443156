"""A SQLite journal's verification of the runs it is to drive (see :mod:`~._head`).

:class:`SqliteHeads` reads a run's head rows inside the claim's own write transaction — in the
statement that loads the run (:func:`~._sqlite_chain.load_sql`: a claim by run id), or in one
of their own (:func:`~._sqlite_chain.head_rows`: ``claim_next``, before its UPDATE) — and hands
them to :func:`~._head.verify_head`. It keeps the keys of the runs ``claim_next`` found
refused, so that a worker logs such a run once and looks past it from then on (nothing is
written to it: no lease, no mark).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from fsm_runner.exceptions import InvalidRunIdError, JournalError, RunNotFoundError
from fsm_runner.journal._digest import RUN_DIGEST_COLUMNS, TRANSITION_DIGEST_COLUMNS, text
from fsm_runner.journal._head import verify_head, verify_history
from fsm_runner.journal._sqlite_chain import (
    LOAD_HEAD_COLUMNS,
    head_rows,
    head_sql,
    history_rows,
    load_sql,
)
from fsm_runner.journal._sqlite_connections import SqliteConnections
from fsm_runner.journal._sqlite_writes import SqliteWriter
from fsm_runner.records import RunRecord

__all__ = ["SqliteHeads"]

_log = logging.getLogger("fsm_runner")
#: Where ``duration_ms`` is among a head's values.
_MS = TRANSITION_DIGEST_COLUMNS.index("duration_ms")
stored_key = SqliteWriter.stored_key


class SqliteHeads:
    """Verifies a run's head before a claim, and a fork's source before its rows are copied.

    Args:
        path: the journal's file, for the errors' messages.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._sql: str | None = None  # the read of a run's head rows: made once
        self._load_sql: str | None = None  # the load of a run with them: made once
        self._at: tuple[list[int], int] | None = None  # where the view has what is verified
        #: The keys of runs ``claim_next`` found refused: not tried again by this journal.
        self.refused: set[int] = set()

    def load(
        self,
        conn: sqlite3.Connection,
        run_id: str,
        read_row: Callable[[Any, Sequence[Any]], RunRecord],
    ) -> RunRecord:
        """The run's row (``read_row`` of the view's), once its head is verified (one read).

        Raises:
            RunNotFoundError: there is no such run.
            InvalidRunIdError: the run's id breaks the rule of run ids; nothing was written.
            JournalError: naming the seq that fails; nothing was written.
        """
        sql = self._load_sql
        if sql is None:
            sql = self._load_sql = load_sql(conn)
        cursor = conn.execute(sql, (run_id,))
        row = cursor.fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        split = len(row) - LOAD_HEAD_COLUMNS
        view, description = row[:split], cursor.description[:split]
        at = self._at
        if at is None:
            names = [column[0] for column in description]
            at = self._at = ([names.index(c) for c in RUN_DIGEST_COLUMNS], names.index("seq"))
        run_digest, head_seq, head_digest, *head = row[split:]
        previous = head.pop()
        if head[_MS] is not None:  # the one number: its canonical text (a float's hex)
            head[_MS] = text(head[_MS]).encode()
        run_row = (run_digest, *[view[index] for index in at[0]])
        head_row = None if head_seq is None else (head_digest, *head)
        verify_head(run_id, view[at[1]], head_row, previous, run_row, path=self.path)
        return read_row(description, view)

    def verify(self, conn: sqlite3.Connection, key: object, run_id: str | None) -> None:
        """Refuse the run of ``key`` if its id breaks the rule or its head fails its digest.

        One read: the run row, its last transition and the digest of the one before. A ``key``
        that is not an int (not given, or damaged) is read from ``run_id``'s row.

        Raises:
            InvalidRunIdError: the run's id breaks the rule of run ids; nothing was written.
            JournalError: naming the seq that fails; nothing was written.
        """
        if type(key) is not int:
            if run_id is None:
                return
            key = stored_key(conn, run_id)
        sql = self._sql
        if sql is None:
            sql = self._sql = head_sql(conn)
        seq, head, previous, run_row = head_rows(conn, sql, key)
        if run_row is None:  # no run of that key (nothing to drive): the caller's read says so
            return
        if run_id is None:  # the id as stored (read as bytes, as the digest reads it)
            run_id = bytes(run_row[1]).decode("utf-8", "surrogateescape")
        verify_head(run_id, seq or 0, head, previous, run_row, path=self.path)

    def sound(self, conn: sqlite3.Connection, key: int) -> bool:
        """``claim_next``'s check of a run found: ``False`` (logged once) if it is refused."""
        if key in self.refused:
            return False
        try:
            self.verify(conn, key, None)
        except (JournalError, InvalidRunIdError) as exc:
            self.refused.add(key)
            _log.error("%s; the run is skipped (not claimed)", exc.message)
            return False
        return True

    def verify_source(self, connections: SqliteConnections, run_id: str, at_seq: int) -> None:
        """Refuse a fork's source whose chain up to ``at_seq``, or whose row, fails its digest.

        Raises:
            RunNotFoundError: there is no such run.
            JournalError: naming the first seq that fails (or the row); nothing was written.
        """
        with connections.read() as conn:
            transitions, run_row = history_rows(conn, stored_key(conn, run_id), at_seq)
        verify_history(run_id, transitions, run_row, path=self.path)
