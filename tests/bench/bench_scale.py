"""Operations on a journal of many runs, against the same on one 100 times smaller (issue 28).

Run from the repository root::

    python tests/bench/bench_scale.py [--runs 10000] [--rounds 3] [--only claim]

Each section builds its journals in a temporary directory, measures in interleaved rounds and
prints its figures, the ratio to its baseline (measured in the same run) and PASS/FAIL per
target. ``--only NAME`` runs one section.

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
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import (  # noqa: E402 - after the path set-up
    Engine,
    MachineSpec,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.exceptions import JournalError  # noqa: E402
from fsm_runner.records import format_utc, utc_now  # noqa: E402
from tests.helpers import NEXT, linear_spec  # noqa: E402

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
        deadline = time.monotonic() + 20  # beside old pollers a start may starve for seconds
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
            late_note = f"   given up (5 s busy timeout, 20 s in all): {late}" if late else ""
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
    return f"{_q(times, 0.5) * 1e3:6.2f} / {_q(times, 0.99) * 1e3:6.2f} / {max(times) * 1e3:7.2f}"


#: The sections, by ``--only`` name (each takes the arguments and a working directory).
SECTIONS: dict[str, Callable[[argparse.Namespace, Path], list[tuple[str, bool]]]] = {
    "claim": run_claim,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10_000, help="runs of the big journal")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--samples", type=int, default=20, help="idle polls a round (big)")
    parser.add_argument("--starts", type=int, default=200, help="starts a round and setting")
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run this section alone")
    parser.add_argument("--poll", help=argparse.SUPPRESS)  # a claim poller process
    parser.add_argument("--mode", default="new", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poll:
        claim_poller(args.poll, args.mode, 5.0)
        return
    print(f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}, {os.cpu_count()} cores")
    targets: list[tuple[str, bool]] = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, section in SECTIONS.items():
            if args.only in (None, name):
                targets += section(args, Path(workdir))
    print()
    for description, met in targets:
        print(f"{'PASS' if met else 'FAIL'}: {description}")


if __name__ == "__main__":
    main()
