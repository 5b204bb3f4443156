"""Real services for the agent-loop preset: git snapshots, verification commands, command agents.

:mod:`fsm_runner.presets.agent_loop` declares what its phases need as protocols; this module
implements them with what every workspace already has — git, a shell and a file system:

====================================  ==============================  ===========================
service                               protocol                        medium
====================================  ==============================  ===========================
:class:`CommandAgentDriver`           :class:`AgentDriver`            the agent's command line
:class:`GitSnapshotter`               :class:`Snapshotter`            the workspace's git repo
:class:`CommandVerifier`              :class:`Verifier`               shell commands, by level
:class:`TemplateFeedbackGenerator`    :class:`FeedbackGenerator`      plain text
:class:`FileResultPersister`          :class:`ResultPersister`        JSON files in a directory
====================================  ==============================  ===========================

Agent and verification commands run in a process group of their own, so a timeout kills
everything they started, not just the shell (POSIX only). They never outlive their runner for
long, and never run two at once in one workspace
(:mod:`fsm_runner.presets.agent_loop._children`): on Linux the kernel kills a command when its
runner dies, and while it runs its runner holds a lock in ``<workspace>/.fsm-runner/`` with a
record of its process group, so the next command started in that workspace (after ``resume``,
say) first kills whatever a dead runner left running there, and waits for a live runner's
command to end. Their output goes to temporary files
rather than pipes: a background process that a command leaves behind cannot block the wait,
and only the tail of a long output is read back into memory.

This module is one of fsm_runner's I/O edges: the foreign failures it meets (``OSError``,
``subprocess.TimeoutExpired``, git's exit codes) become results or :class:`SnapshotError` here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from fsm_runner import ArtifactRecord, check_run_id
from fsm_runner.presets.agent_loop import (
    AgentRequest,
    AgentResult,
    CheckResult,
    LevelResult,
    VerificationReport,
)
from fsm_runner.presets.agent_loop._bytecode import bytecode_prefix
from fsm_runner.presets.agent_loop._children import (
    WorkspaceBusyError,
    WorkspaceClaim,
    die_with_runner,
)
from fsm_runner.presets.agent_loop.git import GitSnapshotter, SnapshotError, check_timeout

if TYPE_CHECKING:
    from fsm_runner.presets.agent_loop import (
        AgentDriver,
        FeedbackGenerator,
        ResultPersister,
        Snapshotter,
        Verifier,
    )

__all__ = [
    "CommandAgentDriver",
    "CommandVerifier",
    "FileResultPersister",
    "GitSnapshotter",
    "SnapshotError",
    "TemplateFeedbackGenerator",
]

_log = logging.getLogger("fsm_runner.presets.agent_loop.services")

# Characters of an agent's stdout and stderr kept in its AgentResult.
_AGENT_OUTPUT_TAIL = 20_000

# The result line is looked for in this many characters at the end of an agent's stdout, so a
# chatty agent cannot make us read gigabytes back into memory.
_RESULT_SCAN_CHARS = 1 << 20

# Exit code of a command that timed out and was killed (128 + SIGKILL, as a shell reports it).
_KILLED = 137
# Exit code of a command that could not be started (as a shell reports a missing command).
_NOT_STARTED = 127


# -- processes ---------------------------------------------------------------------------------


def _ms_since(started: float) -> float:
    return (time.monotonic() - started) * 1000.0


def _kill_group(pid: int) -> None:
    """SIGKILL the process group that ``pid`` leads; it may have ended already."""
    # EPERM too: some systems report it for a group whose only member is a zombie leader.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _wait_or_kill(process: subprocess.Popen[bytes], timeout: float | None) -> bool:
    """Wait for ``process``; past ``timeout``, kill its whole process group.

    Returns:
        Whether the process timed out and was killed.
    """
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        process.wait()
        return True
    except BaseException:
        # The command runs in a session of its own, so a Ctrl-C reaches only us: without this
        # it would outlive us, unsupervised.
        _kill_group(process.pid)
        process.wait()
        raise
    return False


def _read_tail(file: IO[bytes], chars: int) -> str:
    """The last ``chars`` characters written to ``file`` (UTF-8, undecodable bytes replaced)."""
    if chars <= 0:
        return ""
    size = file.seek(0, os.SEEK_END)
    # UTF-8 spends at most 4 bytes on a character; one more covers a character cut at the start.
    file.seek(max(0, size - (chars + 1) * 4))
    return file.read().decode("utf-8", errors="replace")[-chars:]


def _min_timeout(*timeouts: float | None) -> float | None:
    return min((t for t in timeouts if t is not None), default=None)


def _left(timeout: float | None, started: float) -> float | None:
    """What is left of ``timeout`` counted from ``started`` (waiting for the workspace counts)."""
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))


# -- verification ------------------------------------------------------------------------------


def _natural_key(name: str) -> tuple[tuple[int | str, ...], str]:
    """Sort key putting ``L2`` before ``L10``: digit runs compare as numbers."""
    # re.split with a group alternates text and digit runs, so each position holds one kind.
    parts = re.split(r"(\d+)", name)
    return tuple(int(p) if i % 2 else p.casefold() for i, p in enumerate(parts)), name


def _normalize_levels(
    levels: Mapping[str, Sequence[str] | str] | None,
) -> dict[str, tuple[str, ...]]:
    """Levels as ``{name: (command, ...)}`` in natural order of their names.

    Raises:
        ValueError: a level has no commands, or a command is not a non-empty string.
    """
    normalized: dict[str, tuple[str, ...]] = {}
    for name, value in (levels or {}).items():
        # A str is a Sequence[str] too: one command, not a list of one-letter commands.
        commands: tuple[object, ...] = (value,) if isinstance(value, str) else tuple(value)
        if not commands:
            raise ValueError(f"verification level {name!r} has no commands")
        for command in commands:
            if not isinstance(command, str) or not command.strip():
                raise ValueError(
                    f"verification level {name!r}: each command must be a non-empty string, "
                    f"got {command!r}"
                )
        normalized[str(name)] = tuple(str(command) for command in commands)
    return dict(sorted(normalized.items(), key=lambda item: _natural_key(item[0])))


@attrs.frozen
class CommandVerifier:
    """Verifies a workspace by running shell commands, level by level.

    Levels run in the natural order of their names (``L0``, ``L1``, ``L2`` … ``L10``). Every
    command of a level runs, each in the workspace with the shell, stdin closed and stdout and
    stderr merged; a command passes when it exits with 0 and a level passes when all its
    commands pass. Verification stops at the first failed level.

    Each command runs in a process group of its own and may take ``timeout`` seconds, or what is
    left of the ``timeout`` given to :meth:`verify` if that is less; past it, the whole group is
    killed. It dies with its runner, and what a killed runner left running in the workspace is
    killed before it starts (see the module's docs; waiting for another live runner's command
    counts against its time). A command that would start after that budget is spent is not run
    and counts as timed out. Python bytecode is cached apart (``PYTHONPYCACHEPREFIX``, in the
    user's cache directory), the workspace's emptied before and after each verification, so a
    stale ``.pyc`` of the workspace is never run in place of its source; the rest (the standard
    library, pytest) is compiled once, not at every verification.

    Attributes:
        levels: the default levels, ``{name: command or [commands]}``; :meth:`verify` may
            replace them.
        timeout: seconds each command may take (``None``: no limit).
        output_tail: characters of each command's output kept in its :class:`CheckResult`.
    """

    levels: dict[str, tuple[str, ...]] = attrs.field(
        default=None, converter=_normalize_levels, hash=False
    )
    timeout: float | None = attrs.field(default=600.0, kw_only=True, validator=check_timeout)
    output_tail: int = attrs.field(default=2000, kw_only=True, validator=attrs.validators.ge(0))

    def verify(
        self,
        workspace: str,
        *,
        levels: Mapping[str, Sequence[str] | str] | None = None,
        timeout: float | None = None,
    ) -> VerificationReport:
        """Run the levels in order on ``workspace`` until one fails.

        Args:
            workspace: the directory the commands run in.
            levels: levels to run instead of the verifier's own (empty or ``None``: its own).
            timeout: seconds the whole verification may take (``None``: no overall limit).

        Returns:
            The report of the levels that ran; it passed if every level passed.

        Raises:
            ValueError: there are no levels to run, or a level is malformed.
        """
        plan = _normalize_levels(levels) if levels else self.levels
        if not plan:
            raise ValueError(
                "no verification levels to run: give CommandVerifier levels, or pass levels= "
                "to verify() (e.g. {'L0': 'python -m compileall -q .'})"
            )
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        results: list[LevelResult] = []
        with bytecode_prefix(workspace) as pycache:
            # Python bytecode goes to a cache apart, emptied of the workspace's: a .pyc compiled
            # from an earlier version of a file with the same size, written in the same second,
            # would otherwise be run instead of the file the agent just wrote (_bytecode).
            environment = {**os.environ, "PYTHONPYCACHEPREFIX": pycache}
            environment.pop("PYTHONDONTWRITEBYTECODE", None)  # written there, in no user's tree
            for name, commands in plan.items():
                if not self._level(name, commands, workspace, deadline, environment, results):
                    break
        return VerificationReport(
            passed=all(level.passed for level in results),
            levels=tuple(results),
            duration_ms=_ms_since(started),
        )

    def _level(  # noqa: PLR0917 - a private step of verify(), called once
        self,
        name: str,
        commands: Sequence[str],
        workspace: str,
        deadline: float | None,
        environment: Mapping[str, str],
        results: list[LevelResult],
    ) -> bool:
        """Run every command of a level; record it; whether it passed."""
        level_started = time.monotonic()
        # A list, not a generator stopping at the first failure: every check of a level runs.
        checks = tuple(
            [self._check(command, workspace, deadline, environment) for command in commands]
        )
        passed = all(check.passed for check in checks)
        results.append(
            LevelResult(name, passed=passed, checks=checks, duration_ms=_ms_since(level_started))
        )
        return passed

    def _check(
        self,
        command: str,
        workspace: str,
        deadline: float | None,
        environment: Mapping[str, str],
    ) -> CheckResult:
        """Run one command, within the verifier's timeout and the verification's deadline."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return CheckResult(
                command,
                passed=False,
                timed_out=True,
                output_tail="not run: the verification's time budget was spent",
            )
        started = time.monotonic()
        limit = _min_timeout(self.timeout, remaining)
        try:
            claim = WorkspaceClaim.acquire(workspace, command=command, wait=limit)
        except WorkspaceBusyError as exc:
            return CheckResult(
                command,
                passed=False,
                timed_out=True,
                output_tail=f"not run: {exc}",
                duration_ms=_ms_since(started),
            )
        with claim, tempfile.TemporaryFile() as output:
            try:
                process = subprocess.Popen(  # noqa: S602 - verification levels are shell commands by design
                    command,
                    shell=True,
                    cwd=workspace,
                    env=environment,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_runner(),  # noqa: PLW1509 - only prctl and getppid run in it
                )
            except OSError as exc:
                return CheckResult(
                    command,
                    passed=False,
                    exit_code=_NOT_STARTED,
                    output_tail=f"could not start the command: {type(exc).__name__}: {exc}",
                    duration_ms=_ms_since(started),
                )
            claim.started(process.pid)
            with process:
                timed_out = _wait_or_kill(process, _left(limit, started))
            return CheckResult(
                command,
                passed=not timed_out and process.returncode == 0,
                # A killed command did not exit on its own: no exit code to speak of.
                exit_code=None if timed_out else process.returncode,
                output_tail=_read_tail(output, self.output_tail),
                duration_ms=_ms_since(started),
                timed_out=timed_out,
            )


