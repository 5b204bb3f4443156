"""What each page of the run inspector shows, read from a journal: plain data for the templates.

Every read goes through the :class:`~fsm_runner.journal.Journal` API (``runs``, ``load``,
``transitions``, ``iterations``, ``effects``, ``artifacts``, ``run_counts``, ``spec_json``,
``signals``, ``wake_time``) and the library's own functions (:func:`fsm_runner.diagrams.extract`,
:func:`fsm_runner.replay.check_runs` in :mod:`.jobs`), exactly as ``fsm-runner runs``, ``show``,
``diagram --run`` and ``check`` read them. Nothing here writes, and nothing knows about HTTP.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import attrs

from fsm_runner.command_line import suggested_command
from fsm_runner.diagrams import Graph, extract, taken_edges
from fsm_runner.engine.waits import parked_phase
from fsm_runner.journal import Journal
from fsm_runner.journal.base import RunFilters
from fsm_runner.journal.search import JsonMatch, RunSearch, SearchIndexes, SearchKey
from fsm_runner.records import (
    IterationRecord,
    RunRecord,
    SignalRecord,
    TransitionRecord,
    utc_now,
)
from fsm_runner.spec import MachineSpec
from fsm_runner.ui.payloads import (
    artifact_rows,
    clip,
    error_text,
    output_fields,
    payload_text,
    pretty_json,
)
from fsm_runner.ui.svg import render_svg
from fsm_runner.visits import subphase_visits

if TYPE_CHECKING:
    from fsm_runner.ui.jobs import CheckJob

__all__ = [
    "EXACT_UP_TO",
    "RUNS_PAGE",
    "STATUSES",
    "TIMELINE_PAGE",
    "WAITING_SCAN",
    "RunsQuery",
    "check_page",
    "diagram",
    "live_update",
    "machine_page",
    "run_page",
    "run_path",
    "runs_page",
    "signal_rows",
    "timeline_rows",
    "waiting_of",
    "waiting_page",
]

#: Runs a page of the runs table lists.
RUNS_PAGE = 50
#: Transitions a page of a run's timeline lists.
TIMELINE_PAGE = 200
#: Runs with fewer transitions are read whole for their diagram; longer ones as counted moves.
EXACT_UP_TO = 1000
#: The statuses the runs table filters on.
STATUSES = ("active", "succeeded", "failed", "aborted", "dead_letter")
#: Without a machine named, the waiting tab looks for the machines of the newest this many
#: active runs (one bounded read); naming a machine looks at that machine's runs alone.
WAITING_SCAN = 500


@attrs.frozen
class RunsQuery:
    """The runs table's filters, as the query string gives them (empty: no filter)."""

    machine: str = ""
    state: str = ""
    status: str = ""
    parent: str = ""
    q: str = ""
    before: str = ""
    #: The previous page: the runs listed just before this one.
    after: str = ""
    #: "1": the waiting tab (active runs standing in a waiting state of their spec).
    waiting: str = ""
    #: A value in the runs' input or context: ``input.order.id = 42`` (:class:`JsonMatch`).
    where: str = ""
    #: Runs started on or after this day (``YYYY-MM-DD``, UTC), and on or before this one.
    since: str = ""
    until: str = ""
    #: "updated": the runs updated last first (when at most :data:`COUNT_CAP` runs match).
    sort: str = ""

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> RunsQuery:
        """Read the filters from a query string's parameters (unknown ones are ignored).

        Raises:
            ValueError: a status not in :data:`STATUSES`, a search the box does not take, a
                day that is not ``YYYY-MM-DD``.
        """
        values = {f.name: params.get(f.name, "").strip() for f in attrs.fields(cls)}
        if values["status"] and values["status"] not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
        if values["sort"] not in SORTS:
            raise ValueError(f"sort must be one of {', '.join(s for s in SORTS if s)}")
        values["waiting"] = "1" if values["waiting"] not in ("", "0") else ""
        query = cls(**values)
        query.search()  # refused here, once: a page reads a query it took
        return query

    def filters(self) -> RunFilters:
        """The journal's filters these ask for (``Journal.runs``/``count_runs`` keywords)."""
        return RunFilters(
            machine=self.machine or None,
            state=self.state or None,
            status=self.status or None,
            parent_run_id=self.parent or None,
            run_id_prefix=self.q or None,
            search=self.search(),
        )

    def search(self) -> RunSearch | None:
        """What the search box and the days ask (``None``: nothing)."""
        if not (self.where or self.since or self.until):
            return None
        until = _day(self.until, "until") + dt.timedelta(days=1) if self.until else None
        return RunSearch(
            created_from=_day(self.since, "since") if self.since else None,
            created_before=until,
            json=JsonMatch.parse(self.where) if self.where else None,
        )

    def link(self, **changes: str) -> str:
        """The query string of these filters with ``changes``, leaving out empty ones."""
        values = attrs.asdict(self) | changes
        return urlencode({k: v for k, v in values.items() if v})


