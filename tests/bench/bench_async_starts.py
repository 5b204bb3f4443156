"""Starts from an event loop: ``astart`` (off the loop, batched) against ``start`` on the loop.

Run from the repository root::

    python tests/bench/bench_async_starts.py [--clients 20] [--requests 100]
    python tests/bench/bench_async_starts.py --journal postgresql://root@127.0.0.1/test

``--clients`` tasks of one event loop each start ``--requests`` runs one after another, as the
handlers of a web service would: with ``await engine.astart(...)``, and, as the baseline
measured in the same run, with ``engine.start(...)`` called in the coroutine (what a handler
without ``astart`` does: the loop waits for each commit). Prints, for each, the starts a
second, each call's latency (p50, p99) and the loop's worst lag (how late a 1 ms ticker task
woke: what every other request of the service waited), then the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fsm_runner import Engine  # noqa: E402 - after the path set-up
from fsm_runner.journal import open_journal  # noqa: E402
from tests.helpers import handlers_for, linear_spec  # noqa: E402


async def measure(
    start: Callable[[int], Awaitable[object]], clients: int, requests: int
) -> dict[str, float]:
    """Run the clients; the figures."""
    latencies: list[float] = []
    lag = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal lag
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = max(lag, time.perf_counter() - before - 0.001)

    async def client(n: int) -> None:
        for i in range(requests):
            began = time.perf_counter()
            await start(n * requests + i)
            latencies.append(time.perf_counter() - began)

    tick = asyncio.ensure_future(ticker())
    began = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.perf_counter() - began
    done.set()
    await tick
    latencies.sort()
    return {
        "per_s": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "lag_ms": lag * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--journal", help="a PostgreSQL URL (a schema of its own is made)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        location = args.journal or str(Path(folder) / "journal.db")
        if args.journal:
            sep = "&" if "?" in location else "?"
            location = f"{location}{sep}schema=bench_{uuid.uuid4().hex[:8]}"
        with open_journal(location) as journal:
            spec = linear_spec("a", "b")
            with Engine(spec, handlers=handlers_for("a", "b"), journal=journal) as engine:

                async def sync_start(n: int) -> object:
                    return engine.start({"n": n})

                async def async_start(n: int) -> object:
                    return await engine.astart({"n": n})

                baseline = asyncio.run(measure(sync_start, args.clients, args.requests))
                batched = asyncio.run(measure(async_start, args.clients, args.requests))
    kind = "PostgreSQL" if args.journal else "SQLite"
    print(f"{kind}: {args.clients} clients x {args.requests} starts each")
    for name, figures in (("start on the loop (baseline)", baseline), ("astart", batched)):
        print(
            f"  {name:30} {figures['per_s']:8.0f} starts/s  p50 {figures['p50_ms']:7.2f} ms"
            f"  p99 {figures['p99_ms']:7.2f} ms  loop lag max {figures['lag_ms']:7.2f} ms"
        )
    print(
        f"  ratio astart/baseline: starts/s {batched['per_s'] / baseline['per_s']:.2f}x,"
        f" loop lag {batched['lag_ms'] / max(baseline['lag_ms'], 1e-9):.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
