"""Payloads: ones that are not JSON, oversized ones, and ones that are not standard JSON, are
refused before anything is written (a handler's: journaled as a payload problem, the run never
left between states)."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_runner import (
    Engine,
    MachineSpec,
    PhaseResult,
    RunLifecycle,
    RunNotFoundError,
    State,
    Transition,
)
from fsm_runner._json import MAX_JSON_DEPTH
from fsm_runner.exceptions import HandlerResultError, InvalidRunIdError, JournalError, PayloadError
from fsm_runner.records import IterationRecord, RunRecord, TransitionRecord, utc_now
from tests.helpers import (
    NEXT,
    SYSTEM_ERROR,
    approval_spec,
    assert_all_json,
    linear_spec,
    noop,
    snapshot,
    two_phase_engine,
)

SPEC = linear_spec("a", "b")
LIMIT = 1000


def engine_for(journal, a) -> Engine:
    return Engine(
        SPEC,
        handlers={"a": a, "b": lambda _ctx: NEXT},
        journal=journal,
        max_payload_bytes=LIMIT,
    )


class TestNotJson:
    """Values that are not JSON at all (an object, a set) in start, a handler's result, send."""

    @pytest.mark.parametrize(
        ("kwargs", "what"),
        [({"input": {"when": object()}}, "input"), ({"context": {"s": {1, 2}}}, "context")],
    )
    def test_non_json_payload_writes_nothing(self, journal, kwargs, what):
        engine = two_phase_engine(journal)
        with pytest.raises(PayloadError) as info:
            engine.start(run_id="r1", **kwargs)
        assert info.value.what == what
        assert "nothing was written" in str(info.value)
        assert list(journal.runs()) == []
        with pytest.raises(RunNotFoundError):
            journal.load("r1")

    def test_non_json_output_is_a_system_error_and_never_written(self, journal):
        engine = two_phase_engine(
            journal, a=lambda _ctx: PhaseResult(NEXT, output={"at": object()})
        )
        run_id = engine.start()
        transition = engine.step(run_id)
        assert (transition.event, transition.to_state) == (SYSTEM_ERROR, "failed")
        error = transition.result["error"]
        assert error["type"] == "HandlerResultError"
        assert "output" in error["message"]
        assert "JSON" in error["message"]
        assert "output" not in transition.result
        assert_all_json(journal, run_id)

    def test_non_json_context_is_a_system_error_and_never_written(self, journal):
        engine = two_phase_engine(journal, a=lambda _ctx: PhaseResult(NEXT, context={"s": {1}}))
        run_id = engine.start(context={"keep": 1})
        transition = engine.step(run_id)
        assert transition.event == SYSTEM_ERROR
        assert "context" in transition.result["error"]["message"]
        assert journal.load(run_id).context == {"keep": 1}
        assert_all_json(journal, run_id)

    def test_non_json_output_changes_nothing(self, journal):
        engine = Engine(approval_spec(), handlers={"draft": noop, "publish": noop}, journal=journal)
        run_id = engine.start()
        engine.run(run_id)
        before = snapshot(journal, run_id)
        with pytest.raises(PayloadError):
            engine.send(run_id, "APPROVED", output=object())
        assert snapshot(journal, run_id) == before


