from __future__ import annotations

import enum

import pytest

from fsm_runner import PhaseStatus, RunEvent
from fsm_runner.events import OFF_SPEC_EVENTS, RESERVED_EVENTS, STATUS_EVENTS, event_name


class HostEvent(str, enum.Enum):
    """A host app's own str enum of events."""

    DEPLOYED = "deployed"


class PlainStringEnum(enum.Enum):
    """An enum that is not a str subclass but has string values."""

    SHIPPED = "shipped"


class NumberedEvent(enum.Enum):
    """An enum whose values are not strings: not usable as events."""

    ONE = 1


class TestRunEvent:
    """The standard event vocabulary is a str enum whose values are its names."""

    @pytest.mark.parametrize(
        "name",
        [
            "BUILD_FAILED",
            "SNAPSHOT_FAILED",
            "VERIFY_PASSED",
            "VERIFY_FAILED_RETRYABLE",
            "SERVER_UNREACHABLE",
            "SYSTEM_ERROR",
            "TIMEOUT",
            "USER_ABORTED",
            "STARTED",
            "RETRIED",
        ],
    )
    def test_standard_events_exist(self, name):
        assert RunEvent[name].value == name

    def test_every_value_is_its_name(self):
        assert all(event.value == event.name for event in RunEvent)

    def test_events_are_strings(self):
        assert isinstance(RunEvent.VERIFY_PASSED, str)
        assert RunEvent.VERIFY_PASSED == "VERIFY_PASSED"
        assert str(RunEvent.VERIFY_PASSED) == "VERIFY_PASSED"
        assert f"{RunEvent.TIMEOUT}" == "TIMEOUT"

    def test_off_spec_events(self):
        assert sorted(OFF_SPEC_EVENTS) == [
            "DEAD_LETTERED",
            "INTERRUPTED",
            "RETRIED",
            "REWOUND",
            "SPEC_CHANGED",
            "STARTED",
            "USER_ABORTED",
            "WAITING",
            "WOKEN",
        ]

    def test_reserved_events_are_the_off_spec_events_a_spec_may_not_use(self):
        # a spec may declare USER_ABORTED and INTERRUPTED transitions (the engine follows them)
        spec_may_use = OFF_SPEC_EVENTS - RESERVED_EVENTS
        assert spec_may_use == {"USER_ABORTED", "INTERRUPTED"}
        assert RESERVED_EVENTS < OFF_SPEC_EVENTS


class TestRunStatus:
    """PhaseStatus carries the exit code of an outcome and the event it maps to."""

    @pytest.mark.parametrize(
        ("status", "code"),
        [
            (PhaseStatus.OK, 0),
            (PhaseStatus.ERROR, 1),
            (PhaseStatus.INCOMPLETE, 2),
            (PhaseStatus.SERVER_UNREACHABLE, 3),
            (PhaseStatus.INTERRUPTED, 130),
        ],
    )
    def test_values(self, status, code):
        assert int(status) == code
        assert PhaseStatus(code) is status

    def test_is_an_int_enum_with_exactly_these_members(self):
        assert isinstance(PhaseStatus.ERROR, int)
        assert [status.name for status in PhaseStatus] == [
            "OK",
            "ERROR",
            "INCOMPLETE",
            "SERVER_UNREACHABLE",
            "INTERRUPTED",
        ]

    @pytest.mark.parametrize(
        ("status", "event"),
        [
            (PhaseStatus.OK, RunEvent.PHASE_COMPLETED),
            (PhaseStatus.ERROR, RunEvent.PHASE_FAILED),
            (PhaseStatus.INCOMPLETE, RunEvent.PHASE_INCOMPLETE),
            (PhaseStatus.SERVER_UNREACHABLE, RunEvent.SERVER_UNREACHABLE),
            (PhaseStatus.INTERRUPTED, RunEvent.INTERRUPTED),
        ],
    )
    def test_event_mapping(self, status, event):
        assert status.event is event
        assert STATUS_EVENTS[status] is event

    def test_every_status_maps_to_an_event(self):
        assert set(STATUS_EVENTS) == set(PhaseStatus)


class TestEventName:
    """event_name() gives the string an event is journaled as."""

    @pytest.mark.parametrize(
        ("event", "expected"),
        [
            ("CUSTOM_THING", "CUSTOM_THING"),
            ("", ""),
            (RunEvent.SYSTEM_ERROR, "SYSTEM_ERROR"),
            (HostEvent.DEPLOYED, "deployed"),
            (PlainStringEnum.SHIPPED, "shipped"),
        ],
    )
    def test_names(self, event, expected):
        name = event_name(event)

        assert name == expected
        assert type(name) is str

    @pytest.mark.parametrize("event", [None, 3, 1.5, b"BYTES", ["A"]])
    def test_non_string_events_are_refused(self, event):
        with pytest.raises(TypeError, match="must be a str or a str enum"):
            event_name(event)

    @pytest.mark.parametrize("event", [NumberedEvent.ONE, PhaseStatus.OK])
    def test_enum_with_non_string_value_is_refused(self, event):
        with pytest.raises(TypeError, match="must have a string value"):
            event_name(event)
