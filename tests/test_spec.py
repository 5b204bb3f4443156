from __future__ import annotations

import hashlib
import json

import attrs
import pytest

from fsm_runner import (
    WILDCARD,
    Engine,
    MachineSpec,
    MemoryJournal,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    SpecError,
    State,
    Transition,
)
from fsm_runner.machine import compile_spec
from tests.helpers import NEXT, linear_spec


def broken_spec() -> MachineSpec:
    """A spec with one of each kind of problem that validate() must report."""
    return MachineSpec(
        "broken",
        [
            State("building", handler="build"),
            State("verifying", handler="verify"),
            State("stuck", handler="stick"),  # reachable, nothing leaves it
            State("island", handler="island"),  # leaves, but nothing enters it
            State("done", terminal=True, handler="finish"),  # terminal with a handler
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("building", "BUILT", "verifying"),  # unguarded, yet not the last
            Transition("building", "BUILT", "stuck"),
            Transition("verifying", "PASSED", "done", guards="has_budget"),
            Transition("verifying", "PASSED", "failed"),
            Transition("island", "GO", "done"),
            Transition("ghost", "GO", "done"),
            Transition("verifying", "LOST", "nowhere"),
            Transition("done", "AGAIN", "building"),
        ],
    )


def problems_of(spec: MachineSpec, **registered: object) -> tuple[str, ...]:
    with pytest.raises(SpecError) as info:
        spec.validate(**registered)  # type: ignore[arg-type]
    return info.value.problems


def assert_reported(problems: tuple[str, ...], fragment: str) -> None:
    assert any(fragment in problem for problem in problems), (fragment, problems)


def rich_spec() -> MachineSpec:
    """A valid spec that sets every field of every class to something other than its default."""
    return MachineSpec(
        "rich",
        [
            State(
                "building",
                handler="build",
                timeout=30.0,
                retry=RetryPolicy(
                    max_attempts=5, wait_initial=0.5, wait_max=9.0, wait_exp_base=3.0
                ),
                starts_iteration=True,
                description="compile the thing",
            ),
            State("verifying", handler="verify"),
            State("waiting"),
            State("succeeded", terminal=True),
            State("failed", terminal=True, outcome=RunLifecycle.FAILED),
        ],
        [
            Transition("building", RunEvent.BUILD_SUCCEEDED, "verifying"),
            Transition(
                ("building", "verifying"),
                RunEvent.VERIFY_FAILED_RETRYABLE,
                "building",
                guards=("iterations_left", "worth_it"),
                unless="stopping",
            ),
            Transition("verifying", RunEvent.VERIFY_PASSED, "waiting"),
            Transition("waiting", "APPROVED", "succeeded"),
            Transition(WILDCARD, RunEvent.SYSTEM_ERROR, "failed"),
        ],
        initial="building",
    )


def evolve_state(spec: MachineSpec, index: int, **changes: object) -> MachineSpec:
    states = list(spec.states)
    states[index] = attrs.evolve(states[index], **changes)
    return attrs.evolve(spec, states=states)


def evolve_transition(spec: MachineSpec, index: int, **changes: object) -> MachineSpec:
    transitions = list(spec.transitions)
    transitions[index] = attrs.evolve(transitions[index], **changes)
    return attrs.evolve(spec, transitions=transitions)


