"""Muon (``OptimizerConfig.algorithm = 'muon'``, #37): the parameter groups and their dimension numbers, one update
against optax's Muon applied by hand, refusals, the optimizer state's shardings under FSDP and ZeRO-1 on a
(data=2, fsdp=2, tensor=2) mesh, and an exact resume on that mesh."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import tiny_bindings
from jaxpt import config as config_lib
from jaxpt import mesh as mesh_lib
from jaxpt.model import Decoder, ModelConfig
from jaxpt.run import build as builder
from jaxpt.training import optim
from jaxpt.util.errors import ConfigError

MESH = "data=2,fsdp=2,tensor=2"
MDN = optax.contrib.MuonDimensionNumbers

# Every parameter kind: scanned layers (a leading [layers] batch axis), MoE experts (a leading [experts] axis),
# a shared expert, the router, q/k norms, attention biases and an untied output.
SCANNED_MOE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=48,
                   max_seq_len=32, scan_layers=True, qk_norm=True, attention_bias=True, mlp="moe",
                   moe_num_experts=4, moe_shared_expert_dim=16, tie_embeddings=False)
DENSE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=48,
             max_seq_len=32, scan_layers=False, tie_embeddings=False)

# The expected dimension numbers, written out per shape with positive axes (None: AdamW).
EXPECTED = {
    "scanned_moe": {"wq": MDN(1, (2, 3)), "wk": MDN(1, (2, 3)), "wv": MDN(1, (2, 3)), "wo": MDN((1, 2), 3),
                    "mlp/w_gate": MDN(2, 3), "mlp/w_up": MDN(2, 3), "mlp/w_down": MDN(2, 3),  # [L, E, in, out]
                    "shared/w_gate": MDN(1, 2), "shared/w_up": MDN(1, 2), "shared/w_down": MDN(1, 2)},
    "dense": {"wq": MDN(0, (1, 2)), "wk": MDN(0, (1, 2)), "wv": MDN(0, (1, 2)), "wo": MDN((0, 1), 2),
              "mlp/w_gate": MDN(0, 1), "mlp/w_up": MDN(0, 1), "mlp/w_down": MDN(0, 1)},
}
ADAMW_NAMES = {"embedding", "output", "scale", "w_router", "router_bias", "q_bias", "k_bias", "v_bias"}


def _key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path)


def _expected_dims(kind: str, key: str):
    name = key.split("/")[-1]
    if name in ADAMW_NAMES:
        return None
    table = EXPECTED[kind]
    return table.get(name) or table["/".join(key.split("/")[-2:])]


@functools.cache
def _init(kind: str):
    """The params' initializer as one jit, compiled once per kind (eagerly, every distinct param shape would
    compile its own initializer)."""
    cfg = ModelConfig(**(SCANNED_MOE if kind == "scanned_moe" else DENSE))
    return jax.jit(lambda: nnx.to_pure_dict(nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1]))


def _params(kind: str) -> dict:
    return _init(kind)()


@pytest.mark.integration
@pytest.mark.parametrize("kind,on_mesh", [("scanned_moe", ""), ("dense", ""), ("scanned_moe", MESH),
                                          ("scanned_moe", "expert=2,fsdp=2,tensor=2")])
def test_one_muon_update_equals_optax_muon_applied_by_hand(kind, on_mesh, monkeypatch):
    """Two updates of jaxpt's Muon on a model's params equal, per parameter (to float32 rounding, rtol 1e-5),
    optax.contrib.muon run on the matrices with the dimension numbers written out above (Nesterov, consistent RMS
    0.2, decayed) and optax.adamw run on the rest with jaxpt's decay mask (norms, biases, embedding undecayed).

    ``on_mesh``: the update traced as the train step traces it, under that mesh, where each stacked matrix is split
    by layer for Newton-Schulz (:func:`jaxpt.training.optim.by_layer`): its 2 layers padded with zero matrices to 8,
    one per device; on a mesh with an ``expert`` axis, the MoE matrices ``[layers, experts, in, out]`` keep their
    experts split over it and pad their layers to 4 (fsdp x tensor). The reference is still optax on one device."""
    params = _params(kind)
    split = []
    if on_mesh:
        real = optim._layer_padded  # noqa: SLF001

        def recorded(x, d, m, r):  # (leading batch axes, rows of the padded layer axis)
            out = real(x, d, m, r)
            reduction, output = optim.optax_muon._normalize_axes(x, d)  # noqa: SLF001
            split.append((x.ndim - len(reduction) - len(output), out.shape[0]))
            return out

        monkeypatch.setattr(optim, "_layer_padded", recorded)
    flat = {_key(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    assert {k.split("/")[-1] for k in flat} >= {"wq", "wo", "w_gate", "embedding", "output", "scale"}
    lr, wd = 0.01, 0.1
    cfg = optim.OptimizerConfig(algorithm="muon", peak_learning_rate=lr, schedule="constant", warmup_steps=0,
                                weight_decay=wd, grad_clip_norm=0.0)
    tx = optim.make_optimizer(cfg, 10, params)
    muon_keys = [k for k in flat if _expected_dims(kind, k) is not None]
    adam_keys = [k for k in flat if k not in muon_keys]
    ref_muon = optax.contrib.muon(lr, beta=0.95, ns_steps=5, eps=cfg.eps, weight_decay=wd, consistent_rms=0.2,
                                  muon_weight_dimension_numbers={k: _expected_dims(kind, k) for k in muon_keys})
    decays = lambda k: k.split("/")[-1] in {"output", "w_router"}  # noqa: E731  # the AdamW group's matrices
    ref_adam = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd,
                           mask={k: decays(k) for k in adam_keys})
    sub = lambda d, ks: {k: d[k] for k in ks}  # noqa: E731
    state, rm, ra = tx.init(params), ref_muon.init(sub(flat, muon_keys)), ref_adam.init(sub(flat, adam_keys))
    for seed in (1, 2):
        # Gaussian gradients drawn by numpy (jax.random.normal eagerly compiles once per distinct shape).
        rng = np.random.default_rng(seed)
        grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32)), params)
        g = {_key(p): x for p, x in jax.tree_util.tree_leaves_with_path(grads)}
        updates, state = jax.jit(_traced(tx.update, on_mesh))(grads, state, params)
        um, rm = jax.jit(ref_muon.update)(sub(g, muon_keys), rm, sub(flat, muon_keys))
        ua, ra = jax.jit(ref_adam.update)(sub(g, adam_keys), ra, sub(flat, adam_keys))
        got = {_key(p): x for p, x in jax.tree_util.tree_leaves_with_path(updates)}
        for k, want in {**um, **ua}.items():
            np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-8, err_msg=k)
        # Muon's update is not AdamW's: an orthogonalized matrix has RMS ~ 0.2 * lr (Liu et al. 2025).
        k = next(k for k in muon_keys if k.endswith("w_up"))
        rms = float(jnp.sqrt(jnp.mean((got[k] + lr * wd * flat[k]) ** 2)))
        assert 0.1 * lr < rms < 0.3 * lr, (k, rms)
    # On the mesh every Muon matrix (2 updates x gradient and momentum) went through the split; off it none did.
    assert len(split) == (2 * 2 * len(muon_keys) if on_mesh else 0)
    experts_split = "expert" in on_mesh
    assert {rows for batch, rows in split if batch == 1} == ({8} if on_mesh else set()), split
    assert {rows for batch, rows in split if batch == 2} == ({4 if experts_split else 8} if on_mesh else set()), split


def _traced(fn, on_mesh: str):
    """``fn`` traced under the train step's mesh context (the mesh ``on_mesh``, default rules), if one is given."""
    if not on_mesh:
        return fn
    mesh = mesh_lib.mesh_from_config(on_mesh)

    def traced(*args):
        with mesh_lib.activation_sharding(mesh, mesh_lib.DEFAULT_RULES):
            return fn(*args)

    return traced


