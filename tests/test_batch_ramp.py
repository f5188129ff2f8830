"""Batch-size ramp (issue 19.5): sizes by step, the learning-rate rule, the data the steps take, exact resume."""

import math

import numpy as np
import pytest

from conftest import tiny_bindings


from jaxpt.training import batch_ramp
from jaxpt import config as C
from jaxpt.run import monitor
from jaxpt.training import optim
from jaxpt import train
from jaxpt.util.errors import ConfigError
from jaxpt.run.validate import validate


def test_schedule_sizes_tokens_and_lr_rule_by_hand():
    """'1:4,3:8,6:16' over 16 rows: steps 1-2 take 4 rows, 3-5 take 8, 6+ take 16; rows through step 7 are
    4+4+8+8+8+16+16 = 64; loader batches of gcd 4 rows; the sqrt rule gives (4/16)^0.5 = 0.5, linear 0.25."""
    r = batch_ramp.BatchRamp(batch_ramp.parse_schedule("1:4,3:8,6:16"), 16, batch_ramp.LR_RULES["sqrt"], 2)
    assert [r.batch_size(s) for s in range(1, 8)] == [4, 4, 8, 8, 8, 16, 16]
    assert [r.rows_through(s) for s in (0, 1, 2, 5, 7)] == [0, 4, 8, 32, 64]
    assert (r.unit, r.sizes, [r.units(s) for s in (1, 3, 6)]) == (4, (4, 8, 16), [1, 2, 4])
    assert r.lr_factor(4) == 0.5 and r.lr_factor(16) == 1.0
    assert batch_ramp.BatchRamp(r.pairs, 16, batch_ramp.LR_RULES["linear"]).lr_factor(4) == 0.25
    assert [r.grad_accum_for(n) for n in (4, 8, 16)] == [1, 1, 2]  # the full batch's micro-batch is 8 rows
    t = monitor.Throughput(16 * 10, 1.0, 1, 1.0, rows_through=r.rows_through, seq_len=10)
    assert t.tokens_seen(7) == 640 and t.interval_tokens_per_step(2, 5) == 80.0


@pytest.mark.parametrize("text, match", [
    ("2:4,5:16", "first entry must start at step 1"),
    ("1:8,5:4,9:16", "must not decrease"),
    ("1:4,x", "STEP:SIZE"),
])
def test_malformed_schedule_is_a_config_error_naming_the_field(text, match):
    with pytest.raises(ConfigError, match=f"TrainConfig.batch_size_schedule = '{text}'.*{match}"):
        C.TrainConfig(batch_size_schedule=text, global_batch_size=16)


def test_schedule_that_does_not_fit_the_run_is_refused_naming_the_field():
    bad = [("1:8,3:16", 24, 1, "data=8", "the last size must be"),
           ("1:8,3:16", 16, 1, "data=8", None),
           ("1:4,3:16", 16, 1, "data=8", "do not split over the data-parallel size 8"),
           ("1:8,3:12,5:16", 16, 2, "data=8", "not a whole number of micro-batches of 8 rows")]
    for text, gbs, accum, mesh, match in bad:
        cfg = C.TrainConfig(batch_size_schedule=text, global_batch_size=gbs, grad_accum_steps=accum, mesh=mesh)
        if match is None:
            validate(cfg, 8)
            continue
        with pytest.raises(ConfigError, match=f"batch_size_schedule = '{text}'.*{match}"):
            validate(cfg, 8)
    with pytest.raises(ConfigError, match="TrainConfig.batch_lr_scaling = 'cube'"):
        C.TrainConfig(batch_lr_scaling="cube")


