"""conftest.run_in_child, which isolates a test whose process has died inside XLA's runtime: a death by signal is
rerun once with a warning that carries the dead child's stderr, two in a row fail, and a failed assertion in the
child fails at once (never rerun), its traceback in the failure. And conftest.PJRT_NPROC: the simulated devices'
XLA:CPU thread pools have 4 threads per device, not max(cores, devices)."""

import collections
import os
import pathlib
import signal

import pytest

from conftest import PJRT_NPROC, run_in_child


def _abort_in_first_attempt(directory):
    if directory.name == "attempt0":
        os.kill(os.getpid(), signal.SIGABRT)


def _abort(directory):
    os.kill(os.getpid(), signal.SIGABRT)


def _wrong_value(directory):
    assert 1 + 1 == 3, "planted wrong value"


def test_a_death_by_signal_is_rerun_once_with_its_stderr_in_a_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"(?s)rerun after a death by signal 6.*Fatal Python error: Aborted"):
        run_in_child(_abort_in_first_attempt, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt0", "attempt1"]


def test_two_deaths_by_signal_fail(tmp_path):
    with pytest.warns(UserWarning), pytest.raises(pytest.fail.Exception, match=r"_abort in a child process exited -6"):
        run_in_child(_abort, tmp_path)


def test_a_failed_assertion_fails_at_once_and_is_not_rerun(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited 1; .*AssertionError: planted wrong value"):
        run_in_child(_wrong_value, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["attempt0"]


def test_simulated_devices_get_4_intra_op_threads_each():
    """XLA:CPU starts its intra-op pool (threads named tf_XLAEigen) with PJRT_NPROC threads when it is set, else
    max(cores, devices): 8 on a 2-core host, where the pipelined step's waiting collectives could hold every thread
    and abort the process (benchmarks/repro/cpu_collective_starvation.py)."""
    import jax
    assert os.environ["PJRT_NPROC"] == str(PJRT_NPROC) and PJRT_NPROC >= 4 * jax.device_count()
    names = collections.Counter(p.read_text().strip() for p in pathlib.Path("/proc/self/task").glob("*/comm"))
    assert names["tf_XLAEigen"] == PJRT_NPROC, names
