"""Durable waits (issue 29): parked runs cost a worker nothing; how soon a signal is acted on.

Run from the repository root::

    python tests/bench/bench_waits.py [--parked 10000] [--rounds 5] [--samples 200]
    python tests/bench/bench_waits.py --parked 100000             # the issue's measurement
    python tests/bench/bench_waits.py --postgres postgresql://root@127.0.0.1/test
    python tests/bench/bench_waits.py --no-postgres               # SQLite only
    python tests/bench/bench_waits.py --no-sqlite                 # PostgreSQL only

For each journal — a SQLite file, and PostgreSQL (``--postgres URL``; by default the tests'
server, ``FSM_RUNNER_TEST_POSTGRES_URL`` or ``postgresql://root@127.0.0.1:5432/test``, if it
answers; each journal in a schema of its own, dropped afterwards) — two journals are built:

* **empty**: the machine's spec, no run;
* **parked**: ``--parked`` runs parked in the machine's waiting state: active, unleased, their
  wake times (the wait's deadline) from a day to 30 days ahead. One run is parked by the engine
  (started, its first phase run, parked on let-go); the others are cloned from it by SQL in the
  journal's own tables (its columns read from the schema, as ``scale_journals.py`` does), each
  created at a time of its own over the last 30 days and with a wake time of its own: the rows
  the journal stores for a parked run.

Measured in rounds, the two journals' samples interleaved one by one (empty, parked, parked,
empty, ...: neither always first), each figure the median of its round; the ratio parked/empty is the median of the rounds' ratios (target <= 1.10 for each):

* **claim, one runnable**: ``claim_next`` of the worker's handled states when exactly one run
  is runnable (a run started just before, untimed; it is then let go and run to its end,
  untimed);
* **claim, none runnable**: ``claim_next`` finding nothing (a worker's idle poll);
* **step**: a held run's journaled step: ``Engine.run`` of a looping run, each step timed from
  one commit's listener call to the next (``--steps`` a round, in runs of 50 steps).

``next_wake`` (what an idle worker reads to know how long to sleep) is reported too.

**signal → handler**: on the parked journal, one worker (``Engine.work(idle_wait=--poll)`` in a
thread of this process, a journal connection of its own) is idle; ``--signals`` times a parked
run is sent ``Engine.signal`` at a random moment of the worker's poll (a uniform delay after
the previous one), and the time from the call to the first handler call of the state it leads
to is taken. Twice: first with the worker's journal's ``idle`` hidden (the baseline: the worker
sleeps its poll out), then as it is (the worker waits on ``Journal.idle``: SQLite's looks at the
file's ``data_version`` every 20 ms, PostgreSQL's hears the signal's NOTIFY at once); the ratio
is printed. Targets on the listening p95: below the poll interval on SQLite; below 50 ms on
PostgreSQL.

The exit status is 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the repository's fsm_runner
    sys.path.insert(0, str(ROOT))

from fsm_runner import (  # noqa: E402 - after the sys.path set-up above
    Engine,
    MachineSpec,
    PhaseContext,
    SqliteJournal,
    State,
    Transition,
    Wait,
)
from fsm_runner.records import utc_now  # noqa: E402 - after the sys.path set-up
from tests.bench.scale_journals import run_id_of  # noqa: E402 - after the sys.path set-up

CLAIM_TARGET = 1.10
STEP_TARGET = 1.10
PG_SIGNAL_TARGET_MS = 50.0
DEFAULT_POSTGRES = os.environ.get(
    "FSM_RUNNER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test"
)
MACHINE = "bench-waits"
THIRTY_DAYS = 30 * 86_400.0
HANDLED = ("a", "b")
SPEC = MachineSpec(
    MACHINE,
    [
        State("a", handler="a"),
        State("b", handler="b"),
        State("awaiting", wait=Wait(timeout=THIRTY_DAYS, prompt="go on?")),
        State("done", terminal=True),
    ],
    [
        Transition("a", "NEXT", "b"),
        Transition("b", "NEXT", "a"),
        Transition("a", "WAIT", "awaiting"),
        Transition("a", "FINISH", "done"),
        Transition("b", "FINISH", "done"),
        Transition("awaiting", "GO", "b"),
        Transition("awaiting", "TIMEOUT", "done"),
    ],
)
#: What each handled state returns, by the run's ``input["mode"]``.
EVENTS = {
    "a": {"park": "WAIT", "signal": "WAIT", "once": "FINISH", "loop": "NEXT"},
    "b": {"signal": "FINISH", "loop": "NEXT"},
}
#: Runs cloned by one INSERT ... SELECT.
BATCH = 50_000


def handlers(called: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The handlers: each returns its mode's event; ``called(run_id)`` on a signalled run's b."""

    def a(ctx: PhaseContext) -> str:
        return EVENTS["a"][ctx.run.input["mode"]]

    def b(ctx: PhaseContext) -> str:
        mode = ctx.run.input["mode"]
        if mode == "signal" and called is not None:
            called(ctx.run_id)
        return EVENTS["b"][mode]

    return {"a": a, "b": b}


