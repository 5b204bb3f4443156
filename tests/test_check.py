"""``check`` that scales: the parallel check finds what the serial one finds, parts of a journal.

The journals here hold runs of two specs, damaged four ways (a gap in seqs, a run row that its
replay does not give, a transition the spec does not allow, a spec whose JSON no longer matches
its hash); each check is compared with the serial check, line for line.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import subprocess
import sys

import attrs
import pytest
from click.testing import CliRunner

from fsm_runner import Engine, MemoryJournal, SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.cli.maintenance import parse_since
from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.replay import check_journal, check_runs
from tests.conftest import POSTGRES_URL
from tests.helpers import handlers_for, linear_spec

PHASES_A, PHASES_B = ("a", "b", "c"), ("x", "y")
SPEC_A = linear_spec(*PHASES_A, name="checked")
SPEC_B = linear_spec(*PHASES_B, name="other")


def make_runs(journal, *, a: int = 14, b: int = 3) -> tuple[list[str], list[str]]:
    """``a`` ended runs of SPEC_A (seqs 0..3) and ``b`` of SPEC_B (seqs 0..2)."""
    made = []
    for spec, phases, count in ((SPEC_A, PHASES_A, a), (SPEC_B, PHASES_B, b)):
        engine = Engine(spec, handlers=handlers_for(*phases), journal=journal)
        ids = [engine.start() for _ in range(count)]
        for run_id in ids:
            engine.run(run_id)
        made.append(ids)
    return made[0], made[1]


def damage(journal, *statements) -> None:
    """Run SQL on the journal's own medium, behind its back (its triggers left out of it)."""
    if isinstance(journal, SqliteJournal):
        conn = sqlite3.connect(journal.path)
        try:
            for sql, params in statements:
                conn.execute(sql.replace("%s", "?").replace("RUNS", "run_rows"), params)
            conn.commit()
        finally:
            conn.close()
        return
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{journal.schema}"')
        for sql, params in statements:
            conn.execute(sql.replace("RUNS", "runs"), params)


def damage_memory(journal: MemoryJournal, gap: str, row: str, event: str, spec_hash: str) -> None:
    """The same four kinds of damage, in a memory journal's own dicts."""
    journal._transitions[gap] = [t for t in journal._transitions[gap] if t.seq != 2]
    journal._runs[row] = attrs.evolve(journal._runs[row], attempt=5)
    journal._transitions[event] = [
        attrs.evolve(t, event="BOGUS") if t.seq == 2 else t for t in journal._transitions[event]
    ]
    journal._specs[spec_hash] = journal._specs[spec_hash].replace('"y"', '"yy"')


def damaged_journal(journal) -> dict[str, str]:
    """Runs of two specs, four of them damaged; which run got which damage."""
    runs_a, runs_b = make_runs(journal)
    chosen = {"gap": runs_a[3], "row": runs_a[7], "event": runs_a[11]}
    spec_hash = journal.load(runs_b[0]).spec_hash
    if isinstance(journal, MemoryJournal):
        damage_memory(journal, chosen["gap"], chosen["row"], chosen["event"], spec_hash)
    else:
        damage(
            journal,
            ("DELETE FROM transitions WHERE run_id = %s AND seq = 2", (chosen["gap"],)),
            ("UPDATE RUNS SET attempt = 5 WHERE run_id = %s", (chosen["row"],)),
            (
                "UPDATE transitions SET event = 'BOGUS' WHERE run_id = %s AND seq = 2",
                (chosen["event"],),
            ),
            ("UPDATE specs SET json = replace(json, '\"y\"', '\"yy\"')", ()),
        )
    return chosen