class TestValidate:
    """validate() raises one SpecError that lists every problem."""

    def test_valid_spec_passes(self):
        spec = linear_spec("building", "verifying")

        spec.validate(handlers={"building": object(), "verifying": object()}, guards={})

    def test_every_problem_is_reported_together(self):
        problems = problems_of(
            broken_spec(), handlers={"build", "verify", "island", "finish"}, guards=set()
        )

        expected = [
            "unknown source state 'ghost'",
            "unknown destination state 'nowhere'",
            "state 'island' is unreachable from 'building'",
            "non-terminal state 'stuck' is a dead end",
            "terminal state 'done' has an exit",
            "terminal state 'done' has a handler ('finish')",
            "ambiguous: state 'building' has 2 transitions on 'BUILT'",
            "state 'stuck' names handler 'stick', not registered",
            "guard 'has_budget' is not registered",
        ]
        for fragment in expected:
            assert_reported(problems, fragment)
        assert len(problems) == len(expected), problems

    def test_guarded_candidates_before_an_unguarded_one_are_not_ambiguous(self):
        problems = problems_of(broken_spec())

        assert not any("'verifying'" in p and "ambiguous" in p for p in problems), problems

    def test_two_unguarded_candidates_are_ambiguous(self):
        spec = MachineSpec(
            "m",
            [State("a", handler="a"), State("b", terminal=True), State("c", terminal=True)],
            [Transition("a", "GO", "b"), Transition("a", "GO", "c")],
        )

        (problem,) = problems_of(spec)

        assert problem.startswith("ambiguous: state 'a' has 2 transitions on 'GO' (to b, c)")

    def test_registrations_are_checked_only_when_given(self):
        spec = broken_spec()

        without = problems_of(spec)
        with_registry = problems_of(spec, handlers={}, guards={})

        assert not any("not registered" in p for p in without)
        for name in ("build", "verify", "stick", "island", "finish"):
            assert_reported(with_registry, f"names handler {name!r}, not registered")
        assert_reported(with_registry, "guard 'has_budget' is not registered")

    def test_unknown_initial_state_is_reported_with_other_problems(self):
        spec = MachineSpec(
            "m",
            [State("a", handler="a"), State("done", terminal=True)],
            [Transition("a", "GO", "done"), Transition("a", "LOST", "nowhere")],
            initial="nowhere",
        )

        problems = problems_of(spec)

        assert_reported(problems, "initial state 'nowhere' is not a state")
        assert_reported(problems, "unknown destination state 'nowhere'")

    def test_terminal_initial_state_is_reported(self):
        spec = MachineSpec(
            "m",
            [State("a", handler="a"), State("done", terminal=True)],
            [Transition("a", "GO", "done")],
            initial="done",
        )

        assert_reported(problems_of(spec), "initial state 'done' is terminal")

    def test_state_level_problems(self):
        spec = MachineSpec(
            "",
            [
                State("a", handler="a", timeout=0, retry=RetryPolicy(max_attempts=0)),
                State("a", handler="a"),
                State("*"),
                State("b", outcome="failed"),
                State("done", terminal=True, outcome="active"),
            ],
            [Transition("a", "GO", "done"), Transition("b", "GO", "done")],
        )

        problems = problems_of(spec)

        for fragment in (
            "the machine has no name",
            "state 'a' is declared twice",
            "invalid state name '*'",
            "non-terminal state 'b' has an outcome",
            "terminal state 'done' cannot have outcome 'active'",
            "state 'a' has a timeout <= 0",
            "state 'a': max_attempts must be >= 1, not 0",
        ):
            assert_reported(problems, fragment)

    def test_empty_machine(self):
        problems = problems_of(MachineSpec("", [], []))

        assert_reported(problems, "the machine has no name")
        assert_reported(problems, "the machine has no states")

    def test_error_message_is_one_line_naming_the_machine_and_every_problem(self):
        with pytest.raises(SpecError) as info:
            broken_spec().validate()

        error = info.value
        assert error.machine == "broken"
        assert isinstance(error, ValueError)
        assert "\n" not in str(error)
        assert str(error).startswith("invalid machine spec 'broken': ")
        for problem in error.problems:
            assert problem in str(error)


