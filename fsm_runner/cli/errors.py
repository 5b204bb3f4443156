"""Exit codes, and how the CLI turns errors into them: one ``Error:`` line, never a traceback.

The CLI is the only place where errors become exit codes (see the ``EXIT_*`` constants). What
every fsm_runner command line shares (the codes, :func:`fail`, the commands that map errors)
lives in :mod:`fsm_runner.command_line`, below this package, so that the inspector, presets and
examples use it without importing the CLI; this module adds what only ``fsm-runner`` needs.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import click

from fsm_runner.command_line import (
    EXIT_CONFLICT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    ExitCodeCommand,
    ExitCodeGroup,
    fail,
)

if TYPE_CHECKING:
    from fsm_runner.records import RunRecord

__all__ = [
    "EXIT_CONFLICT",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliError",
    "ExitCodeCommand",
    "ExitCodeGroup",
    "FiniteFloatRange",
    "Int64Range",
    "exit_if_failed",
    "fail",
]


def exit_if_failed(run: RunRecord) -> None:
    """Exit 1 when the run a command drove or followed ended failed, aborted or dead_letter."""
    if run.status.value in ("failed", "aborted", "dead_letter"):
        sys.exit(EXIT_FAILURE)


class FiniteFloatRange(click.FloatRange):
    """A ``FloatRange`` that also refuses NaN (it passes every range check) and infinity."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, in range and finite; else click's usage error naming the option."""
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


#: The largest integer a journal stores (SQLite's INTEGER, PostgreSQL's bigint).
_INT64_MAX = 2**63 - 1


class Int64Range(click.IntRange):
    """An ``IntRange`` that also refuses numbers no journal can store (a usage error)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, in range and a 64-bit integer; else click's usage error naming the option."""
        number = super().convert(value, param, ctx)
        if number > _INT64_MAX:
            self.fail(f"{value!r} is too large.", param, ctx)
        return number
