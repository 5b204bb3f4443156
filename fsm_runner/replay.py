"""Replaying a run's journal through its spec: verification, timelines, the run at a seq.

A run's row is a projection of its transitions (invariant 8). Walking the transitions through
the spec the run started with, deriving each row exactly as the engine does, reproduces the
row field by field; the first place where it does not is a :class:`ReplayMismatchError` that
names the seq, what the replay expected and what the journal holds.

Per transition the walk checks that

* seqs start at 0 and have no gaps, and every transition belongs to the run;
* seq 0 is ``STARTED`` from no state into the spec's initial leaf;
* each ``from_state`` is the state the run was in (the ``to_state`` before it), and nothing
  follows the run's end;
* the transition follows one of the engine's rules: an edge of the spec from the state
  (a :data:`fsm_runner.spec.RETURN` candidate standing for the state the run came from; guards
  are not evaluated, they need the host app) or the engine's own use of an engine event
  (``RETRIED``, ``INTERRUPTED``, ``USER_ABORTED`` without an exit, ``REWOUND``,
  ``DEAD_LETTERED``, ``SPEC_CHANGED``). Which rule, and what breaks it, the pure classifier
  says (:func:`fsm_runner.rules.classify.classify`, where the rules are spelled out);
* the transition's ``attempt`` is the attempt the run was on, and its ``iteration`` the one the
  rules give (entering a ``starts_iteration`` state starts one, unless the entry continues a
  visit: a retry, an interruption, an in-place stop, a return).

Each step rebuilds the row the engine wrote with it, with the engine's own reducer
(:mod:`fsm_runner.rules.reducer`): state, status, seq, iteration, attempt, context (a phase's
``result["context"]`` merged in), error (the phase's, or the chosen transition's ``reason``),
``updated_at``, visit and return target. What the engine does not derive from the
transitions — input, ``created_at``, parent, fork origin, lease, a pending abort request — is
taken from the run given.
"""

from __future__ import annotations

import datetime as dt
import operator
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from fsm_runner import run_ids as _run_ids
from fsm_runner._check_pool import Found as _Found
from fsm_runner._check_pool import Medium, check_ranges, medium_checks, report_lines
from fsm_runner._check_pool import Problem as _Problem
from fsm_runner._mismatch import shown_fields
from fsm_runner.events import SPEC_CHANGED
from fsm_runner.exceptions import (
    FsmRunnerError,
    JournalError,
    ReplayMismatchError,
    RunNotFoundError,
    SpecError,
)
from fsm_runner.journal import Journal
from fsm_runner.records import RunRecord, TransitionRecord
from fsm_runner.rules.classify import (
    Problem,
    StepKind,
    classify,
    classify_start,
    output_text,
    plain_reads,
)
from fsm_runner.rules.reducer import ACTIVE, advance, advance_read, begin_fields
from fsm_runner.spec import MachineSpec

__all__ = [
    "CHECK_CHUNK",
    "CheckReport",
    "Replay",
    "ReplayStep",
    "SpecSource",
    "StepKind",
    "check_journal",
    "check_runs",
    "journal_specs",
    "read_run",
    "replay",
    "replay_run",
    "state_at",
    "verify",
]

#: Finds a spec by its hash (the journal's ``specs`` table), for runs that changed spec.
SpecSource = Callable[[str], MachineSpec]
#: The row fields the engine derives from the transitions, in the order they are compared.
_DERIVED = (
    "seq", "state", "status", "iteration", "attempt", "visit_seq", "return_to",
    "return_attempt", "return_visit", "context", "error", "updated_at",
)  # fmt: skip

_derived = operator.attrgetter(*_DERIVED)
_Report = Callable[[ReplayMismatchError], None]