def _compiled_temp_bytes(prepared, tmp_path, algorithm: str) -> int:
    """Per-device temporary bytes (``memory_analysis``) of the compiled train step of an 8-layer scanned model
    (d_model 256, mlp 1024) on fsdp=8 with ``algorithm``."""
    b = _tiny(prepared, tmp_path, **{"OptimizerConfig.algorithm": repr(algorithm), "ModelConfig.scan_layers": "True",
                                     "ModelConfig.num_layers": "8", "ModelConfig.d_model": "256",
                                     "ModelConfig.mlp_dim": "1024", "ModelConfig.head_dim": "64",
                                     "TrainConfig.global_batch_size": "8"}, mesh="fsdp=8")
    return builder.build_for(b).lower_train_step().compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_newton_schulz_needs_one_layer_per_device_not_the_whole_stack(prepared_sample, tmp_path, monkeypatch):
    """The Muon matrices of an 8-layer scanned model (q 256x256, k and v 256x128, o 256x256, gate/up/down
    256x1024: 983,040 float32 parameters, 3.93 MB, per layer) on fsdp=8: the compiled step's temporaries exceed
    AdamW's by less than two layers' matrices (each device orthogonalizes one layer); with the split turned off
    (XLA left to place Newton-Schulz) they exceed them by more than the whole stack (8 layers, 31.5 MB), because
    every device gathers and orthogonalizes every layer. Measured: +5.2 MB with the split, +34.2 MB without."""
    per_layer = 4 * (256 * 256 * 2 + 256 * 128 * 2 + 256 * 1024 * 3)
    adamw = _compiled_temp_bytes(prepared_sample, tmp_path, "adamw")
    muon = _compiled_temp_bytes(prepared_sample, tmp_path, "muon")
    monkeypatch.setattr(optim, "by_layer", lambda inner, dims: inner)
    unsplit = _compiled_temp_bytes(prepared_sample, tmp_path, "muon")
    assert muon - adamw < 2 * per_layer, (muon, adamw)
    assert unsplit - adamw > 8 * per_layer, (unsplit, adamw)


