"""A million runs, flat (issue 28), on PostgreSQL: claim and prune read index ranges only.

Migration 7 keeps what a claim and a prune search in the run row (``ready_state``, ``ended_at``,
generated columns) under partial indexes; these tests check, with ``EXPLAIN`` on a table big
enough (and ``ANALYZE``d) for the planner to choose by real statistics, that the claim's search
and prune's selection never scan ``runs``; that the migration gets there from every older
version; that claims still see every runnable run and only those; that a prune deletes in
batches, each its own transaction, beside a writer that is never held up; and that a step of a
leased run stays a HOT update (it writes no index of ``runs``). Migration 8's ``runs_due``
(durable waits) is checked alike: the claim's due range and ``next_wake`` read it.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg import sql

from fsm_runner import PostgresJournal, RunEvent, RunLifecycle, RunRecord, TransitionRecord
from fsm_runner.journal import RunSearch
from fsm_runner.journal._postgres_claims import claim_next_query
from fsm_runner.journal._postgres_schema import MIGRATIONS, SCHEMA_VERSION
from fsm_runner.journal._postgres_waits import NEXT_WAKE
from fsm_runner.journal._postgres_writes import _BEFORE_ALL, _PRUNABLE
from fsm_runner.journal.base import Commit
from fsm_runner.records import SignalRecord
from tests.helpers import list_pages_both_ways
from tests.test_postgres_journal import SPEC, T0, next_step, table_rows

HANDLED = ["building", "verifying"]  # the states with a handler: what a worker claims
LONG_AGO = T0 - dt.timedelta(days=30)
FAR_AHEAD = dt.datetime(2999, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture
def admin(postgres_server):
    """A connection of the test's own, beside the journal's."""
    return postgres_server.admin


def start(
    journal, run_id: str, *, state: str = "building", created: float = 0, parent: str | None = None
) -> RunRecord:
    when = T0 + dt.timedelta(seconds=created)
    run = RunRecord(
        run_id,
        SPEC.name,
        SPEC.spec_hash,
        state,
        created_at=when,
        updated_at=when,
        parent_run_id=parent,
    )
    first = TransitionRecord(run_id, 0, None, RunEvent.STARTED.value, state, at=when)
    journal.create_run(run, first, spec_json=SPEC.to_json())
    return run


def end(journal, run_id: str) -> RunRecord:
    """Commit the run (as it is stored, under its token) to ``done``."""
    run = journal.load(run_id)
    journal.commit(*next_step(run, "done", status=RunLifecycle.SUCCEEDED))
    return journal.load(run_id)


def heads(admin, schema: str) -> dict[str, tuple[Any, Any]]:
    """Each run's ``(ready_state, ended_at)``."""
    rows = table_rows(admin, schema, "SELECT run_id, ready_state, ended_at FROM runs")
    return {row[0]: (row[1], row[2]) for row in rows}


def claim(journal, owner: str = "w1") -> RunRecord | None:
    return journal.claim_next(owner, ttl=60, machine=SPEC.name, states=HANDLED)


