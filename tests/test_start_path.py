"""The start path (``start``, ``start_many``): its fast paths give exactly what the general ones do."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import sqlite3
import uuid

import attrs
import pytest

from fsm_runner import Engine, MemoryJournal, SqliteJournal
from fsm_runner.engine.core import StepCore, random_ids
from fsm_runner.exceptions import JournalError, RunExistsError
from fsm_runner.journal import _rows
from fsm_runner.journal._sqlite_inserts import insert_rows as _insert_rows
from fsm_runner.journal._sqlite_writes import _INSERT_TRANSITION
from fsm_runner.records import RunLifecycle, TransitionRecord, format_utc
from fsm_runner.rules.reducer import begin
from tests.helpers import NEXT, linear_spec

UTC = dt.timezone.utc
SPEC = linear_spec("a", "b", "c", name="start-path")


def noop(_ctx):
    return NEXT


HANDLERS = {"a": noop, "b": noop, "c": noop}
#: The lease a run is started holding (``start(claim=True)``): its worker and duration.
LEASE = ("w", dt.timedelta(seconds=30))


def _engine(journal):
    return Engine(SPEC, handlers=HANDLERS, journal=journal)


def _core(journal):
    """The engine's step core, on its own: it plans new runs without writing them."""
    return StepCore(SPEC, handlers=HANDLERS, journal=journal)


def _keys(path):
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        return dict(conn.execute("SELECT run_id, run_key FROM run_rows"))


def _reference_run_params(run, columns, stamp):
    """``run_params`` as it was written before its fast paths: one column at a time."""
    values = []
    for column in columns:
        value = getattr(run, column)
        if column in _rows.RUN_JSON:
            value = _rows.dumps(value)
        elif column == "status":
            value = value.value
        elif column in _rows.RUN_TIMES:
            value = None if value is None else stamp(value)
        elif value is not None and not (type(value) is int or type(value) is bool):
            _rows._check_column(value, column)
        values.append(value)
    return tuple(values)