@pytest.mark.slow
def test_ramp_resumed_mid_ramp_equals_uninterrupted_bitwise(prepared_sample, tmp_path):
    """'1:8,3:16' (grad_accum 2: one micro-batch of 8, then two of 8) on data=8 for 5 steps: a run stopped at
    step 2 (before the growth) and resumed to 5 logs bit-identical losses and gradient norms to an uninterrupted
    run; the realized batch, tokens seen and the sqrt learning-rate rule are in metrics.jsonl; the steps take the
    rows of an 8-row loader in order (1, 1, 2, 2, 2 of its batches)."""
    over = {"TrainConfig.batch_size_schedule": "'1:8,3:16'", "TrainConfig.grad_accum_steps": "2",
            "TrainConfig.log_batch_documents": "True", "CheckpointConfig.enabled": "True",
            "CheckpointConfig.save_every_steps": "2"}
    records = {}
    for name, stops in (("whole", (5,)), ("resumed", (2, 5))):
        b = tiny_bindings(prepared_sample, tmp_path / name, **over)
        for s in stops:
            train.run_training(C.parse(["configs/quickstart.gin"], b, steps=s, mesh="data=8"))
        records[name] = [r for r in monitor.read_metrics(str(tmp_path / name)) if "loss" in r]
    whole, resumed = records["whole"], records["resumed"]
    assert [r["step"] for r in whole] == [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [(r["loss"], r["grad_norm"]) for r in whole] == [(r["loss"], r["grad_norm"]) for r in resumed]
    assert [r["batch_size"] for r in whole] == [8, 8, 16, 16, 16]
    assert [r["tokens_seen"] for r in resumed] == [64 * n for n in (8, 16, 32, 48, 64)]
    assert all(r["skipped"] == 0 for r in whole)
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared_sample, tmp_path / "whole", **over), steps=5)
    sched = optim.learning_rate_schedule(cfg.optimizer, 5)
    for r in whole:
        factor = math.sqrt(r["batch_size"] / 16)
        assert r["learning_rate"] == pytest.approx(float(sched(r["step"] - 1)) * factor, rel=1e-6)
    assert whole[1]["learning_rate"] > 0  # warmup: step 1's rate is 0, step 2's is not
    # The data: the documents of each step are those of the next 1 or 2 batches of a plain 8-row loader.
    from jaxpt.data import stream, tokenizer
    import dataclasses
    plain = dataclasses.replace(cfg, batch_size_schedule="", global_batch_size=8)
    # the run's logical data shards (the default: one per row of the 8-row loader batch), read without the ramp
    it = stream.train_batches(plain, tokenizer.Tokenizer.load(cfg.data.tokenizer_path),
                              stream.default_shard_count(cfg), first_step=1)
    logged = [set(line["doc_index"]) for line in _jsonl(tmp_path / "whole" / "batches" / "process_0.jsonl")]
    for step, docs in enumerate(logged, 1):
        rows = np.concatenate([next(it)["doc_index"] for _ in range(1 if step <= 2 else 2)])
        assert docs == {int(d) for d in np.unique(rows) if d >= 0}, step


def _jsonl(path):
    import json
    return [json.loads(line) for line in open(path) if "doc_index" in line]


def test_a_changed_ramp_is_refused_at_resume(prepared_sample, tmp_path):
    """The saved data position counts batches of the ramp's sizes: resuming under another ramp (or adding or
    removing one) is refused naming the key and both values; the same ramp passes."""
    from jaxpt import checkpoint as ckpt_lib
    from jaxpt.run import lineage
    saved = {"config_gin": "TrainConfig.batch_size_schedule = '1:4,11:8,21:16'\n"}
    same = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared_sample, tmp_path, **{
        "TrainConfig.batch_size_schedule": "'1:4,11:8,21:16'"}))
    lineage._check_ramp_unchanged(saved, same, "ckpt/20")
    for schedule in ("'1:8,21:16'", "''"):
        cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared_sample, tmp_path, **{
            "TrainConfig.batch_size_schedule": schedule}))
        with pytest.raises(ckpt_lib.CheckpointError, match=r"ckpt/20 was trained with TrainConfig.batch_size_schedule "
                                                          r"= '1:4,11:8,21:16', this run sets"):
            lineage._check_ramp_unchanged(saved, cfg, "ckpt/20")
    plain = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared_sample, tmp_path))
    lineage._check_ramp_unchanged({"config_gin": "TrainConfig.steps = 5\n"}, plain, "ckpt/5")  # no ramp either side
