"""jaxpt.tools.gate: runs built to fail each criterion fail it with the right reason; a healthy run passes."""

import json
import math
import os

import numpy as np
import pytest

from conftest import tiny_bindings
from jaxpt import config as C
from jaxpt.tools import gate
from jaxpt.run import monitor
from jaxpt import train
from jaxpt.util.errors import ConfigError


def healthy_records(steps=200, every=10, resume_at=100):
    """A run's records as the loop writes them: a loss falling as 2 + 3 e^(-s/50) with 0.3% noise, grad norm
    near 1, clipping in the first steps only, 1000 tokens/s at 1 s/step, held-out evaluations at 100 and 200,
    and a resume at ``resume_at``."""
    rng = np.random.default_rng(0)
    recs = [{"step": 0, "event": "start", "peak_flops_per_device": 1e12}]
    for s in range(every, steps + 1, every):
        if s == resume_at + every:
            recs.append({"step": resume_at, "event": "resume", "peak_flops_per_device": 1e12})
        loss = (2 + 3 * math.exp(-s / 50)) * (1 + 0.003 * rng.standard_normal())
        recs.append({"step": s, "loss": loss, "loss_mean": loss, "grad_norm": 1.0 + 0.05 * rng.standard_normal(),
                     "clipped_fraction": min(20, s) * 0.5 / s, "tokens_per_sec": 1000.0, "step_time_s": 1.0,
                     "data_wait_s": 0.01, "tflops_per_device": 0.1})
        if s == 100:  # an in-loop evaluation rides on the step's own record
            recs[-1]["heldout_loss"] = 2.5 + 3 * math.exp(-1)
    recs.append({"step": steps, "event": "final", "heldout_loss": 2.5 + 3 * math.exp(-4)})
    return recs


def write_run(tmp_path, records, checkpoints=(100, 200)):
    w = monitor.MetricWriter(str(tmp_path))
    for r in records:
        w.write(r)
    w.close()
    for s in checkpoints:
        os.makedirs(tmp_path / "checkpoints" / str(s), exist_ok=True)
    (tmp_path / "run.json").write_text(json.dumps({"devices": {"count": 8}}))
    return str(tmp_path)


def verdicts(workdir, **kw):
    return {c.name: c for c in gate.judge(workdir, **kw)}


def test_healthy_constructed_run_passes(tmp_path):
    v = verdicts(write_run(tmp_path, healthy_records()), estimate_tokens_per_sec=1100.0)
    assert {k: c.verdict for k, c in v.items()} == dict.fromkeys(v, gate.PASS), {k: c.reason for k, c in v.items()}
    # 1000 tokens/s against 1100 is -9.1%
    assert "-9.1%" in v["tokens_per_sec"].measured


def test_rising_segment_fails_loss_smooth(tmp_path):
    recs = healthy_records()
    for r in recs:  # a sustained climb of 4% per logged point over steps 120-160, then back
        if "loss" in r and 120 <= r["step"] <= 160:
            r["loss"] = r["loss_mean"] = r["loss_mean"] * (1 + 0.04 * (r["step"] - 110) / 10)
    c = verdicts(write_run(tmp_path, recs))["loss_smooth"]
    assert c.verdict == gate.FAIL and "loss rises" in c.reason
    # the worst window starts at 120: the fitted rise over 120..160 is 4% x 4 points / mean, about 15%
    assert "steps 120-160" in c.reason


def test_least_squares_rise_by_hand():
    """Points (0, 1), (10, 2), (20, 3): slope 0.1 per step, span 20, mean 2: rise 2 / 2 = 100%."""
    rise, at = gate.max_window_rise(np.array([0, 10, 20]), np.array([1.0, 2.0, 3.0]), 3)
    assert rise == pytest.approx(1.0) and at == 0


