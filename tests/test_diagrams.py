"""Diagrams: Mermaid and Graphviz DOT from a spec, with a run's path drawn on it."""

from __future__ import annotations

import importlib
import itertools
import os
import pkgutil
import re
import shutil
import stat
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import attrs
import pytest

from fsm_runner import (
    RETURN,
    Engine,
    MachineSpec,
    PhaseStatus,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    State,
    Transition,
    TransitionRecord,
    Wait,
)
from fsm_runner import diagrams as diagrams_module
from fsm_runner.diagrams import (
    HISTORY,
    Composite,
    Edge,
    Graph,
    Node,
    extract,
    render,
    render_dot,
    render_image,
    render_mermaid,
    render_mermaid_flowchart,
    wait_duration,
)
from fsm_runner.exceptions import DiagramError
from fsm_runner.testing import FakeClock, ScriptedHandler
from fsm_runner.ui.svg import render_svg

from .test_public_api import isort_style_key

PHASE_COMPLETED = RunEvent.PHASE_COMPLETED.value
SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
USER_ABORTED = RunEvent.USER_ABORTED.value
LOST = "SERVER_LOST"
FOUND = "SERVER_FOUND"
TIMES = "\N{MULTIPLICATION SIGN}"

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")


# -- specs and runs --------------------------------------------------------------------------


def rich_spec(*, retry_a=None):
    """Every element a diagram draws.

    preparing -PREPARED-> working[1a, inner[end, c], d] -PHASE_COMPLETED-> done;
    preparing -SKIPPED [skippable]-> done; LOST anywhere in working -> recovering;
    recovering -FOUND [unless restarts_left]-> failed, else RETURN (back to the lost
    sub-phase); * -SYSTEM_ERROR-> failed, * -USER_ABORTED-> canceled. "1a" and "end" are
    names Mermaid cannot use as ids.
    """
    return MachineSpec(
        "rich",
        [
            State("preparing", handler="prepare", description="get ready"),
            State(
                "working",
                children=[
                    State("1a", handler="a", retry=retry_a),
                    State("inner", children=[State("end", handler="b"), State("c", handler="c")]),
                    State("d", handler="d"),
                ],
                description="the sub-phases",
            ),
            State("recovering", handler="recover"),
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
            State("canceled", terminal=True, outcome="aborted"),
        ],
        [
            Transition("preparing", "PREPARED", "working"),
            Transition("preparing", "SKIPPED", "done", guards=["skippable"]),
            Transition("working", PHASE_COMPLETED, "done"),
            Transition("working", LOST, "recovering"),
            Transition("recovering", FOUND, "failed", unless=["restarts_left"], reason="spent"),
            Transition("recovering", FOUND, RETURN),
            Transition("*", SYSTEM_ERROR, "failed"),
            Transition("*", USER_ABORTED, "canceled"),
        ],
    )


RICH_GUARDS = {"skippable": lambda run: False, "restarts_left": lambda run: True}


def rich_engine(journal, *, retry_a=None, **scripts):
    """An engine on rich_spec whose handlers play scripts (all complete by default)."""
    handlers = {name: ScriptedHandler(PhaseStatus.OK) for name in ("a", "b", "c", "d")}
    handlers["prepare"] = ScriptedHandler("PREPARED")
    handlers["recover"] = ScriptedHandler(FOUND)
    handlers.update({name: ScriptedHandler(*script) for name, script in scripts.items()})
    clock = FakeClock()
    return Engine(
        rich_spec(retry_a=retry_a),
        handlers=handlers,
        journal=journal,
        guards=RICH_GUARDS,
        clock=clock,
        sleep=clock.sleep,
    )


def finished(engine, run_id):
    """(spec, run, timeline) of a run, read back from the journal."""
    return engine.spec, engine.journal.load(run_id), engine.journal.transitions(run_id)


def failed_run_with_retries(journal):
    """1a fails twice (RETRIED x2) then completes; end loses the server and is returned to;
    c raises: SYSTEM_ERROR through the wildcard to failed."""
    boom = RuntimeError("boom")
    engine = rich_engine(
        journal,
        retry_a=RetryPolicy(max_attempts=3, wait_initial=0.1),
        a=(boom, boom, PhaseStatus.OK),
        b=(LOST, PhaseStatus.OK),
        c=(boom,),
    )
    run_id = engine.start()
    engine.run(run_id)
    return finished(engine, run_id)


def succeeded_run(journal):
    engine = rich_engine(journal)
    run_id = engine.start()
    engine.run(run_id)
    return finished(engine, run_id)


def path_of(timeline):
    return [(t.from_state, t.event, t.to_state) for t in timeline]


def counts(graph):
    """{(source, event, dest): count} of the edges the run took."""
    return {(e.source, e.event, e.dest): e.count for e in graph.edges if e.count}


# -- parsing the output back -----------------------------------------------------------------


@dataclass
class Link:
    index: int
    source: str  # the id as written
    dest: str
    label: str
    scope: str | None  # the id of the composite block it is written in


@dataclass
class Mermaid:
    title: str
    links: list[Link] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # id -> label (aliases)
    scopes: dict[str, str | None] = field(default_factory=dict)  # id -> block first named in
    composites: list[str] = field(default_factory=list)
    class_defs: dict[str, str] = field(default_factory=dict)
    classes: dict[str, set[str]] = field(default_factory=dict)  # class -> ids

    def name(self, ident):
        return self.labels.get(ident, ident)

    def named_links(self):
        """(source, dest, label) with ids read back as names (``[*]`` as is)."""
        return [(self.name(link.source), self.name(link.dest), link.label) for link in self.links]

    def id_of(self, name):
        found = [i for i in self.scopes if self.name(i) == name]
        assert len(found) == 1, (name, found)
        return found[0]

    def classed(self, name):
        return {self.name(i) for i in self.classes.get(name, set())}


MERMAID_ID = r"[A-Za-z_][A-Za-z0-9_]*"


def parse_mermaid(text):
    """Read our Mermaid back; any line outside the subset we write fails the test."""
    lines = text.splitlines()
    assert text.endswith("\n")
    assert lines[0] == "---"
    assert lines[2] == "---"
    assert lines[3] == "stateDiagram-v2"
    title = re.fullmatch(r"title: (.+)", lines[1])
    assert title, lines[1]
    parsed = Mermaid(title.group(1))
    stack: list[str | None] = [None]

    def name(ident):
        if ident != "[*]":
            assert re.fullmatch(MERMAID_ID, ident), ident
            parsed.scopes.setdefault(ident, stack[-1])

    for line in lines[4:]:
        text_line = line.strip()
        if m := re.fullmatch(rf'state "([^"]*)" as ({MERMAID_ID})', text_line):
            parsed.labels[m.group(2)] = m.group(1)
            name(m.group(2))
        elif m := re.fullmatch(rf"state ({MERMAID_ID}) \{{", text_line):
            name(m.group(1))
            parsed.composites.append(m.group(1))
            stack.append(m.group(1))
        elif text_line == "}":
            stack.pop()
        elif m := re.fullmatch(r"(\S+) --> (\S+)(?: : ([^:;]*))?", text_line):
            source, dest, label = m.groups()
            name(source)
            name(dest)
            parsed.links.append(Link(len(parsed.links), source, dest, label or "", stack[-1]))
        elif m := re.fullmatch(r"classDef (\w+) (\S+)", text_line):
            parsed.class_defs[m.group(1)] = m.group(2)
        elif m := re.fullmatch(r"class ([\w,]+) (\w+)", text_line):
            parsed.classes.setdefault(m.group(2), set()).update(m.group(1).split(","))
        elif re.fullmatch(MERMAID_ID, text_line):
            name(text_line)
        else:
            raise AssertionError(f"unexpected Mermaid line {line!r}")
    assert stack == [None], "unbalanced composite blocks"
    return parsed


@dataclass
class FlowLink:
    index: int
    source: str  # the id as written
    dest: str
    label: str
    dotted: bool
    scope: str | None  # the id of the subgraph it is written in


