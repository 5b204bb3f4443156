"""Acceptance (issue 29): durable waits with real worker processes, on SQLite and PostgreSQL.

Three worker processes (``python -m tests.waits_app work JOURNAL``: ``Engine.work`` on a real
SQLite file, or on a PostgreSQL schema of the test's own) share one journal; the test starts
runs of ``tests/waits_app.py``'s machine (preparing → awaiting, a waiting state → applying or
expiring) and SIGKILLs workers where it says. Every phase execution is logged by the handler
(``O_APPEND``) with its process and lease token, so "ran once" is counted, not assumed.

What each test checks is the engine's contract: a wait's ``TIMEOUT`` is journaled exactly once
(seqs gapless, one terminal transition, last); a phase runs at least once per journaled visit —
again after its worker was killed inside it, under the next lease token, and never otherwise;
a parked run holds no lease; a signal is consumed once, in arrival order, whenever it came.
No assertion is about how long anything took (deadlines are generous, for a loaded machine).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fsm_runner import Engine, SignalStatus, SqliteJournal
from fsm_runner.journal._postgres_chain import fill_digests as fill_postgres_digests
from fsm_runner.journal._sqlite_chain import fill_digests
from fsm_runner.records import format_utc
from tests.test_postgres_workers import wait_for
from tests.waits_app import HANDLERS, MACHINE, spec

ROOT = Path(__file__).parents[1]
TIMEOUT = 60.0  # seconds any one wait may take before the test gives up (never reached when green)
LEASE_TTL = 1.5
HEARTBEAT = 0.25
WORKERS = 3
THIRTY_DAYS = 30 * 86_400.0
T = TypeVar("T")

pytestmark = [
    pytest.mark.slow,
    # a group of its own: its tests one at a time (each starts three workers), beside the
    # "processes" group's on the other worker rather than after them
    pytest.mark.xdist_group("waits-processes"),
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX processes and signals"),
]


# -- the journal: a SQLite file or a PostgreSQL schema ---------------------------------------------


@dataclasses.dataclass
class Store:
    """The test's journal, where the workers find it, and how its stored times are aged."""

    kind: str
    location: str  # what the workers open
    journal: Any  # the test's own connection
    age: Callable[[str, dt.timedelta], None]


def _age_sqlite(path: Path, journal: SqliteJournal) -> Callable[[str, dt.timedelta], None]:
    def age(run_id: str, by: dt.timedelta) -> None:
        """Move the run's current visit's entry, its row's time and its wake time back by ``by``.

        SQLite stores times as the ISO text ``format_utc`` writes; the wake time's column is
        whichever column of ``run_rows`` is named for it (read from the schema).
        """
        run = journal.load(run_id)
        (entered,) = journal.transitions(run_id, from_seq=run.visit_seq, to_seq=run.visit_seq)
        wake = journal.wake_time(run_id)
        assert wake is not None, "the run has no wake time to age"
        conn = sqlite3.connect(path, timeout=30, isolation_level=None)
        try:
            columns = [row[1] for row in conn.execute("PRAGMA table_info(run_rows)")]
            (wake_column,) = [c for c in columns if "wake" in c]
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "UPDATE transitions SET at = ? WHERE run_id = ? AND seq = ?",
                (format_utc(entered.at - by), run_id, run.visit_seq),
            )
            conn.execute(
                f"UPDATE run_rows SET {wake_column} = ?, updated_at = ? WHERE run_id = ?",
                (format_utc(wake - by), format_utc(entered.at - by), run_id),
            )
            # The aged times as if written so: the run's digests computed again (a claim
            # verifies its head transition, whose time this moved).
            (key,) = conn.execute("SELECT run_key FROM run_rows WHERE run_id = ?", (run_id,))
            fill_digests(conn, run_key=key[0], run_id=run_id)
            conn.execute("COMMIT")
        finally:
            conn.close()

    return age


