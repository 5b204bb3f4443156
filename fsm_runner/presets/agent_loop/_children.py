r"""Commands the agent loop runs in a workspace: they die with their runner, never two at once.

An agent or verification command runs in a session (and process group) of its own, so that a
timeout kills everything it started. That also means a SIGKILL of the runner's process group does
not reach it, and without more care a ``resume`` would start a second agent in the workspace while
the first one still edits it. Two things prevent that:

1. **The command dies with its runner.** On Linux it is started with ``PR_SET_PDEATHSIG`` set to
   SIGKILL, so the kernel kills it when the runner's thread that started it dies. That covers the
   process the runner starts (and whatever it ``exec``\ s), not the processes *it* starts, such as
   a shell's children.
2. **A record in the workspace.** While a command runs, its runner holds an exclusive ``flock``
   on ``<workspace>/.fsm-runner/lock`` and keeps ``<workspace>/.fsm-runner/child.json``, naming
   the command's process group, its leader's start time and the boot it started in. Before a
   command starts in a workspace, the runner takes that lock. A record found then was left by a
   runner that is gone (the kernel released its lock when it died), so every process still in the
   recorded group is killed with SIGKILL, and the runner waits until they are gone and removes
   the record, before the new command starts. The start time and the boot id guard against a
   recycled pid: a group led by another process than the recorded one is left alone.

A live runner's command is never killed: its runner holds the lock, so another runner waits for
the lock (for as long as its own command may take) instead of starting a second command in the
same workspace. ``.fsm-runner/`` holds a ``.gitignore`` of ``*``, so git ignores the whole
directory and snapshots never commit it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fsm_runner.exceptions import FsmRunnerError

__all__ = ["GUARD_DIRECTORY", "WorkspaceBusyError", "WorkspaceClaim", "die_with_runner"]

_log = logging.getLogger("fsm_runner.presets.agent_loop.services")

#: The directory, in a workspace, of the lock and the record of the command running in it.
GUARD_DIRECTORY = ".fsm-runner"
_LOCK = "lock"
_RECORD = "child.json"
_GITIGNORE = "# Written by fsm-runner: its lock and process records, never to commit.\n*\n"

# How often a busy lock or a dying process group is looked at again.
_POLL = 0.05
# Seconds a killed group may take to be gone (SIGKILL cannot be caught; this is a sanity bound).
_KILL_WAIT = 30.0

_PR_SET_PDEATHSIG = 1


class WorkspaceBusyError(FsmRunnerError):
    """A command could not start in a workspace: another runner's command kept it too long.

    Attributes:
        workspace: the workspace.
        detail: what holds it, or what could not be ended.
    """

    def __init__(self, detail: str, *, workspace: str) -> None:
        self.detail = detail
        self.workspace = workspace
        super().__init__(f"workspace {workspace} is busy: {detail}")


# -- dying with the runner ---------------------------------------------------------------------


def _load_prctl() -> Callable[..., int] | None:
    """The C library's ``prctl``, looked up once in the parent, or ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()
_SIGKILL = int(signal.SIGKILL)


def die_with_runner() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies (Linux).

    The signal is tied to the thread that starts the child, which then waits for it. If this
    process died before the signal was armed, the child kills itself at once. Returns ``None``
    where ``prctl`` is not available.
    """
    if _PRCTL is None:
        return None
    prctl, parent = _PRCTL, os.getpid()

    def preexec() -> None:
        # Runs in the child between fork and exec: no imports, no locks, nothing that allocates
        # much (the parent may have other threads).
        prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), _SIGKILL)

    return preexec


# -- processes, read from /proc ------------------------------------------------------------------


@attrs.frozen
class _Process:
    pid: int
    state: str
    pgrp: int
    start_time: int  # clock ticks since boot


def _process(pid: int) -> _Process | None:
    """What ``/proc/PID/stat`` says of ``pid``, or ``None`` if there is no such process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it are counted
    # from its closing parenthesis, the last one in the line.
    fields = data[data.rindex(b")") + 2 :].split()
    return _Process(pid, fields[0].decode(), int(fields[2]), int(fields[19]))


def _processes() -> Iterator[_Process]:
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit() and (found := _process(int(entry.name))) is not None:
                yield found


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _can_inspect() -> bool:
    return os.path.isdir("/proc/self") and _boot_id() is not None


def _stale_members(record: Mapping[str, Any]) -> list[_Process] | None:
    """The live processes of the recorded group, or ``None`` if the group is not the recorded one.

    A group is the recorded one if it is from this boot and its leader, if still alive, is the
    recorded process (same start time); once the leader is gone, if no member started before it.
    Zombies are left out: they no longer run.
    """
    pgid, started = record.get("pgid"), record.get("start_time")
    if not isinstance(pgid, int) or not isinstance(started, int) or pgid <= 1:
        return None
    if record.get("boot_id") != _boot_id():
        return None  # a reboot ended every process of the record's boot
    leader = _process(pgid)
    if leader is not None and leader.start_time != started:
        return None  # the pid was recycled: another process leads that group now
    members = [p for p in _processes() if p.pgrp == pgid and p.state != "Z"]
    if any(p.start_time < started for p in members):
        return None
    return members


# -- the claim on a workspace ------------------------------------------------------------------


