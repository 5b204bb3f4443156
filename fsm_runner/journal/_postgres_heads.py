"""A PostgreSQL journal's verification of the runs it is to drive (see :mod:`~._head`).

:class:`PostgresHeads` reads a run's head rows inside the claim's own transaction, in one
statement (the run row, its last transition and the digest of the one before, by the
transitions' primary key), and hands them to :func:`~._head.verify_head`: a run that fails is
refused with one ``JournalError`` naming the seq, and the claim is rolled back (nothing is
written). It keeps the ids of the runs ``claim_next`` found refused, so that a worker logs such a
run once and looks past it from then on. Times are hashed as the SQLite journal stores them
(:func:`~._postgres_chain.as_text`), as every digest of this journal is.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fsm_runner.exceptions import InvalidRunIdError, JournalError, RunNotFoundError
from fsm_runner.journal import _rows
from fsm_runner.journal._digest import RUN_DIGEST_COLUMNS, TRANSITION_DIGEST_COLUMNS
from fsm_runner.journal._head import is_head_refusal, verify_head
from fsm_runner.journal._postgres_chain import as_text
from fsm_runner.journal._postgres_connection import Connection
from fsm_runner.records import RunRecord

__all__ = ["PostgresHeads"]

_log = logging.getLogger("fsm_runner")
_RUN = len(RUN_DIGEST_COLUMNS)
#: Where the head transition's seq is in :data:`_HEAD_COLUMNS` (its digest next).
_HEAD_SEQ = 2 + _RUN
#: What is verified: the run row's digest and values, its head transition's, and the digest
#: of the transition before the head.
_HEAD_COLUMNS = (
    "r.seq, r.digest, "
    + ", ".join(f"r.{column}" for column in RUN_DIGEST_COLUMNS)
    + ", t.seq, t.digest, "
    + ", ".join(f"t.{column}" for column in TRANSITION_DIGEST_COLUMNS)
    + ", p.digest"
)
_HEAD_JOINS = (
    " FROM runs AS r"
    " LEFT JOIN transitions AS t ON t.run_id = r.run_id AND t.seq = r.seq"
    " LEFT JOIN transitions AS p ON p.run_id = r.run_id AND p.seq = r.seq - 1"
)
_HEAD_SQL = f"SELECT {_HEAD_COLUMNS}{_HEAD_JOINS} WHERE r.run_id = %s"
_HEADS_SQL = f"SELECT r.run_id, {_HEAD_COLUMNS}{_HEAD_JOINS} WHERE r.run_id = ANY(%s)"
#: A claim's read of the run (locked) with what is verified, and the server's time: one
#: statement.
_LOADED = (
    "SELECT "
    + ", ".join(f"r.{column}" for column in _rows.RUN_COLUMNS)
    + f", {_HEAD_COLUMNS}, clock_timestamp(){_HEAD_JOINS}"
)
_LOAD_SQL = f"{_LOADED} WHERE r.run_id = %s FOR UPDATE OF r"
#: The same for several runs (in the order of their ids: locks taken in one order).
_LOAD_MANY_SQL = f"{_LOADED} WHERE r.run_id = ANY(%s) ORDER BY r.run_id FOR UPDATE OF r"


class PostgresHeads:
    """Verifies a run's head before a claim takes it (in the claim's transaction).

    Args:
        location: the journal's location (its URL, password hidden), for the errors' messages.
    """

    def __init__(self, location: str) -> None:
        self.location = location
        #: The ids of runs ``claim_next`` found refused: not tried again by this journal.
        self.refused: set[str] = set()

    def verify(self, conn: Connection, run_id: str) -> None:
        """Refuse ``run_id`` if its id breaks the rule or its head or row fails its digest.

        A run that is not there is not refused (the caller's read says so).

        Raises:
            InvalidRunIdError: the run's id breaks the rule of run ids.
            JournalError: naming the seq that fails (or the run's row).
        """
        row: Any = conn.execute(_HEAD_SQL, (run_id,)).fetchone()
        if row is not None:
            self._verify(run_id, row)

    def verify_many(self, conn: Connection, run_ids: Sequence[str]) -> dict[str, str]:
        """:meth:`verify` of several runs in one read; their heads' digests (run id -> digest).

        For runs whose rows this transaction holds (it just wrote them): their heads as
        committed. Raises as :meth:`verify` does for the first run that fails.
        """
        heads: dict[str, str] = {}
        for run_id, *row in conn.execute(_HEADS_SQL, (list(run_ids),)).fetchall():
            self._verify(run_id, row)
            if row[_HEAD_SEQ] is not None:
                heads[run_id] = row[_HEAD_SEQ + 1]
        return heads

    def load(
        self, conn: Connection, run_id: str, decode: Callable[[Sequence[Any]], RunRecord]
    ) -> tuple[RunRecord, dt.datetime]:
        """The run's row, locked (``FOR UPDATE``), once verified, and the server's time then.

        One read for the three (a claim's: its lease is set and judged by the server's clock).

        Raises:
            RunNotFoundError: there is no such run.
            InvalidRunIdError: the run's id breaks the rule of run ids.
            JournalError: naming the seq that fails (or the run's row).
        """
        row: Any = conn.execute(_LOAD_SQL, (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        split = len(_rows.RUN_COLUMNS)
        self._verify_locked(conn, run_id, row[split:-1])
        return decode(row[:split]), row[-1]

    def load_many(
        self, conn: Connection, run_ids: Sequence[str], decode: Callable[[Sequence[Any]], RunRecord]
    ) -> tuple[dict[str, RunRecord | Exception], dict[str, str], dt.datetime | None]:
        """Each run's row, locked, once verified (or why refused), heads' digests, server time.

        One read for them all (``claim_many``'s). A run not there is :class:`RunNotFoundError`.
        A head digest is given for a run whose head was read at the row's seq (not for one
        whose row moved while the read waited for its lock: its head was read again).
        """
        rows: Any = conn.execute(_LOAD_MANY_SQL, (list(run_ids),)).fetchall()
        split = len(_rows.RUN_COLUMNS)
        found: dict[str, RunRecord | Exception] = {}
        heads: dict[str, str] = {}
        now = None
        for row in rows:
            run_id, now = row[0], row[-1]
            try:
                self._verify_locked(conn, run_id, row[split:-1])
            except (JournalError, InvalidRunIdError) as exc:
                found[run_id] = exc
            else:
                found[run_id] = decode(row[:split])
                if row[split + _HEAD_SEQ] == row[split]:  # t.seq = r.seq: the head as verified
                    heads[run_id] = row[split + _HEAD_SEQ + 1]
        for run_id in run_ids:
            found.setdefault(run_id, RunNotFoundError(run_id))
        return found, heads, now

    def _verify_locked(self, conn: Connection, run_id: str, row: Sequence[Any]) -> None:
        """Verify the head a locking read returned; if it fails, the head as committed.

        A read that locks the run's row (``FOR UPDATE OF r``) and waited for a commit that held
        it gets the row's new version joined to the head rows of its own, older snapshot (none
        at the new seq): a sound run looks damaged. The row is this transaction's now, so a
        read of its own (a new snapshot) sees the head as committed; a run still failing it is
        damaged. One more statement, only when the first read fails.
        """
        try:
            self._verify(run_id, row)
        except (JournalError, InvalidRunIdError):
            self.verify(conn, run_id)

    def _verify(self, run_id: str, row: Sequence[Any]) -> None:
        seq, run_digest, *rest = row
        run_row = (run_digest, *as_text(rest[:_RUN]))
        head_seq, head_digest, *head_values = rest[_RUN:]
        previous = head_values.pop()
        head = None if head_seq is None else (head_digest, *as_text(head_values))
        verify_head(run_id, seq, head, previous, run_row, path=self.location)

    def refuse(self, run_id: str, error: BaseException) -> bool:
        """Whether ``error`` refuses ``run_id`` alone: then noted (logged once), to be passed by.

        Any other error concerns every run (the journal closed, the server away): ``False``.
        """
        if not isinstance(error, (JournalError, InvalidRunIdError)) or not is_head_refusal(error):
            return False
        if run_id not in self.refused:
            self.refused.add(run_id)
            _log.error("%s; the run is skipped (not claimed)", error)
        return True