def fill(admin, schema: str, *, ended: int, waiting: int, leased: int, ready: int = 0) -> None:
    """Runs written straight into the tables (with one transition each), then ``ANALYZE``d.

    ``ended`` runs ended at T0 (ids ``e…``), oldest first; ``waiting`` active unleased runs in a
    state without a handler, parked until a day from now (``w…``); ``leased`` active runs leased for a day (``l…``);
    ``ready`` active unleased runs in a handled state (``r…``), created after all the others.
    """
    groups = (
        ("e", ended, "done", "succeeded", False),
        ("w", waiting, "waiting", "active", False),
        ("l", leased, "building", "active", True),
        ("r", ready, "building", "active", False),
    )
    with admin.transaction():
        admin.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        admin.execute(
            "INSERT INTO specs VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (SPEC.spec_hash, SPEC.name, SPEC.to_json(), T0),
        )
        offset = 0
        for prefix, count, state, status, leased_ in groups:
            admin.execute(
                "INSERT INTO runs (run_id, machine, spec_hash, state, status, seq, created_at,"
                " updated_at, lease_owner, lease_expires_at, lease_token, wake_at)"
                " SELECT %s || lpad(i::text, 7, '0'), %s, %s, %s, %s, 0,"
                " %s + (i + %s) * interval '1 millisecond', %s + i * interval '1 millisecond',"
                " CASE WHEN %s THEN 'holder' END,"
                " CASE WHEN %s THEN clock_timestamp() + interval '1 day' END,"
                " CASE WHEN %s THEN 1 ELSE 0 END,"
                " CASE WHEN %s THEN clock_timestamp() + interval '1 day' + i * interval '1 ms' END"
                " FROM generate_series(1, %s) AS i",
                (prefix, SPEC.name, SPEC.spec_hash, state, status, LONG_AGO, offset, T0)
                + (leased_,) * 3
                + (prefix == "w", count),
            )
            admin.execute(
                "INSERT INTO transitions (run_id, seq, from_state, event, to_state, at)"
                " SELECT run_id, 0, NULL, 'STARTED', state, created_at FROM runs"
                " WHERE run_id LIKE %s",
                (prefix + "%",),
            )
            offset += count
        admin.execute("ANALYZE runs")
        admin.execute("ANALYZE transitions")


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from plan_nodes(child)


def explain(admin, schema: str, statement: str, params, mode: str) -> list[dict[str, Any]]:
    """The plan's nodes (``EXPLAIN (FORMAT JSON)``: planned, not run) as a prepared statement.

    ``mode``: ``force_custom_plan`` (planned for these values) or ``force_generic_plan`` (for
    any values: what PostgreSQL may settle on once psycopg prepares a statement run often).
    """
    parts = statement.split("%s")
    numbered = parts[0] + "".join(f"${n}{part}" for n, part in enumerate(parts[1:], start=1))
    values = sql.SQL(", ").join(sql.Literal(value) for value in params)
    with admin.cursor() as cursor:
        cursor.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        cursor.execute("SELECT set_config('plan_cache_mode', %s, false)", (mode,))
        cursor.execute(f"PREPARE scale_probe AS {numbered}")
        try:
            found = cursor.execute(
                sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE scale_probe ({})").format(values)
            ).fetchone()
        finally:
            cursor.execute("DEALLOCATE scale_probe")
            cursor.execute("RESET plan_cache_mode")
            cursor.execute("SET search_path TO DEFAULT")
    assert found is not None
    return list(plan_nodes(found[0][0]["Plan"]))


