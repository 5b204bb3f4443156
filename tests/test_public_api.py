from __future__ import annotations

import ast
import importlib.resources
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import fsm_runner
from fsm_runner import exceptions
from fsm_runner.exceptions import (
    AmbiguousRunIdError,
    CapabilityError,
    DiagramError,
    EffectFailedError,
    EffectMismatchError,
    EffectOutcomeUnknownError,
    FsmRunnerError,
    HandlerResultError,
    InvalidRunIdError,
    InvalidTransitionError,
    JournalError,
    JournalNotFoundError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    PayloadError,
    PhaseError,
    PhaseTimeoutError,
    ReplayMismatchError,
    RunAbortedError,
    RunConflictError,
    RunExistsError,
    RunNotFoundError,
    RunTerminalError,
    SchemaVersionError,
    SpecError,
    SpecMismatchError,
    SupervisorError,
    WaitTimeoutError,
)


def isort_style_key(name: str) -> tuple[int, str]:
    """Ruff's RUF022 order: CONSTANTS, then CamelCase, then everything else."""
    if name.isupper():
        group = 0
    elif name[:1].isupper():
        group = 1
    else:
        group = 2
    return group, name


def public_names(module: types.ModuleType) -> set[str]:
    """Names a module defines or re-exports on purpose (not submodules, not __future__)."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"  # `from __future__ import annotations` leaves this behind
    }


#: One instance of every exception, with the attribute values it must carry.
SAMPLES: dict[type[FsmRunnerError], tuple[FsmRunnerError, dict[str, object]]] = {
    FsmRunnerError: (FsmRunnerError("something failed"), {}),
    SpecError: (SpecError(["a is bad", "b is bad"], machine="m"), {"machine": "m"}),
    InvalidTransitionError: (
        InvalidTransitionError(run_id="r1", state="building", event="NEXT"),
        {"run_id": "r1", "state": "building", "event": "NEXT", "reason": "not allowed"},
    ),
    PhaseError: (
        PhaseError(
            run_id="r1", state="building", event="SYSTEM_ERROR", error={"type": "E", "message": "m"}
        ),
        {"run_id": "r1", "state": "building", "event": "SYSTEM_ERROR"},
    ),
    HandlerResultError: (
        HandlerResultError(run_id="r1", state="building", detail="returned 42"),
        {"run_id": "r1", "state": "building", "detail": "returned 42"},
    ),
    PayloadError: (
        PayloadError(run_id="r1", what="input", detail="set is not JSON"),
        {"run_id": "r1", "what": "input", "detail": "set is not JSON"},
    ),
    PhaseTimeoutError: (
        PhaseTimeoutError(state="building", timeout=2.5),
        {"state": "building", "timeout": 2.5},
    ),
    WaitTimeoutError: (
        WaitTimeoutError(state="reviewing", signal="verdict", timeout=60.0),
        {"state": "reviewing", "signal": "verdict", "timeout": 60.0},
    ),
    RunAbortedError: (
        RunAbortedError(run_id="r1", reason="operator"),
        {"run_id": "r1", "reason": "operator"},
    ),
    JournalError: (
        JournalError("is read-only", path="/tmp/j.db"),
        {"detail": "is read-only", "path": "/tmp/j.db"},
    ),
    JournalNotFoundError: (
        JournalNotFoundError(path="/tmp/j.db"),
        {"detail": "", "path": "/tmp/j.db"},
    ),
    SchemaVersionError: (
        SchemaVersionError(found=99, supported=1, path="/tmp/j.db"),
        {"found": 99, "supported": 1, "path": "/tmp/j.db"},
    ),
    SpecMismatchError: (
        SpecMismatchError(run_id="r1", expected="a" * 64, found="b" * 64),
        {"run_id": "r1", "expected": "a" * 64, "found": "b" * 64},
    ),
    RunConflictError: (
        RunConflictError(run_id="r1", expected_seq=4, path="/tmp/j.db"),
        {"run_id": "r1", "expected_seq": 4},
    ),
    RunNotFoundError: (RunNotFoundError("r1"), {"run_id": "r1"}),
    AmbiguousRunIdError: (
        AmbiguousRunIdError("ab", ["abc0", "abd1"]),
        {"prefix": "ab", "matches": ("abc0", "abd1")},
    ),
    RunExistsError: (RunExistsError("r1"), {"run_id": "r1"}),
    InvalidRunIdError: (
        InvalidRunIdError("r1\n", "it holds '\\n'"),
        {"run_id": "r1\n", "reason": "it holds '\\n'"},
    ),
    RunTerminalError: (
        RunTerminalError(run_id="r1", state="done", status="succeeded"),
        {"run_id": "r1", "state": "done", "status": "succeeded"},
    ),
    LeaseError: (LeaseError("r1", "no lease"), {"run_id": "r1"}),
    LeaseHeldError: (
        LeaseHeldError("r1", owner="worker-2", expires_at="2024-05-01T12:00:00+00:00"),
        {"run_id": "r1", "owner": "worker-2", "expires_at": "2024-05-01T12:00:00+00:00"},
    ),
    LeaseLostError: (LeaseLostError("r1", token=7), {"run_id": "r1", "token": 7}),
    EffectOutcomeUnknownError: (
        EffectOutcomeUnknownError(run_id="r1", state="mutating", effect="push"),
        {"run_id": "r1", "state": "mutating", "effect": "push"},
    ),
    CapabilityError: (
        CapabilityError(state="verifying", operation="write"),
        {"state": "verifying", "operation": "write"},
    ),
    EffectFailedError: (
        EffectFailedError(run_id="r1", effect="push", error_type="OSError", message="refused"),
        {"run_id": "r1", "effect": "push", "error_type": "OSError"},
    ),
    EffectMismatchError: (
        EffectMismatchError(run_id="r1", state="mutating", effect="push", detail="is used twice"),
        {"run_id": "r1", "state": "mutating", "effect": "push", "detail": "is used twice"},
    ),
    SupervisorError: (
        SupervisorError("helper server", "restart budget spent"),
        {"resource": "helper server", "detail": "restart budget spent"},
    ),
    ReplayMismatchError: (
        ReplayMismatchError(run_id="r1", seq=3, expected="state 'b'", found="state 'c'"),
        {"run_id": "r1", "seq": 3, "expected": "state 'b'", "found": "state 'c'"},
    ),
    DiagramError: (
        DiagramError("Graphviz `dot` is not installed"),
        {"detail": "Graphviz `dot` is not installed"},
    ),
}


class TestAll:
    """fsm_runner.__all__ is the public contract: sorted, complete, importable."""

    def test_sorted(self):
        assert fsm_runner.__all__ == sorted(fsm_runner.__all__, key=isort_style_key)

    def test_the_export_list_is_sorted(self):
        # _EXPORTS is the one list: __all__ and the lazy __getattr__ are made from it
        assert list(fsm_runner._EXPORTS) == sorted(fsm_runner._EXPORTS, key=isort_style_key)
        assert fsm_runner.__all__ == [
            name for name in fsm_runner._EXPORTS if name not in fsm_runner._OPTIONAL
        ]

    def test_what_type_checkers_see_is_the_export_list(self):
        # the TYPE_CHECKING imports say for type checkers what _EXPORTS says at run time
        tree = ast.parse(Path(fsm_runner.__file__).read_text(encoding="utf-8"))
        block = next(
            node
            for node in tree.body
            if isinstance(node, ast.If) and ast.unparse(node.test) == "typing.TYPE_CHECKING"
        )
        seen: dict[str, str] = {}
        for node in block.body:
            assert isinstance(node, ast.ImportFrom)
            assert node.module is not None
            for alias in node.names:
                assert alias.asname == alias.name, f"{alias.name}: `X as X` re-exports it"
                seen[alias.name] = node.module
        assert seen == fsm_runner._EXPORTS

    def test_every_public_exception_is_exported(self):
        assert set(exceptions.__all__) <= set(fsm_runner.__all__)
        for name in exceptions.__all__:
            assert getattr(fsm_runner, name) is getattr(exceptions, name)

    def test_no_duplicates(self):
        assert len(set(fsm_runner.__all__)) == len(fsm_runner.__all__)

    def test_complete(self):
        # the package loads its names lazily: what it offers is what dir() lists
        offered = {
            name
            for name in dir(fsm_runner)
            if not name.startswith("_")
            and not isinstance(getattr(fsm_runner, name), types.ModuleType)
            and name != "annotations"
        }
        assert offered == set(fsm_runner.__all__) | fsm_runner._OPTIONAL

    def test_the_star_import_works_without_optional_extras(self):
        code = (
            "import sys; sys.modules['psycopg'] = None; "  # as if psycopg were not installed
            "from fsm_runner import *; from fsm_runner.journal import *; print(Engine.__name__)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == "Engine"

    def test_an_optional_name_without_its_extra_is_a_clear_error(self):
        code = (
            "import sys; sys.modules['psycopg'] = None\n"
            "from fsm_runner import JournalError\n"
            "try:\n"
            "    from fsm_runner import PostgresJournal\n"
            "except JournalError as exc:\n"
            "    print(exc)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        assert "install fsm-runner[postgres]" in out

    def test_importing_the_package_imports_no_engine(self):
        code = (
            "import sys, fsm_runner; "
            "print(sorted(m for m in sys.modules"
            " if m.startswith(('fsm_runner.', 'sqlite_utils', 'psycopg'))))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == "[]"

    def test_an_unknown_name_is_an_attribute_error(self):
        with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
            fsm_runner.Nope  # noqa: B018 - the access is the test

    def test_every_name_is_importable(self):
        namespace: dict[str, object] = {}
        exec("from fsm_runner import *", namespace)  # the star import is the subject

        for name in fsm_runner.__all__:
            assert namespace[name] is getattr(fsm_runner, name)

    @pytest.mark.parametrize(
        "name",
        [
            "Engine",
            "MachineSpec",
            "State",
            "Transition",
            "RetryPolicy",
            "RunEvent",
            "PhaseStatus",
            "Journal",
            "SqliteJournal",
            "MemoryJournal",
            "open_journal",
            "RunRecord",
            "TransitionRecord",
            "FsmRunnerError",
            "SpecError",
            "InvalidTransitionError",
            "JournalError",
            "RunNotFoundError",
            "RunTerminalError",
        ],
    )
    def test_design_names_are_exported(self, name):
        assert name in fsm_runner.__all__

    @pytest.mark.parametrize("owner", ["Engine", "Journal"])
    def test_what_public_methods_return_is_exported(self, owner):
        # a host app can name (and type) everything the engine and a journal hand back
        cls = getattr(fsm_runner, owner)
        returned = set()
        for name, member in vars(cls).items():
            annotation = getattr(member, "__annotations__", {}).get("return")
            if not name.startswith("_") and isinstance(annotation, str):
                returned |= set(re.findall(r"\b[A-Z]\w*", annotation))
        returned -= {"Exception", "Mapping", "None", "Sequence"}  # builtins and typing
        assert returned, "no annotations found: the test would prove nothing"
        assert returned <= set(fsm_runner.__all__)

    @pytest.mark.parametrize(
        ("name", "module"),
        [
            ("ArtifactRecord", "fsm_runner.records"),
            ("EffectRecord", "fsm_runner.records"),
            ("IterationRecord", "fsm_runner.records"),
            ("PruneReport", "fsm_runner.journal"),
        ],
    )
    def test_returned_types_are_the_journals_own(self, name, module):
        assert getattr(fsm_runner, name) is getattr(importlib.import_module(module), name)

    def test_py_typed(self):
        assert importlib.resources.files("fsm_runner").joinpath("py.typed").is_file()


#: What a preset may import from fsm_runner: the public contract and other presets, as a host
#: app would (DESIGN: "Presets use the public API only").
PUBLIC_MODULES = ("fsm_runner", "fsm_runner.exceptions", "fsm_runner.testing")


def fsm_runner_imports(path: Path) -> set[str]:
    """The fsm_runner modules a source file imports from."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "fsm_runner"}


