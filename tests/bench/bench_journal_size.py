"""Journal size: bytes per transition, and what `prune` gives back.

Run from the repository root::

    python tests/bench/bench_journal_size.py [--runs 10000] [--transitions 100] [--active 100]

Fills a journal with ``runs`` ended runs of ``transitions`` transitions each (written through the
journal's own trigger, in one transaction, as the engine would have written them one by one)
plus ``active`` runs that have not ended, reports the file's bytes per transition, prunes every
ended run (`Journal.prune`, which deletes them with all they own and then VACUUMs), and reports
the size after it as a share of the size before (target: under 5 %). A raw table of the same rows
without the journal's indexes, trigger and run rows is the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition  # noqa: E402
from fsm_runner.records import format_utc, utc_now  # noqa: E402

NEXT, DONE = "NEXT", "DONE"
SPEC = MachineSpec(
    "sized",
    [State(n, handler="noop") for n in "abcd"] + [State("done", terminal=True)],
    [Transition(n, NEXT, m) for n, m in zip("abcd", "bcda", strict=True)]
    + [Transition("*", DONE, "done")],
)
TARGET = 0.05


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def fill(path: Path, runs: int, per_run: int, active: int) -> int:
    with SqliteJournal(path) as journal:
        engine = Engine(SPEC, handlers={"noop": lambda _ctx: NEXT}, journal=journal)
        ended = [engine.start({"n": n}) for n in range(runs)]
        for _ in range(active):
            engine.run(engine.start(), max_steps=3)
        engine.close()
    at = format_utc(utc_now() - dt.timedelta(days=2))
    names = "abcd"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    keys = dict(conn.execute("SELECT run_id, run_key FROM run_rows"))
    conn.executemany(
        "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt,"
        " at, duration_ms, result, lease_token, run_key)"
        " VALUES (?, ?, ?, ?, ?, 0, 1, ?, 0.01, NULL, 0, ?)",
        (
            (run_id, seq, names[(seq - 1) % 4], *(
                (DONE, "done") if seq == per_run - 1 else (NEXT, names[seq % 4])
            ), at, keys[run_id])
            for run_id in ended
            for seq in range(1, per_run)
        ),
    )  # fmt: skip
    conn.execute(
        "UPDATE run_rows SET status = 'succeeded'"
        " WHERE run_id IN (SELECT run_id FROM runs WHERE state = 'done')"
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return runs * per_run + active * 4


def raw_bytes(directory: Path, rows: int) -> int:
    """The same number of transition rows in a bare table: no indexes, trigger or run rows."""
    path = directory / "raw.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "CREATE TABLE t (run_id TEXT, seq INTEGER, from_state TEXT, event TEXT, to_state TEXT,"
        " iteration INTEGER, attempt INTEGER, at TEXT, duration_ms FLOAT, result TEXT,"
        " lease_token INTEGER, run_key INTEGER)"
    )
    at = format_utc(utc_now())
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO t VALUES (?, ?, 'a', 'NEXT', 'b', 0, 1, ?, 0.01, NULL, 0, ?)",
        ((f"{n // 100:032x}", n % 100, at, n // 100 + 1) for n in range(rows)),
    )
    conn.execute("COMMIT")
    conn.close()
    return size(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--transitions", type=int, default=100)
    parser.add_argument("--active", type=int, default=100)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.db"
        started = time.perf_counter()
        count = fill(path, args.runs, args.transitions, args.active)
        before = size(path)
        print(
            f"journal: {args.runs:,} ended runs x {args.transitions} + {args.active} active = "
            f"{count:,} transitions ({time.perf_counter() - started:.1f} s to fill)"
        )
        raw = raw_bytes(Path(tmp), count)
        print(f"  size            {before / 1e6:8.1f} MB   {before / count:6.1f} bytes/transition")
        print(f"  raw rows        {raw / 1e6:8.1f} MB   {raw / count:6.1f} bytes/transition")
        print(f"  ratio           {before / raw:8.2f}x the raw rows")
        with SqliteJournal(path) as journal:
            started = time.perf_counter()
            report = journal.prune(ended_before=utc_now() - dt.timedelta(days=1))
            took = time.perf_counter() - started
            assert len(journal.runs(status="active")) == args.active
        after = size(path)
        share = after / before
        print(
            f"prune: {len(report.run_ids):,} runs, {report.transitions:,} transitions in "
            f"{took:.1f} s (VACUUM included)"
        )
        verdict = "PASS" if share < TARGET else "FAIL"
        print(
            f"  after           {after / 1e6:8.2f} MB   {share:.2%} of before   "
            f"target < {TARGET:.0%}: {verdict}"
        )
    return 0 if share < TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
