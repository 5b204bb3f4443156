"""The README's and docs/'s examples are checked: Python blocks run, `$` commands parse or run.

What each document holds is checked as a reader would use it:

* every ```python block runs as written, the blocks of one document in order, in one empty
  working directory (a later block may read what an earlier one wrote); a block that cannot run
  as it stands is marked on the line before its fence with ``<!-- not-run: REASON -->``, and the
  reason is required;
* every command -- a ``$ ...`` line of a ```console block, every line of a ```bash block, and
  each inline ``python tests/bench/...`` -- names a program this repository ships, and its
  subcommand and options exist (``fsm-runner`` and ``python -m fsm_runner...`` are parsed with
  ``--help``, so nothing runs; a bench script's options must be in its ``--help``; ``pip
  install`` names extras that exist; ``export`` sets a variable fsm_runner reads);
* a ```console block marked ``<!-- session -->`` on the line before its fence runs for real, its
  commands in order through ``bash`` in one empty directory, and each command must print what
  the block shows: run ids (the document's ids stand for the session's, in commands too), times,
  decimal numbers, numbers with thousands separators and absolute paths aside, a ``...`` line
  standing for any lines;
* every fence says its language, and a ```text block is not Python in disguise;
* every relative link and image resolves, anchors included;
* the exception tree in docs/reference.md is ``fsm_runner.exceptions``' tree, and docs/design.md
  numbers every invariant the code and the tests cite.

The README's own rules (its Quick start) are in ``test_readme.py``.
"""

from __future__ import annotations

import ast
import builtins
import configparser
import functools
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

#: A fenced block: its info string and its text.
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", flags=re.MULTILINE | re.DOTALL)
#: What a fence may be labelled; an unlabelled fence is refused.
LANGUAGES = {"python", "console", "bash", "text", "mermaid"}
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->\s*$")


def name_of(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path) -> list[tuple[str, str, str]]:
    """Each fenced block of ``path``: (language, text, the line before its fence)."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((match.group(1).strip(), match.group(2), before))
    return found


def python_blocks(path: Path) -> list[str]:
    return [
        text
        for language, text, before in blocks(path)
        if language == "python" and not NOT_RUN.search(before)
    ]


# -- the blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS, ids=name_of)
def test_every_fence_says_its_language(path):
    for language, text, before in blocks(path):
        assert language in LANGUAGES, f"{name_of(path)}: a fence labelled {language!r}:\n{text}"
        if SESSION.search(before):
            assert language == "console", f"{name_of(path)}: a session mark on a {language} block"
        marked = NOT_RUN.search(before)
        if marked:
            assert language == "python", f"{name_of(path)}: not-run marks a {language} block"
            assert marked.group(1), f"{name_of(path)}: a not-run mark gives no reason"


@pytest.mark.parametrize("path", DOCS, ids=name_of)
def test_text_blocks_are_not_python(path):
    """Code shown as ```text would go unchecked: label it python (or mark it not-run)."""
    for language, text, _ in blocks(path):
        if language != "text":
            continue
        try:
            ast.parse(text)
        except SyntaxError:
            continue
        raise AssertionError(f"{name_of(path)}: a ```text block that is Python:\n{text}")


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=name_of)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for index, block in enumerate(python_blocks(path)):
        code = compile(block, f"{name_of(path)} (python block {index + 1})", "exec")
        exec(code, {"__name__": f"doc_{path.stem}_{index}"})


def test_the_docs_have_python_to_run():
    assert python_blocks(README), "the README lost its ```python example"
    assert python_blocks(ROOT / "docs" / "guide.md"), "the guide lost its examples"


# -- the commands -------------------------------------------------------------------------------


def shell_lines(path: Path) -> list[str]:
    """Each command line of ``path``: `$` lines of console blocks, lines of bash blocks."""
    lines = []
    for language, text, _ in blocks(path):
        joined = text.replace("\\\n", " ").splitlines()
        if language == "console":
            lines += [line[2:] for line in joined if line.startswith("$ ")]
        elif language == "bash":
            lines += [line for line in joined if line.strip() and not line.lstrip().startswith("#")]
    return lines


def inline_bench_commands(path: Path) -> list[str]:
    spans = re.findall(r"`([^`]+)`", path.read_text())
    return [" ".join(span.split()) for span in spans if span.startswith("python tests/bench/")]


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, split at ``&&``, ``||``, ``;`` and ``|``."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in {";", "&&", "||", "|", "&"}:
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def fsm_runner_command():
    """The click group `fsm-runner` runs (the console script's module holds it as ``cli``)."""
    scripts = setup_cfg()["options.entry_points"]["console_scripts"]
    (target,) = [
        line.split("=", 1)[1].strip()
        for line in scripts.strip().splitlines()
        if line.split("=", 1)[0].strip() == "fsm-runner"
    ]
    module = __import__(target.partition(":")[0], fromlist=["cli"])
    return module.cli