# -- the agent ---------------------------------------------------------------------------------


def _to_command(value: str | Sequence[str] | None) -> str | tuple[str, ...] | None:
    """A command as given (a shell string) or as a tuple of arguments.

    Raises:
        ValueError: the command is empty.
        TypeError: it is neither a string nor a sequence of strings.
    """
    if value is None or isinstance(value, str):
        if value is not None and not value.strip():
            raise ValueError("the agent command is empty")
        return value
    if not isinstance(value, Sequence) or not all(isinstance(arg, str) for arg in value):
        raise TypeError(f"an agent command is a string or a list of strings, not {value!r}")
    if not value:
        raise ValueError("the agent command is empty")
    return tuple(value)


def _to_environment(value: Mapping[str, str] | None) -> dict[str, str]:
    return dict(value or {})


def _result_line(stdout: str) -> Mapping[str, Any]:
    """The last line of ``stdout`` that is a JSON object, or an empty mapping."""
    for line in reversed(stdout.splitlines()):
        text = line.strip()
        if not (text.startswith("{") and text.endswith("}")):
            continue
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _int_or_none(value: object) -> int | None:
    # bool is an int in Python, but `"tokens_input": true` is not a count.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


@attrs.frozen
class CommandAgentDriver:
    """Runs a coding agent as a command in the workspace.

    The command is the driver's own, or else the ``command`` of the run's agent options
    (``request.options["command"]``). A string runs with the shell, a list of arguments
    without. It runs in the workspace, in a process group of its own, and gets the request
    twice, so it can use whichever suits it:

    - as environment variables: ``FSM_TASK``, ``FSM_FEEDBACK`` (empty when there is none),
      ``FSM_SESSION_ID`` (empty when there is none), ``FSM_ITERATION`` and ``FSM_WORKSPACE``,
      on top of the driver's ``env`` and the parent's environment; NUL characters, which an
      environment cannot hold, are dropped there;
    - as one JSON object on stdin, exactly: ``{"task": ..., "feedback": ... or null,
      "session_id": ... or null, "iteration": ..., "workspace": ...}``.

    It may report back on stdout: the last line that is a JSON object is read for
    ``session_id`` (str), ``model`` (str), ``tokens_input``, ``tokens_output``,
    ``tokens_total`` (ints; the total defaults to input + output), ``cost_usd`` (a number) and
    ``success`` (a bool; by default, whether the command exited with 0). Keys that are missing
    or of another type are ignored, as are all other keys.

    The command dies with its runner, and what a killed runner left running in the workspace
    (an earlier agent, say, before a ``resume``) is killed before it starts; see the module's
    docs. A command that runs past its timeout (the driver's or the request's, whichever is
    less; waiting for another live runner's command in the workspace counts) is killed with its
    whole process group and reported as timed out with exit code 137; one that never started
    because the workspace stayed busy, as timed out without an exit code; one that cannot be
    started, with exit code 127 and the reason in ``stderr``. Either way the run is an
    unsuccessful :class:`AgentResult`, never an exception.

    Attributes:
        command: the agent command, or ``None`` to take it from each request's options.
        timeout: seconds a run may take (``None``: only the request's limit).
        env: environment variables for the command, over the parent's.
    """

    command: str | tuple[str, ...] | None = attrs.field(default=None, converter=_to_command)
    timeout: float | None = attrs.field(default=None, kw_only=True, validator=check_timeout)
    env: dict[str, str] = attrs.field(
        default=None, kw_only=True, converter=_to_environment, hash=False
    )

    def run(self, request: AgentRequest) -> AgentResult:
        """Run the agent once on ``request``.

        Args:
            request: the task, feedback, session and workspace of this build.

        Returns:
            What the run came to; ``success=False`` when the command failed, timed out or
            could not be started.

        Raises:
            ValueError: neither the driver nor the request's options name a command.
            TypeError: the options' command is neither a string nor a list of strings.
        """
        command = self.command or _to_command(request.options.get("command"))
        if command is None:
            raise ValueError(
                "no agent command: give CommandAgentDriver a command, or put one in the "
                "run's agent options ({'agent': {'command': '...'}})"
            )
        timeout = _min_timeout(self.timeout, request.timeout)
        started = time.monotonic()
        try:
            claim = WorkspaceClaim.acquire(request.workspace, command=command, wait=timeout)
        except WorkspaceBusyError as exc:
            return AgentResult(
                success=False,
                stderr=f"the agent was not started: {exc}",
                duration_ms=_ms_since(started),
                timed_out=True,
            )
        with claim:
            ran = _run_command(
                claim, command, request, self._environment(request), timeout, started
            )
        return ran if isinstance(ran, AgentResult) else _reported(ran)

    def _environment(self, request: AgentRequest) -> dict[str, str]:
        """The command's environment: the parent's, the driver's ``env``, then the request."""
        variables = {
            "FSM_TASK": request.task,
            "FSM_FEEDBACK": request.feedback or "",
            "FSM_SESSION_ID": request.session_id or "",
            "FSM_ITERATION": str(request.iteration),
            "FSM_WORKSPACE": request.workspace,
        }
        return {
            **os.environ,
            **self.env,
            **{name: value.replace("\0", "") for name, value in variables.items()},
        }


