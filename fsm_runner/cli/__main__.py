"""``python -m fsm_runner.cli``: the ``fsm-runner`` command line."""

from fsm_runner.cli import main

if __name__ == "__main__":
    main()
