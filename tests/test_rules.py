"""Learning-rate and batch-size rules (jaxpt.lab.rules): a planted answer recovered, the held-out check, the rules
file, the lr x batch grid, and the planner's recommendation."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpt.config import ConfigError
from jaxpt.lab import rules, scaling
from jaxpt.tools import plan, scaling as scaling_cli

from conftest import simulated_cpu_flags
from test_scaling import REPO, _tiny_data, _write_grid

# The planted optimum: eta* = A C^B and B* = C0 C^D (tokens), exponents near DeepSeek's (-0.125, 0.33).
A, B, C0, D = 0.3, -0.125, 0.29, 0.33


def _planted_records(budgets=np.geomspace(1e15, 1e19, 5), noise=0.0, seed=0):
    """A grid of lr (ratio 2^(1/4)) x batch (ratio 2^(1/2)) at each budget, with the loss a quadratic bowl in
    (ln lr, ln batch) around the planted optimum (+ relative noise)."""
    rng = np.random.default_rng(seed)
    lrs = 1e-4 * 2.0 ** (np.arange(45) / 4)
    batches = 2048 * 2.0 ** (np.arange(22) / 2)
    out = []
    for i, c in enumerate(budgets):
        lr_opt, b_opt = A * c ** B, C0 * c ** D
        for lr in lrs:
            for bt in batches:
                loss = 3.0 + 0.05 * math.log(lr / lr_opt) ** 2 + 0.03 * math.log(bt / b_opt) ** 2
                loss *= 1 + noise * rng.standard_normal()
                out.append({"name": f"b{i}_lr{lr:g}_bt{bt:g}", "budget": f"b{i}", "budget_flops": float(c),
                            "peak_learning_rate": float(lr), "batch_tokens": float(bt), "heldout_loss": loss})
    return out


def test_planted_power_laws_are_recovered():
    """Exponents within 0.01 and coefficients within 15% of the planted ones over a 10^4 compute range (a grid
    step of ln 2^(1/4) = 0.17 in lr and 0.35 in batch bounds what can be resolved); each held-out budget's best
    lr and batch are predicted within one grid step."""
    result = rules.fit_rules(_planted_records())
    r = result["rules"]
    assert abs(r["peak_learning_rate"]["b"] - B) < 0.01 and abs(r["batch_tokens"]["d"] - D) < 0.01, r
    assert abs(r["peak_learning_rate"]["a"] / A - 1) < 0.15 and abs(r["batch_tokens"]["c"] / C0 - 1) < 0.15, r
    assert result["compute_range_flops"] == pytest.approx([1e15, 1e19])
    assert len(result["heldout"]) == 5
    for h in result["heldout"]:
        assert abs(h["peak_learning_rate"]["log_error"]) <= math.log(2) / 4 + 1e-9, h
        assert abs(h["batch_tokens"]["log_error"]) <= math.log(2) / 2 + 1e-9, h
    assert result["heldout_rms_log_error"]["peak_learning_rate"] < 0.17


def test_planted_power_laws_survive_noise():
    """With 0.05% relative loss noise (a fifth of the near-optimal margin), exponents are still within 0.03."""
    r = rules.fit_rules(_planted_records(noise=5e-4, seed=3))["rules"]
    assert abs(r["peak_learning_rate"]["b"] - B) < 0.03 and abs(r["batch_tokens"]["d"] - D) < 0.03, r


def test_a_best_on_the_grid_edge_is_warned():
    """A budget whose grid stops short of the planted optimum (learning rates and batches cut off above it) gets a
    warning naming the budget, the quantity and the side; the full grid's budgets (optimum inside) get none."""
    records = _planted_records(budgets=[1e15, 1e17, 1e19])
    assert all(not b["edges"] for b in rules.fit_rules(records)["budgets"])
    lr_opt = A * 1e17 ** B
    cut = [r for r in records if r["budget"] != "b1" or r["peak_learning_rate"] < lr_opt / 2]
    result = rules.fit_rules(cut)
    edges = {b["budget"]: b["edges"] for b in result["budgets"]}
    assert edges["b0"] == edges["b2"] == []
    assert len(edges["b1"]) == 1 and edges["b1"][0].startswith("best peak_learning_rate"), edges
    assert "is the largest tried" in edges["b1"][0]
    assert "WARNING: budget b1: best peak_learning_rate" in rules.format_rules(result)


