"""``python -m fsm_runner.presets.subphases``: the preset's command line (see the package)."""

from fsm_runner.presets.subphases import main

if __name__ == "__main__":  # not when a tool imports every module
    main()
