"""What a forked child process must not take over from its parent: connections, locks, leases.

``os.fork()`` (``multiprocessing``'s default start method on Linux, a pre-forking server such as
gunicorn with ``--preload``, Celery's workers) copies a process with every object it holds, but
only the thread that forked. So in the child:

* a lock that another thread of the parent held at that moment stays held for ever: the child's
  first journal call waited for ever;
* a database connection is the parent's: SQLite's own rules forbid using it across a fork (its
  locks belong to the parent process), and a PostgreSQL connection shares its socket with the
  parent's, so the two processes' messages would interleave;
* an engine is the parent's worker: the same ``worker_id``, so the child could claim (as
  "already its own") the runs the parent is driving, and its lease keeper believed it held the
  parent's leases.

Objects that hold such things register here (:func:`register`). Just before a fork, each one's
``_before_fork()`` (where it has one) may wait, briefly, until no other thread is inside it, so
that no database transaction is open in the parent when it is copied (SQLite keeps a
process's lock bookkeeping in memory: a child copied mid-transaction could never write to that
file); it returns what lets go again in the parent. Right after a fork, in the child, each
one's ``_after_fork()`` gives it its own (a new lock, a new connection opened on the same file
or server, a new worker id). What the parent's objects were using is kept referenced here
(:func:`keep`) and never used, closed or collected in the child: closing the parent's
PostgreSQL connection would end the parent's session, and closing SQLite's would undo, in the
shared ``-shm`` file, a transaction that the parent is in the middle of.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["WAIT", "keep", "register"]

_log = logging.getLogger("fsm_runner")


#: How long a fork waits for another thread to leave an object (then forks all the same).
WAIT = 10.0


class _Forkable(Protocol):
    def _after_fork(self) -> None: ...


_registered: weakref.WeakSet[Any] = weakref.WeakSet()
#: The parent's connections, locks and loops, held by the child so that it never closes them.
_kept: list[object] = []
#: What lets go, in the parent, of what ``_before_fork`` took: the forking thread's own (two
#: threads that fork at once each let go of what they took).
_forking = threading.local()


def register(obj: _Forkable) -> None:
    """Call ``obj._after_fork()`` in every child forked from now on (while ``obj`` lives)."""
    _registered.add(obj)


def keep(obj: object) -> None:
    """Hold ``obj`` (the parent's) for the child's whole life: never closed nor collected here."""
    _kept.append(obj)


def _before() -> None:
    _forking.releases = releases = []
    for obj in list(_registered):
        hold = getattr(obj, "_before_fork", None)
        if hold is None:
            continue
        try:
            release = hold()
        except Exception:  # noqa: BLE001 - never stop the fork: the child copes as it can
            _log.exception("before a fork: %r could not be held still", obj)
            continue
        if release is not None:
            releases.append(release)


def _in_parent() -> None:
    releases: list[Callable[[], None]] = getattr(_forking, "releases", [])
    while releases:
        releases.pop()()


def _in_child() -> None:
    _forking.releases = []  # the child's objects get new locks instead
    for obj in list(_registered):
        try:
            obj._after_fork()
        except Exception:  # noqa: BLE001, PERF203 - one failure must not stop the others
            _log.exception("after a fork: %r could not take resources of its own", obj)


os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)
