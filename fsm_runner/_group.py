"""Group commit: the transitions of many async runs, written in one journal transaction.

With many runs on one event loop, a phase ends in each of them every few microseconds. Each
run submits its transition and waits; the first submission of a turn of the loop schedules a
flush at the end of that turn (``call_soon``), so every run whose phase ended meanwhile joins
the same transaction. :meth:`Journal.commit_many` checks and refuses each commit on its own,
and nothing is durable before it returns — a run's next phase starts only after its own
transition is durable, exactly as with one commit per step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fsm_runner._lazy import LazyModule
from fsm_runner.journal.base import Commit, Journal
from fsm_runner.records import RunRecord

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["GroupClaimer", "GroupCommitter"]


class GroupCommitter:
    """Collects the commits of one event loop's runs and writes each turn's in one transaction.

    The write happens on the loop itself, at the end of the turn in which the first commit was
    submitted. (A writer thread was measured: SQLite releases the GIL only while it steps a
    statement, and getting it back from a busy loop costs more than the overlap gains.)

    Each commit has its own future, though all of a batch's complete together: a task that is
    cancelled cancels the future it waits on, so a future shared by the batch would cancel
    every run in it. (A shared future that ignores ``cancel()`` must be a Future subclass,
    which asyncio's tasks wait on through a slow generic path: measured ~1 µs a commit slower
    than one plain future each.)

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
        # Two parallel lists rather than a list of pairs: no tuple per commit on the hot path.
        self._commits: list[Commit] = []
        self._futures: list[asyncio.Future[None]] = []
        self._new_future = loop.create_future
        self._scheduled = False
        self.transactions = 0  # how many transactions were written (for benchmarks and tests)
        self.commits = 0  # how many commits they held

    def submit(self, commit: Commit) -> asyncio.Future[None]:
        """Queue ``commit``; the future is done once it is durable (or holds why it was not).

        Cancelling the future before its turn ends leaves the commit out: nothing is written
        for it.
        """
        future = self._new_future()
        self._commits.append(commit)
        self._futures.append(future)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        commits, futures = self._commits, self._futures
        if len(commits) > self.max_batch:  # the rest go in the next transaction
            cap = self.max_batch
            self._commits, self._futures = commits[cap:], futures[cap:]
            commits, futures = commits[:cap], futures[:cap]
            self.loop.call_soon(self._flush)
        else:
            self._commits, self._futures = [], []
            self._scheduled = False
        if any(map(_cancelled, futures)):  # rare: filtered only then
            kept = [index for index, future in enumerate(futures) if not future.cancelled()]
            commits = [commits[index] for index in kept]
            futures = [futures[index] for index in kept]
            if not futures:
                return
        try:
            results = self.journal.commit_many(commits)
        except BaseException as exc:  # a journal that raised instead of returning the errors
            for future in futures:
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.transactions += 1
        self.commits += len(futures)
        for future, error in zip(futures, results, strict=True):
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


#: ``future.cancelled()``, with no Python frame a call (and no asyncio import at import time).
_cancelled = operator.methodcaller("cancelled")


class GroupClaimer:
    """Claims the leases of the runs one event loop starts in one turn, with one journal call.

    ``asyncio.gather`` of a thousand ``Engine.arun`` claims a thousand leases before any step;
    one transaction each was ~5 % of such a drive (bench_concurrent). Each run still gets its
    own answer: its claimed row, or why it was refused.

    Args:
        loop: the event loop whose runs submit.
        claim_many: claims a list of run ids at once, returning a row or an error for each.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        claim_many: Callable[[list[str]], Sequence[RunRecord | Exception]],
    ) -> None:
        self.loop = loop
        self._claim_many = claim_many
        self._run_ids: list[str] = []
        self._futures: list[asyncio.Future[RunRecord]] = []
        self.calls = 0  # how many journal calls were made (for tests)

    def submit(self, run_id: str) -> asyncio.Future[RunRecord]:
        """Queue a claim; the future holds the claimed row (or why the claim was refused).

        Cancelling the future before its turn ends leaves the run unclaimed.
        """
        future: asyncio.Future[RunRecord] = self.loop.create_future()
        if not self._run_ids:
            self.loop.call_soon(self._flush)
        self._run_ids.append(run_id)
        self._futures.append(future)
        return future

    def _flush(self) -> None:
        pending = [
            (run_id, future)
            for run_id, future in zip(self._run_ids, self._futures, strict=True)
            if not future.cancelled()
        ]
        self._run_ids, self._futures = [], []
        if not pending:
            return
        try:
            results = self._claim_many([run_id for run_id, _ in pending])
        except BaseException as exc:  # a journal that raised instead of returning the errors
            for _, future in pending:
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.calls += 1
        for (_, future), result in zip(pending, results, strict=True):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
