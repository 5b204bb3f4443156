"""Crash torture: worker processes SIGKILLed at random moments while they share one journal.

Used by ``tests/test_crash_torture.py`` (CI size) and ``tests/bench/bench_torture.py`` (any size).

The machine has six states in its main line — fetching → building → testing → signing →
publishing → published — plus two more terminals: testing may send the run back to building
(``REBUILD_REQUESTED``, so states are visited more than once) or to ``failed``, and signing may
refuse (``canceled``). What each phase returns and how long it takes is decided by the run's
input alone, so the driver knows every run's exact path in advance.

Every phase execution is recorded in a side table of the same SQLite file, ``executions``
(``run_id, state, visit_seq, lease_token, worker, pid, started_at, finished_at``): a row is
inserted when the phase starts and ``finished_at`` is set just before the handler returns, each in
its own short transaction. The driver (:func:`torture`) starts runs and keeps ``workers`` worker
processes alive, SIGKILLs a random ready worker at random moments and replaces it, stops some
workers (SIGSTOP) for longer than their lease and lets them go on (SIGCONT), and once done lets
the workers finish every run. Workers are forked by a fork server (``python -m tests.torture
zygote JOURNAL``, a subprocess that has imported everything once and forks a fresh worker
process on request), so replacing a killed worker costs milliseconds, not the half second of
CPU a new interpreter takes to import the library; each worker opens its own journal and
connections after the fork. ``python -m tests.torture worker JOURNAL`` runs one worker alone.

Workers drive runs one of two ways (``drive``). ``"sync"``: ``Engine.work`` claims runs one by
one and runs each. ``"async"`` (:class:`AsyncWorker`, async handlers: :class:`AsyncRecorder`):
rounds of ``arun`` of many runs at once (their steps group-committed, their claims grouped),
batches of the worker's own runs started by ``start_many(claim=True)``, and now and then runs of
a batch left undriven until ``Engine.close`` lets go of them (``release_many``); a worker
killed before that close leaves them to be taken over. Runs a worker started are read back
from the journal, each with its input (which alone decides its path), so they are checked as
the driver's are; a batch must be in the journal whole or not at all.

Then it checks (:func:`verify`):

1. every run reached its expected terminal state, by exactly the expected path of
   ``(from_state, event, to_state)`` (so nothing was lost, repeated, or dead-lettered);
2. per run, seqs are gapless from 0, and ``check_journal`` reports nothing (invariants 1, 2, 8,
   lease tokens never going back);
3. no completed phase executed twice (invariant 3). For each journaled transition leaving
   state S at visit V with lease token L: exactly one execution of (run, S, V) ran under
   token L and it finished (its result is what was journaled), and no execution of (run, S, V)
   ran under a token above L — a claim after the transition was journaled finds the run past
   S, and a claim before it would have fenced the transition out. Executions under tokens
   below L are the phase running again after its worker was killed (at-least-once); they are
   counted as ``re_executions``. Every execution belongs to a visit the journal has;
4. no run ever had two live holders (invariant 4): every lease token of a run was used by one
   worker only (one worker per ``(run_id, lease_token)`` among executions), and the tokens of
   a run's transitions never go back, so the writers of a run follow one another and never
   interleave; with 3, every transition was written by the one worker holding its token.
   A killed holder never writes again; a stopped one does once continued, and its commit
   must be refused (``fenced_out`` counts those refusals).

What fencing does not promise is not asserted, only counted: ``stale_starts`` are executions
that began (wall clock) after their visit's outgoing transition was journaled. That happens
only when a worker stalls for longer than its lease between claiming a run and calling the
handler, and its commit is then refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from fsm_runner import (
    Engine,
    JournalError,
    MachineSpec,
    RunEvent,
    RunLifecycle,
    RunTerminalError,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.exceptions import LeaseError, LeaseHeldError
from fsm_runner.replay import check_journal

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("fetching", "building", "testing", "signing", "publishing")
EDGES = {
    ("fetching", "FETCHED"): "building",
    ("building", "BUILT"): "testing",
    ("testing", "TESTS_PASSED"): "signing",
    ("testing", "TESTS_FAILED"): "failed",
    ("testing", "REBUILD_REQUESTED"): "building",
    ("signing", "SIGNED"): "publishing",
    ("signing", "SIGNING_REFUSED"): "canceled",
    ("publishing", "PUBLISHED"): "published",
}
SPEC = MachineSpec(
    "torture",
    [
        *(State(phase, handler=phase) for phase in PHASES),
        State("published", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="failed"),
    ],
    [
        *(Transition(src, event, dest) for (src, event), dest in EDGES.items()),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
    ],
)
#: Milliseconds a phase may take: mostly quick, sometimes long enough to be killed inside.
WORK_MS = (0, 0, 0, 0, 1, 3, 20, 150)
EXECUTIONS_DDL = """
CREATE TABLE IF NOT EXISTS executions (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    state TEXT NOT NULL,
    visit_seq INTEGER NOT NULL,
    lease_token INTEGER NOT NULL,
    worker TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL
)
"""
#: The batches of runs async workers started (``start_many``), recorded once it returned: the
#: batch's id (also in each of its runs' input), its run ids in the order of its inputs, and
#: how many of them (the last ones) the worker left undriven until its engine closed.
BATCHES_DDL = """
CREATE TABLE IF NOT EXISTS batches (
    batch TEXT PRIMARY KEY,
    run_ids TEXT NOT NULL,
    undriven INTEGER NOT NULL,
    worker TEXT NOT NULL
)
"""
BUSY_TIMEOUT = 60.0
#: The driver's own writes (starting runs) give up sooner: the lock may be held by a worker the
#: driver itself stopped, and only the driver can continue it.
STARTER_BUSY_TIMEOUT = 2.0
#: How workers drive runs: ``Engine.work`` (sync), or rounds of ``arun`` (see AsyncWorker).
#: ``"mixed"``: each worker process is one or the other, at random.
DRIVES = ("sync", "async", "mixed")


# -- the machine's behaviour, from the input alone ----------------------------------------------


def make_input(rng: random.Random) -> dict[str, Any]:
    """A run's input: its outcome, how often testing asks for a rebuild, each phase's duration."""
    return {
        "outcome": rng.choices(["published", "failed", "canceled"], weights=[6, 2, 2])[0],
        "rebuilds": rng.choice([0, 0, 0, 1, 2]),
        "work_ms": {phase: rng.choice(WORK_MS) for phase in PHASES},
    }


def decide(state: str, run_input: Mapping[str, Any], seq: int) -> str:
    """The event the phase of ``state`` returns, entered at ``seq`` (deterministic)."""
    if state == "fetching":
        return "FETCHED"
    if state == "building":
        return "BUILT"
    if state == "testing":
        rebuilds_done = (seq - 2) // 2  # testing is entered at seq 2, 4, 6 ...
        if rebuilds_done < run_input["rebuilds"]:
            return "REBUILD_REQUESTED"
        return "TESTS_FAILED" if run_input["outcome"] == "failed" else "TESTS_PASSED"
    if state == "signing":
        return "SIGNING_REFUSED" if run_input["outcome"] == "canceled" else "SIGNED"
    assert state == "publishing", state
    return "PUBLISHED"


def expected_path(run_input: Mapping[str, Any]) -> list[tuple[str | None, str, str]]:
    """The ``(from_state, event, to_state)`` of every transition the run must journal."""
    path: list[tuple[str | None, str, str]] = [(None, RunEvent.STARTED.value, "fetching")]
    state, seq = "fetching", 0
    while state in PHASES:
        event = decide(state, run_input, seq)
        dest = EDGES[(state, event)]
        path.append((state, event, dest))
        state, seq = dest, seq + 1
    return path


class Recorder:
    """Phase handlers that record each execution in the ``executions`` table of the journal file.

    A row is inserted when the phase starts (state, visit, the lease token it runs under, pid,
    wall-clock start); ``finished_at`` is set just before the handler returns. Each write is
    its own short transaction on the recorder's own connection.
    """

    def __init__(self, journal_path: str | os.PathLike[str], worker_id: str = "driver") -> None:
        self._conn = sqlite3.connect(journal_path, timeout=BUSY_TIMEOUT, isolation_level=None)
        # As the journal's own default durability: survives a killed process, fsyncs rarely.
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.execute(EXECUTIONS_DDL)
        self._conn.execute(BATCHES_DDL)
        self.worker_id = worker_id
        self.handlers = dict.fromkeys(PHASES, self.run_phase)

    def run_phase(self, ctx: Any) -> str:
        """Record the execution, take the input's time for this phase, return its event."""
        run = ctx.run
        row_id = self._began(run)
        work_ms = run.input["work_ms"][run.state]
        if work_ms:
            time.sleep(work_ms / 1000.0)
        return self._finished(run, row_id)

    def _began(self, run: Any) -> int:
        """Insert the execution's row as it starts; its id."""
        row = (run.run_id, run.state, run.visit_seq, run.lease_token, self.worker_id, os.getpid())
        cursor = self._conn.execute(
            "INSERT INTO executions"
            " (run_id, state, visit_seq, lease_token, worker, pid, started_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (*row, time.time()),
        )
        return int(cursor.lastrowid or 0)

    def _finished(self, run: Any, row_id: int) -> str:
        """Mark the execution finished; the event the phase returns."""
        event = decide(run.state, run.input, run.seq)
        self._conn.execute(
            "UPDATE executions SET finished_at = ? WHERE id = ?", (time.time(), row_id)
        )
        return event

    def record_batch(self, batch: str, run_ids: list[str], undriven: int) -> None:
        """Record a batch of runs a worker started (once ``start_many`` has returned)."""
        self._conn.execute(
            "INSERT INTO batches (batch, run_ids, undriven, worker) VALUES (?, ?, ?, ?)",
            (batch, json.dumps(run_ids), undriven, self.worker_id),
        )

    def close(self) -> None:
        """Close the recorder's connection."""
        self._conn.close()


