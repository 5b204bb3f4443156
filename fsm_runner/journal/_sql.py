"""What the SQL journals share: reads, row decoding, effects and the rows they bind.

:class:`SqlCore` is an object that :class:`~fsm_runner.journal.sqlite.SqliteJournal` and
:class:`~fsm_runner.journal.postgres.PostgresJournal` each hold. It does everything whose SQL
is the same on both but for what a :class:`SqlDialect` names (the placeholder, ``?`` or ``%s``,
the run table, how a time is stored); it reads and writes through the journal's connection
manager (:class:`SqlConnections`). What really differs stays with each dialect: the fenced
commit, claims, prune, reconnects.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs

from fsm_runner.exceptions import (
    JournalError,
    LeaseLostError,
    RunConflictError,
    RunNotFoundError,
)
from fsm_runner.journal import _rows
from fsm_runner.journal._digest import row_digest
from fsm_runner.journal.base import RunFilters
from fsm_runner.journal.search import JsonMatch, RunSearch
from fsm_runner.records import (
    ArtifactRecord,
    EffectRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    format_utc,
    structure,
)
from fsm_runner.spec import RunLifecycle

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["SqlConnections", "SqlCore", "SqlDialect", "bind_hot_path"]

T = TypeVar("T")

#: Run ids in one ``IN (...)`` list (under SQLite's oldest default limit of 999 variables).
_IDS_A_STATEMENT = 500
#: One run as a bulk read gives it: its id, then its transitions and row, or why they
#: cannot be read.
_EFFECT_COLUMNS = _rows.EFFECT_COLUMNS
_ITERATION_COLUMNS = _rows.ITERATION_COLUMNS
_ARTIFACT_COLUMNS = _rows.ARTIFACT_COLUMNS


def bind_hot_path(journal: object, cls: type, target: object, names: Sequence[str]) -> None:
    """Bind ``target``'s methods ``names`` on ``journal`` itself, in place of ``cls``'s own.

    ``cls``'s methods of those names only pass the call on to ``target``; bound on the
    instance, the engine's call per step goes straight to ``target`` (the call through the
    journal cost ~2 % of a sync step's instructions under callgrind: ~1,900 of ~91,000). A
    subclass of ``cls`` that overrides one keeps its own.
    """
    for name in names:
        if getattr(type(journal), name) is getattr(cls, name):
            setattr(journal, name, getattr(target, name))


@attrs.frozen
class SqlDialect:
    """What differs between the SQL journals in the SQL they share."""

    #: The placeholder for one parameter.
    mark: str
    #: The table of run rows that a read of the rows alone goes to (no view, no trigger).
    run_table: str
    #: The columns read for a run row.
    run_select: str
    #: The column that orders rows inserted in the same microsecond (insertion order).
    row_order: str
    #: The condition that selects one run's transitions through their key (one parameter:
    #: the run id).
    run_transitions: str
    #: The INSERT (or replace) of an effect, only while its run is at a seq (and, if given, a
    #: lease token): parameters are the effect's columns, run id, seq, token, token.
    put_effect: str
    #: A time as the dialect stores it.
    stamp: Callable[[dt.datetime], Any]
    #: The SQL (and its parameters) of "now" that an expired lease is older than.
    stale_bound: Callable[[], tuple[str, list[Any]]]
    #: The condition (and its parameters) that a run's input or context holds a value at a
    #: path: SQLite's ``json_extract``/``json_type``, PostgreSQL's ``jsonb``.
    json_match: Callable[[JsonMatch], tuple[str, list[Any]]]
    #: Listing's order (newest first): ``created_at`` then :attr:`row_order`, or (``False``)
    #: :attr:`row_order` alone, the order runs were stored in (SQLite: the run key, which its
    #: listing indexes are ordered by).
    list_by_created: bool = True
    #: The keys of the active runs, as a subquery, when listing them by status is better served
    #: by it than by ``status = 'active'`` (SQLite: the two partial indexes of its claims; its
    #: index by status holds the ended runs only).
    active_keys: str | None = None
    #: Whether an effect's row carries a digest of its values, bound after them in
    #: :attr:`put_effect` (SQLite's schema 11, PostgreSQL's 9).
    effect_digests: bool = False
    #: The condition that a run stands in a state, whose every parameter is that state, when a
    #: listing by state is better served by it than by ``state = ?`` (SQLite: the keys the ended
    #: runs' index and the claims' hold, instead of every run through the ``runs`` view;
    #: PostgreSQL: the columns those indexes hold, so the planner may read them or walk the
    #: listing's order until a page is full).
    state_match: str | None = None
    #: A machine's runs counted per ``(state, status)``, as rows that may name a pair more than
    #: once (summed), whose every parameter is the machine; ``None``: grouped from ``runs``.
    state_counts: str | None = None
    #: Listing in key order (SQLite): how many of the newest keys (below a page's keyset bound)
    #: a listing or capped count by state or active status reads first, before every run. Those
    #: filters are index-served through every matching run's key (``active_keys``,
    #: ``state_match``): two thirds of 1,000,000 runs active, a page read 666,000 keys (110 ms,
    #: and as much for its count) where the newest few hundred rows held it. 0: never.
    newest_window: int = 0


class SqlConnections(Protocol):
    """What :class:`SqlCore` asks of a journal's connection manager."""

    @property
    def location(self) -> str:
        """Where the journal lives, for messages."""

    def select(
        self, query: str, params: Sequence[Any], *, damaged: bool = False
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run a read; return its column names and rows.

        ``damaged``: a read of tables alone, allowed even when the journal's view is damaged.
        """

    def writing(self, work: Callable[[Any], T]) -> T:
        """Run ``work`` with the connection, as one short write.

        SQLite: inside one ``BEGIN IMMEDIATE`` transaction; PostgreSQL: in autocommit mode,
        getting a lost connection back and trying again.
        """


def _run_filters(
    dialect: SqlDialect,
    *,
    machine: str | None = None,
    status: RunLifecycle | str | None = None,
    parent_run_id: str | None = None,
    state: str | None = None,
    run_id_prefix: str | None = None,
    search: RunSearch | None = None,
) -> tuple[list[str], list[Any]]:
    """The WHERE conditions of a listing by :class:`~fsm_runner.journal.base.RunFilters`."""
    m = dialect.mark
    where: list[str] = []
    params: list[Any] = []
    status = RunLifecycle(status).value if status is not None else None
    if state is not None and dialect.state_match is not None:
        where.append(dialect.state_match)
        params += [state] * dialect.state_match.count(m)
        state = None
    if status is not None and dialect.active_keys is not None:
        if status == RunLifecycle.ACTIVE.value:
            where.append(f"{dialect.row_order} IN ({dialect.active_keys})")
            status = None
        else:  # the index of the ended runs by status is partial: say this is one
            where.append("status != 'active'")
    for column, value in (
        ("machine", machine),
        ("status", status),
        ("parent_run_id", parent_run_id),
        ("state", state),
    ):
        if value is not None:
            where.append(f"{column} = {m}")
            params.append(value)
    if run_id_prefix:
        where.append(f"run_id >= {m} AND run_id < {m}")
        params += [run_id_prefix, run_id_prefix + "\U0010ffff"]
    if search is not None:
        for bound, sign in ((search.created_from, ">="), (search.created_before, "<")):
            if bound is not None:
                where.append(f"created_at {sign} {m}")
                params.append(dialect.stamp(bound))
        if search.json is not None:
            condition, values = dialect.json_match(search.json)
            where.append(condition)
            params += values
    return where, params


def _newest_window(
    dialect: SqlDialect, filters: RunFilters, *, before: str | None, size: int = 0
) -> tuple[list[str], list[Any]] | None:
    """The conditions (and parameters) of a read of the newest keys first, if one is due.

    Only for a listing by state or of the active runs (see ``newest_window``), with no
    filter besides a machine: those filters as plain conditions (read along the keys, not
    through every matching run's key), and the newest ``newest_window`` keys below the
    page's keyset bound (at least ``size`` of them).
    """
    if not dialect.newest_window:
        return None
    size, key = max(dialect.newest_window, size), dialect.row_order
    given = {name for name, value in filters.items() if value is not None}
    status = filters.get("status")
    wanted = "state" in given or (
        status is not None and RunLifecycle(status) is RunLifecycle.ACTIVE
    )
    if not wanted or given - {"state", "status", "machine"}:
        return None
    plain = attrs.evolve(dialect, active_keys=None, state_match=None)
    where, params = _run_filters(plain, **filters)
    table, m = dialect.run_table, dialect.mark
    if before is None:
        where.append(f"{key} > (SELECT max({key}) FROM {table}) - {int(size)}")
    else:
        where.append(f"{key} > (SELECT {key} FROM {table} WHERE run_id = {m}) - {int(size)}")
        params.append(before)
    return where, params


class SqlCore:
    """The part of a SQL journal that is the same in every dialect (see the module).

    Args:
        dialect: the SQL that differs.
        connections: the journal's connection manager.
    """

    def __init__(self, dialect: SqlDialect, connections: SqlConnections) -> None:
        self.dialect = dialect
        self._connections = connections
        self._select = connections.select
        self._stamp = dialect.stamp

    @property
    def location(self) -> str:
        """Where the journal lives, for messages."""
        return self._connections.location

    def release_many(self, leases: Sequence[tuple[str, int]], owner: str) -> dict[str, str | None]:
        """Give up the ``(run_id, token)`` leases ``owner`` holds, in one write (``Journal``).

        SQLite: one transaction; PostgreSQL: one pipelined batch (releasing again after a lost
        connection is harmless: only the owner's own token matches). Then each run's abort
        reason, read in the same write.
        """
        m, table = self.dialect.mark, self.dialect.run_table

        def work(conn: Any) -> dict[str, str | None]:
            conn.cursor().executemany(
                f"UPDATE {table} SET lease_owner = NULL, lease_expires_at = NULL"
                f" WHERE run_id = {m} AND lease_owner = {m} AND lease_token = {m}",
                [(run_id, owner, token) for run_id, token in leases],
            )
            found: dict[str, str | None] = {}
            for start in range(0, len(leases), _IDS_A_STATEMENT):
                run_ids = [run_id for run_id, _ in leases[start : start + _IDS_A_STATEMENT]]
                marks = ", ".join([m] * len(run_ids))
                query = f"SELECT run_id, abort_reason FROM {table} WHERE run_id IN ({marks})"
                found.update(conn.execute(query, run_ids).fetchall())
            return {run_id: found.get(run_id) for run_id, _ in leases}

        return self._connections.writing(work)

    def require_run(self, conn: Any, run_id: str) -> None:
        """Raise :class:`RunNotFoundError` unless the run's row exists (read on ``conn``)."""
        dialect = self.dialect
        found = conn.execute(
            f"SELECT 1 FROM {dialect.run_table} WHERE run_id = {dialect.mark}", (run_id,)
        ).fetchone()
        if found is None:
            raise RunNotFoundError(run_id)

    def lease_lost(self, conn: Any, run_id: str, token: int) -> LeaseLostError:
        """The error for a lease no longer held with ``token`` (read on ``conn``).

        Raises:
            RunNotFoundError: there is no such run.
        """
        self.require_run(conn, run_id)
        return LeaseLostError(run_id, token=token)

    def refuse_malformed(self, run: RunRecord, transition: TransitionRecord) -> None:
        """Refuse a commit whose run row does not follow from its transition, or of seq 0."""
        if run.seq != transition.seq or run.state != transition.to_state:
            raise ValueError("run.seq and run.state must equal the transition's seq and to_state")
        if transition.seq < 1:  # seq 0 is written by create_run only
            dialect = self.dialect
            _, found = self._select(
                f"SELECT 1 FROM {dialect.run_table} WHERE run_id = {dialect.mark}", (run.run_id,)
            )
            if not found:
                raise RunNotFoundError(run.run_id)
            raise RunConflictError(
                run_id=run.run_id, expected_seq=transition.seq - 1, path=self.location
            )

    # -- rows ----------------------------------------------------------------------------------

    def run_params(self, run: RunRecord) -> tuple[Any, ...]:
        return _rows.run_params(run, _rows.RUN_COLUMNS, self._stamp)

    def transition_params(self, transition: TransitionRecord) -> tuple[Any, ...]:
        return _rows.transition_params(transition, self._stamp)

    def iteration_params(self, record: IterationRecord) -> tuple[Any, ...]:
        return _rows.iteration_params(record, self._stamp)

    def artifact_params(self, artifact: ArtifactRecord) -> tuple[Any, ...]:
        return _rows.artifact_params(artifact, self._stamp)

    def _loads(self, text: str | None) -> Any:
        if text is None:
            return None
        try:
            return json.loads(text)
        except (ValueError, TypeError) as exc:  # a row we cannot read must not be misread
            # (TypeError: a damaged record header made the column another type)
            raise JournalError(
                f"holds unreadable JSON ({exc}): {str(text)[:60]!r}", path=self.location
            ) from exc

    def _structure(self, data: dict[str, Any], cls: type[T]) -> T:
        try:
            return structure(data, cls)
        except Exception as exc:  # a row we cannot read must not be misread
            raise JournalError(
                f"has an unreadable {cls.__name__} row ({exc})", path=self.location
            ) from exc

    def decode_run(self, data: dict[str, Any]) -> RunRecord:
        """A run row, by column, as a record (its JSON parsed; SQLite's ``run_key`` dropped)."""
        data.pop("run_key", None)
        try:
            for column in _rows.RUN_JSON:
                data[column] = self._loads(data[column])
            if data["context"] is None:
                data["context"] = {}
            return structure(data, RunRecord)
        except Exception as exc:  # a row we cannot read must not be misread
            raise JournalError(
                f"run {data.get('run_id')!r} has an unreadable row ({exc})", path=self.location
            ) from exc

    def transition_records(
        self, names: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> list[TransitionRecord]:
        records = []
        for row in rows:
            data = dict(zip(names, row, strict=True))
            data.pop("run_key", None)  # SQLite's key of the run, not a field of the record
            if "result" not in data:  # a damaged schema renamed the column
                raise JournalError(
                    "has no 'result' column in its transitions (a damaged schema); 'fsm-runner"
                    " check' says what is damaged",
                    path=self.location,
                )
            data["result"] = self._loads(data["result"])
            records.append(self._structure(data, TransitionRecord))
        return records

    # -- bulk reads (check) --------------------------------------------------------------------

    def check_keys(self, key: str, *, since: dt.datetime | None) -> list[Any]:
        """Every run's ``key`` (the transitions' key of a run), in order (see the journals').

        With ``since``, of the runs updated at or after it: the ``runs`` view's (or table's)
        ``updated_at``; on SQLite the ended runs' from the index of their last updates and the
        active runs' from the claims' indexes, so the runs read are those checked and the active
        ones. Without, the run rows' key index alone.
        """
        m, params = self.dialect.mark, list[Any]()
        query = f"SELECT {key} FROM {self.dialect.run_table}"
        if since is not None:
            query, params = f"SELECT {key} FROM runs WHERE updated_at >= {m}", [self._stamp(since)]
            active = self.dialect.active_keys
            if active is not None:
                query = (
                    f"SELECT {key} FROM (SELECT {key} FROM {self.dialect.run_table}"
                    f" WHERE status != 'active' AND updated_at >= {m}"
                    f" UNION SELECT {key} FROM runs WHERE {key} IN ({active})"
                    f" AND updated_at >= {m})"
                )
                params *= 2
        _, rows = self._select(f"{query} ORDER BY {key}", params, damaged=since is None)
        return [row[0] for row in rows]

    # -- reads ---------------------------------------------------------------------------------

    def effect(self, run_id: str, visit_seq: int, name: str) -> EffectRecord | None:
        """Return the effect recorded under that name in that visit, if any."""
        m = self.dialect.mark
        found = self._effects(
            f"WHERE run_id = {m} AND visit_seq = {m} AND name = {m}", (run_id, visit_seq, name)
        )
        return found[0] if found else None

    def load(self, run_id: str) -> RunRecord:
        """Return the run's row (for the reads of what a run owns: a missing run is an error)."""
        dialect = self.dialect
        names, rows = self._select(
            f"SELECT {dialect.run_select} FROM runs WHERE run_id = {dialect.mark}", (run_id,)
        )
        if not rows:
            raise RunNotFoundError(run_id)
        return self.decode_run(dict(zip(names, rows[0], strict=True)))

    def effects(self, run_id: str) -> list[EffectRecord]:
        """Return the run's effects, in the order they were started."""
        self.load(run_id)
        return self._effects(
            f"WHERE run_id = {self.dialect.mark} ORDER BY started_at NULLS FIRST, rowid", (run_id,)
        )

    def _effects(self, where: str, params: Sequence[Any]) -> list[EffectRecord]:
        _, rows = self._select(f"SELECT {', '.join(_EFFECT_COLUMNS)} FROM effects {where}", params)
        records = []
        for row in rows:
            data = _rows.decode_effect(dict(zip(_EFFECT_COLUMNS, row, strict=True)), self._loads)
            records.append(self._structure(data, EffectRecord))
        return records

    def iteration(self, run_id: str, iteration: int) -> IterationRecord | None:
        """Return the run's record of that iteration, if there is one."""
        m = self.dialect.mark
        records = self._iterations(f"WHERE run_id = {m} AND iteration = {m}", (run_id, iteration))
        return records[0] if records else None

    def iterations(self, run_id: str) -> list[IterationRecord]:
        """Return the run's iteration records, in iteration order."""
        self.load(run_id)
        return self._iterations(f"WHERE run_id = {self.dialect.mark} ORDER BY iteration", (run_id,))

    def _iterations(self, where: str, params: Sequence[Any]) -> list[IterationRecord]:
        _, rows = self._select(
            f"SELECT {', '.join(_ITERATION_COLUMNS)} FROM iterations {where}", params
        )
        records = []
        for row in rows:
            data = _rows.decode_iteration(
                dict(zip(_ITERATION_COLUMNS, row, strict=True)), self._loads
            )
            records.append(self._structure(data, IterationRecord))
        return records

    def artifacts(self, run_id: str) -> list[ArtifactRecord]:
        """Return the run's artifacts, in the order they were committed."""
        self.load(run_id)
        _, rows = self._select(
            f"SELECT {', '.join(_ARTIFACT_COLUMNS)} FROM artifacts"
            f" WHERE run_id = {self.dialect.mark} ORDER BY id",
            (run_id,),
        )
        records = []
        for row in rows:
            data = dict(zip(_ARTIFACT_COLUMNS, row, strict=True))
            data["content"] = self._loads(data["content"])
            records.append(self._structure(data, ArtifactRecord))
        return records

    def runs(
        self,
        *,
        limit: int | None = None,
        effect_in_flight: bool = False,
        stale: bool = False,
        before: str | None = None,
        after: str | None = None,
        by_update: bool = False,
        by_created: bool = False,
        **filters: Unpack[RunFilters],
    ) -> list[RunRecord]:
        """Return runs, newest first, filtered by machine, status, parent and state.

        Newest first: by ``created_at`` (PostgreSQL, memory) or in the order the runs were
        stored (SQLite, whose listing indexes are in key order; the same but for runs stored
        with an older ``created_at``, as a copy of another journal's).

        ``effect_in_flight``: runs with an effect caught in flight; ``stale``: active runs whose
        lease has expired; ``run_id_prefix``: ids that start with it; ``before``: the runs
        listed after that run (a keyset page: the index is read from there, whatever page);
        ``after``: the ``limit`` runs listed just before that run (the previous page: the index
        read the other way from there, the page then turned newest first); ``search``: runs
        started in a time range, or holding a value in their input or context; ``by_update``:
        the last updated first instead (sorted: no index holds every run's last update, which
        moves with each step; meant for a filtered few); ``by_created``: by ``created_at``
        where the dialect lists in key order (SQLite, when its search index serves the search's
        time range).
        """
        m = self.dialect.mark
        where, params = _run_filters(self.dialect, **filters)
        if effect_in_flight:
            where.append("run_id IN (SELECT run_id FROM effects WHERE status = 'in_flight')")
        if stale:
            now, now_params = self.dialect.stale_bound()
            where.append(
                f"status = 'active' AND lease_owner IS NOT NULL AND lease_expires_at < {now}"
            )
            params += now_params
        order = [self.dialect.row_order]
        if by_update:
            order.insert(0, "updated_at")
        elif self.dialect.list_by_created or by_created:
            order.insert(0, "created_at")
        simple = after is None and len(order) == 1 and not (effect_in_flight or stale)
        window = _newest_window(self.dialect, filters, before=before) if simple else None
        self._keyset(where, params, order, before=before, after=after, view=by_update)
        query = f"SELECT {self.dialect.run_select} FROM runs"
        if where:
            query += " WHERE " + " AND ".join(where)
        way = "ASC" if after is not None else "DESC"
        tail = " ORDER BY " + ", ".join(f"{column} {way}" for column in order)
        if limit is not None:
            tail += f" LIMIT {m}"
            params.append(int(limit))
        rows: list[tuple[Any, ...]] = []
        if window is not None and limit is not None:  # the newest keys first (see newest_window)
            near, near_params = window
            self._keyset(near, near_params, order, before=before, after=None)
            near_query = f"SELECT {self.dialect.run_select} FROM runs WHERE {' AND '.join(near)}"
            names, rows = self._select(near_query + tail, [*near_params, int(limit)])
            if len(rows) < limit:
                rows = []
        if not rows:
            names, rows = self._select(query + tail, params)
        found = [self.decode_run(dict(zip(names, row, strict=True))) for row in rows]
        if after is not None:
            found.reverse()  # newest first, as every listing
        return found

    def count_runs(self, *, at_most: int | None = None, **filters: Unpack[RunFilters]) -> int:
        """How many runs :meth:`runs` would list with these filters (at most ``at_most``)."""
        where, params = _run_filters(self.dialect, **filters)
        # (a window four times the cap: found full when a quarter of the runs match)
        window = (
            _newest_window(self.dialect, filters, before=None, size=4 * at_most)
            if at_most
            else None
        )
        if window is not None and at_most is not None:  # the newest keys hold the cap, often
            capped = self._count(*window, at_most)
            if capped >= at_most:
                return capped
        return self._count(where, params, at_most)

    def _count(self, where: list[str], params: list[Any], at_most: int | None) -> int:
        query = "SELECT 1 FROM runs" + (" WHERE " + " AND ".join(where) if where else "")
        if at_most is not None:
            query += f" LIMIT {self.dialect.mark}"
            params = [*params, int(at_most)]
        _, rows = self._select(f"SELECT count(*) FROM ({query}) AS counted", params)
        return int(rows[0][0])

    def _keyset(
        self,
        where: list[str],
        params: list[Any],
        order: list[str],
        *,
        before: str | None,
        after: str | None,
        view: bool = False,
    ) -> None:
        """Add a keyset page's conditions: the runs listed after ``before``, before ``after``.

        ``view``: the bound run's key read through the ``runs`` view (its ``updated_at`` is
        its head's there), not from the run rows alone.
        """
        key = ", ".join(order)
        table = "runs" if view else self.dialect.run_table
        for bound, sign in ((before, "<"), (after, ">")):
            if bound is not None:
                where.append(
                    f"({key}) {sign} (SELECT {key} FROM {table} WHERE run_id = {self.dialect.mark})"
                )
                params.append(bound)

    def run_counts(self, *, machine: str) -> dict[tuple[str, str], int]:
        """Return how many runs of ``machine`` there are per (state, status), now."""
        m, query = self.dialect.mark, self.dialect.state_counts
        if query is None:
            query = f"SELECT state, status, count(*) FROM runs WHERE machine = {m}"
            query += " GROUP BY state, status"
        _, rows = self._select(query, [machine] * query.count(m))
        counts: dict[tuple[str, str], int] = {}
        for state, status, count in rows:
            key = (str(state), str(status))
            counts[key] = counts.get(key, 0) + int(count)
        return counts

    def transition_counts(self, run_id: str) -> list[tuple[str | None, str, str, int, int]]:
        """How often the run took each move: ``(from, event, to, count, last seq)``, by last seq."""
        _, rows = self._select(
            "SELECT from_state, event, to_state, count(*), max(seq) FROM transitions"
            f" WHERE {self.dialect.run_transitions} GROUP BY from_state, event, to_state"
            " ORDER BY max(seq)",
            (run_id,),
        )
        return [(a, str(e), str(b), int(n), int(last)) for a, e, b, n, last in rows]

    def run_ids(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Return up to ``limit`` run ids that start with ``prefix``."""
        m = self.dialect.mark
        _, rows = self._select(
            f"SELECT run_id FROM {self.dialect.run_table} WHERE run_id >= {m} AND run_id < {m}"
            f" ORDER BY run_id LIMIT {m}",
            (prefix, prefix + "\U0010ffff", limit),
            damaged=True,  # the run rows alone: no view, no trigger
        )
        return [str(row[0]) for row in rows]

    def spec_json(self, spec_hash: str) -> str:
        """Return the canonical JSON of the spec with that hash."""
        _, rows = self._select(
            f"SELECT json FROM specs WHERE spec_hash = {self.dialect.mark}", (spec_hash,)
        )
        if not rows:
            raise JournalError(f"holds no spec {spec_hash[:12]}", path=self.location)
        return _rows.checked_spec_json(spec_hash, str(rows[0][0]), path=self.location)

    # -- effects -------------------------------------------------------------------------------

    def put_effect(
        self, record: EffectRecord, *, run_seq: int, lease_token: int | None = None
    ) -> None:
        """Store ``record`` in its own transaction, only while the run is at ``run_seq``.

        It replaces the record of the same run, visit and name, if there is one.

        Raises:
            RunConflictError: the run moved on (another writer advanced it); nothing written.
            LeaseLostError: ``lease_token`` is no longer the run's; nothing written.
        """
        values = _rows.effect_params(record, self._stamp)
        if self.dialect.effect_digests:  # over its times as text (PostgreSQL binds datetimes)
            covered = (
                values if self._stamp is format_utc else _rows.effect_params(record, format_utc)
            )
            values = (*values, row_digest(covered))
        params = (
            *values,
            record.run_id,
            run_seq,
            lease_token,
            lease_token,
        )

        def work(conn: Any) -> None:
            if conn.execute(self.dialect.put_effect, params).rowcount == 1:
                return
            found = conn.execute(
                f"SELECT seq, lease_token FROM runs WHERE run_id = {self.dialect.mark}",
                (record.run_id,),
            ).fetchone()
            if found is None:
                raise RunNotFoundError(record.run_id)
            if lease_token is not None and found[1] != lease_token:
                raise LeaseLostError(record.run_id, token=lease_token)
            raise RunConflictError(run_id=record.run_id, expected_seq=run_seq, path=self.location)

        self._connections.writing(work)  # writing the same record again is harmless
