"""Engine behaviour: starting, stepping, handler results, failures, timeouts.

Abort is tested in ``test_abort.py``, retries in ``test_retries.py``, interruption (Ctrl-C,
SIGTERM) in ``test_interruption.py``."""

from __future__ import annotations

import asyncio
import enum
import logging
import threading

import pytest

from fsm_runner import (
    Engine,
    InvalidTransitionError,
    MachineSpec,
    MemoryJournal,
    PhaseResult,
    PhaseStatus,
    RunEvent,
    RunLifecycle,
    RunNotFoundError,
    RunTerminalError,
    SpecError,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.exceptions import (
    HandlerResultError,
    JournalError,
    PhaseError,
    RunExistsError,
    SpecMismatchError,
)
from fsm_runner.testing import FakeClock
from tests.helpers import (
    NEXT,
    approval_spec,
    assert_all_json,
    handlers_for,
    linear_spec,
    no_exits_spec,
    noop,
    path_of,
    snapshot,
    two_phase_engine,
)

SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
TIMEOUT = RunEvent.TIMEOUT.value
USER_ABORTED = RunEvent.USER_ABORTED.value


# -- helpers ---------------------------------------------------------------------------------


def timeout_spec(*, timeout, timeout_exit=True):
    states = [
        State("working", handler="work", timeout=timeout),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ]
    transitions = [
        Transition("working", NEXT, "done"),
        Transition("working", RunEvent.SYSTEM_ERROR, "failed"),
    ]
    if timeout_exit:
        states.append(State("timed_out", terminal=True, outcome="failed"))
        transitions.append(Transition("working", RunEvent.TIMEOUT, "timed_out"))
    return MachineSpec("timed", states, transitions)


class HostEvent(str, enum.Enum):
    NEXT = "NEXT"


# -- start -----------------------------------------------------------------------------------


class TestStart:
    """start() writes the run row in the initial state and transition seq 0."""

    def test_journals_seq_0_started_and_the_run_row(self, journal):
        engine = two_phase_engine(journal)
        run_id = engine.start({"repo": "x"}, run_id="r1", context={"k": 1})
        assert run_id == "r1"
        run = journal.load("r1")
        assert (run.state, run.status, run.seq, run.attempt) == ("a", RunLifecycle.ACTIVE, 0, 1)
        assert run.input == {"repo": "x"}
        assert run.context == {"k": 1}
        assert run.machine == "linear"
        assert run.spec_hash == engine.spec.spec_hash
        [first] = journal.transitions("r1")
        assert (first.seq, first.from_state, first.event, first.to_state) == (
            0,
            None,
            RunEvent.STARTED.value,
            "a",
        )

    def test_generates_distinct_run_ids(self, journal):
        engine = two_phase_engine(journal)
        ids = {engine.start() for _ in range(3)}
        assert len(ids) == 3
        assert {run.run_id for run in journal.runs()} == ids

    def test_initial_state_that_starts_an_iteration(self, journal):
        spec = MachineSpec(
            "iter",
            [State("a", handler="a", starts_iteration=True), State("done", terminal=True)],
            [Transition("a", NEXT, "done")],
        )
        run_id = Engine(spec, handlers={"a": noop}, journal=journal).start()
        assert journal.load(run_id).iteration == 1

    def test_duplicate_run_id_is_refused(self, journal):
        engine = two_phase_engine(journal)
        engine.start({"first": True}, run_id="r1")
        before = snapshot(journal, "r1")
        with pytest.raises(RunExistsError) as info:
            engine.start({"second": True}, run_id="r1")
        assert info.value.run_id == "r1"
        assert snapshot(journal, "r1") == before


# -- step, run, resume -----------------------------------------------------------------------


class TestStepRunResume:
    """One step is one journaled transition; run() loops; resume() continues."""

    def test_step_commits_one_transition(self, journal):
        engine = Engine(
            linear_spec("a", "b", "c"), handlers=handlers_for("a", "b", "c"), journal=journal
        )
        run_id = engine.start()
        transition = engine.step(run_id)
        assert (transition.seq, transition.from_state, transition.event, transition.to_state) == (
            1,
            "a",
            NEXT,
            "b",
        )
        run = journal.load(run_id)
        assert (run.state, run.seq) == ("b", 1)
        assert journal.transitions(run_id)[-1] == transition

    def test_run_goes_to_the_end(self, journal):
        engine = Engine(
            linear_spec("a", "b", "c"), handlers=handlers_for("a", "b", "c"), journal=journal
        )
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.status, run.seq) == ("done", RunLifecycle.SUCCEEDED, 3)
        assert run == journal.load(run_id)
        assert path_of(journal, run_id) == [
            (None, "STARTED", "a"),
            ("a", NEXT, "b"),
            ("b", NEXT, "c"),
            ("c", NEXT, "done"),
        ]

    def test_max_steps_then_resume_runs_each_phase_once(self, journal):
        calls = []

        def record(ctx):
            calls.append(ctx.state)
            return NEXT

        engine = Engine(
            linear_spec("a", "b", "c", "d"),
            handlers=handlers_for("a", "b", "c", "d", a=record, b=record, c=record, d=record),
            journal=journal,
        )
        run_id = engine.start()
        run = engine.run(run_id, max_steps=2)
        assert (run.state, run.seq, run.status) == ("c", 2, RunLifecycle.ACTIVE)
        assert calls == ["a", "b"]
        run = engine.resume(run_id, max_steps=1)
        assert (run.state, run.seq) == ("d", 3)
        run = engine.resume(run_id)
        assert (run.state, run.seq, run.status) == ("done", 4, RunLifecycle.SUCCEEDED)
        assert calls == ["a", "b", "c", "d"]

    def test_max_steps_zero_does_nothing(self, journal):
        engine = two_phase_engine(journal)
        run_id = engine.start()
        before = snapshot(journal, run_id)
        assert engine.run(run_id, max_steps=0).seq == 0
        assert snapshot(journal, run_id) == before

    def test_unknown_run_id(self, journal):
        engine = two_phase_engine(journal)
        for call in (engine.step, engine.run, engine.resume, journal.load):
            with pytest.raises(RunNotFoundError) as info:
                call("nope")
            assert info.value.run_id == "nope"
        with pytest.raises(RunNotFoundError):
            engine.abort("nope", "why")
        with pytest.raises(RunNotFoundError):
            engine.send("nope", NEXT)

    def test_resuming_an_ended_run_is_refused(self, journal):
        engine = two_phase_engine(journal)
        run_id = engine.start()
        engine.run(run_id)
        before = snapshot(journal, run_id)
        for call in (engine.resume, engine.run, engine.step):
            with pytest.raises(RunTerminalError) as info:
                call(run_id)
            assert (info.value.run_id, info.value.state, info.value.status) == (
                run_id,
                "done",
                "succeeded",
            )
        assert snapshot(journal, run_id) == before


