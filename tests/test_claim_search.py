"""SQLite's ``claim_next`` searches outside the write lock, then claims by a conditional UPDATE.

Threads and processes claiming from one file at once take each run exactly once a round (its
lease token raised once, a takeover counted once); an idle poll neither takes nor waits for the
write lock; a run claimed, moved or renewed between the search and the claim is not claimed.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from fsm_runner import Engine, SqliteJournal
from fsm_runner.exceptions import JournalError
from fsm_runner.journal import _sqlite_claims
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("a", "b", name="claimed")
STATES = ["a", "b"]
ROOT = Path(__file__).parents[1]
TIMEOUT = 120.0  # seconds a thread or process may take before the test gives up (never when green)

#: A claiming process: waits for "go" on stdin, claims until nothing is left, prints its claims.
CHILD = """
import json, sys
from fsm_runner import SqliteJournal
path, owner = sys.argv[1], sys.argv[2]
with SqliteJournal(path) as journal:
    print("ready", flush=True)
    sys.stdin.readline()
    claims = []
    while True:
        got = journal.claim_next(owner, ttl=600, machine="claimed", states=["a", "b"])
        if got is not None:
            claims.append([got.run_id, got.lease_token, got.recoveries])
        elif all(r.lease_owner is not None for r in journal.runs(status="active")):
            break
print(json.dumps(claims))
"""


def engine_for(journal: SqliteJournal) -> Engine:
    return Engine(SPEC, handlers={"a": lambda _ctx: NEXT, "b": lambda _ctx: NEXT}, journal=journal)


def claim_all(path: Path, owner: str, go: threading.Event, claims: list[list[object]]) -> None:
    """Claim until every active run is held (what :data:`CHILD` does, in a thread)."""
    with SqliteJournal(path) as journal:
        go.wait(TIMEOUT)
        while True:
            got = journal.claim_next(owner, ttl=600, machine="claimed", states=STATES)
            if got is not None:
                claims.append([got.run_id, got.lease_token, got.recoveries])
            elif all(r.lease_owner is not None for r in journal.runs(status="active")):
                return


def one_round(path: Path, threads: int, processes: int) -> list[list[object]]:
    """Every claim that ``threads`` threads and ``processes`` processes made, released together."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), f"process-{n}"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(processes)
    ]
    found: list[list[list[object]]] = [[] for _ in range(threads)]
    go = threading.Event()
    workers = [
        threading.Thread(target=claim_all, args=(path, f"thread-{n}", go, found[n]))
        for n in range(threads)
    ]
    for worker in workers:
        worker.start()
    for child in children:  # every process has its journal open: all start together
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    go.set()
    claims = []
    for child in children:
        out, _ = child.communicate(timeout=TIMEOUT)
        assert child.returncode == 0
        claims += json.loads(out)
    for worker in workers:
        worker.join(TIMEOUT)
        assert not worker.is_alive()
    return claims + [claim for made in found for claim in made]


