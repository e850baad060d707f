"""The errors any layer raises and the messages they format: a ConfigError names the field, what was
expected and what it got; a RunInterrupted says what happened, then which checkpoint resumes; a
WriteFailed names the file, the system's reason and the remedy; each exits with its own status."""

import errno
import os
from pathlib import Path

import pytest

from fl_lightning.errors import UNWRITABLE_ERRNOS, ConfigError, RankLost, RunInterrupted, WriteFailed


def test_a_config_error_names_the_field_what_was_expected_and_what_it_got():
    error = ConfigError("federation.clients_per_round", "at most federation.num_clients (10)", 12)
    assert str(error) == "federation.clients_per_round: expected at most federation.num_clients (10), got 12"
    assert error.field_name == "federation.clients_per_round"


@pytest.mark.parametrize("got, shown", [("adam", "'adam'"), (None, "None"), ([1, "b"], "[1, 'b']"),
                                        ("it's", '"it\'s"'), (0.5, "0.5")])
def test_a_config_error_shows_what_it_got_as_python_writes_it(got, shown):
    # A string in quotes: an empty value or one with spaces stays visible as what it is.
    assert str(ConfigError("optimizer.name", "one of sgd, adamw", got)) == \
        f"optimizer.name: expected one of sgd, adamw, got {shown}"


def test_a_config_error_is_a_value_error():
    with pytest.raises(ValueError, match="^data.alpha: expected a number above 0, got -1$"):
        raise ConfigError("data.alpha", "a number above 0", -1)


def test_a_run_interrupted_says_what_happened_until_fit_adds_its_advice():
    error = RunInterrupted("rank 1 is gone", remedy="check the node")
    assert str(error) == "rank 1 is gone"
    assert (error.what, error.remedy, error.advice) == ("rank 1 is gone", "check the node", "")
    error.advice = "the same command resumes from round 4 (checkpoints/round_0004.pt)"
    assert str(error) == "rank 1 is gone; the same command resumes from round 4 (checkpoints/round_0004.pt)"
    assert error.what == "rank 1 is gone"


def test_a_run_interrupted_has_no_remedy_unless_given_and_exits_with_status_1():
    error = RunInterrupted("stopped")
    assert error.remedy == ""
    assert error.exit_status == 1
    assert isinstance(error, RuntimeError)


@pytest.mark.parametrize("code, remedy", [
    (errno.ENOSPC, "free space on its file system"),
    (errno.EDQUOT, "free space within your disk quota"),
    (errno.EACCES, "make its folder writable"),
    (errno.EPERM, "make its folder writable"),
    (errno.EROFS, "make its folder writable (its file system is mounted read-only)"),
])
def test_a_write_failure_the_user_can_put_right_names_the_file_the_reason_and_the_remedy(code, remedy):
    path = Path("runs") / "seed0" / "checkpoint.pt"
    error = WriteFailed(path, OSError(code, os.strerror(code)))
    assert str(error) == f"cannot write runs/seed0/checkpoint.pt ({os.strerror(code)})"
    assert error.remedy == remedy


def test_a_write_failure_of_another_cause_has_no_remedy():
    error = WriteFailed(Path("metrics.jsonl"), OSError(errno.EIO, "Input/output error"))
    assert str(error) == "cannot write metrics.jsonl (Input/output error)"
    assert error.remedy == ""


def test_a_write_failure_without_a_system_reason_shows_the_error_itself():
    error = WriteFailed(Path("state.pt"), OSError("the writer gave up"))
    assert str(error) == "cannot write state.pt (the writer gave up)"
    assert error.remedy == ""


def test_a_write_failure_takes_the_advice_of_a_run_interrupted():
    error = WriteFailed(Path("state.pt"), OSError(errno.ENOSPC, "No space left on device"))
    error.advice = "the same command resumes from round 2"
    assert str(error) == "cannot write state.pt (No space left on device); the same command resumes from round 2"


def test_the_unwritable_errors_are_those_with_a_remedy():
    assert UNWRITABLE_ERRNOS == {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
    for code in UNWRITABLE_ERRNOS:
        assert WriteFailed(Path("f"), OSError(code, os.strerror(code))).remedy


def test_each_interruption_exits_with_its_own_status():
    # sysexits.h: EX_IOERR for a file that cannot be written, EX_TEMPFAIL for a rank that is gone.
    write_failed = WriteFailed(Path("f"), OSError(errno.ENOSPC, "No space left on device"))
    rank_lost = RankLost("rank 2 is gone (its process died)")
    assert (RunInterrupted.exit_status, write_failed.exit_status, rank_lost.exit_status) == (1, 74, 75)
    assert isinstance(write_failed, RunInterrupted) and isinstance(rank_lost, RunInterrupted)
    assert str(rank_lost) == "rank 2 is gone (its process died)"
