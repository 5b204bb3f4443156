from __future__ import annotations

import datetime as dt
import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm_runner import RunLifecycle, RunRecord, TransitionRecord
from fsm_runner.records import format_utc, parse_utc, structure, unstructure

UTC = dt.timezone.utc
CEST = dt.timezone(dt.timedelta(hours=2))


def full_run() -> RunRecord:
    """A run with every field set to something other than its default."""
    return RunRecord(
        run_id="r1",
        machine="agent",
        spec_hash="ab" * 32,
        state="verifying",
        status=RunLifecycle.FAILED,
        seq=7,
        iteration=2,
        attempt=3,
        input={"task": "fix the bug", "files": ["a.py", "b.py"]},
        context={"score": 0.5, "notes": ["ünïcode ✓"]},
        error={"type": "RuntimeError", "message": "boom", "traceback": "line 1\nline 2"},
        created_at=dt.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC),
        updated_at=dt.datetime(2024, 5, 1, 12, 30, tzinfo=UTC),
        parent_run_id="r0",
        forked_from="r0@3",
        abort_reason="operator said so",
        lease_owner="worker-1",
        lease_expires_at=dt.datetime(2024, 5, 1, 12, 31, tzinfo=UTC),
        lease_token=4,
    )


def full_transition() -> TransitionRecord:
    """A transition with every field set to something other than its default."""
    return TransitionRecord(
        run_id="r1",
        seq=7,
        from_state="building",
        event="BUILD_SUCCEEDED",
        to_state="verifying",
        iteration=2,
        attempt=3,
        at=dt.datetime(2024, 5, 1, 12, 30, tzinfo=UTC),
        duration_ms=12.5,
        result={"output": {"ok": True}, "error": None},
    )


class TestRoundTrip:
    """unstructure then structure gives the same record back."""

    @pytest.mark.parametrize(
        "record",
        [
            full_run(),
            full_transition(),
            RunRecord(
                "r2",
                "m",
                "h",
                "a",
                created_at=full_run().created_at,
                updated_at=full_run().updated_at,
            ),
            TransitionRecord("r2", 0, None, "STARTED", "a", at=full_run().created_at),
        ],
        ids=["run", "transition", "default-run", "first-transition"],
    )
    def test_round_trip(self, record):
        assert structure(unstructure(record), type(record)) == record

    @pytest.mark.parametrize("record", [full_run(), full_transition()], ids=["run", "transition"])
    def test_round_trip_through_json(self, record):
        text = json.dumps(unstructure(record))

        assert structure(json.loads(text), type(record)) == record

    def test_unstructure_includes_every_field(self):
        run = RunRecord("r2", "m", "h", "a")

        data = unstructure(run)

        assert set(data) == {field.name for field in attrs.fields(RunRecord)}
        assert data["seq"] == 0
        assert data["lease_token"] == 0
        assert data["context"] == {}
        assert data["abort_reason"] is None


class TestConverter:
    """The one converter: UTC ISO-8601 datetimes and enums by value."""

    def test_datetimes_are_utc_iso_8601(self):
        data = unstructure(full_transition())

        assert data["at"] == "2024-05-01T12:30:00.000000+00:00"

    def test_aware_datetimes_are_converted_to_utc(self):
        transition = attrs.evolve(
            full_transition(), at=dt.datetime(2024, 5, 1, 14, 30, tzinfo=CEST)
        )

        assert unstructure(transition)["at"] == "2024-05-01T12:30:00.000000+00:00"

    def test_naive_datetimes_are_taken_as_utc(self):
        naive = dt.datetime(2024, 5, 1, 12, 30)
        transition = attrs.evolve(full_transition(), at=naive)

        data = unstructure(transition)
        back = structure(data, TransitionRecord)

        assert data["at"] == "2024-05-01T12:30:00.000000+00:00"
        assert back.at == naive.replace(tzinfo=UTC)
        assert back.at.tzinfo is UTC

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("2024-05-01T12:30:00.000000+00:00", dt.datetime(2024, 5, 1, 12, 30, tzinfo=UTC)),
            ("2024-05-01T14:30:00+02:00", dt.datetime(2024, 5, 1, 12, 30, tzinfo=UTC)),
            ("2024-05-01T12:30:00", dt.datetime(2024, 5, 1, 12, 30, tzinfo=UTC)),
            (
                "2024-05-01T12:30:00.000250+00:00",
                dt.datetime(2024, 5, 1, 12, 30, 0, 250, tzinfo=UTC),
            ),
        ],
    )
    def test_parse_utc(self, text, expected):
        parsed = parse_utc(text)

        assert parsed == expected
        assert parsed.tzinfo is UTC
        assert parse_utc(format_utc(parsed)) == parsed

    def test_structured_datetimes_are_aware_utc(self):
        data = unstructure(full_run())
        data["created_at"] = "2024-05-01T14:00:00+02:00"

        run = structure(data, RunRecord)

        assert run.created_at == dt.datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
        assert run.created_at.utcoffset() == dt.timedelta(0)

    def test_enums_are_unstructured_by_value(self):
        data = unstructure(full_run())

        assert data["status"] == "failed"
        assert type(data["status"]) is str

    def test_enums_are_structured_from_their_value(self):
        data = unstructure(full_run())
        data["status"] = "aborted"

        assert structure(data, RunRecord).status is RunLifecycle.ABORTED


