"""The rule of run ids on the journals' hot path: ``create_runs`` of 1,000 runs, checked or not.

Run from the repository root::

    python tests/bench/bench_run_ids.py [--runs 1000] [--rounds 15]

Prints the cost of :func:`fsm_runner.run_ids.check_run_ids` per id (random ids, the ones
``start_many`` makes; and ids that take the full check, non-ASCII), then ``create_runs`` of
``--runs`` runs on SQLite (a file) and in memory with the check as shipped against the same
call with the check replaced by a no-op (the baseline), in interleaved rounds: the medians and
their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, MemoryJournal, SqliteJournal  # noqa: E402 - after the path set-up
from fsm_runner.engine.core import random_ids  # noqa: E402
from fsm_runner.journal import _sqlite_writes, memory  # noqa: E402
from fsm_runner.run_ids import check_run_ids  # noqa: E402
from tests.helpers import NEXT, linear_spec  # noqa: E402

SPEC = linear_spec("a", "b", name="bench")


def per_id_ns(ids: list[str], number: int = 20) -> float:
    """Nanoseconds :func:`check_run_ids` takes per id of ``ids`` (the best of 5)."""
    best = min(timeit.repeat(lambda: check_run_ids(ids), number=number, repeat=5))
    return best / number / len(ids) * 1e9


def batch(runs: int):
    """``runs`` new runs' records, as ``start_many`` gives them to ``create_runs``."""
    engine = Engine(SPEC, handlers={"a": lambda _c: NEXT, "b": lambda _c: NEXT},
                    journal=MemoryJournal())  # fmt: skip
    core = engine._core  # private: the records start_many hands to create_runs, unwritten
    return [core.new_run({"n": n}, run_id, None, None, None)
            for n, run_id in enumerate(random_ids(runs))], core.spec_json  # fmt: skip


def create_ms(kind: str, runs: int, checked: bool, directory: str) -> float:
    """Milliseconds ``create_runs`` of ``runs`` new runs takes on a fresh journal of ``kind``."""
    new, spec_json = batch(runs)
    modules = (_sqlite_writes, memory)
    if not checked:
        for module in modules:
            module.check_run_ids = lambda _ids: None  # type: ignore[attr-defined]
    try:
        if kind == "sqlite":
            journal = SqliteJournal(Path(directory) / f"{os.urandom(6).hex()}.db")
        else:
            journal = MemoryJournal()
        started = time.perf_counter()
        journal.create_runs(new, spec_json=spec_json)
        elapsed = (time.perf_counter() - started) * 1000
        journal.close()
    finally:
        for module in modules:
            module.check_run_ids = check_run_ids  # type: ignore[attr-defined]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")

    ids = random_ids(10_000)
    ascii_ns = per_id_ns(ids)
    full_ns = per_id_ns([f"é-{run_id}" for run_id in ids[:2000]])
    loop_ns = (
        min(timeit.repeat(lambda: [None for _ in ids], number=20, repeat=5)) / 20 / len(ids) * 1e9
    )
    print(f"check_run_ids per id: random ids {ascii_ns:.0f} ns, non-ASCII ids (full check) "
          f"{full_ns:.0f} ns; a bare loop over the ids {loop_ns:.0f} ns")  # fmt: skip

    with tempfile.TemporaryDirectory() as directory:
        for kind in ("sqlite", "memory"):
            checked: list[float] = []
            baseline: list[float] = []
            create_ms(kind, args.runs, True, directory)  # warm up
            for _ in range(args.rounds):  # interleaved: the load changes both alike
                checked.append(create_ms(kind, args.runs, True, directory))
                baseline.append(create_ms(kind, args.runs, False, directory))
            a, b = statistics.median(checked), statistics.median(baseline)
            check_ms = ascii_ns * args.runs / 1e6
            print(f"create_runs of {args.runs} runs on {kind}: checked {a:.2f} ms, unchecked "
                  f"(baseline) {b:.2f} ms, ratio {a / b:.3f}; the check's own share "
                  f"{check_ms:.3f} ms = {check_ms / b:.2%} of the baseline")  # fmt: skip


if __name__ == "__main__":
    main()
