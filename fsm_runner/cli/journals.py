"""The journal a command works on: opening it as ``fsm-runner`` does, and naming its runs.

:func:`open_cli_journal` tells "no journal there" (exit 3) from "a journal that cannot be
opened" (exit 1); :func:`resolve_run_id` turns a unique prefix into a run id.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from fsm_runner.cli.errors import EXIT_NOT_FOUND, EXIT_USAGE, fail

if TYPE_CHECKING:
    from fsm_runner.journal import Journal

ENV_JOURNAL = "FSM_RUNNER_JOURNAL"
DEFAULT_JOURNAL = "fsm-runner.db"

#: What a journal that cannot be opened says when there is no journal at that location
#: (exit 3 like a missing file), as opposed to a journal that is there but damaged (exit 1).
_NO_JOURNAL_DETAILS = (
    "is a directory",
    "its directory does not exist",
    "holds no fsm_runner journal",
)
_NOT_SQLITE = "is not a SQLite database"


def _holds_text(path: str) -> bool:
    """Whether the file at ``path`` is text: a wrong ``--journal`` (a README), no damaged journal.

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


def open_cli_journal(location: str, *, must_exist: bool = True) -> Journal:
    """Open the journal at ``location`` for a command, as ``fsm-runner`` does.

    Args:
        location: a SQLite path, ``sqlite:///PATH``, ``:memory:`` or a PostgreSQL URL.
        must_exist: refuse to create a journal that is not there (read commands, resume).

    Returns:
        The open journal; the caller closes it.

    Raises:
        click.ClickException: exit 3 when there is no journal at ``location`` (a missing file,
            a directory, a text file, a database without a journal); exit 1 when the journal
            cannot be opened otherwise (a damaged file, a foreign database, no server).
    """
    from fsm_runner.exceptions import JournalError
    from fsm_runner.journal import open_journal

    path = location.removeprefix("sqlite:///")
    if location.startswith(("postgresql://", "postgres://")) or location == ":memory:":
        path = ""
    elif must_exist and not Path(path).exists():
        fail(
            f"no journal at {Path(path).absolute()} (pass --journal PATH or set {ENV_JOURNAL})",
            EXIT_NOT_FOUND,
        )
    elif must_exist and _empty(path):
        fail(
            f"journal {Path(path).absolute()}: is not an fsm_runner journal "
            "(an empty file); nothing was changed",
            EXIT_NOT_FOUND,
        )
    try:
        # Only a command that makes a journal (demo) turns an empty file into one.
        # A database is not a file: a missing journal there is the journal's own error.
        return open_journal(location, create=not must_exist)
    except JournalError as exc:
        if exc.detail.startswith(_NO_JOURNAL_DETAILS):
            fail(str(exc), EXIT_NOT_FOUND)
        if exc.detail.startswith(_NOT_SQLITE) and path and _holds_text(path):
            fail(
                f"journal {exc.path}: is a text file, not a SQLite database (is --journal the "
                f"right path?); nothing was changed",
                EXIT_NOT_FOUND,
            )
        raise


def _empty(path: str) -> bool:
    """A 0-byte file (with no WAL that holds its pages): no journal, like a missing one."""
    try:
        return os.stat(path).st_size == 0 and (
            not os.path.exists(path + "-wal") or os.stat(path + "-wal").st_size == 0
        )
    except OSError:
        return False  # the journal's own error says more


class CliState:
    """What the group hands its commands: where the journal is, and the journal once opened."""

    def __init__(self, journal_path: str) -> None:
        self.journal_path = journal_path
        self._journal: Journal | None = None

    def journal(self, *, must_exist: bool = True) -> Journal:
        """The journal, opened by the first command that asks (see :func:`open_cli_journal`)."""
        if self._journal is None:
            self._journal = open_cli_journal(self.journal_path, must_exist=must_exist)
        return self._journal

    def close(self) -> None:
        """Close the journal, if a command opened it."""
        if self._journal is not None:
            self._journal.close()


#: How many of the runs an ambiguous prefix matches its error names.
_AMBIGUOUS_SHOWN = 5


def resolve_run_id(journal: Journal, run_id: str) -> str:  # noqa: RET503 - fail() raises
    """The full id of the run ``run_id`` names: the id itself, or a unique prefix of one.

    Raises:
        RunNotFoundError: no run id starts with ``run_id`` (exit 3).
        click.ClickException: the prefix matches several runs; the message names some of them
            (exit 2).
    """
    from fsm_runner.exceptions import RunNotFoundError

    matches = journal.run_ids(run_id, limit=_AMBIGUOUS_SHOWN + 1)
    if run_id in matches or len(matches) == 1:
        return run_id if run_id in matches else matches[0]
    if not matches:
        raise RunNotFoundError(run_id)
    shown = ", ".join(match[:12] for match in matches[:_AMBIGUOUS_SHOWN])
    more = ", …" if len(matches) > _AMBIGUOUS_SHOWN else ""
    fail(
        f"run id prefix {run_id!r} is ambiguous: it matches {shown}{more}; give more characters",
        EXIT_USAGE,
    )