def reads_of_runs(nodes: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """How each plan node that reads ``runs`` reads it: ``(node type, index name)``.

    A bitmap heap scan is named by the index its bitmap index scan reads.
    """
    reads = []
    for node in nodes:
        if node.get("Relation Name") != "runs" or node["Node Type"] == "ModifyTable":
            continue
        if node["Node Type"] == "Bitmap Heap Scan":
            reads += [
                ("Bitmap Heap Scan", below["Index Name"])
                for below in plan_nodes(node)
                if below["Node Type"] == "Bitmap Index Scan"
            ]
        else:
            reads.append((node["Node Type"], node.get("Index Name")))
    return reads


MODES = ["force_custom_plan", "force_generic_plan"]


@pytest.fixture(scope="module")
def big(postgres_server):
    """One journal of 20,000 runs for :class:`TestIndexServed` (its tests only read and plan)."""
    from fsm_runner.journal.postgres import PostgresJournal

    schema = postgres_server.take()
    journal = PostgresJournal(postgres_server.url, schema=schema)
    fill(postgres_server.admin, schema, ended=19_000, waiting=500, leased=500)
    yield journal
    journal.close()
    postgres_server.give_back(schema)


class TestIndexServed:
    """On 20,000 ANALYZEd runs the planner itself picks the indexes: no Seq Scan of runs.

    Checked for the plan made for the values given and for the generic plan (any values),
    which PostgreSQL may use once psycopg prepares a statement it runs often.
    """

    @pytest.mark.parametrize("mode", MODES)
    def test_the_claim_search_reads_three_partial_indexes(self, big, admin, mode):
        now = table_rows(admin, big.schema, "SELECT clock_timestamp()")[0][0]
        for spec_hash in (None, SPEC.spec_hash):
            statement, params = claim_next_query(
                machine=SPEC.name,
                states=HANDLED,
                spec_hash=spec_hash,
                now=now,
                owner="w1",
                expires=now,
            )
            nodes = explain(admin, big.schema, statement, params, mode)
            reads = reads_of_runs(nodes)
            assert all(kind != "Seq Scan" for kind, _ in reads), reads
            indexes = {index for _, index in reads}
            assert (
                {"runs_ready", "runs_leased", "runs_due"}
                <= indexes
                <= {"runs_ready", "runs_leased", "runs_due", "runs_pkey"}
            ), reads
            due = [node for node in nodes if node.get("Index Name") == "runs_due"]
            assert all("wake_at <=" in node.get("Index Cond", "") for node in due), due

    @pytest.mark.parametrize("mode", MODES)
    def test_next_wake_reads_the_due_index_and_the_leased_one(self, big, admin, mode):
        nodes = explain(admin, big.schema, NEXT_WAKE, (SPEC.name, SPEC.name), mode)
        reads = reads_of_runs(nodes)
        assert {index for _, index in reads} == {"runs_due", "runs_leased"}, reads
        assert all(kind in ("Index Scan", "Index Only Scan") for kind, _ in reads), reads
        limits = [node for node in nodes if node["Node Type"] == "Limit"]
        assert len(limits) >= 1, nodes  # min() as the first entry of the due range
        assert big.next_wake(machine=SPEC.name) is not None

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("cutoff", [LONG_AGO + dt.timedelta(seconds=1), T0 + dt.timedelta(1)])
    def test_prune_selects_on_the_ended_index(self, big, admin, cutoff, mode):
        # A cutoff few runs fall under, and one all 19,000 ended runs do (one batch of 1,000)
        params = (cutoff, _BEFORE_ALL, 0, 1000)
        for lock in ("", " FOR UPDATE OF r"):
            reads = reads_of_runs(explain(admin, big.schema, _PRUNABLE + lock, params, mode))
            assert all(kind != "Seq Scan" for kind, _ in reads), reads
            assert {index for _, index in reads} == {"runs_ended", "runs_parent_run_id"}, reads

    @pytest.mark.parametrize("mode", MODES)
    def test_counts_and_listings_by_state_read_indexes(self, big, admin, mode, monkeypatch):
        # The machine page's counts and the runs list by state (issue 32): the ended runs'
        # index and the claims', never every run.
        statements: list[tuple[str, list[Any]]] = []
        select = big._core._select

        def recorded(query: str, params: Any = (), **options: Any) -> Any:
            statements.append((query, list(params)))
            return select(query, params, **options)

        monkeypatch.setattr(big._core, "_select", recorded)
        assert big.run_counts(machine=SPEC.name) == {
            ("done", "succeeded"): 19_000,
            ("waiting", "active"): 500,
            ("building", "active"): 500,
        }
        for state in ("done", "building", "nowhere"):
            big.runs(state=state, limit=51)
            big.count_runs(state=state, at_most=10_001)
            big.runs(state=state, machine=SPEC.name, limit=51)
        assert len(statements) == 10
        big.runs(machine=SPEC.name, limit=51)  # the other filters: whatever their values
        big.runs(status="failed", limit=51)
        big.runs(run_id_prefix="w00", limit=51)
        big.runs(parent_run_id="p1", limit=51)
        big.runs(search=RunSearch(created_from=T0), limit=51)
        # A state few runs stand in: the planner's own choice reads indexes only. (A generic
        # plan cannot know the state, and expects as many runs as the commonest one holds: it
        # is not chosen while it costs more than the plans made for the values given.)
        for statement, params in statements[7:] if mode == "force_custom_plan" else ():
            reads = reads_of_runs(explain(admin, big.schema, statement, params, mode))
            assert reads, statement
            assert all(kind != "Seq Scan" for kind, _ in reads), (statement, reads)
        middle = big.runs(limit=51)[-1].run_id  # then its list's pages both ways, and sorted
        list_pages_both_ways(big, middle, state="building", machine=SPEC.name)
        assert len(statements) == 15 + 1 + 14
        # Every one, counts included, can be read from indexes alone. (Where nearly every run
        # counts, as this machine's 19,000 ended runs of 20,000, the planner itself may read
        # the table whole instead: cheaper then than any index.)
        admin.execute("SET enable_seqscan = off")
        try:
            plans = [reads_of_runs(explain(admin, big.schema, *s, mode)) for s in statements]
        finally:
            admin.execute("RESET enable_seqscan")
        for (statement, _), reads in zip(statements, plans, strict=True):
            assert reads, statement
            assert all(kind != "Seq Scan" for kind, _ in reads), (statement, reads)
        assert {index for _, index in plans[0]} == {
            "runs_outcomes", "runs_ready", "runs_due", "runs_leased"
        }, plans[0]  # fmt: skip

    def test_the_idle_claim_and_the_dry_run_find_nothing(self, big):
        assert claim(big) is None
        report = big.prune(ended_before=LONG_AGO, dry_run=True)
        assert report.run_ids == ()


#: The indexes of ``runs`` at schema version 10.
ALL_INDEXES = {
    "runs_pkey",
    "runs_rowid_key",
    "runs_machine_created_at",
    "runs_status_created_at",
    "runs_created_at",
    "runs_parent_run_id",
    "runs_status_machine_created_at",
    "runs_ready",
    "runs_leased",
    "runs_ended",
    "runs_spec_hash",
    "runs_due",
    "runs_outcomes",
}


def runs_indexes(admin, schema: str) -> list[str]:
    rows = admin.execute(
        "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = 'runs'", (schema,)
    )
    return [row[0] for row in rows]


def runs_options(admin, schema: str) -> list[str] | None:
    row = admin.execute(
        "SELECT c.reloptions FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = 'runs'",
        (schema,),
    ).fetchone()
    return row[0]


def test_a_new_journal_has_the_indexes_and_fillfactor_of_its_version(postgres_journal, admin):
    assert set(runs_indexes(admin, postgres_journal.schema)) == ALL_INDEXES
    assert runs_options(admin, postgres_journal.schema) == ["fillfactor=50"]
    (definition,) = admin.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
        (postgres_journal.schema, "runs_parent_run_id"),
    ).fetchone()
    assert definition.endswith("WHERE (parent_run_id IS NOT NULL)")  # schema 11


