"""The cheaper step (issue 20): what the hot paths of short runs skip, and what they still keep.

SQLite's group commit writes a group of distinct runs at once — the runs that end included —
and falls back to one SAVEPOINT each when any of it is refused; the reducer's row of a run
that ends carries no lease holder, as the commit that ends it stores it, so ``run`` and
``arun`` return that row as it is. Real SQLite files throughout; the statements are read with
``set_trace_callback``.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import attrs
import pytest

from fsm_runner import Engine, SqliteJournal
from fsm_runner.exceptions import LeaseLostError
from fsm_runner.journal.base import Commit
from fsm_runner.records import RunRecord, TransitionRecord, utc_now
from fsm_runner.replay import check_journal
from fsm_runner.rules.reducer import advance_plain, take
from fsm_runner.spec import RunLifecycle
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("a", "b", name="short")  # a -> b -> done
AT = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def noop(_ctx):
    return NEXT


async def anoop(_ctx):
    return NEXT


def next_commit(run: RunRecord, *, token: int | None = None) -> Commit:
    """The commit moving ``run`` one state on (a -> b -> done); ``done`` ends it."""
    dest = {"a": "b", "b": "done"}[run.state]
    status = RunLifecycle.SUCCEEDED if dest == "done" else RunLifecycle.ACTIVE
    seq, now = run.seq + 1, utc_now()
    transition = TransitionRecord(
        run.run_id, seq, run.state, NEXT, dest,
        lease_token=run.lease_token if token is None else token, at=now,
    )  # fmt: skip
    after = attrs.evolve(run, state=dest, seq=seq, visit_seq=seq, updated_at=now, status=status)
    return Commit(after, transition)


def claimed_runs(journal: SqliteJournal, engine: Engine, count: int, *, at: str) -> list[RunRecord]:
    """``count`` new runs, claimed by ``w`` and moved to ``at`` (``a`` or ``b``)."""
    runs = []
    for _ in range(count):
        run = journal.claim(engine.start(), "w", ttl=60)
        if at == "b":
            assert journal.commit_many([next_commit(run)]) == [None]
            run = journal.load(run.run_id)
        runs.append(run)
    return runs


class TestGroupOfDistinctRuns:
    """A group of distinct runs, some of them ending, is written at once."""

    def test_runs_that_end_are_written_with_the_others_without_savepoints(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = Engine(SPEC, handlers={"a": noop, "b": noop}, journal=journal)
            ending = claimed_runs(journal, engine, 3, at="b")
            going_on = claimed_runs(journal, engine, 3, at="a")
            statements: list[str] = []
            journal._connections.conn.set_trace_callback(statements.append)
            commits = [next_commit(run) for run in [*ending, *going_on]]
            assert journal.commit_many(commits) == [None] * 6
            journal._connections.conn.set_trace_callback(None)
            assert not [s for s in statements if s.startswith("SAVEPOINT")]
            assert [s.split()[0] for s in statements].count("BEGIN") == 1
            for commit in commits:
                stored = journal.load(commit.run.run_id)
                assert (stored.state, stored.seq, stored.status) == (
                    commit.run.state,
                    commit.run.seq,
                    commit.run.status,
                )
            for run in ending:  # the commit that ends a run ends its lease (its token stays)
                stored = journal.load(run.run_id)
                assert (stored.lease_owner, stored.lease_expires_at) == (None, None)
                assert stored.lease_token == run.lease_token
            for run in going_on:
                assert journal.load(run.run_id).lease_owner == "w"
            engine.close()
            assert check_journal(journal) == []

    def test_one_refused_commit_leaves_the_others_stored_each_on_its_own(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = Engine(SPEC, handlers={"a": noop, "b": noop}, journal=journal)
            ending = claimed_runs(journal, engine, 3, at="b")
            going_on = claimed_runs(journal, engine, 2, at="a")
            fenced = ending[1]
            commits = [next_commit(run) for run in [*ending, *going_on]]
            commits[1] = next_commit(fenced, token=fenced.lease_token + 5)  # a stale lease
            statements: list[str] = []
            journal._connections.conn.set_trace_callback(statements.append)
            results = journal.commit_many(commits)
            journal._connections.conn.set_trace_callback(None)
            assert isinstance(results[1], LeaseLostError)
            assert [r for i, r in enumerate(results) if i != 1] == [None] * 4
            assert any(s.startswith("SAVEPOINT") for s in statements)  # the fallback ran
            refused = journal.load(fenced.run_id)
            assert (refused.state, refused.seq, refused.status) == ("b", 1, RunLifecycle.ACTIVE)
            assert refused.lease_owner == "w"
            for commit in [c for i, c in enumerate(commits) if i != 1]:
                stored = journal.load(commit.run.run_id)
                assert (stored.state, stored.seq, stored.status) == (
                    commit.run.state,
                    commit.run.seq,
                    commit.run.status,
                )
            engine.close()
            assert check_journal(journal) == []


class TestEndedRunsHoldNoLease:
    """The reducer's row of a run that ends has no lease holder; the token stays."""

    def row(self, state: str) -> RunRecord:
        expires = AT + dt.timedelta(seconds=30)
        return RunRecord(
            "r", SPEC.name, SPEC.spec_hash, state, seq=3, visit_seq=3, created_at=AT,
            updated_at=AT, lease_owner="w", lease_expires_at=expires, lease_token=4,
        )  # fmt: skip

    def test_a_plain_step_into_a_terminal_state(self):
        run = self.row("b")
        transition, after = advance_plain(run, NEXT, "done", RunLifecycle.SUCCEEDED, 0.5, AT)
        assert (after.lease_owner, after.lease_expires_at, after.lease_token) == (None, None, 4)
        assert (transition, after) == take(
            SPEC, run, NEXT, "done", result=None, duration_ms=0.5, at=AT
        )

    def test_a_step_that_does_not_end_the_run_keeps_its_holder(self):
        run = self.row("a")
        _, after = advance_plain(run, NEXT, "b", RunLifecycle.ACTIVE, 0.5, AT)
        assert (after.lease_owner, after.lease_expires_at) == (
            run.lease_owner,
            run.lease_expires_at,
        )

    @pytest.mark.parametrize("driver", ["run", "arun"])
    def test_the_ended_run_returned_is_the_stored_row(self, tmp_path, driver):
        with SqliteJournal(tmp_path / "j.db") as journal:
            handler = noop if driver == "run" else anoop
            engine = Engine(SPEC, handlers={"a": handler, "b": handler}, journal=journal)
            run_id = engine.start()
            ended = engine.run(run_id) if driver == "run" else asyncio.run(engine.arun(run_id))
            stored = journal.load(run_id)
            assert ended.status is RunLifecycle.SUCCEEDED
            assert (ended.lease_owner, ended.lease_expires_at) == (None, None)
            assert ended == stored
            engine.close()
