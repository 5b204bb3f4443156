"""Git snapshots of an agent's workspace: the agent loop's :class:`Snapshotter` on git.

Part of :mod:`fsm_runner.presets.agent_loop.services`, which exports its names: a capture commits
everything in the workspace to the branch checked out there (see :class:`GitSnapshotter`).
``check_timeout`` is the validator the services share for their timeouts.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from typing import Any

import attrs

from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.presets.agent_loop import Snapshot
from fsm_runner.presets.gitcli import run_git, text_tail

__all__ = ["GitSnapshotter", "SnapshotError", "check_timeout"]


def check_timeout(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: a timeout is a positive number of seconds, or None (none)."""
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds or None")


class SnapshotError(FsmRunnerError):
    """A workspace could not be captured: it is not a git repository, or git failed.

    Attributes:
        workspace: the workspace that was being captured.
        detail: what went wrong, with the tail of git's stderr when git failed.
        command: the git command that failed, if one did.
        returncode: its exit code, if it ran to the end.
        stderr: its whole stderr.
    """

    def __init__(
        self,
        detail: str,
        *,
        workspace: str,
        command: Sequence[str] | None = None,
        returncode: int | None = None,
        stderr: str = "",
    ) -> None:
        self.detail = detail
        self.workspace = workspace
        self.command = tuple(command) if command is not None else None
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"git snapshot of {workspace} failed: {detail}")