# -- the journals ---------------------------------------------------------------------------------


class Backend:
    """Where the journals live: SQLite files in a directory, or schemas of a PostgreSQL database."""

    name = ""

    def new(self, label: str) -> str:
        """A location for a new journal."""
        raise NotImplementedError

    def open(self, location: str) -> Any:
        raise NotImplementedError

    def clone_parked(self, location: str, template: str, count: int) -> None:
        """Clone the parked run ``template`` ``count`` times, wake times 1 to 30 days ahead."""
        raise NotImplementedError

    def settle(self, location: str) -> None:
        """Bring the built journal's statistics up to date (PostgreSQL)."""

    def close(self) -> None:
        """Remove what :meth:`new` made."""


class SqliteBackend(Backend):
    name = "SQLite"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def new(self, label: str) -> str:
        return str(self.workdir / f"{label}.db")

    def open(self, location: str) -> Any:
        return SqliteJournal(location)

    def clone_parked(self, location: str, template: str, count: int) -> None:
        conn = sqlite3.connect(location, isolation_level=None)
        conn.create_function("run_id_of", 1, run_id_of, deterministic=True)
        (key,) = conn.execute(
            "SELECT run_key FROM run_rows WHERE run_id = ?", (template,)
        ).fetchone()
        skip = ("run_key", "run_id", "wake_at", "created_at")
        columns = [r[1] for r in conn.execute("PRAGMA table_info(run_rows)") if r[1] not in skip]
        tcolumns = [
            r[1] for r in conn.execute("PRAGMA table_info(transitions)") if r[1] not in skip
        ]
        now = utc_now().timestamp()
        # created over the last 30 days, oldest first; wake times from a day ahead to 30 days
        # ahead; as format_utc writes them
        when = "strftime('%Y-%m-%dT%H:%M:%f', :now {}, 'unixepoch') || '000+00:00'"
        created, wake = when.format("- 30 * 86400 + i * :step"), when.format("+ 86400 + i * :step")
        for first in range(1, count + 1, BATCH):
            last = min(first + BATCH, count + 1) - 1
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT :first UNION ALL SELECT i + 1 FROM n WHERE i < :last)"
                f" INSERT INTO run_rows (run_key, run_id, created_at, wake_at, {', '.join(columns)})"
                f" SELECT :key + i, run_id_of(i), {created}, {wake},"
                f" {', '.join('t.' + c for c in columns)}"
                " FROM n, run_rows AS t WHERE t.run_key = :key",
                {"first": first, "last": last, "key": key, "now": now, "step": 29 * 86400 / count},
            )
            conn.execute(
                f"INSERT INTO transitions (run_key, run_id, {', '.join(tcolumns)})"
                f" SELECT r.run_key, r.run_id, {', '.join('t.' + c for c in tcolumns)}"
                " FROM run_rows AS r, transitions AS t"
                " WHERE r.run_key BETWEEN ? AND ? AND t.run_key = ? ORDER BY r.run_key, t.seq",
                (key + first, key + last, key),
            )
            conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()


