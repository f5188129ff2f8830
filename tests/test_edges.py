"""Correctness at the edges (issue 18), each case with its right value computed independently:

* an evaluation over no token is never a figure (a config error at setup, NaN elsewhere, never 0 loss / 1 ppl);
  every reduction over a count (held-out report, probes, regression compare) says so;
* the operative config holds every setting the run uses, however and whenever the config was made;
* a resume after lost checkpoints, or a rollback, leaves one record per step in metrics.jsonl, the batch
  document log, TensorBoard and every reader, with tokens seen and training time not counted twice;
* one rule for saved settings this version does not know, in training resume and ``jaxpt.restore``;
* curves with one definition each: interval means, skipped steps apart, MFU never above 1;
* every input and the resume target checked before anything is written or compiled; ``--dry-run``.

(Schedules at their phase boundaries are in test_optim.py; in-loop vs standalone perplexity in
test_eval_checkpoint.py.)
"""

from __future__ import annotations

import gzip
import json
import math
import pathlib
import shutil
import struct
import time

import jax
import numpy as np
import pytest

from conftest import tiny_bindings
from jaxpt import checkpoint as ckpt_lib
from jaxpt import config as C
from jaxpt.util import jsonl
from jaxpt.run import monitor, resolve as preflight
from jaxpt import train
from jaxpt.util.errors import ConfigError

TOKENS_PER_STEP = 16 * 64  # tiny_bindings: global_batch_size 16 x seq_len 64


def _argv(prepared, workdir, steps, **overrides) -> list[str]:
    argv = ["--config", "configs/quickstart.gin", "--steps", str(steps), "--mesh", "data=8"]
    for b in tiny_bindings(prepared, workdir, **overrides):
        argv += ["--gin", b]
    return argv


def _small_data(prepared, root: pathlib.Path, heldout_docs: int = 6) -> pathlib.Path:
    """The prepared sample with a few held-out documents, so a final evaluation is cheap."""
    data = root / "data"
    data.mkdir(parents=True)
    for name in ("train.jsonl.gz", "tokenizer.model"):
        (data / name).symlink_to(prepared / name)
    with gzip.open(prepared / "heldout.jsonl.gz", "rt") as f:
        lines = f.readlines()[:heldout_docs]
    with gzip.open(data / "heldout.jsonl.gz", "wt") as f:
        f.writelines(lines)
    return data


# ------------------------------------------------------------------------------------------ 2. empty evaluations


def test_heldout_set_with_no_token_to_score_is_a_config_error_before_anything_is_written(prepared_sample, tmp_path,
                                                                                         capsys):
    """1-token documents with no EOS appended (the deprecated add_eos = False, read as document_boundary = 'none')
    score nothing (a document's first token never is): the trainer stops at setup with exit 2 naming the keys,
    instead of logging loss 0.0 / perplexity 1.0 over 0 tokens; the workdir is not even created. With the default
    'eos' policy the same documents score one token each (EOS)."""
    from jaxpt.data.tokenizer import Tokenizer
    from jaxpt.eval import heldout, inloop
    tok = Tokenizer.load(str(prepared_sample / "tokenizer.model"))
    words = [w for w in ("a", "and", "The", "in", "x", "is", "to", "I") if len(tok.encode(w)) == 1]
    assert len(words) >= 3, words
    path = tmp_path / "one_token.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "text": w}) + "\n" for i, w in enumerate(words)))
    workdir = tmp_path / "run"
    argv = _argv(prepared_sample, workdir, 3, **{"DataConfig.heldout_path": repr(str(path)),
                                                  "DataConfig.add_eos": "False"})
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "DataConfig.heldout_path" in err and "no token to score" in err and "document_boundary = 'none'" in err
    assert not workdir.exists()
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared_sample, workdir), steps=3)
    docs = heldout.load_documents(str(path))
    hset = inloop.heldout_set(cfg, docs, tok)  # 'eos': EOS is each document's one scored token
    assert sum(w.num_scored for w in hset.windows) == len(words)


