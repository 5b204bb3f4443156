"""The inspector's shared state: one journal, its readers, the templates and the CSRF secret.

:class:`Inspector` is what every route of :mod:`fsm_runner.ui.app` reaches through
``request.app.state.inspector``; :class:`PageError` is how a route answers with an error page.
"""

from __future__ import annotations

import datetime as dt
import hmac
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import anyio
import anyio.to_thread
import jinja2
from markupsafe import Markup
from starlette.responses import HTMLResponse

from fsm_runner.exceptions import JournalError
from fsm_runner.journal import Journal
from fsm_runner.journal._postgres_url import is_postgres_url, redact
from fsm_runner.journal.locate import locate_journal
from fsm_runner.run_ids import shown
from fsm_runner.ui import views
from fsm_runner.ui.drives import Drives
from fsm_runner.ui.jobs import CheckJob, Readers

if TYPE_CHECKING:
    from fsm_runner.engine import Engine

__all__ = [
    "PAGE_HEADERS",
    "POLL_MS",
    "READERS",
    "READ_TIMEOUT",
    "Inspector",
    "PageError",
    "one_line",
    "shown_location",
    "utf8",
]

HERE = Path(__file__).parent
#: How often an active run's page asks for new transitions, in milliseconds.
POLL_MS = 1000
T = TypeVar("T")

#: Seconds a page may read the journal before it is answered with an error page instead.
READ_TIMEOUT = 30.0
#: Pages read at once, each in a thread with a journal of its own.
READERS = 4

#: Sent with every page, behind the escaping: no inline script or eval (the page's own script
#: is /static/inspector.js), no plugin, and no other site may frame a page (and so trick a
#: click on Abort or Fork); styles inline, as the SVG diagram carries its own.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        # wasm-unsafe-eval: Viz.js compiles its WebAssembly (no JavaScript eval is allowed)
        "default-src 'self'; script-src 'self' 'wasm-unsafe-eval';"
        " style-src 'self' 'unsafe-inline';"
        " img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self';"
        " frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}


def utf8(text: str) -> bytes:
    r"""``text`` as UTF-8, a lone surrogate as its escape ``\udXXX``.

    The engine refuses lone surrogates, but JSON allows ``"\ud800"`` and another writer (an
    older version, a hand-edited row) may leave one in the journal: UTF-8 cannot carry it,
    and the page would be a 500. Escaped it shows as what it is, and inside a JSON string
    (the live update, an artifact) the escape is the same JSON.
    """
    return text.encode("utf-8", "backslashreplace")