class TestParallelIsSerial:
    """Every journal: the parallel check's lines are the serial check's, in the same order."""

    def test_the_same_problems(self, journal):
        chosen = damaged_journal(journal)
        serial = check_journal(journal, jobs=1)
        for jobs, chunk in ((1, 4), (2, 4), (2, 1), (3, 5), (2, 1000)):
            assert check_journal(journal, jobs=jobs, chunk=chunk) == serial, (jobs, chunk)
        run_lines = [line for line in serial if line.startswith("run")]
        assert len(run_lines) == 4, serial
        for damaged in chosen.values():
            assert sum(damaged in line for line in run_lines) == 1, (damaged, serial)
        assert "runs " in run_lines[-1] or "cannot be read" in "".join(run_lines)
        assert "does not match its hash" in "".join(run_lines)
        report = check_runs(journal, jobs=2, chunk=3)
        assert report.runs == 17

    def test_a_clean_journal(self, journal):
        make_runs(journal, a=9, b=2)
        assert check_journal(journal, jobs=2, chunk=2) == []

    def test_progress_counts_every_run(self, journal):
        make_runs(journal, a=9, b=2)
        calls = []
        check_runs(journal, jobs=2, chunk=4, progress=lambda done, total: calls.append(total))
        assert calls
        assert set(calls) == {11}
        done = []
        check_runs(journal, jobs=2, chunk=4, progress=lambda n, _total: done.append(n))
        assert sum(done) == 11

    def test_the_medium_is_checked_beside_the_pool_in_a_process_of_its_own(
        self, tmp_path, monkeypatch
    ):
        """Not in this process (PostgreSQL's chains in Python held the inspector's GIL)."""
        import threading

        path = tmp_path / "journal.db"
        calls = []
        original = SqliteJournal.integrity_problems

        def integrity_problems(self, **options):
            calls.append((self, threading.current_thread() is threading.main_thread()))
            return original(self, **options)

        with SqliteJournal(path) as journal:
            make_runs(journal, a=6, b=0)
            conn = sqlite3.connect(path)
            with conn:  # a problem of the medium: an index added to the journal's tables
                conn.execute("CREATE INDEX by_hand ON run_rows (error)")
            conn.close()
            problem = "schema: index by_hand is not part of schema version 12"
            monkeypatch.setattr(SqliteJournal, "integrity_problems", integrity_problems)
            assert check_journal(journal, jobs=2, chunk=2) == [problem]
            assert calls == []  # checked in a spawned process, through a journal of its own
            assert check_journal(journal, jobs=1) == [problem]
            assert calls == [(journal, True)]  # one process: first, as before

    def test_a_stopped_check_stops_the_mediums_process(self, tmp_path, monkeypatch):
        """A cancel (``progress`` raised) ends it: nothing waits for it, an inspector's exit
        included; its answers never come."""
        from fsm_runner import _check_pool

        stopped = []
        stop = _check_pool.Medium.stop

        def recorded(medium):
            stopped.append(medium._process)
            stop(medium)

        monkeypatch.setattr(_check_pool.Medium, "stop", recorded)

        def cancel(_done, _total):
            raise KeyboardInterrupt

        with SqliteJournal(tmp_path / "journal.db") as journal:
            make_runs(journal, a=8, b=0)
            with pytest.raises(KeyboardInterrupt):
                check_runs(journal, jobs=2, chunk=2, progress=cancel)
        (process,) = stopped  # the medium's, beside the pool, stopped once
        assert process is not None
        assert process.exitcode is not None  # ended (killed, or done before the stop came)

    def test_the_mediums_process_stopped_at_once(self, tmp_path):
        with SqliteJournal(tmp_path / "journal.db") as journal:
            make_runs(journal, a=2, b=0)
            medium = _check_pool_medium(journal)
            process = medium._process
            medium.stop()
            medium.stop()  # again: nothing more to do
            assert process.exitcode is not None
            finished = _check_pool_medium(journal)
            assert finished() == []  # left alone, it answers
            assert finished() == []  # and keeps its answer
            assert finished._process is None  # its process joined

    def test_a_damaged_view_falls_back_to_the_serial_check(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            make_runs(journal, a=6, b=0)
        conn = sqlite3.connect(path)
        conn.execute("DROP VIEW runs")
        conn.execute("CREATE VIEW runs AS SELECT * FROM run_rows WHERE 0")
        conn.commit()
        conn.close()
        with SqliteJournal(path) as journal:
            serial = check_journal(journal, jobs=1, chunk=10**6)
            assert check_journal(journal, jobs=2, chunk=2) == serial
            assert serial


class TestBulkReads:
    """A SQL journal's ``read_runs`` gives each run as reading it alone gives it."""

    @pytest.fixture(params=["sqlite", "postgres"])
    def sql_journal(self, request, tmp_path):
        if request.param == "postgres":
            yield request.getfixturevalue("postgres_journal")
            return
        with SqliteJournal(tmp_path / "journal.db") as journal:
            yield journal

    def test_the_same_records_and_errors(self, sql_journal):
        journal = sql_journal
        runs_a, runs_b = make_runs(journal, a=10, b=2)
        lease = "UPDATE RUNS SET lease_owner = 'w1', lease_expires_at = %s WHERE run_id = %s"
        damage(
            journal,
            ("UPDATE transitions SET result = '{bad' WHERE run_id = %s AND seq = 1", (runs_a[1],)),
            ("UPDATE transitions SET result = '[1]' WHERE run_id = %s AND seq = 1", (runs_a[2],)),
            ("UPDATE transitions SET iteration = NULL WHERE run_id = %s", (runs_a[3],)),
            ("UPDATE RUNS SET status = 'bogus' WHERE run_id = %s", (runs_b[0],)),
            # a run row's other shapes: each read in bulk as it is read alone
            (lease, ("2031-02-03T04:05:06.789012+00:00", runs_a[4])),
            (
                "UPDATE RUNS SET error = %s WHERE run_id = %s",
                ('{"type": "E", "n": [1]}', runs_a[5]),
            ),
            ("UPDATE RUNS SET context = '[1]' WHERE run_id = %s", (runs_a[6],)),
            ("UPDATE RUNS SET error = '\"text\"' WHERE run_id = %s", (runs_a[7],)),
            ("UPDATE RUNS SET input = NULL, parent_run_id = 'p' WHERE run_id = %s", (runs_a[8],)),
            ("UPDATE RUNS SET input = '[1, {\"a\": null}]' WHERE run_id = %s", (runs_a[9],)),
        )
        keys = journal.check_keys()
        reads = dict(journal.read_runs(keys[0], keys[-1]))
        assert sorted(reads) == sorted(runs_a + runs_b)
        errors = 0
        for run_id, read in reads.items():
            alone = read_alone(journal, run_id)
            if isinstance(alone, FsmRunnerError):
                errors += 1
                assert (type(read), str(read)) == (type(alone), str(alone))
            else:
                assert read == alone, run_id
        assert errors >= 3  # the unreadable JSON, the unknown status, a context not an object
        if isinstance(journal, SqliteJournal):  # its rows are text: built without the converter
            from fsm_runner.journal._range_reads import _typed_run

            names, rows = journal._core._select("SELECT * FROM runs", [])
            build = _typed_run(names)
            built = {row[names.index("run_id")]: build(row) for row in rows}
            for run_id in (runs_a[0], runs_a[4], runs_a[5]):  # plain, leased, with an error
                assert built[run_id] == journal.load(run_id), run_id
            assert built[runs_a[4]].lease_expires_at.microsecond == 789012
            assert built[runs_b[0]] is None  # a status it does not know: the converter's
            assert built[runs_a[6]] is None  # a context not an object: the converter's


def read_alone(journal, run_id):
    """A run's transitions and row read one at a time, or the error reading them raises."""
    try:
        return journal.transitions(run_id), journal.load(run_id)
    except FsmRunnerError as exc:
        return exc


class TestPartOfAJournal:
    """``run_ids`` and ``since`` select the runs checked."""

    def test_run_ids(self, journal):
        chosen = damaged_journal(journal)
        only = check_journal(journal, run_ids=[chosen["row"], chosen["event"]], jobs=2)
        everything = check_journal(journal)
        # the medium's own problems (PostgreSQL names seq gaps journal-wide) come first, always
        medium = [line for line in everything if not line.startswith("run")]
        assert only == medium + [
            line
            for line in everything
            if line not in medium and (chosen["row"] in line or chosen["event"] in line)
        ]
        assert len(only) == len(medium) + 2
        assert check_runs(journal, run_ids=[chosen["gap"]]).runs == 1

    def test_since(self, journal):
        old, _ = make_runs(journal, a=4, b=0)
        cut = max(journal.load(run_id).updated_at for run_id in old) + dt.timedelta(microseconds=1)
        new, _ = make_runs(journal, a=3, b=0)
        for jobs, chunk in ((1, 2), (2, 2), (1, 100)):
            assert check_runs(journal, since=cut, jobs=jobs, chunk=chunk).runs == 3
            assert check_runs(journal, jobs=jobs, chunk=chunk).runs == 7
        damage_run = new[1]
        if isinstance(journal, MemoryJournal):
            journal._runs[damage_run] = attrs.evolve(journal._runs[damage_run], attempt=5)
            journal._runs[old[0]] = attrs.evolve(journal._runs[old[0]], attempt=5)
        else:
            damage(
                journal,
                ("UPDATE RUNS SET attempt = 5 WHERE run_id IN (%s, %s)", (damage_run, old[0])),
            )
        recent = check_journal(journal, since=cut, jobs=2, chunk=2)
        assert len(recent) == 1
        assert damage_run in recent[0]
        assert len(check_journal(journal, jobs=2, chunk=2)) == 2


class TestSince:
    """``--since``: an ISO date/time or a duration, as ``prune --older-than`` takes its days."""

    @pytest.mark.parametrize(
        ("text", "back"),
        [("7d", dt.timedelta(days=7)), ("12h", dt.timedelta(hours=12)),
         ("30m", dt.timedelta(minutes=30)), ("2w", dt.timedelta(weeks=2)),
         ("1.5", dt.timedelta(days=1.5)), ("90s", dt.timedelta(seconds=90))],
    )  # fmt: skip
    def test_durations(self, text, back):
        now = dt.datetime.now(dt.timezone.utc)
        assert abs(parse_since(text) - (now - back)) < dt.timedelta(minutes=1)

    def test_iso(self):
        utc = dt.timezone.utc
        assert parse_since("2026-11-20") == dt.datetime(2026, 11, 20, tzinfo=utc)
        assert parse_since("2026-11-20T08:30:00+01:00") == dt.datetime(
            2026, 11, 20, 7, 30, tzinfo=utc
        )

    @pytest.mark.parametrize(
        "text", ["nan", "inf", "-inf", "-3", "garbage", "7x", "", "1e400", "400000", "NaNd"]
    )
    def test_refused_in_one_line(self, tmp_path, text):
        path = tmp_path / "journal.db"
        SqliteJournal(path).close()
        result = CliRunner().invoke(cli, ["--journal", str(path), "check", "--since", text])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, result.output
        assert lines[0].startswith("Error: --since: ")
        assert "Traceback" not in result.output


class TestCommand:
    """``fsm-runner check`` with ``--jobs``, ``--run``, ``--since``."""

    def test_options(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chosen = damaged_journal(journal)
        runner = CliRunner()
        base = ["--journal", str(path), "check"]
        serial = runner.invoke(cli, [*base, "--jobs", "1"])
        parallel = runner.invoke(cli, [*base, "--jobs", "2"])
        assert serial.exit_code == parallel.exit_code == 1
        assert serial.output == parallel.output
        # 4 the replay finds, and the 2 runs whose chain of digests is broken (gap, event)
        assert "6 problems in 17 runs" in serial.output
        one = runner.invoke(cli, [*base, "--run", chosen["gap"][:10], "--run", chosen["row"]])
        assert one.exit_code == 1
        assert "4 problems in 2 runs" in one.output  # the chains: the journal's, as ever
        future = runner.invoke(cli, [*base, "--since", "2999-01-01"])
        # no run replayed; the journal's own checks (the chains among them) are whole, as ever
        assert (future.exit_code, future.output.splitlines()[0].split(":")[-1].strip()) == (
            1,
            "2 problems in 0 runs",
        )
        recent = runner.invoke(cli, [*base, "--since", "1d", "--json"])
        assert recent.exit_code == 1
        assert '"runs": 17' in recent.output
        missing = runner.invoke(cli, [*base, "--run", "ffffffffff"])
        assert missing.exit_code == 3

    def test_a_real_process_with_two_jobs(self, tmp_path):
        """A real ``fsm-runner check --jobs 2``: the pool's processes are spawned for real."""
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            make_runs(journal, a=2, b=1)
            # enough runs for several ranges of the CLI's own chunk, made by the journal's writer
            engine = Engine(SPEC_A, handlers=handlers_for("a", "b", "c"), journal=journal)
            many = [engine.start() for _ in range(4500)]
            bad = many[2222]
            engine.run(bad)
        damage(journal, ("UPDATE RUNS SET attempt = 5 WHERE run_id = %s", (bad,)))
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        done = subprocess.run(
            [sys.executable, "-m", "fsm_runner", "--journal", str(path), "check", "--jobs", "2"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=600,
        )
        assert done.returncode == 1, done.stderr
        assert done.stderr == ""  # no progress bar: stderr is not a terminal
        lines = done.stdout.splitlines()
        assert lines[0].endswith(": 1 problems in 4503 runs")
        assert lines[1].startswith(f"  run {bad} at seq 3: replay expected attempt 1")


def _check_pool_medium(journal):
    """The journal's medium checks begun in a process of their own (as beside a pool)."""
    from fsm_runner._check_pool import medium_checks

    return medium_checks(journal, beside_pool=True)
