"""``ModelConfig.fused_projections``: the attention's q/k/v projections and SwiGLU's gate/up projections as one
GEMM each. The fused step computes the same losses and updates as separate projections (the reference: the
model's math as first written), on a mesh that shards heads and the MLP over ``tensor`` and params over
``fsdp``, with grouped-query (K < H: k and v fused, q apart) and multi-head attention; it really makes fewer
GEMMs. (The KV-cache decoder projects through the same method, ``Attention.project_qkv``, fused by default:
``tests/test_kv_cache.py`` checks it against the cache-free forward.)"""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import packed_batch
from jaxpt.run import build as builder
from jaxpt import config as config_lib
from jaxpt import mesh as mesh_lib
from jaxpt.training import step as step_lib
from jaxpt.model import Decoder, ModelConfig

B, L, V = 16, 32, 256


def _bindings(kv_heads: int, fused: bool, mesh: str) -> list[str]:
    return [f"ModelConfig.vocab_size = {V}", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
            "ModelConfig.num_heads = 4", f"ModelConfig.num_kv_heads = {kv_heads}", "ModelConfig.head_dim = 8",
            "ModelConfig.mlp_dim = 64", f"ModelConfig.fused_projections = {fused}", f"TrainConfig.seq_len = {L}",
            f"TrainConfig.global_batch_size = {B}", f"TrainConfig.mesh = '{mesh}'", "TrainConfig.steps = 20",
            "OptimizerConfig.warmup_steps = 0", "OptimizerConfig.peak_learning_rate = 0.01"]


def _dot_generals(cfg: ModelConfig) -> int:
    """``dot_general`` ops in the lowered (unoptimized) forward pass of a ``cfg`` model on one [2, L] batch."""
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = np.ones((2, L), np.int32)

    def forward(p, t):
        return nnx.merge(graphdef, p)(t, jax.numpy.ones_like(t), jax.numpy.broadcast_to(np.arange(L, dtype=np.int32), t.shape))

    return len(re.findall(r"stablehlo\.dot_general", jax.jit(forward).lower(params, tokens).as_text()))


def _grads(built, params, batch):
    """Per-param gradients of the training loss at ``params``, computed under ``built``'s mesh and rules."""
    spec = built.spec

    def fn(p, b):
        with mesh_lib.activation_sharding(built.mesh, built.cfg.logical_axis_rules):
            return step_lib.loss_and_grads(p, spec.graphdef, b, built.cfg.z_loss_weight)[1]

    return jax.tree.map(np.asarray, nnx.to_pure_dict(jax.jit(fn)(params, batch)))


@pytest.mark.integration
@pytest.mark.parametrize("kv_heads,mesh", [(2, "data=2,fsdp=2,tensor=2"), (4, "fsdp=4,tensor=2")])
def test_fused_step_equals_separate_projections(kv_heads, mesh):
    """From the same initial params: every param's gradient agrees (to 1e-5 of that param's largest gradient),
    and over three train steps on one batch the losses and gradient norms (global, attention, MLP) agree (rel 1e-5).

    Fusion changes the forward and backward pass only, so gradients are what to compare. Params after Adam steps
    are not: Adam divides by sqrt(v), so where a gradient is near 0 a float rounding moves that element's update
    by up to the learning rate (CI, Python 3.12: one element of 2,048 off by 2.4e-4 after 3 steps)."""
    runs = {}
    for fused in (False, True):
        built = builder.build_for(config_lib.parse(["configs/quickstart.gin"], _bindings(kv_heads, fused, mesh)))
        state, metrics, batch = built.init_state(), [], packed_batch(built, B, L, V, 0)
        grads = _grads(built, state.params, batch)
        for _ in range(3):  # one batch, so the loss must fall
            state, m = built.train_step(state, batch)
            metrics.append([float(m[k]) for k in ("loss", "grad_norm", "grad_norm/attention", "grad_norm/mlp")])
        runs[fused] = (np.array(metrics), grads)
    (m_sep, g_sep), (m_fused, g_fused) = runs[False], runs[True]
    assert m_sep[-1, 0] < m_sep[0, 0]  # it trains: the comparison is not between two constant runs
    np.testing.assert_allclose(m_fused, m_sep, rtol=1e-5)
    leaves = jax.tree_util.tree_leaves_with_path(g_sep)
    assert len(leaves) == 2 * 9 + 3  # per layer q, k, v, o, gate, up, down, 2 norms; embedding, final norm, output
    for (path, a), b in zip(leaves, jax.tree.leaves(g_fused)):
        scale = np.abs(a).max()
        assert scale > 0, path  # a gradient that is all zero would compare equal whatever fusion did
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.integration
@pytest.mark.parametrize("kv_heads,per_layer", [(4, 6), (2, 7)])
def test_fused_projections_make_fewer_gemms(kv_heads, per_layer):
    """Per layer, separate: q, k, v, o, gate, up, down and the two attention einsums (9); fused multi-head: qkv,
    o, gate+up, down and the two (6); fused grouped-query: q, kv, o, gate+up, down and the two (7). Plus the
    output head."""
    cfg = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads, head_dim=8,
                      mlp_dim=64, max_seq_len=L, fused_projections=False)
    assert _dot_generals(cfg) == 2 * 9 + 1
    assert _dot_generals(dataclasses.replace(cfg, fused_projections=True)) == 2 * per_layer + 1

