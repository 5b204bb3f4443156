"""Compiling a spec to a ``transitions`` machine, once per spec, shared by every run.

The compiled ``transitions.Machine`` is built without models: runs never become models (that
would cost ~26 KiB and up to 240 µs each). Instead the (state, event) → candidate transitions
table is read out of the compiled machine once, and :meth:`CompiledMachine.resolve` answers from
it, evaluating only the guards. The journal, not a ``transitions`` model, holds each run's state.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import transitions

from fsm_runner.exceptions import InvalidTransitionError
from fsm_runner.spec import RETURN, MachineSpec

__all__ = ["CompiledMachine", "Guard", "compile_spec"]

#: A guard reads the run (a :class:`fsm_runner.RunRecord`) and says whether an edge may be taken.
Guard = Callable[[Any], bool]


@attrs.frozen
class _Edge:
    dest: str
    conditions: tuple[tuple[str, bool], ...]
    reason: str = ""


class CompiledMachine:
    """A spec compiled once; answers "where does this event lead from this state?".

    Use :func:`compile_spec`, which caches one instance per spec hash.
    """

    def __init__(self, spec: MachineSpec) -> None:
        self.spec = spec
        self.machine = transitions.Machine(
            model=None,
            states=[state.name for state in spec.leaves],
            initial=spec.initial_leaf,
            auto_transitions=False,
            name=spec.name,
        )
        for (source, event), candidates in spec.edges.items():
            for candidate in candidates:
                self.machine.add_transition(
                    event,
                    source,
                    None if candidate.dest == RETURN else candidate.dest,  # history: internal
                    conditions=list(candidate.guards),
                    unless=list(candidate.unless),
                )
        self._table: dict[tuple[str, str], tuple[_Edge, ...]] = {}
        for event_name, compiled_event in self.machine.events.items():
            for source, compiled in compiled_event.transitions.items():
                declared = spec.edges[(source, event_name)]  # added in this order above
                self._table[(source, event_name)] = tuple(
                    _Edge(
                        dest=RETURN if transition.dest is None else str(transition.dest),
                        conditions=tuple(
                            (str(condition.func), bool(condition.target))
                            for condition in transition.conditions
                        ),
                        reason=candidate.reason,
                    )
                    for transition, candidate in zip(compiled, declared, strict=True)
                )

    @functools.cached_property
    def plain_edges(self) -> dict[tuple[str, str], str]:
        """(state, event) → destination, where the first candidate has no guard and no reason.

        The engine's hot path answers from this table without evaluating anything.
        """
        return {
            key: edges[0].dest
            for key, edges in self._table.items()
            if not edges[0].conditions and not edges[0].reason and edges[0].dest != RETURN
        }

    def allows(self, state: str, event: str) -> bool:
        """Whether ``event`` has any transition out of ``state`` (guards not evaluated)."""
        return (state, event) in self._table

    def resolve(
        self,
        state: str,
        event: str,
        run: object,
        guards: Mapping[str, Guard],
        *,
        run_id: str | None = None,
    ) -> str:
        """Return the destination of ``event`` in ``state`` for ``run``.

        Raises:
            InvalidTransitionError: if the state has no such transition, or every candidate's
                guards reject it.
        """
        return self.resolve_edge(state, event, run, guards, run_id=run_id)[0]

    def resolve_edge(
        self,
        state: str,
        event: str,
        run: object,
        guards: Mapping[str, Guard],
        *,
        run_id: str | None = None,
    ) -> tuple[str, str]:
        """Like :meth:`resolve`, and also return the chosen transition's ``reason``."""
        candidates = self._table.get((state, event))
        if candidates is None:
            raise InvalidTransitionError(run_id=run_id, state=state, event=event)
        for edge in candidates:
            if not edge.conditions or all(
                bool(guards[name](run)) is target for name, target in edge.conditions
            ):
                return edge.dest, edge.reason
        raise InvalidTransitionError(
            run_id=run_id, state=state, event=event, reason="rejected by every guard"
        )


_cache: dict[str, CompiledMachine] = {}
_cache_lock = threading.Lock()


def _new_cache_lock() -> None:
    """In a forked child: a lock of its own (a thread of the parent may have held it)."""
    global _cache_lock  # noqa: PLW0603 - the one module-level lock, replaced after a fork
    _cache_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_cache_lock)


def compile_spec(spec: MachineSpec) -> CompiledMachine:
    """Return the compiled machine for ``spec``, building it only the first time.

    Raises:
        SpecError: if the spec is not valid.
    """
    try:
        key = spec.spec_hash
    except Exception:  # a spec too malformed to hash: the SpecError says what is wrong
        spec.validate()
        raise
    compiled = _cache.get(key)
    if compiled is None:
        spec.validate()
        with _cache_lock:
            compiled = _cache.get(key)
            if compiled is None:
                compiled = _cache[key] = CompiledMachine(spec)
    return compiled
