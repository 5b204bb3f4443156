"""Property tests: random valid specs, random scripts, random crash points (the invariants of docs/design.md).

1. :class:`TestRandomRuns` plays a random script (events, statuses, overrun timeouts, handler
   failures, Ctrl-C, refused events, junk results, external events, aborts, rewinds) on a
   random spec with the real engine, on :class:`MemoryJournal` and on :class:`SqliteJournal`.
   After every move it checks the move against an independent oracle (built from
   ``spec.edges``, not from the engine) of where it must lead, or that it must be refused
   changing nothing, then invariants 1, 2, 5 and 8; at the end invariant 7, a refused spec
   change, and a fork at every seq; both journals must end with the same history.
2. :class:`TestCrashThenResume` kills the engine in the middle of a phase at a random point (a
   ``BaseException`` that is not an ``Exception``, which the engine does not journal; the dead
   engine's journal handle writes nothing more, so its lease stays behind as a killed
   process's would), reopens the journal as a new process would, resumes with a new engine
   under another worker id, and compares everything with an uninterrupted run of the same
   script: no completed phase ran again, the phase in progress ran exactly once more (its
   recorded side effect too, only if the crash caught it in flight), and the run ended
   exactly where the uninterrupted one did.
3. :class:`TestSpecChange` resumes a run under a changed spec (``allow_spec_change``) and
   checks every move and every fork the same way (its two explicit examples are the engine
   bugs it found, now fixed: a spec change starting an iteration, forks before a change).

Set ``FSM_PROPERTIES_EXAMPLES=N`` for more examples per property, or
``FSM_PROPERTIES_PROFILE=fsm-properties-thorough`` for a long hunt (3000 each).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, assume, example, given, note, settings
from hypothesis import event as hypothesis_event

from fsm_runner import (
    RETURN,
    Engine,
    InvalidTransitionError,
    MachineSpec,
    MemoryJournal,
    PhaseResult,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    RunTerminalError,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.engine import fork_run
from fsm_runner.exceptions import (
    HandlerResultError,
    PhaseError,
    SpecMismatchError,
)
from fsm_runner.records import RunRecord
from fsm_runner.replay import check_journal, journal_specs, replay_run
from fsm_runner.rules.reducer import advance, begin
from fsm_runner.testing import FakeClock
from tests.helpers import snapshot
from tests.strategies import (
    BAD_EVENT,
    GUARDS,
    NEXT,
    RECOVERED,
    SERVER_UNREACHABLE,
    SYSTEM_ERROR,
    TIMEOUT,
    USER_ABORTED,
    Case,
    CrashCase,
    Move,
    SpecChangeCase,
    cases,
    crash_cases,
    spec_change_cases,
)

settings.register_profile(
    "fsm-properties",
    max_examples=int(os.environ.get("FSM_PROPERTIES_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fsm-properties-thorough",
    parent=settings.get_profile("fsm-properties"),
    max_examples=3000,
)
PROFILE = settings.get_profile(os.environ.get("FSM_PROPERTIES_PROFILE", "fsm-properties"))

RUN_ID = "run-1"
RETRIED = RunEvent.RETRIED.value
REWOUND = RunEvent.REWOUND.value
INTERRUPTED = RunEvent.INTERRUPTED.value
SPEC_CHANGED = RunEvent.SPEC_CHANGED.value
EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)


class Crash(BaseException):
    """The process dies here: not an ``Exception``, so the engine journals nothing for it."""


class Boom(Exception):
    """A handler failure (journaled as RETRIED or SYSTEM_ERROR)."""


# -- the world the handlers live in ----------------------------------------------------------


class World:
    """Plays a script: each phase handler call makes the next move; counts what ran.

    The cursor, like the outside world, survives a crash: the move a crashed phase was about to
    make is made by the phase when it runs again.
    """

    def __init__(
        self,
        spec: MachineSpec,
        moves: tuple[Move, ...],
        *,
        crash_at: int | None = None,
        crash_where: str = "before_effect",
    ) -> None:
        self.spec = spec
        self.moves = moves
        self.cursor = 0
        self.clock = FakeClock()  # the engine's clock (each engine, each process, has its own)
        #: handler calls by the run's seq when the phase started (one visit-attempt each)
        self.calls: Counter[int] = Counter()
        #: executions of each visit's recorded side effect, by visit
        self.effects: Counter[int] = Counter()
        self.handled = 0  # handler calls made
        self.crash_at = crash_at
        self.crash_where = crash_where
        self.crashed_at: tuple[int, int] | None = None  # (seq, visit) of the crashed phase
        self.on_crash: Callable[[], None] = lambda: None

    @property
    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return dict.fromkeys(self.spec.handler_names, self.handle)

    @property
    def remaining(self) -> int:
        return len(self.moves) - self.cursor

    def handler_moves_ahead(self) -> int:
        """How many moves from the cursor on are made by handlers, before an operator's."""
        count = 0
        for move in self.moves[self.cursor :]:
            if not move.by_handler:
                break
            count += 1
        return count

    def _crash_here(self, ctx: Any, where: str) -> None:
        if (
            self.crash_at is not None
            and self.crashed_at is None
            and where == self.crash_where
            and self.handled > self.crash_at
        ):
            self.crashed_at = (ctx.run.seq, ctx.run.visit_seq)
            self.on_crash()
            raise Crash(f"killed in {ctx.state!r} {where}")

    def _work(self, ctx: Any) -> str:
        self.effects[ctx.run.visit_seq] += 1
        self._crash_here(ctx, "in_effect")
        return "worked"

    def handle(self, ctx: Any) -> Any:
        self.handled += 1
        self.calls[ctx.run.seq] += 1
        self._crash_here(ctx, "before_effect")
        ctx.effect("work", lambda: self._work(ctx), idempotent=True)
        self._crash_here(ctx, "after_effect")
        move = self.moves[self.cursor]
        assert move.by_handler, f"a handler ran for operator move {move}"
        self.cursor += 1
        return self.make(move, ctx.state)

    def make(self, move: Move, state: str) -> Any:
        """What the handler does for ``move`` in ``state``."""
        if move.kind == "raise":
            raise Boom(f"boom at move {self.cursor - 1}")
        if move.kind == "interrupt":
            raise KeyboardInterrupt
        if move.kind == "bad":
            return BAD_EVENT
        if move.kind == "junk":
            return 42
        if move.kind == "status":
            return move.status
        if move.kind == "slow":
            self.clock.advance(1000.0)  # past any timeout
        event = move.pick(self.spec, state)
        if move.kind == "unjson":
            return PhaseResult(event, output={"a set": {1, 2}})
        if move.context or move.output is not None or move.tokens is not None:
            return PhaseResult(
                event,
                output=move.output,
                context=move.context or {},
                iteration={} if move.tokens is None else {"tokens_total": move.tokens},
            )
        return event