# -- what handlers return --------------------------------------------------------------------


class TestHandlerResults:
    """A handler may return an event, a str enum, a PhaseStatus or a PhaseResult."""

    @pytest.mark.parametrize(
        "value",
        [NEXT, HostEvent.NEXT, PhaseResult(NEXT), PhaseResult(HostEvent.NEXT)],
        ids=["str", "str-enum", "result", "result-enum"],
    )
    def test_event_forms(self, journal, value):
        engine = two_phase_engine(journal, a=lambda _ctx: value)
        run_id = engine.start()
        transition = engine.step(run_id)
        assert transition.event == NEXT
        assert type(transition.event) is str
        assert journal.load(run_id).state == "b"

    @pytest.mark.parametrize("status", list(PhaseStatus))
    def test_run_status_maps_to_its_event(self, journal, status):
        targets = {s: f"after_{s.name.lower()}" for s in PhaseStatus}
        spec = MachineSpec(
            "statuses",
            [State("working", handler="work")]
            + [State(name, terminal=True) for name in targets.values()],
            [Transition("working", s.event, targets[s]) for s in PhaseStatus],
        )
        engine = Engine(spec, handlers={"work": lambda _ctx: status}, journal=journal)
        run_id = engine.start()
        transition = engine.step(run_id)
        assert transition.event == status.event.value
        assert journal.load(run_id).state == targets[status]

    def test_run_status_ok_is_phase_completed(self):
        assert PhaseStatus.OK.event is RunEvent.PHASE_COMPLETED
        assert PhaseStatus.ERROR.event is RunEvent.PHASE_FAILED

    def test_phase_result_output_context_and_error(self, journal):
        result = PhaseResult(
            NEXT, output={"files": 3}, context={"new": 2, "keep": "overridden"}, error="flaky"
        )
        engine = two_phase_engine(journal, a=lambda _ctx: result)
        run_id = engine.start(context={"keep": 1, "other": True})
        transition = engine.step(run_id)
        assert transition.result["output"] == {"files": 3}
        assert transition.output == {"files": 3}
        assert transition.result["context"] == {"new": 2, "keep": "overridden"}
        assert transition.result["error"] == {"type": NEXT, "message": "flaky"}
        run = journal.load(run_id)
        assert run.context == {"keep": "overridden", "other": True, "new": 2}
        assert run.error == {"type": NEXT, "message": "flaky"}

    def test_context_accumulates_over_phases(self, journal):
        engine = two_phase_engine(
            journal,
            a=lambda _ctx: PhaseResult(NEXT, context={"a": 1}),
            b=lambda ctx: PhaseResult(NEXT, context={"b": ctx.context["a"] + 1}),
        )
        run_id = engine.start()
        assert engine.run(run_id).context == {"a": 1, "b": 2}
        assert journal.load(run_id).context == {"a": 1, "b": 2}

    def test_error_mapping_is_stored_as_is_and_cleared_by_the_next_phase(self, journal):
        engine = two_phase_engine(
            journal,
            a=lambda _ctx: PhaseResult(NEXT, error={"type": "Lint", "message": "3 warnings"}),
        )
        run_id = engine.start()
        engine.step(run_id)
        assert journal.load(run_id).error == {"type": "Lint", "message": "3 warnings"}
        engine.step(run_id)
        assert journal.load(run_id).error is None

    def test_plain_event_has_no_result_payload(self, journal):
        engine = two_phase_engine(journal)
        run_id = engine.start()
        assert engine.step(run_id).result is None

    def test_context_snapshot_is_read_only(self, journal):
        seen = []

        def mutate(ctx):
            try:
                ctx.context["x"] = 1
            except TypeError:
                seen.append("refused")
            return NEXT

        engine = two_phase_engine(journal, a=mutate)
        run_id = engine.start(context={"y": 2})
        engine.step(run_id)
        assert seen == ["refused"]
        assert journal.load(run_id).context == {"y": 2}