def test_injected_spikes_fail_the_spike_count(tmp_path):
    recs = healthy_records()
    recs += [{"step": s, "event": "spike_skip", "loss": 9.0} for s in (55, 77, 133)]
    c = verdicts(write_run(tmp_path, recs))["spikes"]
    # 200 steps at 5 per 1k steps: 1 allowed; 3 skips
    assert c.verdict == gate.FAIL and "3 spikes > 1 allowed" in c.reason and "spike_skip at 77" in c.reason
    recs = healthy_records()
    for r in recs:  # a loss jump the device-side skip missed, at steps 150 and 170
        if "loss" in r and r["step"] in (150, 170):
            r["loss"] = r["loss_mean"] = 2 * r["loss_mean"]
    c = verdicts(write_run(tmp_path / "jump", recs))["spikes"]
    assert c.verdict == gate.FAIL and "loss_jump at 150" in c.reason and "loss_jump at 170" in c.reason


def test_grad_norm_growth_and_rising_clip_share_fail(tmp_path):
    recs = healthy_records()
    for r in recs:
        if "grad_norm" in r and r["step"] > 150:
            r["grad_norm"] *= 3.0
    c = verdicts(write_run(tmp_path / "g", recs))["grad_norm_stable"]
    assert c.verdict == gate.FAIL and "grew" in c.reason
    recs = healthy_records()
    for r in recs:  # no clipping until step 150, then every step clipped
        if "clipped_fraction" in r:
            r["clipped_fraction"] = max(0, r["step"] - 150) / r["step"]
    c = verdicts(write_run(tmp_path / "c", recs))["grad_norm_stable"]
    # first quarter (10..57.5 -> records 10..60): 0%; last quarter (152.5..200 -> 150..200): 100%
    assert c.verdict == gate.FAIL and "clipped share rose from 0% (first quarter) to 100%" in c.reason


def test_clipped_share_from_cumulative_fraction_by_hand():
    """Cumulative 5/10 at step 10 and 8/40 at step 40: 3 clipped in 30 steps = 10%."""
    recs = [{"step": 10, "loss": 1.0, "clipped_fraction": 0.5}, {"step": 40, "loss": 1.0, "clipped_fraction": 0.2}]
    assert gate.clipped_share(recs, 10, 40) == pytest.approx(0.1)


def test_throttled_input_fails_throughput_and_blames_data(tmp_path):
    recs = healthy_records()
    for r in recs:
        if "tokens_per_sec" in r:  # the loader held each 1 s step for 0.6 s more
            r.update(step_time_s=1.6, tokens_per_sec=1000 / 1.6, data_wait_s=0.6)
    c = verdicts(write_run(tmp_path, recs), estimate_tokens_per_sec=1000.0)["tokens_per_sec"]
    assert c.verdict == gate.FAIL and "data waiting dominates" in c.reason and "-37.5%" in c.measured
    # no estimate: not judged, which fails only with --strict
    v = gate.judge(str(tmp_path))
    assert [c.verdict for c in v if c.name == "tokens_per_sec"] == [gate.NOT_JUDGED]
    assert not gate.passed(v, strict=True)


def test_mfu_estimate_by_hand(tmp_path):
    """0.1 TFLOP/s per device at 1000 tokens/s on 8 devices: 8e8 FLOPs per token; at MFU 0.5 of 1e12 peak
    x 8 devices: 4e12 / 8e8 = 5000 tokens/s."""
    wd = write_run(tmp_path, healthy_records())
    assert gate.mfu_estimate(monitor.read_metrics(wd), wd, 0.5) == pytest.approx(5000.0)


def test_compiled_estimate_by_hand():
    """Peak 1e12 FLOP/s (start record), 1024 tokens per step, 2e9 compiled FLOPs per device-step, utilization
    0.5: 0.5 x 1e12 x 1024 / 2e9 = 256,000 tokens/s."""
    recs = [{"step": 0, "event": "start", "peak_flops_per_device": 1e12}]
    est, how = gate.compiled_estimate(recs, {"flops_per_step": 2e9, "tokens_per_step": 1024}, 0.5)
    assert est == pytest.approx(256000.0) and "2e+09 compiled FLOPs" in how
    assert gate.compiled_estimate(recs, {"flops_per_step": None, "tokens_per_step": 1024}, 0.5)[0] is None