def _day(text: str, name: str) -> dt.datetime:
    """A ``YYYY-MM-DD`` day's start, in UTC."""
    try:
        day = dt.date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{name} must be a day as YYYY-MM-DD, not {text!r}") from None
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc)


#: The most runs a listing counts ("10,000+ runs" beyond): a count reads every run it counts.
COUNT_CAP = 10_000
#: The runs list's orders: newest started first (""), or last updated first.
SORTS = ("", "updated")


def runs_page(journal: Journal, query: RunsQuery, *, counted: bool = True) -> dict[str, Any]:
    """The runs table: newest first, filtered, one page.

    Keyset pages both ways: ``before`` the last run shown (older), ``after`` the first (newer).
    ``counted``: how many runs match, too (``total``; the refreshed rows alone show none).
    """
    backwards = bool(query.after) and not query.before
    filters = query.filters()
    total = None
    by_update = query.sort == "updated"
    if by_update:  # sorted as read: only where few runs match (their count says)
        total = journal.count_runs(at_most=COUNT_CAP + 1, **filters)
        by_update = total <= COUNT_CAP
    found = list(
        journal.runs(
            before=query.before or None,
            after=query.after if backwards else None,
            limit=RUNS_PAGE + 1,
            by_update=by_update,
            **filters,
        )
    )
    more = len(found) > RUNS_PAGE
    if counted and total is None:  # the first page's rows when they are all: no second read
        whole = not (query.before or query.after or more)
        total = len(found) if whole else journal.count_runs(at_most=COUNT_CAP + 1, **filters)
    older: str | None
    if backwards:  # the runs closest to ``after``: the end of the list
        found = found[-RUNS_PAGE:]
        older = query.link(after="", before=query.after)
        newer = query.link(after=found[0].run_id) if more and found else None
    else:
        found = found[:RUNS_PAGE]
        older = query.link(before=found[-1].run_id) if more and found else None
        newer = query.link(before="", after=found[0].run_id) if query.before and found else None
    newest = query.link(before="", after="") if query.before or query.after else None
    named = {run.run_id for run in found} | {r.parent_run_id for r in found if r.parent_run_id}
    shorts = {run_id: short_id(journal, run_id) for run_id in named}
    return {
        "runs": found,
        "query": query,
        "older": older,
        "newer": newer,
        "newest": newest,
        "shorts": shorts,
        "live": not query.before and not query.after,  # the newest page refreshes itself
        "total": total,
        "count_cap": COUNT_CAP,
        "sorts": SORTS,
        "unsorted": query.sort == "updated" and not by_update,  # too many runs to sort
        "unindexed": unindexed(journal, filters.get("search")),
    }


