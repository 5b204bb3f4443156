"""``python -m fsm_runner``: the ``fsm-runner`` command line, for when it is not on ``PATH``."""

from fsm_runner.cli import main

if __name__ == "__main__":
    main()