PRESETS = Path(fsm_runner.__file__).parent.joinpath("presets")

#: Preset modules that import more than the public API, and why. The sub-phases preset's command
#: line uses the journal option and exit codes every command line shares (``command_line``) and
#: run-id prefixes (``journal.locate``), and its harness the supervisor (documented, but not in
#: ``fsm_runner.__all__``).
BEYOND_THE_PUBLIC_API = {
    "subphases/__init__.py": {
        "fsm_runner.command_line",
        "fsm_runner.journal.locate",
        "fsm_runner.supervisor",
    },
}


@pytest.mark.parametrize(
    "path",
    sorted(PRESETS.rglob("*.py")),
    ids=lambda path: path.relative_to(PRESETS).as_posix(),
)
def test_the_presets_use_only_the_public_api(path):
    private = {
        name
        for name in fsm_runner_imports(path)
        if name not in PUBLIC_MODULES and not name.startswith("fsm_runner.presets.")
    }
    assert private <= BEYOND_THE_PUBLIC_API.get(path.relative_to(PRESETS).as_posix(), set())


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # the README names this path
        ("fsm_runner.presets.agent_services", "fsm_runner.presets.agent_loop.services"),
        # runs journaled before the presets were grouped name this app and this agent command
        ("fsm_runner.presets.agent_commands", "fsm_runner.presets.agent_loop.commands"),
    ],
)
def test_a_preset_module_that_moved_keeps_its_old_path(old, new):
    moved, kept = importlib.import_module(new), importlib.import_module(old)
    assert kept.__all__ == moved.__all__
    for name in moved.__all__:
        assert getattr(kept, name) is getattr(moved, name)


