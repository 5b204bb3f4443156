"""``bench_scale.py --only prune``: prune on a small and a big journal, and who waits for it.

Two journals of ended runs (:func:`~tests.bench.scale_journals.build_check_journal`, updated
over the last 30 days, oldest key first): ``--small-runs`` and ``--runs``. In interleaved
rounds, each on both journals:

* ``dry run``: ``journal.prune(ended_before=..., dry_run=True)`` with a cutoff older than every
  run (it selects none), in process, the journal open;
* ``CLI dry run``: ``fsm-runner --journal J prune --older-than 31 --dry-run``, a real process;
* ``prune of nothing``: a real prune with that cutoff (it deletes nothing).

Medians, the ratio big ÷ small (target <= 2 each: flat in the runs journaled). Then, on the big
journal, **blocking**: a prune of its 100,000 oldest runs (all of them if it holds fewer) while
another process starts runs one at a time (``engine.start()``, a single-row write, 1 ms apart,
busy timeout 600 s), each start's latency recorded: the worst and p99 of the starts that
overlapped the prune (target: worst <= 100 ms), against the starts before it. Where the prune
takes a ``vacuum`` keyword it is measured with ``vacuum=False``; otherwise as it is (a prune
that ends with ``VACUUM``, as before schema version 9: every writer waits for it). A dry run
never vacuums, so the CLI's is run as it is.
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fsm_runner import Engine, SqliteJournal
from fsm_runner.records import utc_now
from tests.bench.scale_journals import build_check_journal
from tests.helpers import NEXT, linear_spec

__all__ = ["SPREAD", "add_prune_arguments", "cli_run", "run_prune"]

ROOT = Path(__file__).resolve().parents[2]

SPREAD = dt.timedelta(days=30)
#: ``--older-than`` days: older than every run of the journals, so a prune selects none
NONE_DAYS = 31
PRUNE_FLAT = 2.0
BLOCK_TARGET_MS = 100.0
BLOCK_RUNS = 100_000
#: the writer's pause between two starts (a busy writer, leaving the prune a core of 2)
WRITE_PAUSE = 0.001
WRITER_SPEC = linear_spec("a", name="writer")


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prune (and ops)")
    group.add_argument(
        "--small-runs", type=int, default=10_000, help="runs of the small journal (prune, ops)"
    )
    group.add_argument(
        "--prune-samples", type=int, default=3, help="samples a round and figure (CLI: half)"
    )


def prune_options(journal: SqliteJournal) -> dict[str, Any]:
    """``vacuum=False`` where ``prune`` takes it, else nothing (a prune that vacuums)."""
    return {"vacuum": False} if "vacuum" in inspect.signature(journal.prune).parameters else {}


def cli() -> list[str]:
    """``fsm-runner``: this interpreter, with the ``fsm_runner`` the bench imports (ROOT's)."""
    return [sys.executable, "-m", "fsm_runner"]


def cli_run(argv: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
    """``fsm-runner ARGV`` as a process; it must succeed."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [*cli(), *argv], env=env, check=True, capture_output=True, text=True, **options
    )


def _seconds(action: Callable[[], object]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def measure_round(
    paths: dict[str, Path], journals: dict[str, SqliteJournal], order: list[str], samples: int
) -> dict[tuple[str, str], list[float]]:
    """One round: each figure's samples (seconds) on each journal, ``order`` first to last."""
    cutoff = utc_now() - dt.timedelta(days=NONE_DAYS)
    times: dict[tuple[str, str], list[float]] = {}
    for label in order:
        journal, path = journals[label], paths[label]
        options = prune_options(journal)

        def dry(journal: SqliteJournal = journal) -> None:
            assert journal.prune(ended_before=cutoff, dry_run=True).run_ids == ()

        def command(path: Path = path) -> None:
            argv = ["--journal", str(path), "prune", "--older-than", str(NONE_DAYS)]
            cli_run([*argv, "--dry-run"])

        def nothing(journal: SqliteJournal = journal, options: dict[str, Any] = options) -> None:
            assert journal.prune(ended_before=cutoff, **options).run_ids == ()

        for figure, action, count in (
            ("dry run", dry, samples),
            ("CLI dry run", command, max(1, samples // 2)),
            ("prune of nothing", nothing, samples),
        ):
            times[figure, label] = [_seconds(action) for _ in range(count)]
    return times


def flat_figures(args: argparse.Namespace, paths: dict[str, Path]) -> list[tuple[str, bool]]:
    """The three figures in interleaved rounds; their targets as (description, met)."""
    journals = {label: SqliteJournal(path, create=False) for label, path in paths.items()}
    figures = ("dry run", "CLI dry run", "prune of nothing")
    every: dict[tuple[str, str], list[float]] = {}
    try:
        for journal in journals.values():  # warm: the first read of each opens its pages
            journal.prune(ended_before=utc_now() - dt.timedelta(days=NONE_DAYS), dry_run=True)
        for round_ in range(args.rounds):
            order = ["small", "big"] if round_ % 2 == 0 else ["big", "small"]
            times = measure_round(paths, journals, order, args.prune_samples)
            line = []
            for figure in figures:
                for label in ("small", "big"):
                    every.setdefault((figure, label), []).extend(times[figure, label])
                small, big = (statistics.median(times[figure, x]) for x in ("small", "big"))
                line.append(f"{figure} {small * 1e3:.1f}/{big * 1e3:.1f}")
            print(f"  round {round_ + 1} (small/big ms): " + ", ".join(line))
    finally:
        for journal in journals.values():
            journal.close()
    print(f"  {'median ms':<18} {'small':>10} {'big':>10} {'ratio':>7}")
    targets = []
    for figure in figures:
        small, big = (statistics.median(every[figure, x]) for x in ("small", "big"))
        ratio = big / small
        print(f"  {figure:<18} {small * 1e3:>10.1f} {big * 1e3:>10.1f} {ratio:>7.2f}")
        targets.append(
            (
                f"prune: {figure} ratio big/small <= {PRUNE_FLAT} (got {ratio:.2f};"
                f" {small * 1e3:.1f} against {big * 1e3:.1f} ms)",
                ratio <= PRUNE_FLAT,
            )
        )
    return targets


def write_loop(path: str, ready: Any, stop: Any, out: Connection) -> None:
    """The writer process: starts runs until ``stop`` is set; sends (began, seconds) of each."""
    times: list[tuple[float, float]] = []
    with SqliteJournal(path, busy_timeout=600) as journal:
        engine = Engine(WRITER_SPEC, handlers={"a": lambda _ctx: NEXT}, journal=journal)
        engine.start()
        ready.set()
        while not stop.is_set():
            began = time.monotonic()
            engine.start()
            times.append((began, time.monotonic() - began))
            time.sleep(WRITE_PAUSE)
        engine.close()
    out.send(times)
    out.close()


def cutoff_for(path: Path, runs: int) -> dt.datetime:
    """The cutoff that selects the ``runs`` oldest ended runs (all of them if fewer)."""
    with SqliteJournal(path, create=False) as journal:
        report = journal.prune(ended_before=utc_now() + dt.timedelta(days=1), dry_run=True)
    if runs >= len(report.run_ids):
        return utc_now() + dt.timedelta(days=1)
    with SqliteJournal(path, create=False) as journal:
        return journal.load(report.run_ids[runs]).updated_at


def prune_beside_writer(
    path: Path, cutoff: dt.datetime
) -> tuple[Any, dict[str, Any], tuple[float, float], list[tuple[float, float]]]:
    """A prune of ``path``'s runs before ``cutoff`` while a writer process starts runs.

    Returns the prune's report, its options, when it began and ended (``time.monotonic``, the
    same clock in every process) and the writer's starts: (began, seconds) each.
    """
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    receiver, sender = spawn.Pipe(duplex=False)
    writer = spawn.Process(target=write_loop, args=(str(path), ready, stop, sender))
    writer.start()
    sender.close()
    try:
        assert ready.wait(60), "the writer did not start"
        time.sleep(0.5)  # starts before the prune: the baseline
        with SqliteJournal(path, create=False) as journal:
            options = prune_options(journal)
            began = time.monotonic()
            report = journal.prune(ended_before=cutoff, **options)
            ended = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        times: list[tuple[float, float]] = receiver.recv() if receiver.poll(120) else []
        writer.join(60)
    return report, options, (began, ended), times


def blocking(path: Path, journal_runs: int) -> tuple[str, bool]:
    """A prune of up to 100,000 runs of ``path`` beside a writer process; its target."""
    wanted = min(BLOCK_RUNS, journal_runs)
    report, options, (began, ended), times = prune_beside_writer(path, cutoff_for(path, wanted))
    assert len(report.run_ids) == wanted, (len(report.run_ids), wanted)
    before = [s for b, s in times if b + s < began]
    overlapping = [(b, s) for b, s in times if b < ended and b + s > began]
    during = [s for _, s in overlapping]
    how = "without VACUUM" if options else "as it is (ending with VACUUM)"
    note = "" if wanted == BLOCK_RUNS else f" (all the journal's runs: it holds < {BLOCK_RUNS:,})"
    after = "" if report.bytes_after is None else f" -> {report.bytes_after / 1e6:,.0f}"
    print(
        f"\nblocking: a prune of {wanted:,} runs{note} of the big journal, {how}:"
        f" {ended - began:.2f} s, {report.transitions:,} transitions,"
        f" {(report.bytes_before or 0) / 1e6:,.0f}{after} MB"
    )
    print(f"  a writer process's starts, ms: {'count':>6} {'median':>8} {'p99':>8} {'worst':>9}")
    for name, got in (("before the prune", before), ("during the prune", during)):
        if got:
            print(
                f"    {name:<26} {len(got):>6} {statistics.median(got) * 1e3:>8.2f}"
                f" {_q(got, 0.99) * 1e3:>8.2f} {max(got) * 1e3:>9.2f}"
            )
    if overlapping:
        at, _ = max(overlapping, key=lambda start: start[1])
        print(
            f"  the worst start began {at - began:+.2f} s into the prune; the writer waited"
            f" {sum(during):.2f} s of the prune's {ended - began:.2f} s"
        )
    worst = max(during, default=0.0) * 1e3
    return (
        f"prune of {wanted:,} runs: a writer never waits > {BLOCK_TARGET_MS:.0f} ms"
        f" (worst start during it {worst:.1f} ms, {len(during)} starts)",
        bool(during) and worst <= BLOCK_TARGET_MS,
    )


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_prune(args: argparse.Namespace, workdir: Path) -> list[tuple[str, bool]]:
    """The ``prune`` section; returns its targets as (description, met)."""
    paths = {"small": workdir / "prune-small.db", "big": workdir / "prune-big.db"}
    began = time.perf_counter()
    build_check_journal(paths["small"], args.small_runs, spread=SPREAD)
    build_check_journal(paths["big"], args.runs, spread=SPREAD)
    print(
        f"prune: {args.small_runs:,} and {args.runs:,} ended runs x 5 transitions, updated over"
        f" {SPREAD.days} days ({paths['big'].stat().st_size / 1e6:,.0f} MB big; built in"
        f" {time.perf_counter() - began:.1f} s); a cutoff {NONE_DAYS} days back selects none"
    )
    targets = flat_figures(args, paths)
    targets.append(blocking(paths["big"], args.runs))
    return targets
