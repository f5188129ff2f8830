"""Params and optimizer state are created sharded as the logical-axis rules say."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpt import mesh as M
from jaxpt.training import optim, state as S
from jaxpt.model import ModelConfig

CFG = ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)

# Expected specs by parameter name under DEFAULT_RULES on data=2,fsdp=2,tensor=2, written out by hand.
EXPECTED = {
    "embedding": P("tensor", "fsdp"),
    "output": P("fsdp", "tensor"),
    "wq": P("fsdp", "tensor"), "wk": P("fsdp", "tensor"), "wv": P("fsdp", "tensor"),
    "wo": P("tensor", None, "fsdp"),
    "w_gate": P("fsdp", "tensor"), "w_up": P("fsdp", "tensor"), "w_down": P("tensor", "fsdp"),
    "scale": P(),
}


def leaf_name(path):
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    names = [n for n in names if n != "value"]
    return names[-1]


def make(cfg, mesh_spec):
    mesh = M.make_mesh(mesh_spec)
    spec = S.make_state_spec(cfg, lambda p: optim.make_optimizer(optim.OptimizerConfig(), 100, p), mesh,
                             M.DEFAULT_RULES)
    return mesh, spec, S.init_state(spec, cfg, 0)


@pytest.mark.integration
@pytest.mark.parametrize("scan", [False, True])
def test_param_and_optimizer_shardings_match_rules(scan):
    import dataclasses
    cfg = dataclasses.replace(CFG, scan_layers=scan)
    mesh, spec, state = make(cfg, "data=2,fsdp=2,tensor=2")
    seen = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        name = leaf_name(path)
        expected = EXPECTED[name]
        if scan and "blocks" in jax.tree_util.keystr(path):
            expected = P(None, *expected) if expected != P() else P()
        assert leaf.sharding.spec == expected, (jax.tree_util.keystr(path), leaf.sharding.spec)
        assert leaf.sharding.mesh.shape == mesh.shape
        seen.add(name)
    assert seen == set(EXPECTED)
    # Adam's moments mirror the params leaf for leaf; the step count is replicated.
    mu_nu = 0
    params_flat = {jax.tree_util.keystr(p)[-40:]: l.sharding.spec for p, l in jax.tree_util.tree_leaves_with_path(state.params)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
        if leaf.ndim == 0:
            assert leaf.sharding.is_fully_replicated
            continue
        name = leaf_name(path)
        expected = EXPECTED[name]
        if scan and "blocks" in jax.tree_util.keystr(path):
            expected = P(None, *expected) if expected != P() else P()
        assert leaf.sharding.spec == expected, jax.tree_util.keystr(path)
        mu_nu += 1
    assert mu_nu == 2 * len(params_flat)
    assert state.step.sharding.is_fully_replicated


@pytest.mark.integration
def test_params_are_never_whole_on_one_device():
    # Each device holds only its shard: the local shard of the embedding is 1/4 of it (tensor x fsdp).
    _, spec, state = make(CFG, "data=2,fsdp=2,tensor=2")
    emb = state.params["embedding"][...]
    shard = emb.addressable_shards[0].data
    assert shard.shape == (CFG.vocab_size // 2, CFG.d_model // 2)


def test_replicated_fraction_under_fsdp8_is_at_most_one_percent():
    # The quickstart model shape (vocab 8192) on fsdp=8.
    cfg = ModelConfig(vocab_size=8192, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                      mlp_dim=768)
    mesh = M.make_mesh("fsdp=8")
    spec = S.make_state_spec(cfg, lambda p: optim.make_optimizer(optim.OptimizerConfig(), 100, p), mesh,
                             M.DEFAULT_RULES)
    frac = S.replicated_param_fraction(spec)
    # Only the norm scales replicate: (2 * layers + 1) * d_model floats of the total, computed by hand.
    total = S.num_params(spec)
    assert frac == pytest.approx((2 * 4 + 1) * 256 / total)
    assert frac <= 0.01


def test_logical_to_spec_drops_reused_and_size_one_axes():
    mesh = M.make_mesh("fsdp=8")
    # batch takes data and fsdp; embed would take fsdp again, so it stays unsharded; data has size 1.
    assert M.logical_to_spec(("batch", "length", "embed"), M.DEFAULT_RULES, mesh) == P("fsdp")
    assert M.logical_to_spec(("vocab", "embed"), M.DEFAULT_RULES, mesh) == P(None, "fsdp")


def test_mesh_spec_parsing_errors():
    with pytest.raises(M.MeshError, match="at most one"):
        M.parse_mesh_spec("data=-1,fsdp=-1")
    with pytest.raises(M.MeshError, match="form axis=size"):
        M.parse_mesh_spec("data2")
    with pytest.raises(M.MeshError, match="8 devices"):
        M.make_mesh("data=4")


def test_resolve_mesh_multiplies_ici_by_dcn_and_names_the_field_at_fault():
    shape = M.resolve_mesh("fsdp=-1,tensor=2", "data=2", 8)
    assert dict(shape.ici) == {"stage": 1, "data": 1, "fsdp": 2, "sequence": 1, "expert": 1, "tensor": 2}  # 8 / 2 slices
    assert shape.sizes == {"stage": 1, "data": 2, "fsdp": 2, "sequence": 1, "expert": 1, "tensor": 2}
    assert shape.num_slices == 2 and M.resolve_mesh("data=-1", "", 8).num_slices == 1
    for mesh_spec, dcn_spec, key, text in [("data=-1", "data=3", "dcn_mesh", "3 slices do not divide 8"),
                                           ("data=-1", "data=-1", "dcn_mesh", "-1 is not allowed"),
                                           ("data=-1", "pipe=2", "dcn_mesh", "unknown mesh axis"),
                                           ("fsdp=8", "data=2", "mesh", "4 devices are present")]:
        with pytest.raises(M.MeshError, match=text) as e:
            M.resolve_mesh(mesh_spec, dcn_spec, 8)
        assert e.value.key == key


def test_mesh_from_config_plain_is_make_mesh():
    mesh = M.mesh_from_config("data=2,fsdp=-1,tensor=2")
    assert M.mesh_shape(mesh) == {"stage": 1, "data": 2, "fsdp": 2, "sequence": 1, "expert": 1, "tensor": 2}
    assert (mesh.devices == M.make_mesh("data=2,fsdp=2,tensor=2").devices).all()
    assert M.mesh_from_config("fsdp=4", "", jax.devices()[:4]).size == 4


@pytest.mark.parametrize("ici, dcn", [("fsdp=2,tensor=2", "data=2"), ("data=2,tensor=2", "fsdp=2"),
                                      ("data=2,tensor=2", "data=2")])
def test_hybrid_mesh_keeps_each_slice_in_one_block(ici, dcn):
    """One process simulates 2 slices of 4 devices (ids 0-3 and 4-7). Along an axis that spans slices the DCN
    factor is the outer one, so fixing the DCN coordinate of every axis selects exactly one slice."""
    mesh = M.mesh_from_config(ici, dcn)
    ici_s, dcn_s = M.parse_mesh_spec(ici), M.parse_mesh_spec(dcn)
    assert M.mesh_shape(mesh) == {a: ici_s[a] * dcn_s[a] for a in M.MESH_AXES}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    axis = next(i for i, a in enumerate(M.MESH_AXES) if dcn_s[a] == 2)
    for s in range(2):
        block = np.take(ids, range(s * ici_s[M.MESH_AXES[axis]], (s + 1) * ici_s[M.MESH_AXES[axis]]), axis=axis)
        assert set(block.ravel()) == set(range(4 * s, 4 * s + 4))


def test_slices_come_from_slice_index_then_process_then_blocks():
    from types import SimpleNamespace as Dev
    tpu = [Dev(id=i, process_index=i // 4, slice_index=i % 2) for i in range(8)]
    assert [[d.id for d in g] for g in M._granules(tpu, 2)[0]] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    gpu = [Dev(id=i, process_index=i // 2) for i in range(8)]      # 4 processes, no slice_index
    assert [[d.id for d in g] for g in M._granules(gpu, 4)[0]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    granules, physical = M._granules(gpu, 2)                          # 2 processes per slice: contiguous blocks
    assert [[d.id for d in g] for g in granules] == [[0, 1, 2, 3], [4, 5, 6, 7]] and not physical


def test_unused_mesh_axes_follow_the_rules():
    assert M.rule_mesh_axes(M.DEFAULT_RULES) == {"stage", "data", "fsdp", "expert", "sequence", "tensor"}
    sizes = {"data": 2, "fsdp": 1, "sequence": 2, "expert": 2, "tensor": 1}
    assert M.unused_mesh_axes(sizes, M.DEFAULT_RULES) == {}
    assert M.unused_mesh_axes(sizes, (("batch", "data"),)) == {"sequence": 2, "expert": 2}
    # expert splits experts (and the batch): a model without the 'exp' axis leaves it unused.
    dense = set(M.LOGICAL_AXES) - {"exp"}
    assert M.unused_mesh_axes(sizes, M.DEFAULT_RULES, dense) == {"expert": 2}
    assert M.unused_mesh_axes(sizes, M.DEFAULT_RULES, M.LOGICAL_AXES) == {}
    # Axes inside a tuple count; a later rule for the same logical axis never applies (first match wins).
    rules = (("batch", ("data", "sequence")), ("batch", "expert"))
    assert M.unused_mesh_axes(sizes, rules) == {"expert": 2}
