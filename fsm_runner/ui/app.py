"""The run inspector's web application: Starlette routes over one journal, Jinja2 pages.

Read-mostly: every page reads the journal through :mod:`fsm_runner.ui.views`, in a worker
thread with a journal of its own (:mod:`fsm_runner.ui.jobs`), never on the event loop: a slow
page delays only itself, and one that takes longer than the server's ``read_timeout`` is
answered with an error page. ``check`` is a job of its own in the background, its progress
on its page, one at a time and cancellable. The only writes
are the actions, ``abort``, ``fork`` and ``signal`` (a waiting run's answer), which exist only
when the server was started with ``allow_actions=True``, answer only ``POST`` and only with the
server's CSRF token (a secret made when the app is built, compared in constant time). On
loopback, ``fsm-runner ui`` answers only requests whose Host header names this machine
(:data:`LOOPBACK_HOSTS`): a foreign site that makes its own name resolve to 127.0.0.1 (DNS
rebinding) is refused and reads nothing.

Errors never reach the browser as a traceback: an unknown run is a 404 page, a journal that
cannot be opened or read (missing, damaged, an unreachable server) a clear error page naming
the journal and what is wrong, anything else a plain 500 page (the traceback goes to the
server's log). Every template is autoescaped, so run data (inputs, errors, outputs) is text.
"""

from __future__ import annotations

import collections
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs, quote

import anyio.to_thread
import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fsm_runner.effects import SettleRefusedError, settle_effect
from fsm_runner.engine import Engine, abort_run, fork_run
from fsm_runner.engine.waits import signal_run
from fsm_runner.exceptions import (
    AmbiguousRunIdError,
    FsmRunnerError,
    JournalError,
    RunNotFoundError,
    RunTerminalError,
)
from fsm_runner.journal import Journal
from fsm_runner.journal.locate import resolve_run_id
from fsm_runner.records import RunRecord
from fsm_runner.run_ids import shown
from fsm_runner.spec import RunLifecycle
from fsm_runner.ui import views
from fsm_runner.ui.drives import Drives
from fsm_runner.ui.inspector import (
    HERE,
    POLL_MS,
    READ_TIMEOUT,
    READERS,
    Inspector,
    PageError,
    one_line,
    shown_location,
    utf8,
)

__all__ = ["LOOPBACK_HOSTS", "Inspector", "create_app", "shown_location"]

_LOG = logging.getLogger("fsm_runner.ui")

#: The Host headers a server on loopback answers (any port): a page of another site whose
#: name it made resolve to 127.0.0.1 (DNS rebinding) sends its own name, and is refused.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class _Json(JSONResponse):
    """A JSON response whose lone surrogates are escaped (see :func:`utf8`)."""

    def render(self, content: Any) -> bytes:
        return utf8(json.dumps(content, ensure_ascii=False, separators=(",", ":")))


