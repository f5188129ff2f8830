"""Training stages (jaxpt.run.lineage): a long-context extension continues from a parent checkpoint, explicitly.

Stage 1 trains 6 steps at 32 tokens; stage 2 continues from its step-6 checkpoint for 4 steps at 64 tokens with
another RoPE base, keeping or resetting the optimizer. Checked: run.json's stages and parent, the params and
optimizer state the stage starts from (against the parent checkpoint, read back independently), the fresh
learning-rate schedule, and that a resumed stage must name the same parent.
"""

import json

import jax
import numpy as np
import pytest

from conftest import tiny_bindings
from jaxpt.run import build as builder
from jaxpt import config as C
from jaxpt.run import monitor
from jaxpt import train
from jaxpt.checkpoint import CheckpointConfig, Checkpointer
from jaxpt.util.errors import ConfigError
from jaxpt.run.validate import validate

MESH = "data=4,fsdp=2"
PEAK = 3e-3


def _cfg(prepared, workdir, steps, **overrides):
    b = {"TrainConfig.seq_len": 32, "ModelConfig.max_seq_len": 64, "TrainConfig.global_batch_size": 8,
         "CheckpointConfig.enabled": True, "CheckpointConfig.save_every_steps": 3,
         "CheckpointConfig.async_save": False, "TrainConfig.eval_batches": 1,
         "OptimizerConfig.peak_learning_rate": PEAK, "OptimizerConfig.warmup_steps": 2,
         "OptimizerConfig.decay_steps": 0, "OptimizerConfig.schedule": "'constant'", **overrides}
    return C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **b), steps=steps, mesh=MESH)


def _stage2(prepared, workdir, parent, steps=10, **overrides):
    return _cfg(prepared, workdir, steps, **{
        "TrainConfig.seq_len": 64, "ModelConfig.rope_theta": 500000.0, "TrainConfig.init_from": repr(parent),
        "TrainConfig.stage_name": "'long'", "DataConfig.long_doc_min_chars": 2000, "DataConfig.long_doc_weight": 0.8,
        # the parent's data in another order (long documents upweighted): re-read on purpose (tests/test_stage_data.py)
        "TrainConfig.stage_data": "'replay'", **overrides})


def _capture(into: dict):
    def inject(step, state):
        into.setdefault(step, jax.device_get(state))
        return state
    return inject


def _leaves(tree, name):
    """Leaves of ``tree`` whose path names ``name`` (e.g. "mu", "count"), as numpy arrays."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if any(getattr(k, "name", getattr(k, "key", None)) == name for k in path):
            out.append(np.asarray(leaf))
    return out


@pytest.fixture(scope="module")
def parent_run(prepared_sample, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("stage1")
    train.run_training(_cfg(prepared_sample, workdir, 6))
    return workdir


def _parent_state(prepared, parent_dir, cfg2, step):
    """The parent's saved params and optimizer state, read back from its checkpoint directly."""
    abstract = builder.build_for(cfg2).spec.abstract
    ckpt = Checkpointer(str(parent_dir), CheckpointConfig(enabled=False), read_only=True)
    try:
        return jax.device_get(ckpt.restore_fields(step, abstract, ("params", "opt_state")))
    finally:
        ckpt.close()


