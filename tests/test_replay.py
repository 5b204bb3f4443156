"""Replay: a run's journal, walked through its spec, reproduces the run row exactly (invariant 8)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
from collections import deque
from unittest import mock

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_runner import (
    RETURN,
    Engine,
    Journal,
    MachineSpec,
    MemoryJournal,
    PhaseResult,
    PhaseStatus,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    RunRecord,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner import replay as replay_module
from fsm_runner.exceptions import JournalError, ReplayMismatchError, SpecError
from fsm_runner.presets.agent_loop import agent_loop_engine
from fsm_runner.presets.subphases import SUBPHASE_NAMES, SUBPHASES
from fsm_runner.replay import (
    Replay,
    ReplayStep,
    check_journal,
    journal_specs,
    replay,
    replay_run,
    state_at,
    verify,
)
from fsm_runner.testing import FakeClock, ScriptedHandler, throwaway_journal
from tests.fake_services import (
    FakeAgent,
    FakeFeedback,
    FakeSnapshotter,
    FakeVerifier,
    agent_result,
    failing_report,
    passing_report,
)
from tests.helpers import FOUND, LOST, NEXT, iteration_loop_spec, linear_spec, nested_spec

SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
USER_ABORTED = RunEvent.USER_ABORTED.value
INTERRUPTED = RunEvent.INTERRUPTED.value
RETRIED = RunEvent.RETRIED.value
REWOUND = RunEvent.REWOUND.value
PHASE_COMPLETED = RunEvent.PHASE_COMPLETED.value
AGENT_INPUT = {"task": "make the tests pass", "workspace": "/work/ws"}


# -- helpers ---------------------------------------------------------------------------------


class Held:
    """A listener keeping the run row the journal held right after each commit, by seq."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.rows: dict[str, dict[int, RunRecord]] = {}

    def __call__(self, transition, _run) -> None:
        row = self.journal.load(transition.run_id)
        assert row.seq == transition.seq
        assert row.lease_token == transition.lease_token  # written under the lease it held
        # Who held the lease then, and until when, is not journaled: replay cannot know it.
        row = attrs.evolve(row, lease_owner=None, lease_expires_at=None)
        self.rows.setdefault(transition.run_id, {})[transition.seq] = row


def engine_for(spec, journal, handlers, **options) -> tuple[Engine, Held]:
    held = Held(journal)
    engine = Engine(spec, handlers=handlers, journal=journal, listeners=[held], **options)
    return engine, held


def spec_of(journal, run):
    return MachineSpec.from_json(journal.spec_json(run.spec_hash))


def assert_replays(journal, run_id, held: Held | None = None) -> Replay:
    """The run replays exactly, at its end and (with ``held``) at every seq it went through."""
    run = journal.load(run_id)
    specs = journal_specs(journal)
    spec = specs(run.spec_hash)
    timeline = journal.transitions(run_id)
    result = replay(spec, run, timeline, specs=specs)
    assert result.run == run  # every field, not only the derived ones
    assert [step.seq for step in result.steps] == list(range(run.seq + 1))
    assert verify(spec, run, timeline, specs=specs) == []
    assert replay_run(journal, run_id) == result
    if held is not None:
        rows = held.rows[run_id]
        assert sorted(rows) == list(range(run.seq + 1))
        for step in result.steps:
            then = rows[step.seq]
            if step.seq < run.seq:  # an abort requested then is not journaled: not replayed
                then = attrs.evolve(then, abort_reason=None)
            assert step.run == then, f"seq {step.seq}"
            assert state_at(spec, run, timeline, step.seq, specs=specs) == then
            # the timeline up to that seq is enough, as fork reads it
            partial = journal.transitions(run_id, to_seq=step.seq)
            assert state_at(spec, run, partial, step.seq, specs=specs) == then
    return result


def kinds(result: Replay) -> list[str]:
    return [step.kind for step in result.steps]


def recorder(result=NEXT):
    """A handler returning ``result`` (or ``result(ctx)``)."""

    def handler(ctx):
        return result(ctx) if callable(result) else result

    return handler


def loop_engine(journal, *, passes_on: int, limit: int = 5):
    def verify_phase(ctx):
        passed = ctx.iteration >= passes_on
        return PhaseResult(
            RunEvent.VERIFY_PASSED if passed else RunEvent.VERIFY_FAILED_RETRYABLE,
            iteration={"passed": passed},
            context={"last_verified": ctx.iteration},
        )

    return engine_for(
        iteration_loop_spec(),
        journal,
        {
            "build": recorder(lambda ctx: PhaseResult("BUILT", iteration={"model": "m"})),
            "verify": verify_phase,
            "feedback": recorder(lambda ctx: PhaseResult("FEEDBACK_READY", output="fix it")),
        },
        guards={"iterations_left": lambda run: run.iteration < limit},
    )


