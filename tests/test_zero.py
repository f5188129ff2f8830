"""Optimizer-state sharding over the data-parallel axes (``TrainConfig.shard_optimizer_state``, ZeRO-1/2): the same
training numbers as the replicated optimizer, per-device optimizer bytes divided by the data-parallel size, and
checkpoints that restore across the switch."""

import math

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import packed_batch
from jaxpt.run import build as builder
from jaxpt import config as config_lib
from jaxpt import mesh as mesh_lib
from jaxpt.training import state as state_lib
from jaxpt.checkpoint import CheckpointConfig, Checkpointer
from jaxpt.training import memory

B, L, V = 16, 32, 256
TINY = [f"ModelConfig.vocab_size = {V}", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
        "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 8",
        "ModelConfig.mlp_dim = 64", f"TrainConfig.seq_len = {L}", f"TrainConfig.global_batch_size = {B}",
        "TrainConfig.mesh = 'data=8'", "TrainConfig.steps = 20", "OptimizerConfig.warmup_steps = 0",
        "OptimizerConfig.peak_learning_rate = 0.01"]
STEPS = 3


def _cfg(shard: bool):
    return config_lib.parse(["configs/quickstart.gin"], [*TINY, f"TrainConfig.shard_optimizer_state = {shard}"])


def _batch(built, seed):
    return packed_batch(built, B, L, V, seed)


def _bytes_per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def runs():
    """Per switch: the built run, its AOT-compiled train step, and ``STEPS`` steps' losses, grad norms and states
    (the same batch each step)."""
    out = {}
    for shard in (False, True):
        built = builder.build_for(_cfg(shard))
        compiled = built.lower_train_step().compile()
        state, states, metrics = built.init_state(), [], []
        for i in range(STEPS):
            state, m = compiled(state, _batch(built, 0))  # one batch, so the loss must fall
            metrics.append((float(m["loss"]), float(m["grad_norm"])))
            states.append(jax.tree.map(np.asarray, state))  # host copies: the state is donated next step
        out[shard] = {"built": built, "compiled": compiled, "metrics": np.array(metrics), "states": states,
                      "state": state}
    return out


def test_zero_sharding_adds_the_data_axes_a_param_is_replicated_on():
    """On data=2,fsdp=2,tensor=2: a param already split over fsdp (FSDP) gets ``data`` after ``fsdp`` on the same
    dimension when that dimension holds the most per shard, a replicated one gets ``data`` and ``fsdp`` together;
    shapes the new axes divide nowhere, and scalars, keep their sharding."""
    mesh = mesh_lib.make_mesh("data=2,fsdp=2,tensor=2")
    axes = state_lib.zero_axes(mesh, mesh_lib.DEFAULT_RULES)
    assert axes == ("data", "fsdp")
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    assert state_lib.zero_sharding(s("fsdp", "tensor"), (64, 16), axes).spec == P(("fsdp", "data"), "tensor")
    assert state_lib.zero_sharding(s("fsdp"), (8, 64), axes).spec == P("fsdp", "data")  # 64 > 8/2 per shard
    assert state_lib.zero_sharding(s(), (6, 32), axes).spec == P(None, ("data", "fsdp"))
    assert state_lib.zero_sharding(s(), (3, 6), axes).spec == P()  # 4 divides neither
    assert state_lib.zero_sharding(s(), (), axes).spec == P()


@pytest.mark.slow
def test_sharded_optimizer_trains_to_the_same_numbers(runs):
    """data=8, three AdamW steps: the loss and grad norm of every step, the params and both Adam moments with the
    optimizer state sharded 8 ways equal those of the replicated optimizer (rel 1e-5); and training moved."""
    ref, got = runs[False], runs[True]
    np.testing.assert_allclose(got["metrics"], ref["metrics"], rtol=1e-5)
    assert ref["metrics"][-1, 0] < ref["metrics"][0, 0] - 1e-3
    for a, b in zip(jax.tree.leaves(got["states"][-1]), jax.tree.leaves(ref["states"][-1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_per_device_optimizer_bytes_fall_by_the_data_parallel_size(runs):
    """Per device, the Adam moments take 1/8 of their replicated bytes on data=8 (every dimension of the tiny model
    has a size 8 divides); the step counts (int32 scalars) stay replicated. The params stay whole on every device.
    The compiled step's argument bytes fall by exactly the bytes saved."""
    ref, got = runs[False]["state"], runs[True]["state"]
    moments = lambda st: [x for x in jax.tree.leaves(st.opt_state) if x.ndim > 0]  # noqa: E731
    counts = lambda st: [x for x in jax.tree.leaves(st.opt_state) if x.ndim == 0]  # noqa: E731
    full = sum(math.prod(x.shape) * 4 for x in moments(ref))  # float32 moments, counted from the shapes
    assert _bytes_per_device(moments(ref)) == full
    assert _bytes_per_device(moments(got)) == full // 8
    assert _bytes_per_device(counts(got)) == _bytes_per_device(counts(ref)) == 4 * len(counts(ref))
    assert _bytes_per_device(got.params) == _bytes_per_device(ref.params)
    arg = {k: runs[k]["compiled"].memory_analysis().argument_size_in_bytes for k in (False, True)}
    assert arg[False] - arg[True] == full - full // 8
    planned = {k: memory.estimate_memory(runs[k]["built"].cfg, runs[k]["built"].sizes).opt_state for k in (False, True)}
    assert planned == {False: full, True: full // 8}  # the planner counts the same bytes


def test_planner_divides_by_the_data_axes_fsdp_does_not_already_use():
    """data=2,fsdp=2,tensor=2: params are FSDP-sharded over fsdp, so ZeRO-1 splits their moments over data only
    (2 ways); on data=2,expert=4 (a dense model: expert is data parallelism) 8 ways."""
    assert memory.zero_factor(mesh_lib.DEFAULT_RULES, {"data": 2, "fsdp": 2, "tensor": 2}) == 2
    assert memory.zero_factor(mesh_lib.DEFAULT_RULES, {"data": 2, "expert": 4}) == 8


@pytest.mark.slow
@pytest.mark.parametrize("saved_sharded", [False, True])
def test_checkpoint_restores_across_the_switch(runs, tmp_path, saved_sharded):
    """A state saved after step 2 with the switch one way restores with it the other way (the same numbers, in the
    other shardings), and step 3 then gives the loss and params of the uninterrupted run (rel 1e-5)."""
    src, dst = runs[saved_sharded], runs[not saved_sharded]
    saved = jax.device_put(src["states"][1], src["built"].spec.shardings)
    ckpt = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    ckpt.manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(saved), meta=ocp.args.JsonSave({})),
                      force=True)
    ckpt.close()
    restored = Checkpointer(str(tmp_path), CheckpointConfig(), read_only=True).restore(
        2, dst["built"].spec.abstract, None)
    for a, s in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(dst["built"].spec.shardings.opt_state)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), src["states"][1])
    state, m = dst["compiled"](restored, _batch(dst["built"], 0))
    np.testing.assert_allclose(float(m["loss"]), src["metrics"][2, 0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, state.params)),
                    jax.tree.leaves(src["states"][2].params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
