"""The worker: takes runs from the journal and drives them; aborts and lets go of runs held.

:class:`Worker` composes the lease keeper (which only claims, renews and releases) and the sync
driver (which steps a run it holds): :meth:`Worker.work` claims runnable runs one at a time,
:meth:`Worker.recover` takes over runs whose worker was lost, each driving or parking the run
it took. It also carries out what concerns the runs this process holds as a whole: an abort
(:meth:`Worker.abort`: told to the phase in progress, or carried out at once) and the release
of the runs started holding and never driven (:meth:`Worker.let_go_undriven`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from fsm_runner._json import storable_text
from fsm_runner.engine.core import StepCore
from fsm_runner.engine.leases import LeaseKeeper, unleased
from fsm_runner.engine.operations import abort_run
from fsm_runner.engine.sync_driver import SyncDriver
from fsm_runner.engine.takeover import DeadOwners
from fsm_runner.exceptions import (
    FsmRunnerError,
    LeaseHeldError,
    LeaseLostError,
    RunTerminalError,
    SpecMismatchError,
)
from fsm_runner.journal._head import is_head_refusal
from fsm_runner.records import RunRecord, utc_now

__all__ = ["Worker"]

_log = logging.getLogger("fsm_runner.engine")


class Worker:
    """Claims runs of the core's machine and drives each with the sync driver.

    Args:
        core: the step core (the journal, the spec, ``max_recoveries``).
        leases: the lease keeper that claims, renews and releases.
        driver: the sync driver that steps a run held.
    """

    def __init__(self, core: StepCore, leases: LeaseKeeper, driver: SyncDriver) -> None:
        self.core = core
        self.leases = leases
        self.driver = driver

    def work(
        self,
        *,
        max_runs: int | None,
        stop: threading.Event,
        idle_wait: float,
        exit_when_idle: bool,
        takeover_dead: bool = True,
    ) -> int:
        """Claim runnable runs one at a time and run each (``Engine.work``); how many were taken."""
        spec = self.core.spec
        states = sorted(state.name for state in spec.leaves if state.handler)
        core, leases = self.core, self.leases
        dead = (
            DeadOwners(
                lambda: core.journal,
                spec.name,
                lambda: leases.worker_id,
                lambda: leases.lease_ttl,
            )
            if takeover_dead
            else None
        )
        taken = 0
        orphans: list[tuple[str, str]] = []  # runs held by a dead worker, not yet tried
        while not stop.is_set() and (max_runs is None or taken < max_runs):
            if dead is not None and not orphans:
                orphans = dead.due()
            if orphans:
                taken += self._take_over(*orphans.pop(0))
                continue
            spec_hash = None if core.allow_spec_change else spec.spec_hash
            claimed = leases.claim_next(states=states, spec_hash=spec_hash)
            if claimed is None:
                if exit_when_idle:
                    break
                wait = self._idle_for(idle_wait)
                if dead is not None and dead.watching:  # a worker may die meanwhile
                    wait = min(wait, dead.interval)
                self._idle(wait, stop)
                continue
            taken += 1
            self._work_on(claimed)
        return taken

    def _take_over(self, run_id: str, owner: str) -> bool:
        """Take over and run (or park) a run held by ``owner``, which is gone; whether it was."""
        try:
            claimed = self.leases.claim(run_id, take_over=owner)
        except (LeaseHeldError, RunTerminalError, SpecMismatchError) as exc:
            _log.info("run %s not taken over here: %s", run_id, exc)
            return False
        except FsmRunnerError as exc:
            _log.warning("run %s: could not take it over: %s", run_id, exc)
            return False
        _log.warning("run %s: took over the lease of %s, which is gone", run_id, owner)
        self._work_on(claimed)
        return True

    def park_started(self, run_ids: Sequence[str]) -> None:
        """Give runs that start waiting with a deadline their wake time: claim and park each.

        A new run is stored without one (the start's rows are the hot path of every run); a
        claim and a let-go where it waits park it, which sets its wake time to its deadline. A
        run started holding is let go of here. Nothing for any other spec.
        """
        spec = self.core.spec
        wait = spec.wait_of(spec.initial_leaf)
        if wait is None or wait.timeout is None:
            return
        leases = self.leases
        for run_id in run_ids:
            if not leases.holds(run_id):
                leases.claim(run_id)
            leases.let_go(run_id)

    def _idle(self, seconds: float, stop: threading.Event) -> None:
        """Wait ``seconds``, less when the journal tells work may have come (``idle``)."""
        idle = getattr(self.core.journal, "idle", None)
        if idle is not None:
            try:
                idle(timeout=seconds, stop=stop)
            except FsmRunnerError as exc:
                _log.warning("could not wait on the journal: %s", exc)
            else:
                return
        stop.wait(seconds)

    def _idle_for(self, idle_wait: float) -> float:
        """Seconds to wait for work: ``idle_wait``, or less when a parked run wakes sooner.

        One read of an index (``next_wake``): any phase may park its run (``sleep_until``).
        """
        try:
            wake = self.core.journal.next_wake(machine=self.core.spec.name)
        except FsmRunnerError as exc:
            _log.warning("could not read the next wake time: %s", exc)
            return idle_wait
        if wake is None:
            return idle_wait
        return max(0.0, min(idle_wait, (wake - utc_now()).total_seconds()))

    def _work_on(self, claimed: RunRecord) -> None:
        """Run (or park) one run :meth:`work` claimed, then let go of it or leave it to expire."""
        keep_lease = ended = False
        try:
            ended = self._run_or_park(self.core.adopt_spec(claimed)).ended
        except LeaseLostError as exc:
            _log.warning("%s; the run is left to its new holder", exc)
        except FsmRunnerError as exc:
            keep_lease = True  # back off: the run waits for the lease to expire
            _log.error("run %s failed in this worker: %s", claimed.run_id, exc)
        finally:
            if keep_lease:
                self.leases.forget(claimed.run_id)
            else:
                self.leases.let_go(claimed.run_id, ended=ended)

    def recover(self, *, limit: int | None) -> list[RunRecord]:
        """Take over the runs whose lease expired and run or park each (``Engine.recover``)."""
        core = self.core
        recovered: list[RunRecord] = []
        for stale in core.journal.runs(machine=core.spec.name, stale=True, limit=limit):
            try:
                claimed = self.leases.claim(stale.run_id)
            except (LeaseHeldError, RunTerminalError, SpecMismatchError) as exc:
                _log.info("run %s not recovered here: %s", stale.run_id, exc)
                continue
            except FsmRunnerError as exc:
                if not is_head_refusal(exc):
                    raise
                _log.error("%s; the run is skipped (not recovered)", exc)  # the others proceed
                continue
            ended: RunRecord | None = None
            try:
                ended = self._run_or_park(claimed)
            finally:
                self.leases.let_go(claimed.run_id, ended=ended is not None and ended.ended)
            recovered.append(unleased(ended))
        return recovered

    def _run_or_park(self, claimed: RunRecord) -> RunRecord:
        """Drive a run taken over, or park it if its workers were lost too often."""
        core = self.core
        if claimed.recoveries > core.max_recoveries and claimed.abort_reason is None:
            return core.write(core.plan_park(claimed))[1]
        return self.driver.drive(claimed, None, how="work")

    def abort(self, run_id: str, reason: str) -> RunRecord:
        """``Engine.abort``: told to the phase in progress here, journaled, or done at once."""
        core = self.core
        held = core.held
        reason = storable_text(reason)  # a lone surrogate (an argv byte that is not UTF-8)
        self.leases.let_go_fresh(run_id)  # started holding, not driven: aborted at once below
        with held.lock:
            holding = self.leases.holds(run_id)
            if holding:
                held.aborts[run_id] = reason
                ctx = held.active.get(run_id)
                if ctx is not None:
                    ctx.request_cancel(reason)
        if holding:
            return core.journal.request_abort(run_id, reason)
        return abort_run(
            core.journal,
            run_id,
            reason,
            spec=core.spec,
            guards=core.guards,
            owner=self.leases.worker_id,
            _notify=core.notify,
        )

    def let_go_undriven(self) -> None:
        """Let go of the runs started holding and never driven; carry out aborts asked of them."""
        # One release for all of them where the journal can, which reads whether an abort was
        # asked from elsewhere since the last heartbeat.
        held = self.core.held
        for run_id, stored in self.leases.let_go_undriven().items():
            with held.lock:
                reason = held.aborts.pop(run_id, None) or stored
            if reason is None:
                continue
            try:
                self.abort(run_id, reason)
            except FsmRunnerError as exc:  # a request stays journaled for the next holder
                _log.warning("run %s: could not carry out its abort: %s", run_id, exc)
