"""A fresh process's fixed cost: from process start to the first handler call of a resumed run.

Run from the repository root::

    python tests/bench/bench_fresh_process.py [--rounds 15] [--instructions]

Every CLI command, worker process and resumed run pays it, and so do the test suite's many
subprocesses (issue 20). A child ``python`` resumes a run of a 4-phase machine stopped after
its first phase, on a real SQLite file, and notes the time after each stage: the imports
(``fsm_runner``, ``Engine``, ``SqliteJournal``, the spec classes), building the spec, opening
the journal, ``Engine(...)`` (validation, hash, compiled machine), and ``resume`` up to the
first handler call (the first load with its cattrs code generation, the claim). Against it, in
the same interleaved rounds: ``python -c pass`` (the interpreter's own start-up, the floor),
``python -c "import fsm_runner"`` and ``fsm-runner --help``. Medians of ``--rounds`` rounds.

Two settings: **bytecode cached** (what an installed package costs: ``PYTHONDONTWRITEBYTECODE``
dropped and ``PYTHONPYCACHEPREFIX`` a temporary directory, warmed once) and, when the
environment sets ``PYTHONDONTWRITEBYTECODE``, **as the environment is** (fsm_runner's sources,
having no ``__pycache__``, are compiled by every process: the suite's subprocesses pay this).

``--instructions`` also counts each stage's instructions under valgrind's callgrind
(deterministic on a noisy machine; bytecode cached; ~1 min). No target: figures only.
"""

from __future__ import annotations

import argparse
import itertools
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

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition  # noqa: E402

STAGES = [
    "interpreter start-up",
    "imports",
    "spec",
    "open journal",
    "Engine(...)",
    "resume → first handler",
]
#: Modules a sync resume does not need; the child reports which of them it holds.
HEAVY = ("asyncio", "cattrs", "transitions", "sqlite_utils", "click", "psycopg", "ssl")

CHILD = """
import time
marks = [time.time()]
import sys
STOP = int(sys.argv[3]) if len(sys.argv) > 3 else 99
from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition
marks.append(time.time())
if STOP <= 1: raise SystemExit(0)
PHASES = ["a", "b", "c", "d"]
SPEC = MachineSpec(
    "bench-fresh",
    [*(State(n, handler="noop") for n in PHASES), State("done", terminal=True)],
    [Transition(n, "NEXT", m) for n, m in zip(PHASES, [*PHASES[1:], "done"], strict=True)],
)
marks.append(time.time())
if STOP <= 2: raise SystemExit(0)
journal = SqliteJournal(sys.argv[1], create=False)
marks.append(time.time())
if STOP <= 3: raise SystemExit(0)
def first(ctx):
    marks.append(time.time())
    heavy = [m for m in {heavy!r} if m in sys.modules]
    print(" ".join(map(repr, marks)), ",".join(heavy) or "-", flush=True)
    raise SystemExit(0)
engine = Engine(SPEC, handlers={{"noop": first}}, journal=journal)
marks.append(time.time())
if STOP <= 4: raise SystemExit(0)
engine.resume(sys.argv[2])
"""


def prepare(directory: Path) -> tuple[Path, str]:
    """A journal with one run of the child's machine stopped after its first phase."""
    phases = ["a", "b", "c", "d"]
    spec = MachineSpec(
        "bench-fresh",
        [*(State(n, handler="noop") for n in phases), State("done", terminal=True)],
        [Transition(n, "NEXT", m) for n, m in zip(phases, [*phases[1:], "done"], strict=True)],
    )
    path = directory / "journal.db"
    with SqliteJournal(path) as journal:
        engine = Engine(spec, handlers={"noop": lambda _ctx: "NEXT"}, journal=journal)
        for _ in range(100):  # a few more runs than one, as a worker's file would hold
            engine.run(engine.start(), max_steps=1)
        run_id = engine.start()
        engine.run(run_id, max_steps=1)
        engine.close()
    return path, run_id


