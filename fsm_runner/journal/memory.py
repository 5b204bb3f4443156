"""An in-memory journal with the same contract as the SQLite one: for tests and throwaway runs.

Records are frozen, so storing the objects themselves is safe; JSON payloads are checked on
write exactly as the SQLite journal checks them, so code that passes here passes there.
"""

from __future__ import annotations

import datetime as dt
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from fsm_runner import _fork
from fsm_runner._json import dumps_json
from fsm_runner.events import USER_ABORTED
from fsm_runner.exceptions import (
    JournalError,
    LeaseLostError,
    RunConflictError,
    RunExistsError,
    RunNotFoundError,
    RunTerminalError,
)
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._head import check_stored_id
from fsm_runner.journal._memory_chain import MemoryDigests
from fsm_runner.journal._memory_mailbox import MemoryMailbox
from fsm_runner.journal._search_indexes import MemorySearchIndexes
from fsm_runner.journal.base import (
    Commit,
    NewRun,
    PruneReport,
    Renewal,
    RunFilters,
    claim_each,
    new_runs,
    renewals,
)
from fsm_runner.journal.search import RunSearch
from fsm_runner.records import (
    ArtifactRecord,
    EffectRecord,
    IterationRecord,
    RunRecord,
    SignalRecord,
    TransitionRecord,
    unstructure,
    utc_now,
)
from fsm_runner.run_ids import check_run_id, check_run_ids
from fsm_runner.spec import RunLifecycle

if TYPE_CHECKING:
    from typing_extensions import Unpack


__all__ = ["MemoryJournal"]

#: A wake time given to :meth:`MemoryJournal.park` (``None``: none), and the names it accepts.
Wake = dt.datetime | None
Names = Collection[str]


def _check_json(*values: Any) -> None:
    # The SQL journals' own encoder: this journal refuses exactly what they refuse.
    for value in values:
        if value is not None:
            try:
                dumps_json(value)
            except ValueError as exc:
                raise JournalError(f"payload {exc}; nothing was written") from None


def _check_pair(run: RunRecord, transition: TransitionRecord) -> None:
    if run.seq != transition.seq or run.state != transition.to_state:
        raise ValueError("run.seq and run.state must equal the transition's seq and to_state")


def _listed(runs: list[RunRecord], by_update: bool) -> list[RunRecord]:
    """The runs (in insertion order) newest first, or (``by_update``) updated last first."""
    ordered = runs[::-1]  # insertion order is creation order
    ordered.sort(key=lambda run: run.created_at, reverse=True)
    if by_update:  # stable: runs updated at once stay newest first
        ordered.sort(key=lambda run: run.updated_at, reverse=True)
    return ordered


def _keyset(runs: list[RunRecord], before: str | None, after: str | None) -> list[RunRecord]:
    """The runs listed after ``before`` and before ``after`` (a keyset page's bounds)."""
    for bound, later in ((before, True), (after, False)):
        if bound is not None:
            ids = [run.run_id for run in runs]
            if bound not in ids:
                return []
            at = ids.index(bound)
            runs = runs[at + 1 :] if later else runs[:at]
    return runs


def _select(
    runs: Iterable[RunRecord],
    wanted: Mapping[str, object],
    run_id_prefix: str | None,
    in_flight: set[str] | None,
) -> list[RunRecord]:
    """The ``runs`` whose fields equal ``wanted``'s (``None``: any field), with that prefix.

    Unless ``in_flight`` is ``None``, only runs it names (those with an effect in flight).
    """
    wanted = {field: value for field, value in wanted.items() if value is not None}
    return [
        run
        for run in runs
        if all(getattr(run, field) == value for field, value in wanted.items())
        and (not run_id_prefix or run.run_id.startswith(run_id_prefix))
        and (in_flight is None or run.run_id in in_flight)
    ]


def _searched(runs: list[RunRecord], search: RunSearch | None) -> list[RunRecord]:
    """The ``runs`` a search finds (all of them without one)."""
    if search is None:
        return runs
    return [run for run in runs if search.admits(run.created_at, run.input, run.context)]


def _stale(run: RunRecord, now: dt.datetime) -> bool:
    """Whether ``run`` is active with a lease that has expired."""
    return (
        not run.ended
        and run.lease_owner is not None
        and run.lease_expires_at is not None
        and run.lease_expires_at < now
    )


