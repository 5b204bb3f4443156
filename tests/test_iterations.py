"""Iteration records, artifacts and transition reasons, journaled with their transitions."""

from __future__ import annotations

import sqlite3

import pytest

from fsm_runner import Engine, PhaseResult, RunEvent, SqliteJournal
from fsm_runner.exceptions import JournalError
from fsm_runner.journal import SCHEMA_VERSION
from fsm_runner.records import ArtifactRecord, ErrorType
from tests.helpers import iteration_loop_spec, undo_v4

SPEC = iteration_loop_spec()


def engine_for(journal, *, passes_on: int = 2, limit: int = 3, fail_in_verify: bool = False):
    def build(ctx):
        return PhaseResult(
            "BUILT",
            iteration={"model": "m-1", "tokens_input": 10 * ctx.iteration, "success": True},
            artifacts=[
                ArtifactRecord(f"agent-{ctx.iteration}", "agent_result", {"n": ctx.iteration})
            ],
        )

    def verify(ctx):
        if fail_in_verify:
            raise RuntimeError("verifier crashed")
        passed = ctx.iteration >= passes_on
        return PhaseResult(
            RunEvent.VERIFY_PASSED if passed else RunEvent.VERIFY_FAILED_RETRYABLE,
            iteration={"passed": passed, "levels_run": ["L0", "L1"]},
        )

    def feedback(ctx):
        return PhaseResult("FEEDBACK_READY", iteration={"feedback": f"fix #{ctx.iteration}"})

    return Engine(
        SPEC,
        handlers={"build": build, "verify": verify, "feedback": feedback},
        guards={"iterations_left": lambda run: run.iteration < limit},
        journal=journal,
    )


class TestIterationRecords:
    """One record per iteration, updated in the same transaction as each step."""

    def test_records_follow_the_run(self, journal):
        engine = engine_for(journal)
        run = engine.run(engine.start())
        assert run.state == "succeeded"
        records = journal.iterations(run.run_id)
        assert [r.iteration for r in records] == [1, 2]
        first, second = records
        assert (first.passed, first.feedback, first.tokens_input) == (False, "fix #1", 10)
        assert (second.passed, second.tokens_input, second.levels_run) == (True, 20, ("L0", "L1"))
        assert first.model == "m-1"
        assert first.success is True
        assert first.started_at <= first.completed_at <= second.started_at <= second.completed_at
        assert second.state == "succeeded"
        assert first.error_type is ErrorType.NONE

    def test_artifacts_are_journaled_with_their_transition(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        engine.run(run_id)
        artifacts = journal.artifacts(run_id)
        assert [(a.name, a.kind, a.content) for a in artifacts] == [
            ("agent-1", "agent_result", {"n": 1}),
            ("agent-2", "agent_result", {"n": 2}),
        ]
        seqs = {t.seq: t for t in journal.transitions(run_id)}
        assert all(seqs[a.seq].event == "BUILT" and a.run_id == run_id for a in artifacts)
        assert [a.iteration for a in artifacts] == [1, 2]

    def test_a_handler_error_is_recorded_on_the_iteration(self, journal):
        engine = engine_for(journal, fail_in_verify=True)
        run = engine.run(engine.start())
        (record,) = journal.iterations(run.run_id)
        assert record.error_type is ErrorType.SYSTEM_ERROR
        assert record.error_message == "RuntimeError: verifier crashed"

    def test_unknown_iteration_field_is_a_handler_error(self, journal):
        spec = SPEC
        engine = Engine(
            spec,
            handlers={
                "build": lambda ctx: PhaseResult("BUILT", iteration={"no_such_field": 1}),
                "verify": lambda ctx: RunEvent.VERIFY_PASSED,
                "feedback": lambda ctx: "FEEDBACK_READY",
            },
            guards={"iterations_left": lambda run: True},
            journal=journal,
        )
        run = engine.run(engine.start())
        assert run.state == "failed"
        assert "no_such_field" in run.error["message"]


class TestTransitionReason:
    """A transition's reason becomes the run's error when it is taken."""

    def test_spent_limit_fails_with_the_reason(self, journal):
        engine = engine_for(journal, passes_on=99, limit=2)
        run = engine.run(engine.start())
        assert (run.state, run.iteration) == ("failed", 2)
        assert run.error == {"type": "FEEDBACK_READY", "message": "iteration limit spent"}
        assert journal.transitions(run.run_id)[-1].result["reason"] == "iteration limit spent"


class TestMigration:
    """A version-1 journal is migrated in place to the current schema."""

    def test_v1_journal_gains_iterations_and_artifacts(self, tmp_path):
        path = tmp_path / "old.db"
        journal = SqliteJournal(path)
        run_id = engine_for(journal).start()
        journal.close()
        conn = sqlite3.connect(path)  # turn it back into what version 1 wrote
        undo_v4(conn)
        conn.execute("DROP TABLE iterations")
        conn.execute("DROP TABLE artifacts")
        for column in ("return_to", "return_attempt"):
            conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
        conn.execute("DELETE FROM _sqlite_migrations WHERE name != 'm0001_initial'")
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
        conn.commit()
        conn.close()
        journal = SqliteJournal(path)
        assert journal.meta()["schema_version"] == str(SCHEMA_VERSION)
        run = engine_for(journal).run(run_id)
        assert run.state == "succeeded"
        assert len(journal.iterations(run_id)) == 2
        journal.close()

    def test_unknown_migration_is_refused(self, tmp_path):
        path = tmp_path / "new.db"
        SqliteJournal(path).close()
        conn = sqlite3.connect(path)
        conn.execute(
            "INSERT INTO _sqlite_migrations (migration_set, name, applied_at)"
            " VALUES ('fsm_runner', 'm0099_future', 'x')"
        )
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
        conn.commit()
        conn.close()
        with pytest.raises(JournalError, match="newer"):
            SqliteJournal(path)


class TestOlderRows:
    """An iteration row written before a field existed loads with the field's default."""

    def test_sparse_row_loads_with_defaults(self, tmp_path):
        path = tmp_path / "j.db"
        journal = SqliteJournal(path)
        run_id = engine_for(journal).start()
        journal.close()
        conn = sqlite3.connect(path)
        conn.execute("DELETE FROM iterations")
        conn.execute("INSERT INTO iterations (run_id, iteration) VALUES (?, 1)", (run_id,))
        conn.commit()
        conn.close()
        with SqliteJournal(path) as journal:
            (record,) = journal.iterations(run_id)
        assert record.error_type is ErrorType.NONE
        assert record.levels_run == ()
        assert record.extra == {}
        assert record.feedback_fallback is False
        assert record.passed is None