class TestCreateRuns:
    """SQLite's ``create_runs``: keys given in the transaction, rows by ``executemany``."""

    def test_keys_follow_on_as_sqlite_gives_them(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = _engine(journal)
            first = engine.start()  # a key SQLite gave
            batch = engine.start_many([1, 2, 3])
            keys = _keys(path)
            assert [keys[r] for r in [first, *batch]] == [1, 2, 3, 4]
            with (
                contextlib.closing(sqlite3.connect(path)) as conn,
                conn,
            ):  # the last run gone: keys go on past the highest
                conn.execute("DELETE FROM transitions WHERE run_id = ?", (batch[-1],))
                conn.execute("DELETE FROM run_rows WHERE run_id = ?", (batch[-1],))
            later = engine.start_many([5, 6])
            after = engine.start()
            keys = _keys(path)
            assert [keys[r] for r in [*later, after]] == [4, 5, 6]
            engine.close()

    def test_the_runs_and_their_first_transitions_read_back_as_written(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            core = _core(journal)
            batch = [
                core.new_run(None, None, None, None, None),
                core.new_run({"n": 1}, "given", {"k": "v"}, "parent", LEASE),
                core.new_run("x", None, None, None, LEASE),
                core.new_run(None, None, None, "parent", None),
            ]
            journal.create_runs(batch, spec_json=SPEC.to_json())
            for run, first, _ in batch:
                assert journal.load(run.run_id) == run
                assert journal.transitions(run.run_id) == [first]

    @pytest.mark.parametrize("at", [0, 2, 4])
    def test_an_existing_id_is_named_wherever_it_is_in_the_batch(self, tmp_path, at):
        with SqliteJournal(tmp_path / "j.db") as journal:
            batch = [_core(journal).new_run(n, f"run-{n}", None, None, None) for n in range(5)]
            journal.create_run(*batch[at][:2], spec_json=SPEC.to_json())
            with pytest.raises(RunExistsError) as raised:
                journal.create_runs(batch, spec_json=SPEC.to_json())
            assert raised.value.run_id == f"run-{at}"
            assert [run.run_id for run in journal.runs()] == [f"run-{at}"]

    def test_an_id_twice_in_the_batch_is_named_and_nothing_is_stored(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = _engine(journal)
            batch = [_core(journal).new_run(n, f"run-{n % 3}", None, None, None) for n in range(5)]
            with pytest.raises(RunExistsError) as raised:
                journal.create_runs(batch, spec_json=SPEC.to_json())
            assert raised.value.run_id == "run-0"
            assert list(journal.runs()) == []
            engine.start_many([1])
            assert len(list(journal.runs())) == 1
            engine.close()

    def test_rows_with_nulls_in_sql_are_the_rows_bound(self, tmp_path):
        rows = [
            ("r", 1, None, "E", "s", None, 1, "t", None, None, 0, 7, "d1"),
            ("r", 2, "s", "E", "s", 1, None, "t", 2.5, '{"a": 1}', 0, 7, "d2"),
            ("r", 3, None, "E", "s", None, 1, "t", None, None, 0, 7, "d3"),
            ("r", 4, None, "E", "s", None, 1, "t", None, None, 0, 7, "d4"),
        ]
        with contextlib.closing(sqlite3.connect(":memory:")) as conn, conn:
            conn.execute(
                "CREATE TABLE transitions (run_id, seq, from_state, event, to_state, iteration,"
                " attempt, at, duration_ms, result, lease_token, run_key, digest)"
            )
            _insert_rows(conn.cursor(), _INSERT_TRANSITION, rows)
            stored = conn.execute("SELECT *, typeof(from_state) FROM transitions").fetchall()
        assert [row[:-1] for row in stored] == rows
        assert [row[-1] for row in stored] == ["null", "text", "null", "null"]


class TestRunParams:
    """``run_params`` gives exactly what it gave one column at a time."""

    def _run(self, **changes):
        now = dt.datetime(2026, 11, 24, 23, 0, 1, 123456, tzinfo=UTC)
        run = _core(MemoryJournal()).new_run({"n": 1}, None, {"k": 1}, None, LEASE)[0]
        return attrs.evolve(run, **{"created_at": now, "updated_at": now, **changes})

    @pytest.mark.parametrize(
        "changes",
        [
            {},
            {"lease_owner": None, "lease_expires_at": None, "lease_token": 0},
            {"updated_at": dt.datetime(2026, 11, 25, tzinfo=UTC), "status": RunLifecycle.FAILED},
            {"parent_run_id": "pärent", "forked_from": "run@3", "abort_reason": "stop"},
            {"return_to": "b", "return_attempt": 2, "return_visit": 3, "recoveries": 1},
            {"error": {"type": "E"}, "input": None, "context": {}},
            {"lease_token": True},
            {"created_at": dt.datetime(2026, 11, 24, 23, 0, 1, 123456)},  # naive: as UTC
        ],
    )
    def test_every_column_as_one_at_a_time(self, changes):
        run = self._run(**changes)
        columns = _rows.RUN_COLUMNS
        assert _rows.run_params(run, columns, format_utc) == _reference_run_params(
            run, columns, format_utc
        )
        some = ("updated_at", "status", "run_id", "created_at", "context")
        assert _rows.run_params(run, some, format_utc) == _reference_run_params(
            run, some, format_utc
        )

    @pytest.mark.parametrize(
        ("column", "value"),
        [
            ("parent_run_id", "lone \udc80 surrogate"),
            ("abort_reason", "\ud800"),
            ("recoveries", math.nan),
            ("lease_token", math.inf),
        ],
    )
    def test_a_value_no_database_stores_is_refused_naming_its_column(self, column, value):
        run = self._run(**{column: value})
        with pytest.raises(JournalError, match=column):
            _rows.run_params(run, _rows.RUN_COLUMNS, format_utc)
        with pytest.raises(JournalError, match=column):
            _reference_run_params(run, _rows.RUN_COLUMNS, format_utc)

    def test_a_finite_float_and_a_str_subclass_pass_as_before(self):
        class Name(str):
            pass

        run = self._run(recoveries=1.5, machine=Name("m"))
        assert _rows.run_params(run, _rows.RUN_COLUMNS, format_utc) == _reference_run_params(
            run, _rows.RUN_COLUMNS, format_utc
        )


class TestNewRuns:
    """The engine's side of a start: ids, the first row, the lease keeper told once a batch."""

    def test_run_ids_are_uuid4_hex(self):
        ids = random_ids(500)
        assert len(set(ids)) == 500
        for run_id in ids:
            parsed = uuid.UUID(hex=run_id)
            assert parsed.hex == run_id
            assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)

    @pytest.mark.parametrize("claim", [False, True])
    @pytest.mark.parametrize("context", [None, {"k": [1]}])
    def test_a_new_runs_row_is_what_begin_derives_from_its_fields(self, claim, context):
        run, first, _ = _core(MemoryJournal()).new_run(
            {"n": 1}, "r", context, "parent", LEASE if claim else None
        )
        given = attrs.evolve(run, state="elsewhere", seq=7, context={}, updated_at=None)
        assert begin(SPEC, given, first) == run
        assert run.lease_token == (1 if claim else 0)
        assert run.context == (context or {})
        assert first == TransitionRecord(
            "r", 0, None, "STARTED", "a", 0, 1, run.created_at, 0.0, first.result, 0
        )

    @pytest.mark.parametrize("claim", [False, True])
    def test_start_many_tells_the_lease_keeper_and_every_listener(self, claim):
        heard = []
        engine = Engine(
            SPEC,
            handlers={"a": noop, "b": noop, "c": noop},
            journal=MemoryJournal(),
            listeners=[lambda transition, run: heard.append((transition.seq, run.run_id))],
        )
        run_ids = engine.start_many(range(3), claim=claim)
        assert heard == [(0, run_id) for run_id in run_ids]
        held = [engine.journal.load(run_id).lease_owner for run_id in run_ids]
        assert held == [engine.worker_id if claim else None] * 3
        assert [engine.run(run_id).seq for run_id in run_ids] == [3, 3, 3]
        engine.close()