def operate(engine: Engine, run_id: str, spec: MachineSpec, move: Move) -> None:
    """An operator's move, between phases."""
    run = engine.journal.load(run_id)
    if move.kind == "send":
        engine.send(run_id, move.pick(spec, run.state), output=move.output)
    elif move.kind == "send_bad":
        engine.send(run_id, BAD_EVENT)
    elif move.kind == "abort":
        engine.abort(run_id, "operator abort")
    else:
        assert move.kind == "rewind"
        engine.rewind(run_id, rewind_target(engine.journal.transitions(run_id), move))


def rewind_target(transitions: Sequence[Any], move: Move) -> str:
    visited = sorted({str(t.to_state) for t in transitions})
    return visited[move.index % len(visited)]


#: What a move may raise out of the engine: a refusal (nothing written), or a Ctrl-C (journaled
#: as INTERRUPTED, then raised on).
RAISED = (InvalidTransitionError, PhaseError, KeyboardInterrupt)
OnMove = Callable[[Move, Any, "BaseException | None", Any], None]


def play(
    engine: Engine,
    run_id: str,
    world: World,
    *,
    mode: str = "step",
    on_move: OnMove | None = None,
    until: int | None = None,
) -> None:
    """Make the world's moves on the run until they run out (or ``until`` are made) or it ends.

    ``step`` makes one move per call; ``run`` lets :meth:`Engine.resume` make every handler
    move up to the next operator move. A refused move (``InvalidTransitionError``,
    ``PhaseError``) is a move made; so is a handler move in a state without handler (the step
    does nothing). ``on_move(move, row_before, raised, returned)`` is called after each move in
    ``step`` mode (and after each operator move).
    """
    journal = engine.journal
    while world.remaining and (until is None or world.cursor < until):
        before = journal.load(run_id)
        if before.ended:
            return
        move = world.moves[world.cursor]
        raised: BaseException | None = None
        returned: Any = None
        waiting = world.spec.state(before.state).handler is None
        try:
            if not move.by_handler:
                world.cursor += 1
                operate(engine, run_id, world.spec, move)
            elif waiting:
                world.cursor += 1
                returned = engine.step(run_id) if mode == "step" else engine.resume(run_id)
            elif mode == "step":
                returned = engine.step(run_id)
            else:
                engine.resume(run_id, max_steps=world.handler_moves_ahead())
        except RAISED as exc:
            raised = exc
        if on_move is not None and (mode == "step" or not move.by_handler):
            on_move(move, before, raised, returned)


# -- the oracle --------------------------------------------------------------------------------


@attrs.frozen
class Commit:
    """The move must commit one transition on ``event`` to ``dest``."""

    event: str
    dest: str
    in_place: bool = False  # an abort where the state has no USER_ABORTED exit


@attrs.frozen
class Refusal:
    """The move must be refused with exactly ``error`` and change nothing."""

    error: type[BaseException]


