"""A SQLite journal's connection: opening the file, the lock, reads on a full disk, forks.

:class:`SqliteConnections` is the connection manager that
:class:`~fsm_runner.journal.sqlite.SqliteJournal` holds. It opens the file (with the checks of
:mod:`~fsm_runner.journal._sqlite_check`), owns the connection, its cursor and the lock that
guards them, runs each read and each short write (:meth:`SqliteConnections.read`,
:meth:`SqliteConnections.write`), starts the checkpoint thread at the first write, and gives a
forked child a lock and a connection of its own (:meth:`SqliteConnections._after_fork`, after
waiting in the parent for the transaction under way, :meth:`SqliteConnections._before_fork`).

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
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fsm_runner import _fork
from fsm_runner.exceptions import JournalError
from fsm_runner.journal import _sqlite_check
from fsm_runner.journal._checkpoint import Checkpointer
from fsm_runner.journal._sqlite_errors import describe, errors, no_room_for_shm
from fsm_runner.journal.base import Durability

__all__ = ["TUNING", "SqliteConnections"]

_log = logging.getLogger("fsm_runner")
T = TypeVar("T")

#: Pragmas of every connection beyond WAL, synchronous and the page cache (benchmarks give their
#: raw baselines the same). A checkpoint (with its fsyncs) once the WAL holds 10,000 pages
#: (~40 MB) instead of SQLite's 1,000: a group commit of a thousand runs writes ~1,000 pages, and
#: a checkpoint after every one cost ~15 % of its time (bench_concurrent). The WAL file is cut
#: back to 64 MiB after a checkpoint; a crashed process's WAL is replayed on the next open
#: (tens of milliseconds at that size).
TUNING = {"wal_autocheckpoint": 10_000, "journal_size_limit": 64 * 1024 * 1024}

#: 16 MiB of page cache (SQLite's default is 2 MiB): a group commit of a thousand runs dirties
#: up to a thousand index pages (one a run, once each run's keys fill a page), and spilling
#: them mid-transaction cost ~3 µs a row (bench_concurrent). Allocated only as pages are used.
_CACHE_KIB = 16 * 1024


class SqliteConnections:
    """The connection to one SQLite journal file, and everything that guards it.

    Args: as :class:`~fsm_runner.journal.sqlite.SqliteJournal`'s (``path`` made absolute
    there).

    Attributes:
        path: the file (or ``:memory:``).
        lock: held by every use of the connection (a new one in a forked child).
        conn: the connection; ``cursor``: its one reused cursor (a new one per statement
            costs ~0.5 µs).
        closed: whether :meth:`close` was called.
        unreadable, unwritable: why reads, and why writes, are refused (a schema object
            they depend on is damaged, see :func:`._sqlite_check.verify_code`), or ``None``.
    """

    def __init__(
        self,
        path: str,
        *,
        durability: Durability,
        busy_timeout: float,
        create: bool,
        checkpoint_thread: bool,
    ) -> None:
        self.path = path
        self.durability: Durability = durability
        self.lock = threading.RLock()
        self.closed = False
        self.unreadable: str | None = None
        self.unwritable: str | None = None
        #: The thread that checkpoints the WAL (started by the first write transaction).
        self.checkpointer: Checkpointer | None = None
        self._checkpoint_thread = checkpoint_thread and path != ":memory:"
        self._busy_timeout = busy_timeout
        self._create = create
        #: Opened to read on a disk with no room for the -shm file: reads go by _read_alone.
        self._shm_full = False
        _sqlite_check.check_path(path)
        if not create and path != ":memory:" and not os.path.exists(path):
            raise JournalError("does not exist; nothing was created", path=path)
        _sqlite_check.heal_side_files(path)
        with errors(path):
            self.conn = self._connect()
        try:
            with errors(path):
                # recursive_triggers stays off (SQLite's default; sqlite-utils would turn it on):
                # our one trigger never recurses, and on costs ~1 µs a step.
                self.cursor = self.conn.cursor()
                self._open_file()
                # Foreign keys are declared (Datasette shows the links) but not enforced: the
                # journal's own transactions keep them, and enforcing costs every commit.
        except BaseException:
            self.conn.close()
            raise
        _fork.register(self)  # a forked child gets a connection of its own

    @property
    def location(self) -> str:
        """The journal file's absolute path."""
        return self.path

    def close(self) -> None:
        """Close the connection (once); further use raises ``JournalError``."""
        with self.lock:
            if not self.closed:
                self.closed = True
                self.stop_checkpoints()
                self.conn.close()

    # -- reads and writes ----------------------------------------------------------------------

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One short ``BEGIN IMMEDIATE`` transaction; rolled back on any error."""
        with self.lock, errors(self.path):
            self.check_writable()
            conn = self.conn
            if self.checkpointer is None and self._checkpoint_thread:  # the first write
                self._start_checkpoints()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def check_writable(self) -> None:
        """Raise ``JournalError`` when the journal is closed or its writes are refused."""
        if self.closed:
            raise JournalError("is closed", path=self.path)
        if self.unwritable is not None:  # a damaged fence (or more): see verify_code
            raise JournalError(self.unwritable, path=self.path)

    @contextlib.contextmanager
    def read(self, *, damaged: bool = False) -> Iterator[sqlite3.Connection]:
        """The connection, for reads.

        ``damaged``: even when the ``runs`` view is not the expected one (for reads of tables
        alone, and of the schema itself). On a disk with no room for the ``-shm`` file, a
        connection of the read's own (see the module).
        """
        with self.lock, errors(self.path):
            if self.closed:
                raise JournalError("is closed", path=self.path)
            if self.unreadable is not None and not damaged:
                raise JournalError(self.unreadable, path=self.path)
            if self._shm_full:
                with self._read_alone() as alone:
                    yield alone
            else:
                yield self.conn

    def select(
        self, query: str, params: Sequence[Any], *, damaged: bool = False
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run a read; return its column names and rows (see :meth:`read`)."""
        with self.read(damaged=damaged) as conn:
            cursor = conn.execute(query, params)
            return [column[0] for column in cursor.description], cursor.fetchall()

    def data_version(self) -> int | None:
        """The connection's ``PRAGMA data_version``: it changes when another connection commits.

        ``None`` while reads go through connections of their own (a full disk, see the
        module): a fresh connection's value says nothing of what changed.
        """
        with self.read(damaged=True) as conn:
            if conn is not self.conn:
                return None
            version: int = conn.execute("PRAGMA data_version").fetchone()[0]
            return version

    def writing(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` with the connection inside one :meth:`write` transaction."""
        with self.write() as conn:
            return work(conn)

    def size(self) -> int | None:
        """The file's size with its WAL, in bytes (``None`` for ``:memory:``)."""
        if self.path == ":memory:":
            return None
        # SQLite follows a symlink and keeps the -wal beside the file it points to.
        real = os.path.realpath(self.path)
        return sum(
            Path(real + suffix).stat().st_size
            for suffix in ("", "-wal")
            if Path(real + suffix).exists()
        )

    # -- checkpoints ---------------------------------------------------------------------------

    def stop_checkpoints(self) -> None:
        """Stop the checkpoint thread, if one runs (the next write starts another)."""
        if self.checkpointer is not None:
            self.checkpointer.stop()
            self.checkpointer = None

    def _start_checkpoints(self) -> None:
        """Checkpoint the WAL on a thread of its own from now on (see :mod:`._checkpoint`).

        Called by the first write transaction (of a journal with ``checkpoint_thread``; never
        ``:memory:``, which has no WAL), so that a journal opened only to be read starts none.
        """
        # By the file's real path: SQLite keeps the WAL beside a symlink's target.
        real = os.path.realpath(self.path)
        self.checkpointer = Checkpointer(self, real, size_limit=TUNING["journal_size_limit"])

    # -- forks ---------------------------------------------------------------------------------

    def _before_fork(self) -> Callable[[], None] | None:
        """Before a fork: wait until no thread has a transaction open here (nor a checkpoint).

        Returns what lets the parent go on (see :mod:`fsm_runner._fork`).
        """
        if self.closed or self.path == ":memory:":
            return None
        if not self.lock.acquire(timeout=_fork.WAIT):
            _log.warning(
                "forking while a thread has been inside %s for %.0f s: the child's writes to it"
                " may be refused as locked",
                self.path,
                _fork.WAIT,
            )
            return None
        checkpointer = self.checkpointer
        resume = checkpointer.pause() if checkpointer is not None else None
        lock = self.lock

        def release() -> None:
            if resume is not None:
                resume()
            lock.release()

        return release

    def _after_fork(self) -> None:
        """In a forked child: a lock and a connection of its own (see :mod:`fsm_runner._fork`).

        The parent's connection is kept, never used nor closed here (SQLite's locks are the
        parent process's); the checkpoint thread did not come along (the next write starts
        one). A ``:memory:`` journal keeps its connection: the child's copy is its own.
        """
        self.lock = threading.RLock()
        self.checkpointer = None
        if self.closed or self.path == ":memory:":
            return
        _fork.keep(self.conn)
        try:
            conn = self._connect()
            self._tune_reading(conn)
        except sqlite3.Error as exc:
            self.unreadable = self.unwritable = (
                f"could not be opened again in a forked process ({describe(exc)})"
            )
            conn = sqlite3.connect(":memory:", check_same_thread=False)  # refused before use
        self.conn, self.cursor = conn, conn.cursor()

    # -- opening -------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        """A new connection to the file, with the pragmas that do not read it."""
        conn = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            for pragma, value in TUNING.items():
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
            self._tune_reading(self.conn)
            self._check_schema(self.conn)
        except sqlite3.OperationalError as exc:
            if self._create or not no_room_for_shm(exc, self.path):
                raise
            self._shm_full = True
            with self._read_alone() as conn:
                self._check_schema(conn)

    def _check_schema(self, conn: sqlite3.Connection) -> None:
        _sqlite_check.open_schema(conn, self.path, create=self._create)
        self.unwritable, self.unreadable = _sqlite_check.verify_code(conn)

    @contextlib.contextmanager
    def _read_alone(self) -> Iterator[sqlite3.Connection]:
        """A connection for one read while the disk has no room for the ``-shm`` file."""
        own = self.cursor.connection
        try:
            own.execute("PRAGMA schema_version")  # a read of the file
        except sqlite3.OperationalError as exc:
            if not no_room_for_shm(exc, self.path):
                raise
        else:
            self._tune_reading(own)
            self._shm_full = False
            yield own
            return
        # A connection refused so keeps its lock on the file until it is closed: a new one
        # (unused, it holds none) takes its place.
        own.close()
        self.conn = self._connect()
        self.cursor = self.conn.cursor()
        alone = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            alone.execute("PRAGMA locking_mode = EXCLUSIVE")
            yield alone
        finally:
            alone.close()