class TestMaxPayloadBytes:
    """Input, context, handler output and send output over the limit."""

    def test_an_oversized_input_is_refused_before_the_run_exists(self, journal):
        engine = engine_for(journal, lambda _ctx: NEXT)
        with pytest.raises(PayloadError, match="more than max_payload_bytes=1,000") as info:
            engine.start({"blob": "x" * LIMIT}, run_id="big")
        assert (info.value.run_id, info.value.what) == ("big", "input")
        assert "nothing was written" in str(info.value)
        assert journal.runs() == []

    def test_an_oversized_handler_output_fails_the_phase_without_being_written(self, journal):
        engine = engine_for(journal, lambda _ctx: PhaseResult(NEXT, output="y" * 5000))
        run = engine.run(engine.start())
        assert run.state == "failed"
        last = journal.transitions(run.run_id)[-1]
        assert last.event == "SYSTEM_ERROR"
        assert last.error["type"] == "HandlerResultError"
        assert (
            "output of 5,002 bytes as JSON, more than max_payload_bytes=1,000"
            in (last.error["message"])
        )
        assert "y" * 100 not in str(last.result)

    def test_just_under_the_limit_is_journaled(self, journal):
        engine = engine_for(journal, lambda _ctx: PhaseResult(NEXT, output="z" * 900))
        run = engine.run(engine.start())
        assert run.state == "done"
        assert journal.transitions(run.run_id)[1].output == "z" * 900

    def test_an_oversized_send_output_changes_nothing(self, journal):
        spec = MachineSpec(
            "waits",
            [State("waiting"), State("done", terminal=True)],
            [Transition("waiting", "GO", "done")],
        )
        engine = Engine(spec, handlers={}, journal=journal, max_payload_bytes=LIMIT)
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(PayloadError, match="output is"):
            engine.send(run_id, "GO", output="w" * 2000)
        assert snapshot(journal, run_id) == before


def nested(depth: int, kind: type = list):
    """A value whose containers nest ``depth`` levels deep (built without recursion)."""
    value: object = "leaf"
    for _ in range(depth):
        value = [value] if kind is list else {"k": value}
    return value


#: Values no journal stores: what each is refused for.
NOT_STANDARD_JSON = {
    "nan": (float("nan"), "NaN or Infinity"),
    "infinity": ({"x": [1.0, float("inf")]}, "NaN or Infinity"),
    "minus-infinity": ([-float("inf")], "NaN or Infinity"),
    "nan-key": ({float("nan"): 1}, "NaN or Infinity"),
    "deep-list": (nested(100_000), f"nested more than {MAX_JSON_DEPTH} levels deep"),
    "deep-dict": (nested(100_000, dict), f"nested more than {MAX_JSON_DEPTH} levels deep"),
    "just-too-deep": (nested(MAX_JSON_DEPTH + 1), f"nested more than {MAX_JSON_DEPTH} levels"),
    "lone-surrogate": ({"name": "caf\udce9"}, r"lone surrogate ('\udce9')"),
    "surrogate-key": ({"\ud800": 1}, r"lone surrogate ('\ud800')"),
}
BAD = pytest.mark.parametrize(
    ("value", "reason"), list(NOT_STANDARD_JSON.values()), ids=list(NOT_STANDARD_JSON)
)


def failing_spec() -> MachineSpec:
    """a -> done, with no SYSTEM_ERROR exit: a failed phase leaves the run where it is."""
    return MachineSpec(
        "bare",
        [State("a", handler="a"), State("done", terminal=True)],
        [Transition("a", NEXT, "done")],
    )


