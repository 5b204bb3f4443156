"""Runnable examples: ``python -m fsm_runner.examples.release``."""