class TestHandlerObjects:
    """Handler objects: run(ctx), and validate(ctx) that may short-circuit it."""

    def test_object_with_run(self, journal):
        class Phase:
            def __init__(self):
                self.calls = 0

            def run(self, ctx):
                self.calls += 1
                return PhaseResult(NEXT, output=ctx.state)

        phase = Phase()
        engine = two_phase_engine(journal, a=phase)
        run_id = engine.start()
        assert engine.step(run_id).output == "a"
        assert phase.calls == 1

    def test_validate_returning_none_lets_run_go(self, journal):
        calls = []

        class Phase:
            def validate(self, _ctx):
                calls.append("validate")

            def run(self, _ctx):
                calls.append("run")
                return NEXT

        engine = two_phase_engine(journal, a=Phase())
        run_id = engine.start()
        engine.step(run_id)
        assert calls == ["validate", "run"]
        assert journal.load(run_id).state == "b"

    def test_validate_returning_a_result_short_circuits_run(self, journal):
        calls = []

        class Phase:
            def validate(self, _ctx):
                calls.append("validate")
                return PhaseResult(RunEvent.SYSTEM_ERROR, error="precondition failed")

            def run(self, _ctx):
                calls.append("run")
                return NEXT

        engine = two_phase_engine(journal, a=Phase())
        run_id = engine.start()
        transition = engine.step(run_id)
        assert calls == ["validate"]
        assert (transition.event, transition.to_state) == (SYSTEM_ERROR, "failed")

    def test_async_object_under_arun(self, journal):
        calls = []

        class Phase:
            async def validate(self, _ctx):
                calls.append("validate")
                await asyncio.sleep(0)

            async def run(self, _ctx):
                calls.append("run")
                await asyncio.sleep(0)
                return NEXT

        engine = two_phase_engine(journal, a=Phase(), b=Phase())
        run_id = engine.start()
        run = asyncio.run(engine.arun(run_id))
        assert (run.state, run.status) == ("done", RunLifecycle.SUCCEEDED)
        assert calls == ["validate", "run", "validate", "run"]


# -- async -----------------------------------------------------------------------------------


class TestAsync:
    """Async handlers through arun/astep/aresume, and under the sync run()."""

    @staticmethod
    async def async_next(ctx):
        await asyncio.sleep(0)
        return PhaseResult(NEXT, output=ctx.state)

    def test_arun(self, journal):
        engine = two_phase_engine(journal, a=self.async_next, b=self.async_next)
        run_id = engine.start()
        run = asyncio.run(engine.arun(run_id))
        assert (run.state, run.seq) == ("done", 2)
        assert [t.output for t in journal.transitions(run_id)] == [None, "a", "b"]

    def test_astep_and_aresume(self, journal):
        engine = Engine(
            linear_spec("a", "b", "c"),
            handlers=handlers_for("a", "b", "c", a=self.async_next, c=self.async_next),
            journal=journal,
        )
        run_id = engine.start()

        async def drive():
            transition = await engine.astep(run_id)
            assert (transition.from_state, transition.to_state) == ("a", "b")
            run = await engine.aresume(run_id, max_steps=1)
            assert run.state == "c"
            return await engine.aresume(run_id)

        run = asyncio.run(drive())
        assert (run.state, run.seq) == ("done", 3)

    def test_async_handlers_under_sync_run(self, journal):
        engine = two_phase_engine(journal, a=self.async_next, b=self.async_next)
        try:
            run_id = engine.start()
            run = engine.run(run_id)
        finally:
            engine.close()
        assert (run.state, run.seq) == ("done", 2)
        assert [t.output for t in journal.transitions(run_id)] == [None, "a", "b"]

    def test_async_handler_that_raises(self, journal):
        async def boom(_ctx):
            await asyncio.sleep(0)
            raise RuntimeError("async boom")

        engine = two_phase_engine(journal, a=boom)
        run_id = engine.start()
        run = asyncio.run(engine.arun(run_id))
        assert run.state == "failed"
        assert run.error["type"] == "RuntimeError"
        assert run.error["message"] == "async boom"


# -- guards ----------------------------------------------------------------------------------


