"""A run is never driven past a row that fails its digest (issue 30, point 2).

A claim (``resume``, ``step``, ``astep``, an abort, a worker's ``claim_next``, ``claim_many``)
verifies the run's head transition against the previous transition's digest and the run's row
(input, context, error) against its own, and a fork its source's chain up to the fork seq; a
run that fails is refused with one ``JournalError`` naming the seq, and nothing is written. A
worker logs such a run once and drives the others. Real SQLite files damaged by raw SQL, the
release example, the CLI in-process and a worker in a real subprocess.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from fsm_runner import Engine, JournalError, MemoryJournal, RunLifecycle, SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.command_line import EXIT_FAILURE
from fsm_runner.engine import fork_run
from fsm_runner.examples import release
from fsm_runner.journal._digest import digest
from fsm_runner.journal._head import stored_digest
from tests.helpers import UNDO_TO_VERSION, linear_spec, noop, one_line_error, start_release

ROOT = Path(__file__).parents[1]
APP = "fsm_runner.examples.release:make_engine"
CHECK = "'fsm-runner check' says what is damaged; nothing was written"

#: Raw SQL damage to a release run stopped at seq 2 (building done, testing next), and what
#: the refusal names: a seq, or the run's row.
DAMAGES = {
    "head-result": (
        "UPDATE transitions SET result = replace(result, '9.9.9', '9.9.8') WHERE seq = 2",
        "seq 2",
    ),
    "head-time": ("UPDATE transitions SET at = replace(at, '.', ',') WHERE seq = 2", "seq 2"),
    "previous-digest": (
        "UPDATE transitions SET digest = replace(digest, substr(digest, 1, 1), 'x') WHERE seq = 1",
        "seq 2",
    ),
    "head-bytes": (  # not UTF-8: hashed as the bytes stored, as check does
        "UPDATE transitions SET result = CAST(X'FF' AS TEXT) || result WHERE seq = 2",
        "seq 2",
    ),
    "context": (
        "UPDATE run_rows SET context = '{\"forged\":1}'",
        "the row (input, context, error)",
    ),
    "input": (
        "UPDATE run_rows SET input = replace(input, '9.9.9', '9.9.8')",
        "the row (input, context, error)",
    ),
}


def raw_sql(path: Path, *statements: str) -> None:
    """Change the file by SQL, bypassing the journal (as a disk or a hand edit would)."""
    conn = sqlite3.connect(path)
    try:
        for statement in statements:
            assert conn.execute(statement).rowcount >= 1, statement
        conn.commit()
    finally:
        conn.close()


def stored(path: Path, run_id: str) -> tuple[int, str | None, int, int]:
    """The run's seq, lease owner and token, and how many transitions it has, as stored."""
    with SqliteJournal(path, create=False) as journal:
        run = journal.load(run_id)
    conn = sqlite3.connect(path)
    try:  # counted, not read: a damaged result may not be text
        (count,) = conn.execute("SELECT count(*) FROM transitions WHERE run_id = ?", (run_id,))
    finally:
        conn.close()
    return run.seq, run.lease_owner, run.lease_token, count[0]


@pytest.fixture(params=sorted(DAMAGES))
def damaged(request, tmp_path):
    """A journal whose release run (at seq 2) is damaged one way; (path, run id, what fails)."""
    path = tmp_path / "journal.db"
    run_id = start_release(path, tmp_path, 2)
    sql, what = DAMAGES[request.param]
    raw_sql(path, sql)
    return path, run_id, f"{what} of run {run_id}"


def refusal(path: Path, what: str) -> str:
    return f"journal {path}: {what} fails its digest; {CHECK}"


class TestResume:
    def test_the_engine_refuses_and_writes_nothing(self, damaged):
        path, run_id, what = damaged
        before = stored(path, run_id)
        engine = release.make_engine(str(path))
        try:
            for drive in (engine.resume, engine.step, engine.run):
                with pytest.raises(JournalError) as refused:
                    drive(run_id)
                assert refused.value.message == refusal(path, what)
            with pytest.raises(JournalError, match="fails its digest"):
                asyncio.run(engine.astep(run_id))
            with pytest.raises(JournalError, match="fails its digest"):
                engine.abort(run_id, "stop")
        finally:
            engine.journal.close()
        assert stored(path, run_id) == before  # no transition, no lease taken

    def test_the_cli_prints_one_error_line(self, damaged):
        path, run_id, what = damaged
        before = stored(path, run_id)
        result = CliRunner().invoke(cli, ["--journal", str(path), "resume", run_id, "--app", APP])
        assert one_line_error(result, EXIT_FAILURE) == f"Error: {refusal(path, what)}"
        assert stored(path, run_id) == before
        checked = CliRunner().invoke(cli, ["--journal", str(path), "check"])
        assert checked.exit_code == EXIT_FAILURE
        assert f"run {run_id}" in checked.output  # check names what resume refused

    def test_an_undamaged_journal_resumes(self, tmp_path):
        path = tmp_path / "journal.db"
        run_id = start_release(path, tmp_path, 2)
        engine = release.make_engine(str(path))
        try:
            assert engine.resume(run_id).status is RunLifecycle.SUCCEEDED
        finally:
            engine.journal.close()