@attrs.frozen
class Nothing:
    """The step does nothing: its state has no handler (it waits for an external event)."""


def resolve(spec: MachineSpec, run: Any, event: str) -> str | None:
    """Where ``event`` leads ``run`` per the spec's candidate order; ``None`` if nowhere."""
    candidate = first_candidate(spec, run, event)
    if candidate is None:
        return None
    return run.return_to if candidate.dest == RETURN else candidate.dest


def first_candidate(spec: MachineSpec, run: Any, event: str) -> Any:
    """The candidate transition whose guards pass first, RETURN or not; ``None`` if none."""
    for candidate in spec.edges.get((run.state, event), ()):
        if all(GUARDS[g](run) for g in candidate.guards) and not any(
            GUARDS[g](run) for g in candidate.unless
        ):
            return candidate
    return None


def claims(spec: MachineSpec, run: Any, move: Move) -> bool:
    """Whether the engine takes the run's lease for ``move`` (adopting its spec, if it changed).

    Every step does (even in a state without handler), a rewind does, an external event does
    once the engine's machine has an edge for it (a RETURN's target is checked after); an abort
    by an operator does not go through the engine's claim.
    """
    if move.kind in ("abort", "send_bad"):
        return False
    if move.kind == "send":
        return first_candidate(spec, run, move.pick(spec, run.state)) is not None
    return True


def _to(event: str, dest: str | None) -> Commit | Refusal:
    return Refusal(InvalidTransitionError) if dest is None else Commit(event, dest)


def expect(
    spec: MachineSpec, run: Any, move: Move, transitions: Sequence[Any]
) -> Commit | Refusal | Nothing:
    """What ``move`` must do to ``run`` (an oracle built from ``spec.edges``, not the engine)."""
    state = spec.state(run.state)
    kind = move.kind

    def failure(event: str, refused: type[BaseException]) -> Commit | Refusal:
        if event == TIMEOUT and (run.state, TIMEOUT) not in spec.edges:
            event = SYSTEM_ERROR
        if (run.state, event) not in spec.edges:
            return Refusal(refused)
        return _to(event, resolve(spec, run, event))

    if kind == "send_bad":
        return Refusal(InvalidTransitionError)
    if kind == "send":
        return _to(move.pick(spec, run.state), resolve(spec, run, move.pick(spec, run.state)))
    if kind == "abort":
        if (run.state, USER_ABORTED) in spec.edges:
            return _to(USER_ABORTED, resolve(spec, run, USER_ABORTED))
        return Commit(USER_ABORTED, run.state, in_place=True)
    if kind == "rewind":
        return Commit(REWOUND, rewind_target(transitions, move))
    # a phase handler's move
    if state.handler is None:
        return Nothing()
    if kind == "interrupt":
        return Commit(INTERRUPTED, run.state)
    if kind == "raise":
        if state.retry is not None and run.attempt < state.retry.max_attempts:
            return Commit(RETRIED, run.state)
        return failure(SYSTEM_ERROR, PhaseError)
    if kind in ("junk", "unjson"):
        return failure(SYSTEM_ERROR, HandlerResultError)
    if kind == "bad":
        return Refusal(InvalidTransitionError)
    if kind == "status":
        return _to(
            spec.status_event(move.status), resolve(spec, run, spec.status_event(move.status))
        )
    if move.tokens is not None and run.iteration == 0 and not state.starts_iteration:
        return failure(SYSTEM_ERROR, HandlerResultError)  # no iteration to update
    if kind == "slow" and state.timeout is not None:
        return failure(TIMEOUT, PhaseError)
    event = move.pick(spec, run.state)
    guarded = run
    if move.context:  # guards read the run with the phase's context update merged in
        guarded = attrs.evolve(run, context={**run.context, **move.context})
    return _to(event, resolve(spec, guarded, event))


# -- invariants ------------------------------------------------------------------------------


