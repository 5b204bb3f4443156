"""What an idle worker waits on: its journal's doorbell, rung when work may have come.

A worker that found nothing to claim waits (``Journal.idle``) until its poll interval is over,
the next wake time of a parked run comes, its stop event is set, or work may have come:

* in this process, a signal journaled through the same journal object rings its
  :class:`Doorbell` (the memory journal has nothing else to go by);
* on SQLite, another connection's commit changes the file's ``PRAGMA data_version``, which the
  waiting worker reads every :data:`TICK` (a read of the WAL's index, no I/O);
* on PostgreSQL, ``put_signal`` sends a ``NOTIFY`` in its transaction, which a connection of
  the journal's own, listening, receives at once
  (:class:`~fsm_runner.journal._postgres_listen.PostgresListener`).

Each thread remembers the last ring it saw: a ring between its fruitless claim and its wait
ends the wait at once (the claim is tried again), and the first wait of a thread ends at once
too (it cannot know what came before). A wait that ends for nothing costs one more claim
search, a read of an index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fsm_runner import _fork

__all__ = ["TICK", "Doorbell", "Listen"]

#: Seconds between two looks (at ``PRAGMA data_version``, at the stop event) while idle.
TICK = 0.02

#: Blocks up to the seconds given, for a sign of work; ``True`` when one came.
Listen = Callable[[float], bool]


class Doorbell:
    """Rung when work may have come; waited on by the journal's idle workers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rings = 0
        self._seen = threading.local()
        _fork.register(self)

    def _after_fork(self) -> None:
        """In a forked child: a lock of its own (another thread of the parent may hold it)."""
        self._cond = threading.Condition()
        self._seen = threading.local()

    def ring(self) -> None:
        """Wake every thread waiting on this doorbell (and end the next wait of the others)."""
        with self._cond:
            self._rings += 1
            self._cond.notify_all()

    def pause(self, seconds: float) -> bool:
        """Block up to ``seconds``, less if the doorbell rings; ``True`` if it rang unseen."""
        with self._cond:
            if self._rings == getattr(self._seen, "rings", None):
                self._cond.wait(seconds)
            return self._rings != getattr(self._seen, "rings", None)

    def wait(
        self,
        *,
        timeout: float,
        stop: threading.Event,
        listen: Listen | None = None,
        tick: float = TICK,
    ) -> bool:
        """Wait until the doorbell rings, ``listen`` hears something, ``stop`` or ``timeout``.

        ``listen`` blocks up to a tick (:meth:`pause` while it looks, or on a socket); without
        it the doorbell alone is waited on. ``stop`` is looked at every tick.

        Returns:
            ``True`` when work may have come; ``False`` when the time is up or ``stop`` set.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._cond:
                rings = self._rings
                if rings != getattr(self._seen, "rings", None):
                    self._seen.rings = rings
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or stop.is_set():
                return False
            step = min(tick, remaining)
            heard = self.pause(step) if listen is None else listen(step)
            if heard:
                with self._cond:
                    self._seen.rings = self._rings
                return True
