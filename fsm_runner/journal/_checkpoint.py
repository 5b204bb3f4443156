"""Checkpoints of a SQLite journal's WAL, off the thread that commits.

In WAL mode every commit appends pages to the ``-wal`` file, and a checkpoint copies them back
into the database file (with an ``fsync`` of each). SQLite runs it inside the commit that
crosses ``wal_autocheckpoint``: a sync run's step then waits for 10,000 pages to be copied —
tens of milliseconds, every few thousand steps (~20 % of a sync short run's time,
bench_short_runs). A :class:`Checkpointer` does it on a thread of its own, with a connection of
its own, while the engine goes on. Every ``interval`` in which the WAL was written, a
``PASSIVE`` checkpoint copies what was appended (it never blocks a writer or a reader, and
SQLite makes it safe against a crash at any point: the WAL stays the truth until the database
file holds the pages). Once the WAL holds ``pages`` frames, a ``RESTART`` checkpoint copies the
tail appended meanwhile, holding writers off for that alone, so that the next commit starts the
WAL over. The committing connection keeps an autocheckpoint four times further out, as a
backstop should this thread fall behind.

An idle journal costs a look at its WAL's size a second; the thread holds no reference to the
journal, and stops when the journal is closed or collected.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import weakref

__all__ = ["Checkpointer"]

#: The longest pause between two looks at an unchanged WAL.
_IDLE_INTERVAL = 1.0
#: How long a checkpoint waits for the writer's transaction to end before it tries later.
_RESTART_WAIT_MS = 1000


class Checkpointer:
    """A thread that checkpoints ``path``'s WAL as it grows; starts it over at ``pages`` frames.

    Args:
        owner: the journal; when it is collected unclosed, the thread stops.
        path: the database file.
        pages: the WAL size (in frames: pages) at which it is started over.
        size_limit: the ``journal_size_limit`` the WAL is cut back to after a checkpoint.
        interval: seconds between two looks at a growing WAL.
    """

    def __init__(
        self,
        owner: object,
        path: str,
        *,
        pages: int,
        size_limit: int,
        interval: float = 0.02,
    ) -> None:
        self.path = path
        self._stop = threading.Event()
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=_watch,
            args=(path, pages, size_limit, interval, self._stop),
            name=f"fsm_runner checkpoints {os.path.basename(path)}",
            daemon=True,
        )
        self._thread.start()
        weakref.finalize(owner, self._stop.set)

    @property
    def alive(self) -> bool:
        """Whether the thread runs (in this process: a forked child has none)."""
        return self._pid == os.getpid() and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread and wait for it (a checkpoint under way is finished first)."""
        self._stop.set()
        if self.alive and self._thread is not threading.current_thread():
            self._thread.join()


def _watch(path: str, frames: int, size_limit: int, interval: float, stop: threading.Event) -> None:
    wal = path + "-wal"
    conn: sqlite3.Connection | None = None
    pause, seen = interval, None
    try:
        while not stop.wait(pause):
            try:
                stat = os.stat(wal)
                now = (stat.st_size, stat.st_mtime_ns)
            except OSError:  # no WAL (yet, or the last connection removed it)
                now = None
            if now == seen:  # nothing was written since the last look
                pause = min(pause * 2, _IDLE_INTERVAL)
                continue
            seen, pause = now, interval
            if now is None:
                continue
            try:
                if conn is None:
                    # read-write, never create: the journal made the file and its schema
                    uri = "file:" + _quote(path) + "?mode=rw"
                    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
                    conn.execute(f"PRAGMA journal_size_limit = {size_limit}")
                    conn.execute(f"PRAGMA busy_timeout = {_RESTART_WAIT_MS}")
                # What was appended since the last look, without blocking anyone (a WAL file's
                # size is its high-water mark, not what it holds: the answer tells that).
                _, in_wal, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if in_wal >= frames:
                    # Then the tail appended meanwhile, holding writers off for that alone, so
                    # that the next commit starts the WAL over: checkpoints that never catch up
                    # with a busy writer would let it grow without end (and with it every
                    # read's search of the WAL index, and a crash's recovery).
                    conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
            except sqlite3.Error:
                # Busy (another process checkpoints), a full or read-only disk: the pages stay
                # in the WAL, where every reader finds them, and the writer's backstop
                # autocheckpoint (or the next look) copies them later. Nothing is lost.
                pause = min(pause * 2, _IDLE_INTERVAL)
    finally:
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()


def _quote(path: str) -> str:
    """``path`` for a ``file:`` URI (``?`` and ``#`` would end the path, ``%`` escapes)."""
    return path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