def _sent_to(request: Request) -> str:
    """The path a request was sent to, as the browser wrote it (percent-encoded)."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if raw else quote(request.url.path)


def _resolve(journal: Journal, run_id: str) -> str:
    try:
        return resolve_run_id(journal, run_id)
    except AmbiguousRunIdError as exc:
        raise PageError(400, "Ambiguous run id", one_line(exc)) from None


def _inspector(request: Request) -> Inspector:
    inspector: Inspector = request.app.state.inspector
    return inspector


async def _home(request: Request) -> Response:
    return RedirectResponse("/runs", status_code=302)


async def _runs(request: Request) -> Response:
    inspector = _inspector(request)
    try:
        query = views.RunsQuery.from_params(request.query_params)
    except ValueError as exc:
        raise PageError(400, "Bad request", str(exc)) from None

    def read(journal: Journal) -> Response:
        asked = query
        if asked.parent:
            asked = views.RunsQuery(**{**_fields(asked), "parent": _resolve(journal, asked.parent)})
        if asked.waiting:
            return inspector.page("waiting.html", **views.waiting_page(journal, asked))
        if request.query_params.get("rows") == "1":  # the newest page refreshing its rows
            rows = views.runs_page(journal, asked, counted=False)
            return inspector.page("runs_rows.html", **rows)
        return inspector.page("runs.html", **views.runs_page(journal, asked))

    return await inspector.read(read)


def _fields(query: views.RunsQuery) -> dict[str, str]:
    return attrs.asdict(query)


#: The range of a seq in the query string: what a 64-bit SQL integer holds.
_SEQ_RANGE = range(-(2**63), 2**63)


def _int(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise PageError(400, "Bad request", f"{name} must be a whole number") from None
    if number not in _SEQ_RANGE:  # the journal's SQL cannot bind it
        raise PageError(400, "Bad request", f"{name} is out of range")
    return number


async def _run(request: Request) -> Response:
    inspector = _inspector(request)
    from_seq = _int(request.query_params.get("from"), "from")
    signal = _int(request.query_params.get("signal"), "signal")

    def read(journal: Journal) -> Response:
        run_id = _resolve(journal, request.path_params["run_id"])
        if run_id != request.path_params["run_id"]:
            return RedirectResponse(f"/runs/{quote(run_id, safe='')}", status_code=302)
        context = views.run_page(journal, run_id, from_seq=from_seq, signal=signal)
        return inspector.page("run.html", **context)

    return await inspector.read(read)


async def _live(request: Request) -> Response:
    inspector = _inspector(request)
    after = _int(request.query_params.get("after"), "after") or 0
    update = await inspector.read(
        lambda journal: views.live_update(journal, request.path_params["run_id"], after)
    )
    run = update["run"]
    rows = inspector.templates.get_template("timeline_rows.html").render(rows=update["rows"])
    signals = inspector.templates.get_template("signals.html").render(signals=update["signals"])
    waiting = None
    if update["moved"]:  # what it waits for now ("": nothing); unmoved, the page keeps its own
        waiting = inspector.templates.get_template("waiting_panel.html").render(
            run=run, waiting=update["waiting"]
        )
    summary = commands = None
    if update["facts"] is not None:  # ended: the page's summary and commands as they are now
        ended = {"run": run, "page": {"is_last": True}, **update["facts"]}
        summary = inspector.templates.get_template("run_summary.html").render(**ended)
        commands = inspector.templates.get_template("run_commands.html").render(**ended)
    return _Json(
        {
            "seq": run.seq,
            "state": run.state,
            "status": run.status.value,
            "ended": run.ended,
            "rows": rows,
            "gap": update["gap"],
            "diagram": update["diagram"],
            "signals": signals,
            "waiting": waiting,
            "summary": summary,
            "commands": commands,
        }
    )


async def _artifact(request: Request) -> Response:
    inspector = _inspector(request)
    name = request.path_params["name"]
    run_id = request.path_params["run_id"]

    def read(journal: Journal) -> list[Any]:
        found = [a for a in journal.artifacts(run_id) if a.name == name]
        if not found:
            journal.load(run_id)  # an unknown run is a 404 of its own
            raise PageError(
                404, "No such artifact", f"run {shown(run_id)} has no artifact {name!r}"
            )
        return found

    artifact = (await inspector.read(read))[0]
    body = json.dumps(artifact.content, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    filename = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "artifact"
    return Response(
        utf8(body),
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="{filename}.json"'},
    )


async def _machine(request: Request) -> Response:
    inspector = _inspector(request)
    name = request.path_params["name"]
    context = await inspector.read(lambda journal: views.machine_page(journal, name))
    if context is None:
        raise PageError(404, "No such machine", f"the journal has no runs of machine {name!r}")
    return inspector.page("machine.html", **context)


async def _check(request: Request) -> Response:
    inspector = _inspector(request)
    job = inspector.check
    if job is None:
        await inspector.read(lambda journal: None)  # one that cannot be opened: its error page
        job = inspector.start_check()
    return inspector.page("check.html", **views.check_page(job))


async def _check_progress(request: Request) -> Response:
    """The check job's progress, for its page to poll."""
    job = _inspector(request).check
    if job is None:
        return _Json({"state": None})
    return _Json({"state": job.state, "done": job.done, "total": job.total})


async def _check_again(request: Request) -> Response:
    """Start the check again, or cancel it (``action=cancel``); read-only: no ``allow_actions``."""
    inspector = _inspector(request)
    form = await _posted(request)
    if (form.get("action") or [""])[0] == "cancel":
        if inspector.check is not None:
            inspector.check.cancel()
    else:
        inspector.start_check()
    return RedirectResponse("/check", status_code=303)


