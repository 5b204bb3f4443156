"""Walking a spec's tree of sub-phases without recursion, and the limit on its depth.

Sub-phases nest (a composite's children may be composites), and a spec may come from anyone's
JSON. Python's recursion limit (1,000 frames) would turn a deep one into a ``RecursionError``
wherever the tree is walked recursively -- cattrs reading or writing it, the renderers' nested
blocks. So the tree is walked here with an explicit stack, and a spec deeper than
:data:`MAX_NESTING` is refused by ``MachineSpec.validate()`` (and by everything that reads or
draws a spec) with one ``SpecError`` naming the limit, found before anything recursive runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = ["MAX_NESTING", "data_too_deep", "items", "too_deep", "walk"]

#: How many composites deep a state may sit: a top-level state is at depth 0, a sub-phase of
#: a top-level composite at depth 1, and so on. Far beyond any real machine, far below
#: Python's recursion limit for what walks a spec recursively (cattrs: a few frames a level).
MAX_NESTING = 100

T = TypeVar("T")


def walk(states: Iterable[object], kind: type[T]) -> Iterator[tuple[T, tuple[str, ...]]]:
    """Every ``kind`` in ``states`` and their children, in declaration order (pre-order).

    Each comes with the names of the composites enclosing it, innermost first. Items that are
    not ``kind`` are skipped with what they hold (``validate()`` names them).
    """
    stack: list[tuple[Iterator[object], tuple[str, ...]]] = [(iter(states), ())]
    while stack:
        items, chain = stack[-1]
        for item in items:
            if isinstance(item, kind):
                yield item, chain
                children: Any = getattr(item, "children", ())
                if children:
                    stack.append((iter(children), (getattr(item, "name", ""), *chain)))
                break
        else:
            stack.pop()


def items(states: Iterable[object], kind: type[Any]) -> Iterator[tuple[object, int, Any]]:
    """Every item of ``states`` and of the children of each ``kind`` among them, in pre-order.

    Each comes with its index among its siblings and the ``kind`` holding it (``None`` at the
    top level); the children of an item that is not ``kind`` are not looked at.
    """
    stack: list[tuple[Iterator[tuple[int, object]], object]] = [(enumerate(states), None)]
    while stack:
        siblings, parent = stack[-1]
        for index, item in siblings:
            yield item, index, parent
            children: Any = getattr(item, "children", ()) if isinstance(item, kind) else ()
            if children:
                stack.append((enumerate(children), item))
                break
        else:
            stack.pop()


def _problem(name: object, depth: int) -> str:
    return (
        f"state {name!r:.80} is nested {depth} composites deep: sub-phases may nest at most"
        f" {MAX_NESTING} levels (fsm_runner.spec.MAX_NESTING)"
    )


def too_deep(states: Iterable[object]) -> str | None:
    """The problem of the first state nested deeper than :data:`MAX_NESTING`, if any."""
    stack: list[Iterator[object]] = [iter(states)]
    while stack:
        for item in stack[-1]:
            if len(stack) - 1 > MAX_NESTING:
                return _problem(getattr(item, "name", "?"), len(stack) - 1)
            children: Any = getattr(item, "children", ())
            if isinstance(children, tuple) and children:
                stack.append(iter(children))
                break
        else:
            stack.pop()
    return None


def data_too_deep(data: Mapping[str, Any]) -> str | None:
    """Like :func:`too_deep`, on a spec's plain data (``to_dict`` output), before reading it."""
    stack: list[Iterator[Any]] = [iter(_list(data.get("states")))]
    while stack:
        for item in stack[-1]:
            if len(stack) - 1 > MAX_NESTING:
                name = item.get("name", "?") if isinstance(item, Mapping) else "?"
                return _problem(name, len(stack) - 1)
            children = _list(item.get("children")) if isinstance(item, Mapping) else []
            if children:
                stack.append(iter(children))
                break
        else:
            stack.pop()
    return None


def _list(value: object) -> list[Any] | tuple[Any, ...]:
    return value if isinstance(value, list | tuple) else []
