"""The journal seam: where runs and their transitions are stored.

The engine talks to storage only through :class:`Journal`. Every implementation keeps the same
contract, and the journal test suite runs against each of them:

* :meth:`Journal.create_run` writes a run row and its transition seq 0 in one transaction,
  together with the spec's canonical JSON (kept once per spec hash).
* :meth:`Journal.commit` writes the next transition and the updated run row in one
  transaction. It is refused — writing nothing — unless the stored run's last seq is exactly the
  one before the new transition's (``RunConflictError``), so two writers can never both advance
  one run from the same state, and seqs have no gaps.
* :meth:`Journal.load` reads the run row alone: resuming never replays history.
* A worker :meth:`Journal.claim` s a run's lease before advancing it; each claim raises the
  run's lease token, and a commit is refused (``LeaseLostError``) unless its transition carries
  the current token — a worker whose lease was taken over cannot write (fencing).
* Every failure of the medium (locked, full, read-only, corrupt) is a :class:`JournalError`;
  nothing half-written is ever visible.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal, Protocol, TypedDict, runtime_checkable

import attrs

from fsm_runner.journal.search import RunSearch
from fsm_runner.records import (
    ArtifactRecord,
    EffectRecord,
    IterationRecord,
    RunRecord,
    SignalRecord,
    TransitionRecord,
)
from fsm_runner.spec import RunLifecycle

__all__ = [
    "Commit",
    "Durability",
    "Journal",
    "ListFilters",
    "NewRun",
    "PruneReport",
    "Renewal",
    "RunFilters",
    "claim_each",
    "new_runs",
    "renewals",
]

#: ``process``: a commit survives the process being killed (SQLite synchronous=NORMAL in WAL);
#: ``power``: it also survives power loss (synchronous=FULL).
Durability = Literal["process", "power"]


class RunFilters(TypedDict, total=False):
    """The filters :meth:`Journal.runs` and :meth:`Journal.count_runs` share (as keywords)."""

    machine: str | None
    status: RunLifecycle | str | None
    parent_run_id: str | None
    state: str | None
    run_id_prefix: str | None
    search: RunSearch | None


class ListFilters(RunFilters, total=False):
    """:meth:`Journal.runs`'s keywords: the shared filters, and its own."""

    limit: int | None
    effect_in_flight: bool
    stale: bool
    before: str | None
    after: str | None
    by_update: bool


@attrs.frozen
class Commit:
    """One run's commit in a group (:meth:`Journal.commit_many`): the arguments of ``commit``.

    Attributes:
        run: the run row the transition leads to.
        transition: the transition.
        iterations: iteration records stored with it.
        artifacts: artifacts stored with it.
        spec_json: the spec the run moves to, if it changes spec.
    """

    run: RunRecord
    transition: TransitionRecord
    iterations: Sequence[IterationRecord] = ()
    artifacts: Sequence[ArtifactRecord] = ()
    spec_json: str | None = None


#: A new run for :meth:`create_runs`: its row, its transition seq 0 and its iterations.
NewRun = tuple[RunRecord, TransitionRecord, Sequence[IterationRecord]]


def new_runs(runs: Sequence[NewRun]) -> Sequence[NewRun]:
    """``runs``, checked to be under one spec (``create_runs`` stores one spec with them).

    Raises:
        ValueError: two of them are under different specs.
    """
    hashes = {run.spec_hash for run, _, _ in runs}
    if len(hashes) > 1:
        raise ValueError(f"runs created together are under one spec, not {len(hashes)}")
    return runs


@attrs.frozen
class Renewal:
    """What ``renew_many`` found of one lease, for the heartbeat to pass on.

    Attributes:
        renewed: the lease was extended; ``False``: it is no longer held with that token (taken
            over, let go, or the run is gone).
        abort_reason: an abort requested of the run, if any.
        ended: the run has ended.
    """

    renewed: bool
    abort_reason: str | None = None
    ended: bool = False


