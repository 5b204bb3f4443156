"""Acceptance: an abort acknowledged as requested ends the run aborted, whoever holds it.

Across processes: a real process holds the run inside a slow phase — an ``fsm-runner
worker``, a sync ``Engine.run``, an async ``Engine.arun``, or ``fsm-runner agent-loop`` with an
agent that waits — while ``fsm-runner abort RUN --reason ...`` runs in another process, on a
SQLite file and on PostgreSQL. The abort command says the abort is requested, ``show`` shows the request while the
phase still runs, and once the phase returns (ignoring the abort: its handler never looks at
``ctx.cancelled``, and the holder's heartbeat is far off) the run ends aborted where it was: the
journal refuses the phase's outcome, so the holder carries out the abort instead of finishing
the run, and no later phase runs.

In one process, every route a step can take meets the same refusal: the sync hot path and the
general one (a timeout, a ``validate()``, a result with output), ``step``, ``work``,
``recover``, ``arun`` with and without group commit (and a group of runs committed together),
``astep``, an interruption, and a run due to be parked.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fsm_runner import (
    Engine,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    RunOutcome,
    RunRecord,
    State,
    Transition,
    open_journal,
)
from fsm_runner.engine import abort_run
from fsm_runner.events import RunEvent
from tests.abort_app import SPEC

ROOT = Path(__file__).parents[1]
APP = "tests.abort_app:make_engine"
TIMEOUT = 60.0  # seconds any one wait may take before the test gives up (never reached when green)
USER_ABORTED = RunEvent.USER_ABORTED.value
T = TypeVar("T")

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "SIGKILL"), reason="needs POSIX processes and pipes"
)


def fsm_runner() -> list[str]:
    """The installed ``fsm-runner`` console script, or the CLI module through this Python."""
    beside = Path(sys.executable).with_name("fsm-runner")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "fsm_runner.cli"]


def environment(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def wait_for(check: Callable[[], T | None], what: str, *, poll: float = 0.02) -> T:
    """Call ``check`` until it returns something true; return that."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {TIMEOUT:.0f} s waiting for {what}")
        time.sleep(poll)


