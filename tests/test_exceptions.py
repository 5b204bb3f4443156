"""Every error of fsm_runner survives pickle and copy as itself (issue 18).

Errors cross process boundaries: a worker's error is read back by its parent, and
``multiprocessing`` or ``concurrent.futures`` pools pickle what a task raised. The errors found
here are every subclass of :class:`FsmRunnerError` that ``fsm_runner`` defines, in any module
(presets and the CLI included), found by walking ``__subclasses__()`` after importing the whole
package, so a new error cannot be forgotten: it fails here until it has an example in
``EXAMPLES``.

(The messages and attributes of ``fsm_runner.exceptions`` are tested in ``test_public_api.py``.)
"""

from __future__ import annotations

import concurrent.futures
import copy
import importlib
import multiprocessing
import pickle
import pkgutil
import sys
from typing import Any

import pytest

import fsm_runner
from fsm_runner.exceptions import (
    FsmRunnerError,
    InvalidTransitionError,
    PhaseTimeoutError,
    SpecError,
)

#: Representative constructor arguments of every error fsm_runner defines, by class name:
#: (positional, keyword). Keyword-only arguments are the ones default pickling loses.
EXAMPLES: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    # fsm_runner.exceptions
    "FsmRunnerError": (("something failed",), {}),
    "SpecError": ((["a is bad", "b is bad"],), {"machine": "m"}),
    "InvalidTransitionError": ((), {"run_id": "r1", "state": "building", "event": "NEXT"}),
    "PhaseError": (
        (),
        {
            "run_id": "r1",
            "state": "building",
            "event": "SYSTEM_ERROR",
            "error": {"type": "E", "message": "m"},
        },
    ),
    "HandlerResultError": ((), {"run_id": "r1", "state": "building", "detail": "returned 42"}),
    "PayloadError": ((), {"run_id": "r1", "what": "input", "detail": "set is not JSON"}),
    "PhaseTimeoutError": ((), {"state": "building", "timeout": 2.5}),
    "WaitTimeoutError": ((), {"state": "reviewing", "signal": "verdict", "timeout": 60.0}),
    "RunAbortedError": ((), {"run_id": "r1", "reason": "operator"}),
    "JournalError": (("is read-only",), {"path": "/tmp/j.db"}),
    "JournalNotFoundError": (("is a directory, not a journal file",), {"path": "/tmp/j"}),
    "SchemaVersionError": ((), {"found": 99, "supported": 8, "path": "/tmp/j.db"}),
    "SpecMismatchError": ((), {"run_id": "r1", "expected": "a" * 64, "found": "b" * 64}),
    "RunConflictError": (
        (),
        {"run_id": "r1", "expected_seq": 4, "path": "/tmp/j.db", "abort_reason": "operator"},
    ),
    "ReplayMismatchError": (
        (),
        {"run_id": "r1", "seq": 3, "expected": "state 'b'", "found": "state 'c'", "path": "/j"},
    ),
    "RunNotFoundError": (("r1",), {}),
    "AmbiguousRunIdError": (("ab", ["abc0", "abd1"]), {}),
    "RunExistsError": (("r1",), {}),
    "InvalidRunIdError": (("../x", "it holds '/'"), {}),
    "RunTerminalError": ((), {"run_id": "r1", "state": "done", "status": "succeeded"}),
    "LeaseError": (("r1", "no lease"), {}),
    "LeaseHeldError": (("r1",), {"owner": "worker-2", "expires_at": "2024-05-01T12:00:00+00:00"}),
    "LeaseLostError": (("r1",), {"token": 7}),
    "EffectOutcomeUnknownError": ((), {"run_id": "r1", "state": "mutating", "effect": "push"}),
    "EffectFailedError": (
        (),
        {"run_id": "r1", "effect": "push", "error_type": "OSError", "message": "refused"},
    ),
    "EffectMismatchError": (
        (),
        {"run_id": "r1", "state": "mutating", "effect": "push", "detail": "is used twice"},
    ),
    "CapabilityError": ((), {"state": "verifying", "operation": "write", "detail": " (2 > 1)"}),
    "SupervisorError": (("helper server", "restart budget spent"), {}),
    "DiagramError": (("Graphviz `dot` is not installed",), {}),
    # fsm_runner.presets
    "TaskGraphError": ((["task a depends on b, which does not exist"],), {}),
    "SessionStateError": (
        (),
        {"run_id": "s1", "state": "planning", "operation": "finalize_session", "reason": "early"},
    ),
    "WorkspaceError": (
        ("git apply failed",),
        {"workspace": "/w", "command": ["git", "apply"], "returncode": 1},
    ),
    "WorkspaceBusyError": (("pid 42 holds it",), {"workspace": "/w"}),
    "SnapshotError": (
        ("git commit failed",),
        {"workspace": "/w", "command": ["git", "commit"], "returncode": 128, "stderr": "fatal"},
    ),
    "ServerUnreachableError": (("http://127.0.0.1:1/run", "connection refused"), {}),
    "HelperServerError": (("http://127.0.0.1:1/run", 500, "boom"), {}),
}


