"""The operator's side of durable waits (issue 29): ``fsm-runner signal``, ``runs --waiting``
and the signals of ``show``, through click's CliRunner on real SQLite journal files."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from fsm_runner import Engine, MachineSpec, SignalStatus, SqliteJournal, State, Transition, Wait
from fsm_runner.cli import EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_USAGE
from tests.helpers import one_line_error

pytestmark = pytest.mark.usefixtures("in_tmp_path")

DAY = 86_400


def propose(ctx):
    return "PROPOSED"


def apply(ctx):
    return "APPLIED"


APPROVAL = MachineSpec(
    "approval",
    [
        State("proposing", handler="propose"),
        State("awaiting", wait=Wait(timeout=DAY, prompt="apply the change?")),
        State("applying", handler="apply"),
        State("holding"),  # waits for ever, without a Wait
        State("applied", terminal=True),
        State("cancelled", terminal=True, outcome="aborted"),
    ],
    [
        Transition("proposing", "PROPOSED", "awaiting"),
        Transition("awaiting", "APPROVE", "applying"),
        Transition("awaiting", "REJECT", "proposing"),
        Transition("awaiting", "HOLD", "holding"),
        Transition("awaiting", "TIMEOUT", "cancelled"),
        Transition("holding", "RELEASE", "awaiting"),
        Transition("applying", "APPLIED", "applied"),
    ],
)
HANDLERS = {"propose": propose, "apply": apply}

#: Another machine, with a waiting state of its own.
GATE = MachineSpec(
    "gate",
    [
        State("opening", handler="open"),
        State("closed", wait=Wait(prompt="open the gate?")),
        State("open", terminal=True),
    ],
    [Transition("opening", "OPENED", "closed"), Transition("closed", "KNOCK", "open")],
)


#: An app whose waiting state's exit has a guard: `signal --app` asks it.
GATED_APP = """
from fsm_runner import Engine, MachineSpec, State, Transition


def make_engine(journal=None):
    spec = MachineSpec(
        "gated",
        [
            State("proposing", handler="propose"),
            State("awaiting"),
            State("applying", handler="apply"),
            State("applied", terminal=True),
        ],
        [
            Transition("proposing", "PROPOSED", "awaiting"),
            Transition("awaiting", "APPROVE", "applying", guards=["allowed"]),
            Transition("awaiting", "REJECT", "proposing"),
            Transition("applying", "APPLIED", "applied"),
        ],
    )
    handlers = {"propose": lambda ctx: "PROPOSED", "apply": lambda ctx: "APPLIED"}
    return Engine(spec, handlers=handlers, guards={"allowed": lambda run: True}, journal=journal)