def test_the_old_agent_command_path_still_runs_the_demo_agent():
    done = subprocess.run(
        [sys.executable, "-m", "fsm_runner.presets.agent_commands"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "usage: python -m fsm_runner.presets.agent_loop.commands agent" in done.stderr


class TestExceptionModule:
    """fsm_runner.exceptions exports the whole tree."""

    def test_all_is_sorted(self):
        assert exceptions.__all__ == sorted(exceptions.__all__, key=isort_style_key)

    def test_all_covers_every_error_class(self):
        defined = {
            name
            for name, value in vars(exceptions).items()
            if inspect.isclass(value)
            and issubclass(value, FsmRunnerError)
            and value.__module__ == exceptions.__name__
        }

        assert defined == set(exceptions.__all__)

    def test_every_exported_error_has_a_sample_here(self):
        assert {cls.__name__ for cls in SAMPLES} == set(exceptions.__all__)

    @pytest.mark.parametrize(
        ("child", "parent"),
        [
            (SpecError, ValueError),
            (InvalidTransitionError, ValueError),
            (HandlerResultError, PhaseError),
            (HandlerResultError, TypeError),
            (PayloadError, TypeError),
            (PhaseTimeoutError, TimeoutError),
            (WaitTimeoutError, PhaseTimeoutError),
            (SchemaVersionError, JournalError),
            (SpecMismatchError, JournalError),
            (RunConflictError, JournalError),
            (RunNotFoundError, KeyError),
            (JournalNotFoundError, JournalError),
            (AmbiguousRunIdError, LookupError),
            (LeaseHeldError, LeaseError),
            (LeaseLostError, LeaseError),
        ],
    )
    def test_tree(self, child, parent):
        assert issubclass(child, parent)
        assert issubclass(child, FsmRunnerError)

    def test_every_error_is_an_fsm_runner_error(self):
        for name in exceptions.__all__:
            assert issubclass(getattr(exceptions, name), FsmRunnerError)


class TestExceptionMessages:
    """Every error builds a one-line message from its structured attributes."""

    @pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda cls: cls.__name__)
    def test_one_line_message(self, cls):
        error, _ = SAMPLES[cls]

        text = str(error)

        assert type(error) is cls
        assert text
        assert "\n" not in text
        assert text == error.message

    @pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda cls: cls.__name__)
    def test_structured_attributes(self, cls):
        error, attributes = SAMPLES[cls]

        for name, value in attributes.items():
            assert getattr(error, name) == value

    @pytest.mark.parametrize(
        "cls",
        [cls for cls, (_, expected) in SAMPLES.items() if "run_id" in expected],
        ids=lambda cls: cls.__name__,
    )
    def test_message_names_the_run(self, cls):
        error, _ = SAMPLES[cls]

        assert re.search(r"\br1\b", str(error)), str(error)

    def test_run_not_found_is_a_key_error_with_a_plain_message(self):
        error = RunNotFoundError("x")

        assert error.run_id == "x"
        assert isinstance(error, KeyError)
        assert str(error) == "no run 'x' in the journal"
        with pytest.raises(KeyError):
            raise error

    def test_spec_error_lists_every_problem(self):
        error = SpecError(["first problem", "second problem"], machine="m")

        assert error.problems == ("first problem", "second problem")
        assert isinstance(error, ValueError)
        assert str(error) == "invalid machine spec 'm': first problem; second problem"

    def test_journal_error_names_the_journal(self):
        assert str(JournalError("is full", path="/j.db")) == "journal /j.db: is full"
        assert str(JournalError("is full")) == "journal: is full"

    def test_schema_version_error_names_both_versions(self):
        text = str(SchemaVersionError(found=99, supported=1))

        assert "99" in text
        assert "(1)" in text


