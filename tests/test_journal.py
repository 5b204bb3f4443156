from __future__ import annotations

import contextlib
import datetime as dt
import os
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from fsm_runner import (
    Engine,
    Journal,
    JournalError,
    MemoryJournal,
    RunEvent,
    RunLifecycle,
    RunNotFoundError,
    RunRecord,
    RunTerminalError,
    SqliteJournal,
    TransitionRecord,
    open_journal,
)
from fsm_runner.exceptions import (
    LeaseLostError,
    RunConflictError,
    RunExistsError,
    SchemaVersionError,
)
from fsm_runner.journal import SCHEMA_VERSION
from fsm_runner.journal._sqlite_check import CODE, TABLES, code_objects
from fsm_runner.journal.base import Commit
from fsm_runner.journal.sqlite import APPLICATION_ID
from fsm_runner.records import SignalRecord, SignalStatus, utc_now
from tests.helpers import NEXT, linear_spec, loop_spec, undo_v4, undo_v6, undo_v7, undo_v8

SPEC = linear_spec("building", "verifying")
T0 = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.timezone.utc)

#: Every kind of JSON value, nested, with non-ASCII text.
PAYLOAD = {
    "text": "héllo ✓ 日本",
    "quote": 'say "hi"\n\ttab',
    "int": 3,
    "big": 2**53,
    "float": 1.5,
    "negative": -0.25,
    "true": True,
    "false": False,
    "none": None,
    "list": [1, "two", {"three": [3.0]}],
    "nested": {"deep": {"deeper": [], "empty": {}}},
}


def minutes(n: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=n)


def start(
    journal: Journal,
    run_id: str = "r1",
    *,
    machine: str = SPEC.name,
    created: float = 0,
    parent: str | None = None,
    **fields: Any,
) -> RunRecord:
    """Create a run in ``building`` at seq 0, the way the engine does."""
    run = RunRecord(
        run_id,
        machine,
        SPEC.spec_hash,
        "building",
        created_at=minutes(created),
        updated_at=minutes(created),
        parent_run_id=parent,
        **fields,
    )
    first = TransitionRecord(
        run_id, 0, None, RunEvent.STARTED.value, "building", at=minutes(created)
    )
    journal.create_run(run, first, spec_json=SPEC.to_json())
    return run


def next_step(
    run: RunRecord,
    to_state: str,
    *,
    event: str = NEXT,
    seq: int | None = None,
    result: Any = None,
    **changes: Any,
) -> tuple[RunRecord, TransitionRecord]:
    """The run row and transition that move ``run`` to ``to_state`` (by default at the next seq)."""
    seq = run.seq + 1 if seq is None else seq
    when = run.updated_at + dt.timedelta(seconds=1)
    after = attrs.evolve(run, state=to_state, seq=seq, updated_at=when, **changes)
    transition = TransitionRecord(
        run.run_id,
        seq,
        run.state,
        event,
        to_state,
        iteration=after.iteration,
        attempt=after.attempt,
        at=when,
        duration_ms=1.5,
        result=result,
    )
    return after, transition


def advance(journal: Journal, run: RunRecord, to_state: str, **kwargs: Any) -> RunRecord:
    after, transition = next_step(run, to_state, **kwargs)
    journal.commit(after, transition)
    return after


def snapshot(journal: Journal, run_id: str = "r1") -> tuple[RunRecord, list[TransitionRecord]]:
    return journal.load(run_id), list(journal.transitions(run_id))


#: Changes to the run row beyond what the transition implies: with and without them, a
#: commit takes different paths in the SQLite journal (trigger only, or trigger + UPDATE).
ROW_CHANGES = [
    pytest.param({}, id="transition-only"),
    pytest.param({"attempt": 2, "context": {"k": "v"}}, id="with-row-update"),
]


class TestCreateAndLoad:
    """create_run stores the run row, its seq 0 and its spec."""

    def test_is_a_journal(self, journal):
        assert isinstance(journal, Journal)

    def test_load_returns_the_run_as_created(self, journal):
        run = start(journal, input={"task": "x"}, context={"a": 1})

        assert journal.load("r1") == run

    def test_first_transition(self, journal):
        start(journal)

        (first,) = journal.transitions("r1")

        assert (first.seq, first.from_state, first.event, first.to_state) == (
            0,
            None,
            "STARTED",
            "building",
        )
        assert first.at == T0

    def test_spec_json_is_kept(self, journal):
        start(journal)

        assert journal.spec_json(SPEC.spec_hash) == SPEC.to_json()

    def test_spec_json_that_is_not_its_hash_is_refused(self, journal):
        """A stored spec edited (a state renamed): refused, not handed on to be misread."""
        start(journal)
        edited = SPEC.to_json().replace('"building"', '"built"')
        if isinstance(journal, MemoryJournal):
            journal._specs[SPEC.spec_hash] = edited
        elif isinstance(journal, SqliteJournal):
            with raw(Path(journal.location)) as conn:
                conn.execute("UPDATE specs SET json = ?", (edited,))
        else:
            journal._connection.call(
                lambda conn: conn.execute("UPDATE specs SET json = %s", (edited,))
            )

        with pytest.raises(JournalError, match="does not match its hash") as info:
            journal.spec_json(SPEC.spec_hash)

        assert SPEC.spec_hash[:12] in str(info.value)
        assert info.value.path == journal.location

    def test_unknown_spec_hash(self, journal):
        with pytest.raises(JournalError, match="holds no spec"):
            journal.spec_json("f" * 64)

    def test_duplicate_run_id(self, journal):
        run = start(journal, input="first")

        with pytest.raises(RunExistsError) as info:
            start(journal, input="second")

        assert info.value.run_id == "r1"
        assert snapshot(journal) == (run, [journal.transitions("r1")[0]])
        assert journal.load("r1").input == "first"

    def test_missing_run(self, journal):
        with pytest.raises(RunNotFoundError) as info:
            journal.load("nope")
        assert info.value.run_id == "nope"
        with pytest.raises(RunNotFoundError):
            journal.transitions("nope")