@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION))
def test_every_older_journal_is_migrated(postgres_server, postgres_schema, admin, version):
    # A journal as an fsm_runner of that version left it: runs of each kind a claim and a
    # prune tell apart, written with the columns every version has.
    runs = (  # run_id, state, status, lease owner, updated at
        ("ready", "building", "active", None, T0),
        ("waiting", "waiting", "active", None, T0),
        ("leased", "verifying", "active", "w0", T0),
        ("ended", "done", "succeeded", None, LONG_AGO),
    )
    with admin.transaction():
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(postgres_schema)))
        admin.execute(
            sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(postgres_schema))
        )
        admin.execute("".join(text for number, _, text in MIGRATIONS if number <= version))
        admin.execute(
            "INSERT INTO specs VALUES (%s, %s, %s, %s)",
            (SPEC.spec_hash, SPEC.name, SPEC.to_json(), T0),
        )
        for created, (run_id, state, status, owner, updated) in enumerate(runs):
            created_at = LONG_AGO + dt.timedelta(seconds=created)
            expiry = None if owner is None else FAR_AHEAD
            admin.execute(
                "INSERT INTO runs (run_id, machine, spec_hash, state, status, seq, created_at,"
                " updated_at, lease_owner, lease_expires_at, context)"
                " VALUES (%s, %s, %s, %s, %s, 0, %s, %s, %s, %s, '{}')",
                (
                    run_id,
                    SPEC.name,
                    SPEC.spec_hash,
                    state,
                    status,
                    created_at,
                    updated,
                    owner,
                    expiry,
                ),
            )
            admin.execute(
                "INSERT INTO transitions (run_id, seq, from_state, event, to_state, at)"
                " VALUES (%s, 0, NULL, 'STARTED', %s, %s)",
                (run_id, state, updated),
            )
    with PostgresJournal(postgres_server.url, schema=postgres_schema) as journal:
        assert journal.meta()["schema_version"] == str(SCHEMA_VERSION)
        assert set(runs_indexes(admin, postgres_schema)) == ALL_INDEXES
        assert runs_options(admin, postgres_schema) == ["fillfactor=50"]
        assert heads(admin, postgres_schema) == {
            "ready": ("building", None),
            "waiting": ("waiting", None),
            "leased": (None, None),
            "ended": (None, LONG_AGO),
        }
        cutoff = T0 - dt.timedelta(days=1)
        assert journal.prune(ended_before=cutoff, dry_run=True).run_ids == ("ended",)
        claimed = claim(journal)
        assert claimed is not None
        assert claimed.run_id == "ready"
        assert claim(journal) is None  # the waiting run is not runnable, the leased one is held
        report = journal.prune(ended_before=cutoff)
        assert (report.run_ids, report.transitions) == (("ended",), 1)
        assert sorted(heads(admin, postgres_schema)) == ["leased", "ready", "waiting"]
        # Version 8: no run has a wake time yet; a signal makes the waiting run due.
        assert [journal.wake_time(run_id) for run_id in ("ready", "waiting", "leased")] == [
            None
        ] * 3
        assert journal.next_wake(machine=SPEC.name) is None
        sent = journal.put_signal(SignalRecord("waiting", 0, "APPROVED", {"ok": True}, "s1"))
        assert journal.signals("waiting") == [sent]
        assert journal.wake_time("waiting") == sent.received_at
        due = claim(journal)
        assert due is not None
        assert due.run_id == "waiting"