@attrs.frozen
class ReplayStep:
    """One transition of a replayed run, and the run row it led to.

    Attributes:
        transition: the journaled transition.
        run: the run row as the replay derived it right after the transition.
        kind: how the replay read the transition (see :data:`StepKind`).
    """

    transition: TransitionRecord
    run: RunRecord
    kind: StepKind

    @property
    def seq(self) -> int:
        """The transition's seq."""
        return self.transition.seq

    @property
    def from_state(self) -> str | None:
        """The state left (``None`` at seq 0)."""
        return self.transition.from_state

    @property
    def event(self) -> str:
        """The event that caused the transition."""
        return self.transition.event

    @property
    def to_state(self) -> str:
        """The state entered."""
        return self.transition.to_state

    @property
    def duration_ms(self) -> float:
        """How long the phase that produced the transition took."""
        return self.transition.duration_ms

    @property
    def error(self) -> Mapping[str, Any] | None:
        """The error the run carried after the transition (a phase's, or a transition's reason)."""
        return self.run.error


@attrs.frozen
class Replay:
    """A run's journal replayed through its spec.

    Attributes:
        run: the run row the replay derived at its end (or at the seq it stopped at).
        steps: every transition replayed, in seq order, with the row after it.
    """

    run: RunRecord
    steps: tuple[ReplayStep, ...]

    @property
    def path(self) -> tuple[str, ...]:
        """The states the run entered, in order (seq 0's first)."""
        return tuple(step.to_state for step in self.steps)


def replay(
    spec: MachineSpec,
    run: RunRecord,
    timeline: Iterable[TransitionRecord],
    *,
    to_seq: int | None = None,
    path: str | None = None,
    specs: SpecSource | None = None,
) -> Replay:
    """Replay a run's transitions through ``spec`` and check them against the run row.

    Args:
        spec: the run's spec (``journal.spec_json(run.spec_hash)``), or one to try instead.
        run: the run's row as the journal holds it; the fields the engine does not derive
            (input, ``created_at``, parent, fork origin, lease) are taken from it, and so is
            ``abort_reason`` for the row at ``run.seq`` (a pending abort request is not
            journaled; rows before it carry none).
        timeline: the run's transitions in seq order (``journal.transitions(run_id)``); with
            ``to_seq``, those up to it are enough.
        to_seq: stop after this seq and return the row as it stood then; the run row is then
            not compared.
        path: the journal's location, for the error's message.
        specs: finds a spec by hash (the journal's); needed to follow a run that went on under
            another spec (``SPEC_CHANGED``): it replays through each spec in turn.

    Returns:
        The replay: the derived run row and every step.

    Raises:
        ReplayMismatchError: at the first transition (or, at the end, the first row field) where
            the journal differs from the replay; it names the seq, the expected and the found.
        ValueError: ``to_seq`` is negative or beyond the last transition of ``timeline``.
    """
    if to_seq is not None and to_seq < 0:
        raise ValueError(f"to_seq must be >= 0, not {to_seq}")
    timeline = list(timeline)
    walker = _Walker(spec, run, path=path, report=_raise, specs=specs)
    walker.first_spec(timeline)
    steps = tuple(walker.walk(timeline, to_seq=to_seq))
    if to_seq is None:
        walker.compare(steps[-1].run if steps else None)
    elif not steps or steps[-1].seq != to_seq:
        last = f"its last is {steps[-1].seq}" if steps else "it has none"
        shown = _run_ids.shown(run.run_id)
        raise ValueError(f"run {shown} has no transition seq {to_seq} ({last})")
    return Replay(run=steps[-1].run, steps=steps)


def state_at(
    spec: MachineSpec,
    run: RunRecord,
    timeline: Iterable[TransitionRecord],
    seq: int,
    *,
    path: str | None = None,
    specs: SpecSource | None = None,
) -> RunRecord:
    """The run row as it stood right after transition ``seq`` (what ``fork --at SEQ`` starts from).

    Args:
        spec: the spec the run started with.
        run: the run's row now (for the fields the engine does not derive).
        timeline: the run's transitions in seq order, at least up to ``seq``.
        seq: the transition to stop after.
        path: the journal's location, for the error's message.
        specs: finds a spec by hash, for runs that changed spec (see :func:`replay`).

    Returns:
        The derived run row at ``seq``.

    Raises:
        ReplayMismatchError: the transitions up to ``seq`` do not replay through ``spec``.
        ValueError: the run has no transition ``seq`` (negative, or beyond its last).
    """
    return replay(spec, run, timeline, to_seq=seq, path=path, specs=specs).run