class TestWronglyTypedFields:
    """A field of the wrong type is one more problem in the one SpecError, never a bare error."""

    def test_a_non_string_event_is_listed_with_every_other_problem(self):
        spec = MachineSpec(
            "typed",
            [State("a", handler="a"), State("done", terminal=True)],
            [
                Transition("a", 42, "done"),
                Transition("a", None, "done"),
                Transition("a", "GO", "nowhere"),
            ],
        )

        with pytest.raises(SpecError) as info:
            spec.validate(handlers={})

        problems = info.value.problems
        assert_reported(problems, "transition #0 (a -42->): event 42 is not a str or a str enum")
        assert_reported(problems, "transition #1 (a -None->): event None is not a str")
        assert_reported(problems, "unknown destination state 'nowhere'")
        assert_reported(problems, "names handler 'a', not registered")
        assert not any("has no event" in problem for problem in problems), problems

    def test_an_engine_refuses_it_with_the_same_spec_error(self):
        spec = MachineSpec(
            "typed",
            [State("a", handler="a"), State("done", terminal=True)],
            [Transition("a", 42, "done"), Transition("a", "GO", "done")],
        )

        with pytest.raises(SpecError, match="event 42 is not a str or a str enum"):
            Engine(spec, handlers={"a": lambda _ctx: "GO"}, journal=MemoryJournal())

    @pytest.mark.parametrize(
        ("state", "fragment"),
        [
            (lambda: State(42), "state name 42 is not a str"),
            (lambda: State(["x"]), "state name ['x'] is not a str"),
            (lambda: State("\ud800"), r"state name '\ud800' holds a lone surrogate"),
            (lambda: State("x", handler=7), "state 'x': handler 7 is not a str"),
            (
                lambda: State("x", terminal="yes"),
                "state 'x': terminal must be True or False, not 'yes'",
            ),
            (
                lambda: State("x", outcome="bogus"),
                "outcome 'bogus' is not one of succeeded, failed",
            ),
            (
                lambda: State("x", timeout="soon"),
                "timeout must be a finite number of seconds, not 'soon'",
            ),
            (
                lambda: State("x", timeout=float("nan")),
                "timeout must be a finite number of seconds, not nan",
            ),
            (
                lambda: State("x", timeout=float("inf")),
                "timeout must be a finite number of seconds, not inf",
            ),
            (lambda: State("x", retry=3), "state 'x': retry 3 is not a RetryPolicy"),
            (
                lambda: State("x", retry=RetryPolicy(max_attempts="x")),
                "max_attempts must be an integer",
            ),
            (
                lambda: State("x", retry=RetryPolicy(wait_max=float("inf"))),
                "waits must be finite numbers",
            ),
            (lambda: State("x", description=None), "state 'x': description None is not a str"),
            (
                lambda: State("x", advance_on=3),
                "state 'x': advance_on 3 is not a str or a str enum",
            ),
            (lambda: State("x", allows=[1]), "state 'x': allows 1 is not a str"),
            (lambda: State("x", max_mutations="2"), "max_mutations must be an integer, not '2'"),
            (lambda: "x", "states[1] is not a State: 'x'"),
        ],
    )
    def test_wrongly_typed_state_fields(self, state, fragment):
        spec = MachineSpec(
            "typed",
            [State("a"), state(), State("done", terminal=True)],
            [Transition("a", "GO", "done"), Transition("a", 5, "done")],
        )

        problems = problems_of(spec)

        assert_reported(problems, fragment)
        assert_reported(problems, "event 5 is not a str")

    @pytest.mark.parametrize(
        ("transition", "fragment"),
        [
            (lambda: Transition(7, "GO", "done"), "transition #1 (7 -GO->): source 7 is not a str"),
            (lambda: Transition(["a", None], "GO", "done"), "source None is not a str"),
            (lambda: Transition("a", "GO", ["done"]), "destination ['done'] is not a str"),
            (lambda: Transition("a", "GO", "done", guards=[1]), "guard 1 is not a str"),
            (lambda: Transition("a", "GO", "done", unless=[None]), "guard None is not a str"),
            (lambda: Transition("a", "GO", "done", reason=3), "reason 3 is not a str"),
            (lambda: Transition("a", "\udcff", "done"), r"event '\udcff' holds a lone surrogate"),
            (lambda: "a -> done", "transitions[1] is not a Transition: 'a -> done'"),
        ],
    )
    def test_wrongly_typed_transition_fields(self, transition, fragment):
        spec = MachineSpec(
            "typed",
            [State("a"), State("done", terminal=True), State(3)],
            [Transition("a", "GO", "done"), transition()],
        )

        problems = problems_of(spec)

        assert_reported(problems, fragment)
        assert_reported(problems, "state name 3 is not a str")

    def test_machine_level_fields(self):
        problems = problems_of(
            MachineSpec(
                None,
                [State("a"), State("done", terminal=True)],
                [Transition("a", "GO", "done")],
                initial=["a"],
                status_events={"ERROR": 3},
            )
        )

        assert_reported(problems, "the machine's name None is not a str")
        assert_reported(problems, "initial state ['a'] is not a str")
        assert_reported(problems, "status_events['ERROR'] 3 is not a str or a str enum")

    def test_a_spec_of_wrong_types_is_refused_by_compile_spec_too(self):
        spec = MachineSpec("typed", [State("a", outcome="bogus")], [])

        with pytest.raises(SpecError, match="outcome 'bogus'"):
            compile_spec(spec)

    def test_allows_given_as_one_string_is_one_kind(self):
        assert State("a", allows="read").allows == ("read",)


