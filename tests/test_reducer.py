"""The reducer (fsm_runner.rules.reducer) and its classifier (fsm_runner.rules.classify).

The reducer is pure, and the one place a run row is derived; the classifier, the one place a
journaled transition is read as a kind. That the engine and replay agree with them on random
runs is tests/test_properties.py's TestReducer; here, each rule on a hand-built row.
"""

from __future__ import annotations

import datetime as dt

import attrs
import pytest

from fsm_runner import (
    RETURN,
    InvalidTransitionError,
    MachineSpec,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    State,
)
from fsm_runner import Transition as Edge
from fsm_runner.records import ErrorType, IterationRecord, RunRecord, TransitionRecord
from fsm_runner.rules.classify import (
    Problem,
    abort_stops,
    classify,
    classify_start,
    retries_left,
)
from fsm_runner.rules.reducer import (
    abort_records,
    advance,
    advance_plain,
    iteration_rows,
    take,
    writes_iterations,
)
from tests.helpers import NEXT, iteration_loop_spec, linear_spec

AT = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
THEN = dt.datetime(2030, 1, 2, 3, 0, 0, tzinfo=dt.timezone.utc)
SPEC = linear_spec("a", "b")
RECOVERING = MachineSpec(
    "recovering",
    [State("a", handler="a"), State("fix", handler="fix"), State("done", terminal=True)],
    [Edge("a", NEXT, "done"), Edge("a", "LOST", "fix"), Edge("fix", "FOUND", RETURN)],
)


def row(spec: MachineSpec = SPEC, **fields) -> RunRecord:
    fields = {"state": "a", "created_at": THEN, "updated_at": THEN, "lease_token": 7, **fields}
    return RunRecord(run_id="r", machine=spec.name, spec_hash=spec.spec_hash, **fields)


class TestTake:
    """take builds the transition and the row it leads to."""

    def test_a_plain_step_is_what_the_hot_path_builds(self):
        run = row(seq=3, visit_seq=2, attempt=2, context={"k": 1})
        assert advance_plain(run, NEXT, "b", RunLifecycle.ACTIVE, 1.5, AT) == take(
            SPEC, run, NEXT, "b", result=None, duration_ms=1.5, at=AT
        )

    def test_a_step_begins_a_new_visit(self):
        transition, after = take(SPEC, row(seq=3, attempt=2), NEXT, "b", result=None,
                                 duration_ms=0.0, at=AT)  # fmt: skip
        assert (transition.seq, transition.attempt, transition.lease_token) == (4, 2, 7)
        assert (after.state, after.seq, after.attempt, after.visit_seq) == ("b", 4, 1, 4)
        assert after.updated_at == transition.at == AT

    def test_a_return_goes_back_as_the_next_attempt_of_that_visit(self):
        run = row(RECOVERING, seq=5, attempt=2, visit_seq=3)
        transition, away = take(RECOVERING, run, "LOST", "fix", result=None, duration_ms=0, at=AT)
        assert (away.return_to, away.return_attempt, away.return_visit) == ("a", 2, 3)
        transition, back = take(RECOVERING, away, "FOUND", RETURN, result=None, duration_ms=0,
                                at=AT)  # fmt: skip
        assert transition.to_state == "a"
        assert transition.result == {"returned": True}
        assert (back.state, back.attempt, back.visit_seq, back.return_to) == ("a", 3, 3, None)

    def test_a_return_from_nowhere_is_refused(self):
        with pytest.raises(InvalidTransitionError, match="nowhere to return to"):
            take(RECOVERING, row(RECOVERING, state="fix"), "FOUND", RETURN, result=None,
                 duration_ms=0, at=AT)  # fmt: skip

    def test_a_reason_is_the_error_of_a_spec_transition_only(self):
        run = row(seq=1)
        _, after = take(SPEC, run, NEXT, "b", result={"reason": "why"}, duration_ms=0, at=AT)
        assert after.error == {"type": NEXT, "message": "why"}
        _, retried = take(SPEC, run, RunEvent.RETRIED.value, "a", result={"reason": "why"},
                          duration_ms=0, at=AT, kind="retry")  # fmt: skip
        assert retried.error is None

    def test_context_updates_merge(self):
        _, after = take(SPEC, row(context={"a": 1, "b": 2}), NEXT, "b",
                        result={"context": {"b": 3}}, duration_ms=0, at=AT)  # fmt: skip
        assert after.context == {"a": 1, "b": 3}


