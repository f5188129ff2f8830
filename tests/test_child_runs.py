"""conftest.run_in_child, which isolates a test whose process has died inside XLA's runtime: a death by signal is
rerun once with a warning that carries the dead child's stderr, two in a row fail, and a failed assertion in the
child fails at once (never rerun), its traceback in the failure."""

import os
import signal

import pytest

from conftest import run_in_child


def _abort_in_first_attempt(directory):
    if directory.name == "attempt0":
        os.kill(os.getpid(), signal.SIGABRT)


def _abort(directory):
    os.kill(os.getpid(), signal.SIGABRT)


def _wrong_value(directory):
    assert 1 + 1 == 3, "planted wrong value"


@pytest.mark.integration
def test_a_death_by_signal_is_rerun_once_with_its_stderr_in_a_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"(?s)rerun after a death by signal 6.*Fatal Python error: Aborted"):
        run_in_child(_abort_in_first_attempt, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt0", "attempt1"]


@pytest.mark.integration
def test_two_deaths_by_signal_fail(tmp_path):
    with pytest.warns(UserWarning), pytest.raises(pytest.fail.Exception, match=r"_abort in a child process exited -6"):
        run_in_child(_abort, tmp_path)


@pytest.mark.integration
def test_a_failed_assertion_fails_at_once_and_is_not_rerun(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited 1; .*AssertionError: planted wrong value"):
        run_in_child(_wrong_value, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["attempt0"]