def renewals(
    leases: Sequence[tuple[str, int]],
    owner: str,
    found: Mapping[str, tuple[str | None, int, str | None, str]],
) -> dict[str, Renewal]:
    """Each lease's :class:`Renewal`, from the rows read right after the renewal.

    ``found``: by run id, the stored lease owner, lease token, abort reason and status.
    """
    result = {}
    for run_id, token in leases:
        row = found.get(run_id)
        if row is None:
            result[run_id] = Renewal(renewed=False)
            continue
        holder, stored_token, reason, status = row
        result[run_id] = Renewal(
            renewed=holder == owner and stored_token == token,
            abort_reason=reason,
            ended=status != RunLifecycle.ACTIVE.value,
        )
    return result


@attrs.frozen
class PruneReport:
    """What :meth:`Journal.prune` deleted (or, on a dry run, would delete).

    Attributes:
        run_ids: the runs pruned, oldest first.
        transitions: how many transitions they owned.
        dry_run: nothing was deleted.
        bytes_before: the journal's size on disk before (``None`` where it has no file).
        bytes_after: its size after space was reclaimed.
    """

    run_ids: tuple[str, ...]
    transitions: int
    dry_run: bool
    bytes_before: int | None = None
    bytes_after: int | None = None


@runtime_checkable
class Journal(Protocol):
    """Durable storage of runs and their transitions."""

    @property
    def location(self) -> str:
        """Where the journal lives, for messages (a path, ``:memory:``, a URL)."""

    def create_run(
        self,
        run: RunRecord,
        first: TransitionRecord,
        *,
        spec_json: str,
        iterations: Sequence[IterationRecord] = (),
    ) -> None:
        """Store a new run with its transition seq 0, its spec and iterations, in one transaction.

        A journal may also offer ``create_runs(runs: Sequence[NewRun], *, spec_json)``: many
        new runs under one spec in ONE transaction, all or nothing (the built-in journals do;
        ``Engine.start_many`` uses it, else calls this once per run).

        Raises:
            RunExistsError: a run with that id exists.
            JournalError: the medium failed; nothing was written.
        """

    def commit(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        *,
        iterations: Sequence[IterationRecord] = (),
        artifacts: Sequence[ArtifactRecord] = (),
        spec_json: str | None = None,
    ) -> None:
        """Store ``transition`` and the run row it leads to (``run``), in one transaction.

        ``transition.seq`` must be one more than the stored run's seq; ``run.seq`` and
        ``run.state`` must equal the transition's ``seq`` and ``to_state``. ``iterations`` are
        stored (inserted or replaced by run and iteration) and ``artifacts`` stored (replaced by
        run and name) in the same transaction. An abort request on the run stays until the
        ``USER_ABORTED`` transition that carries it out; meanwhile every other transition
        written under the lease token the run had when the abort was requested (or an older
        one) is refused: a holder that has not seen the request learns of it at its next
        commit, so the run it holds can only end aborted. (A writer that claims the run after
        the request has read it.) With ``spec_json``, the run moves to that spec
        (``run.spec_hash``), which is stored like the one a run starts with.

        Raises:
            RunNotFoundError: no such run.
            RunConflictError: the stored run is not at ``transition.seq - 1`` (another writer
                advanced it), or an abort was requested under the transition's lease token
                (``abort_reason``) and it is not ``USER_ABORTED``; nothing was written.
            JournalError: the medium failed; nothing was written.
        """

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits in ONE transaction: a group commit, one durable write for all.

        Each commit is checked exactly as :meth:`commit` checks it, on its own: one that is
        refused writes nothing and its error (``RunConflictError``, ``LeaseLostError``,
        ``RunNotFoundError``, ``ValueError``) is returned at its index, while the others are
        stored. When the transaction itself fails (disk full, locked past the busy timeout),
        nothing was written and every entry is that ``JournalError``. Nothing is durable
        before this returns.

        Returns:
            For each commit, ``None`` when it was stored, else why it was not.
        """

    def load(self, run_id: str) -> RunRecord:
        """Return the run's row.

        Raises:
            RunNotFoundError: no such run.
        """

    def effect(self, run_id: str, visit_seq: int, name: str) -> EffectRecord | None:
        """Return the effect recorded under that name in that visit of the run, if any."""

    def effects(self, run_id: str) -> Sequence[EffectRecord]:
        """Return the run's effects, in the order they were started."""

    def put_effect(
        self, record: EffectRecord, *, run_seq: int, lease_token: int | None = None
    ) -> None:
        """Store an effect record in its own transaction, only while the run is at ``run_seq``.

        Recording an effect ``in_flight`` before calling it and its outcome after are separate
        commits: that is what lets a resumed run know an effect happened. With ``lease_token``,
        only while that is still the run's lease token (fencing, as for commits).

        Raises:
            RunConflictError: the run moved on meanwhile; nothing was written.
            LeaseLostError: the lease was taken over; nothing was written.
        """

    def iteration(self, run_id: str, iteration: int) -> IterationRecord | None:
        """Return the run's record of that iteration, if there is one."""

    def iterations(self, run_id: str) -> Sequence[IterationRecord]:
        """Return the run's iteration records, in iteration order."""

    def artifacts(self, run_id: str) -> Sequence[ArtifactRecord]:
        """Return the run's artifacts, in the order they were committed."""

    def transitions(
        self, run_id: str, *, from_seq: int = 0, to_seq: int | None = None
    ) -> Sequence[TransitionRecord]:
        """Return the run's transitions with ``from_seq <= seq <= to_seq``, in seq order.

        Raises:
            RunNotFoundError: no such run.
        """

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
    ) -> Sequence[RunRecord]:
        """Return runs, newest first, filtered by machine, status, parent and state.

        ``effect_in_flight`` keeps runs with an effect whose outcome is unknown; ``stale`` keeps
        active runs whose lease has expired (their worker is gone); ``run_id_prefix`` keeps
        runs whose id starts with it. ``before`` (a run id) keeps only the runs listed after
        that run: the next page of a listing, read from an index whatever page it is.
        ``after`` keeps only the runs listed before that run, the ``limit`` closest to it
        (still newest first): the previous page. ``search`` keeps runs started in a range of
        time, or whose input or context holds a value at a path
        (:class:`~fsm_runner.journal.search.RunSearch`). ``by_update``: the runs updated last
        first (then newest first), pages by ``before``/``after`` alike; sorted as they are read
        (no index holds every run's last update: it moves with each step), so for a
        filtered few.
        """

    def count_runs(
        self,
        *,
        machine: str | None = None,
        status: RunLifecycle | str | None = None,
        parent_run_id: str | None = None,
        state: str | None = None,
        run_id_prefix: str | None = None,
        search: RunSearch | None = None,
        at_most: int | None = None,
    ) -> int:
        """Return how many runs :meth:`runs` would list with these filters.

        ``at_most``: stop counting there (a count of a big journal reads every run it counts).
        """

    def run_counts(self, *, machine: str) -> Mapping[tuple[str, str], int]:
        """Return how many runs of ``machine`` there are per (state, status), now."""

    def transition_counts(self, run_id: str) -> Sequence[tuple[str | None, str, str, int, int]]:
        """Return how often the run took each move, as ``(from, event, to, count, last seq)``.

        Ordered by each move's last seq: what a diagram of a long run needs, without reading
        every transition. An unknown run has none.
        """

    def run_ids(self, prefix: str, *, limit: int = 2) -> Sequence[str]:
        """Return up to ``limit`` run ids that start with ``prefix`` (for abbreviated ids)."""

    def spec_json(self, spec_hash: str) -> str:
        """Return the canonical JSON of the spec with that hash.

        Raises:
            JournalError: the journal does not hold that spec, or holds JSON for it that does
                not hash to it (damaged or edited by hand).
        """

    def request_abort(self, run_id: str, reason: str) -> RunRecord:
        """Mark an active run as to be aborted; its holder carries it out at its next step.

        From then on the journal refuses every transition its current lease holder writes but
        the ``USER_ABORTED`` that carries the abort out (see :meth:`commit`).

        Raises:
            RunNotFoundError: no such run.
            RunTerminalError: the run has already ended.
        """

    def claim(
        self, run_id: str, owner: str, *, ttl: float, take_over: str | None = None
    ) -> RunRecord:
        """Take the run's lease for ``ttl`` seconds, in one transaction; return the run row.

        Granted when nobody holds the lease, when it has expired (a takeover: the run's
        ``recoveries`` count increases by one), when ``owner`` holds it already, or when
        ``take_over`` names its live holder (one known to be dead; also a takeover). Every
        claim increases the run's ``lease_token``; commits carrying an older token are refused.

        Raises:
            RunNotFoundError: no such run.
            RunTerminalError: the run has ended.
            LeaseHeldError: another owner holds a live lease (its owner and expiry named).
        """

    def claim_many(
        self,
        run_ids: Sequence[str],
        owner: str,
        *,
        ttl: float,
        check: Callable[[RunRecord], object] | None = None,
    ) -> list[RunRecord | Exception]:
        """Claim several runs' leases at once, each granted or refused on its own.

        Each run is claimed as by :meth:`claim`, after ``check(run)`` is called with it as
        loaded; what either raises refuses that run: the error is returned at its index and
        nothing is written for it. The engine uses this to claim the runs it starts together
        (SQLite: in one transaction; see :func:`claim_each` for journals without one).
        """

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        machine: str,
        states: Collection[str],
        spec_hash: str | None = None,
    ) -> RunRecord | None:
        """Claim the oldest runnable run (first started), or return ``None`` when there is none.

        Runnable: active, of ``machine`` (and ``spec_hash`` if given), with no live lease, and
        either in one of ``states`` (those with a handler) with no wake time, or due: its wake
        time (see :meth:`park`, :meth:`put_signal`) has come, whatever its state (a run its
        phase parked, with a wake time to come, is not runnable before). Choosing and claiming
        are one transaction, so two workers never claim the same run; taking over an expired
        lease counts as a recovery, as in :meth:`claim`. A claim leaves the wake time as it is
        (a holder that dies leaves the run due); :meth:`release` drops one still to come (a
        run let go of without a park does not wait), and its holder parks a run that still
        waits. A run that ends has none.
        """

    def renew(self, run_id: str, owner: str, token: int, *, ttl: float) -> dt.datetime:
        """Extend the lease ``owner`` holds with ``token`` to ``ttl`` seconds from now.

        Returns:
            The new expiry.

        Raises:
            LeaseLostError: ``owner`` no longer holds the lease with ``token``.

        A journal may also offer ``renew_many(leases, owner, *, ttl) -> dict[str, Renewal]``:
        every ``(run_id, token)`` lease renewed in ONE transaction, and per run what the
        heartbeat passes on (still held? an abort requested? ended?). The built-in journals do;
        the engine's heartbeat uses it, else renews and loads run by run.
        """

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token`` (the token stays as it is).

        Returns:
            ``False`` when it no longer held that lease (nothing changed).

        A journal may also offer ``release_many(leases, owner) -> dict[str, str | None]``:
        every ``(run_id, token)`` lease given up in ONE transaction, and each run's abort
        reason (``None``: none requested, or no such run) read in it. The built-in journals
        do; ``Engine.close`` uses it for the runs it started holding and never drove, else
        releases and loads them run by run.
        """

    def park(
        self,
        run_id: str,
        owner: str,
        token: int,
        *,
        wake_at: dt.datetime | None,
        accepts: Collection[str],
    ) -> bool:
        """Give up the lease as :meth:`release` does, and set when the run is due, at once.

        In the same transaction: the run's wake time becomes now if a pending signal of the
        run is named in ``accepts`` (the signals its waiting state accepts: one sent while the
        run was held is not left behind), else ``wake_at`` (``None``: not before a signal
        comes). :meth:`claim_next` offers the run once its wake time has come.

        Returns:
            ``False`` when ``owner`` no longer held the lease with ``token`` (nothing changed).
        """

    def wake_time(self, run_id: str) -> dt.datetime | None:
        """Return the run's wake time (when :meth:`claim_next` offers it), if it has one.

        Raises:
            RunNotFoundError: no such run.
        """

    def next_wake(self, *, machine: str) -> dt.datetime | None:
        """Return the earliest wake time of the machine's active runs nobody holds, if any.

        One read of an index: what a worker sleeps until when nothing is runnable.

        A journal may also offer ``idle(*, timeout, stop) -> bool``: wait up to ``timeout``
        seconds, less when work may have come (``True``: a signal journaled, another
        process's commit) or ``stop`` (a ``threading.Event``) is set (``False``, as when the
        time is up). The built-in journals do (PostgreSQL's hears ``put_signal``'s
        ``NOTIFY``; SQLite's sees the file change); a worker with nothing to claim waits on
        it, else sleeps its poll interval out.
        """

    def put_signal(self, signal: SignalRecord) -> SignalRecord:
        """Journal a signal for its run, in one transaction; return it as stored.

        The journal numbers it (``signal.number`` is ignored: arrival order) and stores it
        pending with its payload (JSON, checked as other payloads are). The run is due at once
        (its wake time becomes now), so a worker looks at its mailbox even if the run was
        held when the signal came. If the run already has a signal with ``signal.signal_id``
        (not ``None``), nothing is written and that first signal is returned as it stands,
        whether the run has ended since or not.

        Raises:
            RunNotFoundError: no such run.
            RunTerminalError: the run has ended (and no signal with that id was stored);
                nothing was written.
            JournalError: the medium failed, or the payload cannot be stored; nothing was
                written.
        """

    def signals(self, run_id: str, *, pending: bool = False) -> Sequence[SignalRecord]:
        """Return the run's signals in arrival order (with ``pending``, the pending ones only).

        A pending signal of a run that has ended is returned ``expired`` (and not with
        ``pending``). An unknown run has none.
        """

    def consume_signal(self, run: RunRecord, transition: TransitionRecord, number: int) -> None:
        """:meth:`commit` the transition and mark signal ``number`` consumed by it, at once.

        The signal's ``consumed_seq`` and ``consumed_at`` become the transition's ``seq``
        and ``at``.

        Raises:
            RunConflictError: as :meth:`commit` raises it, or the signal is not a pending
                signal of this run (consumed already: a signal is consumed once); nothing was
                written.
            (and whatever :meth:`commit` raises, nothing written.)
        """

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``.

        In one transaction: the run row (as given: the source's row as it stood at ``at_seq``,
        with a new id and ``forked_from``), copies of the source's transitions 0..``at_seq``,
        its iteration records up to ``run.iteration``, its artifacts committed up to
        ``at_seq`` and its effects of visits that ended by then. The source is not changed.

        Raises:
            RunNotFoundError: no such source run.
            RunExistsError: a run with ``run.run_id`` exists.
            ValueError: ``at_seq`` is not one of the source's seqs, or ``run.seq != at_seq``.
        """

    def prune(self, *, ended_before: dt.datetime, dry_run: bool = False) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, with all they own.

        A run that has not ended, or whose child runs have not all ended, is never touched.
        Then reclaim the space (SQLite: ``VACUUM``).
        """

    def integrity_problems(self) -> list[str]:
        """Check the medium itself (SQLite: ``integrity_check``, dangling rows); ``[]`` if sound."""

    def close(self) -> None:
        """Release the journal's resources; further use raises ``JournalError``."""


def claim_each(
    journal: Journal,
    run_ids: Sequence[str],
    owner: str,
    *,
    ttl: float,
    check: Callable[[RunRecord], object] | None = None,
) -> list[RunRecord | Exception]:
    """:meth:`Journal.claim_many` as one :meth:`Journal.claim` after another."""
    results: list[RunRecord | Exception] = []
    for run_id in run_ids:
        try:
            if check is not None:
                check(journal.load(run_id))
            results.append(journal.claim(run_id, owner, ttl=ttl))
        except Exception as exc:  # noqa: BLE001, PERF203 - refused alone, returned at its index
            results.append(exc)
    return results
