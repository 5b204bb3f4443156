"""SQLite schema version 9: claims, prune and listing served by index ranges; the stored head.

An unleased active run's stored row is its head (the fence trigger moves it with a commit made
while nobody holds the run, ``run_rows_released`` with each release), so ``claim_next`` reads
one range of ``idx_run_rows_ready`` per state and one of ``idx_run_rows_leased``; an ended run's
row holds its last update, so prune reads one range of ``idx_run_rows_ended``. What a query
costs is counted in SQLite's own virtual-machine steps (its progress handler), never in time:
an idle poll among many waiting or leased runs costs what it costs among a few. Every older
schema version is migrated to this one, its stored rows brought to their heads.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import pytest

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition
from fsm_runner.journal import SCHEMA_VERSION
from fsm_runner.journal._sqlite_claims import _claim_statements, _search_params
from fsm_runner.journal._sqlite_prune import _SELECT as PRUNE_SELECT
from fsm_runner.records import RunRecord, SignalRecord, TransitionRecord, format_utc, utc_now
from tests.helpers import (
    NEXT,
    UNDO_TO_VERSION,
    undo_v9,
)

APPROVED = "APPROVED"
#: ``a`` and ``b`` have handlers; ``wait`` has none (a run there waits for an operator's event).
SPEC = MachineSpec(
    "approvals",
    [State("a", handler="a"), State("wait"), State("b", handler="b"), State("done", terminal=True)],
    [
        Transition("a", NEXT, "wait"),
        Transition("wait", APPROVED, "b"),
        Transition("b", NEXT, "done"),
    ],
)
HANDLERS = {"a": lambda _ctx: NEXT, "b": lambda _ctx: NEXT}
STATES = ["a", "b"]


def engine_for(journal: SqliteJournal) -> Engine:
    return Engine(SPEC, handlers=HANDLERS, journal=journal)


def claim(journal: SqliteJournal, owner: str = "w", ttl: float = 600) -> RunRecord | None:
    return journal.claim_next(owner, ttl=ttl, machine=SPEC.name, states=STATES)


def stored(journal: SqliteJournal, run_id: str) -> tuple[Any, ...]:
    """The run's stored row's head (state, seq) and its head through the view."""
    with journal._connections.read() as conn:
        row = conn.execute("SELECT state, seq FROM run_rows WHERE run_id = ?", (run_id,))
        view = conn.execute("SELECT state, seq FROM runs WHERE run_id = ?", (run_id,))
        return row.fetchone(), view.fetchone()


def step(journal: SqliteJournal, run: RunRecord, to_state: str, event: str) -> RunRecord:
    """Commit ``run``'s next transition straight to the journal (as a holder or not)."""
    at = utc_now()
    after = attrs.evolve(run, state=to_state, seq=run.seq + 1, visit_seq=run.seq + 1, updated_at=at)
    transition = TransitionRecord(
        run.run_id, run.seq + 1, run.state, event, to_state, at=at, lease_token=run.lease_token
    )
    journal.commit(after, transition)
    return after


@contextmanager
def vm_steps(journal: SqliteJournal) -> Iterator[list[int]]:
    """Count the virtual-machine instructions SQLite runs on the journal's connection."""
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    conn = journal._connections.conn
    conn.set_progress_handler(count, 1)
    try:
        yield counted
    finally:
        conn.set_progress_handler(None, 1)


