"""A PostgreSQL journal's connection: making it, getting a lost one back, and forks.

:class:`PostgresConnection` is the connection manager that
:class:`~fsm_runner.journal.postgres.PostgresJournal` holds. It owns the URL (and keeps its
passwords out of every message), the connection and the lock that guards it, and runs every
operation of the journal (:meth:`PostgresConnection.call`): it reconnects with backoff after a
lost connection and asks a write whose outcome the loss left unknown whether it committed
after all (its ``resolve``). A forked child gets a lock of its own and makes a connection of
its own at its first call.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict

from fsm_runner import _fork
from fsm_runner.exceptions import JournalError, LeaseError, RunConflictError, RunExistsError
from fsm_runner.journal._postgres_url import is_postgres_url, passwords, redact, split_schema

__all__ = [
    "DEFAULT_RETRY_FOR",
    "DEFAULT_SCHEMA",
    "UNRESOLVED",
    "Connection",
    "PostgresConnection",
    "Unresolved",
    "reused_cursor",
]

T = TypeVar("T")
Connection = psycopg.Connection[tuple[Any, ...]]

#: The PostgreSQL schema (namespace) a journal lives in when the URL names none.
DEFAULT_SCHEMA = "public"
#: Seconds a write waits for a lost connection to come back before giving up.
DEFAULT_RETRY_FOR = 15.0
_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 1.0


class Unresolved:
    """What a resolver returns when the interrupted write left nothing: do it again."""


UNRESOLVED = Unresolved()
#: Refusals that a write done again may meet because its first try did commit after all.
_REFUSALS = (RunConflictError, LeaseError, RunExistsError)


#: Each connection's cursor for the hot path's statements (see :func:`reused_cursor`).
_CURSORS: weakref.WeakKeyDictionary[Connection, psycopg.Cursor[tuple[Any, ...]]] = (
    weakref.WeakKeyDictionary()
)


def reused_cursor(conn: Connection) -> psycopg.Cursor[tuple[Any, ...]]:
    """The connection's own cursor for one statement at a time, made once.

    ``conn.execute`` makes a cursor (and its adapters' map) for each statement: ~15 µs of the
    client's CPU a statement here (42 against 27 µs for a 12-value INSERT). Not for a pipeline,
    whose cursors each hold their statement's result until the pipeline's sync.
    """
    cursor = _CURSORS.get(conn)
    if cursor is None or cursor.closed:
        cursor = _CURSORS[conn] = conn.cursor()
    return cursor


#: The server ended the session: an administrator's or a crash's shutdown, or not started yet.
_SESSION_ENDED = frozenset({"57P01", "57P02", "57P03"})


def _lost(exc: psycopg.OperationalError) -> bool:
    """Whether ``exc`` says the connection is gone, not that a statement failed on it.

    No SQLSTATE: libpq's own failure (to send, to read); class 08: a connection exception;
    57P01-57P03: the server ended the session. Errors the server reports on a live session
    (a full disk, a statement timeout) have a SQLSTATE of another class and are not retried.
    """
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _SESSION_ENDED


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


class PostgresConnection:
    """The connection to one PostgreSQL journal, and everything that guards it.

    Args: ``url``, ``schema`` and ``retry_for`` as
    :class:`~fsm_runner.journal.postgres.PostgresJournal`'s. Nothing is connected yet
    (:meth:`connect` makes the first connection).

    Attributes:
        schema: the PostgreSQL schema the journal's tables live in.
        location: the URL with its schema, without the password.
        retry_for: seconds :meth:`call` tries to get a lost connection back.
        lock: held by every use of the connection (a new one in a forked child).
        conn: the connection, or ``None`` while there is none.
    """

    def __init__(self, url: str, *, schema: str | None, retry_for: float) -> None:
        self._secrets = passwords(url)  # kept out of every message
        conninfo, url_schema = split_schema(url)
        if schema is not None and url_schema is not None and schema != url_schema:
            raise ValueError(f"schema {schema!r} contradicts the URL's ?schema={url_schema}")
        self.schema: str = schema or url_schema or DEFAULT_SCHEMA
        self.retry_for = retry_for
        shown = redact(conninfo)
        if is_postgres_url(conninfo):
            joiner = "&" if "?" in shown else "?"
            self.location = f"{shown}{joiner}schema={urllib.parse.quote(self.schema)}"
        else:
            self.location = f"{shown} schema={self.schema}"
        try:
            params = conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise JournalError(
                f"is not a valid PostgreSQL URL ({self.describe(exc)})", path=self.location
            ) from None
        self._conninfo = conninfo
        self._connect_options: dict[str, Any] = {}
        if "application_name" not in params:
            self._connect_options["application_name"] = "fsm_runner"
        if "connect_timeout" not in params:
            self._connect_options["connect_timeout"] = 10
        self.lock, self.closed = threading.RLock(), False
        self.conn: Connection | None = None
        _fork.register(self)  # a forked child gets a connection of its own

    def connect(self, *, timeout: float | None = None) -> Connection:
        """A new connection (the journal's from now on), in autocommit mode, in the schema."""
        conn = self.open(timeout=timeout)
        self.conn = conn
        return conn

    def open(self, *, timeout: float | None = None) -> Connection:
        """A new connection to the journal's server, in autocommit mode, in the schema.

        Not the journal's (:meth:`connect`): the listener's is one of these.
        """
        options = dict(self._connect_options)
        if timeout is not None and "connect_timeout" in options:
            options["connect_timeout"] = max(2, min(10, round(timeout)))
        conn = psycopg.connect(self._conninfo, autocommit=True, **options)
        try:
            conn.execute(
                sql.SQL(
                    "SET search_path TO {}; SET TIME ZONE 'UTC'; SET synchronous_commit TO on"
                ).format(sql.Identifier(self.schema))
            )
        except BaseException:
            conn.close()
            raise
        return conn

    def disconnect(self) -> None:
        """Close the connection, if there is one (the next call makes a new one)."""
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None

    def close(self) -> None:
        """Close the connection; further use raises ``JournalError``."""
        with self.lock:
            if not self.closed:
                self.closed = True
                self.disconnect()

    def describe(self, exc: BaseException) -> str:
        """``exc``'s first line, without the URL's passwords."""
        text = _first_line(exc)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _after_fork(self) -> None:
        """In a forked child: a lock of its own, and a connection made at its first call.

        The parent's connection shares its socket with the parent: it is kept, never used nor
        closed here (closing it would end the parent's session). See :mod:`fsm_runner._fork`.
        """
        self.lock = threading.RLock()
        if self.conn is not None:
            _fork.keep(self.conn)
            self.conn = None

    def _live(self, deadline: float | None) -> Connection:
        if self.closed:
            raise JournalError("is closed", path=self.location)
        conn = self.conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
            self.conn = None
        remaining = None if deadline is None else deadline - time.monotonic()
        return self.connect(timeout=remaining)

    # -- calling the database ------------------------------------------------------------------

    def call(
        self,
        work: Callable[[Connection], T],
        *,
        resolve: Callable[[Connection], T | Unresolved] | None = None,
    ) -> T:
        """Run ``work`` on the connection, getting a lost connection back and trying again.

        ``resolve`` tells, after a try whose outcome is unknown (the connection died while it
        ran), whether that try committed after all — then its answer is returned instead of
        doing the work again.
        """
        deadline: float | None = None
        unknown = False
        backoff = _FIRST_BACKOFF
        while True:
            with self.lock:
                started = False
                try:
                    conn = self._live(deadline)
                    if unknown and resolve is not None:
                        found = resolve(conn)
                        if not isinstance(found, Unresolved):
                            return found
                    started = True
                    try:
                        return work(conn)
                    except _REFUSALS:
                        if not (unknown and resolve is not None):
                            raise
                        found = resolve(conn)  # a slow first try may have committed meanwhile
                        if not isinstance(found, Unresolved):
                            return found
                        raise
                except psycopg.OperationalError as exc:
                    if not self._transient(exc):
                        raise JournalError(self.describe(exc), path=self.location) from None
                    unknown = unknown or started
                    last = self.describe(exc)
                except psycopg.Error as exc:
                    raise JournalError(self.describe(exc), path=self.location) from None
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.retry_for
            if now >= deadline:
                outcome = "; whether the last write was committed is unknown" if unknown else ""
                raise JournalError(
                    f"lost its connection to PostgreSQL and could not get it back within "
                    f"{self.retry_for:g} s ({last}){outcome}",
                    path=self.location,
                )
            jitter = 0.5 + random.random()  # noqa: S311 - spreads reconnects, not a secret
            time.sleep(min(backoff * jitter, max(0.0, deadline - now)))
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def _transient(self, exc: psycopg.OperationalError) -> bool:
        """A lost connection (or a failed reconnect), a deadlock or a serialization failure."""
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            return True
        if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF or _lost(exc):
            # Cut off inside a pipeline (``executemany``): psycopg could not leave pipeline mode
            # and did not mark the connection broken, yet no statement can run on it again. Or
            # the session ended (or libpq failed to send or read) before psycopg marked it
            # broken: "sending query failed: terminating connection due to administrator
            # command", its transaction's rollback then "another command is already in
            # progress" (a random kill during a group commit's savepoints, in a suite run).
            self.disconnect()
            return True
        return isinstance(exc, pg_errors.TransactionRollback)

    def select(
        self, query: str, params: Sequence[Any], *, damaged: bool = False
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run a read; return its column names and rows (``damaged``: SQLite's only)."""

        def work(conn: Connection) -> tuple[list[str], list[tuple[Any, ...]]]:
            cursor = conn.execute(query, params)
            return [column.name for column in cursor.description or ()], cursor.fetchall()

        return self.call(work)

    def writing(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` as one short write (:meth:`call`)."""
        return self.call(work)
