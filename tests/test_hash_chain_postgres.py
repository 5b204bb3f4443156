"""The hash chain on PostgreSQL (issue 30, part 1): the same digests as SQLite, found damaged.

What ``tests/test_hash_chain.py`` shows of SQLite and memory journals, on a real server: the
digests written are those a SQLite journal writes for the same records; a byte changed by a raw
``UPDATE`` is named by ``check`` (run and seq); every older schema version is migrated with its
rows' digests computed once (and ``meta`` says so); an exported run verifies elsewhere.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3

import attrs
import pytest
from click.testing import CliRunner
from psycopg import sql

from fsm_runner import (
    PostgresJournal,
    RunLifecycle,
    RunRecord,
    SqliteJournal,
    TransitionRecord,
)
from fsm_runner.cli import cli
from fsm_runner.journal import _postgres_chain
from fsm_runner.journal._digest import row_digest, row_digest_from, row_hasher
from fsm_runner.journal._postgres_schema import MIGRATIONS, SCHEMA_VERSION
from fsm_runner.journal.base import Commit
from tests.helpers import NEXT, one_line_error
from tests.test_hash_chain import (
    DAMAGES,
    SPEC,
    T0,
    chained_run,
    documented_verify_chain,
    flip,
    fork_at_one,
)


@pytest.fixture
def admin(postgres_server):
    """A connection of the test's own, beside the journal's."""
    return postgres_server.admin


#: SQLite's names for what PostgreSQL calls otherwise.
_TABLES = {"run_rows": "runs"}


def url_of(journal: PostgresJournal) -> str:
    base = journal._url  # private: the URL the test opened it with, to give the CLI
    return f"{base}{'&' if '?' in base else '?'}schema={journal.schema}"


def rows(admin, schema: str, query: str, params=()) -> list[tuple]:
    with admin.transaction():
        admin.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        return admin.execute(query, params).fetchall()


def damage(admin, schema: str, name: str) -> None:
    """One changed byte (or second) of a stored value, by a raw UPDATE."""
    table, column, where, old, new, _ = DAMAGES[name]
    table = _TABLES.get(table, table)
    where = "true" if where == "1" else where
    if column == "at":  # a timestamptz: one second later, as ':07.' -> ':08.' in SQLite's text
        rows(admin, schema, f"UPDATE {table} SET at = at + interval '1 second'"
             f" WHERE run_id = 'r1' AND {where} RETURNING 1")  # fmt: skip
        return
    ((value,),) = rows(
        admin, schema, f"SELECT {column} FROM {table} WHERE run_id = 'r1' AND {where}"
    )
    rows(
        admin,
        schema,
        f"UPDATE {table} SET {column} = %s WHERE run_id = 'r1' AND {where} RETURNING 1",
        (flip(value, old, new),),
    )


def sqlite_digests(path) -> dict[str, list]:
    conn = sqlite3.connect(path)
    try:
        return {
            table: [row[0] for row in conn.execute(f"SELECT digest FROM {table} ORDER BY rowid")]
            for table in ("transitions", "run_rows", "iterations", "effects", "artifacts")
        }
    finally:
        conn.close()


def test_a_row_digest_hashed_in_two_parts_is_the_same():
    first = ("r1", "m", "2026-01-02T03:04:05.678901+00:00", None, "r0@1", '{"é":1.5}')
    for rest in [("{}", None), (None, '{"error":"x"}'), ('{"a":[1,2]}', "\udcff")]:
        assert row_digest_from(row_hasher(first), rest) == row_digest((*first, *rest))


class TestPostgresChain:
    """The digests PostgreSQL's writers store, and what ``check`` finds of a changed byte."""

    def test_the_same_digests_as_sqlite(self, postgres_journal, tmp_path):
        chained_run(postgres_journal)
        assert postgres_journal.integrity_problems() == []
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
        expected = sqlite_digests(path)
        stored = postgres_journal._connection.call(  # private: the rows as stored
            lambda conn: {
                table: [row[0] for row in conn.execute(f"SELECT digest FROM {table} ORDER BY {o}")]
                for table, o in (
                    ("transitions", "seq"),
                    ("runs", "rowid"),
                    ("iterations", "iteration"),
                    ("effects", "rowid"),
                    ("artifacts", "id"),
                )
            }
        )
        assert stored == {_TABLES.get(t, t): digests for t, digests in expected.items()}
        assert all(len(d) == 32 for digests in stored.values() for d in digests)
        assert [t.digest for t in postgres_journal.transitions("r1")] == expected["transitions"]

    @pytest.mark.parametrize("name", sorted(DAMAGES))
    def test_a_changed_byte_is_found(self, postgres_journal, admin, name):
        chained_run(postgres_journal)
        chained_run(postgres_journal, "r2")  # untouched: never named
        damage(admin, postgres_journal.schema, name)
        names = DAMAGES[name][-1]
        problems = [p for p in postgres_journal.integrity_problems() if p.startswith("digest:")]
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"digest: run r1 {names}" if "seq" in names else "digest:")
        assert names in problems[0]
        result = CliRunner().invoke(
            cli, ["--journal", url_of(postgres_journal), "check", "--jobs", "1"]
        )
        assert result.exit_code == 1, result.output
        lines = [line for line in result.output.splitlines() if "digest" in line]
        assert len(lines) == 1, result.output
        assert "run r1" in lines[0]
        assert names in lines[0]
        assert "r2" not in result.output

    def test_rows_are_read_in_batches(self, postgres_journal, admin, monkeypatch):
        monkeypatch.setattr(_postgres_chain, "BATCH", 2)  # each table over several reads
        for run_id in ("r0", "r1", "r2"):
            chained_run(postgres_journal, run_id)
        assert postgres_journal.integrity_problems() == []
        damage(admin, postgres_journal.schema, "timestamp")
        problems = postgres_journal.integrity_problems()
        assert [p[: p.index(":", 8)] for p in problems] == ["digest: run r1 at seq 2"]

    def test_a_claim_brings_the_head_its_next_commit_chains_to(self, postgres_journal):
        journal = postgres_journal
        for run_id in ("r1", "r2"):
            journal.create_run(
                RunRecord(run_id, SPEC.name, SPEC.spec_hash, "building", created_at=T0),
                TransitionRecord(run_id, 0, None, "STARTED", "building", at=T0),
                spec_json=SPEC.to_json(),
            )
        (head,) = [t.digest for t in journal.transitions("r1")]
        (head2,) = [t.digest for t in journal.transitions("r2")]
        with PostgresJournal(journal._url, schema=journal.schema) as other:
            claimed = other.claim("r1", "w", ttl=60)
            assert other._writer._heads == {"r1": (0, head)}  # private: no read before a step
            other.release("r1", "w", claimed.lease_token)
            other._writer.forget(["r1"])
            (again,) = other.claim_many(["r1"], "w", ttl=60)
            assert other._writer._heads == {"r1": (0, head)}
            other.release("r1", "w", again.lease_token)
            other._writer.forget(["r1"])
            both = other.claim_many(["r1", "r2"], "w", ttl=60)  # a group: one read of both
            assert other._writer._heads == {"r1": (0, head), "r2": (0, head2)}
            assert [run.lease_owner for run in both] == ["w", "w"]
            assert both == [other.load("r1"), other.load("r2")]  # the rows as the claim left them
            for run in both:
                other.release(run.run_id, "w", run.lease_token)
            other._writer.forget(["r1", "r2"])
            found = other.claim_next("w", ttl=60, machine=SPEC.name, states=["building"])
            assert found is not None
            assert other._writer._heads == {"r1": (0, head)}

    def test_a_group_with_two_steps_of_one_run_chains_them(self, postgres_journal):
        journal = postgres_journal
        run = RunRecord("r1", SPEC.name, SPEC.spec_hash, "building", created_at=T0, updated_at=T0)
        journal.create_run(
            run,
            TransitionRecord("r1", 0, None, "STARTED", "building", at=T0),
            spec_json=SPEC.to_json(),
        )
        commits = []
        for seq, (before, to_state) in enumerate(
            (("building", "verifying"), ("verifying", "done")), 1
        ):
            when = T0 + dt.timedelta(seconds=seq)
            run = attrs.evolve(run, state=to_state, seq=seq, visit_seq=seq, updated_at=when)
            commits.append(
                Commit(run, TransitionRecord("r1", seq, before, NEXT, to_state, at=when))
            )
        refused = Commit(run, TransitionRecord("r1", 2, "building", NEXT, "done", at=T0))
        results = journal.commit_many([*commits, refused])
        assert results[:2] == [None, None]
        assert results[2] is not None  # seq 2 is taken: refused alone, its head forgotten
        assert journal.integrity_problems() == []
        assert len({t.digest for t in journal.transitions("r1")}) == 3

    def test_group_commits_forks_and_claims_keep_the_chain(self, postgres_journal):
        journal = postgres_journal
        fork_at_one(journal, chained_run(journal, "r1"))
        claimed = journal.claim("f1", "w", ttl=60)
        # another writer (this journal opened again) steps the fork: it reads the head it chains to
        with PostgresJournal(journal._url, schema=journal.schema) as other:
            when = T0 + dt.timedelta(seconds=9)
            after = attrs.evolve(
                claimed, state="done", seq=2, visit_seq=2, updated_at=when,
                status=RunLifecycle.SUCCEEDED, lease_owner=None, lease_expires_at=None,
            )  # fmt: skip
            step = TransitionRecord(
                "f1", 2, "verifying", NEXT, "done", at=when, lease_token=claimed.lease_token
            )
            assert other.commit_many([Commit(after, step)]) == [None]
        assert journal.integrity_problems() == []
        chain = [t.digest for t in journal.transitions("f1")]
        assert len(set(chain)) == 3
        assert chain[:2] != [t.digest for t in journal.transitions("r1")][:2]  # its own run id
        result = CliRunner().invoke(cli, ["--journal", url_of(journal), "check", "--jobs", "1"])
        assert result.exit_code == 0, result.output
        assert result.output.endswith("2 runs checked, no problems\n")


