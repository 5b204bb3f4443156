"""The one exception tree of fsm_runner.

Every error the library raises on purpose is a subclass of :class:`FsmRunnerError`; foreign
exceptions (``sqlite3.Error``, ``transitions.MachineError``) are mapped at the module that talks
to them and never leak. Each error carries structured attributes and builds its own message::

    FsmRunnerError
    ├── SpecError                     (also ValueError)  .problems
    ├── InvalidTransitionError        (also ValueError)  .run_id .state .event .reason
    ├── PhaseError                                       .run_id .state .event .error
    │   └── HandlerResultError        (also TypeError)   .run_id .state .detail
    ├── PayloadError                  (also TypeError)   .run_id .what .detail
    ├── PhaseTimeoutError             (also TimeoutError) .state .timeout
    ├── RunAbortedError                                  .run_id .reason
    ├── JournalError                                     .path .detail
    │   ├── JournalNotFoundError                         .path .detail
    │   ├── SchemaVersionError                           .found .supported
    │   ├── SpecMismatchError                            .run_id .expected .found
    │   ├── RunConflictError                             .run_id .expected_seq .abort_reason
    │   └── ReplayMismatchError                          .run_id .seq .expected .found
    ├── RunNotFoundError              (also KeyError)    .run_id
    ├── AmbiguousRunIdError           (also LookupError) .prefix .matches
    ├── RunExistsError                                   .run_id
    ├── InvalidRunIdError             (also ValueError)  .run_id .reason
    ├── RunTerminalError                                 .run_id .state .status
    ├── LeaseError                                       .run_id
    │   ├── LeaseHeldError                               .owner .expires_at
    │   └── LeaseLostError                               .token
    ├── EffectOutcomeUnknownError                        .run_id .state .effect
    ├── EffectFailedError                                .run_id .effect .error_type .message
    ├── EffectMismatchError                              .run_id .state .effect .detail
    ├── CapabilityError                                  .state .operation
    ├── SupervisorError                                  .resource .detail
    └── DiagramError                                     .detail

Only :mod:`fsm_runner.cli` turns these into exit codes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fsm_runner._shown import MAX_LENGTH, shown

__all__ = [
    "AmbiguousRunIdError",
    "CapabilityError",
    "DiagramError",
    "EffectFailedError",
    "EffectMismatchError",
    "EffectOutcomeUnknownError",
    "FsmRunnerError",
    "HandlerResultError",
    "InvalidRunIdError",
    "InvalidTransitionError",
    "JournalError",
    "JournalNotFoundError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "PayloadError",
    "PhaseError",
    "PhaseTimeoutError",
    "ReplayMismatchError",
    "RunAbortedError",
    "RunConflictError",
    "RunExistsError",
    "RunNotFoundError",
    "RunTerminalError",
    "SchemaVersionError",
    "SpecError",
    "SpecMismatchError",
    "SupervisorError",
    "WaitTimeoutError",
]


class FsmRunnerError(Exception):
    """Base of every error fsm_runner raises on purpose.

    Every error pickles and copies as itself, with the same message and attributes: errors cross
    process boundaries (a worker's error read back by its parent, ``multiprocessing`` and
    ``concurrent.futures`` pools), and a subclass gets this for free.
    """

    def __str__(self) -> str:
        return self.message

    @property
    def message(self) -> str:
        """The human-readable, one-line description of the error."""
        return str(self.args[0]) if self.args else type(self).__name__

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuild the error from its ``args`` and attributes, without calling ``__init__``.

        ``BaseException`` pickles as ``cls(*self.args)``, which a constructor with keyword-only
        arguments refuses. Calling no constructor at all is what works for every subclass at once:
        the attributes an error carries are already its normalized state (a ``SpecError``'s
        ``problems`` is a tuple even when it was built from a generator, which could not be
        pickled or read twice), so they are restored as they are.

        Returns:
            What :mod:`pickle` and :mod:`copy` need: :func:`_rebuild` with the error's class and
            ``args``, and its ``__dict__`` as the state, which ``BaseException.__setstate__`` puts
            back (``__notes__`` included). As with any exception, the traceback, ``__cause__``
            and ``__context__`` are not carried.
        """
        return _rebuild, (type(self), self.args), self.__dict__ or None


