"""Acceptance: an abort acknowledged as requested ends the run aborted, whoever holds it.

A real process holds the run inside a slow phase — an ``fsm-runner worker``, a sync
``Engine.run``, an async ``Engine.arun``, or ``fsm-runner agent-loop`` with an agent that waits —
while ``fsm-runner abort RUN --reason ...`` runs in another process, on a SQLite file and on
PostgreSQL. The abort command says the abort is requested, ``show`` shows the request while the
phase still runs, and once the phase returns (ignoring the abort: its handler never looks at
``ctx.cancelled``, and the holder's heartbeat is far off) the run ends aborted where it was: the
journal refuses the phase's outcome, so the holder carries out the abort instead of finishing
the run, and no later phase runs.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fsm_runner import Engine, Outcome, open_journal
from fsm_runner.events import RunEvent
from tests.abort_app import SPEC

ROOT = Path(__file__).parents[1]
APP = "tests.abort_app:make_engine"
TIMEOUT = 60.0  # seconds any one wait may take before the test gives up (never reached when green)
USER_ABORTED = RunEvent.USER_ABORTED.value
T = TypeVar("T")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX processes and pipes"),
]


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
    assert (run.state, run.status, run.abort_reason) == ("canceled", Outcome.ABORTED, None)
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

        with hold.open("w"):  # the agent's cat reads to end-of-file
            pass
        out, err = loop.communicate(timeout=TIMEOUT)
    finally:
        if loop.poll() is None:
            loop.kill()
            loop.communicate()
    assert loop.returncode == 1, f"{out}\n{err}"  # the run ended aborted
    assert f"run {run.run_id} is aborted in state 'canceled'" in out
    found = assert_aborted_in(location, run.run_id, "building", "stop the agent loop")
    assert found["events"] == ["STARTED", "RUN_ACCEPTED", USER_ABORTED]