def test_two_budgets_fit_without_a_heldout_check_and_one_is_refused():
    two = rules.fit_rules(_planted_records(budgets=[1e15, 1e17]))
    assert two["heldout"] == [] and two["heldout_rms_log_error"] is None
    assert "no held-out check" in rules.format_rules(two)
    with pytest.raises(ValueError, match="at least 2"):
        rules.fit_rules(_planted_records(budgets=[1e15]))


def test_records_of_another_grid_are_named():
    with pytest.raises(ValueError, match=r"run r0: no budget.*learning-rate x batch-size grid"):
        rules.fit_rules([{"name": "r0", "heldout_loss": 3.0}])
    bad = _planted_records(budgets=[1e15, 1e16])
    bad[3]["heldout_loss"] = float("nan")
    with pytest.raises(ValueError, match=f"run {bad[3]['name']}: heldout_loss"):
        rules.fit_rules(bad)


def _rules_file(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _planted_records()))
    assert scaling_cli.main(["rules", str(runs)]) == 0
    return runs / "rules.json"


def test_rules_cli_and_plan_recommendation(tmp_path, capsys):
    """`scaling rules` writes rules.json; `plan --rules` prints a*C^b and c*C^d at the planned compute, says
    inside the range or an extrapolation (with the factor), and puts the same numbers in --json."""
    path = _rules_file(tmp_path)
    out = capsys.readouterr().out
    assert "peak learning rate =" in out and "held out b0" in out and str(path) in out
    fitted = json.loads(path.read_text())
    assert plan.main(["--flops", "1e17", "--rules", str(path)]) == 0
    text = capsys.readouterr().out
    assert "inside the fitted range" in text and "EXTRAPOLATION" not in text
    assert plan.main(["--flops", "1e21", "--rules", str(path), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["lr_batch_rules"]
    lr = fitted["rules"]["peak_learning_rate"]
    assert rec["peak_learning_rate"] == pytest.approx(lr["a"] * 1e21 ** lr["b"])
    assert rec["extrapolation"] is True and rec["compute_range_flops"] == pytest.approx([1e15, 1e19])
    assert rec["extrapolation_factor"] == pytest.approx(100.0)  # 1e21 / 1e19
    assert plan.main(["--flops", "1e21", "--rules", str(path)]) == 0
    text = capsys.readouterr().out
    assert "EXTRAPOLATION: 1e+21 FLOPs is 100x above the fitted range" in text
    # --flops and --params count 6ND; the rules were fitted on flops_per_token x tokens: the line says so.
    assert "WARNING: this compute is counted as 6ND; the rules were fitted on flops_per_token x tokens" in text


def test_a_compute_of_another_convention_is_flagged():
    """The rules' compute is flops_per_token x tokens (no input embedding, attention counted); a planned compute
    counted as 6ND (--params, --flops) gets a warning, one counted like the grid's (--config) none."""
    fitted = {"rules": {"peak_learning_rate": {"a": 0.01, "b": 0.0}, "batch_tokens": {"c": 1.0, "d": 0.5}},
              "compute_range_flops": [1e11, 1e12],
              "flops_convention": "flops_per_token x tokens (6 N_matmul + attention)"}
    assert rules.recommend(fitted, 1e12, 128, "flops_per_token (6 N_matmul + attention)")["warnings"] == []
    warned = rules.recommend(fitted, 1e12, None, "6ND")["warnings"]
    assert len(warned) == 1 and "counted as 6ND" in warned[0] and "6 N_matmul + attention" in warned[0]
    assert rules.recommend(fitted, 1e12)["warnings"] == []


def test_a_batch_under_one_row_is_flagged():
    """A rule extrapolated to a batch of less than one row says it is not usable (here: a falling batch rule)."""
    fitted = {"rules": {"peak_learning_rate": {"a": 0.01, "b": 0.0}, "batch_tokens": {"c": 1e9, "d": -0.5}},
              "compute_range_flops": [1e11, 1e12]}
    rec = rules.recommend(fitted, 1e20, seq_len=128)
    assert rec["batch_tokens"] == pytest.approx(0.1) and rec["extrapolation"]
    assert "WARNING: the batch rule gives less than one row of 128 tokens here" in rules.format_recommendation(rec)
    assert rules.recommend(fitted, 1e12, seq_len=128)["warnings"] == []


def test_plan_names_a_bad_rules_file(tmp_path, capsys):
    assert plan.main(["--flops", "1e21", "--rules", str(tmp_path / "nope.json")]) == 2
    assert "no such rules file" in capsys.readouterr().err
    path = _rules_file(tmp_path)
    content = json.loads(path.read_text())
    del content["rules"]["batch_tokens"]["d"]
    path.write_text(json.dumps(content))
    capsys.readouterr()
    assert plan.main(["--flops", "1e21", "--rules", str(path)]) == 2
    assert "rules.json: rules.batch_tokens.d = None" in capsys.readouterr().err
    # The directory `scaling rules` wrote its default rules.json into is read as that file (was IsADirectoryError).
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _planted_records()))
    assert scaling_cli.main(["rules", str(fresh)]) == 0
    capsys.readouterr()
    assert plan.main(["--flops", "1e17", "--rules", str(fresh), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["lr_batch_rules"]
    assert rec["peak_learning_rate"] == pytest.approx(json.loads((fresh / "rules.json").read_text())["rules"][
        "peak_learning_rate"]["a"] * 1e17 ** json.loads((fresh / "rules.json").read_text())["rules"][
        "peak_learning_rate"]["b"])
    assert plan.main(["--flops", "1e21", "--rules", str(tmp_path)]) == 2
    assert f"{tmp_path / 'rules.json'}: no such rules file" in capsys.readouterr().err


def test_rules_input_errors_name_the_file_and_line(tmp_path, capsys):
    """`scaling rules` on bad runs files: the error names the file (and line) and exits 2; the same runs file twice
    is refused naming where the run was read first; an empty file and a missing path are named."""
    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps(dict(r, config_hash=r["name"])) + "\n" for r in _planted_records()))

    def err(*paths):
        assert scaling_cli.main(["rules", *map(str, paths), "--output", str(tmp_path / "r.json")]) == 2
        return capsys.readouterr().err

    assert f"{good}, line 1: run b0_" in err(good, good) and f"was read already at {good}, line 1" in err(good, good)
    other = tmp_path / "b.jsonl"
    other.write_text(json.dumps({"name": "r0", "heldout_loss": 3.0}) + "\n")
    assert f"{other}, line 1: run r0: no budget" in err(good, other)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"{empty}: no runs in this runs file" in err(empty)
    assert f"{tmp_path / 'nope'}: no such file or directory" in err(tmp_path / "nope")
    assert f"{tmp_path}: a directory without runs.jsonl" in err(tmp_path)
    assert scaling_cli.main(["rules", str(good), "--output", str(tmp_path / "r.json")]) == 0
    assert "held-out RMS log error: lr " in capsys.readouterr().out


