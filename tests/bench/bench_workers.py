"""Shared-journal throughput: 1, 2, 4 (and 8) worker processes draining 1,000 runs from one journal.

    python tests/bench/bench_workers.py [--runs 1000] [--workers 1 2 4] [--rounds 3]
    python tests/bench/bench_workers.py --journal postgresql://root@127.0.0.1/test [--workers 1 2 4 8]

Without ``--journal`` the journal is a SQLite file; with a PostgreSQL URL, each measurement gets
a schema of its own in that database (``bench_workers_...``, dropped afterwards), and the
worker counts default to 1, 2, 4 and 8. Each round and worker count gets a fresh journal with
``--runs`` runs of a four-phase machine (fetching → building → testing → publishing →
published: four journaled transitions a run) started in it. Then N worker processes, released
together by closing their stdin, each call ``Engine.work(exit_when_idle=True)``: claim the
longest-waiting run (``claim_next``, one transaction), run it to its end, release it, claim the
next, until none is left.

Every phase handler logs ``run state visit`` to its worker's log. A (run, state, visit) logged
more than once is a double execution; a run that did not end ``succeeded`` is lost. A
"database is locked" error surfaced is any error a worker saw, raised or logged by the engine,
whose message says locked or busy (the SQLite journal maps SQLite's to ``JournalError`` "is
locked by another writer ..."). All must be 0, and every run must end ``succeeded`` having been
claimed once; throughput is the median over the rounds, and ``vs 1w`` its ratio to one worker's.

Baseline, measured in the same run: raw single-row commits from one process into a table of
the journal's own ``transitions`` definition — ``sqlite3`` autocommit INSERTs (WAL,
synchronous=NORMAL), or psycopg autocommit INSERTs (prepared, ``synchronous_commit = on`` as
the journal's commits) for PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the repository's fsm_runner
    sys.path.insert(0, str(ROOT))

from fsm_runner import (  # noqa: E402 - after the sys.path set-up above
    Engine,
    MachineSpec,
    PhaseContext,
    RunEvent,
    RunLifecycle,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.journal import Journal, open_journal  # noqa: E402 - after the sys.path set-up
from fsm_runner.records import format_utc, utc_now  # noqa: E402 - after the sys.path set-up

PHASES = ("fetching", "building", "testing", "publishing")
DONE = "PHASE_DONE"
SPEC = MachineSpec(
    "bench-workers",
    [
        *(State(phase, handler="phase") for phase in PHASES),
        State("published", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    [
        *(
            Transition(phase, DONE, dest)
            for phase, dest in zip(PHASES, [*PHASES[1:], "published"], strict=True)
        ),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
    ],
)
BASELINE_COMMITS = 20_000
#: PostgreSQL commits wait for the WAL to reach the disk: fewer make as good a median.
BASELINE_COMMITS_POSTGRES = 5_000
LOCKED_WORDS = ("locked", "busy")
#: How often a worker calls work() again after an error escaped it, before giving up.
MAX_ESCAPES = 100


def is_postgres(location: str) -> bool:
    """Whether ``location`` is a PostgreSQL URL."""
    return location.startswith(("postgresql://", "postgres://"))


def with_schema(url: str, schema: str) -> str:
    """``url`` naming the PostgreSQL schema ``schema``."""
    return f"{url}{'&' if '?' in url else '?'}schema={urllib.parse.quote(schema)}"


def open_bench_journal(location: str) -> Journal:
    """The journal at ``location``: a SQLite file as before, or a PostgreSQL URL with a schema."""
    return open_journal(location) if is_postgres(location) else SqliteJournal(location)


def new_schema(label: str) -> str:
    return f"bench_workers_{label.replace('-', '_')}_{uuid.uuid4().hex[:8]}"


def drop_schema(url: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# -- the worker process ------------------------------------------------------------------------


class _Collector(logging.Handler):
    """Keeps the messages of fsm_runner's warnings and errors (work() logs what it survives)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


