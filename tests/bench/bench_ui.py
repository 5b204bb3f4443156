"""The run inspector's server time: the runs page on 100,000 runs, a run with 10,000 transitions.

Run from the repository root::

    python tests/bench/bench_ui.py [--runs 100000] [--transitions 10000] [--repeat 15]
    python tests/bench/bench_ui.py --journal postgresql://root@127.0.0.1/test   # a schema of its own
    python tests/bench/bench_ui.py --scale [--runs 1000000] [--small 10000] [--journal URL]

Fills a journal (SQLite by default) with ``--runs`` runs of a three-phase machine (a third of
them finished) and one run of a four-state loop with ``--transitions`` transitions. Then, in the
same process, the median time of each request as the server spends it (the ASGI app called
directly: routing, the journal's reads, the page's rendering; no network), and, as the
baseline, the equivalent `fsm-runner runs` / `show` command run in-process (click's runner:
opening the journal, the same reads, printing; no interpreter start-up). Prints the ratio and
PASS/FAIL against the targets: at most 2x the CLI's time and under 100 ms.

``--scale``: the same pages (every filter of the runs list, page 50, the machine page, the run
page of a 20,000-transition run) on a small journal and a big one (1,000,000 runs by default,
built by SQL: :func:`~tests.bench.scale_journals.build_ui_journal`), interleaved; prints each
page's median server time on both, the ratio, and PASS/FAIL against 300 ms on the big one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from click.testing import CliRunner  # noqa: E402 - after the path set-up

from fsm_runner import Engine  # noqa: E402
from fsm_runner.cli import cli  # noqa: E402
from fsm_runner.journal import open_journal  # noqa: E402
from fsm_runner.records import utc_now  # noqa: E402
from fsm_runner.ui.app import create_app  # noqa: E402
from tests.bench.bench_cli import add_runs  # noqa: E402
from tests.bench.scale_journals import build_ui_journal, build_ui_journal_postgres  # noqa: E402
from tests.helpers import NEXT, loop_spec  # noqa: E402

TARGET_RATIO = 2.0
TARGET_MS = 100.0


def fill(location: str, runs: int, transitions: int) -> str:
    """``runs`` runs of a 3-phase machine, then one loop run with ``transitions`` transitions."""
    with open_journal(location) as journal:
        add_runs(journal, runs)
        looping = Engine(loop_spec(), handlers={"noop": lambda _ctx: NEXT}, journal=journal)
        long_run = looping.start({"long": True})
        looping.run(long_run, max_steps=transitions - 1)
        looping.close()
    return long_run


class Asgi:
    """Calls the inspector's ASGI app in-process, as uvicorn would, and times each request."""

    def __init__(self, location: str) -> None:
        self.app = create_app(location)
        self.loop = asyncio.new_event_loop()

    def get(self, path: str) -> tuple[int, bytes]:
        path, _, query = path.partition("?")
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
            "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query.encode(), "root_path": "", "headers": [(b"host", b"bench")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8765),
        }  # fmt: skip
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        self.loop.run_until_complete(self.app(scope, receive, send))
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, body


