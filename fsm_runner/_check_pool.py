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
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["CHECK_CACHE_KIB", "CheckRange", "Found", "Problem", "check_ranges", "medium_checks"]

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
        result = check_range(journal, first, last, since, specs)
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
    return check_range(_journal[0], first, last, since, _specs)


def medium_checks(journal: Any, *, beside_pool: bool, nice: int = 0) -> Callable[[], list[str]]:
    """The journal's checks of its medium (``integrity_problems()``): a call that gives them.

    ``beside_pool`` (a pool of processes is starting to check the ranges): they run at once, in
    a process of their own (``nice`` added to its niceness) through the journal opened again
    there (``journal.opener()``), so SQLite's integrity check — 13-18 s of a 1,000,000-run
    journal — uses the core the pool leaves free while this process waits, and PostgreSQL's
    hash chains, computed in Python, do not hold this process's GIL (the inspector's pages
    waited on it: ``/runs`` up to 258 ms while 100,000 runs were checked). A check that fails
    meanwhile leaves that process to finish. Otherwise they run now. A journal without such
    checks gives none.
    """
    integrity = getattr(journal, "integrity_problems", None)
    if not callable(integrity):
        return list
    opener = getattr(journal, "opener", None)  # the method giving a journal's opener
    if not beside_pool or not callable(opener) or journal.location == ":memory:":
        found = [str(problem) for problem in integrity()]  # first, as a check in one process
        return lambda: found

    import concurrent.futures  # noqa: PLC0415 - only a parallel check needs them
    import multiprocessing  # noqa: PLC0415

    pool = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    )
    checking = pool.submit(_integrity_in_process, opener(), nice)
    pool.shutdown(wait=False)  # the process ends with the checks
    return checking.result


def _integrity_in_process(opener: Callable[[], Any], nice: int) -> list[str]:
    _lower_priority(nice)
    journal = opener()
    try:
        return [str(problem) for problem in journal.integrity_problems()]
    finally:
        journal.close()
