"""Failover (issue 31): how soon another worker runs a phase whose worker was SIGKILLed in it.

Run from the repository root::

    python tests/bench/bench_failover.py [--rounds 2] [--ttl 30]
    python tests/bench/bench_failover.py --postgres postgresql://root@127.0.0.1/test
    python tests/bench/bench_failover.py --no-postgres              # SQLite only
    python tests/bench/bench_failover.py --no-sqlite                # PostgreSQL only

For each journal — a SQLite file (one host: the dead worker's pid tells it is gone) and
PostgreSQL (``--postgres URL``, by default the tests' server if it answers; a schema of its own,
dropped afterwards; two "hosts": the workers in process groups of their own, their worker ids
naming different hosts, so only the dead worker's database session tells) — each round starts
a run of ``tests/failover_app.py`` (its phase blocks until released), lets one
``fsm-runner worker`` enter the phase, starts a second worker, SIGKILLs the first (at a random
moment of the second's looks) and times the kill to the second worker's first call of the
phase. Rounds alternate the second worker's ``--takeover-dead`` (what is measured) and
``--no-takeover-dead`` (the baseline: the lease expires, up to ``--ttl`` seconds; the default
TTL is 30 s). Target: < 1.5 s with takeover.

It also prints what the takeover costs an idle worker: with ``--held`` runs held by live
owners, the time of an idle ``claim_next`` (every poll, 0.5 s by default) beside one look at
who holds the leases and whether they live (at most every 0.5 s).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the repository's fsm_runner
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine, RunLifecycle, SqliteJournal  # noqa: E402 - after sys.path
from fsm_runner.engine.takeover import DeadOwners  # noqa: E402 - after the sys.path set-up
from tests.failover_app import SPEC, slow  # noqa: E402 - after the sys.path set-up
from tests.test_failover import Workers, wait_for  # noqa: E402 - after the sys.path set-up

DEFAULT_POSTGRES = os.environ.get(
    "FSM_RUNNER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test"
)


def one_failover(workdir: Path, journal, location: str, *, takeover: bool, ttl: float, hosts):
    """Seconds from the SIGKILL of the worker in the phase to the other worker's call of it."""
    run_id = Engine(SPEC, handlers={"slow": slow}, journal=journal).start()
    with Workers(workdir, location, ttl=ttl) as workers:
        victim = workers.spawn(host=hosts[0])
        wait_for(lambda: workers.calls_by(victim), "the first worker in the phase")
        option = "--takeover-dead" if takeover else "--no-takeover-dead"
        survivor = workers.spawn(host=hosts[1], options=(option,))
        wait_for(lambda: workers.ready(survivor), "the second worker to start")
        # Past its start, in its loop; at a random moment of its 0.5 s looks (not in step).
        time.sleep(1.0 + random.uniform(0.0, 0.5))
        killed = time.time()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        (again,) = wait_for(lambda: workers.calls_by(survivor), "the takeover", timeout=ttl * 3)
        (workdir / "release").touch()
        wait_for(lambda: journal.load(run_id).status is RunLifecycle.SUCCEEDED, "the run")
        survivor.send_signal(signal.SIGTERM)
        survivor.wait()
    return again - killed


def idle_costs(journal, held: int, samples: int = 200) -> tuple[float, float]:
    """Median seconds of an idle ``claim_next`` and of one look at the leases' owners."""
    engine = Engine(SPEC, handlers={"slow": slow}, journal=journal)
    run_ids = engine.start_many([None] * held)
    me = f"{os.uname().nodename}:{os.getpid()}"
    for number, run_id in enumerate(run_ids):  # held by live owners (this process's pid)
        journal.claim(run_id, f"{me}:{number % 4}", ttl=3600)
    look = DeadOwners(lambda: journal, SPEC.name, lambda: "me", lambda: 30.0, interval=0.0)
    polls, looks = [], []
    for _ in range(samples):
        began = time.perf_counter()
        assert journal.claim_next("me", ttl=30, machine=SPEC.name, states=["slow"]) is None
        polls.append(time.perf_counter() - began)
        began = time.perf_counter()
        assert look.due() == []
        looks.append(time.perf_counter() - began)
    return statistics.median(polls), statistics.median(looks)


def bench(name: str, make, args, hosts) -> list[tuple[str, bool]]:
    print(f"\n== {name}")
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for takeover in (True, False) if round_ % 2 == 0 else (False, True):
            with tempfile.TemporaryDirectory(prefix="bench_failover_") as workdir:
                journal, location, done = make(Path(workdir))
                try:
                    seconds = one_failover(
                        Path(workdir),
                        journal,
                        location,
                        takeover=takeover,
                        ttl=args.ttl,
                        hosts=hosts,
                    )
                finally:
                    done()
            times[takeover].append(seconds)
            label = "takeover" if takeover else "lease expiry (baseline)"
            print(f"  round {round_ + 1}: {label}: {seconds:.3f} s")
    fast, slow_ = statistics.median(times[True]), statistics.median(times[False])
    print(f"  kill -9 to the next handler call, median of {args.rounds}:")
    print(f"    takeover_dead      {fast:.3f} s")
    print(f"    lease expiry       {slow_:.3f} s   (lease_ttl {args.ttl:g} s)")
    print(f"    ratio              {fast / slow_:.3f}")
    with tempfile.TemporaryDirectory(prefix="bench_failover_") as workdir:
        journal, _, done = make(Path(workdir))
        try:
            poll, look = idle_costs(journal, args.held)
        finally:
            done()
    print(f"  idle worker, {args.held} runs held by live owners (median):")
    print(f"    claim_next finding nothing   {poll * 1e6:8.0f} us  (each poll)")
    print(f"    look at the leases' owners   {look * 1e6:8.0f} us  (at most every 0.5 s)")
    print(f"    ratio                        {look / poll:8.2f}")
    return [(f"{name}: takeover in {fast:.2f} s < 1.5 s", fast < 1.5)]


def sqlite_journal(workdir: Path):
    path = workdir / "journal.db"
    journal = SqliteJournal(path)
    return journal, str(path), journal.close


def postgres_journal(url: str):
    import psycopg

    from fsm_runner.journal.postgres import PostgresJournal

    def make(workdir: Path):
        schema = f"bench_failover_{uuid.uuid4().hex[:8]}"
        journal = PostgresJournal(url, schema=schema)
        location = f"{url}{'&' if '?' in url else '?'}schema={urllib.parse.quote(schema)}"

        def done() -> None:
            journal.close()
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')

        return journal, location, done

    return make


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind")
    parser.add_argument("--ttl", type=float, default=30.0, help="the workers' lease_ttl (s)")
    parser.add_argument("--held", type=int, default=100, help="leased runs for the idle costs")
    parser.add_argument("--postgres", metavar="URL", help="measure PostgreSQL there too")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; lease_ttl {args.ttl:g} s")
    targets = (
        [] if args.no_sqlite else bench("SQLite, one host", sqlite_journal, args, (None, None))
    )
    url = None if args.no_postgres else (args.postgres or DEFAULT_POSTGRES)
    if url is not None:
        try:
            import psycopg

            psycopg.connect(url, connect_timeout=3).close()
        except Exception as exc:
            print(f"(PostgreSQL at {url} does not answer: {exc}; its part is not run)")
        else:
            targets += bench("PostgreSQL, two hosts", postgres_journal(url), args, ("a", "b"))
    print()
    for description, met in targets:
        print(f"{'PASS' if met else 'FAIL'}: {description}")
    return 0 if all(met for _, met in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
