"""Storing new runs; and the engine's async calls: starts, aborts, signals, reads off the loop.

:class:`Starts` holds what :meth:`Engine.start <fsm_runner.engine.Engine.start>` and
``start_many`` do (build each run, write it, then tell the lease keeper, the listeners and the
worker), and their async twins. An ASGI handler that starts a run must not hold its event loop
while the journal writes: a SQLite file another process is writing waits for its lock, and a
PostgreSQL commit is a round trip. So the async calls hand their journal work to one thread of
the engine's own (:class:`OffLoop`), never to a thread per call, and never wait on the loop:

* the ``astart`` calls made in one turn of the event loop are written together, in one
  transaction (``create_runs``): twenty concurrent requests cost one commit, as the async
  driver's group commit does for steps. Should the batch fail (a run id that exists), each of
  its runs is written alone, so each call gets its own answer;
* ``aabort``, ``asignal`` and ``aload`` run on the same thread, in the order they were called.

Each returns once its write is durable. A call cancelled before the end of its loop turn writes
nothing; one cancelled later may still have written (its batch was on its way): as with any
request whose answer was lost, repeat it with the same ``run_id`` and take ``RunExistsError``
as done.

The thread, and the journal calls on it, are safe beside the engine's other users: journals
are safe to use from many threads (each holds a lock around its connection), and the engine's
own state (held runs, leases) has its lock.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fsm_runner import _fork
from fsm_runner._lazy import LazyModule
from fsm_runner.engine.core import StepCore, random_ids
from fsm_runner.engine.leases import LeaseKeeper, as_loaded
from fsm_runner.engine.worker import Worker
from fsm_runner.records import IterationRecord, RunRecord, TransitionRecord

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures
    import datetime as dt
else:  # imported on first use: a sync engine never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["OffLoop", "Starts"]

T = TypeVar("T")
#: A run to store: its row, its transition seq 0, the iteration it opens.
NewRun = tuple[RunRecord, TransitionRecord, list[IterationRecord]]


class OffLoop:
    """One thread of the engine's own for its journal calls made from an event loop.

    Started on first use; :meth:`close` waits for what it was given. In a forked child the
    parent's thread does not exist: the child starts its own when it needs one.
    """

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _fork.register(self)

    def _after_fork(self) -> None:
        self._executor = None
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``work()`` on the thread; its future."""
        with self._lock:
            if self._executor is None:
                # Imported here: a sync engine never starts the thread (nor imports its module).
                import concurrent.futures  # noqa: PLC0415

                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="fsm-runner-journal"
                )
            return self._executor.submit(work)

    async def call(self, work: Callable[[], T]) -> T:
        """Await ``work()`` run on the thread (the loop goes on meanwhile)."""
        return await asyncio.wrap_future(self.submit(work))

    def close(self) -> None:
        """Wait for the calls given, then stop the thread."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


class _Batch:
    """The ``astart`` calls of one turn of one event loop, written in one transaction."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.runs: list[NewRun] = []
        self.futures: list[asyncio.Future[None]] = []