def make_old_journal(admin, schema: str, version: int) -> None:
    """A journal at ``version``, its SQL as it was, holding a run as that fsm_runner left it."""
    with admin.transaction():
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        admin.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        admin.execute("".join(text for number, _, text in MIGRATIONS if number <= version))
        admin.execute(
            "INSERT INTO specs VALUES (%s, %s, %s, %s)",
            (SPEC.spec_hash, SPEC.name, SPEC.to_json(), T0),
        )
        admin.execute(
            "INSERT INTO runs (run_id, machine, spec_hash, state, status, seq, iteration,"
            " created_at, updated_at, input, context) VALUES ('r1', %s, %s, 'verifying',"
            ' \'active\', 1, 1, %s, %s, \'{"ref":"abc"}\', \'{"version":"1.2.1"}\')',
            (SPEC.name, SPEC.spec_hash, T0, T0 + dt.timedelta(seconds=1)),
        )
        admin.execute(
            "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration,"
            " attempt, at, duration_ms, result) VALUES"
            " ('r1', 0, NULL, 'STARTED', 'building', 1, 1, %s, NULL, NULL),"
            " ('r1', 1, 'building', %s, 'verifying', 1, 1, %s, 1.5, '{\"version\":\"1.2.1\"}')",
            (T0, NEXT, T0 + dt.timedelta(seconds=1)),
        )
        if version >= 2:
            admin.execute(
                "INSERT INTO iterations (run_id, iteration, state, started_at)"
                " VALUES ('r1', 1, 'building', %s)",
                (T0,),
            )
            admin.execute(
                "INSERT INTO artifacts (run_id, name, seq, content, created_at)"
                " VALUES ('r1', 'report', 1, '{\"lines\":3}', %s)",
                (T0,),
            )
        if version >= 4:
            admin.execute(
                "INSERT INTO effects (run_id, visit_seq, name, state, kind, params, status)"
                " VALUES ('r1', 1, 'charge', 'verifying', 'mutate', '{\"n\":5}', 'started')"
            )


