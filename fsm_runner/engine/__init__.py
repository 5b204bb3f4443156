"""The engine: drives runs through a machine, one journaled transition per step.

Per step the engine takes the run's row, calls the handler of its state, asks the compiled
machine where the handler's event leads (guards read the run), and commits the transition and
the new run row in one journal transaction. A crash anywhere leaves the run at its last
committed state; :meth:`Engine.resume` continues from there, so no completed phase runs again.

The package, object by object: :class:`Engine` (this module) is the façade and holds no step
logic; ``core.py`` (:class:`~.core.StepCore`: the spec, handlers, journal and settings; decide,
plan, write) is what the two drivers hold, ``sync_driver.py`` (``step``, ``run``; ``send``,
``rewind``) and ``async_driver.py`` (``astep``, ``arun``, the group committer), siblings each
with one fast path; ``held.py`` (:class:`~.held.HeldRuns`: the phases running here, the aborts
to carry out, their lock); ``leases.py`` (:class:`~.leases.LeaseKeeper`: claims, renews,
releases); ``worker.py`` (:class:`~.worker.Worker`: ``work``, ``recover``, aborts of runs
held); ``operations.py`` aborts and forks runs without an engine; ``deadlines.py`` applies a
state's deadline to an async handler; ``interruption.py`` names an interruption. The pure step
logic is :mod:`fsm_runner.rules`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar, overload

from fsm_runner._unclosed import watch
from fsm_runner.engine import waits
from fsm_runner.engine.async_driver import AsyncDriver
from fsm_runner.engine.core import Listener, StepCore
from fsm_runner.engine.held import HeldRuns
from fsm_runner.engine.interruption import interrupt_on_sigterm
from fsm_runner.engine.leases import LeaseKeeper
from fsm_runner.engine.operations import abort_run, fork_run
from fsm_runner.engine.starts import Starts
from fsm_runner.engine.sync_driver import SyncDriver
from fsm_runner.engine.worker import Worker
from fsm_runner.journal import Journal
from fsm_runner.machine import Guard
from fsm_runner.phases import PhaseHandler
from fsm_runner.records import RunRecord, SignalRecord, TransitionRecord
from fsm_runner.spec import MachineSpec
from fsm_runner.telemetry import Telemetry
from fsm_runner.telemetry import resolve as resolve_telemetry

__all__ = ["Engine", "Listener", "abort_run", "fork_run", "interrupt_on_sigterm"]

_T = TypeVar("_T")


async def _asyncio_sleep(delay: float) -> None:
    """``asyncio.sleep``: the default ``async_sleep``, importing asyncio only when it waits."""
    import asyncio  # noqa: PLC0415 - a sync run never imports asyncio (see fsm_runner._lazy)

    await asyncio.sleep(delay)


class _Setting(Generic[_T]):
    """An attribute of the engine that is one of its parts': read and set there, at once."""

    def __init__(self, part: str) -> None:
        self._part = part
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, engine: None, owner: type) -> _Setting[_T]: ...
    @overload
    def __get__(self, engine: Engine, owner: type) -> _T: ...
    def __get__(self, engine: Engine | None, owner: type) -> _T | _Setting[_T]:
        if engine is None:
            return self
        value: _T = getattr(getattr(engine, self._part), self._name)
        return value

    def __set__(self, engine: Engine, value: _T) -> None:
        setattr(getattr(engine, self._part), self._name, value)


#: The engine's settings a copy of it keeps (:meth:`Engine.with_journal`).
_SETTINGS = (
    "handlers", "guards", "services", "listeners", "clock", "sleep", "async_sleep",
    "allow_spec_change", "worker_id", "lease_ttl", "heartbeat_interval", "max_recoveries",
    "max_payload_bytes", "group_commit",
)  # fmt: skip


