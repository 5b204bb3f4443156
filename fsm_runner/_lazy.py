"""A module imported on first use: ``import asyncio`` that costs nothing until it is used.

Every CLI command, worker process and resumed run pays for what ``fsm_runner`` imports. Some
modules are needed on only some paths: ``asyncio`` (with ``ssl``, ``concurrent.futures``,
``subprocess``: ~75 M instructions, ~12 ms) only by async runs and async handlers, never by a
sync run. A module that uses one of them binds a :class:`LazyModule` in its place; for type
checkers it imports the module itself::

    if TYPE_CHECKING:
        import asyncio
    else:
        asyncio = LazyModule("asyncio", globals())

The first attribute read (``asyncio.get_running_loop``) imports the module and puts it in the
stand-in's place in that module's globals, so every later use is a plain global read.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LazyModule"]


class LazyModule:
    """Stands for the module ``name`` in ``namespace`` until an attribute of it is read.

    Args:
        name: a top-level module's name (``asyncio``).
        namespace: the ``globals()`` of the module that uses it; the module replaces this
            stand-in there, under ``name`` as ``import name`` binds it, on first use.
    """

    __slots__ = ("_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name = name
        self._namespace = namespace

    def __getattr__(self, attribute: str) -> Any:
        module = importlib.import_module(self._name)
        # Two threads may both get here: both bind the same module, imported once.
        self._namespace[self._name] = module
        return getattr(module, attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"
