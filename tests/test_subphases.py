"""Acceptance: sub-phases beside a real helper server that is SIGKILLed, and a runner that is killed.

Everything here is real: the helper server is a subprocess on 127.0.0.1, kills are SIGKILL,
journals are SQLite files in ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from fsm_runner import RetryPolicy, RunLifecycle, RunRecord, SqliteJournal
from fsm_runner.presets.subphases import (
    SUBPHASE_NAMES,
    SUBPHASES,
    Harness,
    SubPhase,
    _delays,
    plain_spec,
)
from fsm_runner.presets.subphases.helper_server import (
    HelperClient,
    HelperServer,
    ServerUnreachableError,
)
from fsm_runner.supervisor import Resource, Supervisor

ROOT = Path(__file__).parents[1]
APP = [sys.executable, "-m", "fsm_runner.presets.subphases"]
FAST = RetryPolicy(wait_initial=0.01, wait_max=0.05)
LONG = 30.0  # the first run of a delayed sub-phase; it is always cut short by a kill

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]


# -- helpers ----------------------------------------------------------------------------------


def log_counts(log: Path, kind: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    if log.exists():
        for line in log.read_text(encoding="utf-8").splitlines():
            what, name, _pid = line.split()[:3]  # a fourth field: the run that asked
            if what == kind:
                counts[name] += 1
    return counts


def started_pid(log: Path, name: str) -> int:
    for line in log.read_text(encoding="utf-8").splitlines():
        what, logged, pid = line.split()[:3]
        if (what, logged) == ("start", name):
            return int(pid)
    raise AssertionError(f"no 'start {name}' in the log")


def wait_for(predicate, what: str, *, timeout: float = 20.0, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the runner exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def triples(transitions) -> list[tuple[str | None, str, str]]:
    return [(t.from_state, t.event, t.to_state) for t in transitions]


def journaled(path: Path, run_id: str):
    with SqliteJournal(path) as journal:
        return journal.load(run_id), list(journal.transitions(run_id))


@contextlib.contextmanager
def harness(tmp_path: Path, **options) -> Iterator[Harness]:
    options.setdefault("backoff", FAST)
    options.setdefault("health_timeout", 10.0)
    with (
        SqliteJournal(tmp_path / "journal.db") as journal,
        Harness(journal, workdir=tmp_path / "work", **options) as h,
    ):
        yield h


class Background:
    """Runs a harness's run in a thread; keeps what it returned or raised."""

    def __init__(self, h: Harness, run_id: str) -> None:
        self.result: RunRecord | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._target, args=(h, run_id), daemon=True)
        self.thread.start()

    def _target(self, h: Harness, run_id: str) -> None:
        try:
            self.result = h.run(run_id)
        except BaseException as exc:
            self.error = exc

    def join(self, timeout: float = 30.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def kill_server_in(h: Harness, run_id: str, target: str, *, before_kill=None):
    """Run in the background; SIGKILL the helper server while ``target`` runs; join."""
    background = Background(h, run_id)
    wait_for(lambda: log_counts(h.log_path, "start")[target] == 1, f"'start {target}'")
    pid = started_pid(h.log_path, target)
    assert pid == h.server.pid
    if before_kill is not None:
        before_kill()
    os.kill(pid, signal.SIGKILL)
    return background.join()


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*APP, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the runner and its helper server: one group to kill
    )