def verify_loop_spec():
    """building (new iteration) -> verifying; a failed verify loops back while iterations last."""
    return MachineSpec(
        "agent",
        [
            State("building", handler="build", starts_iteration=True),
            State("verifying", handler="verify"),
            State("succeeded", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("building", RunEvent.BUILD_SUCCEEDED, "verifying"),
            Transition("verifying", RunEvent.VERIFY_PASSED, "succeeded"),
            Transition(
                "verifying", RunEvent.VERIFY_FAILED_RETRYABLE, "building", guards="iterations_left"
            ),
            Transition("verifying", RunEvent.VERIFY_FAILED_RETRYABLE, "failed"),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )


class TestGuards:
    """Guards read the run; starts_iteration counts the loops."""

    def test_retry_loop_guarded_on_iteration(self, journal):
        iterations = []

        def build(ctx):
            iterations.append(ctx.iteration)
            return RunEvent.BUILD_SUCCEEDED

        engine = Engine(
            verify_loop_spec(),
            handlers={"build": build, "verify": lambda _ctx: RunEvent.VERIFY_FAILED_RETRYABLE},
            guards={"iterations_left": lambda run: run.iteration < 3},
            journal=journal,
        )
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.status, run.iteration) == ("failed", RunLifecycle.FAILED, 3)
        assert iterations == [1, 2, 3]
        assert [t.to_state for t in journal.transitions(run_id)] == [
            "building",
            "verifying",
            "building",
            "verifying",
            "building",
            "verifying",
            "failed",
        ]
        assert [t.iteration for t in journal.transitions(run_id)] == [1, 1, 2, 2, 3, 3, 3]

    def test_guard_sees_the_context_the_phase_just_returned(self, journal):
        def verify(ctx):
            tries = ctx.context.get("tries", 0) + 1
            return PhaseResult(
                RunEvent.VERIFY_PASSED if tries == 2 else RunEvent.VERIFY_FAILED_RETRYABLE,
                context={"tries": tries},
            )

        budget = []

        def tries_left(run):
            budget.append(run.context["tries"])
            return run.context["tries"] < 5

        engine = Engine(
            verify_loop_spec(),
            handlers={"build": lambda _ctx: RunEvent.BUILD_SUCCEEDED, "verify": verify},
            guards={"iterations_left": tries_left},
            journal=journal,
        )
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.context) == ("succeeded", {"tries": 2})
        assert budget == [1]

    def test_every_guard_rejecting_changes_nothing(self, journal):
        spec = MachineSpec(
            "gated",
            [State("a", handler="a"), State("done", terminal=True)],
            [Transition("a", NEXT, "done", guards="never")],
        )
        engine = Engine(
            spec, handlers={"a": noop}, guards={"never": lambda _run: False}, journal=journal
        )
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(InvalidTransitionError) as info:
            engine.step(run_id)
        assert "guard" in info.value.reason
        assert snapshot(journal, run_id) == before

    def test_unless_guard(self, journal):
        spec = MachineSpec(
            "unless",
            [State("a", handler="a"), State("left", terminal=True), State("right", terminal=True)],
            [Transition("a", NEXT, "left", unless="go_right"), Transition("a", NEXT, "right")],
        )
        engine = Engine(
            spec,
            handlers={"a": noop},
            guards={"go_right": lambda run: run.input == "right"},
            journal=journal,
        )
        assert engine.run(engine.start("left")).state == "left"
        assert engine.run(engine.start("right")).state == "right"


# -- invalid events and failing handlers -----------------------------------------------------