def _age_postgres(url: str, schema: str, journal: Any) -> Callable[[str, dt.timedelta], None]:
    import psycopg
    from psycopg import sql

    def age(run_id: str, by: dt.timedelta) -> None:
        """Move the run's current visit's entry, its row's time and its wake time back by ``by``."""
        run = journal.load(run_id)
        with psycopg.connect(url, connect_timeout=5) as conn, conn.transaction():
            conn.execute(
                sql.SQL("UPDATE {} SET at = at - %s WHERE run_id = %s AND seq = %s").format(
                    sql.Identifier(schema, "transitions")
                ),
                (by, run_id, run.visit_seq),
            )
            conn.execute(
                sql.SQL(
                    "UPDATE {} SET wake_at = wake_at - %s, updated_at = updated_at - %s"
                    " WHERE run_id = %s"
                ).format(sql.Identifier(schema, "runs")),
                (by, by, run_id),
            )
            # The aged times as if written so: the run's digests computed again (a claim
            # verifies its head transition, whose time this moved).
            conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
            fill_postgres_digests(conn, run_id=run_id)

    return age


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path) -> Iterator[Store]:
    """An empty journal: a SQLite file, or a PostgreSQL schema of this test's own."""
    if request.param == "sqlite":
        path = tmp_path / "journal.db"
        journal = SqliteJournal(path)
        yield Store("sqlite", str(path), journal, _age_sqlite(path, journal))
        journal.close()
        return
    from fsm_runner.journal.postgres import PostgresJournal

    server = request.getfixturevalue("postgres_server")
    schema = request.getfixturevalue("postgres_schema")
    journal = PostgresJournal(server.url, schema=schema)  # creates the schema, once
    separator = "&" if "?" in server.url else "?"
    location = f"{server.url}{separator}schema={urllib.parse.quote(schema)}"
    yield Store("postgres", location, journal, _age_postgres(server.url, schema, journal))
    journal.close()


# -- the worker processes -------------------------------------------------------------------------


class Workers:
    """``tests.waits_app`` worker processes on one journal; whatever is left is killed at exit."""

    def __init__(
        self,
        tmp_path: Path,
        store: Store,
        *,
        timeout: float | None,
        hold: str | None = None,
        idle_wait: float = 0.2,
    ) -> None:
        self.tmp_path = tmp_path
        self.store = store
        self.log = tmp_path / "handlers.log"
        self.log.touch()
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("FSM_WAITS_") and k != "PYTHONWARNINGS"
        }
        self.env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            FSM_WAITS_LOG=str(self.log),
            FSM_WAITS_DIR=str(tmp_path),
            FSM_WAITS_TIMEOUT="none" if timeout is None else repr(timeout),
            FSM_WAITS_LEASE_TTL=str(LEASE_TTL),
            FSM_WAITS_HEARTBEAT=str(HEARTBEAT),
            FSM_WAITS_IDLE=str(idle_wait),
        )
        if hold is not None:
            self.env["FSM_WAITS_HOLD"] = hold
        self.procs: list[subprocess.Popen[bytes]] = []
        self.outputs: dict[int, Path] = {}
        self.stop_codes: dict[int, int] = {}  # what each exits with on SIGTERM

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def spawn(self, count: int = WORKERS, *, cli: bool = False) -> list[subprocess.Popen[bytes]]:
        """Start ``count`` workers and wait until each is up (its engine built, about to work).

        With ``cli``, ``fsm-runner worker --app tests.waits_app:make_engine`` processes; else
        ``python -m tests.waits_app work`` (``Engine.work``, the journal able to hold).
        """
        if cli:
            idle = self.env["FSM_WAITS_IDLE"]
            argv = [*fsm_runner_command(), "--journal", self.store.location, "worker"]
            argv += ["--app", "tests.waits_app:make_engine", "--idle-wait", idle]
        else:
            argv = [sys.executable, "-m", "tests.waits_app", "work", self.store.location]
        started = []
        for _ in range(count):
            output = self.tmp_path / f"worker-{len(self.procs)}.out"
            with output.open("wb") as out:
                proc = subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            self.procs.append(proc)
            self.outputs[proc.pid] = output
            self.stop_codes[proc.pid] = 0  # a clean stop: exit 0, the CLI too (one line)
            started.append(proc)
        pids = {proc.pid for proc in started}
        self.wait_for(
            lambda: pids <= {int(w[1]) for w in self.logged() if w[0] == "up"}, "workers up"
        )
        return started

    def wait_for(self, check: Callable[[], T | None], what: str) -> T:
        """:func:`wait_for`, failing at once (with their output) if a worker dies unasked."""

        def checked() -> T | None:
            self.live()
            return check()

        try:
            return wait_for(checked, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.output()}") from None

    def live(self) -> list[subprocess.Popen[bytes]]:
        """The workers not exited (yet)."""
        for proc in self.procs:
            if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
                raise AssertionError(
                    f"worker {proc.pid} exited {proc.returncode}:\n{self.output()}"
                )
        return [proc for proc in self.procs if proc.poll() is None]

    def kill(self, pid: int) -> None:
        """SIGKILL the worker ``pid`` and reap it."""
        (proc,) = [proc for proc in self.procs if proc.pid == pid]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL

    def stop(self) -> None:
        """SIGTERM the live workers (a clean stop) and wait for each to exit as it should."""
        live = self.live()
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        for proc in live:
            assert proc.wait(timeout=TIMEOUT) == self.stop_codes[proc.pid], self.output()

    def output(self) -> str:
        """Every worker's output, for failure messages."""
        return "\n".join(
            f"--- worker {pid}:\n{path.read_text(errors='replace')[-4000:]}"
            for pid, path in self.outputs.items()
        )

    def logged(self) -> list[tuple[str, ...]]:
        """The handlers' log: one tuple of words per line, in order."""
        return [tuple(line.split()) for line in self.log.read_text(encoding="utf-8").splitlines()]

    def executions(self, run_id: str, phase: str) -> list[tuple[int, int]]:
        """(pid, lease token) of each execution of ``phase`` in ``run_id``, in order."""
        return [
            (int(words[2]), int(words[3]))
            for words in self.logged()
            if words[0] == phase and words[1] == run_id
        ]


