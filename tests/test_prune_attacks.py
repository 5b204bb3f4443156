"""Attacks on the maintenance operations while worker processes drive runs on the same file.

Real processes on one real SQLite file: 2-4 workers (sync ``Engine.work``; async ``arun`` over
``start_many(claim=True)`` batches) start and drive runs without pause, a reader lists runs,
and ``prune`` (library and CLI) deletes what ended before its cutoff beside them — or is
SIGKILLed in its ``DELETE`` transaction, its ``VACUUM`` or its ``TRUNCATE`` checkpoint. The CLI's
``abort``, ``fork``, ``recover``, ``check`` and ``replay`` are pointed at runs being driven right
now, and the journal is given to prune and workers under two names (a symlink; a hard link).

Each process writes what it saw to a side file of its own, a run only AFTER the call that
drove it returned with the run ended, a prune's cutoff BEFORE the call and the runs it pruned
after it. The checks (:func:`verdict`) then hold the journal to prune's rule: a run missing from
the journal was pruned because it ended before a cutoff — never an active run, never one
that ended after the cutoff, never a parent whose child is still active — and what is left
replays (``check_journal``) on an intact file. ``bench/bench_prune_attacks.py`` runs the same
sessions at length and prints the worst stall a worker saw.

Run as ``python -m tests.test_prune_attacks ROLE ...`` the module is one of the processes
(:func:`main`); ``make_engine`` is its app for ``fsm-runner recover --app``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fsm_runner import Engine, MachineSpec, MemoryJournal, SqliteJournal, State, Transition
from fsm_runner._convert import format_utc, parse_utc
from fsm_runner.exceptions import JournalError, RunNotFoundError
from fsm_runner.records import utc_now
from fsm_runner.replay import check_journal

ROOT = Path(__file__).parents[1]
APP = "tests.test_prune_attacks:make_engine"
TIMEOUT = 60.0  # seconds any one wait may take before the test gives up (never reached when green)

#: The job every worker drives: three phases, each pausing ``input["pause"]`` seconds.
SPEC = MachineSpec(
    "prune_job",
    [State("fetching", handler="fetching"), State("building", handler="building"),
     State("testing", handler="testing"), State("done", terminal=True)],
    [Transition("fetching", "FETCHED", "building"), Transition("building", "BUILT", "testing"),
     Transition("testing", "TESTS_PASSED", "done")],
)  # fmt: skip
#: A child of a job: nobody's worker drives it; its starter ends some of them itself.
CHILD_SPEC = MachineSpec(
    "prune_child",
    [State("waiting", handler="waiting"), State("finished", terminal=True)],
    [Transition("waiting", "FINISHED", "finished")],
)


def _phase(event: str) -> Any:
    def handler(ctx: Any) -> str:
        time.sleep((ctx.input or {}).get("pause", 0))
        return event

    return handler


HANDLERS = {
    "fetching": _phase("FETCHED"),
    "building": _phase("BUILT"),
    "testing": _phase("TESTS_PASSED"),
}
CHILD_HANDLERS = {"waiting": _phase("FINISHED")}


def make_engine() -> Engine:
    """The app of ``fsm-runner recover --app``: the job, on ``FSM_PRUNE_JOURNAL``."""
    path = os.environ.get("FSM_PRUNE_JOURNAL")
    return Engine(SPEC, handlers=HANDLERS, journal=SqliteJournal(path) if path else MemoryJournal())


# -- the processes ------------------------------------------------------------------------------


#: Whether a process goes on (its time is not up, and it was not told to stop).
Going = Callable[[], bool]


class Side:
    """A process's side file: one JSON object a line, flushed at once (a SIGKILL loses none)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record: Any) -> None:
        os.write(self._fd, (json.dumps(record) + "\n").encode())


