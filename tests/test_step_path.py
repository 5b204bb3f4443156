"""The step path of async runs (issue 20): what its shortcuts must give exactly as before.

``arun`` writes the plain step out and the step core's ``plan_plain`` reads one table of the
states a plain step may enter (``StepCore.plain_outcomes``); SQLite's group commit binds no ``None`` (a transition
without a result binds 0, which ``NULLIF`` stores as NULL; the NULLs of the UPDATE are in its
SQL) and builds the UPDATE of a run's end at once. Each is checked against the general path.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import attrs
import pytest

from fsm_runner import (
    RETURN,
    Engine,
    MachineSpec,
    PhaseResult,
    RunEvent,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.engine import async_driver
from fsm_runner.engine.async_driver import GroupCommitter
from fsm_runner.engine.core import StepCore
from fsm_runner.journal._sqlite_writes import _row_update
from fsm_runner.journal.base import Commit
from fsm_runner.rules.reducer import advance_plain
from fsm_runner.spec import RunLifecycle
from tests.helpers import NEXT, iteration_loop_spec, linear_spec

AT = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
GUARDS = {"iterations_left": lambda run: run.iteration < 3}  # iteration_loop_spec's


def returning_spec() -> MachineSpec:
    """a -FIX-> fixing -FIXED-> RETURN (a again, its next attempt) -NEXT-> b -NEXT-> done."""
    return MachineSpec(
        "returning",
        [
            State("a", handler="a"),
            State("fixing", handler="fixing"),
            State("b", handler="b"),
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("a", "FIX", "fixing"),
            Transition("a", NEXT, "b"),
            Transition("fixing", "FIXED", RETURN),
            Transition("b", NEXT, "done"),
            Transition("*", "SYSTEM_ERROR", "failed"),
        ],
    )


def returning_handlers(*, asynchronous: bool):
    def a(ctx):
        return "FIX" if ctx.attempt == 1 else NEXT

    def fixing(_ctx):
        return "FIXED"

    def b(_ctx):
        return NEXT

    return _maybe_async({"a": a, "fixing": fixing, "b": b}, asynchronous)


def loop_handlers(*, asynchronous: bool):
    def build(_ctx):
        return "BUILT"

    def verify(ctx):
        if ctx.iteration < 2:
            return RunEvent.VERIFY_FAILED_RETRYABLE.value
        return PhaseResult(RunEvent.VERIFY_PASSED)

    def feedback(_ctx):
        return "FEEDBACK_READY"

    return _maybe_async({"build": build, "verify": verify, "feedback": feedback}, asynchronous)


def _maybe_async(handlers, asynchronous):
    """The handlers as they are, or each wrapped in a coroutine function."""
    if not asynchronous:
        return handlers

    def as_async(fn):
        async def handler(ctx):
            return fn(ctx)

        return handler

    return {name: as_async(fn) for name, fn in handlers.items()}


def what_was_journaled(journal, run_id):
    """The run row (without times and lease bookkeeping) and each transition's reading."""
    run = journal.load(run_id)
    row = attrs.evolve(
        run, created_at=AT, updated_at=AT, lease_token=0, lease_expires_at=None, run_id="r"
    )
    steps = [
        (t.seq, t.from_state, t.event, t.to_state, t.iteration, t.attempt, t.result)
        for t in journal.transitions(run_id)
    ]
    return row, steps