@functools.cache
def help_of(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv, "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def check_cli(argv: list[str]) -> None:
    result = CliRunner().invoke(fsm_runner_command(), [*argv, "--help"])
    assert result.exit_code == 0, (argv, result.output)


def check_python(argv: list[str]) -> None:
    if argv[:1] == ["-m"]:
        module = argv[1]
        if module == "fsm_runner":
            check_cli(argv[2:])
        elif module == "pytest":
            for arg in argv[2:]:
                if arg.startswith("tests/"):
                    assert (ROOT / arg.split("::")[0]).exists(), arg
        elif module.startswith("fsm_runner."):
            shown = help_of(tuple(argv))
            assert shown.returncode == 0, (argv, shown.stderr)
        else:
            raise AssertionError(f"python -m {module}: not a module of this repository")
        return
    script = argv[0]
    assert script.startswith("tests/bench/"), argv
    assert (ROOT / script).is_file(), argv
    shown = help_of((script,))
    assert shown.returncode == 0, (script, shown.stderr)
    for option in (arg.split("=")[0] for arg in argv[1:] if arg.startswith("--")):
        assert re.search(rf"(^|\s|\[){re.escape(option)}\b", shown.stdout), (argv, option)


def check_pip(argv: list[str]) -> None:
    assert argv[0] == "install", argv
    extras = setup_cfg()["options.extras_require"]
    for arg in argv[1:]:
        if arg.startswith("-"):
            continue
        name, _, wanted = arg.partition("[")
        assert name in {".", "fsm-runner"}, f"pip install of {arg!r}, not fsm-runner"
        for extra in filter(None, wanted.rstrip("]").split(",")):
            assert extra in extras, f"pip install names an extra setup.cfg lacks: {extra!r}"


def check_export(argv: list[str]) -> None:
    for assignment in argv:
        variable = assignment.split("=", 1)[0]
        sources = "".join(p.read_text() for p in (ROOT / "fsm_runner").rglob("*.py"))
        assert variable in sources, f"export {variable}: fsm_runner never reads it"


def check_command(argv: list[str]) -> None:
    program, rest = argv[0], argv[1:]
    if program in {"fsm-runner", ".venv/bin/fsm-runner"}:
        check_cli(rest)
    elif program in {"python", "python3", ".venv/bin/python"}:
        if rest[:2] == ["-m", "venv"]:
            assert rest[2:] == [".venv"], argv
        else:
            check_python(rest)
    elif program in {"pip", ".venv/bin/pip"}:
        check_pip(rest)
    elif program == "export":
        check_export(rest)
    elif program == "source":
        assert rest == [".venv/bin/activate"], argv
    elif program != "echo":
        raise AssertionError(f"a command of no program this repository knows: {argv}")


def check_line(line: str) -> None:
    for argv in simple_commands(line):
        check_command(argv)


@pytest.mark.parametrize("path", DOCS, ids=name_of)
def test_commands_parse(path):
    for line in shell_lines(path) + inline_bench_commands(path):
        check_line(line)


def test_the_docs_have_commands_to_check():
    programs = {
        argv[0] for path in DOCS for line in shell_lines(path) for argv in simple_commands(line)
    }
    assert {"fsm-runner", "python", "pip", "export"} <= programs
    assert inline_bench_commands(ROOT / "docs" / "performance.md")


def test_a_bad_command_is_caught():
    """The checks above refuse what they should (the test of the tests)."""
    for bad in (
        "fsm-runner no-such-command",
        "fsm-runner runs --no-such-option",
        "python tests/bench/bench_engine.py --no-such-option",
        "pip install 'fsm-runner[no-such-extra]'",
        "export NO_SUCH_VARIABLE=1",
        "rm -rf /",
    ):
        with pytest.raises(AssertionError):
            check_line(bad)


# -- sessions: console blocks run for real -------------------------------------------------------

SESSION = re.compile(r"<!--\s*session\s*-->\s*$")
#: A run id, or the 12-character prefix the CLI prints.
RUN_ID = re.compile(r"\b[0-9a-f]{32}\b|\b[0-9a-f]{12}\b")
#: What differs from one session to the next: times, durations, absolute paths.
VARYING = [
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?"), "<time>"),
    (re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])"), "<number>"),
    (re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\w.,])"), "<number>"),  # sizes in bytes
    (re.compile(r"(?<![\w.])(?:/[\w.-]+)+/"), "/.../"),
]


def sessions(path: Path) -> list[list[tuple[str, list[str]]]]:
    """Each console block marked ``<!-- session -->``: its commands, each with its output."""
    found = []
    for language, text, before in blocks(path):
        if language != "console" or not SESSION.search(before):
            continue
        steps: list[tuple[str, list[str]]] = []
        for line in text.replace("\\\n", " ").splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line)
        found.append(steps)
    return found


def masked(line: str) -> str:
    line = RUN_ID.sub("<id>", line)
    for pattern, mask in VARYING:
        line = pattern.sub(mask, line)
    return " ".join(line.split())


def bind_ids(expected: str, actual: str, ids: dict[str, str]) -> None:
    """Learn which run of the session each id of the document stands for."""
    for shown, real in zip(RUN_ID.findall(expected), RUN_ID.findall(actual), strict=True):
        ids.setdefault(shown, real)


