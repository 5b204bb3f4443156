"""SQLite's side of durable waits (schema version 10): wake times and signals.

:class:`SqliteWaits` is the object :class:`~fsm_runner.journal.sqlite.SqliteJournal` holds for
them, over the journal's connections. A run's wake time is ``run_rows.wake_at`` (when
``claim_next`` offers the run whatever its state): set by :meth:`SqliteWaits.park` and by a
signal's arrival, cleared by the commit that ends the run (the writer's), and read by claims and
:meth:`SqliteWaits.next_wake` from one range of ``idx_run_rows_due``. Signals are the rows of
``signals``, numbered in arrival order; consuming one is a commit
(:meth:`~fsm_runner.journal._sqlite_writes.SqliteWriter.consume_signal`). An idle worker waits
on :meth:`SqliteWaits.idle`: until another connection commits (the file's ``data_version``), a
signal is journaled or a run let go of through this journal object, or its time is up.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Collection
from typing import Any

import attrs

from fsm_runner.exceptions import RunNotFoundError, RunTerminalError
from fsm_runner.journal import _rows
from fsm_runner.journal._digest import row_digest
from fsm_runner.journal._head import signal_refusal
from fsm_runner.journal._idle import Doorbell
from fsm_runner.journal._sql import SqlCore
from fsm_runner.journal._sqlite_connections import SqliteConnections
from fsm_runner.records import SignalRecord, SignalStatus, format_utc, parse_utc, utc_now
from fsm_runner.spec import RunLifecycle

__all__ = ["Names", "SqliteWaits", "Wake"]

#: A wake time given to :meth:`SqliteWaits.park` (``None``: none).
Wake = dt.datetime | None
#: The signal names a waiting state accepts.
Names = Collection[str]

#: A run's signals as :func:`~._rows.decode_signal` reads them (a WHERE clause follows).
_SELECT_SIGNALS = f"SELECT {', '.join(_rows.SIGNAL_COLUMNS)} FROM signals"
#: A run's pending signals, each with its digest (of :data:`~._digest.SIGNAL_DIGEST_COLUMNS`).
_SELECT_PENDING = (
    f"SELECT {', '.join(_rows.SIGNAL_COLUMNS)}, digest FROM signals"
    " WHERE run_key = ? AND consumed_seq IS NULL ORDER BY number"
)
#: The machine's earliest wake time: one seek at the start of its range of idx_run_rows_due.
NEXT_WAKE = (
    "SELECT min(wake_at) FROM run_rows WHERE machine = ? AND status = 'active'"
    " AND lease_owner IS NULL AND wake_at IS NOT NULL"
)
_ACTIVE = RunLifecycle.ACTIVE.value


class SqliteWaits:
    """Wake times and signals of one SQLite journal.

    Args:
        connections: the journal's connection manager.
        core: the journal's shared SQL (its reading of JSON).
    """

    def __init__(self, connections: SqliteConnections, core: SqlCore) -> None:
        self._connections = connections
        self._loads = core._loads  # the journal's own reading of JSON columns
        self._bell = Doorbell()  # rung by put_signal: for idle workers of this journal object
        #: Per thread, the file's data_version when its last idle wait ended (before its claim).
        self._versions = threading.local()

    def idle(self, *, timeout: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout`` seconds for work (see ``Journal.idle``).

        Every tick (:data:`~._idle.TICK`) the file's ``data_version`` is compared with its
        value when this thread's last wait ended, before the claim that found nothing: another
        connection's commit since (a signal, a start, a release of another process) ends the
        wait. A signal journaled through this journal object rings its doorbell.
        """
        try:
            return self._bell.wait(timeout=timeout, stop=stop, listen=self._listen)
        finally:
            self._versions.value = self._connections.data_version()

    def _listen(self, seconds: float) -> bool:
        """Pause a tick (less if the doorbell rings); then whether another connection wrote."""
        if self._bell.pause(seconds):
            return True
        seen = getattr(self._versions, "value", None)
        now = self._connections.data_version()
        return seen is not None and now is not None and now != seen

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token``; ``False`` if it no longer held it.

        A wake time still to come goes with it (a run let go of without a park does not wait);
        a past one stays: a signal came for the run.
        """
        with self._connections.write() as conn:
            released = conn.execute(
                "UPDATE run_rows SET lease_owner = NULL, lease_expires_at = NULL,"
                " wake_at = CASE WHEN wake_at > ? THEN NULL ELSE wake_at END"
                " WHERE run_id = ? AND lease_owner = ? AND lease_token = ?",
                (format_utc(utc_now()), run_id, owner, token),
            ).rowcount
        if released:
            self._bell.ring()  # a run let go of may be runnable
        return bool(released)

    def park(self, run_id: str, owner: str, token: int, *, wake_at: Wake, accepts: Names) -> bool:
        """Give up the lease as ``release`` does, and set the run's wake time, at once.

        One UPDATE: the release (``run_rows_released`` brings the row to its head) and the
        wake time, now if a pending signal of the run is named in ``accepts``, else
        ``wake_at``. ``False`` (nothing changed) when ``owner`` no longer held the lease.
        """
        now = format_utc(utc_now())
        wake = None if wake_at is None else format_utc(wake_at)
        names = sorted(set(accepts))
        if names:
            wake_sql = (
                "CASE WHEN EXISTS (SELECT 1 FROM signals AS s"
                " WHERE s.run_key = run_rows.run_key AND s.consumed_seq IS NULL"
                f" AND s.name IN ({', '.join('?' * len(names))})) THEN ? ELSE ? END"
            )
            wake_params: list[Any] = [*names, now, wake]
        else:
            wake_sql, wake_params = "?", [wake]
        with self._connections.write() as conn:
            parked = conn.execute(
                "UPDATE run_rows SET lease_owner = NULL, lease_expires_at = NULL,"
                f" wake_at = {wake_sql} WHERE run_id = ? AND lease_owner = ? AND lease_token = ?",
                (*wake_params, run_id, owner, token),
            ).rowcount
        if parked:
            self._bell.ring()  # due at once if a signal it accepts came
        return bool(parked)

    def wake_time(self, run_id: str) -> dt.datetime | None:
        """Return the run's wake time, if it has one.

        Raises:
            RunNotFoundError: no such run.
        """
        with self._connections.read() as conn:
            found = conn.execute(
                "SELECT wake_at FROM run_rows WHERE run_id = ?", (run_id,)
            ).fetchone()
        if found is None:
            raise RunNotFoundError(run_id)
        return None if found[0] is None else parse_utc(found[0])

    def next_wake(self, *, machine: str) -> dt.datetime | None:
        """Return the earliest wake time of the machine's active runs nobody holds, if any.

        One seek in ``idx_run_rows_due``, which holds the unleased runs only: a run whose
        lease expired is left out (``claim_next`` takes it over as any expired lease).
        """
        with self._connections.read() as conn:
            (found,) = conn.execute(NEXT_WAKE, (machine,)).fetchone()
        return None if found is None else parse_utc(found)

    def put_signal(self, signal: SignalRecord) -> SignalRecord:
        """Journal a signal for its run in ONE transaction; return it as stored (``Journal``).

        The run's row is read (its key, whether it ended), a signal with the same
        ``signal_id`` looked for (returned as it stands), then the signal inserted (SQLite
        numbers it: above every stored one) and the run's wake time set to its arrival. The
        payload is checked (and encoded) before the transaction: refused, nothing written.
        """
        params = _rows.signal_params(signal, format_utc(utc_now()))
        received = params[-1]
        with self._connections.write() as conn:
            found = conn.execute(
                "SELECT run_key, status, state FROM runs WHERE run_id = ?", (signal.run_id,)
            ).fetchone()
            if found is None:
                raise RunNotFoundError(signal.run_id)
            key, status, state = found
            if signal.signal_id is not None:
                stored = conn.execute(
                    f"{_SELECT_SIGNALS} WHERE run_key = ? AND signal_id = ?",
                    (key, signal.signal_id),
                ).fetchone()
                if stored is not None:
                    ended = status != _ACTIVE
                    return _rows.decode_signal(
                        stored, self._loads, ended=ended, location=self._connections.path
                    )
            if status != _ACTIVE:
                raise RunTerminalError(run_id=signal.run_id, state=state, status=status)
            number = conn.execute(
                "INSERT INTO signals (run_key, run_id, name, payload, signal_id, received_at,"
                " digest) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key, *params, row_digest(params)),  # what its sender wrote (schema 12)
            ).lastrowid
            assert number is not None  # set by every INSERT
            conn.execute("UPDATE run_rows SET wake_at = ? WHERE run_key = ?", (received, key))
        self._bell.ring()
        return attrs.evolve(
            signal,
            number=number,
            received_at=parse_utc(received),
            status=SignalStatus.PENDING,
            consumed_seq=None,
            consumed_at=None,
        )

    def signals(self, run_id: str, *, pending: bool = False) -> list[SignalRecord]:
        """Return the run's signals in arrival order (pending ones only, with ``pending``).

        A pending signal of a run that has ended is returned ``expired``; an unknown run has
        none.
        """
        with self._connections.read() as conn:
            found = conn.execute(
                "SELECT run_key, status FROM run_rows WHERE run_id = ?", (run_id,)
            ).fetchone()
            if found is None:
                return []
            key, status = found
            ended = status != _ACTIVE
            if pending and ended:
                return []
            if pending:  # about to be delivered: each checked against what its sender wrote
                rows = conn.execute(_SELECT_PENDING, (key,)).fetchall()
            else:
                rows = conn.execute(
                    f"{_SELECT_SIGNALS} WHERE run_key = ? ORDER BY number", (key,)
                ).fetchall()
        path = self._connections.path
        if pending:
            rows = _verified(rows, path=path)
        return [_rows.decode_signal(row, self._loads, ended=ended, location=path) for row in rows]


def _verified(rows: list[Any], *, path: str) -> list[Any]:
    """Pending signals' rows (:data:`_SELECT_PENDING`) without their digests, once checked.

    A digest left NULL (not computed) is not checked, as ``check`` does not check it.

    Raises:
        JournalError: a signal's row no longer matches its digest (naming it); nothing was
            written, nothing delivered.
    """
    for run_id, number, name, payload, signal_id, received_at, _, _, stored in rows:
        if stored is not None and stored != row_digest(
            (run_id, name, payload, signal_id, received_at)
        ):
            raise signal_refusal(run_id, number, path=path)
    return [row[:-1] for row in rows]
