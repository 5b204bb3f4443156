"""The eight invariants of docs/design.md, one test class each; every one fails if its invariant breaks."""

from __future__ import annotations

import sqlite3
from collections import Counter

import attrs
import pytest

from fsm_runner import (
    Engine,
    InvalidTransitionError,
    JournalError,
    MachineSpec,
    PhaseResult,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    RunTerminalError,
    SpecError,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.engine.core import take_now
from fsm_runner.events import OFF_SPEC_EVENTS
from fsm_runner.exceptions import (
    LeaseHeldError,
    LeaseLostError,
    RunConflictError,
    SpecMismatchError,
)
from fsm_runner.machine import compile_spec
from fsm_runner.testing import FakeClock, ScriptedHandler
from tests.helpers import NEXT, linear_spec, snapshot

SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
USER_ABORTED = RunEvent.USER_ABORTED.value
RETRIED = RunEvent.RETRIED.value


def noop(_ctx):
    return NEXT


def reopen(journal):
    """The same journal as a new process would see it (a new connection to the same file)."""
    if isinstance(journal, SqliteJournal):
        return SqliteJournal(journal.path)
    return journal


def agent_spec():
    """A loop with retries, guards, a waiting state and every failure exit: exercises every kind of row."""
    return MachineSpec(
        "agent",
        [
            State(
                "building",
                handler="build",
                starts_iteration=True,
                retry=RetryPolicy(max_attempts=3, wait_initial=0.5),
            ),
            State("verifying", handler="verify"),
            State("reviewing"),  # waits for an external event
            State("succeeded", terminal=True),
            State("failed", terminal=True, outcome="failed"),
            State("canceled", terminal=True, outcome="aborted"),
        ],
        [
            Transition("building", RunEvent.BUILD_SUCCEEDED, "verifying"),
            Transition(
                "verifying", RunEvent.VERIFY_FAILED_RETRYABLE, "building", guards="iterations_left"
            ),
            Transition("verifying", RunEvent.VERIFY_FAILED_RETRYABLE, "failed"),
            Transition("verifying", RunEvent.VERIFY_PASSED, "reviewing"),
            Transition("reviewing", "APPROVED", "succeeded"),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
            Transition("*", RunEvent.USER_ABORTED, "canceled"),
        ],
    )


def agent_engine(journal, fc=None):
    """build fails once (retried), verify fails once (loops), then passes; review waits."""
    fc = fc or FakeClock()
    build = ScriptedHandler(
        ConnectionError("flaky"),
        PhaseResult(RunEvent.BUILD_SUCCEEDED, output={"build": 1}, context={"built": 1}),
        PhaseResult(RunEvent.BUILD_SUCCEEDED, context={"built": 2, "notes": ["second"]}),
    )
    verify = ScriptedHandler(
        PhaseResult(
            RunEvent.VERIFY_FAILED_RETRYABLE, context={"feedback": "fix it"}, error="1 failing"
        ),
        PhaseResult(RunEvent.VERIFY_PASSED, context={"feedback": None}),
    )
    return Engine(
        agent_spec(),
        handlers={"build": build, "verify": verify},
        guards={"iterations_left": lambda run: run.iteration < 5},
        journal=journal,
        clock=fc,
        sleep=fc.sleep,
        async_sleep=fc.async_sleep,
    )


def assert_row_is_last_transition(journal, run_id):
    run = journal.load(run_id)
    transitions = journal.transitions(run_id)
    last = transitions[-1]
    assert run.state == last.to_state
    assert run.seq == last.seq == len(transitions) - 1
    assert run.iteration == last.iteration


class TestInvariant1OneRowPerStateChangeInTheRunRowsTransaction:
    """1. Each state change is one journal row, committed with the run row it updates."""

    def test_run_row_is_the_projection_of_its_last_transition_after_every_step(self, journal):
        engine = agent_engine(journal)
        run_id = engine.start()
        seen_rows = 1
        assert_row_is_last_transition(journal, run_id)
        while engine.step(run_id) is not None:
            seen_rows += 1
            assert len(journal.transitions(run_id)) == seen_rows
            assert_row_is_last_transition(journal, run_id)
        engine.send(run_id, "APPROVED")
        assert_row_is_last_transition(journal, run_id)
        assert journal.load(run_id).state == "succeeded"

    def test_a_failed_commit_leaves_neither_the_transition_nor_the_run_row(self, tmp_path):
        # Fault injection in real SQLite: refuse any run-row UPDATE that writes a "poison"
        # context. The transition INSERT of the same commit must be rolled back with it.
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            engine = Engine(
                linear_spec("a", "b"),
                handlers={"a": lambda _ctx: PhaseResult(NEXT, context={"poison": True}), "b": noop},
                journal=journal,
            )
            run_id = engine.start(context={"clean": True})
            before = snapshot(journal, run_id)
            raw = sqlite3.connect(path)
            raw.execute(
                "CREATE TRIGGER refuse_poison BEFORE UPDATE OF context ON run_rows"
                " WHEN NEW.context LIKE '%poison%' BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
            )
            raw.commit()
            raw.close()
            with pytest.raises(JournalError):
                engine.step(run_id)
            assert snapshot(journal, run_id) == before
        with SqliteJournal(path) as fresh:
            assert snapshot(fresh, run_id) == before


class TestInvariant2SeqStartsAtZeroWithoutGaps:
    """2. Per run, seq starts at 0 and has no gaps."""

    def test_seqs_are_gapless_through_retries_loops_refusals_sends_and_aborts(self, journal):
        engine = agent_engine(journal)
        run_id = engine.start()
        engine.run(run_id)  # retried build, looped verify, now waiting in review
        with pytest.raises(InvalidTransitionError):
            engine.send(run_id, "NOT_AN_EVENT")  # refused: no row, no hole
        engine.abort(run_id, "enough")
        seqs = [t.seq for t in journal.transitions(run_id)]
        assert seqs == list(range(len(seqs)))
        assert journal.load(run_id).seq == seqs[-1]
        assert Counter(t.event for t in journal.transitions(run_id))[RETRIED] == 1
        other = engine.start()
        assert [t.seq for t in journal.transitions(other)] == [0]

    def test_the_journal_refuses_a_gap_or_a_repeat(self, journal):
        engine = Engine(linear_spec("a", "b"), handlers={"a": noop, "b": noop}, journal=journal)
        run_id = engine.start()
        engine.step(run_id)
        run = journal.load(run_id)
        before = snapshot(journal, run_id)
        last = journal.transitions(run_id)[-1]
        for seq in (run.seq + 2, run.seq):  # a hole, then a second row for an existing seq
            transition = attrs.evolve(last, seq=seq, from_state="b", to_state="done")
            with pytest.raises(RunConflictError):
                journal.commit(attrs.evolve(run, seq=seq, state="done"), transition)
        assert snapshot(journal, run_id) == before


class TestInvariant3APhaseRunsAgainOnlyIfItsExitWasNotJournaled:
    """3. A journaled phase never runs again for that visit; the one caught by a crash does.

    The effects half of the invariant (exactly-once for recorded effects, in-flight effects
    reported, idempotent ones repeated with the same key) is tested in ``test_effects.py`` and,
    with a real SIGKILL and a real counter server, in ``test_sandbox.py``.
    """

    @staticmethod
    def counting_engine(journal, calls, crash_in=None):
        def handler(ctx):
            calls[ctx.state] += 1
            if ctx.state == crash_in:
                # SystemExit is what a killed worker looks like in-process: a BaseException
                # the engine must let through without journaling anything.
                raise SystemExit(1)
            return NEXT

        phases = ("a", "b", "c", "d")
        return Engine(
            linear_spec(*phases), handlers=dict.fromkeys(phases, handler), journal=journal
        )

    def test_journaled_phases_are_not_run_again_on_resume(self, journal):
        calls = Counter()
        run_id = self.counting_engine(journal, calls).start()
        self.counting_engine(journal, calls).run(run_id, max_steps=2)
        assert calls == {"a": 1, "b": 1}
        resumed = reopen(journal)
        try:
            run = self.counting_engine(resumed, calls).resume(run_id)
        finally:
            if resumed is not journal:
                resumed.close()
        assert run.state == "done"
        assert calls == {"a": 1, "b": 1, "c": 1, "d": 1}

    def test_the_phase_in_progress_at_a_crash_runs_again(self, journal):
        calls = Counter()
        crashing = self.counting_engine(journal, calls, crash_in="c")
        run_id = crashing.start()
        with pytest.raises(SystemExit):
            crashing.run(run_id)
        run = journal.load(run_id)
        assert (run.state, run.seq, run.status) == ("c", 2, RunLifecycle.ACTIVE)
        assert [t.to_state for t in journal.transitions(run_id)] == ["a", "b", "c"]
        resumed = reopen(journal)
        try:
            run = self.counting_engine(resumed, calls).resume(run_id)
        finally:
            if resumed is not journal:
                resumed.close()
        assert (run.state, run.seq) == ("done", 4)
        assert calls == {"a": 1, "b": 1, "c": 2, "d": 1}


class TestInvariant4OnlyOneWriterAdvancesARun:
    """4. Two workers can never both advance one run.

    A worker claims a run's lease before advancing it; a second worker is refused while the
    lease is live, and a worker whose lease expired and was taken over is refused at its next
    commit by the fencing token, writing nothing. (The crash torture and multi-process race
    tests are in tests/test_crash_torture.py and tests/test_race.py; an abort requested of a
    held run, carried out by its holder, in tests/test_abort.py::TestAbortFromElsewhere.)
    """

    def test_a_live_lease_keeps_a_second_worker_out(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal_a, SqliteJournal(path) as journal_b:
            engine_b = Engine(
                linear_spec("a", "b"), handlers={"a": noop, "b": noop}, journal=journal_b
            )
            refused = []

            def a_phase(ctx):
                with pytest.raises(LeaseHeldError) as info:
                    engine_b.run(ctx.run_id)  # another worker tries meanwhile
                refused.append(info.value)
                return NEXT

            engine_a = Engine(
                linear_spec("a", "b"),
                handlers={"a": a_phase, "b": noop},
                journal=journal_a,
                worker_id="worker-a",
            )
            run_id = engine_a.start()
            run = engine_a.run(run_id)
        assert (run.state, run.seq) == ("done", 2)
        assert refused[0].owner == "worker-a"
        assert refused[0].run_id == run_id
        assert "lease held by worker-a until" in str(refused[0])

    @pytest.mark.parametrize(
        "late_result",
        [NEXT, PhaseResult(NEXT, output="from A", context={"writer": "A"})],
        ids=["insert-only", "insert-and-update"],
    )
    def test_a_worker_whose_lease_was_taken_over_is_refused_at_commit(self, tmp_path, late_result):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal_a, SqliteJournal(path) as journal_b:
            engine_b = Engine(
                linear_spec("a", "b"),
                handlers={
                    "a": lambda _ctx: PhaseResult(NEXT, output="from B", context={"writer": "B"}),
                    "b": noop,
                },
                journal=journal_b,
                worker_id="worker-b",
            )

            def slow_a(ctx):
                # A's lease has expired (ttl ~0): B takes the run over and advances it
                engine_b.step(ctx.run_id)
                return late_result

            engine_a = Engine(
                linear_spec("a", "b"),
                handlers={"a": slow_a, "b": noop},
                journal=journal_a,
                worker_id="worker-a",
                lease_ttl=1e-6,
                heartbeat_interval=3600,
            )
            run_id = engine_a.start()
            with pytest.raises(LeaseLostError) as info:
                engine_a.step(run_id)
            assert info.value.run_id == run_id
            assert info.value.token == 1
            winner = snapshot(journal_b, run_id)
            assert snapshot(journal_a, run_id) == winner
        with SqliteJournal(path) as fresh:
            run, transitions = snapshot(fresh, run_id)
            assert fresh.load(run_id).lease_token == 2
            assert fresh.load(run_id).recoveries == 1  # B took over A's expired lease
        assert [(t.seq, t.to_state, t.output, t.lease_token) for t in transitions] == [
            (0, "a", None, 0),
            (1, "b", "from B", 2),
        ]
        assert (run.state, run.seq, dict(run.context)) == ("b", 1, {"writer": "B"})

    def test_a_stale_seq_is_still_refused(self, journal):
        """The seq fence stands beside the token: a writer that read an old row writes nothing."""
        spec = linear_spec("a", "b")
        run_id = Engine(spec, handlers={"a": noop, "b": noop}, journal=journal).start()
        held = journal.claim(run_id, "worker", ttl=60)  # one holder, one token, two writes
        journal.commit(*reversed(take_now(spec, held, NEXT, "b", result=None, duration_ms=0)))
        with pytest.raises(RunConflictError) as info:  # the same row again: its seq is stale
            journal.commit(*reversed(take_now(spec, held, NEXT, "b", result=None, duration_ms=0)))
        assert info.value.expected_seq == 0
        assert journal.load(run_id).seq == 1


class TestInvariant5ARunIsBoundToItsSpecHash:
    """5. A run remembers its spec's hash; another spec is refused unless opted in and compatible."""

    def test_the_run_keeps_its_spec_hash_and_the_journal_its_spec(self, journal):
        spec = linear_spec("a", "b")
        engine = Engine(spec, handlers={"a": noop, "b": noop}, journal=journal)
        run_id = engine.start()
        run = journal.load(run_id)
        assert run.spec_hash == spec.spec_hash == linear_spec("a", "b").spec_hash
        assert linear_spec("a", "b", "c").spec_hash != spec.spec_hash
        assert MachineSpec.from_json(journal.spec_json(run.spec_hash)) == spec

    def test_resuming_under_another_spec_is_refused_unless_opted_in_and_compatible(self, journal):
        spec_a = linear_spec("a", "b")
        run_id = Engine(spec_a, handlers={"a": noop, "b": noop}, journal=journal).start()
        before = snapshot(journal, run_id)
        spec_b = linear_spec("a", "b", "c")
        handlers_b = {"a": noop, "b": noop, "c": noop}
        with pytest.raises(SpecMismatchError) as info:
            Engine(spec_b, handlers=handlers_b, journal=journal).resume(run_id)
        assert (info.value.expected, info.value.found) == (spec_a.spec_hash, spec_b.spec_hash)
        assert snapshot(journal, run_id) == before
        gone = Engine(
            linear_spec("x"), handlers={"x": noop}, journal=journal, allow_spec_change=True
        )
        with pytest.raises(SpecMismatchError, match="no state 'a'"):
            gone.resume(run_id)
        assert snapshot(journal, run_id) == before
        opted_in = Engine(spec_b, handlers=handlers_b, journal=journal, allow_spec_change=True)
        assert opted_in.resume(run_id).state == "done"


class TestInvariant6BadEventsChangeNothingAndFailuresAreJournaled:
    """6. A disallowed event changes nothing; a raising handler is journaled as SYSTEM_ERROR."""

    def test_a_disallowed_event_raises_and_changes_nothing(self, journal):
        engine = Engine(
            linear_spec("a", "b"), handlers={"a": lambda _ctx: "BOGUS", "b": noop}, journal=journal
        )
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(InvalidTransitionError) as info:
            engine.run(run_id)
        assert (info.value.state, info.value.event) == ("a", "BOGUS")
        assert snapshot(journal, run_id) == before

    def test_a_raising_handler_is_journaled_and_the_spec_followed(self, journal):
        def broken(_ctx):
            raise KeyError("missing-key")

        engine = Engine(linear_spec("a", "b"), handlers={"a": noop, "b": broken}, journal=journal)
        run_id = engine.start()
        run = engine.run(run_id)
        last = journal.transitions(run_id)[-1]
        assert (last.from_state, last.event, last.to_state) == ("b", SYSTEM_ERROR, "failed")
        assert set(last.result["error"]) >= {"type", "message", "traceback"}
        assert last.result["error"]["type"] == "KeyError"
        assert "missing-key" in last.result["error"]["message"]
        assert "broken" in last.result["error"]["traceback"]
        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        assert_row_is_last_transition(journal, run_id)


class TestInvariant7TerminalStatesAreEnds:
    """7. Terminal states have no exits and no handler, `*` skips them, and ended runs stay ended."""

    def test_a_terminal_state_with_a_handler_or_an_exit_is_refused(self):
        spec = MachineSpec(
            "bad",
            [State("a", handler="a"), State("done", terminal=True, handler="cleanup")],
            [Transition("a", NEXT, "done"), Transition("done", "AGAIN", "a")],
        )
        with pytest.raises(SpecError) as info:
            spec.validate()
        problems = " | ".join(info.value.problems)
        assert "'done' has a handler" in problems
        assert "'done' has an exit" in problems
        with pytest.raises(SpecError):
            Engine(spec, handlers={"a": noop, "cleanup": noop})

    def test_a_wildcard_source_never_includes_a_terminal_state(self, journal):
        spec = linear_spec("a", "b")  # has "*" -SYSTEM_ERROR-> failed and "*" -USER_ABORTED->
        wildcard = next(t for t in spec.transitions if t.source == ("*",))
        assert set(spec.expand_source(wildcard)) == {"a", "b"}
        machine = compile_spec(spec)
        for terminal in spec.terminal_states:
            assert spec.events_from(terminal) == ()
            assert not machine.allows(terminal, SYSTEM_ERROR)
            assert not machine.allows(terminal, USER_ABORTED)
        engine = Engine(spec, handlers={"a": noop, "b": noop}, journal=journal)
        run_id = engine.start()
        engine.run(run_id)
        before = snapshot(journal, run_id)
        with pytest.raises((RunTerminalError, InvalidTransitionError)):
            engine.send(run_id, RunEvent.SYSTEM_ERROR)
        assert snapshot(journal, run_id) == before

    def test_a_terminal_run_cannot_be_resumed(self, journal):
        engine = Engine(linear_spec("a"), handlers={"a": noop}, journal=journal)
        run_id = engine.start()
        engine.run(run_id)
        before = snapshot(journal, run_id)
        with pytest.raises(RunTerminalError) as info:
            engine.resume(run_id)
        assert (info.value.state, info.value.status) == ("done", "succeeded")
        assert run_id in str(info.value)
        assert "'done'" in str(info.value)
        assert snapshot(journal, run_id) == before


def fold(spec, transitions, start_context=None):
    """Replay transitions through the spec into the run-row fields they determine.

    Each transition must be an edge of the spec (or an engine event: STARTED, RETRIED, an
    abort where the state has no USER_ABORTED exit); a mismatch names the seq.
    """
    state, context, error, status = None, dict(start_context or {}), None, RunLifecycle.ACTIVE
    attempt, iteration = 1, 0
    for index, transition in enumerate(transitions):
        assert transition.seq == index, f"seq {transition.seq} found where {index} was expected"
        assert transition.from_state == state, (
            f"seq {transition.seq}: from_state {transition.from_state!r}, expected {state!r}"
        )
        if transition.event not in OFF_SPEC_EVENTS or (
            transition.event == USER_ABORTED and transition.from_state != transition.to_state
        ):
            allowed = {t.dest for t in spec.edges.get((state, transition.event), ())}
            assert transition.to_state in allowed, (
                f"seq {transition.seq}: {state!r} -{transition.event}-> {transition.to_state!r}"
                f" is not in the spec (expected one of {sorted(allowed)})"
            )
        result = transition.result or {}
        context.update(result.get("context") or {})
        error = result.get("error")
        state, iteration = transition.to_state, transition.iteration
        attempt = transition.attempt + 1 if transition.event == RETRIED else 1
        status = spec.state(state).final_outcome
        if transition.event == USER_ABORTED and not spec.state(state).terminal:
            status = RunLifecycle.ABORTED
    return {
        "state": state,
        "seq": len(transitions) - 1,
        "context": context,
        "error": error,
        "status": status,
        "attempt": attempt,
        "iteration": iteration,
    }


def row_fields(run):
    return {
        "state": run.state,
        "seq": run.seq,
        "context": dict(run.context),
        "error": None if run.error is None else dict(run.error),
        "status": run.status,
        "attempt": run.attempt,
        "iteration": run.iteration,
    }


class TestInvariant8TheJournalReproducesTheRunRow:
    """8. Folding a run's journaled transitions through its spec reproduces its run row.

    There is no replay module yet; this checks that the journal holds what replay will need.
    """

    def test_folding_the_transitions_reproduces_the_run_row(self, journal):
        engine = agent_engine(journal)
        run_ids = [engine.start() for _ in range(3)]
        engine.run(run_ids[0])  # waiting for review after a retry and a loop
        engine.run(run_ids[1], max_steps=3)
        engine.abort(run_ids[1], "operator")
        engine.run(run_ids[2])
        engine.send(run_ids[2], "APPROVED")
        for run_id in run_ids:
            run = journal.load(run_id)
            # The journal alone is enough: the spec comes from its own specs table.
            spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
            assert fold(spec, journal.transitions(run_id)) == row_fields(run)

    def test_the_start_context_is_journaled_too(self, journal):
        # A run started with a context: without it in the journal, replay cannot rebuild the
        # run row's context from the transitions.
        engine = agent_engine(journal)
        run_id = engine.start(context={"ticket": "T-1"})
        engine.run(run_id)
        run = journal.load(run_id)
        spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
        assert fold(spec, journal.transitions(run_id)) == row_fields(run)
