"""The bytecode cache of a process's verifications (``PYTHONPYCACHEPREFIX``).

A ``.pyc`` is trusted by the source's mtime (whole seconds) and size: an agent's edit of the
same size in the same second as an earlier compile would run the old code. So verification
commands write and read bytecode under a prefix of their own, never the workspace's
``__pycache__``, and that prefix's copy of the workspace is emptied before each verification.

The rest of the prefix -- the standard library, pytest and its plugins -- is kept for the
process's next verification: a fresh prefix each time compiled them all again, for every
``python -m pytest`` level of every iteration (2.5 s of CPU here instead of 0.5 with the cache
warm). The commands write their bytecode there even where ``PYTHONDONTWRITEBYTECODE`` is set:
the prefix is a temporary directory of fsm_runner's, in no tree of the user's, and a prefix
nothing is written to costs every import a compile.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref

__all__ = ["bytecode_prefix"]


class _Prefix:
    """One directory a process, made on first use and removed when the interpreter exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None

    def for_workspace(self, workspace: str) -> str:
        """The prefix, its bytecode of ``workspace`` (as given and as resolved) removed."""
        with self._lock:
            path = self._path
            if path is None or not os.path.isdir(path):
                path = self._path = tempfile.mkdtemp(prefix="fsm-runner-pycache-")
                weakref.finalize(self, shutil.rmtree, path, ignore_errors=True)
            # Python keys a source's bytecode by its absolute path under the prefix; a command's
            # own imports (sys.path[0] is its cwd) see the workspace as its real path.
            for root in {os.path.abspath(workspace), os.path.realpath(workspace)}:
                shutil.rmtree(os.path.join(path, root.lstrip(os.sep)), ignore_errors=True)
            return path


_PREFIX = _Prefix()


def bytecode_prefix(workspace: str) -> str:
    """The ``PYTHONPYCACHEPREFIX`` of a verification of ``workspace`` (see the module's docs)."""
    return _PREFIX.for_workspace(workspace)
