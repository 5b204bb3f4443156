"""What only the PostgreSQL journal has: URLs, schemas, concurrent claims and lost connections.

The journal contract itself is tested for every journal through the ``journal`` fixture
(``tests/conftest.py``); these tests need a real server too, and fail when it is unreachable
(``FSM_RUNNER_TEST_POSTGRES=skip`` skips them instead).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import attrs
import pytest
from click.testing import CliRunner
from psycopg import sql

from fsm_runner import (
    Engine,
    JournalError,
    MemoryJournal,
    PostgresJournal,
    RunEvent,
    RunLifecycle,
    RunRecord,
    SqliteJournal,
    TransitionRecord,
    open_journal,
)
from fsm_runner.cli import cli
from fsm_runner.exceptions import (
    LeaseHeldError,
    LeaseLostError,
    RunConflictError,
    SchemaVersionError,
)
from fsm_runner.journal._postgres_schema import MIGRATIONS, SCHEMA_VERSION
from fsm_runner.journal.postgres import redact
from fsm_runner.records import ArtifactRecord, IterationRecord
from tests.conftest import POSTGRES_URL
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("building", "verifying")
T0 = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.timezone.utc)


def url_with(schema: str, base: str = POSTGRES_URL) -> str:
    return f"{base}{'&' if '?' in base else '?'}schema={schema}"


def start(journal, run_id: str = "r1", *, created: float = 0) -> RunRecord:
    when = T0 + dt.timedelta(seconds=created)
    run = RunRecord(run_id, SPEC.name, SPEC.spec_hash, "building", created_at=when, updated_at=when)
    first = TransitionRecord(run_id, 0, None, RunEvent.STARTED.value, "building", at=when)
    journal.create_run(run, first, spec_json=SPEC.to_json())
    return run


def next_step(run: RunRecord, to_state: str, **changes) -> tuple[RunRecord, TransitionRecord]:
    seq = run.seq + 1
    when = run.updated_at + dt.timedelta(seconds=1)
    after = attrs.evolve(run, state=to_state, seq=seq, updated_at=when, **changes)
    transition = TransitionRecord(
        run.run_id,
        seq,
        run.state,
        NEXT,
        to_state,
        iteration=after.iteration,
        at=when,
        lease_token=run.lease_token,
    )
    return after, transition


@pytest.fixture
def admin(postgres_server):
    """A connection of the test's own, beside the journal's."""
    return postgres_server.admin


def table_rows(admin, schema: str, query: str, params=()) -> list[tuple]:
    with admin.cursor() as cursor:
        cursor.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        rows = cursor.execute(query, params).fetchall()
        cursor.execute("SET search_path TO DEFAULT")
    return rows


class TestUrls:
    """URLs: the schema parameter, passwords kept out of every message."""

    @pytest.mark.parametrize(
        ("url", "shown"),
        [
            ("postgresql://u:sekrit@h:5432/db", "postgresql://u:***@h:5432/db"),
            ("postgres://u:sekrit@h/db?sslmode=disable", "postgres://u:***@h/db?sslmode=disable"),
            ("postgresql://u@h/db?password=sekrit&x=1", "postgresql://u@h/db?password=***&x=1"),
            ("postgresql://h/db", "postgresql://h/db"),
            ("host=h password=sekrit dbname=db", "host=h password=*** dbname=db"),
        ],
    )
    def test_redact(self, url, shown):
        assert redact(url) == shown

    def test_schema_parameter(self, postgres_server, postgres_schema, admin):
        with PostgresJournal(url_with(postgres_schema, postgres_server.url)) as journal:
            assert journal.schema == postgres_schema
            assert journal.location == url_with(postgres_schema, postgres_server.url)
            start(journal)
        assert table_rows(admin, postgres_schema, "SELECT run_id FROM runs") == [("r1",)]

    def test_schema_keyword_and_parameter_must_agree(self, postgres_server):
        with pytest.raises(ValueError, match="contradicts"):
            PostgresJournal(url_with("one", postgres_server.url), schema="two")

    def test_other_parameters_reach_libpq(self, postgres_server, postgres_schema):
        url = url_with(postgres_schema, postgres_server.url) + "&application_name=fsm-test-app"
        with PostgresJournal(url) as journal:
            name = journal._connection.call(
                lambda conn: conn.execute("SHOW application_name").fetchone()
            )
        assert name == ("fsm-test-app",)

    def test_password_is_never_shown(self, postgres_server, postgres_schema):
        # trust authentication ignores the password, so the journal opens with it
        base = postgres_server.url.replace("://root@", "://root:sekrit-pw@")
        with PostgresJournal(url_with(postgres_schema, base)) as journal:
            assert "sekrit" not in journal.location
            assert "sekrit" not in repr(journal)
            assert ":***@" in journal.location

    @pytest.mark.parametrize(
        "url",
        [
            "postgresql://root:sekrit-pw@127.0.0.1:1/test",  # nothing listens on port 1
            "postgresql://ro ot:sekrit-pw@127.0.0.1/test",  # malformed
            "postgresql://root:sekrit-pw@127.0.0.1:5432/test?nonsense=1",  # unknown parameter
        ],
    )
    def test_unusable_urls(self, url):
        with pytest.raises(JournalError) as info:
            PostgresJournal(url)
        message = str(info.value)
        assert "sekrit" not in message
        assert "\n" not in message
        assert message.startswith("journal postgresql://ro")

    def test_open_journal_picks_the_medium(self, postgres_server, postgres_schema, tmp_path):
        for scheme in ("postgresql://", "postgres://"):
            url = url_with(postgres_schema, postgres_server.url).replace("postgresql://", scheme)
            with open_journal(url) as journal:
                assert isinstance(journal, PostgresJournal)
                assert journal.schema == postgres_schema
        assert isinstance(open_journal(":memory:"), MemoryJournal)
        with open_journal(f"sqlite:///{tmp_path / 'j.db'}") as journal:
            assert isinstance(journal, SqliteJournal)

    def test_open_journal_without_creating(self, postgres_server, postgres_schema, tmp_path):
        url = url_with(postgres_schema, postgres_server.url)
        with pytest.raises(JournalError, match="holds no fsm_runner journal"):
            open_journal(url, create=False)
        with pytest.raises(JournalError, match="does not exist"):
            open_journal(tmp_path / "missing.db", create=False)
        open_journal(url).close()
        open_journal(url, create=False).close()

    def test_without_psycopg(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "psycopg", None)
        monkeypatch.delitem(sys.modules, "fsm_runner.journal.postgres")
        with pytest.raises(JournalError, match=r"install fsm-runner\[postgres\]"):
            open_journal("postgresql://root@127.0.0.1/test")

    def test_psycopg_is_imported_only_when_asked_for(self):
        code = (
            "import sys, fsm_runner, fsm_runner.journal, fsm_runner.engine, fsm_runner.cli; "
            "print([m for m in sys.modules if m.startswith(('psycopg', 'fsm_runner.journal.p'))])"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == "[]"


class TestSchema:
    """The journal's tables, their version, and what is refused."""

    def test_a_new_journal(self, postgres_journal, admin):
        assert postgres_journal.meta() == {
            "schema_version": str(SCHEMA_VERSION),
            "format": "fsm_runner journal",
        }
        tables = {
            row[0]
            for row in admin.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s",
                (postgres_journal.schema,),
            )
        }
        assert tables == {
            "meta", "specs", "runs", "transitions", "iterations", "artifacts", "effects",
            "signals",
        }  # fmt: skip

    def test_schemas_keep_journals_apart(self, postgres_server, postgres_journal):
        other_schema = postgres_server.new_schema()
        try:
            with PostgresJournal(postgres_server.url, schema=other_schema) as other:
                start(other, "elsewhere")
                assert postgres_journal.runs() == []
                assert [r.run_id for r in other.runs()] == ["elsewhere"]
        finally:
            postgres_server.drop(other_schema)

    def test_reopen_keeps_everything(self, postgres_server, postgres_schema):
        with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
            run = start(journal)
            journal.commit(*next_step(run, "verifying", context={"k": "v"}))
            before = (journal.load("r1"), journal.transitions("r1"))
        with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
            assert (journal.load("r1"), journal.transitions("r1")) == before

    def test_an_older_journal_is_migrated(self, postgres_server, postgres_schema, admin):
        # A version-3 journal, as an fsm_runner of that time left it: no effects, no leases.
        with admin.transaction():
            admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(postgres_schema)))
            admin.execute(
                sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(postgres_schema))
            )
            admin.execute("".join(text for version, _, text in MIGRATIONS if version <= 3))
            admin.execute(
                "INSERT INTO specs VALUES (%s, %s, %s, %s)",
                (SPEC.spec_hash, SPEC.name, SPEC.to_json(), T0),
            )
            admin.execute(
                "INSERT INTO runs (run_id, machine, spec_hash, state, status, seq, created_at,"
                " updated_at, context) VALUES ('old', %s, %s, 'verifying', 'active', 1, %s, %s, '{}')",
                (SPEC.name, SPEC.spec_hash, T0, T0),
            )
            admin.execute(
                "INSERT INTO transitions (run_id, seq, from_state, event, to_state, at) VALUES"
                " ('old', 0, NULL, 'STARTED', 'building', %s), ('old', 1, 'building', %s, 'verifying', %s)",
                (T0, NEXT, T0),
            )
        with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION)
            run = journal.load("old")
            assert (run.seq, run.visit_seq, run.lease_token, run.recoveries) == (1, 1, 0, 0)
            assert [t.lease_token for t in journal.transitions("old")] == [0, 0]
            journal.commit(*next_step(run, "done", status=RunLifecycle.SUCCEEDED))
            assert journal.load("old").state == "done"

    def test_a_version_5_journal_gets_the_abort_fence(
        self, postgres_server, postgres_schema, admin
    ):
        # A version-5 journal whose run has an abort requested: its holder's commit was taken.
        with admin.transaction():
            admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(postgres_schema)))
            admin.execute(
                sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(postgres_schema))
            )
            admin.execute("".join(text for version, _, text in MIGRATIONS if version <= 5))
            admin.execute(
                "INSERT INTO specs VALUES (%s, %s, %s, %s)",
                (SPEC.spec_hash, SPEC.name, SPEC.to_json(), T0),
            )
            admin.execute(
                "INSERT INTO runs (run_id, machine, spec_hash, state, status, seq, created_at,"
                " updated_at, context, abort_reason, lease_owner, lease_token)"
                " VALUES ('old', %s, %s, 'building', 'active', 0, %s, %s, '{}', 'stop', 'w', 3)",
                (SPEC.name, SPEC.spec_hash, T0, T0),
            )
            admin.execute(
                "INSERT INTO transitions (run_id, seq, from_state, event, to_state, at,"
                " lease_token) VALUES ('old', 0, NULL, 'STARTED', 'building', %s, 0)",
                (T0,),
            )
        with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION)
            run = journal.load("old")
            after, transition = next_step(run, "done", status=RunLifecycle.SUCCEEDED)
            with pytest.raises(RunConflictError) as info:
                journal.commit(after, attrs.evolve(transition, lease_token=3))
            assert info.value.abort_reason == "stop"
            assert journal.load("old").state == "building"

    def test_a_newer_journal_is_refused(self, postgres_server, postgres_journal, admin):
        start(postgres_journal)
        schema = postgres_journal.schema
        table_rows(
            admin, schema, "UPDATE meta SET value = '99' WHERE key = 'schema_version' RETURNING 1"
        )
        with pytest.raises(SchemaVersionError) as info:
            PostgresJournal(postgres_server.url, schema=schema)
        assert (info.value.found, info.value.supported) == (99, SCHEMA_VERSION)
        assert schema in str(info.value)
        assert table_rows(admin, schema, "SELECT value FROM meta WHERE key = 'schema_version'") == [
            ("99",)
        ]

    @pytest.mark.parametrize(
        "ddl",
        [
            "CREATE TABLE customers (id int)",
            "CREATE TABLE meta (id int)",
            "CREATE TABLE meta (key text, value text); INSERT INTO meta VALUES ('format', 'other')",
        ],
        ids=["other-tables", "other-meta", "other-format"],
    )
    def test_foreign_tables_are_refused(self, postgres_server, postgres_schema, admin, ddl):
        with admin.transaction():
            admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(postgres_schema)))
            admin.execute(
                sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(postgres_schema))
            )
            admin.execute(ddl)
        before = admin.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (postgres_schema,)
        ).fetchall()
        with pytest.raises(JournalError, match="not an fsm_runner journal") as info:
            PostgresJournal(postgres_server.url, schema=postgres_schema)
        assert not isinstance(info.value, SchemaVersionError)
        after = admin.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (postgres_schema,)
        ).fetchall()
        assert after == before

    def test_many_openers_of_a_new_schema(self, postgres_server, postgres_schema):
        errors: list[BaseException] = []

        def open_it() -> None:
            try:
                PostgresJournal(postgres_server.url, schema=postgres_schema).close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=open_it) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION)

    @pytest.mark.parametrize(("durability", "setting"), [("process", "on"), ("power", "on")])
    def test_durability(self, postgres_server, postgres_schema, durability, setting):
        with PostgresJournal(
            postgres_server.url, schema=postgres_schema, durability=durability
        ) as journal:
            shown = journal._connection.call(
                lambda conn: conn.execute("SHOW synchronous_commit").fetchone()
            )
        assert shown == (setting,)

    def test_unknown_durability(self, postgres_server):
        with pytest.raises(ValueError, match="durability"):
            PostgresJournal(postgres_server.url, durability="disk")

    def test_json_is_stored_as_written(self, postgres_journal, admin):
        run = start(postgres_journal)
        postgres_journal.commit(*next_step(run, "verifying", context={"b": 1, "a": [1.5, "é"]}))
        (context,) = table_rows(admin, postgres_journal.schema, "SELECT context FROM runs")[0]
        assert context == '{"b":1,"a":[1.5,"é"]}'  # key order kept, as in the SQLite journal

    def test_integrity_problems_find_a_run_row_off_its_transitions(self, postgres_journal, admin):
        run = start(postgres_journal)
        postgres_journal.commit(*next_step(run, "verifying"))
        assert postgres_journal.integrity_problems() == []
        table_rows(admin, postgres_journal.schema, "UPDATE runs SET state = 'nowhere' RETURNING 1")
        table_rows(
            admin, postgres_journal.schema, "DELETE FROM transitions WHERE seq = 0 RETURNING 1"
        )
        problems = postgres_journal.integrity_problems()
        assert len(problems) == 3
        assert "not at their last transition (first r1)" in problems[0]
        assert "gaps" in problems[1]
        # seq 1 no longer chains to a seq 0 (schema 9's digests)
        assert problems[2].startswith("digest: run r1 at seq 1: ")


