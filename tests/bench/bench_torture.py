"""Crash torture at length: workers SIGKILLed (and stopped past their lease) at random, then checked.

    python tests/bench/bench_torture.py --kills 1000 [--pauses 0] [--runs 60] [--workers 4]
        [--seed S] [--kill-interval 0.15] [--lease-ttl 1.0] [--journal PATH]
        [--drive sync|async|mixed]

The session and its checks are those of ``tests/test_crash_torture.py`` (see
``tests/torture.py``): every run reaches its expected terminal state by its expected path,
seqs are gapless and the journal replays, no phase runs again once its transition is
journaled, and no lease token is ever used by two workers. ``--drive async`` makes the workers
async (``AsyncWorker`` in ``tests/torture.py``): rounds of ``arun`` of many runs at once
(group commit), batches of their own started by ``start_many(claim=True)`` (each in the
journal whole or not at all), some left undriven until ``Engine.close`` lets go of them;
``--drive mixed``: each worker sync or async, at random. Prints the figures and PASS or FAIL
(exit code 0 or 1). The journal is kept in a temporary directory unless ``--journal`` names
where to write it, so a failed session can be inspected.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from tests.torture import DRIVES, torture  # after the sys.path line: needs the repository root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=1000, help="SIGKILLs to deliver")
    parser.add_argument(
        "--pauses", type=int, default=0, help="SIGSTOPs past the lease (then SIGCONT)"
    )
    parser.add_argument("--runs", type=int, default=60, help="runs started at first")
    parser.add_argument("--workers", type=int, default=4, help="worker processes at a time")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--kill-interval", type=float, default=0.15, help="mean seconds")
    parser.add_argument("--lease-ttl", type=float, default=1.0, help="the workers' lease")
    parser.add_argument("--journal", type=Path, default=None, help="keep the journal here")
    parser.add_argument(
        "--drive",
        choices=DRIVES,
        default="sync",
        help="how workers drive runs (default: sync; mixed: each worker one or the other)",
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)

    print(f"python {platform.python_version()} on {platform.machine()}, {platform.system()}")
    print(
        f"torture: {args.kills} kills, {args.pauses} pauses, {args.workers} workers,"
        f" {args.runs} runs to start with, lease {args.lease_ttl} s, {args.drive} drive,"
        f" seed {seed}",
        flush=True,
    )
    started = time.monotonic()

    def progress(kills: int, runs: int) -> None:
        if kills % 100 == 0:
            elapsed = time.monotonic() - started
            print(
                f"  {elapsed:6.1f} s: {kills} kills, {runs} runs started by the driver",
                flush=True,
            )

    with tempfile.TemporaryDirectory() as scratch:
        journal = args.journal or Path(scratch) / "torture.db"
        report = torture(
            journal,
            runs=args.runs,
            workers=args.workers,
            kills=args.kills,
            pauses=args.pauses,
            seed=seed,
            kill_interval=args.kill_interval,
            lease_ttl=args.lease_ttl,
            timeout=max(900.0, 2.0 * (args.kills + args.pauses) * args.kill_interval + 300.0),
            drive=args.drive,
            progress=progress,
        )
    print(report.summary())
    passed = report.ok and report.kills == args.kills and report.pauses == args.pauses
    print("PASS" if passed else f"FAIL (replay the choices with --seed {seed})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
