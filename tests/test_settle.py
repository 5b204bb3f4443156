"""Settling an effect caught in flight (issue 31, point 4): ``fsm-runner effects`` lists a run's
effects; ``fsm-runner settle RUN EFFECT --done [--result JSON] | --failed --reason TEXT`` records
an operator's answer in the effect's own row (who and why beside it, no schema change); a
resumed run then takes it as done (its result returned, the effect never called) or failed
(raised as ``EffectFailedError``), and ``runs --effect-in-flight`` stops listing an ended run.
"""

from __future__ import annotations

import pytest

from fsm_runner import Engine, MachineSpec, RunEvent, RunLifecycle, SqliteJournal, State, Transition
from fsm_runner.effects import MUTATE, SETTLED, settled
from fsm_runner.exceptions import EffectFailedError
from fsm_runner.records import EffectStatus

SPEC = MachineSpec(
    "settling",
    [
        State("paying", handler="paying"),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    [
        Transition("paying", "PAID", "done"),
        Transition("paying", "REFUSED", "failed"),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
    ],
)


class Charge:
    """The outside system: a charge that counts its calls; the first one can 'kill' the process."""

    def __init__(self, *, crash: bool) -> None:
        self.crash = crash
        self.calls = 0

    def __call__(self, amount):
        self.calls += 1
        if self.crash:
            raise SystemExit("killed during the call")
        return {"charged": amount}


def make_engine(journal, charge: Charge, seen: list) -> Engine:
    def paying(ctx):
        try:
            seen.append(ctx.effect("charge", charge, 5, kind=MUTATE))
        except EffectFailedError as exc:
            seen.append(("failed", exc.error_type, exc.message))
            return "REFUSED"
        return "PAID"

    return Engine(SPEC, handlers={"paying": paying}, journal=journal)


def caught_in_flight(journal) -> str:
    """A run whose process died during its non-idempotent charge (left in flight)."""
    charge = Charge(crash=True)
    engine = make_engine(journal, charge, [])
    run_id = engine.start()
    with pytest.raises(SystemExit):
        engine.run(run_id)
    (effect,) = journal.effects(run_id)
    assert effect.status is EffectStatus.IN_FLIGHT
    return run_id


class TestLibrary:
    def test_settled_done_is_returned_without_calling_the_effect(self, journal):
        run_id = caught_in_flight(journal)
        (effect,) = journal.effects(run_id)
        record = settled(
            effect, done=True, result={"charged": 5}, reason="seen in the bank", by="ann"
        )
        journal.put_effect(record, run_seq=journal.load(run_id).seq)
        charge, seen = Charge(crash=False), []
        run = make_engine(journal, charge, seen).resume(run_id)
        assert (run.state, charge.calls, seen) == ("done", 0, [{"charged": 5}])
        (effect,) = journal.effects(run_id)
        assert (effect.status, effect.result) == (EffectStatus.DONE, {"charged": 5})
        assert effect.error == {"settled_by": "ann", "reason": "seen in the bank"}

    def test_settled_failed_is_raised_as_the_effects_failure(self, journal):
        run_id = caught_in_flight(journal)
        (effect,) = journal.effects(run_id)
        record = settled(effect, done=False, reason="no such charge", by="ann")
        journal.put_effect(record, run_seq=journal.load(run_id).seq)
        charge, seen = Charge(crash=False), []
        run = make_engine(journal, charge, seen).resume(run_id)
        assert (run.state, charge.calls) == ("failed", 0)
        ((failed, error_type, message),) = seen
        assert (failed, error_type) == ("failed", SETTLED)
        assert "(SettledByOperator: no such charge)" in message
        assert journal.runs(effect_in_flight=True) == []


class TestCli:
    @pytest.fixture
    def run_id(self, journal_path):
        with SqliteJournal(journal_path) as journal:
            return caught_in_flight(journal)

    def test_effects_lists_one_line_each(self, invoke, run_id):
        result = invoke("effects", run_id[:8])
        assert result.exit_code == 0, result.output
        (line,) = result.output.splitlines()
        assert line.split()[:5] == ["0", "charge", "mutate", "in_flight", "once"]
        assert "key=" in line

    def test_settle_done_then_the_run_goes_on(self, invoke, run_id, journal_path):
        result = invoke(
            "settle",
            run_id,
            "charge",
            "--done",
            "--result",
            '{"charged": 5}',
            "--reason",
            "seen in the bank",
            "--by",
            "ann",
        )
        assert result.exit_code == 0, result.output
        assert result.output.strip().endswith("settled done by ann")
        assert invoke("check").exit_code == 0  # the settled row is sound (its digest too)
        listed = invoke("effects", run_id).output
        assert "done" in listed
        assert "settled_by=ann reason=seen in the bank" in listed
        with SqliteJournal(journal_path) as journal:
            charge, seen = Charge(crash=False), []
            run = make_engine(journal, charge, seen).resume(run_id)
        assert (run.status, charge.calls, seen) == (RunLifecycle.SUCCEEDED, 0, [{"charged": 5}])

    def test_an_ended_run_leaves_the_in_flight_listing_once_settled(
        self, invoke, run_id, journal_path
    ):
        with SqliteJournal(journal_path) as journal:
            # Resumed unsettled: the phase fails with the outcome unknown; the effect stays.
            Engine(
                SPEC,
                handlers={
                    "paying": lambda ctx: ctx.effect("charge", Charge(crash=False), 5, kind=MUTATE)
                },
                journal=journal,
            ).resume(run_id)
            assert journal.load(run_id).status is RunLifecycle.FAILED
        assert run_id[:12] in invoke("runs", "--effect-in-flight").output
        result = invoke("settle", run_id, "charge", "--failed", "--reason", "refunded by hand")
        assert result.exit_code == 0, result.output
        assert run_id[:12] not in invoke("runs", "--effect-in-flight").output
        with SqliteJournal(journal_path) as journal:
            (effect,) = journal.effects(run_id)
        assert effect.status is EffectStatus.FAILED
        assert effect.error["type"] == SETTLED
        assert effect.error["reason"] == "refunded by hand"
        assert effect.error["settled_by"]

    @pytest.mark.parametrize(
        ("args", "code", "message"),
        [
            (("nope", "charge", "--done"), 3, "no run"),
            (("RUN", "nope", "--done"), 3, "has no effect 'nope'"),
            (("RUN", "charge"), 2, "give --done or --failed"),
            (("RUN", "charge", "--failed"), 2, "give --reason"),
            (("RUN", "charge", "--done", "--result", "{bad"), 2, "--result: not JSON"),
        ],
    )
    def test_mistakes_are_one_error_line(self, invoke, run_id, args, code, message):
        result = invoke("settle", *(run_id if a == "RUN" else a for a in args))
        assert result.exit_code == code, result.output
        (line,) = result.output.splitlines()
        assert line.startswith("Error: ")
        assert message in line

    def test_an_effect_not_in_flight_is_a_conflict(self, invoke, run_id):
        assert invoke("settle", run_id, "charge", "--done").exit_code == 0
        result = invoke("settle", run_id, "charge", "--failed", "--reason", "again")
        assert result.exit_code == 4
        assert "is not in flight" in result.output

    def test_a_held_run_is_a_conflict(self, invoke, run_id, journal_path):
        with SqliteJournal(journal_path) as journal:
            journal.claim(run_id, "elsewhere:1:x", ttl=600)
        result = invoke("settle", run_id, "charge", "--done")
        assert result.exit_code == 4
        assert "held by elsewhere:1:x" in result.output


class TestInspector:
    """The inspector's settle form (``--allow-actions``): the same answer as the CLI's."""

    @pytest.fixture
    def served(self, tmp_path):
        from fsm_runner.ui.app import create_app
        from tests.ui_helpers import AppServer

        path = tmp_path / "journal.db"
        journal = SqliteJournal(path)
        run_id = caught_in_flight(journal)
        servers = {}

        def serve(actions: bool):
            servers[actions] = AppServer(create_app(str(path), allow_actions=actions))
            return servers[actions]

        yield journal, run_id, serve
        for server in servers.values():
            server.stop()
        journal.close()

    def post(self, server, run_id: str, **fields: str):
        from urllib.parse import urlencode

        from tests.test_ui_waits import csrf_token

        token = csrf_token(server.get(f"/runs/{run_id}").body)
        return server.post(
            f"/runs/{run_id}/settle", urlencode({"csrf_token": token, **fields}).encode()
        )

    def test_only_with_actions_on(self, served):
        journal, run_id, serve = served
        page = serve(False).get(f"/runs/{run_id}")
        assert page.status == 200
        assert 'class="settle"' not in page.body
        answer = serve(False).post(
            f"/runs/{run_id}/settle", b"csrf_token=x&name=charge&outcome=done"
        )
        assert answer.status == 403
        assert journal.effects(run_id)[0].status is EffectStatus.IN_FLIGHT

    def test_settled_done_then_the_run_goes_on(self, served):
        journal, run_id, serve = served
        server = serve(True)
        assert 'class="settle"' in server.get(f"/runs/{run_id}").body
        answer = self.post(
            server,
            run_id,
            name="charge",
            visit="0",
            outcome="done",
            result='{"charged": 5}',
            reason="seen in the bank",
            by="ann",
        )
        assert answer.status == 303, answer.body
        page = server.get(f"/runs/{run_id}").body
        assert "settled by ann: seen in the bank" in page
        assert 'class="settle"' not in page  # nothing in flight any more
        charge, seen = Charge(crash=False), []
        run = make_engine(journal, charge, seen).resume(run_id)
        assert (run.status, charge.calls, seen) == (RunLifecycle.SUCCEEDED, 0, [{"charged": 5}])

    @pytest.mark.parametrize(
        ("fields", "status"),
        [
            ({"name": "charge", "outcome": "failed"}, 400),  # no reason
            ({"name": "charge", "outcome": "maybe"}, 400),
            ({"name": "charge", "outcome": "done", "result": "{bad"}, 400),
            ({"name": "nope", "outcome": "done"}, 404),
        ],
    )
    def test_mistakes_write_nothing(self, served, fields, status):
        journal, run_id, serve = served
        answer = self.post(serve(True), run_id, **fields)
        assert answer.status == status, answer.body
        assert "Traceback" not in answer.body
        assert journal.effects(run_id)[0].status is EffectStatus.IN_FLIGHT

    def test_settled_twice_is_refused(self, served):
        _, run_id, serve = served
        server = serve(True)
        assert self.post(server, run_id, name="charge", outcome="done").status == 303
        again = self.post(server, run_id, name="charge", outcome="failed", reason="x")
        assert again.status == 409
        assert "is not in flight" in again.body
