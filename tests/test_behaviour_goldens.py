"""Behaviour is unchanged by refactoring: the programs' outputs equal goldens recorded before the code moved
(:mod:`tests.goldens.behaviour`, which says what is recorded and how to record it again).

Values that depend only on jax and jaxpt (program fingerprints, plan text, messages, exit codes, configs, metadata)
must be equal; values computed in floating point on the CPU (losses, held-out figures, compiled bytes) are
compared with a small relative tolerance, since another CPU may round differently (on the recording machine they
are equal bit for bit: ``python tests/goldens/behaviour.py compare``)."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "goldens"))
import behaviour  # noqa: E402

pytestmark = pytest.mark.slow

#: Relative tolerance for values computed in floating point on the CPU (50 training steps: measured equal bit for
#: bit on the recording machine; the margin is for another CPU's rounding).
FLOAT_REL = 2e-3


@pytest.fixture(scope="module")
def golden():
    path = behaviour.golden_path()
    if not path.exists():
        pytest.skip(f"no goldens recorded for this jax ({path.name}); record them on the commit before a refactor "
                    "with `python tests/goldens/behaviour.py record`")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tmp_path_factory.mktemp("goldens")


@pytest.fixture(scope="module")
def short_run(prepared_sample, workspace):
    return behaviour.short_run(prepared_sample, workspace)


def test_train_step_programs_are_unchanged(golden, prepared_sample):
    got = behaviour.hlo_fingerprints(prepared_sample)
    assert len(got) == len(behaviour.CONFIGS) * len(behaviour.LAYOUTS)
    assert behaviour.differences(golden["hlo"], got) == []


def test_dry_run_plan_text_is_unchanged(golden, prepared_sample, workspace):
    assert behaviour.dry_run_text(prepared_sample, workspace) == golden["dry_run"]


def test_compile_reports_for_the_slice_presets_are_unchanged(golden, prepared_sample):
    got = behaviour.compile_reports(prepared_sample)
    assert set(got) == set(behaviour.SLICES)
    assert behaviour.differences(golden["compile"], got, rel=0.02) == []


def test_a_short_run_is_unchanged(golden, short_run):
    want = golden["run"]
    assert set(short_run["losses"]) == set(want["losses"])
    assert behaviour.differences(want["losses"], short_run["losses"], "losses", rel=FLOAT_REL) == []
    assert behaviour.differences(want["final"], short_run["final"], "final", rel=FLOAT_REL) == []
    assert behaviour.differences(want["evals"], short_run["evals"], "evals", rel=FLOAT_REL) == []
    assert short_run["config_gin"] == want["config_gin"]
    assert short_run["checkpoint_steps"] == want["checkpoint_steps"]
    assert behaviour.differences(want["meta"], short_run["meta"], "meta") == []
    record = dict(short_run["run_record"], final=None)
    assert behaviour.differences(dict(want["run_record"], final=None), record, "run.json") == []


def test_every_refusal_keeps_its_message_and_exit_status(golden, prepared_sample, workspace, short_run):
    got = behaviour.refusals(prepared_sample, workspace)  # some resume the short run's checkpoints
    assert set(got) == set(golden["refusals"])
    assert behaviour.differences(golden["refusals"], got) == []


def test_the_comparison_sees_a_change():
    """The comparison this module relies on reports a changed fingerprint, a float outside the tolerance, a new
    and a missing key, and accepts a float inside it."""
    want = {"a": "x", "b": {"c": 1.0}, "d": [1, 2]}
    assert behaviour.differences(want, {"a": "y", "b": {"c": 1.0005}, "d": [1, 2]}, rel=FLOAT_REL) == ["/a: 'x' -> 'y'"]
    assert behaviour.differences(want, {"a": "x", "b": {"c": 1.01}, "e": 0}, rel=FLOAT_REL) == [
        "/d: missing", "/e: new", "/b/c: 1.0 -> 1.01"]
    # a perplexity is compared as its loss: 253.79 -> 252.93 is a loss 0.0034 lower (0.06% of 5.54, inside), one
    # whose loss moved by 1% is outside
    ppl = {"heldout_perplexity": 253.79330301264892}
    assert behaviour.differences(ppl, {"heldout_perplexity": 252.92932427670826}, rel=FLOAT_REL) == []
    moved = 253.79330301264892 ** 1.01
    assert behaviour.differences(ppl, {"heldout_perplexity": moved}, rel=FLOAT_REL) == [
        f"/heldout_perplexity: 253.79330301264892 -> {moved!r}"]
