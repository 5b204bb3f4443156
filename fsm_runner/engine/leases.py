"""The lease keeper: which runs an engine holds, and for how long it keeps holding them.

An engine claims a run before it advances it, renews the lease from a heartbeat thread while
it holds it, and lets go of it at the end (or on a clean stop). :class:`LeaseKeeper` owns all
of that: one :class:`_Hold` per run (its fencing token, or none yet while the claim is in
flight), the heartbeat, and the group claims of async runs (:class:`GroupClaimer`). It only
claims, renews and releases: what a run does once held is the drivers' (and the
:class:`~fsm_runner.engine.worker.Worker`'s, which takes runs from the journal).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from fsm_runner import _fork
from fsm_runner._json import dumps_json
from fsm_runner._lazy import LazyModule
from fsm_runner.engine import waits
from fsm_runner.engine.core import StepCore
from fsm_runner.engine.held import HeldRuns
from fsm_runner.exceptions import (
    FsmRunnerError,
    LeaseHeldError,
    LeaseLostError,
)
from fsm_runner.journal import Journal
from fsm_runner.journal.base import Renewal
from fsm_runner.records import RunRecord

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = [
    "GroupClaimer",
    "LeaseKeeper",
    "as_loaded",
    "holder_is_dead",
    "holder_is_gone",
    "new_worker_id",
    "unleased",
]

_log = logging.getLogger("fsm_runner.engine")


@attrs.frozen
class _Hold:
    """A run this engine holds: its lease's fencing token, ``None`` while the claim is in flight.

    ``fresh``: a run this engine started holding its lease (``Engine.start(claim=True)``) and
    has not driven since: the journal it was written to and the row as written, which the run's
    first drive here takes instead of claiming it.
    """

    token: int | None = None
    fresh: tuple[Journal, RunRecord] | None = None


_RESERVED = _Hold()
_TAKEN_OVER = "the run's lease was taken over by another worker"

#: How many runs this engine started and has not yet claimed it remembers (see
#: :meth:`LeaseKeeper.started`); past that the oldest are forgotten and claimed the usual way.
_REMEMBERED_STARTS = 10_000


class LeaseKeeper:
    """Claims, holds, renews and lets go of the leases of one engine's runs.

    Its settings are plain attributes, read at each use (a changed ``lease_ttl`` applies from
    the next claim); the journal is the core's, read at each use too.

    Args:
        core: the step core: its journal, and the checks a claimed run passes (may it run
            here; brought to the core's spec).
        held: the runs the process holds: the lock of the holds is its lock, and the heartbeat
            passes on to it the aborts it reads and cancels the phases of leases lost.
        worker_id: who holds the leases; a new one (host, pid, random) when not given, and
            then a forked child makes itself another (see :meth:`_after_fork`).
        lease_ttl: seconds a lease lasts unless renewed.
        heartbeat_interval: seconds between renewals (default: a third of ``lease_ttl``).
    """

    def __init__(
        self,
        core: StepCore,
        held: HeldRuns,
        *,
        worker_id: str | None = None,
        lease_ttl: float = 30.0,
        heartbeat_interval: float | None = None,
    ) -> None:
        self._core = core
        self._runs = held
        self._own_worker_id = worker_id is None
        self.worker_id = worker_id or new_worker_id()
        self.lease_ttl = lease_ttl
        self.heartbeat_interval = heartbeat_interval or lease_ttl / 3
        self._held: dict[str, _Hold] = {}
        self._heartbeat: threading.Thread | None = None
        self._stop_heartbeat = threading.Event()
        self._claimer: GroupClaimer | None = None
        #: runs this engine started, as it wrote them, until it claims them (by run id)
        self._started: dict[str, tuple[Journal, RunRecord]] = {}
        _fork.register(self)

    def _after_fork(self) -> None:
        """In a forked child: another worker, holding nothing (see ``_fork``).

        The parent's leases stay the parent's. A ``worker_id`` made here becomes a new one, so
        the child cannot claim as its own a run the parent holds; one given is kept (give each
        process its own).
        """
        if self._own_worker_id:
            self.worker_id = new_worker_id()
        self._held, self._started, self._claimer = {}, {}, None
        self._heartbeat, self._stop_heartbeat = None, threading.Event()

    def holds(self, run_id: str) -> bool:
        """Whether this engine holds the run, or is claiming it (read under the held runs' lock)."""
        return run_id in self._held

    def stop(self) -> None:
        """Stop the heartbeat (leases still held then expire) and forget the group claimer."""
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        self._stop_heartbeat.clear()
        self._claimer = None
        with self._runs.lock:
            self._started.clear()

    # -- claiming ------------------------------------------------------------------------------

    def started(self, runs: Sequence[RunRecord]) -> None:
        """Remember runs this engine just started (each :func:`as_loaded`), the lock taken once.

        A run stored without a lease may be claimed by any worker at once; this engine,
        claiming it next, asks the journal to take the lease only if the stored run is still
        the one it wrote (:meth:`claim`: one conditional UPDATE, no load). A run stored holding
        this engine's lease (``Engine.start(claim=True)``) is held from now on: the heartbeat
        renews it, and its first drive here takes the row as written and writes no claim.
        """
        journal = self._core.journal
        with self._runs.lock:
            started = self._started
            held = self._held
            holding = False
            for run in runs:
                if run.lease_owner is None:
                    if len(started) >= _REMEMBERED_STARTS:
                        started.clear()
                    started[run.run_id] = (journal, run)
                else:
                    held[run.run_id] = _Hold(run.lease_token, (journal, run))
                    holding = True
            if holding:
                self._beating()

    def _take_fresh(self, run_id: str) -> RunRecord | None:
        """A run this engine started holding and has not driven, as written, now driven; or None."""
        with self._runs.lock:
            hold = self._held.get(run_id)
            if hold is None or hold.fresh is None or hold.fresh[0] is not self._core.journal:
                return None
            self._held[run_id] = _Hold(hold.token)
            return hold.fresh[1]

    def let_go_undriven(self) -> dict[str, str | None]:
        """Let go of every run this engine started holding and has not driven.

        In one journal call where the journal can (``release_many``), else run by run. Returns
        each run's abort reason as its row holds it (``None``: none, or it could not be read).
        """
        with self._runs.lock:
            leases = [
                (run_id, hold.token)
                for run_id, hold in self._held.items()
                if hold.fresh is not None and hold.token is not None
            ]
            for run_id, _ in leases:
                del self._held[run_id]
        if not leases:
            return {}
        journal, owner = self._core.journal, self.worker_id
        release_many = getattr(journal, "release_many", None)
        if release_many is not None:
            try:
                reasons: dict[str, str | None] = release_many(leases, owner)
            except FsmRunnerError as exc:  # the leases will expire; nothing is lost
                _log.warning("could not release %d leases: %s", len(leases), exc)
                return dict.fromkeys((run_id for run_id, _ in leases), None)
            return reasons
        reasons = {}
        for run_id, token in leases:  # a journal without it: run by run
            reasons[run_id] = None
            try:
                journal.release(run_id, owner, token)
                reasons[run_id] = journal.load(run_id).abort_reason
            except FsmRunnerError as exc:  # the lease will expire; nothing is lost
                _log.warning("run %s: could not release its lease: %s", run_id, exc)
        return reasons

    def let_go_fresh(self, run_id: str) -> bool:
        """Let go of a run this engine started holding and has not driven; whether it was one."""
        with self._runs.lock:
            hold = self._held.get(run_id)
            if hold is None or hold.fresh is None:
                return False
            self._held[run_id] = _Hold(hold.token)
        self.let_go(run_id)
        return True

    def claim(self, run_id: str, *, take_over: str | None = None) -> RunRecord:
        """Load the run, check it may run here, and take its lease (the heartbeat renews it).

        A run this engine started and has not claimed since (:meth:`started`) is claimed
        without a load when the journal can (``claim_unchanged``: one conditional UPDATE) and
        the stored run is still as written; otherwise, the usual way. ``take_over``: the
        holder of its live lease, known to be gone (``takeover``).
        """
        held = self._take_fresh(run_id)
        if held is not None:
            return held
        journal, worker_id, ttl = self._core.journal, self.worker_id, self.lease_ttl
        with self._runs.lock:
            fresh = self._started.pop(run_id, None)
        if fresh is not None and fresh[0] is journal:
            claimed = self._claim_unchanged(journal, fresh[1])
            if claimed is not None:
                return self.take(claimed)
        run = journal.load(run_id)
        self._core.check_runnable(run)
        self.reserve(run_id)
        try:
            try:
                claimed = journal.claim(run_id, worker_id, ttl=ttl, take_over=take_over)
            except LeaseHeldError as exc:
                if not holder_is_gone(journal, exc.owner, settled=ttl):
                    raise
                # Its holder was a process on this host that is gone (killed): no need to
                # wait for the lease to expire.
                _log.warning("run %s: taking over the lease of dead %s", run_id, exc.owner)
                claimed = journal.claim(run_id, worker_id, ttl=ttl, take_over=exc.owner)
        except BaseException:
            self.forget(run_id)
            raise
        telemetry = self._core.telemetry
        if telemetry is not None and run.lease_owner not in (None, worker_id):
            telemetry.took_over(run.machine)  # an expired lease, or a gone holder's
        return self.take(claimed)

    def _claim_unchanged(self, journal: Journal, run: RunRecord) -> RunRecord | None:
        """Claim a run this engine started if the journal still holds it as written, or ``None``."""
        claim_unchanged = getattr(journal, "claim_unchanged", None)
        if claim_unchanged is None:  # a journal without it: claimed the usual way
            return None
        self.reserve(run.run_id)
        try:
            claimed: RunRecord | None = claim_unchanged(run, self.worker_id, ttl=self.lease_ttl)
        except BaseException:
            self.forget(run.run_id)
            raise
        if claimed is None:
            self.forget(run.run_id)
        return claimed

    async def aclaim(self, run_id: str, *, grouped: bool) -> RunRecord:
        """:meth:`claim` for ``arun``: with ``grouped``, the runs a loop starts in one turn at once.

        Every run whose ``arun`` begins in the same turn of the loop is claimed by one
        :meth:`Journal.claim_many` (one transaction on SQLite), each checked by the core's
        ``check_runnable`` and granted or refused on its own.
        """
        held = self._take_fresh(run_id)
        if held is not None:
            return held
        if not grouped:
            return self.claim(run_id)
        journal = self._core.journal
        with self._runs.lock:  # claimed with the loop's others (see _claim_group)
            fresh = self._started.pop(run_id, None)
        loop = asyncio.get_running_loop()
        claimer = self._claimer
        if claimer is None or claimer.loop is not loop:
            claimer = self._claimer = GroupClaimer(loop, self._claim_group)
        self.reserve(run_id)
        future = claimer.submit(
            run_id, fresh[1] if fresh is not None and fresh[0] is journal else None
        )
        try:
            claimed = await future
        except BaseException as exc:
            self.forget(run_id)
            if future.done() and not future.cancelled() and future.exception() is None:
                # Claimed, but this task was cancelled before it resumed: give the lease back.
                self.hold(future.result())
                self.let_go(run_id)
            if isinstance(exc, LeaseHeldError) and holder_is_gone(
                self._core.journal, exc.owner, settled=self.lease_ttl
            ):
                return self.claim(run_id)  # its holder is gone: take the lease over now
            raise
        return self.take(claimed)

    def _claim_group(
        self, claims: Sequence[tuple[str, RunRecord | None]]
    ) -> list[RunRecord | Exception]:
        """Claim a loop turn's runs: each a row or why it was refused (:class:`GroupClaimer`).

        The runs this engine started and has not claimed since (given as written) are claimed
        without a load where the journal can (``claim_unchanged_many``: one transaction for
        them all); the rest, and any of them that changed since, by one ``claim_many`` (a
        load each, checked by the core's ``check_runnable``).
        """
        journal, worker_id, ttl = self._core.journal, self.worker_id, self.lease_ttl
        answers: dict[int, RunRecord | Exception] = {}  # by the claim's index
        fresh = [(index, run) for index, (_, run) in enumerate(claims) if run is not None]
        claim_unchanged_many = getattr(journal, "claim_unchanged_many", None)
        if fresh and claim_unchanged_many is not None:
            claimed = claim_unchanged_many([run for _, run in fresh], worker_id, ttl=ttl)
            for (index, _), run in zip(fresh, claimed, strict=True):
                if run is not None:
                    answers[index] = run
        rest = [index for index in range(len(claims)) if index not in answers]
        if rest:
            check = self._core.check_runnable
            found = journal.claim_many(
                [claims[index][0] for index in rest], worker_id, ttl=ttl, check=check
            )
            answers.update(zip(rest, found, strict=True))
        return [answers[index] for index in range(len(claims))]

    def claim_next(self, *, states: Sequence[str], spec_hash: str | None) -> RunRecord | None:
        """Claim the next runnable run of the core's machine and hold it, or ``None``.

        The run is held as claimed, not yet brought to the core's spec (its worker does that,
        or parks it).
        """
        core = self._core
        claimed = core.journal.claim_next(
            self.worker_id,
            ttl=self.lease_ttl,
            machine=core.spec.name,
            states=states,
            spec_hash=spec_hash,
        )
        if claimed is not None:
            self.hold(claimed)
        return claimed

    def announce(self) -> None:
        """Tell the journal this engine is alive, before it stores a run holding its lease.

        (PostgreSQL: its session holds the owner's advisory lock, ``hold_owner``; a claim does
        that itself.)
        """
        hold_owner = getattr(getattr(self._core.journal, "liveness", None), "hold_owner", None)
        if hold_owner is not None:
            hold_owner(self.worker_id)

    def reserve(self, run_id: str) -> None:
        """Mark the run as being claimed here: one engine advances a run in one place at a time."""
        with self._runs.lock:
            if run_id in self._held:
                raise LeaseHeldError(run_id, owner=self.worker_id, expires_at="its release")
            self._held[run_id] = _RESERVED

    def take(self, claimed: RunRecord) -> RunRecord:
        """Hold a lease just claimed and bring the run to the core's spec."""
        self.hold(claimed)
        try:
            return self._core.adopt_spec(claimed)
        except BaseException:
            self.let_go(claimed.run_id)
            raise

    def hold(self, claimed: RunRecord) -> None:
        """Remember a lease this engine took, and make sure the heartbeat renews it."""
        with self._runs.lock:
            self._held[claimed.run_id] = _Hold(claimed.lease_token)
            self._beating()

    def _beating(self) -> None:
        """Start the heartbeat unless it runs (with the lock held)."""
        if self._heartbeat is None or not self._heartbeat.is_alive():
            self._heartbeat = threading.Thread(
                target=self._beat,
                name=f"fsm-runner-heartbeat-{self.worker_id}",
                daemon=True,
            )
            self._heartbeat.start()

    def let_go(self, run_id: str, *, ended: bool = False) -> None:
        """Release the lease held on the run in the journal (at its end, or on a clean stop).

        With ``ended`` (the run has ended) the journal is not asked: the commit that ended the
        run cleared its lease (and a lease left on an ended run holds nothing back: no claim
        takes an ended run).
        """
        with self._runs.lock:
            hold = self._held.pop(run_id, None)
        if hold is None or hold.token is None or ended:
            return
        core = self._core
        journal = core.journal
        held = core.held
        try:
            parked = False
            if held.parked:
                with held.lock:
                    parked = run_id in held.parked
                    held.parked.discard(run_id)
            if parked or core.spec.waiting_states:  # a run let go of where it waits is parked
                run: RunRecord | None = journal.load(run_id)
                if (
                    run is not None  # a test's double of a dead journal reads nothing
                    and run.spec_hash == core.spec.spec_hash
                    and not run.ended
                ):  # parked where it waits, else released
                    waits.let_go(journal, core.spec, run, (self.worker_id, hold.token), core.guards)
                    return
            journal.release(run_id, self.worker_id, hold.token)
        except FsmRunnerError as exc:  # the lease will expire; nothing is lost
            _log.warning("run %s: could not release its lease: %s", run_id, exc)

    def forget(self, run_id: str) -> None:
        """Stop holding the run without releasing its lease: it is left to expire."""
        with self._runs.lock:
            self._held.pop(run_id, None)

    # -- the heartbeat -------------------------------------------------------------------------

    def _beat(self) -> None:
        """Renew every lease held, until none is held or the engine closes.

        A lease found taken over cancels the phase running under it (its commit would be
        refused anyway); an abort requested from elsewhere is carried out at the next step.
        """
        while not self._stop_heartbeat.wait(self.heartbeat_interval):
            with self._runs.lock:
                held = [
                    (run_id, hold.token)
                    for run_id, hold in self._held.items()
                    if hold.token is not None
                ]
                if not held:
                    self._heartbeat = None
                    return
            journal = self._core.journal
            renew_many = getattr(journal, "renew_many", None)
            if renew_many is None:  # a journal without it: run by run
                for run_id, token in held:
                    self.renew(run_id, token)
                continue
            try:
                found: dict[str, Renewal] = renew_many(held, self.worker_id, ttl=self.lease_ttl)
            except FsmRunnerError as exc:
                _log.warning("could not renew the leases of %d runs: %s", len(held), exc)
                continue
            for run_id, token in held:
                renewal = found[run_id]
                if renewal.renewed:
                    self._pass_on(run_id, token, lost=False, reason=renewal.abort_reason)
                elif not renewal.ended:  # an ended run's last commit cleared its lease
                    self._pass_on(run_id, token, lost=True, reason=_TAKEN_OVER)

    def renew(self, run_id: str, token: int) -> None:
        """Renew one lease; pass on an abort requested elsewhere, or a lease found taken over."""
        journal = self._core.journal
        lost = False
        try:
            journal.renew(run_id, self.worker_id, token, ttl=self.lease_ttl)
            reason = journal.load(run_id).abort_reason
        except LeaseLostError:
            lost, reason = True, _TAKEN_OVER
            with contextlib.suppress(FsmRunnerError):
                if journal.load(run_id).ended:  # its last commit cleared the lease: not lost
                    return
        except FsmRunnerError as exc:
            _log.warning("run %s: could not renew its lease: %s", run_id, exc)
            return
        self._pass_on(run_id, token, lost=lost, reason=reason)

    def _pass_on(self, run_id: str, token: int, *, lost: bool, reason: str | None) -> None:
        """Tell the run's phase of an abort requested elsewhere, or of its lease taken over."""
        if reason is None:
            return
        runs = self._runs
        with runs.lock:
            hold = self._held.get(run_id)
            if hold is None or hold.token != token:
                return  # let go, or claimed again, since the snapshot: not news
            if not lost:  # an abort requested elsewhere: carried out at the next step
                runs.aborts.setdefault(run_id, reason)
            ctx = runs.active.get(run_id)
        if lost:
            # Not an abort: the phase is told to stop, and its commit will be refused.
            _log.warning("run %s: %s", run_id, reason)
        if ctx is not None:
            ctx.request_cancel(reason)


class GroupClaimer:
    """Claims the leases of the runs one event loop starts in one turn, with one journal call.

    ``asyncio.gather`` of a thousand ``Engine.arun`` claims a thousand leases before any step;
    one transaction each was ~5 % of such a drive (bench_concurrent). Each run still gets its
    own answer: its claimed row, or why it was refused.

    Args:
        loop: the event loop whose runs submit.
        claim_many: claims a turn's runs at once, each given by its id and, for a run this
            engine started and has not claimed since, the run as written (else ``None``);
            returns a row or an error for each.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        claim_many: Callable[[list[tuple[str, RunRecord | None]]], Sequence[RunRecord | Exception]],
    ) -> None:
        self.loop = loop
        self._claim_many = claim_many
        self._claims: list[tuple[str, RunRecord | None]] = []
        self._futures: list[asyncio.Future[RunRecord]] = []
        self.calls = 0  # how many journal calls were made (for tests)

    def submit(self, run_id: str, fresh: RunRecord | None = None) -> asyncio.Future[RunRecord]:
        """Queue a claim; the future holds the claimed row (or why the claim was refused).

        ``fresh``: the run as this engine wrote it, if it started it and has not claimed it
        since. Cancelling the future before its turn ends leaves the run unclaimed.
        """
        future: asyncio.Future[RunRecord] = self.loop.create_future()
        if not self._claims:
            self.loop.call_soon(self._flush)
        self._claims.append((run_id, fresh))
        self._futures.append(future)
        return future

    def _flush(self) -> None:
        pending = [
            (claim, future)
            for claim, future in zip(self._claims, self._futures, strict=True)
            if not future.cancelled()
        ]
        self._claims, self._futures = [], []
        if not pending:
            return
        try:
            results = self._claim_many([claim for claim, _ in pending])
        except BaseException as exc:  # a journal that raised instead of returning the errors
            for _, future in pending:
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.calls += 1
        for (_, future), result in zip(pending, results, strict=True):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


def _plain(value: object) -> bool:
    """Whether ``value`` reads back from JSON as itself (and is immutable)."""
    return value is None or type(value) in (str, int, float, bool)


def as_loaded(run: RunRecord) -> RunRecord:
    """A run just written, as a load would read it back: its handlers see JSON values only."""
    if _plain(run.input) and not run.context:
        return run
    return attrs.evolve(run, input=_as_read(run.input), context=_as_read(run.context))


def _as_read(value: Any) -> Any:
    """``value`` as the journal gives it back: its JSON text, read."""
    return value if _plain(value) else json.loads(dumps_json(value))


def new_worker_id() -> str:
    """A new worker id: ``host:pid:random`` (unique per engine, and tells where it ran)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def holder_is_dead(owner: str) -> bool:
    """Whether a lease ``owner`` (``host:pid:...``) was a process on this host that is gone."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, but someone else's
        return False
    return False


def holder_is_gone(journal: Journal, owner: str, *, settled: float) -> bool:
    """Whether lease ``owner`` is gone: dead on this host, or (PostgreSQL) its session ended.

    ``settled``: on PostgreSQL, no session is taken for gone within that many seconds of the
    server's start (a restart ended them all; the live take their locks again).
    """
    if holder_is_dead(owner):
        return True
    owners_gone = getattr(getattr(journal, "liveness", None), "owners_gone", None)
    if owners_gone is None:
        return False
    try:
        return owner in owners_gone([owner], settled=settled)
    except FsmRunnerError:  # cannot tell: alive
        return False


def unleased(run: RunRecord) -> RunRecord:
    """The run row as it stands once its lease is released."""
    if run.lease_owner is None:
        return run
    return attrs.evolve(run, lease_owner=None, lease_expires_at=None)