class Starts:
    """Stores new runs for an engine: sync (:meth:`start`, :meth:`start_many`) and async.

    Args:
        core: the step core (spec, journal, listeners) runs are built and stored with.
        leases: the lease keeper, told of each run started (and holding, with ``claim``).
        worker: the worker, which parks a run started waiting with a deadline.
    """

    def __init__(self, core: StepCore, leases: LeaseKeeper, worker: Worker) -> None:
        self.core = core
        self.leases = leases
        self.worker = worker
        self.off_loop = OffLoop()
        self._batches: dict[asyncio.AbstractEventLoop, _Batch] = {}
        self._batches_lock = threading.Lock()

    def close(self) -> None:
        """Wait for the journal calls handed off, then stop their thread."""
        self.off_loop.close()

    # -- building and telling --------------------------------------------------------------

    def lease(self, claim: bool) -> tuple[str, dt.timedelta] | None:
        """The lease a run is started holding: this engine's, or none."""
        if not claim:
            return None
        import datetime as dt  # noqa: PLC0415 - the one use, on a claimed start

        self.leases.announce()  # alive before a run holds its lease (PostgreSQL: a lock)
        return self.leases.worker_id, dt.timedelta(seconds=self.leases.lease_ttl)

    def new_runs(
        self,
        inputs: Iterable[Any],
        run_ids: Sequence[str | None],
        context: Mapping[str, Any] | None,
        parent_run_id: str | None,
        claim: bool,
    ) -> list[NewRun]:
        """The runs to store, built and checked (nothing written yet), each as loaded.

        As a load would read each back (:func:`~.leases.as_loaded`): the run the journal stores
        and remembers is the very run the engine then drives.
        """
        lease = self.lease(claim)
        built = [
            self.core.new_run(given, run_id, context, parent_run_id, lease)
            for given, run_id in zip(inputs, run_ids, strict=True)
        ]
        return [(as_loaded(run), first, opened) for run, first, opened in built]

    def stored(self, batch: Sequence[NewRun]) -> list[str]:
        """After the runs are durable: the lease keeper, the listeners and the worker told."""
        core = self.core
        self.leases.started([run for run, _, _ in batch])
        if core.listeners or core.telemetry is not None:
            for run, first, _ in batch:
                core.notify(first, run)
        run_ids = [run.run_id for run, _, _ in batch]
        self.worker.park_started(run_ids)
        return run_ids

    # -- sync ----------------------------------------------------------------------------------

    def start(
        self,
        input: Any,  # noqa: A002 - as in Engine.start()
        run_id: str | None,
        context: Mapping[str, Any] | None,
        parent_run_id: str | None,
        claim: bool,
    ) -> str:
        """:meth:`Engine.start <fsm_runner.engine.Engine.start>`."""
        batch = self.new_runs([input], [run_id], context, parent_run_id, claim)
        run, first, opened = batch[0]
        self.core.journal.create_run(run, first, spec_json=self.core.spec_json, iterations=opened)
        return self.stored(batch)[0]

    def start_many(
        self, inputs: Iterable[Any], parent_run_id: str | None, claim: bool
    ) -> list[str]:
        """:meth:`Engine.start_many <fsm_runner.engine.Engine.start_many>`."""
        inputs = list(inputs)
        batch = self.new_runs(inputs, random_ids(len(inputs)), None, parent_run_id, claim)
        self._write(batch)
        return self.stored(batch)

    def _write(self, batch: Sequence[NewRun]) -> None:
        """All of ``batch`` in one transaction where the journal can; else one each, in order."""
        journal, spec_json = self.core.journal, self.core.spec_json
        create_runs = getattr(journal, "create_runs", None)
        if create_runs is not None:
            create_runs(batch, spec_json=spec_json)
        else:
            for run, first, opened in batch:
                journal.create_run(run, first, spec_json=spec_json, iterations=opened)

    def _write_each(self, batch: Sequence[NewRun]) -> list[BaseException | None]:
        """One transaction for the batch; if it fails, one per run: each run's own outcome."""
        if len(batch) > 1:
            with contextlib.suppress(Exception):  # each run is tried alone below: its own answer
                self._write(batch)
                return [None] * len(batch)
        journal, spec_json = self.core.journal, self.core.spec_json
        outcomes: list[BaseException | None] = []
        for run, first, opened in batch:
            try:
                journal.create_run(run, first, spec_json=spec_json, iterations=opened)
            except Exception as exc:  # noqa: BLE001, PERF203 - handed to that run's caller
                outcomes.append(exc)
            else:
                outcomes.append(None)
        return outcomes

    # -- async ---------------------------------------------------------------------------------

    async def astart(
        self,
        input: Any,  # noqa: A002 - as in Engine.start()
        run_id: str | None,
        context: Mapping[str, Any] | None,
        parent_run_id: str | None,
        claim: bool,
    ) -> str:
        """Async :meth:`start`: written with the loop turn's other starts (see the module)."""
        new = self.new_runs([input], [run_id], context, parent_run_id, claim)[0]
        await self._queued(new)
        return self.stored([new])[0]

    async def astart_many(
        self, inputs: Iterable[Any], parent_run_id: str | None, claim: bool
    ) -> list[str]:
        """Async :meth:`start_many`: all in one transaction, or none, off the loop."""
        inputs = list(inputs)
        batch = self.new_runs(inputs, random_ids(len(inputs)), None, parent_run_id, claim)
        await self.off_loop.call(functools.partial(self._write, batch))
        return self.stored(batch)

    def _queued(self, new: NewRun) -> asyncio.Future[None]:
        """Queue ``new`` in the running loop's batch; done once it is durable."""
        loop = asyncio.get_running_loop()
        with self._batches_lock:
            batch = self._batches.get(loop)
            if batch is None:
                batch = self._batches[loop] = _Batch(loop)
                loop.call_soon(self._flush, loop)
            future: asyncio.Future[None] = loop.create_future()
            batch.runs.append(new)
            batch.futures.append(future)
        return future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """At the end of the loop turn: the batch to the thread (cancelled calls left out)."""
        with self._batches_lock:
            batch = self._batches.pop(loop)
        kept = [i for i, future in enumerate(batch.futures) if not future.cancelled()]
        if not kept:
            return
        runs = [batch.runs[i] for i in kept]
        futures = [batch.futures[i] for i in kept]
        written = asyncio.wrap_future(
            self.off_loop.submit(functools.partial(self._write_each, runs)), loop=loop
        )
        written.add_done_callback(functools.partial(_settle, futures))


def _settle(futures: Sequence[asyncio.Future[None]], written: asyncio.Future[Any]) -> None:
    """Each ``astart`` of a batch told its run's outcome."""
    if written.cancelled():
        outcomes: Sequence[BaseException | None] = [asyncio.CancelledError()] * len(futures)
    elif written.exception() is not None:
        outcomes = [written.exception()] * len(futures)
    else:
        outcomes = written.result()
    for future, outcome in zip(futures, outcomes, strict=True):
        if future.done():  # cancelled meanwhile: its run was written, or not, all the same
            continue
        if outcome is None:
            future.set_result(None)
        else:
            future.set_exception(outcome)
