"""Search indexes: searches by a JSON value or a start time read an index (issue 32).

``journal.search_indexes`` adds, lists and drops the indexes named ``search:KEY`` on every
journal; a search finds the same runs with its index as without (every kind of JSON value, the
keyset pages of a time range); the SQL of a search names the index's expression, so the plans
read it: on SQLite no scan of ``run_rows``, on PostgreSQL an index scan of ``search:...``; a
PostgreSQL index decodes JSON that ``jsonb`` refuses as NULL instead of refusing the run's
start. ``fsm-runner index`` drives them from the command line.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3

import pytest
from click.testing import CliRunner
from psycopg import sql

from fsm_runner import Engine, MemoryJournal, PhaseResult, SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.exceptions import JournalError
from fsm_runner.journal import JsonMatch, RunSearch
from fsm_runner.journal.search import SearchKey
from tests.helpers import NEXT, two_phase_engine
from tests.test_postgres_scale import MODES, explain, fill, reads_of_runs
from tests.test_run_search import ORDERS, found
from tests.test_state_counts import sqlite_plans, unserved
from tests.test_ui_pages import waiting_spec

#: Every path the matches below read, and start times.
KEYS = ["input.order.id", "input.user", "input.order.lines[1]", "input.express", "input.note"]
MATCHES = [
    ("input.order.id = 42", [0, 2]),
    ('input.order.id = "42"', [1]),
    ("input.user = ada", [0, 2, 4]),
    ('input.order.lines[1] = "b"', [0]),
    ("input.express = true", [0]),
    ("input.express = 1", []),
    ("input.express = false", [1]),
    ("input.note = null", [2]),
]


@pytest.fixture
def runs(journal):
    with Engine(waiting_spec("orders"), handlers={}, journal=journal) as engine:
        return [engine.start(value) for value in ORDERS]


# -- keys ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "field", "path"),
    [
        ("created_at", "created_at", ()),
        ("input.order.id", "input", ("order", "id")),
        (" context.files[0].name ", "context", ("files", 0, "name")),
        ("input.null", "input", ("null",)),
    ],
)
def test_a_key_reads_back_as_written(text, field, path):
    key = SearchKey.parse(text)
    assert (key.field, key.path) == (field, path)
    assert SearchKey.parse(str(key)) == key
    assert key.index_name == f"search:{text.strip()}"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "input",
        "input.",
        "created_at.x",
        "output.a",
        "input.a b",
        "input['a']",
        "input." + "a" * 60,
    ],
)
def test_a_key_that_is_none_is_refused_with_one_line(text):
    with pytest.raises(ValueError, match=r"^(cannot index|a search index's key)") as caught:
        SearchKey.parse(text)
    assert "\n" not in str(caught.value)


def test_a_path_is_written_into_the_sql_safely():
    # A key named "null" must not become a NULL step of PostgreSQL's text[] path.
    key = SearchKey.parse("input.null[2]")
    assert key.postgres_expression("f") == """(f(input) #> '{"null","2"}'::text[])"""
    assert key.sqlite_expression() == """json_extract(input, '$."null"[2]')"""


# -- on every journal ----------------------------------------------------------------------------


def test_indexes_are_added_listed_and_dropped(journal):
    indexes = journal.search_indexes
    assert indexes.indexed() == []
    assert indexes.add("input.order.id") is True
    assert indexes.add(SearchKey.parse("input.order.id")) is False
    assert indexes.add("context.step") is True
    assert [str(key) for key in indexes.indexed()] == ["context.step", "input.order.id"]
    assert indexes.serves("input.order.id")
    # (a memory journal's searches read memory: every key is served)
    assert indexes.serves("input.user") is isinstance(journal, MemoryJournal)
    assert indexes.drop("input.order.id") is True
    assert indexes.drop("input.order.id") is False
    assert [str(key) for key in indexes.indexed()] == ["context.step"]


@pytest.mark.parametrize(("text", "indexes"), MATCHES)
def test_a_search_finds_the_same_runs_with_its_index(journal, runs, text, indexes):
    without = found(journal, text)
    for key in KEYS:
        journal.search_indexes.add(key)
    assert found(journal, text) == without == [runs[i] for i in reversed(indexes)]
    assert journal.count_runs(search=RunSearch(json=JsonMatch.parse(text))) == len(indexes)


def test_runs_step_and_end_under_indexes_of_their_context(journal):
    """A step rewrites the run's row, and the index of its context with it."""
    for key in ("context.n", "context.phase", "input.order.id"):
        journal.search_indexes.add(key)
    engine = two_phase_engine(
        journal,
        a=lambda _ctx: PhaseResult(NEXT, context={"n": 1, "phase": "a"}),
        b=lambda ctx: PhaseResult(NEXT, context={"n": ctx.context["n"] + 1, "phase": "b"}),
    )
    with engine:
        ran = engine.start({"order": {"id": 7}})
        engine.run(ran)
        waiting = engine.start({"order": {"id": 7}})
    assert found(journal, "context.n = 2") == [ran]
    assert found(journal, "context.phase = a") == []
    assert found(journal, "input.order.id = 7") == [waiting, ran]
    assert journal.load(ran).context == {"n": 2, "phase": "b"}


def test_a_time_range_pages_the_same_with_its_index(journal):
    with Engine(waiting_spec("orders"), handlers={}, journal=journal) as engine:
        ids = [engine.start({"n": n}) for n in range(9)]
    starts = sorted(journal.load(run_id).created_at for run_id in ids)
    search = RunSearch(created_from=starts[2], created_before=starts[7])

    def pages() -> list[list[str]]:
        listed, before = [], None
        while True:
            page = [r.run_id for r in journal.runs(search=search, limit=2, before=before)]
            if not page:
                return listed
            listed.append(page)
            before = page[-1]

    plain = pages()
    journal.search_indexes.add("created_at")
    indexed = pages()
    assert indexed == plain
    assert [run_id for page in indexed for run_id in page] == list(reversed(ids[2:7]))
    newer = journal.runs(search=search, limit=2, after=indexed[1][0])
    assert [r.run_id for r in newer] == indexed[0]


# -- the plans -----------------------------------------------------------------------------------


def test_sqlite_searches_read_their_indexes(sqlite_journal):
    with Engine(waiting_spec("orders"), handlers={}, journal=sqlite_journal) as engine:
        for value in ORDERS:
            engine.start(value)
    for key in [*KEYS, "created_at"]:
        sqlite_journal.search_indexes.add(key)
    week = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=7)
    last = sqlite_journal.runs(limit=1)[0].run_id

    def work() -> None:
        for text, _ in MATCHES:
            search = RunSearch(json=JsonMatch.parse(text))
            sqlite_journal.runs(search=search, limit=51)
            sqlite_journal.count_runs(search=search, at_most=10_001)
            sqlite_journal.runs(search=search, machine="orders", limit=51)
        for search in (
            RunSearch(created_from=week),
            RunSearch(created_before=week),
            RunSearch(created_from=week, created_before=week + dt.timedelta(days=1)),
        ):
            sqlite_journal.runs(search=search, limit=51)
            sqlite_journal.runs(search=search, limit=51, before=last)
            sqlite_journal.runs(search=search, limit=51, after=last)
            sqlite_journal.count_runs(search=search, at_most=10_001)

    plans = sqlite_plans(sqlite_journal, work)
    searches = [
        (s, p)
        for s, p in plans
        if "json_extract" in s or "created_at <" in s or "created_at >" in s
    ]
    assert len(searches) >= len(MATCHES) * 3 + 12
    for statement, plan in searches:
        assert not unserved(plan), (statement, plan)
        if "machine =" not in statement:  # (with it, the machine's index may be the one read)
            assert any("INDEX search:" in line for line in plan), (statement, plan)
        assert not any("TEMP B-TREE" in line for line in plan), (statement, plan)