def cli(location: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``fsm-runner --journal LOCATION ARGS...`` in a process of its own."""
    return subprocess.run(
        [*fsm_runner(), "--journal", location, *args],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


@pytest.fixture(params=["sqlite", "postgres"])
def location(request, tmp_path) -> str:
    """Where the test's journal is: a SQLite file, or a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        return str(tmp_path / "journal.db")
    server = request.getfixturevalue("postgres_server")
    schema = request.getfixturevalue("postgres_schema")
    url = server.url
    return f"{url}{'&' if '?' in url else '?'}schema={urllib.parse.quote(schema)}"


class Holder:
    """A process holding a run of ``tests.abort_app`` inside its ``working`` phase."""

    def __init__(self, command: list[str], tmp_path: Path, **env: str) -> None:
        self.log = tmp_path / "handlers.log"
        self.log.touch()
        self.entered_read, self.entered_write = os.pipe()
        self.hold_read, self.hold_write = os.pipe()
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment(
                FSM_ABORT_LOG=str(self.log),
                FSM_ABORT_ENTERED_FD=str(self.entered_write),
                FSM_ABORT_HOLD_FD=str(self.hold_read),
                **env,
            ),
            pass_fds=(self.entered_write, self.hold_read),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(self.entered_write)
        os.close(self.hold_read)

    def wait_inside(self) -> None:
        """Wait until ``working`` runs (its byte on the pipe), or fail with the process's output."""
        ready, _, _ = select.select([self.entered_read], [], [], TIMEOUT)
        if not ready or not os.read(self.entered_read, 1):
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the holder never entered its phase:\n{out}\n{err}")

    def let_go(self) -> tuple[int, str, str]:
        """Let ``working`` return; the holder's exit code and output once it ends."""
        os.close(self.hold_write)
        self.hold_write = -1
        out, err = self.proc.communicate(timeout=TIMEOUT)
        return self.proc.returncode, out, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()
        for fd in (self.entered_read, self.hold_write):
            if fd >= 0:
                os.close(fd)


@pytest.fixture
def holders(tmp_path) -> Iterator[Callable[..., Holder]]:
    made: list[Holder] = []

    def spawn(command: list[str], **env: str) -> Holder:
        holder = Holder(command, tmp_path, **env)
        made.append(holder)
        return holder

    yield spawn
    for holder in made:
        holder.close()


def start_run(location: str) -> str:
    journal = open_journal(location)
    try:
        engine = Engine(SPEC, handlers={"working": str, "finishing": str}, journal=journal)
        return engine.start()
    finally:
        journal.close()


def request_abort(location: str, run_id: str, reason: str) -> None:
    """``fsm-runner abort`` says the abort is requested, and ``show`` shows the request."""
    aborted = cli(location, "abort", run_id, "--reason", reason)
    assert aborted.returncode == 0, aborted.stderr
    assert "abort requested;" in aborted.stdout
    assert "which holds the run, carries it out at its next step" in aborted.stdout
    shown = cli(location, "show", run_id)
    assert shown.returncode == 0, shown.stderr
    assert f"requested: {reason}" in shown.stdout
    assert "(active)" in shown.stdout


def assert_aborted_in(location: str, run_id: str, state: str, reason: str) -> dict[str, Any]:
    """The run ended aborted through USER_ABORTED from ``state``, with ``reason`` shown."""
    journal = open_journal(location)
    try:
        run = journal.load(run_id)
        transitions = journal.transitions(run_id)
    finally:
        journal.close()
    assert (run.state, run.status, run.abort_reason) == ("canceled", RunOutcome.ABORTED, None)
    last = transitions[-1]
    assert (last.from_state, last.event, last.to_state) == (state, USER_ABORTED, "canceled")
    assert last.result == {"error": {"type": USER_ABORTED, "message": reason}}
    shown = cli(location, "show", run_id)
    assert "aborted" in shown.stdout
    assert reason in shown.stdout
    assert "requested:" not in shown.stdout  # carried out: no longer pending
    return {"events": [t.event for t in transitions]}


HOLDERS = {
    "worker": lambda location, run_id: [
        *fsm_runner(), "--journal", location, "worker", "--app", APP, "--max-runs", "1",
    ],
    "run": lambda location, run_id: [sys.executable, "-m", "tests.abort_app", "run", location, run_id],
    "arun": lambda location, run_id: [
        sys.executable, "-m", "tests.abort_app", "arun", location, run_id,
    ],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(HOLDERS))
def test_an_acknowledged_abort_ends_the_held_run_aborted(kind, location, holders):
    run_id = start_run(location)
    env = {"FSM_ABORT_ASYNC": "1"} if kind == "arun" else {}
    holder = holders(HOLDERS[kind](location, run_id), **env)
    holder.wait_inside()

    request_abort(location, run_id, "no longer needed")

    code, out, err = holder.let_go()
    assert code == 0, f"{out}\n{err}"
    found = assert_aborted_in(location, run_id, "working", "no longer needed")
    assert found["events"] == ["STARTED", USER_ABORTED]  # the phase's DONE was refused
    assert holder.log.read_text() == ""  # and no later phase ran
    if kind == "worker":
        assert "--USER_ABORTED--> canceled" in out
    else:
        assert '"status": "aborted"' in out


def git_workspace(path: Path) -> Path:
    path.mkdir()
    (path / "README").write_text("a project\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "start"]):
        subprocess.run([*git, *args], cwd=path, check=True, capture_output=True)
    return path


@pytest.mark.slow
def test_an_acknowledged_abort_ends_an_agent_loop_run_aborted(location, tmp_path):
    workspace = git_workspace(tmp_path / "work")
    entered, hold = tmp_path / "entered", tmp_path / "hold.fifo"
    os.mkfifo(hold)
    # The agent says it runs, then waits until the test writes to (and closes) the fifo.
    agent = f"touch {entered} && cat {hold} > /dev/null && echo changed >> README"
    loop = subprocess.Popen(
        [
            *fsm_runner(), "--journal", location, "agent-loop", "--workspace", str(workspace),
            "--agent", agent, "--task", "change the README", "--verify", "L0=true",
        ],
        cwd=ROOT, env=environment(), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(entered.exists, "the agent to start")
        journal = open_journal(location)
        try:
            (run,) = journal.runs()
        finally:
            journal.close()
        assert run.state == "building"

        request_abort(location, run.run_id, "stop the agent loop")

        def open_hold() -> int | None:  # once the agent's cat reads it (never blocks)
            try:
                return os.open(hold, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                return None

        os.close(wait_for(open_hold, "the agent to wait"))  # its cat reads to end-of-file
        out, err = loop.communicate(timeout=TIMEOUT)
    finally:
        if loop.poll() is None:
            loop.kill()
            loop.communicate()
    assert loop.returncode == 1, f"{out}\n{err}"  # the run ended aborted
    assert f"run {run.run_id} is aborted in state 'canceled'" in out
    found = assert_aborted_in(location, run.run_id, "building", "stop the agent loop")
    assert found["events"] == ["STARTED", "RUN_ACCEPTED", USER_ABORTED]


# -- every route of a step, in one process ------------------------------------------------------


def route_spec(*, timeout: float | None = None) -> MachineSpec:
    return MachineSpec(
        "abort-routes",
        [
            State("working", handler="working", timeout=timeout),
            State("finishing", handler="finishing"),
            State("done", terminal=True),
            State("canceled", terminal=True, outcome="aborted"),
        ],
        [
            Transition("working", "DONE", "finishing"),
            Transition("finishing", "DONE", "done"),
            Transition("*", USER_ABORTED, "canceled"),
        ],
    )


class Validated:
    """A handler with validate(): it takes the general path."""

    def __init__(self, run: Callable[[PhaseContext], Any]) -> None:
        self.run = run

    def validate(self, ctx: PhaseContext) -> None:
        return None


def route_engine(
    journal, route: str, calls: list[str], *, aborting: Container[str] | None = None
) -> Engine:
    """An engine whose ``working`` phase requests an abort "from elsewhere" and ignores it.

    Only in the runs ``aborting`` holds, when given.
    """

    def requested(ctx: PhaseContext) -> None:
        calls.append(ctx.state)
        if aborting is None or ctx.run_id in aborting:
            # behind the engine's back, as another process would
            journal.request_abort(ctx.run_id, "stop it")

    def bare(ctx: PhaseContext) -> str:
        requested(ctx)
        return "DONE"

    def with_output(ctx: PhaseContext) -> PhaseResult:
        requested(ctx)
        return PhaseResult("DONE", output={"made": 1}, context={"k": 1})

    async def coroutine(ctx: PhaseContext) -> str:
        requested(ctx)
        await asyncio.sleep(0)  # the phases of runs driven together end in one turn
        return "DONE"

    def interrupted(ctx: PhaseContext) -> str:
        requested(ctx)
        raise KeyboardInterrupt

    working: Any = {
        "bare": bare,
        "output": with_output,
        "timeout": bare,
        "validate": Validated(bare),
        "async": coroutine,
        "interrupt": interrupted,
    }[route]
    return Engine(
        route_spec(timeout=600.0 if route == "timeout" else None),
        handlers={"working": working, "finishing": lambda ctx: calls.append(ctx.state) or "DONE"},
        journal=journal,
        heartbeat_interval=600.0,  # the request must not come through the heartbeat
    )


def assert_aborted_while_working(journal, run_id: str, calls: list[str]) -> None:
    run = journal.load(run_id)
    assert (run.state, run.status, run.abort_reason) == ("canceled", RunOutcome.ABORTED, None)
    assert [(t.from_state, t.event, t.to_state) for t in journal.transitions(run_id)] == [
        (None, "STARTED", "working"),
        ("working", USER_ABORTED, "canceled"),
    ]
    assert run.error == {"type": USER_ABORTED, "message": "stop it"}
    assert calls == ["working"]  # the phase after it never ran


DRIVERS: dict[str, Callable[[Engine, str], Any]] = {
    "run": lambda engine, run_id: engine.run(run_id),
    "step": lambda engine, run_id: engine.step(run_id),
    "work": lambda engine, run_id: engine.work(max_runs=1, exit_when_idle=True),
    "recover": lambda engine, run_id: (
        engine.journal.claim(run_id, "gone:1:x", ttl=-1),  # its worker was lost
        engine.recover(),
    ),
    "arun": lambda engine, run_id: asyncio.run(engine.arun(run_id)),
    "astep": lambda engine, run_id: asyncio.run(engine.astep(run_id)),
}


@pytest.mark.parametrize(
    ("driver", "route"),
    [
        *[
            (driver, route)
            for driver in ("run", "step", "work", "recover")
            for route in ("bare", "output")
        ],
        ("run", "timeout"),
        ("run", "validate"),
        *[
            (driver, route)
            for driver in ("arun", "arun-one-commit-a-step", "astep")
            for route in ("bare", "output", "async", "timeout")
        ],
    ],
)
def test_every_route_of_a_step_ends_aborted_where_the_abort_found_it(journal, driver, route):
    calls: list[str] = []
    engine = route_engine(journal, route, calls)
    if driver == "arun-one-commit-a-step":
        engine.group_commit = False
    run_id = engine.start()
    try:
        DRIVERS["arun" if driver == "arun-one-commit-a-step" else driver](engine, run_id)
    finally:
        engine.close()
    assert_aborted_while_working(journal, run_id, calls)


@pytest.mark.parametrize("driver", ["run", "arun"])
def test_an_interrupted_phase_carries_out_the_abort_requested_meanwhile(journal, driver):
    calls: list[str] = []
    engine = route_engine(journal, "interrupt", calls)
    run_id = engine.start()
    with pytest.raises(KeyboardInterrupt):
        DRIVERS[driver](engine, run_id)
    engine.close()
    assert_aborted_while_working(journal, run_id, calls)


def test_a_run_due_to_be_parked_is_aborted_as_requested(journal):
    calls: list[str] = []
    engine = route_engine(journal, "bare", calls)
    engine.max_recoveries = 0
    run_id = engine.start()
    journal.claim(run_id, "gone:1:x", ttl=-1)  # its worker was lost: the next claim parks it
    journal.request_abort(run_id, "stop it")
    assert engine.work(max_runs=1, exit_when_idle=True) == 1
    engine.close()
    run = journal.load(run_id)
    assert (run.state, run.status, run.recoveries) == ("canceled", RunOutcome.ABORTED, 1)
    assert calls == []


def test_abort_moves_the_run_itself_when_its_holder_lets_go_meanwhile(journal):
    """The holder releases between the abort's refused claim and its request: nobody would
    carry the request out, so the abort does it at once instead of saying it is requested."""
    engine = route_engine(journal, "bare", [])
    run_id = engine.start()
    held = journal.claim(run_id, "holder", ttl=600)
    request = journal.request_abort

    def request_as_the_holder_lets_go(run_id: str, reason: str) -> RunRecord:
        journal.release(run_id, "holder", held.lease_token)
        return request(run_id, reason)

    journal.request_abort = request_as_the_holder_lets_go  # the interleaving, on the real journal
    try:
        run = abort_run(journal, run_id, "stop it")
    finally:
        del journal.request_abort
    assert (run.state, run.status, run.lease_owner) == ("canceled", RunOutcome.ABORTED, None)
    assert journal.load(run_id) == run


def test_group_commit_refuses_only_the_run_whose_abort_was_requested(journal):
    """Runs whose phases end in one turn share a transaction; the aborted one alone is refused."""
    calls: list[str] = []
    aborting: set[str] = set()
    engine = route_engine(journal, "async", calls, aborting=aborting)
    aborted = engine.start()
    aborting.add(aborted)
    others = [engine.start() for _ in range(3)]

    async def drive() -> list[RunRecord]:
        return await asyncio.gather(*(engine.arun(run_id) for run_id in [aborted, *others]))

    ended = asyncio.run(drive())
    engine.close()
    assert [(run.state, run.status) for run in ended] == [
        ("canceled", RunOutcome.ABORTED),
        *[("done", RunOutcome.SUCCEEDED)] * 3,
    ]
    assert [t.event for t in journal.transitions(aborted)] == ["STARTED", USER_ABORTED]


@pytest.mark.parametrize("held", [True, False], ids=["held", "not-held"])
def test_a_reason_with_a_lone_surrogate_is_stored_escaped(journal, held):
    """A reason from an argv byte that is not UTF-8 (a lone surrogate) is kept, escaped."""
    engine = route_engine(journal, "bare", [])
    run_id = engine.start()
    if held:
        journal.claim(run_id, "holder", ttl=600)
    run = abort_run(journal, run_id, "stop \udcff now")
    expected = "stop \\udcff now"
    if held:
        assert (run.status, run.abort_reason) == (RunOutcome.ACTIVE, expected)
    else:
        assert (run.state, run.status) == ("canceled", RunOutcome.ABORTED)
        assert journal.transitions(run_id)[-1].result["error"]["message"] == expected
    engine.close()


@pytest.mark.slow
def test_the_cli_takes_a_reason_that_is_not_utf8(tmp_path):
    location = str(tmp_path / "journal.db")
    run_id = start_run(location)
    aborted = subprocess.run(
        [*fsm_runner(), "--journal", location, "abort", run_id, "--reason", b"bad \xff byte"],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert aborted.returncode == 0, aborted.stderr
    assert b"Traceback" not in aborted.stderr
    journal = open_journal(location)
    try:
        run = journal.load(run_id)
        assert run.status is RunOutcome.ABORTED
        assert journal.transitions(run_id)[-1].result["error"]["message"] == "bad \\udcff byte"
    finally:
        journal.close()
