"""Acceptance: a run killed with SIGKILL inside a phase resumes in a new process as if never killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from fsm_runner import RunLifecycle, SqliteJournal

ROOT = Path(__file__).parents[1]
APP = [sys.executable, "-m", "tests.apps.fourphase"]
PHASES = ("fetching", "building", "testing", "publishing")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL"),
]


def app_env(journal: Path, log: Path, block: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSM_TEST_")}
    env["FSM_TEST_JOURNAL"] = str(journal)
    env["FSM_TEST_LOG"] = str(log)
    if block is not None:
        env["FSM_TEST_BLOCK_FILE"] = str(block)
    return env


def run_app(*args: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [*APP, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def journaled(journal_path: Path, run_id: str):
    with SqliteJournal(journal_path) as journal:
        return journal.load(run_id), list(journal.transitions(run_id))


def phases_logged(log: Path, run_id: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in log.read_text(encoding="utf-8").splitlines():
        phase, logged_run = line.split()
        if logged_run == run_id:
            counts[phase] += 1
    return counts


def start_and_kill_in_phase_3(journal: Path, log: Path, marker: Path) -> str:
    """Start a run in a subprocess, SIGKILL it once phase 3 is running; return its run id."""
    proc = subprocess.Popen(
        [*APP, "start"],
        cwd=ROOT,
        env=app_env(journal, log, block=marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(
                    f"the app exited ({proc.returncode}) before phase 3: {proc.stderr.read()}"
                )
            if time.monotonic() > deadline:
                pytest.fail("phase 3 never started")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    return stdout.split()[0]


def test_sigkill_inside_phase_3_then_resume_in_a_new_process(tmp_path):
    # The uninterrupted run, for comparison.
    base_journal, base_log = tmp_path / "base.db", tmp_path / "base.log"
    base_id, base_state = run_app("start", env=app_env(base_journal, base_log))
    base_run, base_transitions = journaled(base_journal, base_id)
    assert (base_state, base_run.state, base_run.status) == (
        "published",
        "published",
        RunLifecycle.SUCCEEDED,
    )
    assert phases_logged(base_log, base_id) == dict.fromkeys(PHASES, 1)

    # The killed run: phases 1 and 2 journaled, phase 3 entered and running when killed.
    journal, log, marker = tmp_path / "crash.db", tmp_path / "crash.log", tmp_path / "in-phase-3"
    run_id = start_and_kill_in_phase_3(journal, log, marker)
    killed, killed_transitions = journaled(journal, run_id)
    assert (killed.state, killed.seq, killed.status) == ("testing", 2, RunLifecycle.ACTIVE)
    assert [t.to_state for t in killed_transitions] == ["fetching", "building", "testing"]
    assert phases_logged(log, run_id) == {"fetching": 1, "building": 1, "testing": 1}

    # Resume in a new process, without the block.
    resumed_id, resumed_state = run_app("resume", run_id, env=app_env(journal, log))
    assert (resumed_id, resumed_state) == (run_id, "published")

    run, transitions = journaled(journal, run_id)
    assert (run.state, run.status) == (base_run.state, base_run.status)
    assert [t.seq for t in transitions] == list(range(len(transitions)))
    assert run.seq == transitions[-1].seq
    assert [(t.from_state, t.event, t.to_state) for t in transitions] == [
        (t.from_state, t.event, t.to_state) for t in base_transitions
    ]
    assert transitions[: len(killed_transitions)] == killed_transitions
    assert phases_logged(log, run_id) == {
        "fetching": 1,
        "building": 1,
        "testing": 2,
        "publishing": 1,
    }