@dataclass
class Flowchart:
    title: str
    links: list[FlowLink] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # id -> label (nodes and subgraphs)
    shapes: dict[str, str] = field(default_factory=dict)  # id -> box, circle, double, plain
    scopes: dict[str, str | None] = field(default_factory=dict)  # id -> subgraph it is in
    subgraphs: list[str] = field(default_factory=list)
    class_defs: dict[str, str] = field(default_factory=dict)
    classes: dict[str, set[str]] = field(default_factory=dict)  # class -> ids
    link_styles: dict[str, set[int]] = field(default_factory=dict)  # style -> link indexes

    def name(self, ident):
        return self.labels[ident]

    def named_links(self):
        return [(self.name(link.source), self.name(link.dest), link.label) for link in self.links]

    def id_of(self, name):
        found = [i for i, label in self.labels.items() if label == name]
        assert len(found) == 1, (name, found)
        return found[0]

    def classed(self, name):
        return {self.name(i) for i in self.classes.get(name, set())}

    @property
    def traversed(self):
        return self.link_styles.get(TRAVERSED_STYLE, set())

    @property
    def untraversed(self):
        return self.link_styles.get(UNTRAVERSED_STYLE, set())


TRAVERSED_STYLE = "stroke:#1565c0,stroke-width:3px"
UNTRAVERSED_STYLE = "stroke:#9e9e9e"
FLOW_ID = r"(?:s_\w+|any_state|start_)"
_FLOW_SHAPES = [
    ("double", r'\(\(\("([^"]*)"\)\)\)'),
    ("circle", r'\(\("([^"]*)"\)\)'),
    ("box", r'\("([^"]*)"\)'),
    ("plain", r'\["([^"]*)"\]'),
]


def parse_flowchart(text):
    """Read our Mermaid flowchart back; any line outside the subset we write fails the test.

    Links are numbered in the order they are written, as Mermaid numbers them for linkStyle.
    """
    lines = text.splitlines()
    assert text.endswith("\n")
    assert lines[0] == "---"
    assert lines[2] == "---"
    assert lines[3] == "flowchart TD"
    title = re.fullmatch(r"title: (.+)", lines[1])
    assert title, lines[1]
    parsed = Flowchart(title.group(1))
    stack: list[str | None] = [None]

    def node_line(line):
        for shape, pattern in _FLOW_SHAPES:
            if m := re.fullmatch(rf"({FLOW_ID}){pattern}", line):
                return m.group(1), shape, m.group(2)
        return None

    for line in lines[4:]:
        text_line = line.strip()
        if m := re.fullmatch(rf'subgraph ({FLOW_ID}) \["([^"]*)"\]', text_line):
            assert m.group(1) not in parsed.labels, "declared twice"
            parsed.labels[m.group(1)] = m.group(2)
            parsed.scopes[m.group(1)] = stack[-1]
            parsed.subgraphs.append(m.group(1))
            stack.append(m.group(1))
        elif text_line == "end":
            stack.pop()
        elif node := node_line(text_line):
            ident, shape, label = node
            assert ident not in parsed.labels, "declared twice"
            parsed.labels[ident] = label
            parsed.shapes[ident] = shape
            parsed.scopes[ident] = stack[-1]
        elif m := re.fullmatch(
            rf'({FLOW_ID}) (-->|-\.->)(?:\|"([^"]*)"\|)? ?({FLOW_ID})', text_line
        ):
            source, arrow, label, dest = m.groups()
            link = FlowLink(
                len(parsed.links), source, dest, label or "", arrow == "-.->", stack[-1]
            )
            parsed.links.append(link)
        elif m := re.fullmatch(r"classDef (\w+) (\S+)", text_line):
            parsed.class_defs[m.group(1)] = m.group(2)
        elif m := re.fullmatch(r"class ([\w,]+) (\w+)", text_line):
            parsed.classes.setdefault(m.group(2), set()).update(m.group(1).split(","))
        elif m := re.fullmatch(r"linkStyle ([\d,]+) (\S+)", text_line):
            assert m.group(2) not in parsed.link_styles
            parsed.link_styles[m.group(2)] = {int(i) for i in m.group(1).split(",")}
        else:
            raise AssertionError(f"unexpected flowchart line {line!r}")
    assert stack == [None], "unbalanced subgraphs"
    for link in parsed.links:
        assert link.source in parsed.labels, f"undeclared {link.source}"
        assert link.dest in parsed.labels, f"undeclared {link.dest}"
    return parsed


def assert_path_styled(text, graph):
    """The linkStyle indexes are exactly the links of the edges the run took.

    Each written link is matched back to the graph's edges it draws (by the labels of its
    ends and its label, a merged self-loop drawing several); every edge is drawn by exactly
    one link; a link is styled as traversed iff one of its edges has a count, grey otherwise,
    and the start point's link is not styled.
    """
    flow = parse_flowchart(text)

    def label_of(name):
        node = graph.node(name)
        return node.label if node is not None else name

    drawn = {index: [] for index in range(len(graph.edges))}
    start = [link.index for link in flow.links if link.source == "start_"]
    assert len(start) == (1 if graph.initial else 0)
    expected = set()
    for link in flow.links:
        if link.source == "start_":
            assert flow.name(link.dest) == label_of(graph.initial)
            continue
        parts = link.label.split(", ")
        edges = [
            index
            for index, edge in enumerate(graph.edges)
            if (label_of(edge.source), label_of(edge.dest))
            == (flow.name(link.source), flow.name(link.dest))
            and edge.counted_label in parts
        ]
        assert len(edges) == len(parts), (link, edges)
        for index in edges:
            drawn[index].append(link.index)
        assert link.dotted == all(graph.edges[i].kind == "engine" for i in edges)
        if any(graph.edges[i].count for i in edges):
            expected.add(link.index)
    assert all(len(links) == 1 for links in drawn.values()), drawn
    assert flow.traversed == expected
    assert flow.untraversed == set(range(len(flow.links))) - expected - set(start)
    assert not set(start) & (flow.traversed | flow.untraversed)
    return flow


_Q = r'"((?:[^"\\]|\\.)*)"'


@dataclass
class Dot:
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    edges: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    clusters: dict[str, str | None] = field(default_factory=dict)  # cluster -> enclosing one
    cluster_of: dict[str, str | None] = field(default_factory=dict)  # node -> its cluster

    def edge(self, tail, head, label):
        found = [a for t, h, a in self.edges if (t, h, a.get("label")) == (tail, head, label)]
        assert len(found) == 1, (tail, head, label, self.edges)
        return found[0]


def _dot_attrs(text):
    return {k: v.replace('\\"', '"') for k, v in re.findall(rf"(\w+)={_Q}", text)}


def parse_dot(text):
    """Read our DOT back (one statement a line)."""
    parsed = Dot()
    stack: list[str | None] = [None]
    lines = text.splitlines()
    assert re.fullmatch(rf"digraph {_Q} \{{", lines[0]), lines[0]
    assert lines[-1] == "}"
    for line in lines[1:-1]:
        text_line = line.strip()
        if m := re.fullmatch(rf"subgraph {_Q} \{{", text_line):
            parsed.clusters[m.group(1)] = stack[-1]
            stack.append(m.group(1))
        elif text_line == "}":
            stack.pop()
        elif re.fullmatch(r"(graph|node|edge) \[.*\]", text_line):
            continue
        elif m := re.fullmatch(rf"{_Q} -> {_Q} \[(.*)\]", text_line):
            parsed.edges.append((m.group(1), m.group(2), _dot_attrs(m.group(3))))
        elif m := re.fullmatch(rf"{_Q} \[(.*)\]", text_line):
            parsed.nodes[m.group(1)] = _dot_attrs(m.group(2))
            parsed.cluster_of[m.group(1)] = stack[-1]
        else:
            raise AssertionError(f"unexpected DOT line {line!r}")
    assert stack == [None]
    return parsed


# -- a spec alone: Mermaid -------------------------------------------------------------------