def verify(
    spec: MachineSpec,
    run: RunRecord,
    timeline: Iterable[TransitionRecord],
    *,
    path: str | None = None,
    specs: SpecSource | None = None,
) -> list[ReplayMismatchError]:
    """Like :func:`replay`, but collect every mismatch instead of raising the first.

    After a mismatch the replay goes on from what the journal holds (the state it names, the
    seq it has), so each later problem is one of its own rather than a consequence.

    Args:
        spec: the spec the run started with.
        run: the run's row as the journal holds it.
        timeline: the run's transitions in seq order.
        path: the journal's location, for the errors' messages.
        specs: finds a spec by hash, for runs that changed spec (see :func:`replay`).

    Returns:
        Every mismatch found, in seq order; empty when the journal replays exactly.
    """
    problems: list[ReplayMismatchError] = []
    timeline = list(timeline)
    walker = _Walker(spec, run, path=path, report=problems.append, specs=specs)
    walker.first_spec(timeline)
    last: RunRecord | None = None
    for step in walker.walk(timeline, to_seq=None):
        last = step.run
    walker.compare(last)
    return problems


def replay_run(journal: Journal, run_id: str, *, to_seq: int | None = None) -> Replay:
    """Replay a run from the journal alone: its row, its spec and its transitions.

    Args:
        journal: the journal holding the run.
        run_id: the run.
        to_seq: stop after this seq (see :func:`replay`).

    Returns:
        The replay.

    Raises:
        RunNotFoundError: no such run.
        JournalError: the journal does not hold the run's spec, or holds one that does not
            match its hash or is not a valid machine spec (damaged or edited by hand).
        ReplayMismatchError: the run's journal does not replay through its spec.
        ValueError: ``to_seq`` is negative or beyond the run's last transition.
    """
    timeline, run = read_run(journal, run_id, to_seq=to_seq)
    specs = journal_specs(journal)
    return replay(
        specs(run.spec_hash), run, timeline, to_seq=to_seq, path=journal.location, specs=specs
    )


#: Runs one bulk read takes (and one task of a parallel check): enough that the reads are
#: long range scans in key order, few enough that a task's rows stay small in memory.
CHECK_CHUNK = 2000


@attrs.frozen
class CheckReport:
    """What :func:`check_runs` found.

    Attributes:
        problems: one readable line per problem (see :func:`check_journal`).
        runs: how many runs were checked.
    """

    problems: tuple[str, ...]
    runs: int


def check_journal(
    journal: Journal,
    *,
    run_ids: Sequence[str] | None = None,
    since: dt.datetime | None = None,
    jobs: int = 1,
    chunk: int = CHECK_CHUNK,
) -> list[str]:
    """Replay every run of a journal; one line per run that does not replay (invariants 1, 2, 8).

    A SQL journal's runs are read a range at a time (their transitions, then the rows), a
    memory journal's one at a time, so a big journal is never held in memory beyond its run
    keys and one range per process; a run advanced by a live writer meanwhile is read
    consistently. A run whose row or spec cannot be read is one
    problem too. Where the journal can check its medium (``integrity_problems()``), those
    problems come first.

    Args:
        journal: the journal to check.
        run_ids: check only these runs (full ids).
        since: check only the runs updated (their last transition) at or after this time.
        jobs: processes to check in (see :func:`check_runs`).
        chunk: runs a range (see :func:`check_runs`).

    Returns:
        One readable line per problem (``run ID at seq N: replay expected ..., the journal
        has ...``); empty when every run replays exactly. Runs that cannot be read for the
        same reason (a damaged spec they share, a damaged schema) are one line together.
    """
    report = check_runs(journal, run_ids=run_ids, since=since, jobs=jobs, chunk=chunk)
    return list(report.problems)