@pytest.mark.slow
def test_threads_and_processes_claim_each_run_once_a_round(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as setup:
        run_ids = engine_for(setup).start_many([None] * 300)
        owners: set[str] = set()
        for round_, (token, recoveries) in enumerate([(1, 0), (2, 0), (3, 1)]):
            claims = one_round(path, threads=3, processes=3)
            assert Counter(claim[0] for claim in claims) == Counter(run_ids)  # each once
            assert {(claim[1], claim[2]) for claim in claims} == {(token, recoveries)}
            stored = {run.run_id: run for run in setup.runs(status="active")}
            owners |= {str(stored[run_id].lease_owner) for run_id in run_ids}
            assert all(stored[r].lease_token == token for r in run_ids)
            if round_ == 0:  # released: the next round claims them afresh
                for run in stored.values():
                    assert setup.release(run.run_id, str(run.lease_owner), run.lease_token)
            else:  # expired: the next round takes each over, once
                with contextlib.closing(sqlite3.connect(path)) as conn, conn:
                    conn.execute("UPDATE run_rows SET lease_expires_at = '2000-01-01T00:00:00Z'")
                conn.close()
        assert len(owners) > 1  # the claimers did share the runs out (any two will do)


def test_an_idle_poll_neither_takes_nor_waits_for_the_write_lock(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as setup:
        engine = engine_for(setup)
        held = engine.start()
        setup.claim(held, "w0", ttl=600)  # live lease: not claimable
        waiting = engine.start()  # claimable only by a worker of state "a"
    # No busy timeout: a poll that so much as tried to take the lock would fail at once.
    with SqliteJournal(path, busy_timeout=0) as worker:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
        try:
            for _ in range(3):
                assert worker.claim_next("w1", ttl=60, machine="claimed", states=["b"]) is None
                assert other.in_transaction
            # Something to claim: that needs the lock, which is not to be had.
            with pytest.raises(JournalError, match="locked"):
                worker.claim_next("w1", ttl=60, machine="claimed", states=["a"])
            other.execute("COMMIT")
            got = worker.claim_next("w1", ttl=60, machine="claimed", states=["a"])
            assert got is not None
            assert (got.run_id, got.lease_token) == (waiting, 1)
        finally:
            other.close()


class Interleaved(SqliteJournal):
    """A journal that lets ``meanwhile`` write between ``claim_next``'s search and its claim."""

    meanwhile = staticmethod(lambda: None)

    def claim_next(self, *args, **kwargs):
        original = _sqlite_claims._claim_found

        def claim_found(*found_args, **found_kwargs):
            self.meanwhile()
            return original(*found_args, **found_kwargs)

        _sqlite_claims._claim_found = claim_found
        try:
            return super().claim_next(*args, **kwargs)
        finally:
            _sqlite_claims._claim_found = original


class TestMovedMeanwhile:
    """A run changed between the search and the claim is judged as it is at the claim."""

    def test_a_run_whose_head_moved_out_of_the_states_is_not_claimed(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as other, Interleaved(path) as worker:
            engine = engine_for(other)
            run_id = engine.start()

            # Another worker claims the run, steps it a -> b and lets go.
            worker.meanwhile = lambda: engine.run(run_id, max_steps=1)
            assert worker.claim_next("w1", ttl=60, machine="claimed", states=["a"]) is None
            stored = other.load(run_id)
            assert (stored.state, stored.lease_owner, stored.lease_token) == ("b", None, 1)
            engine.close()

    def test_a_run_claimed_meanwhile_is_skipped_for_the_next(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as other, Interleaved(path) as worker:
            first, second = engine_for(other).start(), engine_for(other).start()
            worker.meanwhile = lambda: other.claim(first, "w0", ttl=60)
            got = worker.claim_next("w1", ttl=60, machine="claimed", states=STATES)
            assert got is not None
            assert (got.run_id, got.lease_owner, got.lease_token) == (second, "w1", 1)
            assert worker.load(second) == got
            assert (other.load(first).lease_owner, other.load(first).lease_token) == ("w0", 1)

    def test_an_expired_lease_renewed_meanwhile_is_not_taken_over(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as other, Interleaved(path) as worker:
            run_id = engine_for(other).start()
            expired = other.claim(run_id, "w0", ttl=-1)
            worker.meanwhile = lambda: other.renew(run_id, "w0", expired.lease_token, ttl=60)
            assert worker.claim_next("w1", ttl=60, machine="claimed", states=STATES) is None
            stored = other.load(run_id)
            assert (stored.lease_owner, stored.lease_token, stored.recoveries) == ("w0", 1, 0)

    def test_a_lease_released_meanwhile_is_claimed_without_a_takeover(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as other, Interleaved(path) as worker:
            run_id = engine_for(other).start()
            expired = other.claim(run_id, "w0", ttl=-1)
            worker.meanwhile = lambda: other.release(run_id, "w0", expired.lease_token)
            got = worker.claim_next("w1", ttl=60, machine="claimed", states=STATES)
            assert got is not None
            assert (got.lease_owner, got.lease_token, got.recoveries) == ("w1", 2, 0)
            assert other.load(run_id) == got

    def test_runs_taken_meanwhile_search_after_search_end_in_none(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as other, Interleaved(path) as worker:
            engine = engine_for(other)
            run_ids = [engine.start() for _ in range(40)]
            searches = []

            def take_the_oldest():  # each search's runs (the oldest free ones) go to another
                searches.append(1)
                free = [r.run_id for r in other.runs(status="active") if r.lease_owner is None]
                for run_id in run_ids:
                    if run_id in free[: len(free)] and run_ids.index(run_id) < 8 * len(searches):
                        other.claim(run_id, "w0", ttl=60)

            worker.meanwhile = take_the_oldest
            # Bounded: a few searches whose every run was gone meanwhile, then None.
            assert worker.claim_next("w1", ttl=60, machine="claimed", states=STATES) is None
            assert 1 < len(searches) < 10
            held = Counter(other.load(r).lease_owner for r in run_ids)
            assert held == {"w0": 8 * len(searches), None: 40 - 8 * len(searches)}