async def _posted(request: Request) -> dict[str, list[str]]:
    """A form sent with this server's CSRF token (else a 403 that offers it again)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    form = parse_qs(body, keep_blank_values=True)
    _inspector(request).check_csrf(form, _sent_to(request))
    return form


def _actions_on(request: Request) -> None:
    if not _inspector(request).allow_actions:
        raise PageError(
            403,
            "Actions are off",
            "start the inspector with --allow-actions to abort, fork, answer a waiting run or"
            " settle an effect",
        )


async def _form(request: Request) -> dict[str, list[str]]:
    """An action's form: actions on (``--allow-actions``) and the CSRF token right."""
    _actions_on(request)
    return await _posted(request)


async def _bulk_abort(request: Request) -> Response:
    """Abort the active runs the runs list's filters show: a confirm page, then the POST."""
    _actions_on(request)
    inspector = _inspector(request)
    if request.method == "POST":
        form = await _form(request)
        params = {name: values[0] for name, values in form.items()}
    else:
        form, params = {}, dict(request.query_params)
    try:
        query = views.RunsQuery.from_params(params)
    except ValueError as exc:
        raise PageError(400, "Bad request", str(exc)) from None
    reason = params.get("reason", "").strip()
    if form and not reason:
        raise PageError(400, "A reason is needed", "say why the runs are aborted")
    filters = [(k, v) for k, v in attrs.asdict(query).items() if v and k in views.BULK_FILTERS]

    def work(journal: Journal) -> Response:
        parent = _resolve(journal, query.parent) if query.parent else ""
        targets, more = views.bulk_targets(journal, attrs.evolve(query, parent=parent))
        if not form:
            return inspector.page(
                "bulk_abort.html", query=query, targets=targets, more=more, filters=filters
            )
        tally = collections.Counter(_abort_one(journal, run_id, reason) for run_id in targets)
        ended, held, gone = tally["ended"], tally["held"], tally["gone"]
        return inspector.page(
            "bulk_abort.html", query=query, done=ended + held, ended=ended, held=held, gone=gone
        )

    return await inspector.read(work)


def _abort_one(journal: Journal, run_id: str, reason: str) -> str:
    """Abort a run of a bulk abort: ``ended`` at once, ``held`` by a worker, or ``gone``."""
    try:
        run = abort_run(journal, run_id, reason)
    except (RunTerminalError, RunNotFoundError):
        return "gone"  # it ended (or was pruned) since the list was read
    return "held" if run.lease_owner and not run.ended else "ended"


async def _abort(request: Request) -> Response:
    form = await _form(request)
    reason = (form.get("reason") or [""])[0].strip()
    if not reason:
        raise PageError(400, "A reason is needed", "say why the run is aborted")
    inspector = _inspector(request)

    def write(journal: Journal) -> str:
        run_id = _resolve(journal, request.path_params["run_id"])
        abort_run(journal, run_id, reason)
        return run_id

    run_id = await inspector.read(write)
    return RedirectResponse(f"/runs/{quote(run_id, safe='')}", status_code=303)


async def _fork(request: Request) -> Response:
    form = await _form(request)
    at_seq = _int((form.get("at") or [""])[0], "at")
    inspector = _inspector(request)

    def write(journal: Journal) -> RunRecord:
        run_id = _resolve(journal, request.path_params["run_id"])
        try:
            return fork_run(journal, run_id, at_seq=at_seq)
        except ValueError as exc:
            raise PageError(400, "Cannot fork there", str(exc)) from None

    forked = await inspector.read(write)
    return RedirectResponse(f"/runs/{quote(forked.run_id, safe='')}", status_code=303)


def _drives(request: Request) -> Drives:
    drives = _inspector(request).drives
    if drives is None:
        raise PageError(
            403,
            "Resume is off",
            "start the inspector with --allow-actions and --app MODULE:ATTR (the host app, as"
            " `fsm-runner resume` takes it) to resume or retry runs from their page",
        )
    return drives


#: How long Resume and Retry wait for their drive before showing the run's page: long enough
#: that a drive refused at once (the run held by a worker) says so on the page it opens.
_DRIVE_GRACE = 0.5


