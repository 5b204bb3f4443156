"""How ``check`` goes through a SQL journal: by ranges of runs in key order, in processes.

The runs are cut into ranges of ``chunk`` runs in the order of the transitions' primary key
(``run_key`` on SQLite, ``run_id`` on PostgreSQL), so each range is two reads in index order
(the journal's ``read_runs``). With ``jobs`` > 1 the ranges go to a pool of processes started
with ``spawn`` (no journal, no connection crosses a fork: each process opens the journal again
through ``journal.opener()``), each reading with a page cache of :data:`CHECK_CACHE_KIB`. What
checks a range is given (:func:`fsm_runner.replay.check_runs` gives its own), so this module
knows nothing of replay; the caller sorts the runs' problems, which come back per range.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fsm_runner.run_ids import shown

__all__ = [
    "CHECK_CACHE_KIB", "CheckRange", "Found", "Medium", "Problem", "check_ranges",
    "medium_checks", "report_lines",
]  # fmt: skip

#: The page cache of each connection a check reads with (KiB): with the journal's usual 16 MiB
#: a check of a million runs read 46 GB from a 1.17 GB file (issue 28).
CHECK_CACHE_KIB = 256 * 1024

#: What a run's check found: a line, or (what, why) when it cannot be read.
Problem = str | tuple[str, str]
#: The runs of a range that have a problem: (run id, problem).
Found = list[tuple[str, Problem]]
#: Checks the runs of one range: (journal, first key, last key, since, spec cache) → the
#: problems found and how many runs, or ``None`` when the range cannot be read in bulk.
CheckRange = Callable[
    [Any, Any, Any, "dt.datetime | None", dict[str, Any]], "tuple[Found, int] | None"
]
Progress = Callable[[int, int], None]
_SHOWN_RUNS = 3  # run ids named in a line about several runs


def check_ranges(
    journal: Any,
    check_range: CheckRange,
    *,
    since: dt.datetime | None,
    jobs: int,
    chunk: int,
    progress: Progress | None,
    on_pool: Callable[[], object] | None = None,
    nice: int = 0,
) -> tuple[Found | None, int]:
    """Check every run of ``journal`` (updated since ``since``) range by range.

    ``on_pool`` is called just before a pool of processes starts (if one does); ``nice`` is
    added to the niceness of its processes.

    Returns:
        The runs' problems (in range order) and how many runs were checked; ``None`` when
        the journal cannot be read in ranges (a damaged ``runs`` view): the caller then
        checks it run by run.
    """
    from fsm_runner.exceptions import FsmRunnerError  # noqa: PLC0415 - loaded with the package

    try:
        keys = journal.check_keys(since=since)
    except FsmRunnerError:
        return None, 0
    ranges = [(keys[i], keys[min(i + chunk, len(keys)) - 1]) for i in range(0, len(keys), chunk)]
    if jobs > 1 and len(ranges) > 1 and journal.location != ":memory:":
        if on_pool is not None:
            on_pool()
        opener = journal.opener()
        results = _in_pool(opener, check_range, ranges, since, jobs, len(keys), progress, nice)
    else:
        results = list(_in_process(journal, check_range, ranges, since, len(keys), progress))
    found: Found = []
    count = 0
    for result in results:
        if result is None:  # a range the journal could not read: check it all run by run
            return None, 0
        found += result[0]
        count += result[1]
    return found, count


def _in_process(  # noqa: PLR0917 - one private call shape
    journal: Any,
    check_range: CheckRange,
    ranges: Sequence[tuple[Any, Any]],
    since: dt.datetime | None,
    total: int,
    progress: Progress | None,
) -> Iterator[tuple[Found, int] | None]:
    _cache_for_scan(journal)
    specs: dict[str, Any] = {}
    for first, last in ranges:
        result = _collector_paused(check_range, journal, first, last, since, specs)
        if result is not None and progress is not None:
            progress(result[1], total)
        yield result


def _in_pool(  # noqa: PLR0917 - one private call shape
    opener: Callable[[], Any],
    check_range: CheckRange,
    ranges: Sequence[tuple[Any, Any]],
    since: dt.datetime | None,
    jobs: int,
    total: int,
    progress: Progress | None,
    nice: int,
) -> list[tuple[Found, int] | None]:
    import concurrent.futures  # noqa: PLC0415 - only a parallel check needs them
    import multiprocessing  # noqa: PLC0415

    with concurrent.futures.ProcessPoolExecutor(
        max_workers=min(jobs, len(ranges)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_open_journal,
        initargs=(opener, nice),
    ) as pool:
        futures = [
            pool.submit(_check_in_worker, check_range, first, last, since) for first, last in ranges
        ]
        try:
            if progress is not None:
                for future in concurrent.futures.as_completed(futures):
                    result = future.result()
                    progress(result[1] if result is not None else 0, total)
            return [future.result() for future in futures]
        except BaseException:
            # Stopped (``progress`` raised: a cancel, Ctrl-C): the ranges not yet begun are
            # dropped, so the pool's exit waits for the few being checked, not for them all.
            pool.shutdown(wait=False, cancel_futures=True)
            raise


_journal: list[Any] = []  # in a pool's process: the journal it opened for itself
_specs: dict[str, Any] = {}  # and the specs it read, by hash


def _lower_priority(nice: int) -> None:
    """Add ``nice`` to this process's niceness (a pool's or the medium's process)."""
    if nice and hasattr(os, "nice"):  # (not on Windows)
        os.nice(nice)