def worker(journal_location: str, log_path: str) -> int:
    """Drain the journal with Engine.work; print one JSON line of what happened."""
    collector = _Collector()
    logging.getLogger("fsm_runner").addHandler(collector)
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed below, after work()

    def phase(ctx: PhaseContext) -> str:
        log.write(f"{ctx.run_id} {ctx.state} {ctx.run.visit_seq}\n")
        return DONE

    journal = open_bench_journal(journal_location)
    engine = Engine(SPEC, handlers={"phase": phase}, journal=journal)
    print("ready", flush=True)
    sys.stdin.read()  # the barrier: the parent closes every worker's stdin at once
    escaped: list[str] = []
    taken = 0
    started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
    while True:
        try:
            taken += engine.work(exit_when_idle=True)
            break
        except Exception as exc:  # counted and reported: that is the point
            escaped.append(f"{type(exc).__name__}: {exc}")
            if len(escaped) >= MAX_ESCAPES:
                break
    ended = time.monotonic()
    engine.close()
    journal.close()
    log.close()
    report = {
        "pid": os.getpid(),
        "taken": taken,
        "started": started,
        "ended": ended,
        "escaped": escaped,
        "logged": collector.messages,
    }
    print(json.dumps(report), flush=True)
    return 0


# -- the parent --------------------------------------------------------------------------------


def prepare(location: str, runs: int) -> list[str]:
    journal = open_bench_journal(location)
    try:
        engine = Engine(SPEC, handlers={"phase": lambda _ctx: DONE}, journal=journal)
        run_ids = [engine.start() for _ in range(runs)]
        engine.close()
    finally:
        journal.close()
    return run_ids


def count_transitions(location: str, postgres: tuple[str, str] | None) -> int:
    """Journaled transitions past each run's start (seq 0); ``postgres``: (url, schema)."""
    if postgres is None:
        conn = sqlite3.connect(location)
        try:
            return int(conn.execute("SELECT count(*) FROM transitions WHERE seq > 0").fetchone()[0])
        finally:
            conn.close()
    import psycopg
    from psycopg import sql

    url, schema = postgres
    with psycopg.connect(url, autocommit=True) as server:
        found = server.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE seq > 0").format(
                sql.Identifier(schema, "transitions")
            )
        ).fetchone()
    return int(found[0]) if found else 0


def drain(
    directory: Path, runs: int, workers: int, label: str, postgres: str | None = None
) -> dict[str, Any]:
    """Start ``runs`` runs in a fresh journal, drain it with ``workers`` processes; measure.

    The journal is a new SQLite file in ``directory``, or a new schema in the PostgreSQL
    database at ``postgres`` (dropped again afterwards).
    """
    if postgres is None:
        return _drain(directory, str(directory / f"journal-{label}.db"), runs, workers, label, None)
    schema = new_schema(label)
    try:
        location = with_schema(postgres, schema)
        return _drain(directory, location, runs, workers, label, (postgres, schema))
    finally:
        drop_schema(postgres, schema)


def _drain(
    directory: Path,
    location: str,
    runs: int,
    workers: int,
    label: str,
    postgres: tuple[str, str] | None,
) -> dict[str, Any]:
    run_ids = prepare(location, runs)
    logs = [directory / f"worker-{label}-{index}.log" for index in range(workers)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", location, str(log)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for log in logs
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"worker {proc.pid} did not start: {line!r}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()  # go
        reports = []
        for proc in procs:
            assert proc.stdout is not None
            stdout = proc.stdout.read()
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"worker {proc.pid} exited with {proc.returncode}")
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    elapsed = max(r["ended"] for r in reports) - min(r["started"] for r in reports)

    executions: Counter[tuple[str, ...]] = Counter()
    for log in logs:
        executions.update(tuple(line.split()) for line in log.read_text().splitlines())
    errors = [m for r in reports for m in (*r["escaped"], *r["logged"])]
    locked = [m for m in errors if any(word in m.lower() for word in LOCKED_WORDS)]
    journal = open_bench_journal(location)
    try:
        finished = journal.runs(machine=SPEC.name, limit=runs + 1)
    finally:
        journal.close()
    transitions = count_transitions(location, postgres)
    succeeded = sum(1 for run in finished if run.status is RunLifecycle.SUCCEEDED)
    claimed_once = sum(1 for run in finished if (run.lease_token, run.recoveries) == (1, 0))
    return {
        "workers": workers,
        "runs": len(run_ids),
        "succeeded": succeeded,
        "lost": len(run_ids) - succeeded,
        "claimed_once": claimed_once,
        "transitions": int(transitions),
        "executions": sum(executions.values()),
        "doubles": sum(count - 1 for count in executions.values() if count > 1),
        "locked": len(locked),
        "other_errors": len(errors) - len(locked),
        "error_samples": errors[:3],
        "elapsed": elapsed,
        "taken": sorted((r["taken"] for r in reports), reverse=True),
    }


