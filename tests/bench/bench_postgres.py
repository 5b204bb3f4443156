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

Prints each rate, its ratio to raw single commits and to raw batched rows, and PASS/FAIL:
async at least raw single commits (a group's commits cost a round trip or two, not one each),
sync at least 0.35 of them (one statement a step), and every worker drain clean.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--journal", required=True, metavar="URL", help="a postgresql:// URL")
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
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
                "fsm_runner async (group commit)": lambda: async_rate(url, args.runs),
            }
            for label, measure in measures.items():
                figures.setdefault(label, []).append(measure())
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
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