def plan(conn: sqlite3.Connection, query: str, params: Any) -> list[str]:
    return [str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {query}", params)]


class TestClaims:
    def test_a_run_waiting_for_an_event_is_not_claimed_until_it_gets_one(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = engine_for(journal)
            waiting = engine.start()
            assert engine.run(waiting).state == "wait"  # driven there, then let go of
            assert stored(journal, waiting) == (("wait", 1), ("wait", 1))
            ready = engine.start()
            assert claim(journal).run_id == ready
            assert claim(journal) is None  # the waiting run is not runnable
            engine.send(waiting, APPROVED)
            assert stored(journal, waiting)[1][0] == "b"
            taken = claim(journal, "other")
            assert (taken.run_id, taken.state) == (waiting, "b")

    def test_a_commit_nobody_holds_moves_the_stored_row(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            run = journal.load(engine_for(journal).start())
            run = step(journal, run, "wait", NEXT)  # unleased: the fence moves the row
            assert stored(journal, run.run_id) == (("wait", 1), ("wait", 1))
            assert claim(journal) is None
            step(journal, run, "b", APPROVED)
            assert stored(journal, run.run_id) == (("b", 2), ("b", 2))
            assert claim(journal).run_id == run.run_id

    def test_a_held_run_s_row_stays_until_its_release(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            run_id = engine_for(journal).start()
            held = claim(journal)
            moved = step(journal, held, "wait", NEXT)
            assert stored(journal, run_id) == (("a", 0), ("wait", 1))  # a step writes no row
            journal.release(run_id, "w", moved.lease_token)
            assert stored(journal, run_id) == (("wait", 1), ("wait", 1))
            assert claim(journal) is None

    @pytest.mark.parametrize(("to_state", "taken"), [("b", True), ("wait", False)])
    def test_an_expired_lease_is_judged_by_the_run_s_head(self, tmp_path, to_state, taken):
        # The holder died after moving the run: its row still says "a" (a handler's state).
        with SqliteJournal(tmp_path / "j.db") as journal:
            run_id = engine_for(journal).start()
            held = claim(journal, "dead", ttl=0.05)
            moved = step(journal, held, "wait", NEXT)
            if to_state == "b":
                step(journal, moved, "b", APPROVED)
            time.sleep(0.1)
            got = claim(journal, "alive")
            if taken:
                assert (got.run_id, got.state, got.recoveries) == (run_id, "b", 1)
            else:
                assert got is None

    def test_the_oldest_runnable_run_comes_first(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = engine_for(journal)
            first = engine.start()
            waiting = engine.start()
            engine.run(waiting)
            second = engine.start()
            engine.send(waiting, APPROVED)  # runnable again: in "b", stored third
            assert [claim(journal).run_id for _ in range(3)] == [first, waiting, second]

    def test_an_idle_poll_costs_the_same_among_many_runs(self, tmp_path):
        """10 times the waiting and held runs: the same VM steps (no scan, no max(seq))."""
        costs = []
        for runs in (100, 1000):
            with SqliteJournal(tmp_path / f"{runs}.db") as journal:
                engine = engine_for(journal)
                ids = engine.start_many([None] * runs)
                for run_id in ids[::2]:
                    engine.run(run_id)  # waits in "wait", unleased
                for run_id in ids[1::2]:
                    journal.claim(run_id, "holder", ttl=3600)
                claim(journal)  # statements prepared
                with vm_steps(journal) as counted:
                    assert claim(journal) is None
                costs.append(counted[0])
        assert costs[1] <= costs[0] * 1.2 + 50, costs

    @pytest.mark.parametrize("states", [0, 1, 3])
    @pytest.mark.parametrize("spec_hash", [None, "h"])
    def test_the_search_reads_index_ranges_only(self, states, spec_hash):
        search, _claim = _claim_statements(states, spec_hash)
        params = _search_params("m", [f"s{n}" for n in range(states)], spec_hash, "now")
        with SqliteJournal(":memory:") as journal:
            steps = plan(journal._connections.conn, search, params)
        assert (
            steps.count("SEARCH r USING INDEX idx_run_rows_ready (machine=? AND state=?)") == states
        )
        assert (
            "SEARCH r USING INDEX idx_run_rows_leased (machine=? AND lease_expires_at<?)" in steps
        )
        # the due runs (schema version 10): one range of theirs, whatever their state
        due = [s for s in steps if "idx_run_rows_due" in s]
        assert due == [
            "SEARCH run_rows USING INDEX idx_run_rows_due (machine=? AND wake_at>? AND wake_at<?)"
        ], steps
        assert not [s for s in steps if s.startswith("SCAN") and "subquery" not in s], steps

    def test_an_idle_poll_costs_the_same_among_many_parked_runs(self, tmp_path):
        """10 times the runs parked with a wake time to come: the same VM steps, and
        next_wake one seek."""
        costs = []
        for runs in (100, 1000):
            with SqliteJournal(tmp_path / f"{runs}.db") as journal:
                engine = engine_for(journal)
                wake = utc_now() + dt.timedelta(hours=1)
                for run_id in engine.start_many([None] * runs):
                    engine.run(run_id)  # waits in "wait", unleased
                    held = journal.claim(run_id, "w", ttl=60)
                    assert journal.park(run_id, "w", held.lease_token, wake_at=wake, accepts=())
                claim(journal)  # statements prepared
                journal.next_wake(machine=SPEC.name)
                with vm_steps(journal) as counted:
                    assert claim(journal) is None
                with vm_steps(journal) as woken:
                    assert journal.next_wake(machine=SPEC.name) == wake
                costs.append((counted[0], woken[0]))
        (poll, seek), (poll_10x, seek_10x) = costs
        assert poll_10x <= poll * 1.2 + 50, costs
        assert seek_10x <= seek * 1.2 + 20, costs

    def test_a_row_left_behind_its_head_by_hand_is_skipped_not_claimed_by_its_row(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = engine_for(journal)
            behind, ready = engine.start(), engine.start()
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute(  # "behind" moved to wait by a hand-written transition: its row says "a"
            "INSERT INTO transitions (run_id, run_key, seq, from_state, event, to_state, at)"
            " SELECT run_id, run_key, 1, 'a', ?, 'wait', ? FROM run_rows WHERE run_id = ?",
            (NEXT, format_utc(utc_now()), behind),
        )
        conn.close()
        with SqliteJournal(path) as journal:
            assert stored(journal, behind) == (("a", 0), ("wait", 1))
            assert claim(journal).run_id == ready
            assert claim(journal) is None
            assert "run(s) whose row is not their last transition's" in "".join(
                journal.integrity_problems()
            )

    def test_a_row_moved_off_its_head_by_hand_is_reported(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run = step(journal, journal.load(engine_for(journal).start()), "wait", NEXT)
            assert journal.integrity_problems() == []
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("UPDATE run_rows SET state = 'a', seq = 0")  # as version 8 left it
        conn.close()
        with SqliteJournal(path) as journal:
            assert journal.integrity_problems() == [
                "1 unleased active run(s) whose row is not their last transition's, so claims"
                f" misjudge them (first: run {run.run_id}, row in 'a', head in 'wait')"
            ]


class TestPrune:
    def test_the_selection_is_one_range_of_the_ended_runs_index(self):
        with SqliteJournal(":memory:") as journal:
            steps = plan(journal._connections.conn, PRUNE_SELECT, ("2024-01-01",))
        assert "SEARCH r USING INDEX idx_run_rows_ended (updated_at<?)" in steps, steps
        assert not [s for s in steps if s.startswith("SCAN")], steps

    def test_a_prune_that_finds_nothing_costs_the_same_in_a_bigger_journal(self, tmp_path):
        costs = []
        for runs in (50, 500):
            with SqliteJournal(tmp_path / f"{runs}.db") as journal:
                engine = engine_for(journal)
                for run_id in engine.start_many([None] * runs):
                    engine.run(run_id)
                    engine.send(run_id, APPROVED)
                    assert engine.run(run_id).ended  # just now
                long_ago = utc_now() - dt.timedelta(days=1)
                journal.prune(ended_before=long_ago, dry_run=True)
                with vm_steps(journal) as counted:
                    assert journal.prune(ended_before=long_ago, dry_run=True).run_ids == ()
                    assert journal.prune(ended_before=long_ago).run_ids == ()
                costs.append(counted[0])
        assert costs[1] <= costs[0] * 1.2 + 50, costs

    def test_an_ended_run_s_row_holds_its_last_update(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = engine_for(journal)
            run_id = engine.start()
            engine.run(run_id)
            engine.send(run_id, APPROVED)
            ended = engine.run(run_id)
            with journal._connections.read() as conn:
                (updated_at,) = conn.execute(
                    "SELECT updated_at FROM run_rows WHERE run_id = ?", (run_id,)
                ).fetchone()
            assert ended.ended
            assert updated_at == format_utc(journal.transitions(run_id)[-1].at)


class TestCheckSince:
    def test_the_runs_updated_since_are_read_from_the_ended_and_the_claims_indexes(self):
        with SqliteJournal(":memory:") as journal:
            seen: list[str] = []
            conn = journal._connections.conn
            conn.set_trace_callback(seen.append)
            journal._core.check_keys("run_key", since=utc_now())
            conn.set_trace_callback(None)
            (query,) = [sql for sql in seen if "updated_at" in sql]
            steps = plan(conn, query, ())
        assert "SEARCH run_rows USING INDEX idx_run_rows_ended (updated_at>?)" in steps, steps
        assert [s for s in steps if s.startswith("SCAN run_rows")] == [
            "SCAN run_rows USING INDEX idx_run_rows_ready",
            "SCAN run_rows USING INDEX idx_run_rows_due",
            "SCAN run_rows USING INDEX idx_run_rows_leased",
        ], steps

    def test_ended_and_active_runs_updated_since_are_checked(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = engine_for(journal)
            old = engine.start()
            engine.run(old)
            engine.send(old, APPROVED)
            engine.run(old)  # ended before the cutoff
            cutoff = utc_now()
            waiting, ended = engine.start(), engine.start()
            engine.run(waiting)
            engine.run(ended)
            engine.send(ended, APPROVED)
            engine.run(ended)
            keys = journal._core.check_keys("run_key", since=cutoff)
            with journal._connections.read() as conn:
                wanted = [
                    key
                    for (key,) in conn.execute(
                        "SELECT run_key FROM run_rows WHERE run_id IN (?, ?) ORDER BY run_key",
                        (waiting, ended),
                    )
                ]
        assert keys == wanted


class TestListing:
    @pytest.mark.parametrize(
        "filters",
        [
            {},
            {"machine": "m"},
            {"status": "failed"},
            {"status": "active"},
            {"machine": "m", "status": "active"},
            {"parent_run_id": "p"},
            {"before": "r"},
        ],
        ids=repr,
    )
    def test_a_page_is_read_in_index_order_without_a_sort(self, filters):
        with SqliteJournal(":memory:") as journal:
            seen: list[str] = []
            conn = journal._connections.conn
            conn.set_trace_callback(seen.append)
            journal.runs(limit=50, **filters)
            conn.set_trace_callback(None)
            *first, query = [sql for sql in seen if "FROM runs" in sql]
            plan = lambda sql: [str(r[3]) for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}")]  # noqa: E731
            steps = plan(query)
            if filters.get("status") == "active":  # the newest keys first (the page not there)
                (window,) = first
                near = plan(window)
                assert any(s.startswith("SEARCH r ") and "rowid>?" in s for s in near), near
                assert not [s for s in near if s.startswith("SCAN") or "TEMP B-TREE" in s], near
            else:
                assert first == []
        assert not [s for s in steps if "TEMP B-TREE" in s], steps
        scans = [s for s in steps if s.startswith("SCAN")]
        if filters.get("status") == "active":  # the active runs' keys, from the claims' indexes
            assert scans == [
                "SCAN run_rows USING INDEX idx_run_rows_ready",
                "SCAN run_rows USING INDEX idx_run_rows_due",
                "SCAN run_rows USING INDEX idx_run_rows_leased",
            ], steps
        elif filters and "before" not in filters:
            assert not scans, steps


#: Each older schema version, made from a journal of this one (see tests/helpers.py).
UNDO = UNDO_TO_VERSION


class TestMigration:
    @pytest.mark.parametrize("version", sorted(UNDO))
    def test_every_older_version_is_migrated_to_this_one(self, tmp_path, version):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = engine_for(journal)
            ready, waiting, ended = engine.start(), engine.start(), engine.start()
            engine.run(waiting)
            engine.run(ended)
            engine.send(ended, APPROVED)
            assert engine.run(ended).ended
            heads = {run_id: journal.load(run_id) for run_id in (ready, waiting, ended)}
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            UNDO[version](conn)
            assert conn.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'"
            ).fetchone() == (str(version),)
        finally:
            conn.close()

        with SqliteJournal(path) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION) == "12"
            assert journal.schema_problems() == []
            assert journal.integrity_problems() == []
            assert {run_id: journal.load(run_id) for run_id in heads} == heads
            for run_id in heads:
                row, view = stored(journal, run_id)
                assert row == view
            assert claim(journal).run_id == ready
            assert claim(journal) is None
            report = journal.prune(ended_before=utc_now(), dry_run=True)
            assert report.run_ids == (ended,)
            # version 10: no run has a wake time or a signal; a signal makes one due
            assert [journal.wake_time(run_id) for run_id in heads] == [None] * 3
            assert journal.next_wake(machine=SPEC.name) is None
            sent = journal.put_signal(SignalRecord(waiting, 0, APPROVED))
            assert journal.signals(waiting) == [sent]
            assert claim(journal).run_id == waiting

    def test_a_version_8_row_behind_its_head_is_brought_to_it(self, tmp_path):
        # Version 8 moved no row with a commit: an unleased run committed to by hand (or
        # released, then moved by a commit nobody held) kept its older row.
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = engine_for(journal)
            behind, waits = engine.start(), engine.start()
            engine.run(waits)
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            undo_v9(conn)
            at = format_utc(utc_now())
            conn.execute(  # "waits" moves wait -> b, then "behind" a -> wait: rows unchanged
                "INSERT INTO transitions (run_id, run_key, seq, from_state, event, to_state, at,"
                " lease_token) SELECT run_id, run_key, 2, 'wait', ?, 'b', ?, lease_token"
                " FROM run_rows WHERE run_id = ?",
                (APPROVED, at, waits),
            )
            conn.execute(
                "INSERT INTO transitions (run_id, run_key, seq, from_state, event, to_state, at,"
                " lease_token) SELECT run_id, run_key, 1, 'a', ?, 'wait', ?, lease_token"
                " FROM run_rows WHERE run_id = ?",
                (NEXT, at, behind),
            )
            rows = dict(conn.execute("SELECT run_id, state FROM run_rows").fetchall())
            assert rows == {behind: "a", waits: "wait"}
        finally:
            conn.close()

        with SqliteJournal(path) as journal:
            assert stored(journal, behind) == (("wait", 1), ("wait", 1))
            assert stored(journal, waits) == (("b", 2), ("b", 2))
            assert claim(journal).run_id == waits
            assert claim(journal) is None
            with journal._connections.read() as conn:
                sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'run_rows'")
                assert "AUTOINCREMENT" not in sql.fetchone()[0]
