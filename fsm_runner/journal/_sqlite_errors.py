"""What SQLite's errors mean: the one place a ``sqlite3`` error becomes a :class:`JournalError`.

Also the messages of the journal's own fence trigger (written into the schema by
:mod:`~fsm_runner.journal._schema`, recognised by the writes in
:mod:`~fsm_runner.journal._sqlite_writes`), so both import them from here.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator

from fsm_runner.exceptions import JournalError, RunExistsError

__all__ = ["NO_RUN_KEY", "STALE_SEQ", "describe", "errors", "no_room_for_shm", "refused_if_exists"]

#: What the ``transitions_fence`` trigger raises when a transition does not follow the
#: run's last one (a stale seq), its writer's lease token is not the run's (fencing), or it is
#: not the USER_ABORTED that carries out the abort requested of the run.
STALE_SEQ = "fsm_runner: the run is not at the seq before this transition"
#: What it raises for a transition written without its run's ``run_key`` (by hand, say).
NO_RUN_KEY = (
    "fsm_runner: a transition needs the run_key of its run"
    " (SELECT run_key FROM run_rows WHERE run_id = ...)"
)

#: What a ``sqlite3`` error says (lower-cased words in its message) -> what the user is told.
_SQLITE_ERRORS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("locked", "busy"),
        "is locked by another writer for longer than the busy timeout; nothing was written",
    ),
    (
        ("readonly", "read-only"),
        "is read-only (check the permissions of the file, its -wal and -shm files and "
        "its directory); nothing was written",
    ),
    (("full",), "the disk (or the journal's size limit) is full; nothing was written"),
    # SQLITE_NOTADB: the file's header is not SQLite's.
    (
        ("not a database",),
        "is not a SQLite database (a corrupt or foreign file); nothing was changed",
    ),
    (
        ("malformed", "corrupt"),
        "is corrupt ({text}); nothing was changed ('fsm-runner check' says what is damaged)",
    ),
    (("unable to open",), "cannot be opened (check the path and its permissions)"),
)

#: How much of a ``sqlite3`` error's own text a message quotes, at most.
_DETAIL_CHARS = 160


def no_room_for_shm(exc: sqlite3.Error, path: str | None = None) -> bool:
    """Whether SQLite could not make or grow the ``-shm`` file (a full disk).

    Python 3.10's ``sqlite3`` gives no error code: there, a bare "disk I/O error" while the
    directory of the journal at ``path`` has less room than a ``-shm`` file's 32 KiB is taken
    for it.
    """
    name = getattr(exc, "sqlite_errorname", _NO_CODE)
    if name is not _NO_CODE:
        return name == "SQLITE_IOERR_SHMSIZE"
    if path is None or str(exc) != "disk I/O error":
        return False
    try:
        stat = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < _SHM_BYTES


_NO_CODE = object()
_SHM_BYTES = 32 * 1024  # the -shm file's first region


def describe(exc: sqlite3.Error, path: str | None = None) -> str:
    """What ``exc`` means for the journal at ``path``, in one line (its ``JournalError``'s)."""
    # One line, cut: a schema that SQLite cannot parse comes back with the rest of the
    # object's SQL in the message (a corrupt view: 20 lines and more). No -shm: disk full.
    text = "disk full" if no_room_for_shm(exc, path) else " ".join(str(exc).split())
    if len(text) > _DETAIL_CHARS:
        text = text[: _DETAIL_CHARS - 1] + "…"
    lowered = text.lower()
    for needles, message in _SQLITE_ERRORS:
        if any(needle in lowered for needle in needles):
            return message.format(text=text)
    return f"SQLite error: {text}"


@contextlib.contextmanager
def errors(path: str) -> Iterator[None]:
    """Map ``sqlite3`` errors to :class:`JournalError`; they never leave the SQLite journal.

    So does a ``UnicodeDecodeError``: SQLite hands back text (a value, a column name, a
    schema object's SQL) as the bytes the file holds, and bytes that are not UTF-8 are a
    damaged file, not a bug of the caller's.
    """
    try:
        yield
    except sqlite3.Error as exc:
        raise JournalError(describe(exc, path), path=path) from exc
    except UnicodeDecodeError as exc:
        raise JournalError(
            f"is corrupt (it holds text that is not UTF-8: {exc}); nothing was changed"
            " ('fsm-runner check' says what is damaged)",
            path=path,
        ) from exc


@contextlib.contextmanager
def refused_if_exists(run_id: str) -> Iterator[None]:
    """Raise :class:`RunExistsError` for a write that failed on the id of an existing run."""
    try:
        yield
    except JournalError as exc:
        if isinstance(exc.__cause__, sqlite3.IntegrityError) and "run_rows.run_id" in str(
            exc.__cause__
        ):
            raise RunExistsError(run_id) from None
        raise
