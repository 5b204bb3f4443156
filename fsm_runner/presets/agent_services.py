"""The agent loop's real services, under the path the README has always named.

The code lives in :mod:`fsm_runner.presets.agent_loop.services`; this module is that one's
other name, so that code importing ``fsm_runner.presets.agent_services`` goes on working.
"""

from fsm_runner.presets.agent_loop import services as _services
from fsm_runner.presets.agent_loop.services import *  # noqa: F403 - the same names, see above

__all__ = _services.__all__
