"""The stage-data rule (jaxpt.run.lineage, ``TrainConfig.stage_data``): a stage started from a parent never re-reads
its parent's documents unless the config asks for it.

A parent trains 6 steps on a JSON Lines file of short documents (several a row, so a step holds dozens); stages
continue from its step 6 to step 12 with the same data and seed. Documents are compared by index, from each run's
document log (``TrainConfig.log_batch_documents``) and from the uninterrupted data stream of the same config read
directly (:func:`jaxpt.data.stream.train_batches`, no training):

* by default (``'auto'``: the same data version, so ``'continue'``) the stage's steps 7-12 read exactly what an
  uninterrupted run's steps 7-12 read, and share with the parent's window only the documents its last step split
  (at most one a data shard, their remaining tokens);
* with ``'replay'`` the stage's steps 7-12 read exactly the parent's steps 1-6;
* on other data (``'auto'``: ``'fresh'``) the stage reads that data from its start.

Each choice is recorded in run.json's stage; the refusals name ``TrainConfig.stage_data`` before anything is written.
"""

import json

import jax
import numpy as np
import pytest

from conftest import tiny_bindings, word_documents
from jaxpt import config as C
from jaxpt import train
from jaxpt.data import stream
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.run import resolve as preflight
from jaxpt.util.errors import ConfigError

WORDS = ["north", "south", "old", "new", "green", "stone", "quiet", "bright", "river", "mill", "field", "cloud"]
STEPS = 6