@pytest.mark.integration
def test_groups_by_name_and_refusals():
    """The labels follow the names; a parameter of an unknown name, or a matrix of a rank that is not its own,
    is a ConfigError naming OptimizerConfig.algorithm and the parameter; bad Muon knobs name their field."""
    labels, _ = optim.muon_parameter_groups(_params("scanned_moe"))
    got = {_key(p): v for p, v in jax.tree_util.tree_leaves_with_path(labels)}
    assert {k for k, v in got.items() if v == "adamw"} == {k for k in got if k.split("/")[-1] in ADAMW_NAMES}
    assert got["blocks/mlp/w_router"] == "adamw" and got["blocks/attn/wq"] == "muon"
    weird = {"blocks": {"0": {"mlp": {"w_weird": jnp.zeros((4, 4))}}}, "embedding": jnp.zeros((8, 4))}
    with pytest.raises(ConfigError, match=re.escape("OptimizerConfig.algorithm = 'muon': cannot tell whether "
                                                    "parameter blocks/0/mlp/w_weird (shape (4, 4))")):
        optim.make_optimizer(optim.OptimizerConfig(algorithm="muon"), 100, weird)
    with pytest.raises(ConfigError, match=r"parameter attn/wq has shape \(4, 4\)"):
        optim.muon_parameter_groups({"attn": {"wq": jnp.zeros((4, 4))}})
    optim.make_optimizer(optim.OptimizerConfig(), 100, weird)  # AdamW takes anything
    for field, value, allowed in [("algorithm", "sgd", "choose one of ('adamw', 'muon')"),
                                  ("muon_momentum", 1.0, "must be in [0, 1)"),
                                  ("muon_ns_steps", 0, "must be positive"),
                                  ("muon_consistent_rms", -0.1, "must be >= 0")]:
        with pytest.raises(ConfigError, match=re.escape(f"OptimizerConfig.{field} = {value!r}: {allowed}")):
            optim.OptimizerConfig(**{field: value})


def _tiny(prepared, tmp_path, mesh=MESH, **overrides):
    b = tiny_bindings(prepared, tmp_path, **{"OptimizerConfig.algorithm": "'muon'", **overrides})
    return config_lib.parse(["configs/quickstart.gin"], b, mesh=mesh)


