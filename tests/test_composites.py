"""Composite states (sub-phases), RETURN history targets and PhaseStatus mapping.

Interruption (Ctrl-C, SIGTERM), in a composite's leaf too, is tested in ``test_interruption.py``."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from fsm_runner import (
    RETURN,
    Engine,
    InvalidTransitionError,
    MachineSpec,
    PhaseResult,
    PhaseStatus,
    RunEvent,
    SpecError,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.journal import SCHEMA_VERSION
from fsm_runner.machine import compile_spec
from tests.helpers import (
    FOUND,
    LOST,
    linear_spec,
    nested_handlers,
    nested_spec,
    recorder,
    snapshot,
    undo_v4,
)

PHASE_COMPLETED = RunEvent.PHASE_COMPLETED.value
SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value


# -- helpers ---------------------------------------------------------------------------------


def completed(_ctx):
    return PhaseStatus.OK


def lost_once(count):
    return LOST if count == 1 else PhaseStatus.OK


def path_of(journal, run_id):
    """(from_state, event, to_state) of every transition, seq order."""
    return [(t.from_state, t.event, t.to_state) for t in journal.transitions(run_id)]


def dests(spec, state, event):
    return [candidate.dest for candidate in spec.edges[(state, event)]]


def problems_of(spec):
    with pytest.raises(SpecError) as info:
        spec.validate()
    return info.value.problems


# -- the spec --------------------------------------------------------------------------------


class TestCompositeStructure:
    """Leaves, entry and exit leaves, parents of nested composites."""

    def test_leaves_in_declaration_order(self):
        spec = nested_spec()
        assert [s.name for s in spec.leaves] == [
            "prepare", "a", "b", "c", "d", "recovering", "done", "failed",
        ]  # fmt: skip
        assert spec.state("working").composite
        assert not spec.state("a").composite

    def test_entry_and_exit_leaf_through_two_levels(self):
        spec = MachineSpec(
            "deep",
            [
                State(
                    "outer",
                    children=[
                        State("first", children=[State("x", handler="h"), State("y", handler="h")]),
                        State("last", children=[State("z", handler="h"), State("w", handler="h")]),
                    ],
                ),
                State("done", terminal=True),
            ],
            [Transition("outer", PHASE_COMPLETED, "done")],
        )
        spec.validate()
        assert spec.entry_leaf("outer") == "x"
        assert spec.exit_leaf("outer") == "w"
        assert spec.entry_leaf("last") == "z"
        assert spec.exit_leaf("first") == "y"
        assert spec.entry_leaf("y") == spec.exit_leaf("y") == "y"
        assert spec.parents("z") == ("last", "outer")
        assert spec.parents("outer") == ()
        assert spec.leaves_under("outer") == ("x", "y", "z", "w")
        assert spec.initial_leaf == "x"

    def test_transition_from_a_composite_leaves_from_every_leaf_inside(self):
        spec = nested_spec()
        transition = Transition("working", LOST, "recovering")
        assert spec.expand_source(transition) == ("a", "b", "c", "d")
        for leaf in ("a", "b", "c", "d"):
            assert dests(spec, leaf, LOST) == ["recovering"]
        assert ("prepare", LOST) not in spec.edges
        assert ("recovering", LOST) not in spec.edges

    def test_composite_destination_enters_its_first_leaf(self):
        spec = nested_spec(extra_transitions=[Transition("recovering", "RESTARTED", "inner")])
        assert dests(spec, "prepare", PHASE_COMPLETED) == ["a"]
        assert dests(spec, "recovering", "RESTARTED") == ["b"]

    def test_initial_composite_starts_at_its_first_leaf(self):
        spec = nested_spec(initial="inner")
        assert spec.initial == "inner"
        assert spec.initial_leaf == "b"
        composite_first = MachineSpec(
            "first",
            [State("work", children=[State("a", handler="h")]), State("done", terminal=True)],
            [Transition("work", PHASE_COMPLETED, "done")],
        )
        assert composite_first.initial == "work"
        assert composite_first.initial_leaf == "a"


class TestCompositePrecedence:
    """Which candidate a leaf tries first: own, implicit advance, enclosing, wildcard."""

    def test_implicit_advance_between_children_on_phase_completed(self):
        spec = nested_spec()
        assert dests(spec, "a", PHASE_COMPLETED) == ["b", "done"]  # then working's exit
        assert dests(spec, "b", PHASE_COMPLETED)[0] == "c"  # inner's own advance
        assert dests(spec, "c", PHASE_COMPLETED)[0] == "d"  # inner done: working advances

    def test_last_child_uses_the_composites_own_transition(self):
        spec = nested_spec()
        assert dests(spec, "d", PHASE_COMPLETED) == ["done"]

    def test_implicit_advance_on_a_custom_event(self):
        spec = nested_spec(advance_on=RunEvent.VERIFY_PASSED)
        assert spec.state("working").advance_on == "VERIFY_PASSED"
        assert dests(spec, "a", "VERIFY_PASSED") == ["b"]
        assert dests(spec, "c", "VERIFY_PASSED") == ["d"]
        # PHASE_COMPLETED no longer advances working's children: a's leads out of working
        assert dests(spec, "a", PHASE_COMPLETED) == ["done"]
        assert ("d", "VERIFY_PASSED") not in spec.edges  # the last child: working has no exit
        # each composite advances on its own event: inner still on PHASE_COMPLETED
        assert dests(spec, "b", PHASE_COMPLETED)[0] == "c"
        assert ("b", "VERIFY_PASSED") not in spec.edges

    def test_a_childs_own_transition_overrides_the_advance_and_the_composites(self):
        spec = nested_spec(
            extra_transitions=[
                Transition("a", PHASE_COMPLETED, "d"),
                Transition("a", LOST, "failed"),
            ]
        )
        spec.validate()
        assert dests(spec, "a", PHASE_COMPLETED)[0] == "d"
        assert dests(spec, "a", LOST)[0] == "failed"
        assert dests(spec, "b", LOST)[0] == "recovering"  # the sibling keeps the composite's
        assert compile_spec(spec).resolve("a", PHASE_COMPLETED, None, {}) == "d"

    def test_an_inner_composites_transition_overrides_an_outers(self):
        spec = nested_spec(extra_transitions=[Transition("inner", LOST, "failed")])
        spec.validate()
        assert dests(spec, "b", LOST) == ["failed", "recovering"]
        assert dests(spec, "c", LOST) == ["failed", "recovering"]
        assert dests(spec, "a", LOST) == ["recovering"]

    def test_an_inner_composites_exit_overrides_the_outers_implicit_advance(self):
        # inner's own PHASE_COMPLETED exit is more specific than working's implicit
        # inner -> d advance, just as a leaf's own transition overrides it.
        spec = nested_spec(extra_transitions=[Transition("inner", PHASE_COMPLETED, "failed")])
        assert dests(spec, "b", PHASE_COMPLETED)[0] == "c"  # inner's children advance first
        assert dests(spec, "c", PHASE_COMPLETED)[0] == "failed"

    def test_wildcard_comes_last(self):
        spec = nested_spec(
            extra_transitions=[
                Transition("*", LOST, "failed"),
                Transition("inner", LOST, "done"),
            ]
        )
        spec.validate()
        assert dests(spec, "b", LOST) == ["done", "recovering", "failed"]
        assert dests(spec, "a", LOST) == ["recovering", "failed"]
        assert dests(spec, "prepare", LOST) == ["failed"]


class TestCompositeValidation:
    """Problems specific to composites, RETURN and status_events."""

    def test_the_nested_spec_is_valid(self):
        nested_spec().validate()

    @pytest.mark.parametrize(
        "options",
        [{"handler": "h"}, {"terminal": True}, {"timeout": 5.0}],
        ids=["handler", "terminal", "timeout"],
    )
    def test_composite_cannot_have_handler_terminal_or_timeout(self, options):
        spec = nested_spec(**options)
        assert (
            "composite 'working' cannot have a handler or timeout, or be terminal"
            in problems_of(spec)
        )

    def test_duplicate_names_across_levels(self):
        spec = MachineSpec(
            "dup",
            [
                State("a", handler="h"),
                State("work", children=[State("inner", children=[State("a", handler="h")])]),
                State("done", terminal=True),
            ],
            [Transition("a", "GO", "work"), Transition("work", PHASE_COMPLETED, "done")],
        )
        assert "state 'a' is declared twice" in problems_of(spec)

    def test_duplicate_composite_and_child_name(self):
        spec = MachineSpec(
            "dup",
            [State("work", children=[State("work", handler="h")]), State("done", terminal=True)],
            [Transition("work", PHASE_COMPLETED, "done")],
        )
        assert "state 'work' is declared twice" in problems_of(spec)

    @pytest.mark.parametrize("name", ["$return", "$child"])
    def test_names_starting_with_dollar(self, name):
        spec = MachineSpec(
            "dollar",
            [State("work", children=[State(name, handler="h")]), State("done", terminal=True)],
            [Transition("work", PHASE_COMPLETED, "done")],
        )
        assert f"invalid state name {name!r}" in problems_of(spec)

    def test_unknown_status_events_key(self):
        spec = nested_spec(status_events={"BOGUS": "X", "ERROR": "ANALYSIS_FAILED"})
        problems = problems_of(spec)
        assert problems == ("status_events names 'BOGUS', which is not a PhaseStatus",)

    def test_unreachable_leaf_inside_a_composite(self):
        spec = MachineSpec(
            "spare",
            [
                State("a", handler="h"),
                State("spare", children=[State("x", handler="h"), State("y", handler="h")]),
                State("done", terminal=True),
            ],
            [Transition("a", "GO", "done"), Transition("spare", PHASE_COMPLETED, "done")],
        )
        problems = problems_of(spec)
        assert "state 'x' is unreachable from 'a'" in problems
        assert "state 'y' is unreachable from 'a'" in problems
        assert not any("'spare'" in problem and "unreachable" in problem for problem in problems)

    def test_ambiguity_within_a_leafs_own_group(self):
        spec = nested_spec(
            extra_transitions=[Transition("b", "X", "done"), Transition("b", "X", "failed")]
        )
        assert any(p.startswith("ambiguous: state 'b'") for p in problems_of(spec))

    def test_ambiguity_within_a_composites_group(self):
        spec = nested_spec(extra_transitions=[Transition("inner", LOST, "failed")])
        spec.validate()  # inner over working: an override, not an ambiguity
        twice = nested_spec(
            extra_transitions=[
                Transition("inner", LOST, "failed"),
                Transition("inner", LOST, "done"),
            ]
        )
        problems = problems_of(twice)
        assert any(p.startswith("ambiguous: state 'b'") for p in problems)
        assert any(p.startswith("ambiguous: state 'c'") for p in problems)
        assert not any(p.startswith("ambiguous: state 'a'") for p in problems)

    def test_guarded_candidates_in_one_group_are_not_ambiguous(self):
        spec = nested_spec(
            extra_transitions=[
                Transition("inner", LOST, "failed", guards="hopeless"),
                Transition("inner", LOST, "done"),
            ]
        )
        spec.validate(guards={"hopeless": lambda _run: True})


class TestCompositeSerialisation:
    """Nested specs round-trip; flat specs hash as before composites existed."""

    def test_nested_spec_round_trips_with_the_same_hash(self):
        spec = nested_spec(
            advance_on="STEP_DONE",
            status_events={PhaseStatus.ERROR: "ANALYSIS_FAILED"},
            extra_transitions=[Transition("inner", "STEP_DONE", "d")],
        )
        text = spec.to_json()
        again = MachineSpec.from_json(text)
        assert again == spec
        assert again.to_json() == text
        assert again.spec_hash == spec.spec_hash
        assert again.state("inner").children == spec.state("inner").children
        assert again.state("working").advance_on == "STEP_DONE"
        assert again.status_events == {"ERROR": "ANALYSIS_FAILED"}

    def test_nested_fields_change_the_hash(self):
        assert nested_spec().spec_hash != nested_spec(advance_on="STEP_DONE").spec_hash
        assert (
            nested_spec().spec_hash
            != nested_spec(status_events={"ERROR": "ANALYSIS_FAILED"}).spec_hash
        )

    def test_flat_spec_has_no_new_keys(self):
        data = linear_spec("a", "b").to_dict()
        assert not {"children", "advance_on", "status_events"} & set(data)
        for state in data["states"]:
            assert not {"children", "advance_on"} & set(state)

    def test_flat_spec_hash_is_unchanged(self):
        # The hash fsm_runner computed for this spec before composites existed (ff4cce4).
        spec = linear_spec("a", "b")
        assert spec.spec_hash == "8cb367a6db7c9a69ef5fa6df7a38891df7deb52870a507c9fd41cdcda82a0cc3"
        assert spec.spec_hash == hashlib.sha256(spec.to_json().encode()).hexdigest()


class TestCompiledReturn:
    """RETURN edges in the compiled machine."""

    def test_return_is_resolved_but_never_a_plain_edge(self):
        compiled = compile_spec(nested_spec())
        assert compiled.resolve("recovering", FOUND, None, {}) == RETURN
        assert ("recovering", FOUND) not in compiled.plain_edges
        assert compiled.plain_edges[("a", PHASE_COMPLETED)] == "b"
        assert nested_spec().returning_states == frozenset({"recovering"})


# -- the engine ------------------------------------------------------------------------------


class TestCompositeRuns:
    """Runs through composites on every journal."""

    def test_run_visits_the_leaves_in_order(self, journal):
        calls = []
        engine = Engine(nested_spec(), handlers=nested_handlers(calls), journal=journal)
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.status.value) == ("done", "succeeded")
        assert [name for name, _ in calls] == ["prepare", "a", "b", "c", "d"]
        assert path_of(journal, run_id) == [
            (None, "STARTED", "prepare"),
            ("prepare", PHASE_COMPLETED, "a"),
            ("a", PHASE_COMPLETED, "b"),
            ("b", PHASE_COMPLETED, "c"),
            ("c", PHASE_COMPLETED, "d"),
            ("d", PHASE_COMPLETED, "done"),
        ]

    def test_run_starts_in_the_first_leaf_of_an_initial_composite(self, journal):
        calls = []
        spec = nested_spec(
            initial="inner", extra_transitions=[Transition("recovering", "RESTARTED", "prepare")]
        )
        engine = Engine(spec, handlers=nested_handlers(calls), journal=journal)
        run_id = engine.start()
        assert journal.load(run_id).state == "b"
        assert engine.run(run_id).state == "done"
        assert [name for name, _ in calls] == ["b", "c", "d"]

    def test_custom_advance_on_moves_between_children(self, journal):
        calls = []
        handlers = {
            name: recorder(calls, name, "STEP_DONE") for name in ("prepare", "a", "b", "c", "d")
        }
        handlers["prepare"] = recorder(calls, "prepare", "GO")
        handlers["recover"] = recorder(calls, "recover", FOUND)
        spec = nested_spec(
            advance_on="STEP_DONE",
            inner={"advance_on": "STEP_DONE"},
            extra_transitions=[
                Transition("prepare", "GO", "working"),
                Transition("working", "STEP_DONE", "done"),
            ],
        )
        engine = Engine(spec, handlers=handlers, journal=journal)
        run_id = engine.start()
        assert engine.run(run_id).state == "done"
        assert [t.to_state for t in journal.transitions(run_id)] == [
            "prepare", "a", "b", "c", "d", "done",
        ]  # fmt: skip


class TestReturn:
    """RETURN: a recovery state sends the run back to the sub-phase that failed."""

    @pytest.mark.parametrize(
        "recovered",
        [FOUND, PhaseResult(FOUND, output={"restarted": True})],
        ids=["bare-event", "with-output"],
    )
    def test_return_goes_back_to_the_leaf_that_failed(self, journal, recovered):
        calls = []
        handlers = nested_handlers(
            calls,
            b=recorder(calls, "b", lost_once),
            recover=recorder(calls, "recover", recovered),
        )
        engine = Engine(nested_spec(), handlers=handlers, journal=journal)
        run_id = engine.start()
        in_recovery = engine.run(run_id, max_steps=3)
        assert in_recovery.state == "recovering"
        assert (in_recovery.return_to, in_recovery.return_attempt) == ("b", 1)
        run = engine.run(run_id)
        assert (run.state, run.status.value) == ("done", "succeeded")
        assert (run.return_to, run.return_attempt) == (None, 0)
        assert calls == [
            ("prepare", 1), ("a", 1), ("b", 1), ("recover", 1), ("b", 2), ("c", 1), ("d", 1),
        ]  # fmt: skip
        assert path_of(journal, run_id)[3:6] == [
            ("b", LOST, "recovering"),
            ("recovering", FOUND, "b"),
            ("b", PHASE_COMPLETED, "c"),
        ]

    def test_return_to_is_cleared_after_returning(self, journal):
        calls = []
        handlers = nested_handlers(
            calls,
            b=recorder(calls, "b", lost_once),
            recover=recorder(calls, "recover", PhaseResult(FOUND, output="ok")),
        )
        engine = Engine(nested_spec(), handlers=handlers, journal=journal)
        run_id = engine.start()
        engine.run(run_id, max_steps=4)  # ... b -LOST-> recovering -FOUND-> b
        run = journal.load(run_id)
        assert (run.state, run.attempt) == ("b", 2)
        assert (run.return_to, run.return_attempt) == (None, 0)

    def test_return_attempt_counts_on_from_the_attempt_that_left(self, journal):
        calls = []
        handlers = nested_handlers(
            calls,
            c=recorder(calls, "c", lambda count: LOST if count < 3 else PhaseStatus.OK),
            recover=recorder(calls, "recover", PhaseResult(FOUND, output="ok")),
        )
        engine = Engine(nested_spec(), handlers=handlers, journal=journal)
        run_id = engine.start()
        assert engine.run(run_id).state == "done"
        assert [attempt for name, attempt in calls if name == "c"] == [1, 2, 3]
        assert [attempt for name, attempt in calls if name == "recover"] == [1, 1]

    def test_interruption_in_recovery_keeps_the_return_target(self, journal):
        calls = []

        def recover(ctx):
            calls.append(("recover", ctx.attempt))
            if ctx.attempt == 1:
                raise KeyboardInterrupt
            return PhaseResult(FOUND, output="ok")

        handlers = nested_handlers(calls, b=recorder(calls, "b", lost_once), recover=recover)
        engine = Engine(nested_spec(), handlers=handlers, journal=journal)
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.run(run_id)
        run = journal.load(run_id)
        assert (run.state, run.return_to, run.return_attempt) == ("recovering", "b", 1)
        assert engine.resume(run_id).state == "done"
        assert [attempt for name, attempt in calls if name == "b"] == [1, 2]

    def test_return_target_survives_a_journal_reload(self, tmp_path):
        path = tmp_path / "journal.db"
        calls = []
        handlers = nested_handlers(
            calls,
            b=recorder(calls, "b", lost_once),
            recover=recorder(calls, "recover", PhaseResult(FOUND, output="ok")),
        )
        with SqliteJournal(path) as first:
            engine = Engine(nested_spec(), handlers=handlers, journal=first)
            run_id = engine.start()
            assert engine.run(run_id, max_steps=3).state == "recovering"
        with SqliteJournal(path) as second:
            run = second.load(run_id)
            assert (run.state, run.return_to, run.return_attempt) == ("recovering", "b", 1)
            engine = Engine(nested_spec(), handlers=handlers, journal=second)
            run = engine.resume(run_id)
            assert (run.state, run.return_to) == ("done", None)
            assert [t.to_state for t in second.transitions(run_id)][3:6] == [
                "recovering", "b", "c",
            ]  # fmt: skip
        assert [attempt for name, attempt in calls if name == "b"] == [1, 2]
        assert [name for name, _ in calls].count("a") == 1

    def test_return_with_nowhere_to_return_changes_nothing(self, journal):
        calls = []
        spec = nested_spec(
            initial="recovering",
            extra_transitions=[Transition("recovering", "RESTARTED", "prepare")],
        )
        engine = Engine(spec, handlers=nested_handlers(calls), journal=journal)
        run_id = engine.start()
        assert journal.load(run_id).return_to is None
        before = snapshot(journal, run_id)
        with pytest.raises(InvalidTransitionError) as info:
            engine.send(run_id, FOUND)
        assert (info.value.state, info.value.event) == ("recovering", FOUND)
        assert snapshot(journal, run_id) == before

    @pytest.mark.parametrize(
        "recovered",
        [FOUND, PhaseResult(FOUND, output={"restarted": True})],
        ids=["bare-event", "with-output"],
    )
    def test_handler_returning_with_nowhere_to_return_changes_nothing(self, journal, recovered):
        calls = []
        spec = nested_spec(
            initial="recovering",
            extra_transitions=[Transition("recovering", "RESTARTED", "prepare")],
        )
        handlers = nested_handlers(calls, recover=recorder(calls, "recover", recovered))
        engine = Engine(spec, handlers=handlers, journal=journal)
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(InvalidTransitionError):
            engine.run(run_id)
        assert snapshot(journal, run_id) == before

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
        calls = []
        handlers = {
            "loop": recorder(calls, "loop", lost_once),
            "recover": recorder(calls, "recover", FOUND),
        }
        engine = Engine(spec, handlers=handlers, journal=journal)
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.iteration) == ("done", 1)
        assert [(t.to_state, t.iteration) for t in journal.transitions(run_id)] == [
            ("looping", 1), ("recovering", 1), ("looping", 1), ("done", 1),
        ]  # fmt: skip
        assert [record.iteration for record in journal.iterations(run_id)] == [1]
        assert calls == [("loop", 1), ("recover", 1), ("loop", 2)]


class TestStatusEvents:
    """A handler's PhaseStatus reports the event the spec maps it to."""

    @staticmethod
    def analysis_spec(status_events=None):
        return MachineSpec(
            "analysis",
            [
                State("analysing", handler="analyse"),
                State("done", terminal=True),
                State("analysis_failed", terminal=True, outcome="failed"),
                State("unreachable", terminal=True, outcome="failed"),
                State("phase_failed", terminal=True, outcome="failed"),
            ],
            [
                Transition("analysing", PHASE_COMPLETED, "done"),
                Transition("analysing", "ANALYSIS_FAILED", "analysis_failed"),
                Transition("analysing", RunEvent.SERVER_UNREACHABLE, "unreachable"),
                Transition("analysing", RunEvent.PHASE_FAILED, "phase_failed"),
            ],
            status_events=status_events or {},
        )

    def test_status_event_lookup(self):
        spec = self.analysis_spec({"ERROR": "ANALYSIS_FAILED"})
        assert spec.status_event(PhaseStatus.ERROR) == "ANALYSIS_FAILED"
        assert spec.status_event(PhaseStatus.OK) == PHASE_COMPLETED
        assert self.analysis_spec().status_event(PhaseStatus.ERROR) == "PHASE_FAILED"
        assert self.analysis_spec({PhaseStatus.ERROR: RunEvent.BUILD_FAILED}).status_events == {
            "ERROR": "BUILD_FAILED"
        }

    def test_mapped_status_follows_its_event(self, journal):
        spec = self.analysis_spec({"ERROR": "ANALYSIS_FAILED"})
        engine = Engine(spec, handlers={"analyse": lambda _ctx: PhaseStatus.ERROR}, journal=journal)
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.status.value) == ("analysis_failed", "failed")
        assert journal.transitions(run_id)[-1].event == "ANALYSIS_FAILED"

    @pytest.mark.parametrize(
        ("status", "event", "state"),
        [
            (PhaseStatus.SERVER_UNREACHABLE, "SERVER_UNREACHABLE", "unreachable"),
            (PhaseStatus.OK, PHASE_COMPLETED, "done"),
            (PhaseStatus.ERROR, "PHASE_FAILED", "phase_failed"),
        ],
    )
    def test_unmapped_status_reports_the_standard_event(self, journal, status, event, state):
        engine = Engine(
            self.analysis_spec(), handlers={"analyse": lambda _ctx: status}, journal=journal
        )
        run_id = engine.start()
        assert engine.run(run_id).state == state
        assert journal.transitions(run_id)[-1].event == event


