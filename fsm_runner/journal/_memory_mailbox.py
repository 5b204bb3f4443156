"""The memory journal's mailbox: the runs' signals and wake times (see ``Journal.park``).

Held by :class:`~fsm_runner.journal.memory.MemoryJournal`, which calls it under its own lock
with the run rows it has read; it keeps only what the SQL journals keep in ``signals`` and
``run_rows.wake_at``, and rings its doorbell (what the journal's idle workers wait on) when a
signal comes or a run is let go of.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable

import attrs

from fsm_runner.exceptions import RunConflictError, RunTerminalError
from fsm_runner.journal import _lease
from fsm_runner.journal._idle import Doorbell
from fsm_runner.records import RunRecord, SignalRecord, SignalStatus, TransitionRecord, utc_now

__all__ = ["MemoryMailbox"]


def _reported(signal: SignalRecord, run: RunRecord) -> SignalRecord:
    """A pending signal of a run that has ended is reported expired."""
    if signal.status is SignalStatus.PENDING and run.ended:
        return attrs.evolve(signal, status=SignalStatus.EXPIRED)
    return signal


class MemoryMailbox:
    """Signals by run (in arrival order) and wake times by run; no lock of its own."""

    def __init__(self) -> None:
        self.wakes: dict[str, dt.datetime] = {}
        self.signals: dict[str, list[SignalRecord]] = {}
        self.number = 0
        self.bell = Doorbell()  # rung when work may have come (see Journal.idle)

    def forget(self, run_id: str) -> None:
        """A run pruned: its signals and wake time go with it."""
        self.wakes.pop(run_id, None)
        self.signals.pop(run_id, None)

    def due(self, run_id: str, now: dt.datetime) -> bool:
        """Whether the run's wake time has come."""
        wake = self.wakes.get(run_id)
        return wake is not None and wake <= now

    def pending(self, run_id: str) -> list[SignalRecord]:
        """The run's pending signals, in arrival order."""
        return [s for s in self.signals.get(run_id, ()) if s.status is SignalStatus.PENDING]

    def unpark(self, run_id: str) -> None:
        """A run let go of without a park: a wake time still to come goes (a past one stays)."""
        wake = self.wakes.get(run_id)
        if wake is not None and wake > utc_now():
            del self.wakes[run_id]
        self.bell.ring()  # it may be runnable

    def park(self, run_id: str, wake_at: dt.datetime | None, accepts: Collection[str]) -> None:
        """Set the wake time of a run let go of: now if an accepted signal waits."""
        if any(s.name in accepts for s in self.pending(run_id)):
            wake_at = utc_now()
        if wake_at is None:
            self.wakes.pop(run_id, None)
        else:
            self.wakes[run_id] = wake_at

    def next_wake(self, runs: Iterable[RunRecord], now: dt.datetime) -> dt.datetime | None:
        """The earliest wake time of ``runs`` that are active and nobody holds."""
        wakes = [
            self.wakes[run.run_id]
            for run in runs
            if run.run_id in self.wakes and not run.ended and _lease.unheld(run, now)
        ]
        return min(wakes, default=None)

    def put(self, signal: SignalRecord, run: RunRecord) -> SignalRecord:
        """Journal ``signal`` for ``run`` (see ``Journal.put_signal``)."""
        if signal.signal_id is not None:
            for stored in self.signals.get(run.run_id, ()):
                if stored.signal_id == signal.signal_id:
                    return _reported(stored, run)
        if run.ended:
            raise RunTerminalError(run_id=run.run_id, state=run.state, status=run.status.value)
        self.number += 1
        stored = attrs.evolve(
            signal,
            number=self.number,
            received_at=utc_now(),
            status=SignalStatus.PENDING,
            consumed_seq=None,
            consumed_at=None,
        )
        self.signals.setdefault(run.run_id, []).append(stored)
        self.wakes[run.run_id] = stored.received_at
        self.bell.ring()
        return stored

    def listed(self, run: RunRecord | None, *, pending: bool) -> list[SignalRecord]:
        """The run's signals as ``Journal.signals`` returns them."""
        if run is None:
            return []
        if pending:
            return [] if run.ended else self.pending(run.run_id)
        return [_reported(s, run) for s in self.signals.get(run.run_id, ())]

    def take(self, run_id: str, number: int, transition: TransitionRecord) -> None:
        """Mark signal ``number`` consumed by ``transition`` (the caller commits it first).

        Raises:
            RunConflictError: it is not a pending signal of the run (consumed already).
        """
        signals = self.signals.get(run_id, [])
        index = next((i for i, s in enumerate(signals) if s.number == number), None)
        if index is None or signals[index].status is not SignalStatus.PENDING:
            # consumed by another writer already (which advanced the run)
            raise RunConflictError(run_id=run_id, expected_seq=transition.seq - 1, path=":memory:")
        signals[index] = attrs.evolve(
            signals[index],
            status=SignalStatus.CONSUMED,
            consumed_seq=transition.seq,
            consumed_at=transition.at,
        )

    def check(self, run_id: str, number: int, transition: TransitionRecord) -> None:
        """Raise as :meth:`take` would, changing nothing (before the commit)."""
        if not any(
            s.number == number and s.status is SignalStatus.PENDING
            for s in self.signals.get(run_id, ())
        ):
            raise RunConflictError(run_id=run_id, expected_seq=transition.seq - 1, path=":memory:")