def fsm_runner_command() -> list[str]:
    """The installed ``fsm-runner`` console script, or the CLI module through this Python."""
    beside = Path(sys.executable).with_name("fsm-runner")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "fsm_runner.cli"]


def start_runs(store: Store, timeout: float | None, count: int = 1) -> list[str]:
    """Start ``count`` runs (unleased, in ``preparing``) from the test process."""
    engine = Engine(spec(timeout), handlers=HANDLERS, journal=store.journal)
    try:
        return [engine.start() for _ in range(count)]
    finally:
        engine.close()


def ended(store: Store, run_id: str) -> bool:
    return store.journal.load(run_id).ended


def parked(store: Store, run_id: str) -> bool:
    run = store.journal.load(run_id)
    return run.state == "awaiting" and run.lease_owner is None


def history(store: Store, run_id: str) -> list[str]:
    """The run's events, after checking its seqs are gapless and it ended once, last."""
    run = store.journal.load(run_id)
    transitions = store.journal.transitions(run_id)
    assert [t.seq for t in transitions] == list(range(len(transitions))), transitions
    assert run.seq == transitions[-1].seq
    final = {"done", "expired", "failed"}
    assert [t.to_state in final for t in transitions].count(True) == 1, transitions
    assert transitions[-1].to_state in final
    assert transitions[-1].to_state == run.state
    return [t.event for t in transitions]


def send_signal(
    store: Store, run_id: str, name: str, payload: Any = None, *, signal_id: str | None = None
):
    """Send a signal from this process (``Engine.signal``, as an app would)."""
    engine = Engine(spec(None), handlers=HANDLERS, journal=store.journal)
    try:
        return engine.signal(run_id, name, payload, signal_id=signal_id)
    finally:
        engine.close()


def cli_has_signal() -> bool:
    from fsm_runner.cli import cli

    return "signal" in getattr(cli, "commands", {})


