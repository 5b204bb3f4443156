"""The inspector's diagrams can be read: nothing drawn on a label, no text out of its box (issue 32).

Every shipped machine (``tests.test_diagrams_golden.PRESETS``), the agent loop with its approval
gate (``agent_loop_spec(approval=True)``: a waiting state, a run rejected once then approved)
and a 40-state one with composites, back-edges and a wildcard, each with real runs in a real
journal -- SQLite and PostgreSQL, each served by a real ``fsm-runner ui`` server -- is shown in
Debian's chromium: its machine page (a badge per state with runs, one of them over 1,000) and
the run page of its furthest run (the path drawn, edge labels with counts). The browser's own
boxes of what it drew are measured: no two texts overlap, no edge label lies on a state or a
badge, every state's label is inside its box and clear of its badge, every badge inside its
state's box and its count inside the badge. On either journal the badges (the runs in each
state) and the drawn path (each move with how often the run took it) are what a memory journal
reads back of the same runs. Laid out by Graphviz ``dot`` (installed by ``.ci/run``); the
built-in layout, for hosts without it, is held to the same boxes in the browser with a badge of
85,000 on every state, and so is the page's own Graphviz in WebAssembly (over SQLite: it reads no more of the journal).
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from fsm_runner import Engine, MemoryJournal, PhaseResult
from fsm_runner.diagrams import extract
from fsm_runner.journal import Journal, open_journal
from fsm_runner.presets.agent_loop import APPROVE, REJECT, agent_loop_spec
from fsm_runner.ui import dot_layout
from fsm_runner.ui.geometry import Box
from fsm_runner.ui.svg import _builtin, render_svg
from tests.big_specs import big_spec
from tests.test_diagrams_golden import PRESETS, load_spec
from tests.ui_helpers import ARTIFACTS, Server, journal_location

#: One worker runs the module: its module fixtures (journals, servers) are built once, not
#: once on each pytest-xdist worker that would otherwise take some of its tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui-diagram")]

#: The agent loop with its approval gate: runs wait in ``awaiting_approval`` for a signal.
GATED = "agent_loop_approval"
SPECS = {stem: load_spec(path) for stem, path in PRESETS.items()}
SPECS[GATED] = agent_loop_spec(approval=True)
SPECS["forty_states"] = big_spec(45, name="forty-states")  # 48 states, 121 transitions
#: Runs parked in the agent loop's first state: a badge of five characters.
MANY = 1_234
#: Runs left waiting at the approval gate (with the two the steps leave there: a badge of 12).
AT_THE_GATE = 10
#: The run pages saved as screenshots for CI (each costs the browser more than the page).
SHOTS = ("agent_loop", "coordinator_session")
#: Over SQLite only: the page's own layout reads nothing more of the journal than the server's.
SQLITE_ONLY = pytest.mark.parametrize("site", ["sqlite"], indirect=True)

#: What the browser drew, as boxes in page pixels: texts by role, and the shapes they sit in.
MEASURE = """
() => {
  const svg = document.querySelector('svg.fsm');
  const box = (el) => { const r = el.getBoundingClientRect();
                        return [r.left, r.top, r.width, r.height]; };
  const out = {layout: svg.dataset.layout, nodes: [], edges: [], badges: [], titles: []};
  for (const g of svg.querySelectorAll('g.node')) {
    const shape = g.querySelector('rect:not(.outer)') || g.querySelector('circle');
    out.nodes.push({name: g.dataset.state, shape: box(shape), text: box(g.querySelector('text'))});
  }
  for (const g of svg.querySelectorAll('g.edge')) {
    const text = g.querySelector('text');
    out.edges.push({name: g.dataset.event, text: box(text), label: text.textContent,
                    traversed: g.classList.contains('traversed')});
  }
  for (const g of svg.querySelectorAll('g.badge'))
    out.badges.push({name: g.dataset.state, shape: box(g.querySelector('rect')),
                     text: box(g.querySelector('text')), count: g.textContent});
  for (const g of svg.querySelectorAll('g.composite'))
    out.titles.push({name: g.dataset.state, shape: box(g.querySelector('rect')),
                     text: box(g.querySelector('text'))});
  return out;
}
"""
#: Pixels two boxes may share (anti-aliasing), and a text may stand out of its box.
SLACK = 0.5


def overlap(a, b) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return (
        min(ax + aw, bx + bw) - max(ax, bx) > SLACK and min(ay + ah, by + bh) - max(ay, by) > SLACK
    )


def inside(inner, outer) -> bool:
    ix, iy, iw, ih = inner
    ox, oy, ow, oh = outer
    return (
        ix >= ox - SLACK
        and iy >= oy - SLACK
        and ix + iw <= ox + ow + SLACK
        and iy + ih <= oy + oh + SLACK
    )


def problems(drawn: dict) -> list[str]:
    """Every overlap of two texts or of a label and a state or badge, every text or badge out of
    its box."""
    found = []
    texts = [(f"state {n['name']}", n["text"]) for n in drawn["nodes"]]
    texts += [(f"edge {e['name']}", e["text"]) for e in drawn["edges"]]
    texts += [(f"badge {b['name']}", b["text"]) for b in drawn["badges"]]
    texts += [(f"title {t['name']}", t["text"]) for t in drawn["titles"]]
    for i, (one, a) in enumerate(texts):
        found += [f"{one} overlaps {other}" for other, b in texts[i + 1 :] if overlap(a, b)]
    for edge in drawn["edges"]:
        found += [
            f"edge {edge['name']} lies on state {node['name']}"
            for node in drawn["nodes"]
            if overlap(edge["text"], node["shape"])
        ]
    for kind in ("nodes", "badges", "titles"):
        found += [
            f"{kind[:-1]} {item['name']}'s text is not inside its box"
            for item in drawn[kind]
            if not inside(item["text"], item["shape"])
        ]
    states = {node["name"]: node["shape"] for node in drawn["nodes"]}
    for badge in drawn["badges"]:
        name, shape = badge["name"], badge["shape"]
        if name not in states or not inside(shape, states[name]):
            found.append(f"badge {name} is not inside its state's box")
        found += [
            f"{kind} {item['name']}'s label lies on badge {name}"
            for kind, items in (("edge", drawn["edges"]), ("state", drawn["nodes"]))
            for item in items
            if overlap(item["text"], shape)
        ]
    return found


def drawn_path(drawn: dict) -> Counter[str]:
    """The events of the edges drawn as the run's, with how often it took each (ending a label)."""
    path: Counter[str] = Counter()
    for edge in drawn["edges"]:
        if edge["traversed"]:
            taken = re.search(r"\N{MULTIPLICATION SIGN}(\d+)$", edge["label"])
            path[edge["name"]] += int(taken.group(1)) if taken else 0
    return path