class TestKinds:
    """How a transition is read decides the visit, the attempt and the status."""

    def advance(self, run: RunRecord, event: str, kind, result=None) -> RunRecord:
        transition = take(SPEC, run, event, run.state, result=result, duration_ms=0, at=AT,
                          kind=kind)[0]  # fmt: skip
        return advance(SPEC, run, transition, kind)

    @pytest.mark.parametrize(
        ("kind", "event"),
        [("retry", RunEvent.RETRIED.value), ("interruption", RunEvent.INTERRUPTED.value)],
    )
    def test_a_retry_or_interruption_is_the_next_attempt_of_the_visit(self, kind, event):
        after = self.advance(row(seq=4, attempt=2, visit_seq=3), event, kind)
        assert (after.attempt, after.visit_seq, after.status) == (3, 3, RunLifecycle.ACTIVE)

    @pytest.mark.parametrize(
        ("kind", "event", "status"),
        [
            ("stop", RunEvent.USER_ABORTED.value, RunLifecycle.ABORTED),
            ("park", RunEvent.DEAD_LETTERED.value, RunLifecycle.DEAD_LETTER),
        ],
    )
    def test_a_stop_or_park_ends_the_run_where_it_is(self, kind, event, status):
        after = self.advance(row(seq=4, attempt=2, visit_seq=3, abort_reason="x"), event, kind)
        assert (after.state, after.status, after.visit_seq) == ("a", status, 3)
        assert after.abort_reason == (None if kind == "stop" else "x")

    def test_a_spec_change_keeps_the_attempt_and_names_the_new_spec(self):
        output = {"output": {"from_spec": SPEC.spec_hash, "to_spec": "new"}}
        after = self.advance(row(seq=4, attempt=2, visit_seq=3), RunEvent.SPEC_CHANGED.value,
                             "spec_change", output)  # fmt: skip
        assert (after.spec_hash, after.attempt, after.visit_seq) == ("new", 2, 3)

    def test_a_rewind_is_a_new_visit(self):
        after = self.advance(row(seq=4, attempt=2, visit_seq=3), RunEvent.REWOUND.value, "rewind")
        assert (after.attempt, after.visit_seq) == (1, 5)


class TestIterationsAndAborts:
    """Iteration rows and abort records, as the engine writes them."""

    def test_entering_a_starter_opens_the_next_iteration(self):
        spec = iteration_loop_spec()
        run = row(spec, state="feedback", iteration=1, seq=3)
        transition, after = take(spec, run, "FEEDBACK_READY", "building", result=None,
                                 duration_ms=0, at=AT)  # fmt: skip
        assert after.iteration == transition.iteration == 2
        assert writes_iterations(run, after, transition.event, None)
        current = IterationRecord("r", 1, started_at=THEN)
        closed, opened = iteration_rows(run, after, transition, {"tokens_total": 5}, current)
        assert (closed.iteration, closed.state, closed.tokens_total) == (1, "feedback", 5)
        assert (opened.iteration, opened.state, opened.started_at) == (2, "building", AT)

    def test_a_failure_is_written_into_the_iteration(self):
        spec = iteration_loop_spec()
        run = row(spec, state="verifying", iteration=1, seq=2)
        error = {"type": "Boom", "message": "no"}
        transition, after = take(spec, run, RunEvent.SYSTEM_ERROR.value, "failed",
                                 result={"error": error}, duration_ms=0, at=AT)  # fmt: skip
        (closed,) = iteration_rows(run, after, transition, {}, None)
        assert closed.error_type is ErrorType.SYSTEM_ERROR
        assert closed.error_message == "Boom: no"
        assert closed.started_at == THEN  # none in the journal: the run's last update

    def test_an_abort_follows_the_exit_or_stops_in_place(self):
        _, after = abort_records(SPEC, row(), "enough", None, at=AT)
        assert (after.state, after.status) == ("canceled", RunLifecycle.ABORTED)
        no_exit = MachineSpec(
            "no-exit",
            [State("a", handler="a"), State("done", terminal=True)],
            [Edge("a", NEXT, "done")],
        )
        transition, after = abort_records(no_exit, row(no_exit), "enough", None, at=AT)
        assert (transition.to_state, after.state, after.status) == ("a", "a", RunLifecycle.ABORTED)
        assert after.error == {"type": RunEvent.USER_ABORTED.value, "message": "enough"}


