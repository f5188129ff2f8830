"""jaxpt.tools.scaling: grid expansion, the L(N, D) least-squares fit and its uncertainties, end to end on CPU."""

import gzip
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxpt.lab import plan, scaling
from jaxpt.tools import scaling as scaling_cli
from jaxpt.config import ConfigError

from conftest import simulated_cpu_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
TRUE = plan.ParametricLoss(E=1.8, A=400.0, B=1200.0, alpha=0.35, beta=0.30)


def _synthetic_points(noise=0.0, seed=0):
    """A 6 x 5 grid of (N, D) with losses from TRUE, times (1 + noise * standard normal)."""
    n, d = (a.ravel() for a in np.meshgrid(np.geomspace(1e6, 1e9, 6), np.geomspace(1e8, 1e11, 5)))
    y = np.array([TRUE.loss(a, b) for a, b in zip(n, d)])
    if noise:
        y = y * (1 + noise * np.random.default_rng(seed).standard_normal(y.shape))
    return n, d, y


def _assert_close(fit, rel):
    for name, got in zip(scaling.PARAM_NAMES, fit.values):
        want = getattr(TRUE, name)
        assert abs(got / want - 1) <= rel, (name, got, want)


def test_fit_recovers_known_constants_from_exact_points():
    n, d, y = _synthetic_points()
    fit = scaling.fit_law(n, d, y)
    _assert_close(fit, 1e-4)
    assert fit.rmse < 1e-6


@pytest.mark.parametrize("loss", ["linear", "huber"])
def test_fit_recovers_known_constants_within_5_percent_from_noisy_points(loss):
    fit = scaling.fit_law(*_synthetic_points(noise=1e-3, seed=1), loss=loss, f_scale=0.01)
    _assert_close(fit, 0.05)


def test_reported_stderr_matches_the_spread_of_refits():
    """Refit 30 noisy copies of the same grid: the empirical spread of each constant agrees with the
    median reported standard error within a factor of 2 (the asymptotic covariance is calibrated)."""
    n, d, _ = _synthetic_points()
    fits = [scaling.fit_law(n, d, _synthetic_points(noise=3e-3, seed=s)[2], initial=[TRUE]) for s in range(30)]
    values = np.array([f.values for f in fits])
    stderr = np.array([f.stderr for f in fits])
    for i, name in enumerate(scaling.PARAM_NAMES):
        ratio = values[:, i].std(ddof=1) / np.median(stderr[:, i])
        assert 0.5 < ratio < 2.0, (name, ratio)


def test_prediction_of_a_larger_model():
    n, d, y = _synthetic_points()
    exact = scaling.fit_law(n, d, y)
    assert exact.predict(1e10, 1e12)[0] == pytest.approx(TRUE.loss(1e10, 1e12), rel=1e-6)
    noisy = scaling.fit_law(*_synthetic_points(noise=3e-3, seed=2))
    pred, se = noisy.predict(1e10, 1e12)
    assert se > 0 and abs(pred - TRUE.loss(1e10, 1e12)) < 4 * se


def test_fit_rejects_too_few_points():
    with pytest.raises(ValueError, match="at least 5"):
        scaling.fit_law([1e6, 1e7], [1e8, 1e9], [3.0, 2.5])


def _write_grid(path, models, tokens, extra=""):
    path.write_text(f"include '{REPO / 'configs/quickstart.gin'}'\n"
                    f"ModelConfig.vocab_size = 512\nTrainConfig.global_batch_size = 8\nTrainConfig.seq_len = 32\n"
                    f"ScalingGrid.models = {models!r}\nScalingGrid.tokens = {tokens!r}\n"
                    f"ScalingGrid.output = '{path.parent / 'runs'}'\n{extra}")
    return str(path)


def test_grid_points_cover_models_times_tokens(tmp_path):
    models = [{"d_model": 32, "num_layers": 1}, {"d_model": 64, "num_layers": 2}]
    grid, base = scaling.load_grid(_write_grid(tmp_path / "g.gin", models, [1000, 2048, 5000]))
    points = scaling.grid_points(grid, base)
    assert len(points) == 6 and len({p.name for p in points}) == 6
    # 256 tokens per step: ceil(1000/256) = 4 steps -> 1024 tokens; 2048 -> 8 steps; 5000 -> 20 steps.
    assert [p.tokens for p in points[:3]] == [1024, 2048, 5120]
    assert "TrainConfig.steps = 20" in points[2].bindings and "ModelConfig.d_model = 64" in points[5].bindings


