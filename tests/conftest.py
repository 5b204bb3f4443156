from __future__ import annotations

import os
import uuid

import pytest

from fsm_runner import MemoryJournal, SqliteJournal

#: The PostgreSQL database the postgres journal tests use (each test in a schema of its own).
POSTGRES_URL = os.environ.get(
    "FSM_RUNNER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test"
)


class PostgresServer:
    """The test database: hands out schemas, empties and drops them again.

    Each test that uses the ``journal`` fixture gets an empty journal in a schema no other test
    is using. A schema is emptied after its test and handed to the next one, instead of being
    created anew: creating one (tables, indexes) takes ~55 ms, emptying it and opening the
    journal again ~7 ms, which keeps the postgres leg of the suite short.
    """

    #: The journal's tables, children first (the foreign keys are enforced).
    TABLES = ("effects", "artifacts", "iterations", "transitions", "runs", "specs")
    tables = sorted([*TABLES, "meta"])

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = url
        self._admin = psycopg.connect(url, autocommit=True, connect_timeout=5)
        self._admin.execute("SET synchronous_commit TO off")  # test data need not survive a crash
        self.pool: list[str] = []
        self.made: set[str] = set()

    @property
    def admin(self):
        """A connection of the tests' own (a new one after the server restarted)."""
        import psycopg

        if not (self._admin.closed or self._admin.broken):
            try:  # a connection the server dropped is not marked broken until it is used
                self._admin.execute("SELECT 1")
            except psycopg.OperationalError:
                self._admin.close()
        if self._admin.closed or self._admin.broken:
            self._admin = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
            self._admin.execute("SET synchronous_commit TO off")
        return self._admin

    def new_schema(self) -> str:
        return f"fsm_test_{uuid.uuid4().hex[:16]}"

    def take(self) -> str:
        """An empty journal's schema: one emptied before, or a new name."""
        if self.pool:
            return self.pool.pop()
        schema = self.new_schema()
        self.made.add(schema)
        return schema

    def give_back(self, schema: str) -> None:
        """Empty a journal's tables for the next test, or drop the schema if it is not sound."""
        from psycopg import sql

        from fsm_runner.journal.postgres import SCHEMA_VERSION

        ident = sql.Identifier(schema)
        try:
            with self.admin.transaction():
                found = self.admin.execute(
                    sql.SQL(
                        "SELECT (SELECT value FROM {}.meta WHERE key = 'schema_version'),"
                        " (SELECT array_agg(tablename::text ORDER BY tablename) FROM pg_tables"
                        " WHERE schemaname = %s)"
                    ).format(ident),
                    (schema,),
                ).fetchone()
                if found is None or found[0] != str(SCHEMA_VERSION) or found[1] != self.tables:
                    raise LookupError(schema)
                self.admin.execute(
                    sql.SQL("; ").join(
                        sql.SQL("DELETE FROM {}.{}").format(ident, sql.Identifier(table))
                        for table in self.TABLES
                    )
                )
        except Exception:  # a test changed the schema itself: it is not handed on
            self.drop(schema)
            return
        self.pool.append(schema)

    def drop(self, schema: str) -> None:
        from psycopg import sql

        self.made.discard(schema)
        self.admin.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
        )

    def terminate(self, pid: int | None) -> None:
        """End a server backend, as a restart of the server would (from this other connection)."""
        assert pid is not None
        self.admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def close(self) -> None:
        for schema in list(self.made):
            self.drop(schema)
        self.admin.close()


@pytest.fixture(scope="session")
def postgres_server():
    """The test PostgreSQL server; unreachable fails the test unless FSM_RUNNER_TEST_POSTGRES=skip."""
    try:
        server = PostgresServer(POSTGRES_URL)
    except Exception as exc:
        if os.environ.get("FSM_RUNNER_TEST_POSTGRES") == "skip":
            pytest.skip(f"PostgreSQL at {POSTGRES_URL} is unreachable ({exc})")
        pytest.fail(
            f"PostgreSQL at {POSTGRES_URL} is unreachable ({exc}); start it, point "
            "FSM_RUNNER_TEST_POSTGRES_URL at one, or set FSM_RUNNER_TEST_POSTGRES=skip",
            pytrace=False,
        )
    yield server
    server.close()


@pytest.fixture
def postgres_schema(postgres_server):
    """A fresh PostgreSQL schema name, dropped (with all it holds) after the test."""
    schema = postgres_server.new_schema()
    yield schema
    postgres_server.drop(schema)


@pytest.fixture
def postgres_journal(postgres_server):
    """An empty PostgreSQL journal in a schema of its own (see :class:`PostgresServer`)."""
    from fsm_runner.journal.postgres import PostgresJournal

    schema = postgres_server.take()
    j = PostgresJournal(postgres_server.url, schema=schema)
    yield j
    j.close()
    postgres_server.give_back(schema)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def journal(request, tmp_path):
    """Every journal implementation, fresh for each test (SQLite in a real file, PostgreSQL in a
    schema of its own)."""
    if request.param == "postgres":
        j = request.getfixturevalue("postgres_journal")
    elif request.param == "memory":
        j = MemoryJournal()
    else:
        j = SqliteJournal(tmp_path / "journal.db")
    yield j
    j.close()


@pytest.fixture
def sqlite_journal(tmp_path):
    j = SqliteJournal(tmp_path / "journal.db")
    yield j
    j.close()


#: The environment variable that keeps a child ``pytest`` to its built-in plugins.
NO_PLUGIN_AUTOLOAD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"


@pytest.fixture
def lean_child_pytest(monkeypatch):
    """Child ``pytest`` processes (the agent loop's verification level) load no installed plugins.

    The test environment installs hypothesis and anyio, whose pytest plugins a child pytest
    would load on start (about a second of CPU each time, most of it importing hypothesis); the
    tiny test files the agent loop verifies use neither. The child is still a real pytest run.
    """
    monkeypatch.setenv(NO_PLUGIN_AUTOLOAD, "1")


@pytest.fixture
def in_tmp_path(tmp_path, monkeypatch):
    """Run in tmp_path: apps built by `--app` factories open ./fsm-runner.db, not in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def journal_path(tmp_path):
    """Where a CLI test's journal lives."""
    return tmp_path / "journal.db"


@pytest.fixture
def invoke(journal_path):
    """Run `fsm-runner --journal JOURNAL ARGS...` through click's CliRunner."""
    from click.testing import CliRunner

    from fsm_runner.cli import cli

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(cli, ["--journal", str(journal_path), *args], catch_exceptions=False)

    return invoke
