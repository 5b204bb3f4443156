"""The web-service example, run for real: uvicorn, two worker processes, concurrent clients (issue 31).

``fsm_runner/examples/web_service.py`` served by uvicorn on 127.0.0.1 over a SQLite file, two
``fsm-runner worker --app`` processes running its orders, clients POSTing from threads: every
acknowledged order (202) is delivered, each phase's file written, a POST sent again answers the
same run (200), bad input is a 400, a worker SIGKILLed mid-way costs nothing, SIGTERM stops the
service (its lifespan closes the journal) and the other worker cleanly, and ``check`` passes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from fsm_runner.examples.web_service import PHASES
from tests.ui_helpers import ROOT, free_port

pytestmark = pytest.mark.slow

ORDERS = 30


def call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} in {timeout} s"
        time.sleep(0.1)


@pytest.fixture
def service(tmp_path):
    env = {
        **os.environ,
        "FSM_RUNNER_JOURNAL": str(tmp_path / "orders.db"),
        "FSM_RUNNER_ORDERS_DIR": str(tmp_path / "orders"),
        "FSM_RUNNER_ORDERS_DELAY": "0.03",  # each phase: the workers are busy when one is killed
    }
    port = free_port()
    # Logs to files: a pipe nobody reads fills up with the access log and stops the server.
    web_log = (tmp_path / "web.log").open("w")
    worker_log = (tmp_path / "workers.log").open("w")
    web = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory",
         "fsm_runner.examples.web_service:create_app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=web_log, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return call(f"{url}/healthz") == (200, {"ok": True})
        except OSError:
            return False

    workers: list[subprocess.Popen] = []
    try:
        wait_until(healthy, 20, "the service did not answer /healthz")  # its journal made
        app = "fsm_runner.examples.web_service:make_engine"
        workers.extend(
            subprocess.Popen(
                [sys.executable, "-m", "fsm_runner", "worker", "--app", app],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=worker_log,
                text=True,
            )
            for _ in range(2)
        )
        yield url, web, workers, env, tmp_path
    finally:
        for proc in (web, *workers):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        web_log.close()
        worker_log.close()


def test_orders_are_taken_run_and_delivered_through_a_worker_kill(service):
    url, web, workers, env, folder = service
    orders = [{"order_id": f"A-{n}", "items": ["book", "pen"]} for n in range(ORDERS)]
    with ThreadPoolExecutor(max_workers=10) as clients:
        answers = list(clients.map(lambda order: call(f"{url}/orders", order), orders))
        workers[0].send_signal(signal.SIGKILL)  # mid-way: its run is taken over at once
        again = list(clients.map(lambda order: call(f"{url}/orders", order), orders[:5]))
    assert [status for status, _ in answers] == [202] * ORDERS
    assert {body["run_id"] for _, body in answers} == {f"order-A-{n}" for n in range(ORDERS)}
    # Sent again (a retry after a lost answer): the same run, never a second order.
    assert [status for status, _ in again] == [200] * 5
    assert [body["run_id"] for _, body in again] == [f"order-A-{n}" for n in range(5)]

    for bad, says in (
        ({"items": []}, "order_id"), ({"order_id": "../x"}, "order_id"),
        ({"order_id": "B-1", "items": "book"}, "items"),
    ):  # fmt: skip
        status, body = call(f"{url}/orders", bad)
        assert status == 400
        assert says in body["error"]
    assert call(f"{url}/orders/nope")[0] == 404

    def delivered() -> bool:
        return all(call(f"{url}/orders/A-{n}")[1]["state"] == "delivered" for n in range(ORDERS))

    wait_until(delivered, 90, "not every acknowledged order was delivered")
    for n in range(ORDERS):
        written = sorted(path.name for path in (folder / "orders" / f"A-{n}").iterdir())
        assert written == [f"{i}-{name}" for i, name in enumerate(PHASES, 1)]

    # Graceful stops: the service's lifespan closes its journal; the worker exits 0.
    web.send_signal(signal.SIGTERM)
    web.wait(timeout=30)
    web_err = (folder / "web.log").read_text()
    assert "Application shutdown complete" in web_err
    assert "Traceback" not in web_err
    workers[1].send_signal(signal.SIGTERM)
    assert workers[1].wait(timeout=30) == 0, (folder / "workers.log").read_text()
    check = subprocess.run(
        [sys.executable, "-m", "fsm_runner", "check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_readmes_excerpt_is_the_examples_code():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```python\nasync def post_order", 1)[1].split("```", 1)[0]
    example = (ROOT / "fsm_runner" / "examples" / "web_service.py").read_text()
    code = {line.strip() for line in example.splitlines()}
    lines = ["async def post_order" + block.splitlines()[0], *block.splitlines()[1:]]
    missing = [line for line in lines if line.strip() and line.strip() not in code]
    assert missing == [], "README.md's web-service excerpt is not the example's code"
