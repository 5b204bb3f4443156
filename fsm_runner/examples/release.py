"""A four-phase release job, journaled in ``./fsm-runner.db``: the README's tour runs it.

``fetching → building → testing → publishing → published``. Each phase does real work in the
run's own directory of the workspace (``WORKSPACE/RUN_ID``): it fetches the sources (journaled
with the phase's output), builds a reproducible archive of them, checks the archive against the
sources, and publishes the archive with its checksum to ``WORKSPACE/dist``. Run it with::

    python -m fsm_runner.examples.release [--journal PATH] [--workspace DIR] [--stop-after N]

``--stop-after N`` stops the process after N phases, as a crash would; ``fsm-runner resume RUN
--app fsm_runner.examples.release:make_engine`` then finishes the run without repeating them.

A phase takes what an earlier phase made from the journal, not from files an earlier process
left behind: the sources are the output of ``fetching``, and the archive is built again from
them (byte for byte the same) when the run's directory does not hold it. So a fork
(``fsm-runner fork RUN --at SEQ``), which runs the phases after ``SEQ`` again under its own run
id, resumes like the original, and so does a run whose workspace was cleaned.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import click

from fsm_runner import (
    Engine,
    Journal,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    RunEvent,
    SqliteJournal,
    State,
    Transition,
    check_run_id,
    interrupt_on_sigterm,
)
from fsm_runner.command_line import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    ExitCodeCommand,
    journal_option,
    suggested_command,
)
from fsm_runner.journal.locate import locate_journal
from fsm_runner.records import RunRecord, TransitionRecord

__all__ = ["SPEC", "main", "make_engine"]

PROG = "python -m fsm_runner.examples.release"
APP = "fsm_runner.examples.release:make_engine"

SPEC = MachineSpec(
    "release",
    states=[
        State("fetching", handler="fetch", description="write the sources into the workspace"),
        State("building", handler="build", description="archive the sources"),
        State("testing", handler="test", description="check the archive against the sources"),
        State("publishing", handler="publish", description="publish the archive and checksum"),
        State("published", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ],
    transitions=[
        Transition("fetching", "FETCHED", "building"),
        Transition("building", "BUILT", "testing"),
        Transition("testing", "TESTS_PASSED", "publishing"),
        Transition("testing", "TESTS_FAILED", "failed"),
        Transition("publishing", "PUBLISHED", "published"),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "canceled"),
    ],
)


def _run_dir(ctx: PhaseContext) -> Path:
    """This run's own directory: a fork works in its own, never in the original's.

    The run id names the directory, so it is checked here, where it becomes a path: an id that
    breaks the rule of run ids (written before the rule, or by another writer: ``..``,
    ``../elsewhere``) is refused (``InvalidRunIdError``, the run fails), and so is a directory
    that resolves outside the workspace (a symbolic link): the run writes nothing outside it.
    """
    workspace = Path(ctx.input["workspace"])
    run_dir = workspace / check_run_id(ctx.run_id)
    if not run_dir.resolve().is_relative_to(workspace.resolve()):
        raise ValueError(f"run {ctx.run_id}: its directory {run_dir} is outside the workspace")
    return run_dir


def _archive_path(ctx: PhaseContext) -> Path:
    return _run_dir(ctx) / f"release-{ctx.input['version']}.tar.gz"


def _sources(ctx: PhaseContext) -> dict[str, str]:
    """The fetched sources, read from the journal (``fetching``'s output; a fork has it too)."""
    fetched = ctx.output_of("fetching")
    if not isinstance(fetched, Mapping) or not isinstance(fetched.get("sources"), Mapping):
        raise TypeError(f"run {ctx.run_id} has no journaled sources from 'fetching'")
    return {str(name): str(text) for name, text in fetched["sources"].items()}


def _write_archive(archive: Path, sources: Mapping[str, str]) -> str:
    """Archive ``sources`` under ``src/``, reproducibly; return the archive's SHA-256.

    Fixed times, owners, modes and order: the same sources give the same bytes, so an archive
    made again (a fork, a cleaned workspace) is the one that was built and tested.
    """
    archive.parent.mkdir(parents=True, exist_ok=True)
    staging = archive.with_name(archive.name + ".partial")
    with open(staging, "wb") as raw:
        with (
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as compressed,
            tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            folder = tarfile.TarInfo("src")
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(folder)
            for name in sorted(sources):
                data = sources[name].encode()
                member = tarfile.TarInfo(f"src/{name}")
                member.size, member.mode = len(data), 0o644
                tar.addfile(member, io.BytesIO(data))
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(staging, archive)
    return _sha256(archive)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _archive(ctx: PhaseContext) -> Path:
    """This run's archive; made again from the journaled sources when it is not there."""
    archive = _archive_path(ctx)
    if not archive.exists():
        _write_archive(archive, _sources(ctx))
    return archive


def fetch(ctx: PhaseContext) -> PhaseResult:
    """Fetch the release's sources: write them into the run's directory and journal them."""
    version = ctx.input["version"]
    sources = {"VERSION": version + "\n", "hello.py": f'print("hello from {version}")\n'}
    src = _run_dir(ctx) / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (src / name).write_text(text)
    return PhaseResult("FETCHED", output={"files": sorted(sources), "sources": sources})


def build(ctx: PhaseContext) -> PhaseResult:
    """Archive the sources (from the journal) in the run's directory."""
    archive = _archive_path(ctx)
    digest = _write_archive(archive, _sources(ctx))
    return PhaseResult("BUILT", output={"archive": archive.name, "sha256": digest})


def test(ctx: PhaseContext) -> PhaseResult:
    """Check that the archive is the one built and holds exactly the sources."""
    sources = _sources(ctx)
    archive = _archive(ctx)
    built = ctx.output_of("building") or {}
    digest = _sha256(archive)
    if built.get("sha256") not in (None, digest):
        return PhaseResult(
            "TESTS_FAILED", error=f"{archive.name} is not the archive built ({digest[:12]})"
        )
    with tarfile.open(archive) as tar:
        found = {}
        for member in tar.getmembers():
            extracted = tar.extractfile(member) if member.isfile() else None
            if extracted is not None:
                found[member.name] = extracted.read().decode()
    expected = {f"src/{name}": text for name, text in sources.items()}
    if found != expected:
        return PhaseResult(
            "TESTS_FAILED", error=f"archive holds {sorted(found)}, expected {sorted(expected)}"
        )
    return PhaseResult("TESTS_PASSED", output={"checked": len(found)})


def publish(ctx: PhaseContext) -> PhaseResult:
    """Publish the archive next to its SHA-256 in the workspace's ``dist``."""
    archive = _archive(ctx)
    digest = _sha256(archive)
    dist = Path(ctx.input["workspace"]) / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    target = dist / archive.name
    staging = dist / (archive.name + ".partial")
    shutil.copyfile(archive, staging)
    os.replace(staging, target)  # readers of dist never see half an archive
    (dist / (archive.name + ".sha256")).write_text(f"{digest}  {archive.name}\n")
    return PhaseResult("PUBLISHED", output={"published": str(target), "sha256": digest})


HANDLERS = {"fetch": fetch, "build": build, "test": test, "publish": publish}


def make_engine(journal: Journal | str | os.PathLike[str] = "fsm-runner.db") -> Engine:
    """The release engine on ``journal``, or on a SQLite journal at that path.

    ``fsm-runner resume RUN --app fsm_runner.examples.release:make_engine`` gives it the
    command's journal (its parameter is named ``journal``).
    """
    if isinstance(journal, str | os.PathLike):
        journal = SqliteJournal(journal)
    return Engine(SPEC, handlers=HANDLERS, journal=journal)


def _print(transition: TransitionRecord, run: RunRecord) -> None:
    source = transition.from_state or "-"
    click.echo(f"{transition.seq:>3}  {source:<11} --{transition.event}--> {run.state}")


@click.command(
    cls=ExitCodeCommand,
    name=PROG,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@journal_option()
@click.option(
    "--workspace",
    default="fsm-runner-release",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    metavar="DIR",
    help="Where the phases work: a directory per run, and dist/ for what is published.",
)
@click.option("--version", default="1.0.0", show_default=True, help="The version to release.")
@click.option(
    "--stop-after",
    type=click.IntRange(min=1),
    metavar="N",
    help="Stop after N phases, as a crash would; finish the run with fsm-runner resume.",
)
def release(journal_path: str, workspace: Path, version: str, stop_after: int | None) -> None:
    """Start a four-phase release run and drive it (to the end, or for --stop-after phases).

    fetching -> building -> testing -> publishing -> published, journaled transition by
    transition. Exits 0 when the run succeeded or was stopped by --stop-after, 1 when it
    failed, 130 when it was interrupted (Ctrl-C, SIGTERM; it stays resumable), and like
    fsm-runner on a journal it cannot use (3: none there).
    """
    journal = locate_journal(journal_path, must_exist=False)
    engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
    try:
        engine.listeners.append(_print)
        run_id = engine.start({"version": version, "workspace": str(workspace.absolute())})
        # Suggested commands name the journal unless fsm-runner finds it by itself.
        resume = suggested_command("fsm-runner", journal_path, "resume", run_id[:12], "--app", APP)
        try:
            with interrupt_on_sigterm():
                run = engine.run(run_id, max_steps=stop_after)
        except KeyboardInterrupt as exc:
            cause = str(exc).removeprefix("signal ") or "Ctrl-C"
            click.echo(f"Error: run {run_id} interrupted by {cause}; resume it: {resume}", err=True)
            sys.exit(EXIT_INTERRUPTED)
    finally:
        engine.close()
        journal.close()
    click.echo(f"run {run_id}: {run.status.value} in state {run.state!r}")
    click.echo(
        f"inspect it with: {suggested_command('fsm-runner', journal_path, 'show', run_id[:12])}"
    )
    if not run.ended:
        click.echo(f"finish it with: {resume}")
    if run.status.value not in ("succeeded", "active"):
        sys.exit(EXIT_FAILURE)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the example's command line (``--help`` lists its options); exits with its code."""
    release.main(args=list(argv) if argv is not None else None, prog_name=PROG)


if __name__ == "__main__":
    main()