@pytest.mark.parametrize("mode", MODES)
def test_postgres_searches_read_their_indexes(postgres_journal, postgres_server, mode):
    """On 20,000 ANALYZEd runs the planner itself picks the index, for a rare value.

    Without its statistics (``add`` runs ``ANALYZE``) it guessed 0.5 % of the runs match and
    walked the listing's order instead, decoding each run's JSON until the page was full.
    """
    admin, schema = postgres_server.admin, postgres_journal.schema
    fill(admin, schema, ended=20_000, waiting=0, leased=0)
    with admin.transaction():
        admin.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        admin.execute("UPDATE runs SET input = json_build_object('n', substr(run_id, 2)::int)")
    assert postgres_journal.search_indexes.add("input.n") is True
    stats = admin.execute(  # the expression's statistics, gathered by add (it ANALYZEs)
        "SELECT n_distinct FROM pg_stats WHERE schemaname = %s AND tablename = 'search:input.n'",
        (schema,),
    ).fetchall()
    assert stats == [(-1.0,)]  # every run's value its own
    condition, params = postgres_journal.search_indexes.json_match(JsonMatch.parse("input.n = 7"))
    for order in ("created_at DESC, run_id DESC", "run_id"):
        statement = f"SELECT run_id FROM runs WHERE {condition} ORDER BY {order} LIMIT 51"
        reads = reads_of_runs(explain(admin, schema, statement, params, mode))
        assert reads == [(reads[0][0], "search:input.n")], (statement, reads)
    assert [r.run_id for r in postgres_journal.runs(search=RunSearch(json=JsonMatch.parse(
        "input.n = 7")))] == ["e0000007"]  # fmt: skip


