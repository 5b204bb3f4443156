"""Specs of 1,000, 4,000 and 10,000 states: what each path costs, against the 1,000-state one.

Run from the repository root::

    python tests/bench/bench_big_spec.py [--sizes 1000,4000,10000] [--repeat 3] [--only dot,svg]

Builds machines shaped like long real ones (``tests/big_specs.py``: chains whose failures go back
three states while a guard allows it, a wildcard ``CANCEL``, every fifth block a composite of
sub-phases with a nested one and a ``RETURN`` from a recovery state), each measurement on a
fresh spec (its cached answers not yet found) with the compile cache emptied, and times:
``validate()``; ``compile_spec`` (which validates, then builds the ``transitions`` machine: the
figure that "validates and compiles"); the ``transitions`` machine alone, built as
``compile_spec`` builds it; ``Engine(...)`` on a memory journal; ``start`` and five steps;
DOT and Mermaid text (``diagrams.render``); the inspector's drawing
(``render_svg(extract(spec))``). Prints the median of ``--repeat`` rounds (sizes interleaved in
each round) and each figure's ratio to the 1,000-state one (linear growth reads ~10x at
10,000), then the targets at 10,000 states -- validate + compile < 1 s, DOT and Mermaid < 2 s
each -- as PASS/FAIL, and exits 1 on a miss. A path slower than ``--max-seconds`` at one size
is not run at the larger ones (for the quadratic code of before: ``PYTHONPATH=<old
checkout>`` measures it, this file's directory being looked up after it).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: another checkout's fsm_runner may be measured

import transitions  # noqa: E402 - after the path set-up

from fsm_runner import Engine, MachineSpec, MemoryJournal, diagrams  # noqa: E402
from fsm_runner import machine as machine_module  # noqa: E402
from fsm_runner.machine import compile_spec  # noqa: E402
from fsm_runner.spec import RETURN  # noqa: E402
from fsm_runner.ui.svg import render_svg  # noqa: E402
from tests.big_specs import big_handlers, big_spec  # noqa: E402

TARGET_COMPILE_S = 1.0
TARGET_DRAW_S = 2.0
TARGET_SIZE = 10_000

HANDLERS = big_handlers()
GUARDS = {"retries_left": lambda _run: True}


def bare_transitions(spec: MachineSpec) -> object:
    """The ``transitions`` machine alone, built as ``compile_spec`` builds it."""
    built = transitions.Machine(
        model=None,
        states=[state.name for state in spec.leaves],
        initial=spec.initial_leaf,
        auto_transitions=False,
        name=spec.name,
    )
    for (source, event), candidates in spec.edges.items():
        for candidate in candidates:
            built.add_transition(
                event,
                source,
                None if candidate.dest == RETURN else candidate.dest,
                conditions=list(candidate.guards),
                unless=list(candidate.unless),
            )
    return built


def engine(spec: MachineSpec) -> Engine:
    return Engine(spec, handlers=HANDLERS, guards=GUARDS, journal=MemoryJournal())


#: name -> (what is timed, given a fresh spec; what is done first, untimed)
PATHS: dict[str, tuple[Callable[[MachineSpec], object], Callable[[MachineSpec], object]]] = {
    "validate": (MachineSpec.validate, lambda _spec: None),
    "compile": (compile_spec, lambda _spec: None),
    "transitions": (bare_transitions, lambda spec: (spec.edges, spec.leaves)),
    "engine": (engine, lambda _spec: None),
    # the engine built first, untimed: then start and five steps
    "steps": (lambda e: e.run(e.start({}), max_steps=5), engine),  # type: ignore[attr-defined]
    "dot": (lambda spec: diagrams.render(spec, format="dot"), MachineSpec.validate),
    "mermaid": (lambda spec: diagrams.render(spec, format="mermaid"), MachineSpec.validate),
    "svg": (lambda spec: render_svg(diagrams.extract(spec)), MachineSpec.validate),
}


def measure(name: str, size: int) -> float:
    """Seconds ``name`` takes on a fresh spec of ``size`` states, the compile cache emptied."""
    timed, prepare = PATHS[name]
    spec = big_spec(size)
    machine_module._cache.clear()
    subject = prepare(spec)
    if name != "steps":
        subject = spec
    gc.collect()
    started = time.perf_counter()
    timed(subject)  # type: ignore[arg-type]
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,4000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default=",".join(PATHS), help="paths, comma-separated")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    names = [name for name in args.only.split(",") if name]
    print(
        f"python {platform.python_version()}, {os.cpu_count()} cores, load"
        f" {os.getloadavg()[0]:.2f}; fsm_runner from {Path(machine_module.__file__).parents[1]}"
    )
    for size in sizes:
        spec = big_spec(size)
        print(
            f"{size:>6} asked: {len(spec.leaves)} states a run can be in,"
            f" {len(spec.transitions)} transitions, {len(spec.edges)} (state, event) pairs"
        )
    times: dict[tuple[str, int], list[float]] = {}
    skipped: set[tuple[str, int]] = set()
    for _round in range(args.repeat):
        for name in names:
            for size in sizes:
                if (name, size) in skipped:
                    continue
                took = measure(name, size)
                times.setdefault((name, size), []).append(took)
                if took > args.max_seconds:  # the larger sizes would take far longer
                    skipped.update((name, bigger) for bigger in sizes if bigger > size)
    base = sizes[0]
    print(f"\nmedian of {args.repeat} rounds, seconds (x: the ratio to {base:,} states)")
    print(f"{'path':<12}" + "".join(f"{size:>20,}" for size in sizes))
    medians = {key: statistics.median(found) for key, found in times.items()}
    for name in names:
        row = f"{name:<12}"
        for size in sizes:
            if (name, size) not in medians:
                row += f"{'skipped':>20}"
                continue
            ratio = medians[(name, size)] / medians[(name, base)]
            row += f"{medians[(name, size)]:>11.3f} ({ratio:>5.1f}x)"
        print(row)
    return targets(medians)


def targets(medians: dict[tuple[str, int], float]) -> int:
    """Print the targets at 10,000 states as PASS/FAIL; 1 if one is missed (or not measured)."""
    missed = 0
    print()
    for name, limit in (
        ("compile", TARGET_COMPILE_S),
        ("dot", TARGET_DRAW_S),
        ("mermaid", TARGET_DRAW_S),
    ):
        found = medians.get((name, TARGET_SIZE))
        what = "validate + compile" if name == "compile" else f"{name} drawing"
        if found is None:
            print(f"{what} at {TARGET_SIZE:,} states: not measured (target < {limit:g} s)")
            continue
        ok = found < limit
        missed += not ok
        print(
            f"{'PASS' if ok else 'FAIL'}  {what} at {TARGET_SIZE:,} states: {found:.3f} s (target < {limit:g} s)"
        )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