class AsyncRecorder(Recorder):
    """The :class:`Recorder`'s handlers as coroutines: the phase's time is awaited.

    ``worker_id`` is the engine's whose phases it records (an async worker closes its engine
    and makes a new one, with a new worker id, now and then).
    """

    async def run_phase(self, ctx: Any) -> str:  # type: ignore[override]
        """Record the execution, await the input's time for this phase, return its event."""
        run = ctx.run
        row_id = self._began(run)
        await asyncio.sleep(run.input["work_ms"][run.state] / 1000.0)  # 0: yield to the others
        return self._finished(run, row_id)


# -- the worker process --------------------------------------------------------------------------


def done_flag(journal_path: str | os.PathLike[str]) -> Path:
    """The file the driver creates once no more runs will be started."""
    return Path(f"{journal_path}.done")


def _watch(journal_path: str, stop: threading.Event) -> None:
    """Set ``stop`` once the driver is done starting runs and no run is active any more."""
    flag = done_flag(journal_path)
    conn = sqlite3.connect(journal_path, timeout=BUSY_TIMEOUT, isolation_level=None)
    try:
        while not stop.wait(0.1):
            if not flag.exists():
                continue
            active = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM runs WHERE status = 'active')"
            ).fetchone()[0]
            if not active:
                stop.set()
    finally:
        conn.close()