def raw_commit_rate(directory: Path, commits: int, index: int) -> float:
    """Single-row autocommit INSERTs into the journal's transitions table, WAL + NORMAL."""
    schema = directory / "schema.db"
    if not schema.exists():
        SqliteJournal(schema).close()
    source = sqlite3.connect(schema)
    (ddl,) = source.execute("SELECT sql FROM sqlite_master WHERE name = 'transitions'").fetchone()
    source.close()
    conn = sqlite3.connect(directory / f"raw-{index}.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(ddl)
    at = format_utc(utc_now())
    rows = [
        ("0" * 32, seq, PHASES[seq % 4], DONE, PHASES[(seq + 1) % 4], 0, 1, at, 0.01, None, 1)
        for seq in range(commits + 200)
    ]
    sql = (
        "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt,"
        " at, duration_ms, result, run_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    cursor = conn.cursor()
    for row in rows[:200]:  # warm up
        cursor.execute(sql, row)
    started = time.perf_counter()
    for row in rows[200:]:
        cursor.execute(sql, row)
    elapsed = time.perf_counter() - started
    conn.close()
    return commits / elapsed


def raw_postgres_commit_rate(url: str, commits: int, index: int) -> float:
    """Single-row autocommit INSERTs into a copy of the journal's transitions table, prepared,
    with ``synchronous_commit = on`` (as the journal's own commits)."""
    import psycopg
    from psycopg import sql

    schema = new_schema(f"raw_{index}")
    open_bench_journal(with_schema(url, schema)).close()  # the journal's tables, as workers see
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET synchronous_commit TO on")
            table = sql.Identifier(schema, "raw")
            conn.execute(
                sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                    table, sql.Identifier(schema, "transitions")
                )
            )
            at = utc_now()
            rows = [
                (
                    "0" * 32,
                    seq,
                    PHASES[seq % 4],
                    DONE,
                    PHASES[(seq + 1) % 4],
                    0,
                    1,
                    at,
                    0.01,
                    None,
                    1,
                )
                for seq in range(commits + 200)
            ]
            insert = sql.SQL(
                "INSERT INTO {} (run_id, seq, from_state, event, to_state, iteration, attempt,"
                " at, duration_ms, result, lease_token)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
            ).format(table)
            cursor = conn.cursor()
            for row in rows[:200]:  # warm up
                cursor.execute(insert, row, prepare=True)
            started = time.perf_counter()
            for row in rows[200:]:
                cursor.execute(insert, row, prepare=True)
            elapsed = time.perf_counter() - started
    finally:
        drop_schema(url, schema)
    return commits / elapsed


def describe_postgres(url: str) -> str:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute("SHOW server_version").fetchone()
    return f"PostgreSQL {found[0] if found else '?'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, nargs="+", help="default: 1 2 4 (SQLite), 1 2 4 8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--journal",
        metavar="URL",
        help="a postgresql:// URL: measure on that database (a schema per measurement)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("JOURNAL", "LOG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    postgres = args.journal
    if postgres is not None and not is_postgres(postgres):
        parser.error("--journal takes a postgresql:// URL (SQLite is the default)")
    worker_counts = args.workers or ([1, 2, 4, 8] if postgres else [1, 2, 4])

    medium = describe_postgres(postgres) if postgres else f"sqlite {sqlite3.sqlite_version}"
    print(
        f"python {platform.python_version()}, {medium}, "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    print(
        f"{args.runs} runs x {len(PHASES)} phases per journal; workers {worker_counts}; "
        f"{args.rounds} rounds, medians\n"
    )
    results: dict[int, list[dict[str, Any]]] = {n: [] for n in worker_counts}
    raw_rates = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for round_index in range(args.rounds):  # interleaved, so drift hits every column alike
            if postgres:
                raw_rates.append(
                    raw_postgres_commit_rate(postgres, BASELINE_COMMITS_POSTGRES, round_index)
                )
            else:
                raw_rates.append(raw_commit_rate(directory, BASELINE_COMMITS, round_index))
            for workers in worker_counts:
                results[workers].append(
                    drain(directory, args.runs, workers, f"{workers}w-{round_index}", postgres)
                )
    raw = statistics.median(raw_rates)
    baseline = (
        "raw PostgreSQL single-row commits, 1 process (prepared INSERT, synchronous_commit=on)"
        if postgres
        else "raw SQLite single-row commits, 1 process (WAL, synchronous=NORMAL)"
    )
    print(f"baseline  {baseline}: {raw:,.0f} commits/s ({1e6 / raw:.1f} us/commit)\n")
    header = (
        f"{'workers':>7} {'runs':>6} {'transitions':>11} {'elapsed':>8} {'runs/s':>8} "
        f"{'trans/s':>8} {'vs 1w':>6} {'vs raw':>6} {'doubles':>7} {'lost':>5} {'locked':>6} "
        f"{'other':>5}  result"
    )
    print(header)
    print("-" * len(header))
    failed = False
    base_rate = None
    for workers in worker_counts:
        rounds = results[workers]
        elapsed = statistics.median(r["elapsed"] for r in rounds)
        runs = rounds[0]["runs"]
        transitions = rounds[0]["transitions"]
        trans_rate = statistics.median(r["transitions"] / r["elapsed"] for r in rounds)
        runs_rate = statistics.median(r["runs"] / r["elapsed"] for r in rounds)
        base_rate = base_rate or (trans_rate if workers == 1 else None)
        versus = f"{trans_rate / base_rate:.2f}x" if base_rate else "-"
        doubles = sum(r["doubles"] for r in rounds)
        lost = sum(r["lost"] for r in rounds)
        locked = sum(r["locked"] for r in rounds)
        other = sum(r["other_errors"] for r in rounds)
        problems = [
            name
            for name, bad in (
                ("doubles", doubles),
                ("lost runs", lost),
                ("locked", locked),
                (
                    "runs claimed more than once",
                    any(r["claimed_once"] != r["runs"] for r in rounds),
                ),
                (
                    "phases run != transitions",
                    any(r["transitions"] != r["executions"] for r in rounds),
                ),
            )
            if bad
        ]
        failed = failed or bool(problems)
        verdict = f"FAIL ({', '.join(problems)})" if problems else "PASS"
        print(
            f"{workers:>7} {runs:>6} {transitions:>11} {elapsed:>7.2f}s {runs_rate:>8,.0f} "
            f"{trans_rate:>8,.0f} {versus:>6} {trans_rate / raw:>6.2f} {doubles:>7} {lost:>5} "
            f"{locked:>6} {other:>5}  {verdict}"
        )
    if base_rate:
        print(
            f"\n1 worker: {base_rate:,.0f} journaled transitions/s = {base_rate / raw:.2f} x the raw "
            f"commit rate (each run also costs a claim and a release transaction)"
        )
    print("\nruns taken per worker (last round):")
    for workers in worker_counts:
        print(f"  {workers} worker(s): {' / '.join(map(str, results[workers][-1]['taken']))}")
    samples = [m for rounds in results.values() for r in rounds for m in r["error_samples"]]
    if samples:
        print("\nerrors seen (first ones):")
        for message in samples[:5]:
            print(f"  {message}")
    print(
        f"\ndoubles: a (run, state, visit) whose phase ran more than once; lost: runs that did "
        f"not end succeeded; locked: errors mentioning {'/'.join(LOCKED_WORDS)} surfaced in a "
        f"worker (raised or logged); all summed over {args.rounds} rounds. vs 1w: transitions/s "
        f"over one worker's; vs raw: transitions/s over the baseline commits/s."
    )
    print(f"\n{'FAIL' if failed else 'PASS'}: {'not ' if failed else ''}every check held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