class Stalls:
    """The longest wait between two commits of one process, and what it was waiting for."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.worst = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        self.worst = max(self.worst, now - self.last)
        self.last = now


def _done(side: Side, run: Any) -> None:
    side.write(done=run.run_id, at=format_utc(run.updated_at), status=run.status.value)


def _worker(path: str, side: Side, drive: str, going: Going, pause: float, seed: int) -> None:
    """Start and drive jobs (each with a child) while ``going()``; children of even jobs end."""
    rng = random.Random(seed)
    stalls = Stalls()

    def listener(transition: Any, run: Any) -> None:
        stalls.tick()
        if run.ended and run.machine == SPEC.name:  # after the commit of its last transition
            _done(side, run)

    journal = SqliteJournal(path)
    engine = Engine(SPEC, handlers=HANDLERS, journal=journal, listeners=[listener], lease_ttl=30)
    children = Engine(CHILD_SPEC, handlers=CHILD_HANDLERS, journal=journal, lease_ttl=30)
    number = 0
    while going():
        try:
            inputs = [{"n": number + i, "pause": pause * rng.random()} for i in range(4)]
            number += len(inputs)
            if drive == "sync":
                ids = [engine.start(given) for given in inputs]
            else:
                ids = engine.start_many(inputs, claim=True)
            kids = [children.start(None, parent_run_id=run_id) for run_id in ids]
            for run_id, kid in zip(ids, kids, strict=True):
                side.write(started=run_id, child=kid)
            if drive == "sync":
                engine.work(exit_when_idle=True)
            else:
                for run in asyncio.run(_drive(engine, ids)):
                    if not run.ended:
                        side.write(error="arun returned an active run", run=run.run_id)
            for run_id, kid in zip(ids[::2], kids[::2], strict=True):
                ended = children.run(kid)
                stalls.tick()
                side.write(child_done=kid, parent=run_id, at=format_utc(ended.updated_at))
        except Exception as exc:  # noqa: PERF203 - each failure reported, and the loop goes on
            side.write(error=f"{type(exc).__name__}: {exc}")
    engine.close()
    children.close()
    side.write(worst_stall=stalls.worst)


async def _drive(engine: Engine, ids: list[str]) -> list[Any]:
    runs = await asyncio.gather(*(engine.arun(run_id) for run_id in ids))
    return list(runs)


def _fsm_runner() -> str:
    beside = Path(sys.executable).with_name("fsm-runner")
    return str(beside) if beside.exists() else "fsm-runner"


def _pruner(path: str, side: Side, going: Going, lag: float, seed: int) -> None:
    """Prune (library, then the CLI, in turn) what ended more than up to ``lag`` s ago."""
    rng = random.Random(seed)
    journal = SqliteJournal(path, create=False)
    rounds = 0
    while going():
        rounds += 1
        older = lag * rng.random()
        if rounds % 2:
            cutoff = utc_now() - dt.timedelta(seconds=older)
            side.write(cutoff=format_utc(cutoff))
            began = time.monotonic()
            try:
                report = journal.prune(ended_before=cutoff, dry_run=rounds % 5 == 0)
            except Exception as exc:
                side.write(error=f"prune: {type(exc).__name__}: {exc}")
                continue
            if not report.dry_run:
                took = time.monotonic() - began
                side.write(pruned=list(report.run_ids), cutoff=format_utc(cutoff), took=took)
        else:
            command = [_fsm_runner(), "--journal", path, "prune", "--json"]
            side.write(cutoff=format_utc(utc_now() - dt.timedelta(seconds=older)))
            done = subprocess.run(
                [*command, "--older-than", repr(older / 86400)],
                capture_output=True, text=True, timeout=TIMEOUT, check=False,
            )  # fmt: skip
            cutoff = utc_now() - dt.timedelta(seconds=older)  # the latest the CLI may have used
            if done.returncode or done.stderr:
                side.write(error=f"prune CLI exit {done.returncode}: {done.stderr.strip()}")
            else:
                side.write(pruned=json.loads(done.stdout)["run_ids"], cutoff=format_utc(cutoff))
    journal.close()


def _reader(path: str, side: Side, going: Going) -> None:
    """List runs and read each one's transitions, as an operator's listing does."""
    journal = SqliteJournal(path, create=False)
    while going():
        try:
            for run in journal.runs(limit=50):
                journal.transitions(run.run_id)
        except RunNotFoundError:  # noqa: PERF203 - pruned between the listing and its read: fine
            pass
        except Exception as exc:
            side.write(error=f"reader: {type(exc).__name__}: {exc}")
    journal.close()


def main(argv: list[str]) -> None:
    """``python -m tests.test_prune_attacks ROLE PATH SIDE SECONDS [ARG] [SEED]``.

    The process stops after SECONDS, or once a file ``stop`` exists beside SIDE.
    """
    role, path, side_path, seconds = argv[:4]
    side = Side(Path(side_path))
    until = time.monotonic() + float(seconds)
    stop = Path(side_path).with_name("stop")  # or earlier, once the file exists

    def going() -> bool:
        return time.monotonic() < until and not stop.exists()

    seed = int(argv[5]) if len(argv) > 5 else 0
    if role in ("sync", "async"):
        _worker(path, side, role, going, float(argv[4]), seed)
    elif role == "pruner":
        _pruner(path, side, going, float(argv[4]), seed)
    elif role == "reader":
        _reader(path, side, going)
    side.write(exit="clean")


# -- a prune to be killed -----------------------------------------------------------------------

#: The stages of a prune to kill it in: the statement each starts with, as SQLite traces it.
STAGES = {
    "delete": "DELETE FROM transitions",
    "vacuum": "VACUUM",
    "checkpoint": "PRAGMA wal_checkpoint",
}


def killable_prune(path: str, side_path: str, stage: str, markers: Any) -> None:
    """Prune everything ended, sending ``markers`` each statement SQLite starts.

    For ``delete`` and ``vacuum`` the prune holds still (sleeps in SQLite's progress handler)
    at a random point inside the statement that starts the stage, or a later one of the same
    stage, and says ``held``: the SIGKILL lands there. ``checkpoint`` goes on, for the test to
    kill it a random moment after the checkpoint started.
    """
    side = Side(Path(side_path))
    journal = SqliteJournal(path, create=False)
    rng = random.Random()
    # delete: the Nth statement of the transaction (DELETE FROM transitions, iterations,
    # artifacts, effects, run_rows, specs, DROP TABLE), a few instructions into it.
    statements = [rng.randrange(0, 7) if stage == "delete" else 0]
    countdown = [rng.randrange(1, 20) if stage == "delete" else rng.randrange(1, 5000)]
    armed = [False]

    def trace(statement: str) -> None:
        markers.send(statement[:40])
        if stage in ("delete", "vacuum") and statement.startswith(STAGES[stage]):
            armed[0] = True
        elif armed[0] and statements[0] > 0:
            statements[0] -= 1

    def progress() -> int:
        if armed[0] and statements[0] == 0:
            countdown[0] -= 1
            if countdown[0] == 0:
                markers.send("held")
                time.sleep(TIMEOUT)
        return 0

    conn = journal._connections.conn
    conn.set_trace_callback(trace)
    conn.set_progress_handler(progress, 1)
    cutoff = utc_now()
    side.write(cutoff=format_utc(cutoff))
    report = journal.prune(ended_before=cutoff, vacuum=True)
    side.write(pruned=list(report.run_ids), cutoff=format_utc(cutoff))
    markers.send("returned")
    time.sleep(TIMEOUT)


def kill_a_prune(context: Any, path: Path, side: Path, stage: str) -> str:
    """Run :func:`killable_prune` in a process forked from ``context``'s server; SIGKILL it.

    Returns the last statement it started before the kill (or ``held``, ``returned``).
    """
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=killable_prune, args=(str(path), str(side), stage, send))
    process.start()
    send.close()
    seen: list[str] = []
    try:
        while True:
            if not receive.poll(TIMEOUT):
                raise AssertionError(f"the prune said nothing for {TIMEOUT} s after {seen[-3:]}")
            seen.append(receive.recv())
            if seen[-1] == "held":
                seen[-1] = f"held in {seen[-2]}"
                break
            if seen[-1] == "returned":
                break
            if stage == "checkpoint" and seen[-1].startswith(STAGES["checkpoint"]):
                time.sleep(random.uniform(0, 0.01))
                break
    except EOFError:
        raise AssertionError(f"the prune died by itself after {seen[-3:]}") from None
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.join(TIMEOUT)
    with contextlib.suppress(EOFError):
        while receive.poll(0):
            seen.append(receive.recv())
    receive.close()
    assert process.exitcode == -signal.SIGKILL
    return seen[-1]


# -- the checks ---------------------------------------------------------------------------------


def read_sides(directory: Path) -> list[dict[str, Any]]:
    """Every record of every side file in ``directory``."""
    return [
        json.loads(line)
        for side in sorted(directory.glob("*.jsonl"))
        for line in side.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def half_pruned(conn: sqlite3.Connection) -> list[str]:
    """A run row without transitions, or transitions without their run row: a prune cut short."""
    rows, transitions = conn.execute(
        "SELECT (SELECT count(*) FROM run_rows AS r WHERE NOT EXISTS"
        " (SELECT 1 FROM transitions AS t WHERE t.run_key = r.run_key)),"
        " (SELECT count(*) FROM transitions AS t WHERE NOT EXISTS"
        " (SELECT 1 FROM run_rows AS r WHERE r.run_key = t.run_key))"
    ).fetchone()
    if (rows, transitions) == (0, 0):
        return []
    return [
        f"half-pruned: {rows} run rows without transitions, {transitions} transitions without a row"
    ]


def verdict(path: Path, records: list[dict[str, Any]], *, killed: bool = False) -> list[str]:
    """What the journal at ``path`` does wrong against what the processes reported.

    ``killed``: some prunes were SIGKILLed, so a run may be gone without a report naming it;
    it must then have ended before the latest cutoff any prune was given.
    """
    problems = [f"a process failed: {r['error']}" for r in records if "error" in r]
    started = {r["started"]: r["child"] for r in records if "started" in r}
    done = {r["done"]: parse_utc(r["at"]) for r in records if "done" in r}
    done.update((r["child_done"], parse_utc(r["at"])) for r in records if "child_done" in r)
    pruned: dict[str, dt.datetime] = {}
    for record in records:
        for run_id in record.get("pruned", ()):
            pruned.setdefault(run_id, parse_utc(record["cutoff"]))
    cutoffs = [parse_utc(r["cutoff"]) for r in records if "cutoff" in r and "pruned" not in r]
    latest = max(cutoffs, default=None)
    journal = SqliteJournal(path, create=False)
    try:
        present = {run.run_id: run for run in journal.runs(limit=sys.maxsize)}
        for run_id, child in started.items():
            if run_id not in present and run_id not in done:
                problems.append(f"run {run_id} is gone, and no worker saw it end")
            elif run_id not in present:
                cutoff = pruned.get(run_id, latest if killed else None)
                if cutoff is None:
                    problems.append(f"run {run_id} is gone, and no prune reported it")
                elif done[run_id] >= cutoff:
                    problems.append(f"run {run_id} ended at {done[run_id]}, after the cutoff")
                if child in present and not present[child].ended:
                    problems.append(f"run {run_id} was pruned, its child {child} is active")
            elif not present[run_id].ended:
                problems.append(f"run {run_id} is still active after its worker drove it")
        for run_id, cutoff in pruned.items():
            if run_id not in done:
                problems.append(f"pruned {run_id}, which nobody saw end")
            elif done[run_id] >= cutoff:
                problems.append(f"pruned {run_id}, which ended at {done[run_id]}, after {cutoff}")
        problems += check_journal(journal)
        with contextlib.closing(sqlite3.connect(path)) as conn:
            problems += [
                f"integrity: {row[0]}"
                for row in conn.execute("PRAGMA integrity_check")
                if row[0] != "ok"
            ]
            problems += half_pruned(conn)
    finally:
        journal.close()
    return problems


# -- running sessions ---------------------------------------------------------------------------


def environ(path: Path) -> dict[str, str]:
    """The children's environment: this checkout on the path, the journal for ``make_engine``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["FSM_PRUNE_JOURNAL"] = str(path)
    return env


@contextlib.contextmanager
def processes(
    path: Path, sides: Path, roles: Sequence[tuple[str, ...]]
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start one process per role (``ROLE PATH SECONDS [ARG] [SEED]``); wait for all at the end."""
    children = []
    for number, (role, where, *rest) in enumerate(roles):
        argv = [sys.executable, "-m", "tests.test_prune_attacks", role, where,
                str(sides / f"{number}-{role}.jsonl"), *rest]  # fmt: skip
        children.append(subprocess.Popen(argv, cwd=ROOT, env=environ(path), stderr=subprocess.PIPE))
    try:
        yield children
    finally:
        for child in children:
            try:
                _, err = child.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                child.kill()
                _, err = child.communicate()
            assert child.returncode == 0, err.decode()


def seed_journal(path: Path, sides: Path) -> None:
    """A journal with one ended run in it, so that every process opens an existing file."""
    side = Side(sides / "seed.jsonl")
    with SqliteJournal(path) as journal:
        engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
        run_id = engine.start()
        side.write(started=run_id, child=None)
        _done(side, engine.run(run_id))


def add_ballast(path: Path, runs: int = 1500) -> None:
    """Active runs that nobody drives, 2 kB of input each: a VACUUM that takes a while."""
    with SqliteJournal(path) as journal:
        Engine(CHILD_SPEC, handlers=CHILD_HANDLERS, journal=journal).start_many(
            [{"pad": "x" * 2000}] * runs
        )


def forkserver() -> Any:
    """A multiprocessing context whose processes are forked from a server with this module loaded."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.test_prune_attacks"])
    return context


