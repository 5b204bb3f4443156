"""PostgreSQL's shape: raw commits, raw batched rows, fsm_runner sync and async, 1/2/4 workers.

    python tests/bench/bench_postgres.py --journal postgresql://root@127.0.0.1/test
        [--runs 400] [--batch 1000] [--rounds 3] [--workers 1 2 4]

One run of this file measures, in interleaved rounds (medians), each in a schema of its own
(dropped afterwards):

* **raw single commits**: psycopg autocommit INSERTs of transition rows, prepared, one a
  commit, ``synchronous_commit = on`` (as the journal's commits): the rate one step a commit
  cannot beat by much (``bench_workers.raw_postgres_commit_rate``).
* **raw batched rows**: the same rows, ``--batch`` a transaction through ``executemany``
  (psycopg pipelines it): what PostgreSQL takes when round trips are not the cost.
* **fsm_runner sync**: ``--runs`` 4-step runs started and run one after another
  (``Engine.start(claim=True)``, stored holding the engine's lease, then ``Engine.run``, which
  writes no claim, as ``bench_short_runs`` does on SQLite): journaled steps a second, starts
  included.
* **fsm_runner async**: ``--runs`` runs started, then all run at once (``asyncio.gather`` of
  ``Engine.arun``): their steps group-committed (one pipeline a group).
* **workers**: ``--runs`` runs drained by 1, 2 and 4 ``Engine.work`` processes on the one
  database (``bench_workers.drain``: every run claimed once, no phase run twice, none lost).

* **start_many**: ``--starts`` runs stored by one ``Engine.start_many`` (spec, run rows, first
  transitions: one transaction), against **their rows inserted raw**: the very rows it wrote,
  read back, inserted into empty copies of the journal's ``runs`` and ``transitions`` (their
  indexes too) by pipelined ``executemany`` in one transaction.

Prints each rate, its ratio to raw single commits and to raw batched rows, and PASS/FAIL
against the floors this bench holds the journal to (async at least raw single commits, sync at
least 0.35 of them, every worker drain clean) and, on separate lines, issue 33's targets: sync
>= 0.6x single, ``--concurrent`` runs at once >= 5x single (and >= 0.2x raw batched rows: the
issue's other form of it, which does not move with the disk's commit), ``start_many`` <= 2x its
raw rows. It prints what a raw single commit costs here beside the issue's machine's.
The exit code follows the floors; a target not met prints ``not met``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

for _path in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_workers import drain, raw_postgres_commit_rate  # noqa: E402

from fsm_runner import Engine, PostgresJournal  # noqa: E402
from fsm_runner.records import utc_now  # noqa: E402
from tests.helpers import NEXT, linear_spec  # noqa: E402

SPEC = linear_spec("a", "b", "c", "d", name="bench_pg")
STEPS = 4  # a - b - c - d - done
SINGLE_COMMITS = 3000
ASYNC_TARGET = 1.0  # x raw single commits
SYNC_TARGET = 0.35
#: Issue 33's targets: sync and many runs at once (x raw single commits), start_many (x raw).
ISSUE_SYNC, ISSUE_CONCURRENT, ISSUE_STARTS = 0.6, 5.0, 2.0
#: The issue's other form of its many-at-once target (x raw batched rows), and the cost of a raw
#: single commit on the machine it was written on (3,512 a second): every "x single" target
#: is relative to the disk's commit, which other machines of its kind did at twice that rate.
ISSUE_CONCURRENT_BATCHED, ISSUE_COMMIT_US = 0.2, 1e6 / 3512


def _schema() -> str:
    return f"bench_pg_{uuid.uuid4().hex[:12]}"


def _drop(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def raw_batched_rate(url: str, rows: int, batch: int) -> float:
    """Transition rows a second, ``batch`` a transaction, through a pipelined ``executemany``."""
    schema = _schema()
    PostgresJournal(url, schema=schema).close()  # the journal's tables
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            table = sql.Identifier(schema, "raw")
            conn.execute(
                sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                    table, sql.Identifier(schema, "transitions")
                )
            )
            insert = sql.SQL(
                "INSERT INTO {} (run_id, seq, from_state, event, to_state, iteration, attempt,"
                " at, duration_ms, result, lease_token) VALUES"
                " (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
            ).format(table)
            at = utc_now()
            values = [
                (f"r{seq // 1_000_000}", seq, "a", NEXT, "b", 0, 1, at, 0.01, None, 1)
                for seq in range(rows)
            ]
            started = time.perf_counter()
            for start in range(0, rows, batch):
                with conn.transaction(), conn.cursor() as cursor:
                    cursor.executemany(insert, values[start : start + batch])
            elapsed = time.perf_counter() - started
    finally:
        _drop(url, schema)
    return rows / elapsed


def _engine(url: str, schema: str, handler: Any) -> Engine:
    journal = PostgresJournal(url, schema=schema)
    return Engine(SPEC, handlers=dict.fromkeys("abcd", handler), journal=journal)


def sync_rate(url: str, runs: int) -> float:
    """Journaled steps a second of ``runs`` runs started and run one after another."""
    schema = _schema()
    engine = _engine(url, schema, lambda _ctx: NEXT)
    try:
        engine.run(engine.start(claim=True))  # warm: the spec stored, statements prepared
        started = time.perf_counter()
        for _ in range(runs):
            engine.run(engine.start(claim=True))  # stored leased: the drive writes no claim
        elapsed = time.perf_counter() - started
    finally:
        engine.journal.close()
        _drop(url, schema)
    return runs * STEPS / elapsed


def async_rate(url: str, runs: int) -> float:
    """Journaled steps a second of ``runs`` runs run all at once (group commits)."""

    async def step(_ctx: Any) -> str:
        return NEXT

    schema = _schema()
    engine = _engine(url, schema, step)
    try:
        run_ids = engine.start_many([{} for _ in range(runs)], claim=False)

        async def main() -> float:
            started = time.perf_counter()
            await asyncio.gather(*(engine.arun(run_id) for run_id in run_ids))
            return time.perf_counter() - started

        elapsed = asyncio.run(main())
    finally:
        engine.journal.close()
        _drop(url, schema)
    return runs * STEPS / elapsed


def _columns(conn: psycopg.Connection[Any], schema: str, table: str) -> list[str]:
    """The columns of a table an INSERT names (not generated, not identity), in order."""
    rows = conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
        " AND table_name = %s AND is_generated = 'NEVER' AND is_identity = 'NO'"
        " ORDER BY ordinal_position",
        (schema, table),
    ).fetchall()
    return [row[0] for row in rows]


def starts_seconds(url: str, starts: int) -> tuple[float, float]:
    """Seconds to ``start_many`` ``starts`` runs, and to insert the same rows raw.

    The raw insert takes the rows the start wrote (runs, and transitions seq 0), read back,
    into empty copies of both tables (``LIKE ... INCLUDING ALL``: their indexes too), each
    table's rows by one pipelined ``executemany``, in one transaction.
    """
    schema = _schema()
    engine = _engine(url, schema, lambda _ctx: NEXT)
    try:
        engine.start()  # warm: the spec stored, statements prepared
        started = time.perf_counter()
        engine.start_many([{"n": n} for n in range(starts)])
        engine_seconds = time.perf_counter() - started
        with psycopg.connect(url, autocommit=True) as conn:
            tables = {}
            for table in ("runs", "transitions"):
                columns = _columns(conn, schema, table)
                select = sql.SQL("SELECT {} FROM {}").format(
                    sql.SQL(", ").join(map(sql.Identifier, columns)),
                    sql.Identifier(schema, table),
                )
                rows = conn.execute(select).fetchall()
                copy = sql.Identifier(schema, f"raw_{table}")
                conn.execute(
                    sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                        copy, sql.Identifier(schema, table)
                    )
                )
                insert = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                    copy,
                    sql.SQL(", ").join(map(sql.Identifier, columns)),
                    sql.SQL(", ").join(sql.Placeholder() * len(columns)),
                )
                tables[table] = (insert, rows)
            started = time.perf_counter()
            with conn.transaction(), conn.cursor() as cursor:
                for insert, rows in tables.values():
                    cursor.executemany(insert, rows)
            raw_seconds = time.perf_counter() - started
    finally:
        engine.journal.close()
        _drop(url, schema)
    return engine_seconds, raw_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--journal", required=True, metavar="URL", help="a postgresql:// URL")
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--concurrent", type=int, default=1000, help="runs run at once (async, group commits)"
    )
    parser.add_argument("--starts", type=int, default=10_000, help="runs one start_many stores")
    args = parser.parse_args()
    url = args.journal
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute("SHOW server_version").fetchone()
    print(
        f"python {platform.python_version()}, PostgreSQL {found[0] if found else '?'},"
        f" {platform.machine()}, {os.cpu_count()} cores; {args.runs} runs x {STEPS} steps;"
        f" {args.rounds} interleaved rounds, medians\n"
    )
    figures: dict[str, list[float]] = {}
    drains: dict[int, list[dict[str, Any]]] = {n: [] for n in args.workers}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            measures = {
                "raw single commits": lambda i=index: raw_postgres_commit_rate(
                    url, SINGLE_COMMITS, i
                ),
                "raw batched rows": lambda: raw_batched_rate(url, 20_000, args.batch),
                "fsm_runner sync": lambda: sync_rate(url, args.runs),
                "fsm_runner async (group commit)": lambda: async_rate(url, args.concurrent),
            }
            for label, measure in measures.items():
                figures.setdefault(label, []).append(measure())
            engine_seconds, raw_seconds = starts_seconds(url, args.starts)
            figures.setdefault("start_many", []).append(engine_seconds)
            figures.setdefault("raw rows of the starts", []).append(raw_seconds)
            for workers in args.workers:
                drained = drain(Path(tmp), args.runs, workers, f"pg{workers}w{index}", url)
                drains[workers].append(drained)
                figures.setdefault(f"{workers} worker process(es)", []).append(
                    drained["transitions"] / drained["elapsed"]
                )
    single = statistics.median(figures["raw single commits"])
    batched = statistics.median(figures["raw batched rows"])
    ok = True
    print(f"  {'':<34} {'per second':>12} {'x single':>9} {'x batched':>10}")
    starts = statistics.median(figures.pop("start_many"))
    raw_starts = statistics.median(figures.pop("raw rows of the starts"))
    for label, values in figures.items():
        rate = statistics.median(values)
        verdict = ""
        if label == "fsm_runner async (group commit)":
            passed = rate / single >= ASYNC_TARGET
            verdict = f"  >= {ASYNC_TARGET:.2f}x single: {'PASS' if passed else 'FAIL'}"
            ok &= passed
        elif label == "fsm_runner sync":
            passed = rate / single >= SYNC_TARGET
            verdict = f"  >= {SYNC_TARGET:.2f}x single: {'PASS' if passed else 'FAIL'}"
            ok &= passed
        elif label.endswith("process(es)"):
            workers = int(label.split()[0])
            clean = all(
                d["doubles"] == 0 and d["lost"] == 0 and d["other_errors"] == 0
                for d in drains[workers]
            )
            verdict = f"  no run lost or run twice: {'PASS' if clean else 'FAIL'}"
            ok &= clean
        print(
            f"  {label:<34} {rate:>12,.0f} {rate / single:>8.2f}x {rate / batched:>9.3f}x{verdict}"
        )
    sync = statistics.median(figures["fsm_runner sync"]) / single
    at_once = statistics.median(figures["fsm_runner async (group commit)"]) / single
    at_once_batched = at_once * single / batched
    print(
        f"\n  start_many of {args.starts:,} runs: {starts * 1000:,.0f} ms against their rows"
        f" inserted raw {raw_starts * 1000:,.0f} ms: {starts / raw_starts:.2f}x"
    )
    print(
        f"  a raw single commit: {1e6 / single:,.0f} us here, {ISSUE_COMMIT_US:,.0f} us on the"
        " machine issue 33 was measured on"
    )
    print("\nissue 33's targets:")
    for what, value, target, met in (
        ("sync, x raw single commits", sync, f">= {ISSUE_SYNC}", sync >= ISSUE_SYNC),
        (
            f"{args.concurrent:,} runs at once, x raw single commits",
            at_once,
            f">= {ISSUE_CONCURRENT}",
            at_once >= ISSUE_CONCURRENT,
        ),
        (
            f"{args.concurrent:,} runs at once, x raw batched rows",
            at_once_batched,
            f">= {ISSUE_CONCURRENT_BATCHED}",
            at_once_batched >= ISSUE_CONCURRENT_BATCHED,
        ),
        (
            f"start_many of {args.starts:,} runs, x their raw rows",
            starts / raw_starts,
            f"<= {ISSUE_STARTS}",
            starts / raw_starts <= ISSUE_STARTS,
        ),
    ):
        print(f"  {what:<46} {value:>6.2f}  {target}: {'met' if met else 'not met'}")
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
