"""Journals: the one I/O seam of the engine (``base.Journal``) and its implementations."""

from __future__ import annotations

import os

from fsm_runner.journal.base import Durability, Journal, PruneReport
from fsm_runner.journal.memory import MemoryJournal
from fsm_runner.journal.sqlite import DEFAULT_PATH, SCHEMA_VERSION, SqliteJournal

__all__ = [
    "DEFAULT_PATH",
    "SCHEMA_VERSION",
    "Durability",
    "Journal",
    "MemoryJournal",
    "PruneReport",
    "SqliteJournal",
    "open_journal",
]


def open_journal(
    location: str | os.PathLike[str], *, durability: Durability = "process"
) -> Journal:
    """Open the journal at ``location``: ``:memory:``, ``sqlite:///PATH`` or a file path.

    Raises:
        JournalError: the journal cannot be opened (see :class:`SqliteJournal`).
    """
    text = os.fspath(location)
    if text == ":memory:":
        return MemoryJournal()
    if text.startswith("sqlite:///"):
        text = text[len("sqlite:///") :]
    return SqliteJournal(text, durability=durability)
