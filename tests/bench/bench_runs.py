"""Per-run cost: starting a run beyond its commit, and runs held in memory by one engine.

Run from the repository root::

    python tests/bench/bench_runs.py [--starts 5000] [--idle 10000]

1. ``Engine.start`` on a file journal against the raw commit it cannot avoid: one transaction
   inserting the same run row and transition seq 0 with prepared SQL (medians of rounds, in the
   same run). Target: the engine adds <= 100 µs per start.
2. ``--idle`` runs held by one engine at once: each is inside ``arun`` with its async handler
   awaiting an event (claimed, leased, its phase prepared), all in one event loop. Memory is
   traced with ``tracemalloc`` from before the runs are started to when all of them wait, and
   the process's resident set is read at both points too (it also sees SQLite's page cache);
   the larger of the two is held to the target.
   Target: <= 50 MB for 10,000. Also checks that no ``transitions`` machine or model is built
   per run (the compiled machine is shared by every run of a spec).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, SqliteJournal  # noqa: E402 - after the path set-up
from fsm_runner.machine import _cache as machine_cache  # noqa: E402
from fsm_runner.records import format_utc, utc_now  # noqa: E402
from tests.helpers import NEXT, linear_spec  # noqa: E402

SPEC = linear_spec("waiting", "b", name="perrun")
START_TARGET_US = 100.0
IDLE_TARGET_MB = 50.0


def engine_starts(path: Path, count: int) -> float:
    with SqliteJournal(path) as journal:
        engine = Engine(
            SPEC, handlers={"waiting": lambda _c: NEXT, "b": lambda _c: NEXT}, journal=journal
        )
        for _ in range(100):
            engine.start({"n": 0})  # warm up
        gc.collect()
        started = time.perf_counter()
        for n in range(count):
            engine.start({"n": n})
        elapsed = time.perf_counter() - started
        engine.close()
    return elapsed / count * 1e6


def raw_starts(path: Path, count: int) -> float:
    """The same two rows per run (run row, transition seq 0), one transaction each."""
    with SqliteJournal(path):
        pass  # the journal's schema, so the rows land in the same tables and indexes
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(
        "INSERT INTO specs (spec_hash, machine, json, created_at) VALUES (?, ?, ?, ?)",
        (SPEC.spec_hash, SPEC.name, SPEC.to_json(), format_utc(utc_now())),
    )
    run_sql = (
        "INSERT INTO run_rows (run_id, machine, spec_hash, state, status, seq, iteration, attempt,"
        " input, context, created_at, updated_at) VALUES (?, ?, ?, 'waiting', 'active', 0, 0, 1,"
        " ?, '{}', ?, ?)"
    )
    transition_sql = (
        "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt,"
        " at, duration_ms, result, lease_token, run_key) VALUES (?, 0, NULL, 'STARTED', 'waiting',"
        " 0, 1, ?, 0.0, NULL, 0, ?)"
    )
    at = format_utc(utc_now())
    rows = [(f"{n:032x}", f'{{"n": {n}}}') for n in range(count + 100)]
    cursor = conn.cursor()

    def one(run_id: str, payload: str) -> None:
        cursor.execute("BEGIN IMMEDIATE")
        cursor.execute(run_sql, (run_id, SPEC.name, SPEC.spec_hash, payload, at, at))
        cursor.execute(transition_sql, (run_id, at, cursor.lastrowid))
        cursor.execute("COMMIT")

    for run_id, payload in rows[:100]:
        one(run_id, payload)
    gc.collect()
    started = time.perf_counter()
    for run_id, payload in rows[100:]:
        one(run_id, payload)
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed / count * 1e6


def rss_mb() -> float:
    """This process's resident set size (Linux), MB: SQLite's page cache is not traced."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1000
    return float("nan")


async def hold_idle(path: Path, count: int) -> tuple[float, float, int]:
    release = asyncio.Event()
    waiting = 0
    all_waiting = asyncio.Event()

    async def wait(_ctx: object) -> str:
        nonlocal waiting
        waiting += 1
        if waiting == count:
            all_waiting.set()
        await release.wait()
        return NEXT

    with SqliteJournal(path) as journal:
        engine = Engine(
            SPEC, handlers={"waiting": wait, "b": lambda _c: NEXT}, journal=journal, lease_ttl=600
        )
        run_ids = [engine.start() for _ in range(count)]
        gc.collect()
        rss_before = rss_mb()
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        tasks = [asyncio.create_task(engine.arun(run_id, max_steps=1)) for run_id in run_ids]
        await all_waiting.wait()
        gc.collect()
        held, _peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_grew = rss_mb() - rss_before
        machines = len(machine_cache)
        release.set()
        await asyncio.gather(*tasks)
        engine.close()
    return (held - base) / 1e6, rss_grew, machines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5000)
    parser.add_argument("--idle", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}\n")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        engine_us, raw_us = [], []
        for index in range(args.rounds):
            engine_us.append(engine_starts(directory / f"e{index}.db", args.starts))
            raw_us.append(raw_starts(directory / f"r{index}.db", args.starts))
        engine_median, raw_median = statistics.median(engine_us), statistics.median(raw_us)
        extra = engine_median - raw_median
        verdict = "PASS" if extra <= START_TARGET_US else "FAIL"
        failed |= extra > START_TARGET_US
        print(f"start a run ({args.starts:,} x {args.rounds} rounds, medians):")
        print(f"  engine.start   {engine_median:7.1f} µs")
        print(f"  raw commit     {raw_median:7.1f} µs   (run row + transition seq 0, prepared SQL)")
        print(f"  engine adds    {extra:7.1f} µs   target <= {START_TARGET_US:.0f} µs: {verdict}\n")
        megabytes, rss_grew, machines = asyncio.run(hold_idle(directory / "idle.db", args.idle))
        worst = max(megabytes, rss_grew)
        verdict = "PASS" if worst <= IDLE_TARGET_MB else "FAIL"
        failed |= worst > IDLE_TARGET_MB
        print(f"{args.idle:,} runs held at once by one engine (async phases awaiting):")
        print(
            f"  traced memory  {megabytes:7.1f} MB   ({megabytes * 1e6 / args.idle:,.0f} bytes a run)"
        )
        print(
            f"  resident set   {rss_grew:7.1f} MB more   (tracemalloc plus what it does not see:"
            " SQLite's page cache, allocator slack)"
        )
        print(f"  the larger of the two against target <= {IDLE_TARGET_MB:.0f} MB: {verdict}")
        print(
            f"  compiled transitions machines: {machines} in this process (one per spec, none per run)"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
