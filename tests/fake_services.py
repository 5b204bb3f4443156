"""Fake services for the agent-loop preset: scripted, and each keeps the calls it got.

A script is a list of items played in order, the last one repeating once the script is used up;
an exception in it is raised instead of returned, and a callable is called with the call's
argument and its return value used (a hook, e.g. to abort the run while the agent runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from fsm_runner.presets.agent_loop import (
    AgentRequest,
    AgentResult,
    CheckResult,
    LevelResult,
    Snapshot,
    VerificationReport,
)
from fsm_runner.records import ArtifactRecord


class Script:
    """Items played in order; the last one repeats."""

    def __init__(self, items: Sequence[Any]) -> None:
        if not items:
            raise ValueError("a script needs at least one item")
        self.items = list(items)
        self.played = 0

    def play(self, argument: Any) -> Any:
        item = self.items[min(self.played, len(self.items) - 1)]
        self.played += 1
        if isinstance(item, BaseException):
            raise item
        if callable(item):
            return item(argument)
        return item


# -- building what the services return ---------------------------------------------------------


def agent_result(n: int = 1, **changes: Any) -> AgentResult:
    """A successful agent run, numbered ``n`` in its session id and token counts."""
    result = AgentResult(
        success=True,
        exit_code=0,
        session_id=f"session-{n}",
        stdout=f"built #{n}",
        model="model-x",
        tokens_input=100 * n,
        tokens_output=10 * n,
        tokens_total=110 * n,
        cost_usd=0.01 * n,
        duration_ms=5.0,
    )
    return attrs.evolve(result, **changes)


def passing_report(*levels: str) -> VerificationReport:
    """Every level passed (``L0`` and ``L1`` unless named)."""
    names = levels or ("L0", "L1")
    return VerificationReport(
        passed=True,
        levels=tuple(
            LevelResult(name, passed=True, checks=(CheckResult(f"check {name}", passed=True),))
            for name in names
        ),
        duration_ms=3.0,
    )


def failing_report(
    level: str = "L1", command: str = "pytest -q", *, exit_code: int = 1
) -> VerificationReport:
    """L0 passed, then ``level`` failed on ``command`` (after a check of it that passed)."""
    return VerificationReport(
        passed=False,
        levels=(
            LevelResult("L0", passed=True, checks=(CheckResult("ruff check", passed=True),)),
            LevelResult(
                level,
                passed=False,
                checks=(
                    CheckResult("mypy", passed=True, exit_code=0),
                    CheckResult(command, passed=False, exit_code=exit_code, output_tail="1 failed"),
                ),
            ),
        ),
        duration_ms=4.0,
    )


# -- the fakes ---------------------------------------------------------------------------------


class FakeAgent:
    """An ``AgentDriver`` playing a script of ``AgentResult`` values; keeps every request."""

    def __init__(self, *script: Any) -> None:
        self.script = Script(script or [agent_result()])
        self.requests: list[AgentRequest] = []

    def run(self, request: AgentRequest) -> AgentResult:
        self.requests.append(request)
        result: AgentResult = self.script.play(request)
        return result


class FakeSnapshotter:
    """A ``Snapshotter`` returning ``snap-1``, ``snap-2`` …, or raising ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.workspaces: list[str] = []
        self.since: list[str | None] = []

    def capture(self, workspace: str, *, since: str | None = None) -> Snapshot:
        self.workspaces.append(workspace)
        self.since.append(since)
        if self.error is not None:
            raise self.error
        n = len(self.workspaces)
        return Snapshot(
            f"snap-{n}", before=f"rev-{n - 1}", after=f"rev-{n}", changed_files=("a.py",)
        )


@attrs.frozen
class VerifyCall:
    """One call to :class:`FakeVerifier`."""

    workspace: str
    levels: Mapping[str, Sequence[str]] | None
    timeout: float | None


class FakeVerifier:
    """A ``Verifier`` playing a script of ``VerificationReport`` values; keeps every call."""

    def __init__(self, *script: Any) -> None:
        self.script = Script(script or [passing_report()])
        self.calls: list[VerifyCall] = []

    def verify(
        self,
        workspace: str,
        *,
        levels: Mapping[str, Sequence[str]] | None = None,
        timeout: float | None = None,
    ) -> VerificationReport:
        call = VerifyCall(workspace, levels, timeout)
        self.calls.append(call)
        report: VerificationReport = self.script.play(call)
        return report


class FakeFeedback:
    """A ``FeedbackGenerator`` playing a script of texts (``fix #1``, ``fix #2`` … by default)."""

    def __init__(self, *script: Any) -> None:
        self.script = Script(script or [lambda _: f"fix #{len(self.reports)}"])
        self.reports: list[VerificationReport] = []
        self.tasks: list[str] = []

    def generate(self, report: VerificationReport, *, task: str) -> str:
        self.reports.append(report)
        self.tasks.append(task)
        text: str = self.script.play(report)
        return text


@attrs.frozen
class PersistCall:
    """One call to :class:`FakePersister`."""

    run_id: str
    name: str
    kind: str
    data: Any


class FakePersister:
    """A ``ResultPersister`` that stores to nowhere: it raises ``error``, or reports a failure
    when ``fail`` is set, or returns the artifact with a made-up path."""

    def __init__(self, *, error: Exception | None = None, fail: bool = False) -> None:
        self.error = error
        self.fail = fail
        self.calls: list[PersistCall] = []

    def persist(self, run_id: str, name: str, kind: str, data: Any) -> ArtifactRecord:
        self.calls.append(PersistCall(run_id, name, kind, data))
        if self.error is not None:
            raise self.error
        if self.fail:
            return ArtifactRecord(name, kind, status="failed", error="disk full")
        return ArtifactRecord(name, kind, data, path=f"/artifacts/{run_id}/{name}.json")
