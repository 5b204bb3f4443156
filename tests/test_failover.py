"""Failover in about a second: a SIGKILLed worker's run is taken over by another worker before
its lease expires (``Engine.work(takeover_dead=True)``), fenced as any takeover; a live worker's
slow phase is never taken over; and ``fsm-runner worker`` stops cleanly on SIGTERM and SIGINT.

Real ``fsm-runner worker`` processes on a real SQLite file (one host: the dead worker's pid) and
a real PostgreSQL journal (two "hosts": workers in process groups of their own whose worker ids
name different hosts, so only the dead worker's database session tells it is gone). The app is
``tests/failover_app.py``: its phase logs each call and blocks until the test releases it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

from fsm_runner import Engine, RunLifecycle, SqliteJournal
from fsm_runner.exceptions import LeaseLostError
from fsm_runner.records import utc_now
from fsm_runner.rules.reducer import take
from tests.failover_app import SPEC, slow
from tests.test_postgres_workers import wait_for, worker_command

ROOT = Path(__file__).parents[1]
APP = "tests.failover_app:make_engine"
TIMEOUT = 60.0  # seconds any one wait may take (never reached when green)
LEASE_TTL = 30.0  # long: a takeover before it expires can only be the dead worker's

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX processes and signals"),
]


class Workers:
    """``fsm-runner worker`` processes of the failover app on one journal."""

    def __init__(self, tmp_path: Path, journal: str, *, ttl: float = LEASE_TTL) -> None:
        self.dir = tmp_path
        self.ttl = ttl
        self.journal = journal
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        (self.dir / "release").touch()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def spawn(self, *, host: str | None = None, options: tuple[str, ...] = ()):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "FSM_FAILOVER_DIR": str(self.dir),
            "FSM_FAILOVER_LEASE_TTL": str(self.ttl),
            "PYTHONFAULTHANDLER": "1",  # a SIGABRT prints every thread's stack (see stop)
        }
        if host is not None:
            env["FSM_FAILOVER_HOST"] = host
        index = len(self.procs)
        out, err = self.dir / f"worker-{index}.out", self.dir / f"worker-{index}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(
                [*worker_command(), "--journal", self.journal, "worker", "--app", APP, *options],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # a process group of its own
            )
        self.procs.append(proc)
        return proc

    def stop(self, proc, signum: int) -> int:
        """Send ``signum`` and wait for the exit code; a worker that hangs fails with its stacks."""
        proc.send_signal(signum)
        try:
            return proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler dumps each thread's stack to stderr
            proc.wait()
            pytest.fail(f"worker {proc.pid} hung after {signum!r}:\n{self.output(proc)[1]}")

    def lines(self, kind: str) -> list[list[str]]:
        calls = self.dir / "calls"
        if not calls.exists():
            return []
        text = calls.read_text(encoding="utf-8")
        return [line.split() for line in text.splitlines() if line.startswith(kind + " ")]

    def calls_by(self, proc) -> list[float]:
        return [float(at) for _, pid, _, at in self.lines("call") if int(pid) == proc.pid]

    def ready(self, proc) -> bool:
        return any(int(pid) == proc.pid for _, pid in self.lines("ready"))

    def output(self, proc) -> tuple[str, str]:
        index = self.procs.index(proc)
        return tuple(
            (self.dir / f"worker-{index}.{part}").read_text(errors="replace")
            for part in ("out", "err")
        )


def start_run(journal) -> str:
    engine = Engine(SPEC, handlers={"slow": slow}, journal=journal)
    return engine.start()


def assert_late_commit_refused(journal, left_behind) -> None:
    """The dead holder's commit, written now under its old token, is refused and writes nothing."""
    transition, after = take(
        SPEC, left_behind, "DONE", "done", result=None, duration_ms=0.0, at=utc_now()
    )
    before = journal.transitions(left_behind.run_id)
    with pytest.raises(LeaseLostError):
        journal.commit(after, transition)
    assert journal.transitions(left_behind.run_id) == before