class TestCommit:
    """commit writes the next transition and the run row together, or nothing."""

    def test_commits_advance_the_run(self, journal):
        run = start(journal)
        run = advance(journal, run, "verifying", iteration=1, context={"built": True})
        run = advance(
            journal,
            run,
            "failed",
            event=RunEvent.SYSTEM_ERROR.value,
            status=RunLifecycle.FAILED,
            error={"type": "RuntimeError", "message": "boom"},
        )

        loaded = journal.load("r1")

        assert loaded == run
        assert (loaded.state, loaded.seq, loaded.status, loaded.iteration) == (
            "failed",
            2,
            RunLifecycle.FAILED,
            1,
        )
        assert loaded.context == {"built": True}
        assert loaded.ended

    def test_transitions_in_seq_order(self, journal):
        run = start(journal)
        expected = [journal.transitions("r1")[0]]
        for state in ("verifying", "building", "verifying", "done"):
            run, transition = next_step(run, state)
            journal.commit(run, transition)
            expected.append(transition)

        assert journal.transitions("r1") == expected
        assert [t.seq for t in journal.transitions("r1")] == [0, 1, 2, 3, 4]
        assert journal.transitions("r1", from_seq=2) == expected[2:]
        assert journal.transitions("r1", from_seq=1, to_seq=3) == expected[1:4]
        assert journal.transitions("r1", to_seq=0) == expected[:1]

    @pytest.mark.parametrize("changes", ROW_CHANGES)
    def test_seq_gap_is_refused(self, journal, changes):
        run = advance(journal, start(journal), "verifying")
        before = snapshot(journal)

        with pytest.raises(RunConflictError) as info:
            journal.commit(*next_step(run, "done", seq=3, **changes))

        assert info.value.run_id == "r1"
        assert info.value.expected_seq == 2
        assert snapshot(journal) == before

    @pytest.mark.parametrize("changes", ROW_CHANGES)
    @pytest.mark.parametrize("seq", [0, 1])
    def test_stale_seq_is_refused(self, journal, changes, seq):
        run = advance(journal, start(journal), "verifying")
        before = snapshot(journal)

        with pytest.raises(RunConflictError) as info:
            journal.commit(*next_step(run, "done", seq=seq, **changes))

        assert info.value.expected_seq == seq - 1
        assert snapshot(journal) == before

    def test_two_writers_from_the_same_state(self, journal):
        run = start(journal)
        journal.commit(*next_step(run, "verifying", context={"writer": 1}))

        with pytest.raises(RunConflictError):
            journal.commit(*next_step(run, "failed", context={"writer": 2}))

        loaded = journal.load("r1")
        assert (loaded.state, loaded.context) == ("verifying", {"writer": 1})
        assert len(journal.transitions("r1")) == 2

    @pytest.mark.parametrize("seq", [0, 1])
    def test_missing_run(self, journal, seq):
        ghost = RunRecord("ghost", SPEC.name, SPEC.spec_hash, "building", created_at=T0)

        with pytest.raises(RunNotFoundError) as info:
            journal.commit(*next_step(ghost, "verifying", seq=seq))

        assert info.value.run_id == "ghost"
        assert journal.runs() == []
        start(journal, "ghost")  # nothing was left behind under that id
        assert [t.seq for t in journal.transitions("ghost")] == [0]

    def test_run_seq_must_match_transition_seq(self, journal):
        run = start(journal)
        after, transition = next_step(run, "verifying")

        with pytest.raises(ValueError, match=r"must equal the transition's seq"):
            journal.commit(attrs.evolve(after, seq=5), transition)

        assert journal.load("r1") == run

    @pytest.mark.parametrize(
        "payload", [PAYLOAD, [1, [2, [3]]], "just text", 42, 0, False, None], ids=repr
    )
    def test_input_round_trips(self, journal, payload):
        start(journal, input=payload)

        assert journal.load("r1").input == payload

    def test_json_payloads_round_trip(self, journal):
        run = start(journal, input=PAYLOAD, context={"payload": PAYLOAD})
        error = {"type": "ValueError", "message": "bad ✓", "traceback": "line 1\nline 2"}
        advance(
            journal,
            run,
            "verifying",
            context={"after": PAYLOAD},
            error=error,
            result={"output": PAYLOAD, "error": error},
        )

        loaded = journal.load("r1")
        transition = journal.transitions("r1")[1]

        assert loaded.input == PAYLOAD
        assert loaded.context == {"after": PAYLOAD}
        assert loaded.error == error
        assert transition.result == {"output": PAYLOAD, "error": error}
        assert transition.output == PAYLOAD
        assert transition.duration_ms == 1.5


class TestHotPath:
    """A SQL journal's per-step writes go straight to its writer: no call through the journal."""

    HOT = ("commit", "commit_many", "create_runs")

    @pytest.fixture(params=["sqlite", "postgres"])
    def sql_journal(self, request, tmp_path):
        if request.param == "postgres":
            yield request.getfixturevalue("postgres_journal")
            return
        journal = SqliteJournal(tmp_path / "j.db")
        yield journal
        journal.close()

    def test_the_writers_own_methods(self, sql_journal):
        # Private on purpose: what is checked is that the journal adds no call to a step.
        for name in self.HOT:
            assert getattr(sql_journal, name).__self__ is sql_journal._writer, name
        run = start(sql_journal)
        assert advance(sql_journal, run, "verifying") == sql_journal.load("r1")

    def test_a_subclass_keeps_its_own(self, tmp_path):
        committed = []

        class Counting(SqliteJournal):
            def commit(self, run, transition, **kwargs):
                committed.append(transition.seq)
                super().commit(run, transition, **kwargs)

        with Counting(tmp_path / "j.db") as journal:
            assert journal.commit_many.__self__ is journal._writer  # not overridden: bound
            advance(journal, start(journal), "verifying")
            assert committed == [1]
            assert journal.load("r1").seq == 1


class TestAbort:
    """request_abort marks an active run; a USER_ABORTED commit carries it out."""

    def test_request_abort(self, journal):
        start(journal)

        marked = journal.request_abort("r1", "operator asked")

        assert marked.abort_reason == "operator asked"
        assert journal.load("r1").abort_reason == "operator asked"
        assert journal.load("r1").state == "building"
        assert len(journal.transitions("r1")) == 1

    @pytest.mark.parametrize("changes", ROW_CHANGES)
    def test_ordinary_commits_are_refused_while_an_abort_is_requested(self, journal, changes):
        """A writer that has not seen the request (it read the run before) learns of it."""
        run = start(journal)
        run = advance(journal, run, "verifying")
        journal.request_abort("r1", "operator asked")
        before = snapshot(journal)

        for commit in (
            lambda: advance(journal, run, "done", status=RunLifecycle.SUCCEEDED, **changes),
            lambda: journal.commit_many([Commit(*next_step(run, "feedback", **changes))])[0],
        ):
            refused = None
            try:
                refused = commit()
            except RunConflictError as exc:
                refused = exc
            assert isinstance(refused, RunConflictError)
            assert (refused.run_id, refused.expected_seq) == ("r1", 1)
            assert refused.abort_reason == "operator asked"
            assert "has an abort requested (operator asked)" in str(refused)
            assert snapshot(journal) == before  # nothing written, the request kept

        advance(  # the abort itself is taken, and carries the request out
            journal,
            journal.load("r1"),
            "canceled",
            event=RunEvent.USER_ABORTED.value,
            status=RunLifecycle.ABORTED,
        )
        loaded = journal.load("r1")
        assert (loaded.state, loaded.status, loaded.abort_reason) == (
            "canceled",
            RunLifecycle.ABORTED,
            None,
        )

    def test_a_writer_that_claims_after_the_request_is_not_fenced(self, journal):
        """It has read the request (an operator's send, say); the request itself stays."""
        run = advance(journal, start(journal), "verifying")
        journal.request_abort("r1", "operator asked")
        claimed = journal.claim("r1", "operator", ttl=60)
        assert claimed.abort_reason == "operator asked"

        after, transition = next_step(claimed, "feedback", attempt=2)
        journal.commit(after, attrs.evolve(transition, lease_token=claimed.lease_token))

        loaded = journal.load("r1")
        assert (loaded.state, loaded.abort_reason) == ("feedback", "operator asked")
        with pytest.raises(LeaseLostError):  # the old holder's token is fenced for good
            advance(journal, run, "done", status=RunLifecycle.SUCCEEDED)

    def test_a_stale_seq_is_a_plain_conflict_even_with_an_abort_requested(self, journal):
        run = start(journal)
        advance(journal, run, "verifying")
        journal.request_abort("r1", "operator asked")

        with pytest.raises(RunConflictError) as info:
            advance(journal, run, "verifying")  # from seq 0: stale

        assert (info.value.expected_seq, info.value.abort_reason) == (0, None)

    def test_user_aborted_commit_clears_the_reason(self, journal):
        run = start(journal)
        run = advance(journal, run, "verifying")
        journal.request_abort("r1", "operator asked")

        advance(
            journal,
            journal.load("r1"),
            "canceled",
            event=RunEvent.USER_ABORTED.value,
            status=RunLifecycle.ABORTED,
        )

        loaded = journal.load("r1")
        assert loaded.abort_reason is None
        assert (loaded.state, loaded.status) == ("canceled", RunLifecycle.ABORTED)

    def test_ended_run_cannot_be_aborted(self, journal):
        run = start(journal)
        advance(journal, run, "done", status=RunLifecycle.SUCCEEDED)

        with pytest.raises(RunTerminalError) as info:
            journal.request_abort("r1", "too late")

        assert (info.value.run_id, info.value.state, info.value.status) == (
            "r1",
            "done",
            "succeeded",
        )
        assert journal.load("r1").abort_reason is None

    def test_missing_run(self, journal):
        with pytest.raises(RunNotFoundError):
            journal.request_abort("nope", "why")


