"""How the inspector's pages show payloads: clipped for a browser, previewed, viewed as JSON.

The fields of a transition's output and of a run's artifacts are what the JSON viewer shows
(``templates/json_view.html``, ``static/inspector.js``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fsm_runner.records import ArtifactRecord

__all__ = [
    "ARTIFACT_CHARS",
    "INLINE_CHARS",
    "PREVIEW_CHARS",
    "SHOWN_CHARS",
    "artifact_rows",
    "clip",
    "error_text",
    "output_fields",
    "payload_text",
    "pretty_json",
    "preview",
]

#: The most of one payload (input, context, an error, a traceback) a page shows: a run's
#: input may be megabytes (up to the engine's max_payload_bytes), and a browser given tens of
#: megabytes of escaped text stalls; `fsm-runner show` prints it all.
SHOWN_CHARS = 100_000
#: An output (its JSON on one line) at most this long is shown as it is, beside its copy
#: button; a longer one folds, its first :data:`PREVIEW_CHARS` characters its fold's title, and
#: opens as a tree.
INLINE_CHARS = 80
PREVIEW_CHARS = 60
#: The most of a run's artifacts' contents its page shows, all told (each one clipped to
#: :data:`SHOWN_CHARS` too): a run may keep hundreds. Past it, an artifact's content is left to
#: its download.
ARTIFACT_CHARS = 10 * SHOWN_CHARS


def payload_text(value: Any) -> str:
    """A payload's JSON text on one line, clipped (:func:`clip`); ``""`` for ``None``."""
    return clip(json.dumps(value, ensure_ascii=False)) if value is not None else ""


def pretty_json(value: Any) -> str:
    """A payload's JSON text as the page's trees are given it (input, context, artifacts)."""
    return json.dumps(value, ensure_ascii=False, indent=1)


def clip(text: str) -> str:
    """``text``, or its first :data:`SHOWN_CHARS` characters and how many more there are."""
    if len(text) <= SHOWN_CHARS:
        return text
    more = len(text) - SHOWN_CHARS
    return f"{text[:SHOWN_CHARS]}\n… {more} characters more (fsm-runner show prints them all)"


def error_text(error: Mapping[str, Any] | None) -> str:
    """An error record as ``type: message``, clipped; ``""`` for none."""
    if not error:
        return ""
    return clip(f"{error.get('type')}: {error.get('message')}")


def output_fields(output: Any) -> dict[str, Any]:
    """A transition's output as its row shows it: its JSON text, inline or folded with a title."""
    if output is None:
        return {"output": "", "output_inline": True, "output_preview": ""}
    text = payload_text(output)
    return {
        "output": text,
        "output_inline": len(text) <= INLINE_CHARS,
        "output_preview": preview(text),
    }


def preview(text: str) -> str:
    """The first :data:`PREVIEW_CHARS` characters of ``text`` on one line, "…" if there are more."""
    head = text[: 4 * PREVIEW_CHARS]
    line = " ".join(head.split())
    if len(line) <= PREVIEW_CHARS and len(head) == len(text):
        return line
    return f"{line[:PREVIEW_CHARS]}…"


def _compact_head(value: Any) -> str:
    """The start of ``value``'s JSON on one line, as an output's (enough for its preview)."""
    head = []
    size = 0
    for chunk in json.JSONEncoder(ensure_ascii=False).iterencode(value):
        head.append(chunk)
        size += len(chunk)
        if size > 4 * PREVIEW_CHARS:
            break
    return "".join(head)


def artifact_rows(artifacts: Sequence[ArtifactRecord]) -> list[dict[str, Any]]:
    """A run's artifacts as its page lists them, each with its content as the page shows it.

    An artifact whose content the journal holds (``content`` not ``None``, stored or not):
    ``json`` its JSON text, indented as the run's input is (the page shows it as a tree, and
    its copy button copies the text), or ``text``: its content is a string, shown and copied
    as that text itself. Clipped past :data:`SHOWN_CHARS` (``clipped``: no copy, the download
    has it whole), and none past :data:`ARTIFACT_CHARS` for the page (``withheld``).
    """
    budget = ARTIFACT_CHARS
    rows = []
    for artifact in artifacts:
        row: dict[str, Any] = {
            "artifact": artifact,
            "shown": "",  # "json", "text" or "" (no content to show)
            "content": "",
            "preview": "",
            "clipped": False,
            "withheld": False,
        }
        if artifact.content is not None:
            is_text = isinstance(artifact.content, str)
            text = artifact.content if is_text else pretty_json(artifact.content)
            if budget <= 0:
                row["withheld"] = True
            else:
                shown = clip(text)
                budget -= len(shown)
                row.update(
                    shown="text" if is_text else "json",
                    content=shown,
                    preview=preview(text if is_text else _compact_head(artifact.content)),
                    clipped=len(text) > SHOWN_CHARS,
                )
        rows.append(row)
    return rows