class TestInvalidTransition:
    """An event the state does not allow raises and changes nothing."""

    @pytest.mark.parametrize("via", ["step", "run"])
    def test_disallowed_event_changes_nothing(self, journal, via):
        engine = two_phase_engine(journal, a=lambda _ctx: "NOT_IN_SPEC")
        run_id = engine.start(context={"k": 1})
        before = snapshot(journal, run_id)
        with pytest.raises(InvalidTransitionError) as info:
            getattr(engine, via)(run_id)
        error = info.value
        assert (error.run_id, error.state, error.event) == (run_id, "a", "NOT_IN_SPEC")
        assert "NOT_IN_SPEC" in str(error)
        assert snapshot(journal, run_id) == before

    def test_event_of_another_state_is_not_allowed(self, journal):
        # "NEXT" is valid from b, not from a; the engine must look at the run's state.
        spec = MachineSpec(
            "split",
            [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
            [Transition("a", "GO", "b"), Transition("b", NEXT, "done")],
        )
        engine = Engine(spec, handlers={"a": noop, "b": noop}, journal=journal)
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(InvalidTransitionError):
            engine.step(run_id)
        assert snapshot(journal, run_id) == before


class TestHandlerFailures:
    """A raising or misbehaving handler is journaled as SYSTEM_ERROR."""

    def test_raising_handler_is_journaled_as_system_error(self, journal):
        def exploding_phase(_ctx):
            raise ValueError("boom at 42")

        engine = two_phase_engine(journal, a=exploding_phase)
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.status, run.seq) == ("failed", RunLifecycle.FAILED, 1)
        last = journal.transitions(run_id)[-1]
        assert (last.from_state, last.event, last.to_state) == ("a", SYSTEM_ERROR, "failed")
        error = last.result["error"]
        assert error["type"] == "ValueError"
        assert error["message"] == "boom at 42"
        assert "Traceback" in error["traceback"]
        assert "exploding_phase" in error["traceback"]
        assert "ValueError: boom at 42" in error["traceback"]
        assert run.error == error
        assert last.error == error

    @pytest.mark.parametrize("garbage", [42, {"event": NEXT}, None, "", ["NEXT"]])
    def test_garbage_return_is_a_handler_result_error(self, journal, garbage):
        engine = two_phase_engine(journal, a=lambda _ctx: garbage)
        run_id = engine.start()
        transition = engine.step(run_id)
        assert (transition.event, transition.to_state) == (SYSTEM_ERROR, "failed")
        assert transition.result["error"]["type"] == "HandlerResultError"
        assert "'a'" in transition.result["error"]["message"]

    def test_an_exception_whose_str_raises_is_journaled_with_a_fallback_message(self, journal):
        class Unprintable(ValueError):
            def __str__(self):
                raise RuntimeError("no text for you")

        def phase(_ctx):
            raise Unprintable

        engine = two_phase_engine(journal, a=phase)
        run = engine.run(engine.start())

        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        error = journal.transitions(run.run_id)[-1].error
        assert error["type"] == "Unprintable"
        assert error["message"] == "<unprintable Unprintable: __str__ raised RuntimeError>"
        assert "Traceback" in error["traceback"]
        assert "in phase" in error["traceback"]
        assert run.error == error

    def test_an_exception_whose_str_is_not_a_str_is_journaled_too(self, journal):
        class Numbered(Exception):
            def __str__(self):
                return 42  # noqa: PLE0307 - the misbehaviour under test

        def phase(_ctx):
            raise Numbered

        engine = two_phase_engine(journal, a=phase)
        run = engine.run(engine.start())

        assert run.state == "failed"
        error = journal.transitions(run.run_id)[-1].error
        assert error["message"] == "<unprintable Numbered: __str__ raised TypeError>"

    def test_a_lone_surrogate_in_an_exception_message_is_journaled_escaped(self, journal):
        def phase(_ctx):
            raise ValueError("bad byte \udcff in \ud800 file")

        engine = two_phase_engine(journal, a=phase)
        run = engine.run(engine.start())

        assert run.state == "failed"
        error = journal.transitions(run.run_id)[-1].error
        assert error["type"] == "ValueError"
        assert error["message"] == r"bad byte \udcff in \ud800 file"
        assert r"ValueError: bad byte \udcff in \ud800 file" in error["traceback"]
        assert_all_json(journal, run.run_id)

    @pytest.mark.parametrize("event", [42, None, 1.5, b"NEXT"])
    def test_a_non_string_event_returned_by_a_handler_is_a_handler_result_error(
        self, journal, event
    ):
        engine = two_phase_engine(journal, a=lambda _ctx: event)
        run = engine.run(engine.start())

        assert run.state == "failed"
        error = journal.transitions(run.run_id)[-1].error
        assert error["type"] == "HandlerResultError"
        assert type(event).__name__ in error["message"]

    def test_an_exception_a_handler_handled_itself_is_journaled_printably(self, journal):
        class Unprintable(ValueError):
            def __str__(self):
                raise RuntimeError("no text for you")

        errors = iter([ValueError("disk full \udcff"), Unprintable()])

        def phase(_ctx):
            return PhaseResult(NEXT, error=next(errors))

        engine = two_phase_engine(journal, a=phase, b=phase)
        run_id = engine.start()

        assert engine.run(run_id).state == "done"

        first, second = (t.error for t in journal.transitions(run_id)[1:])
        assert first == {"type": NEXT, "message": r"disk full \udcff"}
        assert second == {
            "type": NEXT,
            "message": "<unprintable Unprintable: __str__ raised RuntimeError>",
        }

    def test_no_system_error_transition_raises_phase_error_and_changes_nothing(self, journal):
        def boom(_ctx):
            raise ValueError("boom")

        engine = Engine(no_exits_spec(), handlers={"a": boom, "b": noop}, journal=journal)
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(PhaseError) as info:
            engine.run(run_id)
        assert (info.value.run_id, info.value.state, info.value.event) == (
            run_id,
            "a",
            SYSTEM_ERROR,
        )
        assert info.value.error["type"] == "ValueError"
        assert snapshot(journal, run_id) == before

    def test_garbage_without_system_error_transition_raises(self, journal):
        engine = Engine(
            no_exits_spec(), handlers={"a": lambda _ctx: 42, "b": noop}, journal=journal
        )
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(HandlerResultError) as info:
            engine.step(run_id)
        assert "int" in str(info.value)
        assert snapshot(journal, run_id) == before

    def test_other_base_exceptions_are_not_journaled(self, journal):
        def exiting(_ctx):
            raise SystemExit(3)

        engine = two_phase_engine(journal, a=exiting)
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(SystemExit):
            engine.run(run_id)
        assert snapshot(journal, run_id) == before


# -- timeouts --------------------------------------------------------------------------------