def check_runs(
    journal: Journal,
    *,
    run_ids: Sequence[str] | None = None,
    since: dt.datetime | None = None,
    jobs: int = 1,
    chunk: int = CHECK_CHUNK,
    progress: Callable[[int, int], None] | None = None,
    nice: int = 0,
) -> CheckReport:
    """Check a journal (see :func:`check_journal`), in ``jobs`` processes; say how many runs.

    A SQL journal's runs are cut into ranges of :data:`CHECK_CHUNK` runs in the order of the
    transitions' key (``run_key`` on SQLite, ``run_id`` on PostgreSQL), so each range is two
    reads in index order. With ``jobs`` > 1 the ranges are checked in a pool of processes
    (started with ``spawn``: no journal crosses a fork), each opening the journal again
    (``journal.opener()``) with a larger page cache; the runs' problems are then sorted by
    run id, the order the check of one run after another gives, so the lines are the same
    whatever ``jobs``. A memory journal, ``run_ids`` and a journal that cannot be read in
    ranges (a damaged ``runs`` view) are checked one run at a time, in this process.
    A script that checks with ``jobs`` > 1 needs the ``if __name__ == "__main__":`` guard
    of every ``spawn`` pool (the processes import its main module).

    Args:
        journal: the journal to check.
        run_ids: check only these runs (full ids).
        since: check only the runs updated (their last transition) at or after this time.
        jobs: processes to check in; 1 (or a journal with one range) checks in this one.
        chunk: runs a range (one bulk read, one task of the pool).
        progress: called with (runs checked since the last call, runs to check) as ranges end.
        nice: added to the niceness of the pool's processes (a check in the background, as the
            inspector's, leaves the CPU to what answers people).

    Returns:
        The problems and the number of runs checked.

    Raises:
        ValueError: ``chunk`` is less than 1.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, not {chunk}")
    beside: list[Medium] = []  # the medium's checks, beside a pool if one runs
    found: _Found | None = None
    # A SQLite journal's ranges verify the runs' chains as they read them, but for part of
    # the runs (``since``): the medium's checks, the chains among them, are whole as ever.
    in_ranges = _chains_in_ranges(journal, since) and run_ids is None
    if run_ids is None and callable(getattr(journal, "read_runs", None)):
        try:
            found, count = check_ranges(
                journal, _check_range, since=since, jobs=jobs, chunk=chunk, progress=progress,
                on_pool=lambda: beside.append(
                    medium_checks(journal, beside_pool=True, nice=nice, chains=not in_ranges)
                ),
                nice=nice,
            )  # fmt: skip
        except BaseException:  # stopped (a cancel, Ctrl-C): so are the medium's checks
            for medium in beside:
                medium.stop()
            raise
    chained = in_ranges and found is not None  # (a pool's medium was told before it ended)
    medium = beside[0] if beside else medium_checks(journal, beside_pool=False, chains=not chained)
    lines = medium()
    if in_ranges and beside and found is None:  # no ranges (damaged): the chains are the medium's
        lines = medium_checks(journal, beside_pool=False)()
    if found is None:
        ids = journal.run_ids("", limit=sys.maxsize) if run_ids is None else sorted(set(run_ids))
        found, count = _check_each(journal, ids, since=since, chunk=chunk, progress=progress)
    lines = report_lines(lines, found)
    return CheckReport(problems=tuple(lines), runs=count)


def _chains_in_ranges(journal: Any, since: dt.datetime | None) -> bool:
    """Whether a check's ranges verify the runs' hash chains (as they read them)."""
    return since is None and getattr(journal, "RANGES_VERIFY_CHAINS", False) is True


def _check_each(
    journal: Journal,
    run_ids: Sequence[str],
    *,
    since: dt.datetime | None,
    chunk: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[_Found, int]:
    """Check the runs one at a time, as the serial check always did."""
    specs: dict[str, MachineSpec | str] = {}
    found: _Found = []
    count = 0
    for done, run_id in enumerate(run_ids, 1):
        if since is not None and not _updated_since(journal, run_id, since):
            continue
        count += 1
        problem = _check_run(journal, run_id, specs)
        if problem is not None:
            found.append((run_id, problem))
        if progress is not None and (done % chunk == 0 or done == len(run_ids)):
            progress(chunk if done % chunk == 0 else done % chunk, len(run_ids))
    return found, count


def _updated_since(journal: Journal, run_id: str, since: dt.datetime) -> bool:
    try:
        return journal.load(run_id).updated_at >= since
    except RunNotFoundError:
        return False
    except FsmRunnerError:
        return True  # an unreadable run: its check says why


def _check_range(
    journal: Any,
    first: Any,
    last: Any,
    since: dt.datetime | None,
    specs: dict[str, MachineSpec | str],
) -> tuple[_Found, int] | None:
    """The problems of the runs in one key range, and how many; ``None`` if it cannot be read."""
    chains: list[tuple[str, _Problem]] = []  # runs whose chain breaks, as (id, line)
    try:
        if _chains_in_ranges(journal, since):
            reads = journal.read_runs(first, last, since=since, chains=chains)
        else:
            reads = journal.read_runs(first, last, since=since)
    except FsmRunnerError:
        return None
    found: _Found = [("", line) for _, line in chains]  # first, in key order: the medium's
    for run_id, read in reads:
        problem = _check_read(journal, run_id, read, specs)
        if problem is not None:
            found.append((run_id, problem))
    return found, len(reads)


def _check_run(
    journal: Journal, run_id: str, specs: dict[str, MachineSpec | str]
) -> _Problem | None:
    """The run's problem: a line, or (what, why) when it cannot be read; ``None`` if none."""
    try:
        read: tuple[list[TransitionRecord], RunRecord] | FsmRunnerError = read_run(
            journal, run_id, to_seq=None
        )
    except RunNotFoundError:
        return None  # pruned since the ids were listed
    except FsmRunnerError as exc:  # an unreadable row: this run's problem, not the check's
        read = exc
    return _check_read(journal, run_id, read, specs)


