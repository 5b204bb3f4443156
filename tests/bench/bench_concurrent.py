"""Many runs at once in one process: group commit against SQLite's single-row commit limit.

Run from the repository root::

    python tests/bench/bench_concurrent.py [--runs 1000] [--steps 100] [--rounds 5]

``--runs`` runs of a 4-state loop (async no-op handlers) are driven concurrently by one engine
in one event loop (``asyncio.gather`` of ``Engine.arun``), each for ``--steps`` steps, on a file
journal with durability ``process``. The figure is the aggregate of journaled steps per second
over the whole drive (claims and releases included). Baseline, measured in the same run: raw
``sqlite3`` single-row commits of the same row shape (the journal's own ``transitions`` table,
one autocommit INSERT per row, WAL + synchronous NORMAL) — the single-row commit limit.
Target: group commit >= 1.0x that limit. Also printed: the same drive with
``group_commit=False`` (one transaction per step) and the transactions' mean size.

Every run's next phase still starts only after its own transition is durable: checked here
after each drive (every run at its last seq, gapless) and, for every phase, by
tests/test_group_commit.py.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_engine import raw_rate, transitions_ddl  # noqa: E402

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition  # noqa: E402
from fsm_runner.engine import async_driver  # noqa: E402

TARGET = 1.0
NAMES = ["a", "b", "c", "d"]
SPEC = MachineSpec(
    "bench-concurrent",
    [State(n, handler="noop") for n in NAMES],
    [Transition(n, "NEXT", m) for n, m in zip(NAMES, NAMES[1:] + NAMES[:1], strict=True)],
)


async def noop(ctx: object) -> str:
    return "NEXT"


#: The group committers the engine made (one per event loop): what their transactions held.
_MADE: list[async_driver.GroupCommitter] = []
_GroupCommitter = async_driver.GroupCommitter


def _recorded_committer(*args: Any, **kwargs: Any) -> async_driver.GroupCommitter:
    _MADE.append(_GroupCommitter(*args, **kwargs))
    return _MADE[-1]


async_driver.GroupCommitter = _recorded_committer  # type: ignore[assignment,misc]


def drive(path: Path, runs: int, steps: int, *, group_commit: bool) -> tuple[float, float]:
    """Steps per second of ``runs`` concurrent runs, and the mean commits per transaction."""
    _MADE.clear()
    with SqliteJournal(path) as journal:
        engine = Engine(SPEC, handlers={"noop": noop}, journal=journal, group_commit=group_commit)
        run_ids = [engine.start() for _ in range(runs)]

        async def main() -> float:
            gc.collect()
            started = time.perf_counter()
            done = await asyncio.gather(*(engine.arun(r, max_steps=steps) for r in run_ids))
            elapsed = time.perf_counter() - started
            assert all(run.seq == steps for run in done), "a run stopped short"
            return elapsed

        elapsed = asyncio.run(main())
        committer = _MADE[-1] if _MADE else None
        batch = committer.commits / committer.transactions if committer else 1.0
        for run_id in run_ids[:: max(runs // 20, 1)]:
            seqs = [t.seq for t in journal.transitions(run_id)]
            assert seqs == list(range(steps + 1)), f"{run_id}: seqs {seqs[:5]}..."
        engine.close()
    return runs * steps / elapsed, batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, {platform.machine()}"
    )
    print(f"{args.runs} concurrent runs x {args.steps} steps, {args.rounds} rounds, medians\n")
    grouped, single, raw, batches = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        ddl = transitions_ddl(directory)
        for index in range(args.rounds):
            rate, batch = drive(
                directory / f"group-{index}.db", args.runs, args.steps, group_commit=True
            )
            grouped.append(rate)
            batches.append(batch)
            single.append(
                drive(directory / f"single-{index}.db", args.runs, args.steps, group_commit=False)[
                    0
                ]
            )
            raw.append(raw_rate(directory, 20_000, "process", index, ddl))
    group_rate, single_rate, raw_limit = map(statistics.median, (grouped, single, raw))
    ratio = group_rate / raw_limit
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    print(
        f"  group commit    {group_rate:>9,.0f} journaled steps/s  (mean {statistics.median(batches):,.0f} commits per transaction)"
    )
    print(
        f"  one per step    {single_rate:>9,.0f} journaled steps/s  ({single_rate / raw_limit:.2f}x)"
    )
    print(f"  raw limit       {raw_limit:>9,.0f} single-row commits/s")
    print(f"  ratio   {ratio:.2f}  target >= {TARGET}: {verdict}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