def retry_spec(*, max_attempts: int = 3, starts_iteration: bool = False) -> MachineSpec:
    return MachineSpec(
        "retrying",
        [
            State(
                "calling",
                handler="call",
                retry=RetryPolicy(max_attempts=max_attempts, wait_initial=0.1),
                starts_iteration=starts_iteration,
            ),
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [Transition("calling", NEXT, "done"), Transition("calling", SYSTEM_ERROR, "failed")],
    )


def nested_handlers(**overrides):
    handlers = {name: recorder(PhaseStatus.OK) for name in ("prepare", "a", "b", "c", "d")}
    handlers["recover"] = recorder(FOUND)
    handlers.update(overrides)
    return handlers


def lost_until(attempt: int):
    """LOST on every attempt before ``attempt``, then OK."""
    return recorder(lambda ctx: LOST if ctx.attempt < attempt else PhaseStatus.OK)


def no_exits_spec() -> MachineSpec:
    """a -> b -> done, and no USER_ABORTED exit anywhere."""
    return MachineSpec(
        "bare",
        [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
        [Transition("a", NEXT, "b"), Transition("b", NEXT, "done")],
    )


def agent_engine(journal, *, verifier=None, agent=None, snapshotter=None, listeners=()):
    return agent_loop_engine(
        journal=journal,
        agent=agent or FakeAgent(agent_result(1), agent_result(2), agent_result(3)),
        snapshotter=snapshotter or FakeSnapshotter(),
        verifier=verifier or FakeVerifier(failing_report(), passing_report()),
        feedback=FakeFeedback(),
        listeners=listeners,
    )


def agent_run(journal) -> tuple[str, Held]:
    """An agent-loop run: one failed verification, then success (seqs 0..8, iteration 2)."""
    held = Held(journal)
    engine = agent_engine(journal, listeners=[held])
    run_id = engine.start(AGENT_INPUT)
    run = engine.run(run_id)
    assert (run.state, run.seq, run.iteration) == ("succeeded", 8, 2)
    return run_id, held


# -- good runs replay exactly ----------------------------------------------------------------


class TestLinearRuns:
    """Plain runs through a linear machine."""

    def test_linear_run(self, journal):
        engine, held = engine_for(
            linear_spec("a", "b", "c"), journal, dict.fromkeys("abc", recorder())
        )
        run_id = engine.start({"x": 1}, context={"seed": 7})
        run = engine.run(run_id)
        assert (run.state, run.status) == ("done", RunLifecycle.SUCCEEDED)
        result = assert_replays(journal, run_id, held)
        assert result.path == ("a", "b", "c", "done")
        assert kinds(result) == ["start", "transition", "transition", "transition"]
        assert result.run.context == {"seed": 7}

    def test_an_active_run_part_way(self, journal):
        engine, held = engine_for(
            linear_spec("a", "b", "c"), journal, dict.fromkeys("abc", recorder())
        )
        run_id = engine.start()
        engine.run(run_id, max_steps=2)
        assert assert_replays(journal, run_id, held).run.state == "c"

    def test_a_run_just_started(self, journal):
        engine, held = engine_for(linear_spec("a"), journal, {"a": recorder()})
        run_id = engine.start()
        result = assert_replays(journal, run_id, held)
        assert (result.run.seq, kinds(result)) == (0, ["start"])

    def test_context_updates_are_merged(self, journal):
        def phase(name, update):
            return recorder(lambda ctx: PhaseResult(NEXT, context=update, output={"by": name}))

        handlers = {
            "a": phase("a", {"k": 1, "shared": "a"}),
            "b": phase("b", {"shared": "b", "nested": {"list": [1, 2]}}),
            "c": recorder(),
        }
        engine, held = engine_for(linear_spec("a", "b", "c"), journal, handlers)
        run_id = engine.start(context={"seed": 0, "shared": "start"})
        run = engine.run(run_id)
        assert run.context == {"seed": 0, "shared": "b", "k": 1, "nested": {"list": [1, 2]}}
        assert_replays(journal, run_id, held)

    def test_waiting_state_and_send(self, journal):
        spec = MachineSpec(
            "approval",
            [
                State("drafting", handler="draft"),
                State("awaiting"),
                State("published", terminal=True),
            ],
            [
                Transition("drafting", NEXT, "awaiting"),
                Transition("awaiting", "APPROVED", "published"),
            ],
        )
        engine, held = engine_for(spec, journal, {"draft": recorder()})
        run_id = engine.start()
        engine.run(run_id)
        engine.send(run_id, "APPROVED", output={"by": "ops"})
        assert assert_replays(journal, run_id, held).run.state == "published"


class TestLoopsAndIterations:
    """starts_iteration states, guarded loops and reasons."""

    def test_loop_until_it_passes(self, journal):
        engine, held = loop_engine(journal, passes_on=3)
        run = engine.run(engine.start())
        assert (run.state, run.iteration) == ("succeeded", 3)
        result = assert_replays(journal, run.run_id, held)
        assert [step.run.iteration for step in result.steps][:3] == [1, 1, 1]
        assert result.run.context == {"last_verified": 3}

    def test_iteration_limit_spent_is_the_rows_error(self, journal):
        engine, held = loop_engine(journal, passes_on=99, limit=2)
        run = engine.run(engine.start())
        assert (run.state, run.iteration) == ("failed", 2)
        assert run.error == {"type": "FEEDBACK_READY", "message": "iteration limit spent"}
        result = assert_replays(journal, run.run_id, held)
        assert result.steps[-1].error == run.error


class TestRetriesAndFailures:
    """Retries by policy, handlers raising, timeouts, interruptions."""

    def test_retries_then_success(self, journal):
        clock = FakeClock()
        call = ScriptedHandler(RuntimeError("flaky"), RuntimeError("flaky again"), NEXT)
        engine, held = engine_for(
            retry_spec(), journal, {"call": call}, clock=clock, sleep=clock.sleep
        )
        run = engine.run(engine.start())
        assert (run.state, run.error) == ("done", None)
        result = assert_replays(journal, run.run_id, held)
        assert kinds(result) == ["start", "retry", "retry", "transition"]
        assert [step.run.attempt for step in result.steps] == [1, 2, 3, 1]
        assert [step.run.visit_seq for step in result.steps] == [0, 0, 0, 3]
        assert result.steps[1].error["message"] == "flaky"

    @pytest.mark.parametrize("starts_iteration", [False, True])
    def test_retries_spent_then_system_error(self, journal, starts_iteration):
        clock = FakeClock()
        engine, held = engine_for(
            retry_spec(max_attempts=2, starts_iteration=starts_iteration),
            journal,
            {"call": ScriptedHandler(RuntimeError("down"))},
            clock=clock,
            sleep=clock.sleep,
        )
        run = engine.run(engine.start())
        assert (run.state, run.error["type"]) == ("failed", "RuntimeError")
        result = assert_replays(journal, run.run_id, held)
        assert [t.event for t in (s.transition for s in result.steps)] == [
            "STARTED", RETRIED, SYSTEM_ERROR,
        ]  # fmt: skip
        assert result.run.iteration == int(starts_iteration)

    def test_handler_raising_is_a_system_error_on_the_row(self, journal):
        def broken(_ctx):
            raise ValueError("bad input")

        engine, held = engine_for(linear_spec("a", "b"), journal, {"a": recorder(), "b": broken})
        run = engine.run(engine.start())
        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        assert run.error["type"] == "ValueError"
        assert "Traceback" in run.error["traceback"]
        result = assert_replays(journal, run.run_id, held)
        assert result.run.error == run.error

    def test_phase_reporting_its_own_error(self, journal):
        spec = MachineSpec(
            "own",
            [State("a", handler="a"), State("failed", terminal=True, outcome="failed")],
            [Transition("a", "GAVE_UP", "failed")],
        )
        engine, held = engine_for(
            spec, journal, {"a": recorder(PhaseResult("GAVE_UP", error="no luck"))}
        )
        run = engine.run(engine.start())
        assert run.error == {"type": "GAVE_UP", "message": "no luck"}
        assert_replays(journal, run.run_id, held)

    def test_timeout(self, journal):
        clock = FakeClock()
        spec = MachineSpec(
            "slow",
            [
                State("a", handler="a", timeout=1.0),
                State("done", terminal=True),
                State("late", terminal=True, outcome="failed"),
            ],
            [Transition("a", NEXT, "done"), Transition("a", RunEvent.TIMEOUT, "late")],
        )

        def slow(_ctx):
            clock.advance(5.0)
            return NEXT

        engine, held = engine_for(spec, journal, {"a": slow}, clock=clock, sleep=clock.sleep)
        run = engine.run(engine.start())
        assert (run.state, run.error["type"]) == ("late", "PhaseTimeoutError")
        assert_replays(journal, run.run_id, held)

    def test_interruption_then_resume(self, journal):
        def b(ctx):
            if ctx.attempt == 1:
                raise KeyboardInterrupt
            return NEXT

        engine, held = engine_for(linear_spec("a", "b"), journal, {"a": recorder(), "b": b})
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.run(run_id)
        mid = assert_replays(journal, run_id, held)
        assert (mid.run.state, mid.run.attempt, kinds(mid)[-1]) == ("b", 2, "interruption")
        engine.resume(run_id)
        assert assert_replays(journal, run_id, held).run.state == "done"


class TestReturnTargets:
    """RETURN (history) transitions in composite machines."""

    def test_return_to_the_leaf_that_was_lost(self, journal):
        engine, held = engine_for(nested_spec(), journal, nested_handlers(b=lost_until(2)))
        run = engine.run(engine.start())
        assert run.state == "done"
        result = assert_replays(journal, run.run_id, held)
        assert result.path == ("prepare", "a", "b", "recovering", "b", "c", "d", "done")
        assert kinds(result)[4] == "return"
        in_recovery, returned = result.steps[3].run, result.steps[4].run
        assert (in_recovery.return_to, in_recovery.return_attempt) == ("b", 1)
        assert (returned.attempt, returned.visit_seq, returned.return_to) == (2, 2, None)

    def test_return_attempts_count_on(self, journal):
        engine, held = engine_for(
            nested_spec(),
            journal,
            nested_handlers(c=lost_until(3), recover=recorder(PhaseResult(FOUND, output="ok"))),
        )
        run = engine.run(engine.start())
        result = assert_replays(journal, run.run_id, held)
        assert [s.run.attempt for s in result.steps if s.to_state == "c"] == [1, 2, 3]

    def test_interruption_in_recovery_keeps_the_return_target(self, journal):
        def recover(ctx):
            if ctx.attempt == 1:
                raise KeyboardInterrupt
            return FOUND

        engine, held = engine_for(
            nested_spec(), journal, nested_handlers(b=lost_until(2), recover=recover)
        )
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.run(run_id)
        mid = assert_replays(journal, run_id, held).run
        assert (mid.state, mid.attempt, mid.return_to) == ("recovering", 2, "b")
        engine.resume(run_id)
        assert assert_replays(journal, run_id, held).run.state == "done"

    def test_return_into_a_starts_iteration_state_keeps_the_iteration(self, journal):
        spec = MachineSpec(
            "looping",
            [
                State("looping", handler="loop", starts_iteration=True),
                State("recovering", handler="recover"),
                State("done", terminal=True),
            ],
            [
                Transition("looping", LOST, "recovering"),
                Transition("looping", PHASE_COMPLETED, "done"),
                Transition("recovering", FOUND, RETURN),
            ],
        )
        engine, held = engine_for(
            spec, journal, {"loop": lost_until(2), "recover": recorder(FOUND)}
        )
        run = engine.run(engine.start())
        assert (run.state, run.iteration) == ("done", 1)
        assert_replays(journal, run.run_id, held)

    @pytest.mark.parametrize("flagged", [False, True], ids=["returns", "guarded-edge"])
    def test_a_return_and_a_guarded_edge_to_the_same_state(self, journal, flagged):
        """Both lead back to ``working`` on FOUND: only the journal can say which was taken.

        Found by the property tests: replay took the guarded edge (a new visit, attempt 1)
        for a RETURN (the same visit's next attempt).
        """
        spec = MachineSpec(
            "ambiguous",
            [
                State("working", handler="work"),
                State("recovering", handler="recover"),
                State("done", terminal=True),
            ],
            [
                Transition("working", LOST, "recovering"),
                Transition("working", NEXT, "done"),
                Transition("recovering", FOUND, "working", guards=["flagged"]),
                Transition("recovering", FOUND, RETURN),
            ],
        )
        engine = Engine(
            spec,
            handlers={"work": lambda _c: NEXT, "recover": lambda _c: FOUND},
            guards={"flagged": lambda _run: flagged},
            journal=journal,
        )
        run_id = engine.start()
        engine.send(run_id, LOST)
        run = engine.send(run_id, FOUND)
        assert (run.state, run.attempt) == ("working", 1 if flagged else 2)
        replayed = replay_run(journal, run_id)
        assert replayed.run == journal.load(run_id)
        assert [s.kind for s in replayed.steps][-1] == ("transition" if flagged else "return")
        assert check_journal(journal) == []


class TestAborts:
    """Aborts with and without a USER_ABORTED exit."""

    def test_abort_through_the_user_aborted_exit(self, journal):
        engine, held = engine_for(
            linear_spec("a", "b"), journal, {"a": recorder(), "b": recorder()}
        )
        run_id = engine.start()
        engine.step(run_id)
        run = engine.abort(run_id, "operator said so")
        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
        result = assert_replays(journal, run_id, held)
        assert kinds(result)[-1] == "transition"
        assert result.run.error == {"type": USER_ABORTED, "message": "operator said so"}

    def test_abort_in_place_without_an_exit(self, journal):
        engine, held = engine_for(no_exits_spec(), journal, {"a": recorder(), "b": recorder()})
        run_id = engine.start()
        engine.step(run_id)
        run = engine.abort(run_id, "stop")
        assert (run.state, run.status) == ("b", RunLifecycle.ABORTED)
        result = assert_replays(journal, run_id, held)
        assert kinds(result)[-1] == "stop"
        assert (result.run.visit_seq, result.run.attempt) == (1, 1)

    def test_abort_from_inside_a_running_handler(self, journal):
        holder = {}

        def a(ctx):
            holder["engine"].abort(ctx.run_id, "enough")
            return NEXT

        engine, held = engine_for(linear_spec("a", "b"), journal, {"a": a, "b": recorder()})
        holder["engine"] = engine
        run = engine.run(engine.start())
        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
        assert_replays(journal, run.run_id, held)

    def test_abort_in_place_during_recovery(self, journal):
        engine, held = engine_for(nested_spec(), journal, nested_handlers(b=lost_until(2)))
        run_id = engine.start()
        engine.run(run_id, max_steps=3)
        run = engine.abort(run_id, "stop in recovery")
        assert (run.state, run.status, run.return_to) == ("recovering", RunLifecycle.ABORTED, "b")
        assert_replays(journal, run_id, held)


class TestPresets:
    """The preset machines, with fake services or handlers."""

    def test_agent_loop(self, journal):
        run_id, held = agent_run(journal)
        result = assert_replays(journal, run_id, held)
        assert result.path[-1] == "succeeded"

    def test_agent_loop_iteration_limit_spent(self, journal):
        held = Held(journal)
        engine = agent_engine(journal, verifier=FakeVerifier(failing_report()), listeners=[held])
        run = engine.run(engine.start({**AGENT_INPUT, "max_iterations": 2}))
        assert (run.state, run.error["message"]) == ("failed", "iteration limit spent")
        assert_replays(journal, run.run_id, held)

    def test_agent_loop_snapshot_failure_and_agent_crash(self, journal):
        agent = FakeAgent(agent_result(1), RuntimeError("agent vanished"), agent_result(3))
        held = Held(journal)
        engine = agent_engine(
            journal,
            agent=agent,
            verifier=FakeVerifier(failing_report(), passing_report()),
            listeners=[held],
        )
        run = engine.run(engine.start(AGENT_INPUT))
        assert (run.state, run.iteration) == ("succeeded", 3)
        assert_replays(journal, run.run_id, held)
        snapshot_failed = agent_engine(
            journal,
            snapshotter=FakeSnapshotter(error=RuntimeError("not a git repository")),
            listeners=[held],
        )
        run = snapshot_failed.run(snapshot_failed.start(AGENT_INPUT))
        assert run.state == "failed"
        assert_replays(journal, run.run_id, held)

    def test_subphases_with_a_lost_server(self, journal):
        lost = {"1b": 1, "codeql": 2}  # sub-phase -> attempts that lose the server

        def work(ctx):
            if ctx.attempt <= lost.get(ctx.state, 0):
                return PhaseResult(
                    RunEvent.SERVER_UNREACHABLE, error={"type": "Unreachable", "message": "gone"}
                )
            return PhaseResult(PHASE_COMPLETED, output={"did": ctx.state})

        engine, held = engine_for(
            SUBPHASES, journal, {"work": work, "recover": recorder(RunEvent.SERVER_RECOVERED)}
        )
        run = engine.run(engine.start())
        assert run.state == "done"
        result = assert_replays(journal, run.run_id, held)
        assert [s.to_state for s in result.steps if s.to_state in SUBPHASE_NAMES] == [
            "1a", "1b", "1b", "codeql", "codeql", "codeql", "1c",
        ]  # fmt: skip
        assert kinds(result).count("return") == 3

    def test_subphases_restart_budget_spent(self, journal):
        engine, held = engine_for(
            SUBPHASES,
            journal,
            {
                "work": recorder(PhaseStatus.SERVER_UNREACHABLE),
                "recover": recorder(RunEvent.RESTART_BUDGET_SPENT),
            },
        )
        run = engine.run(engine.start())
        assert run.state == "failed"
        assert run.error["message"] == "helper server restart budget spent"
        assert_replays(journal, run.run_id, held)


class TestRewindAndFork:
    """REWOUND transitions (resume --from-state) and forks replay too."""

    def test_rewind_to_an_earlier_state(self, journal):
        held = Held(journal)
        engine = agent_engine(
            journal,
            verifier=FakeVerifier(passing_report()),
            listeners=[held],
        )
        run_id = engine.start(AGENT_INPUT)
        engine.run(run_id, max_steps=3)  # queued -> building -> snapshotting -> verifying
        run = engine.resume(run_id, from_state="building")
        assert (run.state, run.iteration) == ("succeeded", 2)
        result = assert_replays(journal, run_id, held)
        assert "rewind" in kinds(result)

    def test_fork_replays_and_starts_from_state_at(self, journal):
        run_id, _held = agent_run(journal)
        source = journal.load(run_id)
        spec = spec_of(journal, source)
        expected = state_at(spec, source, journal.transitions(run_id), 5)
        fork = agent_engine(journal).fork(run_id, at_seq=5)
        assert (fork.state, fork.seq, fork.iteration) == ("building", 5, 2)
        for name in ("state", "seq", "iteration", "attempt", "context", "visit_seq", "updated_at"):
            assert getattr(fork, name) == getattr(expected, name)
        assert_replays(journal, fork.run_id)
        assert check_journal(journal) == []


class TestStateAt:
    """The run row as it stood at a seq."""

    def test_each_seq_matches_the_row_the_journal_held(self, journal):
        run_id, held = agent_run(journal)
        assert_replays(journal, run_id, held)  # compares every seq with the held row

    def test_beyond_the_last_seq(self, journal):
        run_id, _held = agent_run(journal)
        run = journal.load(run_id)
        spec = spec_of(journal, run)
        with pytest.raises(ValueError, match="no transition seq 9"):
            state_at(spec, run, journal.transitions(run_id), 9)
        with pytest.raises(ValueError, match="to_seq must be >= 0"):
            state_at(spec, run, journal.transitions(run_id), -1)
        with pytest.raises(ValueError, match="no transition seq 9"):
            replay_run(journal, run_id, to_seq=9)
        assert replay_run(journal, run_id, to_seq=4).run.state == "feedback"

    def test_a_mismatch_after_the_seq_does_not_matter(self, journal):
        run_id, held = agent_run(journal)
        run = journal.load(run_id)
        spec = spec_of(journal, run)
        timeline = list(journal.transitions(run_id))
        timeline[6] = attrs.evolve(timeline[6], to_state="failed")
        assert state_at(spec, run, timeline, 5) == held.rows[run_id][5]
        with pytest.raises(ReplayMismatchError):
            state_at(spec, run, timeline, 6)


# -- a random walk through a machine with every feature --------------------------------------

WALK = MachineSpec(
    "walk",
    [
        State(
            "working",
            handler="h",
            starts_iteration=True,
            retry=RetryPolicy(max_attempts=3, wait_initial=0.01),
        ),
        State("checking", handler="h"),
        State("recovering", handler="h"),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ],
    [
        Transition("working", "DONE", "checking"),
        Transition("working", LOST, "recovering"),
        Transition("working", "AGAIN", "working"),
        Transition("checking", "PASS", "done"),
        Transition("checking", "FAIL", "failed", unless=["left"], reason="no tries left"),
        Transition("checking", "FAIL", "working"),
        Transition("checking", LOST, "recovering"),
        Transition("recovering", FOUND, RETURN),
        Transition("recovering", "GIVE_UP", "failed", reason="budget spent"),
        Transition("*", SYSTEM_ERROR, "failed"),
        Transition(["working", "checking"], USER_ABORTED, "canceled"),  # recovering: in place
    ],
)
WALK_EVENTS = {
    "working": ["DONE", LOST, "AGAIN", LOST],
    "checking": ["FAIL", LOST, "PASS", "FAIL"],
    "recovering": [FOUND, FOUND, "GIVE_UP"],
}
ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["event"] * 6 + ["raise", "interrupt", "abort", "send", "rewind"]),
        st.integers(0, 11),
        st.booleans(),
    ),
    max_size=40,
)


