"""The sandbox preset: four phases, each allowed only certain kinds of side effect.

::

    producing ─OUTPUT_PRODUCED─▶ preparing ─MUTATION_PREPARED─▶ mutating ─MUTATION_APPLIED─▶
        publishing ─RESULT_PUBLISHED─▶ succeeded

plus ``SYSTEM_ERROR → failed``, ``TIMEOUT → failed`` and ``USER_ABORTED → canceled`` from every
phase. The four phases are known by their role; each is a state named for what it does, with a
handler named for the phase:

============  ==============  ===================================================
phase         state           what its handler does
============  ==============  ===================================================
``producer``  ``producing``   reads the item's current value, announces the change
``prepare``   ``preparing``   peeks at the topic, reads the item again, plans the change
``mutate``    ``mutating``    applies the planned change — the run's one mutation
``next``      ``publishing``  publishes the mutation's result for the next stage
============  ==============  ===================================================

Every side effect goes through the effects ledger (``ctx.effect``), and each state allows only
the kinds of operation of this matrix (:data:`CAPABILITIES`); anything else raises
:class:`fsm_runner.exceptions.CapabilityError` naming the operation and the state, and records
nothing:

=================  ==========  =========  ==========  ========
kind               producer    prepare    mutate      next
=================  ==========  =========  ==========  ========
``topic_peek``                 yes
``topic_publish``  yes                                yes
``read``           yes         yes
``mutate``                                one
=================  ==========  =========  ==========  ========

Values pass from phase to phase only through the journal: ``prepare`` reads the producer's
output with ``ctx.output_of("producing")``, ``mutate`` reads the plan with
``ctx.output_of("preparing")`` and ``next`` the mutation's result with
``ctx.output_of("mutating")``. The handlers keep no state, so a run killed anywhere resumes in
another process; the mutation, recorded in the ledger, is not applied twice.

A run's input is ``{"key": KEY, "change": CHANGE}`` (and optionally ``"topic"``, by default
``"sandbox"``). The services are injected through ``ctx.services``:

``topic``  :class:`Topic` — a message topic the phases may peek at or publish to.
``store``  :class:`ExternalStore` — the external system the run reads and changes once.

:class:`MemoryTopic` and :class:`MemoryStore` are real in-process implementations, for examples
and tests (which also use an :class:`ExternalStore` over HTTP, their own counter server)::

    from fsm_runner import SqliteJournal
    from fsm_runner.presets.sandbox import MemoryStore, MemoryTopic, sandbox_engine

    with SqliteJournal("sandbox.db") as journal:
        engine = sandbox_engine(journal=journal, topic=MemoryTopic(), store=MemoryStore())
        run = engine.run(engine.start({"key": "greeting", "change": "hello"}))
        # run.state == "succeeded"

This module uses only fsm_runner's public API, as a host app would.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from fsm_runner import (
    Engine,
    Journal,
    Listener,
    MachineSpec,
    PhaseContext,
    PhaseHandler,
    PhaseResult,
    RunEvent,
    SpecError,
    State,
    Transition,
)

__all__ = [
    "CAPABILITIES",
    "MUTATION_APPLIED",
    "MUTATION_PREPARED",
    "OUTPUT_PRODUCED",
    "PHASE_STATES",
    "RESULT_PUBLISHED",
    "SANDBOX",
    "ExternalStore",
    "MemoryStore",
    "MemoryTopic",
    "MutatePhase",
    "NextPhase",
    "PreparePhase",
    "ProducerPhase",
    "Topic",
    "sandbox_engine",
]

# -- the machine -------------------------------------------------------------------------------

# The kinds of operation the phases perform: the effects ledger's standard kinds, written as a
# host app writes them (``kind="mutate"`` is the kind ``max_mutations`` counts). A preset uses
# the public API only, and these are strings of that API, not names to import from the engine.
_READ = "read"
_MUTATE = "mutate"
_PEEK = "topic_peek"
_PUBLISH = "topic_publish"

OUTPUT_PRODUCED = "OUTPUT_PRODUCED"
MUTATION_PREPARED = "MUTATION_PREPARED"
MUTATION_APPLIED = "MUTATION_APPLIED"
RESULT_PUBLISHED = "RESULT_PUBLISHED"

#: Each phase's state, in the order a run goes through them.
PHASE_STATES: Mapping[str, str] = {
    "producer": "producing",
    "prepare": "preparing",
    "mutate": "mutating",
    "next": "publishing",
}

#: The capability matrix: the kinds of operation each phase may perform.
CAPABILITIES: Mapping[str, tuple[str, ...]] = {
    "producer": (_READ, _PUBLISH),
    "prepare": (_READ, _PEEK),
    "mutate": (_MUTATE,),
    "next": (_PUBLISH,),
}

_MUTATIONS = {"producer": 0, "prepare": 0, "mutate": 1, "next": 0}
_DESCRIPTIONS = {
    "producer": "read the item, announce the change",
    "prepare": "peek at the topic, read the item again, plan the change",
    "mutate": "apply the planned change, once",
    "next": "publish the result for the next stage",
}
_DONE_EVENTS = {
    "producer": OUTPUT_PRODUCED,
    "prepare": MUTATION_PREPARED,
    "mutate": MUTATION_APPLIED,
    "next": RESULT_PUBLISHED,
}

#: The sandbox machine; see the module docstring.
SANDBOX = MachineSpec(
    "sandbox",
    states=[
        *(
            State(
                state,
                handler=phase,
                allows=CAPABILITIES[phase],
                max_mutations=_MUTATIONS[phase],
                description=_DESCRIPTIONS[phase],
            )
            for phase, state in PHASE_STATES.items()
        ),
        State("succeeded", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ],
    transitions=[
        *(
            Transition(state, _DONE_EVENTS[phase], dest)
            for (phase, state), dest in zip(
                PHASE_STATES.items(), [*list(PHASE_STATES.values())[1:], "succeeded"], strict=True
            )
        ),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.TIMEOUT, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "canceled"),
    ],
)

DEFAULT_TOPIC = "sandbox"

# -- the services ------------------------------------------------------------------------------


@runtime_checkable
class Topic(Protocol):
    """A message topic: the phases may look at its messages or add one, nothing else."""

    def peek(self, topic: str) -> list[Any]:
        """Return the topic's messages, oldest first, without consuming them (JSON values)."""

    def publish(self, topic: str, message: Any) -> int:
        """Append ``message`` (a JSON value) to the topic; return its offset (0-based)."""