def fill(journal, count: int) -> list[str]:
    ids = [f"run-{n:03d}" for n in range(count)]
    for n, run_id in enumerate(ids):
        start(journal, run_id, created=n)
    return ids


CLAIMER = textwrap.dedent(
    """
    import json, sys
    from fsm_runner.journal.postgres import PostgresJournal
    url, schema, owner, machine = sys.argv[1:5]
    claimed = []
    with PostgresJournal(url, schema=schema) as journal:
        print("ready", flush=True)
        sys.stdin.readline()  # every worker starts claiming at once
        while (run := journal.claim_next(owner, ttl=60, machine=machine, states=["building"])):
            claimed.append(run.run_id)
    print(json.dumps(claimed))
    """
)


class TestClaimNext:
    """Many workers, one database: each run is claimed by one of them, oldest first."""

    def test_a_locked_run_is_skipped_not_waited_for(self, postgres_journal, admin):
        fill(postgres_journal, 2)
        with admin.transaction():
            table_rows(
                admin,
                postgres_journal.schema,
                "SELECT run_id FROM runs WHERE run_id = 'run-000' FOR UPDATE",
            )
            began = time.monotonic()
            claimed = postgres_journal.claim_next(
                "w", ttl=60, machine=SPEC.name, states=["building"]
            )
            assert time.monotonic() - began < 2
        assert claimed is not None
        assert claimed.run_id == "run-001"
        again = postgres_journal.claim_next("w", ttl=60, machine=SPEC.name, states=["building"])
        assert again is not None
        assert again.run_id == "run-000"

    def test_threads_never_claim_one_run_twice(self, postgres_server, postgres_journal):
        ids = fill(postgres_journal, 60)
        claimed: dict[str, list[str]] = {}
        barrier = threading.Barrier(4)

        def worker(owner: str) -> None:
            mine = claimed[owner] = []
            with PostgresJournal(postgres_server.url, schema=postgres_journal.schema) as journal:
                barrier.wait()
                while run := journal.claim_next(
                    owner, ttl=60, machine=SPEC.name, states=["building"]
                ):
                    mine.append(run.run_id)

        threads = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        every = [run_id for mine in claimed.values() for run_id in mine]
        assert sorted(every) == ids  # each run once, none left out
        for owner, mine in claimed.items():
            assert mine == sorted(mine)  # each worker took the oldest it could get
            assert {postgres_journal.load(run_id).lease_owner for run_id in mine} == {owner}

    @pytest.mark.slow
    def test_processes_never_claim_one_run_twice(self, postgres_server, postgres_journal):
        ids = fill(postgres_journal, 90)
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CLAIMER,
                    postgres_server.url,
                    postgres_journal.schema,
                    f"p{n}",
                    SPEC.name,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for n in range(3)
        ]
        for process in workers:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready"
        for process in workers:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        results = [json.loads(process.communicate(timeout=60)[0]) for process in workers]
        assert all(process.returncode == 0 for process in workers)
        every = [run_id for claimed in results for run_id in claimed]
        assert sorted(every) == ids
        assert len(set(every)) == len(every)

    def test_an_expired_lease_is_taken_over(self, postgres_journal):
        fill(postgres_journal, 1)
        first = postgres_journal.claim_next("dead", ttl=-1, machine=SPEC.name, states=["building"])
        assert first is not None
        taken = postgres_journal.claim_next("alive", ttl=60, machine=SPEC.name, states=["building"])
        assert taken is not None
        assert (taken.lease_owner, taken.lease_token, taken.recoveries) == ("alive", 2, 1)