def _check_read(
    journal: Journal,
    run_id: str,
    read: tuple[list[TransitionRecord], RunRecord] | FsmRunnerError,
    specs: dict[str, MachineSpec | str],
) -> _Problem | None:
    """The problem of a run read (its transitions and row, or why they cannot be read)."""
    if isinstance(read, FsmRunnerError):
        return "cannot be read", str(read)
    timeline, run = read
    spec = specs.get(run.spec_hash)
    if spec is None:
        try:
            spec = _stored_spec(journal, run.spec_hash)
        except FsmRunnerError as exc:
            spec = str(exc)
        specs[run.spec_hash] = spec
    if isinstance(spec, str):
        return f"its spec {run.spec_hash[:12]} cannot be read", spec
    try:
        replay(spec, run, timeline, specs=journal_specs(journal))
    except ReplayMismatchError as exc:
        return exc.detail
    except FsmRunnerError as exc:  # a spec it changed to cannot be read
        return f"run {_run_ids.shown(run_id)}: {exc}"
    return None


def _stored_spec(journal: Journal, spec_hash: str) -> MachineSpec:
    """The spec the journal holds under ``spec_hash``, once it is known to be a valid one.

    The journal checks the JSON against its hash; a spec that still does not validate (a
    state renamed and the hashes rewritten by hand) would fail the replay deep inside, on the
    first name it lacks, so it is refused here, with every problem named.

    Raises:
        JournalError: no such spec, or its JSON is damaged or not a valid machine spec.
    """
    try:
        spec = MachineSpec.from_json(journal.spec_json(spec_hash))
        spec.validate()
    except SpecError as exc:
        raise JournalError(
            f"holds spec {spec_hash[:12]}, which is not a valid machine spec"
            f" ({'; '.join(exc.problems)}); nothing was changed",
            path=journal.location,
        ) from None
    return spec


def read_run(
    journal: Journal, run_id: str, *, to_seq: int | None
) -> tuple[list[TransitionRecord], RunRecord]:
    """The run's transitions and then its row, consistent even while a writer advances it.

    A commit writes a transition and the row together, so transitions read before the row
    are never ahead of it; any the row has moved on to meanwhile are read after it.
    """
    timeline = list(journal.transitions(run_id, to_seq=to_seq))
    run = journal.load(run_id)
    last = timeline[-1].seq if timeline else -1
    end = run.seq if to_seq is None else min(run.seq, to_seq)
    if end > last:
        timeline += journal.transitions(run_id, from_seq=last + 1, to_seq=end)
    return timeline, run