def _rebuild(cls: type[FsmRunnerError], args: tuple[Any, ...]) -> FsmRunnerError:
    """Make an error of ``cls`` holding ``args`` without calling its ``__init__``.

    ``args`` is set again after ``__new__``: ``OSError.__new__`` (under ``PhaseTimeoutError``, a
    ``TimeoutError``) leaves them empty for a subclass with its own ``__init__``. See
    :meth:`FsmRunnerError.__reduce__`.
    """
    error = cls.__new__(cls, *args)
    error.args = args
    return error


class SpecError(FsmRunnerError, ValueError):
    """A machine spec is invalid; ``problems`` lists every problem found, not just the first."""

    def __init__(self, problems: Iterable[str], *, machine: str | None = None) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        self.machine = machine
        super().__init__(self.problems)

    @property
    def message(self) -> str:
        """Every problem, in one message."""
        head = f"invalid machine spec {self.machine!r}" if self.machine else "invalid machine spec"
        return f"{head}: " + "; ".join(self.problems)


class InvalidTransitionError(FsmRunnerError, ValueError):
    """An event that the run's current state does not allow; nothing was changed."""

    def __init__(
        self, *, run_id: str | None, state: str, event: str, reason: str = "not allowed"
    ) -> None:
        self.run_id = run_id
        self.state = state
        self.event = event
        self.reason = reason
        super().__init__(run_id, state, event, reason)

    @property
    def message(self) -> str:
        """Name the run, state and event."""
        where = f"run {shown(self.run_id)}: " if self.run_id else ""
        return f"{where}event {self.event!r} is {self.reason} in state {self.state!r}"


class PhaseError(FsmRunnerError):
    """A phase failed and the spec has no transition to follow for that failure.

    The run is left unchanged in ``state``, so it can be resumed once the spec or the handler
    is fixed.
    """

    def __init__(
        self, *, run_id: str, state: str, event: str, error: Mapping[str, Any] | None = None
    ) -> None:
        self.run_id = run_id
        self.state = state
        self.event = event
        self.error = dict(error or {})
        super().__init__(run_id, state, event)

    @property
    def message(self) -> str:
        """Say what failed and that nothing moved."""
        detail = ""
        if self.error:
            detail = f" ({self.error.get('type')}: {self.error.get('message')})"
        return (
            f"run {shown(self.run_id)}: phase {self.state!r} ended with {self.event}{detail} but "
            f"the spec has no {self.event} transition from {self.state!r}; the run stays in "
            f"{self.state!r}"
        )


class HandlerResultError(PhaseError, TypeError):
    """A phase handler returned something that is not a valid result."""

    def __init__(self, *, run_id: str, state: str, detail: str) -> None:
        self.detail = detail
        super().__init__(run_id=run_id, state=state, event="SYSTEM_ERROR")

    @property
    def message(self) -> str:
        """Say which handler returned what."""
        return f"run {shown(self.run_id)}: handler of state {self.state!r} {self.detail}"


class PayloadError(FsmRunnerError, TypeError):
    """A payload (input, context, event output) is not JSON or is over ``max_payload_bytes``."""

    def __init__(self, *, run_id: str, what: str, detail: str) -> None:
        self.run_id = run_id
        self.what = what
        self.detail = detail
        super().__init__(f"run {shown(run_id)}: {what} {detail}; nothing was written")


class PhaseTimeoutError(FsmRunnerError, TimeoutError):
    """Raised by ``ctx.check()`` once a phase is past its deadline; the engine journals TIMEOUT."""

    def __init__(self, *, state: str, timeout: float | None) -> None:
        self.state = state
        self.timeout = timeout
        super().__init__(f"phase {state!r} ran past its timeout of {timeout}s")


class WaitTimeoutError(PhaseTimeoutError):
    """Raised by ``ctx.wait_for(name)`` once its wait timed out with no signal.

    The phase then times out (the engine journals ``TIMEOUT``) unless the handler catches it.
    """

    def __init__(self, *, state: str, signal: str, timeout: float | None) -> None:
        self.signal = signal
        FsmRunnerError.__init__(
            self, f"phase {state!r} waited for signal {signal!r} past its timeout of {timeout}s"
        )
        self.state = state
        self.timeout = timeout


class RunAbortedError(FsmRunnerError):
    """Raised by ``ctx.check()`` once an abort of the run was requested."""

    def __init__(self, *, run_id: str, reason: str) -> None:
        self.run_id = run_id
        self.reason = reason
        super().__init__(f"run {shown(run_id)} was aborted: {reason}")