def _committed(stored: RunRecord, run: RunRecord, aborting: bool, new_spec: bool) -> RunRecord:
    """The stored row after a commit: only the columns a commit owns change (as in SQL)."""
    return attrs.evolve(
        stored,
        spec_hash=run.spec_hash if new_spec else stored.spec_hash,
        state=run.state,
        status=run.status,
        seq=run.seq,
        iteration=run.iteration,
        attempt=run.attempt,
        context=run.context,
        error=run.error,
        updated_at=run.updated_at,
        return_to=run.return_to,
        return_attempt=run.return_attempt,
        visit_seq=run.visit_seq,
        return_visit=run.return_visit,
        # an abort request stays until the USER_ABORTED commit that carries it out
        abort_reason=None if aborting else stored.abort_reason,
        # a run that ends lets go of its lease (its token stays, as a release leaves it)
        lease_owner=None if run.ended else stored.lease_owner,
        lease_expires_at=None if run.ended else stored.lease_expires_at,
    )


def _unchanged(stored: RunRecord, run: RunRecord) -> bool:
    """Whether the stored run is still as ``run`` shows it, active and unleased."""
    return (
        not stored.ended
        and stored.seq == run.seq
        and stored.lease_token == run.lease_token
        and stored.lease_owner is None
        and stored.abort_reason is None
    )


def _copy_history(
    tables: tuple[
        dict[str, list[TransitionRecord]],
        dict[str, dict[int, IterationRecord]],
        dict[str, dict[str, ArtifactRecord]],
        dict[str, dict[tuple[int, str], EffectRecord]],
    ],
    source_id: str,
    run: RunRecord,
    at_seq: int,
) -> None:
    """A fork's history: the source's transitions, iterations, artifacts and effects by then."""
    transitions, iterations, artifacts, effects = tables
    new_id = run.run_id
    transitions[new_id] = [
        attrs.evolve(t, run_id=new_id, lease_token=0)  # written under the fork's leases
        for t in transitions[source_id]
        if t.seq <= at_seq
    ]
    iterations[new_id] = {
        number: attrs.evolve(record, run_id=new_id)
        for number, record in iterations.get(source_id, {}).items()
        if number <= run.iteration
    }
    artifacts[new_id] = {
        name: attrs.evolve(artifact, run_id=new_id)
        for name, artifact in artifacts.get(source_id, {}).items()
        if artifact.seq <= at_seq
    }
    effects[new_id] = {
        key: attrs.evolve(effect, run_id=new_id)
        for key, effect in effects.get(source_id, {}).items()
        if effect.visit_seq < run.visit_seq
    }


def _prunable(runs: Collection[RunRecord], ended_before: dt.datetime) -> list[RunRecord]:
    """The ended runs updated before ``ended_before`` whose parent (if any) ended, oldest first."""
    live_parents = {run.parent_run_id for run in runs if not run.ended}
    return sorted(
        (
            run
            for run in runs
            if run.ended and run.updated_at < ended_before and run.run_id not in live_parents
        ),
        key=lambda run: run.updated_at,
    )


#: The memory journal's tables of runs, by attribute (each keyed by run id): prune's.
_RUN_TABLES = ("_runs", "_transitions", "_iterations", "_artifacts", "_effects", "_abort_tokens")