class TestTimeouts:
    """A phase past its state's timeout is journaled as TIMEOUT (else SYSTEM_ERROR)."""

    @staticmethod
    def overrunning(fc, *, check=True):
        def handler(ctx):
            assert ctx.timeout == 5.0
            assert ctx.remaining == pytest.approx(5.0)
            fc.advance(6.0)
            assert ctx.remaining == pytest.approx(-1.0)
            if check:
                ctx.check()
            return NEXT

        return handler

    def test_sync_handler_told_by_check(self, journal):
        fc = FakeClock(start=100.0)
        engine = Engine(
            timeout_spec(timeout=5.0),
            handlers={"work": self.overrunning(fc)},
            journal=journal,
            clock=fc,
            sleep=fc.sleep,
        )
        run_id = engine.start()
        run = engine.run(run_id)
        last = journal.transitions(run_id)[-1]
        assert (last.event, last.to_state) == (TIMEOUT, "timed_out")
        assert last.result["error"]["type"] == "PhaseTimeoutError"
        assert (run.state, run.status) == ("timed_out", RunLifecycle.FAILED)

    @pytest.mark.parametrize("kind", ["sync", "async"])
    def test_handlers_own_timeout_error_is_a_system_error(self, journal, kind):
        # A TimeoutError the handler raises itself (an HTTP call timed out) long before the
        # state's deadline is a failure of the phase: SYSTEM_ERROR with its own type and message.
        def sync_upstream(_ctx):
            raise TimeoutError("upstream timed out")

        async def async_upstream(_ctx):
            await asyncio.sleep(0)
            raise TimeoutError("upstream timed out")

        handler = sync_upstream if kind == "sync" else async_upstream
        engine = Engine(timeout_spec(timeout=30.0), handlers={"work": handler}, journal=journal)
        run_id = engine.start()
        run = asyncio.run(engine.arun(run_id))
        last = journal.transitions(run_id)[-1]
        assert (last.event, last.to_state) == (SYSTEM_ERROR, "failed")
        assert last.result["error"]["type"] == "TimeoutError"
        assert last.result["error"]["message"] == "upstream timed out"
        assert run.state == "failed"

    def test_sync_handler_returning_late_is_a_timeout_too(self, journal):
        fc = FakeClock()
        engine = Engine(
            timeout_spec(timeout=5.0),
            handlers={"work": self.overrunning(fc, check=False)},
            journal=journal,
            clock=fc,
        )
        run_id = engine.start()
        assert engine.step(run_id).event == TIMEOUT

    def test_without_timeout_transition_it_is_a_system_error(self, journal):
        fc = FakeClock()
        engine = Engine(
            timeout_spec(timeout=5.0, timeout_exit=False),
            handlers={"work": self.overrunning(fc)},
            journal=journal,
            clock=fc,
        )
        run_id = engine.start()
        last = engine.step(run_id)
        assert (last.event, last.to_state) == (SYSTEM_ERROR, "failed")
        assert last.result["error"]["type"] == "PhaseTimeoutError"

    def test_within_the_timeout_nothing_happens(self, journal):
        fc = FakeClock()

        def quick(ctx):
            fc.advance(4.0)
            ctx.check()
            return NEXT

        engine = Engine(
            timeout_spec(timeout=5.0), handlers={"work": quick}, journal=journal, clock=fc
        )
        run_id = engine.start()
        assert engine.run(run_id).state == "done"

    @staticmethod
    async def stuck(_ctx):
        await asyncio.sleep(10)
        return NEXT

    def test_async_handler_cancelled_at_the_deadline(self, journal):
        engine = Engine(timeout_spec(timeout=0.05), handlers={"work": self.stuck}, journal=journal)
        run_id = engine.start()
        run = asyncio.run(engine.arun(run_id))
        last = journal.transitions(run_id)[-1]
        assert (last.event, last.to_state) == (TIMEOUT, "timed_out")
        assert run.state == "timed_out"

    def test_async_handler_under_sync_run_cancelled_at_the_deadline(self, journal):
        engine = Engine(timeout_spec(timeout=0.05), handlers={"work": self.stuck}, journal=journal)
        try:
            run_id = engine.start()
            run = engine.run(run_id)
        finally:
            engine.close()
        assert run.state == "timed_out"
        assert journal.transitions(run_id)[-1].event == TIMEOUT


# -- listeners -------------------------------------------------------------------------------


class TestListeners:
    """Listeners see every committed transition in order; a failing one breaks nothing."""

    def test_listeners_receive_each_transition_in_order(self, journal):
        seen = []
        engine = Engine(
            linear_spec("a", "b"),
            handlers=handlers_for("a", "b"),
            journal=journal,
            listeners=[
                lambda t, run: seen.append((t.seq, t.event, t.to_state, run.state, run.seq))
            ],
        )
        run_id = engine.start()
        engine.run(run_id)
        assert seen == [
            (0, "STARTED", "a", "a", 0),
            (1, NEXT, "b", "b", 1),
            (2, NEXT, "done", "done", 2),
        ]
        assert [s[0] for s in seen] == [t.seq for t in journal.transitions(run_id)]

    def test_raising_listener_is_logged_and_does_not_break_the_run(self, journal, caplog):
        seen = []

        def broken(_t, _run):
            raise RuntimeError("listener down")

        engine = Engine(
            linear_spec("a", "b"),
            handlers=handlers_for("a", "b"),
            journal=journal,
            listeners=[broken, lambda t, _run: seen.append(t.seq)],
        )
        with caplog.at_level(logging.ERROR, logger="fsm_runner.engine"):
            run_id = engine.start()
            run = engine.run(run_id)
        assert run.state == "done"
        assert seen == [0, 1, 2]
        failures = [r for r in caplog.records if r.name == "fsm_runner.engine"]
        assert len(failures) == 3
        assert all(run_id in r.getMessage() for r in failures)
        assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in failures)