class TestNoTerminalState:
    """A machine without a terminal state is valid: a service loop (decided for issue 17)."""

    def loop(self) -> MachineSpec:
        return MachineSpec(
            "service",
            [State("polling", handler="poll"), State("handling", handler="handle")],
            [
                Transition("polling", "POLLED", "handling"),
                Transition("handling", "DONE", "polling"),
            ],
        )

    def test_it_validates(self):
        self.loop().validate(handlers={"poll": None, "handle": None})

    def test_its_runs_are_driven_by_a_step_budget_and_ended_by_abort(self, journal):
        engine = Engine(
            self.loop(),
            handlers={"poll": lambda _ctx: "POLLED", "handle": lambda _ctx: "DONE"},
            journal=journal,
        )
        run_id = engine.start()

        run = engine.run(run_id, max_steps=5)
        assert (run.state, run.seq, run.status) == ("handling", 5, RunLifecycle.ACTIVE)
        run = engine.abort(run_id, "shutting down")
        assert (run.state, run.status) == ("handling", RunLifecycle.ABORTED)


class TestWildcard:
    """`*` stands for every non-terminal state, never a terminal one."""

    def test_expand_source_excludes_terminal_states(self):
        spec = linear_spec("building", "verifying")
        wildcard = Transition(WILDCARD, RunEvent.SYSTEM_ERROR, "failed")

        assert spec.expand_source(wildcard) == ("building", "verifying")
        assert spec.expand_source(Transition("verifying", NEXT, "done")) == ("verifying",)

    def test_edges_have_no_wildcard_exit_from_a_terminal_state(self):
        spec = linear_spec("building", "verifying")

        for terminal in spec.terminal_states:
            assert spec.events_from(terminal) == ()
        assert ("building", "SYSTEM_ERROR") in spec.edges
        assert ("done", "SYSTEM_ERROR") not in spec.edges
        assert ("failed", "USER_ABORTED") not in spec.edges

    def test_wildcard_exits_do_not_make_terminal_states_invalid(self):
        spec = linear_spec("building")

        spec.validate()  # `*` exits would be "terminal state has an exit" if `*` included them

    def test_explicit_sources_are_tried_before_wildcard_ones(self):
        lost_anywhere = Transition(WILDCARD, "LOST", "failed")
        lost_in_b = Transition("b", "LOST", "recovering", guards="can_recover")
        spec = MachineSpec(
            "m",
            [
                State("a", handler="a"),
                State("b", handler="b"),
                State("recovering", handler="recover"),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                lost_anywhere,  # declared first, still tried last
                Transition("a", NEXT, "b"),
                Transition("b", NEXT, "done"),
                lost_in_b,
                Transition("recovering", NEXT, "b"),
            ],
        )

        spec.validate(guards={"can_recover"})
        assert spec.edges[("b", "LOST")] == (lost_in_b, lost_anywhere)
        assert spec.edges[("a", "LOST")] == (lost_anywhere,)