def test_missing_or_broken_resume_fails_checkpoint_restore(tmp_path):
    recs = [r for r in healthy_records() if r.get("event") != "resume"]
    c = verdicts(write_run(tmp_path / "none", recs))["checkpoint_restore"]
    assert c.verdict == gate.FAIL and "never resumed" in c.reason
    recs = healthy_records()
    for r in recs:  # the restored run starts 30% above the trajectory
        if "loss" in r and r["step"] == 110:
            r["loss"] = r["loss_mean"] = 1.3 * r["loss_mean"]
    c = verdicts(write_run(tmp_path / "jump", recs))["checkpoint_restore"]
    assert c.verdict == gate.FAIL and "does not continue" in c.reason
    c = verdicts(write_run(tmp_path / "nockpt", healthy_records(), checkpoints=()))["checkpoint_restore"]
    assert c.verdict == gate.FAIL and "no checkpoint was saved" in c.reason


def test_rising_heldout_fails(tmp_path):
    recs = healthy_records()
    for r in recs:
        if "heldout_loss" in r and r["step"] == 200:
            r["heldout_loss"] = 9.0
    c = verdicts(write_run(tmp_path, recs))["heldout_trend"]
    assert c.verdict == gate.FAIL and "did not fall" in c.reason


def test_heldout_series_compares_evaluations_on_the_same_tokens():
    """In-loop evaluations (2 batches) and final ones (the whole set) are separate series; the longer one wins."""
    recs = [{"step": 6, "heldout_loss": 5.0, "heldout_tokens": 256}, {"step": 12, "event": "final",
            "heldout_loss": 3.0, "heldout_tokens": 9000}, {"step": 18, "heldout_loss": 4.0, "heldout_tokens": 256}]
    assert gate.heldout_series(recs) == [(6, 5.0), (18, 4.0)]


def test_gate_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"GateConfig.rise_window = 2"):
        gate.GateConfig(rise_window=2)
    with pytest.raises(ConfigError, match="GateConfig.<field>"):
        gate.parse_gate_config(["Gate.x = 1"])
    assert gate.parse_gate_config(["GateConfig.rise_tolerance = 0.05"]).rise_tolerance == 0.05


@pytest.mark.slow
def test_healthy_short_run_passes_the_gate(prepared_sample, tmp_path, capsys):
    """A real tiny run, trained to 12 steps, then resumed to 24 (checkpoints and held-out every 6 steps)."""
    # One logical data shard: the data order this run's healthy trajectory was recorded with (with the default, 16
    # shards, the same tiny run meets a batch at step 22 whose grad norm is 4.5x the median, which the gate flags).
    b = tiny_bindings(prepared_sample, tmp_path, **{"CheckpointConfig.enabled": "True",
                                                    "CheckpointConfig.save_every_steps": "6",
                                                    "TrainConfig.eval_every": "6", "TrainConfig.log_every": "2",
                                                    "DataConfig.num_shards": "1"})
    for steps in (12, 24):
        train.run_training(C.parse(["configs/quickstart.gin"], b, steps=steps, mesh="data=2,fsdp=2,tensor=2"))
    gate.main([str(tmp_path), "--estimate-mfu", "0.5", "--json"])
    out = json.loads(capsys.readouterr().out)
    verdict = {c["name"]: (c["verdict"], c["reason"]) for c in out["criteria"]}
    assert {k: v for k, (v, _) in verdict.items() if k != "tokens_per_sec"} == dict.fromkeys(
        ["loss_smooth", "spikes", "grad_norm_stable", "checkpoint_restore", "heldout_trend"], gate.PASS), verdict
    # The estimate is the gate's documented statistic, computed here from the file: the median logged
    # tokens_per_sec over steps after step 1. Any other selection (e.g. dropping the first record in file order)
    # makes the verdict depend on this host's timing noise, which is not what this test is about.
    measured = [r["tokens_per_sec"] for r in monitor.read_metrics(str(tmp_path))
                if "event" not in r and r["step"] > 1 and r.get("tokens_per_sec")]
    code = gate.main([str(tmp_path), "--estimate-tokens-per-sec", repr(float(np.median(measured)))])
    assert code == 0, capsys.readouterr().out
