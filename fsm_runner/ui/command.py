"""``fsm-runner ui``: serve the run inspector over the journal, on loopback by default.

Nothing web-related is imported at the top of this module: ``fsm-runner --help`` imports it to
list the command and must stay fast; Starlette, uvicorn and Jinja2 (``pip install
'fsm-runner[ui]'``) are imported when the command runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from fsm_runner._lazy import LazyModule
from fsm_runner.command_line import journal_option

if TYPE_CHECKING:
    import ipaddress
    import socket

    from fsm_runner.engine import Engine
    from fsm_runner.journal import Journal
else:  # imported when the command runs, not by --help
    ipaddress = LazyModule("ipaddress", globals())
    socket = LazyModule("socket", globals())

__all__ = ["is_loopback", "ui"]

_MISSING = (
    "the run inspector needs the ui extra: pip install 'fsm-runner[ui]' ({name} is not installed)"
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


@click.command("ui")
@journal_option(inherited=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@click.option("--open", "open_browser", is_flag=True, help="Open the inspector in a browser.")
@click.option(
    "--allow-remote",
    is_flag=True,
    help="Allow a --host that is not loopback (anyone who reaches it can read the journal).",
)
@click.option(
    "--allow-actions",
    is_flag=True,
    help=(
        "Offer abort, fork, a waiting run's answers (signals) and the settling of effects caught"
        " in flight on run pages (POST with a CSRF token); off by default."
    ),
)
@click.option(
    "--app",
    metavar="MODULE:ATTR",
    help=(
        "The host app (an Engine or a factory, as `fsm-runner resume` takes it): run pages offer"
        " Resume, and Retry for failed runs, driven in the server. Needs --allow-actions."
    ),
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds a page may read the journal before it is answered with an error page.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between an open page's looks for news (a live run, a check; the newest runs"
    " twice that).",
)
def ui(  # noqa: PLR0917 - click passes each option by keyword
    journal_path: str,
    host: str,
    port: int,
    open_browser: bool,
    allow_remote: bool,
    allow_actions: bool,
    app: str | None,
    read_timeout: float,
    poll_interval: float,
) -> None:
    """Serve the run inspector: runs, waiting runs, timelines, machines, check.

    Read-only unless --allow-actions; with --app too, run pages resume and retry runs. Listens
    on 127.0.0.1 unless --host names another address together with --allow-remote. Stop it
    with Ctrl-C.
    """
    if app is not None and not allow_actions:
        raise click.UsageError("--app resumes runs from their pages: it needs --allow-actions")
    if not is_loopback(host):
        if not allow_remote:
            raise click.UsageError(
                f"--host {host} is not a loopback address: anyone who can reach it could read "
                "the journal; add --allow-remote to do it anyway"
            )
        click.echo(
            f"Warning: serving the journal on {host}, beyond this machine, without "
            "authentication: anyone who can reach it can read every run"
            + (" and abort, fork or answer them" if allow_actions else ""),
            err=True,
        )
    missing = [n for n in ("starlette", "uvicorn", "jinja2") if importlib.util.find_spec(n) is None]
    if missing:
        raise click.ClickException(_MISSING.format(name=", ".join(missing)))
    _serve(
        journal_path,
        host,
        port,
        open_browser=open_browser,
        allow_actions=allow_actions,
        read_timeout=read_timeout,
        engine_of=_engine_of(app) if app is not None else None,
        poll_ms=round(poll_interval * 1000),
    )


def _engine_of(app: str) -> Callable[[Journal], Engine]:
    """The host app's engine on a given journal; imported once now, so a bad --app fails here."""
    from fsm_runner.cli.apps import load_app  # noqa: PLC0415
    from fsm_runner.journal import open_journal  # noqa: PLC0415

    scratch = open_journal(":memory:")
    try:
        load_app(app, scratch).close()  # an import error, or no Engine: one line, exit 2
    finally:
        scratch.close()
    return functools.partial(load_app, app)


def _serve(
    location: str,
    host: str,
    port: int,
    *,
    open_browser: bool,
    allow_actions: bool,
    read_timeout: float,
    engine_of: Callable[[Journal], Engine] | None,
    poll_ms: int,
) -> None:
    # Imported here, not at the top: `fsm-runner --help` loads this module to list the command.
    import threading  # noqa: PLC0415
    import webbrowser  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415

    from fsm_runner.ui.app import LOOPBACK_HOSTS, create_app, shown_location  # noqa: PLC0415

    shown = f"[{host}]" if ":" in host else host
    # On loopback, only this machine's names: another site's name is DNS rebinding.
    hosts = [*LOOPBACK_HOSTS, shown.lower()] if is_loopback(host) else None
    app = create_app(
        location,
        allow_actions=allow_actions,
        hosts=hosts,
        read_timeout=read_timeout,
        engine_of=engine_of,
        poll_ms=poll_ms,
    )
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    url = f"http://{shown}:{port}/runs"
    click.echo(
        f"fsm-runner inspector on {url} (journal {shown_location(location)}"
        + (", actions on" if allow_actions else "")
        + (", resume and retry on" if engine_of is not None else "")
        + "); Ctrl-C stops it",
        err=True,
    )
    if open_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn shut down, then raised it
        server.run()
    click.echo("fsm-runner inspector stopped", err=True)
