"""A PostgreSQL journal's idle workers, woken at once by a signal: ``LISTEN``/``NOTIFY``.

``put_signal`` sends ``NOTIFY`` on the journal's channel (:func:`channel`, one per schema; the
payload is the run's machine) in its own transaction, so the notification goes out when the
signal is committed, and only then; so does a ``release`` (a run let go of may be runnable:
the sender of a signal that consumed it at once lets go of it in its next state) and a ``park``
that finds an accepted signal waiting. :class:`PostgresListener` is what the journal's ``idle``
waits on: a connection of its own (the journal's is shared, under a lock, by every call),
made at the first wait, that listens (``LISTEN``) on the channel from then on. A notification that
comes while no thread waits is kept by the server for the session and read at the next wait,
so a signal committed between a worker's fruitless claim and its wait is not missed. The first
wait on a new connection ends at once: what came before it listened is unknown.

One thread of the process listens at a time (each waiting thread tries to, every tick); the
others wait on the journal's doorbell, which the listening thread rings for every notification.
A listener that loses its connection says so in the log and waits as a poll does (its time
out) until a new one is made, at most once a second. Nothing here raises: a worker's wait
never fails for want of a notification.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time

import psycopg
from psycopg import sql

from fsm_runner import _fork
from fsm_runner.journal._idle import Doorbell
from fsm_runner.journal._postgres_connection import Connection, PostgresConnection

__all__ = ["PostgresListener", "channel"]

_log = logging.getLogger("fsm_runner")

#: Seconds between two looks at the stop event while listening (a notification ends it at once).
_TICK = 0.05
#: Seconds between two tries to make a lost listening connection again.
_RECONNECT_EVERY = 1.0


def channel(schema: str) -> str:
    """The ``NOTIFY`` channel of the journal in ``schema`` (a name fits in 63 bytes)."""
    return "fsm_runner_" + hashlib.sha256(schema.encode()).hexdigest()[:32]


class PostgresListener:
    """Waits for the journal's notifications on a connection of its own.

    Args:
        connection: the journal's connection manager (its server, options and schema).
        bell: the journal's doorbell, rung for every notification heard.
    """

    def __init__(self, connection: PostgresConnection, bell: Doorbell) -> None:
        self._connection = connection
        self._bell = bell
        self.channel = channel(connection.schema)
        self._lock = threading.Lock()  # held by the thread that listens
        self._conn: Connection | None = None
        self._next_try = 0.0  # monotonic time before which no new connection is made
        self.closed = False
        _fork.register(self)

    def idle(self, *, timeout: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout`` seconds for a notification (``True``) or ``stop``."""
        return self._bell.wait(timeout=timeout, stop=stop, listen=self._listen, tick=_TICK)

    def _listen(self, seconds: float) -> bool:
        """Listen for a tick; or, while another thread listens (and rings), wait on the bell.

        Taken up again at every tick: when the thread that listened stops waiting, another
        reads what came meanwhile.
        """
        if not self._lock.acquire(blocking=False):
            return self._bell.pause(seconds)
        try:
            return self._hear(seconds)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the listening connection (now, or when the listening thread next looks)."""
        self.closed = True
        if self._lock.acquire(timeout=2 * _TICK):
            try:
                self._drop()
            finally:
                self._lock.release()

    def _hear(self, seconds: float) -> bool:
        """Block up to ``seconds`` for a notification; ``True`` when one (or a new session) came."""
        if self.closed:
            self._drop()
            return self._bell.pause(seconds)
        conn = self._conn
        try:
            if conn is None:
                if time.monotonic() < self._next_try:
                    return self._bell.pause(seconds)
                self._next_try = time.monotonic() + _RECONNECT_EVERY
                self._conn = conn = self._connection.open(timeout=seconds + 2)
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                return True  # what was sent before it listened is unknown
            heard = any(True for _ in conn.notifies(timeout=seconds, stop_after=1))
            if heard:  # and whatever else came meanwhile: one wake for them all
                for _ in conn.notifies(timeout=0):
                    pass
        except psycopg.Error as exc:
            if conn is None:
                _log.debug(
                    "the journal's listener could not connect: %s", self._connection.describe(exc)
                )
            else:
                _log.warning(
                    "the journal's listener lost its connection (%s); idle workers poll until"
                    " it is back",
                    self._connection.describe(exc),
                )
            self._drop()
            return False
        if heard:
            self._bell.ring()
        return heard

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def _after_fork(self) -> None:
        """In a forked child: the parent's connection is kept, never used (see ``_fork``)."""
        self._lock = threading.Lock()
        if self._conn is not None:
            _fork.keep(self._conn)
            self._conn = None