class TestClassify:
    """classify reads a journaled transition by the engine's rules, naming what breaks them."""

    def read(self, spec: MachineSpec, run: RunRecord, event: str, dest: str, **fields):
        transition = take(spec, run, event, dest, result=None, duration_ms=0, at=AT)[0]
        return classify(spec, run, attrs.evolve(transition, **fields), visited={"a"})

    def test_a_spec_edge_is_a_transition(self):
        assert self.read(SPEC, row(), NEXT, "b").kind == "transition"

    def test_a_return_is_told_from_its_candidate(self):
        run = row(RECOVERING, state="fix", return_to="a", return_attempt=1)
        reading = self.read(RECOVERING, run, "FOUND", RETURN)
        assert (reading.kind, reading.problems) == ("return", ())

    def test_a_retry_beyond_the_policy_is_named(self):
        spec = MachineSpec(
            "retrying",
            [State("a", handler="a", retry=RetryPolicy(max_attempts=2)), State("z", terminal=True)],
            [Edge("a", NEXT, "z")],
        )
        assert retries_left(spec.state("a"), 1)
        assert not retries_left(spec.state("a"), 2)
        reading = self.read(spec, row(spec, attempt=2), RunEvent.RETRIED.value, "a")
        assert reading.kind == "retry"
        assert reading.problems == (
            Problem("at most 2 attempts of state 'a'", "RETRIED after attempt 2"),
        )

    def test_an_abort_stops_in_place_only_where_the_state_has_no_exit(self):
        assert not abort_stops(SPEC, "a")
        assert self.read(SPEC, row(), RunEvent.USER_ABORTED.value, "canceled").kind == "transition"
        no_exit = MachineSpec("no-exit", [State("a", handler="a"), State("z", terminal=True)],
                              [Edge("a", NEXT, "z")])  # fmt: skip
        assert abort_stops(no_exit, "a")
        reading = self.read(no_exit, row(no_exit), RunEvent.USER_ABORTED.value, "z")
        assert reading.kind == "stop"
        assert reading.problems == (
            Problem("state 'a' (it has no USER_ABORTED exit)", "state 'z'"),
        )

    def test_a_lease_token_going_back_and_an_unknown_event_are_named(self):
        reading = self.read(SPEC, row(), "NOPE", "b", lease_token=6)
        assert reading.problems == (
            Problem("lease token 7 or later", "lease token 6"),
            Problem("an event that state 'a' allows", "event 'NOPE'"),
        )

    def test_seq_0_is_started_from_no_state_into_the_initial_leaf(self):
        started = TransitionRecord("r", 0, None, RunEvent.STARTED.value, "a", 0, 1, AT, 0.0)
        assert classify_start(SPEC, started).problems == ()
        wrong = attrs.evolve(started, from_state="b", to_state="b")
        assert classify_start(SPEC, wrong).problems == (
            Problem("STARTED from no state", "STARTED from state 'b'"),
            Problem("state 'a'", "state 'b'"),
        )
