"""Acceptance: leases hold across real processes sharing one SQLite journal.

Race: eight processes resume the same run at the same instant (released together by a pipe
barrier); exactly one advances it, the seven others are refused with the lease holder and its
expiry, and write nothing. Stale worker: a process whose lease expired while its phase ran, and
was taken over by another process, is refused at its next commit (``LeaseLostError``) and
writes nothing. The processes run tests/race_app.py, through the engine and through the CLI.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsm_runner import Engine, RunLifecycle, SqliteJournal
from fsm_runner.records import EffectStatus, format_utc, utc_now
from tests.race_app import HANDLERS, SPEC

ROOT = Path(__file__).parents[1]
APP = "tests.race_app:make_engine"
WORKERS = 8
TIMEOUT = 60.0  # seconds any one wait may take before the test gives up (never reached when green)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="passes pipe ends to children (POSIX)"),
]


def console_script() -> str:
    """The installed ``fsm-runner`` console script (beside this interpreter, or on PATH)."""
    beside = Path(sys.executable).with_name("fsm-runner")
    found = str(beside) if beside.exists() else shutil.which("fsm-runner")
    if found is None:
        pytest.skip("the fsm-runner console script is not installed")
    return found


class Pipe:
    """An OS pipe; children get its ends by file descriptor number."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()

    def close_write(self) -> None:
        if self.write >= 0:
            os.close(self.write)
            self.write = -1

    def close(self) -> None:
        self.close_write()
        os.close(self.read)