class _NoWindows:
    """A scorer for an empty window list (never called on a device); a dense model, so nothing routes."""

    routed = False
    routing = None

    def score(self, windows, pack=True, progress=None):
        from jaxpt.eval.scorer import WindowScores
        assert not windows
        return WindowScores(np.zeros(0), np.ones(0, bool), np.zeros(0, np.int64))


def test_reductions_over_no_item_are_nan_not_perfect_scores():
    """Held-out report over 0 tokens, probe accuracy over 0 examples: NaN, not 0 loss / perplexity 1 / 100%."""
    from jaxpt.eval import heldout, probes
    hset = heldout.HeldoutSet([], [], np.zeros(0, np.int64), np.zeros(0, np.int64))
    fig = heldout.perplexity_report(_NoWindows(), hset, group_by=("domain",))["overall"]
    assert fig["tokens"] == 0 and math.isnan(fig["loss"]) and math.isnan(fig["perplexity"])
    assert math.isnan(fig["bits_per_byte"])
    assert math.isnan(probes.choice_metrics([], [])["accuracy"])
    assert math.isnan(probes.exact_match([], [])["exact_match"])


def test_other_reductions_over_nothing_are_refused_or_nan():
    """The same kind elsewhere: a spike threshold from fewer than 2 steps (mean and std of an empty history are 0:
    every step would be a spike) is a config error; a near-dup recall over no pair is NaN, not 1; a scaling fit
    refuses a run whose held-out loss is NaN."""
    from data_pipelines import neardup_eval
    from jaxpt.training.stability import StabilityConfig
    from jaxpt.lab import scaling
    with pytest.raises(ConfigError, match=r"StabilityConfig\.spike_min_history = 0: must be >= 2"):
        StabilityConfig(spike_min_history=0)
    StabilityConfig(spike_min_history=0, spike_skip=False)
    docs = [{"id": "a", "text": "one two three four five six", "url_or_path": "x"},
            {"id": "b", "text": "seven eight nine ten eleven twelve", "url_or_path": "y"}]
    res = neardup_eval.score(docs, {"none": {}}, extra_pairs=[("a", "b")])["none"]  # one pair, Jaccard 0
    assert res["n_high"] == 0 and math.isnan(res["recall"])
    assert res["n_low"] == 1 and res["false_merge_rate"] == 0.0
    recs = [{"name": f"r{i}", "params": {"non_embedding": 1e6}, "tokens": 1e7, "heldout_loss": v}
            for i, v in enumerate((3.0, float("nan")))]
    with pytest.raises(ValueError, match="r1"):
        scaling.points_from_runs(recs)


def _report(ppl: float, score: float) -> dict:
    card = {"name": "c", "version": 1, "content_sha256": "x"}
    return {"card": card, "heldout": {"overall": {"tokens": 100}, "core_grouping": "domain",
                                      "regression_tolerance": 0.05, "by_domain": {"web": {"perplexity": ppl}}},
            "tasks": {"t": {"primary_metric": "accuracy", "metrics": {"accuracy": score}, "core": True,
                            "regression_tolerance": 0.02, "examples_sha256": "e"}}}


def test_regression_compare_flags_a_figure_that_is_not_a_number():
    """A NaN figure (an evaluation over nothing) on either side is flagged, never passed: NaN > tolerance is
    False, which let it through before."""
    from jaxpt.eval import regression
    assert regression.compare(_report(10.0, 0.5), _report(10.0, 0.5))["ok"]
    for base, new in ((_report(10.0, 0.5), _report(float("nan"), 0.5)),
                      (_report(10.0, float("nan")), _report(10.0, 0.5)),
                      (_report(10.0, 0.5), _report(10.0, float("nan")))):
        result = regression.compare(base, new)
        assert not result["ok"] and len(result["flagged"]) == 1
        assert "not a number" in result["flagged"][0]["note"]