class TestStandardJson:
    """NaN, Infinity, nesting past MAX_JSON_DEPTH and lone surrogates are payload problems."""

    @BAD
    @pytest.mark.parametrize("what", ["input", "context"])
    def test_start_refuses_them_before_the_run_exists(self, journal, value, reason, what):
        engine = engine_for(journal, lambda _ctx: NEXT)
        payload = {"input": value} if what == "input" else {"context": {"c": value}}

        with pytest.raises(PayloadError) as info:
            engine.start(run_id="bad", **payload)

        assert (info.value.run_id, info.value.what) == ("bad", what)
        assert reason in str(info.value)
        assert "nothing was written" in str(info.value)
        assert journal.runs() == []

    def test_a_run_id_holding_a_lone_surrogate_is_refused(self, journal):
        engine = engine_for(journal, lambda _ctx: NEXT)

        # the rule of run ids (test_run_ids.py) refuses it: not printable
        with pytest.raises(InvalidRunIdError, match=r"'\\ud800' \(U\+D800, not printable\)"):
            engine.start(run_id="run-\ud800")
        assert journal.runs() == []

    def test_nesting_up_to_the_limit_is_journaled_and_reads_back(self, journal):
        engine = Engine(
            SPEC, handlers={"a": lambda _ctx: NEXT, "b": lambda _ctx: NEXT}, journal=journal
        )
        deepest = nested(MAX_JSON_DEPTH - 1)  # inside the run's {"input": ...}: at the limit

        run_id = engine.start({"deep": deepest})

        assert journal.load(run_id).input == {"deep": deepest}
        assert engine.run(run_id).state == "done"

    @BAD
    @pytest.mark.parametrize("where", ["output", "context", "error", "iteration"])
    def test_a_handler_returning_them_is_journaled_as_a_payload_problem(
        self, journal, value, reason, where
    ):
        result = {
            "output": PhaseResult(NEXT, output=value),
            "context": PhaseResult(NEXT, context={"c": value}),
            "error": PhaseResult(NEXT, error={"detail": value}),
            "iteration": PhaseResult(NEXT, iteration={"extra": {"x": value}}),
        }[where]
        spec = MachineSpec(
            "counted",
            [State("a", handler="a", starts_iteration=True), *SPEC.states[1:]],
            SPEC.transitions,
        )
        engine = Engine(
            spec, handlers={"a": lambda _ctx: result, "b": lambda _ctx: NEXT}, journal=journal
        )

        run = engine.run(engine.start(context={"keep": 1}))

        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        last = journal.transitions(run.run_id)[-1]
        assert (last.from_state, last.event) == ("a", "SYSTEM_ERROR")
        assert last.error["type"] == "HandlerResultError"
        assert f"returned {where} that" in last.error["message"]
        assert reason in last.error["message"]
        assert set(last.result) == {"error"}  # the payload itself is never written
        assert run.context == {"keep": 1}

    @BAD
    def test_without_a_system_error_exit_the_run_stays_put_and_resumes(
        self, journal, value, reason
    ):
        outputs = iter([value, "fine"])
        engine = Engine(
            failing_spec(),
            handlers={"a": lambda _ctx: PhaseResult(NEXT, output=next(outputs))},
            journal=journal,
        )
        run_id = engine.start()
        before = snapshot(journal, run_id)

        with pytest.raises(HandlerResultError, match="output") as info:
            engine.run(run_id)

        assert reason in str(info.value)
        assert snapshot(journal, run_id) == before  # not between states: still in 'a', seq 0
        run = engine.resume(run_id)
        assert (run.state, run.seq) == ("done", 1)
        assert journal.transitions(run_id)[-1].output == "fine"

    @BAD
    def test_send_refuses_them_and_changes_nothing(self, journal, value, reason):
        spec = MachineSpec(
            "waits",
            [State("waiting"), State("done", terminal=True)],
            [Transition("waiting", "GO", "done")],
        )
        engine = Engine(spec, handlers={}, journal=journal)
        run_id = engine.start()
        before = snapshot(journal, run_id)

        with pytest.raises(PayloadError, match="output") as info:
            engine.send(run_id, "GO", output=value)

        assert reason in str(info.value)
        assert snapshot(journal, run_id) == before

    @BAD
    def test_an_effects_parameters_are_refused_before_it_runs(self, journal, value, reason):
        calls = []

        def phase(ctx):
            ctx.effect("send", calls.append, value, kind="mutate")
            return NEXT

        engine = engine_for(journal, phase)
        run = engine.run(engine.start())

        assert calls == []
        error = journal.transitions(run.run_id)[-1].error
        assert (error["type"], run.state) == ("PayloadError", "failed")
        assert "effect 'send' parameters" in error["message"]
        assert reason in error["message"]

    @BAD
    def test_an_effects_result_is_recorded_as_failed(self, journal, value, reason):
        def phase(ctx):
            ctx.effect("fetch", lambda: value)
            return NEXT

        engine = engine_for(journal, phase)
        run = engine.run(engine.start())

        assert run.state == "failed"
        (record,) = journal.effects(run.run_id)
        assert record.status.value == "failed"
        assert record.result is None
        assert reason in record.error["message"]


