"""The package as published: one version, a license file, a changelog, what CI runs on.

The built distributions themselves are checked by ``.ci/run`` (``python -m build``, ``twine
check``, the wheel installed and run away from the source tree); these tests keep the files
those steps read in agreement.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from click.testing import CliRunner

import fsm_runner
from fsm_runner.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def test_the_version_is_written_once():
    assert setup_cfg()["metadata"]["version"] == "attr: fsm_runner.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", fsm_runner.__version__)
    answer = CliRunner().invoke(cli, ["--version"])
    assert answer.exit_code == 0
    assert answer.output == f"fsm-runner, version {fsm_runner.__version__}\n"


def test_the_license_file_is_the_license_the_metadata_names():
    assert setup_cfg()["metadata"]["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")


def test_the_changelog_keeps_a_changelog():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n")
    assert "## [Unreleased]" in text
    assert "Keep a Changelog" in text
