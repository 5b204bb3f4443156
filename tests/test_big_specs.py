"""Specs of any size and depth: sub-phases nested too deep refused with one SpecError naming
the limit (and at the limit working) on every path, and 10,000-state specs validated, compiled,
run, drawn and shown by the inspector -- with exactly the problems the quadratic code found.

No timing here: `bench/bench_big_spec.py` measures the sizes.
"""

from __future__ import annotations

import re
import textwrap

import pytest
from click.testing import CliRunner

from fsm_runner import (
    Engine,
    MachineSpec,
    MemoryJournal,
    SpecError,
    SqliteJournal,
    State,
    Transition,
    diagrams,
)
from fsm_runner.cli import cli
from fsm_runner.machine import compile_spec
from fsm_runner.spec import MAX_NESTING
from fsm_runner.ui.svg import render_svg
from tests.big_specs import CANCEL, FAILED, NEXT, big_handlers, big_spec, deep_spec, faulty_specs
from tests.helpers import one_line_error
from tests.ui_helpers import Server

PHASE_COMPLETED = "PHASE_COMPLETED"
LIMIT = f"sub-phases may nest at most {MAX_NESTING} levels"
TOO_DEEP = (MAX_NESTING + 1, 400, 3000)  # just over; past cattrs' recursion; past the json module's


def big_engine(spec, journal):
    guards = {"retries_left": lambda _run: True}
    return Engine(spec, handlers=big_handlers(), guards=guards, journal=journal)


def deep_json(depth: int) -> str:
    """A deep spec's JSON written by hand: json.dumps itself cannot write one 3,000 deep."""
    opened = '{"name":"level","children":[' * depth
    closed = "]}" * depth
    states = f'{opened}{{"name":"work","handler":"work"}}{closed},{{"name":"done","terminal":true}}'
    moves = '[{"source":["level"],"event":"PHASE_COMPLETED","dest":"done"}]'
    return f'{{"name":"deep","states":[{states}],"transitions":{moves}}}'


def deep_data(depth: int, sequence: type) -> dict:
    """A deep spec's plain data, as from_dict reads it (lists, or tuples written by hand)."""
    state = {"name": "work", "handler": "work"}
    for _level in range(depth):
        state = {"name": "level", "children": sequence([state])}
    done = {"name": "done", "terminal": True}
    moves = [{"source": ["level"], "event": "PHASE_COMPLETED", "dest": "done"}]
    return {"name": "deep", "states": sequence([state, done]), "transitions": moves}


def assert_too_deep(error: pytest.ExceptionInfo[SpecError]) -> None:
    (problem,) = error.value.problems
    assert LIMIT in problem, problem


