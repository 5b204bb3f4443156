"""A million runs, flat (issue 28): each section measures one operation on a journal of N runs.

Run from the repository root::

    python tests/bench/bench_scale.py --only check [--runs 20000] [--jobs N] [--baseline-every K]
    python tests/bench/bench_scale.py --only check --runs 1000000 --baseline-every 20

``check`` (issue 28, point 4): builds a journal of ``--runs`` ended runs of 5 transitions each
(one run made by the engine, then cloned in bulk by SQL in the journal's own schema, through its
fence trigger: random run ids, keys in creation order, as a real journal has them), then times
``check_runs`` three ways on fresh journal objects, the file warm in the OS cache:

* ``baseline``: the check as it was — every run read alone, in run-id order (random in the
  key order), through the journal's 16 MiB page cache (``check_runs(run_ids=...)`` takes that
  same path); ``--baseline-every K`` checks every K-th run id only and scales the time up, so a
  million-run journal's baseline takes minutes, not the issue's 381 s;
* ``jobs 1``: ranges of runs in key order, read in bulk, in this process;
* ``jobs N``: the same ranges in N spawned processes (default: the CPU count).

It prints runs/s for each and the time projected for 1,000,000 runs (linear; measured when the
journal holds that many), and PASS/FAIL against the issue's target: the parallel check of
1,000,000 runs in < 60 s. Every way must report the same (no) problems.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import resource
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition  # noqa: E402
from fsm_runner.replay import check_runs  # noqa: E402

NEXT = "NEXT"
PHASES = "abcd"
#: four phases: seqs 0..4, five transitions a run
CHECK_SPEC = MachineSpec(
    "scaled",
    [State(p, handler="noop") for p in PHASES] + [State("done", terminal=True)],
    [Transition(p, NEXT, q) for p, q in zip(PHASES, [*PHASES[1:], "done"], strict=True)],
)
MILLION = 1_000_000
CHECK_TARGET_S = 60.0
#: runs cloned by one INSERT ... SELECT (one transaction each: the WAL stays bounded)
_BATCH = 50_000


def build_check_journal(path: Path, runs: int) -> None:
    """``runs`` ended runs of CHECK_SPEC: one by the engine, the others cloned from it by SQL."""
    with SqliteJournal(path) as journal:
        engine = Engine(CHECK_SPEC, handlers={"noop": lambda _ctx: NEXT}, journal=journal)
        engine.run(engine.start({"n": 0}))
        engine.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.create_function("run_id_of", 1, _run_id_of, deterministic=True)
    (template,) = conn.execute("SELECT run_key FROM run_rows").fetchone()
    columns = [row[1] for row in conn.execute("PRAGMA table_info(run_rows)")]
    copied = [c for c in columns if c not in ("run_key", "run_id")]
    tcolumns = [row[1] for row in conn.execute("PRAGMA table_info(transitions)")]
    tcopied = [c for c in tcolumns if c not in ("run_key", "run_id")]
    for start in range(1, runs, _BATCH):
        end = min(start + _BATCH, runs) - 1
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            f"WITH RECURSIVE n(i) AS (SELECT ? UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
            f" INSERT INTO run_rows (run_key, run_id, {', '.join(copied)})"
            f" SELECT ? + i, run_id_of(i), {', '.join('t.' + c for c in copied)}"
            f" FROM n, run_rows AS t WHERE t.run_key = ?",
            (start, end, template, template),
        )
        conn.execute(
            f"INSERT INTO transitions (run_key, run_id, {', '.join(tcopied)})"
            f" SELECT r.run_key, r.run_id, {', '.join('t.' + c for c in tcopied)}"
            f" FROM run_rows AS r, transitions AS t"
            f" WHERE r.run_key BETWEEN ? AND ? AND t.run_key = ? ORDER BY r.run_key, t.seq",
            (template + start, template + end, template),
        )
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def _run_id_of(n: int) -> str:
    """A run id as random in key order as uuid4's, but the same in every build."""
    return hashlib.md5(f"run {n}".encode(), usedforsecurity=False).hexdigest()