def _moments(opt_tree) -> dict[str, object]:
    """``{'<group>/<moment>/<param path>': leaf}`` for every params-shaped leaf of the optimizer state."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_tree):
        s = jax.tree_util.keystr(path)
        m = re.search(r"inner_states\['(\w+)'\].*?\.(mu|nu)(\[.*)$", s)
        if m:
            out[f"{m[1]}/{m[2]}/{m[3]}"] = leaf
    return out


@pytest.mark.parametrize("zero", [False, True])
def test_optimizer_state_is_sharded_like_the_params(prepared_sample, tmp_path, zero):
    """On data=2,fsdp=2,tensor=2: Muon's momentum exists for the matrices only, AdamW's mu and nu for the rest
    only, and every one of them has its param's sharding (ZeRO-1: the param's update sharding, split over data
    too), never a replicated one where the param is not; counts and Newton-Schulz coefficients are replicated.
    Per device the Muon state is smaller than AdamW's (one moment for the matrices instead of two)."""
    built = builder.build_for(_tiny(prepared_sample, tmp_path, **{"TrainConfig.shard_optimizer_state": zero}))
    spec = built.spec
    p_shard = spec.update_shardings if zero else spec.shardings.params
    params = {jax.tree_util.keystr(p): (a, s) for (p, a), s in zip(
        jax.tree_util.tree_leaves_with_path(spec.abstract.params), jax.tree.leaves(p_shard))}
    moments = _moments(spec.abstract.opt_state)
    labels, _ = optim.muon_parameter_groups(spec.abstract.params)
    for (path, label) in jax.tree_util.tree_leaves_with_path(labels):
        k = jax.tree_util.keystr(path)
        want = ["muon/mu"] if label == "muon" else ["adamw/mu", "adamw/nu"]
        assert [g for g in ("muon/mu", "adamw/mu", "adamw/nu") if f"{g}/{k}" in moments] == want, k
    assert len(moments) == sum(1 if lab == "muon" else 2 for lab in jax.tree.leaves(labels))
    for name, leaf in moments.items():
        param, sharding = params[name.split("/", 2)[2]]
        assert leaf.shape == param.shape and leaf.sharding == sharding, name
        if zero:
            assert "data" in str(sharding.spec) or "data" in str(param.sharding.spec), name
    assert any(s.spec != () for _, s in params.values())
    others = [x for x in jax.tree.leaves(spec.abstract.opt_state) if all(x is not m for m in moments.values())]
    assert others and all(x.sharding.is_fully_replicated and x.size <= 3 for x in others)
    state_bytes = lambda sp: sum(  # noqa: E731
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(sp.abstract.opt_state))
    adamw = builder.build_for(_tiny(prepared_sample, tmp_path, **{"OptimizerConfig.algorithm": "'adamw'",
                                                                  "TrainConfig.shard_optimizer_state": zero}))
    assert state_bytes(spec) < state_bytes(adamw.spec)


@pytest.mark.slow
def test_resume_on_a_sharded_mesh_is_bitwise_the_uninterrupted_run(prepared_sample, tmp_path):
    """A Muon run of 6 steps on data=2,fsdp=2,tensor=2, and the same run stopped after step 4 (checkpoint) and
    resumed by a new run_training to step 6: every step's loss, grad norm and learning rate, and the final params
    and optimizer state (Muon momentum, Adam moments, counts), are equal bit for bit."""
    from jaxpt import train as T
    from jaxpt.tools import drill

    ckpt = {"CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "2",
            "CheckpointConfig.async_save": "False", "OptimizerConfig.warmup_steps": "2"}
    runs = {}
    for name, stops in (("ref", (6,)), ("resumed", (4, 6))):
        workdir = tmp_path / name
        for steps in stops:
            T.run_training(config_lib.parse(["configs/quickstart.gin"],
                                            tiny_bindings(prepared_sample, workdir,
                                                          **{"OptimizerConfig.algorithm": "'muon'", **ckpt}),
                                            steps=steps, mesh=MESH))
        runs[name] = workdir
    ref, got = drill.step_records(str(runs["ref"])), drill.step_records(str(runs["resumed"]))
    for s in range(1, 7):
        for k in drill.DETERMINISTIC_KEYS:
            assert got[s][-1][k] == ref[s][-1][k], (s, k)
    a, b = drill.load_state_numpy(str(runs["ref"]), 6), drill.load_state_numpy(str(runs["resumed"]), 6)
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    assert any("mu" in jax.tree_util.keystr(p) for p, _ in la)
    for (p, x), (_, y) in zip(la, lb):
        assert np.array_equal(x, y), jax.tree_util.keystr(p)