def _open_journal(opener: Callable[[], Any], nice: int) -> None:
    _lower_priority(nice)
    journal = opener()
    _cache_for_scan(journal)
    _journal.append(journal)


def _cache_for_scan(journal: Any) -> None:
    """Give ``journal`` the check's page cache, where it has one to set (SQLite)."""
    scan_cache = getattr(journal, "scan_cache", None)
    if callable(scan_cache):
        scan_cache(CHECK_CACHE_KIB)


def _check_in_worker(
    check_range: CheckRange, first: Any, last: Any, since: dt.datetime | None
) -> tuple[Found, int] | None:
    return _collector_paused(check_range, _journal[0], first, last, since, _specs)


def _collector_paused(  # noqa: PLR0917 - check_range's own arguments
    check_range: CheckRange,
    journal: Any,
    first: Any,
    last: Any,
    since: dt.datetime | None,
    specs: dict[str, Any],
) -> tuple[Found, int] | None:
    """``check_range``'s result, with the cyclic garbage collector paused while it runs.

    A range builds a few records a transition and keeps them to its end: the collector's
    passes over them cost ~6 % of a range's instructions and free nothing (a run's records
    hold no cycles; what a range drops is freed by its count). Left as it was found.
    """
    if not gc.isenabled():
        return check_range(journal, first, last, since, specs)
    gc.disable()
    try:
        return check_range(journal, first, last, since, specs)
    finally:
        gc.enable()


def report_lines(medium: list[str], found: Found) -> list[str]:
    """``check``'s lines: the medium's, then the runs' in the order of their ids.

    Runs that cannot be read for the same reason (what, why) are one line, where the first
    of them would be.
    """
    found.sort(key=lambda pair: pair[0])  # the order of the runs' ids, as run_ids lists them
    problems: list[Problem] = [_one_line(problem) for problem in medium]
    unreadable: dict[tuple[str, str], list[str]] = {}  # (what, why) -> the runs, in order
    for run_id, problem in found:
        if isinstance(problem, tuple):
            if problem not in unreadable:
                unreadable[problem] = []
                problems.append(problem)
            unreadable[problem].append(run_id)
        else:
            problems.append(_one_line(problem))
    return [
        problem if isinstance(problem, str) else _runs_line(unreadable[problem], *problem)
        for problem in problems
    ]


