"""Checkpoints of a SQLite journal's WAL, mostly off the thread that commits.

In WAL mode every commit appends pages to the ``-wal`` file, and a checkpoint copies them back
into the database file (with an ``fsync`` of each). SQLite runs it inside the commit that
crosses ``wal_autocheckpoint``: a sync run's step then waits while 10,000 pages are copied —
tens of milliseconds every few thousand steps, ~20 % of a sync short run's time
(bench_short_runs). A :class:`Checkpointer` copies them on a thread of its own, with a
connection of its own, while the engine goes on: every ``interval`` in which the WAL was
written, a ``PASSIVE`` checkpoint copies what was appended. It never blocks a writer or a
reader, and SQLite makes it safe against a crash at any point (the WAL stays the truth until
the database file holds the pages).

The committing connection keeps its ``wal_autocheckpoint``: a checkpoint that runs beside a
busy writer seldom catches up with it, and only one that does lets the next commit start the
WAL over. So the writer still ends each stretch of 10,000 pages, but copies only what was
appended since the thread's last look. (A ``RESTART`` checkpoint on the thread would start the
WAL over by itself, but it holds writers off while it waits for readers: a listing that reads
for a second stalled a worker's commit for as long.)

An idle journal costs a look at its WAL's size a second; the thread holds no reference to the
journal, and stops when the journal is closed or collected.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable

__all__ = ["Checkpointer"]

#: The longest pause between two looks at an unchanged WAL.
_IDLE_INTERVAL = 1.0


class Checkpointer:
    """A thread that copies what ``path``'s WAL gains back into the database file.

    Args:
        owner: the journal; when it is collected unclosed, the thread stops.
        path: the database file.
        size_limit: the ``journal_size_limit`` the WAL is cut back to (as the journal's).
        interval: seconds between two looks at a growing WAL.
    """

    def __init__(
        self, owner: object, path: str, *, size_limit: int, interval: float = 0.02
    ) -> None:
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held while a checkpoint runs
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=_watch,
            args=(path, size_limit, interval, self._stop, self._busy),
            name=f"fsm_runner checkpoints {os.path.basename(path)}",
            daemon=True,
        )
        self._thread.start()
        weakref.finalize(owner, self._stop.set)

    @property
    def alive(self) -> bool:
        """Whether the thread runs (in this process: a forked child has none)."""
        return self._pid == os.getpid() and self._thread.is_alive()

    def pause(self, timeout: float = 10.0) -> Callable[[], None] | None:
        """Wait for a checkpoint under way to end and start none until the returned call.

        ``None`` if one did not end within ``timeout`` seconds. For a fork: a checkpoint caught
        in the middle would leave its lock on the file held for good in the child.
        """
        if not self._busy.acquire(timeout=timeout):
            return None
        return self._busy.release

    def stop(self) -> None:
        """Stop the thread and wait for it (a checkpoint under way is finished first)."""
        self._stop.set()
        if self.alive and self._thread is not threading.current_thread():
            self._thread.join()


def _watch(
    path: str, size_limit: int, interval: float, stop: threading.Event, busy: threading.Lock
) -> None:
    wal = path + "-wal"
    conn: sqlite3.Connection | None = None
    pause, seen, behind = interval, None, False
    try:
        while not stop.wait(pause):
            try:
                stat = os.stat(wal)
                now = (stat.st_size, stat.st_mtime_ns)
            except OSError:  # no WAL (yet, or the last connection removed it)
                now = None
            if now is None or (now == seen and not behind):  # nothing new since the last look
                pause = min(pause * 2, _IDLE_INTERVAL)
                seen = now
                continue
            if now != seen:
                seen, pause = now, interval
            else:  # a reader held the last one back: try again, less often as it goes on
                pause = min(pause * 2, _IDLE_INTERVAL)
            try:
                with busy:
                    if conn is None:
                        # read-write, never create: the journal made the file and its schema
                        uri = "file:" + _quote(path) + "?mode=rw"
                        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
                        conn.execute(f"PRAGMA journal_size_limit = {size_limit}")
                    _, in_wal, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                behind = copied < in_wal  # a reader's snapshot held some back
            except sqlite3.Error:
                # Busy (another connection checkpoints), a full or read-only disk: the pages
                # stay in the WAL, where every reader finds them, and a later look or the
                # writer's own checkpoint copies them. Nothing is lost. A connection refused
                # its -shm file (no room for it) keeps its lock on the file until it is closed:
                # closed, and opened again at the next look.
                behind, pause = True, min(pause * 2, _IDLE_INTERVAL)
                if conn is not None:
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()
                    conn = None
    finally:
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()


def _quote(path: str) -> str:
    """``path`` for a ``file:`` URI (``?`` and ``#`` would end the path, ``%`` escapes)."""
    return path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