@pytest.mark.integration
@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(optim.OptimizerConfig)])
def test_state_layout_names_every_setting_that_changes_the_state_structure(field):
    """Each OptimizerConfig field set to another legal value changes the optimizer state's tree structure (params
    of a small model with a stack, a norm and an embedding) exactly when :func:`optim.state_layout` changes: so the
    admission check (:func:`jaxpt.run.lineage._check_optimizer_state`) refuses every resume Orbax would fail on."""
    other = {"peak_learning_rate": 1e-2, "schedule": "wsd", "warmup_steps": 7, "decay_steps": 50,
             "min_lr_ratio": 0.5, "wsd_decay_fraction": 0.3, "b1": 0.8, "b2": 0.9, "eps": 1e-6,
             "weight_decay": 0.0, "decay_embeddings": True, "grad_clip_norm": 0.0, "algorithm": "muon",
             "muon_momentum": 0.9, "muon_ns_steps": 3, "muon_consistent_rms": 0.0}
    base = optim.OptimizerConfig(warmup_steps=5)
    assert getattr(base, field) != other[field]
    changed = dataclasses.replace(base, **{field: other[field]})
    params = _params("dense")

    def structure(cfg):
        return jax.tree_util.tree_structure(jax.eval_shape(optim.make_optimizer(cfg, 100, params).init, params))

    def layout(cfg):
        return optim.state_layout({f"OptimizerConfig.{f.name}": getattr(cfg, f.name)
                                   for f in dataclasses.fields(cfg)})

    assert (structure(changed) != structure(base)) == (layout(changed) != layout(base)), field
    assert (layout(changed) != layout(base)) == (field in optim.STATE_LAYOUT), field


@pytest.mark.slow
def test_a_resume_under_another_optimizer_is_refused_before_orbax(prepared_sample, tmp_path):
    """An AdamW run saved at step 2: resuming it with Muon, or without gradient clipping, is refused by the dry run
    and by the run, naming each key and both values, and nothing is written; a stage from it (init_from) with Muon
    is refused unless it resets the optimizer, and with ``reset_optimizer`` it trains (the parent's AdamW moments
    are not read)."""
    from jaxpt import train as T
    from jaxpt.util.errors import CheckpointError
    ckpt = {"CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "2",
            "CheckpointConfig.async_save": "False"}

    def cfg(workdir, steps, **over):
        return config_lib.parse(["configs/quickstart.gin"], tiny_bindings(prepared_sample, workdir, **ckpt, **over),
                                steps=steps, mesh=MESH)

    work = tmp_path / "adamw"
    T.run_training(cfg(work, 2))
    muon = {"OptimizerConfig.algorithm": "'muon'"}
    with pytest.raises(CheckpointError, match=r"optimizer state of another structure .*OptimizerConfig.algorithm = "
                                              r"'adamw' there, 'muon' here.*TrainConfig.reset_optimizer = True"):
        T.dry_run(cfg(work, 4, **muon))
    with pytest.raises(CheckpointError, match=r"OptimizerConfig.grad_clip_norm = 1.0 there, 0.0 here"):
        T.dry_run(cfg(work, 4, **{"OptimizerConfig.grad_clip_norm": "0.0"}))
    with pytest.raises(CheckpointError, match="OptimizerConfig.algorithm"):
        T.run_training(cfg(work, 4, **muon))
    assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    stage = {"TrainConfig.init_from": repr(str(work)), **muon}
    with pytest.raises(CheckpointError, match=r"'adamw' there, 'muon' here.*set TrainConfig.reset_optimizer = True"):
        T.dry_run(cfg(tmp_path / "stage", 4, **stage))
    T.run_training(cfg(tmp_path / "stage", 4, **stage, **{"TrainConfig.reset_optimizer": "True"}))
    assert (tmp_path / "stage" / "checkpoints" / "4").is_dir()