@runtime_checkable
class ExternalStore(Protocol):
    """The external system a sandboxed run reads, and changes at most once."""

    def read(self, key: str) -> Any:
        """Return the current value of ``key`` (a JSON value; ``None`` if there is none)."""

    def mutate(self, key: str, change: Any, *, idempotency_key: str | None = None) -> Any:
        """Apply ``change`` to ``key``; return what happened (a JSON value).

        What a change means is the store's business. A store that honours ``idempotency_key``
        applies a change only once per key and answers a repeat with the first answer: that is
        what makes it safe to declare the mutation idempotent (see :func:`sandbox_engine`).
        """


def _json_copy(value: Any) -> Any:
    """A deep copy that is also proof the value is JSON (what a remote service would see)."""
    return json.loads(json.dumps(value))


class MemoryTopic:
    """A :class:`Topic` in this process's memory (thread-safe), for examples and tests."""

    def __init__(self) -> None:
        self._topics: dict[str, list[Any]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        with self._lock:
            sizes = {name: len(messages) for name, messages in self._topics.items()}
        return f"MemoryTopic({sizes})"

    def peek(self, topic: str) -> list[Any]:
        """Return the topic's messages, oldest first, without consuming them."""
        with self._lock:
            return copy.deepcopy(self._topics.get(topic, []))

    def publish(self, topic: str, message: Any) -> int:
        """Append ``message`` to the topic and return its offset.

        Raises:
            TypeError: ``message`` is not a JSON value.
        """
        message = _json_copy(message)
        with self._lock:
            messages = self._topics.setdefault(topic, [])
            messages.append(message)
            return len(messages) - 1

    def messages(self, topic: str) -> list[Any]:
        """The topic's messages, oldest first (the same as :meth:`peek`, for readers)."""
        return self.peek(topic)


class MemoryStore:
    """An :class:`ExternalStore` in this process's memory (thread-safe), for examples and tests.

    A change *replaces* the key's value, and each change bumps the key's version. An
    ``idempotency_key`` seen before returns the first answer again (with ``"replayed": true``)
    without changing anything.

    Args:
        values: the store's initial values.

    Attributes:
        mutations: every :meth:`mutate` call, in order: key, change, idempotency key, and
            whether it was a replay.
    """

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        self._values: dict[str, Any] = _json_copy(dict(values or {}))
        self._versions: dict[str, int] = {}
        self._answers: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.mutations: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        with self._lock:
            return f"MemoryStore({self._values!r})"

    def read(self, key: str) -> Any:
        """Return the current value of ``key`` (``None`` if it has none)."""
        with self._lock:
            return copy.deepcopy(self._values.get(key))

    def mutate(self, key: str, change: Any, *, idempotency_key: str | None = None) -> Any:
        """Set ``key`` to ``change``; return ``{"key", "value", "version", "replayed"}``.

        Raises:
            TypeError: ``change`` is not a JSON value.
        """
        change = _json_copy(change)
        with self._lock:
            earlier = None if idempotency_key is None else self._answers.get(idempotency_key)
            replayed = earlier is not None
            self.mutations.append(
                {
                    "key": key,
                    "change": change,
                    "idempotency_key": idempotency_key,
                    "replayed": replayed,
                }
            )
            if earlier is not None:
                return {**copy.deepcopy(earlier), "replayed": True}
            self._values[key] = change
            version = self._versions[key] = self._versions.get(key, 0) + 1
            answer = {"key": key, "value": change, "version": version, "replayed": False}
            if idempotency_key is not None:
                self._answers[idempotency_key] = answer
            return copy.deepcopy(answer)


# -- the phases --------------------------------------------------------------------------------


def _job(ctx: PhaseContext) -> tuple[str, Any, str]:
    """The run's key, change and topic, from its input.

    Raises:
        ValueError: the input lacks a key (the phase fails with ``SYSTEM_ERROR``).
    """
    data = ctx.input if isinstance(ctx.input, Mapping) else {}
    key = data.get("key")
    if not isinstance(key, str) or not key:
        raise ValueError(f"the run's input needs a non-empty string 'key', not {key!r}")
    topic = data.get("topic", DEFAULT_TOPIC)
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"the run's 'topic' must be a non-empty string, not {topic!r}")
    return key, data.get("change"), topic


