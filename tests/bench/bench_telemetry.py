"""What OpenTelemetry costs a journaled step: nothing when off, and how much when on (issue 35).

    python tests/bench/bench_telemetry.py [--steps 20000] [--runs 200] [--rounds 7]

Each figure is one fresh process (imports and module state clean), rounds interleaved, medians:

* ``without``: ``opentelemetry`` cannot be imported (an install without the ``otel`` extra);
* ``off``: ``opentelemetry`` imported, no provider set: the engine's telemetry stays off — the
  extra installed but not enabled (target: within 2 % of ``without``);
* ``on``: the SDK's ``TracerProvider`` (no span processor) and ``MeterProvider`` (no reader) set
  globally, so the engine turns telemetry on: the per-step cost of its spans and instruments,
  the general path included (the fast path is off with telemetry);
* ``exported``: as ``on``, spans through a ``BatchSpanProcessor`` to an exporter that drops them
  and metrics read by an in-memory reader: what a configured pipeline adds.

Workloads: ``sync`` is bench_engine's (one run of a 4-state loop of no-op handlers, ``--steps``
steps on a SQLite file); ``async`` is bench_concurrent's (``--runs`` runs of 50 steps at once
with ``arun`` and group commit).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("without", "off", "on", "exported")
WORKLOADS = ("sync", "async")
TARGET = 0.98  # off against without
ASYNC_STEPS = 50


def _prepare(mode: str) -> None:
    """Set the process up as ``mode`` says, before fsm_runner is imported."""
    if mode == "without":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment] # import fails
        return
    from opentelemetry import metrics, trace

    if mode == "off":
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    tracer_provider = TracerProvider()
    readers = []
    if mode == "exported":

        class Dropped(SpanExporter):
            def export(self, spans: object) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        tracer_provider.add_span_processor(BatchSpanProcessor(Dropped()))
        readers.append(InMemoryMetricReader())
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=readers))


def _child(mode: str, workload: str, steps: int, runs: int, directory: Path) -> float:
    """Steps per second of one measurement in this (fresh) process."""
    _prepare(mode)
    sys.path.insert(0, str(ROOT / "tests" / "bench"))
    from bench_engine import SPEC, noop

    from fsm_runner import Engine, SqliteJournal

    journal = SqliteJournal(directory / f"{mode}-{workload}.db")
    engine = Engine(SPEC, handlers={"noop": noop}, journal=journal)
    expected_on = mode in ("on", "exported")
    assert (engine._core.telemetry is not None) is expected_on, mode  # private: the mode holds
    if workload == "sync":
        run_id = engine.start()
        engine.run(run_id, max_steps=200)  # warm up
        gc.collect()
        started = time.perf_counter()
        engine.run(run_id, max_steps=steps)
        elapsed = time.perf_counter() - started
        done = steps
    else:

        async def main() -> float:
            await engine.arun(await engine.astart(), max_steps=200)  # warm up
            run_ids = [await engine.astart() for _ in range(runs)]
            gc.collect()
            began = time.perf_counter()
            await asyncio.gather(*(engine.arun(r, max_steps=ASYNC_STEPS) for r in run_ids))
            return time.perf_counter() - began

        elapsed = asyncio.run(main())
        done = runs * ASYNC_STEPS
    engine.close()
    journal.close()
    return done / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="sync steps per figure")
    parser.add_argument("--runs", type=int, default=200, help="async runs (50 steps each)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "WORKLOAD", "DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        mode, workload, directory = args.child
        print(json.dumps(_child(mode, workload, args.steps, args.runs, Path(directory))))
        return 0
    print(f"{args.steps} sync steps, {args.runs} async runs x {ASYNC_STEPS} steps;")
    print(f"{args.rounds} rounds interleaved, a fresh process each figure, medians\n")
    rates: dict[tuple[str, str], list[float]] = {(m, w): [] for m in MODES for w in WORKLOADS}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for workload in WORKLOADS:
                for mode in MODES:
                    directory = Path(tmp) / f"{index}"
                    directory.mkdir(exist_ok=True)
                    out = subprocess.run(
                        [sys.executable, __file__, "--steps", str(args.steps), "--runs",
                         str(args.runs), "--child", mode, workload, str(directory)],
                        capture_output=True, text=True, check=True, cwd=ROOT,
                    )  # fmt: skip
                    rates[mode, workload].append(float(out.stdout.strip().splitlines()[-1]))
    failed = False
    for workload in WORKLOADS:
        median = {mode: statistics.median(rates[mode, workload]) for mode in MODES}
        base = median["without"]
        print(f"{workload}:")
        for mode in MODES:
            rate = median[mode]
            extra = 1e6 / rate - 1e6 / base
            print(
                f"  {mode:<9} {rate:>9,.0f} steps/s  {1e6 / rate:6.1f} us/step"
                f"  x{rate / base:.3f} of without  ({extra:+.1f} us/step)"
            )
        ratio = median["off"] / base
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        failed |= ratio < TARGET
        print(f"  off / without {ratio:.3f}  target >= {TARGET}: {verdict}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
