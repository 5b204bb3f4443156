"""Group commit: the transitions of many async runs, written in one journal transaction.

With many runs on one event loop, a phase ends in each of them every few microseconds. Each
run submits its transition and waits; the first submission of a turn of the loop schedules a
flush at the end of that turn (``call_soon``), so every run whose phase ended meanwhile joins
the same transaction. :meth:`Journal.commit_many` checks and refuses each commit on its own,
and nothing is durable before it returns — a run's next phase starts only after its own
transition is durable, exactly as with one commit per step.
"""

from __future__ import annotations

import asyncio

from fsm_runner.journal.base import Commit, Journal

__all__ = ["GroupCommitter"]


class GroupCommitter:
    """Collects the commits of one event loop's runs and writes each turn's in one transaction.

    The write happens on the loop itself, at the end of the turn in which the first commit was
    submitted. (A writer thread was measured: SQLite releases the GIL only while it steps a
    statement, and getting it back from a busy loop costs more than the overlap gains.)

    Args:
        journal: where the commits go (:meth:`Journal.commit_many`).
        loop: the event loop whose runs submit.
        max_batch: the most commits written in one transaction; more go in the next one.
    """

    def __init__(
        self, journal: Journal, loop: asyncio.AbstractEventLoop, *, max_batch: int = 4096
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch!r}")
        self.journal = journal
        self.loop = loop
        self.max_batch = max_batch
        self._pending: list[tuple[Commit, asyncio.Future[None]]] = []
        self._scheduled = False
        self.transactions = 0  # how many transactions were written (for benchmarks and tests)
        self.commits = 0  # how many commits they held

    def submit(self, commit: Commit) -> asyncio.Future[None]:
        """Queue ``commit``; the future is done once it is durable (or holds why it was not).

        Cancelling the future before its turn ends leaves the commit out: nothing is written
        for it.
        """
        future: asyncio.Future[None] = self.loop.create_future()
        self._pending.append((commit, future))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        pending = self._pending
        batch = [(c, f) for c, f in pending[: self.max_batch] if not f.cancelled()]
        self._pending = pending[self.max_batch :]
        self._scheduled = bool(self._pending)
        if self._scheduled:
            self.loop.call_soon(self._flush)
        if not batch:
            return
        try:
            results = self.journal.commit_many([commit for commit, _ in batch])
        except BaseException as exc:  # a journal that raised instead of returning the errors
            for _, future in batch:
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.transactions += 1
        self.commits += len(batch)
        for (_, future), error in zip(batch, results, strict=True):
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