class TestRuns:
    """runs() lists runs newest first, filtered by machine, status and parent."""

    @pytest.fixture
    def populated(self, journal):
        start(journal, "r1", machine="alpha", created=1)
        start(journal, "r2", machine="beta", created=2, parent="r1")
        r3 = start(journal, "r3", machine="alpha", created=3, parent="r1")
        advance(journal, r3, "failed", event="SYSTEM_ERROR", status=RunLifecycle.FAILED)
        start(journal, "r4", machine="alpha", created=4)
        return journal

    @staticmethod
    def ids(runs: Any) -> list[str]:
        return [run.run_id for run in runs]

    def test_newest_first(self, populated):
        assert self.ids(populated.runs()) == ["r4", "r3", "r2", "r1"]

    def test_pages_both_ways(self, populated):
        # after: the previous page, the runs closest to it, still newest first
        assert self.ids(populated.runs(after="r1")) == ["r4", "r3", "r2"]
        assert self.ids(populated.runs(after="r1", limit=2)) == ["r3", "r2"]
        assert self.ids(populated.runs(after="r2", machine="alpha")) == ["r4", "r3"]
        assert self.ids(populated.runs(after="r4")) == []
        assert self.ids(populated.runs(before="r4", limit=2)) == ["r3", "r2"]

    def test_runs_stored_with_an_older_created_at(self, journal):
        # SQLite lists in the order runs were stored (its listing indexes are in key order);
        # the others by created_at. The same for every run the engine stores.
        start(journal, "late", created=2)
        start(journal, "early", created=1)
        expected = ["early", "late"] if isinstance(journal, SqliteJournal) else ["late", "early"]
        assert self.ids(journal.runs()) == expected
        assert self.ids(journal.runs(before=expected[0])) == expected[1:]

    @pytest.mark.parametrize(
        ("filters", "expected"),
        [
            ({"machine": "alpha"}, ["r4", "r3", "r1"]),
            ({"machine": "beta"}, ["r2"]),
            ({"machine": "gamma"}, []),
            ({"status": "failed"}, ["r3"]),
            ({"status": RunLifecycle.FAILED}, ["r3"]),
            ({"status": RunLifecycle.ACTIVE}, ["r4", "r2", "r1"]),
            ({"status": "succeeded"}, []),
            ({"parent_run_id": "r1"}, ["r3", "r2"]),
            ({"machine": "alpha", "parent_run_id": "r1"}, ["r3"]),
            ({"machine": "alpha", "status": "active"}, ["r4", "r1"]),
            ({"limit": 2}, ["r4", "r3"]),
            ({"machine": "alpha", "limit": 1}, ["r4"]),
            ({"limit": 0}, []),
        ],
        ids=repr,
    )
    def test_filters(self, populated, filters, expected):
        assert self.ids(populated.runs(**filters)) == expected

    def test_runs_are_full_records(self, populated):
        assert populated.runs(machine="beta") == [populated.load("r2")]

    def test_ties_list_the_later_run_first(self, journal):
        start(journal, "first", created=0)
        start(journal, "second", created=0)

        assert self.ids(journal.runs()) == ["second", "first"]

    def test_empty(self, journal):
        assert journal.runs() == []


class TestClosed:
    """A closed journal refuses every use with JournalError."""

    @pytest.mark.parametrize(
        "use",
        [
            lambda j, run: j.load("r1"),
            lambda j, run: j.transitions("r1"),
            lambda j, run: j.runs(),
            lambda j, run: j.spec_json(SPEC.spec_hash),
            lambda j, run: j.request_abort("r1", "why"),
            lambda j, run: j.commit(*next_step(run, "verifying")),
            lambda j, run: start(j, "r2"),
        ],
        ids=["load", "transitions", "runs", "spec_json", "request_abort", "commit", "create_run"],
    )
    def test_use_after_close(self, journal, use):
        run = start(journal)
        journal.close()

        with pytest.raises(JournalError, match="is closed"):
            use(journal, run)

    def test_close_twice(self, journal):
        journal.close()
        journal.close()


# -- SQLite only ------------------------------------------------------------------------------


@contextlib.contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A separate, plain sqlite3 connection to a journal file."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def assert_consistent(path: Path, run_id: str = "r1") -> list[int]:
    """Invariants 1 and 2, read straight from the file: state = last to_state, gapless seqs."""
    with raw(path) as conn:
        state, seq = conn.execute(
            "SELECT state, seq FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        rows = conn.execute(
            "SELECT seq, to_state FROM transitions WHERE run_id = ? ORDER BY seq", (run_id,)
        ).fetchall()
    seqs = [row[0] for row in rows]
    assert seqs == list(range(len(seqs)))
    assert (state, seq) == (rows[-1][1], rows[-1][0])
    return seqs


def big_result(n: int) -> dict[str, str]:
    return {"output": f"{n}:" + "x" * 4000}