class TestLostConnections:
    """A dropped connection is got back; a write cut off is neither lost nor doubled."""

    def test_between_operations(self, postgres_server, postgres_journal):
        run = start(postgres_journal)
        old_pid = postgres_journal.backend_pid
        postgres_server.terminate(old_pid)
        assert postgres_journal.load("r1") == run  # a read, on a new connection
        assert postgres_journal.backend_pid not in (None, old_pid)

    @pytest.mark.parametrize("extras", [False, True], ids=["one-statement", "transaction"])
    def test_before_a_commit(self, postgres_server, postgres_journal, extras):
        run = start(postgres_journal)
        after, transition = next_step(run, "verifying", iteration=1)
        postgres_server.terminate(postgres_journal.backend_pid)
        postgres_journal.commit(
            after,
            transition,
            iterations=[IterationRecord("r1", 1, state="verifying")] if extras else (),
            artifacts=[ArtifactRecord("a", run_id="r1", seq=1)] if extras else (),
        )
        assert postgres_journal.load("r1") == after
        assert [t.seq for t in postgres_journal.transitions("r1")] == [0, 1]
        assert len(postgres_journal.iterations("r1")) == int(extras)

    @pytest.mark.parametrize("extras", [False, True], ids=["one-statement", "transaction"])
    def test_killed_inside_the_commit(self, postgres_server, postgres_journal, admin, extras):
        """The commit's transaction is under way (waiting for a row lock) when its backend dies."""
        run = start(postgres_journal)
        after, transition = next_step(run, "verifying", iteration=1)
        iterations = [IterationRecord("r1", 1, state="verifying")] if extras else ()
        pid = postgres_journal.backend_pid
        failures: list[BaseException] = []

        def commit() -> None:
            try:
                postgres_journal.commit(after, transition, iterations=iterations)
            except BaseException as exc:
                failures.append(exc)

        with admin.transaction():
            table_rows(
                admin, postgres_journal.schema, "SELECT 1 FROM runs WHERE run_id = 'r1' FOR UPDATE"
            )
            committer = threading.Thread(target=commit)
            committer.start()
            wait_until_waiting(admin, pid)
            postgres_server.terminate(pid)
        committer.join(timeout=30)
        assert failures == []
        assert postgres_journal.backend_pid != pid
        assert postgres_journal.load("r1") == after
        assert [t.seq for t in postgres_journal.transitions("r1")] == [0, 1]
        assert len(postgres_journal.iterations("r1")) == len(iterations)

    def test_a_commit_whose_answer_was_lost_is_not_done_twice(
        self, postgres_server, postgres_journal
    ):
        """The COMMIT went through but its answer never came back: the retry finds it stored."""
        run = start(postgres_journal)
        after, transition = next_step(run, "verifying")
        with PostgresJournal(postgres_server.url, schema=postgres_journal.schema) as twin:
            twin.commit(after, transition)  # what the cut-off try did on the server
        postgres_server.terminate(postgres_journal.backend_pid)
        postgres_journal.commit(after, transition)  # no RunConflictError: it is ours
        assert [t.seq for t in postgres_journal.transitions("r1")] == [0, 1]
        with pytest.raises(RunConflictError):  # on a sound connection a second commit is refused
            postgres_journal.commit(after, transition)

    def test_a_stale_writer_is_still_fenced_after_reconnecting(
        self, postgres_server, postgres_journal
    ):
        start(postgres_journal)
        mine = postgres_journal.claim("r1", "w1", ttl=-1)  # expires at once
        postgres_journal.claim("r1", "w2", ttl=60)  # taken over
        postgres_server.terminate(postgres_journal.backend_pid)
        with pytest.raises(LeaseLostError):
            postgres_journal.commit(*next_step(mine, "verifying"))
        assert [t.seq for t in postgres_journal.transitions("r1")] == [0]

    def test_an_engine_runs_through_lost_connections(self, postgres_server, postgres_journal):
        def building(ctx):
            postgres_server.terminate(postgres_journal.backend_pid)
            return NEXT

        engine = Engine(
            SPEC,
            handlers={"building": building, "verifying": lambda ctx: NEXT},
            journal=postgres_journal,
        )
        run_id = engine.start({"x": 1})
        final = engine.run(run_id)
        assert final.status is RunLifecycle.SUCCEEDED
        assert [t.seq for t in postgres_journal.transitions(run_id)] == list(range(final.seq + 1))

    def test_the_retry_budget_runs_out(self, postgres_server, postgres_schema, admin):
        role = f"fsm_test_{uuid.uuid4().hex[:8]}"
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("GRANT CREATE ON DATABASE test TO {}").format(sql.Identifier(role)))
        url = postgres_server.url.replace("://root@", f"://{role}:sekrit-pw@")
        try:
            journal = PostgresJournal(url, schema=postgres_schema, retry_for=0.5)
            start(journal)
            admin.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
            postgres_server.terminate(journal.backend_pid)
            began = time.monotonic()
            with pytest.raises(JournalError) as info:
                journal.load("r1")
            assert 0.4 < time.monotonic() - began < 10
            message = str(info.value)
            assert "could not get it back within 0.5 s" in message
            assert f"postgresql://{role}:***@" in message
            assert "sekrit" not in message
            admin.execute(sql.SQL("ALTER ROLE {} LOGIN").format(sql.Identifier(role)))
            assert journal.load("r1").run_id == "r1"  # and back again once the server is
            journal.close()
        finally:
            postgres_server.drop(postgres_schema)
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))

    def test_a_closed_journal_does_not_reconnect(self, postgres_journal):
        postgres_journal.close()
        with pytest.raises(JournalError, match="is closed"):
            postgres_journal.load("r1")


