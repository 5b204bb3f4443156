"""Journaled steps per second on PostgreSQL against psycopg's own single-row commit rate.

    python tests/bench/bench_postgres_steps.py --journal postgresql://root@127.0.0.1/test
        [--steps 5000] [--runs 500] [--rounds 5]

Two workloads, each in a schema of its own (``bench_pg_steps_...``, dropped afterwards):

* ``one run``: bench_engine's loop (one run of a 4-state loop, no-op handlers) for ``--steps``
  steps: every commit is the hot path's one statement (the run row's fenced UPDATE and the
  transition's INSERT), its digests chained to the head the journal wrote itself.
* ``claimed``: ``--runs`` runs started by one journal, then each run by an engine on another
  for one step (``Engine.run(max_steps=1)``: its claim, the step, its release): the first
  commit after a claim, whose head digest the claiming journal did not write.

Baseline, measured in the same run: psycopg autocommit INSERTs (prepared, one reused cursor,
``synchronous_commit = on`` as the journal's commits) of transition rows into a table of the
journal's own ``transitions`` definition. Rounds are interleaved and medians reported. Also,
of the one-run workload: this process's CPU a step (the client's work, which a loaded server's
disk does not move), the share of the run row's updates that were HOT, and a transition row's
size. To compare two checkouts, run this file with each one's interpreter, in turns.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

for _path in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_engine import NAMES, SPEC, noop  # noqa: E402  - the loop the SQLite bench steps

from fsm_runner import Engine, PostgresJournal  # noqa: E402
from fsm_runner.records import utc_now  # noqa: E402


def with_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}schema={urllib.parse.quote(schema)}"


def drop(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def one_run(url: str, steps: int) -> tuple[float, float, float, float]:
    """Steps/s (wall), this process's CPU a step (µs), HOT share of run-row updates, bytes a row."""
    schema = f"bench_pg_steps_{uuid.uuid4().hex[:12]}"
    try:
        journal = PostgresJournal(with_schema(url, schema))
        engine = Engine(SPEC, handlers={"noop": noop}, journal=journal)
        run_id = engine.start()
        engine.run(run_id, max_steps=200)  # warm up: prepared statements, compiled machine
        gc.collect()
        started, cpu = time.perf_counter(), time.process_time()
        run = engine.run(run_id, max_steps=steps)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert run.seq == steps + 200, run.seq
        engine.close()
        journal.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_force_next_flush()")
            time.sleep(0.6)  # the statistics collector's next report
            updated, hot = conn.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                " WHERE schemaname = %s AND relname = 'runs'",
                (schema,),
            ).fetchone() or (0, 0)
            width = conn.execute(
                sql.SQL("SELECT avg(pg_column_size(t.*)) FROM {}.transitions AS t").format(
                    sql.Identifier(schema)
                )
            ).fetchone()
        hot_share = hot / updated if updated else 0.0
        return steps / elapsed, cpu / steps * 1e6, hot_share, float(width[0] if width else 0)
    finally:
        drop(url, schema)


def claimed(url: str, runs: int) -> float:
    schema = f"bench_pg_steps_{uuid.uuid4().hex[:12]}"
    try:
        starter = PostgresJournal(with_schema(url, schema))
        run_ids = Engine(SPEC, handlers={"noop": noop}, journal=starter).start_many([{}] * runs)
        starter.close()
        journal = PostgresJournal(with_schema(url, schema))
        engine = Engine(SPEC, handlers={"noop": noop}, journal=journal)
        gc.collect()
        started = time.perf_counter()
        for run_id in run_ids:  # claimed, stepped once, released: by the engine
            assert engine.run(run_id, max_steps=1).seq == 1
        elapsed = time.perf_counter() - started
        engine.close()
        journal.close()
        return runs / elapsed
    finally:
        drop(url, schema)


def raw(url: str, steps: int) -> float:
    schema = f"bench_pg_steps_{uuid.uuid4().hex[:12]}"
    try:
        PostgresJournal(with_schema(url, schema)).close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            conn.execute(
                "INSERT INTO specs VALUES ('h', 'm', '{}', now());"
                "INSERT INTO runs (run_id, machine, spec_hash, state, status, seq, created_at)"
                " VALUES ('r', 'm', 'h', 'a', 'active', 0, now())"
            )
            at = utc_now()
            rows: list[tuple[Any, ...]] = [
                ("r", seq, NAMES[seq % 4], "NEXT", NAMES[(seq + 1) % 4], 0, 1, at, 0.012, None, 1)
                for seq in range(steps + 200)
            ]
            cursor = conn.cursor()
            statement = (
                "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration,"
                " attempt, at, duration_ms, result, lease_token)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
            )
            for row in rows[:200]:
                cursor.execute(statement, row, prepare=True)
            gc.collect()
            started = time.perf_counter()
            for row in rows[200:]:
                cursor.execute(statement, row, prepare=True)
            elapsed = time.perf_counter() - started
        return steps / elapsed
    finally:
        drop(url, schema)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--journal", required=True, help="a PostgreSQL URL")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, psycopg {psycopg.__version__}")
    print(f"{args.steps} steps, {args.runs} claimed runs x {args.rounds} rounds, medians\n")
    rates: dict[str, list[float]] = {"one run": [], "claimed": [], "raw": []}
    cpus, hots, widths = [], [], []
    for _ in range(args.rounds):
        rate, cpu, hot, width = one_run(args.journal, args.steps)
        rates["one run"].append(rate)
        cpus.append(cpu)
        hots.append(hot)
        widths.append(width)
        rates["claimed"].append(claimed(args.journal, args.runs))
        rates["raw"].append(raw(args.journal, args.steps))
    base = statistics.median(rates["raw"])
    for name, unit in (("one run", "steps/s"), ("claimed", "claim+step/s"), ("raw", "commits/s")):
        median = statistics.median(rates[name])
        print(
            f"  {name:<8} {median:>8,.0f} {unit:<13} ({1e6 / median:7.1f} us)"
            f"  ratio to raw {median / base:.2f}"
        )
    print(
        f"  one run: {statistics.median(cpus):.1f} us of this process's CPU a step;"
        f" HOT run-row updates {statistics.median(hots):.0%}; a transition row"
        f" {statistics.median(widths):.0f} bytes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
