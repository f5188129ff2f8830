"""jaxpt.tools.plan: compute-optimal allocations, hardware and wall clock, per-device memory estimates."""

import json
import math

import jax
import numpy as np
import pytest
from scipy import optimize

from jaxpt import config as config_lib
from jaxpt import mesh as mesh_lib
from jaxpt.training import optim
from jaxpt.lab import plan
from jaxpt.tools import plan as plan_cli
from jaxpt.training import memory
from jaxpt.training import state as state_lib
from jaxpt.model import count_params
from jaxpt.run.validate import validate

QUICKSTART = "configs/quickstart.gin"
#: The bundled sample's tokenizer has 8192 pieces (artifacts/sample/prepare.json); bound here so these
#: tests do not need the prepared sample.
VOCAB = "ModelConfig.vocab_size = 8192"


def test_gopher_budget_gives_chinchilla_70b_on_1_4t_tokens():
    """Hoffmann et al. 2022: 5.76e23 FLOPs -> Chinchilla, 70B params on 1.4T tokens (within 15%)."""
    p = plan.plan_flops(5.76e23)
    assert abs(p["params"] / 70e9 - 1) < 0.15
    assert abs(p["tokens"] / 1.4e12 - 1) < 0.15
    assert p["tokens"] == pytest.approx(20 * p["params"])
    assert 6 * p["params"] * p["tokens"] == pytest.approx(5.76e23)


@pytest.mark.parametrize("flops", [1e19, 5.76e23, 1e26])
def test_approach3_closed_form_is_the_numerical_minimum(flops):
    """The closed form N_opt = G (C/6)^a minimises L(N, C/6N); checked by a 1-D numerical search."""
    L = plan.CHINCHILLA

    def loss_of_log_n(log_n):
        n = math.exp(log_n)
        return L.loss(n, flops / (6 * n))

    res = optimize.minimize_scalar(loss_of_log_n, bounds=(math.log(1e3), math.log(1e16)), method="bounded",
                                   options={"xatol": 1e-10})
    n_opt, d_opt = L.optimal(flops)
    assert n_opt == pytest.approx(math.exp(res.x), rel=1e-4)
    assert 6 * n_opt * d_opt == pytest.approx(flops)
    assert L.budget_for_params(n_opt) == pytest.approx(flops, rel=1e-9)


def test_approach3_at_gopher_budget_differs_from_the_rule():
    """With the published constants approach 3 picks a smaller model on more tokens (documented)."""
    n3, d3 = plan.CHINCHILLA.optimal(5.76e23)
    assert 25e9 < n3 < 40e9 and 2.5e12 < d3 < 3.5e12


def test_kaplan_allocation_by_hand():
    """N = 1.3e9 * (C / PF-day)^0.73: at 1000 PF-days, 1.3e9 * 10^2.19 = 2.0135e11."""
    n, d = plan.kaplan_allocation(1000 * 8.64e19)
    assert n == pytest.approx(2.0135e11, rel=1e-4)
    assert d == pytest.approx(1000 * 8.64e19 / (6 * 2.0135e11), rel=1e-4)
    assert plan.kaplan_budget_for_params(n) == pytest.approx(1000 * 8.64e19)


@pytest.mark.parametrize("name,chips,peak", [("v5p-256", 128, 459e12), ("v4-128", 64, 275e12),
                                             ("v5e-64", 64, 197e12), ("v6e-8", 8, 918e12),
                                             ("h100-8", 8, 989e12)])
def test_parse_hardware(name, chips, peak):
    hw = plan.parse_hardware(name)
    assert hw.num_chips == chips
    assert hw.peak_flops == pytest.approx(chips * peak)


@pytest.mark.parametrize("bad", ["tpu-8", "v5p-3", "v5p", "h100-0"])
def test_parse_hardware_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="--hardware"):
        plan.parse_hardware(bad)


def test_training_days_by_hand():
    """5.76e23 FLOPs / (128 chips * 459e12 * 0.45) = 2.17865e7 s = 252.16 days."""
    assert plan.training_days(5.76e23, plan.parse_hardware("v5p-256"), 0.45) == pytest.approx(252.16, rel=1e-4)


