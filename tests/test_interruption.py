"""Interruption: Ctrl-C (``KeyboardInterrupt``) or SIGTERM inside a phase → ``INTERRUPTED``.

The phase's attempt is journaled as an ``INTERRUPTED`` self transition, the interruption goes on
up to the caller, and the run stays resumable: on resume the phase (only that one, a leaf of a
composite too) runs again as its next attempt. ``interrupt_on_sigterm()`` turns SIGTERM into the
same interruption inside its block, in the main thread only.

Other modules' view of an interruption is tested with them (see tests/README.md): an abort
requested meanwhile (``test_abort.py``), a ``RETURN`` target kept (``test_composites.py``),
replay, diagrams, and the presets' command lines (``test_subphases.py``, ``test_coordinator.py``).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from fsm_runner import Engine, PhaseStatus, RunEvent, interrupt_on_sigterm
from tests.helpers import NEXT, nested_handlers, nested_spec, path_of, two_phase_engine

INTERRUPTED = RunEvent.INTERRUPTED.value


class TestKeyboardInterrupt:
    """Ctrl-C in a phase is journaled as INTERRUPTED; the phase runs again on resume."""

    def test_ctrl_c_journals_interrupted_and_stays_resumable(self, journal):
        calls = []

        def interrupted_once(ctx):
            calls.append(ctx.attempt)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return NEXT

        engine = two_phase_engine(journal, a=interrupted_once)
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.run(run_id)
        run = journal.load(run_id)
        last = journal.transitions(run_id)[-1]
        assert (last.from_state, last.event, last.to_state) == ("a", "INTERRUPTED", "a")
        assert (run.state, run.status.value, run.attempt) == ("a", "active", 2)
        assert engine.resume(run_id).status.value == "succeeded"
        assert calls == [1, 2]  # the interrupted phase ran again, as its next attempt

    def test_keyboard_interrupt_in_a_leaf_reruns_only_that_leaf(self, journal):
        calls = []

        def c(ctx):
            calls.append(("c", ctx.attempt))
            if ctx.attempt == 1:
                raise KeyboardInterrupt
            return PhaseStatus.OK

        engine = Engine(nested_spec(), handlers=nested_handlers(calls, c=c), journal=journal)
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.run(run_id)
        run = journal.load(run_id)
        assert (run.state, run.status.value, run.attempt) == ("c", "active", 2)
        assert path_of(journal, run_id)[-1] == ("c", INTERRUPTED, "c")
        assert engine.resume(run_id).state == "done"
        assert calls == [("prepare", 1), ("a", 1), ("b", 1), ("c", 1), ("c", 2), ("d", 1)]


class TestInterruptOnSigterm:
    """interrupt_on_sigterm(): SIGTERM inside the block interrupts the phase as Ctrl-C does."""

    def test_sigterm_interrupts_inside_the_block_and_the_handler_is_restored(self, journal):
        assert threading.current_thread() is threading.main_thread()
        calls = []

        def c(ctx):
            calls.append(("c", ctx.attempt))
            if ctx.attempt == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return PhaseStatus.OK

        def previous(_signum, _frame):
            raise AssertionError("the previous SIGTERM handler must not run inside the block")

        original = signal.signal(signal.SIGTERM, previous)
        try:
            engine = Engine(nested_spec(), handlers=nested_handlers(calls, c=c), journal=journal)
            run_id = engine.start()
            with pytest.raises(KeyboardInterrupt, match="SIGTERM"), interrupt_on_sigterm():
                engine.run(run_id)
            assert signal.getsignal(signal.SIGTERM) is previous
        finally:
            signal.signal(signal.SIGTERM, original)
        transitions = journal.transitions(run_id)
        assert (transitions[-1].from_state, transitions[-1].event) == ("c", INTERRUPTED)
        assert journal.load(run_id).error["message"] == "interrupted by SIGTERM in 'c'"
        assert engine.resume(run_id).state == "done"
        assert [name for name, _ in calls] == ["prepare", "a", "b", "c", "c", "d"]

    def test_outside_the_main_thread_the_block_changes_nothing(self):
        before = signal.getsignal(signal.SIGTERM)
        seen = []

        def body():
            with interrupt_on_sigterm():
                seen.append(signal.getsignal(signal.SIGTERM))

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        assert seen == [before]
        assert signal.getsignal(signal.SIGTERM) is before