class TestClaims:
    """Claims see every runnable run, and only those, through the kept ``ready_state``."""

    def test_a_waiting_run_is_never_claimed(self, postgres_journal, admin):
        start(postgres_journal, "waits", state="waiting")
        assert claim(postgres_journal) is None
        assert heads(admin, postgres_journal.schema)["waits"] == ("waiting", None)

    def test_the_oldest_runnable_run_is_claimed_whatever_its_state(self, postgres_journal):
        start(postgres_journal, "b", state="verifying", created=1)
        start(postgres_journal, "c", state="building", created=2)
        start(postgres_journal, "a", state="building", created=3)
        assert [getattr(claim(postgres_journal), "run_id", None) for _ in range(4)] == [
            "b",
            "c",
            "a",
            None,
        ]

    def test_an_expired_lease_is_taken_over(self, postgres_journal, admin):
        start(postgres_journal, "held")
        first = claim(postgres_journal, "w1")
        assert first is not None
        assert heads(admin, postgres_journal.schema)["held"] == (None, None)
        assert claim(postgres_journal, "w2") is None  # held, not expired
        table_rows(
            admin,
            postgres_journal.schema,
            "UPDATE runs SET lease_expires_at = clock_timestamp() - interval '1 minute'"
            " RETURNING run_id",
        )
        taken = claim(postgres_journal, "w2")
        assert taken is not None
        assert (taken.run_id, taken.lease_owner) == ("held", "w2")
        assert (taken.lease_token, taken.recoveries) == (first.lease_token + 1, 1)

    def test_an_expired_lease_and_a_free_run_are_taken_oldest_first(self, postgres_journal, admin):
        start(postgres_journal, "old", created=0)
        start(postgres_journal, "waits", state="waiting", created=1)
        start(postgres_journal, "young", state="verifying", created=2)
        for run_id in ("old", "waits"):
            postgres_journal.claim(run_id, "w0", ttl=60)
        table_rows(
            admin,
            postgres_journal.schema,
            "UPDATE runs SET lease_expires_at = clock_timestamp() - interval '1 minute'"
            " RETURNING run_id",
        )
        taken = [claim(postgres_journal, "w1") for _ in range(3)]
        assert [getattr(run, "run_id", None) for run in taken] == ["old", "young", None]
        assert [getattr(run, "recoveries", None) for run in taken[:2]] == [1, 0]
        assert postgres_journal.load("waits").lease_owner == "w0"  # expired, but waiting

    def test_the_spec_filter_applies_to_both_halves(self, postgres_journal, admin):
        start(postgres_journal, "free")
        start(postgres_journal, "held", created=1)
        postgres_journal.claim("held", "w0", ttl=60)
        table_rows(
            admin,
            postgres_journal.schema,
            "UPDATE runs SET lease_expires_at = clock_timestamp() - interval '1 minute'"
            " WHERE run_id = 'held' RETURNING run_id",
        )
        other = "0" * 64
        for spec_hash, found in ((other, None), (SPEC.spec_hash, "free")):
            run = postgres_journal.claim_next(
                "w1", ttl=60, machine=SPEC.name, states=HANDLED, spec_hash=spec_hash
            )
            assert getattr(run, "run_id", None) == found
        again = postgres_journal.claim_next(
            "w1", ttl=60, machine=SPEC.name, states=HANDLED, spec_hash=SPEC.spec_hash
        )
        assert getattr(again, "run_id", None) == "held"

    def test_a_released_run_is_claimable_again(self, postgres_journal, admin):
        start(postgres_journal, "r")
        run = claim(postgres_journal)
        assert run is not None
        assert postgres_journal.release("r", "w1", run.lease_token)
        assert heads(admin, postgres_journal.schema)["r"] == ("building", None)
        again = claim(postgres_journal, "w2")
        assert again is not None
        assert (again.run_id, again.lease_token, again.recoveries) == ("r", 2, 0)

    def test_release_many_makes_runs_claimable_again(self, postgres_journal):
        for n in range(3):
            start(postgres_journal, f"r{n}", created=n)
        held = [claim(postgres_journal) for _ in range(3)]
        postgres_journal.release_many([(run.run_id, run.lease_token) for run in held], "w1")
        assert [getattr(claim(postgres_journal), "run_id", None) for _ in range(4)] == [
            "r0",
            "r1",
            "r2",
            None,
        ]

    def test_an_unleased_run_committed_to_a_waiting_state_stops_being_claimable(
        self, postgres_journal, admin
    ):
        run = start(postgres_journal, "moves")
        postgres_journal.commit(*next_step(run, "waiting"))
        assert heads(admin, postgres_journal.schema)["moves"] == ("waiting", None)
        assert claim(postgres_journal) is None

    def test_a_run_that_ends_is_neither_claimable_nor_ready(self, postgres_journal, admin):
        start(postgres_journal, "r")
        held = claim(postgres_journal)
        assert held is not None
        ended = end(postgres_journal, "r")
        assert heads(admin, postgres_journal.schema)["r"] == (None, ended.updated_at)
        assert claim(postgres_journal) is None


