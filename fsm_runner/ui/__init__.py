"""The run inspector, ``fsm-runner ui``: runs, timelines and diagrams in a browser.

Served by the CLI over any journal the CLI opens (SQLite or PostgreSQL); needs the ``ui``
extra (``pip install 'fsm-runner[ui]'``: Starlette, uvicorn, Jinja2). Pages are rendered on
the server and every asset ships in this package, so it works offline. Importing this package
imports nothing of the web stack; :mod:`fsm_runner.ui.app` does.
"""