def unindexed(journal: Journal, search: RunSearch | None) -> list[str]:
    """The keys of ``search`` no search index of the journal serves (none: nothing to say)."""
    indexes: SearchIndexes | None = getattr(journal, "search_indexes", None)
    if search is None or indexes is None:
        return []
    keys = [SearchKey("created_at")] if search.ranged else []
    if search.json is not None:
        keys.append(search.json.key)
    return [str(key) for key in keys if not indexes.serves(key)]


#: The filters a bulk abort takes from the runs list (its page and tab are not filters).
BULK_FILTERS = ("machine", "state", "status", "parent", "q", "where", "since", "until")
#: The most runs one bulk abort asks to end (the confirm page says when more match).
BULK_LIMIT = 1_000


def bulk_targets(journal: Journal, query: RunsQuery) -> tuple[list[str], bool]:
    """The active runs the runs list's filters show (at most :data:`BULK_LIMIT`), newest first.

    What a bulk abort ends: the filters as the list applies them, its page ignored, ended runs
    left out (a status filter other than ``active`` matches none). The flag: more match.
    """
    if query.status not in ("", "active"):
        return [], False
    filters = query.filters()
    filters["status"] = "active"
    found = journal.runs(limit=BULK_LIMIT + 1, **filters)
    ids = [run.run_id for run in found]
    return ids[:BULK_LIMIT], len(ids) > BULK_LIMIT


#: The fewest characters of a run id a page shows, and the longer prefixes it tries when that
#: many name more than one run (coordinator tasks share their session's id as a prefix).
_SHORT = (12, 20, 32, 48, 64)


def short_id(journal: Journal, run_id: str) -> str:
    """The shortest prefix of ``run_id`` (12 characters at least) that names it alone.

    What the lists show and the offered commands take: a prefix shared with another run
    would be refused as ambiguous. One read of the run ids' index a length tried.
    """
    for length in _SHORT:
        if len(run_id) <= length:
            return run_id
        if journal.run_ids(run_id[:length], limit=2) == [run_id]:
            return run_id[:length]
    return run_id


def _specs(journal: Journal) -> Callable[[str], MachineSpec]:
    """A reader of stored specs by hash, each read and parsed once (for one page)."""
    cache: dict[str, MachineSpec] = {}

    def spec_of(spec_hash: str) -> MachineSpec:
        spec = cache.get(spec_hash)
        if spec is None:
            spec = cache[spec_hash] = MachineSpec.from_json(journal.spec_json(spec_hash))
        return spec

    return spec_of


