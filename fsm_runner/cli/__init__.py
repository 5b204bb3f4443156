"""The ``fsm-runner`` command line: list, inspect, replay, resume, abort, fork and draw runs.

The CLI is thin: every command opens the journal, calls the library and prints. It is the only
place where errors become exit codes: a user's mistake prints one line on stderr, never a
traceback. Heavy imports happen inside the commands, so ``fsm-runner --help`` stays fast.
Colour is used only on a terminal; piped output is plain, stable text.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    from fsm_runner.engine import Engine
    from fsm_runner.journal import Journal
    from fsm_runner.records import ArtifactRecord, IterationRecord, RunRecord, TransitionRecord
    from fsm_runner.spec import MachineSpec

__all__ = [
    "EXIT_CONFLICT",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "ExitCodeCommand",
    "ExitCodeGroup",
    "cli",
    "main",
    "open_cli_journal",
    "resolve_run_id",
]

ENV_JOURNAL = "FSM_RUNNER_JOURNAL"
DEFAULT_JOURNAL = "fsm-runner.db"

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


class _MapsErrors(click.Command):
    """Turns library errors into one-line messages and their exit codes."""

    def invoke(self, ctx: click.Context) -> Any:
        from fsm_runner.exceptions import FsmRunnerError

        try:
            return super().invoke(ctx)
        except FsmRunnerError as exc:
            raise _ERRORS[_exit_code(exc)](str(exc)) from None


class _Group(_MapsErrors, click.Group):
    """A group that turns library errors into one-line messages and their exit codes."""


class ExitCodeCommand(_MapsErrors):
    """A click command with ``fsm-runner``'s error handling, for the presets' own CLIs.

    An ``fsm_runner`` error raised by the command prints one ``Error: ...`` line on stderr and
    exits with the code ``fsm-runner`` uses for it (see the ``EXIT_*`` constants).
    """


class ExitCodeGroup(_MapsErrors, click.Group):
    """A click group with ``fsm-runner``'s error handling (see :class:`ExitCodeCommand`)."""


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
        _fail(
            f"no journal at {Path(path).absolute()} (pass --journal PATH or set {ENV_JOURNAL})",
            EXIT_NOT_FOUND,
        )
    elif must_exist and _empty(path):
        _fail(
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
            raise _NotFoundError(str(exc)) from None
        if exc.detail.startswith(_NOT_SQLITE) and path and _holds_text(path):
            _fail(
                f"journal {exc.path}: is a text file, not a SQLite database (is --journal the "
                f"right path?); nothing was changed",
                EXIT_NOT_FOUND,
            )
        raise


class _State:
    """What the group hands its commands: where the journal is."""

    def __init__(self, journal_path: str) -> None:
        self.journal_path = journal_path
        self._journal: Journal | None = None

    def journal(self, *, must_exist: bool = True) -> Journal:
        if self._journal is None:
            self._journal = open_cli_journal(self.journal_path, must_exist=must_exist)
        return self._journal

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()


def _empty(path: str) -> bool:
    """A 0-byte file (with no WAL that holds its pages): no journal, like a missing one."""
    try:
        return os.stat(path).st_size == 0 and (
            not os.path.exists(path + "-wal") or os.stat(path + "-wal").st_size == 0
        )
    except OSError:
        return False  # the journal's own error says more


def _fail(message: str, exit_code: int = EXIT_FAILURE) -> NoReturn:
    raise _ERRORS[exit_code](message)


def _colour() -> bool:
    """Colour only when stdout is a terminal (and NO_COLOR is not set)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


_STATUS_COLOURS = {
    "active": "cyan",
    "succeeded": "green",
    "failed": "red",
    "aborted": "yellow",
    "dead_letter": "magenta",
}


def _styled_status(text: str, status: str) -> str:
    colour = _STATUS_COLOURS.get(status)
    return click.style(text, fg=colour) if colour and _colour() else text


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--journal",
    "journal_path",
    envvar=ENV_JOURNAL,
    default=DEFAULT_JOURNAL,
    show_default=True,
    metavar="PATH",
    help=(
        "The SQLite journal file, or a postgresql://USER@HOST/DB[?schema=NAME] URL "
        f"(also from ${ENV_JOURNAL})."
    ),
)
@click.version_option(package_name="fsm-runner", prog_name="fsm-runner")
@click.pass_context
def cli(ctx: click.Context, journal_path: str) -> None:
    """Run long, multi-phase jobs as durable state machines, and operate their journal.

    Run ids may be abbreviated to any unique prefix.

    Exit codes: 0 ok; 1 failure (also a run that ended failed or aborted); 2 usage error;
    3 run or journal not found; 4 conflict (the run has ended, its lease is held by another
    worker, or another writer moved it).
    """
    state = _State(journal_path)
    ctx.obj = state
    ctx.call_on_close(state.close)


#: How many of the runs an ambiguous prefix matches its error names.
_AMBIGUOUS_SHOWN = 5


def resolve_run_id(journal: Journal, run_id: str) -> str:
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
    _fail(
        f"run id prefix {run_id!r} is ambiguous: it matches {shown}{more}; give more characters",
        EXIT_USAGE,
    )


_resolve_run_id = resolve_run_id


def _time(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def _json_dump(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False))


def _table(
    rows: Sequence[Sequence[str]],
    headers: Sequence[str],
    *,
    styles: Sequence[str] | None = None,
) -> None:
    """Print aligned columns; on a terminal, colour each row by its status in ``styles``."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for index, row in enumerate(rows):
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        click.echo(_styled_status(line, styles[index]) if styles else line)


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken between words, never inside one.

    A word longer than ``width`` gets a line of its own; line breaks in ``text`` are kept.
    """
    import textwrap

    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        lines += textwrap.wrap(
            paragraph, width, break_long_words=False, break_on_hyphens=False
        ) or [""]
    return lines


def _wrap_column(rows: Sequence[Sequence[str]], column: int, width: int) -> list[tuple[str, ...]]:
    """Rows whose cell in ``column`` is wrapped (:func:`_wrap`) onto continuation rows."""
    wrapped: list[tuple[str, ...]] = []
    for row in rows:
        lines = _wrap(row[column], width)
        wrapped.append((*row[:column], lines[0], *row[column + 1 :]))
        blank = [""] * len(row)
        wrapped += [(*blank[:column], line, *blank[column + 1 :]) for line in lines[1:]]
    return wrapped


def _text_width() -> int:
    """Columns to fill: the terminal's, or 100 when stdout is not a terminal."""
    import shutil

    return max(60, shutil.get_terminal_size().columns) if sys.stdout.isatty() else 100


@cli.command()
@click.option("--machine", help="Only runs of this machine.")
@click.option(
    "--status",
    type=click.Choice(["active", "succeeded", "failed", "aborted", "dead_letter"]),
    help="Only runs with this status.",
)
@click.option("--state", "run_state", metavar="STATE", help="Only runs in this state.")
@click.option("--parent", metavar="RUN", help="Only the child runs of this run.")
@click.option(
    "--stale",
    is_flag=True,
    help="Only active runs whose lease has expired (their worker is gone).",
)
@click.option(
    "--effect-in-flight",
    is_flag=True,
    help="Only runs with an effect caught in flight (its outcome unknown).",
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def runs(
    state: _State,
    machine: str | None,
    status: str | None,
    run_state: str | None,
    parent: str | None,
    stale: bool,
    effect_in_flight: bool,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first (child runs show their parent)."""
    from fsm_runner.records import unstructure

    journal = state.journal()
    if parent is not None:
        parent = _resolve_run_id(journal, parent)
    found = journal.runs(
        machine=machine,
        status=status,
        parent_run_id=parent,
        limit=limit,
        effect_in_flight=effect_in_flight,
        state=run_state,
        stale=stale,
    )
    if as_json:
        _json_dump([unstructure(run) for run in found])
        return
    if not found:
        click.echo("no runs")
        return
    rows = [
        (
            run.run_id[:12],
            run.machine,
            run.state,
            run.status.value,
            str(run.seq),
            str(run.iteration),
            _time(run.updated_at),
            (run.parent_run_id or "-")[:12],
        )
        for run in found
    ]
    _table(
        rows,
        ("RUN", "MACHINE", "STATE", "STATUS", "SEQ", "ITER", "UPDATED (UTC)", "PARENT"),
        styles=[run.status.value for run in found],
    )


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_obj
def show(state: _State, run_id: str, as_json: bool) -> None:
    """Show a run: its summary and its timeline of transitions."""
    from fsm_runner.records import unstructure
    from fsm_runner.spec import MachineSpec

    journal = state.journal()
    run = journal.load(_resolve_run_id(journal, run_id))
    timeline = journal.transitions(run.run_id)
    iterations = journal.iterations(run.run_id)
    artifacts = journal.artifacts(run.run_id)
    visits = _subphase_visits(MachineSpec.from_json(journal.spec_json(run.spec_hash)), timeline)
    children = list(reversed(journal.runs(parent_run_id=run.run_id)))
    effects = journal.effects(run.run_id)
    if as_json:
        _json_dump(
            {
                "run": unstructure(run),
                "transitions": [unstructure(t) for t in timeline],
                "iterations": [unstructure(i) for i in iterations],
                "artifacts": [_artifact_summary(a) for a in artifacts],
                "subphases": visits,
                "effects": [unstructure(e) for e in effects],
                "children": [
                    {"run_id": c.run_id, "machine": c.machine, "state": c.state,
                     "status": c.status.value}
                    for c in children
                ],
            }
        )  # fmt: skip
        return
    _print_summary(run)
    click.echo("")
    _print_timeline(timeline)
    if visits:
        click.echo("")
        _table(
            [
                (
                    v["subphase"],
                    v["parent"],
                    str(v["attempts"]),
                    str(v["restarts"]),
                    str(v["interruptions"]),
                    v["last_event"] or "-",
                )
                for v in visits
            ],
            ("SUB-PHASE", "IN", "ATTEMPTS", "RESTARTS", "INTERRUPTED", "LAST EVENT"),
        )
    if effects:
        click.echo("")
        _table(
            [
                (
                    e.name,
                    e.state,
                    str(e.visit_seq),
                    e.kind,
                    e.status.value,
                    e.idempotency_key[:12],
                    f"{(e.error or {}).get('type')}: {(e.error or {}).get('message')}"[:50]
                    if e.error
                    else "",
                )
                for e in effects
            ],
            ("EFFECT", "STATE", "VISIT", "KIND", "STATUS", "KEY", "ERROR"),
        )
    if children:
        click.echo("")
        _table(
            [(c.run_id[:12], c.machine, c.state, c.status.value, str(c.seq)) for c in children],
            ("CHILD RUN", "MACHINE", "STATE", "STATUS", "SEQ"),
        )
    if iterations:
        click.echo("")
        _print_iterations(iterations)
    if artifacts:
        click.echo("")
        _table(
            [
                (a.name, a.kind, str(a.seq), a.status, a.path or "(in journal)", a.error or "")
                for a in artifacts
            ],
            ("ARTIFACT", "KIND", "SEQ", "STATUS", "WHERE", "ERROR"),
        )


def _subphase_visits(
    spec: MachineSpec, timeline: Sequence[TransitionRecord]
) -> list[dict[str, Any]]:
    """Per sub-phase the run entered: attempts, restarts, interruptions, last event.

    All read off the journaled transitions: an attempt is each entry (a return after a server
    restart included) and each rerun after RETRIED or INTERRUPTED.
    """
    visits: dict[str, dict[str, Any]] = {}
    for leaf in spec.leaves:
        parents = spec.parents(leaf.name)
        if parents:
            visits[leaf.name] = {
                "subphase": leaf.name,
                "parent": parents[0],
                "attempts": 0,
                "restarts": 0,
                "interruptions": 0,
                "last_event": None,
            }
    for t in timeline:
        entered = visits.get(t.to_state)
        if entered is not None and t.from_state != t.to_state:
            entered["attempts"] += 1
            if t.event == "SERVER_RECOVERED":
                entered["restarts"] += 1
        left = visits.get(t.from_state or "")
        if left is not None:
            left["last_event"] = t.event
            if t.event == "INTERRUPTED":
                left["interruptions"] += 1
            if t.event in ("INTERRUPTED", "RETRIED"):  # the phase runs again: one more attempt
                left["attempts"] += 1
    return [v for v in visits.values() if v["attempts"]]


def _artifact_summary(artifact: ArtifactRecord) -> dict[str, Any]:
    from fsm_runner.records import unstructure

    data = unstructure(artifact)
    data.pop("content", None)  # `export` writes contents; listings stay short
    return data


def _print_iterations(iterations: Sequence[IterationRecord]) -> None:
    rows = []
    for record in iterations:
        tokens = "-" if record.tokens_total is None else str(record.tokens_total)
        cost = "-" if record.cost_usd is None else f"{record.cost_usd:.4f}"
        ok = {True: "yes", False: "no", None: "-"}
        error = "" if record.error_type.value == "none" else record.error_type.value
        if record.error_message:
            error = f"{error}: {record.error_message}"
        rows.append(
            (
                str(record.iteration),
                record.state,
                ok[record.success],
                ok[record.passed],
                ",".join(record.levels_run) or "-",
                tokens,
                cost,
                "-" if record.duration_ms is None else f"{record.duration_ms / 1000:.1f}s",
                "yes" if record.feedback else "-",
                record.model or "-",
                record.agent_session_id or "-",
                error,
            )
        )
    _table(
        _wrap_column(rows, 11, 50),
        ("ITER", "STATE", "AGENT OK", "PASSED", "LEVELS", "TOKENS", "COST $", "TIME", "FEEDBACK",
         "MODEL", "SESSION", "ERROR"),
    )  # fmt: skip


def _print_summary(run: RunRecord) -> None:
    pairs = [
        ("run", run.run_id),
        ("machine", f"{run.machine} (spec {run.spec_hash[:12]})"),
        ("state", _styled_status(f"{run.state} ({run.status.value})", run.status.value)),
        ("seq", f"{run.seq}   iteration {run.iteration}   attempt {run.attempt}"),
        ("started", f"{_time(run.created_at)} UTC   updated {_time(run.updated_at)} UTC"),
        ("input", json.dumps(run.input, ensure_ascii=False)),
        ("context", json.dumps(dict(run.context), ensure_ascii=False)),
    ]
    if run.parent_run_id:
        pairs.append(("parent", run.parent_run_id))
    if run.forked_from:
        pairs.append(("forked", run.forked_from))
    if run.abort_reason:
        pairs.append(("abort", f"requested: {run.abort_reason}"))
    if run.error:
        pairs.append(("error", f"{run.error.get('type')}: {run.error.get('message')}"))
    width = _text_width() - 9
    for key, value in pairs:
        # Long values (the input, the context) wrap between words under their value.
        lines = _wrap(value, width)
        click.echo(f"{key:<9}{lines[0]}")
        for line in lines[1:]:
            click.echo(f"{'':<9}{line}")


def _print_timeline(timeline: Sequence[TransitionRecord]) -> None:
    rows = []
    for t in timeline:
        error = t.error
        rows.append(
            (
                str(t.seq),
                t.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
                t.from_state or "-",
                t.event,
                t.to_state,
                f"{t.duration_ms:.1f}",
                f"{error.get('type')}: {error.get('message')}" if error else "",
            )
        )
    _table(_wrap_column(rows, 6, 80), ("SEQ", "AT (UTC)", "FROM", "EVENT", "TO", "MS", "ERROR"))


def _import_object(path: str, param_hint: str) -> Any:
    """Import ``MODULE:ATTR`` or ``FILE.py:ATTR`` (ATTR may be dotted); a bad path is one line.

    A path the user got wrong (no colon, no such module or file, no such attribute) is a usage
    error (exit 2); a module that fails while it is imported is a failure (exit 1).
    """
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        _fail(
            f"{param_hint}: expected MODULE:ATTR or FILE.py:ATTR, e.g. myapp.jobs:engine, "
            f"not {path!r}",
            EXIT_USAGE,
        )
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        module = _import_file(module_name, param_hint)
    else:
        module = _import_module(module_name, param_hint)
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            _fail(f"{param_hint}: {module_name!r} has no attribute {attr!r}", EXIT_USAGE)
        target = getattr(target, part)
    return target


def _import_module(module_name: str, param_hint: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # console scripts do not put the cwd on sys.path
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            _fail(
                f"{param_hint}: cannot import {module_name!r}: no module named {missing!r} "
                "(give an importable MODULE:ATTR, or a FILE.py:ATTR path)",
                EXIT_USAGE,
            )
        _fail(f"importing {module_name!r} failed: ModuleNotFoundError: {exc}")
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import; say so in one line
        _fail(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}")


def _import_file(file_name: str, param_hint: str) -> Any:
    """Import a Python file by its path, as ``python FILE`` would find its sibling modules."""
    import importlib.util

    file = Path(file_name).expanduser().resolve()
    if not file.is_file() or file.suffix != ".py":
        what = "is not a .py file" if file.exists() else "does not exist"
        _fail(
            f"{param_hint}: {file_name} {what} (expected MODULE:ATTR or FILE.py:ATTR)", EXIT_USAGE
        )
    name = f"_fsm_runner_app_{re.sub(r'[^0-9A-Za-z_]', '_', str(file))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has a loader
        _fail(f"{param_hint}: cannot import {file_name}", EXIT_USAGE)
    module = importlib.util.module_from_spec(spec)
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))  # its own imports of modules beside it
    sys.modules[name] = module  # dataclasses, attrs and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file failed at import; say so in one line
        del sys.modules[name]
        _fail(f"importing {file_name} failed: {type(exc).__name__}: {exc}")
    return module


def _refuse_non_factory(path: str, factory: Callable[..., Any], wanted: str) -> None:
    """Refuse, before calling it, a callable that needs arguments or says it returns no app.

    Calling, say, a CLI's ``main`` would run it; its signature tells it is not a factory.
    """
    import inspect

    if isinstance(factory, click.Command):
        _fail(f"{path} is a command line, not {wanted} or a factory of one", EXIT_USAGE)
    try:
        signature = inspect.signature(factory, eval_str=True)
    except Exception:  # noqa: BLE001 - no usable signature (a builtin, a forward reference): try it
        return
    try:
        signature.bind()
    except TypeError:
        _fail(f"{path} takes arguments; expected {wanted} or a zero-argument factory", EXIT_USAGE)
    returns = signature.return_annotation
    if returns is None or returns is type(None):
        _fail(f"{path} returns None, not {wanted}", EXIT_USAGE)
    if isinstance(returns, type) and returns.__module__ == "builtins":
        _fail(f"{path} returns {returns.__name__}, not {wanted}", EXIT_USAGE)


def _call_factory(path: str, factory: Callable[[], Any]) -> Any:
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory failed; say so in one line
        _fail(f"{path} failed: {type(exc).__name__}: {exc}")
    except SystemExit as exc:  # a CLI's main, say: it is no factory
        _fail(f"{path} exited (code {exc.code}) instead of returning an app", EXIT_USAGE)


def _load_app(path: str) -> Engine:
    """Import ``MODULE:ATTR``: an Engine, or a zero-argument factory returning one."""
    from fsm_runner.engine import Engine

    target = _import_object(path, "--app")
    if isinstance(target, Engine):
        return target
    if callable(target) and not (isinstance(target, type) and not issubclass(target, Engine)):
        _refuse_non_factory(path, target, "an Engine")
        produced = _call_factory(path, target)
        if isinstance(produced, Engine):
            return produced
        _fail(f"{path} returned {type(produced).__name__}, not an Engine", EXIT_USAGE)
    what = f"the class {target.__name__}" if isinstance(target, type) else type(target).__name__
    _fail(f"{path} is {what}, not an Engine or a zero-argument factory of one", EXIT_USAGE)


def _load_spec(path: str, param_hint: str) -> MachineSpec:
    """Import ``MODULE:ATTR``: a MachineSpec, an Engine, or a factory returning either."""
    from fsm_runner.engine import Engine
    from fsm_runner.spec import MachineSpec

    target = _import_object(path, param_hint)
    if callable(target) and not isinstance(target, MachineSpec | Engine | type):
        _refuse_non_factory(path, target, "a MachineSpec or an Engine")
        target = _call_factory(path, target)
        if isinstance(target, Engine):
            target.close()  # only its spec is wanted
            return target.spec
    if isinstance(target, Engine):
        return target.spec
    if isinstance(target, MachineSpec):
        return target
    _fail(
        f"{path} is {type(target).__name__}, not a MachineSpec, an Engine or a factory of one",
        EXIT_USAGE,
    )


def _echo_transition(transition: TransitionRecord, run: RunRecord) -> None:
    error = transition.error
    note = f"  ({error.get('type')}: {error.get('message')})" if error else ""
    click.echo(
        f"{transition.seq:>4}  {transition.from_state or '-'} --{transition.event}--> "
        f"{transition.to_state}{note}"
    )


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--app",
    metavar="MODULE:ATTR",
    help="The host app: an Engine, or a zero-argument factory returning one, as MODULE:ATTR or"
    " FILE.py:ATTR. Optional for runs whose input names their app (as `demo` and `agent-loop`"
    " runs do).",
)
@click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this many steps.")
@click.option(
    "--from-state",
    metavar="STATE",
    help="Continue from this earlier state of the run instead (journaled as REWOUND).",
)
@click.pass_obj
def resume(
    state: _State, run_id: str, app: str | None, max_steps: int | None, from_state: str | None
) -> None:
    """Resume a run from its last journaled state, with the handlers of --app.

    The run continues in the journal given to fsm-runner (--journal), whatever journal the
    app's engine was built with. Prints each transition as it is committed. With
    --from-state, the run first goes back to that state (one it has been in, not a terminal
    one) and its phase runs again; the move is journaled as a REWOUND transition.
    """
    journal = state.journal()
    run_id = _resolve_run_id(journal, run_id)
    if app is None:
        run_input = journal.load(run_id).input
        app = run_input.get("app") if isinstance(run_input, dict) else None
        if not isinstance(app, str):
            raise click.UsageError("this run's input names no app; pass --app MODULE:ATTR")
    from fsm_runner.engine import interrupt_on_sigterm
    from fsm_runner.exceptions import InvalidTransitionError

    engine = _load_app(app).with_journal(journal)
    engine.listeners.append(_echo_transition)
    try:
        with interrupt_on_sigterm():
            run = engine.resume(run_id, max_steps=max_steps, from_state=from_state)
    except InvalidTransitionError as exc:
        if from_state is None or exc.event != "REWOUND":
            raise
        _fail(f"--from-state: {exc}", EXIT_USAGE)  # a state the run cannot go back to
    except KeyboardInterrupt:
        _fail(f"run {run_id} interrupted; it stays resumable: fsm-runner resume {run_id[:12]}")
    finally:
        engine.close()
    click.echo(f"run {run.run_id} is {run.status.value} in state {run.state!r}")
    if run.status.value in ("failed", "aborted", "dead_letter"):
        sys.exit(1)


@cli.command()
@click.option(
    "--app", required=True, metavar="MODULE:ATTR", help="The host app: an Engine or a factory."
)
@click.option("--limit", type=click.IntRange(min=1), help="Recover at most this many runs.")
@click.pass_obj
def recover(state: _State, app: str, limit: int | None) -> None:
    """Take over the app's runs whose worker is gone (lease expired) and run them.

    A run taken over more often than the engine's max_recoveries is parked as dead_letter
    with the reason instead. Prints one line per run recovered.
    """
    from fsm_runner.engine import interrupt_on_sigterm

    journal = state.journal()
    engine = _load_app(app).with_journal(journal)
    engine.listeners.append(_echo_transition)
    try:
        with interrupt_on_sigterm():
            recovered = engine.recover(limit=limit)
    except KeyboardInterrupt:
        _fail("interrupted; the runs not finished stay recoverable")
    finally:
        engine.close()
    for run in recovered:
        click.echo(
            _styled_status(
                f"run {run.run_id} is {run.status.value} in state {run.state!r}", run.status.value
            )
        )
    click.echo(f"recovered {len(recovered)} runs")


@cli.command()
@click.option(
    "--app", required=True, metavar="MODULE:ATTR", help="The host app: an Engine or a factory."
)
@click.option("--max-runs", type=click.IntRange(min=1), help="Stop after this many runs.")
@click.option("--exit-when-idle", is_flag=True, help="Stop when no run is runnable.")
@click.option(
    "--idle-wait",
    type=click.FloatRange(min=0.01),
    default=0.5,
    show_default=True,
    metavar="S",
    help="Seconds between looks for work while idle.",
)
@click.pass_obj
def worker(
    state: _State, app: str, max_runs: int | None, exit_when_idle: bool, idle_wait: float
) -> None:
    """Be a worker: claim the app's runnable runs one at a time and run them.

    Any number of workers may share one journal; each run is advanced by one worker at a time
    (leases with fencing). Runs whose worker died are taken over once their lease expires.
    Stops on Ctrl-C or SIGTERM, leaving the run in progress resumable.
    """
    from fsm_runner.engine import interrupt_on_sigterm

    journal = state.journal()
    engine = _load_app(app).with_journal(journal)
    engine.listeners.append(
        lambda transition, run: click.echo(
            f"{run.run_id[:12]} {transition.seq:>4}  {transition.from_state or '-'} "
            f"--{transition.event}--> {transition.to_state}"
        )
    )
    try:
        with interrupt_on_sigterm():
            taken = engine.work(
                max_runs=max_runs, exit_when_idle=exit_when_idle, idle_wait=idle_wait
            )
    except KeyboardInterrupt:
        _fail(f"worker {engine.worker_id} stopped; its run in progress stays resumable")
    finally:
        engine.close()
    click.echo(f"worker {engine.worker_id} ran {taken} runs")


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--reason", required=True, help="Why the run is aborted (journaled).")
@click.option(
    "--app",
    metavar="MODULE:ATTR",
    help="The host app, needed only when the spec's USER_ABORTED transition has guards.",
)
@click.pass_obj
def abort(state: _State, run_id: str, reason: str, app: str | None) -> None:
    """Abort a run: it follows its USER_ABORTED transition, or stops where it is."""
    from fsm_runner.engine import abort_run

    journal = state.journal()
    run_id = _resolve_run_id(journal, run_id)
    guards = _load_app(app).guards if app else None
    run = abort_run(journal, run_id, reason, guards=guards)
    if run.ended:
        click.echo(f"run {run.run_id} aborted: {run.status.value} in state {run.state!r}")
    else:  # a live worker holds it: the request is journaled, the worker carries it out
        click.echo(
            f"run {run.run_id}: abort requested; {run.lease_owner}, which holds the run, "
            "carries it out at its next step"
        )


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.argument(
    "directory", metavar="DIR", type=click.Path(file_okay=False, writable=True, path_type=Path)
)
@click.pass_obj
def export(state: _State, run_id: str, directory: Path) -> None:
    """Write a run to DIR as JSON files.

    run.json (the run and its transitions), effects.json (its effects ledger),
    iteration-N.json for each iteration, and one file per artifact named after it
    (agent-N.json, verification-N.json for agent-loop runs).
    """
    from fsm_runner.records import unstructure

    journal = state.journal()
    run = journal.load(_resolve_run_id(journal, run_id))
    files: dict[str, Any] = {
        "run.json": {
            "run": unstructure(run),
            "transitions": [unstructure(t) for t in journal.transitions(run.run_id)],
        },
        "effects.json": [unstructure(e) for e in journal.effects(run.run_id)],
    }
    for record in journal.iterations(run.run_id):
        files[f"iteration-{record.iteration}.json"] = unstructure(record)
    for artifact in journal.artifacts(run.run_id):
        # artifact names come from handlers: keep them inside DIR whatever they hold
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", artifact.name).lstrip(".") or "artifact"
        files[f"{safe}.json"] = (
            artifact.content if artifact.status == "stored" else _artifact_summary(artifact)
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (directory / name).write_text(
                json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            )
    except OSError as exc:
        _fail(f"cannot write to {directory}: {exc.strerror or exc}")
    click.echo(f"wrote {len(files)} files to {directory}: {', '.join(sorted(files))}")


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--at",
    "at_seq",
    type=click.IntRange(min=0),
    help="The last seq the fork keeps (default: the run's last; required for an ended run).",
)
@click.option("--run-id", "new_run_id", metavar="ID", help="The fork's id (default: random).")
@click.option("--json", "as_json", is_flag=True, help="Print the fork's run row as JSON.")
@click.pass_obj
def fork(
    state: _State, run_id: str, at_seq: int | None, new_run_id: str | None, as_json: bool
) -> None:
    """Fork a run: a new run with RUN's history up to --at SEQ.

    The fork records where it came from (RUN@SEQ); the original is untouched. The fork stands
    in the state the original was in at SEQ, and that state's phase runs when it is resumed
    (fsm-runner resume FORK --app ...). Ended runs can be forked at any earlier seq.
    """
    from fsm_runner.engine import fork_run
    from fsm_runner.records import unstructure

    journal = state.journal()
    run_id = _resolve_run_id(journal, run_id)
    try:
        forked = fork_run(journal, run_id, at_seq=at_seq, new_run_id=new_run_id)
    except ValueError as exc:
        _fail(f"--at: {exc}", EXIT_USAGE)
    if as_json:
        _json_dump(unstructure(forked))
        return
    click.echo(
        f"forked {forked.forked_from} as run {forked.run_id}: state {forked.state!r}, "
        f"seq {forked.seq}; continue it with: fsm-runner resume {forked.run_id[:12]} --app ..."
    )


@cli.command()
@click.argument("spec_path", metavar="[SPEC_IMPORT_PATH]", required=False)
@click.option(
    "--run", "run_id", metavar="RUN", help="Draw this run's path on its machine (from the journal)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["mermaid", "dot", "svg", "png"]),
    default="mermaid",
    show_default=True,
    help="Text (mermaid, dot), or an image rendered by Graphviz `dot` (svg, png).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write to this file instead of stdout.",
)
@click.pass_obj
def diagram(
    state: _State, spec_path: str | None, run_id: str | None, fmt: str, output: Path | None
) -> None:
    """Draw a machine, or a run's path on it, as Mermaid, DOT, SVG or PNG.

    SPEC_IMPORT_PATH is MODULE:ATTR naming a MachineSpec, an Engine, or a zero-argument
    factory returning either. With --run, the machine is read from the journal (no import
    needed): visited states and taken edges are highlighted, edges show how often they were
    taken, the current state is marked, and a failed run's last state is marked as failed.
    """
    from fsm_runner.diagrams import render, render_image
    from fsm_runner.spec import MachineSpec

    if (spec_path is None) == (run_id is None):
        _fail("give either SPEC_IMPORT_PATH or --run RUN (one of them)", EXIT_USAGE)
    run = None
    timeline: Sequence[TransitionRecord] = ()
    if run_id is not None:
        journal = state.journal()
        run = journal.load(_resolve_run_id(journal, run_id))
        timeline = journal.transitions(run.run_id)
        spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
    else:
        assert spec_path is not None
        spec = _load_spec(spec_path, "SPEC_IMPORT_PATH")
    if fmt in ("svg", "png"):
        text = render(spec, format="dot", run=run, timeline=timeline)
        data = render_image(text, format="svg" if fmt == "svg" else "png")
    else:
        text = render(spec, format="dot" if fmt == "dot" else "mermaid", run=run, timeline=timeline)
        data = text.encode()
    if output is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    try:
        output.write_bytes(data)
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror or exc}")
    click.echo(f"wrote {output} ({fmt}, {len(data)} bytes)", err=True)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.01),
    default=0.5,
    show_default=True,
    metavar="S",
    help="How often to look at the journal, in seconds.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per transition.")
@click.pass_obj
def watch(state: _State, run_id: str, interval: float, as_json: bool) -> None:
    """Follow a run, printing each transition as it is journaled.

    Follows until the run ends, or Ctrl-C.

    Transitions journaled before the command started are printed first. Exits 1 if the run
    ends failed or aborted.
    """
    import time

    from fsm_runner.records import unstructure

    journal = state.journal()
    run_id = _resolve_run_id(journal, run_id)
    next_seq = 0
    try:
        while True:
            run = journal.load(run_id)
            if run.seq >= next_seq:
                for transition in journal.transitions(run_id, from_seq=next_seq):
                    if as_json:
                        click.echo(json.dumps(unstructure(transition), sort_keys=True))
                    else:
                        _echo_transition(transition, run)
                    next_seq = transition.seq + 1
            if run.ended and next_seq > run.seq:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        sys.exit(130)
    if not as_json:
        click.echo(
            _styled_status(
                f"run {run.run_id} is {run.status.value} in state {run.state!r}", run.status.value
            )
        )
    if run.status.value in ("failed", "aborted", "dead_letter"):
        sys.exit(EXIT_FAILURE)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--to", "to_seq", type=click.IntRange(min=0), metavar="SEQ", help="Stop after this seq."
)
@click.option(
    "--spec",
    "spec_path",
    metavar="MODULE:ATTR",
    help="Replay through this spec (e.g. the changed one) instead of the run's own.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the replayed steps as JSON.")
@click.pass_obj
def replay(
    state: _State, run_id: str, to_seq: int | None, spec_path: str | None, as_json: bool
) -> None:
    """Replay a run's journal through its spec; check that it reproduces the run.

    Checks that seqs start at 0 without gaps, that every transition is one the spec (or the
    engine) allows from the state before it, and that the run row is exactly what the
    transitions lead to. Prints the reconstructed timeline; on a mismatch, exits 1 naming
    the first one (seq, expected, found).
    """
    from fsm_runner.records import unstructure
    from fsm_runner.replay import journal_specs
    from fsm_runner.replay import replay as replay_through

    journal = state.journal()
    run = journal.load(_resolve_run_id(journal, run_id))
    if to_seq is not None and to_seq > run.seq:
        _fail(f"--to: run {run.run_id} has seqs 0..{run.seq}", EXIT_USAGE)
    specs = journal_specs(journal)
    spec = _load_spec(spec_path, "--spec") if spec_path is not None else specs(run.spec_hash)
    timeline = journal.transitions(run.run_id, to_seq=to_seq)
    replayed = replay_through(
        spec,
        run,
        timeline,
        to_seq=to_seq,
        path=journal.location,
        specs=None if spec_path is not None else specs,
    )
    if as_json:
        _json_dump(
            {
                "run": unstructure(replayed.run),
                "steps": [
                    {**unstructure(step.transition), "kind": step.kind,
                     "run": unstructure(step.run)}
                    for step in replayed.steps
                ],
                "matches": True,
            }
        )  # fmt: skip
        return
    rows = [
        (
            str(step.seq),
            step.transition.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            step.from_state or "-",
            step.event,
            step.to_state,
            str(step.run.iteration),
            str(step.run.attempt),
            step.run.status.value,
            step.kind,
        )
        for step in replayed.steps
    ]
    _table(
        rows,
        ("SEQ", "AT (UTC)", "FROM", "EVENT", "TO", "ITER", "ATTEMPT", "STATUS", "AS"),
        styles=[step.run.status.value for step in replayed.steps],
    )
    click.echo("")
    if to_seq is None:
        click.echo(
            f"replay of run {run.run_id} matches the journal: {len(replayed.steps)} "
            f"transitions, state {run.state!r} ({run.status.value})"
        )
    else:
        at = replayed.run
        click.echo(
            f"run {run.run_id} at seq {to_seq}: state {at.state!r} ({at.status.value}), "
            f"iteration {at.iteration}, attempt {at.attempt}"
        )


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the problems as JSON.")
@click.pass_obj
def check(state: _State, as_json: bool) -> None:
    """Check the journal's integrity, and replay every run through its spec.

    SQLite's own integrity check and dangling rows, then for every run: seqs gapless from 0
    (invariant 2), the run row equal to its last transition (1) and to what replaying its
    transitions gives (8). Exits 1 with a list of problems, one per line.
    """
    from fsm_runner.replay import check_journal

    journal = state.journal()
    problems = check_journal(journal)
    count = len(journal.run_ids("", limit=sys.maxsize))
    if as_json:
        _json_dump({"journal": journal.location, "runs": count, "problems": problems})
    elif problems:
        click.echo(f"journal {journal.location}: {len(problems)} problems in {count} runs")
        for problem in problems:
            click.echo(f"  {problem}")
    else:
        click.echo(f"journal {journal.location}: {count} runs checked, no problems")
    if problems:
        sys.exit(EXIT_FAILURE)


@cli.command()
@click.option(
    "--older-than",
    "days",
    type=click.FloatRange(min=0),
    required=True,
    metavar="DAYS",
    help="Prune runs that ended (were last updated) more than this many days ago.",
)
@click.option("--dry-run", is_flag=True, help="Only list what would be pruned.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def prune(state: _State, days: float, dry_run: bool, as_json: bool) -> None:
    """Delete old ended runs with all they own, then reclaim space.

    Runs that have not ended, and ended runs with a child run still active, are never touched.
    """
    import datetime as dt

    from fsm_runner.records import utc_now

    journal = state.journal()
    report = journal.prune(ended_before=utc_now() - dt.timedelta(days=days), dry_run=dry_run)
    if as_json:
        _json_dump(
            {
                "run_ids": list(report.run_ids),
                "runs": len(report.run_ids),
                "transitions": report.transitions,
                "dry_run": report.dry_run,
                "bytes_before": report.bytes_before,
                "bytes_after": report.bytes_after,
            }
        )
        return
    verb = "would prune" if dry_run else "pruned"
    click.echo(
        f"{verb} {_count(len(report.run_ids), 'run')} ({_count(report.transitions, 'transition')})"
    )
    if dry_run:
        for pruned_id in report.run_ids:
            click.echo(f"  {pruned_id}")
    elif report.bytes_before is not None and report.bytes_after is not None:
        click.echo(f"journal size {report.bytes_before:,} -> {report.bytes_after:,} bytes")


def _count(number: int, noun: str) -> str:
    """``1 run``, ``2 runs``, ``0 runs``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _journal_option(state: _State) -> str:
    """``--journal LOCATION `` for a suggested command, unless it would find the journal anyway."""
    import shlex

    location = state.journal_path
    if location in (DEFAULT_JOURNAL, os.environ.get(ENV_JOURNAL)):
        return ""
    return f"--journal {shlex.quote(location)} "


def _run_agent_loop(state: _State, run_input: dict[str, Any]) -> None:
    """Start an agent-loop run with ``run_input``, print it as it goes, then its iterations."""
    from fsm_runner.presets.agent_commands import make_engine
    from fsm_runner.presets.agent_services import GitSnapshotter

    # Refused before anything starts: a workspace that cannot be snapshotted (not in a git
    # repository) would otherwise be found only after the agent had worked in it.
    snapshots = GitSnapshotter().check_workspace(run_input["workspace"])
    journal = state.journal(must_exist=False)
    engine = make_engine(journal)
    engine.listeners.append(_echo_transition)
    click.echo(f"agent loop in {run_input['workspace']}, journal {journal.location}")
    click.echo(f"snapshots: {snapshots} (each build's changes are committed there)")
    run_id = engine.start(run_input)
    from fsm_runner.engine import interrupt_on_sigterm

    try:
        with interrupt_on_sigterm():
            run = engine.run(run_id)
    except KeyboardInterrupt:
        _fail(f"run {run_id} interrupted; it stays resumable: fsm-runner resume {run_id[:12]}")
    finally:
        engine.close()
    click.echo("")
    _print_iterations(journal.iterations(run_id))
    click.echo("")
    click.echo(f"run {run.run_id} is {run.status.value} in state {run.state!r}")
    if run.error and run.ended:
        click.echo(f"reason: {run.error.get('message')}")
    short, journal_option = run_id[:12], _journal_option(state)
    click.echo(
        f"see it with: fsm-runner {journal_option}show {short}   "
        f"export it with: fsm-runner {journal_option}export {short} fsm-runner-export-{short}"
    )
    if run.status.value in ("failed", "aborted", "dead_letter"):
        sys.exit(1)


@cli.command()
@click.pass_obj
def demo(state: _State) -> None:
    """Run the agent loop on a small demo project, journaled like any run.

    Creates a git project with a failing test in a temporary directory, and runs a scripted
    agent (a real subprocess that edits files: one wrong attempt, then the fix) with real
    verification: L0 compiles the code, L1 runs pytest.
    """
    from fsm_runner.presets.agent_commands import create_demo_project, demo_input

    _run_agent_loop(state, demo_input(create_demo_project()))


@cli.command("agent-loop")
@click.option(
    "--workspace",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The git repository the agent works in.",
)
@click.option(
    "--agent",
    "agent_command",
    required=True,
    metavar="CMD",
    help="The agent command, run by the shell in the workspace. It gets the task and feedback"
    " in $FSM_TASK and $FSM_FEEDBACK (also $FSM_SESSION_ID, $FSM_ITERATION, $FSM_WORKSPACE) and"
    " as one JSON object on stdin; a JSON line it prints may report session_id, model, tokens"
    " and cost_usd.",
)
@click.option("--task", required=True, metavar="PROMPT", help="The task prompt.")
@click.option(
    "--verify",
    "levels",
    multiple=True,
    required=True,
    metavar="LEVEL=CMD",
    help="A verification command, e.g. L1='pytest -q'; repeat for more checks and levels.",
)
@click.option("--max-iterations", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="S",
    help="Wall-clock limit of the whole run in seconds (each agent run gets at most this too).",
)
@click.pass_obj
def agent_loop(
    state: _State,
    workspace: Path,
    agent_command: str,
    task: str,
    levels: tuple[str, ...],
    max_iterations: int,
    timeout: float | None,
) -> None:
    """Run the agent loop on your own repository with your own agent CLI.

    build (your agent) -> snapshot (git) -> verify (your levels) -> feedback -> build ...
    until verification passes or a limit is spent. Resume with `fsm-runner resume RUN`.
    """
    from fsm_runner.presets.agent_commands import loop_input

    verify: dict[str, list[str]] = {}
    for item in levels:
        level, sep, command = item.partition("=")
        if not sep or not level.strip() or not command.strip():
            raise click.BadParameter(f"expected LEVEL=CMD, not {item!r}", param_hint="--verify")
        verify.setdefault(level.strip(), []).append(command)
    run_input = loop_input(
        task=task,
        workspace=workspace,
        agent=agent_command,
        verify=verify,
        max_iterations=max_iterations,
        timeout=timeout,
    )
    _run_agent_loop(state, run_input)


cli.add_command(importlib.import_module("fsm_runner.ui.command").ui)  # the run inspector


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``fsm-runner`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="fsm-runner")