def _handlers(spec, *, straight: bool = False):
    """Handlers that take each state's transitions in turn (runs spread over the machine), or
    ``straight`` its first (the agent loop's way to its approval gate)."""

    def step(ctx):
        events = spec.events_from(ctx.run.state)
        return PhaseResult(events[0 if straight else ctx.run.seq % len(events)])

    return dict.fromkeys(spec.handler_names, step)


class Site(NamedTuple):
    """A journal of every machine's runs and a server on it."""

    backend: str
    location: str
    server: Server
    #: The run of each machine whose pages are measured.
    furthest: dict[str, str]


class Reference(NamedTuple):
    """What every journal must read back of :func:`_fill`'s runs (its steps are the same on any
    journal): each machine's badges (state: its runs' count as shown) and its furthest run's
    events, with how often it took each."""

    badges: dict[str, dict[str, str]]
    paths: dict[str, Counter[str]]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def site(request, tmp_path_factory) -> Iterator[Site]:
    """Each machine's runs (see :func:`_fill`) in a journal, and ``fsm-runner ui`` on it."""
    directory = tmp_path_factory.mktemp("diagram")
    with journal_location(request, request.param, directory) as location:
        journal = open_journal(location)
        try:
            furthest = _fill(journal)
        finally:
            journal.close()
        server = Server(location)
        yield Site(request.param, location, server, furthest)
        server.stop()


@pytest.fixture(scope="module")
def reference() -> Reference:
    """The same runs in a memory journal, read back: not by the journal the server reads."""
    with MemoryJournal() as journal:
        furthest = _fill(journal)
        badges = {}
        for stem, spec in SPECS.items():
            held: Counter[str] = Counter()
            for (state, _status), count in journal.run_counts(machine=spec.name).items():
                held[state] += count
            badges[stem] = {state: f"{count:,}" for state, count in held.items()}
        paths = {
            stem: Counter(move.event for move in journal.transitions(run_id) if move.seq > 0)
            for stem, run_id in furthest.items()
        }
    return Reference(badges, paths)