@attrs.frozen
class _Ran:
    """How an agent command that started ended: what :func:`_reported` reads."""

    exit_code: int
    timed_out: bool
    duration_ms: float
    stdout: str  # its last _RESULT_SCAN_CHARS characters
    stderr: str  # its last _AGENT_OUTPUT_TAIL characters


def _run_command(  # noqa: PLR0917 - one private call, from CommandAgentDriver.run
    claim: WorkspaceClaim,
    command: str | tuple[str, ...],
    request: AgentRequest,
    environment: Mapping[str, str],
    timeout: float | None,
    started: float,
) -> _Ran | AgentResult:
    """Run the agent command in the claimed workspace until it ends or its time is up.

    Returns:
        How it ended, or the unsuccessful result of a command that could not be started.
    """
    payload = {
        "task": request.task,
        "feedback": request.feedback,
        "session_id": request.session_id,
        "iteration": request.iteration,
        "workspace": request.workspace,
    }
    # Files, not pipes: a large request cannot block on a command that never reads stdin.
    with (
        tempfile.TemporaryFile() as stdin,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
    ):
        stdin.write(json.dumps(payload).encode() + b"\n")
        stdin.seek(0)
        try:
            process = subprocess.Popen(  # noqa: S603 - running the configured agent is the point
                command,
                shell=isinstance(command, str),
                cwd=request.workspace,
                env=environment,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                preexec_fn=die_with_runner(),  # noqa: PLW1509 - only prctl and getppid run in it
            )
        except OSError as exc:
            return AgentResult(
                success=False,
                exit_code=_NOT_STARTED,
                stderr=f"could not start the agent command {command!r}: "
                f"{type(exc).__name__}: {exc}",
                duration_ms=_ms_since(started),
            )
        claim.started(process.pid)
        with process:
            timed_out = _wait_or_kill(process, _left(timeout, started))
        return _Ran(
            exit_code=_KILLED if timed_out else process.returncode,
            timed_out=timed_out,
            duration_ms=_ms_since(started),
            stdout=_read_tail(stdout, _RESULT_SCAN_CHARS),
            stderr=_read_tail(stderr, _AGENT_OUTPUT_TAIL),
        )


