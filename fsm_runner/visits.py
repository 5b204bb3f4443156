"""What a run did in each sub-phase it entered, read off its journaled transitions.

The same numbers for ``fsm-runner show`` and the run inspector: attempts, restarts,
interruptions and the last event of each sub-phase (a leaf state inside a composite one).
Pure: it reads a spec and transition records, and imports neither the CLI nor the inspector.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsm_runner.records import TransitionRecord
    from fsm_runner.spec import MachineSpec

__all__ = ["subphase_visits"]


def subphase_visits(
    spec: MachineSpec, timeline: Sequence[TransitionRecord]
) -> list[dict[str, Any]]:
    """Per sub-phase the run entered: attempts, restarts, interruptions, last event.

    All read off the journaled transitions: an attempt is each entry (a return after a server
    restart included) and each rerun after RETRIED or INTERRUPTED.
    """
    visits: dict[str, dict[str, Any]] = {}
    for leaf in spec.leaves:
        parents = spec.parents(leaf.name)
        if parents:
            visits[leaf.name] = {
                "subphase": leaf.name,
                "parent": parents[0],
                "attempts": 0,
                "restarts": 0,
                "interruptions": 0,
                "last_event": None,
            }
    for t in timeline:
        entered = visits.get(t.to_state)
        if entered is not None and t.from_state != t.to_state:
            entered["attempts"] += 1
            if t.event == "SERVER_RECOVERED":
                entered["restarts"] += 1
        left = visits.get(t.from_state or "")
        if left is not None:
            left["last_event"] = t.event
            if t.event == "INTERRUPTED":
                left["interruptions"] += 1
            if t.event in ("INTERRUPTED", "RETRIED"):  # the phase runs again: one more attempt
                left["attempts"] += 1
    return [v for v in visits.values() if v["attempts"]]
