"""The tiers hold themselves (tests/tiers.py): a planted unit test that starts a process, enters the training loop
or runs past the CPU limit fails naming which; the same test marked ``integration`` passes; raw-v1 tests are the
corpus tier; ``-m unit`` selects by the markers set at collection. Each case runs pytest in-process (pytester)."""

import contextlib

import pytest

import tiers

pytest_plugins = ["pytester"]
# Each case runs a pytest session of its own (collection, plugins): seconds of CPU, past the unit tier's limit.
pytestmark = pytest.mark.integration

CONFTEST = '''
import pytest
import tiers
from tiers import pytest_runtest_call, pytest_runtest_makereport, pytest_runtest_setup

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    tiers.mark_tiers(items)

def pytest_terminal_summary(terminalreporter):
    tiers.terminal_summary(terminalreporter)
'''

PLANTED = '''
import subprocess, sys, time
import pytest
from jaxpt.run import loop

def test_child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_git_is_allowed():
    subprocess.run(["git", "--version"], check=True, capture_output=True)

def test_busy():
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass

def test_sleeps():
    time.sleep(4)

def test_training_loop():
    with pytest.raises(TypeError):
        loop.train_loop()  # no context: entering it is what counts

@pytest.mark.integration
def test_child_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.raw_v1
def test_corpus():
    pass

def test_cheap():
    assert 1 + 1 == 2

@pytest.fixture(scope="module")
def spawner():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_uses_a_fixture_that_spawns(spawner):
    pass
'''


@contextlib.contextmanager
def _limits(cpu_s: float, wall_factor: float):
    """The unit tier's limits for the planted session only (this test's own check, made after its call, sees the
    real ones again)."""
    before = tiers.UNIT_LIMIT_S, tiers.WALL_FACTOR
    tiers.UNIT_LIMIT_S, tiers.WALL_FACTOR = cpu_s, wall_factor
    try:
        yield
    finally:
        tiers.UNIT_LIMIT_S, tiers.WALL_FACTOR = before


@pytest.fixture
def planted(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    unit\n    integration\n    corpus\n    raw_v1\n    slow\n")
    pytester.makepyfile(test_planted=PLANTED)
    return pytester


def test_unit_tests_that_start_a_process_train_or_burn_cpu_fail_naming_why(planted):
    # test_busy's 0.3 CPU-s is over 0.1; test_sleeps' 4 s of wall over 3 s; git's milliseconds under both
    with _limits(0.1, 30):
        result = planted.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    outcomes = {r.head_line.split(".")[-1]: r.outcome for r in _reports(result)}
    assert outcomes == {"test_child": "failed", "test_git_is_allowed": "passed", "test_busy": "failed",
                        "test_training_loop": "failed", "test_sleeps": "failed", "test_child_marked": "passed", "test_corpus": "passed",
                        "test_cheap": "passed", "test_uses_a_fixture_that_spawns": "failed"}
    text = result.stdout.str()
    assert "test_child: a unit-tier test that started 1 child process(es)" in text
    assert "test_busy: a unit-tier test that used 0." in text and "CPU-s (the unit tier's limit is 0.1)" in text
    assert "test_training_loop: a unit-tier test that entered the training loop 1 time(s)" in text
    assert ("test_uses_a_fixture_that_spawns: a unit-tier test that uses a fixture whose setup started a process "
            "(one of spawner: add it to INTEGRATION_FIXTURES)") in text
    assert "test_sleeps: a unit-tier test that took 4." in text and "(the unit tier's wall limit is 3 s)" in text
    # the summary counts each tier: 7 unit, 1 integration, 1 corpus
    assert [line.split()[:3] for line in text.splitlines() if line.split()[:1] in (["unit"], ["integration"],
            ["corpus"])] == [["unit", "7", "tests"], ["integration", "1", "tests"], ["corpus", "1", "tests"]]


def test_dash_m_selects_the_tier_markers_set_at_collection(planted):
    for tier, names in [("unit", {"test_child", "test_git_is_allowed", "test_busy", "test_training_loop",
                                  "test_sleeps", "test_cheap", "test_uses_a_fixture_that_spawns"}),
                        ("integration", {"test_child_marked"}), ("corpus", {"test_corpus"})]:
        result = planted.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-m", tier,
                                             "--collect-only", "-q")
        got = {line.split("::")[-1] for line in result.stdout.lines if "::" in line}
        assert got == names, tier


def _reports(result):
    return [r for r in result.reprec.getreports("pytest_runtest_logreport") if r.when == "call"]