# -- the tests ----------------------------------------------------------------------------------

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL, fork and POSIX locks"),
]


class TestPruneUnderLoad:
    """prune, again and again, while workers drive runs and a reader lists them."""

    def test_prune_takes_only_what_ended_before_its_cutoff(self, tmp_path):
        path = tmp_path / "journal.db"
        seed_journal(path, tmp_path)
        seconds = "2.5"
        roles = [("sync", str(path), seconds, "0.004", "1"), ("async", str(path), seconds, "0.004", "2"),
                 ("sync", str(path), seconds, "0.002", "3"), ("pruner", str(path), seconds, "0.05", "4"),
                 ("reader", str(path), seconds)]  # fmt: skip
        with processes(path, tmp_path, roles):
            pass
        records = read_sides(tmp_path)
        assert sum(len(r.get("pruned", ())) for r in records) > 0  # prune had work to do
        assert verdict(path, records) == []
        assert all(r.get("exit") == "clean" for r in records if "exit" in r)


if __name__ == "__main__":
    main(sys.argv[1:])


class TestKilledPrune:
    """prune SIGKILLed inside its DELETE transaction, its VACUUM, its checkpoint, beside workers."""

    KILLS = 30

    def test_a_killed_prune_loses_nothing_and_leaves_no_half_pruned_run(self, tmp_path):
        path = tmp_path / "journal.db"
        seed_journal(path, tmp_path)
        add_ballast(path)
        context = forkserver()
        roles = [("sync", str(path), "3", "0.002", "5"), ("async", str(path), "3", "0.002", "6")]
        where, after_kills = [], []
        with processes(path, tmp_path, roles), contextlib.closing(sqlite3.connect(path)) as conn:
            for kill in range(self.KILLS):
                stage = list(STAGES)[kill % len(STAGES)]
                side = tmp_path / f"kill-{kill}.jsonl"
                where.append((stage, kill_a_prune(context, path, side, stage)))
                after_kills += [f"after kill {kill} ({where[-1]}): {p}" for p in half_pruned(conn)]
        assert after_kills == []
        records = read_sides(tmp_path)
        assert verdict(path, records, killed=True) == []
        # Killed inside each stage, as the statements it had started say.
        held = [last.removeprefix("held in ") for _, last in where if last.startswith("held in")]
        assert any(last.startswith("DELETE FROM") for last in held), where
        assert any(last == "VACUUM" for last in held), where
        # The journal works: a new run is driven, and a prune runs to its end.
        with SqliteJournal(path) as journal:
            engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
            assert engine.run(engine.start()).ended
            report = journal.prune(ended_before=utc_now())
            assert len(report.run_ids) > 0
            assert check_journal(journal) == []


