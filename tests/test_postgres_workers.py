"""Acceptance: worker processes share one PostgreSQL journal, through a SIGKILL and server restarts.

The workers are real ``fsm-runner worker --app tests.pg_worker_app:make_engine`` processes on
a real PostgreSQL server, each test in a schema of its own. Their phase handlers record every
execution in a side table of the same database (see ``tests/pg_worker_app.py``), and
:func:`tests.pg_worker_app.verify` checks, as the SQLite crash torture does, that every run
reached its expected end by its expected path with gapless seqs, that ``check_journal`` finds
nothing, and that no completed phase ran twice: each journaled transition out of a visit under
lease token L has exactly one finished execution under L and none under a later token. A phase
run again (under a later token, because its worker was lost inside it) is allowed by the
contract; each test says exactly which re-executions what it did to the workers explains.

- 500 runs, four workers, one SIGKILLed inside a phase midway: its run is taken over once its
  lease (1.5 s, heartbeat 0.25 s) expires and finished by another worker; exactly that phase
  runs again, nothing else does.
- Two workers while the server is stopped and started again (``pg_ctlcluster stop -m fast``,
  and ``-m immediate``: a crash, then recovery from the WAL), down for over a second: every
  run completes, no phase runs again, no lease is taken over (the 20 s lease outlives the
  outage). These need a local cluster that ``pg_ctlcluster`` can stop and start (as root or
  its owner), else they are skipped; the server is up again after them whatever happens.

Seeds are random per session and printed on failure; ``FSM_PG_WORKERS_SEED`` replays a
session's inputs.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs
import psycopg
import pytest
from psycopg import sql

from fsm_runner import Engine, RunLifecycle
from fsm_runner.journal._postgres_chain import fill_digests
from fsm_runner.journal.postgres import PostgresJournal
from tests.pg_worker_app import (
    LONG_MS,
    SPEC,
    Execution,
    Executions,
    Recorder,
    Report,
    make_input,
    verify,
)

ROOT = Path(__file__).parents[1]
APP = "tests.pg_worker_app:make_engine"
SEED = int(os.environ.get("FSM_PG_WORKERS_SEED") or random.SystemRandom().randrange(2**31))
TIMEOUT = 60.0  # seconds any one wait may take before the test gives up (never reached when green)
T = TypeVar("T")

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "SIGKILL"), reason="needs POSIX processes and signals"
)


def wait_for(
    check: Callable[[], T | None], what: str, *, timeout: float = TIMEOUT, poll: float = 0.02
) -> T:
    """Call ``check`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def worker_command() -> list[str]:
    """The installed ``fsm-runner`` console script, or the CLI module through this Python."""
    beside = Path(sys.executable).with_name("fsm-runner")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "fsm_runner.cli"]


class Workers:
    """``fsm-runner worker`` processes on one PostgreSQL journal; whatever is left is killed."""

    def __init__(
        self, tmp_path: Path, url: str, schema: str, *, lease_ttl: float, heartbeat: float
    ) -> None:
        self.tmp_path = tmp_path
        self.journal_url = f"{url}{'&' if '?' in url else '?'}schema={urllib.parse.quote(schema)}"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "FSM_PG_WORKER_URL": url,
            "FSM_PG_WORKER_SCHEMA": schema,
            "FSM_PG_WORKER_LEASE_TTL": str(lease_ttl),
            "FSM_PG_WORKER_HEARTBEAT": str(heartbeat),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, tuple[Path, Path]] = {}

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def spawn(self, count: int) -> None:
        """Start ``count`` workers; their output goes to files (a full pipe would block them)."""
        for _ in range(count):
            index = len(self.procs)
            out, err = self.tmp_path / f"worker-{index}.out", self.tmp_path / f"worker-{index}.err"
            with out.open("wb") as stdout, err.open("wb") as stderr:
                proc = subprocess.Popen(
                    [
                        *worker_command(),
                        "--journal",
                        self.journal_url,
                        "worker",
                        "--app",
                        APP,
                        "--idle-wait",
                        "0.05",
                    ],
                    cwd=ROOT,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                )
            self.procs.append(proc)
            self.logs[proc.pid] = (out, err)

    def kill(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGKILL a worker; return its exit code."""
        proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=TIMEOUT)

    def stop(self) -> dict[int, tuple[int, str]]:
        """SIGTERM the live workers (a clean stop); their exit codes and error output by pid."""
        live = [proc for proc in self.procs if proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        ended = {}
        for proc in live:
            code = proc.wait(timeout=TIMEOUT)
            ended[proc.pid] = (code, self.logs[proc.pid][1].read_text(errors="replace"))
        return ended


def unexpected_output(stderr: str, *, outage: bool = False) -> list[str]:
    """Lines a worker wrote to stderr besides the one a SIGTERM stop prints.

    ``outage``: the server went down meanwhile. A connection cut inside a pipeline leaves
    psycopg's own cleanup failing (the pipeline's sync, the ROLLBACK of the transaction around
    it), and psycopg logs each as a warning, "error ignored ...", on its ``psycopg`` logger:
    true of the outage, and the worker's own handling (reconnect, go on) is what the test checks.
    A SIGTERM that lands while a statement is in flight (an idle worker's claim, its look at the
    leases' owners) cancels it, and psycopg's ROLLBACK of the transaction around it fails the
    same way ("another command is already in progress"; the server rolls it back as the
    connection closes): seen once on CI.
    """
    return [
        line
        for line in stderr.splitlines()
        if line.strip()
        and "stopped by SIGTERM; any run in progress released" not in line
        and "which is gone" not in line  # it took over the killed worker's run (takeover_dead)
        and not (outage and line.startswith("error ignored "))
        and not (
            line.startswith("error ignored in rollback of <psycopg.Transaction")
            and line.endswith("another command is already in progress")
        )
    ]


def count_active(side: Executions, schema: str) -> int:
    table = sql.Identifier(schema, "runs")
    rows = side.execute(sql.SQL("SELECT count(*) FROM {} WHERE status = 'active'").format(table))
    return int(rows[0][0])


def start_runs(
    journal: PostgresJournal, side: Executions, count: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Start ``count`` runs with inputs from ``seed``; return their inputs by run id."""
    rng = random.Random(seed)
    starter = Engine(SPEC, handlers=Recorder(side).handlers, journal=journal)
    inputs: dict[str, dict[str, Any]] = {}
    try:
        for index in range(count):
            run_input = make_input(rng)
            inputs[starter.start(run_input, run_id=f"r{index:04d}")] = run_input
        return inputs
    finally:
        starter.close()


def describe(seed: int, report: Report, elapsed: float, extra: str = "") -> str:
    return f"replay with FSM_PG_WORKERS_SEED={seed}; {elapsed:.1f} s\n{report.summary()}" + (
        f"\n{extra}" if extra else ""
    )


@pytest.fixture
def pg_journal(postgres_server, postgres_schema):
    """The test's journal, in a fresh schema (dropped after the test)."""
    journal = PostgresJournal(postgres_server.url, schema=postgres_schema)
    yield journal
    journal.close()


@pytest.fixture
def side(postgres_server, postgres_schema, pg_journal):
    """The executions side table in the journal's schema, with a connection of its own."""
    side = Executions(postgres_server.url, postgres_schema)
    side.create()
    yield side
    side.close()


@pytest.mark.slow
def test_four_workers_share_the_journal_and_take_over_a_killed_ones_run(
    postgres_server, postgres_schema, pg_journal, side, tmp_path
):
    journal = pg_journal
    # The victim's run is taken over at once (its pid is dead), not by its lease's expiry: a
    # lease long enough that a live worker's, renewed every 0.25 s, never lapses on a loaded
    # machine (at 1.5 s one did on CI: another run taken over, its phase run twice, fenced).
    runs, lease_ttl, heartbeat = 500, 5.0, 0.25
    began = time.monotonic()
    with Workers(
        tmp_path, postgres_server.url, postgres_schema, lease_ttl=lease_ttl, heartbeat=heartbeat
    ) as workers:
        workers.spawn(4)  # they import while the runs are started
        inputs = start_runs(journal, side, runs, SEED)
        wait_for(lambda: count_active(side, postgres_schema) <= runs // 2, "half the runs")

        victim = workers.procs[0]

        def in_a_long_phase() -> Execution | None:
            found = side.running(victim.pid, at_least_ms=LONG_MS)
            fresh = [e for e in found if time.time() - e.started_at < LONG_MS / 4000]
            return fresh[0] if fresh else None

        while True:  # freeze it inside a long phase, make sure it is still in there, kill it
            target = wait_for(in_a_long_phase, "the victim inside a long phase", poll=0.001)
            victim.send_signal(signal.SIGSTOP)
            time.sleep(0.01)  # a write of the victim's already on its way lands meanwhile
            if side.find(target.id).finished_at is None:
                break
            victim.send_signal(signal.SIGCONT)
        # Read while the victim is frozen, still holding its run's lease: once it is killed, a
        # worker takes a dead worker's run over at once (0.15 s here), maybe before a read.
        left_behind = journal.load(target.run_id)
        killed_at = time.time()
        assert workers.kill(victim) == -signal.SIGKILL
        wait_for(lambda: count_active(side, postgres_schema) == 0, "every run to end", poll=0.05)
        stopped = workers.stop()
    elapsed = time.monotonic() - began
    executions = side.all()
    report = verify(journal, executions, inputs)
    held = journal.load(target.run_id)
    after = [t for t in journal.transitions(target.run_id) if t.lease_token > target.lease_token]
    context = describe(
        SEED,
        report,
        elapsed,
        f"victim {victim.pid} killed in {target}; its lease then {left_behind.lease_expires_at};"
        f" next transition {min((t.at.timestamp() for t in after), default=0) - killed_at:.2f} s"
        f" after the kill; its run now {held}",
    )
    print(context)

    assert report.problems == [], context
    assert report.runs == runs
    by_pid = {pid: sum(1 for e in executions if e.pid == pid) for pid in workers.logs}
    assert all(by_pid.values()), f"a worker ran nothing: {by_pid}"

    # What the kill explains: the phase it cut off ran again — once, in another worker, under
    # the next lease token — and no other phase of any run ran twice.
    last = max((e for e in executions if e.pid == victim.pid), key=lambda e: e.started_at)
    assert last == target, context  # killed inside it: it never finished
    assert last.finished_at is None, context
    visit = (target.run_id, target.state, target.visit_seq)
    assert report.re_executions == 1, context
    assert list(report.re_executed) == [visit], context
    again = [e for e in report.re_executed[visit] if e != target]
    assert len(again) == 1, context
    assert again[0].pid != victim.pid, context
    assert again[0].lease_token == target.lease_token + 1, context
    assert again[0].finished_at is not None, context
    assert report.unfinished == [target], context
    assert report.lost_results == [], context
    # Taken over (at once: its worker is gone, ``takeover_dead``), and finished by the others.
    assert report.taken_over == [target.run_id], context
    assert (held.recoveries, held.lease_token) == (1, target.lease_token + 1), context
    assert held.status is not RunLifecycle.ACTIVE, context
    assert held.lease_owner is None, context
    assert (left_behind.lease_owner, left_behind.lease_token) == (
        target.worker,
        target.lease_token,
    ), context
    expired = left_behind.lease_expires_at
    assert expired is not None, context
    assert expired.timestamp() - killed_at <= lease_ttl, context
    assert after, context
    assert {t.lease_token for t in after} == {target.lease_token + 1}, context

    # The survivors stopped cleanly on SIGTERM (exit 0), with nothing on stderr but takeovers.
    assert set(stopped) == {proc.pid for proc in workers.procs[1:]}
    for pid, (code, stderr) in stopped.items():
        assert code == 0, (pid, code, stderr)
        assert unexpected_output(stderr) == [], (pid, code, stderr)


# -- a server restart ----------------------------------------------------------------------------


def local_cluster(url: str) -> tuple[str, str, str, int] | None:
    """``(version, name, host, port)`` of the local cluster serving ``url``, if pg_ctlcluster can
    stop and start it from here (as root or as the cluster's owner)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    if host not in ("127.0.0.1", "localhost", "::1"):
        return None
    if shutil.which("pg_ctlcluster") is None or shutil.which("pg_lsclusters") is None:
        return None
    listed = subprocess.run(
        ["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=False
    ).stdout
    me = pwd.getpwuid(os.geteuid()).pw_name
    for line in listed.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[2] == str(port) and (os.geteuid() == 0 or fields[4] == me):
            return fields[0], fields[1], host, port
    return None


def server_is_ready(host: str, port: int) -> bool:
    return (
        subprocess.run(
            ["pg_isready", "-q", "-h", host, "-p", str(port)], check=False, timeout=30
        ).returncode
        == 0
    )


@attrs.frozen
class Outage:
    """When the server went down and when it took connections again (``time.time()``)."""

    began: float
    stopped: float
    ready: float


@pytest.fixture
def stop_server(postgres_server, postgres_schema) -> Iterator[Callable[[str, float], Outage]]:
    """Stop the test server (``pg_ctlcluster stop -m MODE``), keep it down, start it again.

    Whatever happens in the test, the server is up again afterwards (started if need be), and
    the session's admin connection is renewed, so later tests find both — before
    ``postgres_schema`` drops the test's schema.
    """
    cluster = local_cluster(postgres_server.url)
    if cluster is None:
        pytest.skip(f"no local cluster at {postgres_server.url} that pg_ctlcluster can restart")
    version, name, host, port = cluster
    ctl = ["pg_ctlcluster", "--skip-systemctl-redirect"]
    starts: list[subprocess.Popen[bytes]] = []

    def stop_and_start(mode: str, down_for: float) -> Outage:
        began = time.time()
        subprocess.run(
            [*ctl, "-m", mode, version, name, "stop"], check=True, capture_output=True, timeout=60
        )
        stopped = time.time()
        time.sleep(down_for)
        # pg_ctlcluster start returns ~2 s after the server takes connections: poll instead.
        starts.append(
            subprocess.Popen(
                [*ctl, version, name, "start"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        )
        wait_for(lambda: server_is_ready(host, port), "the server to start", poll=0.02)
        return Outage(began, stopped, time.time())

    try:
        yield stop_and_start
    finally:
        for start in starts:
            _, stderr = start.communicate(timeout=TIMEOUT)
            assert start.returncode == 0, stderr
        up = False
        with contextlib.suppress(AssertionError):
            up = wait_for(lambda: server_is_ready(host, port), "the server", timeout=20, poll=0.1)
        if not up:
            subprocess.run([*ctl, version, name, "start"], check=False, timeout=TIMEOUT)
            wait_for(lambda: server_is_ready(host, port), "the server to start", poll=0.1)
        with contextlib.suppress(psycopg.Error):  # a connection cut by the stop is now broken:
            postgres_server.admin.execute("SELECT 1")  # the next use of .admin reconnects


@pytest.mark.slow
@pytest.mark.alone  # it stops the shared server: no other test may use it meanwhile
# The suite restarts the server the crash's way (``immediate``: sessions cut, recovery on
# start); FSM_RUNNER_TEST_RESTART_MODES=fast,immediate adds the clean one (it idles the other
# worker meanwhile: the suite's budget).
@pytest.mark.parametrize(
    "mode", os.environ.get("FSM_RUNNER_TEST_RESTART_MODES", "immediate").split(",")
)
def test_workers_go_on_through_a_server_restart(
    mode, postgres_server, postgres_schema, pg_journal, side, stop_server, tmp_path
):
    """``fast``: a clean shutdown; ``immediate``: the server crashes and recovers from its WAL.

    The server stays down for over a second (``pg_ctlcluster restart`` keeps it down for ~0.2 s
    only): every worker finds its connections cut, reconnects with back-off and goes on.
    """
    journal = pg_journal
    runs = 200
    began = time.monotonic()
    with Workers(
        tmp_path, postgres_server.url, postgres_schema, lease_ttl=20.0, heartbeat=2.0
    ) as workers:
        workers.spawn(2)
        inputs = start_runs(journal, side, runs, SEED)
        wait_for(lambda: count_active(side, postgres_schema) <= runs * 3 // 4, "a quarter done")
        outage = stop_server(mode, 1.0)
        left = count_active(side, postgres_schema)
        wait_for(lambda: count_active(side, postgres_schema) == 0, "every run to end", poll=0.05)
        stopped = workers.stop()
    elapsed = time.monotonic() - began
    executions = side.all()
    report = verify(journal, executions, inputs)
    at = [t.at.timestamp() for run_id in inputs for t in journal.transitions(run_id)]
    # Nothing lands while the server is down: what landed after the stop landed after the start.
    down = outage.stopped
    spanning = [e for e in executions if e.started_at < down < (e.finished_at or 0)]
    context = describe(
        SEED,
        report,
        elapsed,
        f"stop -m {mode}: down {outage.ready - outage.began:.2f} s; {left} runs active after it;"
        f" {sum(1 for a in at if a < down)} transitions before, {sum(1 for a in at if a > down)}"
        f" after; {len(spanning)} phase(s) ran through it",
    )
    print(context)

    assert report.problems == [], context
    assert report.runs == runs
    # The workers were busy on both sides of the outage, and carried their runs through it.
    assert 0 < left < runs, context
    assert any(a < down for a in at), context
    assert any(a > down for a in at), context
    # The 20 s lease outlived the outage: nothing was taken over and no phase ran again.
    assert (report.re_executions, report.recoveries) == (0, 0), context
    assert report.unfinished == report.lost_results == [], context
    assert len(stopped) == 2
    for pid, (code, stderr) in stopped.items():
        assert code == 0, (pid, code, stderr)
        assert unexpected_output(stderr, outage=True) == [], (pid, code, stderr)


# -- the checks catch what they claim to ---------------------------------------------------------


class TestChecks:
    """Each check of :func:`verify` catches the violation it is there for."""

    @pytest.fixture
    def session(self, postgres_schema, pg_journal, side):
        """Ten runs run to their end in-process, their executions recorded."""
        journal = pg_journal
        engine = Engine(SPEC, handlers=Recorder(side).handlers, journal=journal, lease_ttl=5.0)
        rng = random.Random(7)
        inputs = {}
        for index in range(10):
            run_input = make_input(rng)
            run_input["work_ms"] = dict.fromkeys(run_input["work_ms"], 0)
            inputs[engine.start(run_input, run_id=f"r{index:02d}")] = run_input
        assert engine.work(exit_when_idle=True) == 10
        engine.close()
        return journal, side, inputs, postgres_schema

    @staticmethod
    def check(journal, side, inputs) -> Report:
        return verify(journal, side.all(), inputs)

    @staticmethod
    def first(side: Executions) -> Execution:
        return side.all()[0]

    @staticmethod
    def insert(side, schema, e: Execution, **changes: Any) -> None:
        row = {**e.__dict__, "id": os.urandom(8).hex(), **changes}
        side.execute(
            sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                sql.Identifier(schema, "executions"),
                sql.SQL(", ").join(map(sql.Identifier, row)),
                sql.SQL(", ").join(sql.Placeholder() * len(row)),
            ),
            list(row.values()),
        )

    def test_a_clean_session_passes(self, session):
        journal, side, inputs, _ = session
        report = self.check(journal, side, inputs)
        assert report.problems == []
        assert report.executions == report.transitions - len(inputs)
        assert (report.re_executions, report.recoveries) == (0, 0)

    def test_a_wrong_end_is_caught(self, session):
        journal, side, inputs, _ = session
        run_id = next(r for r, i in inputs.items() if i["outcome"] == "published")
        inputs[run_id] = {**inputs[run_id], "outcome": "failed"}
        problems = self.check(journal, side, inputs).problems
        assert any(f"run {run_id}: ended published" in p for p in problems), problems
        assert any(f"run {run_id}: journaled path" in p for p in problems), problems

    def test_a_phase_run_again_after_its_transition_is_caught(self, session):
        journal, side, inputs, schema = session
        e = self.first(side)
        self.insert(side, schema, e, lease_token=e.lease_token + 1)
        problems = self.check(journal, side, inputs).problems
        assert any("ran again after its transition was journaled" in p for p in problems)

    def test_a_journaled_result_without_its_execution_is_caught(self, session):
        journal, side, inputs, schema = session
        e = self.first(side)
        table = sql.Identifier(schema, "executions")
        side.execute(
            sql.SQL("UPDATE {} SET finished_at = NULL WHERE id = %s").format(table), (e.id,)
        )
        problems = self.check(journal, side, inputs).problems
        assert any(f"run {e.run_id} seq 1: 1 execution(s)" in p for p in problems), problems
        side.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(table), (e.id,))
        problems = self.check(journal, side, inputs).problems
        assert any(f"run {e.run_id} seq 1: 0 execution(s)" in p for p in problems), problems

    def test_an_execution_of_a_visit_never_journaled_is_caught(self, session):
        journal, side, inputs, schema = session
        self.insert(side, schema, self.first(side), visit_seq=99)
        problems = self.check(journal, side, inputs).problems
        assert any("visits the journal never left" in p for p in problems), problems

    def test_two_workers_under_one_lease_token_are_caught(self, session):
        journal, side, inputs, schema = session
        e = self.first(side)
        self.insert(side, schema, e, state="building", visit_seq=e.visit_seq + 1, pid=1)
        problems = self.check(journal, side, inputs).problems
        assert any("lease tokens used by more than one worker" in p for p in problems)

    def test_earlier_executions_are_counted_not_flagged(self, session):
        journal, side, inputs, schema = session
        e = self.first(side)
        for table in ("transitions", "runs", "executions"):
            side.execute(
                sql.SQL("UPDATE {} SET lease_token = lease_token + 2 WHERE run_id = %s").format(
                    sql.Identifier(schema, table)
                ),
                (e.run_id,),
            )
        journal._connection.call(  # private: the run's digests (schema 9) as of this history
            lambda conn: fill_digests(conn, run_id=e.run_id)
        )
        # Killed inside the phase (never finished), then cut off after it (fenced out).
        self.insert(side, schema, e, finished_at=None, worker="w1", pid=1)
        self.insert(side, schema, e, lease_token=e.lease_token + 1, worker="w2", pid=2)
        report = self.check(journal, side, inputs)
        assert report.problems == []
        assert report.re_executions == 2
        assert [x.worker for x in report.unfinished] == ["w1"]
        assert [x.worker for x in report.lost_results] == ["w2"]
        assert list(report.re_executed) == [(e.run_id, e.state, e.visit_seq)]