def _fill(journal: Journal) -> dict[str, str]:
    """Each machine's runs: three moved 2, 5 and 9 steps; the agent loop's many parked; the
    approval gate's runs waiting there, and one rejected once then approved. Returns each
    machine's furthest run."""
    furthest = {}
    for stem, spec in SPECS.items():
        guards = dict.fromkeys(spec.guard_names, lambda _run: True)
        handlers = _handlers(spec, straight=stem == GATED)
        with Engine(spec, handlers=handlers, guards=guards, journal=journal) as engine:
            for steps in (2, 5, 9):
                furthest[stem] = engine.start({})
                engine.run(furthest[stem], max_steps=steps)
            if stem == GATED:
                furthest[stem] = _through_the_gate(engine)
            if stem == "agent_loop":
                engine.start_many([{}] * MANY)
    return furthest


def _through_the_gate(engine: Engine) -> str:
    """Runs left waiting at the approval gate, and one sent back once, then let through."""
    runs = [engine.start({}) for _ in range(AT_THE_GATE + 1)]
    for run_id in runs:
        engine.run(run_id)  # to the gate: it waits there
    engine.signal(runs[-1], REJECT, {"comment": "cover the empty task too"})
    engine.run(runs[-1])  # feedback, another build, back to the gate
    engine.signal(runs[-1], APPROVE)
    return runs[-1]


