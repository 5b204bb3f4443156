"""max_payload_bytes: oversized payloads are refused before anything is written."""

from __future__ import annotations

import pytest

from fsm_runner import Engine, MachineSpec, PhaseResult, State, Transition
from fsm_runner.exceptions import PayloadError
from tests.helpers import NEXT, linear_spec, snapshot

SPEC = linear_spec("a", "b")
LIMIT = 1000


def engine_for(journal, a) -> Engine:
    return Engine(
        SPEC,
        handlers={"a": a, "b": lambda _ctx: NEXT},
        journal=journal,
        max_payload_bytes=LIMIT,
    )


class TestMaxPayloadBytes:
    """Input, context, handler output and send output over the limit."""

    def test_an_oversized_input_is_refused_before_the_run_exists(self, journal):
        engine = engine_for(journal, lambda _ctx: NEXT)
        with pytest.raises(PayloadError, match="more than max_payload_bytes=1,000") as info:
            engine.start({"blob": "x" * LIMIT}, run_id="big")
        assert (info.value.run_id, info.value.what) == ("big", "input")
        assert "nothing was written" in str(info.value)
        assert journal.runs() == []

    def test_an_oversized_handler_output_fails_the_phase_without_being_written(self, journal):
        engine = engine_for(journal, lambda _ctx: PhaseResult(NEXT, output="y" * 5000))
        run = engine.run(engine.start())
        assert run.state == "failed"
        last = journal.transitions(run.run_id)[-1]
        assert last.event == "SYSTEM_ERROR"
        assert last.error["type"] == "HandlerResultError"
        assert (
            "output of 5,002 bytes as JSON, more than max_payload_bytes=1,000"
            in (last.error["message"])
        )
        assert "y" * 100 not in str(last.result)

    def test_just_under_the_limit_is_journaled(self, journal):
        engine = engine_for(journal, lambda _ctx: PhaseResult(NEXT, output="z" * 900))
        run = engine.run(engine.start())
        assert run.state == "done"
        assert journal.transitions(run.run_id)[1].output == "z" * 900

    def test_an_oversized_send_output_changes_nothing(self, journal):
        spec = MachineSpec(
            "waits",
            [State("waiting"), State("done", terminal=True)],
            [Transition("waiting", "GO", "done")],
        )
        engine = Engine(spec, handlers={}, journal=journal, max_payload_bytes=LIMIT)
        run_id = engine.start()
        before = snapshot(journal, run_id)
        with pytest.raises(PayloadError, match="output is"):
            engine.send(run_id, "GO", output="w" * 2000)
        assert snapshot(journal, run_id) == before
