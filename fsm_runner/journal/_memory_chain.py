"""The memory journal's digests: the same as a SQLite journal's, kept beside its records.

Each run's transitions form a hash chain, and its run row, iterations, effects and artifacts
have a digest each (see :mod:`~fsm_runner.journal._digest`), computed from the text a SQL
journal would store for them (the JSON text, the formatted times) as they are stored here.
:meth:`MemoryDigests.problems` computes them again from the records as they are now: a record
changed in place (poked by a test, say) no longer matches; a run to be driven is verified at
its head first (:meth:`MemoryDigests.verify`, as a SQLite journal's claim does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from fsm_runner._shown import shown
from fsm_runner.exceptions import InvalidRunIdError, JournalError
from fsm_runner.journal import _rows
from fsm_runner.journal._digest import RUN_DIGEST_COLUMNS, row_digest, transition_digest
from fsm_runner.journal._head import verify_head, verify_history
from fsm_runner.records import (
    ArtifactRecord,
    EffectRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    format_utc,
)

__all__ = ["MemoryDigests", "Tables"]

_log = logging.getLogger("fsm_runner")

#: A memory journal's transitions, iterations, artifacts and effects, each by run id.
Tables = tuple[Any, ...]


def _transition(previous: str | None, transition: TransitionRecord) -> str:
    return transition_digest(previous, _rows.transition_params(transition, format_utc))


def _run(run: RunRecord) -> str:
    return row_digest(_rows.run_params(run, RUN_DIGEST_COLUMNS, format_utc))


def _own(record: IterationRecord | EffectRecord | ArtifactRecord) -> str:
    if isinstance(record, IterationRecord):
        return row_digest(_rows.iteration_params(record, format_utc))
    if isinstance(record, EffectRecord):
        return row_digest(_rows.effect_params(record, format_utc))
    return row_digest(_rows.artifact_params(record, format_utc))


class MemoryDigests:
    """The digests of one memory journal's rows, by run (the journal's lock held by callers)."""

    def __init__(self) -> None:
        #: Run id -> its transitions' digests, in seq order (the chain).
        self.chains: dict[str, list[str]] = {}
        #: Run id -> its run row's digest.
        self.runs: dict[str, str] = {}
        #: (run id, table, the row's key) -> the row's digest.
        self.rows: dict[tuple[str, str, Any], str] = {}
        #: Runs ``claim_next`` found refused (:meth:`first_sound`): not tried again.
        self.refused: set[str] = set()

    def started(
        self, run: RunRecord, first: TransitionRecord, iterations: Sequence[IterationRecord]
    ) -> TransitionRecord:
        """A new run (its id may be a pruned run's: nothing of that one is kept).

        Returns:
            ``first`` with its digest, as the journal stores it.
        """
        self.forget(run.run_id)
        self.chains[run.run_id] = [_transition(None, first)]
        self.runs[run.run_id] = _run(run)
        self.stored(run.run_id, iterations)
        return attrs.evolve(first, digest=self.chains[run.run_id][0])

    def committed(
        self, run: RunRecord, transition: TransitionRecord, rows: Iterable[Any] = ()
    ) -> TransitionRecord:
        """A commit: ``run`` as stored now, its transition, the iterations and artifacts.

        Returns:
            ``transition`` with its digest, as the journal stores it.
        """
        chain = self.chains[run.run_id]
        chain.append(_transition(chain[-1] if chain else None, transition))
        self.runs[run.run_id] = _run(run)
        self.stored(run.run_id, rows)
        return attrs.evolve(transition, digest=chain[-1])

    def stored(self, run_id: str, records: Iterable[Any]) -> None:
        """Iterations, effects or artifacts stored (each replacing the one of its key)."""
        for record in records:
            table, key = _key(record)
            self.rows[run_id, table, key] = _own(record)

    def forked(self, run: RunRecord, tables: Tables) -> None:
        """A fork's copies (in the journal's ``tables``): its digests, chained from seq 0."""
        self.forget(run.run_id)
        chain: list[str] = []
        copies = tables[0][run.run_id]
        for index, transition in enumerate(copies):
            chain.append(_transition(chain[-1] if chain else None, transition))
            copies[index] = attrs.evolve(transition, digest=chain[-1])
        self.chains[run.run_id] = chain
        self.runs[run.run_id] = _run(run)
        self.stored(run.run_id, _owned(tables, run.run_id))

    def verify(self, run: RunRecord, transitions: Sequence[TransitionRecord]) -> None:
        """Refuse to drive ``run`` (its ``transitions``) as SQLite's journal does (``_head``).

        Raises:
            InvalidRunIdError: its id breaks the rule of run ids; nothing was written.
            JournalError: its head transition or its row fails its digest; nothing was written.
        """
        head, previous, run_row = self._head_rows(run, transitions)
        verify_head(run.run_id, run.seq, head, previous, run_row, path=":memory:")

    def first_sound(
        self, runs: Iterable[RunRecord], transitions: Mapping[str, Sequence[TransitionRecord]]
    ) -> RunRecord | None:
        """The first of ``runs`` not refused (``claim_next``'s); one refused is logged once."""
        for run in runs:
            if run.run_id in self.refused:
                continue
            try:
                self.verify(run, transitions.get(run.run_id, []))
            except (JournalError, InvalidRunIdError) as exc:
                self.refused.add(run.run_id)
                _log.error("%s; the run is skipped (not claimed)", exc.message)
                continue
            return run
        return None

    def verify_source(
        self, run: RunRecord, transitions: Sequence[TransitionRecord], at_seq: int
    ) -> None:
        """Refuse a fork's source whose chain up to ``at_seq``, or whose row, fails its digest.

        Raises:
            JournalError: naming the first seq that fails (or the row); nothing was written.
        """
        rows, run_row = self._history_rows(run, transitions, at_seq)
        verify_history(run.run_id, rows, run_row, path=":memory:")

    def _head_rows(
        self, run: RunRecord, transitions: Sequence[TransitionRecord]
    ) -> tuple[Sequence[Any] | None, str | None, Sequence[Any]]:
        """``run``'s head transition, the previous one's digest and its row, as kept here."""
        chain = self.chains.get(run.run_id, [])
        count = len(transitions)
        head = None
        if count:
            stored = chain[count - 1] if len(chain) >= count else None
            head = (stored, *_rows.transition_params(transitions[-1], format_utc))
        previous = chain[count - 2] if 2 <= count <= len(chain) + 1 else None
        run_row = (
            self.runs.get(run.run_id),
            *_rows.run_params(run, RUN_DIGEST_COLUMNS, format_utc),
        )
        return head, previous, run_row

    def _history_rows(
        self, run: RunRecord, transitions: Sequence[TransitionRecord], to_seq: int
    ) -> tuple[list[tuple[int, str | None, Any]], Sequence[Any]]:
        """``run``'s transitions up to ``to_seq`` (seq, digest, values) and its row, kept here."""
        chain = self.chains.get(run.run_id, [])
        rows = [
            (
                transition.seq,
                chain[index] if index < len(chain) else None,
                _rows.transition_params(transition, format_utc),
            )
            for index, transition in enumerate(transitions)
            if transition.seq <= to_seq
        ]
        run_row = (
            self.runs.get(run.run_id),
            *_rows.run_params(run, RUN_DIGEST_COLUMNS, format_utc),
        )
        return rows, run_row

    def forget(self, run_id: str) -> None:
        """Drop what is kept of a run (pruned, or its id taken by a new run)."""
        self.chains.pop(run_id, None)
        self.runs.pop(run_id, None)
        for key in [key for key in self.rows if key[0] == run_id]:
            del self.rows[key]

    def problems(self, runs: Mapping[str, RunRecord], tables: Tables) -> list[str]:
        """The records that no longer match their digests, one line each (as SQLite's check).

        ``tables``: the journal's transitions, iterations, artifacts and effects, by run id.
        """
        transitions = tables[0]
        owned = [(run_id, _owned(tables, run_id)) for run_id in runs]
        problems = []
        for run_id in sorted(runs):
            chain = self.chains.get(run_id, [])
            previous = None
            for index, transition in enumerate(transitions.get(run_id, ())):
                stored = chain[index] if index < len(chain) else None
                if stored != _transition(previous, transition):
                    problems.append(
                        f"digest: run {shown(run_id)} at seq {transition.seq}: the transition"
                        " does not match its digest (changed since it was written)"
                    )
                    break
                previous = stored
            if self.runs.get(run_id) != _run(runs[run_id]):
                problems.append(
                    f"digest: run {shown(run_id)}: its row (input, context, error) does not"
                    " match its digest (changed since it was written)"
                )
        problems.extend(
            f"digest: run {shown(run_id)}: its {_named(record)} does not match its digest"
            " (changed since it was written)"
            for run_id, records in owned
            for record in records
            if self.rows.get((run_id, *_key(record))) != _own(record)
        )
        return problems


def _owned(tables: Tables, run_id: str) -> list[Any]:
    """The run's iterations, artifacts and effects."""
    return [record for table in tables[1:] for record in table.get(run_id, {}).values()]


def _key(record: Any) -> tuple[str, Any]:
    if isinstance(record, IterationRecord):
        return "iterations", record.iteration
    if isinstance(record, EffectRecord):
        return "effects", (record.visit_seq, record.name)
    return "artifacts", record.name


def _named(record: Any) -> str:
    """How a problem names a row (as SQLite's check does)."""
    if isinstance(record, IterationRecord):
        return f"iteration {record.iteration}"
    if isinstance(record, EffectRecord):
        return f"effect {record.name!r} of visit {record.visit_seq}"
    return f"artifact {record.name!r}"