class TestRoundTrip:
    """A spec survives to_dict/from_dict and to_json/from_json unchanged."""

    def test_dict_round_trip(self):
        spec = rich_spec()

        assert MachineSpec.from_dict(spec.to_dict()) == spec

    def test_json_round_trip(self):
        spec = rich_spec()

        again = MachineSpec.from_json(spec.to_json())

        assert again == spec
        assert again.spec_hash == spec.spec_hash

    def test_from_dict_accepts_json_data(self):
        spec = rich_spec()

        assert MachineSpec.from_dict(json.loads(spec.to_json())) == spec

    def test_json_is_canonical(self):
        text = rich_spec().to_json()

        assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))

    def test_from_dict_accepts_bare_strings_for_source_and_guards(self):
        data = {
            "name": "m",
            "states": [{"name": "a", "handler": "a"}, {"name": "done", "terminal": True}],
            "transitions": [
                {"source": "a", "event": "GO", "dest": "done", "guards": "ok", "unless": "no"}
            ],
        }

        spec = MachineSpec.from_dict(data)

        assert spec.transitions == (
            Transition(("a",), "GO", "done", guards=("ok",), unless=("no",)),
        )
        assert spec.initial == "a"

    @pytest.mark.parametrize(
        "text",
        [
            "",
            "not json",
            "{",
            "[1, 2]",
            "null",
            '"spec"',
            '{"name": "m"}',
            '{"name": "m", "states": 5, "transitions": []}',
            '{"name": "m", "states": [{"handler": "h"}], "transitions": []}',
            '{"name": "m", "states": [{"name": "a", "outcome": "weird"}], "transitions": []}',
        ],
    )
    def test_from_json_on_garbage_raises_spec_error(self, text):
        with pytest.raises(SpecError) as info:
            MachineSpec.from_json(text)

        assert info.value.problems
        assert "\n" not in str(info.value)

    def test_from_dict_on_garbage_raises_spec_error(self):
        with pytest.raises(SpecError):
            MachineSpec.from_dict({"name": "m", "states": [{"name": "a"}], "transitions": [{}]})