class TestSqliteFile:
    """The SQLite journal's file: WAL, durability, the trigger, reopening."""

    def test_wal_mode(self, tmp_path):
        path = tmp_path / "j.db"
        SqliteJournal(path).close()

        with raw(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID

    @pytest.mark.parametrize(
        ("durability", "synchronous"), [("power", 2), ("process", 1), (None, 1)]
    )
    def test_durability(self, tmp_path, durability, synchronous):
        options = {} if durability is None else {"durability": durability}
        with SqliteJournal(tmp_path / "j.db", **options) as journal:
            assert (
                journal._connections.conn.execute("PRAGMA synchronous").fetchone()[0] == synchronous
            )
            assert journal.durability == (durability or "process")

    def test_unknown_durability(self, tmp_path):
        with pytest.raises(ValueError, match="durability"):
            SqliteJournal(tmp_path / "j.db", durability="paranoid")  # type: ignore[arg-type]

    def test_meta(self, sqlite_journal):
        assert sqlite_journal.meta()["schema_version"] == str(SCHEMA_VERSION)

    def test_location_is_the_absolute_path(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        with SqliteJournal("j.db") as journal:
            assert journal.location == str(tmp_path / "j.db")

    def test_trigger_keeps_the_run_row_on_a_direct_insert(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            start(journal)

        with raw(path) as conn:
            with pytest.raises(sqlite3.IntegrityError, match="needs the run_key of its run"):
                conn.execute(
                    "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration,"
                    " attempt, at) VALUES ('r1', 1, 'building', 'NEXT', 'verifying', 3, 1, ?)",
                    (minutes(5).isoformat(),),
                )
            with pytest.raises(sqlite3.IntegrityError, match="not at the seq before"):
                conn.execute(  # a run key that is not the run's: refused like a stale seq
                    "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration,"
                    " attempt, at, run_key) VALUES ('r1', 1, 'building', 'NEXT', 'verifying', 3,"
                    " 1, ?, 99)",
                    (minutes(5).isoformat(),),
                )
            conn.execute(
                "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration,"
                " attempt, at, run_key) VALUES ('r1', 1, 'building', 'NEXT', 'verifying', 3, 1, ?,"
                " (SELECT run_key FROM run_rows WHERE run_id = 'r1'))",
                (minutes(5).isoformat(),),
            )
            assert conn.execute("SELECT state, seq, iteration FROM runs").fetchone() == (
                "verifying",
                1,
                3,
            )
            with pytest.raises(sqlite3.IntegrityError, match="not at the seq before"):
                conn.execute(
                    "INSERT INTO transitions (run_id, seq, from_state, event, to_state, at, run_key)"
                    " VALUES ('r1', 5, 'verifying', 'NEXT', 'done', ?,"
                    " (SELECT run_key FROM run_rows WHERE run_id = 'r1'))",
                    (minutes(6).isoformat(),),
                )
        assert assert_consistent(path) == [0, 1]

    def test_a_plain_step_writes_its_transition_and_nothing_else(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = Engine(loop_spec(), handlers={"noop": lambda _ctx: NEXT}, journal=journal)
            run_id = engine.start()
            engine.run(run_id, max_steps=1)  # the claim's row is known from here on
            before = journal._connections.conn.total_changes
            with journal._connections.read() as conn:
                conn.execute("CREATE TEMP TABLE moved (seq)")
                conn.execute(
                    "CREATE TEMP TRIGGER seen AFTER UPDATE OF seq ON main.run_rows"
                    " BEGIN INSERT INTO moved VALUES (NEW.seq); END"
                )
            run = engine.run(run_id, max_steps=10)
            # the claim, the release, its run_rows_released trigger (the row becomes the head)
            # and this test's own trigger
            claim_and_release = 4
            assert journal._connections.conn.total_changes - before == 10 + claim_and_release
            assert journal.load(run_id) == run
            assert (run.state, run.seq, run.visit_seq) == ("d", 11, 11)
            with journal._connections.read() as conn:
                # the stored row was never rewritten by a step: once, by the release
                assert conn.execute("SELECT seq FROM moved").fetchall() == [(11,)]

        with raw(path) as conn:
            stored = conn.execute("SELECT seq, state FROM run_rows").fetchone()
            head = conn.execute("SELECT seq, state, updated_at FROM runs").fetchone()
            last = conn.execute("SELECT seq, to_state, at FROM transitions ORDER BY seq DESC")
            assert stored == (11, "d")  # released: the row is the head again
            assert head == last.fetchone()
        assert assert_consistent(path, run_id) == list(range(12))

    def test_a_stale_lease_token_is_fenced_out_by_the_trigger(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            start(journal)
            journal.claim("r1", "w1", ttl=60)  # token 1

        with raw(path) as conn:
            with pytest.raises(sqlite3.IntegrityError, match="not at the seq before"):
                conn.execute(
                    "INSERT INTO transitions (run_id, seq, event, to_state, at, lease_token,"
                    " run_key) VALUES ('r1', 1, 'NEXT', 'verifying', ?, 0, (SELECT run_key FROM run_rows WHERE run_id = 'r1'))",
                    (minutes(1).isoformat(),),
                )
            conn.execute(
                "INSERT INTO transitions (run_id, seq, event, to_state, at, lease_token, run_key)"
                " VALUES ('r1', 1, 'NEXT', 'verifying', ?, 1, (SELECT run_key FROM run_rows WHERE run_id = 'r1'))",
                (minutes(1).isoformat(),),
            )
        assert assert_consistent(path) == [0, 1]

    def test_a_version_5_journal_is_migrated_and_its_runs_go_on(self, tmp_path):
        path = tmp_path / "j.db"
        handlers = {"noop": lambda _ctx: NEXT}
        with SqliteJournal(path) as journal:
            engine = Engine(loop_spec(), handlers=handlers, journal=journal)
            run_ids = [engine.start() for _ in range(3)]
            for steps, run_id in enumerate(run_ids):
                engine.run(run_id, max_steps=steps * 5)
            heads = {run_id: journal.load(run_id) for run_id in run_ids}
        with raw(path) as conn:
            undo_v6(conn)
            assert conn.execute("SELECT type FROM sqlite_master WHERE name = 'runs'").fetchone()
            assert [row[0] for row in conn.execute("SELECT seq FROM runs ORDER BY seq")] == [
                0, 5, 10,
            ]  # fmt: skip

        with SqliteJournal(path) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION) == "12"
            assert {run_id: journal.load(run_id) for run_id in run_ids} == heads
            engine = Engine(loop_spec(), handlers=handlers, journal=journal)
            assert engine.run(run_ids[2], max_steps=3).seq == 13
        with raw(path) as conn:
            kinds = dict(conn.execute("SELECT name, type FROM sqlite_master"))
        assert (kinds["runs"], kinds["run_rows"], kinds["transitions_fence"]) == (
            "view", "table", "trigger",
        )  # fmt: skip
        assert "transitions_advance_run" not in kinds
        for run_id in run_ids:
            assert_consistent(path, run_id)

    def test_a_version_6_journal_is_migrated_to_run_keys(self, tmp_path):
        path = tmp_path / "j.db"
        handlers = {"noop": lambda _ctx: NEXT}
        with SqliteJournal(path) as journal:
            engine = Engine(loop_spec(), handlers=handlers, journal=journal)
            run_ids = [engine.start() for _ in range(4)]
            for steps, run_id in enumerate(run_ids):
                engine.run(run_id, max_steps=steps * 3)
            fork = engine.fork(run_ids[3], at_seq=4).run_id
            run_ids.append(fork)
            heads = {run_id: journal.load(run_id) for run_id in run_ids}
            histories = {run_id: journal.transitions(run_id) for run_id in run_ids}
            listed = [run.run_id for run in journal.runs()]
        with raw(path) as conn:
            undo_v7(conn)
            conn.execute(  # a transition whose run was deleted by hand: kept, and reported
                "INSERT INTO transitions (run_id, seq, event, to_state, at)"
                " VALUES ('ghost', 0, 'STARTED', 'a', '2024-01-01T00:00:00.000000+00:00')"
            )
            before = dict(conn.execute("SELECT run_id, rowid FROM run_rows"))
            assert "run_key" not in {row[1] for row in conn.execute("PRAGMA table_info(runs)")}

        with SqliteJournal(path) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION) == "12"
            assert {run_id: journal.load(run_id) for run_id in run_ids} == heads
            assert {run_id: journal.transitions(run_id) for run_id in run_ids} == histories
            assert [run.run_id for run in journal.runs()] == listed
            problems = journal.integrity_problems()
            assert len(problems) == 1, problems
            assert "transitions" in problems[0]
            engine = Engine(loop_spec(), handlers=handlers, journal=journal)
            assert engine.run(run_ids[2], max_steps=3).seq == 9
            assert engine.run(fork, max_steps=2).seq == 6
            new = engine.start()
        with raw(path) as conn:
            keys = dict(conn.execute("SELECT run_id, run_key FROM run_rows"))
            ghost = conn.execute("SELECT run_key FROM transitions WHERE run_id = 'ghost'")
            kinds = dict(conn.execute("SELECT name, type FROM sqlite_master"))
            ghost_key = ghost.fetchone()[0]
        assert {run_id: keys[run_id] for run_id in before} == before  # the rowids, kept
        assert keys[new] == max(before.values()) + 1
        assert ghost_key < 0
        assert (kinds["runs"], kinds["run_rows"], kinds["transitions_fence"]) == (
            "view", "table", "trigger",
        )  # fmt: skip
        for run_id in run_ids:
            assert_consistent(path, run_id)

    def test_a_version_7_journal_gets_the_abort_fence(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run = advance(journal, start(journal), "verifying")
        with raw(path) as conn:
            undo_v8(conn)
            # requested as version 7 did: a holder's commit would still have been taken
            conn.execute("UPDATE run_rows SET abort_reason = 'operator asked'")

        with SqliteJournal(path) as journal:  # migrated: the request now fences the holder
            assert journal.meta()["schema_version"] == "12"
            with pytest.raises(RunConflictError) as info:
                advance(journal, run, "done", status=RunLifecycle.SUCCEEDED)
            assert info.value.abort_reason == "operator asked"
            assert journal.load("r1").state == "verifying"

    def test_a_new_run_key_is_above_every_stored_one(self, tmp_path):
        # No AUTOINCREMENT since version 9: a key comes back only past the highest stored, so
        # listing (in key order) stays newest first; a key is compared with its run id.
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = Engine(
                linear_spec("one"), handlers={"one": lambda _ctx: NEXT}, journal=journal
            )
            first, middle, last = engine.start(), engine.start(), engine.start()
            engine.run(first)
            engine.run(last)
            report = journal.prune(ended_before=minutes(60 * 24 * 365 * 100))
            assert set(report.run_ids) == {first, last}
            again = engine.start()
            assert [t.seq for t in journal.transitions(again)] == [0]
            assert [run.run_id for run in journal.runs()] == [again, middle]
        with raw(path) as conn:
            keys = conn.execute("SELECT run_key FROM run_rows ORDER BY run_key").fetchall()
        assert keys == [(2,), (3,)]  # the middle run's, then the new one's, past it

    def test_a_key_this_journal_knew_for_a_pruned_run_is_never_used(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as first, SqliteJournal(path) as second:
            advance(first, start(first), "done", status=RunLifecycle.SUCCEEDED)
            start(first, "r2")  # stays: the new r1 gets a key past r2's
            assert second.prune(ended_before=minutes(60)).run_ids == ("r1",)
            again = start(second, created=120)  # the same run id: a new run, a new run_key
            after, transition = next_step(again, "verifying")

            with pytest.raises(RunConflictError):
                first.commit(after, transition)  # first knew r1 by the pruned run's key
            assert [t.seq for t in second.transitions("r1")] == [0]

            first.commit(after, transition)  # the key is read again: the commit goes through
            assert second.load("r1") == after

    def test_a_transition_keyed_to_another_run_is_reported(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            advance(journal, start(journal), "verifying")
            start(journal, "r2")
            assert journal.integrity_problems() == []
        with raw(path) as conn:
            conn.execute(
                "UPDATE transitions SET run_key = (SELECT run_key FROM run_rows"
                " WHERE run_id = 'r2') WHERE run_id = 'r1' AND seq = 1"
            )
        with SqliteJournal(path) as journal:
            assert journal.integrity_problems() == [
                "1 row(s) of table transitions have a run_key that is not their run's"
                " (first: run r1, seq 1)",
                # and so r2, whose key it now has, seems to have moved past its row
                "1 unleased active run(s) whose row is not their last transition's, so claims"
                " misjudge them (first: run r2, row in 'building', head in 'verifying')",
                # and its chain of digests is broken there (r1's seq 1 is not r2's)
                "digest: run r2 at seq 1: the transition does not match its digest (changed"
                " since it was written)",
            ]

    def test_a_transition_of_no_run_is_reported_once_with_its_rowid(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            advance(journal, start(journal), "verifying")
            start(journal, "r2")
        with raw(path) as conn:  # no foreign keys enforced here, no insert trigger on UPDATE
            conn.execute("UPDATE transitions SET run_id = 'ghost' WHERE run_id = 'r1' AND seq = 1")
            (rowid,) = conn.execute(
                "SELECT rowid FROM transitions WHERE run_id = 'ghost'"
            ).fetchone()
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == [
                ("transitions", rowid, "run_rows", 0)
            ]
        with SqliteJournal(path) as journal:
            problems = journal.integrity_problems()
        assert (
            problems[0]
            == f"1 row(s) of table transitions refer to missing rows (first rowid {rowid})"
        )
        assert not any("run_key that is not" in line for line in problems)  # not miskeyed too

    def test_reopen_keeps_everything(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run = start(journal, input=PAYLOAD)
            run = advance(journal, run, "verifying", context={"k": "v"}, result=big_result(1))
            journal.request_abort("r1", "later")
            before = snapshot(journal)

        with SqliteJournal(path) as journal:
            assert snapshot(journal) == before
            assert journal.spec_json(SPEC.spec_hash) == SPEC.to_json()
            with pytest.raises(RunConflictError):  # the abort request survived the reopen
                advance(journal, run, "done", status=RunLifecycle.SUCCEEDED)
            advance(
                journal,
                run,
                "canceled",
                event=RunEvent.USER_ABORTED.value,
                status=RunLifecycle.ABORTED,
            )
            assert journal.load("r1").seq == 2

    def test_two_journals_on_one_file_are_fenced_by_seq(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as first, SqliteJournal(path) as second:
            stale = start(first)
            moved = advance(second, second.load("r1"), "verifying")

            with pytest.raises(RunConflictError):
                first.commit(*next_step(stale, "failed", context={"stale": True}))

            assert first.load("r1") == moved
        assert assert_consistent(path) == [0, 1]


def open_and_read(path: Path) -> None:
    """Open a journal and read everything in it."""
    with SqliteJournal(path) as journal:
        for run in journal.runs():
            journal.transitions(run.run_id)
            journal.spec_json(run.spec_hash)
        journal.load("r1")


class TestSqliteOpen:
    """Opening a file that is not a usable journal raises JournalError, never sqlite3.Error."""

    def test_random_bytes(self, tmp_path):
        path = tmp_path / "j.db"
        junk = random.Random(1).randbytes(8192)
        path.write_bytes(junk)

        with pytest.raises(JournalError, match="not a SQLite database") as info:
            SqliteJournal(path)

        assert info.value.path == str(path)
        assert path.read_bytes() == junk

    def test_truncated_journal(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run = start(journal)
            for n in range(1, 40):
                run = advance(journal, run, "verifying", result=big_result(n))
        assert not Path(f"{path}-wal").exists()
        assert path.stat().st_size > 3000
        with path.open("r+b") as handle:
            handle.truncate(3000)

        with pytest.raises(JournalError) as info:  # on open, or at the latest on reading
            open_and_read(path)

        assert not isinstance(info.value, sqlite3.Error)

    def test_foreign_database(self, tmp_path):
        path = tmp_path / "j.db"
        with raw(path) as conn:
            conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
            conn.execute("INSERT INTO invoices (total) VALUES (9.5)")

        with pytest.raises(JournalError, match="not an fsm_runner journal"):
            SqliteJournal(path)

        with raw(path) as conn:  # nothing was changed
            tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
            assert tables == [("invoices",)]
            assert conn.execute("PRAGMA application_id").fetchone()[0] == 0
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"

    @pytest.mark.parametrize("with_tables", [True, False])
    def test_other_application_id(self, tmp_path, with_tables):
        path = tmp_path / "j.db"
        with raw(path) as conn:
            conn.execute("PRAGMA application_id = 1234")
            if with_tables:
                conn.execute("CREATE TABLE t (x)")

        with pytest.raises(JournalError, match="another application") as info:
            SqliteJournal(path)

        assert "not an fsm_runner journal" in str(info.value)

    def test_newer_schema_version(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            start(journal)
        with raw(path) as conn:
            conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")

        with pytest.raises(SchemaVersionError) as info:
            SqliteJournal(path)

        assert (info.value.found, info.value.supported) == (99, SCHEMA_VERSION)
        assert isinstance(info.value, JournalError)
        with raw(path) as conn:  # refused, not migrated
            assert conn.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'"
            ).fetchone() == ("99",)

    def test_empty_file_becomes_a_journal(self, tmp_path):
        path = tmp_path / "j.db"
        path.touch()

        with SqliteJournal(path) as journal:
            start(journal)
            assert journal.load("r1").state == "building"

    def test_missing_directory(self, tmp_path):
        with pytest.raises(JournalError, match="directory does not exist"):
            SqliteJournal(tmp_path / "nope" / "j.db")

    def test_a_tableless_database_becomes_a_journal_when_asked_to(self, tmp_path):
        path = tmp_path / "j.db"
        with raw(path) as conn:
            conn.execute("PRAGMA user_version = 3")

        with SqliteJournal(path) as journal:
            start(journal)
            assert journal.load("r1").state == "building"

    @pytest.mark.parametrize("content", ["missing", "empty", "tableless"])
    def test_not_created_when_not_asked_to(self, tmp_path, content):
        path = tmp_path / "j.db"
        if content == "empty":
            path.touch()
        elif content == "tableless":
            with raw(path) as conn:
                conn.execute("PRAGMA user_version = 3")
        before = path.read_bytes() if path.exists() else None

        with pytest.raises(JournalError) as info:
            SqliteJournal(path, create=False)

        shown = {
            "missing": "does not exist; nothing was created",
            "empty": "is not an fsm_runner journal (an empty file); nothing was changed",
            "tableless": "(a SQLite database without tables); nothing was changed",
        }[content]
        assert shown in str(info.value)
        assert info.value.path == str(path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ([] if before is None else ["j.db"])
        assert (path.read_bytes() if path.exists() else None) == before

    def test_a_journal_opens_when_not_created(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            start(journal)
        with SqliteJournal(path, create=False) as journal:
            assert journal.load("r1").state == "building"


class TestSqliteSchemaObjects:
    """The journal's tables, indexes, view and triggers are those of its schema version."""

    def test_the_code_digests_are_a_new_journals(self):
        """What every open compares with is what the migrations write (keep them in step)."""
        with SqliteJournal(":memory:") as journal:
            assert code_objects(journal._connections.conn) == CODE
            assert {
                name
                for (name,) in journal._connections.conn.execute(
                    "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
                    " AND name NOT LIKE 'sqlite%'"
                )
            } == TABLES
            assert journal.schema_problems() == []
            assert journal.integrity_problems() == []

    def test_a_migrated_journal_has_the_schema_of_a_new_one(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            Engine(loop_spec(), handlers={"noop": lambda _ctx: NEXT}, journal=journal).start()
        with raw(path) as conn:
            undo_v4(conn)
        with SqliteJournal(path) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION)
            assert journal.schema_problems() == []

    @pytest.mark.parametrize(
        ("damage", "problem"),
        [
            (
                "ALTER TABLE artifacts RENAME COLUMN sha256 TO sha1",
                "schema: table artifacts differs from schema version 12 (columns sha1, sha256)",
            ),
            ("DROP INDEX idx_artifacts_run_id_name", "schema: index idx_artifacts_run_id_name is"),
            (
                "CREATE UNIQUE INDEX one_per_state ON transitions (to_state)",
                "schema: index one_per_state is not part of schema version 12",
            ),
        ],
    )
    def test_what_differs_is_named(self, tmp_path, damage, problem):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            start(journal)
        with raw(path) as conn:
            conn.execute(damage)

        with SqliteJournal(path) as journal:
            problems = journal.schema_problems()
            assert journal.load("r1").state == "building"  # tables and indexes: reads go on

        assert len(problems) == 1, problems
        assert problems[0].startswith(problem)

    def test_what_the_user_adds_beside_the_journal_is_theirs(self, tmp_path):
        """A table of their own (with its index, view and trigger) in the file: no problem."""
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            start(journal)
        with raw(path) as conn:
            conn.execute("CREATE TABLE notes (run_id TEXT, note TEXT)")
            conn.execute("CREATE INDEX notes_by_run ON notes (run_id)")
            conn.execute("CREATE VIEW noted AS SELECT * FROM runs JOIN notes USING (run_id)")
            conn.execute("CREATE TRIGGER stamp AFTER INSERT ON notes BEGIN SELECT 1; END")

        with SqliteJournal(path) as journal:
            assert journal.integrity_problems() == []
            run = journal.load("r1")
            journal.commit(*next_step(run, "verifying"))

    def test_a_damaged_fence_refuses_every_write_before_it_happens(self, tmp_path):
        """Fencing lost silently (the lease check gone) would let two workers advance a run."""
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run = start(journal)
        with raw(path) as conn:
            (sql,) = conn.execute(
                "SELECT sql FROM sqlite_master WHERE name = 'transitions_fence'"
            ).fetchone()
            conn.execute("DROP TRIGGER transitions_fence")
            conn.execute(sql.replace("AND lease_token = NEW.lease_token", ""))
        before = path.read_bytes()

        with SqliteJournal(path) as journal:
            assert journal.load("r1") == run  # reads go on
            for write in (
                lambda: journal.commit(*next_step(run, "verifying")),
                lambda: journal.claim("r1", "w1", ttl=60),
                lambda: start(journal, run_id="r2"),
            ):
                with pytest.raises(JournalError, match="trigger transitions_fence") as info:
                    write()
                assert "nothing was written" in str(info.value)
            (refused,) = journal.commit_many([Commit(*next_step(run, "verifying"))])
            assert isinstance(refused, JournalError)
            assert "trigger transitions_fence" in str(refused)
            assert journal.schema_problems() == [
                "schema: trigger transitions_fence differs from schema version 12"
                " (damaged or edited by hand)"
            ]
        assert path.read_bytes() == before


class TestSqliteFailures:
    """A read-only or full medium fails a write with JournalError and writes nothing."""

    @pytest.mark.parametrize("changes", ROW_CHANGES)
    def test_read_only(self, sqlite_journal, changes):
        run = advance(sqlite_journal, start(sqlite_journal), "verifying")
        before = snapshot(sqlite_journal)
        sqlite_journal._connections.conn.execute("PRAGMA query_only = ON")

        with pytest.raises(JournalError, match="read-only") as info:
            sqlite_journal.commit(*next_step(run, "done", **changes))

        assert not isinstance(info.value, RunConflictError)
        assert snapshot(sqlite_journal) == before
        sqlite_journal._connections.conn.execute("PRAGMA query_only = OFF")
        sqlite_journal.commit(*next_step(run, "done", **changes))  # the journal still works
        assert sqlite_journal.load("r1").seq == 2

    @pytest.mark.parametrize(
        "write",
        [lambda j: start(j, "r2"), lambda j: j.request_abort("r1", "why")],
        ids=["create_run", "request_abort"],
    )
    def test_read_only_other_writes(self, sqlite_journal, write):
        start(sqlite_journal)
        sqlite_journal._connections.conn.execute("PRAGMA query_only = ON")

        with pytest.raises(JournalError, match="read-only"):
            write(sqlite_journal)

        assert sqlite_journal.runs() == [sqlite_journal.load("r1")]
        assert sqlite_journal.load("r1").abort_reason is None

    @pytest.mark.parametrize("changes", ROW_CHANGES)
    def test_disk_full(self, tmp_path, changes):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run = start(journal)
            conn = journal._connections.conn
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")

            error = None
            for n in range(1, 100):
                step_changes = {k: (n if k == "attempt" else v) for k, v in changes.items()}
                after, transition = next_step(
                    run, "verifying", result=big_result(n), **step_changes
                )
                try:
                    journal.commit(after, transition)
                except JournalError as exc:
                    error = exc
                    break
                run = after

            assert error is not None, "the journal never filled up"
            assert "full" in str(error)
            assert journal.load("r1") == run
            assert [t.seq for t in journal.transitions("r1")] == list(range(run.seq + 1))
            assert_consistent(path)

            conn.execute(f"PRAGMA max_page_count = {pages * 100}")
            journal.commit(after, transition)  # once there is room, the same commit succeeds
            assert journal.load("r1") == after
        assert assert_consistent(path)[-1] == after.seq


class TestOpenJournal:
    """open_journal picks the implementation from the location."""

    def test_memory(self):
        journal = open_journal(":memory:")

        assert isinstance(journal, MemoryJournal)
        assert journal.location == ":memory:"
        journal.close()

    @pytest.mark.parametrize(
        "spelling",
        [
            lambda path: path,
            str,
            lambda path: f"sqlite:///{path}",
        ],
        ids=["pathlike", "str", "url"],
    )
    def test_sqlite(self, tmp_path, spelling):
        path = tmp_path / "j.db"

        journal = open_journal(spelling(path))

        try:
            assert isinstance(journal, SqliteJournal)
            assert journal.location == str(path)
            start(journal)
        finally:
            journal.close()
        assert path.is_file()
        assert assert_consistent(path) == [0]

    def test_durability_is_passed_on(self, tmp_path):
        journal = open_journal(os.fspath(tmp_path / "j.db"), durability="power")

        try:
            assert isinstance(journal, SqliteJournal)
            assert journal._connections.conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        finally:
            journal.close()


# -- durable waits: signals and wake times (issue 29) -----------------------------------------

HOUR = dt.timedelta(hours=1)
GO = "GO"


def signal(run_id: str = "r1", name: str = GO, payload: Any = None, **fields: Any) -> SignalRecord:
    fields.setdefault("number", 0)
    return SignalRecord(run_id, name=name, payload=payload, **fields)


def held(journal: Journal, run_id: str = "r1", owner: str = "w") -> RunRecord:
    return journal.claim(run_id, owner, ttl=600)


def held_step(
    journal: Journal, run: RunRecord, to_state: str, *, consume: int | None = None, **changes: Any
) -> RunRecord:
    """Commit ``run``'s next transition under its lease (consuming signal ``consume``)."""
    after, transition = next_step(run, to_state, **changes)
    transition = attrs.evolve(transition, lease_token=run.lease_token)
    if consume is None:
        journal.commit(after, transition)
    else:
        journal.consume_signal(after, transition, consume)
    return after


def ended(journal: Journal, run_id: str = "r1") -> RunRecord:
    """Drive the run to ``done`` (succeeded) under a lease."""
    run = held(journal, run_id)
    return held_step(journal, run, "done", status=RunLifecycle.SUCCEEDED, lease_owner=None)


def stored_state(journal: Journal, run_id: str = "r1") -> tuple[Any, ...]:
    """Everything a refused write must leave as it was."""
    return (
        journal.load(run_id),
        list(journal.transitions(run_id)),
        list(journal.signals(run_id)),
        journal.wake_time(run_id),
    )


class TestWaits:
    """The journal's side of durable waits (``Journal.park`` ... ``consume_signal``), on all three.

    The ``journal`` fixture of ``conftest.py``: memory, SQLite, PostgreSQL.
    """

    # -- put_signal / signals ------------------------------------------------------------------

    def test_signals_are_numbered_in_arrival_order(self, journal):
        start(journal, "r1")
        start(journal, "r2")
        before = utc_now()
        first = journal.put_signal(signal("r1", payload=PAYLOAD))
        other = journal.put_signal(signal("r2", "STOP"))
        second = journal.put_signal(signal("r1", "STOP", number=99))  # the number is ignored
        assert first.number < other.number < second.number
        assert before <= first.received_at <= second.received_at <= utc_now()
        assert (first.name, first.payload, first.signal_id) == (GO, PAYLOAD, None)
        assert first.status is SignalStatus.PENDING
        assert (first.consumed_seq, first.consumed_at) == (None, None)
        assert journal.signals("r1") == [first, second]
        assert journal.signals("r2") == [other]
        assert journal.signals("r1", pending=True) == [first, second]

    def test_a_signal_id_is_journaled_once_per_run(self, journal):
        start(journal, "r1")
        start(journal, "r2")
        first = journal.put_signal(signal(payload={"n": 1}, signal_id="once"))
        again = journal.put_signal(signal(payload={"n": 2}, signal_id="once"))
        assert again == first
        assert journal.signals("r1") == [first]
        elsewhere = journal.put_signal(signal("r2", signal_id="once"))  # another run's: its own
        assert elsewhere.number > first.number
        assert journal.signals("r2") == [elsewhere]

    def test_a_repeated_signal_id_returns_the_first_as_it_stands_after_the_run_ended(self, journal):
        start(journal)
        kept = journal.put_signal(signal(signal_id="once"))
        ended(journal)
        again = journal.put_signal(signal(payload={"n": 2}, signal_id="once"))
        assert again == attrs.evolve(kept, status=SignalStatus.EXPIRED)
        with pytest.raises(RunTerminalError):
            journal.put_signal(signal(signal_id="another"))
        assert journal.signals("r1") == [again]

    def test_a_signal_for_an_ended_run_is_refused_with_nothing_written(self, journal):
        start(journal)
        ended(journal)
        before = stored_state(journal)
        with pytest.raises(RunTerminalError) as info:
            journal.put_signal(signal())
        assert (info.value.run_id, info.value.state, info.value.status) == (
            "r1",
            "done",
            "succeeded",
        )
        assert stored_state(journal) == before
        assert before[2:] == ([], None)

    def test_an_unknown_run(self, journal):
        with pytest.raises(RunNotFoundError):
            journal.put_signal(signal("nope"))
        assert journal.signals("nope") == []
        assert journal.signals("nope", pending=True) == []
        with pytest.raises(RunNotFoundError):
            journal.wake_time("nope")

    @pytest.mark.parametrize("payload", ["nan", "inf", "surrogate", "deep", "object"])
    def test_a_payload_that_cannot_be_stored_is_refused_with_nothing_written(
        self, journal, payload
    ):
        deep: Any = []
        for _ in range(10_000):
            deep = [deep]
        bad = {
            "nan": float("nan"),
            "inf": {"x": float("inf")},
            "surrogate": "lone \ud800",
            "deep": deep,
            "object": object(),
        }[payload]
        start(journal)
        with pytest.raises(JournalError, match="nothing was written"):
            journal.put_signal(signal(payload=bad))
        assert stored_state(journal)[2:] == ([], None)

    def test_pending_lists_the_signals_not_consumed_yet(self, journal):
        start(journal)
        first = journal.put_signal(signal())
        second = journal.put_signal(signal("r1", "STOP"))
        run = held_step(journal, held(journal), "verifying", consume=first.number, event=GO)
        assert journal.signals("r1", pending=True) == [second]
        assert [s.status for s in journal.signals("r1")] == [
            SignalStatus.CONSUMED,
            SignalStatus.PENDING,
        ]
        assert run.seq == 1

    def test_the_pending_signals_of_an_ended_run_are_expired(self, journal):
        start(journal)
        first = journal.put_signal(signal())
        second = journal.put_signal(signal("r1", "STOP"))
        run = held_step(journal, held(journal), "verifying", consume=first.number, event=GO)
        held_step(journal, run, "done", status=RunLifecycle.SUCCEEDED, lease_owner=None)
        consumed, expired = journal.signals("r1")
        assert (consumed.number, consumed.status) == (first.number, SignalStatus.CONSUMED)
        assert expired == attrs.evolve(second, status=SignalStatus.EXPIRED)
        assert journal.signals("r1", pending=True) == []

    # -- consume_signal ------------------------------------------------------------------------

    def test_consume_signal_commits_the_transition_and_marks_the_signal(self, journal):
        start(journal)
        sent = journal.put_signal(signal(payload={"ok": True}))
        run = held(journal)
        after, transition = next_step(run, "verifying", event=GO, result={"output": {"ok": True}})
        transition = attrs.evolve(transition, lease_token=run.lease_token)
        journal.consume_signal(after, transition, sent.number)
        assert journal.load("r1") == after
        assert journal.transitions("r1")[-1] == transition
        (consumed,) = journal.signals("r1")
        assert consumed == attrs.evolve(
            sent,
            status=SignalStatus.CONSUMED,
            consumed_seq=transition.seq,
            consumed_at=transition.at,
        )

    def test_a_signal_is_consumed_once_and_a_second_consume_writes_nothing(self, journal):
        start(journal)
        sent = journal.put_signal(signal())
        run = held_step(journal, held(journal), "verifying", consume=sent.number, event=GO)
        before = stored_state(journal)
        with pytest.raises(RunConflictError):
            held_step(journal, run, "done", consume=sent.number, event=GO)
        assert stored_state(journal) == before  # the transition is not written either

    def test_another_run_s_signal_is_not_consumed(self, journal):
        start(journal, "r1")
        start(journal, "r2")
        theirs = journal.put_signal(signal("r2"))
        run = held(journal)
        before = stored_state(journal)
        with pytest.raises(RunConflictError):
            held_step(journal, run, "verifying", consume=theirs.number, event=GO)
        with pytest.raises(RunConflictError):
            held_step(journal, run, "verifying", consume=theirs.number + 100, event=GO)
        assert stored_state(journal) == before
        assert journal.signals("r2") == [theirs]

    def test_a_refused_commit_leaves_the_signal_pending(self, journal):
        start(journal)
        sent = journal.put_signal(signal())
        run = held(journal)
        stale = attrs.evolve(run, lease_token=run.lease_token - 1)
        with pytest.raises((RunConflictError, LeaseLostError)):
            held_step(journal, stale, "verifying", consume=sent.number, event=GO)
        assert journal.signals("r1", pending=True) == [sent]
        assert journal.load("r1").seq == 0

    # -- wake times ----------------------------------------------------------------------------

    def test_a_signal_makes_its_run_due_at_once(self, journal):
        start(journal)
        assert journal.wake_time("r1") is None
        assert journal.next_wake(machine=SPEC.name) is None
        sent = journal.put_signal(signal())
        assert journal.wake_time("r1") == sent.received_at
        assert journal.next_wake(machine=SPEC.name) == sent.received_at
        assert journal.next_wake(machine="another") is None

    def test_park_releases_the_lease_and_sets_the_wake_time(self, journal):
        start(journal)
        wake = utc_now() + HOUR
        run = held(journal)
        assert journal.park("r1", "w", run.lease_token, wake_at=wake, accepts={GO}) is True
        assert journal.load("r1").lease_owner is None
        assert journal.wake_time("r1") == wake
        run = held(journal)
        assert journal.park("r1", "w", run.lease_token, wake_at=None, accepts=()) is True
        assert journal.wake_time("r1") is None

    def test_park_with_an_accepted_pending_signal_makes_the_run_due_now(self, journal):
        start(journal)
        run = held(journal)
        journal.put_signal(signal("r1", "STOP"))  # sent while the run was held
        wake = utc_now() + HOUR
        assert journal.park("r1", "w", run.lease_token, wake_at=wake, accepts={GO}) is True
        assert journal.wake_time("r1") == wake  # STOP is not accepted there
        run = held(journal)
        before = utc_now()
        assert journal.park("r1", "w", run.lease_token, wake_at=wake, accepts={GO, "STOP"})
        assert before <= journal.wake_time("r1") <= utc_now()

    def test_park_without_the_lease_changes_nothing(self, journal):
        start(journal)
        run = held(journal)
        before = stored_state(journal)
        assert not journal.park("r1", "w", run.lease_token + 1, wake_at=utc_now(), accepts=())
        assert not journal.park("r1", "other", run.lease_token, wake_at=utc_now(), accepts=())
        assert stored_state(journal) == before

    def test_claim_next_offers_due_runs_whatever_their_state(self, journal):
        start(journal, "past", created=0)
        start(journal, "future", created=1)
        for run_id, wake in (("past", utc_now() - HOUR), ("future", utc_now() + HOUR)):
            run = held(journal, run_id)
            journal.park(run_id, "w", run.lease_token, wake_at=wake, accepts=())
        # neither is in a state with a handler here: only the due one is runnable
        claimed = journal.claim_next("x", ttl=60, machine=SPEC.name, states=["verifying"])
        assert claimed.run_id == "past"
        assert journal.claim_next("x", ttl=60, machine=SPEC.name, states=["verifying"]) is None
        assert journal.wake_time("past") is not None  # a claim leaves it: a dead claimer's run
        assert journal.wake_time("future") is not None  # stays due

    def test_a_run_with_a_wake_time_to_come_is_not_runnable_before_it(self, journal):
        # a run its phase parked (ctx.wait_for, ctx.sleep_until) stands in a handler's state
        start(journal, "parked", created=0)
        run = held(journal, "parked")
        journal.park("parked", "w", run.lease_token, wake_at=utc_now() + HOUR, accepts=())
        state = journal.load("parked").state
        assert journal.claim_next("x", ttl=60, machine=SPEC.name, states=[state]) is None
        journal.put_signal(signal("parked"))  # now due
        claimed = journal.claim_next("x", ttl=60, machine=SPEC.name, states=[state])
        assert claimed.run_id == "parked"
        assert journal.wake_time("parked") is not None  # due: kept by the claim
        journal.release("parked", "x", claimed.lease_token)
        assert journal.claim_next("y", ttl=60, machine=SPEC.name, states=[state]) is not None

    def test_a_release_drops_a_wake_time_still_to_come(self, journal):
        start(journal, "r1")
        run = held(journal, "r1")
        journal.park("r1", "w", run.lease_token, wake_at=utc_now() + HOUR, accepts=())
        run = held(journal, "r1", owner="x")  # an operator's send, say
        assert journal.wake_time("r1") is not None
        assert journal.release("r1", "x", run.lease_token)
        assert journal.wake_time("r1") is None  # let go of without a park: it does not wait

    def test_a_due_run_is_offered_to_a_worker_of_no_states(self, journal):
        start(journal)
        assert journal.claim_next("x", ttl=60, machine=SPEC.name, states=()) is None
        journal.put_signal(signal())
        assert journal.claim_next("x", ttl=60, machine=SPEC.name, states=()).run_id == "r1"

    def test_a_held_run_is_not_offered_though_it_is_due(self, journal):
        start(journal)
        held(journal)
        journal.put_signal(signal())
        assert journal.claim_next("x", ttl=60, machine=SPEC.name, states=["verifying"]) is None
        assert journal.next_wake(machine=SPEC.name) is None

    def test_a_due_run_of_another_spec_or_machine_is_not_offered(self, journal):
        start(journal)
        journal.put_signal(signal())
        assert journal.claim_next("x", ttl=60, machine="other", states=["verifying"]) is None
        assert (
            journal.claim_next(
                "x", ttl=60, machine=SPEC.name, states=["verifying"], spec_hash="0" * 64
            )
            is None
        )
        claimed = journal.claim_next(
            "x", ttl=60, machine=SPEC.name, states=["verifying"], spec_hash=SPEC.spec_hash
        )
        assert claimed.run_id == "r1"

    def test_the_end_of_a_run_clears_its_wake_time(self, journal):
        start(journal)
        journal.put_signal(signal())
        ended(journal)
        assert journal.wake_time("r1") is None
        assert journal.next_wake(machine=SPEC.name) is None
        assert journal.claim_next("x", ttl=60, machine=SPEC.name, states=["verifying"]) is None

    def test_next_wake_is_the_earliest_of_the_machine_s_unheld_runs(self, journal):
        now = utc_now()
        for run_id, created, wake in (("a", 0, now + 2 * HOUR), ("b", 1, now + HOUR)):
            start(journal, run_id, created=created)
            run = held(journal, run_id)
            journal.park(run_id, "w", run.lease_token, wake_at=wake, accepts=())
        start(journal, "c", machine="other", created=2)
        journal.put_signal(signal("c"))
        assert journal.next_wake(machine=SPEC.name) == now + HOUR
        held(journal, "b")
        assert journal.next_wake(machine=SPEC.name) == now + 2 * HOUR

    # -- prune, fork ---------------------------------------------------------------------------

    def test_prune_deletes_a_pruned_run_s_signals(self, journal):
        start(journal)
        journal.put_signal(signal(signal_id="once"))
        ended(journal)
        assert journal.prune(ended_before=utc_now()).run_ids == ("r1",)
        assert journal.signals("r1") == []
        start(journal)  # the id comes back: none of the old run's signals with it
        assert journal.signals("r1") == []
        fresh = journal.put_signal(signal(signal_id="once"))
        assert journal.signals("r1") == [fresh]

    def test_a_fork_copies_no_signal_and_no_wake_time(self, journal):
        source = start(journal)
        journal.put_signal(signal())
        run = held(journal)
        moved = held_step(journal, run, "verifying")
        journal.release("r1", "w", moved.lease_token)
        fork = attrs.evolve(
            source, run_id="fork", state="building", seq=0, forked_from="r1@0", lease_token=0
        )
        journal.fork_run(fork, source_run_id="r1", at_seq=0)
        assert journal.signals("fork") == []
        assert journal.wake_time("fork") is None
        assert len(journal.signals("r1")) == 1
