"""How many runs stand in each state, and which, from indexes (issue 32, schema 12 / PostgreSQL 10).

The machine page's counts (``Journal.run_counts``) and the listing by state (``runs(state=)``,
``count_runs(state=)``) read the ended runs' index and the claims' indexes instead of every run
through the ``runs`` view. Checked here against the plain answer (every run listed, then counted
in Python) on every journal, for runs of every kind those indexes tell apart: ready, parked with
a wake time, leased and stepped past their stored row (read from inside a phase, while the run's
worker holds it), and ended three ways; then the query plans: on SQLite no read of ``run_rows``
but through an index, on PostgreSQL (20,000 ANALYZEd runs, the planner's own choice) no Seq Scan.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections import Counter
from typing import Any

import attrs
import pytest

from fsm_runner import Engine, MachineSpec, PhaseStatus, State, Transition
from fsm_runner.records import utc_now
from tests.helpers import NEXT, list_pages_both_ways, undo_v12

SPEC = MachineSpec(
    "counted",
    [
        State("prepare", handler="prepare"),
        State("working", handler="working"),
        State("parked", handler="parked"),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ],
    [
        Transition("prepare", NEXT, "working"),
        Transition("working", NEXT, "parked"),
        Transition("parked", NEXT, "done"),
        Transition("*", "SYSTEM_ERROR", "failed"),
        Transition("*", "USER_ABORTED", "canceled"),
    ],
)
OTHER = MachineSpec(
    "other",
    [State("prepare", handler="prepare"), State("done", terminal=True)],
    [Transition("prepare", NEXT, "done")],
)
STATES = ("prepare", "working", "parked", "done", "failed", "canceled", "nowhere")


def plain_counts(journal, machine: str) -> dict[tuple[str, str], int]:
    """Every run of ``machine`` listed, then counted here."""
    return dict(Counter((r.state, r.status.value) for r in journal.runs(machine=machine)))


def plain_ids(journal, state: str) -> list[str]:
    return [r.run_id for r in journal.runs() if r.state == state]


class Seen:
    """What the journal answered while one run was leased and stepped past its stored row."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] | None = None
        self.plain: dict[tuple[str, str], int] | None = None
        self.by_state: dict[str, list[str]] = {}
        self.plain_by_state: dict[str, list[str]] = {}


def fill(journal) -> Seen:
    """Runs of each kind; the answers read while the last one is held, from its third phase."""
    seen = Seen()

    def parked(ctx: Any) -> str:
        if ctx.input.get("look"):  # leased, at seq 2: its stored row still says "prepare"
            seen.counts = journal.run_counts(machine=SPEC.name)
            seen.plain = plain_counts(journal, SPEC.name)
            seen.by_state = {s: [r.run_id for r in journal.runs(state=s)] for s in STATES}
            seen.plain_by_state = {s: plain_ids(journal, s) for s in STATES}
            return NEXT
        ctx.sleep_until(utc_now() + dt.timedelta(days=1))
        return NEXT

    def failing(_ctx: Any) -> PhaseStatus:
        raise RuntimeError("a failed run")

    handlers = {"prepare": lambda _ctx: NEXT, "working": lambda _ctx: NEXT, "parked": parked}
    engine = Engine(SPEC, handlers=handlers, journal=journal)
    engine.start({})  # ready, in its first state
    engine.run(engine.start({}), max_steps=1)  # ready, in its second
    engine.run(engine.start({}))  # parked with a wake time, in its third
    engine.run(engine.start({"look": 1}), max_steps=0)  # started, then...
    Engine(SPEC, handlers={**handlers, "prepare": failing}, journal=journal).run(
        engine.start({})
    )  # failed
    engine.abort(engine.start({}), reason="not wanted")  # canceled
    other = Engine(OTHER, handlers={"prepare": lambda _ctx: NEXT}, journal=journal)
    other.run(other.start({}))
    other.start({})
    looked = next(r for r in journal.runs(machine=SPEC.name) if r.input.get("look"))
    engine.run(looked.run_id)  # ... held: the phase "parked" reads the journal
    return seen


def test_counts_and_listings_by_state_are_every_runs(journal):
    seen = fill(journal)
    assert seen.counts == seen.plain, "while a run was held past its stored row"
    assert seen.by_state == seen.plain_by_state
    assert seen.counts[("parked", "active")] == 2  # the held run and the one parked
    for machine in (SPEC.name, OTHER.name, "no-such-machine"):
        assert journal.run_counts(machine=machine) == plain_counts(journal, machine)
    assert journal.run_counts(machine=SPEC.name) == {
        ("prepare", "active"): 1,
        ("working", "active"): 1,
        ("parked", "active"): 1,
        ("done", "succeeded"): 1,
        ("failed", "failed"): 1,
        ("canceled", "aborted"): 1,
    }
    for state in STATES:
        ids = plain_ids(journal, state)
        assert [r.run_id for r in journal.runs(state=state)] == ids, state
        assert journal.count_runs(state=state) == len(ids)
        for status in ("active", "succeeded"):
            both = [r.run_id for r in journal.runs(state=state, status=status)]
            assert both == [r for r in ids if journal.load(r).status.value == status]
        mine = [r.run_id for r in journal.runs(state=state, machine=OTHER.name)]
        assert mine == [r for r in ids if journal.load(r).machine == OTHER.name]
    page = journal.runs(state="done", limit=1)
    assert [r.run_id for r in journal.runs(state="done", before=page[0].run_id)] == (
        plain_ids(journal, "done")[1:]
    )


