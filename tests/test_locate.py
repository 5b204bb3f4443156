"""Finding and opening a journal, and naming its runs: ``fsm_runner.journal.locate``.

The library's own errors, never the CLI's: "no journal there" (:class:`JournalNotFoundError`)
is told apart from a journal that is there but cannot be opened (:class:`JournalError`), and an
ambiguous run-id prefix is an :class:`AmbiguousRunIdError` naming some of its matches.
"""

from __future__ import annotations

import pytest

from fsm_runner import Engine, SqliteJournal
from fsm_runner.exceptions import (
    AmbiguousRunIdError,
    JournalError,
    JournalNotFoundError,
    RunNotFoundError,
)
from fsm_runner.journal import DEFAULT_PATH, MemoryJournal
from fsm_runner.journal.locate import (
    DEFAULT_JOURNAL,
    ENV_JOURNAL,
    is_implied,
    journal_location,
    locate_journal,
    resolve_run_id,
)
from tests.helpers import linear_spec


class TestWhere:
    """The journal given, else $FSM_RUNNER_JOURNAL, else ./fsm-runner.db."""

    def test_default_is_the_engines_default(self):
        assert DEFAULT_JOURNAL == DEFAULT_PATH

    def test_order(self, monkeypatch):
        monkeypatch.delenv(ENV_JOURNAL, raising=False)
        assert journal_location() == "fsm-runner.db"
        assert journal_location("x.db") == "x.db"
        monkeypatch.setenv(ENV_JOURNAL, "env.db")
        assert journal_location() == "env.db"
        assert journal_location("") == ""  # given, even empty
        monkeypatch.setenv(ENV_JOURNAL, "")
        assert journal_location() == "fsm-runner.db"

    def test_implied(self, monkeypatch):
        monkeypatch.delenv(ENV_JOURNAL, raising=False)
        assert is_implied("fsm-runner.db")
        assert not is_implied("other.db")
        monkeypatch.setenv(ENV_JOURNAL, "other.db")
        assert is_implied("other.db")
        assert not is_implied("fsm-runner.db")  # a command without --journal finds other.db


class TestOpening:
    """No journal there, or one that cannot be opened: two errors, nothing created."""

    @pytest.mark.parametrize("kind", ["missing", "empty", "directory", "text", "no directory"])
    def test_no_journal_there(self, tmp_path, kind):
        path = tmp_path / "j.db"
        if kind == "empty":
            path.write_bytes(b"")
        elif kind == "directory":
            path.mkdir()
        elif kind == "text":
            path.write_text("my notes\n")
        elif kind == "no directory":
            path = tmp_path / "nowhere" / "j.db"
        with pytest.raises(JournalNotFoundError) as info:
            locate_journal(str(path))
        assert info.value.path == str(path)
        message = str(info.value)
        if kind in ("missing", "no directory"):
            assert message == f"no journal at {path}"
            assert not path.exists()
        else:
            assert message.startswith(f"journal {path}: ")
        assert "\n" not in message

    def test_a_damaged_journal_is_a_journal_error(self, tmp_path):
        path = tmp_path / "j.db"
        path.write_bytes(b"\x00garbage" * 1000)
        with pytest.raises(JournalError) as info:
            locate_journal(str(path))
        assert not isinstance(info.value, JournalNotFoundError)
        assert path.read_bytes() == b"\x00garbage" * 1000

    def test_a_missing_directory_when_creating(self, tmp_path):
        path = tmp_path / "nowhere" / "j.db"
        with pytest.raises(JournalNotFoundError) as info:
            locate_journal(str(path), must_exist=False)
        assert str(info.value) == f"journal {path}: its directory does not exist"
        assert not path.parent.exists()

    def test_creates_only_when_asked(self, tmp_path):
        path = tmp_path / "j.db"
        with pytest.raises(JournalNotFoundError):
            locate_journal(f"sqlite:///{path}")
        journal = locate_journal(f"sqlite:///{path}", must_exist=False)
        journal.close()
        locate_journal(str(path)).close()

    def test_memory(self):
        journal = locate_journal(":memory:")
        assert isinstance(journal, MemoryJournal)
        journal.close()


class TestRunIds:
    """A run id, or a unique prefix of one."""

    @pytest.fixture
    def journal(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal:
            engine = Engine(linear_spec("a"), handlers={"a": lambda ctx: "NEXT"}, journal=journal)
            for run_id in ("abc0", "abc1", "abd0", "ab"):
                engine.start(run_id=run_id)
            yield journal

    def test_exact_and_unique_prefix(self, journal):
        assert resolve_run_id(journal, "abc1") == "abc1"
        assert resolve_run_id(journal, "abd") == "abd0"
        assert resolve_run_id(journal, "ab") == "ab"  # an id itself, though others start with it

    def test_unknown(self, journal):
        with pytest.raises(RunNotFoundError):
            resolve_run_id(journal, "x")

    def test_ambiguous(self, journal):
        with pytest.raises(AmbiguousRunIdError) as info:
            resolve_run_id(journal, "abc")
        assert info.value.prefix == "abc"
        assert info.value.matches == ("abc0", "abc1")
        assert str(info.value) == (
            "run id prefix 'abc' is ambiguous: it matches abc0, abc1; give more characters"
        )
        assert isinstance(info.value, LookupError)