async def _resume(request: Request) -> Response:
    """Resume a run in a thread of the server (``--app``); Retry: fork a failed run, resume it."""
    await _form(request)
    drives = _drives(request)
    retry = request.url.path.endswith("/retry")

    def write(journal: Journal) -> str:
        run_id = _resolve(journal, request.path_params["run_id"])
        run = journal.load(run_id)
        if retry:
            if run.status is not RunLifecycle.FAILED:
                raise PageError(400, "Cannot retry", f"the run is {run.status.value}, not failed")
            return fork_run(journal, run_id, at_seq=views.fork_seq(run)).run_id
        if run.ended:
            raise PageError(400, "Cannot resume", f"the run has ended ({run.status.value})")
        return run_id

    run_id = await _inspector(request).read(write)
    drive = drives.start(run_id)
    await anyio.to_thread.run_sync(drive.wait, _DRIVE_GRACE)
    return RedirectResponse(f"/runs/{quote(run_id, safe='')}", status_code=303)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def _signal(request: Request) -> Response:
    """Answer a waiting run: journal a signal (``signal_run``), then show the run again.

    The payload, if any, must be JSON (else 400, nothing written); the signal id is optional.
    The run page the redirect shows says what became of the signal (consumed: the run moved
    on; pending). An ended run or a name no waiting state accepts: the refusal page (409).
    """
    form = await _form(request)
    name = (form.get("name") or [""])[0].strip()
    if not name:
        raise PageError(400, "A signal is needed", "name the signal to send")
    text = (form.get("payload") or [""])[0].strip()
    payload: Any = None
    if text:
        try:
            payload = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            detail = f"the payload is not JSON ({one_line(exc)}); nothing was sent"
            raise PageError(400, "The payload is not JSON", detail) from None
    signal_id = (form.get("signal_id") or [""])[0].strip() or None
    inspector = _inspector(request)

    def write(journal: Journal) -> tuple[str, int]:
        run_id = _resolve(journal, request.path_params["run_id"])
        return run_id, signal_run(journal, run_id, name, payload, signal_id=signal_id).number

    run_id, number = await inspector.read(write)
    return RedirectResponse(
        f"/runs/{quote(run_id, safe='')}?signal={number}#outcome", status_code=303
    )


async def _settle(request: Request) -> Response:
    """Settle an effect caught in flight (``settle_effect``), then show the run again.

    ``outcome`` ``done`` (with ``result``, JSON, optional) or ``failed`` (with a ``reason``);
    who settles it is ``by`` (default: ``inspector``). No such effect: 404; not in flight, or
    a live lease holds the run: the refusal page (409).
    """
    form = await _form(request)
    field = {key: (values or [""])[0].strip() for key, values in form.items()}
    outcome, reason = field.get("outcome"), field.get("reason", "")
    if outcome not in ("done", "failed") or (outcome == "failed" and not reason):
        raise PageError(400, "Bad request", "settle it done, or failed with a reason")
    result: Any = None
    if field.get("result"):
        try:
            result = json.loads(field["result"], parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            detail = f"the result is not JSON ({one_line(exc)}); nothing was written"
            raise PageError(400, "The result is not JSON", detail) from None
    inspector = _inspector(request)

    def write(journal: Journal) -> str:
        run_id = _resolve(journal, request.path_params["run_id"])
        try:
            settle_effect(
                journal,
                run_id,
                field.get("name", ""),
                done=outcome == "done",
                result=result,
                reason=reason,
                by=field.get("by") or "inspector",
                visit_seq=_int(field.get("visit"), "visit"),
            )
        except SettleRefusedError as exc:
            status = 404 if exc.reason == "not_found" else 409
            raise PageError(status, "Cannot settle it", str(exc)) from None
        return run_id

    run_id = await inspector.read(write)
    return RedirectResponse(f"/runs/{quote(run_id, safe='')}#effects", status_code=303)


def _error_page(
    request: Request,
    status: int,
    title: str,
    detail: str,
    resend: tuple[str, list[tuple[str, str]]] | None = None,
) -> Response:
    inspector = _inspector(request)
    if request.url.path.endswith("/live"):
        return _Json({"error": title, "detail": detail}, status_code=status)
    return inspector.page("error.html", status=status, title=title, detail=detail, resend=resend)


async def _on_page_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PageError)
    return _error_page(request, exc.status, exc.title, exc.detail, exc.resend)


async def _on_not_found(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RunNotFoundError)
    return _error_page(request, 404, "No such run", f"the journal has no run {exc.run_id!r}")


async def _on_journal_error(request: Request, exc: Exception) -> Response:
    _LOG.warning("journal error: %s", exc)
    return _error_page(request, 503, "The journal cannot be read", " ".join(str(exc).split()))


async def _on_refused(request: Request, exc: Exception) -> Response:
    return _error_page(request, 409, "Refused", " ".join(str(exc).split()))


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    titles = {404: "Not found", 405: "Method not allowed"}
    title = titles.get(exc.status_code, "Error")
    return _error_page(request, exc.status_code, title, str(exc.detail))