def _time(moment: dt.datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment is not None else ""


def waiting_of(
    journal: Journal, spec: MachineSpec, run: RunRecord, *, now: dt.datetime | None = None
) -> dict[str, Any] | None:
    """What an active run waits for, if it waits; else ``None``.

    A run in a waiting state of its spec: the signals the state accepts, its prompt and
    payload schema, its deadline (its wake time if that is to come, else the wait's timeout
    after since; "none": it waits for ever). A run its phase parked (``ctx.wait_for``,
    ``ctx.sleep_until``): the signal the phase waits for, if any, and until when. Both with
    since when it waits (its ``updated_at``) and its pending signals.
    """
    if run.ended:
        return None
    now = now or utc_now()
    wait = spec.wait_of(run.state)
    phase = parked_phase(run) if wait is None else None
    if wait is None and phase is None:
        return None
    accepts: list[str] = []
    prompt = schema = on_timeout = ""
    due: dt.datetime | None = None
    if wait is not None:
        accepts = sorted(spec.accepts(run.state))
        prompt = wait.prompt
        if wait.schema is not None:
            schema = json.dumps(
                wait.schema, ensure_ascii=False, indent=1, sort_keys=True, default=str
            )
        due = journal.wake_time(run.run_id)
        if due is None or due <= now:
            due = None
            if wait.timeout is not None and run.updated_at is not None:
                due = run.updated_at + dt.timedelta(seconds=wait.timeout)
        on_timeout = wait.on_timeout if wait.timeout is not None else ""
    elif phase is not None:
        name, due = phase
        accepts = [name] if name is not None else []
    return {
        "state": run.state,
        "phase": phase is not None,
        "accepts": accepts,
        "prompt": clip(prompt),
        "schema": clip(schema),
        "since": _time(run.updated_at),
        "deadline": _time(due) or "none",
        "on_timeout": on_timeout,
        "pending": signal_rows(journal.signals(run.run_id, pending=True)),
        "command": suggested_command(
            "fsm-runner",
            journal.location,
            "signal",
            run.run_id[:12],
            accepts[0] if accepts else "NAME",
            name_journal=True,
        ),
    }


def _waits_in(spec: MachineSpec) -> set[str]:
    """The states a run of ``spec`` may wait in: its waiting states, and phases with signals."""
    phases = {s.name for s in spec.leaves if s.handler and s.signals and isinstance(s.name, str)}
    return set(spec.waiting_states) | phases


def waiting_page(journal: Journal, query: RunsQuery) -> dict[str, Any]:
    """The waiting tab: active runs standing in a waiting state of their spec, longest first.

    Index-served: for each machine and each waiting state of its specs, the machine's active
    runs in that state (``runs(machine=, status="active", state=)``), at most a page each;
    never a listing of every run. The states whose phase declares signals are read so too,
    for the runs their phase parked (``ctx.wait_for``); a phase that only sleeps
    (``ctx.sleep_until``) in a state without signals is not looked for. The machines are the
    one named, or else those of the newest :data:`WAITING_SCAN` active runs (``partial`` says
    the scan was full: name a machine to be sure to see all of its waiting runs). A machine's
    waiting states are those of its newest run's spec and of the specs of the active runs the
    scan saw; each run found is kept only if its own spec waits in its state.
    """
    spec_of = _specs(journal)
    hashes: dict[str, set[str]] = {}
    partial = False
    if query.machine:
        hashes[query.machine] = set()
    else:
        scan = journal.runs(status="active", limit=WAITING_SCAN + 1)
        partial = len(scan) > WAITING_SCAN
        for run in scan[:WAITING_SCAN]:
            hashes.setdefault(run.machine, set()).add(run.spec_hash)
    now = utc_now()
    found: dict[str, tuple[RunRecord, MachineSpec]] = {}
    more = False
    for machine, seen in sorted(hashes.items()):
        newest = journal.runs(machine=machine, limit=1)
        seen.update(run.spec_hash for run in newest)
        states: set[str] = set()
        for spec_hash in sorted(seen):
            states.update(_waits_in(spec_of(spec_hash)))
        if query.state:
            states &= {query.state}
        for state in sorted(states):
            runs = journal.runs(
                machine=machine,
                status="active",
                state=state,
                parent_run_id=query.parent or None,
                run_id_prefix=query.q or None,
                limit=RUNS_PAGE + 1,
            )
            more = more or len(runs) > RUNS_PAGE
            for run in runs[:RUNS_PAGE]:
                spec = spec_of(run.spec_hash)
                if state in spec.waiting_states or parked_phase(run) is not None:
                    found[run.run_id] = (run, spec)  # (an older spec may not wait there)
    ordered = sorted(
        found.values(), key=lambda pair: (pair[0].updated_at or pair[0].created_at, pair[0].run_id)
    )
    more = more or len(ordered) > RUNS_PAGE
    rows = []
    for run, spec in ordered[:RUNS_PAGE]:
        waiting = waiting_of(journal, spec, run, now=now)
        if waiting is not None:
            rows.append({"run": run, "short": short_id(journal, run.run_id), **waiting})
    return {
        "waiting": rows,
        "query": query,
        "more": more,
        "partial": partial,
        "waiting_scan": WAITING_SCAN,
    }


def signal_rows(signals: Sequence[SignalRecord]) -> list[dict[str, Any]]:
    """A run's signals as rows: number, name, id, when received, status, consuming seq, payload."""
    return [
        {
            "number": s.number,
            "name": s.name,
            "signal_id": s.signal_id or "",
            "received_at": _time(s.received_at),
            "status": s.status.value,
            "consumed_seq": s.consumed_seq,
            "consumed_at": _time(s.consumed_at),
            "payload": payload_text(s.payload),
        }
        for s in signals
    ]


def timeline_rows(timeline: Sequence[TransitionRecord]) -> list[dict[str, Any]]:
    """A timeline's rows: seq, time, states, event, duration, error and its traceback."""
    return [
        {
            "seq": t.seq,
            "at": t.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            "from_state": t.from_state or "-",
            "event": t.event,
            "to_state": t.to_state,
            "duration_ms": t.duration_ms,
            "attempt": t.attempt,
            "iteration": t.iteration,
            "error": error_text(t.error),
            "traceback": clip((t.error or {}).get("traceback") or ""),
            **output_fields(t.output),
            "signal": _signal_number(t),
        }
        for t in timeline
    ]


def _signal_number(transition: TransitionRecord) -> int | None:
    """The number of the signal a transition consumed (its result's ``signal``), if any."""
    number = (transition.result or {}).get("signal")
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def _totals(iterations: Sequence[IterationRecord]) -> dict[str, Any]:
    tokens = [i.tokens_total for i in iterations if i.tokens_total is not None]
    costs = [i.cost_usd for i in iterations if i.cost_usd is not None]
    durations = [i.duration_ms for i in iterations if i.duration_ms is not None]
    return {
        "tokens_input": sum(i.tokens_input or 0 for i in iterations),
        "tokens_output": sum(i.tokens_output or 0 for i in iterations),
        "tokens_total": sum(tokens) if tokens else None,
        "cost_usd": sum(costs) if costs else None,
        "duration_ms": sum(durations) if durations else None,
    }


def _children(journal: Journal, run_id: str, depth: int = 0) -> list[dict[str, Any]]:
    """The run's child runs as a tree (each with its own children), oldest first."""
    if depth > 8:  # a cycle cannot happen (a child is made after its parent); depth is a guard
        return []
    return [
        {"run": child, "children": _children(journal, child.run_id, depth + 1)}
        for child in reversed(journal.runs(parent_run_id=run_id))
    ]


def _spec(journal: Journal, run: RunRecord) -> MachineSpec:
    return _read_spec(journal.spec_json(run.spec_hash))


@functools.lru_cache(maxsize=8)
def _read_spec(text: str) -> MachineSpec:
    # Read once for every page that shows it (a spec of 10,000 states takes ~0.2 s to read),
    # and its answers (leaves, edges) found once too: a spec is immutable.
    return MachineSpec.from_json(text)


def run_path(
    journal: Journal, spec: MachineSpec, run: RunRecord, *, exact_up_to: int | None = None
) -> tuple[Graph, list[dict[str, Any]]]:
    """The run's path on its machine (as ``fsm-runner diagram --run``), and its sub-phase visits.

    A run of up to ``exact_up_to`` transitions is read whole, as the CLI reads it. A longer one
    is read as its moves and how often it took each (:meth:`Journal.transition_counts`: one
    grouped query instead of thousands of records): the same states visited, edges taken and
    counts, the same sub-phase attempts and restarts, from a few rows. (One difference: two
    guarded transitions with the same source, event and destination share their count.)
    """
    limit = EXACT_UP_TO if exact_up_to is None else exact_up_to
    if run.seq < limit:
        whole = journal.transitions(run.run_id, to_seq=run.seq)  # as the record has it
        return extract(spec, run=run, timeline=whole), subphase_visits(spec, whole)
    moves = journal.transition_counts(run.run_id)
    records = [
        TransitionRecord(run.run_id, last, source, event, dest)
        for source, event, dest, _count, last in moves
    ]
    counts = [move[3] for move in moves]
    graph = extract(spec, run=run, timeline=records)
    weights = [0] * len(graph.edges)
    for taken, count in zip(taken_edges(spec, records), counts, strict=True):
        if taken is not None:  # the spec edge each move took (an extract per move was slow)
            weights[taken] += count
    engine = {(r.from_state, r.event, r.to_state): n for r, n in zip(records, counts, strict=True)}
    edges = [
        attrs.evolve(edge, count=engine.get((edge.source, edge.event, edge.dest), 0))
        if edge.kind == "engine"
        else attrs.evolve(edge, count=weights[index])
        for index, edge in enumerate(graph.edges)
    ]
    repeated = [record for record, n in zip(records, counts, strict=True) for _ in range(n)]
    return attrs.evolve(graph, edges=edges), subphase_visits(spec, repeated)


def diagram(journal: Journal, run: RunRecord) -> str:
    """The run's machine as SVG with its path drawn on it, as ``fsm-runner diagram --run``."""
    spec = _spec(journal, run)
    return render_svg(run_path(journal, spec, run)[0])


def fork_seq(run: RunRecord) -> int:
    """The seq a fork of the run is offered at: its last, or for an ended run the one before.

    A fork at an ended run's last seq would be ended too: ``fork`` refuses it.
    """
    return run.seq - 1 if run.ended and run.seq > 0 else run.seq


def _commands(run: RunRecord, journal: Journal) -> dict[str, str]:
    def command(*args: str) -> str:
        # The journal always named: the page may be read far from the shell it came from.
        return suggested_command("fsm-runner", journal.location, *args, name_journal=True)

    short = short_id(journal, run.run_id)  # quoted, as the line is pasted into a shell
    app = run.input.get("app") if isinstance(run.input, Mapping) else None
    commands = {"fork": command("fork", short, "--at", str(fork_seq(run)))}
    if not run.ended:
        commands["resume"] = command("resume", short, *(() if app else ("--app", "MODULE:ATTR")))
    return commands


def _forked_from(run: RunRecord) -> tuple[str, str] | None:
    """The run and the seq this run was forked from (``forked_from`` is ``RUN@SEQ``)."""
    if run.forked_from is None:
        return None
    source, _, seq = run.forked_from.rpartition("@")
    return (source, seq) if source and seq.isdigit() else (run.forked_from, "")


def run_facts(journal: Journal, run: RunRecord) -> dict[str, Any]:
    """What the run's summary and commands show beside the run: its page's, and once it ends."""
    return {
        "commands": _commands(run, journal),
        "fork_seq": fork_seq(run),
        "forked_from": _forked_from(run),
        "error": error_text(run.error),
        "input": clip(pretty_json(run.input)),
        "context": clip(pretty_json(dict(run.context))),
    }


def run_page(
    journal: Journal, run_id: str, *, from_seq: int | None, signal: int | None = None
) -> dict[str, Any]:
    """Everything the run page shows; the timeline one page long (the last one by default).

    ``signal``: the number of a signal just sent from the page, whose outcome it reports.
    """
    run = journal.load(run_id)
    spec = _spec(journal, run)
    last = max(run.seq - TIMELINE_PAGE + 1, 0)
    start = last if from_seq is None else min(max(from_seq, 0), last)
    # Rows up to the run's own seq, never past it: the run may move on between the two reads
    # (no snapshot spans them), and a row past the page's seq would come again from ``/live``.
    end = min(start + TIMELINE_PAGE - 1, run.seq)
    timeline = journal.transitions(run.run_id, from_seq=start, to_seq=end)
    graph, visits = run_path(journal, spec, run)
    iterations = journal.iterations(run.run_id)
    effects = journal.effects(run.run_id)
    signals = signal_rows(journal.signals(run.run_id))
    return {
        "run": run,
        "spec": spec,
        "timeline": timeline_rows(timeline),
        "page": {
            "start": start,
            "earlier": max(start - TIMELINE_PAGE, 0) if start > 0 else None,
            "later": start + TIMELINE_PAGE if start + TIMELINE_PAGE <= run.seq else None,
            "last": last,
            "is_last": start == last,
        },
        "diagram": render_svg(graph),
        "iterations": iterations,
        "totals": _totals(iterations),
        "subphases": visits,
        "effects": effects,
        "in_flight": sum(1 for e in effects if e.status.value == "in_flight"),
        "children": _children(journal, run.run_id),
        "artifacts": artifact_rows(journal.artifacts(run.run_id)),
        "page_rows": TIMELINE_PAGE,
        **run_facts(journal, run),
        "waiting": waiting_of(journal, spec, run),
        "signals": signals,
        "sent": next((s for s in signals if s["number"] == signal), None),
    }


def live_update(journal: Journal, run_id: str, after: int) -> dict[str, Any]:
    """What changed in a run since seq ``after``: new timeline rows, its state, the diagram.

    With its signals as they stand now (one arrives, or is consumed, between transitions too),
    and, when it moved, what it waits for now (``None``: it moved on; unchanged if it did not).
    Once it has ended, its summary and commands too (``facts``): the lease, the resume line,
    the fork's seq and the abort form change with the end.
    """
    run = journal.load(run_id)
    # One page of rows at most (the page keeps that many): a run that raced ahead of the
    # page's last poll is not sent whole.
    start = max(after + 1, run.seq - TIMELINE_PAGE + 1)
    # Up to the seq this answer reports (the run may have moved since it was loaded): the rows
    # past it come with the next poll, once.
    new = journal.transitions(run.run_id, from_seq=start, to_seq=run.seq) if run.seq > after else []
    spec = _spec(journal, run) if new else None
    return {
        "run": run,
        "rows": timeline_rows(new),
        "gap": bool(new) and new[0].seq > after + 1,  # rows between were left out
        "diagram": render_svg(run_path(journal, spec, run)[0]) if spec is not None else None,
        "moved": spec is not None,
        "waiting": waiting_of(journal, spec, run) if spec is not None else None,
        "signals": signal_rows(journal.signals(run.run_id)),
        "facts": run_facts(journal, run) if run.ended else None,
    }


def machine_page(journal: Journal, machine: str) -> dict[str, Any] | None:
    """A machine's diagram (its newest run's spec) with how many runs are in each state now."""
    newest = journal.runs(machine=machine, limit=1)
    if not newest:
        return None
    spec = _spec(journal, newest[0])
    counts = journal.run_counts(machine=machine)
    per_state: dict[str, dict[str, int]] = {}
    for (state, status), count in counts.items():
        per_state.setdefault(state, {})[status] = count
    terminal = set(spec.terminal_states)
    leaves = [s.name for s in spec.leaves]
    rows: list[dict[str, Any]] = [
        {
            "state": state,
            "terminal": state in terminal,
            "counts": per_state.get(state, {}),
            "total": sum(per_state.get(state, {}).values()),
        }
        for state in [*leaves, *sorted(set(per_state) - set(leaves))]
    ]
    badges = {str(row["state"]): int(row["total"]) for row in rows if row["total"]}
    return {
        "machine": machine,
        "spec": spec,
        "rows": rows,
        "total": sum(counts.values()),
        "diagram": render_svg(extract(spec), counts=badges),
        "spec_hash": newest[0].spec_hash,
    }


def check_page(job: CheckJob) -> dict[str, Any]:
    """What ``fsm-runner check`` reports, from the inspector's check job: running or ended."""
    percent = None
    if job.total:
        percent = min(100, round(100 * job.done / job.total))
    return {
        "job": job,
        "percent": percent,
        "started": _time(job.started_at),
        "ended": _time(job.ended_at),
    }
