"""Taking over at once the runs of a worker that died, rather than when their leases expire.

A lease protects a run from a second worker for ``lease_ttl`` seconds; a worker that is killed
leaves its run blocked that long. A worker (``Engine.work(takeover_dead=True)``, the default)
looks, at most every :data:`INTERVAL` seconds, at who holds its machine's leased runs (one
index range: ``journal.liveness.lease_holders``) and takes over at once the runs of an owner
that is gone: a process of this host that is no longer there (its pid, as ``resume`` judges
it), or, on PostgreSQL, an owner whose database session the server no longer has (its
advisory lock is free: ``journal.liveness.owners_gone``; not within a lease TTL of the
server's start, which ended every session). A live owner's lease is never shortened, however
slow its phase. The takeover is a claim like any other (``take_over=`` the dead owner): the
lease token rises, the run's ``recoveries`` count one more, and the dead holder's late
commit is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fsm_runner.engine.leases import holder_is_dead
from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.journal import Journal

__all__ = ["INTERVAL", "DeadOwners"]

_log = logging.getLogger("fsm_runner.engine")

#: Seconds between two looks at who holds the machine's leases.
INTERVAL = 0.5


class DeadOwners:
    """Finds the runs of one machine held by owners that are gone, at most every ``interval``.

    Args:
        journal: reads the journal to look in (the engine's, read at each look).
        machine: the machine whose runs are looked at.
        own: this worker's owner id (read at each look; never taken for gone).
        settled: seconds after a PostgreSQL server's start during which no session is taken
            for gone (this worker's lease TTL: a restart ended them all, and a live worker
            takes its lock again within its heartbeat).
        interval: seconds between two looks; between them :meth:`due` answers at once.
    """

    def __init__(
        self,
        journal: Callable[[], Journal],
        machine: str,
        own: Callable[[], str],
        settled: Callable[[], float],
        *,
        interval: float = INTERVAL,
    ) -> None:
        self._journal = journal
        self._machine = machine
        self._own = own
        self._settled = settled
        self.interval = interval
        self._next = 0.0
        #: whether the last look found runs held by other owners (worth looking again soon)
        self.watching = False
        #: owners found gone: an owner id is never reused, so it stays gone
        self._dead: set[str] = set()

    def due(self) -> list[tuple[str, str]]:
        """``(run_id, owner)`` of the runs held by owners that are gone; ``[]`` between looks."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self.interval
        liveness = getattr(self._journal(), "liveness", None)
        if liveness is None:  # a journal of one process (memory): its owners live as long
            return []
        try:
            held: list[tuple[str, str]] = liveness.lease_holders(machine=self._machine)
            owners = {owner for _, owner in held} - {self._own()}
            self.watching = bool(owners)
            dead = {owner for owner in owners if owner in self._dead or holder_is_dead(owner)}
            gone = getattr(liveness, "owners_gone", None)
            if gone is not None and owners - dead:
                dead |= gone(owners - dead, settled=self._settled())
        except FsmRunnerError as exc:
            _log.warning("could not look for the leases of dead workers: %s", exc)
            return []
        self._dead = dead  # only the owners still holding runs are remembered
        return [(run_id, owner) for run_id, owner in held if owner in dead]
