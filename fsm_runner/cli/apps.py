"""The host app a command names (``--app``, ``--spec``, ``SPEC_IMPORT_PATH``), and running it.

Each is ``MODULE:ATTR`` (an importable module; the current directory is on the path) or
``FILE.py:ATTR`` (a path to a Python file). A path the user got wrong is a usage error (exit
2); an app that fails while it is imported or built is a failure (exit 1); either is one line.
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


def _refuse_non_factory(path: str, factory: Callable[..., Any], wanted: str) -> None:
    """Refuse, before calling it, a callable that needs arguments or says it returns no app.

    Calling, say, a CLI's ``main`` would run it; its signature tells it is not a factory.
    """
    import inspect

    if isinstance(factory, click.Command):
        fail(f"{path} is a command line, not {wanted} or a factory of one", EXIT_USAGE)
    try:
        signature = inspect.signature(factory, eval_str=True)
    except Exception:  # noqa: BLE001 - no usable signature (a builtin, a forward reference): try it
        return
    try:
        signature.bind()
    except TypeError:
        fail(f"{path} takes arguments; expected {wanted} or a zero-argument factory", EXIT_USAGE)
    returns = signature.return_annotation
    if returns is None or returns is type(None):
        fail(f"{path} returns None, not {wanted}", EXIT_USAGE)
    if isinstance(returns, type) and returns.__module__ == "builtins":
        fail(f"{path} returns {returns.__name__}, not {wanted}", EXIT_USAGE)


def _call_factory(path: str, factory: Callable[[], Any]) -> Any:
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory failed; say so in one line
        fail(f"{path} failed: {type(exc).__name__}: {exc}")
    except SystemExit as exc:  # a CLI's main, say: it is no factory
        fail(f"{path} exited (code {exc.code}) instead of returning an app", EXIT_USAGE)


def load_app(path: str) -> Engine:  # noqa: RET503 - fail() raises
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
        fail(f"{path} returned {type(produced).__name__}, not an Engine", EXIT_USAGE)
    what = f"the class {target.__name__}" if isinstance(target, type) else type(target).__name__
    fail(f"{path} is {what}, not an Engine or a zero-argument factory of one", EXIT_USAGE)


def load_spec(path: str, param_hint: str) -> MachineSpec:  # noqa: RET503 - fail() raises
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
    fail(
        f"{path} is {type(target).__name__}, not a MachineSpec, an Engine or a factory of one",
        EXIT_USAGE,
    )


@contextlib.contextmanager
def driving(engine: Engine, *, interrupted: str) -> Iterator[None]:
    """Run the block with SIGTERM taken as Ctrl-C, then close ``engine``.

    Args:
        engine: the app's engine, which the block drives.
        interrupted: the one line a Ctrl-C or SIGTERM stops the command with (exit 1).
    """
    from fsm_runner.engine import interrupt_on_sigterm

    try:
        with interrupt_on_sigterm():
            yield
    except KeyboardInterrupt:
        fail(interrupted)
    finally:
        engine.close()


def interrupted_run(run_id: str) -> str:
    """What a command says when the run it drove was interrupted."""
    return f"run {run_id} interrupted; it stays resumable: fsm-runner resume {run_id[:12]}"
