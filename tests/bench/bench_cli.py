"""CLI start-up: `fsm-runner --help` and `fsm-runner runs` on a 10,000-run journal.

Run from the repository root::

    python tests/bench/bench_cli.py [--runs 10000] [--repeat 15]

Prints the median wall time of each command (a fresh process each time), the same for a bare
`python -c pass` measured in the same run (the interpreter's own start-up, the floor), the
ratio to it, PASS/FAIL against the 250 ms target, and the top entries of
`python -X importtime` for each command's imports.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, Journal, SqliteJournal  # noqa: E402 - after the path set-up
from tests.helpers import NEXT, linear_spec  # noqa: E402

TARGET_MS = 250.0


def add_runs(journal: Journal, runs: int) -> None:
    """Add ``runs`` runs of a 3-phase machine to ``journal``, a third of them finished."""
    spec = linear_spec("a", "b", "c", name="bench")
    engine = Engine(spec, handlers=dict.fromkeys("abc", lambda _ctx: NEXT), journal=journal)
    for index in range(runs):
        run_id = engine.start({"n": index})
        if index % 3 == 0:
            engine.run(run_id)
    engine.close()


def fill(path: Path, runs: int) -> None:
    """A journal of ``runs`` runs of a 3-phase machine, a third of them finished."""
    with SqliteJournal(path) as journal:
        add_runs(journal, runs)


def wall_ms(command: list[str], repeat: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def import_top(code: str, env: dict[str, str], top: int = 6) -> list[tuple[int, str]]:
    """The modules with the largest cumulative import time (µs) for ``code``."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    entries = []
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|(\s*)(\S+)", line)
        if match and len(match.group(2)) <= 3:  # top-level imports and their direct children
            entries.append((int(match.group(1)), match.group(2) + match.group(3)))
    return sorted(entries, reverse=True)[:top]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    script = shutil.which("fsm-runner") or str(Path(sys.executable).with_name("fsm-runner"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores; "
        f"median of {args.repeat} fresh processes each\n"
    )
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        journal = Path(tmp) / "journal.db"
        started = time.perf_counter()
        fill(journal, args.runs)
        print(f"journal: {args.runs:,} runs ({time.perf_counter() - started:.1f} s to fill)\n")
        floor = wall_ms([sys.executable, "-c", "pass"], args.repeat, env)
        print(f"  python -c pass              {floor:7.1f} ms   (the floor)")
        for label, command in (
            ("fsm-runner --help", [script, "--help"]),
            ("fsm-runner runs", [script, "--journal", str(journal), "runs"]),
        ):
            ms = wall_ms(command, args.repeat, env)
            verdict = "PASS" if ms <= TARGET_MS else "FAIL"
            failed |= ms > TARGET_MS
            print(
                f"  {label:<27} {ms:7.1f} ms   {ms / floor:4.1f}x the floor   "
                f"target <= {TARGET_MS:.0f} ms: {verdict}"
            )
    print("\nlargest imports (cumulative µs), fsm-runner --help:")
    for micros, name in import_top("import fsm_runner.cli", env):
        print(f"  {micros:>8,}  {name}")
    print("largest imports (cumulative µs), fsm-runner runs:")
    code = (
        "import fsm_runner.cli; from fsm_runner.journal import open_journal; "
        "from fsm_runner.records import unstructure"
    )
    for micros, name in import_top(code, env):
        print(f"  {micros:>8,}  {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