def send_signal_cli(
    store: Store, run_id: str, name: str, payload: Any = None, *, signal_id: str | None = None
) -> None:
    """Send a signal with ``fsm-runner signal`` in a process of its own (as an operator would)."""
    argv = [*fsm_runner_command(), "--journal", store.location, "signal"]
    argv += [run_id, name]
    if payload is not None:
        argv += ["--data", json.dumps(payload)]
    if signal_id is not None:
        argv += ["--id", signal_id]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- a wait's timeout ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("store", "via"),
    [("sqlite", "engine"), ("postgres", "engine"), ("sqlite", "cli")],  # the CLI: one journal
    indirect=["store"],
)
def test_a_two_second_wait_times_out_exactly_once_with_three_workers_racing(store, tmp_path, via):
    """Three workers (``Engine.work``, or ``fsm-runner worker``) race for three runs' deadlines."""
    with Workers(tmp_path, store, timeout=2.0) as workers:
        workers.spawn(cli=via == "cli")
        run_ids = start_runs(store, 2.0, count=3)
        for run_id in run_ids:
            workers.wait_for(lambda run_id=run_id: ended(store, run_id), "the runs to time out")
        assert len(workers.live()) == WORKERS
        workers.stop()
    for run_id in run_ids:
        assert history(store, run_id) == ["STARTED", "PREPARED", "TIMEOUT", "EXPIRED"]
        transitions = store.journal.transitions(run_id)
        assert transitions[2].at - transitions[1].at >= dt.timedelta(seconds=2)  # not early
        assert store.journal.load(run_id).state == "expired"
        assert len(workers.executions(run_id, "preparing")) == 1
        assert len(workers.executions(run_id, "expiring")) == 1  # the phase after it: once
        assert store.journal.wake_time(run_id) is None


@pytest.mark.parametrize(
    ("store", "where"),
    [("sqlite", "waking"), ("postgres", "waking"), ("sqlite", "expiring")],
    indirect=["store"],
)
def test_kill_9_of_the_worker_waking_it_still_times_out_exactly_once(store, tmp_path, where):
    """SIGKILL the worker that claimed the due run: before it journaled the ``TIMEOUT``
    (``waking``: inside the journal's commit) or in the phase after it (``expiring``).

    The survivors take the run over once the lease expires. Exactly one ``TIMEOUT``; the
    phase after it ran once, or — killed inside it — twice: the killed execution under the
    ``TIMEOUT``'s lease token and one under the next (at least once per journaled visit).
    """
    with Workers(tmp_path, store, timeout=2.0, hold=where) as workers:
        workers.spawn()
        (run_id,) = start_runs(store, 2.0)
        marker = "waking" if where == "waking" else "held"
        holder = workers.wait_for(
            lambda: [w for w in workers.logged() if w[0] == marker and w[1] == run_id],
            f"a worker to hold the run ({where})",
        )[0]
        victim, victim_token = int(holder[2]), int(holder[3])
        workers.kill(victim)
        workers.wait_for(lambda: ended(store, run_id), "a survivor to finish the run")
        assert len(workers.live()) == WORKERS - 1
        workers.stop()
    assert history(store, run_id) == ["STARTED", "PREPARED", "TIMEOUT", "EXPIRED"]
    run = store.journal.load(run_id)
    transitions = store.journal.transitions(run_id)
    timeout, expired = transitions[2], transitions[3]
    assert run.recoveries == 1  # taken over once, after the kill
    expiring = workers.executions(run_id, "expiring")
    if where == "waking":  # killed before writing it: the survivor journaled the TIMEOUT
        assert timeout.lease_token == expired.lease_token == victim_token + 1
        assert len(expiring) == 1
        assert expiring[0][0] != victim
    else:  # killed in the phase after it: that phase ran again, under the next token
        assert timeout.lease_token == victim_token
        assert expired.lease_token == victim_token + 1
        assert expiring[0] == (victim, victim_token)
        assert len(expiring) == 2
        assert expiring[1][0] != victim
        assert expiring[1][1] == victim_token + 1