def import_everything() -> None:
    """Import every module of fsm_runner, so every error it defines is a known subclass."""
    for module in pkgutil.walk_packages(fsm_runner.__path__, prefix="fsm_runner."):
        if module.name != "fsm_runner.__main__":  # importing it runs the CLI
            importlib.import_module(module.name)


def fsm_runner_errors() -> list[type[FsmRunnerError]]:
    """``FsmRunnerError`` and every subclass of it that fsm_runner defines, found recursively."""
    import_everything()
    found: list[type[FsmRunnerError]] = [FsmRunnerError]
    for cls in found:  # grows while it is walked: a breadth-first walk of the tree
        found.extend(sub for sub in cls.__subclasses__() if sub not in found)
    return sorted(
        (cls for cls in found if cls.__module__.split(".")[0] == "fsm_runner"),
        key=lambda cls: cls.__name__,
    )


ERRORS = fsm_runner_errors()


def example(cls: type[FsmRunnerError]) -> FsmRunnerError:
    """An instance of ``cls`` built from its entry in ``EXAMPLES``; fails if it has none."""
    if cls.__name__ not in EXAMPLES:
        pytest.fail(f"{cls.__module__}.{cls.__qualname__} has no entry in EXAMPLES: add one")
    args, kwargs = EXAMPLES[cls.__name__]
    error = cls(*args, **kwargs)
    assert type(error) is cls
    return error


def assert_same_error(copied: BaseException, original: FsmRunnerError) -> None:
    """``copied`` is ``original``'s type, with its message, args and every attribute."""
    assert type(copied) is type(original)
    assert str(copied) == str(original)
    assert copied.args == original.args
    assert vars(copied) == vars(original)


def raise_example(name: str) -> None:
    """Raise the example error of the class called ``name`` (runs in a spawned process)."""
    raise example(next(cls for cls in ERRORS if cls.__name__ == name))


class TestEveryErrorIsFound:
    """The walk finds the whole tree, and the table has an example of each error."""

    def test_the_walk_finds_errors_of_every_kind(self):
        names = {cls.__name__ for cls in ERRORS}

        # one of each: the base, a deep subclass, a keyword-only one, presets' own
        assert {"FsmRunnerError", "LeaseLostError", "SessionStateError", "SnapshotError"} <= names

    def test_class_names_are_unique(self):
        assert len({cls.__name__ for cls in ERRORS}) == len(ERRORS)

    def test_every_example_names_an_error(self):
        assert set(EXAMPLES) <= {cls.__name__ for cls in ERRORS}


class TestPickle:
    """Every error pickles back as itself, on every protocol."""

    @pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
    @pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
    def test_round_trip(self, cls, protocol):
        error = example(cls)

        copied = pickle.loads(pickle.dumps(error, protocol=protocol))

        assert_same_error(copied, error)

    @pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
    def test_copy(self, cls):
        error = example(cls)

        assert_same_error(copy.copy(error), error)
        assert_same_error(copy.deepcopy(error), error)

    def test_structured_attributes_come_back(self):
        error = InvalidTransitionError(run_id="r1", state="building", event="NEXT", reason="late")

        copied = pickle.loads(pickle.dumps(error))

        assert (copied.run_id, copied.state, copied.event, copied.reason) == (
            "r1",
            "building",
            "NEXT",
            "late",
        )
        assert isinstance(copied, ValueError)

    def test_a_timeout_keeps_its_message_under_oserror(self):
        # OSError.__new__ leaves args empty for a subclass with its own __init__
        error = PhaseTimeoutError(state="building", timeout=2.5)

        copied = pickle.loads(pickle.dumps(error))

        assert str(copied) == "phase 'building' ran past its timeout of 2.5s"
        assert isinstance(copied, TimeoutError)

    def test_an_error_built_from_a_generator(self):
        error = SpecError((f"problem {i}" for i in range(2)), machine="m")

        copied = pickle.loads(pickle.dumps(error))

        assert copied.problems == ("problem 0", "problem 1")
        assert str(copied) == "invalid machine spec 'm': problem 0; problem 1"

    def test_notes_come_back(self):
        error = example(InvalidTransitionError)
        if sys.version_info >= (3, 11):
            error.add_note("while resuming r1")
        else:  # add_note is 3.11's: on 3.10 notes are set by hand (as the exceptiongroup backport does)
            error.__notes__ = ["while resuming r1"]

        copied = pickle.loads(pickle.dumps(error))

        assert copied.__notes__ == ["while resuming r1"]


@pytest.mark.slow
class TestAcrossProcesses:
    """An error raised in a spawned worker process is raised as itself in its parent."""

    def test_a_spawned_worker_raises_it_in_the_parent(self):
        names = ["InvalidTransitionError", "LeaseHeldError", "PhaseTimeoutError"]
        context = multiprocessing.get_context("spawn")

        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            futures = {name: pool.submit(raise_example, name) for name in names}
            errors = {name: future.exception(timeout=60) for name, future in futures.items()}

        for name, error in errors.items():
            assert error is not None
            assert_same_error(error, example(next(cls for cls in ERRORS if cls.__name__ == name)))
