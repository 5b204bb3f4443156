"""Exit codes, and how the CLI turns errors into them: one ``Error:`` line, never a traceback.

The CLI is the only place where errors become exit codes (see the ``EXIT_*`` constants).
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    from fsm_runner.records import RunRecord

#: Everything went as asked.
EXIT_OK = 0
#: The command failed (also: the run it drove ended failed or aborted, a check found problems).
EXIT_FAILURE = 1
#: The command line was wrong (click's own code for usage errors).
EXIT_USAGE = 2
#: The run (or the journal file) does not exist.
EXIT_NOT_FOUND = 3
#: The run is not in a state that allows it: ended, held by another worker, moved meanwhile.
EXIT_CONFLICT = 4
#: A run was interrupted (Ctrl-C, SIGTERM) by the preset CLIs; the run stays resumable.
EXIT_INTERRUPTED = 130
#: How long an ``Error:`` line may be (a terminal or two of text).
_MESSAGE_CHARS = 300


class CliError(click.ClickException):
    """A one-line error; its subclasses carry the other exit codes.

    The message is made one line (a corrupt schema's SQLite message, say, quotes the rest of
    the object's SQL: twenty lines and more) and its detail cut, keeping the first part.
    """

    exit_code = EXIT_FAILURE

    def __init__(self, message: str) -> None:
        text = " ".join(message.split())
        if len(text) > _MESSAGE_CHARS:
            text = text[: _MESSAGE_CHARS - 1] + "…"
        super().__init__(text)


class _UsageError(CliError):
    exit_code = EXIT_USAGE


class _NotFoundError(CliError):
    exit_code = EXIT_NOT_FOUND


class _ConflictError(CliError):
    exit_code = EXIT_CONFLICT


_ERRORS: dict[int, type[CliError]] = {
    EXIT_FAILURE: CliError,
    EXIT_USAGE: _UsageError,
    EXIT_NOT_FOUND: _NotFoundError,
    EXIT_CONFLICT: _ConflictError,
}


def fail(message: str, exit_code: int = EXIT_FAILURE) -> NoReturn:
    """Stop the command with one ``Error:`` line and ``exit_code`` (an ``EXIT_*`` constant)."""
    raise _ERRORS[exit_code](message)


def exit_if_failed(run: RunRecord) -> None:
    """Exit 1 when the run a command drove or followed ended failed, aborted or dead_letter."""
    if run.status.value in ("failed", "aborted", "dead_letter"):
        sys.exit(EXIT_FAILURE)


def _exit_code(exc: Exception) -> int:
    from fsm_runner.exceptions import (
        LeaseError,
        RunConflictError,
        RunExistsError,
        RunNotFoundError,
        RunTerminalError,
    )

    if isinstance(exc, RunNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, LeaseError | RunConflictError | RunExistsError | RunTerminalError):
        return EXIT_CONFLICT
    return EXIT_FAILURE


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


#: Where the arguments of the command line are kept (``Context.meta``, shared by sub-contexts).
_ARGV = "fsm_runner.argv"


class _MapsErrors(click.Command):
    """Turns library errors into one-line messages and their exit codes."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Refuse a NUL in an argument (no path, id or name holds one; ``os`` raises on it)."""
        for arg in args:
            if "\x00" in arg:
                raise _UsageError(f"{arg!r} holds a NUL character")
        ctx.meta.setdefault(_ARGV, list(args))  # the outermost command's: every argument
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        from fsm_runner.exceptions import FsmRunnerError

        try:
            return super().invoke(ctx)
        except FsmRunnerError as exc:
            raise _ERRORS[_exit_code(exc)](str(exc)) from None
        except click.UsageError as exc:
            # click echoes arguments as given ("unexpected extra argument (a<newline>b)").
            if len(exc.message.splitlines()) < 2:
                raise
            raise click.UsageError(" ".join(exc.message.split()), exc.ctx) from None
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            given = [*ctx.params.values(), *ctx.meta.get(_ARGV, ())]
            if not any(isinstance(v, str) and bad in v for v in given):
                # Not an argument: text read from the journal that UTF-8 cannot carry (a lone
                # surrogate another writer left), met while printing it.
                raise _ERRORS[EXIT_FAILURE](f"cannot print text that is not UTF-8: {exc}") from None
            # Bytes of argv that are not UTF-8 arrive as lone surrogates (surrogateescape); the
            # journal cannot store or look up such text.
            text: object = exc.object
            # The bytes as given; a lone surrogate no byte decodes to (only a caller in-process
            # passes one) is shown as it is.
            with contextlib.suppress(UnicodeEncodeError):
                text = exc.object.encode("utf-8", "surrogateescape")
            raise _UsageError(f"{text!r} is not valid UTF-8 text") from None


class ExitCodeCommand(_MapsErrors):
    """A click command with ``fsm-runner``'s error handling, for the presets' own CLIs.

    An ``fsm_runner`` error raised by the command prints one ``Error: ...`` line on stderr and
    exits with the code ``fsm-runner`` uses for it (see the ``EXIT_*`` constants).
    """


class ExitCodeGroup(_MapsErrors, click.Group):
    """A click group with ``fsm-runner``'s error handling (see :class:`ExitCodeCommand`)."""
