"""What a fresh process imports to resume a run (issue 20): only what a sync run needs.

Every CLI command, worker and resumed run pays its imports before its first phase, and so do
the suite's own subprocesses. A real process resumes a run of a real SQLite file to its first
handler call and says which modules it holds then; ``bench_fresh_process.py`` has the timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_runner import Engine, SqliteJournal
from fsm_runner._lazy import LazyModule
from tests.helpers import NEXT, linear_spec

ROOT = Path(__file__).resolve().parents[1]

#: Modules a sync resume on a SQLite file never needs: asyncio (and what only it brings:
#: ssl, concurrent.futures, subprocess), the in-memory journal, sqlite-utils (migrations
#: only), psycopg, click (the CLI), the run inspector's web stack.
NOT_IMPORTED = (
    "asyncio",
    "concurrent.futures",
    "ssl",
    # attrs imports platform, which imports subprocess at once on Python 3.10 (lazily from 3.11)
    *(("subprocess",) if sys.version_info >= (3, 11) else ()),
    "fsm_runner.journal.memory",
    "fsm_runner.journal.postgres",
    "sqlite_utils",
    "psycopg",
    "click",
    "starlette",
    "jinja2",
)

RESUME = """
import json, sys
from fsm_runner import Engine, SqliteJournal
from fsm_runner._lazy import LazyModule
from tests.helpers import NEXT, linear_spec

def first(ctx):
    print(json.dumps(sorted(sys.modules)))
    raise SystemExit(0)

spec = linear_spec("a", "b", "c", name="fresh")
with SqliteJournal(sys.argv[1], create=False) as journal:
    Engine(spec, handlers=dict.fromkeys("abc", first), journal=journal).resume(sys.argv[2])
"""

#: The same run finished by ``arun``, with an async handler that waits (the engine's group
#: committer and claimer, the deadline helper and the default ``async_sleep`` all use asyncio).
ARESUME = """
import asyncio, json, sys
import attrs
from fsm_runner import Engine, MachineSpec, RetryPolicy, SqliteJournal
from tests.helpers import NEXT, linear_spec

calls = []

async def step(ctx):
    calls.append(ctx.state)
    await asyncio.sleep(0)
    if len(calls) == 1:
        raise RuntimeError("once")  # retried after async_sleep
    return NEXT

base = linear_spec("a", "b", "c", name="fresh")
retried = RetryPolicy(wait_initial=0.001)
states = [attrs.evolve(s, retry=retried, timeout=60.0) if s.handler else s for s in base.states]
spec = MachineSpec(base.name, states, base.transitions)
with SqliteJournal(sys.argv[1], create=False) as journal:
    engine = Engine(
        spec, handlers=dict.fromkeys("abc", step), journal=journal, allow_spec_change=True
    )
    run = asyncio.run(engine.aresume(sys.argv[2]))
    engine.close()
assert run.state == "done" and calls == ["b", "b", "c"], (run, calls)
print(json.dumps(sorted(sys.modules)))
"""


def modules_of(code: str, *args: str) -> set[str]:
    """The modules a fresh ``python -c code`` holds at the point it prints them."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.fixture
def stopped_run(tmp_path):
    """A SQLite journal with a run stopped after its first phase, and the run's id."""
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        engine = Engine(
            linear_spec("a", "b", "c", name="fresh"),
            handlers=dict.fromkeys("abc", lambda _ctx: NEXT),
            journal=journal,
        )
        run_id = engine.start()
        engine.run(run_id, max_steps=1)
        engine.close()
    return path, run_id


class TestFreshProcess:
    """A fresh process imports only what its path needs."""

    def test_resume_to_the_first_handler_imports_no_async_or_optional_module(self, stopped_run):
        path, run_id = stopped_run
        loaded = modules_of(RESUME, str(path), run_id)
        assert "fsm_runner.engine" in loaded  # the process did get to the handler
        assert "fsm_runner.journal.sqlite" in loaded
        for name in NOT_IMPORTED:
            assert name not in loaded, f"resuming a run imports {name}"

    def test_import_of_the_public_names_imports_no_async_module(self):
        code = (
            "import json, sys\nfrom fsm_runner import Engine, MachineSpec, SqliteJournal, State\n"
            "print(json.dumps(sorted(sys.modules)))"
        )
        loaded = modules_of(code)
        for name in NOT_IMPORTED:
            assert name not in loaded, f"`from fsm_runner import Engine, ...` imports {name}"

    def test_an_async_run_in_a_fresh_process_imports_asyncio_when_it_runs(self, stopped_run):
        """The engine's modules bind asyncio on first use: an async run works from scratch."""
        path, run_id = stopped_run
        loaded = modules_of(ARESUME, str(path), run_id)
        assert "asyncio" in loaded

    def test_memory_journal_is_still_a_public_name(self):
        import fsm_runner.journal

        assert "MemoryJournal" in dir(fsm_runner.journal)
        assert fsm_runner.journal.MemoryJournal.__module__ == "fsm_runner.journal.memory"
        assert type(fsm_runner.journal.open_journal(":memory:")).__name__ == "MemoryJournal"

    def test_a_lazy_module_puts_the_module_in_its_place_on_first_use(self):
        namespace: dict = {}
        namespace["json"] = LazyModule("json", namespace)
        assert "imported on first use" in repr(namespace["json"])
        assert namespace["json"].dumps([1]) == "[1]"
        assert namespace["json"] is json
