"""Group commit: many async runs' transitions in one journal transaction, every invariant kept.

The contract of ``Journal.commit_many`` on every journal (each commit refused or stored on its
own, a failed transaction writing nothing), the ``GroupCommitter`` (batches,
cancellation) and the engine's async path on a real SQLite file: no phase starts before the
transition that led to it is durable — checked from a second connection, which sees only
committed data — and the journal replays cleanly.
"""

from __future__ import annotations

import asyncio
import enum
import sqlite3
import time

import attrs
import pytest

from fsm_runner import Engine, PhaseResult, SqliteJournal
from fsm_runner.engine import async_driver
from fsm_runner.engine.async_driver import GroupCommitter
from fsm_runner.engine.leases import GroupClaimer
from fsm_runner.events import USER_ABORTED
from fsm_runner.exceptions import (
    FsmRunnerError,
    JournalError,
    LeaseHeldError,
    LeaseLostError,
    RunConflictError,
)
from fsm_runner.journal.base import Commit
from fsm_runner.records import IterationRecord, TransitionRecord, utc_now
from fsm_runner.replay import check_journal
from fsm_runner.spec import RunLifecycle
from tests.helpers import NEXT, linear_spec, loop_spec

SPEC = linear_spec("a", "b", "c", name="grouped")


class Event(str, enum.Enum):
    NEXT = NEXT


def sync_noop(_ctx):
    return NEXT


def engine_for(journal, **options) -> Engine:
    handlers = {"a": sync_noop, "b": sync_noop, "c": sync_noop}
    return Engine(SPEC, handlers=handlers, journal=journal, **options)


def next_commit(run, *, token=None, seq=None, iteration=None) -> Commit:
    """The commit moving ``run`` one state on (a -> b -> c -> done)."""
    order = ["a", "b", "c", "done"]
    dest = order[order.index(run.state) + 1]
    seq = run.seq + 1 if seq is None else seq
    now = utc_now()
    transition = TransitionRecord(
        run.run_id,
        seq,
        run.state,
        NEXT,
        dest,
        lease_token=run.lease_token if token is None else token,
        at=now,
    )
    after = attrs.evolve(run, state=dest, seq=seq, visit_seq=seq, updated_at=now)
    iterations = (IterationRecord(run.run_id, iteration, started_at=now),) if iteration else ()
    return Commit(after, transition, iterations)


class TestCommitMany:
    """Journal.commit_many on every journal: one transaction, each commit judged alone."""

    def test_all_stored_in_order(self, journal):
        engine = engine_for(journal)
        runs = [journal.load(engine.start()) for _ in range(5)]
        results = journal.commit_many([next_commit(run) for run in runs])
        assert results == [None] * 5
        for run in runs:
            assert journal.load(run.run_id).state == "b"
            assert [t.seq for t in journal.transitions(run.run_id)] == [0, 1]

    def test_refused_commits_write_nothing_and_the_others_are_stored(self, journal):
        engine = engine_for(journal)
        ok, stale, fenced, missing_seq, ok2 = (journal.load(engine.start()) for _ in range(5))
        journal.claim(fenced.run_id, "w2", ttl=60)  # its token moved on: the commit is fenced
        commits = [
            next_commit(ok),
            next_commit(stale, seq=stale.seq + 2),  # not at seq - 1
            next_commit(fenced),
            next_commit(missing_seq, seq=0),  # seq 0 is create_run's
            next_commit(ok2, iteration=1),  # several statements: inside a savepoint
        ]
        before = {r.run_id: journal.load(r.run_id) for r in (stale, fenced, missing_seq)}
        results = journal.commit_many(commits)
        assert results[0] is None
        assert isinstance(results[1], RunConflictError)
        assert isinstance(results[2], LeaseLostError)
        assert isinstance(results[3], (RunConflictError, ValueError))
        assert results[4] is None
        for run_id, row in before.items():
            assert journal.load(run_id) == row
            assert [t.seq for t in journal.transitions(run_id)] == [0]
        assert journal.load(ok.run_id).state == "b"
        assert journal.load(ok2.run_id).state == "b"
        assert journal.iteration(ok2.run_id, 1) is not None

    def test_a_refused_commit_of_several_statements_leaves_none_of_them(self, journal):
        engine = engine_for(journal)
        run = journal.load(engine.start())
        journal.claim(run.run_id, "w2", ttl=60)
        (result,) = journal.commit_many([next_commit(run, iteration=1)])
        assert isinstance(result, LeaseLostError)
        assert journal.iteration(run.run_id, 1) is None
        assert journal.iterations(run.run_id) == []

    def test_two_commits_of_one_run_in_one_group(self, journal):
        engine = engine_for(journal)
        run = journal.load(engine.start())
        first = next_commit(run)
        second = next_commit(first.run)
        assert journal.commit_many([first, second]) == [None, None]
        assert journal.load(run.run_id) == second.run
        assert check_journal(journal) == []

    def test_an_empty_group(self, journal):
        assert journal.commit_many([]) == []


