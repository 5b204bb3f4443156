"""Load on the web-service example: acknowledged starts/s and POST p50/p99, against a bare INSERT.

Run from the repository root::

    python tests/bench/bench_web_service.py [--clients 20] [--seconds 10]
    python tests/bench/bench_web_service.py --journal postgresql://root@127.0.0.1/test

Serves ``fsm_runner.examples.web_service`` with uvicorn on 127.0.0.1 (one process, one event
loop) and lets ``--clients`` threads POST orders for ``--seconds``, each as soon as its last
answer came (keep-alive connections). The baseline, measured the same way in the same run, is
a bare endpoint that INSERTs one row into a SQLite table of the same file kind (WAL,
``synchronous=NORMAL``: the journal's default durability) in a worker thread, and answers 202:
the least a durable POST can cost. No worker runs the orders: the figure is the service's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def bare_app() -> Any:
    """The baseline: POST /orders INSERTs one row (in a worker thread) and answers 202."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    conn = sqlite3.connect(
        os.environ["BENCH_BARE_DB"], isolation_level=None, check_same_thread=False
    )
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, body TEXT)")
    lock = threading.Lock()

    def insert(order_id: str, body: str) -> None:
        with lock:
            conn.execute("INSERT INTO orders VALUES (?, ?)", (order_id, body))

    async def post(request: Request) -> JSONResponse:
        body = (await request.body()).decode()
        order_id = json.loads(body)["order_id"]
        await run_in_threadpool(insert, order_id, body)
        return JSONResponse({"order_id": order_id}, status_code=202)

    return Starlette(routes=[Route("/orders", post, methods=["POST"])])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load(port: int, clients: int, seconds: float) -> dict[str, float]:
    """``clients`` threads POSTing for ``seconds``; acknowledged POSTs a second and latencies."""
    latencies: list[float] = []
    failures = [0]
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine: list[float] = []
        while time.monotonic() < stop:
            body = json.dumps({"order_id": uuid.uuid4().hex[:16], "items": ["book"]})
            began = time.perf_counter()
            conn.request("POST", "/orders", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            if answer.status == 202:
                mine.append(time.perf_counter() - began)
            else:
                with lock:
                    failures[0] += 1
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "per_s": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[max(int(len(latencies) * 0.99) - 1, 0)] * 1000,
        "failed": failures[0],
    }


def serve(factory: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", factory, "--port", str(port),
         "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:  # noqa: PERF203 - not listening yet: look again
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{factory} did not start: {proc.communicate()[1]}") from None
            time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--journal", help="a PostgreSQL URL (a schema of its own is made)")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        journal = args.journal or str(Path(folder) / "orders.db")
        if args.journal:
            sep = "&" if "?" in journal else "?"
            journal = f"{journal}{sep}schema=bench_web_{uuid.uuid4().hex[:8]}"
        env = {
            **os.environ,
            "FSM_RUNNER_JOURNAL": journal,
            "FSM_RUNNER_ORDERS_DIR": str(Path(folder) / "orders"),
            "BENCH_BARE_DB": str(Path(folder) / "bare.db"),
            "PYTHONPATH": str(ROOT),
        }
        for name, factory in (
            ("bare INSERT (baseline)", "tests.bench.bench_web_service:bare_app"),
            ("web-service example", "fsm_runner.examples.web_service:create_app"),
        ):
            proc, port = serve(factory, env)
            try:
                results[name] = load(port, args.clients, args.seconds)
            finally:
                proc.terminate()
                proc.communicate(timeout=30)
    kind = "PostgreSQL journal" if args.journal else "SQLite journal"
    print(f"{kind}: {args.clients} clients for {args.seconds:g} s each")
    for name, figures in results.items():
        print(
            f"  {name:24} {figures['per_s']:7.0f} acknowledged/s  p50 {figures['p50_ms']:7.2f} ms"
            f"  p99 {figures['p99_ms']:7.2f} ms  failed {figures['failed']:.0f}"
        )
    base, example = results["bare INSERT (baseline)"], results["web-service example"]
    print(
        f"  ratio example/baseline: acknowledged/s {example['per_s'] / base['per_s']:.2f}x,"
        f" p50 {example['p50_ms'] / base['p50_ms']:.2f}x, p99 {example['p99_ms'] / base['p99_ms']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
