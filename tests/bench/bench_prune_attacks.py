"""prune beside live workers, at length: what workers see, the worst stall, kills anywhere.

Run from the repository root::

    python tests/bench/bench_prune_attacks.py [--seconds 10] [--workers 4] [--ballast 20000]
        [--names same|symlink|hardlink] [--kills 100]

The sessions of ``tests/test_prune_attacks.py`` at any size. First ``--workers`` worker processes
(sync and async in turn) start and drive runs for ``--seconds`` while a reader lists runs and a
pruner prunes (library and CLI in turn) what ended up to 50 ms ago; ``--ballast`` active runs
of 2 kB input that nobody drives make each VACUUM rewrite that much more. ``--names`` gives the
second worker and the pruner the journal under another name (a symlink to it, a hard link).
Prints each worker's worst stall (the longest wait between two of its commits), how long the
prunes took, and what the checks of the test module found. Then ``--kills`` prunes SIGKILLed
in their DELETE transaction, their VACUUM or their checkpoint, beside two workers, with where
each kill landed and the checks.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_prune_attacks import (  # noqa: E402
    STAGES,
    add_ballast,
    forkserver,
    kill_a_prune,
    processes,
    read_sides,
    seed_journal,
    verdict,
)


def load(directory: Path, args: argparse.Namespace) -> None:
    """Workers, a reader and a pruner for ``args.seconds``; the stalls, the prunes, the checks."""
    path = directory / "journal.db"
    seed_journal(path, directory)
    if args.ballast:
        add_ballast(path, args.ballast)
    other = directory / "other.db"
    if args.names == "symlink":
        other.symlink_to(path)
    elif args.names == "hardlink":
        other.hardlink_to(path)
    else:
        other = path
    seconds = str(args.seconds)
    roles: list[tuple[str, ...]] = [
        (
            "sync" if n % 2 == 0 else "async",
            str(other if n == 1 else path),
            seconds,
            "0.002",
            str(n),
        )
        for n in range(args.workers)
    ]
    roles += [("pruner", str(other), seconds, "0.05", "99"), ("reader", str(path), seconds)]
    began = time.monotonic()
    try:
        with processes(path, directory, roles):
            pass
    except AssertionError as exc:  # a process that died: say so, then check what is left
        print(f"a process failed: {str(exc).strip().splitlines()[-1:]}")
    records = read_sides(directory)
    took = [r["took"] for r in records if "took" in r]
    stalls = [r["worst_stall"] for r in records if "worst_stall" in r]
    print(
        f"{args.workers} workers, {args.seconds} s ({time.monotonic() - began:.1f} s),"
        f" ballast {args.ballast}, names {args.names}:"
        f" {sum('done' in r for r in records)} runs done,"
        f" {sum(len(r.get('pruned', ())) for r in records)} pruned"
        f" by {sum('pruned' in r for r in records)} prunes"
    )
    if took:
        print(
            f"library prunes: median {statistics.median(took) * 1000:.0f} ms, max {max(took) * 1000:.0f} ms"
        )
    print(f"worst stall of each worker: {', '.join(f'{s * 1000:.0f} ms' for s in stalls)}")
    try:
        problems = verdict(path, records)
    except Exception as exc:
        problems = [f"the checks failed: {type(exc).__name__}: {exc}"]
    print(f"checks: {len(problems)} problems" + "".join(f"\n  {p}" for p in problems[:10]))


def kills(directory: Path, args: argparse.Namespace) -> None:
    """``args.kills`` prunes SIGKILLed beside two workers; where they landed, and the checks."""
    path = directory / "journal.db"
    seed_journal(path, directory)
    add_ballast(path, max(args.ballast, 1500))
    context = forkserver()
    roles = [("sync", str(path), "3600", "0.002", "1"), ("async", str(path), "3600", "0.002", "2")]
    landed: collections.Counter[str] = collections.Counter()
    with processes(path, directory, roles):
        for kill in range(args.kills):
            stage = list(STAGES)[kill % len(STAGES)]
            last = kill_a_prune(context, path, directory / f"kill-{kill}.jsonl", stage)
            landed[f"{stage}: {last.split(' WHERE')[0]}"] += 1
        (directory / "stop").touch()
    print(f"{args.kills} kills landed:")
    for where, count in sorted(landed.items()):
        print(f"  {count:4d}  {where}")
    problems = verdict(path, read_sides(directory), killed=True)
    print(f"checks: {len(problems)} problems" + "".join(f"\n  {p}" for p in problems[:10]))


def main() -> None:
    """Parse the options and run both sessions."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ballast", type=int, default=20_000)
    parser.add_argument("--names", choices=["same", "symlink", "hardlink"], default="same")
    parser.add_argument("--kills", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        load(Path(directory), args)
    if args.kills:
        with tempfile.TemporaryDirectory() as directory:
            kills(Path(directory), args)


if __name__ == "__main__":
    main()