def _reported(ran: _Ran) -> AgentResult:
    """The result of a command that ran, with what its last JSON line on stdout reported."""
    reported = _result_line(ran.stdout)
    tokens_input = _int_or_none(reported.get("tokens_input"))
    tokens_output = _int_or_none(reported.get("tokens_output"))
    tokens_total = _int_or_none(reported.get("tokens_total"))
    if tokens_total is None and tokens_input is not None and tokens_output is not None:
        tokens_total = tokens_input + tokens_output
    success = reported.get("success")
    if not isinstance(success, bool):
        success = ran.exit_code == 0
    return AgentResult(
        success=success and not ran.timed_out,
        exit_code=ran.exit_code,
        session_id=_str_or_none(reported.get("session_id")),
        stdout=ran.stdout[-_AGENT_OUTPUT_TAIL:],
        stderr=ran.stderr,
        model=_str_or_none(reported.get("model")),
        tokens_input=tokens_input,
        tokens_output=tokens_output,
        tokens_total=tokens_total,
        cost_usd=_float_or_none(reported.get("cost_usd")),
        duration_ms=ran.duration_ms,
        timed_out=ran.timed_out,
    )


# -- feedback ----------------------------------------------------------------------------------


def _fence(text: str) -> str:
    """A Markdown code fence longer than any backtick run in ``text``."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


@attrs.frozen(kw_only=True)
class TemplateFeedbackGenerator:
    """Writes feedback from a failed verification with a fixed template, no model involved.

    The text restates the task on one line, then names each failed level and, for each of its
    failed checks, the command, how it ended (its exit code, or that it timed out) and the end
    of its output in a code block.

    Attributes:
        max_output: characters of each failed check's output quoted, at most.
        max_task: characters of the task restated, at most.
    """

    max_output: int = attrs.field(default=1500, validator=attrs.validators.ge(0))
    max_task: int = attrs.field(default=500, validator=attrs.validators.ge(1))

    def generate(self, report: VerificationReport, *, task: str) -> str:
        """Write the feedback on ``report``.

        Args:
            report: the verification report.
            task: the task the agent works on.

        Returns:
            The feedback text.
        """
        summary = " ".join(task.split())
        if len(summary) > self.max_task:
            summary = summary[: self.max_task - 1] + "…"
        lines = [f"Task: {summary}"]
        failed = report.failed_levels
        if not failed:
            lines.append("Verification passed; there is nothing to fix.")
            return "\n".join(lines)
        lines.append("Verification failed. Fix the following and try again.")
        for level in failed:
            lines += ["", f"Level {level.level} failed:"]
            checks = [check for check in level.checks if not check.passed]
            if not checks:
                lines.append("- (no failed check was recorded)")
            for check in checks:
                lines += self._describe(check)
        return "\n".join(lines)

    def _describe(self, check: CheckResult) -> list[str]:
        if check.timed_out:
            ending = "timed out"
        elif check.exit_code is None:
            ending = "did not finish"
        else:
            ending = f"exited with code {check.exit_code}"
        lines = [f"- `{check.command}` {ending}"]
        output = check.output_tail.strip()
        if not output:
            return [*lines, "  (no output)"]
        if not self.max_output:
            return lines
        if len(output) > self.max_output:
            output = output[-self.max_output :]
            lines.append(f"  Last {self.max_output} characters of its output:")
        else:
            lines.append("  Its output:")
        fence = _fence(output)
        return [*lines, fence, output, fence]


# -- artifacts ---------------------------------------------------------------------------------


def _to_path(value: str | os.PathLike[str]) -> Path:
    # Absolute now, so the paths journaled with artifacts mean the same from any directory.
    return Path(value).absolute()


def _check_component(what: str, value: str) -> None:
    """Refuse a run id or name that would leave its directory.

    Raises:
        ValueError: ``value`` is empty, ``.``, ``..``, or holds a path separator or NUL.
    """
    separators = {"/", "\0", os.sep} | ({os.altsep} if os.altsep else set())
    if value in {"", ".", ".."} or any(sep in value for sep in separators):
        raise ValueError(f"{what} {value!r} cannot be used as a file name")


def _write_atomically(path: Path, body: bytes) -> None:
    """Write ``body`` to ``path`` so that readers see the old file or the whole new one.

    Raises:
        OSError: the file could not be written; no temporary file is left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    # os.open with 0o666 leaves the mode to the umask, as for any file the user writes
    # (tempfile.mkstemp would make it private).
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(body)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    # Make the rename itself durable. The file is in place whatever happens here, and some
    # file systems cannot sync a directory, so a failure is not a failed write.
    with contextlib.suppress(OSError):
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