def cached_env(directory: Path) -> dict[str, str]:
    """The environment with bytecode written to (and read from) a private cache."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONPYCACHEPREFIX": str(directory)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def wall_ms(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    return (time.perf_counter() - started) * 1000


def resume(child: list[str], env: dict[str, str]) -> tuple[list[float], str]:
    """Each stage's milliseconds (the first from the process's start), and the heavy modules."""
    started = time.time()
    out = subprocess.run(child, check=True, capture_output=True, text=True, env=env).stdout
    fields = out.split()
    marks = [started, *map(float, fields[:-1])]  # spawn, the child's first line, each stage
    return [(b - a) * 1000 for a, b in itertools.pairwise(marks)], fields[-1]


def instructions(child: list[str], env: dict[str, str], directory: Path) -> list[int]:
    """Callgrind's instruction count of ``pass``, then of the child stopped after each stage."""
    counts = []
    for stop in range(len(STAGES)):
        command = [sys.executable, "-c", "pass"] if stop == 0 else [*child, str(stop)]
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={directory / f'cg.{stop}'}",
                *command,
            ],
            capture_output=True,
            text=True,
            env={**env, "PYTHONHASHSEED": "0"},
            check=False,
        )
        match = re.search(r"Collected : (\d+)", done.stderr)
        if match is None:
            raise RuntimeError(f"callgrind said: {done.stderr[-500:]}")
        counts.append(int(match.group(1)))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--instructions", action="store_true")
    args = parser.parse_args()
    script = shutil.which("fsm-runner") or str(Path(sys.executable).with_name("fsm-runner"))
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores; "
        f"{args.rounds} interleaved rounds, medians\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path, run_id = prepare(directory)
        code = CHILD.format(heavy=HEAVY)
        child = [sys.executable, "-c", code, str(path), run_id]
        settings = {"bytecode cached": cached_env(directory / "pycache")}
        if os.environ.get("PYTHONDONTWRITEBYTECODE"):
            settings["as the environment is (no bytecode written)"] = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
            }
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import fsm_runner": [sys.executable, "-c", "import fsm_runner"],
            "fsm-runner --help": [script, "--help"],
        }
        for env in settings.values():  # warm: caches written, files read once
            resume(child, env)
            for command in commands.values():
                wall_ms(command, env)
        walls: dict[tuple[str, str], list[float]] = {}
        stages: dict[str, list[list[float]]] = {name: [] for name in settings}
        heavy = {}
        for _ in range(args.rounds):
            for name, env in settings.items():
                for label, command in commands.items():
                    walls.setdefault((name, label), []).append(wall_ms(command, env))
                times, heavy[name] = resume(child, env)
                stages[name].append(times)
        for name in settings:
            floor = statistics.median(walls[name, "python -c pass"])
            medians = [statistics.median(column) for column in zip(*stages[name], strict=True)]
            total = sum(medians)
            print(f"{name}:")
            print(
                f"  resume in a fresh process    {total:6.1f} ms to the first handler call"
                f"   {total / floor:4.1f}x python -c pass; {total - floor:5.1f} ms over it"
            )
            for stage, ms in zip(STAGES, medians, strict=True):
                print(f"    {stage:<26} {ms:6.1f} ms")
            for label in commands:
                ms = statistics.median(walls[name, label])
                print(f"  {label:<28} {ms:6.1f} ms   {ms / floor:4.1f}x")
            print(f"  heavy modules held at the handler: {heavy[name]}\n")
        if args.instructions:
            if shutil.which("valgrind") is None:
                print("--instructions: valgrind not found")
                return 0
            counts = instructions(child, settings["bytecode cached"], directory)
            print("instructions (callgrind, bytecode cached):")
            print(f"  python -c pass               {counts[0]:>13,}")
            for stage, (before, after) in zip(STAGES[1:], itertools.pairwise(counts), strict=True):
                print(f"    {stage:<26} {after - before:>+13,}")
            print(
                f"  resume in a fresh process    {counts[-1]:>13,}   "
                f"{counts[-1] / counts[0]:.2f}x python -c pass"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
