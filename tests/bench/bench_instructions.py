"""CPU instructions per journaled step, counted by callgrind: sync runs and async group commit.

    python tests/bench/bench_instructions.py [--steps 2000] [--runs 100] [--async-steps 20]
        [--python OTHER_CHECKOUT/.venv/bin/python ...]

Wall-clock rates move with whatever else the machine runs; instruction counts barely do, so
this is the figure to compare two versions of the step path on a busy machine. Each workload
runs under ``valgrind --tool=callgrind`` twice, in a fresh process: once whole, and once stopped
just before the measured steps (the setup: imports, journal, engine, runs started, a few
warm-up steps); the difference divided by the steps taken is the figure per journaled step.
A third run takes a fifth of the steps: the whole run less it, over the steps between them, is
the steady figure (without what the measured part pays once), which the ratio compares.

The journals run without their checkpoint thread (``checkpoint_thread=False``): it wakes on a
timer, and under callgrind's slowdown its wake-ups would count in the figures at random.

* ``sync``: one run of a 4-state loop with plain no-op handlers, ``Engine.run`` for ``--steps``
  steps, on a :class:`SqliteJournal` in a temporary directory (durability ``process``).
* ``async``: ``--runs`` runs of the same loop with async no-op handlers, driven together by
  ``asyncio.gather`` of ``Engine.arun`` (group commit) for ``--async-steps`` steps each.
* ``short``: ``--short-runs`` runs of a 3-step machine one after another, each
  ``start(claim=True)`` then ``run``: the per-run fixed cost with its steps (figure per run).
* ``check`` (with ``--modes check``): a journal of ``--check-runs`` ended runs of 5 transitions
  (``bench_scale``'s check journal: one run by the engine, cloned by SQL), then
  ``check_runs(journal)`` in this process (ranges and the medium's checks: figure per run). Its
  setup builds the same journal, so "less the setup" is the check alone; the steady figure is
  the check of ``--check-runs`` runs less the check of a fifth as many, each less its own setup.
* ``raw`` (the baseline, measured in the same run): ``sqlite3`` single-row autocommit INSERTs
  into a table of the transitions' shape, WAL + synchronous NORMAL: SQLite's own cost of one
  commit, which every journaled step pays at least once.

Each interpreter given with ``--python`` (e.g. an untouched checkout's virtual environment)
is measured in the same run, each using the ``fsm_runner`` it has installed, and the ratio of
this checkout's figure to the first of them is printed. The workloads use the public API only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
#: Steps every workload takes before the measured ones (statements prepared, caches warm).
WARM_UP = 8


# The children import fsm_runner inside their functions: the parent process never does, and
# each child imports the fsm_runner its interpreter has installed (``--python``).


def _spec(handler: Any) -> tuple[Any, dict[str, Any]]:
    from fsm_runner import MachineSpec, State, Transition

    names = ["a", "b", "c", "d"]
    spec = MachineSpec(
        "bench-instructions",
        [State(n, handler="noop") for n in names],
        [Transition(n, "NEXT", m) for n, m in zip(names, names[1:] + names[:1], strict=True)],
    )
    return spec, {"noop": handler}


def child_sync(directory: Path, steps: int, *, setup_only: bool) -> None:
    """One run, ``Engine.run`` for ``steps`` plain steps (after the warm-up)."""
    from fsm_runner import Engine, SqliteJournal

    def noop(_ctx: object) -> str:
        return "NEXT"

    spec, handlers = _spec(noop)
    with SqliteJournal(directory / "sync.db", checkpoint_thread=False) as journal:
        engine = Engine(spec, handlers=handlers, journal=journal, lease_ttl=86400.0)
        run_id = engine.start()
        engine.run(run_id, max_steps=WARM_UP)
        gc.freeze()  # the setup's objects: not traversed again by the measured steps' collections
        if not setup_only:
            assert engine.run(run_id, max_steps=steps).seq == WARM_UP + steps
        engine.close()


def child_async(directory: Path, runs: int, steps: int, *, setup_only: bool) -> None:
    """``runs`` runs driven together by ``arun`` (group commit), ``steps`` steps each."""
    import asyncio

    from fsm_runner import Engine, SqliteJournal

    async def noop(_ctx: object) -> str:
        return "NEXT"

    spec, handlers = _spec(noop)
    with SqliteJournal(directory / "async.db", checkpoint_thread=False) as journal:
        engine = Engine(spec, handlers=handlers, journal=journal, lease_ttl=86400.0)
        run_ids = [engine.start() for _ in range(runs)]

        async def drive(count: int) -> None:
            done = await asyncio.gather(*(engine.arun(r, max_steps=count) for r in run_ids))
            assert all(run.status.value == "active" for run in done)

        asyncio.run(drive(WARM_UP))
        gc.freeze()
        if not setup_only:
            asyncio.run(drive(steps))
        engine.close()


def child_short(directory: Path, runs: int, *, setup_only: bool) -> None:
    """``runs`` short runs one after another: ``start(claim=True)`` then ``run`` (3 steps)."""
    from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition

    def noop(_ctx: object) -> str:
        return "NEXT"

    spec = MachineSpec(
        "bench-short",
        [*(State(n, handler="noop") for n in "abc"), State("done", terminal=True)],
        [Transition(n, "NEXT", m) for n, m in zip("abc", ["b", "c", "done"], strict=True)],
    )
    with SqliteJournal(directory / "short.db", checkpoint_thread=False) as journal:
        engine = Engine(spec, handlers={"noop": noop}, journal=journal, lease_ttl=86400.0)
        for _ in range(WARM_UP):
            engine.run(engine.start(claim=True))
        gc.freeze()
        if not setup_only:
            for _ in range(runs):
                assert engine.run(engine.start(claim=True)).seq == 3
        engine.close()


def child_check(directory: Path, runs: int, *, setup_only: bool) -> None:
    """``check_runs`` of a journal of ``runs`` ended runs (bench_scale's), in this process."""
    from fsm_runner import SqliteJournal  # the interpreter's own, before this checkout's path
    from fsm_runner.replay import check_runs

    # scale_journals (and the tests' helpers it uses) from this checkout
    sys.path[:0] = [str(HERE.parents[2]), str(HERE.parent)]
    from scale_journals import build_check_journal

    path = directory / "check.db"
    build_check_journal(path, runs)
    with SqliteJournal(path, checkpoint_thread=False) as journal:
        gc.freeze()
        if not setup_only:
            report = check_runs(journal)
            assert report.runs == runs, report
            assert not report.problems, report


def child_raw(directory: Path, steps: int, *, setup_only: bool) -> None:
    """``steps`` single-row autocommit INSERTs of a transition's shape (SQLite's own cost)."""
    import sqlite3

    conn = sqlite3.connect(directory / "raw.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(
        "CREATE TABLE transitions (run_id TEXT, seq INTEGER, from_state TEXT, event TEXT,"
        " to_state TEXT, at TEXT, duration_ms REAL, PRIMARY KEY (run_id, seq))"
    )
    sql = "INSERT INTO transitions VALUES (?, ?, ?, ?, ?, ?, ?)"
    cursor = conn.cursor()
    row = ["0123456789abcdef0123456789abcdef", 0, "a", "NEXT", "b", "2030-01-01T00:00:00Z", 0.01]
    for seq in range(WARM_UP + (0 if setup_only else steps)):
        row[1] = seq
        cursor.execute(sql, row)
    conn.close()


def child(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if args.child == "sync":
            child_sync(directory, args.steps, setup_only=args.setup_only)
        elif args.child == "async":
            child_async(directory, args.runs, args.async_steps, setup_only=args.setup_only)
        elif args.child == "short":
            child_short(directory, args.short_runs, setup_only=args.setup_only)
        elif args.child == "check":
            child_check(directory, args.check_runs, setup_only=args.setup_only)
        else:
            child_raw(directory, args.steps, setup_only=args.setup_only)
    return 0


def _measured(mode: str, args: argparse.Namespace, part: int) -> tuple[list[str], int]:
    """The child's options for ``1/part`` of the measured steps, and how many steps that is."""
    steps, runs, async_steps, short_runs = (
        args.steps // part,
        args.runs,
        args.async_steps // part,
        args.short_runs // part,
    )
    options = ["--steps", str(steps), "--runs", str(runs), "--async-steps", str(async_steps)]
    options += ["--short-runs", str(short_runs), "--check-runs", str(args.check_runs // part)]
    taken = {"async": runs * async_steps, "short": short_runs, "check": args.check_runs // part}
    return options, taken.get(mode, steps)


def instructions(python: str, mode: str, options: list[str]) -> int:
    """Instructions callgrind counts for one child process."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        python,
        str(HERE),
        "--child",
        mode,
        *options,
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)  # each interpreter imports the fsm_runner it has installed
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=cwd, env=env, check=False
        )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{python} {mode}: failed\n{done.stderr[-3000:]}")
    return int(found.group(1))


def per_step(python: str, mode: str, args: argparse.Namespace) -> tuple[float, float]:
    """Instructions per measured step, two ways: less the setup, and less a fifth of the steps.

    The first is the whole run less the setup-only run, over the steps: it includes what the
    measured part pays once (a lazy import, a cache filled). The second is the whole run less
    one taking a fifth of the steps, over the difference: steady steps only.
    """
    whole_options, whole_steps = _measured(mode, args, 1)
    fifth_options, fifth_steps = _measured(mode, args, 5)
    setup_options = [*whole_options, "--setup-only"]
    runs = [whole_options, fifth_options, setup_options]
    if mode == "check":  # its setup grows with the runs: the fifth's own setup taken off too
        runs.append([*fifth_options, "--setup-only"])
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        counts = list(pool.map(lambda options: instructions(python, mode, options), runs))
    whole, fifth, setup = counts[:3]
    if mode == "check":
        fifth -= counts[3] - setup  # as if the fifth had built the whole's journal
    return (whole - setup) / whole_steps, (whole - fifth) / (whole_steps - fifth_steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="sync (and raw) steps")
    parser.add_argument("--runs", type=int, default=100, help="async runs driven together")
    parser.add_argument("--async-steps", type=int, default=20, help="steps of each async run")
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        help="another interpreter to measure in the same run (the first is the baseline)",
    )
    parser.add_argument("--short-runs", type=int, default=300, help="short runs, one by one")
    parser.add_argument(
        "--check-runs", type=int, default=2000, help="runs of the journal check_runs reads"
    )
    parser.add_argument(
        "--modes",
        default="sync,async,short",
        help="which workloads: sync, async, short, check (comma-separated)",
    )
    parser.add_argument(
        "--child", choices=["sync", "async", "short", "check", "raw"], help=argparse.SUPPRESS
    )
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=2, help="callgrind processes at once")
    args = parser.parse_args()
    if args.child:
        return child(args)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed", file=sys.stderr)
        return 2
    print(f"python {platform.python_version()}, {platform.machine()}; callgrind instructions")
    print(
        f"sync: {args.steps} steps of one run; async: {args.runs} runs x {args.async_steps}"
        f" steps, group commit\n"
    )
    raw = per_step(sys.executable, "raw", args)[1]
    print(f"  raw sqlite3 commit   {raw:>12,.0f} instructions per row (the baseline)\n")
    print("  per step: less the setup | less a fifth of the steps (steady; the ratio's)")
    pythons = [sys.executable, *args.python]
    for mode in args.modes.split(","):
        values = [per_step(python, mode, args) for python in pythons]
        unit = {"short": "run (start + 3 steps)", "check": "run checked"}.get(mode, "step")
        for python, (with_once, steady) in zip(pythons, values, strict=True):
            who = "this checkout" if python == sys.executable else python
            print(
                f"  {mode:<5} {with_once:>10,.0f} | {steady:>10,.0f} instructions per {unit}"
                f"  ({steady / raw:.2f}x raw)  {who}"
            )
        if len(values) > 1:
            ours, theirs = values[0], values[1]
            print(
                f"  {mode:<5} ratio this / {pythons[1]}: {ours[1] / theirs[1]:.4f}"
                f" (less the setup: {ours[0] / theirs[0]:.4f})\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