def _timed(path: Path, check: Callable[[SqliteJournal], Any]) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds (this process and the pool's) and what ``check`` returned."""
    with SqliteJournal(path, create=False, checkpoint_thread=False) as journal:
        cpu = _cpu()
        began = time.perf_counter()
        result = check(journal)
        return time.perf_counter() - began, _cpu() - cpu, result


def _cpu() -> float:
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF),
                      resource.getrusage(resource.RUSAGE_CHILDREN))
    )  # fmt: skip


def run_check(args: argparse.Namespace) -> bool:
    """The ``check`` section: build, time the three ways, print; whether it passed."""
    jobs = args.jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        path = Path(tmp) / "journal.db"
        began = time.perf_counter()
        build_check_journal(path, args.runs)
        built = time.perf_counter() - began
        size = path.stat().st_size
        print(
            f"journal: {args.runs:,} runs x 5 transitions, {size / 1e6:,.0f} MB,"
            f" built in {built:.1f} s"
        )
        with SqliteJournal(path, create=False, checkpoint_thread=False) as journal:
            every = journal.run_ids("", limit=sys.maxsize)[:: args.baseline_every]
        rows = []
        for _ in range(args.rounds):
            for name, check in (
                ("baseline", lambda j: check_runs(j, run_ids=every, jobs=1)),
                ("jobs 1", lambda j: check_runs(j, jobs=1)),
                (f"jobs {jobs}", lambda j: check_runs(j, jobs=jobs)),
            ):
                seconds, cpu, report = _timed(path, check)
                assert report.problems == (), report.problems[:3]
                rows.append((name, report.runs, seconds, cpu))
    best: dict[str, tuple[int, float, float]] = {}
    for name, runs, seconds, cpu in rows:
        if name not in best or seconds < best[name][1]:
            best[name] = (runs, seconds, cpu)
    print(
        f"{'way':<10} {'runs':>10} {'seconds':>9} {'runs/s':>10} {'1M runs (s)':>12}"
        f" {'CPU s':>8} {'cores used':>11}"
    )
    for name, (runs, seconds, cpu) in best.items():
        rate = runs / seconds
        print(
            f"{name:<10} {runs:>10,} {seconds:>9.2f} {rate:>10,.0f} {MILLION / rate:>12.1f}"
            f" {cpu:>8.1f} {cpu / seconds:>11.2f}"
        )
    runs, seconds, cpu = best[f"jobs {jobs}"]
    million = seconds if runs >= MILLION else MILLION * seconds / runs
    how = "measured" if runs >= MILLION else "projected (linear)"
    base_runs, base_seconds, _ = best["baseline"]
    speedup = (base_seconds / base_runs) / (seconds / runs)
    ok = million < CHECK_TARGET_S
    print(
        f"check of 1,000,000 runs with {jobs} jobs: {million:.1f} s {how},"
        f" {speedup:.1f}x the baseline's runs/s; target < {CHECK_TARGET_S:.0f} s:"
        f" {'PASS' if ok else 'FAIL'}"
    )
    if cpu / seconds < jobs - 0.5:  # the processes waited for a core: others were running
        print(
            f"  (the {jobs} jobs got {cpu / seconds:.2f} cores: the machine is busy; with"
            f" {jobs} free cores the same CPU time would take ~{cpu / jobs * MILLION / runs:.0f} s"
            " for 1,000,000 runs — an estimate, not a measurement)"
        )
    return ok


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("check")
    group.add_argument("--jobs", type=int, default=None, help="processes (default: CPU count)")
    group.add_argument(
        "--baseline-every", type=int, default=1, help="the baseline checks every K-th run id"
    )


SECTIONS: dict[str, Callable[[argparse.Namespace], bool]] = {"check": run_check}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000, help="runs in the journal")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; best kept")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="sections")
    add_check_arguments(parser)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version},", end=" ")
    print(f"{os.cpu_count()} CPUs")
    passed = [SECTIONS[name](args) for name in args.only or sorted(SECTIONS)]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