def median_ms(work: Callable[[], object], repeat: int) -> float:
    work()  # warm: the journal opened, templates compiled, pages cached by SQLite
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def cli_call(location: str, *args: str) -> Callable[[], object]:
    runner = CliRunner()

    def call() -> object:
        result = runner.invoke(cli, ["--journal", location, *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result

    return call


def page_call(asgi: Asgi, path: str, must_hold: str) -> Callable[[], object]:
    def call() -> object:
        status, body = asgi.get(path)
        assert status == 200, (path, status, body[:300])
        assert must_hold.encode() in body, (path, must_hold)
        return body

    return call


def report(label: str, ui_ms: float, cli_label: str, cli_ms: float | None) -> bool:
    if cli_ms is None:
        verdict = "PASS" if ui_ms < TARGET_MS else "FAIL"
        print(
            f"  {label:<44} {ui_ms:7.1f} ms   (no CLI equivalent)        < {TARGET_MS:.0f} ms: {verdict}"
        )
        return ui_ms < TARGET_MS
    ratio = ui_ms / cli_ms
    ok = ratio <= TARGET_RATIO and ui_ms < TARGET_MS
    print(
        f"  {label:<44} {ui_ms:7.1f} ms   {cli_label:<24} {cli_ms:7.1f} ms   "
        f"{ratio:4.2f}x   <= {TARGET_RATIO:.0f}x and < {TARGET_MS:.0f} ms: "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


def measure(location: str, long_run: str, repeat: int) -> bool:
    asgi = Asgi(location)
    with open_journal(location, create=False) as journal:
        runs = journal.runs(limit=60)
        deep = journal.runs(machine="bench", limit=1)[0].run_id
    page_two = runs[49].run_id
    some = runs[5].run_id
    rows: list[tuple[str, str, str, tuple[str, ...] | None, str]] = [
        ("runs page (newest 50)", "/runs", "runs", ("runs",), 'class="run'),
        ("runs page 2 (keyset: before the 50th)", f"/runs?before={page_two}", "runs", None,
         'class="run'),
        ("runs page, machine=bench", "/runs?machine=bench", "runs --machine bench",
         ("runs", "--machine", "bench"), 'class="run'),
        ("runs page, state=a", "/runs?state=a", "runs --state a",
         ("runs", "--state", "a"), 'class="run'),
        ("runs page, id prefix", f"/runs?q={some[:6]}", "(runs has no prefix)", None, some[:12]),
        (f"run page, {long_run[:8]} (last 200 of its timeline)", f"/runs/{long_run}",
         "show (every transition)", ("show", long_run), 'data-seq="'),
        ("run page, a 3-phase run", f"/runs/{deep}", "show", ("show", deep), 'data-seq="'),
        ("machine page, loop", "/machines/loop", "-", None, "badge"),
        ("live update of the long run (nothing new)", f"/runs/{long_run}/live?after=99999999",
         "-", None, '"seq"'),
    ]  # fmt: skip
    ok = True
    for label, path, cli_label, cli_args, must_hold in rows:
        ui_ms = median_ms(page_call(asgi, path, must_hold), repeat)
        cli_ms = median_ms(cli_call(location, *cli_args), repeat) if cli_args else None
        ok &= report(label, ui_ms, cli_label, cli_ms)
    machine_ms = median_ms(page_call(asgi, "/machines/bench", "badge"), max(3, repeat // 3))
    print(
        f"  {'machine page, bench (counts of every run)':<44} {machine_ms:7.1f} ms   (informative)"
    )
    asgi.app.state.inspector.close_journal()
    return ok


#: ``--scale``: the most server time a page may take on the big journal.
SCALE_TARGET_MS = 300.0


#: The search indexes ``--scale`` adds to each journal (``--no-search-indexes``: none).
SEARCH_KEYS = ("created_at", "input.n")


def scale_journal(location: str, runs: int, transitions: int) -> str:
    """``runs`` runs built by SQL (:func:`build_ui_journal`), then one long loop run.

    ``location``: a SQLite file, or a PostgreSQL URL with its ``?schema=``.
    """
    url, _, schema = location.partition("?schema=")
    if schema:
        build_ui_journal_postgres(url, schema, runs)
    else:
        build_ui_journal(Path(location), runs)
    with open_journal(location) as journal:
        looping = Engine(loop_spec(), handlers={"noop": lambda _ctx: NEXT}, journal=journal)
        long_run = looping.start({"long": True})
        looping.run(long_run, max_steps=transitions - 1)
        looping.close()
    return long_run


def scale_pages(location: str, long_run: str) -> list[tuple[str, str, str]]:
    """Every page of the runs list's filters, page 50, the machine page and the long run's."""
    with open_journal(location, create=False) as journal:
        newest = journal.runs(limit=2_500)
        failed = next(r for r in journal.runs(status="failed", limit=10) if "n" in r.input)
    some = newest[5].run_id
    week = (utc_now() - dt.timedelta(days=7)).date().isoformat()
    month = (utc_now() - dt.timedelta(days=20)).date().isoformat()
    day_before = (utc_now() - dt.timedelta(days=21)).date().isoformat()
    return [
        ("runs page (newest 50)", "/runs", 'class="run'),
        ("runs page 50 (keyset)", f"/runs?before={newest[-51].run_id}", 'class="run'),
        ("machine=bench", "/runs?machine=bench", 'class="run'),
        ("status=active", "/runs?status=active", 'class="run'),
        ("status=failed", "/runs?status=failed", 'class="run'),
        ("state=b", "/runs?state=b", 'class="run'),
        ("state=nowhere (no run)", "/runs?state=nowhere", "No runs"),
        ("machine=bench&state=done", "/runs?machine=bench&state=done", 'class="run'),
        ("id prefix", f"/runs?q={some[:6]}", some[:12]),
        ("since a week ago", f"/runs?since={week}", 'class="run'),
        ("until 20 days ago", f"/runs?until={month}", 'class="run'),
        ("since a week ago, input.n = (a failed run's)",
         f"/runs?since={week}&where=input.n+%3D+{failed.input['n']}", failed.run_id[:12]),
        ("input.n = (a failed run's), no other filter",
         f"/runs?where=input.n+%3D+{failed.input['n']}", failed.run_id[:12]),
        ("a day 20 days ago", f"/runs?since={day_before}&until={month}", 'class="run'),
        ("parent=(a run without children)", f"/runs?parent={some}", "No runs match"),
        ("the waiting tab", "/runs?waiting=1", "waiting-tab current"),
        ("sort=updated (over 10,000: newest first)", "/runs?sort=updated", 'class="run'),
        ("id prefix, sort=updated", f"/runs?q={some[:4]}&sort=updated", some[:12]),
        ("machine page, bench (counts of every run)", "/machines/bench", "badge"),
        ("run page, 20,000 transitions", f"/runs/{long_run}", 'data-seq="'),
        ("live update of the long run (nothing new)", f"/runs/{long_run}/live?after=99999999",
         '"seq"'),
    ]  # fmt: skip


def scale(args: argparse.Namespace) -> bool:
    """The same pages on a small journal and a big one: server time, ratio, PASS under 300 ms."""
    schemas = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            sites = {}
            for label, runs in (("small", args.small), ("big", args.runs)):
                location = str(Path(tmp) / f"{label}.db")
                if args.journal:
                    schemas.append(f"fsm_bench_ui_{label}_{uuid.uuid4().hex[:8]}")
                    location = f"{args.journal}?schema={schemas[-1]}"
                started = time.perf_counter()
                long_run = scale_journal(location, runs, args.transitions)
                print(f"{label} journal: {runs:,} runs + one of {args.transitions:,} transitions"
                  f" ({time.perf_counter() - started:.1f} s to build)")  # fmt: skip
                if not args.no_search_indexes:  # what the searches below are served by
                    started = time.perf_counter()
                    with open_journal(location, create=False) as journal:
                        for key in SEARCH_KEYS:
                            journal.search_indexes.add(key)
                    print(f"  search indexes {', '.join(SEARCH_KEYS)} added in"
                          f" {time.perf_counter() - started:.1f} s")  # fmt: skip
                sites[label] = (Asgi(location), scale_pages(location, long_run))
            print(
                f"\n  {'page':<46} {'small':>9} {'big':>9}  big/small  big < {SCALE_TARGET_MS:.0f} ms"
            )
            ok = True
            rows = zip(sites["small"][1], sites["big"][1], strict=True)
            for (label, small_path, small_holds), (_, big_path, big_holds) in rows:
                times = {}
                for _round in range(args.repeat):  # interleaved: small, big, small, big ...
                    for name, path, holds in (("small", small_path, small_holds),
                                          ("big", big_path, big_holds)):  # fmt: skip
                        call = page_call(sites[name][0], path, holds)
                        if name not in times:
                            call()  # warm
                            times[name] = []
                        started = time.perf_counter()
                        call()
                        times[name].append((time.perf_counter() - started) * 1000)
                small_ms, big_ms = (statistics.median(times[n]) for n in ("small", "big"))
                passed = big_ms < SCALE_TARGET_MS
                ok &= passed
                print(f"  {label:<46} {small_ms:7.1f}ms {big_ms:7.1f}ms  {big_ms / small_ms:8.2f}x"
                  f"  {'PASS' if passed else 'FAIL'}")  # fmt: skip
            for asgi, _ in sites.values():
                asgi.app.state.inspector.close_journal()
        finally:
            if schemas:
                import psycopg

                with psycopg.connect(args.journal, autocommit=True) as conn:
                    for schema in schemas:
                        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--transitions", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--journal", help="a PostgreSQL URL (a schema of its own is made)")
    parser.add_argument(
        "--scale", action="store_true",
        help="small against big journals built by SQL (--small, --runs: 1,000,000; SQLite,"
        " or PostgreSQL with --journal)",
    )  # fmt: skip
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument(
        "--no-search-indexes", action="store_true",
        help="--scale: without the search indexes of created_at and input.n (searches by them"
        " then read the runs newest first)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.scale:
        args.runs = args.runs or 1_000_000
        args.transitions = args.transitions or 20_000
        print(
            f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores;"
            f" median of {args.repeat} requests each, interleaved, in-process\n"
        )
        ok = scale(args)
        print("\nPASS" if ok else "\nFAIL")
        return 0 if ok else 1
    args.runs = args.runs or 100_000
    args.transitions = args.transitions or 10_000
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores; "
        f"median of {args.repeat} requests / commands each, in-process\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        schema = None
        location = str(Path(tmp) / "journal.db")
        if args.journal:
            schema = f"fsm_bench_ui_{uuid.uuid4().hex[:12]}"
            location = f"{args.journal}?schema={schema}"
        try:
            started = time.perf_counter()
            long_run = fill(location, args.runs, args.transitions)
            print(
                f"journal: {args.runs:,} runs + one of {args.transitions:,} transitions "
                f"({time.perf_counter() - started:.1f} s to fill)\n"
            )
            ok = measure(location, long_run, args.repeat)
        finally:
            if schema is not None:
                import psycopg

                with psycopg.connect(args.journal, autocommit=True) as conn:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