def worker(
    journal_path: str,
    *,
    lease_ttl: float,
    drive: str = "sync",
    seed: int = 0,
    announce: Callable[[str], object] | None = None,
) -> int:
    """Claim and run this machine's runs until every run has ended (or the process is killed).

    ``drive="sync"``: :meth:`Engine.work` claims runs one by one and runs each; ``"async"``:
    an :class:`AsyncWorker` (its choices seeded by ``seed`` and the pid); ``"mixed"``: one or
    the other, at random. ``announce`` is called with ``"ready PID WORKER_ID"`` once the
    worker is about to claim.
    """
    worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # as the engine's
    journal = SqliteJournal(journal_path, busy_timeout=BUSY_TIMEOUT)
    rng = random.Random(f"{seed}:{os.getpid()}")
    if drive == "mixed":
        drive = rng.choice(["sync", "async"])
    if drive == "async":
        async_recorder = AsyncRecorder(journal_path, worker_id)
        (announce or print)(f"ready {os.getpid()} {worker_id}")
        try:
            asyncio.run(AsyncWorker(journal, async_recorder, lease_ttl, worker_id, rng).work())
        finally:
            journal.close()
            async_recorder.close()
        return 0
    recorder = Recorder(journal_path, worker_id)
    engine = _engine(journal, recorder, worker_id, lease_ttl)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(journal_path, stop), daemon=True)
    watcher.start()
    (announce or print)(f"ready {os.getpid()} {worker_id}")
    try:
        engine.work(stop=stop, idle_wait=0.05)
    finally:
        engine.close()
        journal.close()
        recorder.close()
    return 0


def _engine(journal: SqliteJournal, recorder: Recorder, worker_id: str, lease_ttl: float) -> Engine:
    """A worker's engine."""
    return Engine(
        SPEC,
        handlers=recorder.handlers,
        journal=journal,
        worker_id=worker_id,
        lease_ttl=lease_ttl,
        heartbeat_interval=lease_ttl / 4,
        max_recoveries=10**9,  # nothing is parked: every run must reach its own end
    )


#: An async worker starts a batch of its own only while fewer runs than this are active.
OWN_BATCHES_BELOW = 24


class AsyncWorker:
    """An async worker: rounds of runs driven at once by ``arun``, and batches of its own.

    Each round, until the driver's done flag is set and no run is active, it

    1. sometimes (not once the flag is set) starts a batch of runs of its own,
       ``start_many(inputs, claim=True)``, each input marked with the batch's id, size and
       index (:func:`verify` checks that a batch is all there or not at all), recorded in the
       ``batches`` table once ``start_many`` returned;
    2. picks claimable runs (active, and unleased or with an expired lease: what
       ``claim_next`` would take), now and then one held by another worker (a live one refuses
       it; a killed one's is taken over at once), and drives them and its own batch together,
       ``asyncio.gather(*(engine.arun(r) for r in ids))``. A run that another worker holds,
       took meanwhile or ended is normal (:data:`TAKEN_ELSEWHERE`); anything else ends the
       worker with an error (a non-zero exit the driver reports);
    3. sometimes leaves the last runs of its batch undriven and, after the round, closes its
       engine (``Engine.close`` gives them back in one ``release_many``; it is an error if
       one is still leased to the closed engine) and makes a new one, with a new worker id
       (``WORKER_ID/N``). A kill before the close leaves them leased to a dead worker.
    """

    def __init__(
        self,
        journal: SqliteJournal,
        recorder: AsyncRecorder,
        lease_ttl: float,
        worker_id: str,
        rng: random.Random,
    ) -> None:
        self.journal = journal
        self.recorder = recorder
        self.lease_ttl = lease_ttl
        self.worker_id = worker_id
        self.rng = rng
        self.engines = self.batches = 0
        #: what the runs driven came to: "ended", or the name of the error a run was refused with
        self.driven: Counter[str] = Counter()
        self.engine = self._new_engine()

    def _new_engine(self) -> Engine:
        self.engines += 1
        self.recorder.worker_id = f"{self.worker_id}/{self.engines}"
        return _engine(self.journal, self.recorder, self.recorder.worker_id, self.lease_ttl)

    async def work(self) -> None:
        """Do rounds until the done flag is set and no run is active."""
        flag = done_flag(self.journal.path)
        try:
            while True:
                done = flag.exists()  # before the runs are listed: none is started after it
                active = self.journal.runs(machine=SPEC.name, status=RunLifecycle.ACTIVE)
                if done and not active:
                    break
                own: list[str] = []
                undriven: list[str] = []
                # Its first round always starts a batch (else a backlog of the driver's runs
                # could keep every worker from starting one: the batch path left untried).
                if not done and (
                    not self.batches
                    or (len(active) < OWN_BATCHES_BELOW and self.rng.random() < 0.5)
                ):
                    own, undriven = self._start_batch()
                run_ids = list(dict.fromkeys([*own, *self._pick(active)]))
                if run_ids:
                    await self._drive(run_ids)
                else:
                    await asyncio.sleep(0.05)
                if undriven:
                    self._close_engine(undriven)
        finally:
            self.engine.close()
        print(  # to the workers' log: what this worker did, when it ends by itself
            f"{self.worker_id}: {self.batches} batches, {self.engines} engines,"
            f" runs driven: {dict(self.driven)}",
            file=sys.stderr,
        )

    def _start_batch(self) -> tuple[list[str], list[str]]:
        """Start a batch holding its leases; the runs to drive now and those left undriven."""
        rng = self.rng
        self.batches += 1
        batch, size = f"{self.worker_id}#{self.batches}", rng.randint(1, 8)
        inputs = [
            {**make_input(rng), "batch": batch, "of": size, "index": index} for index in range(size)
        ]
        undriven = 0 if rng.random() < 0.7 else rng.randint(1, size)
        run_ids = self.engine.start_many(inputs, claim=True)
        self.recorder.record_batch(batch, run_ids, undriven)
        return run_ids[: size - undriven], run_ids[size - undriven :]

    def _pick(self, active: Collection[Any]) -> list[str]:
        """Some claimable runs, in random order; now and then a run another worker holds."""
        rng, now = self.rng, dt.datetime.now(dt.timezone.utc)
        claimable = [
            run.run_id for run in active if run.lease_owner is None or run.lease_expires_at <= now
        ]
        held = [
            run.run_id
            for run in active
            if run.lease_owner not in (None, self.engine.worker_id) and run.lease_expires_at > now
        ]
        rng.shuffle(claimable)
        picked = claimable[: rng.randint(1, 16)]
        if held and rng.random() < 0.3:
            picked.append(rng.choice(held))
        return picked

    async def _drive(self, run_ids: list[str]) -> None:
        """``arun`` every run at once; raise on anything but a run taken elsewhere."""
        engine = self.engine
        results = await asyncio.gather(
            *(engine.arun(run_id) for run_id in run_ids), return_exceptions=True
        )
        for run_id, result in zip(run_ids, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, TAKEN_ELSEWHERE) and not (
                    isinstance(result, LeaseHeldError) and result.owner == engine.worker_id
                ):
                    self.driven[type(result).__name__] += 1
                    continue
                raise RuntimeError(f"arun({run_id!r}) raised {result!r}") from result
            if not result.ended:
                raise RuntimeError(f"arun({run_id!r}) returned a run not ended: {result}")
            self.driven["ended"] += 1

    def _close_engine(self, undriven: list[str]) -> None:
        """Close the engine (it lets go of the runs left undriven) and make a new one."""
        closed = self.engine.worker_id
        self.engine.close()
        self.engine = self._new_engine()
        kept = [run_id for run_id in undriven if self.journal.load(run_id).lease_owner == closed]
        if kept:
            raise RuntimeError(f"Engine.close() left runs {kept} leased to {closed}")