class Checker:
    """Checks one run move by move: the oracle's verdict, then the invariants.

    Args:
        journal: the run's journal.
        run_id: the run.
        specs: the specs the run may be under; the first is the engine's to begin with.
    """

    def __init__(self, journal: Any, run_id: str, *specs: MachineSpec) -> None:
        self.journal = journal
        self.run_id = run_id
        self.specs = {spec.spec_hash: spec for spec in specs}
        self.engine_spec = specs[0]
        #: the run row right after each seq, as the engine committed it (a listener)
        self.rows: dict[int, Any] = {}
        self.last: Any = None  # the snapshot after the last move

    def listener(self, transition: Any, run: Any) -> None:
        if transition.run_id == self.run_id:
            self.rows[transition.seq] = run

    def started(self) -> None:
        self.check_invariants()
        self.last = snapshot(self.journal, self.run_id)

    def on_move(self, move: Move, before: Any, raised: BaseException | None, returned: Any) -> None:
        self.check_move(move, before, raised, returned)
        self.check_invariants()
        self.last = snapshot(self.journal, self.run_id)

    def check_invariants(self) -> None:
        """Invariants 1, 2, 5 and 8 on the run as it stands."""
        journal, run_id = self.journal, self.run_id
        run = journal.load(run_id)
        transitions = list(journal.transitions(run_id))
        assert [t.seq for t in transitions] == list(range(len(transitions)))  # (2) gapless
        assert (run.seq, run.state) == (transitions[-1].seq, transitions[-1].to_state)  # (1)
        assert run.spec_hash in self.specs  # (5) the spec it runs under, kept by the journal
        assert journal.spec_json(run.spec_hash) == self.specs[run.spec_hash].to_json()
        assert replay_run(journal, run_id).run.state == run.state  # (8) no ReplayMismatchError
        assert stable_row(run) == stable_row(self.rows[run.seq])  # stored as the engine built it
        assert run.lease_owner is None  # every move gives the lease back

    def check_move(
        self, move: Move, before: Any, raised: BaseException | None, returned: Any
    ) -> None:
        """The move did what the oracle says: one transition to the right place, or none."""
        journal, run_id = self.journal, self.run_id
        spec = self.engine_spec
        adopting = before.spec_hash != spec.spec_hash and claims(spec, before, move)
        row = before
        adoption: list[tuple[Any, ...]] = []
        if adopting:  # the engine's claim moves the run to its spec first, as the same visit
            row = attrs.evolve(before, seq=before.seq + 1, spec_hash=spec.spec_hash, error=None)
            adoption = [(before.state, SPEC_CHANGED, before.state)]
        deciding = self.specs[before.spec_hash] if move.kind == "abort" else spec
        expected = expect(deciding, row, move, self.last[1])
        note(f"{move} in {before.state!r} (attempt {before.attempt}): {expected}, {raised!r}")
        new = [
            (t.from_state, t.event, t.to_state)
            for t in journal.transitions(run_id, from_seq=before.seq + 1)
        ]
        if isinstance(expected, (Nothing, Refusal)):
            assert new == adoption
            if not adopting:
                assert snapshot(journal, run_id) == self.last  # (6) nothing changed
            if isinstance(expected, Nothing):
                assert raised is None
                assert returned is None  # step() says the state waits
                return
            assert type(raised) is expected.error, f"{expected.error.__name__}: {raised!r}"
            assert getattr(raised, "run_id", None) == run_id
            assert run_id in str(raised)
            assert "\n" not in str(raised)
            if isinstance(raised, InvalidTransitionError):
                assert raised.state == before.state
            return
        if expected.event == INTERRUPTED:  # journaled, then raised on: Ctrl-C stops the caller
            assert type(raised) is KeyboardInterrupt
        else:
            assert raised is None, f"expected {expected}, raised: {raised!r}"
        assert new == [*adoption, (before.state, expected.event, expected.dest)]
        run = journal.load(run_id)
        dest = deciding.state(expected.dest)
        assert run.status is (RunLifecycle.ABORTED if expected.in_place else dest.final_outcome)
        if expected.event in (RETRIED, INTERRUPTED):  # the same visit, its next attempt
            assert run.attempt == row.attempt + 1
            assert run.visit_seq == row.visit_seq
            assert run.return_to == row.return_to

    def check_forks(self) -> None:
        """A fork at any seq starts as the run stood then, with its history up to there."""
        journal, run_id = self.journal, self.run_id
        run = journal.load(run_id)
        for at_seq in range(run.seq + 1):
            fork_id = f"{run_id}@{at_seq}"
            if at_seq == run.seq and run.ended:
                with pytest.raises(ValueError, match="had ended"):
                    fork_run(journal, run_id, at_seq=at_seq, new_run_id=fork_id)
                continue
            fork = fork_run(journal, run_id, at_seq=at_seq, new_run_id=fork_id)
            assert fork.forked_from == fork_id
            assert fork_view(fork) == fork_view(self.rows[at_seq])
            assert history(journal, fork_id) == history(journal, run_id)[: at_seq + 1]
        assert journal.load(run_id) == run  # the original is untouched
        assert check_journal(journal) == []  # and every fork replays


def check_terminal(spec: MachineSpec, engine: Engine, run_id: str) -> None:
    """(7) Terminal states have no exits and no handler; an ended run cannot be advanced."""
    for name in spec.terminal_states:
        assert spec.state(name).handler is None
        assert spec.events_from(name) == ()  # a wildcard source never includes one either
    journal = engine.journal
    if not journal.load(run_id).ended:
        return
    before = snapshot(journal, run_id)
    for attempt in (
        lambda: engine.step(run_id),
        lambda: engine.resume(run_id),
        lambda: engine.send(run_id, NEXT),
        lambda: engine.abort(run_id, "too late"),
        lambda: engine.rewind(run_id, spec.initial_leaf),
    ):
        with pytest.raises(RunTerminalError) as info:
            attempt()
        assert info.value.run_id == run_id
    assert snapshot(journal, run_id) == before


