"""A journal collected unclosed: its connections closed then, and a ``ResourceWarning`` naming it.

Python closes a ``sqlite3`` or ``psycopg`` connection it collects, and (``sqlite3`` from 3.13,
``psycopg`` always) warns of it by the connection's own name, which says nothing of the
journal that opened it nor of what to close. A journal or engine left to the garbage collector
is a host's mistake, so it is told in its own words, as ``ResourceWarning`` (shown by
``python -X dev`` and ``-W error`` test suites, silent by default) — after the connections are
closed, so that a warning turned into an error still leaks nothing.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

__all__ = ["watch"]


def watch(owner: object, close: Callable[[], None], name: str) -> Callable[[], None]:
    """Call ``close`` when ``owner`` is collected (or at exit) and warn that ``name`` was.

    ``close`` must not hold ``owner`` (a bound method of one of its parts, not of it). Returns
    what ``owner`` calls to close itself: ``close``, the watch ended first.
    """
    finalizer = weakref.finalize(owner, _collected, close, name)

    def closed() -> None:
        finalizer.detach()
        close()

    return closed


def _collected(close: Callable[[], None], name: str) -> None:
    close()
    warnings.warn(
        f"{name} was not closed: its connections are closed now. Close it yourself"
        " (.close(), or open it in a 'with' block)",
        ResourceWarning,
        stacklevel=2,
    )