class TestPostgresMigration:
    """Every older PostgreSQL version: migration 9 computes the digests and says so."""

    @pytest.mark.parametrize("version", range(1, 9))  # 9 on had them
    def test_every_older_version_gets_digests(
        self, postgres_server, postgres_schema, admin, version
    ):
        make_old_journal(admin, postgres_schema, version)
        with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
            meta = journal.meta()
            assert meta["schema_version"] == str(SCHEMA_VERSION) == "11"
            assert meta["digests_computed"].startswith("computed at migration to version 9 on ")
            assert meta["digests_computed_to_run_key"] == "1"  # runs.rowid on PostgreSQL
            assert journal.integrity_problems() == []
            assert all(t.digest for t in journal.transitions("r1"))
            chained_run(journal, "r2")  # a new run: its own digests, written as it goes
            assert journal.integrity_problems() == []
            empty = [
                table
                for table in ("transitions", "runs", "iterations", "effects", "artifacts")
                if rows(admin, postgres_schema, f"SELECT 1 FROM {table} WHERE digest IS NULL")
            ]
            assert empty == []
        damage(admin, postgres_schema, "result-value")
        with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
            lines = [p for p in journal.integrity_problems() if p.startswith("digest:")]
        assert len(lines) == 1, lines
        assert lines[0].startswith("digest: run r1 at seq 1:")
        assert "computed at migration to version 9" in lines[0]
        assert "vouch only for what the migration read" in lines[0]

    def test_a_new_journal_says_nothing_of_a_migration(self, postgres_journal):
        chained_run(postgres_journal)
        assert "digests_computed" not in postgres_journal.meta()


class TestPostgresExportAndReplay:
    """`export` carries a PostgreSQL run's digests; `replay` finds the first changed seq."""

    def test_an_exported_run_verifies_elsewhere(self, postgres_journal, tmp_path):
        chained_run(postgres_journal)
        out = tmp_path / "out"
        result = CliRunner().invoke(
            cli, ["--journal", url_of(postgres_journal), "export", "r1", str(out)]
        )
        assert result.exit_code == 0, result.output
        exported = json.loads((out / "run.json").read_text())
        stored = [t.digest for t in postgres_journal.transitions("r1")]
        assert exported["head_digest"] == stored[-1]
        assert [t["digest"] for t in exported["transitions"]] == stored
        verify_chain = documented_verify_chain()
        assert verify_chain(exported) is None
        changed = json.loads(json.dumps(exported))
        changed["transitions"][1]["result"]["version"] = "1.2.7"
        assert verify_chain(changed) == 1

    def test_replay_names_the_first_seq_that_changed(self, postgres_journal, admin):
        chained_run(postgres_journal)
        base = ["--journal", url_of(postgres_journal), "replay", "r1"]
        assert CliRunner().invoke(cli, base).exit_code == 0
        damage(admin, postgres_journal.schema, "result-value")
        line = one_line_error(CliRunner().invoke(cli, base))
        assert line == (
            "Error: run r1 at seq 1: the transition does not match its digest (changed since it"
            " was written)"
        )