class Processes:
    """Children of one test, steered through pipes; whatever is left is killed at exit."""

    def __init__(self, tmp_path: Path) -> None:
        self.log = tmp_path / "handlers.log"
        self.log.touch()
        self.pipes: list[Pipe] = []
        self.procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        for pipe in self.pipes:
            pipe.close()

    def pipe(self) -> Pipe:
        """A new pipe, closed when the test ends."""
        self.pipes.append(Pipe())
        return self.pipes[-1]

    def spawn(
        self,
        argv: list[str],
        *,
        entered: Pipe,
        barrier: tuple[Pipe, Pipe] | None = None,
        hold: Pipe | None = None,
        more_fds: dict[str, int] | None = None,
        **env: str,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` from the repository root with the app's environment.

        Args:
            argv: the command.
            entered: where the child's ``working`` phase signals it is inside.
            barrier: (ready, go): the child signals ``ready`` and waits until ``go`` is closed.
            hold: the child's ``working`` phase returns once this is closed.
            more_fds: more pipe ends the child inherits, by the variable that names them.
            env: more environment variables.
        """
        environ = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("FSM_RACE_", "FSM_RUNNER_")) and k != "PYTHONWARNINGS"
        }
        environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        )
        environ["FSM_RACE_LOG"] = str(self.log)
        ends = {"FSM_RACE_ENTERED_FD": entered.write}
        if barrier is not None:
            ends["FSM_RACE_READY_FD"] = barrier[0].write
            ends["FSM_RACE_GO_FD"] = barrier[1].read
        if hold is not None:
            ends["FSM_RACE_HOLD_FD"] = hold.read
        ends.update(more_fds or {})
        environ.update({name: str(fd) for name, fd in ends.items()}, **env)
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=environ,
            pass_fds=list(ends.values()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def await_bytes(
        self, pipe: Pipe, count: int, *, what: str, among: list[subprocess.Popen[str]]
    ) -> None:
        """Read ``count`` signal bytes from ``pipe``; fail if every one of ``among`` exits first."""
        got = 0
        deadline = time.monotonic() + TIMEOUT
        while got < count:
            if all(proc.poll() is not None for proc in among):
                self.fail(f"the processes exited while waiting for {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what} ({got}/{count})")
            readable, _, _ = select.select([pipe.read], [], [], 0.05)
            if readable:
                got += len(os.read(pipe.read, count - got))

    def await_exits(self, count: int, *, what: str, quiet: Pipe) -> list[subprocess.Popen[str]]:
        """Wait until ``count`` children have exited, failing if ``quiet`` is signalled meanwhile."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            exited = [proc for proc in self.procs if proc.poll() is not None]
            if len(exited) >= count:
                return exited
            if select.select([quiet.read], [], [], 0)[0]:
                self.fail(f"a second process entered the phase while waiting for {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what} ({len(exited)}/{count} exited)")
            time.sleep(0.01)  # a bounded poll: there is no portable wait-for-any on Popen

    def finish(self, proc: subprocess.Popen[str]) -> tuple[int, str, str]:
        """Wait for ``proc``; its exit code, stdout and stderr."""
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        return proc.returncode, stdout, stderr

    def fail(self, message: str) -> None:
        details = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            stdout, stderr = proc.communicate()
            details.append(f"pid {proc.pid} exit {proc.returncode}:\n{stdout}{stderr}")
        pytest.fail(message + "\n" + "\n".join(details))

    def logged(self) -> list[tuple[str, ...]]:
        """The handlers' log: one tuple of words per line, in order."""
        return [tuple(line.split()) for line in self.log.read_text(encoding="utf-8").splitlines()]


def start_run(path: Path) -> str:
    with SqliteJournal(path) as journal:
        engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
        run_id = engine.start()
        engine.close()
    return run_id


def journaled(path: Path, run_id: str):
    """The run row, its transitions and its effects: what "wrote nothing" compares."""
    with SqliteJournal(path) as journal:
        return journal.load(run_id), journal.transitions(run_id), journal.effects(run_id)


def engine_argv(run_id: str) -> list[str]:
    return [sys.executable, "-m", "tests.race_app", "resume", run_id]


def cli_argv(path: Path, run_id: str, *, console: bool) -> list[str]:
    prefix = [console_script()] if console else [sys.executable, "-m", "fsm_runner.cli"]
    return [*prefix, "--journal", str(path), "resume", run_id, "--app", APP]


def owner_pid(owner: str) -> int:
    return int(owner.split(":")[1])


class TestEightProcessesRaceForOneRun:
    """Eight processes resume one run at once: one advances it, seven are refused and write nothing."""

    @pytest.mark.parametrize("via", ["engine", "cli"])
    def test_exactly_one_advances_the_run(self, tmp_path, via):
        path = tmp_path / "journal.db"
        run_id = start_run(path)
        # A long lease and no renewal: the expiry every loser reports is the one journaled.
        lease = {"FSM_RACE_LEASE_TTL": "600", "FSM_RACE_HEARTBEAT": "3600"}
        with Processes(tmp_path) as procs:
            ready, go, entered, hold = procs.pipe(), procs.pipe(), procs.pipe(), procs.pipe()
            for index in range(WORKERS):
                if via == "engine":
                    argv, env = engine_argv(run_id), {"FSM_RACE_JOURNAL": str(path), **lease}
                else:  # half through the console script, half through python -m
                    argv, env = cli_argv(path, run_id, console=index % 2 == 0), lease
                procs.spawn(argv, entered=entered, barrier=(ready, go), hold=hold, **env)
            procs.await_bytes(ready, WORKERS, what="all at the barrier", among=procs.procs)
            go.close_write()  # all eight claim the run at once
            procs.await_bytes(entered, 1, what="the winner in its phase", among=procs.procs)
            losers = procs.await_exits(WORKERS - 1, what="the seven losers", quiet=entered)
            (winner,) = [proc for proc in procs.procs if proc not in losers]

            # The winner holds the run inside its phase; nothing has moved yet.
            held, transitions, _ = journaled(path, run_id)
            assert (held.state, held.seq, held.lease_token, held.recoveries) == ("working", 0, 1, 0)
            assert len(transitions) == 1
            assert held.lease_owner is not None
            assert held.lease_expires_at is not None
            assert re.fullmatch(r"[^:\s]+:\d+:[0-9a-f]{8}", held.lease_owner)
            assert owner_pid(held.lease_owner) == winner.pid
            expiry = format_utc(held.lease_expires_at)
            refusal = f"run {run_id}: lease held by {held.lease_owner} until {expiry}"

            for loser in losers:
                code, stdout, stderr = procs.finish(loser)
                assert code == 4, stderr
                if via == "engine":
                    report = json.loads(stdout)
                    assert report["outcome"] == "LeaseHeldError", report
                    assert (report["owner"], report["expires_at"]) == (held.lease_owner, expiry)
                    assert report["message"] == refusal
                else:
                    assert stdout == ""  # no transition was committed, so none was echoed
                    assert stderr.splitlines() == [f"Error: {refusal}"]

            hold.close_write()  # let the winner's phase return
            code, stdout, stderr = procs.finish(winner)
            assert code == 0, stderr
            if via == "engine":
                report = json.loads(stdout)
                assert report["outcome"] == "ran"
                assert report["worker"] == held.lease_owner
                assert (report["state"], report["seq"]) == ("done", 2)
            else:
                assert (
                    stdout.splitlines()[-1] == f"run {run_id} has ended (succeeded) in state 'done'"
                )
            logged = procs.logged()

        run, transitions, effects = journaled(path, run_id)
        assert (run.state, run.status, run.seq) == ("done", RunLifecycle.SUCCEEDED, 2)
        assert (run.lease_owner, run.lease_token, run.recoveries) == (None, 1, 0)
        # Every transition after the start carries the winner's token: no loser wrote one.
        assert [(t.seq, t.from_state, t.to_state, t.lease_token) for t in transitions] == [
            (0, None, "working", 0),
            (1, "working", "finishing", 1),
            (2, "finishing", "done", 1),
        ]
        assert transitions[1].output == {"charged_by": winner.pid, "ran_in": winner.pid}
        assert [(e.name, e.status, e.result) for e in effects] == [
            ("charge", EffectStatus.DONE, {"pid": winner.pid})
        ]
        # Each phase ran once, in the winner; the effect happened once.
        assert logged == [
            ("working", run_id, str(winner.pid), "1"),
            ("charge", run_id, str(winner.pid)),
            ("finishing", run_id, str(winner.pid), "1"),
        ]


class TestAStaleWorkerIsFencedOut:
    """A worker whose lease was taken over while its phase ran is refused at commit, writing nothing.

    ``b-in-phase``: A returns while B, which took the run over, is still inside the same phase,
    so the run is still at the seq A read and only the lease token stops A. ``b-finished``: A
    returns after B ran the run to its end.
    """

    @pytest.mark.parametrize(
        ("via", "when"),
        [
            ("engine", "b-in-phase"),
            ("engine", "b-finished"),
            ("engine-late-effect", "b-in-phase"),
            ("engine-late-effect", "b-finished"),
            ("cli", "b-in-phase"),
        ],
    )
    def test_the_taken_over_worker_gets_lease_lost_and_writes_nothing(self, tmp_path, via, when):
        path = tmp_path / "journal.db"
        run_id = start_run(path)
        # A's lease expires at once and its heartbeat never renews it: A does not notice.
        stale = {"FSM_RACE_LEASE_TTL": "0.001", "FSM_RACE_HEARTBEAT": "3600"}
        if via == "engine-late-effect":
            stale["FSM_RACE_LATE_EFFECT"] = "1"
        with Processes(tmp_path) as procs:
            entered, hold_a, hold_b = procs.pipe(), procs.pipe(), procs.pipe()
            if via == "cli":
                argv, env = cli_argv(path, run_id, console=True), stale
            else:
                argv, env = engine_argv(run_id), {"FSM_RACE_JOURNAL": str(path), **stale}
            worker_a = procs.spawn(argv, entered=entered, hold=hold_a, **env)
            procs.await_bytes(entered, 1, what="A in its phase", among=[worker_a])
            deadline = time.monotonic() + TIMEOUT
            while (expires := journaled(path, run_id)[0].lease_expires_at) > utc_now():
                assert time.monotonic() < deadline, f"A's lease never expired ({expires})"
                time.sleep(0.001)

            # B takes the run over while A's phase is still running.
            worker_b = procs.spawn(
                engine_argv(run_id),
                entered=entered,
                hold=hold_b if when == "b-in-phase" else None,
                FSM_RACE_JOURNAL=str(path),
            )
            if when == "b-in-phase":
                procs.await_bytes(entered, 1, what="B in its phase", among=[worker_b])
                taken_over = journaled(path, run_id)
                assert (taken_over[0].seq, taken_over[0].lease_token) == (0, 2)
            else:
                code, stdout, stderr = procs.finish(worker_b)
                assert code == 0, stderr
                assert json.loads(stdout)["outcome"] == "ran"
                taken_over = journaled(path, run_id)

            hold_a.close_write()  # A's phase returns now, after its lease was taken over
            code, stdout, stderr = procs.finish(worker_a)
            assert code == 4, stderr
            refusal = f"run {run_id}: lease token 1 was taken over by another worker"
            if via == "cli":
                assert stdout == ""
                assert stderr.splitlines() == [f"Error: {refusal}"]
            else:
                report = json.loads(stdout)
                assert (report["outcome"], report["token"]) == ("LeaseLostError", 1), report
                assert report["message"] == refusal
            assert (
                journaled(path, run_id) == taken_over
            )  # A wrote nothing: no transition, no effect

            if when == "b-in-phase":
                hold_b.close_write()
                code, stdout, stderr = procs.finish(worker_b)
                assert code == 0, stderr
                assert json.loads(stdout)["outcome"] == "ran"
            logged = procs.logged()

        run, transitions, effects = journaled(path, run_id)
        assert (run.state, run.status, run.seq) == ("done", RunLifecycle.SUCCEEDED, 2)
        assert (run.lease_owner, run.lease_token, run.recoveries) == (None, 2, 1)
        assert [(t.seq, t.from_state, t.to_state, t.lease_token) for t in transitions] == [
            (0, None, "working", 0),
            (1, "working", "finishing", 2),
            (2, "finishing", "done", 2),
        ]
        # B ran the phase again (at least once per visit) but not A's recorded effect.
        assert transitions[1].output == {"charged_by": worker_a.pid, "ran_in": worker_b.pid}
        assert [(e.name, e.status, e.result) for e in effects] == [
            ("charge", EffectStatus.DONE, {"pid": worker_a.pid})
        ]
        a, b = str(worker_a.pid), str(worker_b.pid)
        b_runs = [("working", run_id, b, "2"), ("finishing", run_id, b, "2")]
        a_late = [("late-refused", run_id, a, "1")] if via == "engine-late-effect" else []
        b_first, b_last = (b_runs[:1], b_runs[1:]) if when == "b-in-phase" else (b_runs, [])
        # "late" never ran: A's late effect was refused before it happened.
        assert logged == [
            ("working", run_id, a, "1"),
            ("charge", run_id, a),
            *b_first,
            *a_late,
            *b_last,
        ]