# ------------------------------------------------------------------------------------------ 4. operative config


def test_operative_config_is_rendered_from_the_config_itself():
    """Every setting is in the operative config even when gin's state no longer matches the config (cleared, as
    jaxpt.restore does, or a config changed with dataclasses.replace), and parsing it back gives the same config."""
    import dataclasses

    import gin
    cfg = C.parse(["configs/quickstart.gin"], ["HeldoutEvalConfig.stride = 7"])
    cfg = dataclasses.replace(cfg, seed=5)
    gin.clear_config()
    text = C.operative_config_str(cfg)
    assert "HeldoutEvalConfig.stride = 7\n" in text and "TrainConfig.seed = 5\n" in text
    n_settings = sum(len(dataclasses.fields(c)) for c in C.CONFIG_CLASSES.values()) - len(C._SUB_CONFIGS)
    assert len([ln for ln in text.splitlines() if " = " in ln]) == n_settings
    assert C.parse([], text.splitlines()) == cfg
    other = C.operative_config_str(dataclasses.replace(cfg, heldout_eval=dataclasses.replace(cfg.heldout_eval,
                                                                                             stride=0)))
    assert C.config_hash(other) != C.config_hash(text)


@pytest.mark.slow
def test_two_runs_differing_only_in_a_late_used_setting_differ_in_config_hash_and_saved_config(prepared_sample,
                                                                                                tmp_path):
    """HeldoutEvalConfig.stride (used only by the evaluations): config.gin, the checkpoint's saved config and
    run.json's config_hash differ between the two runs, by exactly that line."""
    data = _small_data(prepared_sample, tmp_path)
    texts, hashes, saved = [], [], []
    for stride in (0, 7):
        workdir = tmp_path / f"run{stride}"
        over = {"HeldoutEvalConfig.stride": str(stride), "CheckpointConfig.enabled": "True",
                "CheckpointConfig.async_save": "False", "TrainConfig.workdir": repr(str(tmp_path / "run"))}
        cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(data, tmp_path / "run", **over), steps=1, mesh="data=8")
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        train.run_training(cfg)
        shutil.move(tmp_path / "run", workdir)
        texts.append((workdir / "config.gin").read_text())
        hashes.append(json.loads((workdir / "run.json").read_text())["config_hash"])
        saved.append(json.loads((workdir / "checkpoints" / "1" / "meta" / "metadata").read_text())["config_gin"])
    diff = set(texts[0].splitlines()) ^ set(texts[1].splitlines())
    assert diff == {"HeldoutEvalConfig.stride = 0", "HeldoutEvalConfig.stride = 7"}
    assert hashes[0] != hashes[1] and hashes == [C.config_hash(t) for t in texts]
    assert saved == texts


# ------------------------------------------------------------------------------------------ shared 6-step run


@pytest.fixture(scope="module")
def run6(prepared_sample, tmp_path_factory) -> dict:
    """A 6-step run with checkpoints at 2, 4, 6, log_every 1 and the batch document log."""
    root = tmp_path_factory.mktemp("edges")
    data = _small_data(prepared_sample, root)
    over = {"CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "2",
            "CheckpointConfig.async_save": "False", "CheckpointConfig.keep_last": "5",
            "TrainConfig.log_batch_documents": "True"}
    workdir = root / "run"
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(data, workdir, **over), steps=6, mesh="data=8")
    train.run_training(cfg)
    return {"data": data, "workdir": workdir, "over": over}