def failover(tmp_path: Path, journal, location: str, hosts: tuple[str | None, str | None]) -> None:
    """Kill the worker in the run's phase; the other takes it over before the lease expires."""
    run_id = start_run(journal)
    with Workers(tmp_path, location) as workers:
        victim = workers.spawn(host=hosts[0])
        wait_for(lambda: workers.calls_by(victim), "the first worker in the phase")
        survivor = workers.spawn(host=hosts[1])
        wait_for(lambda: workers.ready(survivor), "the second worker to start")
        # A live worker's slow phase is left alone: three looks at the leases later, still one call.
        time.sleep(1.5)
        assert workers.calls_by(survivor) == []
        left_behind = journal.load(run_id)
        assert left_behind.lease_owner is not None
        assert left_behind.lease_token == 1
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=TIMEOUT) == -signal.SIGKILL
        (again,) = wait_for(lambda: workers.calls_by(survivor), "the takeover")
        expires = left_behind.lease_expires_at
        assert expires is not None
        assert again < expires.timestamp()  # before the dead worker's lease expired
        held = journal.load(run_id)
        assert (held.lease_token, held.recoveries) == (2, 1)
        assert held.lease_owner not in (None, left_behind.lease_owner)
        assert_late_commit_refused(journal, left_behind)
        (tmp_path / "release").touch()
        wait_for(lambda: journal.load(run_id).status is RunLifecycle.SUCCEEDED, "the run to end")
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(timeout=TIMEOUT) == 0, workers.output(survivor)
    transitions = journal.transitions(run_id)
    assert [(t.to_state, t.lease_token) for t in transitions] == [("slow", 0), ("done", 2)]


def test_sqlite_a_killed_workers_run_is_taken_over_before_its_lease_expires(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        failover(tmp_path, journal, str(path), (None, None))


def test_postgres_a_worker_whose_session_ended_is_taken_over_at_once(
    tmp_path, postgres_server, postgres_schema
):
    from fsm_runner.journal.postgres import PostgresJournal

    url = postgres_server.url
    location = f"{url}{'&' if '?' in url else '?'}schema={urllib.parse.quote(postgres_schema)}"
    with PostgresJournal(url, schema=postgres_schema) as journal:
        settle_after_a_restart(url)
        failover(tmp_path, journal, location, ("host-a", "host-b"))


def settle_after_a_restart(url: str) -> None:
    """Wait until the server has been up for a lease TTL: no session is taken for gone before
    (a restart ends them all; the live take their locks again within their heartbeat)."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT extract(epoch FROM now() - pg_postmaster_start_time())")
        (up,) = row.fetchone()
    time.sleep(max(0.0, LEASE_TTL + 1 - float(up)))


def test_takeover_off_leaves_a_dead_workers_run_until_its_lease_expires(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        run_id = start_run(journal)
        journal.claim(run_id, "elsewhere:1:x", ttl=LEASE_TTL)  # a live holder elsewhere
        with Workers(tmp_path, str(path)) as workers:
            victim = workers.spawn(options=("--no-takeover-dead",))
            wait_for(lambda: workers.ready(victim), "the worker to start")
            time.sleep(1.5)
            assert workers.lines("call") == []
            assert journal.load(run_id).lease_owner == "elsewhere:1:x"


@pytest.mark.every_python  # how each Python delivers SIGINT and SIGTERM to the worker's loop
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_idle_worker_stops_cleanly(tmp_path, signum):
    if signum == signal.SIGINT and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # (pytest started as a script's background job: its children ignore SIGINT, as Python
        # leaves a SIGINT ignored at its start ignored; the worker would wait on for ever)
        pytest.skip("SIGINT is ignored in this process, so in the worker too")
    path = tmp_path / "journal.db"
    SqliteJournal(path).close()
    with Workers(tmp_path, str(path)) as workers:
        proc = workers.spawn()
        wait_for(lambda: workers.ready(proc), "the worker to start")
        time.sleep(0.3)  # inside its idle wait
        assert workers.stop(proc, signum) == 0
        out, err = workers.output(proc)
    name = signal.Signals(signum).name if signum == signal.SIGTERM else "Ctrl-C"
    (line,) = out.splitlines()
    assert line.startswith("worker ")
    assert line.endswith(f"stopped by {name}; any run in progress released")
    assert err == ""


@pytest.mark.every_python
def test_a_busy_worker_stopped_releases_its_run(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        run_id = start_run(journal)
        with Workers(tmp_path, str(path)) as workers:
            busy = workers.spawn(options=("--no-takeover-dead",))
            wait_for(lambda: workers.calls_by(busy), "the worker in the phase")
            assert workers.stop(busy, signal.SIGTERM) == 0, workers.output(busy)
            stopped = journal.load(run_id)
            assert (stopped.status, stopped.lease_owner) == (RunLifecycle.ACTIVE, None)
            # The next worker takes it at once (no takeover of a dead worker: none is needed).
            after = workers.spawn(options=("--no-takeover-dead",))
            wait_for(lambda: workers.calls_by(after), "the next worker in the phase")
            assert journal.load(run_id).recoveries == 0
            (tmp_path / "release").touch()
            wait_for(lambda: journal.load(run_id).status is RunLifecycle.SUCCEEDED, "the run")
        out, err = workers.output(busy)
    assert out.splitlines()[-1].endswith("stopped by SIGTERM; any run in progress released")
    assert "Traceback" not in err