def _shown(command: str | Sequence[str]) -> str:
    return command if isinstance(command, str) else shlex.join(command)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        _log.warning("ignoring the unreadable record %s: %s", path, exc)
        return {}
    return value if isinstance(value, dict) else {}


def _holder(record: Mapping[str, Any] | None) -> str:
    if not record:
        return "another fsm-runner process holds its lock"
    return (
        f"fsm-runner process {record.get('runner_pid')} runs `{record.get('command')}` in it "
        f"(process group {record.get('pgid')}, since {record.get('started_at')})"
    )


class WorkspaceClaim:
    """One command's hold on its workspace: the lock, and the record of its process group.

    Use :meth:`acquire`, then :meth:`started` once the command runs, and close it (it is a
    context manager) when the command has ended.
    """

    def __init__(
        self, workspace: str, *, command: str, directory: Path | None, fd: int | None
    ) -> None:
        """Hold ``fd`` locked; :meth:`acquire` builds a claim."""
        self.workspace = workspace
        self.command = command
        self._directory = directory
        self._fd = fd

    @classmethod
    def acquire(
        cls,
        workspace: str,
        *,
        command: str | Sequence[str],
        wait: float | None,
    ) -> WorkspaceClaim:
        """Lock ``workspace`` for one command, ending what a dead runner left running in it.

        A workspace that is not a directory, or in which ``.fsm-runner/`` cannot be written
        (logged), gets a claim that guards nothing: the command still dies with its runner.

        Args:
            workspace: the directory the command is to run in.
            command: the command, for the record.
            wait: seconds to wait for another live runner's command to end (``None``: no limit).

        Raises:
            WorkspaceBusyError: another live runner's command held the workspace past ``wait``,
                or a dead runner's process group could not be ended.
        """
        shown = _shown(command)
        if not os.path.isdir(workspace):
            return cls(workspace, command=shown, directory=None, fd=None)
        directory = Path(workspace) / GUARD_DIRECTORY
        fd = None
        try:
            directory.mkdir(exist_ok=True)
            ignore = directory / ".gitignore"
            if not ignore.exists():
                ignore.write_text(_GITIGNORE, encoding="utf-8")
            fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            cls._lock(fd, directory, workspace, wait)
        except OSError as exc:
            # A read-only workspace, or a file system without locks: the command still dies
            # with its runner, which is the most that can be done there.
            if fd is not None:
                os.close(fd)
            _log.warning(
                "cannot keep a record of the commands run in %s (%s): a command left behind by "
                "a killed runner will not be ended there",
                workspace,
                exc,
            )
            return cls(workspace, command=shown, directory=None, fd=None)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        claim = cls(workspace, command=shown, directory=directory, fd=fd)
        try:
            claim._end_stale(directory)
        except BaseException:
            claim.close()
            raise
        return claim

    @staticmethod
    def _lock(fd: int, directory: Path, workspace: str, wait: float | None) -> None:
        """Lock ``fd``, waiting up to ``wait`` seconds for the runner that holds it."""
        deadline = None if wait is None else time.monotonic() + wait
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(_read_record(directory / _RECORD))
            else:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkspaceBusyError(holder, workspace=workspace)
            if not told:
                _log.warning("waiting for the workspace %s: %s", workspace, holder)
                told = True
            time.sleep(_POLL)

    def _end_stale(self, directory: Path) -> None:
        """Kill the process group a dead runner recorded, wait until it is gone, drop the record."""
        path = directory / _RECORD
        record = _read_record(path)
        if record is None:
            return
        members = _stale_members(record) if _can_inspect() else None
        if members:
            pgid = int(record["pgid"])
            _log.warning(
                "killing process group %d (`%s`, %d processes) left running in %s by "
                "fsm-runner process %s, which is gone",
                pgid,
                record.get("command"),
                len(members),
                self.workspace,
                record.get("runner_pid"),
            )
            deadline = time.monotonic() + _KILL_WAIT
            while members:
                # Again each time: a member may have started another process meanwhile.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
                if time.monotonic() >= deadline:
                    raise WorkspaceBusyError(
                        f"process group {pgid} left by a dead runner did not end after SIGKILL",
                        workspace=self.workspace,
                    )
                time.sleep(_POLL / 5)
                members = _stale_members(record)
        path.unlink(missing_ok=True)

    def started(self, pid: int) -> None:
        """Record the command's process group (``pid`` leads it); a failure is only logged."""
        if self._directory is None:
            return
        leader = _process(pid)
        record = {
            "pgid": pid,
            "start_time": leader.start_time if leader is not None else None,
            "boot_id": _boot_id(),
            "command": self.command,
            "runner_pid": os.getpid(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        path = self._directory / _RECORD
        temporary = path.with_name(f".{_RECORD}.{uuid.uuid4().hex}.tmp")
        try:
            temporary.write_text(json.dumps(record) + "\n", encoding="utf-8")
            os.replace(temporary, path)
        except OSError as exc:
            _log.warning("could not record the command's process group in %s: %s", path, exc)
            with contextlib.suppress(OSError):
                temporary.unlink()

    def close(self) -> None:
        """Drop the record and release the lock (the command has ended)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._directory is not None:
                with contextlib.suppress(OSError):
                    (self._directory / _RECORD).unlink(missing_ok=True)
        finally:
            os.close(fd)  # releases the flock

    def __enter__(self) -> WorkspaceClaim:
        """The claim itself."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the claim."""
        self.close()
