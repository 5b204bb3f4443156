"""Servers only the tests run: real external systems in subprocesses."""
