"""What OpenTelemetry costs a journaled step: nothing when off, little when on (issue 35).

Run from the repository root::

    python tests/bench/bench_telemetry.py [--steps 20000] [--runs 400] [--run-steps 50]
                                          [--rounds 7] [--no-exported]

Each figure is one fresh ``python`` process (imports and module state clean: the mode is set
up before ``fsm_runner`` is imported), the modes of a round run one after another in an order
rotated every round, and the median of ``--rounds`` rounds is reported. The modes:

* **without**: ``opentelemetry`` cannot be imported (``sys.modules["opentelemetry"] = None``):
  an install without the ``otel`` extra. The baseline.
* **off**: ``from opentelemetry import trace, metrics`` done, no provider set, so the engine's
  ``telemetry=None`` resolves to off: the extra installed but not enabled. Target (the issue's
  point 4): within 2 % of **without**, for each workload.
* **on**: the SDK's ``TracerProvider()`` (no span processor) and ``MeterProvider()`` (no
  metric reader) set as the global providers, so the engine turns telemetry on: the per-step
  cost of its spans and instruments with a no-op SDK, the general path included (there is no
  fast path with telemetry). Reported, no target.
* **exported**: as **on**, with ``SimpleSpanProcessor(InMemorySpanExporter())`` and an
  ``InMemoryMetricReader`` (its metrics collected once, after the drive, in the timing): every
  span ended is exported as it ends. A realistic figure; reported, no target.

Each process checks that its engine's telemetry is on or off as its mode says (and, exported,
that a span per step reached the exporter). The workloads, on a file journal with durability
``process``:

* **sync**: bench_engine.py's: one run of its 4-state loop of no-op handlers, ``Engine.run``
  for ``--steps`` steps (after 200 to warm up).
* **async**: bench_concurrent.py's: ``--runs`` runs of its 4-state loop (async no-op handlers)
  driven at once by ``asyncio.gather`` of ``Engine.arun`` with group commit, ``--run-steps``
  steps each, claims and releases included.

Printed for each workload: steps/s and us/step of each mode, its ratio to **without** and what
it adds per step in microseconds, then ``PASS``/``FAIL`` for **off** within 2 % of **without**.
Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODES = ("without", "off", "on", "exported")
WORKLOADS = ("sync", "async")
TARGET = 0.98  # off / without, for each workload
WARM_UP = 200


def _prepare(mode: str) -> Any:
    """Set this (fresh) process up as ``mode`` says, before fsm_runner is imported.

    Returns the span exporter and metric reader of ``exported`` (``None`` otherwise).
    """
    if mode == "without":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment] # every import of it fails
        return None
    from opentelemetry import metrics, trace

    if mode == "off":
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracer_provider = TracerProvider()
    readers: list[InMemoryMetricReader] = []
    exported = None
    if mode == "exported":
        exporter = InMemorySpanExporter()
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        readers.append(InMemoryMetricReader())
        exported = (exporter, readers[0])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=readers))
    return exported


def _child(mode: str, workload: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """One figure, in this fresh process: steps per second, and what telemetry produced."""
    exported = _prepare(mode)
    for path in (ROOT, ROOT / "tests" / "bench"):
        sys.path.insert(0, str(path))
    # bench_engine's module imports nothing but fsm_runner (bench_concurrent's wraps the group
    # committer on import, so its machine is rebuilt here).
    from bench_engine import SPEC, noop

    from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition

    journal = SqliteJournal(directory / f"{mode}-{workload}.db")
    if workload == "sync":
        engine = Engine(SPEC, handlers={"noop": noop}, journal=journal)
    else:
        names = ["a", "b", "c", "d"]
        spec = MachineSpec(
            "bench-concurrent",
            [State(n, handler="noop") for n in names],
            [Transition(n, "NEXT", m) for n, m in zip(names, names[1:] + names[:1], strict=True)],
        )

        async def anoop(ctx: object) -> str:
            return "NEXT"

        engine = Engine(spec, handlers={"noop": anoop}, journal=journal)
    on = engine._core.telemetry is not None  # private: that the mode holds
    assert on is (mode in ("on", "exported")), f"{mode}: telemetry {'on' if on else 'off'}"
    if workload == "sync":
        run_id = engine.start()
        engine.run(run_id, max_steps=WARM_UP)
        steps = args.steps
        gc.collect()
        started = time.perf_counter()
        run = engine.run(run_id, max_steps=steps)
        if exported:
            exported[1].get_metrics_data()
        elapsed = time.perf_counter() - started
        assert run.seq == WARM_UP + steps, run.seq
    else:
        run_ids = [engine.start() for _ in range(args.runs)]
        steps = args.runs * args.run_steps

        async def drive() -> float:
            gc.collect()
            started = time.perf_counter()
            done = await asyncio.gather(
                *(engine.arun(r, max_steps=args.run_steps) for r in run_ids)
            )
            if exported:
                exported[1].get_metrics_data()
            elapsed = time.perf_counter() - started
            assert all(run.seq == args.run_steps for run in done), "a run stopped short"
            return elapsed

        elapsed = asyncio.run(drive())
    spans = len(exported[0].get_finished_spans()) if exported else 0
    if exported:
        assert spans >= steps, f"{spans} spans exported for {steps} steps"
    engine.close()
    journal.close()
    return {"rate": steps / elapsed, "spans": spans}


def _measure(mode: str, workload: str, args: argparse.Namespace, directory: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    sizes = [
        "--steps",
        str(args.steps),
        "--runs",
        str(args.runs),
        "--run-steps",
        str(args.run_steps),
    ]
    out = subprocess.run(
        [sys.executable, __file__, *sizes, "--child", mode, workload, str(directory)],
        capture_output=True, text=True, check=False, cwd=ROOT, env=env,
    )  # fmt: skip
    if out.returncode != 0:
        sys.exit(f"{mode} {workload}: exit {out.returncode}\n{out.stderr}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["rate"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="sync: steps of the one run")
    parser.add_argument("--runs", type=int, default=400, help="async: runs driven at once")
    parser.add_argument("--run-steps", type=int, default=50, help="async: steps of each run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-exported", action="store_true", help="leave out exported")
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "WORKLOAD", "DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        mode, workload, directory = args.child
        print(json.dumps(_child(mode, workload, args, Path(directory))))
        return 0
    modes = MODES[:3] if args.no_exported else MODES
    print(
        f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, {platform.machine()}"
    )
    print(
        f"sync: 1 run x {args.steps} steps; async: {args.runs} runs x {args.run_steps} steps;"
        f" {args.rounds} rounds, a fresh process a figure, medians\n"
    )
    rates: dict[tuple[str, str], list[float]] = {(m, w): [] for m in modes for w in WORKLOADS}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            directory = Path(tmp) / str(index)
            directory.mkdir()
            # without and off side by side (their ratio is taken round by round), first in turns
            order = list(modes) if index % 2 == 0 else [modes[1], modes[0], *modes[:1:-1]]
            for workload in WORKLOADS:
                for mode in order:
                    rates[mode, workload].append(_measure(mode, workload, args, directory))
    failed = False
    for workload in WORKLOADS:
        median = {mode: statistics.median(rates[mode, workload]) for mode in modes}
        base = median["without"]
        print(f"{workload}:")
        for mode in modes:
            rate = median[mode]
            low, high = min(rates[mode, workload]), max(rates[mode, workload])
            print(
                f"  {mode:<9} {rate:>8,.0f} steps/s  {1e6 / rate:6.1f} us/step"
                f"  {rate / base:5.3f}x without  {1e6 / rate - 1e6 / base:+7.1f} us/step"
                f"  (rounds {low:,.0f}..{high:,.0f})"
            )
        paired = [
            off / without
            for off, without in zip(rates["off", workload], rates["without", workload], strict=True)
        ]
        ratio = statistics.median(paired)
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        failed |= ratio < TARGET
        print(
            f"  off / without  {ratio:.3f} (the rounds' {min(paired):.3f}..{max(paired):.3f})"
            f"  target >= {TARGET}: {verdict}"
        )
        print(
            f"  on / without   {median['on'] / base:.3f}: on adds"
            f" {1e6 / median['on'] - 1e6 / base:.1f} us per step with a no-op SDK\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