@pytest.fixture(scope="module")
def page(browser):
    """One page for the module's tests, each going to the page it measures: a context of its
    own for each test costs more (half a second on a busy host) than most of its tests."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    yield context.new_page()
    context.close()


def measured(page, url: str) -> dict:
    page.goto(url)
    page.wait_for_selector("svg.fsm g.node")
    return page.evaluate(MEASURE)


@pytest.mark.parametrize("stem", sorted(SPECS))
def test_machine_and_run_pages_have_nothing_drawn_over_a_label(site, reference, page, stem):
    if shutil.which("dot") is None:
        pytest.fail("Graphviz `dot` is not installed (.ci/run installs it)")
    spec, url = SPECS[stem], site.server.url
    machine = measured(page, f"{url}/machines/{spec.name}")
    run = measured(page, f"{url}/runs/{site.furthest[stem]}")
    assert machine["layout"] == run["layout"] == "graphviz"
    # What this journal reads back, as another reads the same runs: the runs in each state,
    # the run's moves and how often it took each.
    badges, path = reference.badges[stem], reference.paths[stem]
    assert {badge["name"]: badge["count"] for badge in machine["badges"]} == badges
    assert drawn_path(run) == path
    assert problems(machine) == []
    assert problems(run) == []
    if stem == "agent_loop":
        assert badges["queued"] == f"{MANY:,}"
    if stem == GATED:  # runs wait at the gate; the run went through it twice
        assert badges["awaiting_approval"] == f"{AT_THE_GATE + 2}"
        assert {REJECT: 1, APPROVE: 1, "BUILD_SUCCEEDED": 2}.items() <= path.items()
    if stem in SHOTS and site.backend == "sqlite":
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"run-of-{stem}.png"), full_page=True)


def test_the_checks_find_what_they_look_for():
    """The measure is not blind: a text over another, out of its box, on a state or a badge; a
    badge out of its state; the run's path read from its edges' labels."""
    node = {"name": "a", "shape": [0, 0, 100, 32], "text": [10, 10, 40, 14]}
    drawn = {
        "nodes": [node],
        "edges": [{"name": "GO", "text": [30, 15, 40, 14]}],  # on the state, and its text
        "badges": [{"name": "a", "shape": [200, 0, 20, 16], "text": [200, 0, 40, 16]}],
        "titles": [],
    }
    assert problems(drawn) == [
        "state a overlaps edge GO",
        "edge GO lies on state a",
        "badge a's text is not inside its box",
        "badge a is not inside its state's box",
    ]
    drawn = {
        "nodes": [{"name": "b", "shape": [0, 0, 100, 32], "text": [10, 9, 60, 14]}],
        "edges": [{"name": "STOP", "text": [80, 20, 30, 12]}],  # on the badge (and the state)
        "badges": [{"name": "b", "shape": [66, 8, 30, 16], "text": [84, 10, 10, 10]}],
        "titles": [],
    }
    assert problems(drawn) == [
        "edge STOP lies on state b",
        "edge STOP's label lies on badge b",
        "state b's label lies on badge b",  # their texts clear of each other
    ]
    edges = [
        {"name": "GO", "label": "GO \N{MULTIPLICATION SIGN}2", "traversed": True},
        {"name": "GO", "label": "GO [ready] \N{MULTIPLICATION SIGN}11", "traversed": True},
        {"name": "STOP", "label": "STOP", "traversed": False},
    ]
    assert drawn_path({"edges": edges}) == {"GO": 13}


@pytest.mark.parametrize("stem", sorted(SPECS))
def test_the_builtin_layout_keeps_every_text_in_its_box(stem, page, monkeypatch):
    """Without Graphviz: no edge label on a state or on another label (boxes as laid out), and
    in the browser, with a badge of 85,000 on every state, no text over another (a
    composite's title included), every text in its box, every badge in its state's box and no
    label on a badge."""
    spec = SPECS[stem]
    graph = extract(spec)
    counts = {state.name: 85_000 for state in spec.leaves}
    drawing = _builtin(graph, counts)
    assert drawing.engine == "builtin"
    boxes = {n.name: drawing.boxes[n.name] for n in graph.nodes if n.name in drawing.boxes}
    for i, (edge, _path, label) in enumerate(drawing.edges):
        on = [name for name, box in boxes.items() if _overlaps(label, box)]
        on += [other.label for other, _, box in drawing.edges[i + 1 :] if _overlaps(label, box)]
        assert not on, f"{edge.label} on {on}"
    monkeypatch.setattr(dot_layout, "lay_out", lambda _graph, _counts: None)  # no `dot` here
    page.set_content(f"<!doctype html><body>{render_svg(graph, counts=counts)}</body>")
    drawn = page.evaluate(MEASURE)
    assert drawn["layout"] == "builtin"
    assert {badge["name"]: badge["count"] for badge in drawn["badges"]} == dict.fromkeys(
        counts, "85,000"
    )
    assert problems(drawn) == []


def _overlaps(a: Box, b: Box) -> bool:
    return overlap((a.x, a.y, a.w, a.h), (b.x, b.y, b.w, b.h))


@pytest.fixture(scope="module")
def server_without_dot(site, tmp_path_factory):
    """A server on a host without Graphviz: ``dot`` is not on its PATH."""
    bare = tmp_path_factory.mktemp("bin")  # sys.executable runs the server: it needs no PATH
    server = Server(site.location, env={"PATH": str(bare)})
    yield server
    server.stop()


@SQLITE_ONLY
def test_a_host_without_dot_gets_the_builtin_layout_and_the_dot_for_the_page(server_without_dot):
    """``dot`` not on PATH: the server draws its built-in layout, and gives the page the DOT."""
    body = server_without_dot.get(f"/machines/{SPECS['agent_loop'].name}").body
    assert 'data-layout="builtin" data-dot="digraph layout {' in body
    assert '<g class="badge" data-state="queued">' in body
    assert 'data-layout-id="e0" data-stack="0 1"' in body
    viz = server_without_dot.get("/static/viz-global.js")
    assert viz.status == 200
    assert viz.body.startswith("/*!\nViz.js 3.31.0")


@SQLITE_ONLY
@pytest.mark.parametrize("stem", sorted(SPECS))
def test_without_dot_the_page_lays_it_out_with_graphviz_in_webassembly(
    server_without_dot, site, page, stem
):
    """Viz.js in the page: the same Graphviz layout, nothing drawn over a label."""
    spec = SPECS[stem]
    url = f"{server_without_dot.url}/runs/{site.furthest[stem]}"
    if stem == "agent_loop":  # its machine page: the badges move with their states
        url = f"{server_without_dot.url}/machines/{spec.name}"
    page.goto(url)
    page.wait_for_selector("svg.fsm[data-layout='viz'] g.node", timeout=20_000)
    drawn = page.evaluate(MEASURE)
    assert drawn["layout"] == "viz"
    assert problems(drawn) == []
    if stem == "agent_loop":
        assert f"{MANY:,}" in {badge["count"] for badge in drawn["badges"]}
