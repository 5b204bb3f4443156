"""Journals: the one I/O seam of the engine (``base.Journal``) and its implementations.

Modules: ``base`` (the protocol), ``memory``, ``sqlite`` and ``postgres`` (the journals, one
class per dialect, each holding a connection manager, the shared SQL core and a writer);
``_sql`` (``SqlCore``: what both SQL journals share, reads, row decoding, effects),
``_rows`` (records as the rows they bind), ``_lease`` (the lease rules every journal asks:
granting a claim, the verdict on a fenced commit); ``_sqlite_connections`` and
``_postgres_connection`` (each dialect's connection manager), ``_sqlite_writes`` and
``_postgres_writes`` (each dialect's fenced commit), ``_sqlite_check`` (opening and checking a
SQLite file: functions), ``_sqlite_errors`` (what ``sqlite3``'s errors mean),
``_checkpoint`` (the WAL's checkpoint thread), ``_postgres_url``; ``_schema`` and
``_postgres_schema`` (migrations; the latter also opens a PostgreSQL journal's schema).

:class:`PostgresJournal` loads on first use, so that nothing here imports psycopg unless a
PostgreSQL journal is asked for; :class:`MemoryJournal` too, so that a process on a file journal
(every CLI command and worker) does not import it.
"""

from __future__ import annotations

import os
import typing

from fsm_runner.exceptions import JournalError
from fsm_runner.journal.base import Durability, Journal, PruneReport
from fsm_runner.journal.search import JsonMatch, RunSearch
from fsm_runner.journal.sqlite import DEFAULT_PATH, SCHEMA_VERSION, SqliteJournal

if typing.TYPE_CHECKING:
    from fsm_runner.journal.memory import MemoryJournal
    from fsm_runner.journal.postgres import PostgresJournal as PostgresJournal  # not in __all__

__all__ = [
    "DEFAULT_PATH",
    "SCHEMA_VERSION",
    "Durability",
    "Journal",
    "JsonMatch",
    "MemoryJournal",
    "PruneReport",
    "RunSearch",
    "SqliteJournal",
    "open_journal",
]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def __getattr__(name: str) -> typing.Any:
    if name == "PostgresJournal":
        return _postgres_journal()
    if name == "MemoryJournal":
        from fsm_runner.journal.memory import MemoryJournal  # noqa: PLC0415 - lazy (above)

        globals()[name] = MemoryJournal  # later uses are plain attribute reads
        return MemoryJournal
    raise AttributeError(f"module 'fsm_runner.journal' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _postgres_journal() -> type[PostgresJournal]:
    """Import the PostgreSQL journal, or explain how to install what it needs."""
    try:
        from fsm_runner.journal.postgres import PostgresJournal  # noqa: PLC0415 - lazy (above)
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("psycopg"):
            raise
        raise JournalError(
            "a PostgreSQL journal needs psycopg 3: install fsm-runner[postgres]"
        ) from None
    return PostgresJournal


def open_journal(
    location: str | os.PathLike[str],
    *,
    durability: Durability = "process",
    create: bool = True,
) -> Journal:
    """Open the journal at ``location``.

    ``location`` is ``:memory:``, a PostgreSQL URL (``postgresql://...`` or ``postgres://...``,
    with an optional ``?schema=NAME``), ``sqlite:///PATH`` or a file path.

    Args:
        location: where the journal is.
        durability: see :data:`Durability`.
        create: make the journal when it does not exist yet; when ``False`` a missing journal
            (a PostgreSQL schema without one, a SQLite file that is not there, or that is
            empty: 0 bytes, or a SQLite database without tables) is an error.

    Raises:
        JournalError: the journal cannot be opened (see :class:`SqliteJournal` and
            :class:`PostgresJournal`), or psycopg is not installed for a PostgreSQL URL.
    """
    text = os.fspath(location)
    if text == ":memory:":
        from fsm_runner.journal.memory import MemoryJournal  # noqa: PLC0415 - lazy (above)

        return MemoryJournal()
    if text.startswith(_POSTGRES_SCHEMES):
        return _postgres_journal()(text, durability=durability, create=create)
    if text.startswith("sqlite:///"):
        text = text[len("sqlite:///") :]
    if not create and not os.path.exists(text):
        raise JournalError("does not exist", path=os.path.abspath(text))
    return SqliteJournal(text, durability=durability, create=create)
