"""Helpers for testing your own handlers and machines fast: no real waiting, no files left.

* :class:`FakeClock` — a monotonic clock that only moves when told to (or when the engine
  "sleeps" through it), so retries, backoff and timeouts are tested without real waiting.
* :class:`ScriptedHandler` — a handler that returns (or raises) a script of results in order and
  remembers every context it was called with.
* :func:`throwaway_journal` — a journal that is gone after the ``with`` block.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from fsm_runner.journal import Journal, MemoryJournal, SqliteJournal
from fsm_runner.phases import PhaseContext

__all__ = ["FakeClock", "ScriptedHandler", "throwaway_journal"]


class FakeClock:
    """A monotonic clock for tests: ``clock=c, sleep=c.sleep, async_sleep=c.async_sleep``.

    Args:
        start: the clock's initial reading, in seconds.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.slept: list[float] = []
        self._lock = threading.Lock()

    def __call__(self) -> float:
        """Read the clock."""
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        with self._lock:
            self.now += seconds

    def sleep(self, seconds: float) -> None:
        """Record the wait and move the clock forward by it, at once."""
        self.slept.append(seconds)
        self.advance(seconds)

    async def async_sleep(self, seconds: float) -> None:
        """Async :meth:`sleep`."""
        self.sleep(seconds)


class ScriptedHandler:
    """A phase handler that plays a script: each call returns the next item, or raises it.

    The last item repeats once the script is used up. Every context the handler was called with
    is kept in :attr:`calls`.

    Args:
        script: results to return in order (events, ``PhaseResult`` or ``PhaseStatus`` values), or
            exceptions to raise.
    """

    def __init__(self, *script: Any) -> None:
        if not script:
            raise ValueError("a scripted handler needs at least one item")
        self.script = list(script)
        self.calls: list[PhaseContext] = []

    def __call__(self, ctx: PhaseContext) -> Any:
        """Play the next item of the script."""
        index = min(len(self.calls), len(self.script) - 1)
        self.calls.append(ctx)
        item = self.script[index]
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def call_count(self) -> int:
        """How many times the handler was called."""
        return len(self.calls)


@contextlib.contextmanager
def throwaway_journal(kind: str = "memory", *, sqlite_dir: str | None = None) -> Iterator[Journal]:
    """Yield a fresh journal that is closed (and deleted) afterwards.

    Args:
        kind: ``memory`` for a :class:`MemoryJournal`, ``sqlite`` for a :class:`SqliteJournal`
            in a temporary file.
        sqlite_dir: where to put the temporary SQLite file (a new temporary directory otherwise).
    """
    if kind == "memory":
        with MemoryJournal() as journal:
            yield journal
        return
    if kind != "sqlite":
        raise ValueError(f"kind must be 'memory' or 'sqlite', not {kind!r}")
    with (
        tempfile.TemporaryDirectory(dir=sqlite_dir) as directory,
        SqliteJournal(os.path.join(directory, "journal.db")) as journal,
    ):
        yield journal