class TestFork:
    def test_a_source_is_verified_up_to_the_fork_seq(self, tmp_path):
        path = tmp_path / "journal.db"
        run_id = start_release(path, tmp_path, 2)
        raw_sql(path, DAMAGES["head-result"][0])
        with SqliteJournal(path) as journal:
            assert fork_run(journal, run_id, at_seq=1, new_run_id="before").seq == 1
            with pytest.raises(JournalError) as refused:
                fork_run(journal, run_id, at_seq=2, new_run_id="at")
            assert refused.value.message == refusal(path, f"seq 2 of run {run_id}")
            assert [run.run_id for run in journal.runs()] == ["before", run_id]
            assert journal.integrity_problems()[0].startswith(f"digest: run {run_id} at seq 2")
            assert len(journal.integrity_problems()) == 1  # the fork's copies verify

    def test_a_source_whose_row_fails_is_not_forked(self, tmp_path):
        path = tmp_path / "journal.db"
        run_id = start_release(path, tmp_path, 2)
        raw_sql(path, DAMAGES["input"][0])
        result = CliRunner().invoke(cli, ["--journal", str(path), "fork", run_id, "--at", "1"])
        what = f"the row (input, context, error) of run {run_id}"
        assert one_line_error(result, EXIT_FAILURE) == f"Error: {refusal(path, what)}"


