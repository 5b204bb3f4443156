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
import concurrent.futures
import functools
from collections.abc import Sequence

from fsm_runner.journal.base import Commit, Journal

__all__ = ["GroupCommitter"]


class GroupCommitter:
    """Collects the commits of one event loop's runs and writes them in few transactions.

    A batch of at least ``thread_from`` commits is written by a writer thread, so the loop
    runs the phases of other runs (whose commits are durable) while SQLite writes; its
    commits accumulate into the next batch, written as soon as this one is done. Smaller
    batches — one run alone, say — are written on the loop itself, which is quicker for them.

    Args:
        journal: where the commits go (:meth:`Journal.commit_many`).
        loop: the event loop whose runs submit.
        max_batch: the most commits written in one transaction; more wait for the next one.
        thread_from: the smallest batch handed to the writer thread.
    """

    def __init__(
        self,
        journal: Journal,
        loop: asyncio.AbstractEventLoop,
        *,
        max_batch: int = 512,
        thread_from: int = 16,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch!r}")
        self.journal = journal
        self.loop = loop
        self.max_batch = max_batch
        self.thread_from = thread_from
        self._pending: list[tuple[Commit, asyncio.Future[None]]] = []
        self._scheduled = False
        self._writing = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.transactions = 0  # how many transactions were written (for benchmarks and tests)
        self.commits = 0  # how many commits they held

    def close(self) -> None:
        """Stop the writer thread (after the batch it is writing, if any)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def submit(self, commit: Commit) -> asyncio.Future[None]:
        """Queue ``commit``; the future is done once it is durable (or holds why it was not).

        Cancelling the future before its batch is written leaves the commit out: nothing is
        written for it.
        """
        future: asyncio.Future[None] = self.loop.create_future()
        self._pending.append((commit, future))
        if not self._scheduled and not self._writing:
            self._scheduled = True
            self.loop.call_soon(self._flush)
        return future

    def _take(self) -> list[tuple[Commit, asyncio.Future[None]]]:
        pending = self._pending
        self._pending = pending[self.max_batch :]
        return [(c, f) for c, f in pending[: self.max_batch] if not f.cancelled()]

    def _flush(self) -> None:
        self._scheduled = False
        while not self._writing and self._pending:
            batch = self._take()
            if len(batch) >= self.thread_from:
                self._writing = True
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="fsm-runner-group-commit"
                    )
                commits = [commit for commit, _ in batch]
                written = self.loop.run_in_executor(
                    self._executor, self.journal.commit_many, commits
                )
                written.add_done_callback(functools.partial(self._written, batch))
            elif batch:
                try:
                    results = self.journal.commit_many([commit for commit, _ in batch])
                except BaseException as exc:  # a journal that raised instead of returning
                    self._fail(batch, exc)
                    if not isinstance(exc, Exception):
                        raise
                else:
                    self._resolve(batch, results)

    def _written(
        self,
        batch: Sequence[tuple[Commit, asyncio.Future[None]]],
        written: asyncio.Future[list[Exception | None]],
    ) -> None:
        self._writing = False
        error = written.exception() if not written.cancelled() else asyncio.CancelledError()
        if error is not None:
            self._fail(batch, error)
        else:
            self._resolve(batch, written.result())
        self._flush()  # what accumulated meanwhile goes at once: the next batch

    @staticmethod
    def _fail(batch: Sequence[tuple[Commit, asyncio.Future[None]]], exc: BaseException) -> None:
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)

    def _resolve(
        self,
        batch: Sequence[tuple[Commit, asyncio.Future[None]]],
        results: Sequence[Exception | None],
    ) -> None:
        self.transactions += 1
        self.commits += len(batch)
        for (_, future), error in zip(batch, results, strict=True):
            if future.done():  # cancelled while the transaction was written: it is written
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