def check_spec_change_refused(spec: MachineSpec, journal: Any, run_id: str) -> None:
    """(5) An active run is not resumed under another spec; nothing changes."""
    if journal.load(run_id).ended:
        return
    other = attrs.evolve(spec, name="prop-changed")
    engine = Engine(
        other, handlers=dict.fromkeys(other.handler_names, _never), journal=journal, guards=GUARDS
    )
    before = snapshot(journal, run_id)
    try:
        with pytest.raises(SpecMismatchError) as info:
            engine.step(run_id)
    finally:
        engine.close()
    assert info.value.run_id == run_id
    assert snapshot(journal, run_id) == before


def _never(_ctx: Any) -> str:
    raise AssertionError("a handler ran under a refused spec")


# -- comparing runs ----------------------------------------------------------------------------


def _stable(value: Any) -> Any:
    """A result or error without its traceback (it names source lines)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k != "traceback"}
    return value


def stable_row(run: Any) -> Any:
    """The run row without what differs between two equal runs: times and lease bookkeeping."""
    return attrs.evolve(
        run,
        created_at=EPOCH,
        updated_at=EPOCH,
        lease_owner=None,
        lease_expires_at=None,
        lease_token=0,
        recoveries=0,
        error=_stable(run.error),
    )


def fork_view(run: Any) -> Any:
    """What a fork keeps of the row it was forked from."""
    return attrs.evolve(
        stable_row(run), run_id="", forked_from=None, parent_run_id=None, abort_reason=None
    )


def history(journal: Any, run_id: str) -> list[tuple[Any, ...]]:
    """Every transition, without times and lease tokens."""
    return [
        (t.seq, t.from_state, t.event, t.to_state, t.iteration, t.attempt, _stable(t.result))
        for t in journal.transitions(run_id)
    ]


def records(journal: Any, run_id: str) -> tuple[list[Any], list[Any]]:
    """The iteration records and effects, without times."""
    iterations = [
        attrs.evolve(i, started_at=None, completed_at=None, duration_ms=None)
        for i in journal.iterations(run_id)
    ]
    effects = sorted(
        (e.visit_seq, e.name, e.state, e.status.value, e.result, e.idempotency_key)
        for e in journal.effects(run_id)
    )
    return iterations, effects


@attrs.frozen
class Finished:
    """Everything a finished run left: its row, its journal, and what its handlers did."""

    row: Any
    history: list[tuple[Any, ...]]
    records: tuple[list[Any], list[Any]]
    calls: Counter[int]
    effects: Counter[int]


def finished(journal: Any, run_id: str, world: World) -> Finished:
    return Finished(
        stable_row(journal.load(run_id)),
        history(journal, run_id),
        records(journal, run_id),
        world.calls,
        world.effects,
    )


def make_engine(spec: MachineSpec, world: World, journal: Any, **options: Any) -> Engine:
    """An engine (a process) for the world's run, with a clock of its own."""
    clock = world.clock = FakeClock()
    return Engine(
        spec,
        handlers=world.handlers,
        journal=journal,
        guards=GUARDS,
        clock=clock,
        sleep=clock.sleep,
        **options,
    )


@contextlib.contextmanager
def journals() -> Iterator[list[tuple[str, Any]]]:
    """A fresh MemoryJournal and SqliteJournal (in a temporary file), closed afterwards."""
    with tempfile.TemporaryDirectory() as directory:
        memory, sqlite = MemoryJournal(), SqliteJournal(Path(directory) / "journal.db")
        try:
            yield [("memory", memory), ("sqlite", sqlite)]
        finally:
            memory.close()
            sqlite.close()


# -- 1. random runs ----------------------------------------------------------------------------


def play_checked(case: Case, journal: Any) -> Finished:
    """Play ``case`` on ``journal`` one move at a time, checking every move and invariant."""
    spec = case.spec
    world = World(spec, case.moves)
    checker = Checker(journal, RUN_ID, spec)
    engine = make_engine(spec, world, journal, listeners=[checker.listener])
    try:
        engine.start(run_id=RUN_ID)
        checker.started()
        play(engine, RUN_ID, world, on_move=checker.on_move)
        assert check_journal(journal) == []  # (1, 2, 8) for the whole journal, medium included
        check_terminal(spec, engine, RUN_ID)
        check_spec_change_refused(spec, journal, RUN_ID)
        hypothesis_event(f"run ended {journal.load(RUN_ID).status.value}")
        result = finished(journal, RUN_ID, world)
        checker.check_forks()
        return result
    finally:
        engine.close()