def test_grid_points_cover_lr_times_batch_times_budget(tmp_path):
    models = [{"d_model": 32, "num_layers": 1}]
    extra = "ScalingGrid.learning_rates = [1e-3, 3e-3]\nScalingGrid.batch_sizes = [8, 16]\n"
    grid, base = scaling.load_grid(_write_grid(tmp_path / "g.gin", models, [4096, 8192], extra))
    points = scaling.grid_points(grid, base)
    assert len(points) == 8 and len({p.name for p in points}) == 8
    assert len({p.budget for p in points}) == 2 and {p.budget_tokens for p in points} == {4096, 8192}
    p = points[3]  # 4096 tokens, lr 3e-3, batch 16 rows of 32 tokens: 8 steps
    assert p.name.endswith("_lr0.003_bs16") and p.tokens == 4096
    assert {"OptimizerConfig.peak_learning_rate = 0.003", "TrainConfig.global_batch_size = 16",
            "TrainConfig.steps = 8"} <= set(p.bindings)
    with pytest.raises(ConfigError, match=r"g2.gin: ScalingGrid.batch_sizes entry 8.5 must be a positive integer"):
        scaling.load_grid(_write_grid(tmp_path / "g2.gin", models, [4096], "ScalingGrid.batch_sizes = [8.5]\n"))
    with pytest.raises(ConfigError, match=r"g3.gin: ScalingGrid.learning_rates entry -0.1"):
        scaling.load_grid(_write_grid(tmp_path / "g3.gin", models, [4096], "ScalingGrid.learning_rates = [-0.1]\n"))


