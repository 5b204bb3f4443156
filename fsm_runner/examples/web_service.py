"""A web service that takes orders and runs each as a durable five-phase job (needs ``[ui]``).

The service only starts runs; workers in processes of their own run them::

    export FSM_RUNNER_JOURNAL=orders.db FSM_RUNNER_ORDERS_DIR=orders
    uvicorn --factory fsm_runner.examples.web_service:create_app --port 8000 &
    fsm-runner worker --app fsm_runner.examples.web_service:make_engine &
    curl -X POST localhost:8000/orders -d '{"order_id": "A-1", "items": ["book"]}'
    curl localhost:8000/orders/A-1

* ``POST /orders`` takes ``{"order_id": ..., "items": [...]}`` and answers **202** once the run is
  durable in the journal (``Engine.astart``: off the event loop, one commit for the requests of
  a loop turn). The client's id is the run's (``order-<id>``), so a request sent again — a
  retry after a lost answer — finds the run it started (``RunExistsError``) and gets **200**
  with the same run id: never a second order. Bad input is a **400** with a JSON error.
* ``GET /orders/{id}`` answers the run's state and status (**404** for an unknown order);
  ``GET /healthz`` answers 200 while the journal can be read, 503 when it cannot.
* The phases (validating, reserving, charging, packing, shipping) each write one small file
  in ``FSM_RUNNER_ORDERS_DIR`` (default ``./orders``), after ``FSM_RUNNER_ORDERS_DELAY``
  seconds of simulated work (default 0): a worker killed at any point leaves its
  run to another, which goes on from its last journaled state; a phase that was cut off runs
  again and writes the same file.
* Shutdown is graceful: the lifespan closes the engine and the journal once uvicorn has let
  the requests in progress finish; a worker stops on SIGTERM (exit 0), its run let go.

``FSM_RUNNER_JOURNAL`` names the journal (a SQLite path or a PostgreSQL URL) for the service and,
as for every command, for ``fsm-runner worker``, which gives ``make_engine`` its journal.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fsm_runner import Engine, MachineSpec, PhaseContext, RunEvent, State, Transition
from fsm_runner.exceptions import JournalError, RunExistsError, RunNotFoundError
from fsm_runner.journal import Journal, open_journal

__all__ = ["SPEC", "create_app", "make_engine"]

#: The phases of an order, in order; each ends with ``DONE``.
PHASES = ("validating", "reserving", "charging", "packing", "shipping")
SPEC = MachineSpec(
    "order",
    [
        *(State(phase, handler="phase") for phase in PHASES),
        State("delivered", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ],
    [
        *(
            Transition(phase, "DONE", after)
            for phase, after in zip(PHASES, [*PHASES[1:], "delivered"], strict=True)
        ),
        Transition("validating", "INVALID", "failed"),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "canceled"),
    ],
)
#: What an order id may be: it becomes part of a run id and of file names.
ORDER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def orders_dir() -> Path:
    """Where the phases write (``FSM_RUNNER_ORDERS_DIR``, default ``./orders``)."""
    return Path(os.environ.get("FSM_RUNNER_ORDERS_DIR", "orders"))


def phase(ctx: PhaseContext) -> str:
    """One step of an order: a file that says it was done (the same file if it runs again)."""
    order = ctx.input["order_id"]
    if ctx.state == "validating" and not ctx.input.get("items"):
        return "INVALID"
    time.sleep(float(os.environ.get("FSM_RUNNER_ORDERS_DELAY", "0")))  # the work, simulated
    folder = orders_dir() / order
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{PHASES.index(ctx.state) + 1}-{ctx.state}").write_text(
        json.dumps({"order": order, "phase": ctx.state, "attempt": ctx.attempt}) + "\n"
    )
    return "DONE"


def make_engine(journal: Journal) -> Engine:
    """The order engine on ``journal`` (the caller's to close).

    ``fsm-runner worker --app fsm_runner.examples.web_service:make_engine`` gives it the
    command's journal (its parameter is named ``journal``): ``--journal``, or
    ``FSM_RUNNER_JOURNAL``, the one the service writes.
    """
    return Engine(SPEC, handlers={"phase": phase}, journal=journal)


def _order(body: bytes) -> Mapping[str, Any]:
    """The order a request sends, or ``ValueError`` saying what is wrong with it."""
    try:
        order = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("the body is not JSON") from None
    if not isinstance(order, dict):
        raise ValueError("the body is not a JSON object")  # noqa: TRY004 - a 400, as the rest
    order_id = order.get("order_id")
    if not isinstance(order_id, str) or not ORDER_ID.fullmatch(order_id):
        raise ValueError("order_id must be 1 to 64 letters, digits, '.', '_' or '-'")
    items = order.get("items", [])
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ValueError("items must be a list of strings")
    return {"order_id": order_id, "items": items}


def create_app(location: str | None = None) -> Any:
    """The Starlette app of the service, on the journal at ``location`` (or the environment's)."""
    from starlette.applications import Starlette  # noqa: PLC0415 - the [ui] extra's
    from starlette.concurrency import run_in_threadpool  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import JSONResponse  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    where = location or os.environ.get("FSM_RUNNER_JOURNAL", "orders.db")
    state: dict[str, Engine] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        journal = open_journal(where)
        try:
            with make_engine(journal) as engine:
                state["engine"] = engine
                yield
                state.clear()
        finally:
            journal.close()

    def answer(run: Any, status: int = 200) -> JSONResponse:
        return JSONResponse(
            {
                **run.input,
                "run_id": run.run_id,
                "state": run.state,
                "status": run.status.value,
                "seq": run.seq,
            },
            status_code=status,
        )

    async def post_order(request: Request) -> JSONResponse:
        try:
            order = _order(await request.body())
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        engine = state["engine"]
        run_id = f"order-{order['order_id']}"  # the client's id: a retried POST finds its run
        try:
            await engine.astart(order, run_id=run_id)  # off the event loop; durable on return
        except RunExistsError:  # sent again: the run the first request started, not a second
            return answer(await engine.aload(run_id), 200)
        first = {"state": SPEC.initial_leaf, "status": "active", "seq": 0}  # as just stored
        return JSONResponse({**order, "run_id": run_id, **first}, status_code=202)

    async def get_order(request: Request) -> JSONResponse:
        order_id = request.path_params["order_id"]
        if not ORDER_ID.fullmatch(order_id):
            return JSONResponse({"error": "no such order"}, status_code=404)
        try:
            run = await state["engine"].aload(f"order-{order_id}")
        except RunNotFoundError:
            return JSONResponse({"error": "no such order"}, status_code=404)
        return answer(run)

    async def healthz(request: Request) -> JSONResponse:
        journal = state["engine"].journal
        try:
            await run_in_threadpool(journal.runs, limit=1)
        except JournalError as exc:
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=503)
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/orders", post_order, methods=["POST"]),
            Route("/orders/{order_id}", get_order),
            Route("/healthz", healthz),
        ],
        lifespan=lifespan,
    )