def walk_run(journal, actions) -> tuple[str, Held]:
    queue = deque(actions)
    clock = FakeClock()

    def handler(ctx):
        kind, index, update = queue.popleft() if queue else ("event", 0, False)
        if kind == "raise":
            raise RuntimeError(f"boom {index}")
        if kind == "interrupt":
            raise KeyboardInterrupt
        events = WALK_EVENTS[ctx.state]
        return PhaseResult(
            events[index % len(events)],
            context={"n": index, ctx.state: ctx.attempt} if update else {},
            output=index if index % 3 == 0 else None,
        )

    engine, held = engine_for(
        WALK,
        journal,
        {"h": handler},
        guards={"left": lambda run: run.iteration < 3},
        clock=clock,
        sleep=clock.sleep,
    )
    run_id = engine.start(context={"start": True})
    for _ in range(80):
        if journal.load(run_id).ended:
            break
        if queue and queue[0][0] in ("abort", "send", "rewind"):
            kind, index, _update = queue.popleft()
            if kind == "abort":
                engine.abort(run_id, f"abort {index}")
            elif kind == "rewind":
                visited = sorted({t.to_state for t in journal.transitions(run_id)})
                engine.rewind(run_id, visited[index % len(visited)])
            elif journal.load(run_id).state == "recovering":
                engine.send(run_id, FOUND if index % 2 else "GIVE_UP")
            continue
        with contextlib.suppress(KeyboardInterrupt):  # journaled as INTERRUPTED
            engine.step(run_id)
    return run_id, held