class Engine:
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
        telemetry: OpenTelemetry spans and metrics of its runs (:mod:`fsm_runner.telemetry`,
            the ``[otel]`` extra). ``None``: on when the host configured OpenTelemetry (set a
            tracer or meter provider) before making the engine, unless ``OTEL_SDK_DISABLED``
            is ``true``; ``True``/``False``: on/off; or a :class:`~fsm_runner.telemetry.Telemetry`
            over providers of its own. Off, it costs nothing.

    The engine is a façade over objects that each own their state: the step core (the spec,
    handlers, journal and how a step is written), the sync and the async driver holding it,
    the held runs, the lease keeper and the worker (see the module). Its settings are theirs:
    reading or setting one (``engine.journal = ...``) reads or sets the part's, at once.

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
        telemetry: Telemetry | bool | None = None,
    ) -> None:
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be positive, not {lease_ttl!r}")
        held = HeldRuns()
        # No journal given: the core opens the engine's own, at ./fsm-runner.db, which
        # close() closes.
        core = StepCore(
            spec,
            handlers=handlers,
            journal=journal,
            held=held,
            guards=guards,
            services=services,
            listeners=listeners,
            clock=clock,
            allow_spec_change=allow_spec_change,
            max_recoveries=max_recoveries,
            max_payload_bytes=max_payload_bytes,
            telemetry=resolve_telemetry(telemetry),
        )
        if core.telemetry is not None:
            core.telemetry.observe(core)
        self._core = core
        self._leases = LeaseKeeper(
            core,
            held,
            worker_id=worker_id,
            lease_ttl=lease_ttl,
            heartbeat_interval=heartbeat_interval,
        )
        self._sync = SyncDriver(core, self._leases, sleep=sleep)
        self._async = AsyncDriver(
            core, self._leases, async_sleep=async_sleep, group_commit=group_commit
        )
        self._worker = Worker(core, self._leases, self._sync)
        self._starts = Starts(core, self._leases, self._worker)
        # The default journal is the engine's own: an engine collected unclosed closes it
        # and says so by the engine's name (a journal passed in is the host's to close).
        self._close_journal = (
            watch(self, core.journal.close, f"Engine({core.spec.name!r}) (and its own journal)")
            if journal is None
            else None
        )

    spec = _Setting[MachineSpec]("_core")
    handlers = _Setting[dict[str, PhaseHandler]]("_core")
    guards = _Setting[dict[str, Guard]]("_core")
    journal = _Setting[Journal]("_core")
    services = _Setting[Mapping[str, Any]]("_core")
    listeners = _Setting[list[Listener]]("_core")
    clock = _Setting[Callable[[], float]]("_core")
    allow_spec_change = _Setting[bool]("_core")
    max_recoveries = _Setting[int]("_core")
    max_payload_bytes = _Setting[int]("_core")
    sleep = _Setting[Callable[[float], None]]("_sync")
    async_sleep = _Setting[Callable[[float], Awaitable[None]]]("_async")
    group_commit = _Setting[bool]("_async")
    worker_id = _Setting[str]("_leases")
    lease_ttl = _Setting[float]("_leases")
    heartbeat_interval = _Setting[float]("_leases")

    def __repr__(self) -> str:
        """``Engine('spec-name', journal=SqliteJournal('/abs/fsm-runner.db', ...))``.

        The journal is shown whether it was passed or is the engine's own default, so where
        runs go is never a guess.
        """
        return f"Engine({self.spec.name!r}, journal={self.journal!r})"

    def with_journal(self, journal: Journal) -> Engine:
        """Return an engine like this one that journals to ``journal``."""
        settings = {name: getattr(self, name) for name in _SETTINGS}
        return Engine(self.spec, journal=journal, **settings)

    @property
    def telemetry(self) -> Telemetry | None:
        """The OpenTelemetry spans and instruments of its runs, or ``None`` (off)."""
        return self._core.telemetry

    def close(self) -> None:
        """Stop the heartbeat and close the event loop of async handlers in sync runs.

        Runs started holding (``start(claim=True)``) and never driven are let go of (an abort
        requested meanwhile is carried out here). A journal passed to the engine is the host's
        to close; the default one the engine opened itself (no ``journal`` given) is closed
        here, after everything else.
        """
        self._worker.let_go_undriven()
        self._starts.close()
        self._leases.stop()
        self._async.close()
        self._sync.close()
        if self._core.telemetry is not None:
            self._core.telemetry.forget(self._core)
        if self._close_journal is not None:
            self._close_journal()

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
        takeover_dead: bool = True,
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
            idle_wait: seconds to wait when no run is runnable before looking again (less
                when the journal tells that work may have come, ``Journal.idle``: a signal).
            exit_when_idle: return as soon as no run is runnable.
            takeover_dead: take over at once (not when their leases expire) the runs held by
                a worker that is gone: a process of this host that died, or on PostgreSQL a
                worker whose database session ended. Looked at every half second at most.

        Returns:
            How many runs this worker took.
        """
        return self._worker.work(
            max_runs=max_runs,
            stop=stop or threading.Event(),
            idle_wait=idle_wait,
            exit_when_idle=exit_when_idle,
            takeover_dead=takeover_dead,
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
        return self._worker.recover(limit=limit)

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
            run_id: the run's id, which must follow the rule of run ids
                (:mod:`fsm_runner.run_ids`); a new random one when not given.
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
            InvalidRunIdError: ``run_id`` breaks the rule of run ids; nothing was written.
            PayloadError: the input or context is not standard JSON (not serialisable, NaN or
                Infinity, nested more than 255 levels, a lone surrogate) or is over
                ``max_payload_bytes``; nothing was written.
            JournalError: the journal failed; nothing was written.
        """
        return self._starts.start(input, run_id, context, parent_run_id, claim)

    async def astart(
        self,
        input: Any = None,  # noqa: A002 - as in start()
        *,
        run_id: str | None = None,
        context: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        claim: bool = False,
    ) -> str:
        """Async :meth:`start`: written off the event loop, in one transaction with the loop turn's.

        Returns once durable; what a cancelled call leaves: :mod:`fsm_runner.engine.starts`.
        """
        return await self._starts.astart(input, run_id, context, parent_run_id, claim)

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
        return self._starts.start_many(inputs, parent_run_id, claim)

    async def astart_many(
        self, inputs: Iterable[Any], *, parent_run_id: str | None = None, claim: bool = False
    ) -> list[str]:
        """Async :meth:`start_many`: one transaction, written off the event loop."""
        return await self._starts.astart_many(inputs, parent_run_id, claim)

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
        return self._sync.step(run_id)

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
        return self._sync.run(run_id, max_steps=max_steps)

    async def astep(self, run_id: str) -> TransitionRecord | None:
        """Async :meth:`step`: async handlers are awaited (and cancelled at their deadline)."""
        return await self._async.astep(run_id)

    async def arun(self, run_id: str, *, max_steps: int | None = None) -> RunRecord:
        """Async :meth:`run`: runs on one event loop share it (and their commits' transactions).

        With ``group_commit``, the transitions of all runs whose phases ended in the same turn
        of the loop are committed in one journal transaction.
        """
        return await self._async.arun(run_id, max_steps=max_steps)

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
        return self._sync.rewind(run_id, state)

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
        return self._sync.send(run_id, event, output=output)

    def signal(
        self, run_id: str, name: Any, payload: Any = None, *, signal_id: str | None = None
    ) -> SignalRecord:
        """Send a signal to a run: journaled in its mailbox, consumed when it waits for it.

        Consumed in arrival order, each exactly once, when the run waits where it is accepted
        (at once here if it waits now and nobody holds it; else by whoever holds it then: a
        worker is woken for it); the transition carries the payload as its output. A repeated
        ``signal_id`` writes nothing and returns the first signal (see :mod:`.waits`).

        Returns:
            The signal as it stands: ``consumed`` (``consumed_seq``) or ``pending``.

        Raises:
            RunNotFoundError: no such run.
            RunTerminalError: the run has ended (and no signal with ``signal_id`` was sent).
            InvalidTransitionError: no waiting state of the run's spec accepts a signal of
                that name; nothing was written.
            PayloadError: the payload is not JSON the journal stores; nothing was written.
        """
        core = self._core
        core.check_json(run_id, "signal payload", payload)
        return waits.signal_run(
            core.journal,
            run_id,
            name,
            payload,
            signal_id=signal_id,
            spec=core.spec,
            guards=core.guards,
            owner=f"{self._leases.worker_id}:signal",
        )

    async def asignal(
        self, run_id: str, name: Any, payload: Any = None, *, signal_id: str | None = None
    ) -> SignalRecord:
        """Async :meth:`signal`: the journal written off the event loop (:mod:`.starts`)."""
        send = functools.partial(self.signal, run_id, name, payload, signal_id=signal_id)
        return await self._starts.off_loop.call(send)

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
        return self._worker.abort(run_id, reason)

    async def aabort(self, run_id: str, reason: str) -> RunRecord:
        """Async :meth:`abort`: the journal written off the event loop (:mod:`.starts`)."""
        return await self._starts.off_loop.call(functools.partial(self.abort, run_id, reason))

    async def aload(self, run_id: str) -> RunRecord:
        """The run as stored now, read off the event loop (:meth:`Journal.load`)."""
        return await self._starts.off_loop.call(functools.partial(self.journal.load, run_id))
