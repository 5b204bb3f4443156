"""Real services for the coordinator preset: a git workspace, gates, and scripted agents.

:mod:`fsm_runner.presets.coordinator` declares what its phases need as protocols; this module
implements them with git, a shell and plain Python:

=============================  ====================  =========================================
service                        protocol              medium
=============================  ====================  =========================================
:class:`GitWorkspace`          :class:`Workspace`    ``git apply`` in a git work tree
:class:`DiffGate`              :class:`Gate`         ``git apply --numstat``, a shell command
:class:`PolicyGate`            :class:`Gate`         path globs and patterns, in Python
:class:`ScriptedAgents`        :class:`AgentRole`    proposals scripted per task and attempt
=============================  ====================  =========================================

plus :func:`file_diff`, which writes the unified diff of one file for scripted agents.

This module is one of fsm_runner's I/O edges: the foreign failures it meets (``OSError``,
``subprocess.TimeoutExpired``, git's exit codes) become results or :class:`WorkspaceError` here.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import hashlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.presets.coordinator.tasks import GateVerdict, PatchResult, Proposal, Task
from fsm_runner.presets.gitcli import git_environment, run_git, text_tail

if TYPE_CHECKING:
    from fsm_runner.presets.coordinator.tasks import AgentRole, Gate, Workspace

__all__ = [
    "AgentCall",
    "DiffGate",
    "GitWorkspace",
    "PolicyGate",
    "ScriptedAgents",
    "WorkspaceError",
    "diff_paths",
    "file_diff",
]


class WorkspaceError(FsmRunnerError):
    """Git could not be run in a workspace, or failed where it must not.

    A diff that does not apply is not an error (it is a :class:`PatchResult`); this is for a
    workspace that is not a git work tree, git missing, a git command timing out or failing.

    Attributes:
        workspace: the workspace.
        detail: what went wrong, with the end of git's stderr.
        command: the git arguments, if a command failed.
        returncode: its exit code, if it ran to the end.
    """

    def __init__(
        self,
        detail: str,
        *,
        workspace: str,
        command: Sequence[str] | None = None,
        returncode: int | None = None,
    ) -> None:
        self.workspace = workspace
        self.detail = detail
        self.command = tuple(command) if command is not None else None
        self.returncode = returncode
        super().__init__(f"workspace {workspace}: {detail}")


def _patch_bytes(diff: str) -> bytes:
    # git refuses a patch whose last line has no newline ("corrupt patch").
    return (diff if diff.endswith("\n") else diff + "\n").encode()


def _clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return git_environment(extra=extra)


def _check_timeout(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds or None")


def _absolute(value: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fspath(value))


# -- the workspace -----------------------------------------------------------------------------


@attrs.frozen
class GitWorkspace:
    """A git work tree that diffs are applied to with ``git apply``: whole, or not at all.

    ``git apply`` checks every hunk of every file before it writes anything, so a diff that
    does not fit leaves the work tree untouched. Applying is also idempotent across crashes:
    a diff whose result is already in the work tree, and that cannot be applied on top of it,
    is reported as already applied; and when a diff could be applied either way (its result
    would fit again, as in a file of repeated lines), the ``key`` decides — each application
    leaves a marker named for its key in the repository's git directory *before* it writes, so
    the same application run again after a crash knows it got that far and does not apply the
    diff a second time. Taking a diff out (:meth:`revert`) works the same way in reverse.

    The one window no check can close is a kill while git itself is writing the files of a
    multi-file diff; on resume the diff then neither applies nor reverts, and the task's
    phase fails with git's message instead of guessing.

    Attributes:
        path: the top of the work tree (made absolute).
        commits: commit the work tree when a task is done (``git add -A``, so ``.gitignore``
            is respected; hooks are skipped and nothing is signed).
        author_name: the commits' author and committer name.
        author_email: their email address.
        timeout: seconds one git command may take (``None``: no limit).
    """

    path: str = attrs.field(converter=_absolute)
    commits: bool = attrs.field(default=True, kw_only=True)
    author_name: str = attrs.field(default="fsm-runner", kw_only=True)
    author_email: str = attrs.field(default="fsm-runner@localhost", kw_only=True)
    timeout: float | None = attrs.field(default=120.0, kw_only=True, validator=_check_timeout)

    def apply(self, diff: str, *, key: str | None = None) -> PatchResult:
        """Apply ``diff`` to the work tree, all of it or nothing, unless it is applied already.

        Args:
            diff: a unified diff with paths relative to the top of the work tree.
            key: identifies this application (the coordinator passes the task run and the
                seq of its visit): run again with the same key, it never applies twice.

        Returns:
            ``done`` if the work tree now holds the diff (``already`` if it did before);
            otherwise ``done=False`` with git's reason, and the work tree unchanged.

        Raises:
            WorkspaceError: the workspace is not a git work tree, or git could not be run.
        """
        return self._move(diff, key=key, reverse=False)

    def revert(self, diff: str, *, key: str | None = None) -> PatchResult:
        """Take ``diff`` out of the work tree, all of it or nothing, if it is applied.

        Returns:
            ``done`` if the work tree no longer holds the diff (``already`` if it did not
            hold it before); otherwise ``done=False`` with git's reason, the tree unchanged.

        Raises:
            WorkspaceError: the workspace is not a git work tree, or git could not be run.
        """
        return self._move(diff, key=key, reverse=True)

    def is_applied(self, diff: str) -> bool:
        """Whether the work tree holds the result of ``diff`` (its reverse applies cleanly).

        Raises:
            WorkspaceError: git could not be run.
        """
        return self._fits(_patch_bytes(diff), reverse=True)[0]

    def changed_files(self, diff: str) -> tuple[str, ...]:
        """The files ``diff`` touches, as git reads it (empty if git cannot read it).

        Raises:
            WorkspaceError: git could not be run.
        """
        done = self._git("apply", "--numstat", "-", stdin=_patch_bytes(diff), ok=None)
        if done.returncode != 0:
            return ()
        return tuple(_numstat(done.stdout.decode("utf-8", errors="replace"))[2])

    def commit(self, message: str) -> str | None:
        """Commit everything in the work tree with ``message``; return the commit's id.

        When nothing is left to commit, the id of ``HEAD`` is returned if its subject is this
        message (a commit repeated after a crash), else ``None``. Without ``commits``, nothing
        is committed and ``None`` returned.

        Raises:
            WorkspaceError: git failed.
        """
        if not self.commits:
            return None
        self._git("add", "-A")
        staged = self._git("diff", "--cached", "--quiet", ok=(0, 1)).returncode == 1
        subject = message.splitlines()[0] if message else ""
        if staged:
            self._git("commit", "--quiet", "--no-verify", "-m", message)
            return self._head()
        found = self._git("log", "-1", "--format=%H%x00%s", ok=(0, 128)).stdout.decode()
        head, _, last_subject = found.strip().partition("\0")
        return head if head and last_subject == subject else None

    # -- the parts -----------------------------------------------------------------------------

    def _move(self, diff: str, *, key: str | None, reverse: bool) -> PatchResult:
        patch = _patch_bytes(diff)
        files = self.changed_files(diff)
        can, detail = self._fits(patch, reverse=reverse)
        done_before, _ = self._fits(patch, reverse=not reverse)
        marker = self._marker(key, reverse=reverse)
        # Looks done and cannot be done (again): it was. Could be done either way: only a
        # marker left by this very application before it wrote says it was.
        if done_before and (not can or (marker is not None and marker.exists())):
            return PatchResult(done=True, already=True, files=files)
        if not can:
            return PatchResult(done=False, files=files, detail=detail)
        if marker is not None:
            _touch_durably(marker)
        args = ["apply", "--whitespace=nowarn", *(["--reverse"] if reverse else []), "-"]
        applied = self._git(*args, stdin=patch, ok=None)
        if applied.returncode != 0:  # git checked first and writes nothing when it fails
            detail = (
                text_tail(applied.stderr.decode("utf-8", errors="replace")) or "git apply failed"
            )
            return PatchResult(done=False, files=files, detail=detail)
        return PatchResult(done=True, files=files)

    def _fits(self, patch: bytes, *, reverse: bool) -> tuple[bool, str]:
        args = ["apply", "--check", *(["--reverse"] if reverse else []), "-"]
        done = self._git(*args, stdin=patch, ok=None)
        return done.returncode == 0, text_tail(done.stderr.decode("utf-8", errors="replace"))

    def _marker(self, key: str | None, *, reverse: bool) -> Path | None:
        if key is None:
            return None
        git_dir = self._git("rev-parse", "--absolute-git-dir").stdout.decode().strip()
        digest = hashlib.sha256(f"{'revert' if reverse else 'apply'}\0{key}".encode()).hexdigest()
        return Path(git_dir) / "fsm-runner" / "patches" / digest

    def _head(self) -> str | None:
        found = self._git("rev-parse", "--verify", "--quiet", "HEAD^{commit}", ok=(0, 1))
        return found.stdout.decode().strip() if found.returncode == 0 else None

    def _git(
        self, *args: str, stdin: bytes = b"", ok: tuple[int, ...] | None = (0,)
    ) -> subprocess.CompletedProcess[bytes]:
        """Run ``git args`` in the work tree; an exit code not in ``ok`` is a WorkspaceError."""
        if not os.path.isdir(self.path):
            raise WorkspaceError("the workspace is not a directory", workspace=self.path)

        def error(
            detail: str, *, command: Sequence[str], returncode: int | None = None, stderr: str = ""
        ) -> WorkspaceError:
            # the error names git's own arguments, without the identity options in front
            return WorkspaceError(
                detail, workspace=self.path, command=command[7:], returncode=returncode
            )

        return run_git(
            self.path,
            args,
            author_name=self.author_name,
            author_email=self.author_email,
            timeout=self.timeout,
            error=error,
            stdin=stdin,
            ok=ok,
        )


def _touch_durably(path: Path) -> None:
    """Create ``path`` and make sure it survives a kill (the file and its directory entry)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    # Some file systems cannot sync a directory; the marker exists either way.
    with contextlib.suppress(OSError):
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _numstat(text: str) -> tuple[int, int, list[str]]:
    """Lines added, lines deleted and paths from ``git apply --numstat`` output."""
    added = deleted = 0
    paths: list[str] = []
    for line in text.splitlines():
        parts = line.split("\t", 2)
        if len(parts) != 3:
            continue
        # Binary files show "-" for both counts.
        added += int(parts[0]) if parts[0].isdigit() else 0
        deleted += int(parts[1]) if parts[1].isdigit() else 0
        paths.append(parts[2])
    return added, deleted, paths