@pytest.mark.slow
def test_extension_stage_keeps_params_and_optimizer(prepared_sample, parent_run, tmp_path):
    workdir = tmp_path / "stage2"
    cfg = _stage2(prepared_sample, workdir, str(parent_run))  # no @step: the newest committed, 6
    seen: dict = {}
    train.run_training(cfg, fault_injector=_capture(seen))
    assert sorted(seen) == [7, 8, 9, 10]  # global steps continue from the parent's 6
    start = seen[7]
    parent = _parent_state(prepared_sample, parent_run, cfg, 6)
    for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(parent["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("mu", "nu"):  # the parent's moments, kept
        for a, b in zip(_leaves(start.opt_state, name), _leaves(parent["opt_state"], name)):
            np.testing.assert_array_equal(a, b)
        assert any(np.abs(a).max() > 0 for a in _leaves(start.opt_state, name))
    counts = [int(c) for c in _leaves(start.opt_state, "count")]
    assert sorted(counts) == [0, 6]  # Adam's bias-correction count goes on; the schedule's restarts
    assert int(start.num_updates) == 0 and int(start.step) == 6

    records = [r for r in monitor.read_metrics(str(workdir)) if "loss" in r]
    assert [r["step"] for r in records] == [7, 8, 9, 10]
    # a fresh schedule: warmup from 0 again (constant schedule, 2 warmup steps): 0, PEAK/2, PEAK, PEAK
    np.testing.assert_allclose([r["learning_rate"] for r in records], [0.0, PEAK / 2, PEAK, PEAK], rtol=1e-6)

    run = json.loads((workdir / "run.json").read_text())
    base, long = run["stages"]
    assert base["name"] == "base" and base["start_step"] == 0 and base["end_step"] == 6
    assert base["parent"] is None and base["workdir"] == str(parent_run.resolve())
    assert long["name"] == "long" and long["start_step"] == 6 and long["target_steps"] == 10
    assert long["parent"] == {"path": str(parent_run.resolve()), "step": 6}
    assert long["reset_optimizer"] is False and long["seq_len"] == 64 and long["stage_data"] == "replay"
    # each stage names its data version (here both the prepared sample's, which prepare.json records)
    sample_version = json.loads((prepared_sample / "prepare.json").read_text())["data_version"]
    assert sample_version.startswith("prepared:")
    assert base["data_version"] == long["data_version"] == sample_version
    changed = " ".join(long["changed_settings"])
    assert "ModelConfig.rope_theta = 10000.0 -> 500000.0" in changed and "TrainConfig.seq_len = 32 -> 64" in changed
    meta = Checkpointer(str(workdir), CheckpointConfig(enabled=False), read_only=True).read_meta(10)
    assert meta["stage"]["parent"] == long["parent"] and meta["seq_len"] == 64

    # Resuming the stage must name the same parent: another step is refused before anything runs.
    with pytest.raises(ConfigError, match="belongs to a stage begun from"):
        train.run_training(_stage2(prepared_sample, workdir, f"{parent_run}@3", steps=12))


def test_extension_stage_can_reset_the_optimizer(prepared_sample, parent_run, tmp_path):
    """The stage's first state with ``reset_optimizer`` (built as run_training builds it, without the loop)."""
    from jaxpt.run import resolve as preflight, lineage as stage
    cfg = _stage2(prepared_sample, tmp_path / "reset", f"{parent_run}@3", steps=5,
                  **{"TrainConfig.reset_optimizer": True})
    pre = preflight.resolve(cfg)
    assert pre.cfg.init_from == f"{parent_run.resolve()}@3" and pre.lineage.parent.step == 3
    built = builder.build(pre.layout)
    start = jax.device_get(stage.begin_stage(built, pre.lineage.parent))
    parent = _parent_state(prepared_sample, parent_run, cfg, 3)
    for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(parent["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("mu", "nu"):  # fresh moments, while the parent's were not zero
        assert all(np.abs(a).max() == 0 for a in _leaves(start.opt_state, name))
        assert any(np.abs(a).max() > 0 for a in _leaves(parent["opt_state"], name))
    assert [int(c) for c in _leaves(start.opt_state, "count")] == [0, 0]
    assert int(start.step) == 3 and int(start.num_updates) == 0
    record = stage.stage_record(pre.cfg, pre.lineage.parent)
    assert record["parent"] == {"path": str(parent_run.resolve()), "step": 3} and record["reset_optimizer"] is True
    assert stage.parent_stages(pre.lineage.parent)[-1]["end_step"] == 3


def test_stage_settings_are_checked(prepared_sample, tmp_path):
    with pytest.raises(ConfigError, match="TrainConfig.reset_optimizer = True"):
        _cfg(prepared_sample, tmp_path, 4, **{"TrainConfig.reset_optimizer": True})
    with pytest.raises(ConfigError, match="TrainConfig.init_from = 'x@0'"):
        _cfg(prepared_sample, tmp_path, 4, **{"TrainConfig.init_from": "'x@0'"})
    with pytest.raises(ConfigError, match="holds no checkpoints"):
        train.run_training(_stage2(prepared_sample, tmp_path / "s", str(tmp_path / "nowhere")))


@pytest.mark.slow
def test_extrapolation_report_of_a_checkpoint(prepared_sample, parent_run, tmp_path):
    """``python -m jaxpt.tools.evaluate extrapolation``: JSON and PNG written; the loss at one length equals a direct
    computation (model called on the same windows, log-softmax in numpy)."""
    import jaxpt
    from jaxpt.tools import evaluate
    from jaxpt.data.loader import load_texts
    out = tmp_path / "extra.json"
    assert evaluate.main(["extrapolation", "--workdir", str(parent_run), "--lengths", "16,64", "--max-tokens", "256",
                          "--tolerance", "0.1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (tmp_path / "extra.png").stat().st_size > 0 and report["plot"] == str(tmp_path / "extra.png")
    assert sorted(report["lengths"], key=int) == ["16", "32", "64"]  # the trained length 32 is always measured
    assert report["trained_length"] == 32 and report["tokens_per_length"] == 256
    assert report["effective_extrapolation_length"] in (32, 64)

    restored = jaxpt.restore(str(parent_run))
    tok = restored.tokenizer
    stream = np.concatenate([np.append(np.asarray(tok.encode(t), np.int32), np.int32(tok.eos_id))
                             for t in load_texts(restored.config.data.heldout_path)])[:256]  # the run's own held-out
    rows = stream.reshape(8, 32)
    logits = np.asarray(jax.device_get(restored.model(rows, np.ones_like(rows), np.tile(np.arange(32), (8, 1)))),
                        np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz[:, :-1] - np.take_along_axis(logits[:, :-1], rows[:, 1:, None], -1)[..., 0]
    assert report["lengths"]["32"]["loss"] == pytest.approx(nll.mean(), rel=1e-4)
    assert report["lengths"]["32"]["tail_loss"] == pytest.approx(nll[:, 15:].mean(), rel=1e-4)


@pytest.mark.integration
def test_length_mixture_upweights_long_documents():
    """``DataConfig.long_doc_weight``: the share of long documents drawn is the weight, not the file's share."""
    from jaxpt.data.loader import _length_mixture
    texts = ["short"] * 10 + ["x" * 3000] * 2  # long documents: 2 of 12 in the file
    draws = [int(i) for i in _length_mixture(texts, 2000, 0.8, seed=0, shuffle=True)[:1000]]
    share = sum(i >= 10 for i in draws) / len(draws)
    assert abs(share - 0.8) < 0.05  # binomial std at n = 1000 is 0.013; the file's share would be 0.17
    assert set(draws) == set(range(12))  # every document still drawn
    with pytest.raises(ValueError, match="no long documents"):
        _length_mixture(["a", "b"], 2000, 0.5, seed=0, shuffle=True)
    with pytest.raises(ConfigError, match="DataConfig.long_doc_min_chars = 0"):
        C.DataConfig(long_doc_weight=0.5)
    with pytest.raises(ConfigError, match="DataConfig.long_doc_weight = 1.5"):
        C.DataConfig(long_doc_weight=1.5, long_doc_min_chars=10)


def test_stage_steps_at_or_below_the_parent_step_name_the_key():
    """``steps`` counts from the first stage, so a stage from @10 with steps = 8 is refused naming both keys."""
    from jaxpt import config as config_lib
    from jaxpt.util.errors import ConfigError
    cfg = config_lib.parse(["configs/quickstart.gin"], ["TrainConfig.init_from = 'workdirs/parent@10'",
                                                         "TrainConfig.steps = 8", "ModelConfig.vocab_size = 512"])
    with pytest.raises(ConfigError, match=r"TrainConfig.steps = 8 must exceed the step the stage starts from \(10"):
        validate(cfg, 8)