class TestPrune:
    """Prune reads ended runs off an index and deletes them in batches, each committed."""

    def test_batches_delete_everything_they_report(self, postgres_journal, admin):
        fill(admin, postgres_journal.schema, ended=2_500, waiting=3, leased=3)
        cutoff = T0 + dt.timedelta(days=1)
        dry = postgres_journal.prune(ended_before=cutoff, dry_run=True, batch_size=1000)
        expected = tuple(f"e{n:07d}" for n in range(1, 2_501))  # oldest first
        assert (dry.run_ids, dry.transitions) == (expected, 2_500)
        report = postgres_journal.prune(ended_before=cutoff, batch_size=1000)
        assert (report.run_ids, report.transitions, report.dry_run) == (expected, 2_500, False)
        left = heads(admin, postgres_journal.schema)
        assert sorted(left) == [
            *(f"l{n:07d}" for n in (1, 2, 3)),
            *(f"w{n:07d}" for n in (1, 2, 3)),
        ]
        count = table_rows(admin, postgres_journal.schema, "SELECT count(*) FROM transitions")
        assert count == [(6,)]
        assert postgres_journal.prune(ended_before=cutoff).run_ids == ()

    def test_the_cutoff_is_when_the_run_ended(self, postgres_journal):
        start(postgres_journal, "old", created=0)
        start(postgres_journal, "young", created=10)
        end(postgres_journal, "old")
        end(postgres_journal, "young")
        report = postgres_journal.prune(ended_before=T0 + dt.timedelta(seconds=5))
        assert report.run_ids == ("old",)
        assert [run.run_id for run in postgres_journal.runs()] == ["young"]

    def test_a_parent_with_an_active_child_is_kept(self, postgres_journal):
        start(postgres_journal, "parent")
        start(postgres_journal, "child", created=1, parent="parent")
        end(postgres_journal, "parent")
        cutoff = T0 + dt.timedelta(days=1)
        for batch_size in (1, 1000):
            assert postgres_journal.prune(ended_before=cutoff, batch_size=batch_size).run_ids == ()
        end(postgres_journal, "child")
        report = postgres_journal.prune(ended_before=cutoff, batch_size=1)
        assert report.run_ids == ("parent", "child")
        assert postgres_journal.runs() == []

    def test_a_kept_run_does_not_end_the_batches(self, postgres_journal):
        # Batches of one: the kept parent is the first run read; the ones after it still go.
        start(postgres_journal, "parent")
        start(postgres_journal, "child", created=1, parent="parent")
        end(postgres_journal, "parent")
        for n in range(3):
            start(postgres_journal, f"x{n}", created=2 + n)
            end(postgres_journal, f"x{n}")
        report = postgres_journal.prune(ended_before=T0 + dt.timedelta(days=1), batch_size=1)
        assert report.run_ids == ("x0", "x1", "x2")

    def test_a_batch_size_below_one_is_refused(self, postgres_journal):
        with pytest.raises(ValueError, match="batch_size"):
            postgres_journal.prune(ended_before=T0, batch_size=0)

    def test_a_writer_goes_on_during_a_big_prune(
        self, postgres_server, postgres_journal, admin, monkeypatch
    ):
        # 5,000 ended runs pruned 500 a batch, while another connection starts runs under the
        # same spec (whose row the prune may try to delete) and commits steps: every write
        # succeeds. Each batch after the first waits for a write to complete first, so some
        # writes surely complete while the prune is under way (no timing is assumed).
        fill(admin, postgres_journal.schema, ended=5_000, waiting=0, leased=0)
        wrote = threading.Event()
        done = threading.Event()
        batches = []
        reports = []
        one_batch = postgres_journal._writer._prune_batch

        def batch_after_a_write(*args, **kwargs):
            if batches:
                assert wrote.wait(timeout=60)
                wrote.clear()
            batches.append(one_batch(*args, **kwargs))
            return batches[-1]

        monkeypatch.setattr(postgres_journal._writer, "_prune_batch", batch_after_a_write)

        def prune() -> None:
            try:
                reports.append(
                    postgres_journal.prune(ended_before=T0 + dt.timedelta(1), batch_size=500)
                )
            finally:
                done.set()

        during = 0
        thread = threading.Thread(target=prune)
        with PostgresJournal(postgres_server.url, schema=postgres_journal.schema) as writer:
            run = start(writer, "writer")
            thread.start()
            n = 0
            while not done.is_set():
                writer.commit(*next_step(run, HANDLED[n % 2]))
                run = writer.load("writer")
                start(writer, f"new{n}", created=n)
                during += not done.is_set()
                n += 1
                wrote.set()
            thread.join()
        assert len(reports[0].run_ids) == 5_000
        assert len(batches) == 11  # ten of 500, then the empty one that ends it
        assert during >= 10
        kept = {run.run_id for run in postgres_journal.runs()}
        assert kept == {"writer", *(f"new{k}" for k in range(n))}
        assert postgres_journal.integrity_problems() == []