def cli(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``fsm-runner --journal PATH ARGS...`` in a process of its own."""
    return subprocess.run(
        [_fsm_runner(), "--journal", str(path), *args],
        cwd=ROOT, env=environ(path), capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )  # fmt: skip


def one_clear_line(done: subprocess.CompletedProcess[str]) -> str | None:
    """What is wrong with a command's output: a traceback, or an error of more than one line."""
    if "Traceback" in done.stderr or len(done.stderr.splitlines()) > 1:
        return f"{done.args[3:]} exit {done.returncode}: {done.stderr!r}"
    return None


class TestOperationsOnLiveRuns:
    """abort, fork, recover, check and replay from the CLI, on runs workers drive right now."""

    #: Each command, what it may answer (exit code -> what its output holds), on a live run.
    OUTCOMES: ClassVar[dict[str, dict[int, tuple[str, ...]]]] = {
        "abort": {0: ("aborted: aborted", "abort requested"), 4: ("has ended",)},
        "fork": {0: ("forked",), 2: ("had ended at seq",)},  # ended meanwhile: --at needed
        "replay": {0: ("matches the journal",)},
        "check": {0: ("no problems",)},
        "recover": {0: ("recovered 0 runs",)},
    }

    def test_each_command_answers_in_one_line_and_keeps_its_word(self, tmp_path):
        path = tmp_path / "journal.db"
        seed_journal(path, tmp_path)
        roles = [("sync", str(path), "2.5", "0.3", "7"), ("async", str(path), "2.5", "0.3", "8")]
        calls = [command for command in self.OUTCOMES for _ in range(3)] + ["abort"]
        random.Random(9).shuffle(calls)
        with processes(path, tmp_path, roles), SqliteJournal(path, create=False) as journal:
            deadline = time.monotonic() + TIMEOUT
            while not journal.runs(machine=SPEC.name, status="active", limit=8):
                assert time.monotonic() < deadline
                time.sleep(0.01)

            def call(command: str) -> tuple[str, str, subprocess.CompletedProcess[str]]:
                live = journal.runs(machine=SPEC.name, status="active", limit=8)
                run_id = random.choice(live).run_id if live else journal.runs(limit=1)[0].run_id
                args = {"abort": ["abort", run_id, "--reason", "attack"], "fork": ["fork", run_id],
                        "replay": ["replay", run_id], "check": ["check"],
                        "recover": ["recover", "--app", APP]}[command]  # fmt: skip
                return command, run_id, cli(path, *args)

            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(call, calls))
        problems = [p for _, _, done in answers if (p := one_clear_line(done))]
        for command, run_id, done in answers:
            expected = self.OUTCOMES[command].get(done.returncode)
            said = done.stdout + done.stderr
            if expected is None or not any(words in said for words in expected):
                problems.append(f"{command} {run_id}: exit {done.returncode}: {said.strip()!r}")
        with SqliteJournal(path, create=False) as journal:
            for command, run_id, done in answers:  # an abort acknowledged is carried out
                if command == "abort" and done.returncode == 0:
                    run = journal.load(run_id)
                    if run.status.value != "aborted":
                        problems.append(
                            f"abort of {run_id} acknowledged, the run {run.status.value}"
                        )
        assert problems == []
        # Whether an abort lands on a run still active is a race with the workers (each run
        # ends in well under a second): its carrying out is checked above when it does, and
        # test_abort.py covers an abort of a run being driven deterministically.
        assert verdict(path, read_sides(tmp_path)) == []