def _copy(run6, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(run6["workdir"], dst)
    return dst


def _cfg(run6, workdir, steps, **extra):
    return C.parse(["configs/quickstart.gin"], tiny_bindings(run6["data"], workdir, **{**run6["over"], **extra}),
                   steps=steps, mesh="data=8")


def _snapshot(workdir: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(workdir)): p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ 8. resume target


@pytest.mark.slow
def test_steps_below_or_at_the_checkpoint_touch_nothing(run6, tmp_path, capsys):
    """--steps 5 on a workdir at step 6: exit 2 naming TrainConfig.steps and the checkpoint, before anything
    compiles; --steps 6: nothing to do, exit 0. Neither touches any file (run.json keeps its train_loss)."""
    workdir = _copy(run6, tmp_path / "run")
    before = _snapshot(workdir)
    argv = lambda steps: _argv(run6["data"], workdir, steps, **run6["over"])  # noqa: E731
    assert train.main(argv(5)) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.steps = 5 is below step 6 of the newest checkpoint" in err
    assert train.main(argv(6)) == 0
    assert _snapshot(workdir) == before
    assert json.loads((workdir / "run.json").read_text())["final"]["train_loss"] is not None


@pytest.mark.slow
def test_dry_run_checks_the_resume_target_and_prints_the_plan(run6, tmp_path, capsys):
    """--dry-run on the 6-step workdir with --steps 10 prints the plan (params counted independently, tokens per
    step, 4 steps to train) and writes nothing; on a fresh workdir nothing is created."""
    from jaxpt.model import count_params
    workdir = _copy(run6, tmp_path / "run")
    before = _snapshot(workdir)
    assert train.main(_argv(run6["data"], workdir, 10, **run6["over"]) + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    model = C.parse(["configs/quickstart.gin"], tiny_bindings(run6["data"], workdir)).model
    params = count_params(model.__class__(**{**model.__dict__, "vocab_size": 2048}))["total"]
    assert f"params {params:,}" in out and f"tokens per step {TOKENS_PER_STEP:,}" in out
    assert f"steps 6 -> 10 (4 steps, {4 * TOKENS_PER_STEP:,} tokens)" in out
    assert _snapshot(workdir) == before
    fresh = tmp_path / "fresh"
    assert train.main(_argv(run6["data"], fresh, 10) + ["--dry-run"]) == 0
    assert "steps 0 -> 10" in capsys.readouterr().out and not fresh.exists()


def test_missing_paths_exit_2_before_the_workdir_exists(prepared_sample, tmp_path, capsys):
    """A missing DataConfig.train_path is exit 2 naming the key, with no traceback and no workdir; so is a
    misspelled key, with a suggestion."""
    workdir = tmp_path / "run"
    missing = tmp_path / "nope.jsonl.gz"
    assert train.main(_argv(prepared_sample, workdir, 3, **{"DataConfig.train_path": repr(str(missing))})) == 2
    err = capsys.readouterr().err
    assert f"DataConfig.train_path = {str(missing)!r}: no such file" in err and "Traceback" not in err
    assert not workdir.exists()
    assert train.main(_argv(prepared_sample, workdir, 3) + ["--gin", "OptimizerConfig.warmup = 3"]) == 2
    assert "did you mean 'OptimizerConfig.warmup_steps'?" in capsys.readouterr().err
    assert not workdir.exists()


# ------------------------------------------------------------------------------------------ 5. one record per step


def _tb_events(workdir: pathlib.Path) -> list:
    """Every event of the TensorBoard files (TFRecord framing: length u64, crc u32, data, crc u32), file order."""
    from tensorboardX.proto import event_pb2
    out = []
    for path in sorted((workdir / "tensorboard").iterdir(), key=lambda p: p.stat().st_mtime_ns):
        raw, pos = path.read_bytes(), 0
        while pos < len(raw):
            (n,) = struct.unpack("<Q", raw[pos:pos + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(raw[pos + 12:pos + 12 + n])
            out.append(ev)
            pos += 12 + n + 4
    return out


def _tb_loss_by_step(workdir: pathlib.Path) -> dict[int, int]:
    """How many ``loss`` values TensorBoard shows per step, applying its purge rule: a session START at step p
    hides every earlier event of step >= p."""
    seen: list[int] = []
    for ev in _tb_events(workdir):
        if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
            seen = [s for s in seen if s < ev.step]
        seen += [ev.step for v in ev.summary.value if v.tag == "loss"]
    return {s: seen.count(s) for s in set(seen)}


@pytest.mark.slow
def test_resume_after_lost_checkpoints_keeps_one_record_per_step(run6, tmp_path):
    """Lose checkpoint 6 (a kill before it committed), resume to 8: steps 5 and 6 are trained again. Every reader
    (read_metrics, runs plot curves, the batch document log, TensorBoard) has one value per step 1..8, the
    superseded records are kept apart, and tokens_seen / train_time_s do not count steps 5-6 twice."""
    from jaxpt.tools import runs
    workdir = _copy(run6, tmp_path / "run")
    first = {r["step"]: r for r in monitor.read_metrics(str(workdir)) if "loss" in r and "event" not in r}
    shutil.rmtree(workdir / "checkpoints" / "6")
    rec = json.loads((workdir / "run.json").read_text())
    rec["events"] += [{"step": 3, "event": "spike_skip"}, {"step": 5, "event": "spike_skip"}]
    (workdir / "run.json").write_text(json.dumps(rec))
    train.run_training(_cfg(run6, workdir, 8))
    events = json.loads((workdir / "run.json").read_text())["events"]
    assert [(e["step"], e.get("superseded_at")) for e in events] == [(3, None), (5, 4)]
    recs = [r for r in monitor.read_metrics(str(workdir)) if "loss" in r and "event" not in r]
    assert [r["step"] for r in recs] == list(range(1, 9))
    everything = [r["step"] for r in monitor.read_metrics(str(workdir), superseded=True)
                  if "loss" in r and "event" not in r]
    assert everything == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert [r["loss"] for r in recs[:6]] == [first[s]["loss"] for s in range(1, 7)]  # same data, same losses
    assert [s for s, _ in runs.read_curves(str(workdir))["loss"]] == list(range(1, 9))
    assert [r["tokens_seen"] for r in recs] == [s * TOKENS_PER_STEP for s in range(1, 9)]
    times = [r["train_time_s"] for r in recs]
    assert times == sorted(times) and times[4] >= first[4]["train_time_s"]
    assert times[5] < first[6]["train_time_s"] + (times[7] - times[3])  # the lost steps' time is not added
    docs = jsonl.drop_superseded(jsonl.read_objects(workdir / "batches" / "process_0.jsonl"))
    assert [d["step"] for d in docs if "doc_index" in d] == list(range(1, 9))
    assert _tb_loss_by_step(workdir) == {s: 1 for s in range(1, 9)}


@pytest.mark.integration
def test_a_slow_save_keeps_the_record_and_the_checkpoint_on_one_clock(run6, tmp_path, monkeypatch):
    """A save that blocks the loop (a slow disk or bucket; CI once blocked 5 s) must not put the step's metrics
    record ahead of the time its checkpoint carries: a resume from that checkpoint would then write a later
    step with a smaller train_time_s. The record of each saved step says exactly what the checkpoint's meta says,
    and a resume from step 6 continues increasing from it."""
    workdir = _copy(run6, tmp_path / "run")
    shutil.rmtree(workdir / "checkpoints" / "6")
    save = ckpt_lib.Checkpointer.save

    def slow_save(self, *args, **kwargs):
        time.sleep(1.0)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", slow_save)
    train.run_training(_cfg(run6, workdir, 8))
    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save)
    recs = {r["step"]: r for r in monitor.read_metrics(str(workdir)) if "loss" in r and "event" not in r}
    for step in (6, 8):
        meta = json.loads((workdir / "checkpoints" / str(step) / "meta" / "metadata").read_text())
        assert recs[step]["train_time_s"] == meta["train_time_s"]
    shutil.rmtree(workdir / "checkpoints" / "8")
    train.run_training(_cfg(run6, workdir, 8))
    times = [r["train_time_s"] for r in monitor.read_metrics(str(workdir)) if "loss" in r and "event" not in r]
    assert len(times) == 8 and times == sorted(times)


def test_a_saved_time_serves_its_own_step_once():
    """LoopContext.time_through: before the saved step, the time now; at it, the saved time; a step past it (the
    saved step was not reported) forgets it, so the same step trained again after a rollback, unsaved, gets the
    time now and never the old one."""
    from jaxpt.run.context import LoopContext
    ctx = LoopContext.__new__(LoopContext)   # only the clock: no run needed
    ctx._clock0 = time.perf_counter() - 100.0
    ctx._saved_time = (6, 50.0)
    assert ctx.time_through(5) >= 100.0
    assert ctx.time_through(6) == 50.0 and ctx._saved_time is None
    ctx._saved_time = (6, 50.0)
    assert ctx.time_through(7) >= 100.0 and ctx._saved_time is None
    assert ctx.time_through(6) >= 100.0


def test_metric_writer_supersedes_later_steps_and_fresh_runs(tmp_path):
    """Unit case of the writer: resuming from step 2 over records of steps 1-3 appends one marker, and readers see
    steps 1, 2, then the rewritten 3; a fresh run (start 0) supersedes every older record; a resume with nothing
    lost writes no marker."""
    w = monitor.MetricWriter(str(tmp_path), start_step=0)
    for s in (1, 2, 3):
        w.write({"step": s, "loss": float(s)})
    w.close()
    w = monitor.MetricWriter(str(tmp_path), start_step=2)
    w.write({"step": 3, "loss": 30.0})
    w.close()
    assert [(r["step"], r["loss"]) for r in monitor.read_metrics(str(tmp_path)) if "loss" in r] == [
        (1, 1.0), (2, 2.0), (3, 30.0)]
    monitor.MetricWriter(str(tmp_path), start_step=3).close()
    assert sum("superseded_after" in r for r in monitor.read_metrics(str(tmp_path), superseded=True)) == 1
    w = monitor.MetricWriter(str(tmp_path), start_step=0)
    w.write({"step": 1, "loss": 100.0})
    w.close()
    assert [(r["step"], r["loss"]) for r in monitor.read_metrics(str(tmp_path)) if "loss" in r] == [(1, 100.0)]


# ------------------------------------------------------------------------------------------ 6. unknown settings


def _with_saved_settings(run6, dst: pathlib.Path, lines: list[str], model: dict | None = None,
                         fields: dict | None = None) -> pathlib.Path:
    """A copy of the run whose newest checkpoint's meta has extra saved settings (a newer jaxpt wrote it)."""
    workdir = _copy(run6, dst)
    path = workdir / "checkpoints" / "6" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["config_gin"] += "".join(f"{ln}\n" for ln in lines)
    meta["model"].update(model or {})
    meta["config_fields"].update(fields or {})
    path.write_text(json.dumps(meta))
    return workdir


@pytest.mark.slow
def test_unknown_saved_settings_follow_one_rule_in_resume_and_restore(run6, tmp_path):
    """A saved setting this version does not know that changes numerics (ModelConfig.logit_softcap = 30.0: Gemma 2's,
    which jaxpt has no field for; the test once used qk_norm, until jaxpt gained that setting) is refused, naming it,
    by both training resume and jaxpt.restore; harmless ones (a bookkeeping setting, a numeric one at its recorded
    default, an unknown config of an old checkpoint's CheckpointConfig) are reported and ignored by both; a known
    setting changed since the checkpoint is reported on resume."""
    import jaxpt
    bad = _with_saved_settings(run6, tmp_path / "bad", ["ModelConfig.logit_softcap = 30.0"], {"logit_softcap": 30.0},
                               {"ModelConfig.logit_softcap": {"default": 0.0, "bookkeeping": False}})
    for attempt in (lambda: preflight.resolve(_cfg(run6, bad, 8)), lambda: train.run_training(_cfg(run6, bad, 8)),
                    lambda: jaxpt.restore(bad)):
        with pytest.raises(ckpt_lib.CheckpointError, match=r"ModelConfig\.logit_softcap = 30\.0"):
            attempt()
    ok = _with_saved_settings(run6, tmp_path / "ok", ["ModelConfig.logit_softcap = 0.0", "TrainConfig.log_hist = 3",
                                                      "CheckpointConfig.compress = 'zstd'"], {"logit_softcap": 0.0},
                              {"ModelConfig.logit_softcap": {"default": 0.0, "bookkeeping": False},
                               "TrainConfig.log_hist": {"default": 0, "bookkeeping": True}})
    notes = preflight.resolve(_cfg(run6, ok, 8, **{"OptimizerConfig.peak_learning_rate": "0.001"})).notes
    assert notes == ["ignored saved setting CheckpointConfig.compress = 'zstd'",
                     "ignored saved setting ModelConfig.logit_softcap = 0.0",
                     "ignored saved setting TrainConfig.log_hist = 3",
                     "changed since the checkpoint: OptimizerConfig.peak_learning_rate = 0.003 -> 0.001"]
    restored = jaxpt.restore(ok)
    assert restored.step == 6 and restored.config.model.d_model == 64


# ------------------------------------------------------------------------------------------ 7. curves


def test_loss_series_interval_mean_and_skipped_steps_apart():
    """loss is the logged step's value, loss_mean the mean since the previous record; a skipped step's loss is
    in skipped_loss only, and in no mean."""
    series = monitor.LossSeries(last=2)
    recs = [{"loss": 2.0, "skipped": 0.0}, {"loss": 50.0, "skipped": 1.0}, {"loss": 4.0, "skipped": 0.0}]
    for r in recs:
        series.observe(r)
    assert recs[1] == {"skipped_loss": 50.0, "skipped": 1.0} and recs[2]["loss"] == 4.0
    assert series.pop_interval() == {"loss_mean": 3.0} and series.pop_interval() == {}
    series.observe({"loss": 10.0, "skipped": 0.0})
    assert series.mean_last() == 7.0  # the last 2 accepted steps: 4 and 10


def test_mfu_never_exceeds_one_with_a_measured_peak():
    """A CPU peak measured under load (1 GFLOP/s) below what a step achieves (2 GFLOP/s): MFU is capped at 1 by
    raising the peak; later, slower steps are measured against the raised peak. A spec-sheet peak is not raised
    (an MFU above 1 there is a FLOP-count bug to see, not to hide)."""
    t = monitor.Throughput(tokens_per_step=1000, flops_per_token=2e6, num_devices=1, peak_flops_per_device=1e9,
                           peak_is_measured=True)
    assert t.figures(1.0)["mfu"] == 1.0 and t.peak == 2e9 and t.peak_raised == 1
    assert t.figures(2.0)["mfu"] == pytest.approx(0.5)
    spec = monitor.Throughput(1000, 2e6, 1, 1e9)
    assert spec.figures(1.0)["mfu"] == pytest.approx(2.0) and spec.peak == 1e9
    assert t.tokens_seen(7) == 7000


def test_a_model_vocabulary_far_past_the_tokenizer_is_noted_in_the_plan():
    """A preset's vocabulary kept over a data config's ``vocab_size = 0`` (the order of ``--config`` files): the dry
    run's plan notes the unused rows and says what to bind; padding (within 1,024 rows) and equal sizes are not noted."""
    import dataclasses
    from types import SimpleNamespace
    from jaxpt import config as C
    from jaxpt.run import resolve

    cfg = C.parse(["configs/quickstart.gin"], ["ModelConfig.vocab_size = 128256"])
    notes = resolve._vocab_notes(cfg, SimpleNamespace(vocab_size=512))
    assert len(notes) == 1 and "128,256" in notes[0] and "127,744 embedding rows" in notes[0]
    assert "ModelConfig.vocab_size = 0" in notes[0]
    for model_vocab in (512, 512 + 1024):
        same = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=model_vocab))
        assert resolve._vocab_notes(same, SimpleNamespace(vocab_size=512)) == []