class JournalError(FsmRunnerError):
    """The journal cannot be opened, read or written; nothing was changed."""

    def __init__(self, detail: str, *, path: str | None = None) -> None:
        self.detail = detail
        self.path = path
        super().__init__(detail, path)

    @property
    def message(self) -> str:
        """Name the journal and the problem."""
        return f"journal {self.path}: {self.detail}" if self.path else f"journal: {self.detail}"


class JournalNotFoundError(JournalError):
    """No journal is at the location given; nothing was created or changed there.

    ``detail`` says what is there instead (a directory, a text file, an empty file, a database
    without a journal); it is empty when nothing is there at all.
    """

    def __init__(self, detail: str = "", *, path: str | None = None) -> None:
        super().__init__(detail, path=path)

    @property
    def message(self) -> str:
        """Name the location, and what is there instead of a journal."""
        return super().message if self.detail else f"no journal at {self.path}"


class SchemaVersionError(JournalError):
    """The journal was written by a newer fsm_runner (or its schema is unknown)."""

    def __init__(self, *, found: int, supported: int, path: str | None = None) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            f"schema version {found} is newer than this fsm_runner supports ({supported}); "
            "upgrade fsm_runner to open it",
            path=path,
        )


class SpecMismatchError(JournalError):
    """A run is resumed under a spec other than the one it started with."""

    def __init__(self, *, run_id: str, expected: str, found: str, detail: str = "") -> None:
        self.run_id = run_id
        self.expected = expected
        self.found = found
        advice = "" if detail else "; an engine with allow_spec_change=True may resume it"
        super().__init__(
            f"run {shown(run_id)} started with spec {expected[:12]} but the engine has spec "
            f"{found[:12]}{detail}{advice}"
        )

    @property
    def message(self) -> str:
        """Name the run and both specs (no journal path: the engine found the mismatch)."""
        return self.detail


class RunConflictError(JournalError):
    """The run is not as this writer read it; nothing was written.

    Another writer advanced it first (its last seq is not the one this writer read), or an
    abort of it was requested under this writer's lease (``abort_reason``): then the journal
    takes only the ``USER_ABORTED`` transition that carries the abort out.
    """

    def __init__(
        self,
        *,
        run_id: str,
        expected_seq: int,
        path: str | None = None,
        abort_reason: str | None = None,
    ) -> None:
        self.run_id = run_id
        self.expected_seq = expected_seq
        self.abort_reason = abort_reason
        if abort_reason is not None:
            detail = (
                f"run {shown(run_id)} has an abort requested ({abort_reason}); only the"
                " USER_ABORTED transition that carries it out is journaled, nothing else was"
                " written"
            )
        else:
            detail = (
                f"run {shown(run_id)} was advanced by another writer (expected last seq"
                f" {expected_seq}); nothing was written"
            )
        super().__init__(detail, path=path)


class ReplayMismatchError(JournalError):
    """Replaying a run's journal through its spec does not reproduce what the journal holds."""

    def __init__(
        self, *, run_id: str, seq: int, expected: str, found: str, path: str | None = None
    ) -> None:
        self.run_id = run_id
        self.seq = seq
        self.expected = expected
        self.found = found
        super().__init__(
            f"run {shown(run_id)} at seq {seq}: replay expected {expected}, the journal has "
            f"{found}",
            path=path,
        )


class RunNotFoundError(FsmRunnerError, KeyError):
    """No run with that id exists in the journal."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(run_id)

    @property
    def message(self) -> str:
        """Name the missing run."""
        return f"no run {self.run_id!r} in the journal"


class AmbiguousRunIdError(FsmRunnerError, LookupError):
    """A run id prefix matches several runs; ``matches`` holds some of them."""

    #: How many of the matching runs the message names.
    SHOWN = 5

    def __init__(self, prefix: str, matches: Iterable[str]) -> None:
        self.prefix = prefix
        self.matches = tuple(matches)
        super().__init__(prefix, self.matches)

    @property
    def message(self) -> str:
        """Name the prefix and the first runs it matches."""
        shown = ", ".join(match[:12] for match in self.matches[: self.SHOWN])
        more = ", …" if len(self.matches) > self.SHOWN else ""
        return (
            f"run id prefix {self.prefix!r} is ambiguous: it matches {shown}{more}; "
            "give more characters"
        )


class RunExistsError(FsmRunnerError):
    """A run with that id already exists."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(run_id)

    @property
    def message(self) -> str:
        """Name the duplicate run id."""
        return f"a run {self.run_id!r} already exists in the journal"