def journal_specs(journal: Journal) -> SpecSource:
    """A :data:`SpecSource` reading (and caching) the specs a journal keeps by hash."""
    cache: dict[str, MachineSpec] = {}

    def find(spec_hash: str) -> MachineSpec:
        if spec_hash not in cache:
            cache[spec_hash] = _stored_spec(journal, spec_hash)
        return cache[spec_hash]

    return find


def _raise(error: ReplayMismatchError) -> None:
    raise error


class _Walker:
    """Walks one run's transitions, checking each and deriving its row with the reducer."""

    def __init__(
        self,
        spec: MachineSpec,
        run: RunRecord,
        *,
        path: str | None,
        report: _Report,
        specs: SpecSource | None = None,
    ) -> None:
        self.run = run
        self.path = path
        self.report = report
        self.specs = specs
        self.spec_hash = run.spec_hash  # the spec the run was under at each step
        self.use(spec)
        self.visited: set[str] = set()

    def use(self, spec: MachineSpec) -> None:
        self.spec = spec  # its states looked up by name: a dict of its leaves per run would
        # cost the spec's size for each run a check replays (plain_reads: once a spec)
        self.plain = plain_reads(spec)

    def first_spec(self, timeline: Sequence[TransitionRecord]) -> None:
        """Start from the spec the run started with, if it changed spec on the way."""
        for transition in timeline:
            if transition.event == SPEC_CHANGED and self.specs is not None:
                first = output_text(transition, "from_spec")
                if first is not None:
                    self.use(self.specs(first))
                    self.spec_hash = first
                return

    def problem(self, seq: int, expected: str, found: str) -> None:
        self.report(
            ReplayMismatchError(
                run_id=self.run.run_id, seq=seq, expected=expected, found=found, path=self.path
            )
        )

    def problems(self, seq: int, found: Iterable[Problem]) -> None:
        """Report what the classifier found wrong with the transition ``seq``."""
        for problem in found:
            self.problem(seq, problem.expected, problem.found)

    def walk(
        self, timeline: Iterable[TransitionRecord], *, to_seq: int | None
    ) -> Iterator[ReplayStep]:
        row: RunRecord | None = None
        expected_seq = 0
        for transition in timeline:
            seq = transition.seq
            if to_seq is not None and seq > to_seq:
                break
            if seq != expected_seq:
                self.problem(expected_seq, f"seq {expected_seq}", f"seq {seq}")
            if transition.run_id != self.run.run_id:
                self.problem(
                    seq, f"a transition of run {self.run.run_id}", f"one of run {transition.run_id}"
                )
            if row is None:
                kind: StepKind = "start"
                row = self.start(transition)
            else:
                row, kind = self.follow(row, transition)
            self.visited.add(transition.to_state)
            expected_seq = seq + 1
            yield ReplayStep(transition, row, kind)

    def compare(self, row: RunRecord | None) -> None:
        """Compare the derived row with the run's row, field by field."""
        if row is None:
            self.problem(0, "transition seq 0 (STARTED)", "no transitions")
            return
        if _derived(row) == _derived(self.run):
            return
        for name in _DERIVED:
            expected, found = getattr(row, name), getattr(self.run, name)
            if expected != found:
                self.problem(row.seq, *shown_fields(name, expected, found))

    def start(self, transition: TransitionRecord) -> RunRecord:
        self.problems(transition.seq, classify_start(self.spec, transition).problems)
        run = self.run  # ``begin`` of the run under its first spec and the seq-0 token: no copy
        begun = begin_fields(
            self.spec, transition, run.run_id, run.machine, self.spec_hash, run.input,
            run.created_at, run.parent_run_id, run.lease_owner, run.lease_expires_at,
            transition.lease_token, run.forked_from, run.abort_reason, run.recoveries,
        )  # fmt: skip
        row = self.own(begun, transition)
        self.check_counts(transition, attempt=1, iteration=row.iteration)
        return row

    def follow(self, prev: RunRecord, transition: TransitionRecord) -> tuple[RunRecord, StepKind]:
        seq, dest = transition.seq, transition.to_state
        entry = self.plain.get((prev.state, transition.event, dest))
        if (  # a plain spec step, as classify and advance read it (the general path's result)
            entry is not None
            and transition.from_state == prev.state
            and prev.status is ACTIVE
            and transition.lease_token >= prev.lease_token
            and not transition.result
        ):
            run, (status, starts, returning) = self.run, entry
            if seq == run.seq:  # what own() gives: the run row's own at its last seq
                row = advance_read(
                    prev, transition, status, starts, returning, run.spec_hash,
                    run.abort_reason, run.lease_owner, run.lease_expires_at, run.lease_token,
                )  # fmt: skip
            else:
                row = advance_read(
                    prev, transition, status, starts, returning, self.spec_hash, None, None,
                    None, transition.lease_token,
                )  # fmt: skip
            if transition.attempt != prev.attempt or transition.iteration != row.iteration:
                self.check_counts(transition, attempt=prev.attempt, iteration=row.iteration)
            return row, "transition"
        if prev.ended:
            self.problem(
                seq,
                f"no transition after the run ended in state {prev.state!r}",
                f"{transition.event} to state {dest!r}",
            )
        if transition.from_state != prev.state:
            source = transition.from_state
            self.problem(
                seq,
                f"a transition from state {prev.state!r}",
                f"a transition from state {source!r}" if source else "a transition from no state",
            )
            # go on from where the journal says (when collecting), if the spec has that leaf
            if source and self.spec.has_state(source) and not self.spec.state(source).composite:
                prev = attrs.evolve(prev, state=source)
        kind = self.classify(prev, transition)
        row = self.own(advance(self.spec, prev, transition, kind), transition)
        self.check_counts(transition, attempt=prev.attempt, iteration=row.iteration)
        return row, kind

    def check_counts(self, transition: TransitionRecord, *, attempt: int, iteration: int) -> None:
        if transition.attempt != attempt:
            self.problem(transition.seq, f"attempt {attempt}", f"attempt {transition.attempt}")
        if transition.iteration != iteration:
            self.problem(
                transition.seq, f"iteration {iteration}", f"iteration {transition.iteration}"
            )

    def classify(self, prev: RunRecord, transition: TransitionRecord) -> StepKind:
        """Which of the engine's rules the transition follows; report what breaks them."""
        reading = classify(self.spec, prev, transition, visited=self.visited)
        self.problems(transition.seq, reading.problems)
        if reading.kind == "spec_change":
            self.change_spec(transition)
        return reading.kind

    def change_spec(self, transition: TransitionRecord) -> None:
        """Go on under the spec a ``SPEC_CHANGED`` names, read from the journal's specs."""
        new = output_text(transition, "to_spec")
        if self.specs is None or new is None:
            self.problem(
                transition.seq, "the journal's specs to follow a change of spec", "none given"
            )
        else:
            self.use(self.specs(new))
            self.spec_hash = new

    def own(self, row: RunRecord, transition: TransitionRecord) -> RunRecord:
        """The reducer's row, with what the transitions do not say taken from the run given.

        The run's row is known only at its last seq: its spec, a pending abort request and its
        lease. Before, the row carries no request and no lease holder, the spec the run was
        under, and the token the transition was written under.
        """
        run = self.run
        if transition.seq == run.seq:
            spec_hash, abort_reason = run.spec_hash, run.abort_reason
            owner, expires, token = run.lease_owner, run.lease_expires_at, run.lease_token
        else:
            spec_hash, abort_reason = self.spec_hash, None
            owner, expires, token = None, None, transition.lease_token
        if (
            row.spec_hash != spec_hash
            or row.abort_reason != abort_reason
            or row.lease_owner != owner
            or row.lease_expires_at != expires
            or row.lease_token != token
        ):
            row = attrs.evolve(
                row,
                spec_hash=spec_hash,
                abort_reason=abort_reason,
                lease_owner=owner,
                lease_expires_at=expires,
                lease_token=token,
            )
        return row