def _earlier(ctx: PhaseContext, state: str) -> Mapping[str, Any]:
    """The output of an earlier phase, read from the journal.

    Raises:
        LookupError: that phase has left no output (the run did not come through it).
    """
    output = ctx.output_of(state)
    if output is None:
        raise LookupError(f"no output of {state!r} in the journal of run {ctx.run_id}")
    if not isinstance(output, Mapping):
        raise TypeError(f"the output of {state!r} in run {ctx.run_id} is not an object")
    return output


class ProducerPhase:
    """``producing``: read the item's current value, and announce the change on the topic."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report ``OUTPUT_PRODUCED`` with the key, the change and the value read."""
        key, change, topic_name = _job(ctx)
        topic: Topic = ctx.services["topic"]
        store: ExternalStore = ctx.services["store"]
        current = ctx.effect("read_current", store.read, key, kind=_READ)
        announcement = {"event": "proposed", "run_id": ctx.run_id, "key": key, "change": change}
        offset = ctx.effect("announce", topic.publish, topic_name, announcement, kind=_PUBLISH)
        return PhaseResult(
            OUTPUT_PRODUCED,
            output={"key": key, "change": change, "current": current, "announced_at": offset},
        )


class PreparePhase:
    """``preparing``: look at the topic and the item again, and plan the change."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report ``MUTATION_PREPARED`` with the plan the ``mutate`` phase carries out."""
        produced = _earlier(ctx, PHASE_STATES["producer"])
        _, _, topic_name = _job(ctx)
        topic: Topic = ctx.services["topic"]
        store: ExternalStore = ctx.services["store"]
        messages = ctx.effect("peek_topic", topic.peek, topic_name, kind=_PEEK)
        key = produced["key"]
        before = ctx.effect("read_before", store.read, key, kind=_READ)
        plan = {
            "key": key,
            "change": produced["change"],
            "before": before,
            "changed_since_produced": before != produced["current"],
            "queued": len(messages),
        }
        return PhaseResult(MUTATION_PREPARED, output=plan)