def test_paired_grid_gives_one_budget_per_model(tmp_path):
    """ScalingGrid.paired: model i trains tokens[i] only (2 budgets, not 2 x 2); unequal lengths are refused."""
    models = [{"d_model": 32, "num_layers": 1}, {"d_model": 64, "num_layers": 2}]
    extra = "ScalingGrid.learning_rates = [1e-3, 3e-3]\nScalingGrid.paired = True\n"
    grid, base = scaling.load_grid(_write_grid(tmp_path / "g.gin", models, [4096, 8192], extra))
    points = scaling.grid_points(grid, base)
    assert [(p.model_overrides["d_model"], p.budget_tokens) for p in points] == [(32, 4096)] * 2 + [(64, 8192)] * 2
    assert len({p.budget for p in points}) == 2
    with pytest.raises(ConfigError, match=r"g2.gin: ScalingGrid.paired = True needs one token budget per model: "
                                          r"2 models, 3 entries"):
        scaling.load_grid(_write_grid(tmp_path / "g2.gin", models, [4096, 8192, 16384], extra))


@pytest.mark.slow
def test_tiny_lr_batch_grid_end_to_end(tmp_path):
    """2 budgets x 2 learning rates x 2 batch sizes (8 runs of a 1-layer model) on real text: every run records
    its budget, learning rate and batch; `rules` fits both laws (no held-out check with 2 budgets) and writes
    rules.json that the planner reads."""
    _tiny_data(tmp_path)
    models = [{"d_model": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "head_dim": 8, "mlp_dim": 48}]
    extra = "\n".join([f"DataConfig.{k}_path = '{tmp_path / f}'" for k, f in
                       (("train", "train.jsonl.gz"), ("heldout", "heldout.jsonl.gz"), ("tokenizer", "tokenizer.model"))]
                      + ["ModelConfig.vocab_size = 0", "TrainConfig.mesh = 'data=8'", "TrainConfig.log_every = 100",
                         "TrainConfig.eval_every = 0", "CheckpointConfig.enabled = False",
                         "ModelConfig.max_seq_len = 32", "ScalingGrid.learning_rates = [1e-3, 1e-2]",
                         "ScalingGrid.batch_sizes = [8, 16]"])
    grid = _write_grid(tmp_path / "grid.gin", models, [2048, 8192], extra)
    env = dict(os.environ, XLA_FLAGS=simulated_cpu_flags(8))
    cmd = [sys.executable, "-m", "jaxpt.tools.scaling"]
    subprocess.run([*cmd, "run", "--grid", grid], check=True, cwd=REPO, env=env, capture_output=True, text=True)
    runs = scaling.read_runs([str(tmp_path / "runs")])
    assert len(runs) == 8 and {r["peak_learning_rate"] for r in runs} == {1e-3, 1e-2}
    assert {r["batch_tokens"] for r in runs} == {256, 512} and len({r["budget"] for r in runs}) == 2
    out = subprocess.run([*cmd, "rules", str(tmp_path / "runs")], check=True, cwd=REPO, env=env,
                         capture_output=True, text=True).stdout
    assert "no held-out check" in out
    fitted = rules.load_rules(str(tmp_path / "runs" / "rules.json"))
    assert all(math.isfinite(v) for law in fitted["rules"].values() for v in law.values())