async def _on_crash(request: Request, exc: Exception) -> Response:
    # Starlette raises it again once this page is sent, and uvicorn logs its traceback.
    return _error_page(
        request, 500, "Internal error", "the inspector failed on this page; its log says why"
    )


def _routes() -> list[Route | Mount]:
    """Every page, form and file the inspector answers."""
    run_routes = [
        Route("/runs/{run_id:path}/live", _live),
        Route("/runs/{run_id:path}/artifacts/{name:path}", _artifact),
        Route("/runs/{run_id:path}/abort", _abort, methods=["POST"]),
        Route("/runs/{run_id:path}/fork", _fork, methods=["POST"]),
        Route("/runs/{run_id:path}/resume", _resume, methods=["POST"]),
        Route("/runs/{run_id:path}/retry", _resume, methods=["POST"]),
        Route("/runs/{run_id:path}/signal", _signal, methods=["POST"]),
        Route("/runs/{run_id:path}/settle", _settle, methods=["POST"]),
        Route("/runs/{run_id:path}", _run),
    ]
    for route in run_routes:
        # The path convertor's ``.*`` stops at a newline, which a run id written before the
        # rule of run ids may hold (its link quotes it as %0A): such a run's page answers too.
        route.path_regex = re.compile(route.path_regex.pattern, re.DOTALL)
    return [
        Route("/", _home),
        Route("/runs", _runs),
        Route("/bulk-abort", _bulk_abort, methods=["GET", "POST"]),
        *run_routes,
        Route("/machines/{name:path}", _machine),
        Route("/check", _check),
        Route("/check/progress", _check_progress),
        Route("/check", _check_again, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]


def create_app(
    location: str,
    *,
    allow_actions: bool = False,
    hosts: Sequence[str] | None = None,
    journal: Journal | None = None,
    read_timeout: float = READ_TIMEOUT,
    readers: int = READERS,
    engine_of: Callable[[Journal], Engine] | None = None,
    poll_ms: int = POLL_MS,
) -> Starlette:
    """The inspector's ASGI app over the journal at ``location`` (a path or a PostgreSQL URL).

    Args:
        location: the journal, as ``fsm-runner --journal`` takes it.
        allow_actions: serve the abort, fork and answer forms (POST, with the CSRF token).
        hosts: the only Host header names answered (others: 400); ``None``: any.
            ``fsm-runner ui`` on loopback gives :data:`LOOPBACK_HOSTS` and its ``--host``.
        journal: an open journal to serve instead of opening ``location`` (a memory
            journal, an app embedding the inspector); its giver closes it.
        read_timeout: seconds a page may read before it is answered with an error page (503).
        readers: pages read at once, each in a worker thread with a journal of its own.
        engine_of: the host app's engine on a journal (``fsm-runner ui --app``): with
            ``allow_actions``, run pages offer Resume and, on failed runs, Retry.
        poll_ms: how often an open page looks for news, in milliseconds: a live run page and
            a running check's (the newest runs' page, twice that).

    Returns:
        The Starlette app; its ``state.inspector`` holds the :class:`Inspector`.
    """
    inspector = Inspector(
        location,
        allow_actions=allow_actions,
        journal=journal,
        read_timeout=read_timeout,
        readers=readers,
        engine_of=engine_of,
        poll_ms=poll_ms,
    )
    routes = _routes()
    handlers: dict[Any, Callable[[Request, Exception], Any]] = {
        PageError: _on_page_error,
        RunNotFoundError: _on_not_found,
        JournalError: _on_journal_error,
        FsmRunnerError: _on_refused,
        HTTPException: _on_http,
        Exception: _on_crash,
    }

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        inspector.close_journal()

    middleware = [
        Middleware(_HostInLowerCase),
        Middleware(TrustedHostMiddleware, allowed_hosts=[host.lower() for host in hosts or ["*"]]),
    ]
    app = Starlette(
        routes=routes, exception_handlers=handlers, lifespan=lifespan, middleware=middleware
    )
    app.state.inspector = inspector
    return app


class _HostInLowerCase:
    """An ASGI middleware: the request's Host header in lower case, as host names compare.

    Starlette's ``TrustedHostMiddleware`` compares them case-blind in its newer releases; 1.7,
    the newest pip installs on Python 3.10, compares them as sent (``LOCALHOST`` refused).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = [(k, v.lower() if k == b"host" else v) for k, v in scope["headers"]]
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)
