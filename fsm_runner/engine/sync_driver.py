"""The sync driver: ``step`` and ``run``, one phase after another in the calling thread.

:class:`SyncDriver` holds the step core (:mod:`.core`) and the lease keeper; the async driver
(:mod:`.async_driver`) is its sibling over the same core, never combined with it. Its one fast
path is :meth:`SyncDriver._step_fast`: a plain sync handler in a state without a timeout or
``validate()`` that returns a bare event outside iterations is called, resolved and committed
inline, and :meth:`SyncDriver.drive` calls it straight from its loop. Everything else takes the
general path (:meth:`SyncDriver._step`): prepare the phase, call it (:meth:`SyncDriver._call_sync`:
validate, run, await an async handler on a private event loop), and settle its outcome
(:meth:`SyncDriver._settle`: commit it, or a retry and wait).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsm_runner import _fork
from fsm_runner._lazy import LazyModule
from fsm_runner.engine.core import PLAIN_RETURNS, StepCore
from fsm_runner.engine.deadlines import with_deadline
from fsm_runner.engine.leases import LeaseKeeper, unleased
from fsm_runner.events import REWOUND, USER_ABORTED, WAITING, event_name
from fsm_runner.exceptions import InvalidTransitionError, RunConflictError
from fsm_runner.phases import PhaseContext, PhaseWaits
from fsm_runner.records import RunRecord, TransitionRecord, utc_now
from fsm_runner.rules.classify import StepKind
from fsm_runner.rules.decisions import PhaseOutcome, PhaseStep, retry_wait
from fsm_runner.rules.reducer import ACTIVE as _ACTIVE
from fsm_runner.rules.reducer import advance_plain

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["SyncDriver"]


class SyncDriver:
    """Steps runs in the calling thread: :meth:`step`, :meth:`run` (and workers' runs).

    Also what is written without a phase from the calling thread: :meth:`send`, :meth:`rewind`.

    Args:
        core: the step core it drives runs with.
        leases: the lease keeper it claims and lets go of runs with.
        sleep: how to wait between retries.
    """

    def __init__(
        self, core: StepCore, leases: LeaseKeeper, *, sleep: Callable[[float], None]
    ) -> None:
        self.core = core
        self.leases = leases
        self.sleep = sleep
        # The held runs' maps, emptied in place after a fork: safe to keep (see HeldRuns).
        self._active = core.held.active
        self._aborts = core.held.aborts
        #: the event loop that runs async handlers in sync runs (made on first use)
        self._loop: asyncio.AbstractEventLoop | None = None
        _fork.register(self)

    def _after_fork(self) -> None:
        """In a forked child: the event loop is the parent's (its selector too): never closed."""
        if self._loop is not None:
            _fork.keep(self._loop)
            self._loop = None

    def close(self) -> None:
        """Close the event loop of async handlers in sync runs, if one was made."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def step(self, run_id: str) -> TransitionRecord | None:
        """``Engine.step``: claim the run, take one step, let go of it."""
        run = self.leases.claim(run_id)
        try:
            telemetry = self.core.telemetry
            if telemetry is None:
                return self._step_held(run)
            with telemetry.drive(self.core.journal, run, "step", self.leases.worker_id):
                return self._step_held(run)
        finally:
            self.leases.let_go(run_id)

    def _step_held(self, run: RunRecord) -> TransitionRecord | None:
        try:
            return self._step(run)[0]
        except RunConflictError:
            core = self.core
            run = core.journal.load(run.run_id)
            if run.ended or run.abort_reason is None:
                raise
            # An abort was requested while the phase ran: the journal refused the phase's
            # outcome, and this step carries the abort out instead.
            return core.write(core.plan_abort(run, run.abort_reason))[0]

    def run(self, run_id: str, *, max_steps: int | None = None) -> RunRecord:
        """``Engine.run``: claim the run, drive it, let go of it (not written if it ended)."""
        if max_steps == 0:  # nothing to do: not even the lease is taken
            run = self.core.journal.load(run_id)
            self.core.check_runnable(run)
            return run
        run = self.leases.claim(run_id)
        ended = False
        try:
            run = self.drive(run, max_steps)
            ended = run.ended  # its last commit cleared the lease: no release to write
        finally:
            self.leases.let_go(run_id, ended=ended)
        return unleased(run)

    def drive(self, run: RunRecord, max_steps: int | None, *, how: str = "run") -> RunRecord:
        """Step a run this engine holds until it ends, waits, or ``max_steps`` were taken.

        ``how``: what drives it (``run``, a worker's ``work``), for its span.
        """
        telemetry = self.core.telemetry
        if telemetry is None:
            return self._drive(run, max_steps)
        with telemetry.drive(self.core.journal, run, how, self.leases.worker_id) as span:
            run = self._drive(run, max_steps)
            telemetry.drove(span, run)
            return run

    def _drive(self, run: RunRecord, max_steps: int | None) -> RunRecord:
        core = self.core
        fast, aborts = core.fast, self._aborts
        steps = 0
        while (max_steps is None or steps < max_steps) and run.status is _ACTIVE:  # not ended
            try:
                handler = fast.get(run.state)
                if (
                    handler is None
                    or run.error is not None  # a phase parked it, perhaps (see _step)
                    or run.abort_reason is not None
                    or run.run_id in aborts
                ):
                    transition, after = self._step(run)
                else:
                    transition, after = self._step_fast(run, handler)
            except RunConflictError as refused:
                run = core.after_refusal(run.run_id, refused)
                continue  # ended elsewhere (the loop stops), or an abort the next step carries out
            run = after
            if transition is None:
                break
            steps += 1
        return run

    def send(self, run_id: str, event: Any, *, output: Any = None) -> RunRecord:
        """``Engine.send``: journal an external event for the run; no phase runs."""
        core = self.core
        try:
            name = event_name(event)
        except TypeError:
            state = core.journal.load(run_id).state
            raise InvalidTransitionError(
                run_id=run_id,
                state=state,
                event=repr(event),
                reason=f"not a str or a str enum ({type(event).__name__})",
            ) from None
        core.check_json(run_id, "output", output)
        run = core.journal.load(run_id)
        core.check_runnable(run)
        # Refused before the lease is taken: a refused event changes nothing at all.
        core.machine.resolve(run.state, name, run, core.guards, run_id=run_id)
        return self._commit_once(
            run_id,
            name,
            "transition",
            lambda run: core.machine.resolve(run.state, name, run, core.guards, run_id=run_id),
            lambda _run: {"output": output} if output is not None else None,
        )

    def rewind(self, run_id: str, state: str) -> RunRecord:
        """``Engine.rewind``: a ``REWOUND`` transition back to a state the run was in."""
        core = self.core
        core.rewind_target(core.journal.load(run_id), state)  # refused before the lease
        return self._commit_once(
            run_id,
            REWOUND,
            "rewind",
            lambda run: core.rewind_target(run, state),
            lambda run: {"output": {"rewound_from": run.state}},
        )

    def _commit_once(
        self,
        run_id: str,
        event: str,
        kind: StepKind,
        dest: Callable[[RunRecord], str],
        result: Callable[[RunRecord], Mapping[str, Any] | None],
    ) -> RunRecord:
        """Claim the run, commit one transition decided on the claimed row, and let go of it."""
        core = self.core
        run = self.leases.claim(run_id)
        try:
            planned = core.plan(
                run, event, dest(run), result=result(run), duration_ms=0.0, kind=kind
            )
            run = core.write(planned)[1]
        finally:
            self.leases.let_go(run_id)
        return unleased(run)

    def _step(self, run: RunRecord) -> tuple[TransitionRecord | None, RunRecord]:
        # The caller has checked the run is runnable: either loaded and checked, or the row
        # this engine just committed (same spec, not ended).
        core = self.core
        run_id = run.run_id
        pending_abort = self._aborts.get(run_id) or run.abort_reason
        if pending_abort is not None:
            return core.write(core.plan_abort(run, pending_abort))
        if run.error is not None and run.error.get("type") == WAITING:  # its phase parked it
            transition, after = core.wait_move(run)
            if transition is None:
                return None, run  # it waits on
            run = after  # WOKEN: the phase runs again
        fast = core.fast.get(run.state)
        if fast is not None:
            return self._step_fast(run, fast)
        step = core.prepare(run)
        if step is None:  # it waits: a signal it accepts, or its deadline, moves it
            return core.wait_move(run)
        if core.telemetry is not None:
            phase = core.telemetry.phase(run, run.attempt, core.spec.parents(run.state))
            try:
                transition, after, error = self._call_and_settle(step)
            except BaseException as exc:
                phase.end(None, None, raised=exc)
                raise
            phase.end(transition, error)
            return transition, after
        return self._call_and_settle(step)[:2]

    def _call_and_settle(
        self, step: PhaseStep
    ) -> tuple[TransitionRecord, RunRecord, BaseException | None]:
        """Call a prepared phase and settle its outcome; what it raised (if it did) too."""
        core = self.core
        try:
            outcome = self._call_sync(step)
        except KeyboardInterrupt as exc:
            core.journal_interruption(step.run, exc)
            raise
        finally:
            core.close_phase(step.run.run_id)
        error = outcome.error if type(outcome.error) is not PhaseWaits else None  # it parks
        return (*self._settle(step, outcome), error)

    def _step_fast(
        self, run: RunRecord, handler: Callable[[PhaseContext], Any]
    ) -> tuple[TransitionRecord, RunRecord]:
        """The hot path: a plain sync handler in a state without timeout or validate().

        What ``core.prepare``, :meth:`_call_sync`, ``core.outcome``, ``core.decide`` and
        ``core.write`` do, inlined for a handler returning a bare event outside iterations
        (~3 µs a step less); anything else continues on the general path (:meth:`_settle`)
        with the value the handler returned.
        """
        core = self.core
        run_id = run.run_id
        clock = core.clock
        state = core.states[run.state]
        ctx = PhaseContext(
            run, core.services, clock, None, None, core.logger_names[run.state], core.journal,
            state,
        )  # fmt: skip
        active = self._active
        active[run_id] = ctx
        started = clock()
        try:
            value = handler(ctx)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            core.close_phase(run_id)
            step = PhaseStep(run, state, ctx, started)
            return self._settle(step, core.outcome(step, None, exc))
        except KeyboardInterrupt as exc:
            core.close_phase(run_id)
            core.journal_interruption(run, exc)
            raise
        except BaseException:  # SystemExit and the like: not journaled, but the phase is over
            core.close_phase(run_id)
            raise
        if type(value) is str and not run.iteration and run.return_to is None:
            dest = core.plain_edges.get((run.state, value), "")
            status = core.plain_outcomes.get(dest)
            if status is not None:  # core.plan_plain and core.write, inlined
                active.pop(run_id, None)
                ctx.close()
                transition, after = advance_plain(
                    run, value, dest, status, (clock() - started) * 1000.0, utc_now()
                )
                core.journal.commit(after, transition)
                if status is not _ACTIVE or value == USER_ABORTED:  # core.committed
                    with core.held.lock:
                        self._aborts.pop(run_id, None)
                if core.listeners:
                    core.notify(transition, after)
                return transition, after
        step = PhaseStep(run, state, ctx, started)
        try:
            if not isinstance(value, PLAIN_RETURNS):
                value = self._await_sync(value, step)
            outcome = core.outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            outcome = core.outcome(step, None, exc)
        finally:
            core.close_phase(run_id)
        return self._settle(step, outcome)

    def _settle(self, step: PhaseStep, outcome: PhaseOutcome) -> tuple[TransitionRecord, RunRecord]:
        """Journal a phase's outcome, or a retry of it (then wait before the next attempt)."""
        core = self.core
        if type(outcome.error) is PhaseWaits:  # ctx.wait_for / sleep_until: parked here
            return core.park_phase(step, outcome.error)
        wait = retry_wait(step, outcome)
        if wait is None:
            return core.write(core.decide(step, outcome))
        committed = core.write(core.plan_retry(step, outcome))
        self.sleep(wait)
        return committed

    def _call_sync(self, step: PhaseStep) -> PhaseOutcome:
        core = self.core
        run_fn, validate_fn = core.by_state[step.state.name]
        try:
            value = None
            if validate_fn is not None:
                value = self._await_sync(validate_fn(step.ctx), step)
            if value is None:
                value = run_fn(step.ctx)
                if not isinstance(value, PLAIN_RETURNS):
                    value = self._await_sync(value, step)
            return core.outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - every handler failure is journaled, not raised
            return core.outcome(step, None, exc)

    def _await_sync(self, value: Any, step: PhaseStep) -> Any:
        if isinstance(value, PLAIN_RETURNS) or not inspect.isawaitable(value):
            return value
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(with_deadline(value, step))
