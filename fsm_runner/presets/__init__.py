"""Ready-made machines with their handlers and service protocols, built on the public API.

One package or module a preset: :mod:`~fsm_runner.presets.agent_loop` (an AI coding agent's
build → snapshot → verify → feedback loop), :mod:`~fsm_runner.presets.subphases` (ordered
sub-phases beside a helper server the harness owns), :mod:`~fsm_runner.presets.coordinator` (a
session that walks a task graph), and :mod:`~fsm_runner.presets.sandbox` (phases each allowed
only certain kinds of side effect). ``gitcli`` is the git the agent loop and the coordinator
share, ``_local_server`` the HTTP half of our small JSON servers (the sub-phases' helper server;
the tests' counter server); ``agent_services`` and ``agent_commands`` are the old paths of two
modules that moved into ``agent_loop``.
"""
