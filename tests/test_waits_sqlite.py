"""The SQLite journal's side of durable waits (schema version 10): what its file holds and does.

The journal contract (signals, park, wake times, claims of due runs) is tested on every journal
in ``tests/test_journal.py`` (``TestWaits``); here what is SQLite's own: the rows and indexes,
one transaction per write (nothing of a refused one stays), the statements a commit makes (a
plain step none more), the plans of the reads, prune and ``check``.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest

from fsm_runner import RunEvent, RunLifecycle, SqliteJournal, TransitionRecord
from fsm_runner._json import dumps_json
from fsm_runner.exceptions import JournalError, RunConflictError
from fsm_runner.journal._digest import row_digest
from fsm_runner.journal._sqlite_waits import NEXT_WAKE
from fsm_runner.journal.base import Commit
from fsm_runner.records import RunRecord, SignalRecord, SignalStatus, format_utc, utc_now
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("building", "verifying")
GO = "GO"
HOUR = dt.timedelta(hours=1)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SqliteJournal]:
    j = SqliteJournal(tmp_path / "journal.db")
    yield j
    j.close()


def start(journal: SqliteJournal, run_id: str = "r1") -> RunRecord:
    now = utc_now()
    run = RunRecord(run_id, SPEC.name, SPEC.spec_hash, "building", created_at=now, updated_at=now)
    first = TransitionRecord(run_id, 0, None, RunEvent.STARTED.value, "building", at=now)
    journal.create_run(run, first, spec_json=SPEC.to_json())
    return run


def step(
    run: RunRecord, to_state: str, *, event: str = NEXT, **changes: Any
) -> tuple[RunRecord, TransitionRecord]:
    at = utc_now()
    after = attrs.evolve(
        run, state=to_state, seq=run.seq + 1, visit_seq=run.seq + 1, updated_at=at, **changes
    )
    transition = TransitionRecord(
        run.run_id,
        run.seq + 1,
        run.state,
        event,
        to_state,
        at=at,
        lease_token=run.lease_token,
        result={"output": 1},
    )
    return after, transition


def row(journal: SqliteJournal, sql: str, *params: Any) -> Any:
    with journal._connections.read() as conn:
        return conn.execute(sql, params).fetchone()


def rows(journal: SqliteJournal, sql: str, *params: Any) -> list[Any]:
    with journal._connections.read() as conn:
        return conn.execute(sql, params).fetchall()


def everything(journal: SqliteJournal) -> list[Any]:
    """Every row of the tables a wait writes to."""
    return [
        rows(journal, f"SELECT * FROM {table} ORDER BY rowid")
        for table in ("run_rows", "transitions", "signals")
    ]


@contextmanager
def statements(journal: SqliteJournal) -> Iterator[list[str]]:
    """The distinct SQL statements the journal's connection runs meanwhile, in order.

    (The trace shows a statement again for each trigger program it runs.)
    """
    seen: list[str] = []
    distinct: list[str] = []
    conn = journal._connections.conn
    conn.set_trace_callback(seen.append)
    try:
        yield distinct
    finally:
        conn.set_trace_callback(None)
        distinct += dict.fromkeys(seen)


def plan(journal: SqliteJournal, query: str, params: Any) -> list[str]:
    conn = journal._connections.conn
    return [str(r[3]) for r in conn.execute(f"EXPLAIN QUERY PLAN {query}", params)]


class TestSchema:
    def test_version_10_objects(self, journal):
        assert journal.meta()["schema_version"] == "12"
        assert journal.schema_problems() == []
        columns = [r[1] for r in rows(journal, "SELECT * FROM pragma_table_info('signals')")]
        assert columns == [
            "number",
            "run_key",
            "run_id",
            "name",
            "payload",
            "signal_id",
            "received_at",
            "consumed_seq",
            "consumed_at",
            "digest",  # schema 12: what its sender wrote
        ]
        assert rows(journal, "SELECT * FROM pragma_foreign_key_list('signals')")[0][2:5] == (
            "run_rows",
            "run_key",
            "run_key",
        )
        indexes = dict(
            rows(
                journal,
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL",
            )
        )
        assert (
            "WHERE status = 'active' AND lease_owner IS NULL AND wake_at IS NOT NULL"
            in (indexes["idx_run_rows_due"])
        )
        assert "UNIQUE" in indexes["idx_signals_id"]
        assert "idx_signals_run" in indexes

    def test_a_hand_made_signal_of_no_run_is_reported(self, journal):
        start(journal)
        with journal._connections.write() as conn:
            conn.execute(
                "INSERT INTO signals (run_key, run_id, name, received_at) VALUES (999, 'x', ?, ?)",
                (GO, format_utc(utc_now())),
            )
            (number,) = conn.execute("SELECT max(number) FROM signals").fetchone()
        assert journal.integrity_problems() == [
            f"1 row(s) of table signals refer to missing rows (first rowid {number})"
        ]

    def test_a_hand_made_signal_under_another_run_s_key_is_reported(self, journal):
        start(journal, "r1")
        start(journal, "r2")
        sent = journal.put_signal(SignalRecord("r1", 0, GO))
        assert journal.integrity_problems() == []
        with journal._connections.write() as conn:
            conn.execute(
                "UPDATE signals SET run_key = (SELECT run_key FROM run_rows WHERE run_id = 'r2')"
            )
        assert journal.integrity_problems() == [
            "1 row(s) of table signals have a run_key that is not their run's"
            f" (first: number {sent.number})"
        ]

    def test_next_wake_is_one_seek(self, journal):
        steps = plan(journal, NEXT_WAKE, ("m",))
        assert steps == ["SEARCH run_rows USING INDEX idx_run_rows_due (machine=? AND wake_at>?)"]


class TestSignalRows:
    def test_a_signal_is_stored_as_sent(self, journal):
        start(journal)
        payload = {"b": [1, 2.5, "ü"], "a": None}
        sent = journal.put_signal(SignalRecord("r1", 0, GO, payload, signal_id="s-1"))
        stored = row(journal, "SELECT * FROM signals")
        key = row(journal, "SELECT run_key FROM run_rows WHERE run_id = 'r1'")[0]
        assert stored == (
            sent.number,
            key,
            "r1",
            GO,
            dumps_json(payload),
            "s-1",
            format_utc(sent.received_at),
            None,
            None,
            row_digest(("r1", GO, dumps_json(payload), "s-1", format_utc(sent.received_at))),
        )
        assert row(journal, "SELECT wake_at FROM run_rows")[0] == format_utc(sent.received_at)

    def test_a_new_number_is_above_every_stored_one(self, journal):
        start(journal)
        numbers = [journal.put_signal(SignalRecord("r1", 0, GO)).number for _ in range(3)]
        assert numbers == sorted(numbers)
        assert len(set(numbers)) == 3
        # another journal object on the same file numbers on from there
        with SqliteJournal(journal.path) as other:
            assert other.put_signal(SignalRecord("r1", 0, GO)).number > numbers[-1]

    def test_a_signal_id_is_unique_per_run_in_the_file_itself(self, journal):
        start(journal)
        journal.put_signal(SignalRecord("r1", 0, GO, signal_id="once"))
        with pytest.raises(JournalError, match="UNIQUE"), journal._connections.write() as conn:
            conn.execute(
                "INSERT INTO signals (run_key, run_id, name, signal_id, received_at)"
                " SELECT run_key, run_id, 'GO', 'once', 'now' FROM run_rows"
            )


class TestConsume:
    def test_one_transaction_with_the_commit_s_statements(self, journal):
        start(journal)
        sent = journal.put_signal(SignalRecord("r1", 0, GO))
        run = journal.claim("r1", "w", ttl=60)
        after, transition = step(run, "verifying", event=GO, attempt=2)  # an UPDATE too
        with statements(journal) as seen:
            journal.consume_signal(after, transition, sent.number)
        assert seen[0] == "BEGIN IMMEDIATE"
        assert seen[-1] == "COMMIT"
        assert [" ".join(s.split()[:2]) for s in seen[1:-1]] == [
            "INSERT INTO",
            "UPDATE run_rows",
            "UPDATE signals",
        ]
        assert journal.load("r1") == after
        assert journal.signals("r1")[0].consumed_seq == 1

    def test_a_refused_consume_rolls_back_the_run_row_it_wrote(self, journal):
        """An unleased run: the commit writes its row (what claims read), then the signal
        is found consumed: the row and the transition are rolled back with it."""
        run = start(journal)
        sent = journal.put_signal(SignalRecord("r1", 0, GO))
        run = journal.load("r1")
        after, transition = step(run, "verifying", event=GO)
        journal.consume_signal(after, transition, sent.number)
        before = everything(journal)
        again, transition = step(after, "done", event=GO, status=RunLifecycle.SUCCEEDED)
        with pytest.raises(RunConflictError):
            journal.consume_signal(again, transition, sent.number)
        assert everything(journal) == before
        # the journal does not take the refused row for the stored one: the next commit works
        assert journal.load("r1") == after
        journal.commit(again, transition)
        assert journal.load("r1").status is RunLifecycle.SUCCEEDED

    def test_the_signal_of_a_run_stored_under_another_key_is_not_consumed(self, journal):
        start(journal, "r1")
        start(journal, "r2")
        theirs = journal.put_signal(SignalRecord("r2", 0, GO))
        run = journal.claim("r1", "w", ttl=60)
        before = everything(journal)
        with pytest.raises(RunConflictError):
            journal.consume_signal(*step(run, "verifying", event=GO), theirs.number)
        assert everything(journal) == before


class TestWakeTimes:
    def test_a_plain_step_writes_nothing_more(self, journal):
        start(journal)
        journal.put_signal(SignalRecord("r1", 0, GO))
        run = journal.claim("r1", "w", ttl=60)
        after, transition = step(run, "verifying")
        with statements(journal) as seen:
            journal.commit(after, transition)
        assert len(seen) == 1
        assert seen[0].startswith("INSERT INTO transitions")

    @pytest.mark.parametrize("group", [False, True], ids=["commit", "commit_many"])
    def test_the_run_s_end_clears_its_wake_time_in_the_same_update(self, journal, group):
        start(journal)
        start(journal, "r2")
        for run_id in ("r1", "r2"):
            journal.put_signal(SignalRecord(run_id, 0, GO))
        ends = []
        for run_id in ("r1", "r2"):
            run = journal.claim(run_id, "w", ttl=60)
            moved, transition = step(run, "verifying")
            journal.commit(moved, transition)
            ends.append(step(moved, "done", status=RunLifecycle.SUCCEEDED, lease_owner=None))
        with statements(journal) as seen:
            if group:
                assert journal.commit_many([Commit(*end) for end in ends]) == [None, None]
            else:
                for end in ends:
                    journal.commit(*end)
        updates = [s for s in seen if s.startswith("UPDATE run_rows")]
        assert updates
        assert all("wake_at = NULL" in s for s in updates), updates
        assert rows(journal, "SELECT wake_at, lease_owner FROM run_rows") == [(None, None)] * 2

    def test_park_is_one_update_of_the_run_row(self, journal):
        start(journal)
        run = journal.claim("r1", "w", ttl=60)
        moved, transition = step(run, "verifying")
        journal.commit(moved, transition)
        wake = utc_now() + HOUR
        with statements(journal) as seen:
            assert journal.park("r1", "w", run.lease_token, wake_at=wake, accepts={GO, "B"})
        assert [s.split()[0] for s in seen] == ["BEGIN", "UPDATE", "COMMIT"]
        # the release trigger brought the row to its head, as release does
        assert row(journal, "SELECT state, seq, wake_at FROM run_rows") == (
            "verifying",
            1,
            format_utc(wake),
        )

    def test_an_expired_lease_of_a_due_run_is_taken_over(self, journal):
        start(journal)
        run = journal.claim("r1", "dead", ttl=0.05)
        journal.put_signal(SignalRecord("r1", 0, GO))  # due while held
        time.sleep(0.1)
        assert journal.next_wake(machine=SPEC.name) is None  # next_wake: unleased runs only
        taken = journal.claim_next("alive", ttl=60, machine=SPEC.name, states=["verifying"])
        assert (taken.run_id, taken.lease_owner, taken.recoveries) == ("r1", "alive", 1)
        assert taken.lease_token == run.lease_token + 1

    def test_a_due_run_claimed_meanwhile_is_not_claimed_again(self, journal):
        start(journal)
        journal.put_signal(SignalRecord("r1", 0, GO))
        with SqliteJournal(journal.path) as other:
            first = other.claim_next("a", ttl=60, machine=SPEC.name, states=["verifying"])
        assert first.run_id == "r1"
        assert journal.claim_next("b", ttl=60, machine=SPEC.name, states=["verifying"]) is None
        assert journal.wake_time("r1") is not None


class TestPrune:
    def test_the_pruned_runs_signals_go_with_them(self, journal):
        for run_id in ("old", "kept"):
            start(journal, run_id)
            journal.put_signal(SignalRecord(run_id, 0, GO))
            journal.put_signal(SignalRecord(run_id, 0, "B", signal_id="x"))
        run = journal.claim("old", "w", ttl=60)
        journal.commit(*step(run, "done", status=RunLifecycle.SUCCEEDED, lease_owner=None))
        assert journal.prune(ended_before=utc_now() + HOUR).run_ids == ("old",)
        assert rows(journal, "SELECT DISTINCT run_id FROM signals") == [("kept",)]
        assert [s.status for s in journal.signals("kept")] == [SignalStatus.PENDING] * 2
        assert journal.integrity_problems() == []