def test_seeds_of_one_grid_point_are_averaged():
    """Two seeds' grids passed together: each (budget, lr, batch) is one point at the mean of its runs' losses, so
    the best is the best mean, not the luckiest seed; the point carries its seed count and spread; a runs file
    passed twice (one config_hash twice at a point) is refused, naming the run."""
    seed0 = _planted_records(budgets=[1e15, 1e17, 1e19])
    seed1 = [dict(r, config_hash=f"s1-{r['name']}") for r in seed0]
    for r in seed0:
        r["config_hash"] = f"s0-{r['name']}"
    # At budget b1, seed 1's run at twice the optimal lr (0.05 ln(2)^2 = 0.024 nats above the bowl's floor) is
    # lucky by 0.03 nats: alone it is the best; averaged with seed 0 (0.015 below its floor-plus-0.024) it is not.
    lr_opt, b_opt = A * 1e17 ** B, C0 * 1e17 ** D
    lucky = min((r for r in seed1 if r["budget"] == "b1"), key=lambda r: abs(math.log(
        r["peak_learning_rate"] / (2 * lr_opt))) + abs(math.log(r["batch_tokens"] / b_opt)))
    lucky["heldout_loss"] -= 0.03
    alone = {b["budget"]: b for b in rules.fit_rules(seed1)["budgets"]}
    assert alone["b1"]["best"]["peak_learning_rate"] == lucky["peak_learning_rate"]
    both = rules.fit_rules(seed0 + seed1)
    b = {x["budget"]: x for x in both["budgets"]}["b1"]
    assert b["runs"] == 2 * b["points"] and b["best"]["seeds"] == 2
    twin = [r for r in seed0 if r["budget"] == "b1" and r["peak_learning_rate"] == b["best"]["peak_learning_rate"]
            and r["batch_tokens"] == b["best"]["batch_tokens"]][0]
    assert b["best"]["heldout_loss"] == pytest.approx(twin["heldout_loss"]) and b["best"]["spread"] == 0.0
    assert b["best"]["peak_learning_rate"] != lucky["peak_learning_rate"]
    assert abs(math.log(b["best"]["peak_learning_rate"] / lr_opt)) <= math.log(2) / 8 + 1e-9
    lucky_point = [p for p in rules.seed_averaged_points([r for r in seed0 + seed1 if r["budget"] == "b1"])
                   if (p["peak_learning_rate"], p["batch_tokens"]) ==
                   (lucky["peak_learning_rate"], lucky["batch_tokens"])][0]
    assert lucky_point["spread"] == pytest.approx(0.03) and lucky_point["seeds"] == 2
    assert "runs averaged over seeds" in rules.format_rules(both)
    with pytest.raises(ValueError, match=f"run {seed0[0]['name']}: listed more than once"):
        rules.fit_rules(seed0 + seed0)
    # Uneven seeds: at b1 the lucky point keeps only its (lucky) seed-1 run, three other points have both seeds, the
    # rest seed 0 only. The lucky run is the best on one seed where three points average two: the budget says so.
    twin0 = [r for r in seed0 if r["budget"] == "b1" and (r["peak_learning_rate"], r["batch_tokens"]) ==
             (lucky["peak_learning_rate"], lucky["batch_tokens"])][0]
    others1 = [r for r in seed1 if r["budget"] == "b1" and r is not lucky][:3]
    mixed = [r for r in seed0 if r is not twin0] + [lucky] + others1
    mixed_fit = rules.fit_rules(mixed)
    m = {x["budget"]: x for x in mixed_fit["budgets"]}["b1"]
    assert m["best"]["seeds"] == 1 and m["best"]["peak_learning_rate"] == lucky["peak_learning_rate"]
    point = f"lr {lucky['peak_learning_rate']:.4g}, batch {lucky['batch_tokens']:.4g}"
    assert m["uneven_seeds"] == [f"best point ({point}) has 1 seed(s) where 3 point(s) of this budget have 2: its "
                                 "lead may be one seed's luck"]
    assert b["uneven_seeds"] == [] and "its lead may be one seed's luck; run its other seeds" in rules.format_rules(
        mixed_fit)