class TestMermaidSpec:
    """A spec alone, drawn in Mermaid."""

    @pytest.fixture
    def mermaid(self):
        return parse_mermaid(render(rich_spec(), format="mermaid"))

    def test_front_matter_title_then_state_diagram(self):
        text = render(rich_spec())

        assert text.startswith("---\ntitle: rich\n---\nstateDiagram-v2\n")

    def test_initial_state_from_the_start_point(self, mermaid):
        starts = [link for link in mermaid.links if link.source == "[*]" and link.scope is None]

        assert [mermaid.name(link.dest) for link in starts] == ["preparing"]

    def test_every_terminal_state_and_only_those_go_to_the_end_point(self, mermaid):
        ends = [link for link in mermaid.links if link.dest == "[*]"]

        assert {mermaid.name(link.source) for link in ends} == {"done", "failed", "canceled"}
        assert all(link.scope is None and link.label == "" for link in ends)

    def test_guards_and_unless_guards_label_their_edges(self, mermaid):
        links = mermaid.named_links()

        assert ("preparing", "done", "SKIPPED [skippable]") in links
        assert ("recovering", "failed", "SERVER_FOUND [unless restarts_left]") in links

    def test_wildcard_transitions_are_drawn_once_from_a_star_node(self, mermaid):
        links = mermaid.named_links()

        assert ("*", "failed", SYSTEM_ERROR) in links
        assert ("*", "canceled", USER_ABORTED) in links
        assert [link for link in links if link[2] == SYSTEM_ERROR] == [
            ("*", "failed", SYSTEM_ERROR)
        ]
        assert [link for link in links if link[2] == USER_ABORTED] == [
            ("*", "canceled", USER_ABORTED)
        ]

    def test_composites_are_nested_blocks_holding_their_sub_phases(self, mermaid):
        scope = {mermaid.name(i): mermaid.name(s) if s else None for i, s in mermaid.scopes.items()}

        assert mermaid.composites == ["working", "inner"]
        assert scope["working"] is None
        assert scope["inner"] == "working"
        assert scope["1a"] == scope["d"] == scope["H*"] == "working"
        assert scope["end"] == scope["c"] == "inner"
        assert scope["preparing"] is scope["recovering"] is scope["done"] is None

    def test_each_composite_enters_its_first_sub_phase(self, mermaid):
        entries = {
            link.scope: mermaid.name(link.dest)
            for link in mermaid.links
            if link.source == "[*]" and link.scope is not None
        }

        assert entries == {"working": "1a", "inner": "end"}

    def test_advance_edges_join_consecutive_sub_phases_inside_their_composite(self, mermaid):
        advances = [
            (mermaid.name(link.source), mermaid.name(link.dest), link.scope)
            for link in mermaid.links
            if link.label == PHASE_COMPLETED and link.scope is not None
        ]

        assert advances == [
            ("end", "c", "inner"),
            ("1a", "inner", "working"),
            ("inner", "d", "working"),
        ]

    def test_composite_transitions_leave_the_composite_itself(self, mermaid):
        links = mermaid.named_links()

        assert ("working", "done", PHASE_COMPLETED) in links
        assert ("working", "recovering", LOST) in links
        assert ("preparing", "working", "PREPARED") in links

    def test_return_goes_to_a_history_node_in_the_composite_it_returns_into(self, mermaid):
        history = mermaid.id_of("H*")

        assert mermaid.scopes[history] == "working"
        assert ("recovering", "H*", FOUND) in mermaid.named_links()

    def test_names_mermaid_cannot_read_get_aliases(self, mermaid):
        one_a, end = mermaid.id_of("1a"), mermaid.id_of("end")

        assert one_a != "1a"
        assert end.lower() != "end"
        assert mermaid.labels[one_a] == "1a"
        assert mermaid.labels[end] == "end"
        text = render(rich_spec())
        assert not re.search(r"^\s*(1a|end)\b", text, flags=re.MULTILINE)

    def test_no_styles_without_a_run(self, mermaid):
        assert mermaid.class_defs == {}
        assert mermaid.classes == {}
        assert TIMES not in render(rich_spec())

    def test_a_transition_with_several_sources_is_an_edge_from_each(self):
        spec = MachineSpec(
            "multi",
            [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
            [
                Transition("a", "NEXT", "b"),
                Transition(["a", "b"], "FINISHED", "done"),
            ],
        )

        links = parse_mermaid(render(spec)).named_links()

        assert ("a", "done", "FINISHED") in links
        assert ("b", "done", "FINISHED") in links

    def test_a_composite_initial_state_is_entered_as_the_composite(self):
        spec = MachineSpec(
            "starts-inside",
            [
                State("phase", children=[State("x", handler="x"), State("y", handler="y")]),
                State("done", terminal=True),
            ],
            [Transition("phase", PHASE_COMPLETED, "done")],
        )

        mermaid = parse_mermaid(render(spec))

        assert ("[*]", "phase", "") in mermaid.named_links()
        assert mermaid.links[-1].dest == "[*]"

    def test_a_return_from_anywhere_goes_to_a_top_level_history_node(self):
        spec = MachineSpec(
            "anywhere",
            [
                State("a", handler="a"),
                State("b", handler="b"),
                State("pausing", handler="pause"),
                State("done", terminal=True),
            ],
            [
                Transition("a", "NEXT", "b"),
                Transition("b", "NEXT", "done"),
                Transition("*", "PAUSED", "pausing"),
                Transition("pausing", "RESUMED", RETURN),
            ],
        )

        graph = extract(spec)
        mermaid = parse_mermaid(render_mermaid(graph))

        history = graph.node(HISTORY)
        assert history is not None
        assert history.parent is None
        assert mermaid.scopes[mermaid.id_of("H*")] is None
        assert ("pausing", "H*", "RESUMED") in mermaid.named_links()

    def test_self_loops_of_one_state_are_one_link_listing_them_all(self):
        # Mermaid keeps only the last of several self-loops on one state.
        spec = MachineSpec(
            "loops",
            [State("waiting"), State("done", terminal=True)],
            [
                Transition("waiting", "PINGED", "waiting"),
                Transition("waiting", "POLLED", "waiting", guards=["due"]),
                Transition("waiting", "FINISHED", "done"),
                Transition("waiting", "NUDGED", "waiting"),
            ],
        )

        links = parse_mermaid(render(spec)).named_links()

        assert [link for link in links if link[0] == link[1] == "waiting"] == [
            ("waiting", "waiting", "PINGED, POLLED [due], NUDGED")
        ]
        assert links.index(("waiting", "waiting", "PINGED, POLLED [due], NUDGED")) < links.index(
            ("waiting", "done", "FINISHED")
        )
        dot = parse_dot(render(spec, format="dot"))
        assert [a["label"] for t, h, a in dot.edges if t == h == "waiting"] == [
            "PINGED",
            "POLLED [due]",
            "NUDGED",
        ]

    def test_a_state_diagram_never_has_link_styles(self, journal):
        # Mermaid's state diagrams have no linkStyle (flowchart syntax): Mermaid 11 reads a
        # linkStyle line in a stateDiagram-v2 as stray states. A run is drawn as a flowchart.
        spec, run, timeline = failed_run_with_retries(journal)
        graph = extract(spec, run=run, timeline=timeline)

        assert "linkStyle" not in render(spec)
        assert "linkStyle" not in render_mermaid(graph)
        assert render(spec, run=run, timeline=timeline) == render_mermaid_flowchart(graph)

    def test_a_spec_alone_is_still_a_state_diagram(self):
        text = render(rich_spec(), format="mermaid")

        assert text.splitlines()[3] == "stateDiagram-v2"
        assert text == render_mermaid(extract(rich_spec()))
        assert "flowchart" not in text


class TestMermaidIds:
    """Every state gets an id Mermaid reads as that one state."""

    @staticmethod
    def graph(*names, composites=()):
        nodes = [Node(name) for name in names]
        return Graph(
            "ids",
            nodes=nodes,
            composites=[Composite(c, children=[names[0]]) for c in composites],
            edges=[Edge(a, "NEXT", b) for a, b in itertools.pairwise(names)],
            initial=names[0],
        )

    @pytest.mark.parametrize(
        "name",
        [
            "1a",
            "end",
            "End",
            "default",
            "state",
            "class",
            "classDef",
            "note",
            "style",
            "root",
            "a-b",
            "a b",
            "día",
        ],
    )
    def test_names_mermaid_would_misread_are_aliased(self, name):
        mermaid = parse_mermaid(render_mermaid(self.graph("first", name)))

        ident = mermaid.id_of(name)
        assert ident != name
        assert ident.lower() not in {
            "end",
            "default",
            "state",
            "class",
            "classdef",
            "note",
            "style",
            "root",
        }
        assert ("first", name, "NEXT") in mermaid.named_links()

    @pytest.mark.parametrize("name", ["queued", "ended", "defaults", "classy", "Building_2"])
    def test_ordinary_names_are_their_own_ids(self, name):
        mermaid = parse_mermaid(render_mermaid(self.graph("first", name)))

        assert mermaid.id_of(name) == name
        assert name not in mermaid.labels

    def test_an_alias_never_takes_another_states_name(self):
        mermaid = parse_mermaid(render_mermaid(self.graph("s_1a", "1a")))

        assert len({mermaid.id_of("s_1a"), mermaid.id_of("1a")}) == 2
        assert mermaid.id_of("s_1a") == "s_1a"

    def test_names_of_mermaids_own_start_and_end_points_are_aliased(self):
        # Mermaid names a composite's start and end points <id>_start and <id>_end.
        graph = self.graph("a", "grp_start", "root_end", "grp_endless", composites=["grp"])

        mermaid = parse_mermaid(render_mermaid(graph))

        assert mermaid.id_of("grp_start") != "grp_start"
        assert mermaid.id_of("root_end") != "root_end"
        assert mermaid.id_of("grp_endless") == "grp_endless"

    def test_labels_and_title_stay_readable_by_mermaid(self):
        graph = Graph(
            "team: release; v2",
            nodes=[Node("a"), Node('say "hi"')],
            edges=[Edge("a", "DONE: ok; really", 'say "hi"')],
            initial="a",
        )

        text = render_mermaid(graph)
        mermaid = parse_mermaid(text)

        assert mermaid.title == '"team: release; v2"'
        (link,) = [link for link in mermaid.links if link.source == "a"]
        assert ":" not in link.label
        assert ";" not in link.label
        assert link.label.startswith("DONE")
        assert mermaid.labels[link.dest] == "say 'hi'"


class TestRenderersOnHandBuiltGraphs:
    """The renderers draw any graph, not only extracted ones."""

    GRAPH = Graph(
        "tiny",
        nodes=[
            Node("a", parent="box", visited=True),
            Node("b", parent="box", visited=True, current=True),
            Node("c", terminal=True),
            Node("*", kind="wildcard"),
        ],
        composites=[Composite("box", children=["a", "b"])],
        edges=[
            Edge("a", "NEXT", "b", kind="advance", count=2),
            Edge("box", "DONE", "c"),
            Edge("*", "FAILED", "c", wildcard=True),
            Edge("b", "RETRIED", "b", kind="engine", count=1),
        ],
        initial="box",
        has_run=True,
        order=["box", "a", "b", "c"],
    )

    def test_mermaid_text(self):
        assert render_mermaid(self.GRAPH) == (
            "---\n"
            "title: tiny\n"
            "---\n"
            "stateDiagram-v2\n"
            "    state box {\n"
            "        a\n"
            "        b\n"
            "        [*] --> a\n"
            f"        a --> b : NEXT {TIMES}2\n"
            f"        b --> b : RETRIED {TIMES}1\n"
            "    }\n"
            "    c\n"
            '    state "*" as any_state\n'
            "    [*] --> box\n"
            "    box --> c : DONE\n"
            "    any_state --> c : FAILED\n"
            "    c --> [*]\n"
            "    classDef visited fill:#e3f2fd,stroke:#1565c0\n"
            "    classDef current fill:#fff59d,stroke:#f57f17,stroke-width:3px\n"
            "    classDef failed fill:#ffcdd2,stroke:#c62828,stroke-width:3px\n"
            "    class a,b visited\n"
            "    class b current\n"
        )

    def test_mermaid_flowchart_text(self):
        assert render_mermaid_flowchart(self.GRAPH) == (
            "---\n"
            "title: tiny\n"
            "---\n"
            "flowchart TD\n"
            '    start_((" "))\n'
            '    subgraph s_box ["box"]\n'
            '        s_a("a")\n'
            '        s_b("b")\n'
            f'        s_a -->|"NEXT {TIMES}2"| s_b\n'
            f'        s_b -.->|"RETRIED {TIMES}1"| s_b\n'
            "    end\n"
            '    s_c((("c")))\n'
            '    any_state["*"]\n'
            "    start_ --> s_box\n"
            '    s_box -->|"DONE"| s_c\n'
            '    any_state -->|"FAILED"| s_c\n'
            "    classDef initial fill:#212121,stroke:#212121\n"
            "    classDef visited fill:#e3f2fd,stroke:#1565c0\n"
            "    classDef current fill:#fff59d,stroke:#f57f17,stroke-width:3px\n"
            "    classDef failed fill:#ffcdd2,stroke:#c62828,stroke-width:3px\n"
            "    class start_ initial\n"
            "    class s_a,s_b visited\n"
            "    class s_b current\n"
            "    linkStyle 0,1 stroke:#1565c0,stroke-width:3px\n"
            "    linkStyle 3,4 stroke:#9e9e9e\n"
        )
        assert_path_styled(render_mermaid_flowchart(self.GRAPH), self.GRAPH)

    def test_dot_statements(self):
        dot = parse_dot(render_dot(self.GRAPH))

        assert dot.clusters == {"cluster_box": None}
        assert dot.cluster_of["a"] == dot.cluster_of["b"] == "cluster_box"
        assert dot.nodes["c"]["shape"] == "doublecircle"
        assert dot.nodes["$initial"]["shape"] == "point"
        assert dot.edge("$initial", "a", "")["lhead"] == "cluster_box"
        assert dot.edge("b", "c", "DONE")["ltail"] == "cluster_box"  # from the last sub-phase
        assert dot.edge("a", "b", f"NEXT {TIMES}2")["penwidth"] == "2.5"
        assert dot.edge("b", "b", f"RETRIED {TIMES}1")["style"] == "dotted"
        assert dot.edge("*", "c", "FAILED")["style"] == "dashed"


# -- a spec alone: DOT -----------------------------------------------------------------------


class TestDotSpec:
    """A spec alone, drawn in DOT."""

    @pytest.fixture
    def dot(self):
        return parse_dot(render(rich_spec(), format="dot"))

    def test_terminal_states_are_double_circles(self, dot):
        shapes = {name: a["shape"] for name, a in dot.nodes.items()}

        assert {n for n, s in shapes.items() if s == "doublecircle"} == {
            "done",
            "failed",
            "canceled",
        }
        assert shapes["preparing"] == shapes["1a"] == "box"

    def test_a_point_node_points_at_the_initial_state(self, dot):
        assert dot.nodes["$initial"]["shape"] == "point"
        assert [(t, h) for t, h, _ in dot.edges if t == "$initial"] == [("$initial", "preparing")]

    def test_composites_are_nested_clusters(self, dot):
        assert dot.clusters == {"cluster_working": None, "cluster_inner": "cluster_working"}
        assert dot.cluster_of["1a"] == dot.cluster_of["d"] == "cluster_working"
        assert dot.cluster_of["end"] == dot.cluster_of["c"] == "cluster_inner"
        assert dot.cluster_of[f"{HISTORY}:working"] == "cluster_working"
        assert dot.nodes[f"{HISTORY}:working"]["label"] == "H*"

    def test_wildcards_are_drawn_once(self, dot):
        wild = [
            (t, h, a["label"])
            for t, h, a in dot.edges
            if a["label"] in (SYSTEM_ERROR, USER_ABORTED)
        ]

        assert wild == [("*", "failed", SYSTEM_ERROR), ("*", "canceled", USER_ABORTED)]

    def test_composite_edges_end_at_the_cluster_border(self, dot):
        assert dot.edge("preparing", "1a", "PREPARED")["lhead"] == "cluster_working"
        assert dot.edge("d", "done", PHASE_COMPLETED)["ltail"] == "cluster_working"
        assert dot.edge("1a", "end", PHASE_COMPLETED)["lhead"] == "cluster_inner"
        assert dot.edge("c", "d", PHASE_COMPLETED)["ltail"] == "cluster_inner"

    def test_guards_history_and_advance_edges(self, dot):
        assert dot.edge("preparing", "done", "SKIPPED [skippable]")
        assert dot.edge("recovering", "failed", "SERVER_FOUND [unless restarts_left]")
        assert dot.edge("recovering", f"{HISTORY}:working", FOUND)["style"] == "dashed"
        assert dot.edge("end", "c", PHASE_COMPLETED)

    def test_descriptions_are_tooltips(self, dot):
        assert dot.nodes["preparing"]["tooltip"] == "get ready"

    def test_no_run_no_colours(self, dot):
        assert not any("color" in a for _, _, a in dot.edges)
        assert not any("fillcolor" in a for a in dot.nodes.values())


# -- with a run ------------------------------------------------------------------------------


class TestExtractRun:
    """What a run's timeline marks on the graph."""

    def test_failed_run_with_retries(self, journal):
        spec, run, timeline = failed_run_with_retries(journal)
        assert path_of(timeline) == [
            (None, "STARTED", "preparing"),
            ("preparing", "PREPARED", "1a"),
            ("1a", "RETRIED", "1a"),
            ("1a", "RETRIED", "1a"),
            ("1a", PHASE_COMPLETED, "end"),
            ("end", LOST, "recovering"),
            ("recovering", FOUND, "end"),
            ("end", PHASE_COMPLETED, "c"),
            ("c", SYSTEM_ERROR, "failed"),
        ]

        graph = extract(spec, run=run, timeline=timeline)

        assert counts(graph) == {
            ("preparing", "PREPARED", "working"): 1,
            ("1a", "RETRIED", "1a"): 2,
            ("1a", PHASE_COMPLETED, "inner"): 1,
            ("working", LOST, "recovering"): 1,
            ("recovering", FOUND, f"{HISTORY}:working"): 1,
            ("end", PHASE_COMPLETED, "c"): 1,
            ("*", SYSTEM_ERROR, "failed"): 1,
        }
        nodes = {node.name: node for node in graph.nodes}
        visited = {name for name, node in nodes.items() if node.visited}
        assert visited == {"preparing", "1a", "end", "c", "recovering", "failed"}
        assert [name for name, node in nodes.items() if node.current] == ["failed"]
        assert [name for name, node in nodes.items() if node.failed] == ["c"]
        (retried,) = [edge for edge in graph.edges if edge.event == "RETRIED"]
        assert retried.kind == "engine"

    def test_engine_edges_are_drawn_only_when_taken(self, journal):
        spec, run, timeline = succeeded_run(journal)

        graph = extract(spec, run=run, timeline=timeline)

        assert not [edge for edge in graph.edges if edge.kind == "engine"]
        assert run.state == "done"
        assert [node.name for node in graph.nodes if node.current] == ["done"]
        assert not [node.name for node in graph.nodes if node.failed]

    def test_edges_keep_spec_order_and_counts_add_nothing_new(self, journal):
        spec, run, timeline = succeeded_run(journal)

        plain = extract(spec).edges
        drawn = extract(spec, run=run, timeline=timeline).edges

        assert [attrs.evolve(edge, count=0) for edge in drawn] == list(plain)

    def test_interrupted_phase_is_a_self_loop(self, journal):
        engine = rich_engine(journal, d=(KeyboardInterrupt(), PhaseStatus.OK))
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.run(run_id)
        engine.resume(run_id)
        spec, run, timeline = finished(engine, run_id)

        graph = extract(spec, run=run, timeline=timeline)

        assert counts(graph)[("d", "INTERRUPTED", "d")] == 1
        assert counts(graph)[("working", PHASE_COMPLETED, "done")] == 1
        assert ("d", "d", f"INTERRUPTED {TIMES}1") in parse_mermaid(
            render_mermaid(graph)
        ).named_links()

    def test_retries_and_interruptions_of_one_state_share_its_loop_in_mermaid(self, journal):
        boom = RuntimeError("boom")
        engine = rich_engine(
            journal,
            retry_a=RetryPolicy(max_attempts=3, wait_initial=0.1),
            a=(boom, KeyboardInterrupt(), PhaseStatus.OK),
        )
        run_id = engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.run(run_id)
        engine.resume(run_id)
        spec, run, timeline = finished(engine, run_id)
        assert ("1a", "RETRIED", "1a") in path_of(timeline)
        assert ("1a", "INTERRUPTED", "1a") in path_of(timeline)

        text = render(spec, run=run, timeline=timeline)
        flow = assert_path_styled(text, extract(spec, run=run, timeline=timeline))

        assert ("1a", "1a", f"RETRIED {TIMES}1, INTERRUPTED {TIMES}1") in flow.named_links()
        assert ("1a", "1a", f"RETRIED {TIMES}1, INTERRUPTED {TIMES}1") in parse_mermaid(
            render_mermaid(extract(spec, run=run, timeline=timeline))
        ).named_links()

    def test_abort_through_the_spec_counts_the_wildcard_edge(self, journal):
        engine = rich_engine(journal)
        run_id = engine.start()
        engine.step(run_id)
        engine.abort(run_id, "enough")
        spec, run, timeline = finished(engine, run_id)

        graph = extract(spec, run=run, timeline=timeline)

        assert counts(graph) == {
            ("preparing", "PREPARED", "working"): 1,
            ("*", USER_ABORTED, "canceled"): 1,
        }
        assert [node.name for node in graph.nodes if node.current] == ["canceled"]
        assert not [node.name for node in graph.nodes if node.failed]  # aborted, not failed

    def test_abort_without_an_exit_is_a_self_loop_where_the_run_stopped(self, journal):
        spec = MachineSpec(
            "bare",
            [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
            [Transition("a", "NEXT", "b"), Transition("b", "NEXT", "done")],
        )
        engine = Engine(
            spec, handlers={"a": lambda ctx: "NEXT", "b": lambda ctx: "NEXT"}, journal=journal
        )
        run_id = engine.start()
        engine.step(run_id)
        engine.abort(run_id, "stop")
        spec, run, timeline = finished(engine, run_id)
        assert path_of(timeline)[-1] == ("b", USER_ABORTED, "b")

        graph = extract(spec, run=run, timeline=timeline)
        mermaid = parse_mermaid(render_mermaid(graph))

        assert counts(graph) == {("a", "NEXT", "b"): 1, ("b", USER_ABORTED, "b"): 1}
        assert ("b", "b", f"{USER_ABORTED} {TIMES}1") in mermaid.named_links()
        assert mermaid.classed("current") == {"b"}
        assert "failed" not in mermaid.classes

    def test_rewound_run(self, journal):
        # An operator moves a run back to an earlier state (`resume --from-state`): the engine
        # journals REWOUND, which no spec transition matches.
        engine = rich_engine(journal)
        run_id = engine.start()
        engine.run(run_id, max_steps=3)  # preparing, 1a, end: now in c
        assert journal.load(run_id).state == "c"
        engine.resume(run_id, from_state="preparing")
        spec, run, timeline = finished(engine, run_id)

        graph = extract(spec, run=run, timeline=timeline)

        assert run.state == "done"
        assert counts(graph)[("c", "REWOUND", "preparing")] == 1
        assert counts(graph)[("preparing", "PREPARED", "working")] == 2
        assert counts(graph)[("end", PHASE_COMPLETED, "c")] == 2
        links = parse_mermaid(render_mermaid(graph)).named_links()
        assert ("c", "preparing", f"REWOUND {TIMES}1") in links

    def test_guarded_edges_to_one_state_are_told_apart_by_the_recorded_reason(self, journal):
        spec = MachineSpec(
            "limits",
            [
                State("checking", handler="check"),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                Transition(
                    "checking", "CHECKED", "failed", unless=["budget_left"], reason="budget spent"
                ),
                Transition(
                    "checking", "CHECKED", "failed", unless=["time_left"], reason="time spent"
                ),
                Transition("checking", "CHECKED", "done"),
            ],
        )
        engine = Engine(
            spec,
            handlers={"check": lambda ctx: "CHECKED"},
            journal=journal,
            guards={"budget_left": lambda run: True, "time_left": lambda run: False},
        )
        run_id = engine.start()
        engine.run(run_id)
        spec, run, timeline = finished(engine, run_id)

        graph = extract(spec, run=run, timeline=timeline)

        assert [edge.count for edge in graph.edges] == [0, 1, 0]
        assert [node.name for node in graph.nodes if node.failed] == ["checking"]

    @pytest.mark.skipif(
        "dead_letter" not in {outcome.value for outcome in RunLifecycle},
        reason="this fsm_runner has no dead_letter status",
    )
    def test_a_dead_lettered_run_is_drawn_failed_where_it_was_parked(self, journal):
        engine = rich_engine(journal)
        run_id = engine.start()
        engine.run(run_id, max_steps=2)  # preparing, 1a: now in end
        run = journal.load(run_id)
        parked = TransitionRecord(run_id, run.seq + 1, "end", "DEAD_LETTERED", "end")
        timeline = [*journal.transitions(run_id), parked]
        run = attrs.evolve(run, seq=parked.seq, status=RunLifecycle("dead_letter"))

        graph = extract(engine.spec, run=run, timeline=timeline)

        assert counts(graph)[("end", "DEAD_LETTERED", "end")] == 1
        assert [n.name for n in graph.nodes if n.current] == ["end"]
        assert [n.name for n in graph.nodes if n.failed] == ["end"]

    def test_a_timeline_alone_says_where_the_run_is(self, journal):
        spec, _run, timeline = failed_run_with_retries(journal)

        graph = extract(spec, timeline=timeline)

        assert graph.has_run
        assert [node.name for node in graph.nodes if node.current] == ["failed"]
        assert [node.name for node in graph.nodes if node.failed] == ["c"]

    def test_a_just_started_run(self, journal):
        engine = rich_engine(journal)
        run_id = engine.start()
        spec, run, timeline = finished(engine, run_id)

        graph = extract(spec, run=run, timeline=timeline)

        assert [n.name for n in graph.nodes if n.visited] == ["preparing"]
        assert [n.name for n in graph.nodes if n.current] == ["preparing"]
        assert counts(graph) == {}

    def test_transitions_naming_states_the_spec_lacks_are_left_out(self, journal):
        spec, run, timeline = succeeded_run(journal)
        stray = [
            TransitionRecord(run.run_id, 90, "gone", "NEXT", "preparing"),
            TransitionRecord(run.run_id, 91, "preparing", "NEXT", "vanished"),
        ]

        graph = extract(spec, run=attrs.evolve(run, state="vanished"), timeline=[*timeline, *stray])

        assert counts(graph) == counts(extract(spec, run=run, timeline=timeline))
        assert not [n for n in graph.nodes if n.current]
        assert {n.name for n in graph.nodes} == {n.name for n in extract(spec).nodes}

    def test_a_run_without_its_timeline_marks_only_where_it_is(self, journal):
        spec, run, _timeline = failed_run_with_retries(journal)

        graph = extract(spec, run=run)

        assert [n.name for n in graph.nodes if n.visited] == ["failed"]
        assert [n.name for n in graph.nodes if n.failed] == ["failed"]  # nothing says where else
        assert counts(graph) == {}


class TestMermaidRun:
    """A run in Mermaid: a flowchart with classes on states, counts and styles on links."""

    @pytest.fixture
    def drawn(self, journal):
        spec, run, timeline = failed_run_with_retries(journal)
        return parse_flowchart(render(spec, format="mermaid", run=run, timeline=timeline))

    def test_class_definitions_use_lower_case_keywords(self, drawn, journal):
        spec, run, timeline = failed_run_with_retries(journal)
        text = render(spec, run=run, timeline=timeline)

        assert set(drawn.class_defs) == {"initial", "visited", "current", "failed"}
        assert re.findall(r"^\s*(classDef|class) ", text, flags=re.MULTILINE)
        assert not re.search(r"^\s*(ClassDef|CLASSDEF|Class|CLASS) ", text, flags=re.MULTILINE)

    def test_visited_current_and_failed_states(self, drawn):
        assert drawn.classed("visited") == {"preparing", "1a", "end", "c", "recovering", "failed"}
        assert drawn.classed("current") == {"failed"}
        assert drawn.classed("failed") == {"c"}

    def test_traversed_edges_carry_their_counts(self, drawn):
        counted = {
            (source, dest, label) for source, dest, label in drawn.named_links() if TIMES in label
        }

        assert counted == {
            ("preparing", "working", f"PREPARED {TIMES}1"),
            ("1a", "1a", f"RETRIED {TIMES}2"),
            ("1a", "inner", f"{PHASE_COMPLETED} {TIMES}1"),
            ("working", "recovering", f"{LOST} {TIMES}1"),
            ("recovering", "H*", f"{FOUND} {TIMES}1"),
            ("end", "c", f"{PHASE_COMPLETED} {TIMES}1"),
            ("*", "failed", f"{SYSTEM_ERROR} {TIMES}1"),
        }

    def test_the_retry_loop_is_drawn_dotted_in_the_composite_of_its_state(self, drawn):
        (loop,) = [link for link in drawn.links if "RETRIED" in link.label]

        assert drawn.name(loop.source) == drawn.name(loop.dest) == "1a"
        assert drawn.name(loop.scope) == "working"
        assert loop.dotted
        assert loop.index in drawn.traversed

    def test_traversed_links_are_styled_by_their_index(self, journal):
        spec, run, timeline = failed_run_with_retries(journal)
        text = render(spec, run=run, timeline=timeline)

        drawn = assert_path_styled(text, extract(spec, run=run, timeline=timeline))

        assert {drawn.named_links()[i] for i in drawn.traversed} == {
            ("end", "c", f"{PHASE_COMPLETED} {TIMES}1"),  # written first: inside inner
            ("1a", "inner", f"{PHASE_COMPLETED} {TIMES}1"),
            ("1a", "1a", f"RETRIED {TIMES}2"),
            ("preparing", "working", f"PREPARED {TIMES}1"),
            ("working", "recovering", f"{LOST} {TIMES}1"),
            ("recovering", "H*", f"{FOUND} {TIMES}1"),
            ("*", "failed", f"{SYSTEM_ERROR} {TIMES}1"),
        }
        assert sorted(drawn.traversed) == [0, 1, 3, 5, 8, 10, 11]
        assert sorted(drawn.untraversed) == [2, 6, 7, 9, 12]
        assert drawn.links[4].source == "start_"
        assert drawn.named_links()[4] == (" ", "preparing", "")

    def test_composites_are_nested_subgraphs(self, drawn):
        working, inner = drawn.id_of("working"), drawn.id_of("inner")

        assert drawn.subgraphs == [working, inner]
        assert drawn.scopes[inner] == working
        assert drawn.scopes[drawn.id_of("end")] == inner
        assert drawn.scopes[drawn.id_of("1a")] == working
        assert drawn.scopes[drawn.id_of("H*")] == working
        assert drawn.scopes[drawn.id_of("preparing")] is None
        assert ("inner", "d", PHASE_COMPLETED) in drawn.named_links()  # an advance edge

    def test_shapes(self, drawn):
        assert drawn.shapes[drawn.id_of("preparing")] == "box"
        assert drawn.shapes[drawn.id_of("failed")] == "double"
        assert drawn.shapes[drawn.id_of("H*")] == "circle"
        assert drawn.shapes[drawn.id_of("*")] == "plain"
        assert drawn.shapes["start_"] == "circle"
        assert drawn.classes["initial"] == {"start_"}

    def test_every_id_is_an_alias(self, drawn):
        assert all(re.fullmatch(r"s_\w+|any_state|start_", ident) for ident in drawn.labels)
        assert drawn.id_of("end") == "s_end"  # a flowchart keyword as an id of its own
        assert drawn.id_of("1a") == "s_1a"

    def test_untraversed_edges_have_plain_labels(self, drawn):
        links = drawn.named_links()

        assert ("inner", "d", PHASE_COMPLETED) in links
        assert ("recovering", "failed", "SERVER_FOUND [unless restarts_left]") in links


class TestMermaidFlowchartLinkStyles:
    """linkStyle indexes name exactly the links a run took, whatever the machine's shape."""

    def test_a_succeeded_run_through_composites(self, journal):
        spec, run, timeline = succeeded_run(journal)
        graph = extract(spec, run=run, timeline=timeline)

        drawn = assert_path_styled(render(spec, run=run, timeline=timeline), graph)

        assert len(drawn.traversed) == len(counts(graph))
        assert drawn.classed("current") == {"done"}

    def test_a_return_through_composites_and_history(self, journal):
        engine = rich_engine(journal, b=(LOST, PhaseStatus.OK))
        run_id = engine.start()
        engine.run(run_id)
        spec, run, timeline = finished(engine, run_id)
        graph = extract(spec, run=run, timeline=timeline)

        drawn = assert_path_styled(render(spec, run=run, timeline=timeline), graph)

        (returned,) = [link for link in drawn.links if drawn.name(link.dest) == "H*"]
        assert returned.index in drawn.traversed
        assert drawn.scopes[returned.dest] == drawn.id_of("working")

    def test_wildcards_and_a_top_level_history_node(self):
        spec = MachineSpec(
            "anywhere",
            [
                State("a", handler="a"),
                State("b", handler="b"),
                State("pausing", handler="pause"),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                Transition("a", "NEXT", "b"),
                Transition("b", "NEXT", "done"),
                Transition("*", "PAUSED", "pausing"),
                Transition("pausing", "RESUMED", RETURN),
                Transition("*", SYSTEM_ERROR, "failed"),
            ],
        )
        timeline = [
            TransitionRecord("r", 0, None, "STARTED", "a"),
            TransitionRecord("r", 1, "a", "PAUSED", "pausing"),
            TransitionRecord("r", 2, "pausing", "RESUMED", "a"),
            TransitionRecord("r", 3, "a", "NEXT", "b"),
            TransitionRecord("r", 4, "b", "PAUSED", "pausing"),
            TransitionRecord("r", 5, "pausing", "RESUMED", "b"),
            TransitionRecord("r", 6, "b", "NEXT", "done"),
        ]
        graph = extract(spec, timeline=timeline)

        drawn = assert_path_styled(render(spec, timeline=timeline), graph)

        assert {drawn.named_links()[i] for i in drawn.traversed} == {
            ("a", "b", f"NEXT {TIMES}1"),
            ("b", "done", f"NEXT {TIMES}1"),
            ("*", "pausing", f"PAUSED {TIMES}2"),
            ("pausing", "H*", f"RESUMED {TIMES}2"),
        }
        assert {drawn.named_links()[i] for i in drawn.untraversed} == {
            ("*", "failed", SYSTEM_ERROR)
        }
        assert drawn.scopes[drawn.id_of("H*")] is None

    def test_a_failed_run_with_retries_on_names_needing_aliases(self, journal):
        names = ["o1", "x1", "a-b", "default", "subgraph", "click"]
        retry = RetryPolicy(max_attempts=3, wait_initial=0.1)
        spec = MachineSpec(
            "names",
            [
                *(State(n, handler="h", retry=retry if n == "default" else None) for n in names),
                State("end", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                *(Transition(a, "NEXT", b) for a, b in itertools.pairwise([*names, "end"])),
                Transition("*", SYSTEM_ERROR, "failed"),
            ],
        )
        boom = RuntimeError("boom")
        clock = FakeClock()
        handler = ScriptedHandler("NEXT", "NEXT", "NEXT", boom, boom, "NEXT", boom)
        engine = Engine(
            spec, handlers={"h": handler}, journal=journal, clock=clock, sleep=clock.sleep
        )
        run_id = engine.start()
        engine.run(run_id)
        spec, run, timeline = finished(engine, run_id)
        assert path_of(timeline).count(("default", "RETRIED", "default")) == 2
        graph = extract(spec, run=run, timeline=timeline)

        drawn = assert_path_styled(render(spec, run=run, timeline=timeline), graph)

        assert [drawn.id_of(n) for n in [*names, "end"]] == [
            "s_o1",
            "s_x1",
            "s_a_b",
            "s_default",
            "s_subgraph",
            "s_click",
            "s_end",
        ]
        assert drawn.classed("failed") == {"subgraph"}
        assert drawn.classed("current") == {"failed"}
        (retried,) = [link for link in drawn.links if "RETRIED" in link.label]
        assert retried.dotted
        assert retried.label == f"RETRIED {TIMES}2"
        assert retried.index in drawn.traversed
        assert {drawn.named_links()[i] for i in drawn.untraversed} == {
            ("subgraph", "click", "NEXT"),
            ("click", "end", "NEXT"),
        }

    def test_a_just_started_run_styles_no_link_as_taken(self, journal):
        engine = rich_engine(journal)
        run_id = engine.start()
        spec, run, timeline = finished(engine, run_id)
        text = render(spec, run=run, timeline=timeline)

        drawn = assert_path_styled(text, extract(spec, run=run, timeline=timeline))

        assert not drawn.traversed
        assert drawn.untraversed  # every link but the start point's is grey


class TestDotRun:
    """A run in DOT: filled states, thick counted edges, grey untaken ones."""

    @pytest.fixture
    def dot(self, journal):
        spec, run, timeline = failed_run_with_retries(journal)
        return parse_dot(render(spec, format="dot", run=run, timeline=timeline))

    def test_states(self, dot):
        fills = {name: a.get("fillcolor") for name, a in dot.nodes.items()}

        assert fills["preparing"] == fills["1a"] == fills["recovering"] == "#e3f2fd"
        assert fills["failed"] == "#fff59d"  # current
        assert fills["c"] == "#ffcdd2"  # where it failed
        assert dot.nodes["c"]["color"] == "#c62828"
        assert fills["d"] is None
        assert fills["done"] is None

    def test_traversed_edges(self, dot):
        retried = dot.edge("1a", "1a", f"RETRIED {TIMES}2")
        wildcard = dot.edge("*", "failed", f"{SYSTEM_ERROR} {TIMES}1")
        returned = dot.edge("recovering", f"{HISTORY}:working", f"{FOUND} {TIMES}1")

        assert retried["style"] == "dotted"
        assert wildcard["style"] == returned["style"] == "dashed"
        for edge in (retried, wildcard, returned):
            assert edge["penwidth"] == "2.5"
            assert edge["color"] == "#1565c0"

    def test_untraversed_edges_are_grey(self, dot):
        assert dot.edge("c", "d", PHASE_COMPLETED)["color"] == "#9e9e9e"
        assert dot.edge("*", "canceled", USER_ABORTED)["color"] == "#9e9e9e"
        assert "color" not in dot.edge("$initial", "preparing", "")


# -- render and render_image -----------------------------------------------------------------


class TestRender:
    """render() chains extract and a renderer."""

    def test_is_extract_then_render(self, journal):
        spec, run, timeline = failed_run_with_retries(journal)
        graph = extract(spec, run=run, timeline=timeline)

        assert render(spec) == render_mermaid(extract(spec))
        assert render(spec, run=run, timeline=timeline) == render_mermaid_flowchart(graph)
        assert render(spec, timeline=timeline) == render_mermaid_flowchart(
            extract(spec, timeline=timeline)
        )
        assert render(spec, run=run) == render_mermaid_flowchart(extract(spec, run=run))
        assert render(spec, format="dot", run=run, timeline=timeline) == render_dot(graph)

    @pytest.mark.parametrize("fmt", ["svg", "png", "plantuml", ""])
    def test_unknown_format(self, fmt):
        with pytest.raises(DiagramError) as info:
            render(rich_spec(), format=fmt)

        assert repr(fmt) in str(info.value)
        assert "mermaid" in str(info.value)

    def test_is_pure(self, monkeypatch):
        def no_subprocess(*args, **kwargs):
            raise AssertionError("render ran a subprocess")

        monkeypatch.setattr(subprocess, "run", no_subprocess)

        assert render(rich_spec(), format="dot")
        assert render(rich_spec(), format="mermaid")


def fake_dot(directory, script):
    """Put an executable `dot` shell script in ``directory``."""
    path = directory / "dot"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


class TestRenderImage:
    """render_image() runs Graphviz dot, and says clearly when it cannot."""

    def test_missing_dot_says_how_to_install_it(self, tmp_path, monkeypatch):
        monkeypatch.setenv("PATH", str(tmp_path))

        with pytest.raises(DiagramError) as info:
            render_image(render(rich_spec(), format="dot"), format="svg")

        message = str(info.value)
        assert "\n" not in message
        assert "Graphviz `dot` is not installed" in message
        assert "apt-get install graphviz" in message
        assert "brew install graphviz" in message
        assert "--format mermaid|dot" in message

    @pytest.mark.parametrize("fmt", ["pdf", "mermaid", "dot", "SVG"])
    def test_unknown_format(self, fmt, tmp_path, monkeypatch):
        monkeypatch.setenv("PATH", str(tmp_path))  # the format is checked before dot is looked for

        with pytest.raises(DiagramError, match="unknown image format"):
            render_image("digraph {}", format=fmt)

    def test_dot_failing_reports_its_error_line(self, tmp_path, monkeypatch):
        fake_dot(
            tmp_path,
            'echo "Warning: something minor" >&2\n'
            "echo \"Error: <stdin>: syntax error in line 1 near '{'\" >&2\n"
            'echo "more detail" >&2\nexit 1\n',
        )
        monkeypatch.setenv("PATH", str(tmp_path))

        with pytest.raises(DiagramError) as info:
            render_image("digraph {", format="png")

        assert (
            str(info.value)
            == "Graphviz `dot` failed: Error: <stdin>: syntax error in line 1 near '{'"
        )

    def test_dot_failing_silently(self, tmp_path, monkeypatch):
        fake_dot(tmp_path, "exit 3\n")
        monkeypatch.setenv("PATH", str(tmp_path))

        with pytest.raises(DiagramError, match="failed: no message"):
            render_image("digraph {}", format="svg")

    def test_runs_dot_with_the_format_on_the_text(self, tmp_path, monkeypatch):
        fake_dot(tmp_path, 'printf "%s|" "$@"\ncat\n')
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")  # ours first

        assert render_image("digraph { a }", format="png") == b"-Tpng|digraph { a }"

    @needs_dot
    @pytest.mark.parametrize("scenario", ["spec", "failed_run", "succeeded_run"])
    def test_real_dot_renders_svg(self, scenario, journal):
        if scenario == "spec":
            spec, run, timeline = rich_spec(), None, ()
        else:
            spec, run, timeline = {
                "failed_run": failed_run_with_retries,
                "succeeded_run": succeeded_run,
            }[scenario](journal)

        svg = render_image(render(spec, format="dot", run=run, timeline=timeline), format="svg")

        root = ET.fromstring(svg)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        titles = {el.text for el in root.iter("{http://www.w3.org/2000/svg}title")}
        assert {"preparing", "1a", "end", "done", "cluster_working", "cluster_inner"} <= titles
        texts = {el.text for el in root.iter("{http://www.w3.org/2000/svg}text")}
        assert "H*" in texts
        if scenario == "failed_run":
            assert f"RETRIED {TIMES}2" in texts

    @needs_dot
    def test_real_dot_renders_png(self):
        png = render_image(render(rich_spec(), format="dot"), format="png")

        assert png.startswith(b"\x89PNG\r\n\x1a\n")

    @needs_dot
    def test_real_dot_rejecting_text(self):
        with pytest.raises(DiagramError) as info:
            render_image("digraph { a -> }", format="svg")

        message = str(info.value)
        assert message.startswith("Graphviz `dot` failed: ")
        assert "syntax error" in message
        assert "\n" not in message

    @needs_dot
    def test_real_dot_reads_names_that_need_quoting(self):
        spec = MachineSpec(
            'quo"ting',
            [
                State('say "hi"', handler="a"),
                State("back\\slash", handler="b"),
                State("done", terminal=True),
            ],
            [
                Transition('say "hi"', "NEXT", "back\\slash"),
                Transition("back\\slash", "NEXT", "done"),
            ],
        )

        svg = render_image(render(spec, format="dot"), format="svg")

        titles = {el.text for el in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}title")}
        assert 'say "hi"' in titles


# -- waiting states --------------------------------------------------------------------------


def approval_spec():
    """A machine with two waiting states: one with a Wait (timeout, prompt), one bare."""
    return MachineSpec(
        name="approval",
        initial="proposing",
        states=[
            State("proposing", handler="propose"),
            State(
                "approving",
                wait=Wait(timeout=86_400, prompt="Apply the change?"),
                description="a person decides",
            ),
            State("holding"),
            State("applied", terminal=True),
            State("dropped", terminal=True, outcome=RunLifecycle.ABORTED),
        ],
        transitions=[
            Transition("proposing", PHASE_COMPLETED, "approving"),
            Transition("approving", "APPROVED", "applied"),
            Transition("approving", "REJECTED", "proposing"),
            Transition("approving", "TIMEOUT", "dropped"),
            Transition("approving", "HELD", "holding"),
            Transition("holding", "RELEASED", "approving"),
        ],
    )


class TestWaitingStates:
    """States that wait for a signal are drawn distinctly: dashed, their timeout in the label."""

    def test_extract_marks_them(self):
        graph = extract(approval_spec())
        nodes = {node.name: node for node in graph.nodes}

        assert {name for name, node in nodes.items() if node.waiting} == {"approving", "holding"}
        assert nodes["approving"].label == "approving (waits 24h)"
        assert nodes["approving"].timeout == 86_400
        assert nodes["approving"].prompt == "Apply the change?"
        assert nodes["approving"].tooltip == (
            "a person decides\nwaits for a signal, at most 24h: Apply the change?"
        )
        assert nodes["holding"].label == "holding"  # no timeout: the name alone
        assert nodes["holding"].tooltip == "waits for a signal"
        assert not nodes["proposing"].waiting
        assert not nodes["applied"].waiting

    @pytest.mark.parametrize(
        ("seconds", "shown"),
        [
            (30, "30s"),
            (90, "90s"),
            (300, "5m"),
            (5400, "90m"),
            (86_400, "24h"),
            (2 * 86_400, "2d"),
            (30 * 86_400, "30d"),
            (1.5, "1.5s"),
            (0.25, "0.25s"),
        ],
    )
    def test_durations(self, seconds, shown):
        assert wait_duration(seconds) == shown

    def test_mermaid_state_diagram(self):
        text = render(approval_spec(), format="mermaid")

        assert '    state "approving (waits 24h)" as approving\n' in text
        assert "    holding\n" in text
        assert "    classDef waiting stroke:#6a1b9a,stroke-dasharray:5\n" in text
        assert text.endswith("    class approving,holding waiting\n")
        assert "classDef visited" not in text  # no run, no run classes

    def test_mermaid_without_waiting_states_is_unchanged(self):
        assert "waiting" not in render(rich_spec(), format="mermaid")

    def test_mermaid_flowchart_of_a_run(self):
        spec = approval_spec()
        timeline = [
            TransitionRecord("r", 0, None, "STARTED", "proposing"),
            TransitionRecord("r", 1, "proposing", PHASE_COMPLETED, "approving"),
        ]
        graph = extract(spec, timeline=timeline)

        flow = assert_path_styled(render_mermaid_flowchart(graph), graph)

        assert flow.class_defs["waiting"] == "stroke:#6a1b9a,stroke-dasharray:5"
        assert flow.classed("waiting") == {"approving (waits 24h)", "holding"}
        assert flow.classed("current") == {"approving (waits 24h)"}
        text = render_mermaid_flowchart(graph)
        # Defined before the run's classes, so theirs override its colour, not its dashes.
        assert text.index("classDef waiting") < text.index("classDef visited")

    def test_dot(self):
        dot = parse_dot(render(approval_spec(), format="dot"))

        for name in ("approving", "holding"):
            assert dot.nodes[name]["style"] == "rounded,dashed"
            assert dot.nodes[name]["color"] == "#6a1b9a"
            assert dot.nodes[name]["shape"] == "box"
        assert dot.nodes["approving"]["label"] == "approving (waits 24h)"
        assert dot.nodes["approving"]["tooltip"] == (
            "a person decides\\nwaits for a signal, at most 24h: Apply the change?"
        )
        assert dot.nodes["proposing"]["style"] == "rounded"
        assert "color" not in dot.nodes["proposing"]

    def test_dot_of_a_run_waiting(self):
        timeline = [
            TransitionRecord("r", 0, None, "STARTED", "proposing"),
            TransitionRecord("r", 1, "proposing", PHASE_COMPLETED, "approving"),
        ]
        dot = parse_dot(render(approval_spec(), format="dot", timeline=timeline))

        approving = dot.nodes["approving"]
        assert approving["style"] == "rounded,dashed,filled,bold"
        assert approving["fillcolor"] == "#fff59d"  # current: the run's colours win
        assert dot.nodes["holding"]["style"] == "rounded,dashed"

    @needs_dot
    def test_real_dot_draws_them_dashed(self):
        svg = render_image(render(approval_spec(), format="dot"), format="svg")

        root = ET.fromstring(svg)
        ns = "{http://www.w3.org/2000/svg}"
        dashed = set()
        for group in root.iter(f"{ns}g"):
            title = group.find(f"{ns}title")
            if group.get("class") != "node" or title is None:
                continue
            if any(path.get("stroke-dasharray") for path in group.iter(f"{ns}path")):
                dashed.add(title.text)
        assert dashed == {"approving", "holding"}
        texts = {el.text for el in root.iter(f"{ns}text")}
        assert "approving (waits 24h)" in texts

    def test_inspector_svg(self):
        svg = render_svg(extract(approval_spec()))

        root = ET.fromstring(svg)
        ns = "{http://www.w3.org/2000/svg}"
        classes = {
            group.get("data-state"): group.get("class", "").split()
            for group in root.iter(f"{ns}g")
            if "node" in group.get("class", "").split()
        }
        assert {name for name, c in classes.items() if "waiting" in c} == {"approving", "holding"}
        assert "waiting" not in classes["proposing"]
        style = root.find(f"{ns}style").text
        assert ".fsm .node.waiting rect{" in style
        assert "stroke-dasharray" in style.split(".fsm .node.waiting rect{")[1].split("}")[0]
        titles = [el.text for el in root.iter(f"{ns}title")]
        assert "a person decides\nwaits for a signal, at most 24h: Apply the change?" in titles


class TestModule:
    """The package's public names (fsm_runner.diagrams and the modules it is made of)."""

    def test_all_is_sorted_and_complete(self):
        public = {
            name
            for module in package_modules()
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        }

        assert diagrams_module.__all__ == sorted(diagrams_module.__all__, key=isort_style_key)
        assert public <= set(diagrams_module.__all__)

    def test_every_public_function_and_class_has_a_docstring(self):
        modules = {module.__name__ for module in package_modules()}
        for name in diagrams_module.__all__:
            value = getattr(diagrams_module, name)
            if callable(value) and hasattr(value, "__module__") and value.__module__ in modules:
                assert value.__doc__, name

    def test_does_not_import_transitions(self):
        for module in package_modules():
            with open(module.__file__) as handle:
                text = handle.read()

            assert not re.search(r"^\s*(import|from) transitions\b", text, flags=re.MULTILINE)


def package_modules():
    """fsm_runner.diagrams and every module of the package."""
    return [
        diagrams_module,
        *(
            importlib.import_module(f"{diagrams_module.__name__}.{info.name}")
            for info in pkgutil.iter_modules(diagrams_module.__path__)
        ),
    ]
