"""Abort: ``Engine.abort``, ``fsm-runner abort``, ``USER_ABORTED`` and the abort fence, in one place.

Across processes (the acceptance test, ``TestAbortAcrossProcesses``): a real process holds the
run inside a slow phase — an ``fsm-runner worker``, a sync ``Engine.run``, an async
``Engine.arun``, or ``fsm-runner agent-loop`` with an agent that waits — while ``fsm-runner abort
RUN --reason ...`` runs in another process, on a SQLite file and on PostgreSQL. The abort command
says the abort is requested, ``show`` shows the request while the phase still runs, and once the
phase returns (ignoring the abort: its handler never looks at ``ctx.cancelled``, and the holder's
heartbeat is far off) the run ends aborted where it was: the journal refuses the phase's
outcome, so the holder carries out the abort instead of finishing the run, and no later phase
runs.

In one process: ``abort()`` from any non-terminal state and from inside a handler
(``TestAbortInProcess``); an abort requested of a run another writer holds, which the holder
carries out, and of a run nobody holds, done at once (``TestAbortFromElsewhere``); every route a
step can take meets the same refusal (``TestEveryRouteOfAStep``): the sync hot path and the
general one (a timeout, a ``validate()``, a result with output), ``step``, ``work``,
``recover``, ``arun`` with and without group commit (and a group of runs committed together),
``astep``, an interruption, and a run due to be parked; reasons that are not UTF-8
(``TestReasons``); and the ``abort`` command through click's CliRunner (``TestAbortCommand``).

Other modules' view of an abort is tested with them: the journal's fence in
``test_journal.py::TestAbort``, replay in ``test_replay.py::TestAborts`` (see tests/README.md).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
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
    RunLifecycle,
    RunRecord,
    RunTerminalError,
    SqliteJournal,
    State,
    Transition,
    open_journal,
)
from fsm_runner.engine import abort_run
from fsm_runner.events import RunEvent
from tests.abort_app import SPEC
from tests.helpers import (
    NEXT,
    handlers_for,
    linear_spec,
    no_exits_spec,
    noop,
    one_line_error,
    path_of,
    snapshot,
    start_release,
    two_phase_engine,
)

ROOT = Path(__file__).parents[1]
APP = "tests.abort_app:make_engine"
TIMEOUT = 60.0  # seconds any one wait may take before the test gives up (never reached when green)
USER_ABORTED = RunEvent.USER_ABORTED.value
T = TypeVar("T")

posix_processes = pytest.mark.skipif(
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
    assert (run.state, run.status, run.abort_reason) == ("canceled", RunLifecycle.ABORTED, None)
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


def git_workspace(path: Path) -> Path:
    path.mkdir()
    (path / "README").write_text("a project\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "start"]):
        subprocess.run([*git, *args], cwd=path, check=True, capture_output=True)
    return path


# -- across processes ---------------------------------------------------------------------------


@posix_processes
class TestAbortAcrossProcesses:
    """The acceptance test: a real process holds the run; `fsm-runner abort` runs in another."""

    @pytest.mark.slow
    @pytest.mark.parametrize("kind", sorted(HOLDERS))
    def test_an_acknowledged_abort_ends_the_held_run_aborted(self, kind, location, holders):
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

    @pytest.mark.slow
    def test_an_acknowledged_abort_ends_an_agent_loop_run_aborted(self, location, tmp_path):
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
        assert f"run {run.run_id} has ended (aborted) in state 'canceled'" in out
        found = assert_aborted_in(location, run.run_id, "building", "stop the agent loop")
        assert found["events"] == ["STARTED", "RUN_ACCEPTED", USER_ABORTED]


# -- in one process: Engine.abort ---------------------------------------------------------------


class TestAbortInProcess:
    """abort() from any non-terminal state; nothing journaled is removed."""

    def test_idle_run_moves_at_once_through_user_aborted(self, journal):
        seen = []
        engine = Engine(
            linear_spec("a", "b"),
            handlers=handlers_for("a", "b"),
            journal=journal,
            listeners=[lambda t, run: seen.append((t.event, run.status))],
        )
        run_id = engine.start()
        engine.step(run_id)
        history = journal.transitions(run_id)
        run = engine.abort(run_id, "operator said so")
        assert (run.state, run.status, run.seq) == ("canceled", RunLifecycle.ABORTED, 2)
        assert run == journal.load(run_id)
        transitions = journal.transitions(run_id)
        assert transitions[: len(history)] == history
        last = transitions[-1]
        assert (last.from_state, last.event, last.to_state) == ("b", USER_ABORTED, "canceled")
        assert last.result["error"]["message"] == "operator said so"
        assert seen[-1] == (USER_ABORTED, RunLifecycle.ABORTED)
        with pytest.raises(RunTerminalError):
            engine.resume(run_id)

    def test_without_user_aborted_transition_the_run_stays_put(self, journal):
        engine = Engine(no_exits_spec(), handlers={"a": noop, "b": noop}, journal=journal)
        run_id = engine.start()
        engine.step(run_id)
        run = engine.abort(run_id, "stop")
        assert (run.state, run.status) == ("b", RunLifecycle.ABORTED)
        last = journal.transitions(run_id)[-1]
        assert (last.from_state, last.event, last.to_state) == ("b", USER_ABORTED, "b")
        assert journal.load(run_id).status is RunLifecycle.ABORTED
        with pytest.raises(RunTerminalError) as info:
            engine.resume(run_id)
        assert info.value.status == "aborted"

    def test_ended_run_cannot_be_aborted(self, journal):
        engine = two_phase_engine(journal)
        run_id = engine.start()
        engine.run(run_id)
        before = snapshot(journal, run_id)
        with pytest.raises(RunTerminalError):
            engine.abort(run_id, "too late")
        assert snapshot(journal, run_id) == before

    def test_abort_from_inside_the_running_handler(self, journal):
        seen = {}
        holder = {}

        def phase(ctx):
            holder["engine"].abort(ctx.run_id, "stop")
            seen["cancelled"] = ctx.cancelled
            try:
                ctx.check()
            except Exception as exc:
                seen["check"] = type(exc).__name__
                raise
            return NEXT

        b_calls = []
        engine = two_phase_engine(journal, a=phase, b=lambda _ctx: b_calls.append(1) or NEXT)
        holder["engine"] = engine
        run_id = engine.start()
        run = engine.run(run_id)
        assert seen == {"cancelled": True, "check": "RunAbortedError"}
        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
        assert run.error["message"] == "stop"
        assert b_calls == []
        last = journal.transitions(run_id)[-1]
        assert (last.from_state, last.event, last.to_state) == ("a", USER_ABORTED, "canceled")
        assert last.result["error"]["message"] == "stop"
        assert journal.load(run_id) == run
        assert run.abort_reason is None

    def test_handler_ignoring_the_abort_ends_aborted_where_it_ran(self, journal):
        """Its outcome is not journaled (the journal refuses it): the abort is, from its state."""
        holder = {}
        calls = []

        def phase(ctx):
            calls.append(ctx.state)
            if ctx.state == "a":
                holder["engine"].abort(ctx.run_id, "enough")
            return NEXT

        engine = Engine(
            linear_spec("a", "b", "c"),
            handlers=handlers_for("a", "b", "c", a=phase, b=phase, c=phase),
            journal=journal,
        )
        holder["engine"] = engine
        run_id = engine.start()
        run = engine.run(run_id)
        assert calls == ["a"]
        assert path_of(journal, run_id) == [
            (None, "STARTED", "a"),
            ("a", USER_ABORTED, "canceled"),
        ]
        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)


# -- from elsewhere: a run another writer holds -------------------------------------------------


class TestAbortFromElsewhere:
    """An abort of a run another writer holds is only requested; the holder carries it out."""

    def test_an_abort_from_elsewhere_reaches_the_worker_holding_the_run(self, tmp_path):
        path = tmp_path / "journal.db"
        b_calls = []
        with SqliteJournal(path) as journal_a, SqliteJournal(path) as journal_ops:
            operator = Engine(
                linear_spec("a", "b"), handlers={"a": noop, "b": noop}, journal=journal_ops
            )

            def slow_a(ctx):
                requested = operator.abort(ctx.run_id, "operator")  # from "another process"
                assert requested.abort_reason == "operator"  # A holds the run: only requested
                assert requested.state == "a"
                ctx_deadline = time.monotonic() + 30
                while not ctx.cancelled and time.monotonic() < ctx_deadline:
                    time.sleep(0.005)  # A's heartbeat brings the request to its phase
                assert ctx.cancelled
                return NEXT

            engine_a = Engine(
                linear_spec("a", "b"),
                handlers={"a": slow_a, "b": lambda _ctx: b_calls.append(1) or NEXT},
                journal=journal_a,
                heartbeat_interval=0.01,
            )
            run_id = engine_a.start()
            run = engine_a.run(run_id)
            assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
            # the phase in progress was told and finished; the journal refused its outcome and
            # took the abort from its state instead, before b ran
            assert [(t.event, t.to_state) for t in journal_a.transitions(run_id)] == [
                ("STARTED", "a"),
                (USER_ABORTED, "canceled"),
            ]
            assert journal_a.load(run_id).abort_reason is None
        assert b_calls == []

    def test_a_run_nobody_holds_is_aborted_at_once(self, journal):
        engine = Engine(linear_spec("a", "b"), handlers={"a": noop, "b": noop}, journal=journal)
        run_id = engine.start()
        other = Engine(linear_spec("a", "b"), handlers={"a": noop, "b": noop}, journal=journal)
        run = other.abort(run_id, "not needed")
        assert (run.state, run.status, run.lease_owner) == ("canceled", RunLifecycle.ABORTED, None)

    def test_a_held_run_aborted_elsewhere_stops_at_its_next_step(self, journal):
        """The holder sees a request journaled by another writer through its heartbeat."""
        spec = linear_spec("a", "b")
        seen = threading.Event()

        def a_phase(ctx):
            journal.request_abort(ctx.run_id, "from elsewhere")
            deadline = time.monotonic() + 30
            while not ctx.cancelled and time.monotonic() < deadline:
                time.sleep(0.005)
            if ctx.cancelled:
                seen.set()
            return PhaseResult(NEXT)

        engine = Engine(
            spec, handlers={"a": a_phase, "b": noop}, journal=journal, heartbeat_interval=0.01
        )
        run = engine.run(engine.start())
        engine.close()
        assert seen.is_set()
        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)

    def test_abort_moves_the_run_itself_when_its_holder_lets_go_meanwhile(self, journal):
        """The holder releases between the abort's refused claim and its request: nobody would
        carry the request out, so the abort does it at once instead of saying it is requested."""
        engine = route_engine(journal, "bare", [])
        run_id = engine.start()
        held = journal.claim(run_id, "holder", ttl=600)
        request = journal.request_abort

        def request_as_the_holder_lets_go(run_id: str, reason: str) -> RunRecord:
            journal.release(run_id, "holder", held.lease_token)
            return request(run_id, reason)

        # the interleaving, on the real journal
        journal.request_abort = request_as_the_holder_lets_go
        try:
            run = abort_run(journal, run_id, "stop it")
        finally:
            del journal.request_abort
        assert (run.state, run.status, run.lease_owner) == ("canceled", RunLifecycle.ABORTED, None)
        assert journal.load(run_id) == run


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
    assert (run.state, run.status, run.abort_reason) == ("canceled", RunLifecycle.ABORTED, None)
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


class TestEveryRouteOfAStep:
    """Whatever route a step takes, the journal refuses its outcome and the abort is carried out."""

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
    def test_every_route_of_a_step_ends_aborted_where_the_abort_found_it(
        self, journal, driver, route
    ):
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
    def test_an_interrupted_phase_carries_out_the_abort_requested_meanwhile(self, journal, driver):
        calls: list[str] = []
        engine = route_engine(journal, "interrupt", calls)
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            DRIVERS[driver](engine, run_id)
        engine.close()
        assert_aborted_while_working(journal, run_id, calls)

    def test_a_run_due_to_be_parked_is_aborted_as_requested(self, journal):
        calls: list[str] = []
        engine = route_engine(journal, "bare", calls)
        engine.max_recoveries = 0
        run_id = engine.start()
        journal.claim(run_id, "gone:1:x", ttl=-1)  # its worker was lost: the next claim parks it
        journal.request_abort(run_id, "stop it")
        assert engine.work(max_runs=1, exit_when_idle=True) == 1
        engine.close()
        run = journal.load(run_id)
        assert (run.state, run.status, run.recoveries) == ("canceled", RunLifecycle.ABORTED, 1)
        assert calls == []

    def test_group_commit_refuses_only_the_run_whose_abort_was_requested(self, journal):
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
            ("canceled", RunLifecycle.ABORTED),
            *[("done", RunLifecycle.SUCCEEDED)] * 3,
        ]
        assert [t.event for t in journal.transitions(aborted)] == ["STARTED", USER_ABORTED]


class TestReasons:
    """A reason that is not UTF-8 is kept, escaped."""

    @pytest.mark.parametrize("held", [True, False], ids=["held", "not-held"])
    def test_a_reason_with_a_lone_surrogate_is_stored_escaped(self, journal, held):
        """A reason from an argv byte that is not UTF-8 (a lone surrogate) is kept, escaped."""
        engine = route_engine(journal, "bare", [])
        run_id = engine.start()
        if held:
            journal.claim(run_id, "holder", ttl=600)
        run = abort_run(journal, run_id, "stop \udcff now")
        expected = "stop \\udcff now"
        if held:
            assert (run.status, run.abort_reason) == (RunLifecycle.ACTIVE, expected)
        else:
            assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
            assert journal.transitions(run_id)[-1].result["error"]["message"] == expected
        engine.close()

    @posix_processes
    @pytest.mark.slow
    def test_the_cli_takes_a_reason_that_is_not_utf8(self, tmp_path):
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
            assert run.status is RunLifecycle.ABORTED
            assert journal.transitions(run_id)[-1].result["error"]["message"] == "bad \\udcff byte"
        finally:
            journal.close()


# -- the `fsm-runner abort` command -------------------------------------------------------------


@pytest.mark.usefixtures("in_tmp_path")
class TestAbortCommand:
    """`fsm-runner abort RUN --reason TEXT` through click's CliRunner."""

    def test_aborts_through_the_spec(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        result = invoke("abort", run_id, "--reason", "not needed")
        assert result.exit_code == 0, result.output
        assert "aborted in state 'canceled'" in result.output
        with SqliteJournal(journal_path) as journal:
            run = journal.load(run_id)
            last = journal.transitions(run_id)[-1]
        assert (run.state, run.status.value) == ("canceled", "aborted")
        assert last.event == "USER_ABORTED"
        assert last.error == {"type": "USER_ABORTED", "message": "not needed"}

    def test_reason_is_required(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        assert invoke("abort", run_id).exit_code == 2

    def test_ended_run(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        assert "has ended" in one_line_error(invoke("abort", run_id, "--reason", "x"), code=4)

    def test_abort_of_a_held_run_is_requested(self, invoke, journal_path):
        path = journal_path
        with SqliteJournal(path) as journal:
            run_id = Engine(
                linear_spec("a", "b", "c", name="leased"),
                handlers=handlers_for("a", "b", "c"),
                journal=journal,
            ).start()
            journal.claim(run_id, "elsewhere:1:x", ttl=600)
        result = invoke("abort", run_id, "--reason", "stop it")
        assert result.exit_code == 0, result.output
        assert "abort requested; elsewhere:1:x, which holds the run, carries it out" in (
            result.output
        )
        with SqliteJournal(path) as journal:
            run = journal.load(run_id)
        assert (run.state, run.abort_reason) == ("a", "stop it")
