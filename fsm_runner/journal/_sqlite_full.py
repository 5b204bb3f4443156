"""A SQLite journal on a disk with no room for its ``-shm`` file.

In WAL mode every connection shares the ``-shm`` file (the WAL's index), which SQLite makes
and grows as it is needed. On a full disk it cannot, and SQLite says "disk I/O error"
(``SQLITE_IOERR_SHMSIZE``): a full disk, told as one.
"""

from __future__ import annotations

import sqlite3

__all__ = ["no_room_for_shm"]


def no_room_for_shm(exc: sqlite3.Error) -> bool:
    """Whether SQLite could not make or grow the ``-shm`` file (a full disk)."""
    return getattr(exc, "sqlite_errorname", None) == "SQLITE_IOERR_SHMSIZE"
