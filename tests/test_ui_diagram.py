"""The inspector's diagrams can be read: nothing drawn on a label, no text out of its box (issue 32).

Every shipped machine (``tests.test_diagrams_golden.PRESETS``) and a 40-state one with
composites, back-edges and a wildcard, each with real runs in a real SQLite journal, is shown
by a real ``fsm-runner ui`` server in Debian's chromium: its machine page (a badge per state
with runs, one of them over 1,000) and the run page of its furthest run (the path drawn, edge
labels with counts). The browser's own boxes of what it drew are measured: no two texts
overlap, no edge label lies on a state, every state's label is inside its box and every
badge's count inside its badge. Laid out by Graphviz ``dot`` (installed by ``.ci/run``); the
built-in layout, for hosts without it, is held to the boxes.
"""

from __future__ import annotations

import shutil

import pytest

from fsm_runner import Engine, PhaseResult, SqliteJournal
from fsm_runner.diagrams import extract
from fsm_runner.ui.geometry import Box
from fsm_runner.ui.svg import _builtin
from tests.big_specs import big_spec
from tests.test_diagrams_golden import PRESETS, load_spec
from tests.ui_helpers import ARTIFACTS, Server

#: One worker runs the module: its module fixtures (journals, a server) are built once, not
#: once on each pytest-xdist worker that would otherwise take some of its tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui-diagram")]

SPECS = {stem: load_spec(path) for stem, path in PRESETS.items()}
SPECS["forty_states"] = big_spec(45, name="forty-states")  # 48 states, 121 transitions
#: Runs parked in the agent loop's first state: a badge of five characters.
MANY = 1_234
#: The run pages saved as screenshots for CI (each costs the browser more than the page).
SHOTS = ("agent_loop", "coordinator_session")

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
  for (const g of svg.querySelectorAll('g.edge'))
    out.edges.push({name: g.dataset.event, text: box(g.querySelector('text'))});
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
    """Every overlap of two texts or of a label and a state, every text out of its box."""
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
    return found


def _handlers(spec):
    """Handlers that take each state's transitions in turn: runs spread over the machine."""

    def step(ctx):
        events = spec.events_from(ctx.run.state)
        return PhaseResult(events[ctx.run.seq % len(events)])

    return dict.fromkeys(spec.handler_names, step)


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    """Each machine's runs: three moved 2, 5 and 9 steps; the agent loop's many parked."""
    path = tmp_path_factory.mktemp("diagram") / "journal.db"
    furthest = {}
    with SqliteJournal(path) as journal:
        for stem, spec in SPECS.items():
            guards = dict.fromkeys(spec.guard_names, lambda _run: True)
            with Engine(spec, handlers=_handlers(spec), guards=guards, journal=journal) as engine:
                for steps in (2, 5, 9):
                    run_id = engine.start({})
                    engine.run(run_id, max_steps=steps)
                furthest[stem] = run_id
                if stem == "agent_loop":
                    engine.start_many([{}] * MANY)
    return path, furthest


@pytest.fixture(scope="module")
def server(journal):
    server = Server(str(journal[0]))
    yield server
    server.stop()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    yield context.new_page()
    context.close()


def measured(page, url: str) -> dict:
    page.goto(url)
    page.wait_for_selector("svg.fsm g.node")
    return page.evaluate(MEASURE)


@pytest.mark.parametrize("stem", sorted(SPECS))
def test_machine_and_run_pages_have_nothing_drawn_over_a_label(server, journal, page, stem):
    if shutil.which("dot") is None:
        pytest.fail("Graphviz `dot` is not installed (.ci/run installs it)")
    spec = SPECS[stem]
    machine = measured(page, f"{server.url}/machines/{spec.name}")
    run = measured(page, f"{server.url}/runs/{journal[1][stem]}")
    assert machine["layout"] == run["layout"] == "graphviz"
    assert machine["badges"], "the machine page shows how many runs are in each state"
    assert any(edge["name"] for edge in run["edges"])
    assert problems(machine) == []
    assert problems(run) == []
    if stem == "agent_loop":
        assert f"{MANY:,}" in {badge["count"] for badge in machine["badges"]}
    ARTIFACTS.mkdir(exist_ok=True)
    if stem in SHOTS:
        page.screenshot(path=str(ARTIFACTS / f"run-of-{stem}.png"), full_page=True)


def test_the_checks_find_what_they_look_for():
    """The measure is not blind: a text over another, out of its box, on a state."""
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
    ]


@pytest.mark.parametrize("stem", sorted(SPECS))
def test_the_builtin_layout_keeps_every_text_in_its_box(stem):
    """Without Graphviz: no edge label on a state or on another label (boxes as drawn)."""
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


def _overlaps(a: Box, b: Box) -> bool:
    return overlap((a.x, a.y, a.w, a.h), (b.x, b.y, b.w, b.h))


@pytest.fixture(scope="module")
def server_without_dot(journal, tmp_path_factory):
    """A server on a host without Graphviz: ``dot`` is not on its PATH."""
    bare = tmp_path_factory.mktemp("bin")  # sys.executable runs the server: it needs no PATH
    server = Server(str(journal[0]), env={"PATH": str(bare)})
    yield server
    server.stop()


def test_a_host_without_dot_gets_the_builtin_layout_and_the_dot_for_the_page(server_without_dot):
    """``dot`` not on PATH: the server draws its built-in layout, and gives the page the DOT."""
    body = server_without_dot.get(f"/machines/{SPECS['agent_loop'].name}").body
    assert 'data-layout="builtin" data-dot="digraph layout {' in body
    assert '<g class="badge" data-state="queued">' in body
    assert 'data-layout-id="e0" data-stack="0 1"' in body
    viz = server_without_dot.get("/static/viz-global.js")
    assert viz.status == 200
    assert viz.body.startswith("/*!\nViz.js 3.31.0")


@pytest.mark.parametrize("stem", sorted(SPECS))
def test_without_dot_the_page_lays_it_out_with_graphviz_in_webassembly(
    server_without_dot, journal, page, stem
):
    """Viz.js in the page: the same Graphviz layout, nothing drawn over a label."""
    spec = SPECS[stem]
    url = f"{server_without_dot.url}/runs/{journal[1][stem]}"
    if stem == "agent_loop":  # its machine page: the badges move with their states
        url = f"{server_without_dot.url}/machines/{spec.name}"
    page.goto(url)
    page.wait_for_selector("svg.fsm[data-layout='viz'] g.node", timeout=20_000)
    drawn = page.evaluate(MEASURE)
    assert drawn["layout"] == "viz"
    assert problems(drawn) == []
    if stem == "agent_loop":
        assert f"{MANY:,}" in {badge["count"] for badge in drawn["badges"]}