def test_cli_json_has_params_tokens_flops(capsys):
    assert plan_cli.main(["--flops", "5.76e23", "--hardware", "v5p-256", "--mfu", "0.45", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["params"] / 70e9 - 1) < 0.15 and abs(out["tokens"] / 1.4e12 - 1) < 0.15
    assert out["flops"] == 5.76e23
    assert out["days"] == pytest.approx(252.16, rel=1e-4)
    assert set(out["allocations"]) == {"chinchilla_rule", "chinchilla_approach3", "kaplan"}


def test_cli_text_prints_all_three_allocations(capsys):
    assert plan_cli.main(["--params", "7e9"]) == 0
    text = capsys.readouterr().out
    assert "headline" in text and "approach 3" in text and "Kaplan" in text and "140B tokens" in text


@pytest.mark.parametrize("argv", [["--flops", "1e20", "--params", "1e9"], [], ["--flops", "1e20", "--hardware", "x-1"],
                                  ["--flops", "-5"]])
def test_cli_rejects_bad_input(argv, capsys):
    assert plan_cli.main(argv) == 2
    assert "error" in capsys.readouterr().err


def _cfg(mesh, *bindings):
    return config_lib.parse([QUICKSTART], [VOCAB, *bindings], mesh=mesh)


@pytest.mark.parametrize("algorithm", ["adamw", "muon"])
@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "fsdp=8", "data=8", "fsdp=4,tensor=2"])
def test_param_and_optimizer_bytes_match_the_state_shardings(mesh, algorithm):
    """Estimated per-device param and optimizer-state bytes (AdamW: two moments per param; Muon: one per matrix it
    updates, two for the rest) equal the shard shapes of the real sharded state."""
    cfg = _cfg(mesh, f"OptimizerConfig.algorithm = '{algorithm}'")
    sizes = validate(cfg, 8)
    spec = state_lib.make_state_spec(cfg.model, lambda p: optim.make_optimizer(cfg.optimizer, 100, p),
                                     mesh_lib.make_mesh(sizes), cfg.logical_axis_rules)

    def shard_bytes(tree):
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree) if x.ndim > 0)

    est = memory.estimate_memory(cfg, sizes)
    assert est.params == shard_bytes(spec.abstract.params)
    coefficients = 3 * 4 if algorithm == "muon" else 0   # Muon's state also holds its 3 Newton-Schulz coefficients
    assert est.opt_state + coefficients == shard_bytes(spec.abstract.opt_state)


