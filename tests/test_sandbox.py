"""The sandbox preset: the capability matrix cell by cell, values through the journal, and
real SIGKILLs around a real side effect (a hit on the counter server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsm_runner import PhaseContext, RunEvent, RunLifecycle, SpecError, SqliteJournal
from fsm_runner.effects import MUTATE, PEEK, PUBLISH, READ
from fsm_runner.exceptions import CapabilityError
from fsm_runner.presets.sandbox import (
    CAPABILITIES,
    MUTATION_APPLIED,
    MUTATION_PREPARED,
    OUTPUT_PRODUCED,
    PHASE_STATES,
    RESULT_PUBLISHED,
    SANDBOX,
    ExternalStore,
    MemoryStore,
    MemoryTopic,
    MutatePhase,
    Topic,
    sandbox_engine,
)
from fsm_runner.records import EffectStatus
from tests.servers.counter_server import CounterClient, CounterServer, CounterServerError

ROOT = Path(__file__).parents[1]
APP = [sys.executable, "-m", "tests.apps.effects_app"]
PHASES = ("producer", "prepare", "mutate", "next")
KINDS = (PEEK, PUBLISH, READ, MUTATE)
DONE_EVENTS = {
    "producer": OUTPUT_PRODUCED,
    "prepare": MUTATION_PREPARED,
    "mutate": MUTATION_APPLIED,
    "next": RESULT_PUBLISHED,
}

#: The matrix of the issue, written out independently of the preset's CAPABILITIES.
ALLOWED = {
    ("producer", PEEK): False,
    ("producer", PUBLISH): True,
    ("producer", READ): True,
    ("producer", MUTATE): False,
    ("prepare", PEEK): True,
    ("prepare", PUBLISH): False,
    ("prepare", READ): True,
    ("prepare", MUTATE): False,
    ("mutate", PEEK): False,
    ("mutate", PUBLISH): False,
    ("mutate", READ): False,
    ("mutate", MUTATE): True,
    ("next", PEEK): False,
    ("next", PUBLISH): True,
    ("next", READ): False,
    ("next", MUTATE): False,
}


def passing(phase: str):
    """A handler that does nothing and reports its phase done."""

    def handler(ctx: PhaseContext) -> str:
        return DONE_EVENTS[phase]

    return handler


def only(phase: str, handler) -> dict:
    """Handlers for every phase: ``handler`` for ``phase``, pass-throughs elsewhere."""
    return {p: handler if p == phase else passing(p) for p in PHASES}


class TestTheMachine:
    """SANDBOX declares the matrix on its states; the engine factory checks its overrides."""

    def test_states_carry_the_matrix(self):
        for phase, state_name in PHASE_STATES.items():
            state = SANDBOX.state(state_name)
            assert state.handler == phase
            assert set(state.allows) == {k for k in KINDS if ALLOWED[phase, k]}
            assert state.max_mutations == (1 if phase == "mutate" else 0)
        assert set(CAPABILITIES) == set(PHASES)
        SANDBOX.validate()

    def test_the_services_are_the_protocols(self):
        assert isinstance(MemoryTopic(), Topic)
        assert isinstance(MemoryStore(), ExternalStore)
        assert isinstance(CounterClient("http://127.0.0.1:1"), ExternalStore)

    def test_unknown_phase_override_is_refused(self, journal):
        with pytest.raises(SpecError, match="no phase 'mutating'"):
            sandbox_engine(
                journal=journal,
                topic=MemoryTopic(),
                store=MemoryStore(),
                handlers={"mutating": passing("mutate")},
            )

    def test_memory_store_honours_idempotency_keys(self):
        store = MemoryStore({"item": 0})
        first = store.mutate("item", 5, idempotency_key="k")
        again = store.mutate("item", 7, idempotency_key="k")
        assert first == {"key": "item", "value": 5, "version": 1, "replayed": False}
        assert again == {**first, "replayed": True}
        assert store.read("item") == 5
        store.mutate("item", 7)
        assert store.read("item") == 7
        assert [m["replayed"] for m in store.mutations] == [False, True, False]


@pytest.mark.parametrize(
    ("phase", "kind"),
    [
        pytest.param(p, k, id=f"{p}-{k}-{'allowed' if ALLOWED[p, k] else 'forbidden'}")
        for p in PHASES
        for k in KINDS
    ],
)
def test_capability_matrix_cell(journal, phase, kind):
    """Every (phase, kind) cell: allowed works and is recorded done; forbidden raises and
    records nothing, and the service is never called."""
    topic, store = MemoryTopic(), MemoryStore({"item": "old"})
    operations = {
        PEEK: lambda: topic.peek("sandbox"),
        PUBLISH: lambda: topic.publish("sandbox", {"probe": phase}),
        READ: lambda: store.read("item"),
        MUTATE: lambda: store.mutate("item", "new"),
    }
    called: list[str] = []
    refused: list[CapabilityError] = []

    def operation():
        called.append(kind)
        return operations[kind]()

    def probe(ctx: PhaseContext) -> str:
        try:
            ctx.effect("probe", operation, kind=kind)
        except CapabilityError as exc:
            refused.append(exc)
            raise
        return DONE_EVENTS[phase]

    engine = sandbox_engine(journal=journal, topic=topic, store=store, handlers=only(phase, probe))
    run = engine.run(engine.start({"key": "item", "change": "new"}))
    effects = journal.effects(run.run_id)
    state = PHASE_STATES[phase]

    if ALLOWED[phase, kind]:
        assert (run.state, refused, called) == ("succeeded", [], [kind])
        [effect] = effects
        assert (effect.name, effect.state, effect.kind, effect.status) == (
            "probe",
            state,
            kind,
            EffectStatus.DONE,
        )
        expected_result = {
            PEEK: [],
            PUBLISH: 0,
            READ: "old",
            MUTATE: {"key": "item", "value": "new", "version": 1, "replayed": False},
        }[kind]
        assert effect.result == expected_result
    else:
        [error] = refused
        assert (error.state, error.operation) == (state, kind)
        assert f"operation {kind!r}" in str(error)
        assert f"state {state!r}" in str(error)
        assert called == []
        assert effects == []
        assert (topic.messages("sandbox"), store.mutations, store.read("item")) == ([], [], "old")
        assert (run.state, run.status, run.error["type"]) == (
            "failed",
            RunLifecycle.FAILED,
            "CapabilityError",
        )
        last = journal.transitions(run.run_id)[-1]
        assert (last.from_state, last.event) == (state, RunEvent.SYSTEM_ERROR.value)


class TestMutationLimit:
    """The mutate phase may mutate once per visit; a second mutation is refused."""

    def test_second_mutation_raises_and_is_not_recorded(self, journal):
        store = MemoryStore({"item": 0})
        refused: list[CapabilityError] = []

        class TwiceMutatePhase(MutatePhase):
            def run(self, ctx):
                result = super().run(ctx)
                try:
                    ctx.effect("apply_again", store.mutate, "item", 2, kind=MUTATE)
                except CapabilityError as exc:
                    refused.append(exc)
                    raise
                return result

        engine = sandbox_engine(
            journal=journal,
            topic=MemoryTopic(),
            store=store,
            handlers={"mutate": TwiceMutatePhase()},
        )
        run = engine.run(engine.start({"key": "item", "change": 1}))

        [error] = refused
        assert (error.state, error.operation) == ("mutating", MUTATE)
        assert "more than 1" in str(error)
        assert [m["change"] for m in store.mutations] == [1]
        mutations = [e for e in journal.effects(run.run_id) if e.kind == MUTATE]
        assert [(e.name, e.status) for e in mutations] == [("apply_change", EffectStatus.DONE)]
        assert (run.state, run.error["type"]) == ("failed", "CapabilityError")

    def test_a_refused_second_mutation_can_be_handled(self, journal):
        store = MemoryStore()

        def mutate(ctx):
            ctx.effect("one", store.mutate, "a", 1, kind=MUTATE)
            with pytest.raises(CapabilityError):
                ctx.effect("two", store.mutate, "b", 2, kind=MUTATE)
            return MUTATION_APPLIED

        engine = sandbox_engine(
            journal=journal, topic=MemoryTopic(), store=store, handlers=only("mutate", mutate)
        )
        run = engine.run(engine.start({"key": "a"}))
        assert run.state == "succeeded"
        assert [e.name for e in journal.effects(run.run_id)] == ["one"]
        assert (store.read("a"), store.read("b")) == (1, None)


class TestOutsideAnyHandler:
    """An effect outside a running phase handler is refused, whatever the state allows."""

    def test_after_the_run_ended(self, journal):
        kept: list[PhaseContext] = []
        store = MemoryStore({"item": 1})
        calls: list[str] = []

        def producer(ctx):
            kept.append(ctx)
            return OUTPUT_PRODUCED

        engine = sandbox_engine(
            journal=journal, topic=MemoryTopic(), store=store, handlers=only("producer", producer)
        )
        run = engine.run(engine.start({"key": "item"}))
        assert run.state == "succeeded"

        with pytest.raises(CapabilityError, match="outside any phase handler") as caught:
            kept[0].effect("late", lambda: calls.append("late"), kind=READ)
        assert (caught.value.state, caught.value.operation) == (None, READ)
        assert calls == []
        assert journal.effects(run.run_id) == []

    def test_an_earlier_phases_context_inside_a_later_phase(self, journal):
        """A stale context cannot borrow the capabilities of the phase now running."""
        kept: list[PhaseContext] = []
        store = MemoryStore({"item": 1})
        refused: list[CapabilityError] = []

        def producer(ctx):
            kept.append(ctx)
            return OUTPUT_PRODUCED

        def prepare(ctx):
            try:
                kept[0].effect("sneaky", store.read, "item", kind=READ)  # prepare allows READ
            except CapabilityError as exc:
                refused.append(exc)
            return MUTATION_PREPARED

        handlers = {**only("producer", producer), "prepare": prepare}
        engine = sandbox_engine(
            journal=journal, topic=MemoryTopic(), store=store, handlers=handlers
        )
        run = engine.run(engine.start({"key": "item"}))
        assert run.state == "succeeded"
        [error] = refused
        assert (error.state, error.operation) == (None, READ)
        assert journal.effects(run.run_id) == []

    def test_a_context_the_engine_did_not_give(self, journal):
        engine = sandbox_engine(journal=journal, topic=MemoryTopic(), store=MemoryStore())
        run_id = engine.start({"key": "item"})
        ctx = PhaseContext(journal.load(run_id), {}, time.monotonic)
        with pytest.raises(CapabilityError, match="outside any phase handler"):
            ctx.effect("mutation", lambda: None, kind=MUTATE)
        assert journal.effects(run_id) == []


def test_values_pass_between_phases_only_through_the_journal(journal):
    """Each step runs in a new engine with new handlers; what a phase needs of an earlier one
    it reads from the journal (ctx.output_of)."""
    topic, store = MemoryTopic(), MemoryStore({"greeting": "hi"})
    first = sandbox_engine(journal=journal, topic=topic, store=store)
    run_id = first.start({"key": "greeting", "change": "hello", "topic": "news"})
    run = journal.load(run_id)
    while not run.ended:
        engine = sandbox_engine(journal=journal, topic=topic, store=store)  # nothing carried over
        engine.step(run_id)
        run = journal.load(run_id)
    assert (run.state, run.status) == ("succeeded", RunLifecycle.SUCCEEDED)

    transitions = journal.transitions(run_id)
    assert [(t.from_state, t.event) for t in transitions[1:]] == [
        ("producing", OUTPUT_PRODUCED),
        ("preparing", MUTATION_PREPARED),
        ("mutating", MUTATION_APPLIED),
        ("publishing", RESULT_PUBLISHED),
    ]
    produced, plan, mutation, published = (t.output for t in transitions[1:])
    assert produced == {"key": "greeting", "change": "hello", "current": "hi", "announced_at": 0}
    # prepare built its plan from the producer's output ...
    assert plan == {
        "key": "greeting",
        "change": "hello",
        "before": "hi",
        "changed_since_produced": False,
        "queued": 1,
    }
    # ... mutate carried out the plan ...
    answer = {"key": "greeting", "value": "hello", "version": 1, "replayed": False}
    assert mutation == {"key": "greeting", "result": answer}
    assert store.read("greeting") == "hello"
    # ... and next published the mutation's result.
    assert published == {"key": "greeting", "result": answer, "published_at": 1}
    assert topic.messages("news") == [
        {"event": "proposed", "run_id": run_id, "key": "greeting", "change": "hello"},
        {"event": "mutated", "run_id": run_id, "key": "greeting", "result": answer},
    ]
    effects = journal.effects(run_id)
    assert [(e.state, e.name, e.kind, e.status) for e in effects] == [
        ("producing", "read_current", READ, EffectStatus.DONE),
        ("producing", "announce", PUBLISH, EffectStatus.DONE),
        ("preparing", "peek_topic", PEEK, EffectStatus.DONE),
        ("preparing", "read_before", READ, EffectStatus.DONE),
        ("mutating", "apply_change", MUTATE, EffectStatus.DONE),
        ("publishing", "publish_result", PUBLISH, EffectStatus.DONE),
    ]
    [applied] = [e for e in effects if e.kind == MUTATE]
    assert store.mutations == [
        {
            "key": "greeting",
            "change": "hello",
            "idempotency_key": applied.idempotency_key,
            "replayed": False,
        }
    ]


def test_a_run_without_a_key_fails_in_its_first_phase(journal):
    engine = sandbox_engine(journal=journal, topic=MemoryTopic(), store=MemoryStore())
    run = engine.run(engine.start({"change": 1}))
    assert (run.state, run.error["type"]) == ("failed", "ValueError")
    assert journal.effects(run.run_id) == []


# -- real processes: SIGKILL around a hit on the counter server ---------------------------------

needs_sigkill = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")


def app_env(journal: Path, server: CounterServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSM_TEST_")}
    env["FSM_TEST_JOURNAL"] = str(journal)
    env["FSM_TEST_COUNTER_URL"] = server.base_url
    env.update(extra)
    return env


def run_app(*args: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [*APP, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def start_and_kill(env: dict[str, str], marker: Path) -> str:
    """Start a run in a subprocess, SIGKILL it once ``marker`` exists; return its run id."""
    proc = subprocess.Popen(
        [*APP, "start", "item"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"the app exited ({proc.returncode}) too early: {proc.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{marker.name} never appeared")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    return stdout.split()[0]


def journaled(path: Path, run_id: str):
    with SqliteJournal(path) as journal:
        run = journal.load(run_id)
        [mutation] = [e for e in journal.effects(run_id) if e.kind == MUTATE]
        in_flight = [r.run_id for r in journal.runs(effect_in_flight=True)]
        return run, mutation, list(journal.transitions(run_id)), in_flight


@pytest.mark.slow
@needs_sigkill
class TestSigkill:
    """A real process killed by SIGKILL around a real side effect, resumed in a new process."""

    def test_killed_after_the_mutation_before_the_transition(self, tmp_path):
        """The mutation is recorded done: resuming does not repeat it (the counter stays)."""
        journal, marker = tmp_path / "j.db", tmp_path / "mutated"
        with CounterServer(state=tmp_path / "counter.json") as server:
            client = server.client()
            env = app_env(journal, server)
            run_id = start_and_kill({**env, "FSM_TEST_BLOCK_AFTER_MUTATION": str(marker)}, marker)

            run, mutation, transitions, in_flight = journaled(journal, run_id)
            assert (run.state, run.status) == ("mutating", RunLifecycle.ACTIVE)
            assert mutation.status is EffectStatus.DONE
            assert mutation.result["count"] == 1
            assert in_flight == []
            assert client.count("item") == 1

            assert run_app("resume", run_id, env=env) == [run_id, "succeeded", "-"]

            assert client.count("item") == 1  # not repeated
            assert client.hits() == [
                {
                    "key": "item",
                    "by": 1,
                    "idempotency_key": mutation.idempotency_key,
                    "replayed": False,
                }
            ]
            run, after, transitions, _ = journaled(journal, run_id)
            assert (run.state, run.status) == ("succeeded", RunLifecycle.SUCCEEDED)
            assert after == mutation
            assert [t.seq for t in transitions] == list(range(len(transitions)))
            assert transitions[-1].output["result"] == mutation.result

    def test_killed_during_a_non_idempotent_mutation(self, tmp_path):
        """Caught in flight: the outcome is unknown, so the resumed run fails and says so."""
        journal, marker = tmp_path / "j.db", tmp_path / "stalled"
        with CounterServer(state=tmp_path / "counter.json", stall_after_hit=marker) as server:
            client = server.client()
            env = app_env(journal, server)
            run_id = start_and_kill(env, marker)  # the server counted the hit, then stalled

            run, mutation, _, in_flight = journaled(journal, run_id)
            assert (run.state, run.status) == ("mutating", RunLifecycle.ACTIVE)
            assert (mutation.status, mutation.idempotent) == (EffectStatus.IN_FLIGHT, False)
            assert in_flight == [run_id]
            assert client.count("item") == 1

            assert run_app("resume", run_id, env=env) == [
                run_id,
                "failed",
                "EffectOutcomeUnknownError",
            ]

            assert client.count("item") == 1
            assert len(client.hits()) == 1  # never sent again
            run, after, transitions, in_flight = journaled(journal, run_id)
            assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
            last = transitions[-1]
            assert (last.from_state, last.event, last.to_state) == (
                "mutating",
                RunEvent.SYSTEM_ERROR.value,
                "failed",
            )
            assert last.error["type"] == "EffectOutcomeUnknownError"
            assert "'apply_change'" in last.error["message"]
            assert after.status is EffectStatus.IN_FLIGHT  # still there for someone to look at
            assert in_flight == [run_id]

    def test_killed_during_an_idempotent_mutation(self, tmp_path):
        """Caught in flight but idempotent: sent again with the same key; counted once."""
        journal, marker = tmp_path / "j.db", tmp_path / "stalled"
        with CounterServer(state=tmp_path / "counter.json", stall_after_hit=marker) as server:
            client = server.client()
            env = app_env(journal, server, FSM_TEST_IDEMPOTENT="1")
            run_id = start_and_kill(env, marker)

            run, mutation, _, in_flight = journaled(journal, run_id)
            assert (mutation.status, mutation.idempotent) == (EffectStatus.IN_FLIGHT, True)
            assert in_flight == [run_id]

            assert run_app("resume", run_id, env=env) == [run_id, "succeeded", "-"]

            key = mutation.idempotency_key
            assert client.hits() == [
                {"key": "item", "by": 1, "idempotency_key": key, "replayed": False},
                {"key": "item", "by": 1, "idempotency_key": key, "replayed": True},
            ]
            assert client.count("item") == 1  # the server's idempotency kept it at one
            run, after, _transitions, in_flight = journaled(journal, run_id)
            assert (run.state, run.status) == ("succeeded", RunLifecycle.SUCCEEDED)
            assert (after.status, after.idempotency_key) == (EffectStatus.DONE, key)
            assert after.result == {
                "key": "item",
                "count": 1,
                "idempotency_key": key,
                "replayed": True,
            }
            assert in_flight == []


@pytest.mark.slow
class TestCounterServer:
    """The counter server: counts, idempotency keys, state kept across restarts."""

    def test_counts_and_replays(self, tmp_path):
        with CounterServer(state=tmp_path / "counter.json") as server:
            assert server.health()
            client = server.client()
            assert client.hit("a")["count"] == 1
            assert client.hit("a", 2)["count"] == 3
            first = client.hit("a", idempotency_key="k")
            assert first == {"key": "a", "count": 4, "idempotency_key": "k", "replayed": False}
            assert client.hit("a", idempotency_key="k") == {**first, "replayed": True}
            assert client.counts() == {"a": 4}
            port = server.port
            server.start()  # a restart keeps the port and the state
            assert server.port == port
            assert server.health()
            assert client.count("a") == 4
            assert client.hit("a", idempotency_key="k")["replayed"] is True
            assert len(client.hits()) == 5
        assert not server.health()

    def test_unreachable_and_bad_requests(self, tmp_path):
        with CounterServer(state=tmp_path / "counter.json") as server:
            client = server.client()
            with pytest.raises(CounterServerError) as caught:
                client._request("POST", "/hit")
            assert caught.value.status == 400
            with pytest.raises(TypeError):
                client.mutate("a", "one")
        with pytest.raises(CounterServerError) as caught:
            client.count("a")
        assert caught.value.status is None
