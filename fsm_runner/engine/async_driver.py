"""The async driver: ``astep`` and ``arun``, many runs on one event loop.

Its one fast path — a state in ``_fast`` (no timeout, no validate()) whose handler returns a
bare event outside iterations — is written out in :meth:`AsyncDriver.arun`'s own loop, what
``_step_fast`` does for sync runs: a helper coroutine per step cost its creation, a level in
every resumption and one more object for the garbage collector while the run waits for its
group commit (~9 % of the Python per step); even a loop in a coroutine that ``arun`` awaits
adds a level to every resumption. Everything else takes :meth:`AsyncDriver._astep` (prepare,
call with the state's deadline, settle), and a fast-path phase that did not end in a bare
event is settled by :meth:`AsyncDriver._afinish_fast`.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fsm_runner._lazy import LazyModule
from fsm_runner.engine.commits import PLAIN_RETURNS, StepWriter, new_commit
from fsm_runner.engine.deadlines import with_deadline
from fsm_runner.engine.decisions import PhaseOutcome, PhaseStep, retry_wait
from fsm_runner.engine.leases import unleased
from fsm_runner.engine.reducer import ACTIVE as _ACTIVE
from fsm_runner.engine.reducer import advance_plain
from fsm_runner.events import USER_ABORTED
from fsm_runner.exceptions import RunConflictError
from fsm_runner.phases import PhaseContext
from fsm_runner.records import RunRecord, TransitionRecord, utc_now

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["AsyncDriver"]


class AsyncDriver(StepWriter):
    """Steps runs on an event loop: :meth:`astep`, :meth:`arun`."""

    async_sleep: Callable[[float], Awaitable[None]]

    async def astep(self, run_id: str) -> TransitionRecord | None:
        """Async :meth:`step`: async handlers are awaited (and cancelled at their deadline)."""
        run = self._leases.claim(run_id)
        try:
            try:
                return (await self._astep(run))[0]
            except RunConflictError:
                run = self.journal.load(run_id)
                if run.ended or run.abort_reason is None:
                    raise
                return (await self._awrite(self._plan_abort(run, run.abort_reason)))[0]
        finally:
            self._leases.let_go(run_id)

    async def arun(  # noqa: PLR0912, PLR0915 - the hot path is inlined (see the module)
        self, run_id: str, *, max_steps: int | None = None
    ) -> RunRecord:
        """Async :meth:`run`, with the one hot path written out in its loop (see the module).

        Other outcomes of a fast-path handler: :meth:`_afinish_fast`; other states: :meth:`_astep`.
        """
        run = await self._leases.aclaim(run_id)
        try:
            steps = 0
            fast_states, plain_edges, aborts = self._fast, self._plain_edges, self._aborts
            plain_outcomes, active = self._plain_outcomes, self._active
            clock = self.clock
            group = self._group_committer()  # None: each step commits on its own
            transition: TransitionRecord | None
            while (max_steps is None or steps < max_steps) and run.status is _ACTIVE:  # not ended
                try:
                    handler = fast_states.get(run.state)
                    if handler is None or run.abort_reason is not None or run_id in aborts:
                        transition, after = await self._astep(run)
                    else:
                        ctx = PhaseContext(
                            run, self.services, clock, None, None, self._logger_names[run.state],
                            self.journal, self._states[run.state],
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
                            self._close_phase(run_id)
                            transition, after = await self._afinish_fast(
                                run, ctx, started, None, exc
                            )
                        except BaseException as exc:
                            self._close_phase(run_id)
                            self._interrupted(run, exc)
                            raise
                        else:
                            closing = active.pop(run_id, None)  # _close_phase, inlined
                            if closing is not None:
                                closing.close()
                            status = None  # a plain step's (see _plan_plain)
                            if type(value) is str and not run.iteration and run.return_to is None:
                                dest = plain_edges.get((run.state, value), "")
                                status = plain_outcomes.get(dest)
                            if status is None:  # the general path: _decide, _awrite
                                transition, after = await self._afinish_fast(
                                    run, ctx, started, value, None
                                )
                            else:  # _plan_plain and _awrite's plain step, inlined
                                del ctx, closing  # not kept alive (GC-tracked) while it waits
                                transition, after = advance_plain(
                                    run, value, dest, status, (clock() - started) * 1e3, utc_now()
                                )
                                if group is None:
                                    self.journal.commit(after, transition)
                                else:
                                    await group.submit(new_commit(after, transition, (), (), None))
                                if status is not _ACTIVE or value == USER_ABORTED:  # _committed
                                    with self._lock:
                                        aborts.pop(run_id, None)
                                if self.listeners:
                                    self._notify(transition, after)
                except RunConflictError as refused:
                    run = self._after_refusal(run_id, refused)
                    if run.ended:
                        return run  # another writer ended it: its row as the journal has it
                    continue  # refused for an abort requested meanwhile: carried out next
                if transition is None:
                    break
                run = after
                steps += 1
        finally:
            self._leases.let_go(run_id, ended=run.ended)  # ended: its last commit let go
        return unleased(run)

    def _interrupted(self, run: RunRecord, exc: BaseException) -> None:
        """A fast-path phase was stopped: journal ``INTERRUPTED`` if Ctrl-C or a cancel did it.

        ``SystemExit`` and the like are not journaled; the caller re-raises either way.
        """
        if isinstance(exc, (KeyboardInterrupt, asyncio.CancelledError)):
            self._journal_interruption(run, exc)

    async def _astep(self, run: RunRecord) -> tuple[TransitionRecord | None, RunRecord]:
        pending_abort = self._aborts.get(run.run_id) or run.abort_reason
        if pending_abort is not None:
            return await self._awrite(self._plan_abort(run, pending_abort))
        step = self._prepare(run)
        if step is None:
            return None, run
        try:
            outcome = await self._call_async(step)
        except (KeyboardInterrupt, asyncio.CancelledError) as exc:
            self._journal_interruption(run, exc)
            raise
        finally:
            self._close_phase(run.run_id)
        return await self._asettle(step, outcome)

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
        step = PhaseStep(run, self._states[run.state], ctx, started)
        try:
            outcome = self._outcome(step, value, error)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            outcome = self._outcome(step, None, exc)
        return await self._asettle(step, outcome)

    async def _asettle(
        self, step: PhaseStep, outcome: PhaseOutcome
    ) -> tuple[TransitionRecord, RunRecord]:
        """Async :meth:`_settle`."""
        wait = retry_wait(step, outcome)
        if wait is None:
            return await self._awrite(self._decide(step, outcome))
        committed = await self._awrite(self._plan_retry(step, outcome))
        await self.async_sleep(wait)
        return committed

    async def _call_async(self, step: PhaseStep) -> PhaseOutcome:
        run_fn, validate_fn = self._by_state[step.state.name]
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
            return self._outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - every handler failure is journaled, not raised
            return self._outcome(step, None, exc)