@pytest.mark.parametrize("mesh,tensor", [("fsdp=8", 1), ("data=2,fsdp=2,tensor=2", 2), ("data=8", None)])
def test_gathered_weights_by_hand(mesh, tensor):
    """FSDP gathers every matmul weight over fsdp (still split over tensor) in the compute dtype (fp32
    here), and the decoder gathers the whole embedding table for the lookup; pure data parallelism
    gathers nothing. Quickstart: 5,242,880 matmul params, embedding 8192 x 256."""
    sizes = mesh_lib.resolve_mesh_shape(mesh_lib.parse_mesh_spec(mesh), 8)
    got = memory.estimate_memory(_cfg(None), sizes).gathered_params
    assert got == (0 if tensor is None else 5_242_880 * 4 // tensor + 8192 * 256 * 4)


def test_activation_estimate_by_hand_for_full_remat():
    """Quickstart, mesh data=2,fsdp=2,tensor=2, remat 'full': 512 tokens per device (16 rows / 4 x 128).
    Kept per layer: the block input, 256 floats/token. The block being recomputed holds, per token:
    x, norm, x_mid, norm 4 x 256; q 2 heads x 64; k, v 1 x 64 each; fp32 probs 2 heads x 96 keys (two causal
    query blocks of 64: 64 x 64 and 64 x 128 scores, 3/4 of 128 x 128); attention out 128; gate, up, h 3 x 384
    -> 2752 floats. Plus the final norm's input and output."""
    sizes = mesh_lib.resolve_mesh_shape(mesh_lib.parse_mesh_spec("data=2,fsdp=2,tensor=2"), 8)
    cfg = _cfg(None, "ModelConfig.remat_policy = 'full'")
    tokens = 512
    expected = 4 * (4 * tokens * 256) + 4 * tokens * 2752 + 2 * 4 * tokens * 256
    assert memory.estimate_memory(cfg, sizes).activations == expected


def test_activation_estimate_orders_remat_policies():
    """Policies that save a subset save no more: full <= dots_no_batch <= dots, and full is well below
    none. ('dots' may exceed 'none': it also keeps matmul outputs the backward pass never reads.)"""
    sizes = mesh_lib.resolve_mesh_shape(mesh_lib.parse_mesh_spec("data=2,fsdp=2,tensor=2"), 8)
    acts = {p: memory.estimate_memory(_cfg(None, f"ModelConfig.remat_policy = '{p}'"), sizes).activations
            for p in ("none", "dots", "dots_no_batch", "full")}
    assert acts["full"] <= acts["dots_no_batch"] <= acts["dots"]
    assert acts["full"] < 0.5 * acts["none"]


def test_config_plan_says_whether_it_fits(capsys):
    """The quickstart fits a v5e chip; a 70B-class model on 8 v5e chips does not."""
    base = ["--config", QUICKSTART, "--gin", VOCAB, "--hardware", "v5e-8", "--json"]
    assert plan_cli.main([*base, "--mesh", "fsdp=-1"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["memory"]["fits"] is True
    assert small["params"] == count_params(_cfg(None).model)["total"]
    assert small["flops"] == pytest.approx(small["flops_per_token"] * small["tokens"])
    big = ["--gin", "ModelConfig.d_model = 8192", "--gin", "ModelConfig.num_layers = 80",
           "--gin", "ModelConfig.num_heads = 64", "--gin", "ModelConfig.num_kv_heads = 8",
           "--gin", "ModelConfig.head_dim = 128", "--gin", "ModelConfig.mlp_dim = 28672",
           "--gin", "ModelConfig.scan_layers = True", "--gin", "TrainConfig.global_batch_size = 8"]
    assert plan_cli.main([*base, "--mesh", "fsdp=-1", *big]) == 0
    large = json.loads(capsys.readouterr().out)
    assert 60e9 < large["params"] < 80e9
    assert large["memory"]["fits"] is False


def _compiled_step_bytes(cfg) -> int:
    """Per-device bytes of the train step the trainer builds for ``cfg`` (:func:`jaxpt.run.build.build_for`, donated as
    on an accelerator), compiled: argument + output - alias + temp (``jaxpt.tools.compile.memory_bytes``)."""
    from jaxpt.run.build import build_for
    from jaxpt.tools.compile import memory_bytes
    built = build_for(cfg, donate_state=True)  # the planner estimates an accelerator's (donated) step
    return memory_bytes(built.lower_train_step().compile())["total"]


def _check_against_compiled(mesh, *bindings, files=(QUICKSTART,)):
    cfg = config_lib.parse(list(files), [VOCAB, *bindings], mesh=mesh)
    sizes = validate(cfg, jax.device_count())
    measured = _compiled_step_bytes(cfg)
    est = memory.estimate_memory(cfg, sizes).total
    assert abs(est / measured - 1) <= 0.25, (est, measured, est / measured)


@pytest.mark.slow
def test_memory_estimate_matches_compiled_quickstart():
    """The quickstart step (mesh data=2,fsdp=2,tensor=2, no remat) on 8 CPU devices: the estimate is within
    25% of XLA's compiled per-device memory (argument + output - alias + temp)."""
    _check_against_compiled("data=2,fsdp=2,tensor=2")


#: Every layout the planner's estimate covers, compiled: FSDP, tensor, data and their mix; remat policies; scanned
#: layers in bf16; ZeRO-1 (optimizer state over the data-parallel axes, where the estimate once divided the update
#: too and read 0.74 of the compiled step); a pipeline (stage); context parallelism (sequence); experts (expert).
LAYOUTS = [
    ("fsdp=8", ()),
    ("data=2,fsdp=2,tensor=2", ("ModelConfig.remat_policy = 'full'",)),
    ("fsdp=8", ("ModelConfig.remat_policy = 'full'", "ModelConfig.scan_layers = True",
                "ModelConfig.compute_dtype = 'bfloat16'")),
    ("data=8", ("TrainConfig.shard_optimizer_state = True",)),
    ("data=2,fsdp=2,tensor=2", ("TrainConfig.shard_optimizer_state = True",)),
    ("stage=2,data=4", ()),
    ("sequence=2,data=4", ()),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,bindings", LAYOUTS)
def test_memory_estimate_matches_compiled_other_layouts(mesh, bindings):
    _check_against_compiled(mesh, *bindings)


@pytest.mark.slow
def test_memory_estimate_matches_compiled_moe():
    _check_against_compiled("expert=4,data=2", files=(QUICKSTART.replace("quickstart.gin", "quickstart_moe.gin"),))


# ------------------------------------------------------------------------------------- checkpoint interval


def test_young_and_daly_intervals_by_hand():
    """Young 1974: sqrt(2 delta M); Daly 2006 first order: sqrt(2 delta M) - delta (delta < 2M), else M.
    delta = 30 s, M = 24 h: 2 * 30 * 86400 = 5,184,000, whose root is 2276.84 s; Daly: 2246.84 s."""
    assert plan.young_interval(30, 86400) == pytest.approx(2276.840, abs=1e-3)
    assert plan.daly_interval(30, 86400) == pytest.approx(2246.840, abs=1e-3)
    # delta = 50 s, M = 1 h: sqrt(360000) = 600 s; minus 50 = 550 s.
    assert plan.young_interval(50, 3600) == pytest.approx(600.0)
    assert plan.daly_interval(50, 3600) == pytest.approx(550.0)
    assert plan.daly_interval(500, 200) == 200  # delta >= 2M: Daly's tau = M
    with pytest.raises(ValueError, match="mtbf_s"):
        plan.young_interval(30, 0)


def test_goodput_model_by_hand_and_daly_is_near_its_optimum():
    """Goodput tau / (M e^(R/M) (e^((tau+delta)/M) - 1)) at tau = 550, delta = 50, M = 3600, R = 100:
    e^(100/3600) = 1.028167, e^(600/3600) - 1 = 0.181360, so 550 / (3600 * 1.028167 * 0.181360) = 0.819321."""
    assert plan.goodput_at(550, 50, 3600, 100) == pytest.approx(0.819321, rel=1e-5)
    assert plan.expected_lost_s(550, 50, 100) == pytest.approx(400.0)  # (550 + 50) / 2 + 100
    # The first-order optimum is within 0.5% of the numerical optimum of the model (delta << M).
    best = optimize.minimize_scalar(lambda t: -plan.goodput_at(t, 50, 3600), bounds=(1, 3600), method="bounded")
    assert plan.goodput_at(550, 50, 3600) > (1 - 0.005) * -best.fun
    assert plan.goodput_at(550, 50, 3600) > plan.goodput_at(100, 50, 3600)
    assert plan.goodput_at(550, 50, 3600) > plan.goodput_at(3000, 50, 3600)


def test_plan_cli_recommends_an_interval_and_compares_the_configured_one(capsys):
    """MTBF 1 h, save 50 s, 2 s/step: tau = 550 s = 275 steps; the quickstart config saves every 100 steps."""
    assert plan_cli.main(["--config", QUICKSTART, "--gin", VOCAB, "--devices", "8", "--mtbf-hours", "1",
                      "--save-seconds", "50", "--step-seconds", "2", "--json"]) == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint_interval"]
    assert ck["recommended_every_steps"] == 275 and ck["configured_every_steps"] == 100
    assert ck["configured_interval_s"] == 200.0
    assert ck["configured_goodput"] == pytest.approx(plan.goodput_at(200, 50, 3600))
    assert plan_cli.main(["--mtbf-hours", "1"]) == 2
    assert plan_cli.main(["--mtbf-hours", "1", "--save-seconds", "50"]) == 0
    assert "sqrt(2 delta M) - delta): 550.0 s" in capsys.readouterr().out


def test_json_tools_print_their_error_as_json(tmp_path, capsys):
    """With --json, an input error is still exit 2 with the message on stderr, and stdout carries one JSON object
    naming it (not nothing): plan, compile (a bad config key, refused before anything compiles) and the gate."""
    from jaxpt.tools import compile as compile_lib
    from jaxpt.tools import gate
    cases = [(plan_cli.main, ["--flops", "-5", "--json"], "flops"),
             (compile_lib.main, ["--config", "configs/quickstart.gin", "--gin", "TrainConfig.no_such_key = 1",
                                 "--topology", "cpu:8", "--json"], "no_such_key"),
             (gate.main, [str(tmp_path / "missing"), "--json"], "not a run directory")]
    for main, argv, words in cases:
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert words in json.loads(out)["error"] and words in err and err.startswith("error: "), (argv, out, err)
