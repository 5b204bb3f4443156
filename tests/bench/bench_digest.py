"""What each run's hash chain costs a journaled step: the digest computed, in one run.

    python tests/bench/bench_digest.py [--steps 20000] [--rounds 7]

bench_engine's loop (one run of a 4-state loop, no-op handlers, a SQLite file journal,
durability ``process``), as it is, against the same loop with the transition's digest not
computed (a constant 32-character digest written in its place: the same bytes stored, so the
difference is the computation). Rounds are interleaved and medians reported; also the digest
alone (``transition_digest`` of one step's values), per call. The A/B against the fsm_runner
before the chain (no digest written at all) is bench_engine, bench_concurrent and
bench_short_runs run against both checkouts, interleaved.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import engine_rate

from fsm_runner.journal import _sqlite_writes
from fsm_runner.journal._digest import transition_digest

_CONSTANT = "0" * 32


def _without_digest(previous: str | None, values: tuple[object, ...]) -> str:
    return _CONSTANT


def digest_ns() -> float:
    """One step's digest alone, in nanoseconds (best of 5)."""
    values = ("0" * 32, 1234, "b", "NEXT", "c", 0, 1, "2026-01-02T03:04:05.678901+00:00", 0.012)
    values += (None, 1)
    calls = 100_000
    best = min(timeit.repeat(lambda: transition_digest(_CONSTANT, values), number=calls, repeat=5))
    return best / calls * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}")
    print(f"{args.steps} steps x {args.rounds} rounds, medians")
    real = _sqlite_writes.transition_digest
    chained: list[float] = []
    bare: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for rates, digest in ((chained, real), (bare, _without_digest)):
                _sqlite_writes.transition_digest = digest  # type: ignore[assignment]
                try:
                    gc.collect()
                    rates.append(engine_rate(Path(tmp), args.steps, "process", index))
                finally:
                    _sqlite_writes.transition_digest = real
                time.sleep(0.1)
    with_chain, without = statistics.median(chained), statistics.median(bare)
    step_us, bare_us = 1e6 / with_chain, 1e6 / without
    print(f"  with the chain     {with_chain:10,.0f} journaled steps/s  ({step_us:.2f} us/step)")
    print(f"  digest not computed {without:9,.0f} journaled steps/s  ({bare_us:.2f} us/step)")
    print(
        f"  the digest: {step_us - bare_us:+.2f} us/step, ratio {with_chain / without:.3f}"
        f" (alone: {digest_ns():.0f} ns a call)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
