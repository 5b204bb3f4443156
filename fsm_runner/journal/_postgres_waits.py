"""The PostgreSQL journal's durable waits: releases and parks, wake times, the signal mailbox.

:class:`PostgresWaits` is the object :class:`~fsm_runner.journal.postgres.PostgresJournal`
holds for them, over the journal's
:class:`~fsm_runner.journal._postgres_connection.PostgresConnection`. Migration 8 (see
:mod:`fsm_runner.journal._postgres_schema`) stores them: ``runs.wake_at`` (when a claim offers
the run whatever its state; ``runs_due`` indexes it for the active runs nobody holds) and the
``signals`` table (each run's mailbox, numbered in arrival order).

Every write that a signal and a park race on takes the run row's lock first (``SELECT ... FOR
UPDATE``, a statement of its own): ``put_signal`` numbers, stores and makes the run due under
it; ``park`` releases and sets the wake time under it, in a later statement whose snapshot
(READ COMMITTED) sees any signal committed while it waited. So a signal that the waiting state
accepts is never left pending behind a run due later, or never. Times are the server's clock
(``clock_timestamp()``), as the leases'. The consumption of a signal is a commit
(:meth:`PostgresWriter.consume_signal
<fsm_runner.journal._postgres_writes.PostgresWriter.consume_signal>`).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from fsm_runner.exceptions import JournalError, RunNotFoundError, RunTerminalError
from fsm_runner.journal import _rows
from fsm_runner.journal._head import signal_refusal
from fsm_runner.journal._idle import Doorbell
from fsm_runner.journal._postgres_chain import signal_digest
from fsm_runner.journal._postgres_connection import (
    UNRESOLVED,
    Connection,
    PostgresConnection,
    Unresolved,
)
from fsm_runner.journal._postgres_listen import PostgresListener
from fsm_runner.journal._postgres_writes import utc
from fsm_runner.records import SignalRecord, SignalStatus
from fsm_runner.spec import RunLifecycle

__all__ = ["NEXT_WAKE", "PostgresWaits"]

#: A signal's columns, in the order :meth:`PostgresWaits._signal` reads them.
_SIGNAL_COLUMNS = (
    "number", "run_id", "name", "payload", "signal_id", "received_at", "consumed_seq",
    "consumed_at",
)  # fmt: skip
_SIGNAL_SELECT = ", ".join(_SIGNAL_COLUMNS)
#: The earliest wake time of a machine's active runs nobody holds: the first entry of its
#: range of ``runs_due``, or of a run whose lease expired (``runs_leased``'s range below now;
#: ``now()``, stable, can bound an index range where ``clock_timestamp()`` cannot).
NEXT_WAKE = (
    "SELECT least((SELECT min(wake_at) FROM runs WHERE machine = %s AND status = 'active'"
    " AND lease_owner IS NULL AND wake_at IS NOT NULL),"
    " (SELECT min(wake_at) FROM runs WHERE machine = %s AND status = 'active'"
    " AND lease_owner IS NOT NULL AND lease_expires_at < now()))"
)
_dumps = _rows.dumps


def _let_go(run_id: str, token: int) -> Callable[[Connection], bool | Unresolved]:
    """The resolver of a release or park whose outcome a lost connection left unknown.

    Done if the run is unleased with the token it had: let go of by the try that was cut off,
    and claimed by nobody since (a claim raises the token).
    """

    def resolve(conn: Connection) -> bool | Unresolved:
        row = conn.execute(
            "SELECT lease_owner, lease_token FROM runs WHERE run_id = %s", (run_id,)
        ).fetchone()
        if row is not None and row[0] is None and row[1] == token:
            return True
        return UNRESOLVED

    return resolve


class PostgresWaits:
    """The lease releases, parks, wake times and signals of one PostgreSQL journal.

    Args:
        connection: the journal's connection manager, which runs each operation.
    """

    def __init__(self, connection: PostgresConnection) -> None:
        self._connection = connection
        self._listener = PostgresListener(connection, Doorbell())

    def idle(self, *, timeout: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout`` seconds for a signal's ``NOTIFY`` (see ``Journal.idle``)."""
        return self._listener.idle(timeout=timeout, stop=stop)

    def close(self) -> None:
        """Close the listener's connection, if it has one."""
        self._listener.close()

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token``; ``False`` if it no longer held it.

        A ``NOTIFY`` at the commit wakes idle workers: the run may be runnable.
        """

        def work(conn: Connection) -> bool:
            return bool(
                conn.execute(
                    "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL,"
                    # a wake time still to come goes (a run let go of without a park does
                    # not wait); a past one stays: a signal came for it
                    " wake_at = CASE WHEN wake_at > clock_timestamp() THEN NULL ELSE wake_at END"
                    " WHERE run_id = %s AND lease_owner = %s AND lease_token = %s"
                    # a run let go of may be runnable: idle workers hear it (at the commit)
                    " RETURNING pg_notify(%s, machine)",
                    (run_id, owner, token, self._listener.channel),
                ).rowcount
            )

        return self._connection.call(work, resolve=_let_go(run_id, token))

    def park(
        self,
        run_id: str,
        owner: str,
        token: int,
        *,
        wake_at: dt.datetime | None,
        accepts: Collection[str],
    ) -> bool:
        """Give up the lease and set when the run is due, in one transaction (see ``Journal``).

        The run row is locked first, in a statement of its own: a ``put_signal`` holding it
        has committed by then, and (READ COMMITTED) the next statement's snapshot sees its
        signal, so an accepted signal is never left pending behind a run due later or never.
        The release and the wake time are then one ``UPDATE``: now (the server's clock) if a
        pending signal is named in ``accepts``, else ``wake_at``.
        """
        names = sorted(set(accepts))

        def work(conn: Connection) -> bool:
            with conn.transaction():
                held = conn.execute(
                    "SELECT machine FROM runs WHERE run_id = %s AND lease_owner = %s"
                    " AND lease_token = %s FOR UPDATE",
                    (run_id, owner, token),
                ).fetchone()
                if held is None:
                    return False
                due = conn.execute(
                    "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL,"
                    " wake_at = CASE WHEN EXISTS (SELECT 1 FROM signals WHERE run_id = %s"
                    " AND consumed_seq IS NULL AND name = ANY(%s::text[]))"
                    " THEN clock_timestamp() ELSE %s::timestamptz END"
                    " WHERE run_id = %s AND lease_owner = %s AND lease_token = %s"
                    " RETURNING wake_at <= clock_timestamp()",
                    (run_id, names, utc(wake_at), run_id, owner, token),
                ).fetchone()
                if due is not None and due[0]:  # an accepted signal waits: runnable now
                    conn.execute("SELECT pg_notify(%s, %s)", (self._listener.channel, held[0]))
                return True

        return self._connection.call(work, resolve=_let_go(run_id, token))

    def wake_time(self, run_id: str) -> dt.datetime | None:
        """Return the run's wake time, if it has one (see ``Journal``)."""

        def work(conn: Connection) -> dt.datetime | None:
            row = conn.execute("SELECT wake_at FROM runs WHERE run_id = %s", (run_id,)).fetchone()
            if row is None:
                raise RunNotFoundError(run_id)
            wake: dt.datetime | None = row[0]
            return wake

        return self._connection.call(work)

    def next_wake(self, *, machine: str) -> dt.datetime | None:
        """The earliest wake time of the machine's active runs nobody holds (see ``Journal``).

        The first entry of the machine's range of ``runs_due``, and (usually none) the wake
        times of runs whose lease expired, read off ``runs_leased``'s range below now.
        """

        def work(conn: Connection) -> dt.datetime | None:
            row = conn.execute(NEXT_WAKE, (machine, machine)).fetchone()
            wake: dt.datetime | None = None if row is None else row[0]
            return wake

        return self._connection.call(work)

    def put_signal(self, signal: SignalRecord) -> SignalRecord:
        """Journal a signal pending for its run, in one transaction (see ``Journal``).

        The run row is locked first (``FOR UPDATE``): a run's signals are numbered in the
        order they are journaled, a ``park`` or claim of the run waits for the signal (and
        sees it), and two signals with one ``signal_id`` are stored once. Then the signal is
        inserted, received now by the server's clock, and the run is due at that time; a
        ``NOTIFY`` on the journal's channel, sent at the commit, wakes idle workers (their
        :meth:`idle`).
        """
        payload = _dumps(signal.payload)
        tried: list[dt.datetime] = []  # the receipt time each try used: the resolver looks

        def work(conn: Connection) -> SignalRecord:
            with conn.transaction():
                found = conn.execute(
                    "SELECT state, status, clock_timestamp(), machine FROM runs"
                    " WHERE run_id = %s FOR UPDATE",
                    (signal.run_id,),
                ).fetchone()
                if found is None:
                    raise RunNotFoundError(signal.run_id)
                state, status, now, machine = found
                ended = status != RunLifecycle.ACTIVE.value
                if signal.signal_id is not None:
                    row = conn.execute(
                        f"SELECT {_SIGNAL_SELECT} FROM signals WHERE run_id = %s"
                        " AND signal_id = %s",
                        (signal.run_id, signal.signal_id),
                    ).fetchone()
                    if row is not None:
                        return self._signal(row, ended=ended)
                if ended:
                    raise RunTerminalError(run_id=signal.run_id, state=state, status=status)
                tried.append(now)
                values = (signal.run_id, signal.name, payload, signal.signal_id, now)
                row = conn.execute(
                    "INSERT INTO signals (run_id, name, payload, signal_id, received_at, digest)"
                    f" VALUES (%s, %s, %s, %s, %s, %s) RETURNING {_SIGNAL_SELECT}",
                    (*values, signal_digest(values)),  # what its sender wrote (schema 10)
                ).fetchone()
                conn.execute(
                    "UPDATE runs SET wake_at = %s WHERE run_id = %s RETURNING pg_notify(%s, %s)",
                    (now, signal.run_id, self._listener.channel, machine),
                )
                return self._signal(row, ended=False)

        def resolve(conn: Connection) -> SignalRecord | Unresolved:
            row = conn.execute(
                f"SELECT {_SIGNAL_SELECT} FROM signals WHERE run_id = %s AND name = %s"
                " AND received_at = ANY(%s) ORDER BY number LIMIT 1",
                (signal.run_id, signal.name, tried),
            ).fetchone()
            return UNRESOLVED if row is None else self._signal(row, ended=False)

        return self._connection.call(work, resolve=resolve)

    def signals(self, run_id: str, *, pending: bool = False) -> list[SignalRecord]:
        """The run's signals in arrival order (pending ones only, with ``pending``).

        One read: the run's row (whether it ended) joined to its signals, on the
        ``(run_id, number)`` index. An unknown run has none.
        """
        only = " AND s.consumed_seq IS NULL" if pending else ""
        digest = ", s.digest" if pending else ""  # about to be delivered: each checked

        def work(conn: Connection) -> list[tuple[Any, ...]]:
            return conn.execute(
                f"SELECT r.status, {', '.join(f's.{c}' for c in _SIGNAL_COLUMNS)}{digest}"
                f" FROM runs AS r LEFT JOIN signals AS s ON s.run_id = r.run_id{only}"
                " WHERE r.run_id = %s ORDER BY s.number",
                (run_id,),
            ).fetchall()

        records = []
        for row in self._connection.call(work):
            ended = row[0] != RunLifecycle.ACTIVE.value
            if row[1] is None or (pending and ended):
                continue  # no signals (the LEFT JOIN's one row), or expired ones
            if pending:
                number, signal_run, name, payload, signal_id, received_at, *_, stored = row[1:]
                values = (signal_run, name, payload, signal_id, received_at)
                if stored is not None and stored != signal_digest(values):
                    raise signal_refusal(run_id, number, path=self._connection.location)
            records.append(self._signal(row[1:-1] if pending else row[1:], ended=ended))
        return records

    def _signal(self, row: Sequence[Any] | None, *, ended: bool) -> SignalRecord:
        """A signal's row as a record (``ended``: its run has ended)."""
        assert row is not None
        number, run_id, name, payload, signal_id, received_at, consumed_seq, consumed_at = row
        if consumed_seq is not None:
            status = SignalStatus.CONSUMED
        else:
            status = SignalStatus.EXPIRED if ended else SignalStatus.PENDING
        try:
            value = None if payload is None else json.loads(payload)
        except ValueError as exc:  # a row we cannot read must not be misread
            raise JournalError(
                f"signal {number} of run {run_id!r} has an unreadable payload ({exc})",
                path=self._connection.location,
            ) from exc
        return SignalRecord(
            run_id=run_id,
            number=int(number),
            name=name,
            payload=value,
            signal_id=signal_id,
            received_at=received_at,
            status=status,
            consumed_seq=None if consumed_seq is None else int(consumed_seq),
            consumed_at=consumed_at,
        )