class PostgresBackend(Backend):
    name = "PostgreSQL"

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = url
        self.admin = psycopg.connect(url, autocommit=True, connect_timeout=5)
        self.schemas: list[str] = []

    def new(self, label: str) -> str:
        schema = f"bench_waits_{label}_{uuid.uuid4().hex[:8]}"
        self.schemas.append(schema)
        return f"{self.url}{'&' if '?' in self.url else '?'}schema={urllib.parse.quote(schema)}"

    def open(self, location: str) -> Any:
        from fsm_runner.journal.postgres import PostgresJournal

        return PostgresJournal(location)

    def clone_parked(self, location: str, template: str, count: int) -> None:
        from psycopg import sql

        schema = urllib.parse.unquote(location.rsplit("schema=", 1)[1])

        def copied(table: str) -> list[str]:
            rows = self.admin.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
                " AND table_name = %s AND is_generated = 'NEVER' AND is_identity = 'NO'"
                " ORDER BY ordinal_position",
                (schema, table),
            ).fetchall()
            return [name for (name,) in rows if name not in ("run_id", "wake_at", "created_at")]

        runs, transitions = copied("runs"), copied("transitions")
        ident = sql.Identifier

        def names(columns: list[str], prefix: str = "") -> sql.Composable:
            return sql.SQL(", ").join(
                sql.SQL(prefix) + ident(c) if prefix else ident(c) for c in columns
            )

        step = 29 * 86400 / count
        for first in range(1, count + 1, BATCH):
            last = min(first + BATCH, count + 1) - 1
            with self.admin.transaction():
                self.admin.execute(
                    sql.SQL(
                        "INSERT INTO {} (run_id, created_at, wake_at, {}) SELECT md5('run ' || i),"
                        " clock_timestamp() - interval '30 days' + i * %s * interval '1 second',"
                        " clock_timestamp() + interval '1 day' + i * %s * interval '1 second', {}"
                        " FROM generate_series(%s::bigint, %s::bigint) AS i, {} AS t"
                        " WHERE t.run_id = %s ORDER BY i"
                    ).format(
                        ident(schema, "runs"), names(runs), names(runs, "t."), ident(schema, "runs")
                    ),
                    (step, step, first, last, template),
                )
                self.admin.execute(
                    sql.SQL(
                        "INSERT INTO {} (run_id, {}) SELECT md5('run ' || i), {}"
                        " FROM generate_series(%s::bigint, %s::bigint) AS i, {} AS t"
                        " WHERE t.run_id = %s ORDER BY i, t.seq"
                    ).format(
                        ident(schema, "transitions"),
                        names(transitions),
                        names(transitions, "t."),
                        ident(schema, "transitions"),
                    ),
                    (first, last, template),
                )

    def settle(self, location: str) -> None:
        """VACUUM ANALYZE the journal's tables (each journal alike, as autovacuum would)."""
        from psycopg import sql

        schema = urllib.parse.unquote(location.rsplit("schema=", 1)[1])
        for table in ("runs", "transitions", "signals"):
            self.admin.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, table)))

    def close(self) -> None:
        """Drop the schemas made (on a new connection if the server dropped this one)."""
        import psycopg
        from psycopg import sql

        self.admin.close()
        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as admin:
            for schema in self.schemas:
                admin.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


def build(backend: Backend, label: str, parked: int) -> str:
    """A journal with the spec and ``parked`` parked runs (0: none); its location."""
    location = backend.new(label)
    journal = backend.open(location)
    try:
        engine = Engine(SPEC, handlers=handlers(), journal=journal)
        if parked:
            template = engine.start({"mode": "park"})
            run = engine.run(template)
            assert (run.state, run.lease_owner) == ("awaiting", None), run
            assert journal.wake_time(template) is not None
        else:
            engine.run(engine.start({"mode": "once"}))  # the spec stored, one ended run
        engine.close()
    finally:
        journal.close()
    if parked > 1:
        backend.clone_parked(location, template, parked - 1)
    backend.settle(location)
    return location


def check_parked(journal: Any, parked: int) -> None:
    """The parked journal as meant: that many waiting runs, none claimable, the next wake ahead."""
    waiting = journal.runs(machine=MACHINE, status="active", state="awaiting", limit=parked + 1)
    assert len(waiting) == parked, (len(waiting), parked)
    assert all(run.lease_owner is None for run in waiting)
    assert journal.claim_next("check", ttl=1, machine=MACHINE, states=HANDLED) is None
    wake = journal.next_wake(machine=MACHINE)
    assert wake is not None
    assert wake > utc_now(), wake