def _runs_line(run_ids: Sequence[str], what: str, why: str) -> str:
    """One line for runs that cannot be checked for the same reason."""
    if len(run_ids) == 1:
        return _one_line(f"run {shown(run_ids[0])}: {what}: {why}")
    named = ", ".join(shown(run_id) for run_id in run_ids[:_SHOWN_RUNS])
    more = f" and {len(run_ids) - _SHOWN_RUNS} more" if len(run_ids) > _SHOWN_RUNS else ""
    return _one_line(f"runs {named}{more}: {what}: {why}")


def _one_line(text: str) -> str:
    """``text`` on one line: a problem printed with newlines in it would read as several."""
    return " ".join(text.split())


class Medium:
    """The journal's checks of its medium, begun: call it for their lines; :meth:`stop` drops them.

    Made by :func:`medium_checks`: the lines found already, or a process of its own finding
    them, which :meth:`stop` ends (a check cancelled meanwhile: nothing waits for it, the
    inspector's exit included).
    """

    def __init__(
        self, found: list[str] | None = None, process: Any = None, pipe: Any = None
    ) -> None:
        self._found = found
        self._process = process
        self._pipe = pipe

    def __call__(self) -> list[str]:
        """The lines of the medium's checks (waiting for the process finding them)."""
        if self._found is None:
            try:
                outcome, value = self._pipe.recv()
            except EOFError:  # the process died without a word (killed): say so, not hang
                code = self._process.exitcode
                raise RuntimeError(f"the journal's medium checks ended ({code})") from None
            finally:
                self.stop()
            if outcome == "raised":
                raise value
            self._found = value
        return self._found

    def stop(self) -> None:
        """End the process finding the lines, if one is still at it, and wait for it."""
        process, self._process = self._process, None
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join()
            self._pipe.close()


def medium_checks(journal: Any, *, beside_pool: bool, nice: int = 0, chains: bool = True) -> Medium:
    """The journal's checks of its medium (``integrity_problems()``), begun.

    ``beside_pool`` (a pool of processes is starting to check the ranges): they run at once, in
    a process of their own (``nice`` added to its niceness) through the journal opened again
    there (``journal.opener()``), so SQLite's integrity check — 13-18 s of a 1,000,000-run
    journal — uses the core the pool leaves free while this process waits, and PostgreSQL's
    hash chains, computed in Python, do not hold this process's GIL (the inspector's pages
    waited on it: ``/runs`` up to 258 ms while 100,000 runs were checked). A check stopped
    meanwhile stops that process (:meth:`Medium.stop`). Otherwise they run now. A journal
    without such checks gives none. ``chains=False``: all but the runs' hash chains (a SQLite
    journal's, verified as a check reads each run).
    """
    integrity = getattr(journal, "integrity_problems", None)
    if not callable(integrity):
        return Medium([])
    options = {} if chains else {"chains": False}
    opener = getattr(journal, "opener", None)  # the method giving a journal's opener
    if not beside_pool or not callable(opener) or journal.location == ":memory:":
        # first, as a check in one process
        return Medium([str(problem) for problem in integrity(**options)])

    import multiprocessing  # noqa: PLC0415 - only a parallel check needs it

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(
        target=_integrity_in_process, args=(opener(), nice, options, send), daemon=True
    )
    process.start()
    send.close()  # (the child's end: this one sees EOF if the child dies)
    return Medium(process=process, pipe=receive)


def _integrity_in_process(
    opener: Callable[[], Any], nice: int, options: dict[str, bool], send: Any
) -> None:
    _lower_priority(nice)
    try:
        journal = opener()
        try:
            found = [str(problem) for problem in journal.integrity_problems(**options)]
        finally:
            journal.close()
    except Exception as exc:  # noqa: BLE001 - given to the caller, raised there
        send.send(("raised", exc))
    else:
        send.send(("found", found))
    finally:
        send.close()