class TestJournalsAgree:
    """Every journal refuses the same payloads with a JournalError, and writes nothing."""

    @BAD
    def test_create_run_refuses_them(self, journal, value, reason):
        now = utc_now()
        run = RunRecord(
            run_id="r", machine=SPEC.name, spec_hash=SPEC.spec_hash, state="a", input=value,
            created_at=now, updated_at=now,
        )  # fmt: skip
        first = TransitionRecord(
            run_id="r", seq=0, from_state=None, event="STARTED", to_state="a", at=now
        )

        with pytest.raises(JournalError, match="nothing was written") as info:
            journal.create_run(run, first, spec_json=SPEC.to_json())

        assert reason in str(info.value)
        assert journal.runs() == []

    @BAD
    def test_commit_refuses_them(self, journal, value, reason):
        engine = engine_for(journal, lambda _ctx: NEXT)
        run_id = engine.start()
        run = journal.claim(run_id, "me", ttl=60)
        before = list(journal.transitions(run_id))
        transition = TransitionRecord(
            run_id=run_id, seq=1, from_state="a", event=NEXT, to_state="b", at=utc_now(),
            result={"output": value}, lease_token=run.lease_token,
        )  # fmt: skip

        with pytest.raises(JournalError, match="nothing was written") as info:
            journal.commit(attrs.evolve(run, state="b", seq=1), transition)

        assert reason in str(info.value)
        assert journal.transitions(run_id) == before

    @pytest.mark.parametrize("value", [float("nan"), float("inf")])
    def test_an_iteration_number_that_is_not_finite_is_refused(self, journal, value):
        engine = engine_for(journal, lambda _ctx: NEXT)
        run_id = engine.start()
        run = journal.claim(run_id, "me", ttl=60)
        transition = TransitionRecord(
            run_id=run_id, seq=1, from_state="a", event=NEXT, to_state="b", at=utc_now(),
            iteration=1, lease_token=run.lease_token,
        )  # fmt: skip
        record = IterationRecord(run_id, 1, state="b", cost_usd=value)

        with pytest.raises(JournalError, match="nothing was written"):
            journal.commit(
                attrs.evolve(run, state="b", seq=1, iteration=1), transition, iterations=[record]
            )

        assert journal.iterations(run_id) == []


#: Any JSON-ish value: floats with NaN and ±Infinity, text with lone surrogates, some nesting.
json_ish = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from([float("nan"), float("inf"), -float("inf")])
    # st.text() filters lone surrogates out of any alphabet: joined characters keep them
    | st.lists(st.characters() | st.sampled_from("\ud800\udbff\udc00\udfff")).map("".join),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=3), children, max_size=4)
    ),
    max_leaves=20,
)


def standard_json(value) -> bool:
    """The standard library's word on it: strict JSON whose text UTF-8 can hold."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    return True


class TestEveryValue:
    """Whatever a payload is, the engine refuses it with a PayloadError or stores it readably."""

    @settings(
        max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(value=json_ish)
    def test_start_stores_it_as_given_or_refuses_it_and_writes_nothing(self, sqlite_journal, value):
        engine = engine_for(sqlite_journal, lambda _ctx: NEXT)
        engine.max_payload_bytes = 16 * 1024 * 1024
        before = len(sqlite_journal.runs())

        if not standard_json(value):
            with pytest.raises(PayloadError) as info:
                engine.start(value)
            assert info.value.what == "input"
            assert len(sqlite_journal.runs()) == before
            return

        stored = sqlite_journal.load(engine.start(value)).input
        assert json.dumps(stored, allow_nan=False) == json.dumps(value, allow_nan=False)
