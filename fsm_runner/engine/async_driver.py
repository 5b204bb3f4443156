"""The async driver: ``astep`` and ``arun``, many runs on one event loop, and their group commit.

:class:`AsyncDriver` holds the step core (:mod:`.core`) and the lease keeper; the sync driver
(:mod:`.sync_driver`) is its sibling over the same core, never combined with it. Its one fast
path — a state in the core's ``fast`` (no timeout, no validate()) whose handler returns a bare
event outside iterations — is written out in :meth:`AsyncDriver.arun`'s own loop, what the sync
driver's ``_step_fast`` does for sync runs: a helper coroutine per step cost its creation, a
level in every resumption and one more object for the garbage collector while the run waits
for its group commit (~9 % of the Python per step); even a loop in a coroutine that ``arun``
awaits adds a level to every resumption. Everything else takes :meth:`AsyncDriver._astep`
(prepare, call with the state's deadline, settle), and a fast-path phase that did not end in
a bare event is settled by :meth:`AsyncDriver._afinish_fast`.

With group commit, the transitions of all runs whose phases ended in the same turn of the
loop are written in one journal transaction (:class:`GroupCommitter`).
"""

from __future__ import annotations

import inspect
import operator
import time
import types
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fsm_runner import _fork
from fsm_runner._lazy import LazyModule
from fsm_runner.engine.core import PLAIN_RETURNS, Planned, StepCore, new_commit
from fsm_runner.engine.deadlines import with_deadline
from fsm_runner.engine.leases import LeaseKeeper, unleased
from fsm_runner.events import USER_ABORTED, WAITING
from fsm_runner.exceptions import RunConflictError
from fsm_runner.journal.base import Commit, Journal
from fsm_runner.phases import PhaseContext, PhaseWaits
from fsm_runner.records import RunRecord, TransitionRecord, utc_now
from fsm_runner.rules.decisions import PhaseOutcome, PhaseStep, retry_wait
from fsm_runner.rules.reducer import ACTIVE as _ACTIVE
from fsm_runner.rules.reducer import advance_plain
from fsm_runner.telemetry import Telemetry

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["AsyncDriver", "GroupCommitter"]