class TestDeepNesting:
    """Nesting beyond MAX_NESTING: one SpecError naming the limit, never a RecursionError."""

    def test_the_limit_is_100(self):
        assert MAX_NESTING == 100

    def test_at_the_limit_every_path_works(self):
        spec = deep_spec(MAX_NESTING)
        spec.validate()
        again = MachineSpec.from_json(spec.to_json())
        assert again.spec_hash == spec.spec_hash
        assert compile_spec(spec).resolve("work", "PHASE_COMPLETED", None, {}) == "done"
        assert spec.parents("work") == tuple(f"level{n}" for n in range(MAX_NESTING, 0, -1))
        assert "level100" in diagrams.render(spec, format="dot")
        assert "level100" in diagrams.render(spec, format="mermaid")
        assert 'data-state="level100"' in render_svg(diagrams.extract(spec))
        engine = Engine(
            spec, handlers={"work": lambda _ctx: PHASE_COMPLETED}, journal=MemoryJournal()
        )
        run_id = engine.start({})
        assert engine.run(run_id).state == "done"

    @pytest.mark.parametrize("depth", TOO_DEEP)
    def test_validate_and_compile(self, depth):
        spec = deep_spec(depth)  # building it is fine: validate() says what is wrong
        with pytest.raises(SpecError) as error:
            spec.validate()
        assert_too_deep(error)
        assert error.value.problems == (
            f"state 'level{MAX_NESTING + 2}' is nested {MAX_NESTING + 1} composites deep: {LIMIT}"
            " (fsm_runner.spec.MAX_NESTING)"
            if depth > MAX_NESTING + 1
            else f"state 'work' is nested {depth} composites deep: {LIMIT}"
            " (fsm_runner.spec.MAX_NESTING)",
        )
        with pytest.raises(SpecError) as error:
            compile_spec(spec)
        assert_too_deep(error)
        with pytest.raises(SpecError) as error:
            Engine(spec, handlers={"work": lambda _ctx: None}, journal=MemoryJournal())
        assert_too_deep(error)

    @pytest.mark.parametrize("depth", TOO_DEEP)
    def test_json_and_hash(self, depth):
        with pytest.raises(SpecError) as error:
            MachineSpec.from_json(deep_json(depth))
        assert_too_deep(error)
        for data in (deep_data(depth, list), deep_data(depth, tuple)):
            with pytest.raises(SpecError) as error:
                MachineSpec.from_dict(data)
            assert_too_deep(error)
        for write in (lambda s: s.spec_hash, MachineSpec.to_json, MachineSpec.to_dict):
            with pytest.raises(SpecError) as error:
                write(deep_spec(depth))
            assert_too_deep(error)

    @pytest.mark.parametrize("depth", TOO_DEEP)
    def test_diagrams(self, depth):
        spec = deep_spec(depth)
        for draw in (
            lambda: diagrams.render(spec, format="dot"),
            lambda: diagrams.render(spec, format="mermaid"),
            lambda: render_svg(diagrams.extract(spec)),
        ):
            with pytest.raises(SpecError) as error:
                draw()
            assert_too_deep(error)

    def test_the_diagram_command(self, tmp_path, monkeypatch):
        (tmp_path / "deep_specs_app.py").write_text(
            textwrap.dedent(
                """
                from tests.big_specs import deep_spec

                at_limit = deep_spec(100)
                over = deep_spec(101)
                far_over = deep_spec(3000)
                """
            )
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        runner = CliRunner()
        drawn = runner.invoke(cli, ["diagram", "deep_specs_app:at_limit", "--format", "dot"])
        assert drawn.exit_code == 0, drawn.output
        assert "level100" in drawn.output
        for name in ("over", "far_over"):
            result = runner.invoke(cli, ["diagram", f"deep_specs_app:{name}"])
            line = one_line_error(result)
            assert line.startswith("Error: invalid machine spec 'deep': ")
            assert LIMIT in line


#: What validate() found in `faulty_specs()` before it was made linear (the quadratic code of
#: the commit before, run on these very specs): the same problems, in the same order.
OLD_PROBLEMS = {
    "graph": [
        "transition #8 (b -\udc80->): event '\\udc80' holds a lone surrogate, which UTF-8 "
        "cannot store",
        "transition #8 (b -\udc80->): guard 7 is not a str",
        "transition #8 (b -\udc80->): reason 'x\\udc80' holds a lone surrogate, which UTF-8 "
        "cannot store",
        "transition #5 (done -NEXT->): terminal state 'done' has an exit",
        "transition #6 (ghost -NEXT->): unknown source state 'ghost'",
        "transition #6 (ghost -NEXT->): unknown destination state 'nowhere'",
        "ambiguous: state 'a' has 2 transitions on 'NEXT' (to b, done) and an unguarded one "
        "is not the last",
        "state 'island' is unreachable from 'a'",
        "state 'lost' is unreachable from 'a'",
    ],
    "graph registered": [
        "transition #8 (b -\udc80->): event '\\udc80' holds a lone surrogate, "
        "which UTF-8 cannot store",
        "transition #8 (b -\udc80->): guard 7 is not a str",
        "transition #8 (b -\udc80->): reason 'x\\udc80' holds a lone surrogate, "
        "which UTF-8 cannot store",
        "transition #3 (b -FAILED->): guard 'retries_left' is not registered",
        "transition #5 (done -NEXT->): terminal state 'done' has an exit",
        "transition #6 (ghost -NEXT->): unknown source state 'ghost'",
        "transition #6 (ghost -NEXT->): unknown destination state 'nowhere'",
        "transition #9 (island -FAILED->): guard 'gé' is not registered",
        "ambiguous: state 'a' has 2 transitions on 'NEXT' (to b, done) and an "
        "unguarded one is not the last",
        "state 'island' is unreachable from 'a'",
        "state 'lost' is unreachable from 'a'",
    ],
    "nested": [
        "transition #3 (start -5->): event 5 is not a str or a str enum",
        "terminal state 'free' has a handler ('work')",
        "state 'waits' waits at most 5 s but has no exit for its on_timeout event 'TIMEOUT'",
        "state 'free' is unreachable from 'start'",
        "state 'waits' is unreachable from 'start'",
        "non-terminal state 'waits' is a dead end (no transition leaves it)",
    ],
    "nested registered": [
        "transition #3 (start -5->): event 5 is not a str or a str enum",
        "state 'start' names handler 'work', not registered",
        "state 'o1' names handler 'work', not registered",
        "state 'i1' names handler 'work', not registered",
        "state 'i2' names handler 'work', not registered",
        "terminal state 'free' has a handler ('work')",
        "state 'free' names handler 'work', not registered",
        "state 'waits' waits at most 5 s but has no exit for its on_timeout event 'TIMEOUT'",
        "state 'free' is unreachable from 'start'",
        "state 'waits' is unreachable from 'start'",
        "non-terminal state 'waits' is a dead end (no transition leaves it)",
    ],
    "registered registered": [
        "state 'recovering' names handler 'recover', not registered",
        "transition #3 (s0_3 -FAILED->): guard 'retries_left' is not registered",
        "transition #5 (s0_4 -FAILED->): guard 'retries_left' is not registered",
        "transition #7 (s0_5 -FAILED->): guard 'retries_left' is not registered",
        "transition #9 (s0_6 -FAILED->): guard 'retries_left' is not registered",
        "transition #11 (s0_7 -FAILED->): guard 'retries_left' is not registered",
        "transition #13 (s0_8 -FAILED->): guard 'retries_left' is not registered",
        "transition #15 (s0_9 -FAILED->): guard 'retries_left' is not registered",
        "transition #17 (s1_0 -FAILED->): guard 'retries_left' is not registered",
        "transition #19 (s1_1 -FAILED->): guard 'retries_left' is not registered",
        "transition #21 (s1_2 -FAILED->): guard 'retries_left' is not registered",
        "transition #23 (s1_3 -FAILED->): guard 'retries_left' is not registered",
        "transition #25 (s1_4 -FAILED->): guard 'retries_left' is not registered",
        "transition #27 (s1_5 -FAILED->): guard 'retries_left' is not registered",
        "transition #29 (s1_6 -FAILED->): guard 'retries_left' is not registered",
        "transition #31 (s1_7 -FAILED->): guard 'retries_left' is not registered",
        "transition #33 (s1_8 -FAILED->): guard 'retries_left' is not registered",
        "transition #35 (s1_9 -FAILED->): guard 'retries_left' is not registered",
        "transition #37 (s2_0 -FAILED->): guard 'retries_left' is not registered",
        "transition #39 (s2_1 -FAILED->): guard 'retries_left' is not registered",
        "transition #41 (s2_2 -FAILED->): guard 'retries_left' is not registered",
        "transition #43 (s2_3 -FAILED->): guard 'retries_left' is not registered",
        "transition #45 (s2_4 -FAILED->): guard 'retries_left' is not registered",
        "transition #47 (s2_5 -FAILED->): guard 'retries_left' is not registered",
        "transition #49 (s2_6 -FAILED->): guard 'retries_left' is not registered",
        "transition #51 (s2_7 -FAILED->): guard 'retries_left' is not registered",
        "transition #53 (s2_8 -FAILED->): guard 'retries_left' is not registered",
        "transition #55 (s2_9 -FAILED->): guard 'retries_left' is not registered",
        "transition #57 (s3_0 -FAILED->): guard 'retries_left' is not registered",
        "transition #59 (s3_1 -FAILED->): guard 'retries_left' is not registered",
        "transition #61 (s3_2 -FAILED->): guard 'retries_left' is not registered",
        "transition #63 (s3_3 -FAILED->): guard 'retries_left' is not registered",
        "transition #65 (s3_4 -FAILED->): guard 'retries_left' is not registered",
        "transition #67 (s3_5 -FAILED->): guard 'retries_left' is not registered",
        "transition #69 (s3_6 -FAILED->): guard 'retries_left' is not registered",
        "transition #71 (s3_7 -FAILED->): guard 'retries_left' is not registered",
        "transition #73 (s3_8 -FAILED->): guard 'retries_left' is not registered",
        "transition #75 (s3_9 -FAILED->): guard 'retries_left' is not registered",
    ],
}


class TestProblemsAsBefore:
    """The linear validate() reports exactly what the quadratic one did, in its order."""

    @pytest.mark.parametrize("name", ["graph", "nested", "registered"])
    def test_problems(self, name):
        spec, registrations = faulty_specs()[name]
        for key, given in ((name, {}), (f"{name} registered", registrations)):
            if key not in OLD_PROBLEMS:
                spec.validate(**given)
                continue
            with pytest.raises(SpecError) as error:
                spec.validate(**given)
            assert list(error.value.problems) == OLD_PROBLEMS[key]

    def test_a_valid_spec_checked_again_with_registrations(self):
        spec, registrations = faulty_specs()["registered"]
        spec.validate()  # its own problems (none) found once ...
        with pytest.raises(SpecError) as error:  # ... then only the registrations are checked
            spec.validate(**registrations)
        assert list(error.value.problems) == OLD_PROBLEMS["registered registered"]
        spec.validate(handlers=big_handlers(), guards={"retries_left": bool})

    def test_a_child_that_is_not_a_state(self):
        # The walk of the sub-phases skips it (validate() names it): before, its moves
        # between sub-phases read its name and raised AttributeError
        spec = MachineSpec(
            "odd",
            states=[
                State("x", children=[State("a", handler="work"), 7]),
                State("done", terminal=True),
            ],
            transitions=[Transition("x", PHASE_COMPLETED, "done")],
        )
        with pytest.raises(SpecError) as error:
            spec.validate()
        assert error.value.problems == ("state 'x': children[1] is not a State: 7",)


@pytest.fixture(scope="module")
def ten_thousand():
    return big_spec(10_000)


class TestTenThousandStates:
    """A 10,000-state spec validates, compiles, runs and draws; its moves are the declared ones."""

    def test_validates_and_compiles(self, ten_thousand):
        spec = ten_thousand
        assert len(spec.leaves) > 9_000
        spec.validate(handlers=big_handlers(), guards={"retries_left": bool})
        machine = compile_spec(spec)
        chain = [s.name for s in spec.states if not s.terminal and s.name != "recovering"]
        assert machine.resolve("s0_0", NEXT, None, {}) == "s0_1"
        assert machine.resolve("s0_5", FAILED, None, {"retries_left": lambda _run: True}) == "s0_2"
        assert (
            machine.resolve("s0_5", FAILED, None, {"retries_left": lambda _run: False}) == "failed"
        )
        assert machine.resolve(chain[-1], NEXT, None, {}) == "succeeded"
        for leaf in spec.leaves:
            if not leaf.terminal:
                assert machine.resolve(leaf.name, CANCEL, None, {}) == "cancelled"
        assert spec.events_from("s0_0") == (FAILED, NEXT, CANCEL)

    def test_a_run_takes_a_few_steps(self, ten_thousand):
        engine = big_engine(ten_thousand, MemoryJournal())
        run_id = engine.start({})
        assert engine.run(run_id, max_steps=3).state == "s0_3"

    def test_draws(self, ten_thousand):
        names = {state.name for state in ten_thousand.leaves}
        dot = diagrams.render(ten_thousand, format="dot")
        mermaid = diagrams.render(ten_thousand, format="mermaid")
        for name in ("s0_0", "c4_mid_b", "recovering", "cancelled"):
            assert f'"{name}"' in dot
            assert name in mermaid
        drawn = set(re.findall(r'^\s+"([^"]+)" \[', dot, flags=re.MULTILINE))
        assert names <= drawn


class TestInspector:
    """The run inspector shows a run of a big machine, its path drawn on it."""

    def test_a_big_machines_run_page_answers(self, tmp_path):
        spec = big_spec(2_000)
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            engine = big_engine(spec, journal)
            run_id = engine.start({})
            engine.run(run_id, max_steps=3)
            engine.close()
        server = Server(str(path))
        try:
            page = server.get(f"/runs/{run_id}")
            machine = server.get(f"/machines/{spec.name}")
        finally:
            server.stop()
        assert page.status == 200, page.body[:500]
        nodes = re.findall(r'<g class="node[^"]*" data-state="([^"]+)"', page.body)
        assert set(nodes) >= {state.name for state in spec.leaves}
        assert re.search(r'<g class="node[^"]*current[^"]*" data-state="s0_3"', page.body)
        assert machine.status == 200
        assert 'data-state="c4_mid_b"' in machine.body
