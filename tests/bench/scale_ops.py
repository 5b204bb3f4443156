"""``bench_scale.py --only ops``: everyday operations on a small and a big journal.

Two journals (``--small-runs`` and ``--runs`` ended runs of a four-phase machine, cloned by SQL,
updated over the last 30 days; then :data:`ACTIVE` active runs started by the engine in each,
waiting at their first phase). In interleaved rounds (the journal measured first alternates),
``--ops-samples`` samples of each figure on each journal, a random run each sample:

* ``resume warm``: ``engine.run(run_id)`` of an active run, the journal open, until the run's
  handler is entered (it raises: the run stays as it was, unleased) — what ``bench_resume.py``
  measures: load the run, claim its lease, prepare the phase;
* ``resume cold``: the same through a journal opened for the sample (a new connection, its
  page cache empty, as a new process or ``fsm-runner resume`` has it), the open included;
* ``start + 4 steps``: ``engine.start(claim=True)`` then ``engine.run`` to the end;
* ``runs``: ``journal.runs(limit=50)``, the newest-first page;
* ``show``: ``journal.load`` + ``journal.transitions`` of an ended run;
* ``CLI runs``, ``CLI show``: ``fsm-runner runs`` and ``fsm-runner show RUN`` as real processes
  (``--cli-samples`` a round);
* ``resume evicted``: ``resume cold`` with the journal's file first dropped from the OS page
  cache (``posix_fadvise(DONTNEED)``): every page the resume reads comes from the disk, so a
  deeper b-tree shows. Reported, no target (it is the disk's figure as much as the journal's).

Medians, the ratio big ÷ small (target <= 1.5 each but the last: flat in the runs journaled),
and each journal's p90: some figures are bimodal whatever the size (the first write of a journal
just opened takes ~4 ms one time in ten, against ~0.5), which moves a median on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from fsm_runner import Engine, SqliteJournal
from tests.bench.scale_journals import CHECK_SPEC, build_check_journal, handlers, run_id_of
from tests.bench.scale_prune import SPREAD, cli_run

__all__ = ["add_ops_arguments", "run_ops"]

#: active runs of each journal, started by the engine after the ended ones were cloned
ACTIVE = 1_000
OPS_FLAT = 1.5
FIGURES = (
    "resume warm",
    "resume cold",
    "start + 4 steps",
    "runs",
    "show",
    "CLI runs",
    "CLI show",
    "resume evicted",
)
#: figures printed without a target
REPORTED = {"resume evicted"}


class _Entered(BaseException):
    """Raised by the handler the moment it is called: the engine is ready, the clock stops."""


def add_ops_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ops")
    group.add_argument("--ops-samples", type=int, default=50, help="samples a round and figure")
    group.add_argument("--cli-samples", type=int, default=3, help="CLI processes a round")


def build(path: Path, runs: int) -> list[str]:
    """The journal: ``runs`` ended runs and :data:`ACTIVE` active ones; the active runs' ids."""
    build_check_journal(path, runs, spread=SPREAD)
    with SqliteJournal(path, create=False) as journal:
        engine = Engine(CHECK_SPEC, handlers=handlers(), journal=journal)
        active = engine.start_many([None] * ACTIVE)
        engine.close()
    return active


