"""conftest.run_in_child, which runs a test body in a fresh process so that an abort inside XLA's runtime fails
the test with the child's stderr (XLA's message, every thread's Python stack): a death by signal fails at once,
never rerun, as does a failed assertion, its traceback in the failure. And conftest.PJRT_NPROC: the simulated
devices' XLA:CPU thread pools have 4 threads per device, not max(cores, devices)."""

import collections
import os
import pathlib
import signal

import pytest

from conftest import PJRT_NPROC, run_in_child


def _abort(directory):
    os.kill(os.getpid(), signal.SIGABRT)


def _wrong_value(directory):
    assert 1 + 1 == 3, "planted wrong value"


@pytest.mark.integration
def test_a_death_by_signal_fails_at_once_with_its_stderr(tmp_path):
    with pytest.raises(pytest.fail.Exception,
                       match=r"(?s)_abort in a child process exited -6; .*Fatal Python error: Aborted"):
        run_in_child(_abort, tmp_path)


@pytest.mark.integration
def test_a_failed_assertion_fails_at_once(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited 1; .*AssertionError: planted wrong value"):
        run_in_child(_wrong_value, tmp_path)


def test_simulated_devices_get_4_intra_op_threads_each():
    """XLA:CPU starts its intra-op pool (threads named tf_XLAEigen) with PJRT_NPROC threads when it is set, else
    max(cores, devices): 8 on a 2-core host, where the pipelined step's waiting collectives could hold every thread
    and abort the process (benchmarks/repro/cpu_collective_starvation.py)."""
    import jax
    assert os.environ["PJRT_NPROC"] == str(PJRT_NPROC) and PJRT_NPROC >= 4 * jax.device_count()
    names = collections.Counter(p.read_text().strip() for p in pathlib.Path("/proc/self/task").glob("*/comm"))
    assert names["tf_XLAEigen"] == PJRT_NPROC, names