#: What ``arun`` may raise in a round for a run that is not this worker's to drive: held by
#: another worker, taken over from this one (a commit fenced out), or ended meanwhile.
TAKEN_ELSEWHERE = (LeaseError, RunTerminalError)


def _say(line: str) -> None:
    """Write one line to stdout at once (atomic: forked workers share the zygote's pipe)."""
    os.write(1, f"{line}\n".encode())


def _forked_worker(journal_path: str, lease_ttl: float, drive: str, seed: int) -> None:
    """The body of a forked worker process; never returns."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the zygote's commands are not for its workers
        os.close(devnull)
        code = worker(journal_path, lease_ttl=lease_ttl, drive=drive, seed=seed, announce=_say)
    except BaseException:  # reported through the exit code; the traceback goes to the log
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def zygote(journal_path: str, *, lease_ttl: float, drive: str = "sync", seed: int = 0) -> int:
    """Fork a worker (see :func:`worker`) for each ``spawn`` line on stdin; report on stdout.

    Lines: ``spawned PID`` (from here), ``ready PID WORKER_ID`` (from the worker) and
    ``exit PID CODE`` (reaped here; CODE is negative for a signal). The zygote itself runs no
    thread and opens no connection, so forking it is safe. It ends at end of input once its
    workers have exited.
    """
    sys.stdout.flush()
    pending = b""
    children: set[int] = set()
    reading = True
    while reading or children:
        if reading and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 4096)
            reading = bool(chunk)
            pending += chunk
            *commands, pending = pending.split(b"\n")
            for command in commands:
                if command.strip() != b"spawn":
                    continue
                pid = os.fork()
                if pid == 0:
                    _forked_worker(journal_path, lease_ttl, drive, seed)
                children.add(pid)
                _say(f"spawned {pid}")
        elif not reading:
            time.sleep(0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    return 0


# -- the driver ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    """What a torture session did and found; ``problems`` is empty when every check passed."""

    seed: int
    drive: str = "sync"
    #: Every run: the driver's and those async workers started in batches (``worker_runs``).
    runs: int = 0
    worker_runs: int = 0
    #: Batches async workers started (``start_many``) and the runs of them they left undriven
    #: until ``Engine.close`` let go of them (as recorded: a kill may come before the close).
    batches: int = 0
    undriven: int = 0
    workers: int = 0
    kills: int = 0
    pauses: int = 0
    spawned: int = 0
    transitions: int = 0
    executions: int = 0
    #: Phase executions beyond one per journaled visit (the phase ran again: at-least-once).
    re_executions: int = 0
    #: Executions that finished but whose result was never journaled, and whose worker lived
    #: on: its commit was refused because its lease had been taken over (fencing at work).
    fenced_out: int = 0
    #: Lease takeovers (``runs.recoveries``, summed).
    recoveries: int = 0
    #: Executions that began after their visit's transition was journaled (see module doc).
    stale_starts: int = 0
    #: Where the kills landed (the victim's last execution): inside a phase; after a phase
    #: returned but before its result was journaled; elsewhere (claiming, committing, idle).
    kills_mid_phase: int = 0
    kills_before_commit: int = 0
    kills_between_phases: int = 0
    elapsed: float = 0.0
    log: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return not self.problems

    def summary(self) -> str:
        """The figures, one per line, then the first problems."""
        lines = [
            f"seed                 {self.seed}",
            f"kills                {self.kills}"
            f" (mid-phase {self.kills_mid_phase}, after the phase before its commit"
            f" {self.kills_before_commit}, between phases {self.kills_between_phases})",
            f"pauses past lease    {self.pauses}",
            f"workers              {self.workers} at a time, {self.spawned} spawned",
            f"drive                {self.drive}",
            f"runs                 {self.runs}"
            + (
                f" ({self.worker_runs} started by workers in {self.batches} batches,"
                f" {self.undriven} of them left undriven until a close)"
                if self.batches
                else ""
            ),
            f"transitions          {self.transitions}",
            f"phase executions     {self.executions}",
            f"re-executions        {self.re_executions}",
            f"fenced-out commits   {self.fenced_out}",
            f"recoveries           {self.recoveries}",
            f"stale starts         {self.stale_starts}",
            f"elapsed              {self.elapsed:.1f} s",
            f"throughput           {self.transitions / max(self.elapsed, 1e-9):.0f} transitions/s",
            f"problems             {len(self.problems)}",
        ]
        lines += [f"  {problem}" for problem in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"  ... and {len(self.problems) - 20} more")
        return "\n".join(lines)


@dataclasses.dataclass
class _Worker:
    pid: int
    worker_id: str | None = None  # known once it is ready


class _Pool:
    """The worker processes of one session, forked by a zygote subprocess."""

    def __init__(
        self, journal_path: Path, lease_ttl: float, log: Any, *, drive: str, seed: int
    ) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        command = [sys.executable, "-m", "tests.torture", "zygote", str(journal_path)]
        self.zygote = subprocess.Popen(
            [*command, "--lease-ttl", str(lease_ttl), "--drive", drive, "--seed", str(seed)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        self.workers: dict[int, _Worker] = {}
        self.exits: list[tuple[int, int]] = []  # (pid, code) not yet looked at
        self.spawned = 0
        self._asked = 0  # spawns asked for and not yet answered
        self._buffer = b""

    @property
    def live(self) -> int:
        """Workers alive or on their way."""
        return len(self.workers) + self._asked

    def ready(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.worker_id is not None]

    def spawn(self) -> None:
        assert self.zygote.stdin is not None
        self.zygote.stdin.write(b"spawn\n")
        self.zygote.stdin.flush()
        self._asked += 1
        self.spawned += 1

    def wait(self, seconds: float) -> None:
        """Take the zygote's news for ``seconds``."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            self._pump(left)

    def _pump(self, timeout: float) -> None:
        assert self.zygote.stdout is not None
        fd = self.zygote.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError(f"the zygote exited ({self.zygote.wait()})")
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        for line in lines:
            kind, pid_text, *rest = line.decode().split()
            pid = int(pid_text)
            if kind == "spawned":
                self._asked -= 1
                self.workers.setdefault(pid, _Worker(pid))
            elif kind == "ready":  # may come before the zygote's "spawned"
                self.workers.setdefault(pid, _Worker(pid)).worker_id = rest[0]
            elif kind == "exit":
                self.workers.pop(pid, None)
                self.exits.append((pid, int(rest[0])))

    def reap(self) -> list[tuple[int, int]]:
        """The ``(pid, code)`` of workers that exited by themselves since last asked."""
        exits, self.exits = self.exits, []
        return exits

    def kill(self, victim: _Worker) -> int:
        """SIGKILL a worker and wait until it has been reaped; return its exit code."""
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30.0
        while victim.pid in self.workers and time.monotonic() < deadline:
            self._pump(0.5)
        found = [code for pid, code in self.exits if pid == victim.pid]
        self.exits = [(pid, code) for pid, code in self.exits if pid != victim.pid]
        assert found, f"worker {victim.pid} was not reaped"
        return found[0]

    def close(self) -> None:
        """Kill whatever workers are left (spawns still on their way too), then end the zygote."""
        deadline = time.monotonic() + 30.0
        with contextlib.suppress(RuntimeError):  # the zygote is gone already
            while (self.workers or self._asked) and time.monotonic() < deadline:
                for w in list(self.workers.values()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.pid, signal.SIGKILL)
                self._pump(0.2)
        assert self.zygote.stdin is not None
        assert self.zygote.stdout is not None
        self.zygote.stdin.close()
        try:
            self.zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
            self.zygote.wait()
        self.zygote.stdout.close()


