"""Retries: a state's ``RetryPolicy``, the ``RETRIED`` self transition, ``ctx.attempt``.

A failed attempt of a state with a retry policy is journaled as a ``RETRIED`` self transition and
run again after the policy's backoff, through the engine's injected sleep (sync and async), until
the attempts are spent and the failure takes the spec's ``SYSTEM_ERROR`` exit. The attempt is
journaled (it survives a resume), a success resets it, and a retry is not a new iteration.

Other modules' view of a retry is tested with them (see tests/README.md): replay
(``test_replay.py::TestRetriesAndFailures``), the effects ledger across attempts
(``test_effects.py``), diagrams, and the presets' own retries.
"""

from __future__ import annotations

import asyncio

import pytest

from fsm_runner import Engine, MachineSpec, RetryPolicy, RunEvent, RunLifecycle, State, Transition
from fsm_runner.testing import FakeClock, ScriptedHandler
from tests.helpers import NEXT, events_of

SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
RETRIED = RunEvent.RETRIED.value


def retry_spec(*, max_attempts=3, starts_iteration=False):
    return MachineSpec(
        "retrying",
        [
            State(
                "calling",
                handler="call",
                retry=RetryPolicy(max_attempts=max_attempts, wait_initial=0.1, wait_exp_base=2.0),
                starts_iteration=starts_iteration,
            ),
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("calling", NEXT, "done"),
            Transition("calling", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )


class TestRetryPolicyOnItsOwn:
    """RetryPolicy's backoff and its problems, without an engine."""

    def test_retry_policy_backs_off_exponentially_up_to_the_maximum(self):
        policy = RetryPolicy(wait_initial=0.5, wait_max=3.0, wait_exp_base=2.0)

        assert [policy.wait(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]

    @pytest.mark.parametrize(
        "policy",
        [RetryPolicy(max_attempts=0), RetryPolicy(wait_initial=-1), RetryPolicy(wait_exp_base=0.5)],
    )
    def test_bad_retry_policy_is_a_problem(self, policy):
        assert list(policy.problems())
        assert not list(RetryPolicy().problems())


class TestRetryPolicy:
    """Failed attempts are RETRIED self transitions, with backoff through the injected sleep."""

    def test_retries_then_system_error(self, journal):
        fc = FakeClock()
        attempts = []

        def flaky(ctx):
            attempts.append(ctx.attempt)
            raise ConnectionError(f"attempt {ctx.attempt}")

        engine = Engine(
            retry_spec(max_attempts=3),
            handlers={"call": flaky},
            journal=journal,
            clock=fc,
            sleep=fc.sleep,
            async_sleep=fc.async_sleep,
        )
        run_id = engine.start()
        run = engine.run(run_id)
        assert attempts == [1, 2, 3]
        assert fc.slept == [0.1, 0.2]
        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        transitions = journal.transitions(run_id)
        assert [(t.from_state, t.event, t.to_state, t.attempt) for t in transitions[1:]] == [
            ("calling", RETRIED, "calling", 1),
            ("calling", RETRIED, "calling", 2),
            ("calling", SYSTEM_ERROR, "failed", 3),
        ]
        assert [t.result["error"]["message"] for t in transitions[1:]] == [
            "attempt 1",
            "attempt 2",
            "attempt 3",
        ]

    def test_success_after_retries_resets_attempt(self, journal):
        fc = FakeClock()
        handler = ScriptedHandler(OSError("no"), OSError("no"), NEXT)
        engine = Engine(
            retry_spec(max_attempts=5),
            handlers={"call": handler},
            journal=journal,
            clock=fc,
            sleep=fc.sleep,
        )
        run_id = engine.start()
        run = engine.run(run_id)
        assert [ctx.attempt for ctx in handler.calls] == [1, 2, 3]
        assert events_of(journal, run_id) == ["STARTED", RETRIED, RETRIED, NEXT]
        assert (run.state, run.attempt) == ("done", 1)
        assert fc.slept == [0.1, 0.2]

    def test_attempt_survives_resume(self, journal):
        fc = FakeClock()
        handler = ScriptedHandler(OSError("no"), NEXT)
        engine = Engine(
            retry_spec(), handlers={"call": handler}, journal=journal, clock=fc, sleep=fc.sleep
        )
        run_id = engine.start()
        engine.run(run_id, max_steps=1)
        assert journal.load(run_id).attempt == 2
        fresh = Engine(
            retry_spec(), handlers={"call": handler}, journal=journal, clock=fc, sleep=fc.sleep
        )
        fresh.resume(run_id)
        assert [ctx.attempt for ctx in handler.calls] == [1, 2]

    def test_async_retries_wait_through_async_sleep(self, journal):
        fc = FakeClock()

        def no_sync_sleep(seconds):
            raise AssertionError(f"the sync sleep was used in an async run ({seconds})")

        async def flaky(_ctx):
            await asyncio.sleep(0)
            raise ConnectionError("down")

        engine = Engine(
            retry_spec(max_attempts=3),
            handlers={"call": flaky},
            journal=journal,
            clock=fc,
            sleep=no_sync_sleep,
            async_sleep=fc.async_sleep,
        )
        run_id = engine.start()
        run = asyncio.run(engine.arun(run_id))
        assert fc.slept == [0.1, 0.2]
        assert events_of(journal, run_id) == ["STARTED", RETRIED, RETRIED, SYSTEM_ERROR]
        assert run.state == "failed"

    def test_retry_is_not_a_new_iteration(self, journal):
        # A retried attempt re-runs the same visit; only entering the state starts an iteration.
        fc = FakeClock()
        engine = Engine(
            retry_spec(starts_iteration=True),
            handlers={"call": ScriptedHandler(OSError("no"), NEXT)},
            journal=journal,
            clock=fc,
            sleep=fc.sleep,
        )
        run_id = engine.start()
        assert journal.load(run_id).iteration == 1
        run = engine.run(run_id)
        assert [t.iteration for t in journal.transitions(run_id)] == [1, 1, 1]
        assert run.iteration == 1