class PageError(Exception):
    """An error page: its HTTP status, a title and a one-line detail (a route raises it)."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        resend: tuple[str, list[tuple[str, str]]] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        #: A refused form to offer again: where it went, and its fields (the token aside).
        self.resend = resend


class Inspector:
    """One journal, opened on first use, and what the pages share (templates, CSRF secret).

    The journal is opened as every command opens it
    (:func:`~fsm_runner.journal.locate.locate_journal`): a missing or damaged journal is an
    error page, not a server that refuses to start, and it is opened again on the next request
    once it was refused. Each request reads in a worker thread (:meth:`read`), at most
    ``readers`` at once, each with a journal of its own (:class:`~fsm_runner.ui.jobs.Readers`);
    ``check`` runs as a job of its own (:meth:`start_check`).
    """

    def __init__(
        self,
        location: str,
        *,
        allow_actions: bool = False,
        journal: Journal | None = None,
        read_timeout: float = READ_TIMEOUT,
        readers: int = READERS,
        engine_of: Callable[[Journal], Engine] | None = None,
        poll_ms: int = POLL_MS,
    ) -> None:
        self.location = location
        self.allow_actions = allow_actions
        #: Resume and Retry from run pages: with actions on and the host app given.
        self.drives = (
            Drives(self._check_journal, engine_of) if engine_of and allow_actions else None
        )
        self.read_timeout = read_timeout
        self.csrf_token = secrets.token_urlsafe(32)
        self._given = journal
        self._readers = Readers(self._open, journal)
        self._limiter = anyio.CapacityLimiter(readers)
        self._check_lock = threading.Lock()
        self.check: CheckJob | None = None
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        # A run id, machine or artifact name as one path segment: its "/" and ".." kept
        # from making the link another page's (Jinja's urlencode leaves "/" as it is).
        self.templates.filters["segment"] = lambda value: quote(str(value), safe="")
        # A run id as text: escaped, on one line, if it breaks the rule of run ids.
        self.templates.filters["shown"] = shown
        self.templates.filters["plural"] = _plural
        self.templates.filters["when"] = _when
        self.templates.filters["time_tag"] = _time_tag
        self.templates.globals.update(
            allow_actions=allow_actions,
            csrf_token=self.csrf_token,
            location=shown_location(location),
            poll_ms=poll_ms,
            statuses=views.STATUSES,
            drive_of=self.drives.of if self.drives else lambda _run_id: None,
            drives_on=self.drives is not None,
        )

    async def read(self, work: Callable[[Journal], T]) -> T:
        """``work(journal)`` in a worker thread, off the event loop, within ``read_timeout``.

        Raises:
            PageError: it took longer (503); the thread finishes on its own and its journal
                goes back to the others then.
        """
        try:
            with anyio.fail_after(self.read_timeout):
                return await anyio.to_thread.run_sync(
                    self._with_journal, work, limiter=self._limiter, abandon_on_cancel=True
                )
        except TimeoutError:
            raise PageError(
                503,
                "The journal is slow",
                f"reading this page took longer than {self.read_timeout:g} s; try again",
            ) from None

    def _with_journal(self, work: Callable[[Journal], T]) -> T:
        with self.journal() as journal:
            return work(journal)

    @contextmanager
    def journal(self) -> Iterator[Journal]:
        """A journal for one request; a journal error closes it (opened again next time)."""
        with self._readers.journal() as journal:
            yield journal

    def start_check(self) -> CheckJob:
        """Start ``check`` unless it is running; the job running or started."""
        with self._check_lock:
            if self.check is None or self.check.state != "running":
                self.check = CheckJob(self._check_journal)
            return self.check

    def _check_journal(self) -> tuple[Journal, bool]:
        """The journal a check or a drive uses, and whether it is its own to close after.

        One of its own, unless a memory journal was given (shared, never closed by them).
        """
        if self._given is None:
            return self._open(), True
        opener = getattr(self._given, "opener", None)
        if self._given.location == ":memory:" or opener is None:
            return self._given, False
        return opener()(), True

    def _open(self) -> Journal:
        try:
            return locate_journal(self.location)
        except JournalError as exc:  # none there; or damaged, foreign, its server unreachable
            raise PageError(503, "The journal cannot be opened", one_line(exc)) from None

    def close_journal(self) -> None:
        """Close the journals opened for reads and stop a running check (the server stops)."""
        self._readers.close()
        check = self.check
        if check is not None and check.state == "running":
            check.cancel()
            check.wait(self.read_timeout)

    def page(self, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        """Render ``template`` with ``context``."""
        html = self.templates.get_template(template).render(**context)
        return HTMLResponse(utf8(html), status_code=status, headers=PAGE_HEADERS)

    def check_csrf(self, form: Mapping[str, list[str]], action: str) -> None:
        """Refuse a form without this server's CSRF token (403).

        The refusal page offers the form again, its fields as they were sent and this server's
        token, to be sent with one more click: a page loaded before the server restarted (a new
        token) loses nothing typed into it, and a form another site made the browser send is
        shown to the user, never carried out.
        """
        given = (form.get("csrf_token") or [""])[0]
        if not hmac.compare_digest(given.encode(), self.csrf_token.encode()):
            fields = [(k, v) for k, values in form.items() if k != "csrf_token" for v in values]
            raise PageError(
                403,
                "Refused",
                "the form's CSRF token is missing or wrong (was the page loaded before the"
                " inspector restarted?); nothing was done",
                resend=(action, fields),
            )


def _plural(count: int, noun: str) -> str:
    """``1 run``, ``2 runs``: the count and its noun."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _when(moment: dt.datetime | None) -> str:
    """A time as the pages show it: to the second, in UTC, said so."""
    return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def _time_tag(moment: dt.datetime | None) -> Markup:
    """A ``<time>`` element: UTC as text and on hover; the page's script shows it in local time."""
    if moment is None:
        return Markup("-")
    utc = _when(moment)
    return Markup('<time datetime="{}" title="{}">{}</time>').format(
        moment.astimezone(dt.timezone.utc).isoformat(), utc, utc
    )


def shown_location(location: str) -> str:
    """The journal's location as pages and messages show it: a URL's password hidden."""
    return redact(location) if is_postgres_url(location) else location


def one_line(exc: Exception) -> str:
    """An error's message on one line."""
    return " ".join(str(exc).split())