class TestRandomWalks:
    """Whatever a run does, its journal replays exactly, at every seq."""

    @settings(max_examples=60, deadline=None)
    @given(actions=ACTIONS)
    def test_memory(self, actions):
        with throwaway_journal("memory") as journal:
            run_id, held = walk_run(journal, actions)
            assert_replays(journal, run_id, held)

    @settings(
        max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(actions=ACTIONS)
    def test_sqlite(self, actions, tmp_path):
        with throwaway_journal("sqlite", sqlite_dir=str(tmp_path)) as journal:
            run_id, held = walk_run(journal, actions)
            assert_replays(journal, run_id, held)


#: Changes made to one transition of a walked run, to meet the plain path's conditions one by one.
DAMAGES = {
    "token back": lambda t: attrs.evolve(t, lease_token=0),
    "no source": lambda t: attrs.evolve(t, from_state=None),
    "another source": lambda t: attrs.evolve(t, from_state="checking"),
    "another destination": lambda t: attrs.evolve(t, to_state="working"),
    "a terminal destination": lambda t: attrs.evolve(t, to_state="done"),
    "an unknown destination": lambda t: attrs.evolve(t, to_state="nowhere"),
    "another event": lambda t: attrs.evolve(t, event="PASS"),
    "an engine event": lambda t: attrs.evolve(t, event=RETRIED),
    "a result": lambda t: attrs.evolve(t, result={"context": {"n": -1}}),
    "an empty result": lambda t: attrs.evolve(t, result={}),
    "a list for a result": lambda t: attrs.evolve(t, result=[1]),
    "an attempt": lambda t: attrs.evolve(t, attempt=t.attempt + 1),
    "an iteration": lambda t: attrs.evolve(t, iteration=t.iteration + 1),
    "a seq": lambda t: attrs.evolve(t, seq=t.seq + 1),
}


def read_both_ways(spec, run, timeline, specs):
    """verify()'s problems and the steps replay() gives, with and without the plain path."""

    def read():
        problems = [named(p) for p in verify(spec, run, timeline, specs=specs)]
        try:
            steps = [(s.run, s.kind) for s in replay(spec, run, timeline, specs=specs).steps]
        except ReplayMismatchError as exc:
            steps = [named(exc)]
        return problems, steps

    plain = read()
    with mock.patch.object(replay_module, "plain_reads", return_value={}):
        general = read()
    return plain, general


class TestPlainReads:
    """Replay's plain path (a spec step with no result) derives what classify and advance do."""

    @settings(max_examples=50, deadline=None)
    @given(
        actions=ACTIONS,
        damages=st.lists(
            st.tuples(st.integers(0, 80), st.sampled_from(sorted(DAMAGES))), max_size=3
        ),
        ended=st.booleans(),
    )
    def test_the_same_rows_and_problems_either_way(self, actions, damages, ended):
        with throwaway_journal("memory") as journal:
            run_id, _held = walk_run(journal, actions)
            run = journal.load(run_id)
            specs = journal_specs(journal)
            timeline = journal.transitions(run_id)
            for index, damage in damages:
                at = 1 + index % max(1, len(timeline) - 1)
                if at < len(timeline):
                    timeline[at] = DAMAGES[damage](timeline[at])
            if ended and timeline:  # a transition after the run's last one
                timeline.append(attrs.evolve(timeline[-1], seq=timeline[-1].seq + 1))
            plain, general = read_both_ways(specs(run.spec_hash), run, timeline, specs)
        assert plain == general

    @pytest.mark.parametrize("damage", sorted(DAMAGES))
    def test_each_condition_of_a_plain_step(self, damage):
        """Each damage at each plain step of a run: both ways read it alike."""
        with throwaway_journal("memory") as journal:
            run_id, _held = walk_run(journal, [("event", 4, False)] * 4)  # seqs 1-4 plain
            run = journal.load(run_id)
            specs = journal_specs(journal)
            for at in range(1, 5):
                timeline = journal.transitions(run_id)
                timeline[at] = DAMAGES[damage](timeline[at])
                plain, general = read_both_ways(specs(run.spec_hash), run, timeline, specs)
                assert plain == general, at

    def test_a_plain_step_after_a_stop_in_place(self):
        """A run aborted where it stands (its state has edges) takes no plain step after."""
        with throwaway_journal("memory") as journal:
            run_id, _held = walk_run(journal, [("event", 1, False), ("abort", 0, False)])
            run = journal.load(run_id)
            assert (run.state, run.status) == ("recovering", RunLifecycle.ABORTED)
            specs = journal_specs(journal)
            timeline = journal.transitions(run_id)
            last = timeline[-1]
            timeline.append(
                attrs.evolve(
                    last, seq=last.seq + 1, event="GIVE_UP", to_state="failed", result=None
                )
            )
            plain, general = read_both_ways(specs(run.spec_hash), run, timeline, specs)
        assert plain == general
        assert "no transition after the run ended" in plain[0][0][1]

    def test_it_is_taken(self):
        """The walks above do go through it: a plain step is read without classify()."""
        with throwaway_journal("memory") as journal:
            run_id, _held = walk_run(journal, [("event", 4, False)] * 4)  # no outputs
            run = journal.load(run_id)
            specs = journal_specs(journal)
            timeline = journal.transitions(run_id)
            assert [t.result for t in timeline[1:5]] == [None] * 4
            with mock.patch.object(replay_module, "classify", side_effect=AssertionError):
                steps = replay(specs(run.spec_hash), run, timeline, to_seq=4, specs=specs).steps
            assert [step.kind for step in steps[1:]] == ["transition"] * 4


# -- tampered journals -----------------------------------------------------------------------


@pytest.fixture
def agent_db(tmp_path):
    """A SQLite journal file holding one agent-loop run (seqs 0..8); yields (path, run_id)."""
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        run_id, _held = agent_run(journal)
        assert [t.to_state for t in journal.transitions(run_id)] == [
            "queued", "building", "snapshotting", "verifying", "feedback",
            "building", "snapshotting", "verifying", "succeeded",
        ]  # fmt: skip
    return path, run_id


def tamper(path, *statements):
    conn = sqlite3.connect(path)
    try:
        for sql in statements:
            conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


def mismatch(path, run_id) -> ReplayMismatchError:
    with SqliteJournal(path) as journal, pytest.raises(ReplayMismatchError) as info:
        replay_run(journal, run_id)
    error = info.value
    assert error.run_id == run_id
    assert f"at seq {error.seq}: replay expected {error.expected}" in str(error)
    assert str(path) in str(error)
    return error


def named(error: ReplayMismatchError) -> tuple[int, str, str]:
    return error.seq, error.expected, error.found


class TestTamperedJournals:
    """A journal edited behind the engine's back names the first seq that does not replay."""

    def test_a_gap_in_seqs(self, agent_db):
        path, run_id = agent_db
        tamper(path, "DELETE FROM transitions WHERE seq = 4")
        assert named(mismatch(path, run_id)) == (4, "seq 4", "seq 5")

    def test_a_missing_last_transition(self, agent_db):
        path, run_id = agent_db
        tamper(path, "DELETE FROM transitions WHERE seq = 8")
        assert named(mismatch(path, run_id)) == (7, "seq 7", "seq 8")

    def test_a_wrong_to_state(self, agent_db):
        path, run_id = agent_db
        tamper(path, "UPDATE transitions SET to_state = 'building' WHERE seq = 3")
        assert named(mismatch(path, run_id)) == (3, "state 'verifying'", "state 'building'")

    def test_a_wrong_to_state_among_guarded_candidates(self, agent_db):
        path, run_id = agent_db
        tamper(path, "UPDATE transitions SET to_state = 'succeeded' WHERE seq = 5")
        assert named(mismatch(path, run_id)) == (
            5, "state 'failed' or 'building'", "state 'succeeded'",
        )  # fmt: skip

    def test_an_event_not_allowed(self, agent_db):
        path, run_id = agent_db
        tamper(path, "UPDATE transitions SET event = 'VERIFY_PASSED' WHERE seq = 2")
        assert named(mismatch(path, run_id)) == (
            2, "an event that state 'building' allows", "event 'VERIFY_PASSED'",
        )  # fmt: skip

    def test_a_wrong_from_state(self, agent_db):
        path, run_id = agent_db
        tamper(path, "UPDATE transitions SET from_state = 'queued' WHERE seq = 6")
        assert named(mismatch(path, run_id)) == (
            6, "a transition from state 'building'", "a transition from state 'queued'",
        )  # fmt: skip

    def test_a_wrong_start(self, agent_db):
        path, run_id = agent_db
        tamper(path, "UPDATE transitions SET to_state = 'building' WHERE seq = 0")
        assert named(mismatch(path, run_id)) == (0, "state 'queued'", "state 'building'")

    def test_a_transition_with_a_wrong_iteration(self, agent_db):
        path, run_id = agent_db
        tamper(path, "UPDATE transitions SET iteration = 3 WHERE seq = 5")
        assert named(mismatch(path, run_id)) == (5, "iteration 2", "iteration 3")

    def test_a_transition_after_the_end(self, agent_db):
        path, run_id = agent_db
        tamper(
            path,
            "DROP TRIGGER transitions_fence",
            "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration,"
            f" attempt, at, run_key) SELECT '{run_id}', 9, 'succeeded', 'RUN_ACCEPTED', 'building',"
            f" 3, 1, at, run_key FROM transitions WHERE run_id = '{run_id}' AND seq = 8",
            f"UPDATE run_rows SET seq = 9, state = 'building' WHERE run_id = '{run_id}'",
        )
        assert named(mismatch(path, run_id)) == (
            9,
            "no transition after the run ended in state 'succeeded'",
            "RUN_ACCEPTED to state 'building'",
        )

    @pytest.mark.parametrize(
        ("column", "value", "expected", "found"),
        [
            ("state", "'verifying'", "state 'succeeded'", "state 'verifying'"),
            ("iteration", "3", "iteration 2", "iteration 3"),
            ("status", "'failed'", "status 'succeeded'", "status 'failed'"),
            ("attempt", "2", "attempt 1", "attempt 2"),
            ("visit_seq", "7", "visit_seq 8", "visit_seq 7"),
            ("return_to", "'building'", "return_to None", "return_to 'building'"),
            ("error", '\'{"type": "X"}\'', "error None", 'error {"type": "X"}'),
            ("updated_at", "'2001-01-01T00:00:00.000000+00:00'", None, None),
        ],
    )
    def test_a_run_row_that_differs_from_its_last_transition(
        self, agent_db, column, value, expected, found
    ):
        path, run_id = agent_db
        tamper(path, f"UPDATE run_rows SET {column} = {value} WHERE run_id = '{run_id}'")
        error = mismatch(path, run_id)
        assert error.seq == 8
        if expected is None:
            assert error.expected.startswith(f"{column} ")
            assert error.found == f"{column} 2001-01-01T00:00:00.000000+00:00"
        else:
            assert (error.expected, error.found) == (expected, found)

    def test_a_run_row_whose_context_differs(self, agent_db):
        path, run_id = agent_db
        with SqliteJournal(path) as journal:
            context = journal.load(run_id).context
        changed = {**context, "extra": 1}
        tamper(
            path, f"UPDATE run_rows SET context = '{json.dumps(changed)}' WHERE run_id = '{run_id}'"
        )
        error = mismatch(path, run_id)
        assert error.seq == 8
        assert (error.expected, error.found) == ("context['extra'] absent", "context['extra'] 1")

    def test_a_context_update_removed_from_a_transition(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            engine, _held = loop_engine(journal, passes_on=2)
            run_id = engine.start()
            engine.run(run_id)
        tamper(path, "UPDATE transitions SET result = NULL WHERE seq = 5")
        error = mismatch(path, run_id)
        assert error.seq == 5  # the last seq: the row's context no longer follows
        assert error.found == "context['last_verified'] 2"
        assert error.expected == "context['last_verified'] 1"

    def test_verify_collects_every_problem(self, agent_db):
        path, run_id = agent_db
        tamper(
            path,
            "UPDATE transitions SET event = 'VERIFY_PASSED' WHERE seq = 2",
            "UPDATE transitions SET iteration = 7 WHERE seq = 5",
            f"UPDATE run_rows SET attempt = 4 WHERE run_id = '{run_id}'",
        )
        with SqliteJournal(path) as journal:
            run = journal.load(run_id)
            problems = verify(spec_of(journal, run), run, journal.transitions(run_id))
        assert [named(problem) for problem in problems] == [
            (2, "an event that state 'building' allows", "event 'VERIFY_PASSED'"),
            (5, "iteration 2", "iteration 7"),
            (8, "attempt 1", "attempt 4"),
        ]


class TestEngineEventsMisused:
    """Engine events are accepted only as the engine uses them (timelines edited in memory)."""

    @pytest.fixture
    def agent(self):
        with MemoryJournal() as journal:
            run_id, _held = agent_run(journal)
            run = journal.load(run_id)
            yield spec_of(journal, run), run, list(journal.transitions(run_id))

    def test_retried_in_a_state_without_a_retry_policy(self, agent):
        spec, run, timeline = agent
        timeline[2] = attrs.evolve(timeline[2], event=RETRIED, to_state="building")
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, timeline)
        assert named(info.value) == (
            2, "no RETRIED (state 'building' has no retry policy)", "RETRIED",
        )  # fmt: skip

    def test_retried_beyond_the_policys_attempts(self):
        spec = retry_spec(max_attempts=2)
        clock = FakeClock()
        with MemoryJournal() as journal:
            engine = Engine(
                spec,
                handlers={"call": ScriptedHandler(RuntimeError("down"))},
                journal=journal,
                clock=clock,
                sleep=clock.sleep,
            )
            run = engine.run(engine.start())
            timeline = list(journal.transitions(run.run_id))
        last = timeline[-1]
        timeline[-1] = attrs.evolve(last, event=RETRIED, to_state="calling", attempt=2)
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, timeline)
        assert named(info.value) == (
            2, "at most 2 attempts of state 'calling'", "RETRIED after attempt 2",
        )  # fmt: skip

    def test_rewind_to_a_state_never_visited(self, agent):
        spec, run, timeline = agent
        rewound = attrs.evolve(timeline[4], event=REWOUND, to_state="building", iteration=2)
        assert replay(spec, run, [*timeline[:4], rewound], to_seq=4).steps[-1].kind == "rewind"
        timeline[3] = attrs.evolve(timeline[3], event=REWOUND, to_state="feedback")
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, timeline)
        assert named(info.value) == (
            3, "a rewind to a non-terminal state the run was in", "state 'feedback'",
        )  # fmt: skip

    def test_in_place_stop_where_the_state_has_an_exit(self, agent):
        spec, run, timeline = agent
        timeline[3] = attrs.evolve(timeline[3], event=USER_ABORTED, to_state="snapshotting")
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, timeline)
        assert named(info.value) == (3, "state 'canceled'", "state 'snapshotting'")

    def test_an_in_place_stop_elsewhere(self):
        spec = no_exits_spec()
        with MemoryJournal() as journal:
            engine = Engine(spec, handlers={"a": recorder(), "b": recorder()}, journal=journal)
            run = engine.abort(engine.start(), "stop")
            timeline = list(journal.transitions(run.run_id))
        timeline[1] = attrs.evolve(timeline[1], to_state="b")
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, timeline)
        assert named(info.value) == (1, "state 'a' (it has no USER_ABORTED exit)", "state 'b'")

    def test_started_is_only_seq_0(self, agent):
        spec, run, timeline = agent
        timeline[0] = attrs.evolve(timeline[0], event="RUN_ACCEPTED", from_state="queued")
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, timeline)
        assert named(info.value) == (
            0, "STARTED from no state", "RUN_ACCEPTED from state 'queued'",
        )  # fmt: skip

    def test_a_transition_of_another_run(self, agent):
        spec, run, timeline = agent
        timeline[1] = attrs.evolve(timeline[1], run_id="someone-else")
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, timeline)
        assert named(info.value) == (
            1, f"a transition of run {run.run_id}", "one of run someone-else",
        )  # fmt: skip

    def test_no_transitions_at_all(self, agent):
        spec, run, _timeline = agent
        with pytest.raises(ReplayMismatchError) as info:
            replay(spec, run, [])
        assert named(info.value) == (0, "transition seq 0 (STARTED)", "no transitions")
        assert [named(p) for p in verify(spec, run, [])] == [named(info.value)]
        with pytest.raises(ValueError, match="it has none"):
            replay(spec, run, [], to_seq=0)