class TestWorker:
    def test_a_worker_skips_it_and_drives_the_others(self, tmp_path):
        """A real ``fsm-runner worker``: the damaged run is logged once and left as it was."""
        path = tmp_path / "journal.db"
        damaged_id = start_release(path, tmp_path / "a", 2)
        sound_id = start_release(path, tmp_path / "b", 2, version="1.0.0")
        raw_sql(path, DAMAGES["context"][0] + " WHERE run_key = 1")
        before = stored(path, damaged_id)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        finished = subprocess.run(
            [sys.executable, "-m", "fsm_runner.cli", "--journal", str(path), "worker", "--app",
             APP, "--exit-when-idle", "--idle-wait", "0.05"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert finished.returncode == 0, finished.stderr
        assert "Traceback" not in finished.stderr
        lines = [line for line in finished.stderr.splitlines() if "fails its digest" in line]
        what = f"the row (input, context, error) of run {damaged_id}"
        assert lines == [f"{refusal(path, what)}; the run is skipped (not claimed)"]
        assert stored(path, damaged_id) == before
        with SqliteJournal(path, create=False) as journal:
            assert journal.load(sound_id).status is RunLifecycle.SUCCEEDED

    def test_claim_next_logs_it_once(self, tmp_path, caplog):
        path = tmp_path / "journal.db"
        run_id = start_release(path, tmp_path, 2)
        raw_sql(path, DAMAGES["head-result"][0])
        with SqliteJournal(path) as journal, caplog.at_level(logging.ERROR, "fsm_runner"):
            for _ in range(3):  # three polls: refused, then looked past
                assert journal.claim_next("w", ttl=5, machine="release", states=["testing"]) is None
        assert [r.getMessage() for r in caplog.records] == [
            f"{refusal(path, f'seq 2 of run {run_id}')}; the run is skipped (not claimed)"
        ]
        assert stored(path, run_id)[1:3] == (None, 1)  # no lease taken

    def test_claim_many_refuses_it_alone(self, tmp_path):
        path = tmp_path / "journal.db"
        damaged_id = start_release(path, tmp_path / "a", 2)
        sound_id = start_release(path, tmp_path / "b", 2, version="1.0.0")
        raw_sql(path, DAMAGES["head-result"][0] + " AND run_key = 1")
        with SqliteJournal(path) as journal:
            refused, claimed = journal.claim_many([damaged_id, sound_id], "w", ttl=5)
            assert isinstance(refused, JournalError)
            assert "seq 2 of run" in refused.message
            assert (claimed.run_id, claimed.lease_owner) == (sound_id, "w")
            assert journal.load(damaged_id).lease_owner is None

    def test_recover_skips_it_and_recovers_the_others(self, tmp_path, caplog):
        path = tmp_path / "journal.db"
        damaged_id = start_release(path, tmp_path / "a", 2)
        sound_id = start_release(path, tmp_path / "b", 2, version="1.0.0")
        with SqliteJournal(path) as journal:  # both held by a worker that died
            for run_id in (damaged_id, sound_id):
                journal.claim(run_id, "gone", ttl=0.001)
        raw_sql(path, DAMAGES["head-result"][0] + " AND run_key = 1")
        time.sleep(0.01)  # the leases expire
        engine = release.make_engine(str(path))
        try:
            with caplog.at_level(logging.ERROR, "fsm_runner"):
                recovered = engine.recover()
        finally:
            engine.journal.close()
        assert [(run.run_id, run.status) for run in recovered] == [
            (sound_id, RunLifecycle.SUCCEEDED)
        ]
        assert [r.getMessage() for r in caplog.records] == [
            f"{refusal(path, f'seq 2 of run {damaged_id}')}; the run is skipped (not recovered)"
        ]
        assert stored(path, damaged_id)[:2] == (2, "gone")


class TestWithoutDigests:
    def test_rows_without_digests_pass(self, tmp_path):
        """A journal whose rows carry no digest (NULL) is driven as before."""
        path = tmp_path / "journal.db"
        run_id = start_release(path, tmp_path, 2)
        raw_sql(path, "UPDATE transitions SET digest = NULL", "UPDATE run_rows SET digest = NULL")
        engine = release.make_engine(str(path))
        try:
            assert engine.resume(run_id).status is RunLifecycle.SUCCEEDED
        finally:
            engine.journal.close()

    @pytest.mark.parametrize("version", [3, 10])
    def test_a_run_migrated_from_an_older_version_resumes(self, tmp_path, version):
        path = tmp_path / "journal.db"
        run_id = start_release(path, tmp_path, 2)
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            UNDO_TO_VERSION[version](conn)
        finally:
            conn.close()
        engine = release.make_engine(str(path))  # migrated: digests computed from the rows
        try:
            assert engine.resume(run_id).status is RunLifecycle.SUCCEEDED
            assert engine.journal.integrity_problems() == []
        finally:
            engine.journal.close()


@pytest.mark.parametrize(
    "values",
    [
        ("run", 3, None, "STARTED", 1.5, 2.0, True, b'{"a":"\xc3\xa9"}'),
        (b"\xff\xfe not UTF-8", "a\udcff lone surrogate", 0, -7, 1e-300),
        (),
    ],
)
@pytest.mark.parametrize("previous", [None, "", "0123456789abcdef0123456789abcdef"])
def test_stored_digest_is_the_chains_digest(previous, values):
    """The claim's hash of stored values (bytes as read) is ``_digest.digest`` of them."""
    assert stored_digest(previous, values) == digest(previous, values)


SPEC = linear_spec("a", "b")


def poked_memory(poke: str) -> tuple[MemoryJournal, str, str]:
    """A memory journal with runs ``bad`` (at seq 1, its head or row poked) and ``good``."""
    journal = MemoryJournal()
    engine = Engine(SPEC, handlers={"a": noop, "b": noop}, journal=journal)
    for run_id in ("bad", "good"):
        engine.step(engine.start({"n": 1}, run_id=run_id))
    if poke == "head":
        head = journal._transitions["bad"][-1]
        journal._transitions["bad"][-1] = attrs.evolve(head, duration_ms=99.5)
        return journal, "bad", "seq 1 of run bad"
    journal._runs["bad"] = attrs.evolve(journal._runs["bad"], context={"forged": 1})
    return journal, "bad", "the row (input, context, error) of run bad"


@pytest.mark.parametrize("poke", ["head", "row"])
class TestMemory:
    def test_claim_and_fork_refuse_it(self, poke):
        journal, run_id, what = poked_memory(poke)
        with pytest.raises(JournalError) as refused:
            journal.claim(run_id, "w", ttl=5)
        assert refused.value.message == f"journal :memory:: {what} fails its digest; {CHECK}"
        assert journal.load(run_id).lease_owner is None
        with pytest.raises(JournalError, match="fails its digest"):
            fork_run(journal, run_id, at_seq=1, new_run_id="fork")

    def test_claim_next_looks_past_it(self, poke, caplog):
        journal, run_id, _ = poked_memory(poke)
        with caplog.at_level(logging.ERROR, "fsm_runner"):
            claimed = journal.claim_next("w", ttl=5, machine=SPEC.name, states=["b"])
            assert getattr(claimed, "run_id", None) == "good"
            journal.release("good", "w", claimed.lease_token)
            journal.claim_next("w", ttl=5, machine=SPEC.name, states=["b"])
        assert len([r for r in caplog.records if "fails its digest" in r.getMessage()]) == 1
        assert journal.load(run_id).lease_owner is None
