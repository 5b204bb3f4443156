"""The sync driver: ``step`` and ``run``, one phase after another in the calling thread.

Its one fast path is :meth:`SyncDriver._step_fast`: a plain sync handler in a state without a
timeout or ``validate()`` that returns a bare event outside iterations is called, resolved and
committed inline. Everything else takes the general path: prepare the phase, call it
(:meth:`SyncDriver._call_sync`: validate, run, await an async handler on a private event
loop), and settle its outcome (:meth:`SyncDriver._settle`: commit it, or a retry and wait).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsm_runner._lazy import LazyModule
from fsm_runner.engine.commits import PLAIN_RETURNS, StepWriter
from fsm_runner.engine.deadlines import with_deadline
from fsm_runner.engine.decisions import PhaseOutcome, PhaseStep, retry_wait
from fsm_runner.engine.leases import unleased
from fsm_runner.engine.reducer import ACTIVE as _ACTIVE
from fsm_runner.exceptions import RunConflictError
from fsm_runner.phases import PhaseContext
from fsm_runner.records import RunRecord, TransitionRecord

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["SyncDriver"]


class SyncDriver(StepWriter):
    """Steps runs in the calling thread: :meth:`step`, :meth:`run` (and workers' runs)."""

    sleep: Callable[[float], None]
    #: the event loop that runs async handlers in sync runs (made on first use)
    _loop: asyncio.AbstractEventLoop | None

    def step(self, run_id: str) -> TransitionRecord | None:
        """Run the current state's phase once and journal where it led.

        Returns:
            The committed transition, or ``None`` when the state has no handler (it waits for
            :meth:`send`).

        Raises:
            RunNotFoundError: no such run.
            RunTerminalError: the run has ended.
            SpecMismatchError: the run started under another spec (see ``allow_spec_change``).
            InvalidTransitionError: the handler's event is not allowed in the state; nothing
                was written and the phase runs again on resume.
            PhaseError: the phase failed and the spec has no transition for that failure.
            RunConflictError: another writer advanced the run while the phase ran.
        """
        run = self._leases.claim(run_id)
        try:
            try:
                return self._step(run)[0]
            except RunConflictError:
                run = self.journal.load(run_id)
                if run.ended or run.abort_reason is None:
                    raise
                # An abort was requested while the phase ran: the journal refused the phase's
                # outcome, and this step carries the abort out instead.
                return self._commit_abort(run, run.abort_reason)[0]
        finally:
            self._leases.let_go(run_id)

    def run(self, run_id: str, *, max_steps: int | None = None) -> RunRecord:
        """Step the run until it ends, waits for an event, or ``max_steps`` steps were taken.

        The engine holds the run's lease meanwhile (renewed by a heartbeat) and releases it
        when it returns, whatever the reason.

        Returns:
            The run as it stands at the end.

        Raises:
            LeaseHeldError: another worker holds the run's live lease; nothing was written.
            LeaseLostError: the lease expired and was taken over while a phase ran; this engine
                wrote nothing after that.
            The errors of :meth:`step`; when another writer ended the run meanwhile (an abort
            from another process), the ended run is returned instead.
        """
        if max_steps == 0:  # nothing to do: not even the lease is taken
            run = self.journal.load(run_id)
            self._check_runnable(run)
            return run
        run = self._leases.claim(run_id)
        ended = False
        try:
            run = self._drive(run, max_steps)
            ended = run.ended  # its last commit cleared the lease: no release to write
        finally:
            self._leases.let_go(run_id, ended=ended)
        return unleased(run)

    def _drive(self, run: RunRecord, max_steps: int | None) -> RunRecord:
        steps = 0
        while (max_steps is None or steps < max_steps) and run.status is _ACTIVE:  # not ended
            try:
                transition, after = self._step(run)
            except RunConflictError as refused:
                run = self._after_refusal(run.run_id, refused)
                continue  # ended elsewhere (the loop stops), or an abort the next step carries out
            if transition is None:
                break
            run = after
            steps += 1
        return run

    def _step(self, run: RunRecord) -> tuple[TransitionRecord | None, RunRecord]:
        # The caller has checked the run is runnable: either loaded and checked, or the row
        # this engine just committed (same spec, not ended).
        run_id = run.run_id
        pending_abort = self._aborts.get(run_id) or run.abort_reason
        if pending_abort is not None:
            return self._commit_abort(run, pending_abort)
        fast = self._fast.get(run.state)
        if fast is not None:
            return self._step_fast(run, fast)
        step = self._prepare(run)
        if step is None:
            return None, run
        try:
            outcome = self._call_sync(step)
        except KeyboardInterrupt as exc:
            self._journal_interruption(run, exc)
            raise
        finally:
            self._close_phase(run_id)
        return self._settle(step, outcome)

    def _step_fast(
        self, run: RunRecord, handler: Callable[[PhaseContext], Any]
    ) -> tuple[TransitionRecord, RunRecord]:
        """The hot path: a plain sync handler in a state without timeout or validate().

        What :meth:`_prepare`, :meth:`_call_sync`, :meth:`_outcome`, :meth:`_decide` and
        :meth:`_write` do, inlined for a handler returning a bare event outside iterations
        (~3 µs a step less); anything else continues on the general path (:meth:`_settle`)
        with the value the handler returned.
        """
        run_id = run.run_id
        ctx = PhaseContext(
            run,
            self.services,
            self.clock,
            None,
            None,
            self._logger_names[run.state],
            self.journal,
            self._states[run.state],
        )
        self._active[run_id] = ctx
        started = self.clock()
        try:
            value = handler(ctx)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            self._close_phase(run_id)
            step = PhaseStep(run, self._states[run.state], ctx, started)
            return self._settle(step, self._outcome(step, None, exc))
        except KeyboardInterrupt as exc:
            self._close_phase(run_id)
            self._journal_interruption(run, exc)
            raise
        except BaseException:
            self._close_phase(
                run_id
            )  # SystemExit and the like: not journaled, but the phase is over
            raise
        if type(value) is str and not run.iteration:
            dest = self._plain_edges.get((run.state, value))
            if dest is not None:
                self._close_phase(run_id)
                planned = self._plan_plain(run, value, dest, (self.clock() - started) * 1000.0)
                transition, after, iterations, _ = planned
                if iterations:
                    return self._write(planned)
                self.journal.commit(after, transition)
                if after.status is not _ACTIVE:
                    self._aborts.pop(run_id, None)
                if self.listeners:
                    self._notify(transition, after)
                return transition, after
        step = PhaseStep(run, self._states[run.state], ctx, started)
        try:
            if not isinstance(value, PLAIN_RETURNS):
                value = self._await_sync(value, step)
            outcome = self._outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            outcome = self._outcome(step, None, exc)
        finally:
            self._close_phase(run_id)
        return self._settle(step, outcome)

    def _settle(self, step: PhaseStep, outcome: PhaseOutcome) -> tuple[TransitionRecord, RunRecord]:
        """Journal a phase's outcome, or a retry of it (then wait before the next attempt)."""
        wait = retry_wait(step, outcome)
        if wait is None:
            return self._write(self._decide(step, outcome))
        committed = self._write(self._plan_retry(step, outcome))
        self.sleep(wait)
        return committed

    def _call_sync(self, step: PhaseStep) -> PhaseOutcome:
        run_fn, validate_fn = self._by_state[step.state.name]
        try:
            value = None
            if validate_fn is not None:
                value = self._await_sync(validate_fn(step.ctx), step)
            if value is None:
                value = run_fn(step.ctx)
                if not isinstance(value, PLAIN_RETURNS):
                    value = self._await_sync(value, step)
            return self._outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - every handler failure is journaled, not raised
            return self._outcome(step, None, exc)

    def _await_sync(self, value: Any, step: PhaseStep) -> Any:
        if isinstance(value, PLAIN_RETURNS) or not inspect.isawaitable(value):
            return value
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(with_deadline(value, step))
