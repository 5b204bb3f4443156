"""The pure step logic: what a step decides and what the run row becomes, with no I/O.

``reducer.py`` derives a run's row from each transition (the engine when it steps, replay
when it rebuilds a run); ``classify.py`` reads which rule a journaled transition follows;
``decisions.py`` says what a handler's return came to and whether to retry it. Nothing here
imports a driver, a lease, a journal or asyncio: the engine and replay import these modules,
never the other way round (``tests/test_rules.py`` checks it).
"""