class TestHash:
    """The spec hash identifies a spec's content, and only its content."""

    def test_same_spec_same_hash(self):
        first, second = rich_spec(), rich_spec()

        assert first is not second
        assert first.spec_hash == second.spec_hash
        assert first.spec_hash == hashlib.sha256(first.to_json().encode()).hexdigest()

    @pytest.mark.parametrize(
        ("whole", "fractional"),
        [
            ({"timeout": 30}, {"timeout": 30.0}),
            (
                {"retry": RetryPolicy(wait_max=5, wait_exp_base=3)},
                {"retry": RetryPolicy(wait_max=5.0, wait_exp_base=3.0)},
            ),
        ],
        ids=["timeout", "retry"],
    )
    def test_equal_specs_hash_alike_whatever_the_number_type(self, whole, fractional):
        # The journal keeps a spec's JSON; the spec read back from it must keep the run's hash.
        def make(**fields: object) -> MachineSpec:
            return MachineSpec(
                "m",
                [State("a", handler="a", **fields), State("done", terminal=True)],  # type: ignore[arg-type]
                [Transition("a", "GO", "done")],
            )

        spec = make(**whole)

        assert spec == make(**fractional)
        assert make(**fractional).spec_hash == spec.spec_hash
        assert MachineSpec.from_json(spec.to_json()).spec_hash == spec.spec_hash

    def test_implicit_and_explicit_initial_hash_alike(self):
        spec = linear_spec("a", "b")

        explicit = MachineSpec(spec.name, spec.states, spec.transitions, initial="a")

        assert explicit.spec_hash == spec.spec_hash

    @pytest.mark.parametrize(
        "change",
        [
            lambda s: attrs.evolve(s, name="other"),
            lambda s: attrs.evolve(s, initial="verifying"),
            lambda s: evolve_state(s, 0, timeout=31.0),
            lambda s: evolve_state(s, 0, description=""),
            lambda s: evolve_transition(s, -1, dest="succeeded"),
            lambda s: evolve_transition(s, 0, guards=("g",)),
            lambda s: attrs.evolve(s, transitions=tuple(reversed(s.transitions))),
        ],
        ids=["name", "initial", "timeout", "description", "dest", "guard", "order"],
    )
    def test_changed_spec_changes_hash(self, change):
        spec = rich_spec()

        changed = change(spec)

        assert changed != spec
        assert changed.spec_hash != spec.spec_hash

    def test_defaulted_fields_are_left_out(self):
        spec = MachineSpec(
            "m",
            [State("a", handler="a", retry=RetryPolicy()), State("done", terminal=True)],
            [Transition("a", "GO", "done")],
        )

        assert spec.to_dict() == {
            "name": "m",
            "states": [
                {"name": "a", "handler": "a", "retry": {}},
                {"name": "done", "terminal": True},
            ],
            "transitions": [{"source": ["a"], "event": "GO", "dest": "done"}],
            "initial": "a",
        }

    def test_hash_is_pinned_to_the_canonical_json_of_non_default_fields(self):
        # Written by hand: a field added later with a default must not change this hash.
        canonical = (
            '{"initial":"a","name":"m","states":[{"handler":"a","name":"a"},'
            '{"name":"done","outcome":"failed","terminal":true}],'
            '"transitions":[{"dest":"done","event":"GO","source":["a"]}]}'
        )
        spec = MachineSpec(
            "m",
            [State("a", handler="a"), State("done", terminal=True, outcome="failed")],
            [Transition("a", "GO", "done")],
        )

        assert spec.to_json() == canonical
        assert spec.spec_hash == hashlib.sha256(canonical.encode()).hexdigest()

    def test_to_dict_is_plain_data(self):
        spec = rich_spec()

        data = spec.to_dict()

        assert type(data["states"][-1]["outcome"]) is str
        assert type(data["transitions"][0]["event"]) is str
        assert json.loads(json.dumps(data)) == json.loads(spec.to_json())


class TestParts:
    """State and Transition on their own (RetryPolicy on its own: test_retries.py)."""

    def test_transition_normalises_source_event_and_guards(self):
        transition = Transition("a", RunEvent.SYSTEM_ERROR, "b", guards="g")

        assert transition.source == ("a",)
        assert transition.event == "SYSTEM_ERROR"
        assert type(transition.event) is str
        assert transition.guards == ("g",)
        assert transition.guarded
        assert not Transition("a", "GO", "b").guarded
        assert Transition("a", "GO", "b", unless="u").guarded

    def test_final_outcome(self):
        assert State("a", handler="a").final_outcome is RunLifecycle.ACTIVE
        assert State("done", terminal=True).final_outcome is RunLifecycle.SUCCEEDED
        assert State("x", terminal=True, outcome="failed").final_outcome is RunLifecycle.FAILED

    def test_spec_lookups(self):
        spec = linear_spec("building", "verifying")

        assert spec.state("verifying").handler == "verifying"
        assert spec.has_state("done")
        assert not spec.has_state("nope")
        assert spec.terminal_states == ("done", "failed", "canceled")
        assert spec.handler_names == {"building", "verifying"}
        with pytest.raises(KeyError):
            spec.state("nope")