class TestDeprecatedNames:
    """``Outcome`` (then ``RunOutcome``) and ``RunStatus`` were renamed ``RunLifecycle`` and ``PhaseStatus``."""

    @pytest.mark.parametrize(
        ("module", "old", "new"),
        [
            ("fsm_runner", "Outcome", "RunLifecycle"),
            ("fsm_runner", "RunOutcome", "RunLifecycle"),
            ("fsm_runner", "RunStatus", "PhaseStatus"),
            ("fsm_runner.spec", "Outcome", "RunLifecycle"),
            ("fsm_runner.spec", "RunOutcome", "RunLifecycle"),
            ("fsm_runner.events", "RunStatus", "PhaseStatus"),
        ],
    )
    def test_an_old_name_warns_and_is_the_new_class(self, module, old, new):
        imported = importlib.import_module(module)
        with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated; use {new}"):
            value = getattr(imported, old)
        assert value is getattr(fsm_runner, new)

    def test_from_import_of_an_old_name_warns_too(self):
        with pytest.warns(DeprecationWarning, match="use RunLifecycle"):
            from fsm_runner import Outcome
        assert Outcome.SUCCEEDED is fsm_runner.RunLifecycle.SUCCEEDED

    @pytest.mark.parametrize("module", ["fsm_runner.spec", "fsm_runner.events"])
    def test_an_unknown_name_is_still_an_attribute_error(self, module):
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            getattr(importlib.import_module(module), "Nope")  # noqa: B009

    def test_old_names_are_not_in_all(self):
        assert {"Outcome", "RunOutcome", "RunStatus"}.isdisjoint(fsm_runner.__all__)
