"""The journal a command works on, opened once by the first command that asks.

Finding and opening it is the journal package's job (:mod:`fsm_runner.journal.locate`); this
module only holds it for the command, and is imported by ``fsm-runner --help``, so it imports
the journal package when a command runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from fsm_runner.journal import Journal


class CliState:
    """What the group hands its commands: where the journal is, and the journal once opened."""

    def __init__(self, journal_path: str, *, otel: bool = False) -> None:
        self.journal_path = journal_path
        #: ``--otel``: OpenTelemetry set up (:meth:`telemetry`) before the command's engine
        self.otel = otel
        self._journal: Journal | None = None

    def telemetry(self) -> None:
        """Set OpenTelemetry's SDK up as ``--otel`` or the ``OTEL_*`` variables ask (once).

        Called by the commands that make an engine, before they make it (each engine finds
        the providers set); never for ``--help`` or a command that drives nothing.
        """
        from fsm_runner.telemetry import configure_sdk

        try:
            configure_sdk(force=self.otel)
        except (ImportError, ValueError) as exc:
            raise click.UsageError(str(exc)) from None

    def journal(self, *, must_exist: bool = True) -> Journal:
        """The journal, opened by the first command that asks (see :func:`open_cli_journal`)."""
        if self._journal is None:
            self._journal = open_cli_journal(self.journal_path, must_exist=must_exist)
        return self._journal

    def close(self) -> None:
        """Close the journal, if a command opened it."""
        if self._journal is not None:
            self._journal.close()


def open_cli_journal(location: str, *, must_exist: bool = True) -> Journal:
    """Open the journal at ``location``: :func:`fsm_runner.journal.locate.locate_journal`."""
    from fsm_runner.journal.locate import locate_journal

    return locate_journal(location, must_exist=must_exist)


def resolve_run_id(journal: Journal, run_id: str) -> str:
    """The run ``run_id`` names: :func:`fsm_runner.journal.locate.resolve_run_id`."""
    from fsm_runner.journal.locate import resolve_run_id as resolve

    return resolve(journal, run_id)
