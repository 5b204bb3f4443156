"""A four-phase release job, journaled in ``./fsm-runner.db``: the README's first command.

``fetching → building → testing → publishing → published``. Each phase does real work in a
workspace directory: it writes the sources, builds an archive of them, checks the archive's
contents against the sources, and publishes the archive with its checksum. Run it with::

    python -m fsm_runner.examples.release [--journal PATH] [--workspace DIR] [--stop-after N]

``--stop-after N`` stops the process after N phases, as a crash would; ``fsm-runner resume RUN
--app fsm_runner.examples.release:make_engine`` then finishes the run without repeating them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tarfile
from pathlib import Path

from fsm_runner import (
    Engine,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    RunEvent,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.records import RunRecord, TransitionRecord

__all__ = ["SPEC", "main", "make_engine"]

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


def _workspace(ctx: PhaseContext) -> Path:
    return Path(ctx.input["workspace"]) / ctx.run_id


def fetch(ctx: PhaseContext) -> PhaseResult:
    """Write the release's sources."""
    src = _workspace(ctx) / "src"
    src.mkdir(parents=True, exist_ok=True)
    version = ctx.input["version"]
    (src / "VERSION").write_text(version + "\n")
    (src / "hello.py").write_text(f'print("hello from {version}")\n')
    return PhaseResult("FETCHED", output={"files": sorted(p.name for p in src.iterdir())})


def build(ctx: PhaseContext) -> PhaseResult:
    """Archive the sources."""
    root = _workspace(ctx)
    archive = root / f"release-{ctx.input['version']}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root / "src", arcname="src")
    return PhaseResult("BUILT", output={"archive": archive.name}, context={"archive": str(archive)})


def test(ctx: PhaseContext) -> PhaseResult:
    """Check that the archive holds exactly the sources."""
    root = _workspace(ctx)
    with tarfile.open(ctx.context["archive"]) as tar:
        names = sorted(name for name in tar.getnames() if name.count("/") == 1)
    expected = sorted(f"src/{p.name}" for p in (root / "src").iterdir())
    if names != expected:
        return PhaseResult("TESTS_FAILED", error=f"archive holds {names}, expected {expected}")
    return PhaseResult("TESTS_PASSED", output={"checked": len(names)})


def publish(ctx: PhaseContext) -> PhaseResult:
    """Publish the archive next to its SHA-256."""
    archive = Path(ctx.context["archive"])
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    dist = Path(ctx.input["workspace"]) / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    target = dist / archive.name
    os.replace(archive, target)
    (dist / (archive.name + ".sha256")).write_text(f"{digest}  {archive.name}\n")
    return PhaseResult("PUBLISHED", output={"published": str(target), "sha256": digest})


HANDLERS = {"fetch": fetch, "build": build, "test": test, "publish": publish}


def make_engine(journal_path: str | os.PathLike[str] = "fsm-runner.db") -> Engine:
    """The release engine on a SQLite journal (the CLI rebinds it to its own journal)."""
    return Engine(SPEC, handlers=HANDLERS, journal=SqliteJournal(journal_path))


def _print(transition: TransitionRecord, run: RunRecord) -> None:
    source = transition.from_state or "-"
    print(f"{transition.seq:>3}  {source:<11} --{transition.event}--> {run.state}")


def main(argv: list[str] | None = None) -> int:
    """Start a release run and drive it (to the end, or for ``--stop-after`` phases)."""
    parser = argparse.ArgumentParser(prog="python -m fsm_runner.examples.release")
    parser.add_argument("--journal", default=os.environ.get("FSM_RUNNER_JOURNAL", "fsm-runner.db"))
    parser.add_argument("--workspace", default="fsm-runner-release")
    parser.add_argument("--version", default="1.0.0")
    parser.add_argument("--stop-after", type=int, default=None, metavar="N")
    args = parser.parse_args(argv)
    engine = make_engine(args.journal)
    engine.listeners.append(_print)
    run_id = engine.start({"version": args.version, "workspace": os.path.abspath(args.workspace)})
    run = engine.run(run_id, max_steps=args.stop_after)
    print(f"run {run_id}: {run.status.value} in state {run.state!r}")
    print(f"inspect it with: fsm-runner --journal {args.journal} show {run_id[:12]}")
    if not run.ended:
        print(
            f"finish it with: fsm-runner --journal {args.journal} resume {run_id[:12]}"
            " --app fsm_runner.examples.release:make_engine"
        )
    engine.journal.close()
    return 0 if run.status.value in ("succeeded", "active") else 1


if __name__ == "__main__":
    raise SystemExit(main())
