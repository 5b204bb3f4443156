from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Bytecode is cached for the suite and every process it starts, whatever the environment says
# (PYTHONDONTWRITEBYTECODE): the suite starts hundreds of Pythons (the CLI, workers, apps),
# each of which would compile fsm_runner's modules again; and each xdist worker would rewrite
# and compile every test module again (5 s a worker). ~15 % of a process-heavy module's time.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from fsm_runner import MemoryJournal, SqliteJournal  # noqa: E402

#: The PostgreSQL database the postgres journal tests use (each test in a schema of its own).
POSTGRES_URL = os.environ.get(
    "FSM_RUNNER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test"
)


#: Test modules whose tests run one after another on one pytest-xdist worker (``--dist
#: loadgroup``) while the other workers run the rest: the ones that spawn many processes and
#: steer them by time (leases of a second or two, kills every 0.2 s), and the run inspector's
#: browser tests, whose PostgreSQL server must not see the server restart from another worker.
PROCESS_MODULES = frozenset(
    {
        "test_crash_torture.py",
        "test_postgres_workers.py",
        "test_race.py",
        "test_shared_file.py",
        "test_ui.py",
    }
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))
        if "browser" in getattr(item, "fixturenames", ()):  # chromium draws it: -m "not browser"
            item.add_marker(pytest.mark.browser)
    # The groups first: each is one unit of work for one worker (the process-heavy tests, the
    # browser modules: tens of seconds each), handed out in collection order; handed out last,
    # one of them kept a worker busy while the others had nothing left to run.
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


@pytest.hookimpl(trylast=True)  # after pytest-xdist named the groups
def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse to run a session whose groups do not hold (a pytest that pytest-xdist misreads).

    pytest-xdist's ``--dist loadgroup`` sends a group's tests to one worker by renaming each
    ``TEST@GROUP``; a pytest that ignores the new name (9.2 with pytest-xdist 3.8) spreads them
    over every worker, silently: module fixtures built once per worker, the process-heavy
    tests beside each other.
    """
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid
    ]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup does not group {lost[0]} (this pytest, "
            f"{pytest.__version__}, ignores its renaming); install the test extra's pytest"
        )


class SuiteLock:
    """Lets a test marked ``alone`` run while no other worker of the session runs a test.

    Under pytest-xdist every test holds a shared lock (``flock``) on a file of the session for
    its setup, call and teardown; an ``alone`` test holds it exclusively. A second file is the
    turnstile: a test takes it before the shared lock, so that once an ``alone`` test waits, no
    new test starts before it. In a single process tests run one at a time anyway: no locks.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.files: list[int] = []
        workerinput = getattr(config, "workerinput", None)
        if workerinput is not None:
            # Each worker's basetemp is a folder of the controller's, one per session.
            folder = Path(config.option.basetemp).parent
            self.files = [
                os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)
                for name in ("turnstile.lock", "suite.lock")
            ]

    @contextlib.contextmanager
    def held(self, *, alone: bool) -> Iterator[None]:
        if not self.files:
            yield
            return
        import fcntl

        turnstile, suite = self.files
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(suite, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(suite, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self.files:
            os.close(fd)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[SUITE_LOCK] = SuiteLock(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash[SUITE_LOCK].close()


SUITE_LOCK = pytest.StashKey[SuiteLock]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Setup, call and teardown (session fixtures' too) under the suite lock."""
    with item.config.stash[SUITE_LOCK].held(alone=item.get_closest_marker("alone") is not None):
        return (yield)


class PostgresServer:
    """The test database: hands out schemas, empties and drops them again.

    Each test that uses the ``journal`` fixture gets an empty journal in a schema no other test
    is using. A schema is emptied after its test and handed to the next one, instead of being
    created anew: creating one (tables, indexes) takes ~55 ms, emptying it and opening the
    journal again ~7 ms, which keeps the postgres leg of the suite short.
    """

    #: The journal's tables, children first (the foreign keys are enforced).
    TABLES = ("effects", "artifacts", "iterations", "transitions", "signals", "runs", "specs")
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
                        " WHERE schemaname = %s),"
                        # a search index (or its function) a test added: not handed on
                        " EXISTS (SELECT 1 FROM pg_proc WHERE pronamespace = %s::regnamespace)"
                    ).format(ident),
                    (schema, schema),
                ).fetchone()
                if (
                    found is None
                    or found[0] != str(SCHEMA_VERSION)
                    or found[1] != self.tables
                    or found[2]
                ):
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


@pytest.fixture(scope="session", autouse=True)
def lean_child_pytest():
    """Child ``pytest`` processes (the agent loop's verification level) load no installed plugins.

    The test environment installs hypothesis and anyio, whose pytest plugins a child pytest
    would load on start (0.7 s of CPU each time instead of 0.2 with bytecode cached, most of it
    importing hypothesis); the tiny test files the agent loop verifies use neither. The child is
    still a real pytest run. Set for the whole session, in the processes that run tests
    (each xdist worker has loaded its own plugins by then): every demo, guide session and inspector
    journal that verifies with pytest spawns such children, ~60 of them in a suite.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NO_PLUGIN_AUTOLOAD, "1")
        yield


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


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through Playwright's sync API, for one module's browser tests.

    Playwright's sync API runs an event loop of its own on the thread for as long as it lives:
    a second one beside it refuses to start, as does ``asyncio.run`` on that thread. So it lives
    as long as the module's tests (pytest tears a module's fixtures down before the next
    module's tests on the same worker), never beside another module's.
    """
    from playwright.sync_api import sync_playwright

    from tests.ui_helpers import CHROMIUM

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shared_page(browser):
    """One page, 1280 x 900, for a module's browser tests: each goes to the page it looks at.

    A context of its own for each test cost chromium half a CPU-second (its renderer processes),
    more than most tests; the inspector keeps nothing in the browser (no cookie, no storage) that
    one test could leave to the next. A test that needs another screen size or colour scheme sets
    it on this page and sets it back; one that needs another time zone or a permission makes a
    context of its own.
    """
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.dialogs = []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    yield page
    context.close()


@pytest.fixture
def page(shared_page):
    """The module's page, for one test: no script from run data may open a dialog in it."""
    shared_page.dialogs.clear()
    yield shared_page
    assert shared_page.dialogs == [], "a script from run data ran in the page"