# -- the journal -----------------------------------------------------------------------------


class TestSchemaV2Migration:
    """A version-2 journal (before RETURN targets) opens migrated to version 3."""

    def test_v2_journal_is_migrated_and_its_run_resumes(self, tmp_path):
        path = tmp_path / "v2.db"
        calls = []
        handlers = nested_handlers(
            calls,
            c=recorder(calls, "c", lost_once),
            recover=recorder(calls, "recover", PhaseResult(FOUND, output="ok")),
        )
        with SqliteJournal(path) as journal:
            engine = Engine(nested_spec(), handlers=handlers, journal=journal)
            run_id = engine.start()
            assert engine.run(run_id, max_steps=2).state == "b"
        conn = sqlite3.connect(path)
        try:
            undo_v4(conn)
            for column in ("return_to", "return_attempt"):
                conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
            conn.execute(
                "DELETE FROM _sqlite_migrations WHERE name IN"
                " ('m0003_return_targets', 'm0004_effects')"
            )
            conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
            conn.commit()
            columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
            assert not {"return_to", "return_attempt"} & columns
        finally:
            conn.close()

        with SqliteJournal(path) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION)
            run = journal.load(run_id)
            assert (run.state, run.return_to, run.return_attempt) == ("b", None, 0)
            engine = Engine(nested_spec(), handlers=handlers, journal=journal)
            run = engine.resume(run_id)
            assert (run.state, run.status.value) == ("done", "succeeded")
            assert [t.to_state for t in journal.transitions(run_id)][3:7] == [
                "c", "recovering", "c", "d",
            ]  # fmt: skip
        conn = sqlite3.connect(path)
        try:
            columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
            migrations = [row[0] for row in conn.execute("SELECT name FROM _sqlite_migrations")]
        finally:
            conn.close()
        assert {"return_to", "return_attempt"} <= columns
        assert "m0003_return_targets" in migrations
        assert [name for name, _ in calls] == [
            "prepare", "a", "b", "c", "recover", "c", "d",
        ]  # fmt: skip


class TestStatusWithDetails:
    """A PhaseResult may carry a PhaseStatus with an error; the spec still maps the status."""

    def test_status_result_is_mapped_and_keeps_its_error(self, journal):
        from fsm_runner import Engine, MachineSpec, PhaseResult, PhaseStatus, State, Transition

        spec = MachineSpec(
            "mapped",
            [State("a", handler="a"), State("broken", terminal=True, outcome="failed")],
            [Transition("a", "ANALYSIS_FAILED", "broken")],
            status_events={"ERROR": "ANALYSIS_FAILED"},
        )
        engine = Engine(
            spec,
            handlers={
                "a": lambda ctx: PhaseResult(PhaseStatus.ERROR, error="lint found 3 problems")
            },
            journal=journal,
        )
        run = engine.run(engine.start())
        assert run.state == "broken"
        assert run.error == {"type": "ANALYSIS_FAILED", "message": "lint found 3 problems"}
        assert journal.transitions(run.run_id)[-1].event == "ANALYSIS_FAILED"
