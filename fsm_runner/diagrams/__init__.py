"""Draw a machine, and a run's path through it, as Mermaid or Graphviz DOT (and as an image).

Two pure steps: :func:`extract` reads a :class:`~fsm_runner.spec.MachineSpec` (and a run's
journaled timeline) into a :class:`Graph` of plain records, and a renderer turns a graph into
text (:func:`render_mermaid`, :func:`render_dot`). Renderers know nothing about specs, so they
are tested on hand-built graphs; :func:`render` chains both steps. :func:`render_image` runs
Graphviz ``dot`` on DOT text; it is the module's only I/O. The package holds one step a
module: :mod:`~fsm_runner.diagrams.graph` (the records), :mod:`~fsm_runner.diagrams.extraction`
(:func:`extract`), :mod:`~fsm_runner.diagrams.mermaid` and :mod:`~fsm_runner.diagrams.dot`
(with :func:`render_image`); this module holds :func:`render` and exports every public name.

The spec is the source of truth, drawn as it is declared:

* the initial state gets an arrow from a start point, terminal states one to an end point
  (Mermaid ``[*]``) or a double circle (DOT);
* a transition's label is its event and its guards: ``EVENT [guard] [unless guard]``;
* a wildcard transition (source ``*``) is drawn once, from a ``*`` node;
* a composite state is a box around its sub-phases (``state X { ... }``, a DOT cluster) with
  an arrow into its first sub-phase and its ``advance_on`` edges between consecutive ones;
* a waiting state (a non-terminal state without a handler: it waits for a signal) is drawn
  dashed -- Mermaid's ``waiting`` class, a dashed DOT box, the inspector's ``waiting`` class --
  with its wait's timeout in its label (``approving (waits 24h)``) and its prompt in the
  tooltip;
* a :data:`~fsm_runner.spec.RETURN` transition goes to a deep-history node ``H*`` placed in the
  innermost composite that encloses every state the run can come from (at the top level when
  there is none): the run goes back to the very sub-phase it left.

With a run, every visited state is marked, the run's current state too, and for a failed run
(or one parked as ``dead_letter``) the state it failed in (the one the transition that ended it
left). Every traversed edge has its count in its label (``EVENT ×2``). Events the engine
journals without a spec transition -- ``RETRIED`` and ``INTERRUPTED`` (self transitions),
``USER_ABORTED`` from a state with no ``USER_ABORTED`` exit (the run stops in place),
``REWOUND`` (an operator moved the run back) and any other -- are drawn as dotted edges only
when the run took them, with their counts: a phase retried twice shows a ``RETRIED ×2``
self-loop. ``STARTED`` (seq 0) marks the initial state visited.
Transitions that name states the spec does not have (a run resumed under a changed spec) are
left out.

Mermaid's state diagrams cannot style transitions: ``linkStyle`` is flowchart syntax, and
Mermaid (11.x) reads a ``linkStyle`` line in a ``stateDiagram-v2`` as stray states. So a spec
alone is a ``stateDiagram-v2`` (:func:`render_mermaid`), and a run a ``flowchart``
(:func:`render_mermaid_flowchart`) whose states get ``classDef``/``class`` styles (``visited``,
``current``, ``failed``) and whose traversed links are drawn thick and blue by ``linkStyle``,
the others grey -- as DOT draws them. Mermaid also keeps only the last of several self-loops on
one state, so they are written as one link that lists them all.
"""  # noqa: RUF002 - the multiplication sign of traversal counts, as the diagrams show them

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fsm_runner.diagrams.dot import (
    IMAGE_FORMATS,
    ImageFormat,
    dot_edge_ends,
    dot_quote,
    render_dot,
    render_image,
)
from fsm_runner.diagrams.extraction import extract, taken_edges
from fsm_runner.diagrams.graph import (
    HISTORY,
    Composite,
    Edge,
    EdgeKind,
    Graph,
    Node,
    NodeKind,
    wait_duration,
)
from fsm_runner.diagrams.mermaid import render_mermaid, render_mermaid_flowchart
from fsm_runner.exceptions import DiagramError
from fsm_runner.records import RunRecord, TransitionRecord
from fsm_runner.spec import MachineSpec

__all__ = [
    "HISTORY",
    "IMAGE_FORMATS",
    "TEXT_FORMATS",
    "Composite",
    "Edge",
    "EdgeKind",
    "Graph",
    "ImageFormat",
    "Node",
    "NodeKind",
    "TextFormat",
    "dot_edge_ends",
    "dot_quote",
    "extract",
    "render",
    "render_dot",
    "render_image",
    "render_mermaid",
    "render_mermaid_flowchart",
    "taken_edges",
    "wait_duration",
]

#: The text formats :func:`render` writes.
TextFormat = Literal["mermaid", "dot"]
#: The text formats, for command-line choices.
TEXT_FORMATS: tuple[TextFormat, ...] = ("mermaid", "dot")


def render(
    spec: MachineSpec,
    *,
    format: TextFormat = "mermaid",  # noqa: A002 - the CLI's --format, under the same name
    run: RunRecord | None = None,
    timeline: Sequence[TransitionRecord] = (),
) -> str:
    """Draw a spec, and a run's path through it: :func:`extract`, then render as text.

    Mermaid is a ``stateDiagram-v2`` for a spec alone and a ``flowchart`` (whose links can be
    styled) when a run or a timeline is given.

    Args:
        spec: the machine.
        format: ``mermaid`` or ``dot``.
        run: the run to mark, if any.
        timeline: the run's transitions, in seq order.

    Returns:
        The diagram's text.

    Raises:
        DiagramError: for an unknown format.
    """
    if format not in TEXT_FORMATS:
        raise DiagramError(
            f"unknown diagram format {format!r}: use mermaid or dot (svg and png through "
            "render_image)"
        )
    graph = extract(spec, run=run, timeline=timeline)
    if format == "dot":
        return render_dot(graph)
    return render_mermaid_flowchart(graph) if graph.has_run else render_mermaid(graph)