# -- (i) and (ii): claims and steps ---------------------------------------------------------------


def claim_one(journal: Any, engine: Engine) -> float:
    """Seconds of one ``claim_next`` when exactly one run is runnable (set up and undone untimed)."""
    run_id = engine.start({"mode": "once"})
    began = time.perf_counter()
    claimed = journal.claim_next(
        "bench", ttl=60, machine=MACHINE, states=HANDLED, spec_hash=SPEC.spec_hash
    )
    took = time.perf_counter() - began
    assert claimed is not None
    assert claimed.run_id == run_id, claimed
    journal.release(run_id, "bench", claimed.lease_token)
    assert engine.run(run_id).state == "done"
    return took


def claim_none(journal: Any, _engine: Engine) -> float:
    """Seconds of one ``claim_next`` finding nothing."""
    began = time.perf_counter()
    found = journal.claim_next(
        "bench", ttl=60, machine=MACHINE, states=HANDLED, spec_hash=SPEC.spec_hash
    )
    took = time.perf_counter() - began
    assert found is None, found
    return took


def next_wake(journal: Any, _engine: Engine) -> float:
    """Seconds of one ``next_wake``."""
    began = time.perf_counter()
    journal.next_wake(machine=MACHINE)
    return time.perf_counter() - began


class Steps:
    """Times each journaled step of a looping run: from one commit's listener call to the next."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last: float | None = None
        self.times: list[float] = []
        engine.listeners.append(self._committed)

    def _committed(self, _transition: Any, _run: Any) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now

    def __call__(self, count: int) -> list[float]:
        """Seconds of each of ``count`` steps of a held run (which is then aborted)."""
        run_id = self.engine.start({"mode": "loop"})
        self.last, self.times = None, []
        run = self.engine.run(run_id, max_steps=count + 1)
        assert run.seq == count + 1, run
        taken = self.times
        self.last, self.times = None, []
        self.engine.abort(run_id, "bench: measured")
        return taken


def measure_costs(
    backend: Backend, empty: str, parked: str, args: argparse.Namespace
) -> list[tuple[str, bool]]:
    """(i) and (ii) on the two journals, sample by sample alternately, in rounds; the targets."""
    names = ("empty", "parked")
    journals = {"empty": backend.open(empty), "parked": backend.open(parked)}
    engines = {name: Engine(SPEC, handlers=handlers(), journal=j) for name, j in journals.items()}
    steps = {name: Steps(engine) for name, engine in engines.items()}
    probes: dict[str, Callable[[Any, Engine], float]] = {
        "one": claim_one,
        "none": claim_none,
        "wake": next_wake,
    }
    figures: dict[str, dict[str, list[float]]] = {
        what: {name: [] for name in names} for what in (*probes, "step")
    }
    try:
        check_parked(journals["parked"], args.parked)
        for name in names:  # warm up: connections, statement caches, the OS's file cache
            for probe in probes.values():
                for _ in range(10):
                    probe(journals[name], engines[name])
            steps[name](20)
        print(
            f"  {'round':>5}  {'':7} {'claim one':>10} {'claim none':>11} {'step':>9}"
            f" {'next_wake':>10}   (µs, medians of the round)"
        )
        for round_ in range(1, args.rounds + 1):
            taken: dict[str, dict[str, list[float]]] = {
                what: {name: [] for name in names} for what in figures
            }
            for sample in range(args.samples):
                order = names if sample % 2 else names[::-1]  # neither always goes first
                for what, probe in probes.items():
                    for name in order:
                        taken[what][name].append(probe(journals[name], engines[name]))
            for sample in range(0, args.steps, 50):
                order = names if sample % 100 else names[::-1]
                for name in order:
                    taken["step"][name] += steps[name](min(50, args.steps - sample))
            for name in names:
                for what in figures:
                    figures[what][name].append(statistics.median(taken[what][name]) * 1e6)
                print(
                    f"  {round_:>5}  {name:7}"
                    + "".join(
                        f" {figures[what][name][-1]:{width}.1f}"
                        for what, width in (("one", 10), ("none", 11), ("step", 9), ("wake", 10))
                    )
                )
    finally:
        for engine in engines.values():
            engine.close()
        for journal in journals.values():
            journal.close()
    targets = []
    print(f"  ratio parked/empty (median of the {args.rounds} rounds' ratios):")
    for what, label, target in (
        ("one", "claim_next, one runnable", CLAIM_TARGET),
        ("none", "claim_next, none runnable", CLAIM_TARGET),
        ("step", "a journaled step", STEP_TARGET),
        ("wake", "next_wake (reported)", None),
    ):
        ratios = [
            p / e for p, e in zip(figures[what]["parked"], figures[what]["empty"], strict=True)
        ]
        ratio = statistics.median(ratios)
        empty_us = statistics.median(figures[what]["empty"])
        parked_us = statistics.median(figures[what]["parked"])
        print(
            f"    {label:28} empty {empty_us:9.1f} µs  parked {parked_us:9.1f} µs"
            f"  ratio {ratio:5.2f}" + (f" (target <= {target:.2f})" if target else "")
        )
        if target is not None:
            targets.append(
                (
                    f"{backend.name}: {label} with {args.parked:,} parked runs within"
                    f" {target:.2f}x an empty journal's (got {ratio:.2f})",
                    ratio <= target,
                )
            )
    return targets


# -- (iii): signal to handler ---------------------------------------------------------------------


@contextmanager
def idle_worker(
    backend: Backend, location: str, poll: float, *, listen: bool = True
) -> Iterator[dict[str, Any]]:
    """A worker in ``Engine.work(idle_wait=poll)`` in a thread, on a journal of its own.

    ``listen=False``: the baseline, a worker that polls (its journal's ``idle`` hidden, as a
    journal without one: the worker sleeps its poll out).
    Yields ``{"called": {run_id: perf_counter at the handler call}, "event": Condition}``.
    """
    called: dict[str, float] = {}
    cond = threading.Condition()

    def record(run_id: str) -> None:
        at = time.perf_counter()
        with cond:
            called[run_id] = at
            cond.notify_all()

    journal = backend.open(location)
    if not listen:
        journal.idle = None  # as a journal that does not offer it
    engine = Engine(SPEC, handlers=handlers(record), journal=journal)
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: engine.work(stop=stop, idle_wait=poll), name="bench-worker", daemon=True
    )
    thread.start()
    try:
        yield {"called": called, "cond": cond}
    finally:
        stop.set()
        thread.join(60)
        engine.close()
        journal.close()


def measure_signals(
    backend: Backend, location: str, args: argparse.Namespace
) -> list[tuple[str, bool]]:
    """(iii) on the parked journal, the worker polling (baseline) then listening; its target."""
    polled = signal_latencies(backend, location, args, listen=False)
    heard = signal_latencies(backend, location, args, listen=True)
    for label, (latencies, calls) in (("polling (baseline)", polled), ("listening", heard)):
        print(
            f"  signal -> first handler call, idle worker {label}, idle_wait"
            f" {args.poll * 1e3:.0f} ms, {len(latencies)} signals:"
            f" p50 {quantile(latencies, 0.5) * 1e3:.1f} ms,"
            f" p95 {quantile(latencies, 0.95) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms"
            f" (Engine.signal itself: p50 {quantile(calls, 0.5) * 1e3:.1f} ms)"
        )
    p50, p95 = quantile(heard[0], 0.5), quantile(heard[0], 0.95)
    print(
        f"  listening / polling: p50 {p50 / quantile(polled[0], 0.5):.3f}x,"
        f" p95 {p95 / quantile(polled[0], 0.95):.3f}x"
    )
    if isinstance(backend, PostgresBackend):
        target, label = PG_SIGNAL_TARGET_MS / 1e3, f"{PG_SIGNAL_TARGET_MS:.0f} ms (NOTIFY)"
    else:
        target, label = args.poll, f"the poll interval, {args.poll * 1e3:.0f} ms"
    met = p95 < target
    print(f"  target: p95 < {label}: {'met' if met else 'NOT MET'}")
    return [(f"{backend.name}: signal -> handler p95 {p95 * 1e3:.1f} ms < {label}", met)]


def signal_latencies(
    backend: Backend, location: str, args: argparse.Namespace, *, listen: bool
) -> tuple[list[float], list[float]]:
    """Seconds from ``Engine.signal`` to the first handler call; and of the call itself."""
    journal = backend.open(location)
    sender = Engine(SPEC, handlers=handlers(), journal=journal)
    rng = random.Random(29)
    latencies: list[float] = []
    calls: list[float] = []
    try:
        run_ids = []
        for _ in range(args.signals):
            run_id = sender.start({"mode": "signal"})
            assert sender.run(run_id).state == "awaiting"
            run_ids.append(run_id)
        with idle_worker(backend, location, args.poll, listen=listen) as worker:
            time.sleep(2 * args.poll)  # idle: it has polled and found nothing
            for run_id in run_ids:
                time.sleep(rng.uniform(0, args.poll))  # a random moment of its poll
                began = time.perf_counter()
                sender.signal(run_id, "GO")
                calls.append(time.perf_counter() - began)
                with worker["cond"]:
                    assert worker["cond"].wait_for(lambda r=run_id: r in worker["called"], 60)
                latencies.append(worker["called"][run_id] - began)
            deadline = time.monotonic() + 60
            while any(journal.load(r).state != "done" for r in run_ids):
                assert time.monotonic() < deadline, "the signalled runs did not end"
                time.sleep(0.01)
    finally:
        sender.close()
        journal.close()
    return latencies, calls


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (p95 of 20 values: the 19th smallest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- main -------------------------------------------------------------------------------------------


def bench(backend: Backend, args: argparse.Namespace) -> list[tuple[str, bool]]:
    print(f"\n== {backend.name}")
    began = time.perf_counter()
    empty = build(backend, "empty", 0)
    parked = build(backend, "parked", args.parked)
    print(
        f"  journals built: empty, and {args.parked:,} parked runs ({time.perf_counter() - began:.1f} s)"
    )
    targets = measure_costs(backend, empty, parked, args)
    targets += measure_signals(backend, parked, args)
    return targets


def postgres_url(args: argparse.Namespace) -> str | None:
    """The PostgreSQL server to measure, if any: ``--postgres``, or the tests' if it answers."""
    if args.no_postgres:
        return None
    url = args.postgres or DEFAULT_POSTGRES
    try:
        import psycopg

        psycopg.connect(url, connect_timeout=3).close()
    except Exception as exc:
        if args.postgres:
            raise SystemExit(f"PostgreSQL at {url} does not answer: {exc}") from None
        print(f"(PostgreSQL at {url} does not answer: its part is not run)")
        return None
    return url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parked", type=int, default=10_000, help="parked runs (issue: 100000)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--samples", type=int, default=200, help="samples of each claim a round and journal"
    )
    parser.add_argument("--steps", type=int, default=500, help="steps a round and journal")
    parser.add_argument("--signals", type=int, default=20, help="signals sent to an idle worker")
    parser.add_argument("--poll", type=float, default=0.5, help="the worker's idle_wait (s)")
    parser.add_argument("--postgres", metavar="URL", help="measure PostgreSQL there too")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    args = parser.parse_args()
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version},", end=" ")
    print(f"{os.cpu_count()} CPUs; {args.parked:,} parked runs, {args.rounds} rounds")
    targets: list[tuple[str, bool]] = []
    if not args.no_sqlite:
        with tempfile.TemporaryDirectory(prefix="bench_waits_") as workdir:
            targets += bench(SqliteBackend(Path(workdir)), args)
    url = postgres_url(args)
    if url is not None:
        backend = PostgresBackend(url)
        try:
            targets += bench(backend, args)
        finally:
            backend.close()
    print()
    for description, met in targets:
        print(f"{'PASS' if met else 'FAIL'}: {description}")
    return 0 if all(met for _, met in targets) else 1


if __name__ == "__main__":
    raise SystemExit(main())