class TestOneFileTwoNames:
    """The journal given to prune and workers under two names at once."""

    def test_prune_and_workers_through_a_symlink_and_the_real_path(self, tmp_path):
        path = tmp_path / "journal.db"
        seed_journal(path, tmp_path)
        other = tmp_path / "other.db"
        other.symlink_to(path)
        roles = [("sync", str(path), "1.5", "0.002", "10"), ("async", str(other), "1.5", "0.002", "11"),
                 ("pruner", str(other), "1.5", "0.05", "12"), ("reader", str(path), "1.5")]  # fmt: skip
        with processes(path, tmp_path, roles):
            pass
        records = read_sides(tmp_path)
        assert verdict(path, records) == []

    def test_prune_reports_the_size_of_the_file_behind_a_symlink(self, tmp_path):
        path = tmp_path / "journal.db"
        link = tmp_path / "link.db"
        link.symlink_to(path)
        with SqliteJournal(link, checkpoint_thread=False) as journal:
            engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
            for _ in range(50):
                engine.run(engine.start())
            wal = Path(f"{path}-wal")
            assert wal.exists()  # SQLite keeps the WAL beside the real file, not the link
            size = path.stat().st_size + wal.stat().st_size
            report = journal.prune(ended_before=utc_now())
        assert len(report.run_ids) == 50
        assert report.bytes_before == size

    def test_a_journal_with_a_second_hard_link_is_refused(self, tmp_path):
        # A hard link has -wal/-shm files of its own, so SQLite's writers of the two names do
        # not exclude each other and the file is corrupted (sqlite.org/howtocorrupt.html 2.4;
        # bench_prune_attacks.py --names hardlink showed "database disk image is malformed").
        path = tmp_path / "journal.db"
        SqliteJournal(path).close()
        before = path.read_bytes()
        os.link(path, tmp_path / "other.db")
        for name in (path, tmp_path / "other.db"):
            with pytest.raises(JournalError, match="has 2 hard links"):
                SqliteJournal(name).close()
        assert path.read_bytes() == before  # refused untouched
        os.unlink(tmp_path / "other.db")
        SqliteJournal(path).close()  # one name again: opens

    def test_the_checkpoint_thread_finds_the_wal_behind_a_symlink(self, tmp_path):
        real = tmp_path / "real.db"
        link = tmp_path / "link.db"
        SqliteJournal(real).close()
        link.symlink_to(real)
        with SqliteJournal(link) as journal:
            journal._connections.conn.execute(
                "PRAGMA wal_autocheckpoint = 0"
            )  # only the thread copies
            engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
            size = real.stat().st_size
            for run_id in engine.start_many([None] * 200):
                engine.run(run_id)
            deadline = time.monotonic() + 10
            while real.stat().st_size == size and time.monotonic() < deadline:
                time.sleep(0.02)
            assert real.stat().st_size > size  # the thread copied the WAL into the real file
            engine.close()


class TestPruneHoldsTheLockBriefly:
    """prune's DELETE transaction holds every writer off: its work must grow with the journal."""

    def test_the_selection_reads_each_run_a_bounded_number_of_times(self, tmp_path):
        # Found under load: with 20,000 active runs, a prune of 680 ended ones held the write
        # lock for 25 s in its selection (each ended run scanned every active run for a child),
        # close to the workers' 30 s busy timeout. Counted in SQLite's VM instructions, not time.
        with SqliteJournal(tmp_path / "journal.db") as journal:
            Engine(CHILD_SPEC, handlers=CHILD_HANDLERS, journal=journal).start_many([None] * 2000)
            engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
            for run_id in engine.start_many([None] * 400):
                engine.run(run_id)
            instructions = [0]

            def count() -> int:
                instructions[0] += 100
                return 0

            journal._connections.conn.set_progress_handler(count, 100)
            report = journal.prune(ended_before=utc_now())
            journal._connections.conn.set_progress_handler(None, 0)
        assert len(report.run_ids) == 400
        # ~65 a run here; the selection that scanned the active runs for each ended one: ~2,000.
        assert instructions[0] / 2400 < 300