class MemoryJournal:
    """A journal held in this process's memory; gone when the process ends.

    Its ``_lock`` guards all of it: held still across a fork, and new in the child, which
    copies the journal whole (see :mod:`fsm_runner._fork`).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        _fork.register(self)
        self._runs: dict[str, RunRecord] = {}
        self._transitions: dict[str, list[TransitionRecord]] = {}
        self._specs: dict[str, str] = {}
        self._iterations: dict[str, dict[int, IterationRecord]] = {}
        self._artifacts: dict[str, dict[str, ArtifactRecord]] = {}
        self._effects: dict[str, dict[tuple[int, str], EffectRecord]] = {}
        self.search_indexes = MemorySearchIndexes()  # kept only: searches read memory anyway
        # run id -> the lease token the run had when its abort was requested (the SQLite
        # journal's run_rows.abort_token): commits under it may only carry the abort out
        self._abort_tokens: dict[str, int] = {}
        self._mailbox = MemoryMailbox()  # signals and wake times (see Journal.park)
        self._digests = MemoryDigests()  # each run's chain, each row's digest (as SQLite's)
        self._closed = False

    def _before_fork(self) -> Callable[[], None] | None:
        return self._lock.release if self._lock.acquire(timeout=_fork.WAIT) else None

    def _after_fork(self) -> None:
        self._lock = threading.RLock()

    @property
    def location(self) -> str:
        """Always ``:memory:``."""
        return ":memory:"

    def __repr__(self) -> str:
        return f"MemoryJournal(runs={len(self._runs)})"

    def __enter__(self) -> MemoryJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Mark the journal closed; its data stays readable to nobody."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise JournalError("is closed", path=":memory:")

    def create_run(
        self,
        run: RunRecord,
        first: TransitionRecord,
        *,
        spec_json: str,
        iterations: Sequence[IterationRecord] = (),
    ) -> None:
        """Store a new run with its transition seq 0, its spec and iterations."""
        self.create_runs([(run, first, iterations)], spec_json=spec_json)

    def create_runs(self, runs: Sequence[NewRun], *, spec_json: str) -> None:
        """Store new runs, each with its transition seq 0 and iterations: all or none."""
        check_run_ids([run.run_id for run, _, _ in runs])
        for run, first, _ in new_runs(runs):
            _check_json(run.input, run.context, run.error, first.result)
        with self._lock:
            self._check_open()
            seen: set[str] = set()
            for run, _, _ in runs:
                if run.run_id in self._runs or run.run_id in seen:
                    raise RunExistsError(run.run_id)
                seen.add(run.run_id)
            for run, first, iterations in runs:
                self._specs.setdefault(run.spec_hash, spec_json)
                self._runs[run.run_id] = run
                self._transitions[run.run_id] = [self._digests.started(run, first, iterations)]
                self._iterations[run.run_id] = {record.iteration: record for record in iterations}

    def commit(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        *,
        iterations: Sequence[IterationRecord] = (),
        artifacts: Sequence[ArtifactRecord] = (),
        spec_json: str | None = None,
    ) -> None:
        """Store ``transition`` and the run row it leads to, with iterations and artifacts."""
        _check_pair(run, transition)
        _check_json(run.context, run.error, transition.result)
        _check_json(*(unstructure(i) for i in iterations), *(unstructure(a) for a in artifacts))
        with self._lock:
            self._check_open()
            stored = self._runs.get(run.run_id)
            token, expected = transition.lease_token, transition.seq - 1
            aborting = transition.event == USER_ABORTED
            fence = self._abort_tokens.get(run.run_id)
            found = (
                None
                if stored is None
                else (stored.seq, stored.lease_token, stored.abort_reason, fence)
            )
            if stored is None or not _lease.admits(found, expected, token, aborting=aborting):
                raise _lease.commit_refusal(found, run.run_id, expected, token, path=":memory:")
            if aborting:
                self._abort_tokens.pop(run.run_id, None)
            if run.ended:
                self._mailbox.wakes.pop(run.run_id, None)
            if spec_json is not None:
                self._specs.setdefault(run.spec_hash, spec_json)
            self._runs[run.run_id] = _committed(stored, run, aborting, spec_json is not None)
            stored_run = self._runs[run.run_id]
            rows = [*iterations, *artifacts]
            self._transitions[run.run_id].append(
                self._digests.committed(stored_run, transition, rows)
            )
            for record in iterations:
                self._iterations.setdefault(run.run_id, {})[record.iteration] = record
            for artifact in artifacts:
                named = self._artifacts.setdefault(run.run_id, {})
                named.pop(artifact.name, None)  # replaced by name, and ordered as committed
                named[artifact.name] = artifact

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits; each is refused or stored on its own, as by :meth:`commit`."""
        results: list[Exception | None] = []
        with self._lock:
            for item in commits:
                try:
                    self.commit(
                        item.run,
                        item.transition,
                        iterations=item.iterations,
                        artifacts=item.artifacts,
                        spec_json=item.spec_json,
                    )
                except Exception as exc:  # noqa: BLE001, PERF203 - refused alone, returned
                    results.append(exc)
                else:
                    results.append(None)
        return results

    def request_abort(self, run_id: str, reason: str) -> RunRecord:
        """Mark an active run as to be aborted; its lease's writes are fenced but for the abort."""
        with self._lock:
            run = self.load(run_id)
            if run.ended:
                raise RunTerminalError(run_id=run_id, state=run.state, status=run.status.value)
            run = self._runs[run_id] = attrs.evolve(run, abort_reason=reason)
            self._abort_tokens[run_id] = run.lease_token
            return run

    def load(self, run_id: str) -> RunRecord:
        """Return the run's row."""
        with self._lock:
            self._check_open()
            try:
                return self._runs[run_id]
            except KeyError:
                raise RunNotFoundError(run_id) from None

    def effect(self, run_id: str, visit_seq: int, name: str) -> EffectRecord | None:
        """Return the effect recorded under that name in that visit, if any."""
        with self._lock:
            self._check_open()
            return self._effects.get(run_id, {}).get((visit_seq, name))

    def effects(self, run_id: str) -> list[EffectRecord]:
        """Return the run's effects, in the order they were started."""
        with self._lock:
            self.load(run_id)
            return list(self._effects.get(run_id, {}).values())

    def put_effect(
        self, record: EffectRecord, *, run_seq: int, lease_token: int | None = None
    ) -> None:
        """Store ``record`` only while the run is still at ``run_seq`` (and ``lease_token``)."""
        _check_json(record.params, record.result, record.error)
        with self._lock:
            run = self.load(record.run_id)
            if lease_token is not None and run.lease_token != lease_token:
                raise LeaseLostError(record.run_id, token=lease_token)
            if run.seq != run_seq:
                raise RunConflictError(run_id=record.run_id, expected_seq=run_seq, path=":memory:")
            ledger = self._effects.setdefault(record.run_id, {})
            ledger[record.visit_seq, record.name] = record
            self._digests.stored(record.run_id, [record])

    def iteration(self, run_id: str, iteration: int) -> IterationRecord | None:
        """Return the run's record of that iteration, if there is one."""
        with self._lock:
            self._check_open()
            return self._iterations.get(run_id, {}).get(iteration)

    def iterations(self, run_id: str) -> list[IterationRecord]:
        """Return the run's iteration records, in iteration order."""
        with self._lock:
            self.load(run_id)
            return [record for _, record in sorted(self._iterations.get(run_id, {}).items())]

    def artifacts(self, run_id: str) -> list[ArtifactRecord]:
        """Return the run's artifacts, in the order they were committed."""
        with self._lock:
            self.load(run_id)
            return list(self._artifacts.get(run_id, {}).values())

    def transitions(
        self, run_id: str, *, from_seq: int = 0, to_seq: int | None = None
    ) -> list[TransitionRecord]:
        """Return the run's transitions with ``from_seq <= seq <= to_seq``, in seq order."""
        with self._lock:
            self.load(run_id)
            return [
                t
                for t in self._transitions[run_id]
                if t.seq >= from_seq and (to_seq is None or t.seq <= to_seq)
            ]

    def runs(
        self,
        *,
        machine: str | None = None,
        status: RunLifecycle | str | None = None,
        parent_run_id: str | None = None,
        limit: int | None = None,
        effect_in_flight: bool = False,
        state: str | None = None,
        stale: bool = False,
        run_id_prefix: str | None = None,
        before: str | None = None,
        after: str | None = None,
        search: RunSearch | None = None,
        by_update: bool = False,
    ) -> list[RunRecord]:
        """Return runs, newest first, filtered (:meth:`Journal.runs`)."""
        with self._lock:
            self._check_open()
            ordered = list(self._runs.values())
            in_flight = {
                run_id
                for run_id, ledger in self._effects.items()
                if any(e.status.value == "in_flight" for e in ledger.values())
            }
        ordered = _keyset(_listed(ordered, by_update), before, after)
        wanted = {
            "machine": machine,
            "status": RunLifecycle(status) if status is not None else None,
            "parent_run_id": parent_run_id,
            "state": state,
        }
        selected = _select(ordered, wanted, run_id_prefix, in_flight if effect_in_flight else None)
        selected = _searched(selected, search)
        if stale:
            now = utc_now()
            selected = [run for run in selected if _stale(run, now)]
        if limit is None:
            return selected
        # After a run: the ones closest to it, at the end of the newest-first list.
        return selected[max(len(selected) - limit, 0) :] if after is not None else selected[:limit]

    def count_runs(self, *, at_most: int | None = None, **filters: Unpack[RunFilters]) -> int:
        """How many runs :meth:`runs` would list with these filters (at most ``at_most``)."""
        return min(len(self.runs(**filters)), sys.maxsize if at_most is None else at_most)

    def run_counts(self, *, machine: str) -> dict[tuple[str, str], int]:
        """Return how many runs of ``machine`` there are per (state, status), now."""
        with self._lock:
            self._check_open()
            found = [(r.state, r.status.value) for r in self._runs.values() if r.machine == machine]
        counts: dict[tuple[str, str], int] = {}
        for key in found:
            counts[key] = counts.get(key, 0) + 1
        return counts

    def transition_counts(self, run_id: str) -> list[tuple[str | None, str, str, int, int]]:
        """How often the run took each move: ``(from, event, to, count, last seq)``, by last seq."""
        counts: dict[tuple[str | None, str, str], list[int]] = {}
        for t in self.transitions(run_id) if run_id in self._runs else ():
            found = counts.setdefault((t.from_state, t.event, t.to_state), [0, 0])
            found[0] += 1
            found[1] = t.seq
        moves = [(*key, n, last) for key, (n, last) in counts.items()]
        return sorted(moves, key=lambda move: move[4])

    def run_ids(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Return up to ``limit`` run ids that start with ``prefix``."""
        with self._lock:
            self._check_open()
            return sorted(run_id for run_id in self._runs if run_id.startswith(prefix))[:limit]

    def spec_json(self, spec_hash: str) -> str:
        """Return the canonical JSON of the spec with that hash."""
        with self._lock:
            self._check_open()
            try:
                text = self._specs[spec_hash]
            except KeyError:
                raise JournalError(f"holds no spec {spec_hash[:12]}", path=":memory:") from None
        return _rows.checked_spec_json(spec_hash, text, path=":memory:")

    def claim(
        self, run_id: str, owner: str, *, ttl: float, take_over: str | None = None
    ) -> RunRecord:
        """Take the run's lease for ``ttl`` seconds; its token increases by one."""
        now = utc_now()
        with self._lock:
            run = self.load(run_id)
            self._digests.verify(run, self._transitions.get(run_id, []))
            takeover = _lease.grant(run, owner, now, take_over=take_over)
            expires = now + dt.timedelta(seconds=ttl)
            claimed = self._runs[run_id] = _lease.claimed(run, owner, expires, takeover=takeover)
            return claimed

    def claim_unchanged(self, run: RunRecord, owner: str, *, ttl: float) -> RunRecord | None:
        """Claim ``run``'s lease if the stored run is still as ``run`` shows it; else ``None``."""
        expires = utc_now() + dt.timedelta(seconds=ttl)
        with self._lock:
            self._check_open()
            stored = self._runs.get(run.run_id)
            if stored is None or not _unchanged(stored, run):
                return None
            claimed = self._runs[run.run_id] = _lease.claimed(
                stored, owner, expires, takeover=False
            )
            return claimed

    def claim_many(
        self,
        run_ids: Sequence[str],
        owner: str,
        *,
        ttl: float,
        check: Callable[[RunRecord], object] | None = None,
    ) -> list[RunRecord | Exception]:
        """Claim several runs' leases, each granted or refused on its own."""
        with self._lock:
            return claim_each(self, run_ids, owner, ttl=ttl, check=check)

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        machine: str,
        states: Collection[str],
        spec_hash: str | None = None,
    ) -> RunRecord | None:
        """Claim the oldest runnable run, or ``None``."""
        now = utc_now()
        with self._lock:
            self._check_open()
            runnable = [
                run
                for run in self._runs.values()
                if not run.ended
                and run.machine == machine
                and (
                    (run.state in states and run.run_id not in self._mailbox.wakes)
                    or self._mailbox.due(run.run_id, now)
                )
                and (spec_hash is None or run.spec_hash == spec_hash)
                and _lease.unheld(run, now)
            ]
            ordered = sorted(runnable, key=lambda run: run.created_at)
            chosen = self._digests.first_sound(ordered, self._transitions)
            return None if chosen is None else self.claim(chosen.run_id, owner, ttl=ttl)

    def park(self, run_id: str, owner: str, token: int, *, wake_at: Wake, accepts: Names) -> bool:
        """Give up the lease and set when the run is due (now, if an accepted signal waits)."""
        with self._lock:
            if self.release(run_id, owner, token):
                self._mailbox.park(run_id, wake_at, accepts)
                return True
            return False

    def wake_time(self, run_id: str) -> dt.datetime | None:
        """The run's wake time, if it has one."""
        with self._lock:
            return self._mailbox.wakes.get(self.load(run_id).run_id)

    def next_wake(self, *, machine: str) -> dt.datetime | None:
        """The earliest wake time of the machine's active runs nobody holds, if any."""
        with self._lock:
            runs = (run for run in self._runs.values() if run.machine == machine)
            return self._mailbox.next_wake(runs, utc_now())

    def put_signal(self, signal: SignalRecord) -> SignalRecord:
        """Journal a signal pending for its run (see ``Journal.put_signal``)."""
        check_stored_id(signal.run_id)  # a run under an id that breaks the rule is read-only
        _check_json(signal.payload)
        with self._lock:
            return self._mailbox.put(signal, self.load(signal.run_id))

    def idle(self, *, timeout: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout`` seconds for a signal to come (see ``Journal.idle``)."""
        return self._mailbox.bell.wait(timeout=timeout, stop=stop)

    def signals(self, run_id: str, *, pending: bool = False) -> list[SignalRecord]:
        """The run's signals in arrival order (pending ones only, with ``pending``)."""
        with self._lock:
            return self._mailbox.listed(self._runs.get(run_id), pending=pending)

    def consume_signal(self, run: RunRecord, transition: TransitionRecord, number: int) -> None:
        """Commit the transition and mark signal ``number`` consumed by it, at once."""
        with self._lock:
            self._mailbox.check(run.run_id, number, transition)  # refused: nothing written
            self.commit(run, transition)
            self._mailbox.take(run.run_id, number, transition)

    def renew(self, run_id: str, owner: str, token: int, *, ttl: float) -> dt.datetime:
        """Extend the lease ``owner`` holds with ``token`` by ``ttl`` seconds from now."""
        expires = utc_now() + dt.timedelta(seconds=ttl)
        with self._lock:
            run = self.load(run_id)
            if not _lease.holds(run, owner, token):
                raise LeaseLostError(run_id, token=token)
            self._runs[run_id] = attrs.evolve(run, lease_expires_at=expires)
        return expires

    def renew_many(
        self, leases: Sequence[tuple[str, int]], owner: str, *, ttl: float
    ) -> dict[str, Renewal]:
        """Renew the ``(run_id, token)`` leases ``owner`` holds, at once (see ``Journal``)."""
        expires = utc_now() + dt.timedelta(seconds=ttl)
        found = {}
        with self._lock:
            self._check_open()
            for run_id, token in leases:
                run = self._runs.get(run_id)
                if run is None:
                    continue
                if _lease.holds(run, owner, token):
                    run = self._runs[run_id] = attrs.evolve(run, lease_expires_at=expires)
                row = (run.lease_owner, run.lease_token, run.abort_reason, run.status.value)
                found[run_id] = row
        return renewals(leases, owner, found)

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token``; ``False`` if it no longer held it."""
        with self._lock:
            run = self.load(run_id)
            if not _lease.holds(run, owner, token):
                return False
            self._runs[run_id] = attrs.evolve(run, lease_owner=None, lease_expires_at=None)
            self._mailbox.unpark(run_id)
        return True

    def release_many(self, leases: Sequence[tuple[str, int]], owner: str) -> dict[str, str | None]:
        """Give up the ``(run_id, token)`` leases ``owner`` holds, at once (see ``Journal``)."""
        reasons: dict[str, str | None] = {}
        with self._lock:
            self._check_open()
            for run_id, token in leases:
                run = self._runs.get(run_id)
                if run is not None:  # the abort reason stays as it is
                    self.release(run_id, owner, token)
                reasons[run_id] = None if run is None else run.abort_reason
        return reasons

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        check_run_id(run.run_id)
        _rows.check_fork(run, at_seq)
        with self._lock:
            source = self.load(source_run_id)
            _rows.check_fork_source(source_run_id, source.seq, at_seq)
            self._digests.verify_source(source, self._transitions.get(source_run_id, []), at_seq)
            if run.run_id in self._runs:
                raise RunExistsError(run.run_id)
            self._runs[run.run_id] = run
            tables = (self._transitions, self._iterations, self._artifacts, self._effects)
            _copy_history(tables, source_run_id, run, at_seq)
            self._digests.forked(run, tables)

    def prune(self, *, ended_before: dt.datetime, dry_run: bool = False) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, with all they own."""
        with self._lock:
            self._check_open()
            doomed = _prunable(self._runs.values(), ended_before)
            ids = tuple(run.run_id for run in doomed)
            count = sum(len(self._transitions.get(run_id, ())) for run_id in ids)
            if not dry_run:
                for run_id in ids:
                    for name in _RUN_TABLES:
                        getattr(self, name).pop(run_id, None)
                    self._mailbox.forget(run_id)
                    self._digests.forget(run_id)
                used = {run.spec_hash for run in self._runs.values()}
                self._specs = {h: text for h, text in self._specs.items() if h in used}
        return PruneReport(ids, count, dry_run=dry_run)

    def integrity_problems(self) -> list[str]:
        """The records that no longer match their digests (see ``_memory_chain``)."""
        with self._lock:
            self._check_open()
            tables = (self._transitions, self._iterations, self._artifacts, self._effects)
            return self._digests.problems(self._runs, tables)