class MutatePhase:
    """``mutating``: apply the planned change — the one mutation the run may make.

    Args:
        idempotent: declare the mutation idempotent: a mutation caught in flight by a crash
            is then sent again on resume, with the same idempotency key. Only for a store that
            honours the key; otherwise the resumed run fails with
            :class:`fsm_runner.exceptions.EffectOutcomeUnknownError`, for someone to look.
    """

    def __init__(self, *, idempotent: bool = False) -> None:
        self.idempotent = idempotent

    def __repr__(self) -> str:
        return f"MutatePhase(idempotent={self.idempotent})"

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report ``MUTATION_APPLIED`` with the store's answer."""
        plan = _earlier(ctx, PHASE_STATES["prepare"])
        store: ExternalStore = ctx.services["store"]
        key = plan["key"]
        result = ctx.effect(
            "apply_change",
            store.mutate,
            key,
            plan["change"],
            kind=_MUTATE,
            idempotent=self.idempotent,
        )
        return PhaseResult(MUTATION_APPLIED, output={"key": key, "result": result})


class NextPhase:
    """``publishing``: hand the mutation's result on to the next stage, through the topic."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report ``RESULT_PUBLISHED`` with where the result was published."""
        mutation = _earlier(ctx, PHASE_STATES["mutate"])
        _, _, topic_name = _job(ctx)
        topic: Topic = ctx.services["topic"]
        message = {
            "event": "mutated",
            "run_id": ctx.run_id,
            "key": mutation["key"],
            "result": mutation["result"],
        }
        offset = ctx.effect("publish_result", topic.publish, topic_name, message, kind=_PUBLISH)
        return PhaseResult(
            RESULT_PUBLISHED,
            output={"key": mutation["key"], "result": mutation["result"], "published_at": offset},
        )


def sandbox_engine(
    *,
    journal: Journal,
    topic: Topic,
    store: ExternalStore,
    idempotent_mutation: bool = False,
    handlers: Mapping[str, PhaseHandler] | None = None,
    listeners: Sequence[Listener] = (),
) -> Engine:
    """An engine running :data:`SANDBOX` with the preset's handlers and these services.

    Args:
        journal: where runs are journaled.
        topic: the topic the phases peek at and publish to.
        store: the external system the run reads and mutates.
        idempotent_mutation: declare the mutation idempotent (see :class:`MutatePhase`).
        handlers: handlers that replace the preset's, by phase name (``producer``,
            ``prepare``, ``mutate``, ``next``); the capability matrix binds them just the same.
        listeners: called with each committed transition.

    Raises:
        SpecError: ``handlers`` names a phase the machine does not have.
    """
    chosen: dict[str, PhaseHandler] = {
        "producer": ProducerPhase(),
        "prepare": PreparePhase(),
        "mutate": MutatePhase(idempotent=idempotent_mutation),
        "next": NextPhase(),
    }
    unknown = sorted(set(handlers or {}) - set(chosen))
    if unknown:
        problems = [f"no phase {name!r} (the phases are {', '.join(chosen)})" for name in unknown]
        raise SpecError(problems, machine=SANDBOX.name)
    chosen.update(handlers or {})
    return Engine(
        SANDBOX,
        handlers=chosen,
        journal=journal,
        services={"topic": topic, "store": store},
        listeners=listeners,
    )
