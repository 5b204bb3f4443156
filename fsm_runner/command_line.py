"""What every fsm_runner command line shares: fsm-runner's, the presets' and the examples'.

The ``--journal`` option (:func:`journal_option`), the command a message suggests
(:func:`suggested_command`: it names the journal unless the command would find it by itself),
the exit codes (``EXIT_*``) and click commands that turn fsm_runner's errors into them, one
``Error:`` line each (:class:`ExitCodeCommand`, :class:`ExitCodeGroup`, :func:`fail`).

It sits below :mod:`fsm_runner.cli` and imports nothing of it, so that the inspector, the
presets and the examples, which ``fsm-runner`` itself imports, can use it too. Nothing heavy
is imported at the top: ``fsm-runner --help`` imports this module; where a journal is (see
:mod:`fsm_runner.journal.locate`) is worked out when a command runs.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from fsm_runner.exceptions import (
    AmbiguousRunIdError,
    FsmRunnerError,
    InvalidRunIdError,
    JournalNotFoundError,
    LeaseError,
    RunConflictError,
    RunExistsError,
    RunNotFoundError,
    RunTerminalError,
)

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
    "fail",
    "journal_option",
    "suggested_command",
]

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


def _exit_code(exc: Exception) -> int:
    if isinstance(exc, RunNotFoundError | JournalNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, AmbiguousRunIdError | InvalidRunIdError):
        return EXIT_USAGE
    if isinstance(exc, LeaseError | RunConflictError | RunExistsError | RunTerminalError):
        return EXIT_CONFLICT
    return EXIT_FAILURE


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
        try:
            return super().invoke(ctx)
        except FsmRunnerError as exc:
            message = str(exc)
            if isinstance(exc, JournalNotFoundError) and not exc.detail:  # nothing there at all
                message += " (pass --journal PATH or set FSM_RUNNER_JOURNAL)"
            raise _ERRORS[_exit_code(exc)](message) from None
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


_F = TypeVar("_F", bound=Callable[..., Any])

#: The help of ``--journal``: the rule of :func:`fsm_runner.journal.locate.journal_location`
#: in words (a test checks that it names its variable and its file).
_JOURNAL_HELP = (
    "The journal: a SQLite file, or a postgresql://USER@HOST/DB[?schema=NAME] URL "
    "(default: $FSM_RUNNER_JOURNAL, else ./fsm-runner.db)."
)
_INHERITED_HELP = (
    "The journal (default: fsm-runner's --journal, $FSM_RUNNER_JOURNAL, ./fsm-runner.db)."
)


def journal_option(*, inherited: bool = False) -> Callable[[_F], _F]:
    """The ``--journal PATH`` option, passed to the command as ``journal_path`` (a ``str``).

    The value is where the journal is, worked out by
    :func:`fsm_runner.journal.locate.journal_location`: the option, else
    ``$FSM_RUNNER_JOURNAL``, else ``./fsm-runner.db``; open it with
    :func:`fsm_runner.journal.locate.locate_journal`.

    Args:
        inherited: for a command under a group that has the option too (``fsm-runner ui``):
            without the option, the group's journal.
    """

    def resolve(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
        if value is not None:
            return value
        if inherited:
            parent = ctx.parent
            while parent is not None:
                if isinstance(parent.params.get("journal_path"), str):
                    return str(parent.params["journal_path"])
                parent = parent.parent
        from fsm_runner.journal.locate import journal_location  # noqa: PLC0415 - see above

        return journal_location()

    return click.option(
        "--journal",
        "journal_path",
        metavar="PATH",
        callback=resolve,
        help=_INHERITED_HELP if inherited else _JOURNAL_HELP,
    )


def suggested_command(program: str, journal: str, *args: str, name_journal: bool = False) -> str:
    """A command line to suggest to the user, ready to paste into a shell.

    ``program [--journal JOURNAL] ARGS``: the journal is named unless the command would find it
    by itself (it is ``$FSM_RUNNER_JOURNAL``'s, or ``./fsm-runner.db`` without it).

    Args:
        program: the command as shell text (``fsm-runner``, ``python -m ...``; not quoted).
        journal: the journal's location, as the option took it.
        *args: the rest of the command line (quoted as needed).
        name_journal: name the journal even so (a page read far from the shell it came from).
    """
    from fsm_runner.journal.locate import is_implied  # noqa: PLC0415 - see the module docstring

    argv = [] if not name_journal and is_implied(journal) else ["--journal", journal]
    return " ".join([program, shlex.join([*argv, *args])])