@attrs.frozen
class FileResultPersister:
    """Stores artifacts as JSON files: ``<directory>/<run_id>/<name>.json``.

    Files are written atomically (a temporary file in the same directory, synced, then renamed
    over the old one), as JSON with sorted keys, indented by 2. The artifact keeps its content
    in the journal too, with the file's path, SHA-256 and size. A write that fails is logged
    and returned as a ``failed`` artifact, never raised: storing an artifact never fails a
    phase.

    Attributes:
        directory: the directory the runs' folders are created in (made absolute).
    """

    directory: Path = attrs.field(converter=_to_path)

    def persist(self, run_id: str, name: str, kind: str, data: Any) -> ArtifactRecord:
        """Write ``data`` to ``<directory>/<run_id>/<name>.json``.

        Args:
            run_id: the run the artifact belongs to.
            name: the artifact's name, unique within its run.
            kind: what the artifact is (``agent_result``, ``verification_report`` …).
            data: its JSON content.

        Returns:
            The artifact with its content, path, SHA-256 and size; or, if the file could not
            be written, with ``status="failed"`` and the error.

        Raises:
            ValueError: ``run_id`` or ``name`` cannot be a file name (it is empty, ``.`` or
                ``..``, or holds a path separator), ``run_id`` breaks the rule of run ids
                (``InvalidRunIdError``), or ``data`` is circular.
            TypeError: ``data`` is not JSON-serialisable.
        """
        _check_component("run id", run_id)
        check_run_id(run_id)  # the rest of the rule of run ids: no id a journal refuses
        _check_component("artifact name", name)
        body = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
        path = self.directory / run_id / f"{name}.json"
        try:
            _write_atomically(path, body)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
            _log.warning(
                "could not write artifact %s of run %s to %s: %s", name, run_id, path, error
            )
            return ArtifactRecord(name, kind, content=data, status="failed", error=error)
        return ArtifactRecord(
            name,
            kind,
            content=data,
            path=str(path),
            sha256=hashlib.sha256(body).hexdigest(),
            size=len(body),
        )


if TYPE_CHECKING:
    # mypy checks here, once, that each service fits the protocol the agent loop declares.
    _FITS: tuple[AgentDriver, Snapshotter, Verifier, FeedbackGenerator, ResultPersister] = (
        CommandAgentDriver(),
        GitSnapshotter(),
        CommandVerifier(),
        TemplateFeedbackGenerator(),
        FileResultPersister("."),
    )
