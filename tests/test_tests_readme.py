"""tests/README.md, the map of where each behaviour is tested, names every file of tests/.

It is kept by hand; this keeps it whole: every test module, bench script and helper module of
``tests/`` is named in it, and every such file it names exists.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parent
MAP = TESTS / "README.md"


def named() -> set[str]:
    """Every ``.py`` file of tests/ the map names, as a path relative to tests/."""
    text = MAP.read_text()
    return {
        name.removeprefix("tests/")
        for name in re.findall(r"`(?:python )?((?:tests/)?(?:apps/|bench/)?\w+\.py)\b", text)
    }


def files() -> set[str]:
    """Every module of tests/ a reader may look for: tests, bench scripts, helpers, apps."""
    return {
        str(path.relative_to(TESTS))
        for path in [*TESTS.glob("*.py"), *TESTS.glob("apps/*.py"), *TESTS.glob("bench/*.py")]
        if path.name != "__init__.py"
    }


def is_named(name: str) -> bool:
    """A file is named by its path in tests/, or by its bare name (the bench table's way)."""
    return name in named() or Path(name).name in named()


def test_every_test_module_is_on_the_map():
    missing = {name for name in files() if name.startswith("test_") and not is_named(name)}
    assert not missing, f"tests/README.md does not say what these test: {sorted(missing)}"


def test_every_bench_script_and_helper_is_on_the_map():
    missing = {name for name in files() if not name.startswith("test_") and not is_named(name)}
    assert not missing, f"tests/README.md does not name: {sorted(missing)}"


def test_the_map_names_no_module_that_is_gone():
    present = files() | {Path(name).name for name in files()}
    gone = named() - present
    assert not gone, f"tests/README.md names modules that do not exist: {sorted(gone)}"