class TestRandomRuns:
    """Random specs and scripts: every move does what the spec says, or is refused changing nothing."""

    @PROFILE
    @given(case=cases())
    def test_invariants_hold_after_every_move(self, case):
        with journals() as both:
            outcomes = {kind: play_checked(case, journal) for kind, journal in both}
        assert outcomes["memory"] == outcomes["sqlite"]  # one contract, two implementations


# -- 2. crash, then resume ---------------------------------------------------------------------


class DyingJournal:
    """The journal as the crashed process sees it: once it dies, it writes nothing more.

    A killed process does not release its lease (the engine's ``finally`` would); the calls the
    dead engine still makes are recorded and not carried out.
    """

    def __init__(self, journal: Any) -> None:
        self._journal = journal
        self.dead = False
        self.after_death: list[str] = []

    def die(self) -> None:
        self.dead = True

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._journal, name)
        if not self.dead or not callable(attribute):
            return attribute

        def not_carried_out(*_args: Any, **_kwargs: Any) -> None:
            self.after_death.append(name)

        return not_carried_out


def play_uninterrupted(case: CrashCase) -> tuple[Finished, list[Any]]:
    """The run as it goes without a crash; also its row after each number of moves made."""
    world = World(case.spec, case.moves)
    with MemoryJournal() as journal:
        engine = make_engine(case.spec, world, journal)
        try:
            engine.start(run_id=RUN_ID)
            rows = [stable_row(journal.load(RUN_ID))]

            def on_move(*_args: Any) -> None:
                rows.append(stable_row(journal.load(RUN_ID)))

            play(engine, RUN_ID, world, on_move=on_move)
            return finished(journal, RUN_ID, world), rows
        finally:
            engine.close()


def crash_and_resume(
    case: CrashCase, journal: Any, reopen: Callable[[], Any], reference: Finished, rows: list[Any]
) -> None:
    """Play ``case``, killing the process where it says; resume in a new one; compare."""
    spec = case.spec
    total = reference.calls.total()
    world = World(
        spec,
        case.moves,
        crash_at=case.crash_at % total if total else None,
        crash_where=case.crash_where,
    )
    dying = DyingJournal(journal)
    world.on_crash = dying.die
    # A tiny lease, never renewed: by the time a new process looks, the lease has expired.
    crashed = make_engine(
        spec, world, dying, worker_id="crashed-worker", lease_ttl=1e-6, heartbeat_interval=3600
    )
    try:
        crashed.start(run_id=RUN_ID)
        with contextlib.suppress(Crash):
            play(crashed, RUN_ID, world, mode=case.resume_with)
    finally:
        crashed.close()
    # its let-go only: a release, or a park where the run waits (read first), never carried out
    assert set(dying.after_death) <= {"release", "load", "park"}, dying.after_death
    if world.crashed_at is None:  # no handler ran, or none ran its effect after the point
        hypothesis_event("no crash")
        assert finished(journal, RUN_ID, world) == reference
        return
    hypothesis_event(f"crashed {case.crash_where}")
    crash_seq, crash_visit = world.crashed_at

    # What the dead process left: exactly the moves made before the crash, and its lease.
    left = journal.load(RUN_ID)
    assert left.seq == crash_seq
    assert left.lease_owner == "crashed-worker"
    assert left.lease_expires_at is not None
    assert stable_row(left) == rows[world.cursor]
    assert history(journal, RUN_ID) == reference.history[: crash_seq + 1]

    journal = reopen()  # a new process
    resumer = make_engine(spec, world, journal, worker_id="resuming-worker")
    try:
        play(resumer, RUN_ID, world, mode=case.resume_with)
    finally:
        resumer.close()
    assert journal.load(RUN_ID).recoveries == 1  # the dead worker's lease was taken over
    resumed = finished(journal, RUN_ID, world)
    assert resumed.row == reference.row
    assert resumed.history == reference.history
    assert resumed.records == reference.records
    # (3) A phase whose outcome was journaled never ran again; the one in progress ran once more.
    assert resumed.calls == reference.calls + Counter({crash_seq: 1})
    if case.crash_where == "in_effect":  # caught in flight; declared idempotent: done again
        assert resumed.effects == reference.effects + Counter({crash_visit: 1})
    else:  # recorded done before the crash (never repeated), or not started (done once, after)
        assert resumed.effects == reference.effects