def test_a_thirty_day_wait_times_out_exactly_once_with_three_workers(store, tmp_path):
    """A wait of 30 days, under a fake clock: the JOURNAL is aged, the clocks are real.

    What is faked: once the run is parked, the ``at`` of the transition that entered the wait
    (and the run row's ``updated_at``) and the run's stored wake time are moved back 30 days
    (and a second), by SQL on the SQLite file / PostgreSQL tables — as if 30 days had passed.
    The workers' clocks (the engine's deadline, SQLite's claim: Python's ``utc_now``) and the
    PostgreSQL server's (its claims and wake times) are untouched: nothing in any process is
    patched. Before the ageing, the run is parked with its wake time 30 days ahead, and the
    workers leave it alone.
    """
    with Workers(tmp_path, store, timeout=THIRTY_DAYS) as workers:
        workers.spawn()
        (run_id,) = start_runs(store, THIRTY_DAYS)
        workers.wait_for(lambda: parked(store, run_id), "the run to park")
        entered = store.journal.transitions(run_id)[-1]
        assert entered.to_state == "awaiting"
        wake = store.journal.wake_time(run_id)
        assert wake is not None
        assert abs(wake - (entered.at + dt.timedelta(days=30))) < dt.timedelta(seconds=1)
        time.sleep(2 * 0.2)  # a few idle polls of every worker: it is not due
        assert parked(store, run_id)
        assert store.journal.load(run_id).seq == 1
        store.age(run_id, dt.timedelta(days=30, seconds=1))
        workers.wait_for(lambda: ended(store, run_id), "the run to time out")
        assert len(workers.live()) == WORKERS
        workers.stop()
    assert history(store, run_id) == ["STARTED", "PREPARED", "TIMEOUT", "EXPIRED"]
    transitions = store.journal.transitions(run_id)
    aged_entry = entered.at - dt.timedelta(days=30, seconds=1)
    assert abs(transitions[1].at - aged_entry) < dt.timedelta(milliseconds=1)
    assert transitions[2].result["output"]["deadline"] == format_utc(
        transitions[1].at + dt.timedelta(days=30)
    )
    assert len(workers.executions(run_id, "expiring")) == 1


# -- signals ---------------------------------------------------------------------------------------


def test_a_parked_run_survives_every_worker_killed_and_continues_on_a_signal(store, tmp_path):
    """Park a run; SIGKILL all three workers; start three more (``fsm-runner worker``, this
    time); the lease stays free all along.

    The signal then comes (``fsm-runner signal`` in a process of its own when the CLI has the
    command, else ``Engine.signal`` from the test process) and a new worker runs the next phase.
    """
    with Workers(tmp_path, store, timeout=None) as workers:
        first = {proc.pid for proc in workers.spawn()}
        (run_id,) = start_runs(store, None)
        workers.wait_for(lambda: parked(store, run_id), "the run to park")
        seen = []

        def look() -> None:
            run = store.journal.load(run_id)
            seen.append((run.state, run.seq, run.lease_owner, run.lease_token))

        look()
        token = seen[0][3]
        for pid in sorted(first):
            workers.kill(pid)
            look()
        assert workers.live() == []
        second = {proc.pid for proc in workers.spawn(cli=True)}
        look()
        until = time.monotonic() + 2 * LEASE_TTL  # the new workers poll, many times
        while time.monotonic() < until:
            look()
            time.sleep(0.02)
        assert set(seen) == {("awaiting", 1, None, token)}, seen  # nobody held it, ever
        assert store.journal.signals(run_id) == []
        if cli_has_signal():
            send_signal_cli(store, run_id, "APPROVE", {"by": "ops"}, signal_id="ops-1")
        else:
            send_signal(store, run_id, "APPROVE", {"by": "ops"}, signal_id="ops-1")
        workers.wait_for(lambda: ended(store, run_id), "the run to continue and end")
        assert len(workers.live()) == WORKERS
        workers.stop()
    assert history(store, run_id) == ["STARTED", "PREPARED", "APPROVE", "APPLIED"]
    (sent,) = store.journal.signals(run_id)
    assert (sent.status, sent.consumed_seq, sent.payload) == (
        SignalStatus.CONSUMED,
        2,
        {"by": "ops"},
    )
    assert store.journal.transitions(run_id)[2].result == {
        "output": {"by": "ops"},
        "signal": sent.number,
    }
    (applied,) = workers.executions(run_id, "applying")
    assert applied[0] in second