def reap(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- the helper server and its client ---------------------------------------------------------


class TestHelperServer:
    """The server resource and its client, on their own."""

    def test_resource_and_client(self, tmp_path):
        server = HelperServer(log=tmp_path / "log")
        assert isinstance(server, Resource)
        with Supervisor(server, health_timeout=10.0) as sup:
            first = server.pid
            client = server.client()
            assert client.work("x") == {"name": "x", "done": 1, "pid": first}
            assert sup.restart("test").ok
            assert server.pid != first
            # The same client, the same port, a new process.
            assert client.work("x") == {"name": "x", "done": 2, "pid": server.pid}
        assert server.pid is None
        server.stop()  # idempotent

    def test_client_maps_a_dead_server(self, tmp_path):
        server = HelperServer(log=tmp_path / "log")
        client = server.client()  # nothing listens on the port
        with pytest.raises(ServerUnreachableError) as caught:
            client.work("x")
        assert isinstance(caught.value, ConnectionError)
        assert caught.value.url == f"{server.base_url}/work/x"

    def test_a_delay_applies_to_each_keys_first_time(self, tmp_path):
        from fsm_runner.presets.subphases.helper_server.__main__ import _WorkLog

        log = _WorkLog(tmp_path / "log")
        assert log.start("1b", "run-1")
        assert not log.start("1b", "run-1")  # its re-run is fast
        assert log.start("1b", "run-2")  # another run in the same workdir is slow again
        assert log.start("1a")
        assert not log.start("1a")
        assert not log.start("1b")  # without a key: any earlier start counts
        assert log_counts(tmp_path / "log", "start") == {"1b": 4, "1a": 2}

    def test_refuse_if_exists(self, tmp_path):
        refuse = tmp_path / "refuse"
        refuse.touch()
        server = HelperServer(log=tmp_path / "log", refuse_if_exists=refuse)
        with pytest.raises(Exception, match="exited with 1"):
            Supervisor(server, health_timeout=10.0).start()
        assert server.pid is None


# -- re-entry at the failed sub-phase ---------------------------------------------------------


@pytest.mark.parametrize("target", SUBPHASE_NAMES)
def test_server_killed_in_a_sub_phase_reenters_that_sub_phase(tmp_path, target):
    with harness(tmp_path) as h:
        run_id = h.start({"delays": {target: LONG}})
        run = kill_server_in(h, run_id, target)
        transitions = list(h.engine.journal.transitions(run_id))
        history = list(h.supervisor.history)

    assert (run.state, run.status) == ("done", RunLifecycle.SUCCEEDED)
    # Completed sub-phases ran exactly once; the failed one ran again; each is done once.
    assert log_counts(h.log_path, "done") == dict.fromkeys(SUBPHASE_NAMES, 1)
    assert log_counts(h.log_path, "start") == {n: 1 + (n == target) for n in SUBPHASE_NAMES}

    index = SUBPHASE_NAMES.index(target)
    path: list[tuple[str | None, str, str]] = [(None, "STARTED", "1a")]
    for name, following in zip(SUBPHASE_NAMES, [*SUBPHASE_NAMES[1:], "done"], strict=True):
        if name == target:
            path += [
                (name, "SERVER_UNREACHABLE", "recovering"),
                ("recovering", "SERVER_RECOVERED", name),
            ]
        path.append((name, "PHASE_COMPLETED", following))
    assert triples(transitions) == path
    assert [t.seq for t in transitions] == list(range(len(transitions)))

    lost, recovered, completed = transitions[index + 1 : index + 4]
    assert lost.error is not None
    assert "unreachable" in lost.error["message"]
    assert recovered.output == {"restarts": 1, "attempts": 1, "return_to": target}
    assert (lost.attempt, completed.attempt) == (1, 2)  # re-entered as the second attempt
    assert [(r.ok, r.reason) for r in history] == [(True, lost.error["message"])]


def test_server_that_never_comes_back_fails_the_run_after_the_budget(tmp_path):
    refuse = tmp_path / "refuse"
    with harness(tmp_path, max_restarts=2, refuse_if_exists=refuse) as h:
        run_id = h.start({"delays": {"1b": LONG}})
        run = kill_server_in(h, run_id, "1b", before_kill=refuse.touch)
        history = list(h.supervisor.history)
    run, transitions = journaled(tmp_path / "journal.db", run_id)

    assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
    assert run.error is not None
    assert transitions[-1].result is not None
    assert run.error["message"].startswith("restart budget spent: 2 restarts; last: ")
    assert "exited with 1" in run.error["message"]
    assert triples(transitions) == [
        (None, "STARTED", "1a"),
        ("1a", "PHASE_COMPLETED", "1b"),
        ("1b", "SERVER_UNREACHABLE", "recovering"),
        ("recovering", "RESTART_BUDGET_SPENT", "failed"),
    ]
    assert [t.seq for t in transitions] == [0, 1, 2, 3]
    assert run.seq == 3
    assert transitions[-1].result["reason"] == "helper server restart budget spent"
    assert transitions[-1].output == {"restarts": 2, "attempts": 2, "return_to": "1b"}
    assert transitions[1].output["done"] == 1  # nothing lost: 1a's answer is journaled
    assert [r.ok for r in history] == [False, False]
    assert log_counts(h.log_path, "done") == {"1a": 1}


def test_no_failure_takes_the_same_transitions_as_a_plain_run(tmp_path):
    paths = []
    for spec, where in ((SUBPHASES, tmp_path / "composite"), (plain_spec(), tmp_path / "plain")):
        where.mkdir()
        with harness(where, spec=spec) as h:
            run = h.run(h.start())
            paths.append(triples(h.engine.journal.transitions(run.run_id)))
            assert (run.state, run.status, h.supervisor.restarts) == (
                "done",
                RunLifecycle.SUCCEEDED,
                0,
            )
            assert log_counts(h.log_path, "done") == dict.fromkeys(SUBPHASE_NAMES, 1)
    assert paths[0] == paths[1]
    assert paths[0][-1] == ("1c", "PHASE_COMPLETED", "done")


def test_a_sub_phase_the_server_fails_fails_the_run(tmp_path):
    with harness(tmp_path) as h:
        run = h.run(h.start({"fail": {"codeql": "analysis broke"}}))
        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        assert run.error is not None
        assert "analysis broke" in run.error["message"]
        assert triples(h.engine.journal.transitions(run.run_id))[-1] == (
            "codeql",
            "PHASE_FAILED",
            "failed",
        )
        assert h.supervisor.restarts == 0


# -- the runner itself stopped ----------------------------------------------------------------


def test_runner_killed_in_1b_resumes_at_1b_in_a_new_process(tmp_path):
    journal, work = tmp_path / "journal.db", tmp_path / "work"
    log = work / "helper-server.log"
    common = ["--journal", str(journal), "--workdir", str(work)]
    proc = spawn(*common, "start", "--delay", f"1b={LONG:g}")
    try:
        wait_for(lambda: log_counts(log, "start")["1b"] == 1, "'start 1b'", proc=proc)
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its helper server
        stdout, _ = reap(proc)
    finally:
        reap(proc)
    assert proc.returncode == -signal.SIGKILL
    run_id = stdout.split()[0]
    killed, before = journaled(journal, run_id)
    assert (killed.state, killed.seq, killed.status) == ("1b", 1, RunLifecycle.ACTIVE)

    resumed = spawn(*common, "resume", run_id)
    stdout, stderr = reap(resumed)
    assert resumed.returncode == 0, stderr
    assert stdout.split() == [run_id, "done", "succeeded"]

    run, transitions = journaled(journal, run_id)
    assert (run.state, run.status) == ("done", RunLifecycle.SUCCEEDED)
    assert transitions[: len(before)] == before
    assert transitions[len(before)].from_state == "1b"
    assert triples(transitions) == [
        (None, "STARTED", "1a"),
        ("1a", "PHASE_COMPLETED", "1b"),
        ("1b", "PHASE_COMPLETED", "codeql"),
        ("codeql", "PHASE_COMPLETED", "1c"),
        ("1c", "PHASE_COMPLETED", "done"),
    ]
    assert log_counts(log, "done") == dict.fromkeys(SUBPHASE_NAMES, 1)
    assert log_counts(log, "start") == {"1a": 1, "1b": 2, "codeql": 1, "1c": 1}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_in_1b_journals_interrupted_and_resume_finishes_from_1b(tmp_path, signum):
    if signum == signal.SIGINT and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("SIGINT is ignored in this process, so in the runner too")
    journal, work = tmp_path / "journal.db", tmp_path / "work"
    log = work / "helper-server.log"
    common = ["--journal", str(journal), "--workdir", str(work)]
    proc = spawn(*common, "start", "--delay", f"1b={LONG:g}")
    try:
        wait_for(lambda: log_counts(log, "start")["1b"] == 1, "'start 1b'", proc=proc)
        server_pid = started_pid(log, "1b")
        os.kill(proc.pid, signum)  # the runner only
        stdout, stderr = reap(proc)
    finally:
        reap(proc)
    assert proc.returncode == 130, stderr
    assert gone(server_pid)  # the harness stopped its server on the way out
    run_id = stdout.split()[0]
    run, transitions = journaled(journal, run_id)
    assert (run.state, run.status, run.attempt) == ("1b", RunLifecycle.ACTIVE, 2)
    assert triples(transitions)[-1] == ("1b", "INTERRUPTED", "1b")

    resumed = spawn(*common, "resume", run_id)
    stdout, stderr = reap(resumed)
    assert resumed.returncode == 0, stderr
    run, after = journaled(journal, run_id)
    assert run.state == "done"
    assert after[len(transitions)].from_state == "1b"
    assert after[len(transitions)].attempt == 2
    assert log_counts(log, "done") == dict.fromkeys(SUBPHASE_NAMES, 1)


# -- phases have no handle on the server's lifecycle ------------------------------------------

LIFECYCLE = ("start", "stop", "restart", "kill", "terminate", "process", "supervisor", "server")


def reachable(obj, depth: int) -> Iterator[object]:
    """Objects reachable from ``obj`` through attributes and gc references, ``depth`` levels."""
    frontier, seen = [obj], {id(obj)}
    for _ in range(depth):
        following = []
        for item in frontier:
            values = list(gc.get_referents(item))
            for name in getattr(type(item), "__slots__", ()):
                with contextlib.suppress(AttributeError):
                    values.append(getattr(item, name))
            values.extend(getattr(item, "__dict__", {}).values())
            for value in values:
                if id(value) not in seen:
                    seen.add(id(value))
                    following.append(value)
        yield from following
        frontier = following


def test_phase_handlers_have_no_handle_on_the_server_lifecycle(tmp_path):
    with harness(tmp_path) as h:
        services = h.engine.services
        assert set(services) == {"server"}
        client = services["server"]
        assert type(client) is HelperClient
        assert not [name for name in dir(client) if name.lower() in LIFECYCLE]
        for handler in (client, h.engine.handlers["work"]):
            for found in reachable(handler, 3):
                assert not isinstance(found, (Supervisor, HelperServer, subprocess.Popen, Harness))
        assert type(h.engine.handlers["work"]) is SubPhase
        # The client works, and is all a phase would use.
        assert client.work("probe")["done"] == 1


# -- the command line, as the README uses it ---------------------------------------------------


class TestCommandLine:
    """`python -m fsm_runner.presets.subphases`: delays, run-id prefixes, exit codes, signals."""

    def test_delay_for_every_sub_phase_or_one(self):
        assert _delays(["2"]) == dict.fromkeys(SUBPHASE_NAMES, 2.0)
        assert _delays(["2", "1b=0.5"]) == {**dict.fromkeys(SUBPHASE_NAMES, 2.0), "1b": 0.5}
        assert _delays([]) == {}
        for bad in ("x=1", "1b=", "soon", "-1", "1b=nan"):
            with pytest.raises(click.BadParameter, match="SUBPHASE=SECONDS"):
                _delays([bad])

    def test_sigterm_then_resume_by_prefix(self, tmp_path):
        journal, work = tmp_path / "journal.db", tmp_path / "work"
        log = work / "helper-server.log"
        common = ["--journal", str(journal), "--workdir", str(work)]
        # --delay LONG slows every sub-phase; 1b..1c are set back so the resume is quick.
        fast = [arg for name in SUBPHASE_NAMES[1:] for arg in ("--delay", f"{name}=0")]
        proc = spawn(*common, "start", "--delay", f"{LONG:g}", *fast)
        try:
            wait_for(lambda: log_counts(log, "start")["1a"] == 1, "'start 1a'", proc=proc)
            os.kill(proc.pid, signal.SIGTERM)
            stdout, stderr = reap(proc)
        finally:
            reap(proc)
        assert proc.returncode == 130, stderr
        run_id = stdout.split()[0]
        assert stdout.split() == [run_id]
        assert "KeyboardInterrupt" not in stderr
        assert "Traceback" not in stderr
        assert stderr.splitlines() == [
            f"Error: run {run_id} interrupted by SIGTERM; it stays resumable: "
            f"python -m fsm_runner.presets.subphases --journal {journal} --workdir {work} "
            f"resume {run_id[:12]}"
        ]
        run, transitions = journaled(journal, run_id)
        assert run.input == {"delays": {"1a": LONG, "1b": 0.0, "codeql": 0.0, "1c": 0.0}}
        assert triples(transitions)[-1] == ("1a", "INTERRUPTED", "1a")
        assert transitions[-1].error["message"] == "interrupted by SIGTERM in '1a'"

        resumed = spawn(*common, "resume", run_id[:6])
        stdout, stderr = reap(resumed)
        assert resumed.returncode == 0, stderr
        assert stdout.split() == [run_id, "done", "succeeded"]
        assert log_counts(log, "start") == {"1a": 2, "1b": 1, "codeql": 1, "1c": 1}

        # An ended run, an unknown one, an ambiguous prefix: fsm-runner's codes, one line.
        for args, code, message in (
            (["resume", run_id[:6]], 4, "has ended"),
            (["resume", "zzz"], 3, "no run 'zzz'"),
            (["resume", ""], 2, "ambiguous"),
        ):
            if code == 2:  # a second run makes the empty prefix ambiguous
                quick = spawn(*common, "start")
                assert reap(quick)[0].split()[1:] == ["done", "succeeded"]
            proc = spawn(*common, *args)
            _, stderr = reap(proc)
            assert proc.returncode == code, stderr
            lines = stderr.splitlines()
            assert len(lines) == 1, stderr
            assert lines[0].startswith("Error: ")
            assert message in lines[0]

    def test_a_journal_that_is_not_there_or_not_a_journal(self, tmp_path):
        (tmp_path / "notes.txt").write_text("notes\n")
        for journal, command, code in (
            (tmp_path / "missing.db", "resume", 3),
            (tmp_path / "notes.txt", "start", 3),
            (tmp_path, "start", 3),
        ):
            proc = spawn("--journal", str(journal), "--workdir", str(tmp_path / "w"), command,
                         *(["r1"] if command == "resume" else []))  # fmt: skip
            stdout, stderr = reap(proc)
            assert proc.returncode == code, stderr
            assert len(stderr.splitlines()) == 1, stderr
            assert stderr.startswith("Error: journal") or stderr.startswith("Error: no journal")
            assert stdout == ""
        assert (tmp_path / "notes.txt").read_text() == "notes\n"