class TestCrashThenResume:
    """A run killed in a phase and resumed by a new process ends as if never killed."""

    @PROFILE
    @given(case=crash_cases())
    @example(  # RETURN after a crash in the recovery state: it still knows where to return to
        case=CrashCase(
            spec=MachineSpec(
                "prop",
                [
                    State("p0", handler="p0"),
                    State("recovering", handler="recovering"),
                    State("done", terminal=True),
                ],
                [
                    Transition("p0", NEXT, "done"),
                    Transition("p0", SERVER_UNREACHABLE, "recovering"),
                    Transition("recovering", RECOVERED, RETURN),
                ],
            ),
            moves=(Move(event=SERVER_UNREACHABLE), Move(event=RECOVERED), Move(event=NEXT)),
            crash_at=1,
            crash_where="after_effect",
        )
    )
    @example(  # a retry policy exhausting: the crashed last attempt is the last attempt again
        case=CrashCase(
            spec=MachineSpec(
                "prop",
                [
                    State("p0", handler="p0", retry=RetryPolicy(max_attempts=2)),
                    State("done", terminal=True),
                    State("failed", terminal=True, outcome="failed"),
                ],
                [Transition("p0", NEXT, "done"), Transition("*", SYSTEM_ERROR, "failed")],
            ),
            moves=(Move("raise"), Move("raise"), Move(event=NEXT)),
            crash_at=1,
            crash_where="before_effect",
            resume_with="step",
        )
    )
    def test_resumed_run_ends_like_an_uninterrupted_one(self, case):
        reference, rows = play_uninterrupted(case)
        assume(reference.calls.total() > 0)  # a phase must run for the process to die in it
        with MemoryJournal() as memory:
            crash_and_resume(case, memory, lambda: memory, reference, rows)
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "journal.db"
            opened = [SqliteJournal(path)]

            def reopen() -> SqliteJournal:
                opened[0].close()
                opened.append(SqliteJournal(path))
                return opened[-1]

            try:
                crash_and_resume(case, opened[0], reopen, reference, rows)
            finally:
                opened[-1].close()


# -- 3. a run that goes on under a changed spec ------------------------------------------------


def play_changed(case: SpecChangeCase, journal: Any) -> Checker:
    """Play ``case.before`` under ``case.spec``, then ``case.after`` under ``case.changed``.

    The second engine has ``allow_spec_change=True``: its first claim of the run journals
    ``SPEC_CHANGED``. Every move is checked against the oracle, under the spec deciding it.
    """
    world = World(case.spec, case.before + case.after)
    checker = Checker(journal, RUN_ID, case.spec, case.changed)
    engine = make_engine(case.spec, world, journal, listeners=[checker.listener])
    try:
        engine.start(run_id=RUN_ID)
        checker.started()
        play(engine, RUN_ID, world, on_move=checker.on_move, until=len(case.before))
    finally:
        engine.close()
    world.spec = checker.engine_spec = case.changed
    engine = make_engine(
        case.changed, world, journal, listeners=[checker.listener], allow_spec_change=True
    )
    try:
        play(engine, RUN_ID, world, on_move=checker.on_move)
    finally:
        engine.close()
    changed = any(t.event == SPEC_CHANGED for t in journal.transitions(RUN_ID))
    hypothesis_event(f"spec changed: {changed}")
    assert check_journal(journal) == []
    return checker


# The smallest runs that showed the two engine bugs these properties found (now fixed): a
# SPEC_CHANGED starting an iteration, and fork_run replaying before a change with the new spec.
_ITERATING = MachineSpec(
    "prop",
    [State("p0", handler="p0", starts_iteration=True), State("done", terminal=True)],
    [Transition("p0", NEXT, "done")],
)
_FORKED = MachineSpec(
    "prop",
    [State("p0", handler="p0"), State("p1", handler="p1"), State("done", terminal=True)],
    [
        Transition("p0", NEXT, "p1"),
        Transition("p1", NEXT, "done"),
        Transition("p0", "SKIP", "p1"),
    ],
)


def _described(spec: MachineSpec, name: str, *, drop: int | None = None) -> MachineSpec:
    """``spec`` with state ``name`` described anew (and transition ``drop`` left out)."""
    states = [attrs.evolve(s, description="changed") if s.name == name else s for s in spec.states]
    kept = [t for i, t in enumerate(spec.transitions) if i != drop]
    return MachineSpec(spec.name, states, kept)


class TestSpecChange:
    """A run resumed under a changed spec (``allow_spec_change``) keeps every invariant."""

    @PROFILE
    @given(case=spec_change_cases())
    @example(
        case=SpecChangeCase(
            _ITERATING, _described(_ITERATING, "p0"), before=(), after=(Move(event=NEXT),)
        )
    )
    def test_every_move_under_the_changed_spec(self, case):
        with journals() as both:
            for _kind, journal in both:
                play_changed(case, journal)

    @PROFILE
    @given(case=spec_change_cases())
    @example(
        case=SpecChangeCase(
            _FORKED,
            _described(_FORKED, "p1", drop=2),  # SKIP is gone from the new spec
            before=(Move(event="SKIP"),),
            after=(Move("bad"),),  # refused, but the claim has adopted the new spec
        )
    )
    def test_forks_of_a_run_that_changed_spec(self, case):
        with journals() as both:
            for _kind, journal in both:
                play_changed(case, journal).check_forks()


# -- 4. the reducer ----------------------------------------------------------------------------

