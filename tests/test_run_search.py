"""Searching runs by their input and context, and by when they started; counting them (issue 32).

``Journal.runs(search=RunSearch(...))`` and ``Journal.count_runs`` on every journal (memory,
SQLite in a file, PostgreSQL): a value at a path of a run's input or context, compared with its
JSON type; a range of start times; both with the other filters and the keyset pages; counts
capped. ``JsonMatch.parse`` reads what the inspector's search box takes, and refuses the rest
with one line.
"""

from __future__ import annotations

import datetime as dt

import pytest

from fsm_runner import Engine
from fsm_runner.journal import JsonMatch, RunSearch
from tests.test_ui_pages import waiting_spec

ORDERS = [
    {"order": {"id": 42, "lines": ["a", "b"]}, "user": "ada", "express": True},
    {"order": {"id": "42", "lines": []}, "user": "bob", "express": False},
    {"order": {"id": 42.0}, "user": "ada", "note": None},
    {"order": {"id": 7}, "user": "cy"},
    {"user": "ada"},
]


@pytest.fixture
def runs(journal):
    """Five runs of ``orders`` (inputs above), then three of ``other`` with the same inputs."""
    ids = []
    with Engine(waiting_spec("orders"), handlers={}, journal=journal) as engine:
        ids += [engine.start(value) for value in ORDERS]
    with Engine(waiting_spec("other"), handlers={}, journal=journal) as engine:
        ids += [engine.start(value) for value in ORDERS[:3]]
    return ids


def found(journal, text, **filters):
    search = RunSearch(json=JsonMatch.parse(text))
    return [run.run_id for run in journal.runs(search=search, **filters)]


@pytest.mark.parametrize(
    ("text", "indexes"),
    [
        ("input.order.id = 42", [0, 2]),  # 42.0 is the number 42 in JSON
        ('input.order.id = "42"', [1]),  # the string is not the number
        ("input.user = ada", [0, 2, 4]),  # plain text: the string it spells
        ('input.order.lines[1] = "b"', [0]),
        ("input.order.lines[5] = 1", []),  # no such index: no match, no error
        ("input.express = true", [0]),  # true is not 1
        ("input.express = 1", []),
        ("input.note = null", [2]),  # a null is there; a missing key is not null
        ("input.nothing.here = 1", []),
    ],
)
def test_a_value_at_a_path_with_its_json_type(journal, runs, text, indexes):
    expected = [runs[i] for i in reversed(indexes)]  # newest first
    assert found(journal, text, machine="orders") == expected


def test_context_is_searched_too_and_other_filters_hold(journal, runs):
    with Engine(waiting_spec("orders"), handlers={}, journal=journal) as engine:
        engine.start({}, run_id="with-context")
    journal.load("with-context")  # started: its context is its initial one ({})
    assert found(journal, "context.anything = 1") == []
    everywhere = found(journal, "input.user = ada")
    assert len(everywhere) == 5  # both machines
    assert found(journal, "input.user = ada", machine="other") == [runs[7], runs[5]]
    assert found(journal, "input.user = ada", run_id_prefix=runs[0]) == [runs[0]]
    page = journal.runs(search=RunSearch(json=JsonMatch.parse("input.user = ada")), limit=2)
    rest = journal.runs(
        search=RunSearch(json=JsonMatch.parse("input.user = ada")), before=page[-1].run_id
    )
    assert [r.run_id for r in [*page, *rest]] == everywhere  # keyset pages as ever


def test_a_range_of_start_times(journal, runs):
    starts = {run.run_id: run.created_at for run in journal.runs()}
    middle = starts[runs[3]]
    later = RunSearch(created_from=middle)
    earlier = RunSearch(created_before=middle)
    assert {r.run_id for r in journal.runs(search=later)} == {
        i for i, at in starts.items() if at >= middle
    }
    assert {r.run_id for r in journal.runs(search=earlier)} == {
        i for i, at in starts.items() if at < middle
    }
    both = RunSearch(created_from=middle, created_before=middle + dt.timedelta(microseconds=1))
    assert runs[3] in {r.run_id for r in journal.runs(search=both)}
    assert journal.runs(search=RunSearch(created_from=middle + dt.timedelta(days=1))) == []


def test_counts_with_the_same_filters_capped(journal, runs):
    assert journal.count_runs() == 8
    assert journal.count_runs(machine="orders") == 5
    assert journal.count_runs(machine="orders", status="active") == 5
    assert journal.count_runs(machine="orders", status="succeeded") == 0
    ada = RunSearch(json=JsonMatch.parse("input.user = ada"))
    assert journal.count_runs(search=ada) == 5
    assert journal.count_runs(search=ada, at_most=3) == 3
    assert journal.count_runs(run_id_prefix=runs[0]) == 1
    assert journal.count_runs(state="waiting") == 8


def test_the_last_updated_first_with_its_pages(journal, runs):
    with Engine(waiting_spec("orders"), handlers={}, journal=journal) as engine:
        for index in (3, 0):
            engine.abort(runs[index], reason="moved on")  # updated now, in this order
    with Engine(waiting_spec("other"), handlers={}, journal=journal) as engine:
        engine.abort(runs[6], reason="moved on")
    untouched = [run_id for run_id in reversed(runs) if run_id not in (runs[3], runs[0], runs[6])]
    expected = [runs[6], runs[0], runs[3], *untouched]
    listed = journal.runs(by_update=True)
    assert [run.run_id for run in listed] == expected
    stamps = [run.updated_at for run in listed]
    assert stamps == sorted(stamps, reverse=True)
    first = journal.runs(by_update=True, limit=3)
    assert [run.run_id for run in first] == expected[:3]
    second = journal.runs(by_update=True, limit=3, before=first[-1].run_id)
    assert [run.run_id for run in second] == expected[3:6]
    back = journal.runs(by_update=True, limit=3, after=second[0].run_id)
    assert [run.run_id for run in back] == expected[:3]
    mine = journal.runs(by_update=True, machine="orders", status="aborted")
    assert [run.run_id for run in mine] == [runs[0], runs[3]]
    assert [run.run_id for run in journal.runs()][:3] == list(reversed(runs))[:3]  # as before


@pytest.mark.parametrize(
    "text",
    [
        "order.id = 42",  # not input or context
        "input = 42",  # no path
        "input.order.id",  # no value
        "input.order.id = [42]",  # not a scalar
        "input.order.id = {}",
        "input.9lives = 1",  # a key starts with a letter or _
        "input.a = NaN",
        "input.a'; DROP TABLE runs; -- = 1",
    ],
)
def test_what_the_search_box_refuses(text):
    with pytest.raises(ValueError, match=r"search as|compares|JSON value"):
        JsonMatch.parse(text)


def test_times_must_say_their_zone():
    with pytest.raises(ValueError, match="timezone-aware"):
        RunSearch(created_from=dt.datetime(2026, 1, 1))


def test_a_match_reads_back_as_written():
    match = JsonMatch.parse('context.files[0].name = "a.py"')
    assert (match.field, match.path, match.value) == ("context", ("files", 0, "name"), "a.py")
    assert str(match) == 'context.files[0].name = "a.py"'
    assert match.json_path == '$."files"[0]."name"'
