"""The command-driven agent loop, under the path that runs journaled before it moved record.

The code lives in :mod:`fsm_runner.presets.agent_loop.commands`. A run's input names its app
(``fsm_runner.presets.agent_commands:make_engine``) and the demo's agent command (``python -m
fsm_runner.presets.agent_commands agent``), and ``fsm-runner resume`` imports and runs what the
journal says: this module keeps both working for runs started before the presets were grouped.
"""

from fsm_runner.presets.agent_loop import commands as _commands
from fsm_runner.presets.agent_loop.commands import *  # noqa: F403 - the same names, see above

__all__ = _commands.__all__

if __name__ == "__main__":
    raise SystemExit(_commands.main())