def test_signals_sent_before_the_run_waits_are_consumed_once_in_order(store, tmp_path):
    """While a worker process runs ``preparing``, two signals come (and a duplicate of the
    first's ``signal_id``): the run consumes the first when it reaches ``awaiting``, goes back
    to ``preparing``, and consumes the second the next time; the duplicate changes nothing,
    then or after the run ended (sent again from another process: the CLI, when it has the
    command).
    """
    with Workers(tmp_path, store, timeout=None, hold="preparing") as workers:
        workers.spawn()
        (run_id,) = start_runs(store, None)
        held = workers.wait_for(
            lambda: [w for w in workers.logged() if w[0] == "held" and w[1] == run_id],
            "a worker inside preparing",
        )[0]
        reject = send_signal(store, run_id, "REJECT", {"n": 1}, signal_id="first")
        approve = send_signal(store, run_id, "APPROVE", {"n": 2}, signal_id="second")
        again = send_signal(store, run_id, "APPROVE", {"n": 3}, signal_id="first")
        assert reject.status is approve.status is SignalStatus.PENDING
        assert reject.number < approve.number
        assert again == reject
        run = store.journal.load(run_id)
        assert (run.state, run.seq, run.lease_owner is not None) == ("preparing", 0, True)
        (tmp_path / "open").touch()
        workers.wait_for(lambda: ended(store, run_id), "the run to end")
        if cli_has_signal():
            send_signal_cli(store, run_id, "REJECT", {"n": 4}, signal_id="first")
        else:
            send_signal(store, run_id, "REJECT", {"n": 4}, signal_id="first")
        assert send_signal(store, run_id, "REJECT", signal_id="second").number == approve.number
        assert len(workers.live()) == WORKERS
        workers.stop()
    events = history(store, run_id)
    assert events == ["STARTED", "PREPARED", "REJECT", "PREPARED", "APPROVE", "APPLIED"]
    signals = store.journal.signals(run_id)
    assert [(s.number, s.name, s.signal_id, s.payload) for s in signals] == [
        (reject.number, "REJECT", "first", {"n": 1}),
        (approve.number, "APPROVE", "second", {"n": 2}),
    ]
    assert [(s.status, s.consumed_seq) for s in signals] == [
        (SignalStatus.CONSUMED, 2),
        (SignalStatus.CONSUMED, 4),
    ]
    transitions = store.journal.transitions(run_id)
    assert transitions[2].result == {"output": {"n": 1}, "signal": reject.number}
    assert transitions[4].result == {"output": {"n": 2}, "signal": approve.number}
    preparing = workers.executions(run_id, "preparing")
    assert len(preparing) == 2  # once a visit
    assert preparing[0] == (int(held[2]), int(held[3]))
    assert len(workers.executions(run_id, "applying")) == 1


# -- what a killed waker leaves behind, in one process, on every journal ---------------------------


def test_a_due_run_whose_waker_died_before_its_timeout_is_taken_over_by_work(
    journal, tmp_path, monkeypatch
):
    """The state ``kill -9`` of the worker waking a run leaves (the ``waking`` test above), made
    in one process on every journal: a worker claimed the run once its deadline passed
    (``claim_next``), then died before journaling the ``TIMEOUT`` — its lease expires. Another
    worker's ``Engine.work`` must take the run over and time it out, once.
    """
    monkeypatch.setenv("FSM_WAITS_LOG", str(tmp_path / "handlers.log"))
    engine = Engine(spec(0.3), handlers=HANDLERS, journal=journal)
    try:
        run_id = engine.start()
        assert engine.run(run_id).state == "awaiting"
        wait_for(
            lambda: journal.wake_time(run_id) <= dt.datetime.now(dt.timezone.utc), "its deadline"
        )
        time.sleep(0.05)
        handled = ["preparing", "applying", "expiring"]
        claimed = wait_for(
            lambda: journal.claim_next("dead-waker", ttl=0.5, machine=MACHINE, states=handled),
            "the waker's claim of the due run",
        )
        assert claimed.run_id == run_id  # ... and the waker dies here, holding it
        wait_for(
            lambda: journal.load(run_id).lease_expires_at < dt.datetime.now(dt.timezone.utc),
            "expiry",
        )
        time.sleep(0.05)
        stop = threading.Event()
        threading.Timer(10, stop.set).start()  # a bound: it returns at once once it took the run
        taken = engine.work(stop=stop, max_runs=1, idle_wait=0.1)
        stop.set()
        assert taken == 1, (journal.load(run_id), journal.wake_time(run_id))
        run = journal.load(run_id)
        assert (run.state, run.recoveries) == ("expired", 1)
        events = [t.event for t in journal.transitions(run_id)]
        assert events == ["STARTED", "PREPARED", "TIMEOUT", "EXPIRED"]
    finally:
        engine.close()