def test_grid_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(ConfigError, match=r"g1.gin.*unknown ModelConfig field.*d_modle.*did you mean 'd_model'"):
        scaling.load_grid(_write_grid(tmp_path / "g1.gin", [{"d_modle": 32}], [1000]))
    with pytest.raises(ConfigError, match=r"(?s)g4.gin.*line 8.*did you mean 'ScalingGrid.learning_rates'"):
        scaling.load_grid(_write_grid(tmp_path / "g4.gin", [{"d_model": 32}], [1000], "ScalingGrid.learning_rate = [0.1]"))
    with pytest.raises(ConfigError, match="g2.gin.*non-empty"):
        scaling.load_grid(_write_grid(tmp_path / "g2.gin", [], [1000]))
    path = _write_grid(tmp_path / "g3.gin", [{"num_heads": 3, "num_kv_heads": 3}], [1000])
    grid, base = scaling.load_grid(path)
    with pytest.raises(ConfigError, match="g3.gin: grid point .*num_heads = 3"):
        scaling.check_points(path, scaling.grid_points(grid, base))  # quickstart mesh has tensor=2


def test_a_finished_point_trained_with_another_config_is_refused_not_skipped(tmp_path):
    """A grid rerun into the same output with another seed must not count the old runs as its own: the point's
    saved config.gin (else the record's config_hash) is compared with the config the grid gives it now."""
    from jaxpt import config as config_lib
    path = _write_grid(tmp_path / "g.gin", [{"d_model": 32}], [1000])
    grid, base = scaling.load_grid(path)
    (pt,) = scaling.grid_points(grid, base)
    cfg = config_lib.parse([path], pt.bindings)
    workdir = pathlib.Path(cfg.workdir)
    workdir.mkdir(parents=True)
    (workdir / "config.gin").write_text(config_lib.operative_config_str(cfg))
    record = {"name": pt.name, "workdir": str(workdir)}
    scaling.check_same_config(pt.name, record, cfg, "runs.jsonl")  # the same config: counted as done
    seed1 = config_lib.parse([path], [*pt.bindings, "TrainConfig.seed = 1"])
    with pytest.raises(ConfigError, match=rf"runs.jsonl: grid point {pt.name} .*TrainConfig.seed = 0 there, 1 now"):
        scaling.check_same_config(pt.name, record, seed1, "runs.jsonl")
    (workdir / "config.gin").unlink()  # a moved run dir: the record's hash decides
    record["config_hash"] = config_lib.config_hash(config_lib.operative_config_str(cfg))
    scaling.check_same_config(pt.name, record, cfg, "runs.jsonl")
    with pytest.raises(ConfigError, match="config hash differs"):
        scaling.check_same_config(pt.name, record, seed1, "runs.jsonl")


def _runs_jsonl(path, n, d, y):
    with open(path, "w") as f:
        for i, (a, b, c) in enumerate(zip(n, d, y)):
            f.write(json.dumps({"name": f"r{i}", "params": {"non_embedding": a, "total": 2 * a, "matmul": a},
                                "tokens": b, "heldout_loss": c}) + "\n")