def with_real_ids(command: str, ids: dict[str, str]) -> str:
    """The command with each run id (or prefix of one) of the document replaced by the real one."""

    def real(match: re.Match[str]) -> str:
        word = match.group(0)
        for shown, run_id in ids.items():
            if len(word) >= 4 and shown.startswith(word):
                return run_id[: len(word)]
        return word

    return re.sub(r"\b[0-9a-f]{4,32}\b", real, command)


def outputs_match(expected: list[str], actual: list[str], ids: dict[str, str]) -> bool:
    """Whether ``actual`` is ``expected``, a ``...`` line standing for any lines."""
    if not expected:
        return not actual
    if expected[0].strip() == "...":
        return any(
            outputs_match(expected[1:], actual[skip:], ids) for skip in range(len(actual) + 1)
        )
    if not actual or masked(expected[0]) != masked(actual[0]):
        return False
    bind_ids(expected[0], actual[0], ids)
    return outputs_match(expected[1:], actual[1:], ids)


def run_session(steps: list[tuple[str, list[str]]], directory: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.update(PYTHONUNBUFFERED="1", NO_COLOR="1", COLUMNS="200")
    env.pop("FSM_RUNNER_JOURNAL", None)
    ids: dict[str, str] = {}
    for command, expected in steps:
        real = with_real_ids(command, ids)
        done = subprocess.run(
            ["bash", "-c", f"{{ {real}\n}} 2>&1"],
            capture_output=True,
            text=True,
            check=False,
            cwd=directory,
            env=env,
            timeout=120,
        )
        actual = done.stdout.rstrip("\n").split("\n") if done.stdout.strip() else []
        assert outputs_match(expected, actual, ids), (
            f"$ {command}\n(run as: {real})\n--- the document shows:\n"
            + "\n".join(expected)
            + "\n--- it printed:\n"
            + "\n".join(actual)
        )


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if sessions(p)], ids=name_of)
def test_sessions_print_what_the_docs_show(path, tmp_path):
    for index, steps in enumerate(sessions(path)):
        directory = tmp_path / f"session-{index}"
        directory.mkdir()
        run_session(steps, directory)


def test_the_readme_shows_a_session():
    assert sessions(README)


# -- links --------------------------------------------------------------------------------------


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of ``path``."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


@pytest.mark.parametrize("path", [*DOCS, ROOT / "tests" / "README.md"], ids=name_of)
def test_links_resolve(path):
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{name_of(path)}: a link to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(linked), f"{name_of(path)}: no heading for {target}"


@pytest.mark.parametrize("path", DOCS[1:], ids=name_of)
def test_the_readme_links_every_doc(path):
    assert f"(docs/{path.name})" in README.read_text()


# -- the reference and the design ---------------------------------------------------------------


def sets_attribute(cls: type, attribute: str) -> bool:
    """Whether ``cls`` (or a base of it) sets or defines ``attribute``."""
    return any(
        attribute in vars(klass)
        or re.search(rf"self\.{attribute}\b(: [^=]+)? =", inspect.getsource(klass))
        for klass in cls.__mro__
        if klass.__module__.startswith("fsm_runner")
    )


def test_the_reference_draws_the_exception_tree():
    import fsm_runner.exceptions as exceptions

    (tree,) = [
        text
        for language, text, _ in blocks(ROOT / "docs" / "reference.md")
        if language == "text" and text.startswith("FsmRunnerError")
    ]
    parents: list[type] = []
    drawn = set()
    for line in tree.splitlines():
        match = re.match(r"^([│ ]*)(?:[├└]── )?(\w+)(?:\s+\(also (\w+)\))?(.*)$", line)
        assert match, line
        depth = len(match.group(1)) // 4 + (1 if "──" in line else 0)
        cls = getattr(exceptions, match.group(2))
        del parents[depth:]
        if parents:
            assert cls.__bases__[0] is parents[-1], (cls, parents[-1])
        if match.group(3):
            assert issubclass(cls, getattr(builtins, match.group(3))), cls
        for attribute in re.findall(r"(?<![\w.])\.(\w+)", match.group(4)):
            assert sets_attribute(cls, attribute), f"{cls.__name__} has no .{attribute}"
        parents.append(cls)
        drawn.add(cls.__name__)
    public = {
        name
        for name in exceptions.__all__
        if isinstance(getattr(exceptions, name), type)
        and issubclass(getattr(exceptions, name), exceptions.FsmRunnerError)
    }
    assert public == drawn


def cited_invariants() -> set[int]:
    cited = set()
    for path in [*(ROOT / "fsm_runner").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for phrase in re.findall(r"[Ii]nvariants? ((?:\d+(?:, | and |,)?)+)", path.read_text()):
            cited |= {int(number) for number in re.findall(r"\d+", phrase)}
    return cited


def test_design_numbers_every_cited_invariant():
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("\n## Invariants\n", 1)[1].split("\n## ", 1)[0]
    numbered = [int(n) for n in re.findall(r"^(\d+)\. ", section, flags=re.MULTILINE)]
    assert numbered == list(range(1, 9))
    assert cited_invariants() <= set(numbered), cited_invariants() - set(numbered)
