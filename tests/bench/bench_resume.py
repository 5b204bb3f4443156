"""Resume latency: open a journal, load a run, and be ready to call its handler.

Run from the repository root::

    python tests/bench/bench_resume.py [--small 100x100] [--large 10000x100] [--samples 300]

Two journals, ``RUNSxTRANSITIONS``: the small one 100 runs of 100 transitions (10,000), the large
one 10,000 runs of 100 (1,000,000). For random runs of each, a fresh ``SqliteJournal`` is opened
and an engine (built once, as a worker process would, and given that journal) resumes the run; the clock stops when the
run's handler is entered. That covers opening the file and checking its schema, loading the run
row, claiming its lease (one write transaction) and preparing the phase. Prints the median and
p95, the large/small ratio (target <= 1.5: flat in journal size) and PASS/FAIL against the 1 ms
median target; also the same with the journal already open (``warm``).
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, SqliteJournal  # noqa: E402 - after the path set-up
from fsm_runner.records import format_utc, utc_now  # noqa: E402
from tests.helpers import NEXT, loop_spec  # noqa: E402

SPEC = loop_spec()
NAMES = ["a", "b", "c", "d"]
TARGET_MS = 1.0
FLAT = 1.5


class _Entered(BaseException):
    """Raised by the handler the moment it is called: the engine is ready, the clock stops."""


def fill(path: Path, runs: int, transitions: int) -> list[str]:
    """``runs`` runs of the 4-state loop with ``transitions`` transitions each."""
    with SqliteJournal(path) as journal:
        engine = Engine(SPEC, handlers={"noop": lambda _ctx: NEXT}, journal=journal)
        run_ids = [engine.start() for _ in range(runs)]
        engine.close()
    conn = sqlite3.connect(path, isolation_level=None)
    at = format_utc(utc_now())
    conn.execute("BEGIN")
    keys = dict(conn.execute("SELECT run_id, run_key FROM run_rows"))
    conn.executemany(
        "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt,"
        " at, duration_ms, result, lease_token, run_key)"
        " VALUES (?, ?, ?, ?, ?, 0, 1, ?, 0.01, NULL, 0, ?)",
        (
            (run_id, seq, NAMES[(seq - 1) % 4], NEXT, NAMES[seq % 4], at, keys[run_id])
            for run_id in run_ids
            for seq in range(1, transitions)
        ),
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return run_ids


def resume_ms(path: Path, run_ids: list[str], samples: int, *, warm: bool) -> list[float]:
    entered: list[float] = []

    def noop(_ctx: object) -> str:
        entered.append(time.perf_counter())
        raise _Entered

    engine = Engine(SPEC, handlers={"noop": noop}, journal=SqliteJournal(path))
    chosen = random.Random(7).sample(run_ids, samples)
    times = []
    gc.collect()
    kept = engine.journal
    for run_id in chosen:
        started = time.perf_counter()
        if not warm:  # a new connection, as a new process (or `fsm-runner resume`) opens
            engine.journal = SqliteJournal(path)
        try:
            engine.run(run_id)
        except _Entered:
            times.append((entered[-1] - started) * 1000)
        if not warm:
            engine.journal.close()
    kept.close()
    engine.close()
    return times


def describe(times: list[float]) -> str:
    ordered = sorted(times)
    p95 = ordered[int(len(ordered) * 0.95) - 1]
    return f"median {statistics.median(times):6.3f} ms   p95 {p95:6.3f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", default="100x100")
    parser.add_argument("--large", default="10000x100")
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    print(
        f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, {platform.machine()}\n"
    )
    failed = False
    medians: dict[tuple[str, bool], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in (("small", args.small), ("large", args.large)):
            runs, per_run = (int(part) for part in shape.split("x"))
            path = Path(tmp) / f"{label}.db"
            started = time.perf_counter()
            run_ids = fill(path, runs, per_run)
            size = path.stat().st_size
            print(
                f"{label}: {runs:,} runs x {per_run} = {runs * per_run:,} transitions, "
                f"{size / 1e6:.1f} MB ({time.perf_counter() - started:.1f} s to fill)"
            )
            for warm in (False, True):
                times = resume_ms(path, run_ids, min(args.samples, runs), warm=warm)
                medians[label, warm] = statistics.median(times)
                kind = "warm (journal open)" if warm else "cold (open + resume)"
                print(f"  {kind:<22} {describe(times)}")
    cold = medians["large", False]
    ratio = cold / medians["small", False]
    print()
    verdict = "PASS" if cold <= TARGET_MS else "FAIL"
    failed |= cold > TARGET_MS
    print(f"large cold median {cold:.3f} ms   target <= {TARGET_MS} ms: {verdict}")
    verdict = "PASS" if ratio <= FLAT else "FAIL"
    failed |= ratio > FLAT
    print(f"large / small      {ratio:.2f}x      target <= {FLAT}x: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