def test_fit_cli_on_runs_file(tmp_path, capsys):
    _runs_jsonl(tmp_path / "runs.jsonl", *_synthetic_points())
    assert scaling_cli.main(["fit", str(tmp_path), "--predict-params", "1e10", "--predict-tokens", "1e12"]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "predicted held-out loss" in out
    result = json.loads((tmp_path / "fit.json").read_text())
    for name in scaling.PARAM_NAMES:
        assert result["fit"]["values"][name] == pytest.approx(getattr(TRUE, name), rel=1e-3)
    assert result["prediction"]["loss"] == pytest.approx(TRUE.loss(1e10, 1e12), rel=1e-5)
    assert (tmp_path / "scaling_fit.png").read_bytes()[:4] == b"\x89PNG"


def test_fit_cli_reports_missing_runs(tmp_path, capsys):
    assert scaling_cli.main(["fit", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such file or directory" in capsys.readouterr().err
    assert scaling_cli.main(["fit", str(tmp_path)]) == 2
    assert f"{tmp_path}: a directory without runs.jsonl" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# End to end: a tiny grid trained on real sample text.


def _tiny_data(root: pathlib.Path):
    """Train/held-out JSON Lines cut from the bundled sample (disjoint documents) and a 512-piece tokenizer."""
    from jaxpt.data import tokenizer as tokenizer_lib
    docs = []
    for domain in ("web", "reference", "code", "multilingual"):
        with gzip.open(REPO / "data" / "sample" / f"{domain}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs += [json.loads(line) for line in itertools.islice(f, 0, 200, 5)]
    for doc in docs:
        doc["text"] = doc["text"][:1500]
    heldout, train = docs[::8], [doc for i, doc in enumerate(docs) if i % 8]
    for name, part in (("train", train), ("heldout", heldout)):
        with gzip.open(root / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(doc, ensure_ascii=False) + "\n" for doc in part)
    tokenizer_lib.train_sentencepiece([doc["text"] for doc in train], root / "tokenizer.model", 512)


@pytest.mark.slow
def test_tiny_grid_end_to_end(tmp_path):
    """Train 3 sizes x 2 budgets on real text, fit, predict; a second `run` resumes and trains nothing.
    (Six runs, the fewest that determine five constants, to keep the test near a minute on 2 cores.)"""
    _tiny_data(tmp_path)
    models = [{"d_model": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "head_dim": 8, "mlp_dim": 48},
              {"d_model": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16, "mlp_dim": 96},
              {"d_model": 48, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 24, "mlp_dim": 144}]
    extra = "\n".join([f"DataConfig.{k}_path = '{tmp_path / f}'" for k, f in
                       (("train", "train.jsonl.gz"), ("heldout", "heldout.jsonl.gz"), ("tokenizer", "tokenizer.model"))]
                      + ["ModelConfig.vocab_size = 0", "TrainConfig.mesh = 'data=8'", "TrainConfig.log_every = 100",
                         "TrainConfig.eval_every = 0", "CheckpointConfig.enabled = False", "ModelConfig.max_seq_len = 32"])
    grid = _write_grid(tmp_path / "grid.gin", models, [2048, 8192], extra)
    env = dict(os.environ, XLA_FLAGS=simulated_cpu_flags(8))
    cmd = [sys.executable, "-m", "jaxpt.tools.scaling"]
    subprocess.run([*cmd, "run", "--grid", grid], check=True, cwd=REPO, env=env, capture_output=True, text=True)
    runs = scaling.read_runs([str(tmp_path / "runs")])
    assert len(runs) == 6
    for size in range(3):
        losses = [r["heldout_loss"] for r in runs[2 * size:2 * size + 2]]
        assert losses[0] > losses[1], losses  # four times the tokens, lower held-out loss
        assert all(2.0 < x < math.log(512) + 0.5 for x in losses)
    assert runs[0]["params"]["non_embedding"] < runs[2]["params"]["non_embedding"] < runs[4]["params"]["non_embedding"]

    again = subprocess.run([*cmd, "run", "--grid", grid], check=True, cwd=REPO, env=env, capture_output=True, text=True)
    assert again.stderr.count("already in") == 6 and len(scaling.read_runs([str(tmp_path / "runs")])) == 6
    assert all(r["config_hash"] for r in scaling.read_runs([str(tmp_path / "runs")]))
    seed1 = subprocess.run([*cmd, "run", "--grid", grid, "--gin", "TrainConfig.seed = 1"], cwd=REPO, env=env,
                           capture_output=True, text=True)
    assert seed1.returncode != 0 and "TrainConfig.seed = 0 there, 1 now" in seed1.stderr, seed1.stderr[-2000:]

    fit = subprocess.run([*cmd, "fit", str(tmp_path / "runs"), "--predict-params", "1e6", "--predict-tokens", "1e6"],
                         check=True, cwd=REPO, env=env, capture_output=True, text=True)
    assert "predicted held-out loss" in fit.stdout
    result = json.loads((tmp_path / "runs" / "fit.json").read_text())
    assert result["points"] == 6 and result["fit"]["rmse"] < 0.1
    assert math.isfinite(result["prediction"]["loss"])
    assert (tmp_path / "runs" / "scaling_fit.png").read_bytes()[:4] == b"\x89PNG"


def test_output_flag_sets_where_the_grid_and_the_mixture_experiment_write(monkeypatch):
    """`--output` of `scaling run` and of every `mixtures` command is the gin output of the grid or experiment
    (the README's one grammar: programs write to --output), after the file's and the --gin bindings."""
    from jaxpt.tools import mixtures
    seen = {}
    monkeypatch.setattr(scaling_cli, "run_grid", lambda grid, bindings, compile_cache: seen.update(grid=list(bindings)) or [])
    assert scaling_cli.main(["run", "--grid", "g.gin", "--gin", "TrainConfig.seed = 1", "--output", "runs/s1"]) == 0
    assert seen["grid"] == ["TrainConfig.seed = 1", "ScalingGrid.output = 'runs/s1'"]

    def fake(path, bindings, *rest):
        seen["mix"] = list(bindings)
        raise ValueError("stop here")
    for cmd, fn in (("run", "run_proxies"), ("fit", "fit_and_propose"), ("validate", "validate")):
        monkeypatch.setattr(mixtures, fn, fake)
        assert mixtures.main([cmd, "--experiment", "e.gin", "--output", "runs/m"]) == 2
        assert seen.pop("mix") == ["MixtureExperiment.output = 'runs/m'"], cmd