class InvalidRunIdError(FsmRunnerError, ValueError):
    """A run id breaks the rule of run ids (see :mod:`fsm_runner.run_ids`); nothing was written."""

    #: How many characters of the id the message quotes.
    QUOTED = 60

    def __init__(self, run_id: object, reason: str) -> None:
        self.run_id = run_id
        self.reason = reason
        super().__init__(run_id, reason)

    @property
    def message(self) -> str:
        """Quote the id (escaped, on one line), say what is wrong and what the rule is."""
        quoted = repr(self.run_id)
        if len(quoted) > self.QUOTED:
            quoted = quoted[: self.QUOTED - 1] + "…"
        return (
            f"invalid run id {quoted}: {self.reason} (a run id is 1 to {MAX_LENGTH} printable"
            " characters, no whitespace, '/' or '\\', not '.' or '..', not starting with '-')"
        )


class RunTerminalError(FsmRunnerError):
    """The run has ended (terminal state or aborted) and cannot be advanced."""

    def __init__(self, *, run_id: str, state: str, status: str) -> None:
        self.run_id = run_id
        self.state = state
        self.status = status
        super().__init__(run_id, state, status)

    @property
    def message(self) -> str:
        """Name the run and how it ended."""
        return (
            f"run {shown(self.run_id)} has ended ({self.status} in state {self.state!r}) and "
            "cannot be resumed or advanced"
        )


class LeaseError(FsmRunnerError):
    """Base of errors about who may advance a run."""

    def __init__(self, run_id: str, detail: str) -> None:
        self.run_id = run_id
        super().__init__(f"run {shown(run_id)}: {detail}")


class LeaseHeldError(LeaseError):
    """Another worker holds a live lease on the run."""

    def __init__(self, run_id: str, *, owner: str, expires_at: str) -> None:
        self.owner = owner
        self.expires_at = expires_at
        super().__init__(run_id, f"lease held by {owner} until {expires_at}")


class LeaseLostError(LeaseError):
    """This worker's lease expired and was taken over; it must stop without writing."""

    def __init__(self, run_id: str, *, token: int) -> None:
        self.token = token
        super().__init__(run_id, f"lease token {token} was taken over by another worker")


class EffectOutcomeUnknownError(FsmRunnerError):
    """An effect was caught in flight by a crash and is not declared idempotent."""

    def __init__(self, *, run_id: str, state: str, effect: str) -> None:
        self.run_id = run_id
        self.state = state
        self.effect = effect
        super().__init__(
            f"run {shown(run_id)}: effect {effect!r} in state {state!r} was in flight when the "
            "process stopped; its outcome is unknown"
        )


class EffectFailedError(FsmRunnerError):
    """An effect recorded as failed in this visit is asked for again (without a retry)."""

    def __init__(self, *, run_id: str, effect: str, error_type: str, message: str) -> None:
        self.run_id = run_id
        self.effect = effect
        self.error_type = error_type
        self.message_text = message
        super().__init__(
            f"run {shown(run_id)}: effect {effect!r} failed before ({error_type}: {message}); "
            "pass retry_failed=True to call it again"
        )


class EffectMismatchError(FsmRunnerError):
    """An effect's name does not identify one effect of the visit (reused, or changed)."""

    def __init__(self, *, run_id: str, state: str, effect: str, detail: str) -> None:
        self.run_id = run_id
        self.state = state
        self.effect = effect
        self.detail = detail
        super().__init__(f"run {shown(run_id)}: effect {effect!r} in state {state!r} {detail}")


class CapabilityError(FsmRunnerError):
    """A state tried an operation it is not allowed to perform."""

    def __init__(self, *, state: str | None, operation: str, detail: str = "") -> None:
        self.state = state
        self.operation = operation
        where = f"in state {state!r}" if state else "outside any phase handler"
        super().__init__(f"operation {operation!r} is not allowed {where}{detail}")


class SupervisorError(FsmRunnerError):
    """A supervised resource (a helper server) could not be started or brought back."""

    def __init__(self, resource: str, detail: str) -> None:
        self.resource = resource
        self.detail = detail
        super().__init__(f"{resource}: {detail}")


class DiagramError(FsmRunnerError):
    """A diagram cannot be drawn or rendered (an unknown format, Graphviz missing or failing)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)

    @property
    def message(self) -> str:
        """Say what went wrong, and how to fix it where there is a fix."""
        return self.detail