class TestFailedTransaction:
    def test_a_full_disk_fails_every_commit_and_writes_nothing(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = engine_for(journal)
            runs = [journal.load(engine.start()) for _ in range(40)]
            conn = journal._connections.conn
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")
            commits = [next_commit(run) for run in runs]
            for commit in commits:  # results big enough to need new pages
                object.__setattr__(commit.transition, "result", {"output": "x" * 3000})
            results = journal.commit_many(commits)
            assert all(isinstance(r, JournalError) and "full" in str(r) for r in results)
            for run in runs:
                assert journal.load(run.run_id) == run
                assert [t.seq for t in journal.transitions(run.run_id)] == [0]
            conn.execute(f"PRAGMA max_page_count = {pages * 100}")
            assert journal.commit_many(commits) == [None] * 40  # the same group, once there is room
            assert check_journal(journal) == []

    def test_a_closed_journal(self, tmp_path):
        journal = SqliteJournal(tmp_path / "j.db")
        run = journal.load(engine_for(journal).start())
        journal.close()
        (result,) = journal.commit_many([next_commit(run)])
        assert isinstance(result, JournalError)
        assert "closed" in str(result)


class TestGroupCommitter:
    def test_one_turn_of_the_loop_is_one_transaction(self, sqlite_journal):
        engine = engine_for(sqlite_journal)
        runs = [sqlite_journal.load(engine.start()) for _ in range(30)]

        async def main():
            committer = GroupCommitter(sqlite_journal, asyncio.get_running_loop())
            await asyncio.gather(*(committer.submit(next_commit(run)) for run in runs))
            return committer

        committer = asyncio.run(main())
        assert (committer.transactions, committer.commits) == (1, 30)
        assert all(sqlite_journal.load(run.run_id).seq == 1 for run in runs)

    def test_batches_are_capped(self, sqlite_journal):
        engine = engine_for(sqlite_journal)
        runs = [sqlite_journal.load(engine.start()) for _ in range(50)]

        async def main():
            committer = GroupCommitter(sqlite_journal, asyncio.get_running_loop(), max_batch=20)
            await asyncio.gather(*(committer.submit(next_commit(run)) for run in runs))
            return committer

        committer = asyncio.run(main())
        assert (committer.transactions, committer.commits) == (3, 50)
        assert check_journal(sqlite_journal) == []

    def test_refusals_reach_their_own_submitter_only(self, sqlite_journal):
        engine = engine_for(sqlite_journal)
        good, fenced = (sqlite_journal.load(engine.start()) for _ in range(2))
        sqlite_journal.claim(fenced.run_id, "w2", ttl=60)

        async def main():
            committer = GroupCommitter(sqlite_journal, asyncio.get_running_loop())
            return await asyncio.gather(
                committer.submit(next_commit(good)),
                committer.submit(next_commit(fenced)),
                return_exceptions=True,
            )

        ok, refused = asyncio.run(main())
        assert ok is None
        assert isinstance(refused, LeaseLostError)

    def test_a_commit_cancelled_before_the_flush_is_not_written(self, sqlite_journal):
        engine = engine_for(sqlite_journal)
        kept, dropped = (sqlite_journal.load(engine.start()) for _ in range(2))

        async def main():
            committer = GroupCommitter(sqlite_journal, asyncio.get_running_loop())
            first = committer.submit(next_commit(kept))
            second = committer.submit(next_commit(dropped))
            second.cancel()
            await first

        asyncio.run(main())
        assert sqlite_journal.load(kept.run_id).seq == 1
        assert sqlite_journal.load(dropped.run_id).seq == 0

    def test_a_turn_whose_commits_were_all_cancelled_writes_nothing(self, sqlite_journal):
        engine = engine_for(sqlite_journal)
        runs = [sqlite_journal.load(engine.start()) for _ in range(5)]

        async def main():
            committer = GroupCommitter(sqlite_journal, asyncio.get_running_loop(), max_batch=2)
            futures = [committer.submit(next_commit(run)) for run in runs]
            for future in futures[1:]:
                future.cancel()
            await futures[0]
            await asyncio.sleep(0)  # the capped remainder's turns
            await asyncio.sleep(0)
            return committer

        committer = asyncio.run(main())
        assert (committer.transactions, committer.commits) == (1, 1)
        assert [sqlite_journal.load(run.run_id).seq for run in runs] == [1, 0, 0, 0, 0]

    def test_max_batch_must_be_positive(self, sqlite_journal):
        loop = asyncio.new_event_loop()
        with pytest.raises(ValueError, match="max_batch"):
            GroupCommitter(sqlite_journal, loop, max_batch=0)
        loop.close()


class TestEngineGroupCommit:
    """Concurrent async runs on a real file: durable before the next phase, replayable after."""

    @pytest.mark.parametrize("max_batch", [7, 4096])
    def test_no_phase_starts_before_its_transition_is_durable(
        self, tmp_path, monkeypatch, max_batch
    ):
        path = tmp_path / "journal.db"
        observer = sqlite3.connect(path, check_same_thread=False)  # sees committed data only
        observer.execute("PRAGMA query_only = 1")
        premature: list[tuple[str, int, int]] = []
        entered: list[int] = []

        async def phase(ctx):
            (committed,) = observer.execute(
                "SELECT max(seq) FROM transitions WHERE run_id = ?", (ctx.run.run_id,)
            ).fetchone()
            if committed != ctx.run.seq:
                premature.append((ctx.run.run_id, ctx.run.seq, committed))
            entered.append(ctx.run.seq)
            await asyncio.sleep(0)
            return NEXT

        made = []  # the engine's group committer, with this test's max_batch

        def committer_of(journal, loop):
            made.append(GroupCommitter(journal, loop, max_batch=max_batch))
            return made[-1]

        monkeypatch.setattr(async_driver, "GroupCommitter", committer_of)
        with SqliteJournal(path) as journal:
            engine = Engine(loop_spec(), handlers={"noop": phase}, journal=journal)
            run_ids = [engine.start() for _ in range(200)]

            async def main():
                return await asyncio.gather(*(engine.arun(r, max_steps=12) for r in run_ids))

            done = asyncio.run(main())
            (committer,) = made
            engine.close()
            assert premature == []
            assert len(entered) == 200 * 12
            assert all(run.seq == 12 for run in done)
            assert committer.commits == 200 * 12
            assert committer.transactions < committer.commits / 6  # they really were grouped
            assert check_journal(journal) == []
        observer.close()

    def test_results_match_one_commit_per_step(self, tmp_path):
        async def phase(ctx):
            return NEXT

        def drive(path, group_commit):
            with SqliteJournal(path) as journal:
                engine = Engine(
                    SPEC,
                    handlers={"a": phase, "b": phase, "c": phase},
                    journal=journal,
                    group_commit=group_commit,
                )
                run_ids = [engine.start(run_id=f"run-{n}") for n in range(20)]

                async def main():
                    return await asyncio.gather(*(engine.arun(r) for r in run_ids))

                done = asyncio.run(main())
                engine.close()
                paths = [
                    [(t.seq, t.from_state, t.event, t.to_state) for t in journal.transitions(r)]
                    for r in run_ids
                ]
                return [(r.state, r.status, r.seq) for r in done], paths

        assert drive(tmp_path / "grouped.db", True) == drive(tmp_path / "single.db", False)

    def test_a_failing_handler_and_a_fenced_run_do_not_disturb_the_others(self, tmp_path):
        async def phase(ctx):
            if ctx.run.input.get("fail") and ctx.run.state == "b":
                raise RuntimeError("boom")
            return NEXT

        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = Engine(SPEC, handlers={"a": phase, "b": phase, "c": phase}, journal=journal)
            run_ids = [engine.start({"fail": n % 3 == 0}) for n in range(30)]

            async def main():
                return await asyncio.gather(*(engine.arun(r) for r in run_ids))

            done = asyncio.run(main())
            engine.close()
            for n, run in enumerate(done):
                assert run.state == ("failed" if n % 3 == 0 else "done")
            assert check_journal(journal) == []

    def test_a_run_taken_over_mid_group_gets_lease_lost(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            stolen: dict[str, bool] = {}

            async def phase(ctx):
                if ctx.run.input.get("steal") and not stolen:
                    stolen["done"] = True
                    # another worker takes the lease over while this phase runs
                    journal.claim(ctx.run.run_id, "thief", ttl=60, take_over=ctx.run.lease_owner)
                await asyncio.sleep(0)
                return NEXT

            engine = Engine(SPEC, handlers={"a": phase, "b": phase, "c": phase}, journal=journal)
            run_ids = [engine.start({"steal": n == 3}) for n in range(10)]

            async def main():
                return await asyncio.gather(
                    *(engine.arun(r) for r in run_ids), return_exceptions=True
                )

            done = asyncio.run(main())
            engine.close()
            assert isinstance(done[3], LeaseLostError)
            assert journal.load(run_ids[3]).seq == 0  # nothing of the fenced worker written
            assert all(run.state == "done" for n, run in enumerate(done) if n != 3)
            assert check_journal(journal) == []


class TestArunHotPath:
    """arun's inlined hot path: every other outcome of a fast handler goes the general way."""

    @staticmethod
    def outcomes(journal, run_id):
        return [
            (t.event, t.to_state, t.output, (t.error or {}).get("type"))
            for t in journal.transitions(run_id)
        ]

    @pytest.mark.parametrize("group_commit", [True, False])
    def test_arun_journals_what_the_sync_run_does(self, tmp_path, group_commit):
        spec = linear_spec("a", "b", "c", "d", "e", name="outcomes")

        async def with_output(_ctx):
            return PhaseResult(NEXT, output={"n": 1})

        async def enum_event(_ctx):
            return Event.NEXT  # not a bare str: the general path

        async def returns_an_exception(_ctx):
            return RuntimeError("returned, not raised")

        async def raises(ctx):
            if ctx.attempt == 1 and ctx.run.input == "raise":
                raise RuntimeError("boom")
            return NEXT

        handlers = {
            "a": with_output,
            "b": enum_event,
            "c": sync_noop,
            "d": raises,
            "e": returns_an_exception,
        }

        def drive(path, use_async, run_input):
            with SqliteJournal(path) as journal:
                engine = Engine(spec, handlers=handlers, journal=journal, group_commit=group_commit)
                run_id = engine.start(run_input, run_id="r")
                run = asyncio.run(engine.arun(run_id)) if use_async else engine.run(run_id)
                engine.close()
                assert run.lease_owner is None
                return run.state, self.outcomes(journal, run_id)

        for run_input in ("raise", "go"):
            sync = drive(tmp_path / f"sync-{run_input}.db", False, run_input)
            grouped = drive(tmp_path / f"async-{run_input}.db", True, run_input)
            assert grouped == sync
        assert sync[0] == "failed"
        assert ("NEXT", "b", {"n": 1}, None) in sync[1]
        assert sync[1][-1][3] == "HandlerResultError"  # a returned exception is no event

    def test_a_run_cancelled_while_its_commit_waits_is_left_out(self, tmp_path):
        tasks: list[asyncio.Task] = []

        async def phase(ctx):
            if ctx.run.run_id == "r1" and ctx.run.seq == 0:
                tasks[0].cancel()  # r0's commit of this turn is queued, not yet written
            return NEXT

        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = Engine(loop_spec(), handlers={"noop": phase}, journal=journal)
            run_ids = [engine.start(run_id=f"r{n}") for n in range(3)]

            async def main():
                tasks.extend(asyncio.create_task(engine.arun(r, max_steps=5)) for r in run_ids)
                return await asyncio.gather(*tasks, return_exceptions=True)

            done = asyncio.run(main())
            engine.close()
            assert isinstance(done[0], asyncio.CancelledError)
            assert [run.seq for run in done[1:]] == [5, 5]
            cancelled = journal.load("r0")
            assert (cancelled.seq, cancelled.lease_owner) == (0, None)
            assert [t.seq for t in journal.transitions("r0")] == [0]
            assert check_journal(journal) == []


class TestGroupClaims:
    """The runs an engine starts in one turn of its loop are claimed in one transaction."""

    def test_claim_many_grants_and_refuses_each_on_its_own(self, journal):
        engine = engine_for(journal)
        free, ended, held, vetoed, lapsed = (engine.start(run_id=f"r{n}") for n in range(5))
        engine.run(ended)
        journal.claim(held, "w2", ttl=60)
        journal.claim(lapsed, "w3", ttl=0.001)
        time.sleep(0.05)  # w3's lease has lapsed: w1 takes it over (a recovery)
        before = {r: journal.load(r) for r in (ended, held, vetoed)}

        def check(run):
            if run.run_id == vetoed:
                raise ValueError("not here")

        results = journal.claim_many(
            [free, ended, "missing", held, vetoed, lapsed], "w1", ttl=60, check=check
        )
        claimed, taken = results[0], results[-1]
        assert (claimed.lease_owner, claimed.lease_token, claimed.recoveries) == ("w1", 1, 0)
        assert (taken.lease_owner, taken.lease_token, taken.recoveries) == ("w1", 2, 1)
        assert [journal.load(free), journal.load(lapsed)] == [claimed, taken]  # as stored
        assert [type(r).__name__ for r in results[1:-1]] == [
            "RunTerminalError", "RunNotFoundError", "LeaseHeldError", "ValueError",
        ]  # fmt: skip
        assert {r: journal.load(r) for r in before} == before  # nothing written for them

    @pytest.mark.parametrize("journal", ["sqlite", "postgres"], indirect=True)  # memory: none
    def test_claim_unchanged_many_claims_only_runs_still_as_written(self, journal):
        engine = engine_for(journal)
        run_ids = [engine.start(run_id=f"r{n}") for n in range(5)]
        engine.close()
        written = {r: journal.load(r) for r in run_ids}
        plain, claimed_elsewhere, released, stepped, aborted = run_ids
        held = journal.claim(claimed_elsewhere, "w2", ttl=60)
        token = journal.claim(released, "w2", ttl=60).lease_token
        journal.release(released, "w2", token)  # as it was, but for its token
        engine_for(journal).step(stepped)
        journal.request_abort(aborted, "stop")
        before = {r: journal.load(r) for r in run_ids[1:]}
        results = journal.claim_unchanged_many([written[r] for r in run_ids], "w1", ttl=60)
        assert results[1:] == [None] * 4  # nothing written for them
        assert {r: journal.load(r) for r in run_ids[1:]} == before
        assert journal.load(claimed_elsewhere) == held
        claimed = results[0]
        assert (claimed.lease_owner, claimed.lease_token, claimed.seq) == ("w1", 1, 0)
        assert journal.load(plain) == claimed  # as stored
        assert journal.claim_unchanged_many([written[plain]], "w3", ttl=60) == [None]
        assert journal.claim_unchanged_many([], "w3", ttl=60) == []

    def test_arun_claims_the_runs_it_starts_together(self, journal):
        engine = engine_for(journal)
        run_ids = [engine.start() for _ in range(50)]
        calls = []
        for name in ("claim_many", "claim_unchanged_many"):
            method = getattr(journal, name, None)
            if method is None:
                continue
            setattr(journal, name, lambda *a, name=name, method=method, **k: (
                calls.append((name, len(a[0]))) or method(*a, **k)
            ))  # fmt: skip

        async def main(ids):
            runs = (engine.arun(r, max_steps=2) for r in ids)
            return await asyncio.gather(*runs, return_exceptions=True)

        done = asyncio.run(main(run_ids))
        if not hasattr(journal, "claim_unchanged_many"):  # the memory journal: loaded, at once
            assert calls == [("claim_many", 50)]
            return
        assert calls == [("claim_unchanged_many", 50)]  # as written: no load, one transaction
        assert all(run.seq == 2 and run.lease_token == 1 for run in done)
        assert all(journal.load(r).lease_owner is None for r in run_ids)  # released
        with engine_for(journal) as other:
            others = other.start_many([{}] * 30)  # not this engine's: loaded
        run_ids[:20] = [engine.start() for _ in range(20)]
        journal.claim_many(run_ids[15:20], "elsewhere:1:x", ttl=60)  # changed: loaded too
        calls.clear()
        done = asyncio.run(main(run_ids[:20] + others))
        engine.close()
        assert calls == [("claim_unchanged_many", 20), ("claim_many", 35)]
        assert [type(run).__name__ for run in done[15:20]] == ["LeaseHeldError"] * 5
        assert all(run.seq == 2 and run.lease_owner is None for run in done[:15] + done[20:])

    def test_a_refused_claim_fails_only_its_run(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = engine_for(journal)
            run_ids = [engine.start() for _ in range(3)]
            journal.claim(run_ids[1], "elsewhere:1:x", ttl=60)

            async def main():
                runs = (engine.arun(r) for r in run_ids)
                return await asyncio.gather(*runs, return_exceptions=True)

            first, second, third = asyncio.run(main())
            engine.close()
            assert isinstance(second, LeaseHeldError)
            assert (first.state, third.state) == ("done", "done")
            assert journal.load(run_ids[1]).seq == 0

    def test_a_run_cancelled_after_its_claim_gives_the_lease_back(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = engine_for(journal)
            run_ids = [engine.start() for _ in range(3)]
            tasks = []
            claim_many = journal.claim_unchanged_many

            def claim_then_cancel(*args, **kwargs):
                results = claim_many(*args, **kwargs)
                asyncio.get_running_loop().call_soon(tasks[1].cancel)  # before it resumes
                return results

            journal.claim_unchanged_many = claim_then_cancel  # the runs are as it wrote them

            async def main():
                tasks.extend(asyncio.ensure_future(engine.arun(r)) for r in run_ids)
                return await asyncio.gather(*tasks, return_exceptions=True)

            first, second, third = asyncio.run(main())
            engine.close()
            assert isinstance(second, asyncio.CancelledError)
            cancelled = journal.load(run_ids[1])
            assert (cancelled.seq, cancelled.lease_token, cancelled.lease_owner) == (0, 1, None)
            assert (first.state, third.state) == ("done", "done")

    def test_a_claim_cancelled_before_its_turn_is_not_made(self):
        calls = []

        async def main():
            loop = asyncio.get_running_loop()
            claimer = GroupClaimer(
                loop, lambda claims: calls.append(claims) or [f"row {r}" for r, _ in claims]
            )
            futures = [claimer.submit(r) for r in ("a", "b", "c")]
            futures[1].cancel()
            await asyncio.sleep(0)
            return [f.result() for f in (futures[0], futures[2])]

        assert asyncio.run(main()) == ["row a", "row c"]
        assert calls == [[("a", None), ("c", None)]]


class TestPostgresPipeline:
    """On PostgreSQL a group of one-statement commits is pipelined: two round trips, not 3N + 2.

    A refused commit rolls the pipelined group back and sends it the careful way (a savepoint a
    commit): each commit is still judged alone.
    """

    def spy(self, monkeypatch) -> list[bool]:
        from fsm_runner.journal import _postgres_writes

        outcomes: list[bool] = []
        pipelined = _postgres_writes._pipelined

        def recorded(conn, plans):
            outcomes.append(pipelined(conn, plans))
            return outcomes[-1]

        monkeypatch.setattr(_postgres_writes, "_pipelined", recorded)
        return outcomes

    def test_a_group_is_stored_by_one_pipeline(self, postgres_journal, monkeypatch):
        outcomes = self.spy(monkeypatch)
        engine = engine_for(postgres_journal)
        runs = [postgres_journal.load(engine.start()) for _ in range(4)]
        assert postgres_journal.commit_many([next_commit(run) for run in runs]) == [None] * 4
        assert outcomes == [True]
        assert {postgres_journal.load(run.run_id).state for run in runs} == {"b"}

    def test_a_refusal_in_the_pipeline_refuses_its_commit_alone(
        self, postgres_journal, monkeypatch
    ):
        outcomes = self.spy(monkeypatch)
        engine = engine_for(postgres_journal)
        ok, fenced, stale, ok2 = (postgres_journal.load(engine.start()) for _ in range(4))
        postgres_journal.claim(fenced.run_id, "w2", ttl=60)
        commits = [
            next_commit(ok),
            next_commit(fenced),
            next_commit(stale, seq=stale.seq + 2),
            next_commit(ok2),
        ]
        results = postgres_journal.commit_many(commits)
        assert outcomes == [False]  # rolled back, then done a savepoint a commit
        assert results[0] is None
        assert isinstance(results[1], LeaseLostError)
        assert isinstance(results[2], RunConflictError)
        assert results[3] is None
        assert [t.seq for t in postgres_journal.transitions(fenced.run_id)] == [0]
        assert [t.seq for t in postgres_journal.transitions(stale.run_id)] == [0]
        assert postgres_journal.load(ok2.run_id).state == "b"

    def grouped(self, monkeypatch) -> list[tuple[int, bool]]:
        """Spy on the group statements: (how many commits, narrow) of each."""
        from fsm_runner.journal import _postgres_writes

        grouped: list[tuple[int, bool]] = []
        group_statement = _postgres_writes.group_statement

        def recorded(commits, *, narrow):
            grouped.append((len(commits), narrow))
            return group_statement(commits, narrow=narrow)

        monkeypatch.setattr(_postgres_writes, "group_statement", recorded)
        return grouped

    def test_a_group_of_runs_is_one_statement(self, postgres_journal, monkeypatch):
        """Each commit of another run: the group's work is one statement (_postgres_groups)."""
        grouped = self.grouped(monkeypatch)
        engine = engine_for(postgres_journal)
        runs = [postgres_journal.load(engine.start()) for _ in range(3)]
        changed = [next_commit(attrs.evolve(run, context={"k": 1})) for run in runs]
        assert postgres_journal.commit_many(changed) == [None] * 3
        assert grouped == [(3, False)]  # a new context: all of the row
        after = [postgres_journal.load(run.run_id) for run in runs[:2]]
        assert postgres_journal.commit_many([next_commit(run) for run in after]) == [None, None]
        assert grouped == [(3, False), (2, True)]  # the same context and error: the narrow one
        assert [postgres_journal.load(run.run_id).context for run in runs] == [{"k": 1}] * 3
        assert postgres_journal.integrity_problems() == []

    def test_the_runs_an_engine_started_step_narrow_from_their_first_step(
        self, postgres_journal, monkeypatch
    ):
        """A start remembers each row's digest as a commit computes it: the engine's first
        group of steps of the runs it started keeps it, and is narrow as the next ones are."""
        grouped = self.grouped(monkeypatch)
        engine = engine_for(postgres_journal)
        run_ids = engine.start_many([{"n": n} for n in range(3)] + [{}, {}])

        async def main():
            return await asyncio.gather(*(engine.arun(run_id) for run_id in run_ids))

        done = asyncio.run(main())
        engine.close()
        assert [run.state for run in done] == ["done"] * 5
        assert grouped == [(5, True)] * 3  # a, b, c: each group of the five narrow
        assert postgres_journal.integrity_problems() == []
        assert check_journal(postgres_journal) == []

    def test_the_narrow_group_writes_the_row_the_whole_one_would(
        self, postgres_journal, monkeypatch
    ):
        """GROUP_NARROW leaves context, error and digest, and writes what a step changes."""
        grouped = self.grouped(monkeypatch)
        engine = engine_for(postgres_journal)
        runs = [postgres_journal.load(engine.start(context={"n": 1})) for _ in range(3)]
        commits = [next_commit(attrs.evolve(run, attempt=2)) for run in runs]  # a retried one
        assert postgres_journal.commit_many(commits) == [None] * 3
        # the next: a step that sets the attempt back to 1 (narrow), then the end
        second = [next_commit(attrs.evolve(c.run, attempt=1)) for c in commits]
        assert postgres_journal.commit_many(second) == [None] * 3
        ending = []
        for commit in (next_commit(c.run) for c in second):
            run = attrs.evolve(
                commit.run, status=RunLifecycle.SUCCEEDED, lease_owner=None, lease_expires_at=None
            )
            ending.append(attrs.evolve(commit, run=run))
        assert postgres_journal.commit_many(ending) == [None] * 3
        assert [narrow for _, narrow in grouped] == [True, True, True]  # the start's digest kept
        for commit in ending:
            stored = postgres_journal.load(commit.run.run_id)
            assert (stored.state, stored.seq, stored.visit_seq, stored.status) == (
                "done",
                3,
                3,
                RunLifecycle.SUCCEEDED,
            )
            assert (stored.context, stored.error, stored.attempt) == ({"n": 1}, None, 1)
            assert stored.updated_at == commit.transition.at
            assert stored.lease_owner is None
        assert postgres_journal.integrity_problems() == []
        assert check_journal(postgres_journal) == []

    def test_a_row_changed_behind_the_writer_refuses_the_narrow_group_not_its_commits(
        self, postgres_journal, monkeypatch
    ):
        """A row whose digest is not the one the writer remembers: the careful way writes it."""
        outcomes = self.spy(monkeypatch)
        grouped = self.grouped(monkeypatch)
        engine = engine_for(postgres_journal)
        runs = [postgres_journal.load(engine.start()) for _ in range(3)]
        commits = [next_commit(run) for run in runs]
        assert postgres_journal.commit_many(commits) == [None] * 3
        changed = runs[1].run_id
        postgres_journal._connection.call(  # private: another writer's row, as stored
            lambda conn: conn.execute(
                "UPDATE runs SET context = %s, digest = %s WHERE run_id = %s",
                ('{"other": true}', "0" * 32, changed),
            )
        )
        second = [next_commit(c.run) for c in commits]
        assert postgres_journal.commit_many(second) == [None] * 3
        assert grouped == [(3, True), (3, True)]
        assert outcomes == [True, False]  # refused whole, then a savepoint a commit
        stored = postgres_journal.load(changed)
        # all of the row written, as the commit has it
        assert (stored.state, stored.seq, stored.context) == ("c", 2, second[1].run.context)
        assert postgres_journal.integrity_problems() == []

    def test_an_abort_requested_refuses_the_step_and_admits_the_abort_in_one_group(
        self, postgres_journal, monkeypatch
    ):
        """The group statement fences as the one-statement commit does, abort tokens too."""
        outcomes = self.spy(monkeypatch)
        engine = engine_for(postgres_journal)
        ok, stepping, ok2, aborting = (postgres_journal.load(engine.start()) for _ in range(4))
        for run in (stepping, aborting):
            postgres_journal.request_abort(run.run_id, "enough")
        # A plain step of a run whose abort was requested under its token: refused (were it
        # admitted, the group would be stored whole).
        results = postgres_journal.commit_many([next_commit(ok), next_commit(stepping)])
        assert results[0] is None
        assert isinstance(results[1], FsmRunnerError)
        assert [t.seq for t in postgres_journal.transitions(stepping.run_id)] == [0]
        # The USER_ABORTED that carries the abort out: admitted, in the one statement.
        step = next_commit(aborting)
        abort = Commit(
            attrs.evolve(
                step.run,
                state="canceled",
                status=RunLifecycle.ABORTED,
                abort_reason=None,
                lease_owner=None,
                lease_expires_at=None,
            ),
            attrs.evolve(step.transition, event=USER_ABORTED, to_state="canceled"),
        )
        assert postgres_journal.commit_many([next_commit(ok2), abort]) == [None, None]
        assert outcomes == [False, True]
        ended = postgres_journal.load(aborting.run_id)
        assert (ended.state, ended.status, ended.abort_reason) == (
            "canceled",
            RunLifecycle.ABORTED,
            None,
        )
        assert postgres_journal.integrity_problems() == []

    def test_a_lease_taken_over_refuses_its_commit_in_the_group_statement(
        self, postgres_journal, monkeypatch
    ):
        """Fenced by the lease token (were the commit admitted, the group would be stored whole)."""
        outcomes = self.spy(monkeypatch)
        engine = engine_for(postgres_journal)
        ok, fenced = (postgres_journal.load(engine.start()) for _ in range(2))
        postgres_journal.claim(fenced.run_id, "w2", ttl=60)
        results = postgres_journal.commit_many([next_commit(ok), next_commit(fenced)])
        assert outcomes == [False]
        assert results[0] is None
        assert isinstance(results[1], LeaseLostError)
        assert [t.seq for t in postgres_journal.transitions(fenced.run_id)] == [0]