def _active_runs(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT count(*) FROM runs WHERE status = 'active'").fetchone()[0])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def torture(
    journal_path: str | os.PathLike[str],
    *,
    runs: int,
    workers: int,
    kills: int,
    seed: int,
    pauses: int = 0,
    kill_interval: float = 0.3,
    lease_ttl: float = 1.0,
    timeout: float = 900.0,
    drive: str = "sync",
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Run a torture session on a new journal at ``journal_path`` and check it (see module doc).

    Args:
        journal_path: a journal file that does not exist yet.
        runs: runs started at first; more are started whenever fewer than ``2 * workers`` are
            active while kills remain, so the workers are never idle when killed.
        workers: worker processes alive at a time.
        kills: SIGKILLs to deliver, each to a random worker that has said it is ready; a
            replacement is spawned after each.
        seed: seeds the runs' inputs, the victims and the moments of the kills and pauses.
        pauses: SIGSTOPs to deliver, mixed in with the kills: the worker is stopped for 1.5 to 3
            lease TTLs, so its runs are taken over while it lives, then continued (SIGCONT). A
            killed holder never writes again; a paused one does, and must be fenced out.
        kill_interval: mean seconds between kills or pauses (uniform from 0 to twice this).
        lease_ttl: the workers' lease; a killed worker's run is taken over once it expires.
        timeout: seconds after which the session gives up (a problem in the report).
        drive: how the workers drive runs: ``"sync"`` (``Engine.work``, one run at a time),
            ``"async"`` (:class:`AsyncWorker`: rounds of ``arun`` of many runs at once, and
            batches of their own started by ``start_many``), or ``"mixed"`` (each worker
            process one or the other, at random).
        progress: called with ``(kills_done, runs_started)`` after each kill, if given.

    Returns:
        The report; its ``problems`` list what failed.
    """
    path = Path(journal_path)
    log_path = Path(f"{path}.workers.log")
    rng = random.Random(seed)
    report = Report(seed=seed, drive=drive, workers=workers, log=str(log_path))
    started = time.monotonic()
    deadline = started + timeout
    inputs: dict[str, dict[str, Any]] = {}
    killed: list[str] = []  # worker ids
    paused: dict[int, float] = {}  # pid -> when to continue it

    journal = SqliteJournal(path, busy_timeout=STARTER_BUSY_TIMEOUT)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None)
    recorder = Recorder(path)  # creates the table; its handlers run nowhere in the driver
    starter = Engine(SPEC, handlers=recorder.handlers, journal=journal)

    def start_runs(count: int) -> None:
        for _ in range(count):
            run_input = make_input(rng)
            run_id = f"r{len(inputs):06d}"
            while True:
                try:
                    inputs[starter.start(run_input, run_id=run_id)] = run_input
                    break
                except JournalError:  # locked: nothing was written
                    if not paused:
                        raise
                    # A worker stopped inside its transaction holds the write lock until it
                    # is continued; waiting for it here would wait for ever.
                    continue_paused(all_of_them=True)

    def continue_paused(*, all_of_them: bool = False) -> None:
        now = time.monotonic()
        for pid, until in list(paused.items()):
            if all_of_them or until <= now:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                del paused[pid]

    with log_path.open("a", encoding="utf-8") as log:
        pool = _Pool(path, lease_ttl, log, drive=drive, seed=seed)
        try:
            start_runs(runs)
            for _ in range(workers):
                pool.spawn()
            while (report.kills < kills or report.pauses < pauses) and len(report.problems) < 5:
                if time.monotonic() > deadline:
                    report.problems.append(f"gave up after {timeout:.0f} s: still killing")
                    break
                pool.wait(rng.uniform(0.0, 2.0 * kill_interval))
                continue_paused()
                for pid, code in pool.reap():
                    report.problems.append(f"worker {pid} exited by itself with {code}")
                while pool.live < workers:
                    pool.spawn()
                ready = [w for w in pool.ready() if w.pid not in paused]
                if not ready:
                    continue
                victim = rng.choice(ready)
                kills_left, pauses_left = kills - report.kills, pauses - report.pauses
                if rng.random() * (kills_left + pauses_left) < pauses_left:
                    os.kill(victim.pid, signal.SIGSTOP)
                    pause = rng.uniform(1.5, 3.0) * lease_ttl
                    paused[victim.pid] = time.monotonic() + pause
                    report.pauses += 1
                    continue
                code = pool.kill(victim)
                if code != -signal.SIGKILL:
                    report.problems.append(f"worker {victim.pid} ended with {code}, not SIGKILL")
                killed.append(str(victim.worker_id))
                report.kills += 1
                pool.spawn()
                if _active_runs(conn) < 2 * workers:
                    start_runs(max(runs // 4, 2 * workers))
                if progress is not None:
                    progress(report.kills, len(inputs))
            continue_paused(all_of_them=True)
            done_flag(path).touch()
            while (pool.workers or pool.live) and time.monotonic() < deadline:
                pool.wait(0.1)
                for pid, code in pool.reap():
                    if code != 0:
                        report.problems.append(f"worker {pid} exited with {code} at the end")
            if pool.live:
                report.problems.append(
                    f"gave up after {timeout:.0f} s with {report.kills} kills,"
                    f" {_active_runs(conn)} runs still active"
                )
        finally:
            continue_paused(all_of_them=True)
            pool.close()
            report.spawned = pool.spawned
            starter.close()
            journal.close()
            recorder.close()
            conn.close()

    report.elapsed = time.monotonic() - started
    with SqliteJournal(path, busy_timeout=BUSY_TIMEOUT) as journal:
        verify(journal, inputs, killed, report)
    report.runs = len(inputs) + report.worker_runs
    if any("exited" in problem for problem in report.problems):
        report.problems.append(f"last lines of {log_path}:\n{_tail(log_path)}")
    return report


# -- the checks ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Execution:
    id: int
    run_id: str
    state: str
    visit_seq: int
    lease_token: int
    worker: str
    pid: int
    started_at: float
    finished_at: float | None


def _executions(journal: SqliteJournal) -> list[_Execution]:
    conn = sqlite3.connect(journal.path, timeout=BUSY_TIMEOUT)
    try:
        rows = conn.execute(
            "SELECT id, run_id, state, visit_seq, lease_token, worker, pid, started_at,"
            " finished_at FROM executions ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    return [_Execution(*row) for row in rows]


def _visits(transitions: list[Any]) -> Iterator[tuple[Any, int]]:
    """Each transition that leaves a visit, with that visit's seq (as the engine counts them)."""
    visit = 0
    for t in transitions[1:]:
        yield t, visit
        if t.to_state != t.from_state or t.event not in ("RETRIED", "INTERRUPTED"):
            visit = t.seq


@dataclasses.dataclass
class Checked:
    """What :func:`check_executions` found in a journal and its phase executions.

    Executions are any records with ``id``, ``run_id``, ``state``, ``visit_seq``,
    ``lease_token``, ``worker``, ``pid``, ``started_at`` and ``finished_at`` (epoch seconds):
    the SQLite torture's side table and the PostgreSQL workers' one alike.
    """

    problems: list[str] = dataclasses.field(default_factory=list)
    transitions: int = 0
    #: Lease takeovers (``runs.recoveries``, summed) and the runs that had any.
    recoveries: int = 0
    taken_over: list[str] = dataclasses.field(default_factory=list)
    #: The visits that ran more than once: ``(run_id, state, visit_seq)`` -> their executions.
    re_executed: dict[tuple[str, str, int], list[Any]] = dataclasses.field(default_factory=dict)
    #: Executions under a token below the one whose result was journaled (the phase ran again
    #: after its worker was lost): unfinished, or finished with the result refused.
    earlier: list[Any] = dataclasses.field(default_factory=list)
    #: ``(run, state, visit, token)`` of every journaled phase result.
    committed: set[tuple[str, str, int, int]] = dataclasses.field(default_factory=set)
    #: Executions that began after their visit's transition was journaled.
    stale_starts: int = 0

    @property
    def re_executions(self) -> int:
        """Executions beyond one per journaled visit."""
        return sum(len(ran) - 1 for ran in self.re_executed.values())


def check_executions(
    journal: Any, executions: Collection[Any], inputs: Mapping[str, Mapping[str, Any]]
) -> Checked:
    """Check a finished session's journal against its runs' inputs and phase executions.

    1. Every run reached its expected terminal state by exactly its expected path (nothing
       lost, nothing repeated), with gapless seqs, and ``check_journal`` finds nothing.
    2. No completed phase executed twice: for each journaled transition out of
       ``(run, state, visit)`` under lease token L, exactly one execution of that visit ran
       under L and it finished, and none ran under a token above L. Executions under tokens
       below L are the phase running again after its worker was lost: they are listed
       (``earlier``, ``re_executed``) for the caller to match with what it did to the workers.
    3. Every execution belongs to a visit the journal left, each lease token of a run was used
       by one worker only, and the tokens of a run's transitions never go back.
    """
    checked = Checked()
    problems = checked.problems
    problems += [f"check_journal: {problem}" for problem in check_journal(journal)]
    by_visit: dict[tuple[str, str, int], list[Any]] = defaultdict(list)
    workers_by_token: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    for e in executions:
        by_visit[(e.run_id, e.state, e.visit_seq)].append(e)
        workers_by_token[(e.run_id, e.lease_token)].add((e.worker, e.pid))
    left: set[tuple[str, str, int]] = set()
    for run_id, run_input in inputs.items():
        run = journal.load(run_id)
        transitions = list(journal.transitions(run_id))
        checked.transitions += len(transitions)
        checked.recoveries += run.recoveries
        if run.recoveries:
            checked.taken_over.append(run_id)
        path = [(t.from_state, t.event, t.to_state) for t in transitions]
        want = expected_path(run_input)
        want_status = RunLifecycle.SUCCEEDED if want[-1][2] == "published" else RunLifecycle.FAILED
        if (run.state, run.status) != (want[-1][2], want_status):
            problems.append(
                f"run {run_id}: ended {run.state}/{run.status}, expected {want[-1][2]}/{want_status}"
            )
        if path != want:
            problems.append(f"run {run_id}: journaled path {path}, expected {want}")
        seqs = [t.seq for t in transitions]
        if seqs != list(range(len(transitions))) or run.seq != len(transitions) - 1:
            problems.append(f"run {run_id}: seqs {seqs}, run row at seq {run.seq}")
        tokens = [t.lease_token for t in transitions]
        if tokens != sorted(tokens):
            problems.append(f"run {run_id}: transition lease tokens go back: {tokens}")
        for t, visit in _visits(transitions):
            key = (run_id, t.from_state, visit)
            left.add(key)
            ran = by_visit.get(key, [])
            writers = [e for e in ran if e.lease_token == t.lease_token]
            if len(writers) != 1 or writers[0].finished_at is None:
                problems.append(
                    f"run {run_id} seq {t.seq}: {len(writers)} execution(s) of {t.from_state!r}"
                    f" visit {visit} under token {t.lease_token} (expected one, finished):"
                    f" {writers}"
                )
            checked.committed.add((*key, t.lease_token))
            later = [e for e in ran if e.lease_token > t.lease_token]
            if later:
                problems.append(
                    f"run {run_id} seq {t.seq}: {t.from_state!r} visit {visit} ran again after"
                    f" its transition was journaled under token {t.lease_token}: {later}"
                )
            if len(ran) > 1:
                checked.re_executed[key] = ran
            checked.earlier += [e for e in ran if e.lease_token < t.lease_token]
            at = t.at.timestamp()
            checked.stale_starts += sum(1 for e in ran if e.started_at >= at)
    phantom = [e for e in executions if (e.run_id, e.state, e.visit_seq) not in left]
    if phantom:
        problems.append(
            f"{len(phantom)} execution(s) of visits the journal never left: {phantom[:3]}"
        )
    shared = {key: ids for key, ids in workers_by_token.items() if len(ids) > 1}
    if shared:
        problems.append(
            f"lease tokens used by more than one worker: {dict(list(shared.items())[:5])}"
        )
    return checked


def verify(
    journal: SqliteJournal,
    inputs: Mapping[str, Mapping[str, Any]],
    killed: list[str],
    report: Report,
) -> None:
    """Check a finished session's journal and executions; add figures and problems to ``report``.

    The runs checked are every run of the journal: those the driver started (their journaled
    input must be the one it gave) and those async workers started in batches
    (:func:`runs_started`).

    Args:
        journal: the session's journal.
        inputs: the input of every run the driver started, by run id.
        killed: the worker ids of the workers killed, in order.
        report: where figures and problems go.
    """
    executions = _executions(journal)
    checked = check_executions(journal, executions, runs_started(journal, inputs, report))
    report.problems += checked.problems
    report.executions = len(executions)
    report.transitions += checked.transitions
    report.recoveries += checked.recoveries
    report.re_executions += checked.re_executions
    report.stale_starts += checked.stale_starts
    # finished under an older token, result not journaled
    lost = [e for e in checked.earlier if e.finished_at is not None]

    # A killed worker's results finished after its last journaled one were lost to the kill
    # (an async worker may have many waiting for their group commit); a lost result whose
    # worker committed another one after it, or was never killed, was committed and refused.
    last_committed: dict[str, float] = defaultdict(float)
    for e in executions:
        if e.finished_at is not None and _committed(e, checked):
            worker = _process(e.worker)
            last_committed[worker] = max(last_committed[worker], e.finished_at)
    victims = set(killed)
    lost_to_kills = {
        e.id
        for e in lost
        if _process(e.worker) in victims
        and (e.finished_at or 0.0) > last_committed[_process(e.worker)]
    }
    report.fenced_out = len(lost) - len(lost_to_kills)
    # Where the kills landed: inside a phase (an execution of the victim never finished),
    # after a phase before its commit (a result lost to the kill), elsewhere.
    unfinished = {_process(e.worker) for e in executions if e.finished_at is None}
    before_commit = {_process(e.worker) for e in lost if e.id in lost_to_kills}
    for worker_id in killed:
        if worker_id in unfinished:
            report.kills_mid_phase += 1
        elif worker_id in before_commit:
            report.kills_before_commit += 1
        else:
            report.kills_between_phases += 1


def _process(worker: str) -> str:
    """The worker process's id of an engine's worker id (``WORKER_ID/N`` in async workers)."""
    return worker.partition("/")[0]


def _committed(e: _Execution, checked: Checked) -> bool:
    return (e.run_id, e.state, e.visit_seq, e.lease_token) in checked.committed


def runs_started(
    journal: SqliteJournal, inputs: Mapping[str, Mapping[str, Any]], report: Report
) -> dict[str, Mapping[str, Any]]:
    """Every run of the journal with its input, checked for where it came from.

    A run the driver started must be in the journal with the input the driver gave; any other
    run must belong to a batch an async worker started, and a batch must be whole (every index
    of its size, or no run at all: ``start_many`` stores all or none). A batch the worker
    recorded as started must hold the run ids ``start_many`` returned, in the inputs' order.
    Problems go to ``report``, with the figures ``worker_runs``, ``batches`` and ``undriven``.
    """
    problems = report.problems
    found = {run.run_id: run.input for run in journal.runs(machine=SPEC.name)}
    missing = sorted(set(inputs) - set(found))
    if missing:
        problems.append(
            f"{len(missing)} run(s) the driver started are not in the journal: {missing[:5]}"
        )
    runs: dict[str, Mapping[str, Any]] = {}
    batches: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
    for run_id, run_input in found.items():
        if run_id in inputs:
            if run_input != inputs[run_id]:
                problems.append(
                    f"run {run_id}: journaled input {run_input}, started with {inputs[run_id]}"
                )
            runs[run_id] = inputs[run_id]
        elif isinstance(run_input, dict) and "batch" in run_input:
            batches[run_input["batch"]].append((run_input["index"], run_id, run_input["of"]))
            runs[run_id] = run_input
        else:
            problems.append(f"run {run_id}: started by neither the driver nor a batch: {run_input}")
    for batch, members in batches.items():
        members.sort()
        size = members[0][2]
        if [(index, of) for index, _, of in members] != [(index, size) for index in range(size)]:
            problems.append(
                f"batch {batch}: the journal holds indexes {[m[0] for m in members]}"
                f" of {size} (a batch is stored whole or not at all)"
            )
    recorded = _batches(journal)
    for batch, run_ids, _ in recorded:
        held = [run_id for _, run_id, _ in sorted(batches.get(batch, []))]
        if held != run_ids:
            problems.append(f"batch {batch}: start_many returned {run_ids}, the journal has {held}")
    report.worker_runs = sum(len(members) for members in batches.values())
    report.batches = len(batches)
    report.undriven = sum(undriven for _, _, undriven in recorded)
    return runs


def _batches(journal: SqliteJournal) -> list[tuple[str, list[str], int]]:
    """The batches async workers recorded: ``(batch, run ids, how many left undriven)``."""
    conn = sqlite3.connect(journal.path, timeout=BUSY_TIMEOUT)
    try:
        rows = conn.execute("SELECT batch, run_ids, undriven FROM batches ORDER BY rowid")
        return [(batch, json.loads(run_ids), undriven) for batch, run_ids, undriven in rows]
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.torture worker|zygote JOURNAL [--lease-ttl S] [--drive async]``."""
    parser = argparse.ArgumentParser(prog="python -m tests.torture")
    parser.add_argument("command", choices=["worker", "zygote"])
    parser.add_argument("journal")
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--drive", choices=DRIVES, default="sync")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "zygote":
        return zygote(args.journal, lease_ttl=args.lease_ttl, drive=args.drive, seed=args.seed)
    return worker(args.journal, lease_ttl=args.lease_ttl, drive=args.drive, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
