"""The engine is a façade over parts that own their state; its settings are theirs, at once.

``engine.journal = other`` (or ``max_payload_bytes``, ``group_commit``, ``worker_id``...) sets
the attribute of the part that reads it, so it applies from the next step or claim, as it did
when the engine was one object.
"""

from __future__ import annotations

import asyncio

import pytest

from fsm_runner import Engine, MemoryJournal, RunLifecycle
from fsm_runner.engine.async_driver import AsyncDriver
from fsm_runner.engine.sync_driver import SyncDriver
from fsm_runner.exceptions import PayloadError
from tests.helpers import NEXT, Counting, linear_spec

SPEC = linear_spec("a", "b", name="parts")


def noop(_ctx):
    return NEXT


async def anoop(_ctx):
    return NEXT


class TestSettingsApplyAtOnce:
    """A setting changed on a live engine applies from its next use."""

    def test_the_journal(self):
        first, second = MemoryJournal(), MemoryJournal()
        engine = Engine(SPEC, handlers={"a": noop, "b": noop}, journal=first)
        engine.journal = second
        run_id = engine.start()
        assert engine.run(run_id).status is RunLifecycle.SUCCEEDED
        assert second.load(run_id).status is RunLifecycle.SUCCEEDED
        assert list(first.runs()) == []
        engine.close()

    def test_the_payload_limit(self):
        engine = Engine(SPEC, handlers={"a": noop, "b": noop}, journal=MemoryJournal())
        engine.max_payload_bytes = 10
        assert engine.max_payload_bytes == 10
        with pytest.raises(PayloadError):
            engine.start("x" * 100)
        engine.close()

    @pytest.mark.parametrize("group_commit", [False, True])
    def test_group_commit(self, group_commit):
        journal = Counting(MemoryJournal())
        engine = Engine(SPEC, handlers={"a": anoop, "b": anoop}, journal=journal)
        engine.group_commit = group_commit
        run_id = engine.start()
        assert asyncio.run(engine.arun(run_id)).status is RunLifecycle.SUCCEEDED
        assert ("commit_many" in journal.calls) is group_commit
        engine.close()

    def test_the_worker_id_and_lease(self):
        journal = MemoryJournal()
        engine = Engine(SPEC, handlers={"a": noop, "b": noop}, journal=journal)
        engine.worker_id, engine.lease_ttl = "me", 600.0
        run_id = engine.start(claim=True)
        stored = journal.load(run_id)
        assert stored.lease_owner == "me"
        assert (stored.lease_expires_at - stored.created_at).total_seconds() == 600.0
        engine.close()


def test_the_drivers_are_siblings_not_one_class():
    assert Engine.__mro__ == (Engine, object)
    assert set(SyncDriver.__mro__) & set(AsyncDriver.__mro__) == {object}
