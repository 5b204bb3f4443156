"""Running the git CLI for the presets: one careful way, shared by snapshots and workspaces.

Git runs without a shell, with a fixed identity (so it works on machines without git config),
never prompting for a password, and without the variables that would point it at another
repository than the workspace (they leak in when fsm-runner runs inside a git hook).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence

__all__ = ["GIT_LOCATION_VARIABLES", "git_environment", "run_git", "text_tail"]

#: Variables that point git at another repository than the one the workspace is in.
GIT_LOCATION_VARIABLES = frozenset(
    {
        "GIT_ALTERNATE_OBJECT_DIRECTORIES",
        "GIT_COMMON_DIR",
        "GIT_DIR",
        "GIT_INDEX_FILE",
        "GIT_NAMESPACE",
        "GIT_OBJECT_DIRECTORY",
        "GIT_PREFIX",
        "GIT_WORK_TREE",
    }
)

#: Builds the caller's own error: ``error(detail, command=..., returncode=..., stderr=...)``.
GitErrorFactory = Callable[..., Exception]


def text_tail(text: str, *, lines: int = 3, chars: int = 300) -> str:
    """The last few non-blank lines of ``text`` on one line (git puts ``fatal:`` last)."""
    found = [line.strip() for line in text.splitlines() if line.strip()]
    tail = " | ".join(found[-lines:])
    return tail if len(tail) <= chars else "..." + tail[-chars:]


def git_environment(
    *,
    author_name: str | None = None,
    author_email: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """This process's environment for git: location variables removed, prompts off.

    Identity variables beat configuration, so a parent's ``GIT_AUTHOR_NAME`` would otherwise win
    over ours; when a name and email are given they are set for author and committer.
    """
    environment = {
        name: value for name, value in os.environ.items() if name not in GIT_LOCATION_VARIABLES
    }
    environment["GIT_TERMINAL_PROMPT"] = "0"
    if author_name is not None and author_email is not None:
        environment |= {
            "GIT_AUTHOR_NAME": author_name,
            "GIT_AUTHOR_EMAIL": author_email,
            "GIT_COMMITTER_NAME": author_name,
            "GIT_COMMITTER_EMAIL": author_email,
        }
    return environment | dict(extra or {})


def run_git(
    workspace: str,
    args: Sequence[str],
    *,
    author_name: str,
    author_email: str,
    timeout: float | None,
    error: GitErrorFactory,
    stdin: bytes = b"",
    ok: tuple[int, ...] | None = (0,),
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git args`` in ``workspace`` and return what it did.

    Args:
        workspace: the directory git runs in.
        args: git's arguments.
        author_name: the identity commits are made with.
        author_email: likewise.
        timeout: seconds git may take.
        error: builds the caller's error for a failure.
        stdin: bytes fed to git's standard input.
        ok: the exit codes that are not failures (``None``: any).

    Raises:
        Exception: what ``error`` builds, when git is missing, times out, cannot start, or exits
            with a code not in ``ok`` (with the end of its stderr).
    """
    command = [
        "git",
        "-c",
        f"user.name={author_name}",
        "-c",
        f"user.email={author_email}",
        "-c",
        "commit.gpgsign=false",
        *args,
    ]
    shown = "git " + " ".join(args)
    try:
        done = subprocess.run(  # noqa: S603 - a fixed git command line, no shell
            command,
            cwd=workspace,
            env=git_environment(author_name=author_name, author_email=author_email),
            input=stdin,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        raise error("git is not installed (or not on PATH)", command=command) from None
    except subprocess.TimeoutExpired:
        raise error(f"`{shown}` took longer than {timeout}s", command=command) from None
    except OSError as exc:
        raise error(f"could not run `{shown}`: {exc}", command=command) from exc
    if ok is not None and done.returncode not in ok:
        stderr = done.stderr.decode("utf-8", errors="replace")
        raise error(
            f"`{shown}` exited with {done.returncode}: {text_tail(stderr) or '(no output)'}",
            command=command,
            returncode=done.returncode,
            stderr=stderr,
        )
    return done
