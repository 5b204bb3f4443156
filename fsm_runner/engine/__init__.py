"""The engine: drives runs through a machine, one journaled transition per step.

Per step the engine takes the run's row, calls the handler of its state, asks the compiled
machine where the handler's event leads (guards read the run), and commits the transition and
the new run row in one journal transaction. A crash anywhere leaves the run at its last
committed state; :meth:`Engine.resume` continues from there, so no completed phase runs again.

The package, along its seams: :class:`Engine` (this module) is the façade; the sync and async
drivers (``sync_driver.py``, ``async_driver.py``) step runs, each with one fast path;
``commits.py`` plans and commits a step's transition (the group committer too);
``leases.py`` claims, holds and lets go of runs (the heartbeat, ``work``, ``recover``);
``reducer.py`` and ``decisions.py`` are pure; ``operations.py`` aborts and forks runs
without an engine; ``deadlines.py`` and ``interruption.py`` are small helpers of the drivers.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from fsm_runner._json import storable_text
from fsm_runner.engine.async_driver import AsyncDriver
from fsm_runner.engine.commits import Listener, take_now
from fsm_runner.engine.interruption import interrupt_on_sigterm
from fsm_runner.engine.leases import LeaseKeeper, new_worker_id
from fsm_runner.engine.operations import abort_run, fork_run
from fsm_runner.engine.reducer import begin_fields
from fsm_runner.engine.sync_driver import SyncDriver
from fsm_runner.events import REWOUND, STARTED, event_name
from fsm_runner.exceptions import FsmRunnerError, InvalidTransitionError, SpecError
from fsm_runner.journal import Journal, SqliteJournal
from fsm_runner.machine import Guard, compile_spec
from fsm_runner.phases import PhaseContext, PhaseHandler, split_handler
from fsm_runner.records import (
    IterationRecord,
    RunRecord,
    TransitionRecord,
    positional_builder,
    utc_now,
)
from fsm_runner.spec import MachineSpec

__all__ = ["Engine", "Listener", "abort_run", "fork_run", "interrupt_on_sigterm"]

_log = logging.getLogger("fsm_runner.engine")


async def _asyncio_sleep(delay: float) -> None:
    """``asyncio.sleep``: the default ``async_sleep``, importing asyncio only when it waits."""
    import asyncio  # noqa: PLC0415 - a sync run never imports asyncio (see fsm_runner._lazy)

    await asyncio.sleep(delay)


#: A transition record from every field, in order (see positional_builder).
_new_transition = positional_builder(TransitionRecord)
#: uuid4's bits: the version (4) and the variant (RFC 4122), as ``uuid.UUID`` sets them.
_UUID4_KEEP = ~(0xF000 << 64) & ~(0xC000 << 48)
_UUID4_SET = (4 << 76) | (0x8000 << 48)


def _random_ids(count: int) -> list[str]:
    """``count`` new run ids, each what ``uuid.uuid4().hex`` gives, from one ``os.urandom``."""
    data = os.urandom(16 * count)
    return [
        f"{int.from_bytes(data[at : at + 16], 'big') & _UUID4_KEEP | _UUID4_SET:032x}"
        for at in range(0, 16 * count, 16)
    ]


#: The reducer's ``take`` at the time it is now, under the name tests import it by.
_advance = take_now


class Engine(SyncDriver, AsyncDriver):
    """Runs machines durably: start runs, step them, run them to the end, resume, abort.

    Args:
        spec: the machine every run of this engine follows.
        handlers: phase handlers by the names the spec's states give.
        journal: where runs are journaled, and the caller's to close. When not given, the
            engine opens its own :class:`SqliteJournal` at ``fsm-runner.db`` in the current
            directory (creating it; ``repr(engine)`` shows its absolute path) and closes it in
            :meth:`close`.
        guards: guard functions by name; each reads the run and returns a bool.
        services: the host's services, handed to every handler through ``ctx.services``.
        listeners: called with each transition after it is committed (errors are logged).
        clock: a monotonic clock in seconds, for deadlines and durations.
        sleep: how to wait between retries in sync runs.
        async_sleep: how to wait between retries in async runs (``asyncio.sleep`` by default).
        allow_spec_change: resume runs that started under another spec, as long as their
            current state exists in this one.
        worker_id: who this engine is when it holds leases (default: host, pid and a random
            part, unique per engine).
        lease_ttl: seconds a lease lasts unless renewed; a worker that dies holding one blocks
            its run for at most this long.
        heartbeat_interval: seconds between lease renewals while runs are held (default: a
            third of ``lease_ttl``). The heartbeat also picks up abort requests from elsewhere.
        max_recoveries: how often :meth:`recover` takes over a run whose worker was lost
            before parking it as ``dead_letter``.
        max_payload_bytes: the largest JSON payload (a run's input or context, a phase's
            output, context update, iteration update, artifacts or error), in UTF-8 bytes of
            its compact JSON, the engine journals; a larger one is refused before anything is
            written (a handler's: as a :class:`HandlerResultError`, journaled as
            ``SYSTEM_ERROR``), as is one that is not standard JSON (NaN or Infinity, nesting
            deeper than 255 levels, a lone surrogate).
        group_commit: in async runs (:meth:`arun`), commit the transitions of all runs whose
            phases ended in the same turn of the event loop in one journal transaction; each
            run still waits for its own transition to be durable before its next phase.

    Raises:
        SpecError: the spec is invalid, or names handlers or guards that are not given.
    """

    def __init__(
        self,
        spec: MachineSpec,
        /,
        *,
        handlers: Mapping[str, PhaseHandler],
        journal: Journal | None = None,
        guards: Mapping[str, Guard] | None = None,
        services: Mapping[str, Any] | None = None,
        listeners: Iterable[Listener] = (),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = _asyncio_sleep,
        allow_spec_change: bool = False,
        worker_id: str | None = None,
        lease_ttl: float = 30.0,
        heartbeat_interval: float | None = None,
        max_recoveries: int = 3,
        max_payload_bytes: int = 16 * 1024 * 1024,
        group_commit: bool = True,
    ) -> None:
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be positive, not {lease_ttl!r}")
        self.spec = spec
        self.handlers = dict(handlers)
        self.guards = dict(guards or {})
        spec.validate(handlers=self.handlers, guards=self.guards)
        try:
            self._handlers = {name: split_handler(h) for name, h in self.handlers.items()}
        except TypeError as exc:
            raise SpecError([str(exc)], machine=spec.name) from None
        self._machine = compile_spec(spec)
        # No journal given: the engine's own, at ./fsm-runner.db, which close() closes.
        self._owns_journal = journal is None
        self.journal: Journal = journal if journal is not None else SqliteJournal()
        self.services: Mapping[str, Any] = types.MappingProxyType(dict(services or {}))
        self.listeners = list(listeners)
        self.clock = clock
        self.sleep = sleep
        self.async_sleep = async_sleep
        self.allow_spec_change = allow_spec_change
        self._spec_json = spec.to_json()
        self._initial = spec.state(spec.initial_leaf)
        self._active: dict[str, PhaseContext] = {}  # runs whose phase runs in this process
        self._by_state = {
            state.name: self._handlers[state.handler] for state in spec.leaves if state.handler
        }
        self._states = {state.name: state for state in spec.leaves}
        # States whose handler is a plain callable with no validate() and no timeout: their
        # step takes the inlined hot path (_step_fast in sync runs, arun's loop in async ones).
        self._fast = {
            name: run_fn
            for name, (run_fn, validate_fn) in self._by_state.items()
            if validate_fn is None and self._states[name].timeout is None
        }
        self._plain_edges = self._machine.plain_edges
        self._returning = spec.returning_states
        self._logger_names = {
            state.name: f"fsm_runner.phase.{spec.name}.{state.name}" for state in spec.leaves
        }
        self._aborts: dict[str, str] = {}
        self._loop = None
        self.worker_id = worker_id or new_worker_id()
        self.lease_ttl = lease_ttl
        self.heartbeat_interval = heartbeat_interval or lease_ttl / 3
        self.max_recoveries = max_recoveries
        self.max_payload_bytes = max_payload_bytes
        self.group_commit = group_commit
        self._committer = None
        self._leases = LeaseKeeper(self, own_worker_id=worker_id is None)
        # One lock for the leases held and for what the heartbeat shares with the steps.
        self._lock = self._leases.lock

    def __repr__(self) -> str:
        """``Engine('spec-name', journal=SqliteJournal('/abs/fsm-runner.db', ...))``.

        The journal is shown whether it was passed or is the engine's own default, so where
        runs go is never a guess.
        """
        return f"Engine({self.spec.name!r}, journal={self.journal!r})"

    def with_journal(self, journal: Journal) -> Engine:
        """Return an engine like this one that journals to ``journal``."""
        return Engine(
            self.spec,
            handlers=self.handlers,
            journal=journal,
            guards=self.guards,
            services=self.services,
            listeners=self.listeners,
            clock=self.clock,
            sleep=self.sleep,
            async_sleep=self.async_sleep,
            allow_spec_change=self.allow_spec_change,
            worker_id=self.worker_id,
            lease_ttl=self.lease_ttl,
            heartbeat_interval=self.heartbeat_interval,
            max_recoveries=self.max_recoveries,
            max_payload_bytes=self.max_payload_bytes,
            group_commit=self.group_commit,
        )

    def close(self) -> None:
        """Stop the heartbeat and close the event loop of async handlers in sync runs.

        A journal passed to the engine is the host's to close; the default one the engine
        opened itself (no ``journal`` given) is closed here, after everything else.
        """
        self._let_go_undriven()
        self._leases.stop()
        self._committer = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self._owns_journal:
            self.journal.close()

    def _let_go_undriven(self) -> None:
        """Let go of the runs started holding and never driven; carry out aborts asked of them."""
        # One release for all of them where the journal can, which reads whether an abort was
        # asked from elsewhere since the last heartbeat.
        for run_id, stored in self._leases.let_go_undriven().items():
            with self._lock:
                reason = self._aborts.pop(run_id, None) or stored
            if reason is None:
                continue
            try:
                self.abort(run_id, reason)
            except FsmRunnerError as exc:  # a request stays journaled for the next holder
                _log.warning("run %s: could not carry out its abort: %s", run_id, exc)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def work(
        self,
        *,
        max_runs: int | None = None,
        stop: threading.Event | None = None,
        idle_wait: float = 0.5,
        exit_when_idle: bool = False,
    ) -> int:
        """Be a worker: claim runnable runs of this machine one at a time and run each.

        Runnable runs are those waiting in a state with a handler and not held by a live
        lease: new runs, runs a clean stop left, and runs whose worker died (their lease
        expired; taking one over counts in its ``recoveries``, and past ``max_recoveries`` it
        is parked as ``dead_letter`` instead of run). Any number of workers, in threads or
        processes, may share one journal: claiming is one transaction, and fencing refuses a
        worker whose lease was taken over. A run whose phase raises an error the spec has no
        transition for keeps its lease until it expires, so it is retried after a back-off
        (and eventually parked), never in a hot loop.

        Args:
            max_runs: stop after this many runs.
            stop: stop when this event is set (checked between runs and while idle).
            idle_wait: seconds to wait when no run is runnable before looking again.
            exit_when_idle: return as soon as no run is runnable.

        Returns:
            How many runs this worker took.
        """
        return self._leases.work(
            max_runs=max_runs,
            stop=stop or threading.Event(),
            idle_wait=idle_wait,
            exit_when_idle=exit_when_idle,
        )

    def recover(self, *, limit: int | None = None) -> list[RunRecord]:
        """Take over this machine's runs whose lease expired (their worker is gone) and run them.

        Each takeover counts in the run's ``recoveries``; a run taken over more than
        ``max_recoveries`` times is not run again but parked with status ``dead_letter`` and
        the reason (a ``DEAD_LETTERED`` transition), so a run that kills its worker is not
        retried forever. Runs another worker claims first, and runs under another spec, are
        left alone.

        Args:
            limit: recover at most this many runs.

        Returns:
            The recovered runs as they ended up (parked ones included).
        """
        return self._leases.recover(limit=limit)

    def start(
        self,
        input: Any = None,  # noqa: A002 - "input" is the name users know from the design
        *,
        run_id: str | None = None,
        context: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        claim: bool = False,
    ) -> str:
        """Start a run in the initial state and journal its transition seq 0.

        Args:
            input: the run's JSON input, readable by every phase as ``ctx.input``.
            run_id: the run's id; a new random one when not given.
            context: the run's initial JSON context.
            parent_run_id: the run that starts this one, if any.
            claim: store the run holding this engine's lease, in the same transaction, for a
                run this engine drives next (:meth:`run`, :meth:`arun`, :meth:`resume`): its
                first drive here then writes no claim. Until then the heartbeat renews the
                lease, so no other worker takes the run; :meth:`close` lets go of it (an abort
                requested meanwhile is carried out there), and :meth:`abort` aborts it at once.
                Without it the run is stored unleased, for any worker to take.

        Returns:
            The run's id.

        Raises:
            RunExistsError: a run with ``run_id`` exists.
            PayloadError: the run id is not text the journal can store, or the input or
                context is not standard JSON (not serialisable, NaN or Infinity, nested more
                than 255 levels, a lone surrogate) or is over ``max_payload_bytes``; nothing
                was written.
            JournalError: the journal failed; nothing was written.
        """
        run, first, opened = self._new_run(input, run_id, context, parent_run_id, claim)
        self.journal.create_run(run, first, spec_json=self._spec_json, iterations=opened)
        self._started(run, first)
        return run.run_id

    def start_many(
        self,
        inputs: Iterable[Any],
        *,
        parent_run_id: str | None = None,
        claim: bool = False,
    ) -> list[str]:
        """Start one run per input, all in one journal transaction: all are stored, or none.

        What :meth:`start` does for each input (new random run ids, no initial context), at
        the cost of one write for the whole batch where the journal can (``create_runs``; a
        journal without it stores the runs one transaction each, in order).

        Args:
            inputs: the runs' JSON inputs.
            parent_run_id: the run that starts these, if any.
            claim: store each run holding this engine's lease (see :meth:`start`).

        Returns:
            The new runs' ids, in the order of ``inputs``.

        Raises:
            PayloadError: an input is not standard JSON or is over ``max_payload_bytes``;
                nothing was written.
            JournalError: the journal failed; nothing was written.
        """
        inputs = list(inputs)
        ttl = dt.timedelta(seconds=self.lease_ttl)
        batch = [
            self._new_run(given, run_id, None, parent_run_id, claim, ttl=ttl)
            for given, run_id in zip(inputs, _random_ids(len(inputs)), strict=True)
        ]
        create_runs = getattr(self.journal, "create_runs", None)
        if create_runs is not None:
            create_runs(batch, spec_json=self._spec_json)
        else:
            for run, first, opened in batch:
                self.journal.create_run(run, first, spec_json=self._spec_json, iterations=opened)
        self._leases.started_many([run for run, _, _ in batch])
        if self.listeners:
            for run, first, _ in batch:
                self._notify(first, run)
        return [run.run_id for run, _, _ in batch]

    def _new_run(
        self,
        input: Any,  # noqa: A002 - as in start()
        run_id: str | None,
        context: Mapping[str, Any] | None,
        parent_run_id: str | None,
        claim: bool,
        *,
        ttl: dt.timedelta | None = None,
    ) -> tuple[RunRecord, TransitionRecord, list[IterationRecord]]:
        """A new run's row, its transition seq 0 and its opened iteration, checked for storage.

        ``ttl``: ``lease_ttl`` as a timedelta, made once for a batch.
        """
        initial = self._initial
        run_id = run_id or _random_ids(1)[0]
        if not run_id.isascii():  # SQL journals store it as text: UTF-8 must hold it
            self._check_json(storable_text(run_id), "run id", run_id)
        now = utc_now()
        iteration = 1 if initial.starts_iteration else 0
        # the journal alone reproduces the run row (invariant 8), initial context included
        seeded = {"context": dict(context)} if context else None
        first = _new_transition(
            run_id, 0, None, STARTED, initial.name, iteration, 1, now, 0.0, seeded, 0
        )
        # What the transition does not say; the reducer derives the rest from seq 0.
        if claim and not initial.terminal:  # as a claim would leave it: its first token
            expires = now + (ttl or dt.timedelta(seconds=self.lease_ttl))
            owner, token = self.worker_id, 1
        else:
            owner, expires, token = None, None, 0
        spec = self.spec
        run = begin_fields(
            spec, first, run_id, spec.name, spec.spec_hash, input, now, parent_run_id,
            owner, expires, token,
        )  # fmt: skip
        self._check_json(run_id, "input", input)
        if run.context:
            self._check_json(run_id, "context", run.context)
        opened = (
            [IterationRecord(run_id, 1, state=initial.name, started_at=now)] if iteration else []
        )
        return run, first, opened

    def _started(self, run: RunRecord, first: TransitionRecord) -> None:
        """Tell the lease keeper and the listeners about a run just stored."""
        if run.lease_owner is not None:
            self._leases.started_holding(run)
        else:
            self._leases.started(run)
        self._notify(first, run)

    def resume(
        self, run_id: str, *, max_steps: int | None = None, from_state: str | None = None
    ) -> RunRecord:
        """Continue a run from its journaled state (the run row is read; history is not).

        Args:
            run_id: the run.
            max_steps: stop after this many steps.
            from_state: continue from this earlier state instead (see :meth:`rewind`).

        Raises:
            RunTerminalError: the run has ended; fork it instead.
            SpecMismatchError: the run started under another spec.
            InvalidTransitionError: ``from_state`` is not a state the run can be rewound to.
        """
        if from_state is not None:
            self.rewind(run_id, from_state)
        return self.run(run_id, max_steps=max_steps)

    async def aresume(
        self, run_id: str, *, max_steps: int | None = None, from_state: str | None = None
    ) -> RunRecord:
        """Async :meth:`resume`."""
        if from_state is not None:
            self.rewind(run_id, from_state)
        return await self.arun(run_id, max_steps=max_steps)

    def rewind(self, run_id: str, state: str) -> RunRecord:
        """Move an active run back to ``state``, a state it was in before: a ``REWOUND`` transition.

        The phase of ``state`` runs again on the next step, as a new visit (entering a
        ``starts_iteration`` state starts a new iteration). Nothing journaled is removed: the
        transition records where the run was rewound from.

        Args:
            run_id: the run.
            state: a non-terminal state the run has been in (a composite: its first sub-phase).

        Returns:
            The run after the rewind.

        Raises:
            RunTerminalError: the run has ended; fork it at an earlier seq instead.
            InvalidTransitionError: ``state`` is not in the spec, is terminal, or the run has
                never been in it; nothing was written.
        """
        self._rewind_target(self.journal.load(run_id), state)  # refused before the lease
        return self._commit_held(
            run_id,
            REWOUND,
            "rewind",
            lambda run: self._rewind_target(run, state),
            lambda run: {"output": {"rewound_from": run.state}},
        )

    def fork(
        self, run_id: str, *, at_seq: int | None = None, new_run_id: str | None = None
    ) -> RunRecord:
        """Fork a run: see :func:`fork_run`. The fork runs under this engine if its spec matches."""
        return fork_run(self.journal, run_id, at_seq=at_seq, new_run_id=new_run_id)

    def send(self, run_id: str, event: Any, *, output: Any = None) -> RunRecord:
        """Journal an external event for the run (e.g. an approval for a waiting state).

        Raises:
            InvalidTransitionError: the run's state does not allow the event, or the event is
                not a str or a str enum; nothing changed.
            RunTerminalError: the run has ended.
            PayloadError: the output is not JSON the journal stores; nothing changed.
        """
        try:
            name = event_name(event)
        except TypeError:
            state = self.journal.load(run_id).state
            raise InvalidTransitionError(
                run_id=run_id,
                state=state,
                event=repr(event),
                reason=f"not a str or a str enum ({type(event).__name__})",
            ) from None
        self._check_json(run_id, "output", output)
        run = self.journal.load(run_id)
        self._check_runnable(run)
        # Refused before the lease is taken: a refused event changes nothing at all.
        self._machine.resolve(run.state, name, run, self.guards, run_id=run_id)
        return self._commit_held(
            run_id,
            name,
            "transition",
            lambda run: self._machine.resolve(run.state, name, run, self.guards, run_id=run_id),
            lambda _run: {"output": output} if output is not None else None,
        )

    def abort(self, run_id: str, reason: str) -> RunRecord:
        """Abort a run from any non-terminal state; nothing journaled is removed.

        A run this engine is advancing is told through ``ctx.cancelled`` and ends aborted in the
        state whose phase was running; a run another worker holds (a live lease) gets the
        request journaled, and that worker carries it out at its next step (the journal refuses
        any other transition of the run from then on; its heartbeat tells the phase in
        progress); a run nobody holds is moved at once.

        Returns:
            The run after the abort (or with the abort requested, if a worker holds it).

        Raises:
            RunTerminalError: the run has already ended.
        """
        reason = storable_text(reason)  # a lone surrogate (an argv byte that is not UTF-8)
        self._leases.let_go_fresh(run_id)  # started holding, not driven: aborted at once below
        with self._lock:
            held = self._leases.holds(run_id)
            if held:
                self._aborts[run_id] = reason
                ctx = self._active.get(run_id)
                if ctx is not None:
                    ctx.request_cancel(reason)
        if held:
            return self.journal.request_abort(run_id, reason)
        return abort_run(
            self.journal,
            run_id,
            reason,
            spec=self.spec,
            guards=self.guards,
            owner=self.worker_id,
            _notify=self._notify,
        )
