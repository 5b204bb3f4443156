"""Journaled steps per second against SQLite's own single-row commit rate, in one run.

    python tests/bench/bench_engine.py [--steps 20000] [--rounds 5]

Engine: one run of a 4-state loop (a → b → c → d → a …) with no-op handlers, on a file
journal, durability ``process`` (and ``power``). Baseline: raw ``sqlite3`` inserts of the same
row shape — the journal's own ``transitions`` table definition, rows with the same values —
one commit per row, in a fresh file with the same pragmas (WAL; synchronous NORMAL, or FULL
for ``power``; the journal's ``TUNING``), with pre-built rows and one reused cursor: the
fastest plain loop, so the ratio is an honest one. Rounds are interleaved and the median is reported. Target: ratio >= 0.6.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition
from fsm_runner.journal.sqlite import TUNING
from fsm_runner.records import format_utc, utc_now

TARGET = 0.6
NAMES = ["a", "b", "c", "d"]
SPEC = MachineSpec(
    "bench-loop",
    [State(n, handler="noop") for n in NAMES],
    [Transition(n, "NEXT", m) for n, m in zip(NAMES, NAMES[1:] + NAMES[:1], strict=True)],
)


def noop(ctx: object) -> str:
    return "NEXT"


def engine_rate(directory: Path, steps: int, durability: str, index: int) -> float:
    journal = SqliteJournal(directory / f"engine-{durability}-{index}.db", durability=durability)  # type: ignore[arg-type]
    engine = Engine(SPEC, handlers={"noop": noop}, journal=journal)
    run_id = engine.start()
    engine.run(run_id, max_steps=200)  # warm up: statement cache, compiled machine
    gc.collect()
    started = time.perf_counter()
    run = engine.run(run_id, max_steps=steps)
    elapsed = time.perf_counter() - started
    assert run.seq == steps + 200, run.seq
    journal.close()
    return steps / elapsed


def raw_rate(directory: Path, steps: int, durability: str, index: int, ddl: str) -> float:
    conn = sqlite3.connect(directory / f"raw-{durability}-{index}.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = " + ("FULL" if durability == "power" else "NORMAL"))
    for pragma, value in TUNING.items():  # the journal's own tuning: the same pragmas
        conn.execute(f"PRAGMA {pragma} = {value}")
    conn.execute(ddl)
    run_id = "0" * 32
    at = format_utc(utc_now())
    rows = [
        (run_id, seq, NAMES[seq % 4], "NEXT", NAMES[(seq + 1) % 4], 0, 1, at, 0.012, None, 1, 1)
        for seq in range(steps + 200)
    ]
    sql = (
        "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt,"
        " at, duration_ms, result, lease_token, run_key)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    cursor = conn.cursor()
    for row in rows[:200]:
        cursor.execute(sql, row)  # autocommit: every INSERT is its own committed transaction
    gc.collect()
    started = time.perf_counter()
    for row in rows[200:]:
        cursor.execute(sql, row)
    elapsed = time.perf_counter() - started
    conn.close()
    return steps / elapsed


def transitions_ddl(directory: Path) -> str:
    with SqliteJournal(directory / "schema.db") as journal:
        journal.close()
    conn = sqlite3.connect(directory / "schema.db")
    (ddl,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'transitions'").fetchone()
    conn.close()
    return str(ddl)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, {platform.machine()}"
    )
    print(f"{args.steps} steps x {args.rounds} rounds, medians\n")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        ddl = transitions_ddl(directory)
        for durability, steps in (("process", args.steps), ("power", max(args.steps // 5, 1000))):
            engine_rates, raw_rates = [], []
            for index in range(args.rounds):
                engine_rates.append(engine_rate(directory, steps, durability, index))
                raw_rates.append(raw_rate(directory, steps, durability, index, ddl))
            engine_median = statistics.median(engine_rates)
            raw_median = statistics.median(raw_rates)
            ratio = engine_median / raw_median
            verdict = ""
            if durability == "process":
                verdict = "PASS" if ratio >= TARGET else "FAIL"
                failed = ratio < TARGET
                verdict = f"  target >= {TARGET}: {verdict}"
            print(f"durability {durability}:")
            print(
                f"  engine  {engine_median:>9,.0f} journaled steps/s  ({1e6 / engine_median:.1f} us/step)"
            )
            print(
                f"  raw     {raw_median:>9,.0f} commits/s          ({1e6 / raw_median:.1f} us/commit)"
            )
            print(f"  ratio   {ratio:.2f}{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
