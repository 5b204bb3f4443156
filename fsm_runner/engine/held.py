"""The runs this process holds: the phases running here, the aborts to carry out, their lock.

One :class:`HeldRuns` per engine, shared by its parts: the drivers put a phase's context in
:attr:`HeldRuns.active` while its handler runs, the heartbeat of the lease keeper adds the
aborts it reads in the journal to :attr:`HeldRuns.aborts` and cancels the phase concerned, and
the step core drops an abort once the run's commit has carried it out. :attr:`HeldRuns.lock`
guards both, and the lease keeper's holds too (one lock, so an abort and a release never cross).
"""

from __future__ import annotations

import threading

from fsm_runner import _fork
from fsm_runner.phases import PhaseContext

__all__ = ["HeldRuns"]


class HeldRuns:
    """The phases running in this process and the aborts to carry out, by run id.

    After a fork the child holds nothing (see :mod:`fsm_runner._fork`): both maps are emptied
    in place (the drivers keep references to them) and the lock is a new one.
    """

    def __init__(self) -> None:
        #: the contexts of the phases running in this process
        self.active: dict[str, PhaseContext] = {}
        #: aborts to carry out at a run's next step (requested here, or seen by the heartbeat)
        self.aborts: dict[str, str] = {}
        #: runs whose phase parked them here (``ctx.wait_for``/``sleep_until``): let go of by
        #: parking, not by a plain release
        self.parked: set[str] = set()
        #: guards the maps, and the lease keeper's holds
        self.lock = threading.Lock()
        _fork.register(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's phases and aborts stay the parent's."""
        self.lock = threading.Lock()
        self.active.clear()
        self.aborts.clear()
        self.parked.clear()
