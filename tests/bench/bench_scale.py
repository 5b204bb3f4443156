"""A million runs, flat (issue 28): each section measures one operation as the journal grows.

Run from the repository root::

    python tests/bench/bench_scale.py [--only check|claim|prune|ops ...] [--runs N] [--rounds R]
    python tests/bench/bench_scale.py --only check [--runs 20000] [--jobs N] [--baseline-every K]
    python tests/bench/bench_scale.py --only check --runs 1000000 --baseline-every 20
    python tests/bench/bench_scale.py --only claim [--runs 10000] [--rounds 3] [--samples 20]
    python tests/bench/bench_scale.py --only prune [--runs 50000] [--small-runs 10000]
    python tests/bench/bench_scale.py --only ops --runs 1000000 [--ops-samples 50] [--cli-samples 3]

Each section builds its journals in a temporary directory, measures its baseline in the same run
and prints its figures, the ratio and PASS/FAIL per target. ``--runs`` and ``--rounds`` default
per section (check: 20,000 runs, 1 round; claim: 10,000 runs, 3 rounds; prune and ops: 50,000
runs against ``--small-runs`` 10,000, 3 rounds); the exit status is 1 if a target is missed.
All four run by default (small sizes: CI's, under two minutes); ``--runs 1000000`` is the
issue's measurement. ``prune`` and ``ops`` are described in their modules,
``tests/bench/scale_prune.py`` and ``tests/bench/scale_ops.py``; every section's journals of
ended runs are built by ``tests/bench/scale_journals.py``.

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

``claim``: ``--runs`` active runs of one machine, none claimable (half hold a live lease, half
wait in a state without a handler), and a journal of ``--runs`` / 100 built the same way.

* **idle poll**: ``claim_next`` finding nothing, median µs on each journal, and the ratio
  big ÷ small (target <= 2: flat in the runs held; the search still reads every active run of
  the machine through the ``runs`` view, which a later schema increment indexes).
* **starts beside idle pollers**: on the big journal, ``start()`` of another machine's runs,
  its median, p99 and worst latency with 2 worker processes polling in a tight loop, against
  the same starts with no pollers (the baseline) and beside 2 processes polling as
  ``claim_next`` did before issue 28 (its search inside ``BEGIN IMMEDIATE``). Then the same
  starts by a journal with no busy timeout at all: a start that found the write lock held by a
  poller is refused at once, so the count of refusals is how many starts a poll delayed
  (target: 0; the latency figures also show the CPU the pollers take on a small machine).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition  # noqa: E402
from fsm_runner.exceptions import JournalError  # noqa: E402
from fsm_runner.records import format_utc, utc_now  # noqa: E402
from fsm_runner.replay import check_runs  # noqa: E402
from tests.bench.scale_journals import build_check_journal  # noqa: E402
from tests.bench.scale_ops import add_ops_arguments, run_ops  # noqa: E402
from tests.bench.scale_prune import add_prune_arguments, run_prune  # noqa: E402
from tests.helpers import NEXT, linear_spec  # noqa: E402

# -- check: the whole journal replayed --------------------------------------------------------

MILLION = 1_000_000
CHECK_TARGET_S = 60.0


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


# -- claim: claim_next's search and the writers beside idle workers ---------------------------

#: The polled machine: ``a`` has a handler (workers poll for it), ``b`` none (its runs wait).
CLAIM_SPEC = MachineSpec(
    "scale",
    [State("a", handler="a"), State("b"), State("done", terminal=True)],
    [Transition("a", NEXT, "b"), Transition("b", NEXT, "done")],
)
#: What the starts of the second measurement start: another machine, never claimable here.
OTHER_SPEC = linear_spec("a", name="started")
CLAIM_STATES = ["a"]
CLAIM_FLAT = 2.0
#: how long the starts of one measurement may take in all (the whole bench stays under ~2 min)
STARVED_S = 6.0
#: claim_next's search before issue 28, run inside BEGIN IMMEDIATE by the ``old`` pollers.
OLD_SEARCH = (
    "SELECT run_id, lease_owner FROM runs WHERE status = 'active' AND machine = ?"
    " AND state IN (?) AND (lease_owner IS NULL OR lease_expires_at < ?)"
    " ORDER BY created_at, run_key LIMIT 1"
)


def claim_fill(path: Path, runs: int) -> None:
    """``runs`` active runs of :data:`CLAIM_SPEC`: even ones leased for a day, odd ones at ``b``."""
    with SqliteJournal(path) as journal:
        engine = Engine(CLAIM_SPEC, handlers={"a": lambda _ctx: NEXT}, journal=journal)
        for start in range(0, runs, 10_000):
            engine.start_many([None] * min(10_000, runs - start))
        engine.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    at = format_utc(utc_now())
    conn.execute(
        "UPDATE run_rows SET lease_owner = 'holder', lease_expires_at = '2999-01-01T00:00:00Z',"
        " lease_token = 1 WHERE run_key % 2 = 0"
    )
    conn.execute(
        "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt,"
        " at, duration_ms, result, lease_token, run_key)"
        " SELECT run_id, 1, 'a', ?, 'b', 0, 1, ?, 0.01, NULL, 0, run_key FROM run_rows"
        " WHERE run_key % 2 = 1",
        (NEXT, at),
    )
    if "idx_run_rows_ready" in {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}:
        # schema 9: a commit of a run nobody holds writes its row too (as the journal would)
        conn.execute(
            "UPDATE run_rows SET state = 'b', seq = 1, updated_at = ?, visit_seq = 1"
            " WHERE run_key % 2 = 1",
            (at,),
        )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def claim_poll_us(path: Path, samples: int) -> float:
    """Median µs of an idle ``claim_next`` (a journal opened and warmed first)."""
    with SqliteJournal(path) as journal:
        for _ in range(3):
            assert journal.claim_next("w", ttl=60, machine="scale", states=CLAIM_STATES) is None
        times = []
        for _ in range(samples):
            began = time.perf_counter()
            found = journal.claim_next("w", ttl=60, machine="scale", states=CLAIM_STATES)
            times.append(time.perf_counter() - began)
            assert found is None
    return statistics.median(times) * 1e6


def claim_poller(path: str, mode: str, busy_timeout: float) -> None:
    """A poller process (``--poll``): polls until its stdin closes, then prints its poll count."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    polls = 0
    if mode == "new":
        with SqliteJournal(path) as journal:
            print("ready", flush=True)
            while not stop.is_set():
                journal.claim_next("poller", ttl=60, machine="scale", states=CLAIM_STATES)
                polls += 1
    else:
        conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout)
        print("ready", flush=True)
        while not stop.is_set():
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:  # starved by the other poller: poll again
                continue
            conn.execute(OLD_SEARCH, ("scale", *CLAIM_STATES, format_utc(utc_now()))).fetchone()
            conn.execute("COMMIT")
            polls += 1
        conn.close()
    print(polls, flush=True)


