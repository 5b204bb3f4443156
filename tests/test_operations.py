"""Operator operations on every journal: fork, rewind (resume from an earlier state), prune,
state and stale-lease filters, and the journal's own integrity check."""

from __future__ import annotations

import datetime as dt
import sqlite3

import attrs
import pytest

from fsm_runner import (
    Engine,
    InvalidTransitionError,
    PhaseResult,
    RunNotFoundError,
    RunTerminalError,
    SqliteJournal,
)
from fsm_runner.effects import MUTATE
from fsm_runner.engine import fork_run
from fsm_runner.exceptions import RunExistsError
from fsm_runner.records import ArtifactRecord, RunRecord, TransitionRecord, utc_now
from fsm_runner.replay import replay
from fsm_runner.spec import RunLifecycle
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("fetching", "building", "testing", "publishing", name="ops")


class Recorder:
    """Handlers that record every execution, write an artifact, and perform one effect."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.charges: list[str] = []

    def handlers(self) -> dict[str, object]:
        return {
            name: self.phase(name) for name in ("fetching", "building", "testing", "publishing")
        }

    def phase(self, name: str):
        def handler(ctx):
            self.calls.append(name)
            ctx.effect(f"charge-{name}", lambda: self.charges.append(name) or name, kind=MUTATE)
            return PhaseResult(
                NEXT,
                output={"phase": name},
                context={name: ctx.attempt},
                artifacts=[ArtifactRecord(f"{name}-report", content={"phase": name})],
            )

        return handler


def finished_run(journal, recorder: Recorder | None = None) -> tuple[Engine, str]:
    recorder = recorder or Recorder()
    engine = Engine(SPEC, handlers=recorder.handlers(), journal=journal)
    run_id = engine.start({"n": 1}, run_id="source")
    engine.run(run_id)
    return engine, run_id


def strip_ids(transitions: list[TransitionRecord]) -> list[TransitionRecord]:
    return [attrs.evolve(t, run_id="", lease_token=0) for t in transitions]


class TestFork:
    """fork_run: a new run with the history up to a seq; the original untouched."""

    def test_copies_history_up_to_seq_and_records_origin(self, journal):
        _engine, source = finished_run(journal)
        before = journal.transitions(source)
        source_row = journal.load(source)
        fork = fork_run(journal, source, at_seq=1, new_run_id="fork")
        assert fork.run_id == "fork"
        assert fork.forked_from == "source@1"
        assert (fork.state, fork.seq, fork.status.value) == ("building", 1, "active")
        assert fork.context == {"fetching": 1}
        assert strip_ids(journal.transitions("fork")) == strip_ids(before[:2])
        # the original is untouched
        assert journal.transitions(source) == before
        assert journal.load(source) == source_row
        # invariant 8 holds for the fork too
        spec_replayed = replay(SPEC, fork, journal.transitions("fork")).run
        assert spec_replayed.state == fork.state
        assert spec_replayed.seq == fork.seq

    def test_fork_runs_on_from_its_state(self, journal):
        recorder = Recorder()
        engine, source = finished_run(journal, recorder)
        recorder.calls.clear()
        fork_run(journal, source, at_seq=1, new_run_id="fork")
        run = engine.resume("fork")
        assert run.state == "done"
        assert recorder.calls == ["building", "testing", "publishing"]
        assert [t.seq for t in journal.transitions("fork")] == list(range(5))

    def test_copies_artifacts_and_effects_of_ended_visits_only(self, journal):
        recorder = Recorder()
        engine, source = finished_run(journal, recorder)
        fork_run(journal, source, at_seq=1, new_run_id="fork")
        assert [a.name for a in journal.artifacts("fork")] == ["fetching-report"]
        assert [a.run_id for a in journal.artifacts("fork")] == ["fork"]
        # fetching's visit ended at seq 1 → its effect is history; building's is not copied
        assert [e.name for e in journal.effects("fork")] == ["charge-fetching"]
        recorder.charges.clear()
        engine.resume("fork")
        assert recorder.charges == ["building", "testing", "publishing"]

    def test_an_ended_run_must_be_forked_before_its_end(self, journal):
        _engine, source = finished_run(journal)
        with pytest.raises(ValueError, match="had ended at seq 4"):
            fork_run(journal, source)
        with pytest.raises(ValueError, match="no seq 9"):
            fork_run(journal, source, at_seq=9)

    def test_unknown_run_and_taken_id(self, journal):
        _engine, source = finished_run(journal)
        with pytest.raises(RunNotFoundError):
            fork_run(journal, "nope", at_seq=0)
        with pytest.raises(RunExistsError):
            fork_run(journal, source, at_seq=1, new_run_id=source)
        assert journal.load(source).state == "done"

    def test_fork_of_an_active_run_defaults_to_its_last_seq(self, journal):
        engine = Engine(SPEC, handlers=Recorder().handlers(), journal=journal)
        run_id = engine.start(None)
        engine.run(run_id, max_steps=2)
        fork = engine.fork(run_id)
        assert (fork.state, fork.seq, fork.forked_from) == ("testing", 2, f"{run_id}@2")


class TestRewind:
    """resume(from_state=...): back to a state the run was in, journaled as REWOUND."""

    def test_runs_the_earlier_phase_again(self, journal):
        recorder = Recorder()
        engine = Engine(SPEC, handlers=recorder.handlers(), journal=journal)
        run_id = engine.start(None)
        engine.run(run_id, max_steps=3)  # in publishing
        recorder.calls.clear()
        run = engine.resume(run_id, from_state="building")
        assert run.state == "done"
        assert recorder.calls == ["building", "testing", "publishing"]
        rewound = journal.transitions(run_id)[4]
        assert (rewound.from_state, rewound.event, rewound.to_state) == (
            "publishing",
            "REWOUND",
            "building",
        )
        assert rewound.output == {"rewound_from": "publishing"}
        assert replay(SPEC, run, journal.transitions(run_id)).run == run

    @pytest.mark.parametrize(
        ("state", "message"),
        [
            ("nowhere", "has no state 'nowhere'"),
            ("done", "terminal"),
            ("publishing", "never been in 'publishing'"),
        ],
    )
    def test_refused_where_the_spec_or_history_does_not_allow_it(self, journal, state, message):
        engine = Engine(SPEC, handlers=Recorder().handlers(), journal=journal)
        run_id = engine.start(None)
        engine.run(run_id, max_steps=2)
        with pytest.raises(InvalidTransitionError, match=message):
            engine.resume(run_id, from_state=state)
        assert journal.load(run_id).seq == 2

    def test_an_ended_run_is_refused(self, journal):
        engine, source = finished_run(journal)
        with pytest.raises(RunTerminalError):
            engine.resume(source, from_state="building")


def ended_run(journal, run_id: str, *, ended: bool = True, parent: str | None = None) -> None:
    """A run row straight through the journal API: started, then ended (or not)."""
    now = utc_now()
    run = RunRecord(run_id, SPEC.name, SPEC.spec_hash, "fetching", parent_run_id=parent)
    first = TransitionRecord(run_id, 0, None, "STARTED", "fetching", at=now)
    journal.create_run(run, first, spec_json=SPEC.to_json())
    if ended:
        after = attrs.evolve(run, state="failed", seq=1, status=RunLifecycle.FAILED, updated_at=now)
        journal.commit(after, TransitionRecord(run_id, 1, "fetching", "SYSTEM_ERROR", "failed"))


class TestPrune:
    """prune: ended runs only, with everything they own; never an active run."""

    def test_deletes_ended_runs_and_what_they_own(self, journal):
        _engine, source = finished_run(journal)
        ended_run(journal, "old-failed")
        ended_run(journal, "active", ended=False)
        report = journal.prune(ended_before=utc_now() + dt.timedelta(seconds=1))
        assert set(report.run_ids) == {source, "old-failed"}
        assert report.transitions == 5 + 2
        assert not report.dry_run
        assert [r.run_id for r in journal.runs()] == ["active"]
        for gone in (source, "old-failed"):
            with pytest.raises(RunNotFoundError):
                journal.load(gone)
        assert journal.transitions("active")[0].event == "STARTED"

    def test_dry_run_deletes_nothing(self, journal):
        _engine, source = finished_run(journal)
        report = journal.prune(ended_before=utc_now() + dt.timedelta(seconds=1), dry_run=True)
        assert report.run_ids == (source,)
        assert report.dry_run
        assert journal.load(source).state == "done"

    def test_recent_runs_and_parents_of_active_children_stay(self, journal):
        ended_run(journal, "parent")
        ended_run(journal, "child", ended=False, parent="parent")
        ended_run(journal, "recent")
        report = journal.prune(ended_before=utc_now() - dt.timedelta(days=1))
        assert report.run_ids == ()
        report = journal.prune(ended_before=utc_now() + dt.timedelta(seconds=1))
        assert report.run_ids == ("recent",)
        assert {r.run_id for r in journal.runs()} == {"parent", "child"}

    def test_sqlite_reclaims_space_and_drops_unused_specs(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = Engine(SPEC, handlers=Recorder().handlers(), journal=journal)
            for _ in range(200):
                engine.run(engine.start({"padding": "x" * 500}))
            report = journal.prune(ended_before=utc_now() + dt.timedelta(seconds=1), vacuum=True)
            assert len(report.run_ids) == 200
            assert report.bytes_before is not None
            assert report.bytes_after is not None
            assert report.bytes_after < report.bytes_before / 4
        conn = sqlite3.connect(path)
        for table in ("runs", "transitions", "iterations", "artifacts", "effects", "specs"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table
        conn.close()

    def test_sqlite_without_vacuum_deletes_in_batches_and_keeps_the_file(
        self, tmp_path, monkeypatch
    ):
        from fsm_runner.journal import _sqlite_prune

        monkeypatch.setattr(_sqlite_prune, "BATCH", 7)
        monkeypatch.setattr(_sqlite_prune, "_SIZES", (7, 7))  # no resizing to the time taken
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = Engine(SPEC, handlers=Recorder().handlers(), journal=journal)
            for _ in range(30):
                engine.run(engine.start())
            kept = engine.start()  # active: stays, and so does the spec it uses
            transactions = []
            journal._connections.conn.set_trace_callback(
                lambda sql: transactions.append(sql) if sql.startswith("BEGIN") else None
            )
            report = journal.prune(ended_before=utc_now() + dt.timedelta(seconds=1))
            journal._connections.conn.set_trace_callback(None)
            assert len(report.run_ids) == 30
            assert report.bytes_after is None  # not vacuumed: the space is reused
            assert len(transactions) == 5  # 7 + 7 + 7 + 7 + 2 runs, each batch its own
            assert [run.run_id for run in journal.runs()] == [kept]
            assert journal.spec_json(SPEC.spec_hash)
            assert engine.run(kept).ended


class TestFilters:
    """runs(state=..., stale=...)."""

    def test_state(self, journal):
        engine = Engine(SPEC, handlers=Recorder().handlers(), journal=journal)
        first = engine.start(None)
        second = engine.start(None)
        engine.run(second, max_steps=1)
        assert [r.run_id for r in journal.runs(state="fetching")] == [first]
        assert [r.run_id for r in journal.runs(state="building")] == [second]

    def test_stale_leases(self, journal):
        past = utc_now() - dt.timedelta(minutes=5)
        future = utc_now() + dt.timedelta(minutes=5)
        for run_id, owner, expires in (
            ("expired", "worker-1", past),
            ("live", "worker-2", future),
            ("free", None, None),
        ):
            run = RunRecord(
                run_id,
                SPEC.name,
                SPEC.spec_hash,
                "fetching",
                lease_owner=owner,
                lease_expires_at=expires,
            )
            first = TransitionRecord(run_id, 0, None, "STARTED", "fetching")
            journal.create_run(run, first, spec_json=SPEC.to_json())
        assert [r.run_id for r in journal.runs(stale=True)] == ["expired"]


class TestIntegrity:
    """integrity_problems: the medium's own check."""

    def test_a_sound_journal_has_none(self, journal):
        finished_run(journal)
        assert journal.integrity_problems() == []

    def test_sqlite_dangling_rows_are_reported(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            finished_run(journal)
        conn = sqlite3.connect(path)
        conn.execute(
            "INSERT INTO transitions (run_id, seq, event, to_state, at, run_key) "
            "VALUES ('ghost', 0, 'STARTED', 'fetching', '2024-01-01T00:00:00.000000+00:00', -1)"
        )
        conn.commit()
        conn.close()
        with SqliteJournal(path) as journal:
            problems = journal.integrity_problems()
        assert len(problems) == 2
        assert "transitions" in problems[0]
        assert "missing" in problems[0]
        # a row written by hand carries no digest (schema 11): its chain is broken there
        assert problems[1].startswith("digest: run with run_key -1 at seq 0:")