# -- external events -------------------------------------------------------------------------


class TestSend:
    """send() journals external events for states that wait for them."""

    def engine(self, journal):
        return Engine(approval_spec(), handlers={"draft": noop, "publish": noop}, journal=journal)

    def test_waiting_state_then_send(self, journal):
        engine = self.engine(journal)
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.status, run.seq) == ("awaiting_approval", RunLifecycle.ACTIVE, 1)
        assert engine.step(run_id) is None
        assert journal.load(run_id).seq == 1
        run = engine.send(run_id, "APPROVED", output={"by": "alice"})
        assert (run.state, run.seq) == ("publishing", 2)
        last = journal.transitions(run_id)[-1]
        assert (last.from_state, last.event, last.to_state) == (
            "awaiting_approval",
            "APPROVED",
            "publishing",
        )
        assert last.output == {"by": "alice"}
        assert engine.run(run_id).state == "published"

    def test_send_a_str_enum(self, journal):
        class Decision(str, enum.Enum):
            REJECTED = "REJECTED"

        engine = self.engine(journal)
        run_id = engine.start()
        engine.run(run_id)
        run = engine.send(run_id, Decision.REJECTED)
        assert (run.state, run.status) == ("rejected", RunLifecycle.FAILED)
        assert journal.transitions(run_id)[-1].event == "REJECTED"

    def test_disallowed_event_changes_nothing(self, journal):
        engine = self.engine(journal)
        run_id = engine.start()
        engine.run(run_id)
        before = snapshot(journal, run_id)
        with pytest.raises(InvalidTransitionError) as info:
            engine.send(run_id, NEXT)
        assert (info.value.state, info.value.event) == ("awaiting_approval", NEXT)
        assert snapshot(journal, run_id) == before

    @pytest.mark.parametrize("event", [42, None, 1.5, ["APPROVED"], PhaseStatus.OK])
    def test_a_non_string_event_is_an_invalid_transition_that_changes_nothing(self, journal, event):
        engine = self.engine(journal)
        run_id = engine.start()
        engine.run(run_id)
        before = snapshot(journal, run_id)

        with pytest.raises(InvalidTransitionError) as info:
            engine.send(run_id, event)

        assert (info.value.run_id, info.value.state) == (run_id, "awaiting_approval")
        assert info.value.event == repr(event)
        assert "not a str or a str enum" in str(info.value)
        assert snapshot(journal, run_id) == before

    def test_send_to_an_ended_run(self, journal):
        engine = self.engine(journal)
        run_id = engine.start()
        engine.run(run_id)
        engine.send(run_id, "REJECTED")
        with pytest.raises(RunTerminalError):
            engine.send(run_id, "APPROVED")


# -- specs -----------------------------------------------------------------------------------


class TestSpecMismatch:
    """A run resumed under another spec is refused unless the caller opts in."""

    def started_under_a(self, journal):
        engine_a = Engine(linear_spec("a", "b"), handlers=handlers_for("a", "b"), journal=journal)
        run_id = engine_a.start()
        engine_a.run(run_id, max_steps=1)
        assert journal.load(run_id).state == "b"
        return engine_a, run_id

    def test_other_spec_is_refused(self, journal):
        engine_a, run_id = self.started_under_a(journal)
        spec_b = linear_spec("a", "b", "c")
        engine_b = Engine(spec_b, handlers=handlers_for("a", "b", "c"), journal=journal)
        before = snapshot(journal, run_id)
        for call in (engine_b.resume, engine_b.step):
            with pytest.raises(SpecMismatchError) as info:
                call(run_id)
            assert info.value.run_id == run_id
            assert info.value.expected == engine_a.spec.spec_hash
            assert info.value.found == spec_b.spec_hash
            assert "allow_spec_change" in str(info.value)
        assert snapshot(journal, run_id) == before

    def test_opt_in_works_when_the_state_exists(self, journal):
        _, run_id = self.started_under_a(journal)
        engine_b = Engine(
            linear_spec("a", "b", "c"),
            handlers=handlers_for("a", "b", "c"),
            journal=journal,
            allow_spec_change=True,
        )
        run = engine_b.resume(run_id)
        assert (run.state, run.status) == ("done", RunLifecycle.SUCCEEDED)
        # the switch is journaled (a same-visit SPEC_CHANGED), and the run names its new spec
        assert [(t.event, t.to_state) for t in journal.transitions(run_id)][1:3] == [
            (NEXT, "b"),
            ("SPEC_CHANGED", "b"),
        ]
        assert [t.to_state for t in journal.transitions(run_id)] == ["a", "b", "b", "c", "done"]
        assert run.spec_hash == engine_b.spec.spec_hash

    def test_opt_in_fails_clearly_when_the_state_is_gone(self, journal):
        _, run_id = self.started_under_a(journal)
        engine_c = Engine(
            linear_spec("x", "y"),
            handlers=handlers_for("x", "y"),
            journal=journal,
            allow_spec_change=True,
        )
        before = snapshot(journal, run_id)
        with pytest.raises(SpecMismatchError) as info:
            engine_c.resume(run_id)
        assert "'b'" in str(info.value)
        assert snapshot(journal, run_id) == before