@pytest.mark.parametrize("due", [False, True], ids=["no-wake-time", "wake-time"])
def test_a_step_of_a_leased_run_is_a_hot_update(postgres_server, admin, due):
    """No index holds a column a plain step changes: the row is updated in place (HOT).

    Also when the run has a wake time (a signal came while it was held): a step writes
    ``wake_at`` as it is, so ``runs_due`` is not written either. The journal is in a schema
    of its own, made for this test: a pooled one's table counts the updates of the tests
    before it, which a closed connection's backend may report late, in the middle of this one.
    """
    schema = postgres_server.new_schema()
    postgres_server.made.add(schema)
    postgres_journal = PostgresJournal(postgres_server.url, schema=schema)
    try:
        _count_hot_updates(postgres_journal, admin, due)
    finally:
        postgres_journal.close()
        postgres_server.drop(schema)


def updates(postgres_journal, admin) -> tuple[int, int]:
    """How many updates of the journal's runs, and how many of them HOT, the server counted."""
    postgres_journal._connection.call(
        lambda conn: conn.execute("SELECT pg_stat_force_next_flush()")
    )
    admin.execute("SELECT pg_stat_clear_snapshot()")
    row = admin.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE schemaname = %s AND relname = 'runs'",
        (postgres_journal.schema,),
    ).fetchone()
    return int(row[0]), int(row[1])