class TestOlderJournals:
    """A row missing fields that have defaults loads with the defaults."""

    def test_missing_defaulted_fields_take_their_defaults(self):
        row = {
            "run_id": "r1",
            "machine": "m",
            "spec_hash": "h",
            "state": "building",
            "status": "active",
            "seq": 3,
            "created_at": "2023-01-01T00:00:00+00:00",
            "updated_at": "2023-01-01T00:05:00+00:00",
        }

        run = structure(row, RunRecord)

        assert run.seq == 3
        assert run.status is RunLifecycle.ACTIVE
        assert (run.iteration, run.attempt, run.lease_token) == (0, 1, 0)
        assert run.context == {}
        assert run.error is None
        assert run.abort_reason is None
        assert run.lease_expires_at is None

    def test_null_columns_take_their_defaults(self):
        row = unstructure(full_run())
        for name in ("iteration", "attempt", "lease_token", "context", "status", "seq"):
            row[name] = None

        run = structure(row, RunRecord)

        assert (run.iteration, run.attempt, run.lease_token, run.seq) == (0, 1, 0, 0)
        assert run.context == {}
        assert run.status is RunLifecycle.ACTIVE

    def test_old_transition_row(self):
        row = {
            "run_id": "r1",
            "seq": 1,
            "from_state": "a",
            "event": "NEXT",
            "to_state": "b",
            "at": "2023-01-01T00:00:00+00:00",
        }

        transition = structure(row, TransitionRecord)

        assert (transition.iteration, transition.attempt, transition.duration_ms) == (0, 1, 0.0)
        assert transition.result is None
        assert transition.output is None
        assert transition.error is None


class TestRecords:
    """Records are frozen snapshots with a few derived properties."""

    @pytest.mark.parametrize(
        ("record", "field"),
        [(full_run(), "state"), (full_run(), "seq"), (full_transition(), "to_state")],
    )
    def test_frozen(self, record, field):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(record, field, "changed")

    def test_timestamps_default_to_aware_utc_now(self):
        run = RunRecord("r1", "m", "h", "a")

        assert run.created_at.tzinfo is UTC
        assert run.updated_at.tzinfo is UTC

    @pytest.mark.parametrize(
        ("status", "ended"),
        [
            (RunLifecycle.ACTIVE, False),
            (RunLifecycle.SUCCEEDED, True),
            (RunLifecycle.FAILED, True),
            (RunLifecycle.ABORTED, True),
        ],
    )
    def test_ended(self, status, ended):
        assert RunRecord("r1", "m", "h", "a", status=status).ended is ended

    def test_transition_output_and_error(self):
        failed = TransitionRecord(
            "r1", 1, "a", "SYSTEM_ERROR", "failed", result={"output": 3, "error": {"type": "E"}}
        )

        assert failed.output == 3
        assert failed.error == {"type": "E"}
        assert TransitionRecord("r1", 1, "a", "X", "b", result={"error": "text"}).error is None


class TestFormatUtc:
    """Timestamps are fixed-width UTC ISO-8601, so their text sorts as time does."""

    def test_fixed_width_across_seconds_and_zones(self):
        from fsm_runner.records import format_utc

        base = dt.datetime(2026, 1, 2, 3, 4, 5, 999999, tzinfo=dt.timezone.utc)
        texts = [
            format_utc(base),
            format_utc(base + dt.timedelta(microseconds=1)),
            format_utc(base + dt.timedelta(seconds=1, microseconds=1)),
            format_utc(
                (base + dt.timedelta(seconds=2)).astimezone(dt.timezone(dt.timedelta(hours=5)))
            ),
        ]
        assert texts == [
            "2026-01-02T03:04:05.999999+00:00",
            "2026-01-02T03:04:06.000000+00:00",
            "2026-01-02T03:04:07.000000+00:00",
            "2026-01-02T03:04:07.999999+00:00",
        ]
        assert sorted(texts) == texts
        assert {len(text) for text in texts} == {32}
        assert [dt.datetime.fromisoformat(t) for t in texts][1] == base + dt.timedelta(
            microseconds=1
        )

    @given(
        st.datetimes(
            min_value=dt.datetime(1000, 1, 1),
            timezones=st.sampled_from([dt.timezone.utc, dt.timezone(dt.timedelta(hours=-7))]),
        )
    )
    def test_is_isoformat_with_microseconds(self, value: dt.datetime) -> None:
        from fsm_runner.records import format_utc

        expected = value.astimezone(dt.timezone.utc).isoformat(timespec="microseconds")
        assert format_utc(value) == expected


class TestPositionalBuilder:
    """The hot path's record constructors build exactly what the attrs constructors build."""

    def test_builds_equal_frozen_records(self):
        from fsm_runner.records import positional_builder

        now = dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)
        values = [f"v{i}" for i in range(len(attrs.fields(RunRecord)))]
        values[4] = RunLifecycle.ACTIVE
        built = positional_builder(RunRecord)(*values)
        assert type(built) is RunRecord  # not the builder's private subclass
        assert built == RunRecord(*values)
        assert attrs.evolve(built, state="y") == RunRecord(*values[:3], "y", *values[4:])
        assert hash(built) == hash(RunRecord(*values))
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            built.state = "x"
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            del built.state
        transition = positional_builder(TransitionRecord)(
            "r", 1, "a", "NEXT", "b", 0, 1, now, 0.5, None, 3
        )
        assert transition == TransitionRecord("r", 1, "a", "NEXT", "b", 0, 1, now, 0.5, None, 3)

    def test_every_field_is_required(self):
        from fsm_runner.records import positional_builder

        with pytest.raises(TypeError):
            positional_builder(TransitionRecord)("r", 1)

    def test_classes_with_converters_or_without_slots_are_refused(self):
        from fsm_runner.records import IterationRecord, positional_builder

        with pytest.raises(TypeError, match="converters"):
            positional_builder(IterationRecord)

        @attrs.frozen(slots=False)
        class Loose:
            a: int

        with pytest.raises(TypeError, match="not a slot"):
            positional_builder(Loose)