class AsyncDriver:
    """Steps runs on an event loop: :meth:`astep`, :meth:`arun`.

    Args:
        core: the step core it drives runs with.
        leases: the lease keeper it claims and lets go of runs with.
        async_sleep: how to wait between retries.
        group_commit: commit the transitions of the runs whose phases ended in the same turn
            of the event loop in one journal transaction (read at each ``arun``).
    """

    def __init__(
        self,
        core: StepCore,
        leases: LeaseKeeper,
        *,
        async_sleep: Callable[[float], Awaitable[None]],
        group_commit: bool = True,
    ) -> None:
        self.core = core
        self.leases = leases
        self.async_sleep = async_sleep
        self.group_commit = group_commit
        #: the running event loop's group committer (made on first use in a loop)
        self.committer: GroupCommitter | None = None
        _fork.register(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's event loop and its committer stay the parent's."""
        self.committer = None

    def close(self) -> None:
        """Forget the group committer (and the event loop it was made for)."""
        self.committer = None

    async def astep(self, run_id: str) -> TransitionRecord | None:
        """Async ``Engine.step``: async handlers are awaited (and cancelled at their deadline)."""
        run = self.leases.claim(run_id)
        try:
            telemetry = self.core.telemetry
            if telemetry is None:
                return await self._astep_held(run)
            with telemetry.drive(self.core.journal, run, "astep", self.leases.worker_id):
                return await self._astep_held(run)
        finally:
            self.leases.let_go(run_id)

    async def _astep_held(self, run: RunRecord) -> TransitionRecord | None:
        try:
            return (await self._astep(run))[0]
        except RunConflictError:
            run = self.core.journal.load(run.run_id)
            if run.ended or run.abort_reason is None:
                raise
            return (await self._awrite(self.core.plan_abort(run, run.abort_reason)))[0]

    async def arun(self, run_id: str, *, max_steps: int | None = None) -> RunRecord:
        """Async ``Engine.run``, its hot path inlined; the rest: :meth:`_astep` (see the module)."""
        run = await self.leases.aclaim(run_id, grouped=self.group_commit)
        telemetry = self.core.telemetry
        if telemetry is None:
            return await self._arun_held(run, max_steps)
        with telemetry.drive(self.core.journal, run, "arun", self.leases.worker_id) as span:
            run = await self._arun_held(run, max_steps)
            telemetry.drove(span, run)
            return run

    async def _arun_held(  # noqa: PLR0912, PLR0915 - the hot path is inlined (see the module)
        self, run: RunRecord, max_steps: int | None
    ) -> RunRecord:
        """:meth:`arun`'s loop over the run it claimed; lets go of it at the end."""
        core = self.core
        run_id = run.run_id
        try:
            steps = 0
            held, clock, services = core.held, core.clock, core.services
            fast, edges, outcomes = core.fast, core.plain_edges, core.plain_outcomes
            active, aborts, states, names = held.active, held.aborts, core.states, core.logger_names
            group = self._group_committer()  # None: each step commits on its own
            transition: TransitionRecord | None
            while (max_steps is None or steps < max_steps) and run.status is _ACTIVE:  # not ended
                try:
                    handler = fast.get(run.state)
                    if run.error is not None or run.abort_reason is not None or run_id in aborts:
                        handler = None  # the general path (a phase parked it, perhaps: _astep)
                    if handler is None:
                        transition, after = await self._astep(run)
                    else:
                        ctx = PhaseContext(
                            run, services, clock, None, None, names[run.state], core.journal,
                            states[run.state],
                        )  # fmt: skip
                        active[run_id] = ctx
                        started = clock()
                        try:
                            value = handler(ctx)
                            if type(value) is types.CoroutineType or (
                                not isinstance(value, PLAIN_RETURNS) and inspect.isawaitable(value)
                            ):
                                value = await value
                        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
                            core.close_phase(run_id)
                            transition, after = await self._afinish_fast(
                                run, ctx, started, None, exc
                            )
                        except BaseException as exc:
                            core.close_phase(run_id)
                            self._interrupted(run, exc)
                            raise
                        else:
                            closing = active.pop(run_id, None)  # close_phase, inlined
                            if closing is not None:
                                closing.close()
                            status = None  # a plain step's (see plan_plain)
                            if type(value) is str and not run.iteration and run.return_to is None:
                                dest = edges.get((run.state, value), "")
                                status = outcomes.get(dest)
                            if status is None:  # the general path: decide, _awrite
                                transition, after = await self._afinish_fast(
                                    run, ctx, started, value, None
                                )
                            else:  # plan_plain and _awrite's plain step, inlined
                                del ctx, closing  # not kept alive (GC-tracked) while it waits
                                transition, after = advance_plain(
                                    run, value, dest, status, (clock() - started) * 1e3, utc_now()
                                )
                                if group is None:
                                    core.journal.commit(after, transition)
                                else:
                                    await group.submit(new_commit(after, transition, (), (), None))
                                if status is not _ACTIVE or value == USER_ABORTED:  # committed
                                    with held.lock:
                                        aborts.pop(run_id, None)
                                if core.listeners:
                                    core.notify(transition, after)
                except RunConflictError as refused:
                    run = core.after_refusal(run_id, refused)
                    if run.ended:
                        return run  # another writer ended it: its row as the journal has it
                    continue  # refused for an abort requested meanwhile: carried out next
                run = after
                if transition is None:
                    break
                steps += 1
        finally:
            self.leases.let_go(run_id, ended=run.ended)  # ended: its last commit let go
        return unleased(run)

    def _interrupted(self, run: RunRecord, exc: BaseException) -> None:
        """A fast-path phase was stopped: journal ``INTERRUPTED`` if Ctrl-C or a cancel did it.

        ``SystemExit`` and the like are not journaled; the caller re-raises either way.
        """
        if isinstance(exc, (KeyboardInterrupt, asyncio.CancelledError)):
            self.core.journal_interruption(run, exc)

    async def _astep(self, run: RunRecord) -> tuple[TransitionRecord | None, RunRecord]:
        core = self.core
        pending_abort = core.held.aborts.get(run.run_id) or run.abort_reason
        if pending_abort is not None:
            return await self._awrite(core.plan_abort(run, pending_abort))
        if run.error is not None and run.error.get("type") == WAITING:  # its phase parked it
            transition, after = core.wait_move(run)
            if transition is None:
                return None, run  # it waits on
            run = after  # WOKEN: the phase runs again
        step = core.prepare(run)
        if step is None:  # it waits: a signal it accepts, or its deadline, moves it
            return core.wait_move(run)
        if core.telemetry is not None:
            phase = core.telemetry.phase(run, run.attempt, core.spec.parents(run.state))
            try:
                transition, after, error = await self._acall_and_settle(step)
            except BaseException as exc:
                phase.end(None, None, raised=exc)
                raise
            phase.end(transition, error)
            return transition, after
        return (await self._acall_and_settle(step))[:2]

    async def _acall_and_settle(
        self, step: PhaseStep
    ) -> tuple[TransitionRecord, RunRecord, BaseException | None]:
        """Call a prepared phase and settle its outcome; what it raised (if it did) too."""
        core = self.core
        try:
            outcome = await self._call_async(step)
        except (KeyboardInterrupt, asyncio.CancelledError) as exc:
            core.journal_interruption(step.run, exc)
            raise
        finally:
            core.close_phase(step.run.run_id)
        error = outcome.error if type(outcome.error) is not PhaseWaits else None  # it parks
        return (*await self._asettle(step, outcome), error)

    async def _afinish_fast(
        self,
        run: RunRecord,
        ctx: PhaseContext,
        started: float,
        value: Any,
        error: Exception | None,
    ) -> tuple[TransitionRecord, RunRecord]:
        """Settle a phase of :meth:`arun`'s hot path that did not end in a bare event.

        ``value`` is what its handler returned, or ``error`` what it raised.
        """
        core = self.core
        step = PhaseStep(run, core.states[run.state], ctx, started)
        try:
            outcome = core.outcome(step, value, error)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            outcome = core.outcome(step, None, exc)
        return await self._asettle(step, outcome)

    async def _asettle(
        self, step: PhaseStep, outcome: PhaseOutcome
    ) -> tuple[TransitionRecord, RunRecord]:
        """Journal a phase's outcome, or a retry of it (then wait before the next attempt)."""
        if type(outcome.error) is PhaseWaits:  # ctx.wait_for / sleep_until: parked here
            return self.core.park_phase(step, outcome.error)
        wait = retry_wait(step, outcome)
        if wait is None:
            return await self._awrite(self.core.decide(step, outcome))
        committed = await self._awrite(self.core.plan_retry(step, outcome))
        await self.async_sleep(wait)
        return committed

    async def _call_async(self, step: PhaseStep) -> PhaseOutcome:
        core = self.core
        run_fn, validate_fn = core.by_state[step.state.name]
        try:
            value = None
            if validate_fn is not None:
                value = validate_fn(step.ctx)
                if inspect.isawaitable(value):
                    value = await with_deadline(value, step)
            if value is None:
                value = run_fn(step.ctx)
                if inspect.isawaitable(value):
                    value = await with_deadline(value, step)
            return core.outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - every handler failure is journaled, not raised
            return core.outcome(step, None, exc)

    async def _awrite(self, planned: Planned) -> tuple[TransitionRecord, RunRecord]:
        """Commit a planned transition with other runs' in one transaction (group commit).

        Returns once the transaction is durable, so the run's next phase cannot start before.
        """
        committer = self._group_committer()
        if committer is None:
            return self.core.write(planned)
        transition, after, iterations, artifacts = planned
        await committer.submit(new_commit(after, transition, iterations, artifacts, None))
        return self.core.committed(transition, after)

    def _group_committer(self) -> GroupCommitter | None:
        """The running event loop's group committer, or ``None`` without group commit."""
        if not self.group_commit:
            return None
        loop = asyncio.get_running_loop()
        committer = self.committer
        if (
            committer is None
            or committer.loop is not loop
            or committer.journal is not self.core.journal
        ):
            telemetry = self.core.telemetry
            committer = self.committer = (
                GroupCommitter(self.core.journal, loop)
                if telemetry is None
                else GroupCommitter(self.core.journal, loop, telemetry=telemetry)
            )
        return committer


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
        self,
        journal: Journal,
        loop: asyncio.AbstractEventLoop,
        *,
        max_batch: int = 4096,
        telemetry: Telemetry | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch!r}")
        self.journal = journal
        self.telemetry = telemetry
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
        telemetry = self.telemetry
        began = time.perf_counter() if telemetry is not None else 0.0
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
        if telemetry is not None:
            took = time.perf_counter() - began
            telemetry.commit_took(commits[0].run.machine, took, grouped=True, size=len(commits))
        for future, error in zip(futures, results, strict=True):
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


#: ``future.cancelled()``, with no Python frame a call (and no asyncio import at import time).
_cancelled = operator.methodcaller("cancelled")
