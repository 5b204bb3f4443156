from __future__ import annotations

from types import SimpleNamespace

import pytest
import transitions

from fsm_runner import InvalidTransitionError, MachineSpec, RunEvent, SpecError, State, Transition
from fsm_runner.machine import CompiledMachine, compile_spec
from tests.helpers import NEXT, linear_spec


def loop_spec(name: str = "verify-loop") -> MachineSpec:
    """building -> verifying; a failed verify goes to feedback, recovery or failure by guards."""
    return MachineSpec(
        name,
        [
            State("building", handler="build"),
            State("verifying", handler="verify"),
            State("feedback", handler="feedback"),
            State("recovering", handler="recover"),
            State("succeeded", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("building", NEXT, "verifying"),
            Transition(
                "verifying",
                RunEvent.VERIFY_FAILED,
                "feedback",
                guards=("iterations_left", "worth_retrying"),
            ),
            Transition("verifying", RunEvent.VERIFY_FAILED, "recovering", unless="server_up"),
            Transition("verifying", RunEvent.VERIFY_FAILED, "failed"),
            Transition("verifying", RunEvent.VERIFY_PASSED, "succeeded"),
            Transition("verifying", "RETRY", "building", guards="iterations_left"),
            Transition("feedback", NEXT, "building"),
            Transition("recovering", NEXT, "verifying"),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )


GUARDS = {
    "iterations_left": lambda run: run.left > 0,
    "worth_retrying": lambda run: run.worth,
    "server_up": lambda run: run.up,
}


def run(*, left: int = 1, worth: bool = True, up: bool = True) -> SimpleNamespace:
    return SimpleNamespace(left=left, worth=worth, up=up)


class TestCompileSpec:
    """compile_spec builds one CompiledMachine per spec hash and reuses it."""

    def test_same_spec_returns_the_same_object(self):
        spec = loop_spec()

        first = compile_spec(spec)

        assert isinstance(first, CompiledMachine)
        assert compile_spec(spec) is first

    def test_equal_spec_built_again_reuses_the_compiled_machine(self):
        first, second = loop_spec(), loop_spec()
        assert first is not second

        assert compile_spec(second) is compile_spec(first)

    def test_different_spec_gets_its_own_machine(self):
        assert compile_spec(loop_spec("other-loop")) is not compile_spec(loop_spec())

    def test_invalid_spec_is_refused_every_time(self):
        spec = MachineSpec("bad", [State("a", handler="a")], [Transition("a", "GO", "nowhere")])

        for _ in range(2):
            with pytest.raises(SpecError, match="unknown destination state 'nowhere'"):
                compile_spec(spec)

    def test_builds_a_transitions_machine_without_models(self):
        compiled = compile_spec(loop_spec())
        machine = compiled.machine

        assert isinstance(machine, transitions.Machine)
        assert machine.models == []
        assert list(machine.states) == [state.name for state in loop_spec().states]
        assert not any(event.startswith("to_") for event in machine.events)

    def test_resolving_adds_no_model(self):
        compiled = compile_spec(loop_spec())

        for _ in range(3):
            compiled.resolve("building", NEXT, run(), GUARDS)

        assert compiled.machine.models == []

    def test_allows(self):
        compiled = compile_spec(loop_spec())

        assert compiled.allows("building", NEXT)
        assert compiled.allows("verifying", "SYSTEM_ERROR")
        assert not compiled.allows("building", "VERIFY_PASSED")
        assert not compiled.allows("succeeded", "SYSTEM_ERROR")  # `*` skips terminal states


class TestResolve:
    """resolve() returns the first candidate whose guards pass."""

    def test_unguarded_transition(self):
        compiled = compile_spec(loop_spec())

        assert compiled.resolve("building", NEXT, run(), GUARDS) == "verifying"

    def test_wildcard_transition(self):
        compiled = compile_spec(loop_spec())

        assert compiled.resolve("feedback", "SYSTEM_ERROR", run(), GUARDS) == "failed"

    def test_event_may_be_given_as_enum(self):
        compiled = compile_spec(loop_spec())

        assert compiled.resolve("verifying", RunEvent.VERIFY_PASSED, run(), GUARDS) == "succeeded"

    @pytest.mark.parametrize(
        ("facts", "dest"),
        [
            ({"left": 1, "worth": True, "up": True}, "feedback"),
            ({"left": 1, "worth": True, "up": False}, "feedback"),  # first passing one wins
            ({"left": 0, "worth": True, "up": False}, "recovering"),
            ({"left": 1, "worth": False, "up": False}, "recovering"),  # every guard must pass
            ({"left": 0, "worth": True, "up": True}, "failed"),  # `unless` must be false
            ({"left": 1, "worth": False, "up": True}, "failed"),
        ],
    )
    def test_guards_and_unless(self, facts, dest):
        compiled = compile_spec(loop_spec())

        assert compiled.resolve("verifying", "VERIFY_FAILED", run(**facts), GUARDS) == dest

    def test_guards_read_the_run_and_stop_at_the_first_passing_candidate(self):
        compiled = compile_spec(loop_spec())
        seen: list[tuple[str, object]] = []

        def recording(name: str, answer: bool) -> object:
            def guard(current: object) -> bool:
                seen.append((name, current))
                return answer

            return guard

        the_run = run()
        guards = {
            "iterations_left": recording("iterations_left", True),
            "worth_retrying": recording("worth_retrying", True),
            "server_up": recording("server_up", False),
        }

        dest = compiled.resolve("verifying", "VERIFY_FAILED", the_run, guards)

        assert dest == "feedback"
        assert seen == [("iterations_left", the_run), ("worth_retrying", the_run)]

    def test_explicit_candidate_is_tried_before_the_wildcard(self):
        spec = MachineSpec(
            "override",
            [
                State("a", handler="a"),
                State("recovering", handler="recover"),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                Transition("*", "LOST", "failed"),
                Transition("a", NEXT, "done"),
                Transition("a", "LOST", "recovering", guards="can_recover"),
                Transition("recovering", NEXT, "a"),
            ],
        )
        compiled = compile_spec(spec)

        assert compiled.resolve("a", "LOST", None, {"can_recover": lambda _: True}) == "recovering"
        assert compiled.resolve("a", "LOST", None, {"can_recover": lambda _: False}) == "failed"
        assert compiled.resolve("recovering", "LOST", None, {}) == "failed"


class TestInvalidTransition:
    """An event the state does not allow raises InvalidTransitionError."""

    def test_unknown_event(self):
        compiled = compile_spec(loop_spec())

        with pytest.raises(InvalidTransitionError) as info:
            compiled.resolve("building", "VERIFY_PASSED", run(), GUARDS, run_id="run-7")

        error = info.value
        assert (error.run_id, error.state, error.event) == ("run-7", "building", "VERIFY_PASSED")
        assert error.reason == "not allowed"
        assert isinstance(error, ValueError)
        assert str(error) == "run run-7: event 'VERIFY_PASSED' is not allowed in state 'building'"

    def test_unknown_state(self):
        compiled = compile_spec(loop_spec())

        with pytest.raises(InvalidTransitionError) as info:
            compiled.resolve("nowhere", NEXT, run(), GUARDS)

        assert info.value.run_id is None
        assert info.value.state == "nowhere"
        assert "run " not in str(info.value)

    def test_no_exit_from_a_terminal_state_even_by_wildcard(self):
        compiled = compile_spec(linear_spec("building"))

        with pytest.raises(InvalidTransitionError) as info:
            compiled.resolve("done", "SYSTEM_ERROR", None, {}, run_id="r1")

        assert info.value.state == "done"
        assert info.value.event == "SYSTEM_ERROR"

    def test_every_guard_rejects(self):
        compiled = compile_spec(loop_spec())

        with pytest.raises(InvalidTransitionError) as info:
            compiled.resolve("verifying", "RETRY", run(left=0), GUARDS, run_id="run-8")

        error = info.value
        assert (error.run_id, error.state, error.event) == ("run-8", "verifying", "RETRY")
        assert error.reason == "rejected by every guard"
        assert "rejected by every guard" in str(error)