# -- diffs -------------------------------------------------------------------------------------

_NO_NEWLINE = "\\ No newline at end of file\n"
_HEADER = re.compile(r"^(?:---|\+\+\+) (?:[ab]/)?(?P<path>[^\t\n]+)")


def file_diff(path: str, before: str | None, after: str | None, *, context: int = 3) -> str:
    """The unified diff, as git writes it, that turns one file from ``before`` into ``after``.

    Args:
        path: the file, relative to the top of the work tree.
        before: its content before (``None``: the diff creates it).
        after: its content after (``None``: the diff deletes it).
        context: lines of context around each change.

    Returns:
        The diff (empty if ``before == after``).

    Raises:
        ValueError: both contents are ``None``.
    """
    if before is None and after is None:
        raise ValueError("a file diff needs a content before or after")
    if before == after:
        return ""
    header = [f"diff --git a/{path} b/{path}\n"]
    if before is None:
        header.append("new file mode 100644\n")
    if after is None:
        header.append("deleted file mode 100644\n")
    lines = difflib.unified_diff(
        (before or "").splitlines(keepends=True),
        (after or "").splitlines(keepends=True),
        "/dev/null" if before is None else f"a/{path}",
        "b/" + path if after is not None else "/dev/null",
        n=context,
    )
    body = [line if line.endswith("\n") else line + "\n" + _NO_NEWLINE for line in lines]
    return "".join(header + body)