@attrs.frozen(kw_only=True)
class GitSnapshotter:
    """Captures a workspace by committing everything in it to its git repository.

    Each capture stages every change (``git add -A``, so ``.gitignore`` is respected) and, if
    anything is staged, commits it as ``author_name <author_email>`` with ``message``. The
    commit works on machines without any git configuration, skips the ``pre-commit`` and
    ``commit-msg`` hooks (a snapshot records the workspace as it is; judging it is the
    verifier's job) and is never signed. A repository without commits gets an initial
    (possibly empty) commit, so every snapshot has an id.

    Snapshots are commits on the branch checked out in the workspace: each one moves that
    branch forward (on a detached ``HEAD``, only ``HEAD``), and no other ref is touched. Run
    the agent on a branch of its own to keep yours as it is. :meth:`check_workspace` says which
    branch, before the agent starts.

    The snapshot compares the workspace's ``HEAD`` before the capture with the one after it:
    commits the agent made itself are already in ``HEAD`` before, so they do not show up in
    ``changed_files``.

    Attributes:
        author_name: the snapshot commits' author and committer name.
        author_email: their email address.
        message: the snapshot commits' message.
        timeout: seconds one git command may take (``None``: no limit).
    """

    author_name: str = "fsm-runner"
    author_email: str = "fsm-runner@localhost"
    message: str = "fsm-runner snapshot"
    timeout: float | None = attrs.field(default=300.0, validator=check_timeout)

    def capture(self, workspace: str, *, since: str | None = None) -> Snapshot:
        """Commit the workspace's changes and describe them.

        Args:
            workspace: a directory inside a git work tree.
            since: the last snapshot's commit: changes are counted from it, so an agent that
                commits its own work, or a capture repeated after a crash, still shows what
                the build changed. Without it (or if it names no commit), from HEAD.

        Returns:
            The snapshot: ``snapshot_id`` and ``after`` are the commit after the capture,
            ``before`` the one before it (``None`` if the repository had no commits), and the
            changed files with their inserted and deleted lines (binary files count none).
            When nothing changed, ``after == before`` and ``changed_files`` is empty.

        Raises:
            SnapshotError: the workspace is not a directory in a git work tree, git is not
                installed, or a git command failed or took longer than ``timeout``.
        """
        workspace = os.fspath(workspace)
        self._check(workspace)
        before = self._head(workspace)
        if (
            since
            and self._git(
                workspace, "cat-file", "-e", f"{since}^{{commit}}", ok=(0, 1, 128)
            ).returncode
            == 0
        ):
            before = since
        self._git(workspace, "add", "-A")
        staged = self._git(workspace, "diff", "--cached", "--quiet", ok=(0, 1)).returncode == 1
        if staged or before is None:
            # A repository without commits gets one even when empty, so the snapshot has an id.
            empty = () if staged else ("--allow-empty",)
            self._git(workspace, "commit", "--quiet", "--no-verify", *empty, "-m", self.message)
        after = self._head(workspace)
        if after is None:
            raise SnapshotError("HEAD names no commit after committing", workspace=workspace)
        if after == before:
            return Snapshot(snapshot_id=after, before=before, after=after)
        base = before or self._empty_tree(workspace)
        numstat = self._git(
            workspace, "diff", "--numstat", "-z", "--no-renames", "--no-ext-diff", base, after
        ).stdout
        files: list[str] = []
        insertions = deletions = 0
        for record in numstat.split(b"\0"):
            if not record:
                continue
            added, deleted, path = record.split(b"\t", 2)
            files.append(path.decode("utf-8", errors="replace"))
            # Binary files show "-" for both counts.
            insertions += int(added) if added.isdigit() else 0
            deletions += int(deleted) if deleted.isdigit() else 0
        return Snapshot(
            snapshot_id=after,
            before=before,
            after=after,
            changed_files=tuple(files),
            insertions=insertions,
            deletions=deletions,
        )

    def check_workspace(self, workspace: str) -> str:
        """Make sure ``workspace`` can be captured, before an agent works in it.

        Args:
            workspace: the directory the agent is to work in.

        Returns:
            Where the snapshots will go, for people to read: ``"commits on branch main"``, or
            ``"commits on a detached HEAD"``.

        Raises:
            SnapshotError: the workspace is not a directory in a git work tree, or git is not
                installed or failed.
        """
        workspace = os.fspath(workspace)
        self._check(workspace)
        branch = self._git(workspace, "symbolic-ref", "--quiet", "--short", "HEAD", ok=(0, 1))
        name = branch.stdout.decode("utf-8", errors="replace").strip()
        return (
            f"commits on branch {name}" if branch.returncode == 0 else "commits on a detached HEAD"
        )

    def _check(self, workspace: str) -> None:
        """Raise a SnapshotError unless ``workspace`` is a directory in a git work tree."""
        if not os.path.isdir(workspace):
            raise SnapshotError("the workspace is not a directory", workspace=workspace)
        inside = self._git(workspace, "rev-parse", "--is-inside-work-tree", ok=(0, 128))
        if inside.returncode != 0 or inside.stdout.strip() != b"true":
            stderr = inside.stderr.decode("utf-8", errors="replace")
            raise SnapshotError(
                "the workspace is not inside a git work tree (snapshots are git commits: "
                f"`git init` it first): {text_tail(stderr) or '(no output)'}",
                workspace=workspace,
                command=("git", "rev-parse", "--is-inside-work-tree"),
                returncode=inside.returncode,
                stderr=stderr,
            )

    def _head(self, workspace: str) -> str | None:
        """The commit ``HEAD`` names, or ``None`` in a repository without commits."""
        found = self._git(workspace, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", ok=(0, 1))
        return found.stdout.decode().strip() if found.returncode == 0 else None

    def _empty_tree(self, workspace: str) -> str:
        """The id of the empty tree, in the repository's hash (SHA-1 or SHA-256)."""
        return self._git(workspace, "hash-object", "-t", "tree", "--stdin").stdout.decode().strip()

    def _git(
        self, workspace: str, *args: str, ok: tuple[int, ...] = (0,)
    ) -> subprocess.CompletedProcess[bytes]:
        """Run ``git args`` in ``workspace``; an exit code not in ``ok`` is a SnapshotError."""

        def error(detail: str, **details: Any) -> SnapshotError:
            return SnapshotError(detail, workspace=workspace, **details)

        return run_git(
            workspace,
            args,
            author_name=self.author_name,
            author_email=self.author_email,
            timeout=self.timeout,
            error=error,
            ok=ok,
        )