class TestConstruction:
    """Engine(...) validates its spec against what it is given."""

    def test_unregistered_handler(self):
        with pytest.raises(SpecError) as info:
            Engine(linear_spec("a", "b"), handlers={"a": noop}, journal=MemoryJournal())
        assert any("'b'" in problem for problem in info.value.problems)

    def test_unregistered_guard(self):
        with pytest.raises(SpecError) as info:
            Engine(
                verify_loop_spec(),
                handlers={"build": noop, "verify": noop},
                journal=MemoryJournal(),
            )
        assert any("iterations_left" in problem for problem in info.value.problems)

    def test_handler_that_cannot_be_called(self):
        with pytest.raises(SpecError):
            Engine(linear_spec("a"), handlers={"a": 42}, journal=MemoryJournal())

    def test_with_journal_binds_another_journal(self, tmp_path):
        seen = []
        first = MemoryJournal()
        engine = Engine(
            linear_spec("a", "b"),
            handlers=handlers_for("a", "b"),
            journal=first,
            listeners=[lambda t, _run: seen.append(t.seq)],
        )
        with SqliteJournal(tmp_path / "other.db") as second:
            other = engine.with_journal(second)
            assert other is not engine
            assert other.journal is second
            assert engine.journal is first
            assert other.spec == engine.spec
            run_id = other.start()
            assert other.run(run_id).state == "done"
            assert second.load(run_id).state == "done"
            assert list(first.runs()) == []
            assert seen == [0, 1, 2]


class TestDefaultJournal:
    """Without a journal, the engine opens ./fsm-runner.db, shows it, and closes it itself (``with``)."""

    def test_the_default_journal_is_fsm_runner_db_in_the_current_directory(
        self, tmp_path, monkeypatch
    ):
        monkeypatch.chdir(tmp_path)
        engine = Engine(linear_spec("a"), handlers=handlers_for("a"))
        try:
            assert isinstance(engine.journal, SqliteJournal)
            assert engine.journal.path == str(tmp_path / "fsm-runner.db")
            assert repr(engine) == (
                f"Engine('linear', journal=SqliteJournal({str(tmp_path / 'fsm-runner.db')!r},"
                " durability='process'))"
            )
            assert engine.run(engine.start()).state == "done"
        finally:
            engine.close()

        with SqliteJournal(tmp_path / "fsm-runner.db") as journal:
            assert [run.state for run in journal.runs()] == ["done"]

    def test_close_closes_the_journal_the_engine_opened(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        engine = Engine(linear_spec("a"), handlers=handlers_for("a"))
        run_id = engine.start()

        engine.close()
        engine.close()  # twice is harmless

        with pytest.raises(JournalError, match="closed"):
            engine.journal.load(run_id)

    def test_close_leaves_a_journal_passed_in_open(self, journal):
        engine = two_phase_engine(journal)
        run_id = engine.start()

        engine.close()

        assert journal.load(run_id).state == "a"
        assert repr(engine) == f"Engine('linear', journal={journal!r})"

    @staticmethod
    def _engine_with_loop_and_heartbeat(journal):
        """An engine (in a ``with``) that ran an async handler in a sync run: loop and heartbeat."""
        loops = []

        async def a_phase(ctx):
            loops.append(asyncio.get_running_loop())
            return NEXT

        engine = Engine(linear_spec("a", "b"), handlers={"a": a_phase, "b": noop}, journal=journal)
        return engine, loops

    @staticmethod
    def _heartbeats(engine):
        name = f"fsm-runner-heartbeat-{engine.worker_id}"
        return [thread for thread in threading.enumerate() if thread.name == name]

    def test_with_closes_thread_loop_and_the_journal_the_engine_opened(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        engine, loops = self._engine_with_loop_and_heartbeat(None)
        with engine as entered:
            assert entered is engine
            run_id = engine.start()
            assert engine.run(run_id, max_steps=1).state == "b"
            assert self._heartbeats(engine)  # renewing nothing now, until its next beat

        assert self._heartbeats(engine) == []
        assert len(loops) == 1
        assert loops[0].is_closed()
        with pytest.raises(JournalError, match="closed"):
            engine.journal.load(run_id)

    def test_with_leaves_a_journal_passed_in_open(self, journal):
        engine, loops = self._engine_with_loop_and_heartbeat(journal)
        with engine:
            run_id = engine.start()
            engine.run(run_id, max_steps=1)

        assert self._heartbeats(engine) == []
        assert loops[0].is_closed()
        assert journal.load(run_id).state == "b"

    def test_with_closes_when_the_block_raises(self, journal):
        engine, loops = self._engine_with_loop_and_heartbeat(journal)

        def host():
            with engine:
                engine.run(engine.start(), max_steps=1)
                raise RuntimeError("host failure")

        with pytest.raises(RuntimeError, match="host failure"):
            host()

        assert self._heartbeats(engine) == []
        assert loops[0].is_closed()