def test_a_postgres_index_takes_json_jsonb_refuses(postgres_journal):
    """``\\u0000`` is JSON, stored as text; ``jsonb`` refuses it: the index holds NULL.

    Built over such a run (by a scan of every run), and written for one started after.
    """
    with Engine(waiting_spec("orders"), handlers={}, journal=postgres_journal) as engine:
        before = engine.start({"note": "a\u0000b"})
        postgres_journal.search_indexes.add("input.note")
        after = engine.start({"note": "\u0000", "escaped": "\\u0000"})
        plain = engine.start({"note": "ab", "escaped": "\\u0000"})  # a backslash, then u0000
    assert found(postgres_journal, "input.note = ab") == [plain]
    assert postgres_journal.load(before).input == {"note": "a\u0000b"}
    assert postgres_journal.load(after).input["note"] == "\u0000"


# -- the command line ----------------------------------------------------------------------------


def test_the_cli_adds_lists_and_drops_them(tmp_path):
    path = str(tmp_path / "journal.db")
    SqliteJournal(path).close()

    def run(*args: str):
        return CliRunner().invoke(cli, ["--journal", path, "index", *args])

    assert run("list").output == "no search indexes\n"
    result = run("add", "input.order.id", "created_at")
    assert (result.exit_code, result.output) == (
        0,
        "input.order.id: indexed\ncreated_at: indexed\n",
    )
    assert run("add", "created_at").output == "created_at: already indexed\n"
    assert json.loads(run("list", "--json").output) == ["created_at", "input.order.id"]
    checked = CliRunner().invoke(cli, ["--journal", path, "check"])
    assert (checked.exit_code, checked.output.count("problem")) == (0, 1), checked.output
    assert run("drop", "created_at").output == "created_at: dropped\n"
    assert run("drop", "created_at").output == "created_at: no search index\n"
    refused = run("add", "input.ok", "output.x")
    assert refused.exit_code == 2
    assert "cannot index 'output.x'" in refused.output
    assert "Traceback" not in refused.output
    assert run("list").output == "input.order.id\n"  # nothing added from a refused line


def test_check_tells_a_search_index_from_one_made_by_hand(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        journal.search_indexes.add("input.x")
        assert journal.schema_problems() == []
    conn = sqlite3.connect(path)
    with conn:  # named as a search index, over another path: an index added by hand
        conn.execute("""CREATE INDEX "search:input.z" ON run_rows (json_extract(input, '$."y"'))""")
    conn.close()
    with SqliteJournal(path) as journal:
        assert journal.schema_problems() == [
            "schema: index search:input.z is not part of schema version 12"
        ]
        assert [str(key) for key in journal.search_indexes.indexed()] == ["input.x"]
        assert not journal.search_indexes.serves("input.z")
        with pytest.raises(JournalError, match=r"index named search:input.z that is not the"):
            journal.search_indexes.add("input.z")
        assert journal.search_indexes.drop("input.z") is True
        assert journal.search_indexes.add("input.z") is True
        assert journal.schema_problems() == []