class TestCheckJournal:
    """check_journal replays every run and names the ones that do not replay."""

    def test_a_good_journal(self, journal):
        agent_run(journal)
        engine, _ = loop_engine(journal, passes_on=2)
        engine.run(engine.start())
        nested, _ = engine_for(nested_spec(), journal, nested_handlers(b=lost_until(2)))
        nested.run(nested.start())
        active, _ = engine_for(linear_spec("a", "b"), journal, {"a": recorder(), "b": recorder()})
        active.run(active.start(), max_steps=1)
        assert len(journal.run_ids("", limit=10)) == 4
        assert check_journal(journal) == []

    def test_the_tampered_run_among_good_ones(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            good = [agent_run(journal)[0] for _ in range(3)]
            bad, _held = agent_run(journal)
            nested, _ = engine_for(nested_spec(), journal, nested_handlers(b=lost_until(2)))
            good.append(nested.run(nested.start()).run_id)
        tamper(
            path, f"UPDATE transitions SET to_state = 'building' WHERE run_id = '{bad}' AND seq = 3"
        )
        with SqliteJournal(path) as journal:
            problems = check_journal(journal)
        assert problems == [
            f"digest: run {bad} at seq 3: the transition does not match its digest (changed"
            " since it was written)",
            f"run {bad} at seq 3: replay expected state 'verifying', the journal has state 'building'",
        ]

    def test_a_run_whose_spec_is_missing(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            run_id, _held = agent_run(journal)
            spec_hash = journal.load(run_id).spec_hash
        tamper(path, "DELETE FROM specs")
        with SqliteJournal(path) as journal:
            problems = check_journal(journal)
        assert f"run {run_id}: its spec {spec_hash[:12]} cannot be read" in problems[-1]
        assert "holds no spec" in problems[-1]

    @pytest.mark.parametrize("rehash", [False, True], ids=["json-edited", "json-and-hash-edited"])
    def test_a_spec_with_a_renamed_state(self, tmp_path, rehash):
        """Once a KeyError from deep inside the replay; now one problem for the spec's runs."""
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            runs = [agent_run(journal)[0] for _ in range(5)]
            old = journal.load(runs[0]).spec_hash
            text = journal.spec_json(old)
        edited = text.replace('"name":"queued"', '"name":"waiting"')
        assert edited != text
        new = hashlib.sha256(edited.encode()).hexdigest() if rehash else old
        tamper(
            path,
            f"UPDATE specs SET json = '{edited}', spec_hash = '{new}'",
            f"UPDATE run_rows SET spec_hash = '{new}'",
        )
        with SqliteJournal(path) as journal:
            problems = check_journal(journal)
            with pytest.raises(JournalError) as info:
                replay_run(journal, runs[0])
        why = "is not a valid machine spec (" if rehash else "does not match its hash"
        assert why in str(info.value)
        assert problems == [
            f"runs {', '.join(sorted(runs)[:3])} and 2 more: its spec {new[:12]} cannot be read:"
            f" {info.value}"
        ]

    def test_an_unreadable_run_row_is_one_problem_among_others(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            good, _held = agent_run(journal)
            bad, _held = agent_run(journal)
        tamper(path, f"UPDATE run_rows SET status = 'bogus' WHERE run_id = '{bad}'")
        with SqliteJournal(path) as journal:
            problems = check_journal(journal)
            assert replay_run(journal, good).run.state == "succeeded"
        assert len(problems) == 1
        assert problems[0].startswith(f"run {bad}: cannot be read: journal ")

    def test_a_run_advanced_while_it_is_read(self):
        class Racing(MemoryJournal):
            """Another writer commits a step between reading the transitions and the row."""

            engine = None
            armed = False

            def transitions(self, run_id, **bounds):
                read = list(super().transitions(run_id, **bounds))
                if self.armed:
                    self.armed = False
                    self.engine.step(run_id)
                return read

        with Racing() as journal:
            engine, _held = engine_for(
                linear_spec("a", "b"), journal, {"a": recorder(), "b": recorder()}
            )
            journal.engine = engine
            run_id = engine.start()
            journal.armed = True
            assert check_journal(journal) == []
            assert journal.load(run_id).seq == 1

    def test_the_medium_is_checked_first(self):
        class Damaged(MemoryJournal):
            def integrity_problems(self):
                return ["page 3 is broken"]

        with Damaged() as journal:
            assert check_journal(journal) == ["page 3 is broken"]


# -- what the engine writes that replay cannot read back -------------------------------------


class TestEngineQuirks:
    """Engine output that once did not replay exactly, and the fixes that keep it replaying."""

    @pytest.mark.parametrize(
        ("event", "dest"),
        [(INTERRUPTED, "a"), ("RETRIED", "a"), ("RETRIED", "done"), ("STARTED", "done"),
         ("REWOUND", "a")],
    )  # fmt: skip
    def test_spec_transitions_on_engine_events_are_refused(self, event, dest):
        """They would read in the journal exactly like the engine's own, and replay differently."""
        spec = MachineSpec(
            "self-interrupt",
            [State("a", handler="a"), State("done", terminal=True)],
            [Transition("a", event, dest), Transition("a", NEXT, "done")],
        )
        with pytest.raises(SpecError, match="engine"):
            spec.validate()

    def test_resumed_under_a_changed_spec(self, journal):
        first = MachineSpec(
            "m", [State("a", handler="a"), State("done", terminal=True)],
            [Transition("a", NEXT, "done")],
        )  # fmt: skip
        second = MachineSpec(
            "m",
            [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
            [Transition("a", NEXT, "b"), Transition("b", NEXT, "done")],
        )
        run_id = Engine(first, handlers={"a": recorder()}, journal=journal).start()
        Engine(
            second,
            handlers={"a": recorder(), "b": recorder()},
            journal=journal,
            allow_spec_change=True,
        ).run(run_id)
        result = assert_replays(journal, run_id)
        # the switch is journaled: a same-visit SPEC_CHANGED naming both specs
        change = journal.transitions(run_id)[1]
        assert (change.event, change.from_state, change.to_state) == ("SPEC_CHANGED", "a", "a")
        assert change.output == {"from_spec": first.spec_hash, "to_spec": second.spec_hash}
        assert [step.kind for step in result.steps] == [
            "start", "spec_change", "transition", "transition",
        ]  # fmt: skip
        assert result.steps[0].run.spec_hash == first.spec_hash
        assert journal.load(run_id).spec_hash == second.spec_hash
        assert check_journal(journal) == []
        # without the journal's specs the change cannot be followed: said so, not misread
        with pytest.raises(ReplayMismatchError, match="the journal's specs"):
            replay(second, journal.load(run_id), journal.transitions(run_id))


class TestRecords:
    """The replay's result records."""

    def test_step_properties(self, journal):
        run_id, _held = agent_run(journal)
        result = replay_run(journal, run_id)
        step = result.steps[3]
        assert isinstance(step, ReplayStep)
        transition = journal.transitions(run_id)[3]
        assert (step.seq, step.from_state, step.event, step.to_state) == (
            3, "snapshotting", "SNAPSHOT_TAKEN", "verifying",
        )  # fmt: skip
        assert step.duration_ms == transition.duration_ms
        assert step.error is None
        assert step.run.updated_at == transition.at
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            result.steps = ()  # type: ignore[misc]
