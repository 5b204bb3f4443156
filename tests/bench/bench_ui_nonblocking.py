"""The inspector never blocks: ``/runs`` while ``check`` runs over 100,000 runs (issue 32, point 1).

Run from the repository root::

    python tests/bench/bench_ui_nonblocking.py [--runs 100000] [--rounds 3] [--journal URL]

Starts runs with the engine (``start_many``, 5,000 at a time) in a SQLite file (or a PostgreSQL
schema of its own with ``--journal``), then serves it with a real ``fsm-runner ui`` process on a
loopback port and asks ``/runs`` over HTTP, one request after another, as an operator's browser
would: first with nothing else running (the baseline), then while the check job the first visit
to ``/check`` starts replays every run in the server's background. Each round checks the whole
journal again. Prints the check's duration, the median, 95th percentile and slowest ``/runs``
answer on both sides, their ratio, and PASS/FAIL against the issue's target: every ``/runs``
answered in under 200 ms while the check runs. (The tests show the same by order, not by time:
``tests/test_ui_nonblocking.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsm_runner.journal.locate import locate_journal
from tests.helpers import two_phase_engine
from tests.ui_helpers import Server

#: The issue's target: each ``/runs`` while the check runs.
TARGET_MS = 200.0


def fill(location: str, runs: int) -> None:
    with (
        locate_journal(location, must_exist=False) as journal,
        two_phase_engine(journal) as engine,
    ):
        for start in range(0, runs, 5000):
            engine.start_many([{"n": n} for n in range(start, min(runs, start + 5000))])


def timed_runs(server: Server) -> float:
    started = time.perf_counter()
    answer = server.get("/runs")
    elapsed = (time.perf_counter() - started) * 1000
    assert answer.status == 200, answer.status
    return elapsed


def progress(server: Server) -> str | None:
    return json.loads(server.get("/check/progress").body)["state"]


def check_round(server: Server) -> tuple[float, list[float]]:
    """Start a check (or check again), time ``/runs`` until it ends; its duration, the times."""
    page = server.get("/check")
    if progress(server) != "running":  # a check ended before: "Check again"
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.body).group(1)
        data = urllib.parse.urlencode({"csrf_token": token, "action": "start"}).encode()
        server.post("/check", data)
    started = time.perf_counter()
    times = []
    while progress(server) == "running":
        times.append(timed_runs(server))
        if times[-1] > 100 and os.environ.get("BENCH_SLOW"):
            print(f"    slow: {times[-1]:.0f} ms at {time.perf_counter() - started:.2f} s")
    return time.perf_counter() - started, times


def summary(times: list[float]) -> str:
    ranked = sorted(times)
    p95 = ranked[min(len(ranked) - 1, int(len(ranked) * 0.95))]
    return (
        f"median {statistics.median(ranked):6.1f} ms, p95 {p95:6.1f} ms, max {ranked[-1]:6.1f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--journal", help="a PostgreSQL URL (a schema of its own is made)")
    args = parser.parse_args()
    print(f"python {platform.python_version()}, {os.cpu_count()} cores; {args.runs:,} runs")
    with tempfile.TemporaryDirectory() as tmp:
        schema = f"fsm_bench_nonblock_{uuid.uuid4().hex[:8]}"
        location = f"{args.journal}?schema={schema}" if args.journal else str(Path(tmp) / "j.db")
        started = time.perf_counter()
        fill(location, args.runs)
        print(f"journal filled in {time.perf_counter() - started:.1f} s")
        server = Server(location)
        try:
            timed_runs(server)  # warm: the server's first page (templates, connections)
            idle = [timed_runs(server) for _ in range(50)]
            during: list[float] = []
            for round_ in range(args.rounds):
                took, times = check_round(server)
                during += times
                print(f"  check {round_ + 1}: {took:.1f} s, {len(times)} /runs answered meanwhile")
            page = server.get("/check").body
            assert f"{args.runs:,} runs checked, no problems" in page, "the check did not pass"
        finally:
            _, err = server.stop()
            if args.journal:
                import psycopg

                with psycopg.connect(args.journal, autocommit=True) as conn:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if not during:
        print("FAIL: every check ended before /runs was asked")
        return 1
    print(f"  /runs, nothing else running:   {summary(idle)}")
    print(f"  /runs, while check runs:      {summary(during)}")
    ratio = statistics.median(during) / statistics.median(idle)
    passed = max(during) < TARGET_MS
    print(f"  median ratio while / idle: {ratio:.2f}x; slowest while checking < {TARGET_MS:.0f} ms:"
          f" {'PASS' if passed else 'FAIL'}")  # fmt: skip
    if "Traceback" in err:
        print(err)
        return 1
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