def _count_hot_updates(postgres_journal, admin, due):
    start(postgres_journal, "hot")
    run = claim(postgres_journal)
    assert run is not None
    if due:
        postgres_journal.put_signal(SignalRecord("hot", 0, "APPROVED"))
        assert postgres_journal.wake_time("hot") is not None

    before = updates(postgres_journal, admin)
    steps = 50
    for n in range(steps):
        after, transition = next_step(run, HANDLED[(n + 1) % 2])
        postgres_journal.commit(after, transition)
        run = after
    done = updates(postgres_journal, admin)
    assert done[0] - before[0] == steps
    # HOT as long as the row's page has room: an old snapshot elsewhere on the server (other
    # tests) can keep the page from being pruned, and then one update moves the row to another
    # page. An index over a column a step changes would make every one of them non-HOT.
    assert done[1] - before[1] >= steps // 2
    assert (postgres_journal.wake_time("hot") is not None) is due


def test_a_group_commit_of_runs_stored_together_is_hot(postgres_server, admin):
    """A group rewrites every row of a page at once: each page has room for all (schema 11).

    Runs started together fill pages side by side; their first group commit needs a second
    version of each row on its page (at fillfactor 90 about a third were HOT). Counted on the
    first group, which needs no page pruned. A schema of its own (see the test above).
    """
    schema = postgres_server.new_schema()
    postgres_server.made.add(schema)
    journal = PostgresJournal(postgres_server.url, schema=schema)
    try:
        runs = []
        for n in range(300):  # stored held, as Engine.start(claim=True) stores them
            run = RunRecord(
                f"g{n}",
                SPEC.name,
                SPEC.spec_hash,
                "building",
                created_at=T0,
                updated_at=T0,
                lease_owner="w0",
                lease_expires_at=FAR_AHEAD,
                lease_token=1,
            )
            first = TransitionRecord(run.run_id, 0, None, RunEvent.STARTED.value, "building", at=T0)
            journal.create_run(run, first, spec_json=SPEC.to_json())
            runs.append(run)
        before = updates(journal, admin)
        commits = [Commit(*next_step(run, HANDLED[1])) for run in runs]
        assert journal.commit_many(commits) == [None] * len(runs)
        done = updates(journal, admin)
        assert done[0] - before[0] == len(runs)
        assert done[1] - before[1] >= 0.8 * len(runs), (done, before)
    finally:
        journal.close()
        postgres_server.drop(schema)