class TestPlainOutcomes:
    """``plain_outcomes`` holds exactly the states a plain step may enter, with their status."""

    @pytest.mark.parametrize(
        ("spec", "handlers"),
        [
            (linear_spec("a", "b"), {"a": lambda _: NEXT, "b": lambda _: NEXT}),
            (iteration_loop_spec(), loop_handlers(asynchronous=False)),
            (returning_spec(), returning_handlers(asynchronous=False)),
        ],
        ids=["linear", "iterations", "returning"],
    )
    def test_it_is_what_each_state_says(self, tmp_path, spec, handlers):
        with SqliteJournal(tmp_path / "j.db") as journal:
            core = StepCore(spec, handlers=handlers, journal=journal, guards=GUARDS)
            expected = {
                name: state.final_outcome
                for name, state in core.states.items()
                if not state.starts_iteration and name not in spec.returning_states
            }
            assert core.plain_outcomes == expected

    def test_a_state_that_starts_iterations_or_returns_is_not_in_it(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            loop = StepCore(
                iteration_loop_spec(),
                handlers=loop_handlers(asynchronous=False),
                journal=journal,
                guards=GUARDS,
            )
            assert "building" not in loop.plain_outcomes
            assert loop.plain_outcomes["succeeded"] is RunLifecycle.SUCCEEDED
            returning = StepCore(
                returning_spec(), handlers=returning_handlers(asynchronous=False), journal=journal
            )
            assert "fixing" not in returning.plain_outcomes
            assert returning.plain_outcomes["b"] is RunLifecycle.ACTIVE


class TestArunJournalsWhatRunDoes:
    """arun's written-out plain step and its general path journal what ``run`` does."""

    @pytest.mark.parametrize("group_commit", [True, False])
    @pytest.mark.parametrize(
        ("spec", "handlers"),
        [
            (linear_spec("a", "b", "c"), None),
            (iteration_loop_spec(), loop_handlers),
            (returning_spec(), returning_handlers),
        ],
        ids=["linear", "iterations", "returning"],
    )
    def test_same_rows_and_transitions(self, tmp_path, spec, handlers, group_commit):
        def drive(path, asynchronous):
            if handlers is None:

                async def anext_(_ctx):
                    return NEXT

                chosen = dict.fromkeys(("a", "b", "c"), anext_ if asynchronous else lambda _: NEXT)
            else:
                chosen = handlers(asynchronous=asynchronous)
            seen = []
            with SqliteJournal(path) as journal:
                engine = Engine(
                    spec,
                    handlers=chosen,
                    journal=journal,
                    group_commit=group_commit,
                    guards=GUARDS,
                    listeners=[lambda t, r: seen.append((t.seq, t.to_state, r.status))],
                )
                run_id = engine.start()
                ended = asyncio.run(engine.arun(run_id)) if asynchronous else engine.run(run_id)
                assert ended == journal.load(run_id)
                engine.close()
                return what_was_journaled(journal, run_id), seen

        assert drive(tmp_path / "async.db", True) == drive(tmp_path / "sync.db", False)

    def test_the_plain_steps_are_group_committed(self, tmp_path, monkeypatch):
        async def anext_(_ctx):
            return NEXT

        made = []  # the group committers the engine makes (one per event loop)

        def committer(journal, loop):
            made.append(GroupCommitter(journal, loop))
            return made[-1]

        monkeypatch.setattr(async_driver, "GroupCommitter", committer)

        with SqliteJournal(tmp_path / "j.db") as journal:
            spec = linear_spec("a", "b", "c")
            engine = Engine(spec, handlers=dict.fromkeys("abc", anext_), journal=journal)

            async def main():
                ids = engine.start_many([None] * 5, claim=True)
                return await asyncio.gather(*(engine.arun(run_id) for run_id in ids))

            runs = asyncio.run(main())
            assert {(run.state, run.seq, run.lease_owner) for run in runs} == {("done", 3, None)}
            assert len(made) == 1
            assert made[0].commits == 15
            assert made[0].transactions == 3  # each turn's steps in one transaction
            engine.close()


class TestNoNoneBound:
    """SQLite's commits bind no ``None``; what they store is what they stored before."""

    def plain_runs(self, journal, count):
        engine = Engine(linear_spec("a", "b"), handlers={"a": noop, "b": noop}, journal=journal)
        return engine, [journal.load(engine.start(claim=True)) for _ in range(count)]

    def test_a_transition_without_a_result_is_stored_as_null(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine, runs = self.plain_runs(journal, 2)
            statements: list[str] = []
            bound: list[tuple] = []
            commits = []
            for run in runs:
                transition, after = advance_plain(run, NEXT, "b", RunLifecycle.ACTIVE, 0.5, AT)
                commits.append(Commit(after, transition))
                insert, rows = journal._writer._statements(after, transition, (), (), None)
                bound.append(insert)
                assert rows is None
            assert all(None not in params for params in bound)
            journal._connections.conn.set_trace_callback(statements.append)
            assert journal.commit_many(commits) == [None, None]
            journal._connections.conn.set_trace_callback(None)
            assert any("NULLIF" in s for s in statements)
            for run in runs:
                (stored,) = journal._connections.conn.execute(
                    "SELECT result IS NULL FROM transitions WHERE run_id = ? AND seq = 1",
                    (run.run_id,),
                ).fetchall()
                assert stored == (1,)
                assert journal.transitions(run.run_id)[1].result is None
            engine.close()

    def test_a_result_is_stored_as_its_json(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine, (run,) = self.plain_runs(journal, 1)
            transition, after = advance_plain(run, NEXT, "b", RunLifecycle.ACTIVE, 0.5, AT)
            transition = attrs.evolve(transition, result={"output": 0})
            assert journal.commit_many([Commit(after, transition)]) == [None]
            assert journal.transitions(run.run_id)[1].result == {"output": 0}
            journal.commit(*self.next_step(journal, run.run_id, {"output": "0"}))
            assert journal.transitions(run.run_id)[2].result == {"output": "0"}
            engine.close()

    @staticmethod
    def next_step(journal, run_id, result):
        run = journal.load(run_id)
        transition, after = advance_plain(run, NEXT, "done", RunLifecycle.SUCCEEDED, 0.5, AT)
        return after, attrs.evolve(transition, result=result)


def noop(_ctx):
    return NEXT


class TestTheEndOfARun:
    """The UPDATE of a run's end built at once is the one ``_row_update`` builds."""

    @pytest.mark.parametrize("same_time", [True, False])
    def test_same_statement(self, tmp_path, same_time):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = Engine(linear_spec("a"), handlers={"a": noop}, journal=journal)
            run = journal.load(engine.start(claim=True))
            transition, after = advance_plain(run, NEXT, "done", RunLifecycle.SUCCEEDED, 0.5, AT)
            if not same_time:
                after = attrs.evolve(after, updated_at=AT + dt.timedelta(seconds=1))
            insert, rows = journal._writer._statements(after, transition, (), (), None)
            writer = journal._writer
            known = writer._written.get(after.run_id)
            built = _row_update(known, {}, after, transition, at=insert[7], key=insert[11])
            assert rows == [built]
            assert None not in rows[0][1]
            assert "lease_owner = NULL" in rows[0][0]
            assert journal.commit_many([Commit(after, transition)]) == [None]
            stored = journal.load(run.run_id)
            assert (stored.status, stored.lease_owner, stored.lease_expires_at) == (
                RunLifecycle.SUCCEEDED,
                None,
                None,
            )
            assert stored.updated_at == after.updated_at
            engine.close()

    def test_an_unknown_row_is_written_whole(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = Engine(linear_spec("a"), handlers={"a": noop}, journal=journal)
            run = journal.load(engine.start(claim=True))
            journal._writer._written.clear()  # written by another journal, say: every column
            transition, after = advance_plain(run, NEXT, "done", RunLifecycle.SUCCEEDED, 0.5, AT)
            _, rows = journal._writer._statements(after, transition, (), (), None)
            assert rows is not None
            assert "context = ?" in rows[0][0]
            engine.close()