def _jsonl(path, n, seed):
    return word_documents(path, n, seed, WORDS, 12)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two files of 3000 short documents (about 10 tokens each: ~50 documents a step, no epoch wraps in 12 steps)."""
    tmp = tmp_path_factory.mktemp("stage_data")
    return {"same": _jsonl(tmp / "a.jsonl.gz", 3000, 1), "other": _jsonl(tmp / "b.jsonl.gz", 3000, 2),
            "cache": tmp / "jax_cache"}


def _cfg(prepared, data, workdir, steps, train_path=None, **overrides):
    b = {"DataConfig.train_path": repr(str(train_path or data["same"])), "TrainConfig.global_batch_size": 8,
         "TrainConfig.eval_batches": 1, "TrainConfig.log_batch_documents": True, "CheckpointConfig.enabled": True,
         "CheckpointConfig.save_every_steps": 3, "CheckpointConfig.async_save": False,
         "TrainConfig.compilation_cache_dir": repr(str(data["cache"])), "OptimizerConfig.warmup_steps": 1,
         "OptimizerConfig.decay_steps": 0, "OptimizerConfig.schedule": "'constant'", **overrides}
    return C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **b), steps=steps, mesh="data=8")


def _stage(prepared, data, workdir, parent, **overrides):
    return _cfg(prepared, data, workdir, 2 * STEPS, **{"TrainConfig.init_from": repr(f"{parent}@{STEPS}"),
                                                       "TrainConfig.stage_name": "'next'", **overrides})


def documents_by_step(workdir) -> dict[int, set]:
    """``{step: documents of the global batch}`` from the run's document log (one process: one file)."""
    out: dict[int, set] = {}
    for line in (workdir / "batches" / "process_0.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "doc_index" in r:
            out[r["step"]] = set(r["doc_index"])
    return out


def stream_documents(cfg, steps: int) -> dict[int, set]:
    """``{step: documents}`` of the first ``steps`` batches of ``cfg``'s data stream read from its start."""
    cfg = preflight.resolve_vocab(cfg)
    tok = Tokenizer.load(cfg.data.tokenizer_path)
    batches = stream.train_batches(cfg, tok, stream.data_shard_count(cfg), first_step=1)
    out = {}
    for step in range(1, steps + 1):
        out[step] = {int(d) for d in np.unique(next(batches)["doc_index"]) if d >= 0}
    return out


def _stage_record(workdir) -> dict:
    return json.loads((workdir / "run.json").read_text())["stages"][-1]


@pytest.fixture(scope="module")
def parent(prepared_sample, data, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("parent")
    train.run_training(_cfg(prepared_sample, data, workdir, STEPS))
    return workdir


@pytest.mark.slow
def test_a_stage_on_its_parents_data_reads_on_from_where_the_parent_stopped(prepared_sample, data, parent, tmp_path):
    ref = stream_documents(_cfg(prepared_sample, data, tmp_path / "ref", 2 * STEPS), 2 * STEPS)
    seen = documents_by_step(parent)
    assert seen == {s: ref[s] for s in range(1, STEPS + 1)}
    window = set().union(*seen.values())
    assert len(window) > 100  # about two dozen documents a step

    workdir = tmp_path / "continue"
    train.run_training(_stage(prepared_sample, data, workdir, parent))
    got = documents_by_step(workdir)
    assert got == {s: ref[s] for s in range(STEPS + 1, 2 * STEPS + 1)}  # as if the parent had gone on
    repeated = set().union(*got.values()) & window
    # only the documents the parent's last step split across the boundary (their remaining tokens), one a shard
    assert repeated <= ref[STEPS] & ref[STEPS + 1] and len(repeated) <= 8
    record = _stage_record(workdir)
    assert record["stage_data"] == "continue" and "parent's data version" in record["stage_data_note"]


@pytest.mark.slow
def test_a_replay_rereads_the_parents_window_only_when_asked(prepared_sample, data, parent, tmp_path):
    workdir = tmp_path / "replay"
    train.run_training(_stage(prepared_sample, data, workdir, parent, **{"TrainConfig.stage_data": "'replay'"}))
    got, seen = documents_by_step(workdir), documents_by_step(parent)
    assert got == {s + STEPS: seen[s] for s in range(1, STEPS + 1)}
    assert _stage_record(workdir)["stage_data"] == "replay"


@pytest.mark.slow
def test_a_stage_on_other_data_reads_it_from_its_start(prepared_sample, data, parent, tmp_path):
    workdir = tmp_path / "other"
    cfg = _stage(prepared_sample, data, workdir, parent, train_path=data["other"])
    train.run_training(cfg)
    ref = stream_documents(_cfg(prepared_sample, data, tmp_path / "ref", STEPS, train_path=data["other"]), STEPS)
    assert documents_by_step(workdir) == {s + STEPS: ref[s] for s in range(1, STEPS + 1)}
    record = _stage_record(workdir)
    assert record["stage_data"] == "fresh" and record["data_version"] != json.loads(
        (parent / "run.json").read_text())["stages"][-1]["data_version"]


def test_a_silent_replay_is_refused_naming_the_key(prepared_sample, data, parent, tmp_path):
    """Refused by the checks, before anything is written: 'fresh' on the parent's own data (it would re-read the
    parent's window), 'continue' into another document order (the carried position would mean nothing there), and
    the default on the parent's data with another order (neither carrying nor re-reading is safe to pick)."""
    cases = [({"TrainConfig.stage_data": "'fresh'"}, "TrainConfig.stage_data = 'fresh'.*parent's data"),
             ({"TrainConfig.stage_data": "'continue'", "TrainConfig.seed": 1},
              "TrainConfig.stage_data = 'continue'.*TrainConfig.seed = 0 -> 1"),
             ({"DataConfig.long_doc_min_chars": 40, "DataConfig.long_doc_weight": 0.5},
              "TrainConfig.stage_data = 'auto'.*DataConfig.long_doc_weight = 0.0 -> 0.5.*'replay'"),
             ({"TrainConfig.stage_data": "'continue'", "TrainConfig.global_batch_size": 16,
               "DataConfig.num_shards": 16}, "TrainConfig.stage_data = 'continue'.*8 logical data shards")]
    for i, (overrides, message) in enumerate(cases):
        workdir = tmp_path / f"refused{i}"
        with pytest.raises(ConfigError, match=message):
            preflight.resolve(_stage(prepared_sample, data, workdir, parent, **overrides))
        assert not workdir.exists()
    with pytest.raises(ConfigError, match="TrainConfig.stage_data = 'replay'.*init_from"):
        _cfg(prepared_sample, data, tmp_path / "x", 4, **{"TrainConfig.stage_data": "'replay'"})


def test_the_stage_data_choice_is_in_the_dry_run_plan(prepared_sample, data, parent, tmp_path):
    r = preflight.resolve(_stage(prepared_sample, data, tmp_path / "plan", parent))
    assert r.data_start.choice == "continue" and r.data_shards == 8
    assert "data: continue" in preflight.format_plan(preflight.plan(r, devices=jax.devices()))


def test_a_token_mixture_reads_on_per_group_under_the_stages_own_schedule():
    """'continue' with a token mixture (a corpus version, or the sample with weights): the carried per-group positions
    stay and the stage's schedule is followed from the stage's first step, not from the parent's batch count
    (:meth:`jaxpt.data.shards.ShardedBatches.restart_step_count`)."""
    from jaxpt.data import mixture
    n = 400
    domains, sources = ["a" if i % 2 else "b" for i in range(n)], [""] * n

    def fetch(i):
        return np.full(3 + i % 5, 7, np.int32), i

    def stream_of(schedule, first_step):
        return mixture.mixture_iterator(domains, sources, fetch, mixture.parse_schedule(schedule), key="k", seed=0,
                                        shuffle=True, shard=0, num_shards=1, rows=2, seq_len=16, eos_id=1,
                                        first_step=first_step)

    def docs(batch):
        return {int(d) for d in np.unique(batch["doc_index"]) if d >= 0}

    parent = stream_of(((1, (("a", 0.5), ("b", 0.5))),), 1)
    window = set().union(*(docs(next(parent)) for _ in range(STEPS)))
    state = json.loads(json.dumps(parent.get_state()))  # as a checkpoint holds it
    reference = [docs(next(parent)) for _ in range(3)]  # what the parent would have read next, same mixture

    # the stage's schedule: the same mixture for steps 7-9, only 'a' from step 10
    stage = stream_of(((1, (("a", 0.5), ("b", 0.5))), (10, (("a", 1.0),))), STEPS + 1)
    stage.set_state(state)
    stage.restart_step_count()
    got = [docs(next(stage)) for _ in range(STEPS)]
    assert got[:3] == reference  # steps 7-9: read on exactly
    assert all(i % 2 for d in got[3:] for i in d - window)  # steps 10-12: the stage's second mixture, 'a' only
    assert len(set().union(*got) & window) <= 2  # at most each group's document open at the boundary