#: Row fields the reducer does not derive: what the transitions do not say (identity, input,
#: origin, a pending abort request, the lease, recoveries). Every other field, one added later
#: included, must be reproduced from the transitions alone.
NOT_DERIVED = frozenset(
    {
        "run_id",
        "machine",
        "input",
        "created_at",
        "parent_run_id",
        "forked_from",
        "abort_reason",
        "lease_owner",
        "lease_expires_at",
        "lease_token",
        "recoveries",
    }
)
DERIVED = tuple(field.name for field in attrs.fields(RunRecord) if field.name not in NOT_DERIVED)
REDUCER_EXAMPLES = int(os.environ.get("FSM_PROPERTIES_EXAMPLES", "30"))


def derived(row: RunRecord) -> dict[str, Any]:
    """The fields of ``row`` the reducer derives."""
    return {name: getattr(row, name) for name in DERIVED}


def reduce_run(journal: Any, run_id: str) -> list[RunRecord]:
    """Every row of the run, derived by the reducer from its stored transitions alone.

    How each transition is read (its kind) is replay's reading; the rows are the reducer's.
    """
    run = journal.load(run_id)
    timeline = list(journal.transitions(run_id))
    specs = journal_specs(journal)
    kinds = [step.kind for step in replay_run(journal, run_id).steps]
    changes = [t for t in timeline if t.event == SPEC_CHANGED]
    first_hash = changes[0].result["output"]["from_spec"] if changes else run.spec_hash
    rows = [begin(specs(first_hash), attrs.evolve(run, spec_hash=first_hash), timeline[0])]
    for transition, kind in zip(timeline[1:], kinds[1:], strict=True):
        prev = rows[-1]
        # a spec change is read under the spec it changes to, as the engine that adopts it does
        under = transition.result["output"]["to_spec"] if kind == "spec_change" else prev.spec_hash
        rows.append(advance(specs(under), prev, transition, kind))
    return rows


@contextlib.contextmanager
def three_journals(postgres_server: Any) -> Iterator[list[tuple[str, Any]]]:
    """A fresh MemoryJournal, SqliteJournal and PostgresJournal, closed (and emptied) after."""
    from fsm_runner.journal.postgres import PostgresJournal

    schema = postgres_server.take()
    try:
        with journals() as both, PostgresJournal(postgres_server.url, schema=schema) as postgres:
            yield [*both, ("postgres", postgres)]
    finally:
        postgres_server.give_back(schema)


def play_recorded(case: SpecChangeCase, journal: Any) -> tuple[list[RunRecord], list[RunRecord]]:
    """Play ``case`` (``before`` under its spec, ``after`` under the changed one).

    Returns:
        The rows the engine committed (its listeners' view) and the run row as the journal
        stored it after the start and after every move.
    """
    committed: list[RunRecord] = []
    stored: list[RunRecord] = []
    world = World(case.spec, case.before + case.after)

    def listener(_transition: Any, run: RunRecord) -> None:
        committed.append(run)

    def on_move(*_args: Any) -> None:
        stored.append(journal.load(RUN_ID))

    engine = make_engine(case.spec, world, journal, listeners=[listener])
    try:
        engine.start(run_id=RUN_ID)
        stored.append(journal.load(RUN_ID))
        play(engine, RUN_ID, world, on_move=on_move, until=len(case.before))
    finally:
        engine.close()
    world.spec = case.changed
    engine = make_engine(case.changed, world, journal, listeners=[listener], allow_spec_change=True)
    try:
        play(engine, RUN_ID, world, on_move=on_move)
    finally:
        engine.close()
    return committed, stored


class TestReducer:
    """The reducer reproduces every run row the engine stored, on every journal (invariant 8)."""

    @settings(PROFILE, max_examples=REDUCER_EXAMPLES)
    @given(case=spec_change_cases())
    @example(  # bare events: the engine's plain step (its hot path), before and after a change
        case=SpecChangeCase(
            _FORKED,
            _described(_FORKED, "p1"),
            before=(Move(event=NEXT),),
            after=(Move(event=NEXT),),
        )
    )
    def test_every_stored_row_is_the_reducers(self, case, postgres_server):
        histories = {}
        with three_journals(postgres_server) as all_three:
            for kind, journal in all_three:
                committed, stored = play_recorded(case, journal)
                rows = reduce_run(journal, RUN_ID)
                assert [row.seq for row in rows] == list(range(len(rows)))
                for row in committed + stored:  # every row the engine wrote, as written
                    assert derived(rows[row.seq]) == derived(row), (kind, row.seq)
                last = journal.load(RUN_ID)
                assert rows[-1].seq == last.seq
                assert replay_run(journal, RUN_ID).run == last  # replay's last row: all of it
                histories[kind] = [derived(stable_row(row)) for row in rows]
        assert histories["memory"] == histories["sqlite"] == histories["postgres"]
