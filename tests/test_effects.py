"""The effects ledger (ctx.effect) and per-state capabilities, on every journal.

A crash is simulated in-process by raising ``SystemExit`` (which the engine does not journal)
from the handler after an effect, or from the effect's own function during the call; the run is
then resumed by a fresh engine on the same journal, as a new process would.
"""

from __future__ import annotations

import string

import attrs
import pytest

from fsm_runner import (
    Engine,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    SpecError,
    State,
    Transition,
)
from fsm_runner.effects import MUTATE, PEEK, PUBLISH, READ
from fsm_runner.exceptions import (
    CapabilityError,
    EffectFailedError,
    EffectMismatchError,
    EffectOutcomeUnknownError,
    PayloadError,
)
from fsm_runner.records import EffectRecord, EffectStatus, utc_now

NEXT = "NEXT"
SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
NO_RETRY_WAIT = RetryPolicy(max_attempts=3, wait_initial=0)


def machine(*states: State, name: str = "effects") -> MachineSpec:
    """states[0] -NEXT-> states[1] ... -NEXT-> done; SYSTEM_ERROR from anywhere -> failed."""
    names = [s.name for s in states]
    return MachineSpec(
        name,
        [
            *states,
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            *(Transition(a, NEXT, b) for a, b in zip(names, [*names[1:], "done"], strict=True)),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )


def phase(name: str, **options) -> State:
    return State(name, handler=name, **options)


def engine(spec: MachineSpec, journal, **handlers) -> Engine:
    return Engine(spec, handlers=handlers, journal=journal, sleep=lambda seconds: None)


class Calls:
    """A side effect that counts its calls and remembers the keys it was given."""

    def __init__(self, result=None, *, crash_first: bool = False):
        self.result = result
        self.crash_first = crash_first
        self.keys: list[str | None] = []
        self.args: list[tuple] = []

    @property
    def count(self) -> int:
        return len(self.args)

    def __call__(self, *args, idempotency_key=None):
        self.args.append(args)
        self.keys.append(idempotency_key)
        if self.crash_first and self.count == 1:
            raise SystemExit("killed during the call")
        return self.result if self.result is not None else {"args": list(args)}


def in_flight(run, name: str, *, kind=MUTATE, args=(), key="", idempotent=False) -> EffectRecord:
    """The record a process killed during the call would have left behind."""
    return EffectRecord(
        run_id=run.run_id,
        visit_seq=run.visit_seq,
        name=name,
        state=run.state,
        kind=kind,
        params={"args": list(args), "kwargs": {}},
        idempotency_key=key,
        idempotent=idempotent,
        started_at=utc_now(),
    )


class TestDoneEffects:
    """An effect recorded done is never called again; its recorded result is returned."""

    def test_not_repeated_on_resume(self, journal):
        charge = Calls({"charged": 5})
        crash = [True]
        results = []

        def paying(ctx):
            results.append(ctx.effect("charge", charge, 5, kind=MUTATE))
            if crash[0]:
                raise SystemExit("killed before the transition")
            return NEXT

        spec = machine(phase("paying"))
        first = engine(spec, journal, paying=paying)
        run_id = first.start()
        with pytest.raises(SystemExit):
            first.run(run_id)
        assert journal.load(run_id).state == "paying"

        crash[0] = False
        run = engine(spec, journal, paying=paying).resume(run_id)

        assert (run.state, run.status) == ("done", RunLifecycle.SUCCEEDED)
        assert charge.count == 1
        assert results == [{"charged": 5}, {"charged": 5}]
        [effect] = journal.effects(run_id)
        assert (effect.name, effect.status, effect.result) == (
            "charge",
            EffectStatus.DONE,
            {"charged": 5},
        )
        assert effect.params == {"args": [5], "kwargs": {}}
        assert (effect.kind, effect.state, effect.visit_seq) == (MUTATE, "paying", 0)
        assert effect.started_at <= effect.completed_at


class TestFailedEffects:
    """An effect recorded failed raises EffectFailedError again, unless retry_failed."""

    def test_reraised_unless_retry_failed(self, journal):
        outcomes = []

        def flaky(amount):
            outcomes.append(amount)
            if len(outcomes) == 1:
                raise ValueError("card declined")
            return "ok"

        seen = []

        def paying(ctx):
            try:
                seen.append(
                    ctx.effect("charge", flaky, 5, kind=MUTATE, retry_failed=ctx.attempt == 3)
                )
            except EffectFailedError as exc:
                seen.append((exc.effect, exc.error_type, exc.message_text))
                raise
            return NEXT

        spec = machine(phase("paying", retry=NO_RETRY_WAIT))
        e = engine(spec, journal, paying=paying)
        run = e.run(e.start())

        assert run.state == "done"
        assert outcomes == [5, 5]  # attempt 1 and attempt 3; attempt 2 only read the record
        assert seen == [("charge", "ValueError", "card declined"), "ok"]
        events = [(t.event, t.attempt) for t in journal.transitions(run.run_id)[1:]]
        assert events == [("RETRIED", 1), ("RETRIED", 2), (NEXT, 3)]
        assert journal.transitions(run.run_id)[2].error["type"] == "EffectFailedError"
        [effect] = journal.effects(run.run_id)
        assert (effect.status, effect.result, effect.error) == (EffectStatus.DONE, "ok", None)

    def test_the_original_error_fails_the_phase_and_is_recorded(self, journal):
        def refuse():
            raise ConnectionRefusedError("no")

        def paying(ctx):
            ctx.effect("charge", refuse, kind=MUTATE)
            return NEXT

        e = engine(machine(phase("paying")), journal, paying=paying)
        run = e.run(e.start())
        assert (run.state, run.error["type"]) == ("failed", "ConnectionRefusedError")
        [effect] = journal.effects(run.run_id)
        assert effect.status is EffectStatus.FAILED
        assert effect.error == {"type": "ConnectionRefusedError", "message": "no"}
        assert effect.completed_at is not None


class TestInFlightEffects:
    """An effect caught in flight is reported, never silently redone unless idempotent."""

    def test_non_idempotent_fails_the_phase_with_outcome_unknown(self, journal):
        charge = Calls()
        spec = machine(phase("paying"))

        def paying(ctx):
            ctx.effect("charge", charge, 5, kind=MUTATE)
            return NEXT

        e = engine(spec, journal, paying=paying)
        run_id = e.start()
        run = journal.load(run_id)
        journal.put_effect(in_flight(run, "charge", args=[5], key="k1"), run_seq=run.seq)
        assert [r.run_id for r in journal.runs(effect_in_flight=True)] == [run_id]

        run = engine(spec, journal, paying=paying).resume(run_id)

        assert charge.count == 0
        assert (run.state, run.status, run.error["type"]) == (
            "failed",
            RunLifecycle.FAILED,
            "EffectOutcomeUnknownError",
        )
        last = journal.transitions(run_id)[-1]
        assert (last.from_state, last.event, last.to_state) == ("paying", SYSTEM_ERROR, "failed")
        assert last.error["type"] == "EffectOutcomeUnknownError"
        assert "'charge'" in last.error["message"]
        assert "'paying'" in last.error["message"]
        [effect] = journal.effects(run_id)
        assert effect.status is EffectStatus.IN_FLIGHT  # left for an operator to look at
        assert [r.run_id for r in journal.runs(effect_in_flight=True)] == [run_id]

    def test_a_crash_during_the_call_leaves_it_in_flight(self, journal):
        charge = Calls(crash_first=True)
        spec = machine(phase("paying"))
        errors = []

        def paying(ctx):
            try:
                ctx.effect("charge", charge, 5, kind=MUTATE)
            except EffectOutcomeUnknownError as exc:
                errors.append((exc.run_id, exc.state, exc.effect))
                return NEXT  # the host reconciles by itself
            return NEXT

        first = engine(spec, journal, paying=paying)
        run_id = first.start()
        with pytest.raises(SystemExit):
            first.run(run_id)
        [effect] = journal.effects(run_id)
        assert effect.status is EffectStatus.IN_FLIGHT

        run = engine(spec, journal, paying=paying).resume(run_id)
        assert run.state == "done"
        assert charge.count == 1
        assert errors == [(run_id, "paying", "charge")]

    def test_idempotent_is_called_again_with_the_same_key(self, journal):
        charge = Calls({"charged": 5}, crash_first=True)
        spec = machine(phase("paying"))

        def paying(ctx):
            ctx.effect("charge", charge, 5, kind=MUTATE, idempotent=True)
            return NEXT

        first = engine(spec, journal, paying=paying)
        run_id = first.start()
        with pytest.raises(SystemExit):
            first.run(run_id)
        [caught] = journal.effects(run_id)
        assert (caught.status, caught.idempotent) == (EffectStatus.IN_FLIGHT, True)

        run = engine(spec, journal, paying=paying).resume(run_id)

        assert run.state == "done"
        assert charge.count == 2
        assert charge.keys == [caught.idempotency_key, caught.idempotency_key]
        assert len(caught.idempotency_key) == 32
        [effect] = journal.effects(run_id)
        assert (effect.status, effect.result, effect.idempotency_key) == (
            EffectStatus.DONE,
            {"charged": 5},
            caught.idempotency_key,
        )

    def test_the_recorded_key_is_the_one_sent_again(self, journal):
        charge = Calls()
        spec = machine(phase("paying"))

        def paying(ctx):
            ctx.effect("charge", charge, 5, kind=MUTATE, idempotent=True)
            return NEXT

        e = engine(spec, journal, paying=paying)
        run_id = e.start()
        run = journal.load(run_id)
        record = in_flight(run, "charge", args=[5], key="order-17", idempotent=True)
        journal.put_effect(record, run_seq=run.seq)
        e.resume(run_id)
        assert charge.keys == ["order-17"]

    def test_recorded_as_idempotent_is_enough(self, journal):
        charge = Calls()
        spec = machine(phase("paying"))

        def paying(ctx):
            ctx.effect("charge", charge, 5, kind=MUTATE)  # not declared idempotent this time
            return NEXT

        e = engine(spec, journal, paying=paying)
        run_id = e.start()
        run = journal.load(run_id)
        journal.put_effect(
            in_flight(run, "charge", args=[5], key="k", idempotent=True), run_seq=run.seq
        )
        assert e.resume(run_id).state == "done"
        assert charge.keys == ["k"]

    def test_the_key_is_passed_only_to_functions_that_take_it(self, journal):
        got = {}

        def plain(x):
            got["plain"] = x
            return x

        def keyword(x, **options):
            got["keyword"] = options
            return x

        def reading(ctx):
            ctx.effect("plain", plain, 1)
            ctx.effect("keyword", keyword, 2, idempotency_key="given")
            return NEXT

        e = engine(machine(phase("reading")), journal, reading=reading)
        run = e.run(e.start())
        assert run.state == "done"
        assert got == {"plain": 1, "keyword": {"idempotency_key": "given"}}
        assert [x.idempotency_key for x in journal.effects(run.run_id)][1] == "given"


class TestNames:
    """An effect's name identifies one effect of the visit."""

    def test_a_name_used_twice_in_one_visit(self, journal):
        calls = Calls()
        errors = []

        def reading(ctx):
            ctx.effect("fetch", calls, 1)
            try:
                ctx.effect("fetch", calls, 2, kind=PEEK)
            except EffectMismatchError as exc:
                errors.append(exc)
                raise
            return NEXT

        e = engine(machine(phase("reading")), journal, reading=reading)
        run = e.run(e.start())
        [error] = errors
        assert (error.state, error.effect) == ("reading", "fetch")
        assert "used twice" in str(error)
        assert calls.count == 1
        assert (run.state, run.error["type"]) == ("failed", "EffectMismatchError")
        [effect] = journal.effects(run.run_id)
        assert effect.params == {"args": [1], "kwargs": {}}

    @pytest.mark.parametrize(
        ("args", "kind"), [((6,), MUTATE), ((5,), READ)], ids=["other-params", "other-kind"]
    )
    def test_a_replay_with_other_params_or_kind(self, journal, args, kind):
        calls = Calls()
        spec = machine(phase("paying"))
        replay = [False]

        def paying(ctx):
            if replay[0]:
                ctx.effect("charge", calls, *args, kind=kind)
                return NEXT
            ctx.effect("charge", calls, 5, kind=MUTATE)
            raise SystemExit("killed")

        first = engine(spec, journal, paying=paying)
        run_id = first.start()
        with pytest.raises(SystemExit):
            first.run(run_id)

        replay[0] = True
        run = engine(spec, journal, paying=paying).resume(run_id)
        assert calls.count == 1
        assert (run.state, run.error["type"]) == ("failed", "EffectMismatchError")
        assert "another kind or other parameters" in run.error["message"]
        [effect] = journal.effects(run_id)
        assert (effect.status, effect.params["args"]) == (EffectStatus.DONE, [5])


class TestVisits:
    """Effects belong to a visit: retries continue it, a new visit starts afresh."""

    def test_derived_keys_are_distinct(self, journal):
        def reading(ctx):
            ctx.effect("a", lambda x: x, 1)
            ctx.effect("b", lambda x: x, 1)
            ctx.effect("c", lambda x: x, 2)
            return NEXT

        e = engine(machine(phase("reading")), journal, reading=reading)
        first, second = e.run(e.start()), e.run(e.start())
        keys = [x.idempotency_key for r in (first, second) for x in journal.effects(r.run_id)]
        assert len(set(keys)) == 6
        assert all(len(k) == 32 and set(k) <= set(string.hexdigits) for k in keys)

    def test_a_retried_attempt_continues_the_visit(self, journal):
        first_effect, second_effect = Calls("a"), Calls("b")
        seen = []

        def working(ctx):
            seen.append((ctx.attempt, ctx.effect("first", first_effect, kind=MUTATE)))
            if ctx.attempt == 1:
                raise TimeoutError("transient")
            seen.append((ctx.attempt, ctx.effect("second", second_effect)))
            return NEXT

        spec = machine(phase("working", retry=NO_RETRY_WAIT, max_mutations=1))
        e = engine(spec, journal, working=working)
        run = e.run(e.start())

        assert run.state == "done"
        assert seen == [(1, "a"), (2, "a"), (2, "b")]
        assert (first_effect.count, second_effect.count) == (1, 1)
        effects = journal.effects(run.run_id)
        assert [(x.name, x.visit_seq, x.status) for x in effects] == [
            ("first", 0, EffectStatus.DONE),
            ("second", 0, EffectStatus.DONE),
        ]
        assert first_effect.keys == [effects[0].idempotency_key]

    def test_a_replayed_mutation_still_counts_against_the_limit(self, journal):
        calls = Calls()
        errors = []

        def working(ctx):
            ctx.effect("one", calls, kind=MUTATE)
            if ctx.attempt == 1:
                raise TimeoutError("transient")
            try:
                ctx.effect("two", calls, kind=MUTATE)
            except CapabilityError as exc:
                errors.append(exc)
            return NEXT

        spec = machine(phase("working", retry=NO_RETRY_WAIT, max_mutations=1))
        e = engine(spec, journal, working=working)
        run = e.run(e.start())
        assert run.state == "done"
        assert calls.count == 1
        assert [x.operation for x in errors] == [MUTATE]

    def test_a_new_visit_of_the_same_state_gets_fresh_effects(self, journal):
        tick = Calls("tick")

        def working(ctx):
            ctx.effect("tick", tick, kind=MUTATE)
            return NEXT

        def checking(ctx):
            loops = ctx.context.get("loops", 0)
            if loops < 1:
                return PhaseResult("AGAIN", context={"loops": loops + 1})
            return NEXT

        spec = MachineSpec(
            "looping",
            [*machine(phase("working"), phase("checking")).states],
            [
                *machine(phase("working"), phase("checking")).transitions,
                Transition("checking", "AGAIN", "working"),
            ],
        )
        e = engine(spec, journal, working=working, checking=checking)
        run = e.run(e.start())

        assert run.state == "done"
        assert tick.count == 2
        effects = journal.effects(run.run_id)
        assert [(x.name, x.visit_seq) for x in effects] == [("tick", 0), ("tick", 2)]
        assert effects[0].idempotency_key != effects[1].idempotency_key
        assert tick.keys == [x.idempotency_key for x in effects]

    def test_a_self_transition_on_a_host_event_is_a_new_visit(self, journal):
        poll = Calls()

        def waiting(ctx):
            ctx.effect("poll", poll)
            return "NOT_READY" if len(poll.args) < 2 and ctx.run.seq < 5 else NEXT

        base = machine(phase("waiting"))
        spec = attrs.evolve(
            base, transitions=[*base.transitions, Transition("waiting", "NOT_READY", "waiting")]
        )
        e = engine(spec, journal, waiting=waiting)
        run = e.run(e.start())
        assert run.state == "done"
        assert poll.count == 2


class TestPayloads:
    """Parameters and results are JSON; anything else is refused."""

    def test_non_json_params_record_nothing(self, journal):
        calls = Calls()
        errors = []

        def reading(ctx):
            try:
                ctx.effect("fetch", calls, {1, 2})
            except PayloadError as exc:
                errors.append(exc)
                raise
            return NEXT

        e = engine(machine(phase("reading")), journal, reading=reading)
        run = e.run(e.start())
        [error] = errors
        assert "'fetch'" in error.what
        assert calls.count == 0
        assert journal.effects(run.run_id) == []
        assert run.error["type"] == "PayloadError"

    def test_a_non_json_result_is_refused(self, journal):
        calls = Calls(object())

        def reading(ctx):
            ctx.effect("fetch", calls)
            return NEXT

        e = engine(machine(phase("reading")), journal, reading=reading)
        run = e.run(e.start())
        assert calls.count == 1
        assert run.error["type"] == "PayloadError"
        [effect] = journal.effects(run.run_id)
        assert effect.status is not EffectStatus.DONE


class TestCapabilities:
    """A state performs only the kinds it allows, at most max_mutations mutations a visit."""

    @pytest.mark.parametrize("kind", [MUTATE, PUBLISH, "send_email"])
    def test_a_kind_the_state_does_not_allow(self, journal, kind):
        calls = Calls()
        errors = []

        def reading(ctx):
            try:
                ctx.effect("probe", calls, kind=kind)
            except CapabilityError as exc:
                errors.append(exc)
                raise
            return NEXT

        spec = machine(phase("reading", allows=[READ, PEEK]))
        e = engine(spec, journal, reading=reading)
        run = e.run(e.start())
        [error] = errors
        assert (error.state, error.operation) == ("reading", kind)
        assert str(error).startswith(f"operation {kind!r} is not allowed in state 'reading'")
        assert "it allows read, topic_peek" in str(error)
        assert calls.count == 0
        assert journal.effects(run.run_id) == []
        assert (run.state, run.error["type"]) == ("failed", "CapabilityError")

    def test_allows_nothing_or_everything(self, journal):
        calls = Calls()

        def sealed(ctx):
            with pytest.raises(CapabilityError, match="it allows nothing"):
                ctx.effect("probe", calls, kind=READ)
            return NEXT

        def free(ctx):
            for kind in (READ, MUTATE, PEEK, PUBLISH, "send_email"):
                ctx.effect(kind, calls, kind=kind)
            return NEXT

        spec = machine(phase("sealed", allows=[]), phase("free"))
        e = engine(spec, journal, sealed=sealed, free=free)
        run = e.run(e.start())
        assert run.state == "done"
        assert calls.count == 5
        assert [x.state for x in journal.effects(run.run_id)] == ["free"] * 5

    def test_a_host_defined_kind(self, journal):
        def notifying(ctx):
            ctx.effect("mail", lambda to: f"sent to {to}", "ops", kind="send_email")
            return NEXT

        spec = machine(phase("notifying", allows=["send_email"]))
        e = engine(spec, journal, notifying=notifying)
        run = e.run(e.start())
        assert run.state == "done"
        [effect] = journal.effects(run.run_id)
        assert (effect.kind, effect.result) == ("send_email", "sent to ops")

    def test_a_second_mutation(self, journal):
        calls = Calls()
        errors = []

        def applying(ctx):
            ctx.effect("read", calls)  # reads are not limited
            ctx.effect("one", calls, kind=MUTATE)
            try:
                ctx.effect("two", calls, kind=MUTATE)
            except CapabilityError as exc:
                errors.append(exc)
                raise
            return NEXT

        spec = machine(phase("applying", allows=[READ, MUTATE], max_mutations=1))
        e = engine(spec, journal, applying=applying)
        run = e.run(e.start())
        [error] = errors
        assert (error.state, error.operation) == ("applying", MUTATE)
        assert "more than 1 time(s) per visit" in str(error)
        assert calls.count == 2
        assert [x.name for x in journal.effects(run.run_id)] == ["read", "one"]
        assert run.error["type"] == "CapabilityError"

    def test_no_mutation_limit(self, journal):
        calls = Calls()

        def applying(ctx):
            for n in range(3):
                ctx.effect(f"m{n}", calls, kind=MUTATE)
            return NEXT

        e = engine(machine(phase("applying", allows=[MUTATE])), journal, applying=applying)
        assert e.run(e.start()).state == "done"
        assert calls.count == 3

    class _ObjectHandler:
        """A handler object (the engine's general path, not the inlined fast one)."""

        def __init__(self, kept):
            self.kept = kept

        def run(self, ctx):
            self.kept.append(ctx)
            return NEXT

    @pytest.mark.parametrize("shape", ["function", "object"])
    def test_an_effect_after_the_handler_returned(self, journal, shape):
        kept: list[PhaseContext] = []
        calls = Calls()

        def keeping(ctx):
            kept.append(ctx)
            return NEXT

        handler = keeping if shape == "function" else self._ObjectHandler(kept)
        e = engine(machine(phase("keeping")), journal, keeping=handler)
        run = e.run(e.start())
        [ctx] = kept
        assert ctx.closed
        with pytest.raises(CapabilityError, match="outside any phase handler") as caught:
            ctx.effect("late", calls)
        assert (caught.value.state, caught.value.operation) == (None, READ)
        assert calls.count == 0
        assert journal.effects(run.run_id) == []

    def test_an_effect_after_the_handler_raised_systemexit(self, journal):
        """BUG: the fast path (_step_fast) closes the context only on Exception and
        KeyboardInterrupt; after SystemExit the context stays open (and in Engine._active),
        so an effect through it is still recorded while no handler runs."""
        kept: list[PhaseContext] = []
        calls = Calls()

        def keeping(ctx):
            kept.append(ctx)
            raise SystemExit("stop")

        e = engine(machine(phase("keeping")), journal, keeping=keeping)
        run_id = e.start()
        with pytest.raises(SystemExit):
            e.run(run_id)
        [ctx] = kept
        with pytest.raises(CapabilityError):
            ctx.effect("late", calls)
        assert calls.count == 0
        assert journal.effects(run_id) == []

    def test_a_callable_that_is_not_hashable(self, journal):
        """BUG: effects._takes_key is functools.lru_cache'd on fn, so an unhashable callable
        (an instance of an eq=True attrs class or dataclass with __call__) raises TypeError —
        after the in_flight record was committed, leaving it in flight without a call."""

        @attrs.define
        class Fetch:
            calls: int = 0

            def __call__(self, x):
                self.calls += 1
                return x

        fetch = Fetch()

        def reading(ctx):
            ctx.effect("fetch", fetch, 1)
            return NEXT

        e = engine(machine(phase("reading")), journal, reading=reading)
        run = e.run(e.start())
        assert run.state == "done", run.error
        assert fetch.calls == 1
        [effect] = journal.effects(run.run_id)
        assert effect.status is EffectStatus.DONE

    def test_allows_on_a_composite_binds_its_children(self, journal):
        """BUG (spec): ``allows``/``max_mutations`` on a composite state are accepted by
        validate() but never applied to its children, which then allow every kind."""
        calls = Calls()
        try:
            spec = MachineSpec(
                "composite",
                [
                    State("outer", allows=[READ], max_mutations=0, children=[phase("inner")]),
                    State("done", terminal=True),
                    State("failed", terminal=True, outcome="failed"),
                ],
                [
                    Transition("outer", RunEvent.PHASE_COMPLETED, "done"),
                    Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
                ],
            )
            spec.validate()
        except SpecError:
            return  # refusing it is a fine answer too

        def inner(ctx):
            ctx.effect("mutation", calls, kind=MUTATE)
            return RunEvent.PHASE_COMPLETED

        e = engine(spec, journal, inner=inner)
        run = e.run(e.start())
        assert calls.count == 0
        assert run.error is not None
        assert run.error["type"] == "CapabilityError"

    def test_effects_work_in_async_handlers(self, journal):
        calls = Calls("ok")

        async def reading(ctx):
            return NEXT if ctx.effect("fetch", calls) == "ok" else "NOPE"

        e = engine(machine(phase("reading")), journal, reading=reading)
        try:
            assert e.run(e.start()).state == "done"
        finally:
            e.close()
        assert calls.count == 1


class TestJournalQueries:
    """The journal finds runs with an effect in flight."""

    def test_runs_with_an_effect_in_flight(self, journal):
        def failing():
            raise OSError("down")

        def working(ctx):
            if ctx.input == "fail":
                ctx.effect("x", failing, kind=MUTATE)
            ctx.effect("x", lambda: 1, kind=MUTATE)
            return NEXT

        spec = machine(phase("working"))
        e = engine(spec, journal, working=working)
        done, failed, stuck, waiting = (e.start(x) for x in ("ok", "fail", "stuck", "waiting"))
        e.run(done)
        e.run(failed)
        run = journal.load(stuck)
        journal.put_effect(in_flight(run, "x", key="k"), run_seq=run.seq)

        assert [r.run_id for r in journal.runs(effect_in_flight=True)] == [stuck]
        assert [r.run_id for r in journal.runs(effect_in_flight=True, machine="other")] == []
        assert {r.run_id for r in journal.runs()} == {done, failed, stuck, waiting}
        assert [x.status for x in journal.effects(failed)] == [EffectStatus.FAILED]


class TestReadingEarlierPhases:
    """A phase reads earlier phases' outputs and the previous state from the journal."""

    def test_output_of_and_previous_state(self, journal):
        seen = {}

        def producing(ctx):
            seen["producing"] = (ctx.previous_state, ctx.output_of("preparing"))
            return PhaseResult(NEXT, output={"item": 41})

        def preparing(ctx):
            produced = ctx.output_of("producing")
            seen["preparing"] = (ctx.previous_state, produced)
            return PhaseResult(NEXT, output={"plan": produced["item"] + 1})

        def mutating(ctx):
            seen["mutating"] = (
                ctx.previous_state,
                ctx.output_of("preparing"),
                ctx.output_of("producing"),
                ctx.output_of("nowhere"),
            )
            return NEXT

        spec = machine(phase("producing"), phase("preparing"), phase("mutating"))
        handlers = {"producing": producing, "preparing": preparing, "mutating": mutating}
        run_id = engine(spec, journal, **handlers).start()
        for _ in range(3):  # a fresh engine each step: nothing but the journal carries over
            engine(spec, journal, **handlers).step(run_id)
        assert journal.load(run_id).state == "done"
        assert seen == {
            "producing": (None, None),
            "preparing": ("producing", {"item": 41}),
            "mutating": ("preparing", {"plan": 42}, {"item": 41}, None),
        }

    def test_output_of_reads_the_latest_visit(self, journal):
        outputs = []

        def working(ctx):
            return PhaseResult(NEXT, output={"visit": ctx.run.visit_seq})

        def checking(ctx):
            outputs.append(ctx.output_of("working"))
            if len(outputs) < 2:
                return "AGAIN"
            return NEXT

        base = machine(phase("working"), phase("checking"))
        spec = attrs.evolve(
            base, transitions=[*base.transitions, Transition("checking", "AGAIN", "working")]
        )
        e = engine(spec, journal, working=working, checking=checking)
        assert e.run(e.start()).state == "done"
        assert outputs == [{"visit": 0}, {"visit": 2}]

    def test_previous_state_is_stable_across_attempts(self, journal):
        """BUG: previous_state reads the from_state of the run's *last* transition, so after a
        RETRIED (or INTERRUPTED) self transition it names the state itself, not the state the
        visit came from; it should read the transition at run.visit_seq."""
        seen = []

        def preparing(ctx):
            return NEXT

        def mutating(ctx):
            seen.append((ctx.attempt, ctx.previous_state))
            if ctx.attempt == 1:
                raise TimeoutError("transient")
            return NEXT

        spec = machine(phase("preparing"), phase("mutating", retry=NO_RETRY_WAIT))
        e = engine(spec, journal, preparing=preparing, mutating=mutating)
        assert e.run(e.start()).state == "done"
        assert seen == [(1, "preparing"), (2, "preparing")]
