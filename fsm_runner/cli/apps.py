"""The host app a command names (``--app``, ``--spec``, ``SPEC_IMPORT_PATH``), and running it.

Each is ``MODULE:ATTR`` (an importable module; the current directory is on the path) or
``FILE.py:ATTR`` (a path to a Python file). A path the user got wrong is a usage error (exit
2); an app that fails while it is imported or built is a failure (exit 1); either is one line.

An app is an ``Engine`` or a factory of one. A factory that takes the journal
(``make(journal) -> Engine``: its first parameter is named ``journal``) is given the command's
journal, so nothing else is opened. An app that opens a journal of its own (an
``Engine`` at import, a zero-argument factory, an engine on the default ``./fsm-runner.db``)
is used on the command's journal instead (``with_journal``), and the engine it built is
closed with its journal; a journal file it created for nothing in the current directory (not
there before, and no run in it) is removed, so no stray ``fsm-runner.db`` is left behind.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fsm_runner.cli.errors import EXIT_USAGE, fail

if TYPE_CHECKING:
    from fsm_runner.engine import Engine
    from fsm_runner.journal import Journal
    from fsm_runner.spec import MachineSpec


def _import_object(path: str, param_hint: str) -> Any:
    """Import ``MODULE:ATTR`` or ``FILE.py:ATTR`` (ATTR may be dotted); a bad path is one line.

    A path the user got wrong (no colon, no such module or file, no such attribute) is a usage
    error (exit 2); a module that fails while it is imported is a failure (exit 1).
    """
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        fail(
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
            fail(f"{param_hint}: {module_name!r} has no attribute {attr!r}", EXIT_USAGE)
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
            fail(
                f"{param_hint}: cannot import {module_name!r}: no module named {missing!r} "
                "(give an importable MODULE:ATTR, or a FILE.py:ATTR path)",
                EXIT_USAGE,
            )
        fail(f"importing {module_name!r} failed: ModuleNotFoundError: {exc}")
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import; say so in one line
        fail(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}")


def _import_file(file_name: str, param_hint: str) -> Any:
    """Import a Python file by its path, as ``python FILE`` would find its sibling modules."""
    import importlib.util

    file = Path(file_name).expanduser().resolve()
    if not file.is_file() or file.suffix != ".py":
        what = "is not a .py file" if file.exists() else "does not exist"
        fail(f"{param_hint}: {file_name} {what} (expected MODULE:ATTR or FILE.py:ATTR)", EXIT_USAGE)
    name = f"_fsm_runner_app_{re.sub(r'[^0-9A-Za-z_]', '_', str(file))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has a loader
        fail(f"{param_hint}: cannot import {file_name}", EXIT_USAGE)
    module = importlib.util.module_from_spec(spec)
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))  # its own imports of modules beside it
    sys.modules[name] = module  # dataclasses, attrs and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file failed at import; say so in one line
        del sys.modules[name]
        fail(f"importing {file_name} failed: {type(exc).__name__}: {exc}")
    return module


def _takes_journal(path: str, factory: Callable[..., Any], wanted: str) -> bool:
    """Whether ``factory`` is given the journal; refuse one that is no factory, before calling it.

    A factory takes no argument, or the journal (its first parameter is named ``journal``).
    Calling, say, a CLI's ``main`` would run it; its signature tells it is not a factory.
    """
    import inspect

    if isinstance(factory, click.Command):
        fail(f"{path} is a command line, not {wanted} or a factory of one", EXIT_USAGE)
    try:
        signature = inspect.signature(factory, eval_str=True)
    except Exception:  # noqa: BLE001 - no usable signature (a builtin, a forward reference): try it
        return False
    returns = signature.return_annotation
    if returns is None or returns is type(None):
        fail(f"{path} returns None, not {wanted}", EXIT_USAGE)
    if isinstance(returns, type) and returns.__module__ == "builtins":
        fail(f"{path} returns {returns.__name__}, not {wanted}", EXIT_USAGE)
    first = next(iter(signature.parameters.values()), None)
    if first is not None and first.name == "journal" and _binds(signature, 1):
        return True
    if not _binds(signature, 0):
        fail(
            f"{path} takes arguments; expected {wanted} or a factory taking no argument or "
            "the journal (a parameter named journal)",
            EXIT_USAGE,
        )
    return False


def _binds(signature: Any, count: int) -> bool:
    try:
        signature.bind(*([None] * count))
    except TypeError:
        return False
    return True


def _call_factory(path: str, factory: Callable[..., Any], *args: Any) -> Any:
    try:
        return factory(*args)
    except Exception as exc:  # noqa: BLE001 - the user's factory failed; say so in one line
        fail(f"{path} failed: {type(exc).__name__}: {exc}")
    except SystemExit as exc:  # a CLI's main, say: it is no factory
        fail(f"{path} exited (code {exc.code}) instead of returning an app", EXIT_USAGE)


def load_app(path: str, journal: Journal) -> Engine:
    """The engine of the app at ``MODULE:ATTR``, journaling to ``journal``; the caller closes it.

    ``ATTR`` is an Engine, or a factory of one taking no argument or the journal (see the
    module docstring). An engine the app built on another journal is closed, and a journal
    file it created for nothing in the current directory is removed.
    """
    from fsm_runner.cli.journals import CliState

    context = click.get_current_context(silent=True)
    state = context.find_object(CliState) if context is not None else None
    if state is not None:
        state.telemetry()  # before the app's engine is made (its module may make it)
    before = _cwd_entries()  # an Engine built when its module is imported opens its journal
    built = _build_app(path, journal)
    if built.journal is journal:
        return built
    try:
        return built.with_journal(journal)
    finally:
        _discard(built, keep=journal, before=before)


def _build_app(path: str, journal: Journal) -> Engine:  # noqa: RET503 - fail() raises
    from fsm_runner.engine import Engine

    target = _import_object(path, "--app")
    if isinstance(target, Engine):
        return target
    if callable(target) and not (isinstance(target, type) and not issubclass(target, Engine)):
        args = [journal] if _takes_journal(path, target, "an Engine") else []
        produced = _call_factory(path, target, *args)
        if isinstance(produced, Engine):
            return produced
        fail(f"{path} returned {type(produced).__name__}, not an Engine", EXIT_USAGE)
    what = f"the class {target.__name__}" if isinstance(target, type) else type(target).__name__
    fail(f"{path} is {what}, not an Engine or a factory of one", EXIT_USAGE)


def load_spec(path: str, param_hint: str) -> MachineSpec:  # noqa: RET503 - fail() raises
    """Import ``MODULE:ATTR``: a MachineSpec, an Engine, or a factory returning either.

    A factory that takes the journal is given one in memory: only its spec is wanted.
    """
    from fsm_runner.engine import Engine
    from fsm_runner.journal import open_journal
    from fsm_runner.spec import MachineSpec

    before = _cwd_entries()
    target = _import_object(path, param_hint)
    if callable(target) and not isinstance(target, MachineSpec | Engine | type):
        takes_journal = _takes_journal(path, target, "a MachineSpec or an Engine")
        scratch = open_journal(":memory:") if takes_journal else None
        try:
            target = _call_factory(path, target, *([scratch] if scratch else []))
        finally:
            if scratch is not None:
                scratch.close()  # a journal in memory: nothing to keep
        if isinstance(target, Engine):
            spec = target.spec
            _discard(target, keep=None, before=before)  # only its spec is wanted
            return spec
    if isinstance(target, Engine):
        return target.spec
    if isinstance(target, MachineSpec):
        return target
    fail(
        f"{path} is {type(target).__name__}, not a MachineSpec, an Engine or a factory of one",
        EXIT_USAGE,
    )


def _cwd_entries() -> set[str]:
    """The names in the current directory, to tell a journal file an app creates from one there."""
    try:
        return set(os.listdir())
    except OSError:
        return set()


#: What SQLite keeps beside a journal file while it is open (or after a crash).
_SIDECARS = ("", "-wal", "-shm", "-journal")


def _discard(engine: Engine, *, keep: Journal | None, before: set[str]) -> None:
    """Close an engine the command does not use, with the journal the app opened for it.

    A SQLite journal file in the current directory that was not there before the app was
    loaded, and holds no run, was created by the app for nothing (its default
    ``./fsm-runner.db``, say): it is removed. Anything that may be someone's is left alone.
    """
    from fsm_runner.exceptions import FsmRunnerError
    from fsm_runner.journal import SqliteJournal

    made = engine.journal
    stray = None
    if made is not keep and isinstance(made, SqliteJournal):
        file = Path(made.path)
        if file.parent == Path.cwd() and file.name not in before and not _same_file(file, keep):
            try:
                stray = file if not made.runs(limit=1) else None
            except FsmRunnerError:  # unreadable: not provably empty
                stray = None
    engine.close()  # closes the journal it opened itself (none given)
    if made is not keep:
        made.close()
    if stray is not None:
        for suffix in _SIDECARS:
            if stray.name + suffix not in before:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stray.with_name(stray.name + suffix))


def _same_file(file: Path, journal: Journal | None) -> bool:
    try:
        return journal is not None and os.path.samefile(file, journal.location)
    except OSError:
        return False


@contextlib.contextmanager
def driving(engine: Engine, *, interrupted: str | None) -> Iterator[None]:
    """Run the block with SIGTERM taken as Ctrl-C, then close ``engine``.

    Args:
        engine: the app's engine, which the block drives.
        interrupted: the one line a Ctrl-C or SIGTERM stops the command with (exit 1);
            ``None``: the ``KeyboardInterrupt`` goes on to the caller, once ``engine`` closed.
    """
    from fsm_runner.engine import interrupt_on_sigterm

    try:
        with interrupt_on_sigterm():
            yield
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        fail(interrupted)
    finally:
        if engine.telemetry is not None:  # the process is about to exit: its counts go now
            engine.telemetry.flush()
        engine.close()


def interrupted_run(run_id: str) -> str:
    """What a command says when the run it drove was interrupted."""
    from fsm_runner.run_ids import shown

    return f"run {shown(run_id)} interrupted; it stays resumable: fsm-runner resume {run_id[:12]}"
