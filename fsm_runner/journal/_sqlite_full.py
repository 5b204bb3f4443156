"""A SQLite journal's connections: reads on a full disk, and a forked child's own connection.

A forked child gets a lock and a connection of its own (:meth:`RoomlessReads._after_fork`,
after waiting in the parent for the transaction under way, :meth:`RoomlessReads._before_fork`).

In WAL mode every connection shares the ``-shm`` file (the WAL's index), which SQLite makes
and grows as it is needed. On a full disk it cannot: a journal that no process has open has
no ``-shm`` yet, and SQLite refuses every read of it ("disk I/O error",
``SQLITE_IOERR_SHMSIZE``), so an operator could not even list the runs. A connection in
``EXCLUSIVE`` locking mode keeps that index in its own memory instead. A journal opened to
read (``create=False``: the CLI's read commands, ``resume``, the run inspector) gets such a
connection for each read, closed at once: writers of other processes wait while it reads, as
they wait for a write, and no lock outlives the read. Writes still go through the journal's own
connection and are refused with "the disk is full". The own connection is tried first at each
read: once there is room again, it reads, and the journal is as any other from then on.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fsm_runner import _fork
from fsm_runner.journal._checkpoint import Checkpointer
from fsm_runner.journal.base import Durability

__all__ = ["RoomlessReads", "no_room_for_shm"]

_log = logging.getLogger("fsm_runner")

#: 16 MiB of page cache (SQLite's default is 2 MiB): a group commit of a thousand runs dirties
#: up to a thousand index pages (one a run, once each run's keys fill a page), and spilling
#: them mid-transaction cost ~3 µs a row (bench_concurrent). Allocated only as pages are used.
_CACHE_KIB = 16 * 1024


def no_room_for_shm(exc: sqlite3.Error) -> bool:
    """Whether SQLite could not make or grow the ``-shm`` file (a full disk)."""
    return getattr(exc, "sqlite_errorname", None) == "SQLITE_IOERR_SHMSIZE"


class RoomlessReads:
    """How a SQLite journal connects, and reads with no room for the ``-shm`` (see the module)."""

    path: str
    durability: Durability
    _conn: sqlite3.Connection
    _cursor: sqlite3.Cursor
    _create: bool
    _busy_timeout: float
    _tuning: dict[str, Any]
    #: Opened to read on a disk with no room for the -shm file: reads go by _read_alone.
    _shm_full: bool
    _open_schema: Callable[[], None]
    _verify_code: Callable[[], None]
    _lock: threading.RLock
    _closed: bool
    _checkpointer: Checkpointer | None
    _unreadable: str | None
    _unwritable: str | None
    _describe: Callable[[sqlite3.Error], str]

    def _before_fork(self) -> Callable[[], None] | None:
        """Before a fork: wait until no thread has a transaction open here (nor a checkpoint).

        Returns what lets the parent go on (see :mod:`fsm_runner._fork`).
        """
        if self._closed or self.path == ":memory:":
            return None
        if not self._lock.acquire(timeout=_fork.WAIT):
            _log.warning(
                "forking while a thread has been inside %s for %.0f s: the child's writes to it"
                " may be refused as locked",
                self.path,
                _fork.WAIT,
            )
            return None
        checkpointer = self._checkpointer
        resume = checkpointer.pause() if checkpointer is not None else None

        def release() -> None:
            if resume is not None:
                resume()
            self._lock.release()

        return release

    def _after_fork(self) -> None:
        """In a forked child: a lock and a connection of its own (see :mod:`fsm_runner._fork`).

        The parent's connection is kept, never used nor closed here (SQLite's locks are the
        parent process's); the checkpoint thread did not come along (the next write starts
        one). A ``:memory:`` journal keeps its connection: the child's copy is its own.
        """
        self._lock = threading.RLock()
        self._checkpointer = None
        if self._closed or self.path == ":memory:":
            return
        _fork.keep(self._conn)
        try:
            conn = self._connect()
            self._tune_reading(conn)
        except sqlite3.Error as exc:
            self._unreadable = self._unwritable = (
                f"could not be opened again in a forked process ({self._describe(exc)})"
            )
            conn = sqlite3.connect(":memory:", check_same_thread=False)  # refused before use
        self._conn, self._cursor = conn, conn.cursor()

    def _connect(self) -> sqlite3.Connection:
        """A new connection to the file, with the pragmas that do not read it."""
        conn = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            for pragma, value in self._tuning.items():
                conn.execute(f"PRAGMA {pragma} = {value}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _tune_reading(self, conn: sqlite3.Connection) -> None:
        """The pragmas that read the file: the page cache, the durability asked for."""
        conn.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
        conn.execute("PRAGMA synchronous = " + ("FULL" if self.durability == "power" else "NORMAL"))

    def _open_file(self) -> None:
        """Read the schema (make it, a new journal's), tune the connection; or read alone."""
        try:
            self._tune_reading(self._conn)
            self._open_schema()
            self._verify_code()
        except sqlite3.OperationalError as exc:
            if self._create or not no_room_for_shm(exc):
                raise
            self._shm_full = True
            with self._read_alone() as conn:
                self._conn = conn  # while the schema is read
                try:
                    self._open_schema()
                    self._verify_code()
                finally:
                    self._conn = self._cursor.connection

    @contextlib.contextmanager
    def _read_alone(self) -> Iterator[sqlite3.Connection]:
        """A connection for one read while the disk has no room for the ``-shm`` file."""
        own = self._cursor.connection
        try:
            own.execute("PRAGMA schema_version")  # a read of the file
        except sqlite3.OperationalError as exc:
            if not no_room_for_shm(exc):
                raise
        else:
            self._tune_reading(own)
            self._shm_full = False
            yield own
            return
        # A connection refused so keeps its lock on the file until it is closed: a new one
        # (unused, it holds none) takes its place.
        own.close()
        self._conn = self._connect()
        self._cursor = self._conn.cursor()
        alone = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            alone.execute("PRAGMA locking_mode = EXCLUSIVE")
            yield alone
        finally:
            alone.close()