def wait_until_waiting(admin, pid: int | None, timeout: float = 10.0) -> None:
    """Until backend ``pid`` waits for a lock."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited for the lock")


class TestCli:
    """fsm-runner --journal postgresql://..."""

    def test_runs_and_show(self, postgres_server, postgres_journal):
        engine = Engine(
            SPEC,
            handlers={"building": lambda ctx: NEXT, "verifying": lambda ctx: NEXT},
            journal=postgres_journal,
        )
        run_id = engine.start(None)
        engine.run(run_id)
        url = url_with(postgres_journal.schema, postgres_server.url)
        runner = CliRunner()
        listed = runner.invoke(cli, ["--journal", url, "runs"])
        assert listed.exit_code == 0, listed.output
        assert run_id[:8] in listed.output
        shown = runner.invoke(cli, ["--journal", url, "show", run_id[:8]])
        assert shown.exit_code == 0, shown.output
        assert "done" in shown.output

    def test_a_schema_without_journal_is_not_created(self, postgres_server, postgres_schema, admin):
        result = CliRunner().invoke(
            cli, ["--journal", url_with(postgres_schema, postgres_server.url), "runs"]
        )
        assert result.exit_code != 0
        assert "holds no fsm_runner journal" in result.output
        assert (
            admin.execute(
                "SELECT 1 FROM pg_namespace WHERE nspname = %s", (postgres_schema,)
            ).fetchone()
            is None
        )

    @pytest.mark.parametrize(
        "url",
        [
            "postgresql://root:sekrit-pw@127.0.0.1:1/test",
            "postgresql://root:sekrit-pw@[127.0.0.1/test",
        ],
        ids=["unreachable", "malformed"],
    )
    def test_errors_are_one_line(self, url):
        result = subprocess.run(
            [sys.executable, "-m", "fsm_runner.cli", "--journal", url, "runs"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode != 0
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("Error: journal postgresql://root:***@")
        assert "sekrit" not in result.stderr
        assert "Traceback" not in result.stderr


class TestServerClock:
    """Leases are set and judged by the database server's clock, never a worker host's."""

    def test_an_expiry_is_the_servers_now_plus_ttl(self, postgres_journal, admin):
        start(postgres_journal)
        (before,) = admin.execute("SELECT clock_timestamp()").fetchone()
        run = postgres_journal.claim("r1", "w", ttl=30)
        (after,) = admin.execute("SELECT clock_timestamp()").fetchone()
        assert run.lease_expires_at is not None
        ttl = dt.timedelta(seconds=30)
        assert before + ttl <= run.lease_expires_at <= after + ttl
        later = postgres_journal.renew("r1", "w", run.lease_token, ttl=60)
        assert later > after + dt.timedelta(seconds=59)

    @pytest.mark.parametrize("skew", [dt.timedelta(hours=1), dt.timedelta(hours=-1)])
    def test_a_worker_whose_clock_is_off_neither_steals_nor_misses(
        self, postgres_journal, monkeypatch, skew
    ):
        """A host an hour ahead must not take live leases over; one behind must see dead ones."""
        import fsm_runner.journal._postgres_writes as module  # the PostgreSQL journal's writes
        import fsm_runner.records as records

        start(postgres_journal)
        start(postgres_journal, "r2")
        postgres_journal.claim("r1", "w1", ttl=60)  # live for a minute
        postgres_journal.claim("r2", "w1", ttl=-1)  # already expired
        skewed = lambda: dt.datetime.now(dt.timezone.utc) + skew  # noqa: E731
        monkeypatch.setattr(module, "utc_now", skewed)
        monkeypatch.setattr(records, "utc_now", skewed)
        with pytest.raises(LeaseHeldError):
            postgres_journal.claim("r1", "w2", ttl=60)
        assert [r.run_id for r in postgres_journal.runs(stale=True)] == ["r2"]
        taken = postgres_journal.claim("r2", "w2", ttl=60)
        assert (taken.lease_owner, taken.recoveries) == ("w2", 1)


class TestMoreLostConnections:
    """Group commits, leases and refusals across a lost connection."""

    def test_a_group_commit_after_a_lost_connection(self, postgres_server, postgres_journal):
        from fsm_runner.journal.base import Commit

        runs = [start(postgres_journal, f"r{n}") for n in range(3)]
        steps = [next_step(run, "verifying") for run in runs]
        stale = next_step(runs[2], "done")  # a second writer of r2 from the same seq
        postgres_server.terminate(postgres_journal.backend_pid)
        results = postgres_journal.commit_many([Commit(*step) for step in [*steps, stale]])
        assert results[:3] == [None, None, None]
        assert isinstance(results[3], RunConflictError)
        for run, (after, _) in zip(runs, steps, strict=True):
            assert postgres_journal.load(run.run_id) == after
            assert [t.seq for t in postgres_journal.transitions(run.run_id)] == [0, 1]

    def test_a_group_commit_whose_answer_was_lost(self, postgres_server, postgres_journal):
        from fsm_runner.journal.base import Commit

        runs = [start(postgres_journal, f"r{n}") for n in range(2)]
        steps = [next_step(run, "verifying") for run in runs]
        with PostgresJournal(postgres_server.url, schema=postgres_journal.schema) as twin:
            assert twin.commit_many([Commit(*steps[0])]) == [None]  # the cut-off try's half
        postgres_server.terminate(postgres_journal.backend_pid)
        assert postgres_journal.commit_many([Commit(*step) for step in steps]) == [None, None]
        for run in runs:
            assert [t.seq for t in postgres_journal.transitions(run.run_id)] == [0, 1]

    def test_leases_after_lost_connections(self, postgres_server, postgres_journal):
        start(postgres_journal)
        postgres_server.terminate(postgres_journal.backend_pid)
        claimed = postgres_journal.claim("r1", "w", ttl=60)
        assert (claimed.lease_owner, claimed.lease_token) == ("w", 1)
        postgres_server.terminate(postgres_journal.backend_pid)
        postgres_journal.renew("r1", "w", 1, ttl=60)
        postgres_server.terminate(postgres_journal.backend_pid)
        assert postgres_journal.release("r1", "w", 1) is True
        assert postgres_journal.load("r1").lease_owner is None
        postgres_server.terminate(postgres_journal.backend_pid)
        assert postgres_journal.claim_next("v", ttl=60, machine=SPEC.name, states=["building"])

    def test_a_refused_commit_inside_a_transaction_writes_nothing(self, postgres_journal, admin):
        """A transition already at that seq (the row was tampered with) refuses the commit."""
        run = start(postgres_journal)
        table_rows(
            admin,
            postgres_journal.schema,
            "INSERT INTO transitions (run_id, seq, event, to_state, at)"
            " VALUES ('r1', 1, 'X', 'elsewhere', now()) RETURNING 1",
        )
        after, transition = next_step(run, "verifying", iteration=1)
        with pytest.raises(RunConflictError):
            postgres_journal.commit(
                after, transition, iterations=[IterationRecord("r1", 1, state="verifying")]
            )
        assert postgres_journal.load("r1") == run
        assert postgres_journal.iterations("r1") == []


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("os").environ.get("FSM_RUNNER_TEST_POSTGRES_RESTART") != "1",
    reason="restarts the PostgreSQL server: set FSM_RUNNER_TEST_POSTGRES_RESTART=1",
)
def test_a_real_server_restart(postgres_server, postgres_journal):
    """Commits go on through `pg_ctlcluster restart`, gapless and without a duplicate."""
    run = start(postgres_journal)
    version = subprocess.run(
        ["ls", "/etc/postgresql"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    restarter = threading.Thread(
        target=subprocess.run,
        args=(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],),
        kwargs={"check": True},
    )
    restarter.start()
    while restarter.is_alive() or run.seq < 50:
        after, transition = next_step(run, "building")
        postgres_journal.commit(after, transition)
        run = after
    restarter.join()
    seqs = [t.seq for t in postgres_journal.transitions("r1")]
    assert seqs == list(range(run.seq + 1))
    assert postgres_journal.load("r1") == run
    assert postgres_journal.integrity_problems() == []