def claim_starts(path: Path, samples: int, *, busy_timeout: float) -> tuple[list[float], int]:
    """``samples`` starts of :data:`OTHER_SPEC` runs, 1 ms apart: their seconds, and refusals."""
    times: list[float] = []
    refused = 0
    with SqliteJournal(path, busy_timeout=busy_timeout) as journal:
        engine = Engine(OTHER_SPEC, handlers={"a": lambda _ctx: NEXT}, journal=journal)
        # beside old pollers a start may starve for seconds: given up after STARVED_S in all
        deadline = time.monotonic() + STARVED_S
        for _ in range(samples):
            if time.monotonic() > deadline:
                refused += 1
                continue
            time.sleep(0.001)
            began = time.perf_counter()
            try:
                engine.start()
            except JournalError:  # the lock was held then (or, beside old pollers, for too long)
                refused += 1
                continue
            times.append(time.perf_counter() - began)
        engine.close()
    return times, refused


def with_pollers(path: Path, mode: str | None, measure: Callable[[], object]) -> tuple[object, int]:
    """Run ``measure`` while 2 poller processes poll (``mode``; ``None``: no pollers)."""
    if mode is None:
        return measure(), 0
    pollers = [
        subprocess.Popen(
            [sys.executable, __file__, "--poll", str(path), "--mode", mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for poller in pollers:
            assert poller.stdout is not None
            assert poller.stdout.readline() == "ready\n"
        result = measure()
    finally:
        polls = 0
        for poller in pollers:
            out, _ = poller.communicate(timeout=60)  # closes its stdin: it stops
            polls += int(out.split()[-1])
    return result, polls


def run_claim(args: argparse.Namespace, workdir: Path) -> list[tuple[str, bool]]:
    """The ``claim`` section; returns its targets as (description, met)."""
    big, small = workdir / "claim-big.db", workdir / "claim-small.db"
    began = time.perf_counter()
    claim_fill(big, args.runs)
    claim_fill(small, max(1, args.runs // 100))
    print(
        f"claim: {args.runs:,} and {max(1, args.runs // 100):,} active runs, none claimable"
        f" (built in {time.perf_counter() - began:.1f} s)"
    )

    print("\nidle claim_next, median µs")
    ratios = []
    for round_ in range(1, args.rounds + 1):
        small_us = claim_poll_us(small, args.samples * 10)
        big_us = claim_poll_us(big, args.samples)
        ratios.append(big_us / small_us)
        print(
            f"  round {round_}: small {small_us:10.1f}  big {big_us:10.1f}  ratio {ratios[-1]:.1f}"
        )
    ratio = statistics.median(ratios)
    print(f"  median ratio big/small: {ratio:.1f} (target <= {CLAIM_FLAT})")

    print("\nstart() on the big journal beside 2 idle pollers, ms (median / p99 / worst)")
    modes: list[tuple[str, str | None]] = [
        ("no pollers (baseline)", None),
        ("claim_next pollers", "new"),
        ("pollers searching under BEGIN IMMEDIATE (before)", "old"),
    ]
    latencies: dict[str | None, list[float]] = {mode: [] for _, mode in modes}
    refusals: dict[str | None, list[int]] = {mode: [] for _, mode in modes}
    for round_ in range(1, args.rounds + 1):
        for name, mode in modes:
            (times, late), polls = with_pollers(
                big, mode, lambda: claim_starts(big, args.starts, busy_timeout=5)
            )
            latencies[mode] += times  # type: ignore[arg-type]
            late_note = (
                f"   given up (5 s busy timeout, {STARVED_S:.0f} s in all): {late}" if late else ""
            )
            (_, refused), _ = with_pollers(
                big, mode, lambda: claim_starts(big, args.starts, busy_timeout=0)
            )
            refusals[mode].append(refused)  # type: ignore[arg-type]
            print(
                f"  round {round_}: {name:50} {_ms(times)}   polls {polls:6}"
                f"   refused with no busy timeout: {refused}/{args.starts}{late_note}"
            )
    print("  all rounds:")
    for name, mode in modes:
        print(f"    {name:50} {_ms(latencies[mode])}  refused {sum(refusals[mode])}")
    base, new = latencies[None], latencies["new"]
    print(
        f"  ratio claim_next pollers / baseline: median {_q(new, 0.5) / _q(base, 0.5):.2f},"
        f" worst {max(new) / max(base):.2f}"
    )
    return [
        (f"idle claim_next ratio big/small <= {CLAIM_FLAT} (got {ratio:.1f})", ratio <= CLAIM_FLAT),
        (
            "an idle poll never holds the write lock: no start refused for it"
            f" (got {sum(refusals['new'])} of {args.rounds * args.starts})",
            sum(refusals["new"]) == 0,
        ),
        (
            "a start beside idle pollers is not slower at worst than 2x the baseline's worst"
            f" ({max(new) * 1e3:.2f} ms against {max(base) * 1e3:.2f} ms)",
            max(new) <= 2 * max(base),
        ),
    ]


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(times: list[float]) -> str:
    if not times:  # every start gave up (beside pollers searching under BEGIN IMMEDIATE)
        return f"{'-':>6} / {'-':>6} / {'-':>7}"
    return f"{_q(times, 0.5) * 1e3:6.2f} / {_q(times, 0.99) * 1e3:6.2f} / {max(times) * 1e3:7.2f}"


Targets = Callable[[argparse.Namespace, Path], list[tuple[str, bool]]]


def in_workdir(run: Targets) -> Callable[[argparse.Namespace], bool]:
    """A section run in a temporary directory of its own that prints its verdicts."""

    def section(args: argparse.Namespace) -> bool:
        began = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench_scale_") as workdir:
            targets = run(args, Path(workdir))
        print(f"\n({time.perf_counter() - began:.0f} s)")
        for description, met in targets:
            print(f"{'PASS' if met else 'FAIL'}: {description}")
        print()
        return all(met for _, met in targets)

    return section


#: The sections, by ``--only`` name, with their default ``--runs`` and ``--rounds``.
SECTIONS: dict[str, tuple[Callable[[argparse.Namespace], bool], int, int]] = {
    "check": (run_check, 20_000, 1),
    "claim": (in_workdir(run_claim), 10_000, 3),
    "ops": (in_workdir(run_ops), 50_000, 3),
    "prune": (in_workdir(run_prune), 50_000, 3),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="runs of the (big) journal")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="sections")
    add_check_arguments(parser)
    group = parser.add_argument_group("claim")
    group.add_argument("--samples", type=int, default=20, help="idle polls a round (big)")
    group.add_argument("--starts", type=int, default=200, help="starts a round and setting")
    add_prune_arguments(parser)
    add_ops_arguments(parser)
    parser.add_argument("--poll", help=argparse.SUPPRESS)  # a claim poller process
    parser.add_argument("--mode", default="new", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poll:
        claim_poller(args.poll, args.mode, 5.0)
        return 0
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version},", end=" ")
    print(f"{os.cpu_count()} CPUs")
    passed = []
    for name in args.only or SECTIONS:
        section, runs, rounds = SECTIONS[name]
        given = copy.copy(args)
        given.runs = args.runs or runs
        given.rounds = args.rounds or rounds
        passed.append(section(given))
    return 0 if all(passed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