class Ops:
    """One journal's figures: its engines and journal stay open across rounds (warm)."""

    def __init__(self, path: Path, runs: int, active: list[str], seed: int) -> None:
        self.path, self.runs, self.active = path, runs, active
        self.random = random.Random(seed)
        self.journal = SqliteJournal(path, create=False)
        self.entering = Engine(CHECK_SPEC, handlers={"noop": self._enter}, journal=self.journal)
        self.driving = Engine(CHECK_SPEC, handlers=handlers(), journal=self.journal)
        self.entered = 0.0
        self.files: dict[Path, int] = {}

    def _enter(self, _ctx: object) -> None:
        self.entered = time.perf_counter()
        raise _Entered

    def close(self) -> None:
        self.entering.close()
        self.driving.close()
        self.journal.close()
        for fd in self.files.values():  # after the journal's connections: see evict()
            os.close(fd)

    def ended(self) -> str:
        """A random ended run (a clone: the template is run 0)."""
        return run_id_of(self.random.randrange(1, self.runs))

    def evict(self) -> None:
        """Drop the journal's file and WAL from the OS page cache (their clean pages).

        Through descriptors opened once and closed after the journal: closing a descriptor of
        the file would drop every POSIX lock this process holds on it, SQLite's included, and
        another process could then take itself for the last connection and reset the WAL.
        """
        for name in (self.path, Path(f"{self.path}-wal")):
            if name not in self.files:
                self.files[name] = os.open(name, os.O_RDONLY)
            os.posix_fadvise(self.files[name], 0, 0, os.POSIX_FADV_DONTNEED)

    def resume(self, *, cold: bool, evict: bool = False) -> float:
        run_id = self.random.choice(self.active)
        if evict:
            self.evict()
        began = time.perf_counter()
        if cold:
            self.entering.journal = SqliteJournal(self.path, create=False)
        try:
            self.entering.run(run_id)
        except _Entered:
            pass
        else:
            raise AssertionError(f"{run_id}: the handler was not entered")
        finally:
            if cold:
                self.entering.journal.close()
                self.entering.journal = self.journal
        return self.entered - began

    def start_and_run(self) -> float:
        began = time.perf_counter()
        run = self.driving.run(self.driving.start(claim=True))
        assert run.ended, run
        return time.perf_counter() - began

    def listing(self) -> float:
        began = time.perf_counter()
        assert len(self.journal.runs(limit=50)) == 50
        return time.perf_counter() - began

    def show(self) -> float:
        run_id = self.ended()
        began = time.perf_counter()
        self.journal.load(run_id)
        assert len(self.journal.transitions(run_id)) == 5
        return time.perf_counter() - began

    def command(self, *argv: str) -> float:
        began = time.perf_counter()
        cli_run(["--journal", str(self.path), *argv])
        return time.perf_counter() - began

    def measures(self) -> dict[str, Callable[[], float]]:
        return {
            "resume warm": lambda: self.resume(cold=False),
            "resume cold": lambda: self.resume(cold=True),
            "start + 4 steps": self.start_and_run,
            "runs": self.listing,
            "show": self.show,
            "CLI runs": lambda: self.command("runs"),
            "CLI show": lambda: self.command("show", self.ended()),
            "resume evicted": lambda: self.resume(cold=True, evict=True),
        }


def rounds(args: argparse.Namespace, ops: dict[str, Ops]) -> dict[tuple[str, str], list[float]]:
    """Every sample (seconds) of each figure on each journal, in interleaved rounds.

    The reported figures (the file evicted) come in rounds of their own, after the others:
    the pages they evict would slow every figure measured after them.
    """
    every: dict[tuple[str, str], list[float]] = {}
    for one in ops.values():  # a warm-up: each engine's first use, each query's first plan
        for name, measure in one.measures().items():
            if not name.startswith("CLI") and name not in REPORTED:
                measure()
    for names in ([f for f in FIGURES if f not in REPORTED], [f for f in FIGURES if f in REPORTED]):
        for round_ in range(args.rounds):
            order = ["small", "big"] if round_ % 2 == 0 else ["big", "small"]
            line = []
            for name in names:
                count = args.cli_samples if name.startswith("CLI") else args.ops_samples
                for label in order:
                    measure = ops[label].measures()[name]
                    every.setdefault((name, label), []).extend(measure() for _ in range(count))
                small, big = (statistics.median(every[name, x][-count:]) for x in ("small", "big"))
                line.append(f"{name} {small * 1e3:.2f}/{big * 1e3:.2f}")
            print(f"  round {round_ + 1} (small/big ms): " + ", ".join(line))
    return every


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def run_ops(args: argparse.Namespace, workdir: Path) -> list[tuple[str, bool]]:
    """The ``ops`` section; returns its targets as (description, met)."""
    began = time.perf_counter()
    sizes = {"small": args.small_runs, "big": args.runs}
    ops = {}
    for seed, (label, runs) in enumerate(sizes.items()):
        path = workdir / f"ops-{label}.db"
        ops[label] = Ops(path, runs, build(path, runs), seed)
    print(
        f"ops: {args.small_runs:,} and {args.runs:,} ended runs x 5 transitions, {ACTIVE:,}"
        f" active runs each ({ops['big'].path.stat().st_size / 1e6:,.0f} MB big; built in"
        f" {time.perf_counter() - began:.1f} s)"
    )
    try:
        every = rounds(args, ops)
    finally:
        for one in ops.values():
            one.close()
    print(f"  {'median ms':<18} {'small':>10} {'big':>10} {'ratio':>7}   p90 small / big")
    targets = []
    for name in FIGURES:
        small, big = (statistics.median(every[name, x]) for x in ("small", "big"))
        ratio = big / small
        mark = "  (reported)" if name in REPORTED else ""
        p90 = " / ".join(f"{_p90(every[name, x]) * 1e3:.3f}" for x in ("small", "big"))
        print(f"  {name:<18} {small * 1e3:>10.3f} {big * 1e3:>10.3f} {ratio:>7.2f}   {p90}{mark}")
        if name in REPORTED:
            continue
        targets.append(
            (
                f"ops: {name} ratio big/small <= {OPS_FLAT} (got {ratio:.2f};"
                f" {small * 1e3:.3f} against {big * 1e3:.3f} ms)",
                ratio <= OPS_FLAT,
            )
        )
    return targets
