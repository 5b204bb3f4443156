"""The lease keeper: which runs an engine holds, and for how long it keeps holding them.

An engine claims a run before it advances it, renews the lease from a heartbeat thread while
it holds it, and lets go of it at the end (or on a clean stop). :class:`LeaseKeeper` owns all
of that: one :class:`_Hold` per run (its fencing token, or none yet while the claim is in
flight), the heartbeat, the group claims of async runs, and the two loops that take runs from
the journal (:meth:`LeaseKeeper.work`, :meth:`LeaseKeeper.recover`). What a run does once held
is the engine's (its drivers and commits); the keeper reaches it through :class:`LeaseOwner`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from fsm_runner import _fork
from fsm_runner._group import GroupClaimer
from fsm_runner._json import dumps_json
from fsm_runner._lazy import LazyModule
from fsm_runner.exceptions import (
    FsmRunnerError,
    LeaseHeldError,
    LeaseLostError,
    RunTerminalError,
    SpecMismatchError,
)
from fsm_runner.journal import Journal
from fsm_runner.journal.base import Renewal
from fsm_runner.phases import PhaseContext
from fsm_runner.records import RunRecord
from fsm_runner.spec import MachineSpec

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["LeaseKeeper", "LeaseOwner", "holder_is_dead", "new_worker_id", "unleased"]

_log = logging.getLogger("fsm_runner.engine")


class LeaseOwner(Protocol):
    """What the keeper reads of its engine: settings (read live: users change some), and steps."""

    journal: Journal
    spec: MachineSpec
    worker_id: str
    lease_ttl: float
    heartbeat_interval: float
    max_recoveries: int
    allow_spec_change: bool
    group_commit: bool
    #: abort requests to carry out at a run's next step, by run id (the heartbeat adds to it)
    _aborts: dict[str, str]
    #: the contexts of the phases running in this process, by run id
    _active: dict[str, PhaseContext]
    #: the lock of the leases held (the keeper's), the group committer and the event loop of
    #: async handlers in sync runs: what a forked child must not take over (see _after_fork)
    _lock: threading.Lock
    _committer: Any
    _loop: Any

    def _check_runnable(self, run: RunRecord) -> None: ...

    def _adopt_spec(self, run: RunRecord) -> RunRecord: ...

    def _drive(self, run: RunRecord, max_steps: int | None) -> RunRecord: ...

    def _park(self, run: RunRecord) -> RunRecord: ...


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

    Args:
        owner: the engine; its settings are read each time (a changed ``journal`` or
            ``lease_ttl`` applies from the next claim), its steps run the runs held.
        own_worker_id: the engine's ``worker_id`` was made for it, not given: a forked child
            makes a new one (see :meth:`_after_fork`).
    """

    def __init__(self, owner: LeaseOwner, *, own_worker_id: bool = False) -> None:
        self._owner = owner
        self._own_worker_id = own_worker_id
        #: guards the holds, and the owner's aborts and active phases the heartbeat reads
        self.lock = threading.Lock()
        self._held: dict[str, _Hold] = {}
        self._heartbeat: threading.Thread | None = None
        self._stop_heartbeat = threading.Event()
        self._claimer: GroupClaimer | None = None
        #: runs this engine started, as it wrote them, until it claims them (by run id)
        self._started: dict[str, tuple[Journal, RunRecord]] = {}
        _fork.register(self)

    def _after_fork(self) -> None:
        """In a forked child: the engine is another worker, holding nothing (see ``_fork``).

        The parent's leases, phases under way, abort notes and event loop stay the parent's. A
        ``worker_id`` made for the engine becomes a new one, so the child cannot claim as its
        own a run the parent holds; one given to the engine is kept (give each process its own).
        """
        owner = self._owner
        if self._own_worker_id:
            owner.worker_id = new_worker_id()
        self.lock = owner._lock = threading.Lock()
        self._held, self._started, self._claimer = {}, {}, None
        self._heartbeat, self._stop_heartbeat = None, threading.Event()
        owner._active, owner._aborts, owner._committer = {}, {}, None
        if owner._loop is not None:
            _fork.keep(owner._loop)  # its selector is the parent's too: never closed here
            owner._loop = None

    def holds(self, run_id: str) -> bool:
        """Whether this engine holds the run, or is claiming it (read under :attr:`lock`)."""
        return run_id in self._held

    def stop(self) -> None:
        """Stop the heartbeat (leases still held then expire) and forget the group claimer."""
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        self._stop_heartbeat.clear()
        self._claimer = None
        with self.lock:
            self._started.clear()

    # -- claiming ------------------------------------------------------------------------------

    def started(self, run: RunRecord) -> None:
        """Remember a run this engine just started: its first claim here need not read it.

        The run is stored without a lease, so any worker may claim it at once; this engine,
        claiming it next, asks the journal to take the lease only if the stored run is still
        the one it wrote (:meth:`claim`), which needs neither a load nor a transaction of its own
        beyond that one conditional UPDATE.
        """
        self.started_many([run])

    def started_holding(self, run: RunRecord) -> None:
        """Hold a run this engine just started with its lease (``Engine.start(claim=True)``).

        The heartbeat renews the lease from now on; the run's first drive here takes the row
        as written (:meth:`claim`, :meth:`aclaim`) and writes no claim.
        """
        self.started_many([run])

    def started_many(self, runs: Sequence[RunRecord]) -> None:
        """Remember runs this engine just started, the lock taken once.

        :meth:`started` of each run stored without a lease, :meth:`started_holding` of each one
        stored holding this engine's.
        """
        journal = self._owner.journal
        loaded = [_as_loaded(run) for run in runs]
        with self.lock:
            started = self._started
            held = self._held
            holding = False
            for run in loaded:
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
        with self.lock:
            hold = self._held.get(run_id)
            if hold is None or hold.fresh is None or hold.fresh[0] is not self._owner.journal:
                return None
            self._held[run_id] = _Hold(hold.token)
            return hold.fresh[1]

    def undriven(self) -> list[str]:
        """The runs this engine started holding and has not driven."""
        with self.lock:
            return [run_id for run_id, hold in self._held.items() if hold.fresh is not None]

    def let_go_undriven(self) -> dict[str, str | None]:
        """Let go of every run this engine started holding and has not driven.

        In one journal call where the journal can (``release_many``), else run by run. Returns
        each run's abort reason as its row holds it (``None``: none, or it could not be read).
        """
        with self.lock:
            leases = [
                (run_id, hold.token)
                for run_id, hold in self._held.items()
                if hold.fresh is not None and hold.token is not None
            ]
            for run_id, _ in leases:
                del self._held[run_id]
        if not leases:
            return {}
        journal, owner = self._owner.journal, self._owner.worker_id
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
        with self.lock:
            hold = self._held.get(run_id)
            if hold is None or hold.fresh is None:
                return False
            self._held[run_id] = _Hold(hold.token)
        self.let_go(run_id)
        return True

    def claim(self, run_id: str) -> RunRecord:
        """Load the run, check it may run here, and take its lease (the heartbeat renews it).

        A run this engine started and has not claimed since (:meth:`started`) is claimed
        without a load when the journal can (``claim_unchanged``: one conditional UPDATE) and
        the stored run is still as written; otherwise, the usual way.
        """
        held = self._take_fresh(run_id)
        if held is not None:
            return held
        owner = self._owner
        journal, worker_id, ttl = owner.journal, owner.worker_id, owner.lease_ttl
        with self.lock:
            fresh = self._started.pop(run_id, None)
        if fresh is not None and fresh[0] is journal:
            claimed = self._claim_unchanged(journal, fresh[1])
            if claimed is not None:
                return self.take(claimed)
        run = journal.load(run_id)
        owner._check_runnable(run)
        self.reserve(run_id)
        try:
            try:
                claimed = journal.claim(run_id, worker_id, ttl=ttl)
            except LeaseHeldError as exc:
                if not holder_is_dead(exc.owner):
                    raise
                # Its holder was a process on this host that is gone (killed): no need to
                # wait for the lease to expire.
                _log.warning("run %s: taking over the lease of dead %s", run_id, exc.owner)
                claimed = journal.claim(run_id, worker_id, ttl=ttl, take_over=exc.owner)
        except BaseException:
            self.forget(run_id)
            raise
        return self.take(claimed)

    def _claim_unchanged(self, journal: Journal, run: RunRecord) -> RunRecord | None:
        """Claim a run this engine started if the journal still holds it as written, or ``None``."""
        claim_unchanged = getattr(journal, "claim_unchanged", None)
        if claim_unchanged is None:  # a journal without it: claimed the usual way
            return None
        owner = self._owner
        self.reserve(run.run_id)
        try:
            claimed: RunRecord | None = claim_unchanged(run, owner.worker_id, ttl=owner.lease_ttl)
        except BaseException:
            self.forget(run.run_id)
            raise
        if claimed is None:
            self.forget(run.run_id)
        return claimed

    async def aclaim(self, run_id: str) -> RunRecord:
        """:meth:`claim` for ``arun``: the runs a loop starts in one turn, claimed at once.

        With group commit, every run whose ``arun`` begins in the same turn of the loop is
        claimed by one :meth:`Journal.claim_many` (one transaction on SQLite), each checked by
        the engine's ``_check_runnable`` and granted or refused on its own.
        """
        held = self._take_fresh(run_id)
        if held is not None:
            return held
        owner = self._owner
        if not owner.group_commit:
            return self.claim(run_id)
        with self.lock:  # claimed with the loop's others, by claim_many (a load each)
            self._started.pop(run_id, None)
        loop = asyncio.get_running_loop()
        claimer = self._claimer
        if claimer is None or claimer.loop is not loop:
            journal, worker_id, ttl = owner.journal, owner.worker_id, owner.lease_ttl
            check = owner._check_runnable
            claimer = self._claimer = GroupClaimer(
                loop, lambda run_ids: journal.claim_many(run_ids, worker_id, ttl=ttl, check=check)
            )
        self.reserve(run_id)
        future = claimer.submit(run_id)
        try:
            claimed = await future
        except BaseException as exc:
            self.forget(run_id)
            if future.done() and not future.cancelled() and future.exception() is None:
                # Claimed, but this task was cancelled before it resumed: give the lease back.
                self.hold(future.result())
                self.let_go(run_id)
            if isinstance(exc, LeaseHeldError) and holder_is_dead(exc.owner):
                return self.claim(run_id)  # its holder is gone: take the lease over now
            raise
        return self.take(claimed)

    def reserve(self, run_id: str) -> None:
        """Mark the run as being claimed here: one engine advances a run in one place at a time."""
        with self.lock:
            if run_id in self._held:
                raise LeaseHeldError(run_id, owner=self._owner.worker_id, expires_at="its release")
            self._held[run_id] = _RESERVED

    def take(self, claimed: RunRecord) -> RunRecord:
        """Hold a lease just claimed and bring the run to the engine's spec."""
        self.hold(claimed)
        try:
            return self._owner._adopt_spec(claimed)
        except BaseException:
            self.let_go(claimed.run_id)
            raise

    def hold(self, claimed: RunRecord, *, fresh: tuple[Journal, RunRecord] | None = None) -> None:
        """Remember a lease this engine took, and make sure the heartbeat renews it."""
        with self.lock:
            self._held[claimed.run_id] = _Hold(claimed.lease_token, fresh)
            self._beating()

    def _beating(self) -> None:
        """Start the heartbeat unless it runs (with the lock held)."""
        if self._heartbeat is None or not self._heartbeat.is_alive():
            self._heartbeat = threading.Thread(
                target=self._beat,
                name=f"fsm-runner-heartbeat-{self._owner.worker_id}",
                daemon=True,
            )
            self._heartbeat.start()

    def let_go(self, run_id: str, *, ended: bool = False) -> None:
        """Release the lease held on the run in the journal (at its end, or on a clean stop).

        With ``ended`` (the run has ended) the journal is not asked: the commit that ended the
        run cleared its lease (and a lease left on an ended run holds nothing back: no claim
        takes an ended run).
        """
        with self.lock:
            hold = self._held.pop(run_id, None)
        if hold is None or hold.token is None or ended:
            return
        owner = self._owner
        try:
            owner.journal.release(run_id, owner.worker_id, hold.token)
        except FsmRunnerError as exc:  # the lease will expire; nothing is lost
            _log.warning("run %s: could not release its lease: %s", run_id, exc)

    def forget(self, run_id: str) -> None:
        """Stop holding the run without releasing its lease: it is left to expire."""
        with self.lock:
            self._held.pop(run_id, None)

    # -- the heartbeat -------------------------------------------------------------------------

    def _beat(self) -> None:
        """Renew every lease held, until none is held or the engine closes.

        A lease found taken over cancels the phase running under it (its commit would be
        refused anyway); an abort requested from elsewhere is carried out at the next step.
        """
        owner = self._owner
        while not self._stop_heartbeat.wait(owner.heartbeat_interval):
            with self.lock:
                held = [
                    (run_id, hold.token)
                    for run_id, hold in self._held.items()
                    if hold.token is not None
                ]
                if not held:
                    self._heartbeat = None
                    return
            renew_many = getattr(owner.journal, "renew_many", None)
            if renew_many is None:  # a journal without it: run by run
                for run_id, token in held:
                    self._renew(run_id, token)
                continue
            try:
                found: dict[str, Renewal] = renew_many(held, owner.worker_id, ttl=owner.lease_ttl)
            except FsmRunnerError as exc:
                _log.warning("could not renew the leases of %d runs: %s", len(held), exc)
                continue
            for run_id, token in held:
                renewal = found[run_id]
                if renewal.renewed:
                    self._pass_on(run_id, token, lost=False, reason=renewal.abort_reason)
                elif not renewal.ended:  # an ended run's last commit cleared its lease
                    self._pass_on(run_id, token, lost=True, reason=_TAKEN_OVER)

    def _renew(self, run_id: str, token: int) -> None:
        """Renew one lease; pass on an abort requested elsewhere, or a lease found taken over."""
        owner = self._owner
        journal = owner.journal
        lost = False
        try:
            journal.renew(run_id, owner.worker_id, token, ttl=owner.lease_ttl)
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
        owner = self._owner
        with self.lock:
            hold = self._held.get(run_id)
            if hold is None or hold.token != token:
                return  # let go, or claimed again, since the snapshot: not news
            if not lost:  # an abort requested elsewhere: carried out at the next step
                owner._aborts.setdefault(run_id, reason)
            ctx = owner._active.get(run_id)
        if lost:
            # Not an abort: the phase is told to stop, and its commit will be refused.
            _log.warning("run %s: %s", run_id, reason)
        if ctx is not None:
            ctx.request_cancel(reason)

    # -- taking runs from the journal ----------------------------------------------------------

    def work(
        self, *, max_runs: int | None, stop: threading.Event, idle_wait: float, exit_when_idle: bool
    ) -> int:
        """Claim runnable runs one at a time and run each (``Engine.work``); how many were taken."""
        owner = self._owner
        states = sorted(state.name for state in owner.spec.leaves if state.handler)
        spec_hash = None if owner.allow_spec_change else owner.spec.spec_hash
        taken = 0
        while not stop.is_set() and (max_runs is None or taken < max_runs):
            claimed = owner.journal.claim_next(
                owner.worker_id,
                ttl=owner.lease_ttl,
                machine=owner.spec.name,
                states=states,
                spec_hash=spec_hash,
            )
            if claimed is None:
                if exit_when_idle:
                    break
                stop.wait(idle_wait)
                continue
            taken += 1
            self.hold(claimed)
            self._work_on(claimed)
        return taken

    def _work_on(self, claimed: RunRecord) -> None:
        """Run (or park) one run :meth:`work` claimed, then let go of it or leave it to expire."""
        owner = self._owner
        keep_lease = ended = False
        try:
            claimed = owner._adopt_spec(claimed)
            if claimed.recoveries > owner.max_recoveries and claimed.abort_reason is None:
                ended = owner._park(claimed).ended
            else:
                ended = owner._drive(claimed, None).ended
        except LeaseLostError as exc:
            _log.warning("%s; the run is left to its new holder", exc)
        except FsmRunnerError as exc:
            keep_lease = True  # back off: the run waits for the lease to expire
            _log.error("run %s failed in this worker: %s", claimed.run_id, exc)
        finally:
            if keep_lease:
                self.forget(claimed.run_id)
            else:
                self.let_go(claimed.run_id, ended=ended)

    def recover(self, *, limit: int | None) -> list[RunRecord]:
        """Take over the runs whose lease expired and run or park each (``Engine.recover``)."""
        owner = self._owner
        recovered: list[RunRecord] = []
        for stale in owner.journal.runs(machine=owner.spec.name, stale=True, limit=limit):
            try:
                claimed = self.claim(stale.run_id)
            except (LeaseHeldError, RunTerminalError, SpecMismatchError) as exc:
                _log.info("run %s not recovered here: %s", stale.run_id, exc)
                continue
            ended: RunRecord | None = None
            try:
                if claimed.recoveries > owner.max_recoveries and claimed.abort_reason is None:
                    ended = owner._park(claimed)
                else:
                    ended = owner._drive(claimed, None)
            finally:
                self.let_go(claimed.run_id, ended=ended is not None and ended.ended)
            recovered.append(unleased(ended))
        return recovered


def _plain(value: object) -> bool:
    """Whether ``value`` reads back from JSON as itself (and is immutable)."""
    return value is None or type(value) in (str, int, float, bool)


def _as_loaded(run: RunRecord) -> RunRecord:
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


def unleased(run: RunRecord) -> RunRecord:
    """The run row as it stands once its lease is released."""
    if run.lease_owner is None:
        return run
    return attrs.evolve(run, lease_owner=None, lease_expires_at=None)
