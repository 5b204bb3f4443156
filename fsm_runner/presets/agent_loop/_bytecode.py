"""The bytecode cache of verifications (``PYTHONPYCACHEPREFIX``).

A ``.pyc`` is trusted by the source's mtime (whole seconds) and size: an agent's edit of the
same size in the same second as an earlier compile would run the old code. So verification
commands write and read bytecode under a prefix of their own, never the workspace's
``__pycache__``, and that prefix's copy of the workspace is emptied before each verification and
after it.

The rest of the prefix -- the standard library, pytest and its plugins -- is kept: a fresh
prefix for each verification compiled them all again for every ``python -m pytest`` level of
every iteration (2.5 s of CPU here instead of 0.5 with the cache warm). It is the user's cache
directory's ``fsm-runner/pycache`` (``$XDG_CACHE_HOME``, else ``~/.cache``), shared by every
process of the user as Python's own ``__pycache__`` folders are; where that directory cannot be
made, or is not the user's own and private to them, a temporary one of the process's. The
commands write their bytecode there even where ``PYTHONDONTWRITEBYTECODE`` is set: it is in no
tree of the user's, and a prefix nothing is written to costs every import a compile.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["bytecode_prefix"]


def _user_cache() -> str | None:
    """The user's own bytecode cache, made if need be; ``None`` if it is not theirs alone."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "fsm-runner", "pycache")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        found = os.lstat(path)
    except OSError:
        return None
    # Bytecode found there is run: a folder another user could write to is not used.
    private = stat.S_ISDIR(found.st_mode) and not found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return path if private and found.st_uid == os.getuid() else None


class _Prefix:
    """The prefix of this process's verifications: the user's cache, else a temporary folder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None

    def path(self) -> str:
        with self._lock:
            path = self._path
            if path is None or not os.path.isdir(path):
                path = _user_cache()
                if path is None:
                    path = tempfile.mkdtemp(prefix="fsm-runner-pycache-")
                    weakref.finalize(self, shutil.rmtree, path, ignore_errors=True)
                self._path = path
            return path


_PREFIX = _Prefix()


def _forget(prefix: str, workspace: str) -> None:
    """Remove the prefix's bytecode of ``workspace``, as given and as resolved.

    (Python keys a source's bytecode by its absolute path under the prefix; a command's own
    imports -- ``sys.path[0]`` is its cwd -- see the workspace as its real path.)
    """
    for root in {os.path.abspath(workspace), os.path.realpath(workspace)}:
        shutil.rmtree(os.path.join(prefix, root.lstrip(os.sep)), ignore_errors=True)


@contextmanager
def bytecode_prefix(workspace: str) -> Iterator[str]:
    """The ``PYTHONPYCACHEPREFIX`` of one verification of ``workspace`` (the module's docs)."""
    prefix = _PREFIX.path()
    _forget(prefix, workspace)
    try:
        yield prefix
    finally:
        _forget(prefix, workspace)