def diff_paths(diff: str) -> tuple[str, ...]:
    """The paths a unified diff names in its ``---``/``+++`` headers, in order, once each."""
    found: dict[str, None] = {}
    for line in diff.splitlines():
        match = _HEADER.match(line)
        if match and match["path"] != "/dev/null":
            found.setdefault(match["path"].strip(), None)
    return tuple(found)


def _added_lines(diff: str) -> list[str]:
    return [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


# -- gates -------------------------------------------------------------------------------------


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@attrs.frozen(kw_only=True)
class DiffGate:
    """The diff/command gate: a real, non-empty patch, small enough, that a command accepts.

    The diff is read with ``git apply --numstat`` (nothing is applied). When ``command`` is
    given, it runs with the shell in the workspace, in a process group of its own, with the
    diff on stdin and ``FSM_TASK_ID`` and ``FSM_CHANGED_FILES`` (one path a line) in its
    environment; a non-zero exit blocks, with the end of its output as the reason.

    Attributes:
        name: the gate's name in verdicts.
        max_changed_lines: most lines added plus deleted (``None``: any number).
        command: a shell command that must accept the diff (``None``: none).
        timeout: seconds the command may take; past it, it is killed and the diff blocked.
    """

    name: str = "diff"
    max_changed_lines: int | None = None
    command: str | None = None
    timeout: float | None = attrs.field(default=300.0, validator=_check_timeout)

    def check(self, task: Task, proposal: Proposal, *, workspace: str) -> GateVerdict:
        """Judge the proposal's diff.

        Args:
            task: the task the diff is for.
            proposal: the proposal.
            workspace: the directory the command runs in.

        Returns:
            The verdict; a blocked one says why.
        """
        if not proposal.diff.strip():
            return GateVerdict(self.name, passed=False, reason="the diff is empty")
        try:
            read = subprocess.run(
                ["git", "apply", "--numstat", "-"],  # noqa: S607 - git from PATH, as everywhere
                cwd=workspace,
                env=_clean_environment(),
                input=_patch_bytes(proposal.diff),
                capture_output=True,
                timeout=self.timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return GateVerdict(self.name, passed=False, reason=f"cannot read the diff: {exc}")
        if read.returncode != 0:
            reason = (
                text_tail(read.stderr.decode("utf-8", errors="replace")) or "git cannot read it"
            )
            return GateVerdict(self.name, passed=False, reason=f"not a valid patch: {reason}")
        added, deleted, paths = _numstat(read.stdout.decode("utf-8", errors="replace"))
        if self.max_changed_lines is not None and added + deleted > self.max_changed_lines:
            return GateVerdict(
                self.name,
                passed=False,
                reason=f"the diff changes {added + deleted} lines, more than the "
                f"{self.max_changed_lines} allowed",
            )
        if self.command:
            refusal = self._run_command(task, proposal, workspace, paths)
            if refusal is not None:
                return GateVerdict(self.name, passed=False, reason=refusal)
        return GateVerdict(
            self.name, passed=True, reason=f"{len(paths)} files, +{added} -{deleted}"
        )

    def _run_command(
        self, task: Task, proposal: Proposal, workspace: str, paths: Sequence[str]
    ) -> str | None:
        """Run the gate's command; return why it refused the diff, or ``None``."""
        assert self.command is not None
        environment = _clean_environment(
            {"FSM_TASK_ID": task.id, "FSM_CHANGED_FILES": "\n".join(paths)}
        )
        try:
            process = subprocess.Popen(  # noqa: S602 - the gate command is a shell command by design
                self.command,
                shell=True,
                cwd=workspace,
                env=environment,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            return f"could not start `{self.command}`: {exc}"
        with process:
            try:
                output, _ = process.communicate(_patch_bytes(proposal.diff), timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(process.pid)
                process.communicate()
                return f"`{self.command}` took longer than {self.timeout}s"
            except BaseException:
                _kill_group(process.pid)  # a Ctrl-C reaches only us: do not leave it behind
                raise
        if process.returncode != 0:
            tail = text_tail(output.decode("utf-8", errors="replace"))
            return f"`{self.command}` exited with {process.returncode}" + (
                f": {tail}" if tail else ""
            )
        return None


def _str_tuple(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _optional_str_tuple(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    return None if value is None else _str_tuple(value)


@attrs.frozen(kw_only=True)
class PolicyGate:
    """The policy gate: which paths a diff may touch, and what it may not add.

    Paths are matched with shell-style globs (:func:`fnmatch.fnmatchcase`, where ``*`` also
    matches ``/``) against the paths in the diff's headers.

    Attributes:
        name: the gate's name in verdicts.
        forbidden_paths: globs no touched path may match (``.github/*``, ``*.lock`` …).
        allowed_paths: globs every touched path must match (``None``: any path).
        forbidden_patterns: regular expressions no added line may match (secrets, debug
            leftovers …).
    """

    name: str = "policy"
    forbidden_paths: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    allowed_paths: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_str_tuple)
    forbidden_patterns: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)

    def check(self, task: Task, proposal: Proposal, *, workspace: str) -> GateVerdict:
        """Judge the paths the diff touches and the lines it adds.

        Args:
            task: the task the diff is for.
            proposal: the proposal.
            workspace: unused: the policy reads only the diff.

        Returns:
            The verdict; a blocked one names the path or line and the rule it broke.
        """
        for path in diff_paths(proposal.diff):
            for glob in self.forbidden_paths:
                if fnmatch.fnmatchcase(path, glob):
                    return GateVerdict(
                        self.name,
                        passed=False,
                        reason=f"touches {path!r}, which matches forbidden {glob!r}",
                    )
            if self.allowed_paths is not None and not any(
                fnmatch.fnmatchcase(path, glob) for glob in self.allowed_paths
            ):
                return GateVerdict(
                    self.name, passed=False, reason=f"touches {path!r}, outside the allowed paths"
                )
        for pattern in self.forbidden_patterns:
            compiled = re.compile(pattern)
            for line in _added_lines(proposal.diff):
                if compiled.search(line):
                    return GateVerdict(
                        self.name,
                        passed=False,
                        reason=f"adds a line matching forbidden pattern {pattern!r}",
                    )
        return GateVerdict(self.name, passed=True)


# -- scripted agents ---------------------------------------------------------------------------


@attrs.frozen
class AgentCall:
    """One call of a scripted agent, as :class:`ScriptedAgents` remembers it."""

    task_id: str
    role: str
    attempt: int
    feedback: str | None


_MISSING = object()


@attrs.define
class ScriptedAgents:
    """Agents that follow a script: for tests and examples, no model involved.

    The script maps ``(task_id, attempt)`` — or just ``task_id``, for every attempt — to a
    :class:`Proposal`, a diff (a string) or an exception to raise (an agent failure; a
    ``KeyboardInterrupt`` stops the process as Ctrl-C would). Every call is remembered in
    :attr:`calls` and, if ``log`` is given, appended to that file as a JSON line.

    Attributes:
        script: the proposals, by task and attempt.
        log: a file to append each call to (for tests that run the coordinator in a
            subprocess).
        calls: the calls so far, in order.
    """

    script: Mapping[Any, Proposal | str | BaseException] = attrs.field(converter=dict)
    log: Path | None = attrs.field(default=None, kw_only=True)
    calls: list[AgentCall] = attrs.field(factory=list, init=False)

    def produce(
        self, task: Task, *, role: str, attempt: int, feedback: str | None, workspace: str
    ) -> Proposal:
        """Return (or raise) what the script says for this task and attempt.

        Raises:
            LookupError: the script has nothing for the task.
            BaseException: whatever the script says to raise.
        """
        call = AgentCall(task.id, role, attempt, feedback)
        self.calls.append(call)
        if self.log is not None:
            with self.log.open("a", encoding="utf-8") as file:
                file.write(json.dumps(attrs.asdict(call)) + "\n")
        entry = self.script.get((task.id, attempt), self.script.get(task.id, _MISSING))
        if entry is _MISSING:
            raise LookupError(f"the script has no proposal for task {task.id!r}, attempt {attempt}")
        if isinstance(entry, BaseException):
            raise entry
        if isinstance(entry, Proposal):
            return entry
        return Proposal(str(entry), notes=f"scripted: {task.id} attempt {attempt} as {role}")

    def roles_for(self, task_id: str) -> list[str]:
        """The role of each call for ``task_id``, in order."""
        return [call.role for call in self.calls if call.task_id == task_id]


if TYPE_CHECKING:
    # mypy checks here, once, that each service fits the protocol the coordinator declares.
    _FITS: tuple[Workspace, Gate, Gate, AgentRole] = (
        GitWorkspace("."),
        DiffGate(),
        PolicyGate(),
        ScriptedAgents({}),
    )
