"""Finding a journal and naming its runs, as every command does.

Where the journal is (:func:`journal_location`: given, else ``$FSM_RUNNER_JOURNAL``, else
``./fsm-runner.db``), opening it so that "no journal there" is told apart from "a journal that
cannot be opened" (:func:`locate_journal`), and the run a unique id prefix names
(:func:`resolve_run_id`). Errors are the library's own (:class:`JournalNotFoundError`,
:class:`AmbiguousRunIdError`, :class:`RunNotFoundError`); the command lines turn them into exit
codes.

Importing this module loads the journal package (``fsm_runner.journal``); a command line that
must start fast imports it when a command runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from fsm_runner.exceptions import (
    AmbiguousRunIdError,
    JournalError,
    JournalNotFoundError,
    RunNotFoundError,
)

if TYPE_CHECKING:
    from fsm_runner.journal import Journal

__all__ = [
    "DEFAULT_JOURNAL",
    "ENV_JOURNAL",
    "is_implied",
    "journal_location",
    "locate_journal",
    "resolve_run_id",
]

#: The environment variable that names the journal when no location is given.
ENV_JOURNAL = "FSM_RUNNER_JOURNAL"
#: The journal when neither a location nor ``$FSM_RUNNER_JOURNAL`` is given (relative to the
#: current directory); the file an ``Engine`` built without a journal opens too.
DEFAULT_JOURNAL = "fsm-runner.db"

#: What a journal that cannot be opened says when there is no journal at that location, as
#: opposed to a journal that is there but damaged.
_NO_JOURNAL_DETAILS = (
    "is a directory",
    "its directory does not exist",
    "holds no fsm_runner journal",
)
_NOT_SQLITE = "is not a SQLite database"
_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def journal_location(given: str | None = None) -> str:
    """Where the journal is: ``given``, else ``$FSM_RUNNER_JOURNAL``, else ``fsm-runner.db``."""
    if given is not None:
        return given
    return os.environ.get(ENV_JOURNAL) or DEFAULT_JOURNAL


def is_implied(location: str) -> bool:
    """Whether a command given no location would find the journal at ``location`` anyway."""
    return location == journal_location()


def locate_journal(location: str, *, must_exist: bool = True) -> Journal:
    """Open the journal at ``location``, telling "no journal there" from a damaged one.

    Args:
        location: a SQLite path, ``sqlite:///PATH``, ``:memory:`` or a PostgreSQL URL.
        must_exist: refuse to create a journal that is not there (reads, resume); when
            ``False``, a missing or empty file becomes a new journal.

    Returns:
        The open journal; the caller closes it.

    Raises:
        JournalNotFoundError: there is no journal at ``location``: a missing or empty file, a
            directory, a text file, a database or schema without a journal.
        JournalError: the journal is there but cannot be opened (a damaged file, a foreign
            database, no server).
    """
    from fsm_runner.journal import open_journal  # noqa: PLC0415 - the package imports this one

    path = location.removeprefix("sqlite:///")
    if location.startswith(_POSTGRES_SCHEMES) or location == ":memory:":
        path = ""
    elif must_exist and not Path(path).exists():
        raise JournalNotFoundError(path=str(Path(path).absolute()))
    elif must_exist and _empty(path):
        raise JournalNotFoundError(
            "is not an fsm_runner journal (an empty file); nothing was changed",
            path=str(Path(path).absolute()),
        )
    try:
        # Only a caller that makes a journal turns an empty file into one. A database is not a
        # file: a missing journal there is the journal's own error.
        return open_journal(location, create=not must_exist)
    except JournalNotFoundError:
        raise
    except JournalError as exc:
        if exc.detail.startswith(_NO_JOURNAL_DETAILS):
            raise JournalNotFoundError(exc.detail, path=exc.path) from None
        if exc.detail.startswith(_NOT_SQLITE) and path and _holds_text(path):
            raise JournalNotFoundError(
                "is a text file, not a SQLite database (is that the journal's path?); "
                "nothing was changed",
                path=exc.path,
            ) from None
        raise


def _empty(path: str) -> bool:
    """A 0-byte file (with no WAL that holds its pages): no journal, like a missing one."""
    try:
        return os.stat(path).st_size == 0 and (
            not os.path.exists(path + "-wal") or os.stat(path + "-wal").st_size == 0
        )
    except OSError:
        return False  # the journal's own error says more


def _holds_text(path: str) -> bool:
    """Whether the file at ``path`` is text: a wrong location (a README), no damaged journal.

    Only called once SQLite has refused the file, so no connection of this process holds
    POSIX locks on it that closing a descriptor could drop.
    """
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    if not head or b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(head) - 3  # a character cut at the end of what was read
    return True


def resolve_run_id(journal: Journal, run_id: str) -> str:
    """The full id of the run ``run_id`` names: the id itself, or a unique prefix of one.

    Raises:
        RunNotFoundError: no run id starts with ``run_id``.
        AmbiguousRunIdError: the prefix matches several runs (the error names some of them).
    """
    matches = journal.run_ids(run_id, limit=AmbiguousRunIdError.SHOWN + 1)
    if run_id in matches:
        return run_id
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise RunNotFoundError(run_id)
    raise AmbiguousRunIdError(run_id, matches)