"""


@pytest.fixture
def journal(journal_path):
    """The journal the CLI works on, opened beside it (a real SQLite file)."""
    journal = SqliteJournal(journal_path)
    yield journal
    journal.close()


@pytest.fixture
def engine(journal):
    engine = Engine(APPROVAL, handlers=HANDLERS, journal=journal)
    yield engine
    engine.close()


def waiting(engine: Engine) -> str:
    """A run parked in ``awaiting``."""
    run_id = engine.start()
    run = engine.run(run_id)
    assert run.state == "awaiting"
    assert run.lease_owner is None
    return run_id


class TestSignal:
    """``fsm-runner signal RUN NAME [--data JSON] [--id ID]``."""

    def test_a_waiting_run_consumes_it_at_once(self, invoke, journal, engine):
        run_id = waiting(engine)

        result = invoke("signal", run_id[:8], "APPROVE", "--data", '{"by": "ana"}')

        assert result.exit_code == 0, result.output
        assert result.output == (
            f"signal #1 APPROVE for run {run_id}: consumed by seq 2 (now in state 'applying')\n"
        )
        (signal,) = journal.signals(run_id)
        assert signal.status is SignalStatus.CONSUMED
        assert signal.payload == {"by": "ana"}
        moved = journal.transitions(run_id, from_seq=2)[0]
        assert (moved.from_state, moved.event, moved.to_state) == (
            "awaiting",
            "APPROVE",
            "applying",
        )
        assert moved.result["output"] == {"by": "ana"}
        assert engine.run(run_id).state == "applied"  # a worker of the app goes on

    def test_a_run_not_waiting_yet_keeps_it_pending(self, invoke, journal, engine):
        run_id = engine.start()  # still in proposing: its phase has not run

        result = invoke("signal", run_id, "APPROVE")

        assert result.exit_code == 0, result.output
        assert result.output == (
            f"signal #1 APPROVE for run {run_id}: pending (the run is in state 'proposing'; it"
            " is consumed when the run waits in a state that accepts it)\n"
        )
        assert [s.status for s in journal.signals(run_id, pending=True)] == ["pending"]
        run = engine.run(run_id)  # proposing -> awaiting, which consumes it -> ... -> applied
        assert run.state == "applied"
        (signal,) = journal.signals(run_id)
        assert signal.status is SignalStatus.CONSUMED
        assert signal.payload is None

    def test_a_run_held_where_it_waits_leaves_it_to_its_holder(self, invoke, journal, engine):
        run_id = waiting(engine)
        journal.claim(run_id, "worker-1", ttl=600)  # a worker holds it (about to look at it)

        result = invoke("signal", run_id, "APPROVE")

        assert result.exit_code == 0, result.output
        assert result.output == (
            f"signal #1 APPROVE for run {run_id}: pending (the run waits in state 'awaiting',"
            " which accepts it; a worker of its app consumes it)\n"
        )
        assert journal.load(run_id).state == "awaiting"

    def test_app_for_guards(self, invoke, journal, tmp_path):
        app = tmp_path / "gated.py"
        app.write_text(GATED_APP)
        namespace: dict = {}
        exec(compile(GATED_APP, str(app), "exec"), namespace)  # the same engine, here
        engine = namespace["make_engine"](journal)
        try:
            run_id = engine.start()
            assert engine.run(run_id).state == "awaiting"
        finally:
            engine.close()

        without = invoke("signal", run_id, "APPROVE")  # its guard can only be asked by the app
        assert without.exit_code == 0, without.output
        assert "pending (the run waits in state 'awaiting', which accepts it" in without.output

        result = invoke("signal", run_id, "REJECT", "--app", f"{app}:make_engine")

        assert result.exit_code == 0, result.output
        # The oldest signal the state accepts goes first: APPROVE, which its guard lets through.
        assert journal.load(run_id).state == "applying"
        assert [s.status for s in journal.signals(run_id)] == ["consumed", "pending"]

    def test_a_run_its_phase_parked_is_woken_by_a_worker(self, invoke, journal):
        def review(ctx):
            verdict = ctx.wait_for("verdict")
            return "ACCEPTED" if verdict["ok"] else "REVISED"

        spec = MachineSpec(
            "review",
            [
                State("reviewing", handler="review", signals=["verdict"]),
                State("done", terminal=True),
            ],
            [
                Transition("reviewing", "ACCEPTED", "done"),
                Transition("reviewing", "REVISED", "done"),
            ],
        )
        engine = Engine(spec, handlers={"review": review}, journal=journal)
        try:
            run_id = engine.start()
            assert engine.run(run_id).state == "reviewing"  # parked by its phase

            result = invoke("signal", run_id, "verdict", "--data", '{"ok": true}')

            assert result.exit_code == 0, result.output
            assert result.output == (
                f"signal #1 verdict for run {run_id}: pending (the run's phase waits for it in"
                " state 'reviewing'; a worker of its app wakes the run, and the phase reads it)\n"
            )
            assert engine.run(run_id).state == "done"
        finally:
            engine.close()
        (signal,) = journal.signals(run_id)
        assert signal.status is SignalStatus.CONSUMED

    def test_a_repeated_id_sends_nothing_and_says_so(self, invoke, journal, engine):
        run_id = engine.start()
        first = invoke("signal", run_id, "APPROVE", "--id", "hook-1", "--data", "1")
        assert first.exit_code == 0, first.output

        again = invoke("signal", run_id, "APPROVE", "--id", "hook-1", "--data", "2")

        assert again.exit_code == 0, again.output
        assert again.output == (
            f"signal #1 APPROVE for run {run_id} (already sent with --id hook-1; nothing"
            " written): pending (the run is in state 'proposing'; it is consumed when the run"
            " waits in a state that accepts it)\n"
        )
        (signal,) = journal.signals(run_id)
        assert (signal.signal_id, signal.payload) == ("hook-1", 1)

    def test_a_repeat_after_consumption_prints_the_first_outcome(self, invoke, journal, engine):
        run_id = waiting(engine)
        assert invoke("signal", run_id, "APPROVE", "--id", "k").exit_code == 0
        engine.run(run_id)  # ended: applied

        again = invoke("signal", run_id, "APPROVE", "--id", "k")

        assert again.exit_code == 0, again.output
        assert again.output == (
            f"signal #1 APPROVE for run {run_id} (already sent with --id k; nothing written):"
            " consumed by seq 2 (now in state 'applied')\n"
        )
        assert len(journal.signals(run_id)) == 1

    def test_signals_are_numbered_in_arrival_order(self, invoke, journal, engine):
        run_id = engine.start()
        assert invoke("signal", run_id, "HOLD").exit_code == 0
        assert invoke("signal", run_id, "RELEASE").exit_code == 0
        assert invoke("signal", run_id, "APPROVE").exit_code == 0

        assert [s.name for s in journal.signals(run_id)] == ["HOLD", "RELEASE", "APPROVE"]
        assert engine.run(run_id).state == "applied"
        events = [t.event for t in journal.transitions(run_id)]
        assert events == ["STARTED", "PROPOSED", "HOLD", "RELEASE", "APPROVE", "APPLIED"]

    def test_unknown_run_is_not_found(self, invoke, engine):
        waiting(engine)
        line = one_line_error(invoke("signal", "nope", "APPROVE"), EXIT_NOT_FOUND)
        assert "no run 'nope'" in line

    def test_an_ended_run_is_a_conflict_and_nothing_is_written(self, invoke, journal, engine):
        run_id = waiting(engine)
        engine.signal(run_id, "APPROVE")
        assert engine.run(run_id).state == "applied"

        line = one_line_error(invoke("signal", run_id, "REJECT"), EXIT_CONFLICT)

        assert "has ended" in line
        assert [s.name for s in journal.signals(run_id)] == ["APPROVE"]

    def test_a_name_no_waiting_state_accepts_is_a_usage_error(self, invoke, journal, engine):
        run_id = waiting(engine)

        line = one_line_error(invoke("signal", run_id, "PROPOSED"), EXIT_USAGE)

        assert "NAME" in line
        assert "'PROPOSED'" in line
        assert "APPROVE, HOLD, REJECT, RELEASE" in line  # what it accepts
        assert journal.signals(run_id) == []
        assert journal.load(run_id).state == "awaiting"

    @pytest.mark.parametrize(
        "data",
        ["{not json", "", "NaN", "-Infinity", "[1,", "{'a': 1}", "1e999", "[" * 100_000],
        ids=["brace", "empty", "nan", "infinity", "unclosed", "quotes", "huge", "deep"],
    )
    def test_bad_json_is_a_usage_error_and_nothing_is_written(self, invoke, journal, engine, data):
        run_id = waiting(engine)

        line = one_line_error(invoke("signal", run_id, "APPROVE", "--data", data), EXIT_USAGE)

        assert line.startswith("Error: --data: not JSON")
        assert journal.signals(run_id) == []
        assert journal.load(run_id).state == "awaiting"

    def test_missing_journal_is_not_found(self, invoke, journal_path):
        line = one_line_error(invoke("signal", "r1", "APPROVE"), EXIT_NOT_FOUND)
        assert "no journal at" in line

    def test_help(self, invoke):
        result = invoke("signal", "--help")
        assert result.exit_code == 0
        for option in ("--data", "--id", "--app"):
            assert option in result.output


def start(journal: SqliteJournal, spec: MachineSpec, handlers, *, runs: int) -> list[str]:
    """``runs`` runs of ``spec``, each driven until it waits."""
    engine = Engine(spec, handlers=handlers, journal=journal)
    try:
        ids = [engine.start() for _ in range(runs)]
        for run_id in ids:
            engine.run(run_id)
        return ids
    finally:
        engine.close()


class TestRunsWaiting:
    """``fsm-runner runs --waiting``: what waits for what, since when, until when."""

    @pytest.fixture
    def scene(self, journal, engine):
        """Two runs awaiting, one holding, one not waiting yet, one ended; one gate closed."""
        awaiting = [waiting(engine), waiting(engine)]
        holding = waiting(engine)
        engine.signal(holding, "HOLD")
        busy = engine.start()  # in proposing: not waiting
        ended = waiting(engine)
        engine.signal(ended, "APPROVE")
        engine.run(ended)
        (gate,) = start(journal, GATE, {"open": lambda ctx: "OPENED"}, runs=1)
        return {
            "awaiting": awaiting,
            "holding": holding,
            "busy": busy,
            "ended": ended,
            "gate": gate,
        }

    def test_table(self, invoke, journal, scene):
        result = invoke("runs", "--waiting")

        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert lines[0].split() == [
            "RUN", "MACHINE", "STATE", "WAITS", "FOR", "SINCE", "(UTC)", "DEADLINE", "(UTC)",
            "PENDING", "PROMPT",
        ]  # fmt: skip
        rows = {line.split()[0]: line for line in lines[1:]}
        expected = {*scene["awaiting"], scene["holding"], scene["gate"]}
        assert set(rows) == {run_id[:12] for run_id in expected}
        for run_id in scene["awaiting"]:
            run = journal.load(run_id)
            entered = journal.transitions(run_id, from_seq=run.seq)[0].at
            deadline = (entered + dt.timedelta(seconds=DAY)).strftime("%Y-%m-%d %H:%M:%S")
            since = run.updated_at.strftime("%Y-%m-%d %H:%M:%S")
            row = rows[run_id[:12]]
            assert row.split()[1:4] == ["approval", "awaiting", "APPROVE,HOLD,REJECT"]
            assert f"{since}  {deadline}" in row
            assert row.split()[-4:] == ["0", "apply", "the", "change?"]
        holding = rows[scene["holding"][:12]].split()
        assert holding[1:4] == ["approval", "holding", "RELEASE"]
        assert holding[6:] == ["-", "0", "-"]  # no deadline, no signal pending, no prompt
        gate = rows[scene["gate"][:12]].split()
        assert gate[1:4] == ["gate", "closed", "KNOCK"]
        assert gate[-3:] == ["open", "the", "gate?"]

    def test_json(self, invoke, journal, scene):
        result = invoke("runs", "--waiting", "--json")

        assert result.exit_code == 0, result.output
        found = {entry["run_id"]: entry for entry in json.loads(result.output)}
        assert set(found) == {*scene["awaiting"], scene["holding"], scene["gate"]}
        awaiting = found[scene["awaiting"][0]]
        assert awaiting["state"] == "awaiting"
        assert awaiting["status"] == "active"
        wait = awaiting["wait"]
        assert wait["by"] == "state"
        assert wait["accepts"] == ["APPROVE", "HOLD", "REJECT"]
        assert wait["on_timeout"] == "TIMEOUT"
        assert wait["prompt"] == "apply the change?"
        assert wait["pending_signals"] == 0
        since = dt.datetime.fromisoformat(wait["since"])
        deadline = dt.datetime.fromisoformat(wait["deadline"])
        assert dt.timedelta(seconds=DAY) - (deadline - since) < dt.timedelta(seconds=60)
        assert found[scene["holding"]]["wait"]["deadline"] is None

    def test_pending_signals_are_counted(self, invoke, journal, scene):
        # The run waits in holding, which accepts only RELEASE: APPROVE stays pending.
        holding = scene["holding"]
        assert invoke("signal", holding, "APPROVE").exit_code == 0
        assert invoke("signal", holding, "APPROVE", "--id", "again").exit_code == 0

        found = {e["run_id"]: e for e in json.loads(invoke("runs", "--waiting", "--json").output)}

        assert found[holding]["wait"]["pending_signals"] == 2
        assert found[scene["gate"]]["wait"]["pending_signals"] == 0

    def test_machine_and_state_filters(self, invoke, scene):
        by_machine = json.loads(invoke("runs", "--waiting", "--machine", "gate", "--json").output)
        assert [e["run_id"] for e in by_machine] == [scene["gate"]]

        by_state = json.loads(invoke("runs", "--waiting", "--state", "holding", "--json").output)
        assert [e["run_id"] for e in by_state] == [scene["holding"]]

        none = invoke("runs", "--waiting", "--machine", "nothing-such")
        assert none.exit_code == 0
        assert none.output == "no waiting runs\n"

    def test_newest_first_and_limit(self, invoke, journal, scene):
        found = json.loads(invoke("runs", "--waiting", "--json", "--limit", "2").output)

        assert len(found) == 2
        everyone = json.loads(invoke("runs", "--waiting", "--json").output)
        times = [e["wait"]["since"] for e in everyone]
        assert times == sorted(times, reverse=True)
        assert [e["run_id"] for e in found] == [e["run_id"] for e in everyone[:2]]

    def test_a_run_under_an_older_spec_is_found(self, invoke, journal, scene):
        # The machine changed: its newest runs have a new spec in which `holding` is gone.
        changed = MachineSpec(
            "approval",
            [s for s in APPROVAL.states if s.name != "holding"],
            [t for t in APPROVAL.transitions if "holding" not in (t.source[0], t.dest)],
        )
        (newer,) = start(journal, changed, HANDLERS, runs=1)

        found = {e["run_id"] for e in json.loads(invoke("runs", "--waiting", "--json").output)}

        assert {scene["holding"], newer} <= found

    def test_runs_their_phase_parked(self, invoke, journal):
        def review(ctx):
            verdict = ctx.wait_for("verdict", timeout=3600)
            return "ACCEPTED" if verdict["ok"] else "REVISED"

        def nap(ctx):
            ctx.sleep_until(dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc))
            return "RESTED"

        spec = MachineSpec(
            "review",
            [
                State("reviewing", handler="review", signals=["verdict"]),
                State("napping", handler="nap"),
                State("done", terminal=True),
            ],
            [
                Transition("reviewing", "ACCEPTED", "napping"),
                Transition("reviewing", "REVISED", "reviewing"),
                Transition("reviewing", "TIMEOUT", "done"),
                Transition("napping", "RESTED", "done"),
            ],
        )
        engine = Engine(spec, handlers={"review": review, "nap": nap}, journal=journal)
        try:
            asking, sleeping = engine.start(), engine.start()
            engine.run(asking)
            engine.run(sleeping)
            engine.signal(sleeping, "verdict", {"ok": True})
            engine.run(sleeping)  # the verdict read, then napping parks it
            busy = engine.start()  # its phase has not run
        finally:
            engine.close()
        assert journal.load(sleeping).state == "napping"

        result = invoke("runs", "--waiting", "--machine", "review")

        assert result.exit_code == 0, result.output
        rows = {line.split()[0]: line.split() for line in result.output.splitlines()[1:]}
        assert set(rows) == {asking[:12], sleeping[:12]}
        assert rows[asking[:12]][2:5] == ["reviewing", "(phase)", "verdict"]
        assert rows[sleeping[:12]][2:6] == ["napping", "(phase)", "(a", "time)"]
        assert "2100-01-01 00:00:00" in " ".join(rows[sleeping[:12]])
        found = {
            e["run_id"]: e["wait"] for e in json.loads(invoke("runs", "--waiting", "--json").output)
        }
        assert found[asking]["by"] == "phase"
        assert found[asking]["accepts"] == ["verdict"]
        assert found[sleeping]["accepts"] == []
        assert found[sleeping]["deadline"].startswith("2100-01-01T00:00:00")
        assert busy not in found

    def test_nothing_waits(self, invoke, journal, engine):
        engine.start()
        result = invoke("runs", "--waiting")
        assert result.exit_code == 0
        assert result.output == "no waiting runs\n"

    @pytest.mark.parametrize(
        "option", [("--status", "failed"), ("--stale",), ("--effect-in-flight",)]
    )
    def test_clashing_filters_are_a_usage_error(self, invoke, engine, option):
        waiting(engine)
        line = one_line_error(invoke("runs", "--waiting", *option), EXIT_USAGE)
        assert f"--waiting cannot be combined with {option[0]}" in line

    def test_help(self, invoke):
        result = invoke("runs", "--help")
        assert result.exit_code == 0
        assert "--waiting" in result.output


class TestShow:
    """``fsm-runner show``: what a waiting run waits for, and its signals."""

    def test_signals_section(self, invoke, journal, engine):
        run_id = waiting(engine)
        assert (
            invoke("signal", run_id, "HOLD", "--id", "h1", "--data", '{"why": "later"}').exit_code
            == 0
        )
        assert invoke("signal", run_id, "APPROVE", "--data", json.dumps("x" * 100)).exit_code == 0

        result = invoke("show", run_id)

        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("SIGNAL "))
        assert lines[at].split() == [
            "SIGNAL", "NAME", "STATUS", "RECEIVED", "(UTC)", "CONSUMED", "BY", "ID", "PAYLOAD",
        ]  # fmt: skip
        hold, approve = lines[at + 1].split(), lines[at + 2].split()
        assert hold[:3] == ["#1", "HOLD", "consumed"]
        assert hold[5:] == ["seq", "2", "h1", '{"why":', '"later"}']
        assert approve[:3] == ["#2", "APPROVE", "pending"]
        assert approve[5:7] == ["-", "-"]
        assert approve[7] == '"' + "x" * 38 + "…"  # cut to 40 characters

    def test_expired_signals(self, invoke, journal, engine):
        run_id = waiting(engine)
        engine.signal(run_id, "HOLD")
        assert invoke("signal", run_id, "APPROVE").exit_code == 0  # pending: holding
        assert invoke("abort", run_id, "--reason", "no").exit_code == 0

        lines = invoke("show", run_id).output.splitlines()

        row = next(line for line in lines if line.startswith("#2 "))
        assert row.split()[:3] == ["#2", "APPROVE", "expired"]

    def test_json(self, invoke, journal, engine):
        run_id = waiting(engine)
        assert invoke("signal", run_id, "APPROVE", "--id", "a", "--data", "[1]").exit_code == 0

        shown = json.loads(invoke("show", run_id, "--json").output)

        (signal,) = shown["signals"]
        assert signal["name"] == "APPROVE"
        assert signal["number"] == 1
        assert signal["status"] == "consumed"
        assert signal["consumed_seq"] == 2
        assert signal["signal_id"] == "a"
        assert signal["payload"] == [1]

    def test_a_waiting_run_says_what_it_waits_for(self, invoke, journal, engine):
        run_id = waiting(engine)
        engine.signal(run_id, "HOLD")
        assert invoke("signal", run_id, "APPROVE").exit_code == 0  # pending: holding

        lines = invoke("show", run_id).output.splitlines()

        assert "waits    for RELEASE; 1 signal pending" in lines
        awaiting = waiting(engine)
        run = journal.load(awaiting)
        entered = journal.transitions(awaiting, from_seq=run.seq)[0].at
        deadline = (entered + dt.timedelta(seconds=DAY)).strftime("%Y-%m-%d %H:%M:%S")
        lines = invoke("show", awaiting).output.splitlines()
        assert (
            f"waits    for APPROVE, HOLD, REJECT until {deadline} UTC (then TIMEOUT): apply the"
            " change?"
        ) in lines
        wait = json.loads(invoke("show", awaiting, "--json").output)["wait"]
        assert wait["accepts"] == ["APPROVE", "HOLD", "REJECT"]
        assert wait["prompt"] == "apply the change?"

    def test_a_run_not_waiting_says_nothing_of_it(self, invoke, engine):
        run_id = engine.start()
        assert not any(
            line.startswith("waits ") for line in invoke("show", run_id).output.splitlines()
        )
        assert json.loads(invoke("show", run_id, "--json").output)["wait"] is None

    def test_no_signals_no_section(self, invoke, engine):
        run_id = waiting(engine)
        output = invoke("show", run_id).output
        assert "SIGNAL" not in output
        assert json.loads(invoke("show", run_id, "--json").output)["signals"] == []
