"""The standard event vocabulary and the structured outcomes a phase can report.

Events are past-tense facts (``BUILD_FAILED``, ``VERIFY_PASSED``). Host apps may use their own
``str`` enums or plain strings: the engine only ever stores an event's string value.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Final

__all__ = [
    "DEAD_LETTERED",
    "INTERRUPTED",
    "OFF_SPEC_EVENTS",
    "RESERVED_EVENTS",
    "RETRIED",
    "REWOUND",
    "SPEC_CHANGED",
    "STARTED",
    "STATUS_EVENTS",
    "SYSTEM_ERROR",
    "TIMEOUT",
    "USER_ABORTED",
    "WAITING",
    "WOKEN",
    "PhaseStatus",
    "RunEvent",
    "event_name",
]


class RunEvent(str, enum.Enum):
    """The standard events; a transition's ``event`` may be one of these or any host string."""

    STARTED = "STARTED"
    PHASE_COMPLETED = "PHASE_COMPLETED"
    PHASE_FAILED = "PHASE_FAILED"
    PHASE_INCOMPLETE = "PHASE_INCOMPLETE"
    BUILD_SUCCEEDED = "BUILD_SUCCEEDED"
    BUILD_FAILED = "BUILD_FAILED"
    SNAPSHOT_TAKEN = "SNAPSHOT_TAKEN"
    SNAPSHOT_FAILED = "SNAPSHOT_FAILED"
    VERIFY_PASSED = "VERIFY_PASSED"
    VERIFY_FAILED = "VERIFY_FAILED"
    VERIFY_FAILED_RETRYABLE = "VERIFY_FAILED_RETRYABLE"
    FEEDBACK_READY = "FEEDBACK_READY"
    SERVER_UNREACHABLE = "SERVER_UNREACHABLE"
    SERVER_RECOVERED = "SERVER_RECOVERED"
    RESTART_BUDGET_SPENT = "RESTART_BUDGET_SPENT"
    RETRIED = "RETRIED"
    SYSTEM_ERROR = "SYSTEM_ERROR"
    TIMEOUT = "TIMEOUT"
    INTERRUPTED = "INTERRUPTED"
    USER_ABORTED = "USER_ABORTED"
    REWOUND = "REWOUND"
    DEAD_LETTERED = "DEAD_LETTERED"
    SPEC_CHANGED = "SPEC_CHANGED"
    WAITING = "WAITING"
    WOKEN = "WOKEN"

    def __str__(self) -> str:
        return self.value


# The events the engine, the reducer, replay, the journals and spec validation compare, once,
# as the plain strings a transition holds (a str compared with a str enum member goes through
# the enum's machinery; these are compared on every step).
STARTED: Final = RunEvent.STARTED.value
RETRIED: Final = RunEvent.RETRIED.value
SYSTEM_ERROR: Final = RunEvent.SYSTEM_ERROR.value
TIMEOUT: Final = RunEvent.TIMEOUT.value
INTERRUPTED: Final = RunEvent.INTERRUPTED.value
USER_ABORTED: Final = RunEvent.USER_ABORTED.value
REWOUND: Final = RunEvent.REWOUND.value
DEAD_LETTERED: Final = RunEvent.DEAD_LETTERED.value
SPEC_CHANGED: Final = RunEvent.SPEC_CHANGED.value
WAITING: Final = RunEvent.WAITING.value
WOKEN: Final = RunEvent.WOKEN.value


class PhaseStatus(enum.IntEnum):
    """A phase's structured outcome, with the exit code a CLI would report for it."""

    OK = 0
    ERROR = 1
    INCOMPLETE = 2
    SERVER_UNREACHABLE = 3
    INTERRUPTED = 130

    @property
    def event(self) -> RunEvent:
        """The event a phase that ends with this status reports."""
        return STATUS_EVENTS[self]


#: How a :class:`PhaseStatus` returned by a handler maps to an event.
STATUS_EVENTS: dict[PhaseStatus, RunEvent] = {
    PhaseStatus.OK: RunEvent.PHASE_COMPLETED,
    PhaseStatus.ERROR: RunEvent.PHASE_FAILED,
    PhaseStatus.INCOMPLETE: RunEvent.PHASE_INCOMPLETE,
    PhaseStatus.SERVER_UNREACHABLE: RunEvent.SERVER_UNREACHABLE,
    PhaseStatus.INTERRUPTED: RunEvent.INTERRUPTED,
}

#: Events the engine journals on its own, without a spec transition to follow: the first row
#: of a run, a retried attempt (a self transition), an abort from a state with no USER_ABORTED
#: exit, an interruption (Ctrl-C, SIGTERM: a self transition; the run stays resumable), an
#: operator's resume from an earlier state (``resume --from-state``: the run is rewound there),
#: recovery parking a run whose worker was lost too often (a self transition; status
#: ``dead_letter``), and a run continuing under another spec (``allow_spec_change``: a self
#: transition of the same visit that records the switch), and a phase that waits for a signal
#: or a time (``ctx.wait_for``, ``ctx.sleep_until``: a ``WAITING`` self transition parks the run,
#: a ``WOKEN`` one records what woke it before the phase runs again). A journaled transition on
#: one of these need not be an edge of the spec; every other one must be.
OFF_SPEC_EVENTS: frozenset[str] = frozenset(
    {
        STARTED,
        RETRIED,
        USER_ABORTED,
        INTERRUPTED,
        REWOUND,
        DEAD_LETTERED,
        SPEC_CHANGED,
        WAITING,
        WOKEN,
    }
)

#: The part of :data:`OFF_SPEC_EVENTS` a spec may not use at all: a spec transition on one would
#: be indistinguishable from the engine's own in the journal, and replay (invariant 8) could not
#: tell them apart. The two others are a spec's to use too: ``USER_ABORTED`` (an abort follows a
#: state's own exit when it has one) and ``INTERRUPTED`` (except as a self transition, which is
#: the engine's own).
RESERVED_EVENTS: frozenset[str] = frozenset(
    {STARTED, RETRIED, REWOUND, DEAD_LETTERED, SPEC_CHANGED, WAITING, WOKEN}
)


def event_name(event: str | enum.Enum) -> str:
    """Return the string an event is journaled as (an enum's value, or the string itself).

    Raises:
        TypeError: if ``event`` is neither a string nor a string-valued enum.
    """
    if isinstance(event, enum.Enum):
        value = event.value
        if not isinstance(value, str):
            raise TypeError(f"event enum {event!r} must have a string value")
        return value
    if isinstance(event, str):
        return event
    raise TypeError(f"an event must be a str or a str enum, not {type(event).__name__}")


if not TYPE_CHECKING:  # type checkers see only the new name

    def __getattr__(name: str) -> Any:
        if name == "RunStatus":  # the old name, deprecated: see fsm_runner._DEPRECATED
            from fsm_runner._deprecation import deprecated  # noqa: PLC0415

            return deprecated(__name__, name, "PhaseStatus", PhaseStatus)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