@pytest.mark.parametrize("window", [1, 2, 5, 40])
def test_sqlite_reads_the_newest_keys_first_and_finds_the_same(sqlite_journal, window):
    """A listing by state or active status tries the newest keys first (``newest_window``).

    Whatever the window, every page (both ways) and every capped count is the plain one: a
    window that holds less than a page, or fewer runs than the cap, is read again whole.
    """
    fill(sqlite_journal)
    every = [{}, {"machine": SPEC.name}, {"machine": OTHER.name}]
    asked = [{"state": s, **m} for s in STATES for m in every]
    asked += [{"status": "active", **m} for m in every] + [{"status": "active", "state": "working"}]

    def pages(filters) -> list[list[str]]:
        listed, before = [], None
        while page := [r.run_id for r in sqlite_journal.runs(limit=2, before=before, **filters)]:
            listed.append(page)
            before = page[-1]
        return listed

    def seen() -> list[Any]:
        return [
            (pages(f), [sqlite_journal.count_runs(at_most=n, **f) for n in (1, 2, 3, 100)])
            for f in asked
        ]

    plain = seen()
    core = sqlite_journal._core
    assert core.dialect.newest_window > 0  # the journal's own: many runs for one window here
    core.dialect = attrs.evolve(core.dialect, newest_window=window)
    assert seen() == plain
    assert any(listed for listed, _ in plain)


# --- the plans -----------------------------------------------------------------------------


def sqlite_plans(journal, work) -> list[tuple[str, list[str]]]:
    """Each SELECT ``work`` ran on the journal's connection, with its query plan."""
    statements: list[str] = []
    with journal._connections.read() as conn:
        conn.set_trace_callback(statements.append)
    try:
        work()
    finally:
        with journal._connections.read() as conn:
            conn.set_trace_callback(None)
    plans = []
    probe = sqlite3.connect(journal.path)
    try:
        for statement in statements:
            if statement.lstrip().upper().startswith(("SELECT", "WITH")):
                plan = [str(r[3]) for r in probe.execute(f"EXPLAIN QUERY PLAN {statement}")]
                plans.append((statement, plan))
    finally:
        probe.close()
    return plans


#: A read of the run rows' table that no index serves: every run read.
def unserved(plan: list[str]) -> list[str]:
    return [line for line in plan if line in ("SCAN run_rows", "SCAN r", "SCAN runs")]


def test_sqlite_reads_by_state_and_counts_are_index_served(sqlite_journal):
    fill(sqlite_journal)
    middle = sqlite_journal.runs(limit=51)[-1].run_id  # (the newest page: the table's own order)

    def work() -> None:
        sqlite_journal.run_counts(machine=SPEC.name)
        for state in STATES:
            sqlite_journal.runs(state=state, limit=51)
            sqlite_journal.count_runs(state=state, at_most=10_001)
            sqlite_journal.runs(state=state, machine=SPEC.name, limit=51)
        for status in ("active", "failed"):
            sqlite_journal.runs(status=status, limit=51)
            sqlite_journal.count_runs(status=status, at_most=10_001)
        sqlite_journal.runs(machine=SPEC.name, limit=51)
        sqlite_journal.count_runs(machine=SPEC.name, at_most=10_001)
        sqlite_journal.runs(parent_run_id="some-parent", limit=51)
        sqlite_journal.runs(run_id_prefix="ab", limit=51)
        sqlite_journal.count_runs(run_id_prefix="ab", at_most=10_001)
        list_pages_both_ways(sqlite_journal, middle, state="working", machine=SPEC.name)
        # (Not here: a search by a value in the input or context, or by start time, reads the
        # runs newest first until a page is full: no index holds every JSON path, and none of
        # start times is written a start. bench_ui.py --scale measures them on 1,000,000 runs.)

    plans = sqlite_plans(sqlite_journal, work)
    assert len(plans) >= 45
    for statement, plan in plans:
        assert not unserved(plan), (statement, plan)
    counts = [
        plan for statement, plan in plans if "count(*)" in statement and "GROUP BY" in statement
    ]
    assert any(
        "USING COVERING INDEX idx_run_rows_outcomes (machine=?)" in line for line in counts[0]
    )


def test_a_version_11_journal_gets_the_index_and_the_same_answers(tmp_path):
    from fsm_runner import SqliteJournal

    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        fill(journal)
        before = {m: journal.run_counts(machine=m) for m in (SPEC.name, OTHER.name)}
    conn = sqlite3.connect(path, isolation_level=None)
    undo_v12(conn)
    conn.close()
    with SqliteJournal(path) as journal:
        assert journal.meta()["schema_version"] == "12"
        assert journal.schema_problems() == []
        assert {m: journal.run_counts(machine=m) for m in before} == before
