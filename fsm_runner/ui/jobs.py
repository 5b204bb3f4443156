"""What keeps the inspector answering: journals for reads off the event loop, and the check job.

Every page reads the journal in a worker thread (:meth:`fsm_runner.ui.app.Inspector.read`),
never on the event loop, so a slow read delays only its own request. :class:`Readers` hands
each such thread a journal of its own — a few, opened on first use and kept — so reads do
not wait on one another's connection either. ``check`` replays every run, which on a big
journal takes minutes: :class:`CheckJob` runs it in a thread of its own, on a journal of its
own, one at a time, with its progress for the page to show and a cancel that takes effect at
the end of the range of runs being checked.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

from fsm_runner.exceptions import JournalError
from fsm_runner.journal import Journal
from fsm_runner.records import utc_now
from fsm_runner.replay import check_runs

__all__ = ["CheckJob", "Readers"]


class Readers:
    """Journals for the pages' reads: each used by one thread at a time, kept between requests.

    Args:
        open_journal: opens the journal once more (raises what the pages show when it cannot).
        given: an open journal to share instead (an app's, a memory journal): journals are
            safe to use from many threads; its giver closes it.
    """

    def __init__(self, open_journal: Callable[[], Journal], given: Journal | None) -> None:
        self._open = open_journal
        self._given = given
        self._idle: list[Journal] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def journal(self) -> Iterator[Journal]:
        """A journal for one request's reads; one that failed is closed, not used again."""
        if self._given is not None:
            yield self._given
            return
        with self._lock:
            journal = self._idle.pop() if self._idle else None
        if journal is None:
            journal = self._open()
        try:
            yield journal
        except JournalError:
            journal.close()  # reopened by a later request: the journal may be back by then
            raise
        except BaseException:
            self._keep(journal)
            raise
        self._keep(journal)

    def _keep(self, journal: Journal) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(journal)
                return
        journal.close()  # the server stopped while this request read

    def close(self) -> None:
        """Close the journals opened for reads (the server stops)."""
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for journal in idle:
            journal.close()


class _Cancelled(Exception):  # noqa: N818 - a signal between two of this module's functions
    """Raised in the check's progress callback to stop it."""


#: The processes a check job replays runs in (a SQL journal of more than one range of runs):
#: off the server's interpreter, whose pages would otherwise wait on the GIL the replay holds
#: (``/runs`` while 100,000 runs were checked on PostgreSQL: up to 239 ms in a thread;
#: ``tests/bench/bench_ui_nonblocking.py``).
CHECK_JOBS = 2
#: Added to those processes' niceness: the pages (and their database's work) come first
#: (the slowest ``/runs`` while checking on PostgreSQL: 252 ms at the same niceness, 171 ms).
CHECK_NICE = 10

#: Where a check job is.
CheckState = Literal["running", "done", "cancelled", "failed"]


class CheckJob:
    """One run of ``check`` (:func:`fsm_runner.replay.check_runs`) in a thread of its own.

    Args:
        open_journal: opens the journal the check reads (closed at its end), and says
            whether it is the check's own to close.
    """

    def __init__(self, open_journal: Callable[[], tuple[Journal, bool]]) -> None:
        self._open = open_journal
        self.state: CheckState = "running"
        self.done = 0  # runs checked so far
        self.total: int | None = None  # runs to check, once known
        self.problems: list[str] = []
        self.count = 0  # runs checked, once done
        self.error: str | None = None  # why it failed
        self.started_at: dt.datetime = utc_now()
        self.ended_at: dt.datetime | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._work, name="fsm-runner-check", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Stop the check at the end of the range of runs it is checking."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the check to end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _progress(self, checked: int, total: int) -> None:
        self.done += checked
        self.total = total
        if self._cancel.is_set():
            raise _Cancelled

    def _work(self) -> None:
        try:
            journal, own = self._open()
            try:
                if self._cancel.is_set():
                    raise _Cancelled
                report = check_runs(
                    journal, jobs=CHECK_JOBS, nice=CHECK_NICE, progress=self._progress
                )
            finally:
                if own:
                    journal.close()
        except _Cancelled:
            state: CheckState = "cancelled"
        except Exception as exc:  # noqa: BLE001 - whatever stopped it is shown on the page
            self.error = " ".join(str(exc).split()) or type(exc).__name__
            state = "failed"
        else:
            self.problems, self.count = list(report.problems), report.runs
            self.done = self.total = report.runs
            state = "done"
        self.ended_at = utc_now()
        self.state = state  # last: a page that reads the state finds the rest set
