"""The KV-cached decode step (jaxpt.infer.kv_cache) equals the cache-free reference (jaxpt.infer.decode.NoCacheStep).

Prompts of different lengths share a batch (rows at different positions), one longer than the row keeps its
tail, and the batch is sharded over a data x tensor mesh (rows over data, kv heads over tensor). Checked: the
prefill and every extend step's logits equal the cache-free step's within float32 rounding, and greedy decoding
gives the same tokens; for looped and scanned layers, and on a sharded mesh; for a mixture of experts with each
of its routers (both steps route it token by token); and a model whose MLP cannot be decoded token by token is
decoded without a cache, said once in the log.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpt.infer import decode
from jaxpt import mesh as mesh_lib
from jaxpt.infer.kv_cache import KVCacheStep, step_class
from jaxpt.model import Decoder, ModelConfig, add_mlp


def _model(scan: bool, **overrides):
    """A random model, its params drawn on the host (eager initializers would compile one program each)."""
    cfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, max_seq_len=32, scan_layers=scan, **overrides)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(5))))
    rng = np.random.default_rng(5)
    state = jax.tree.map(lambda a: jax.numpy.asarray(0.2 * rng.standard_normal(a.shape), a.dtype), state)
    return nnx.merge(graphdef, state)


PROMPTS = [np.random.default_rng(i).integers(3, 128, size=n).astype(np.int32) for i, n in enumerate((1, 9, 4, 30))]


@pytest.mark.integration
@pytest.mark.parametrize("scan,mesh", [(False, None), (True, "data=2,tensor=2,fsdp=2")])
def test_cached_decoding_equals_the_cache_free_path(scan, mesh):
    model = _model(scan)
    mesh = None if mesh is None else mesh_lib.mesh_from_config(mesh)
    L, new = 32, 6
    ref = decode.NoCacheStep.from_model(model, mesh, seq_len=L, batch_size=4)
    got = KVCacheStep.from_model(model, mesh, seq_len=L, batch_size=4)
    prompts = [decode.truncate_prompt(p, L, new) for p in PROMPTS]
    s_ref, l_ref = ref.prefill(prompts)
    s_got, l_got = got.prefill(prompts)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-5)
    for _ in range(new - 1):  # the same tokens into both (the reference's argmax), each row at its own position
        tokens = np.argmax(l_ref, axis=-1).astype(np.int32)
        s_ref, l_ref = ref.extend(s_ref, tokens)
        s_got, l_got = got.extend(s_got, tokens)
        np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-5)
    if mesh is not None:
        k = s_got.cache[0]
        assert k.shape == (2, 4, L, 2, 8) and not k.sharding.is_fully_replicated
    a, b = decode.greedy(got, PROMPTS, new), decode.greedy(ref, PROMPTS, new)
    assert [g.ids for g in a] == [g.ids for g in b] and all(len(g.ids) == new for g in a)


def test_extend_refuses_a_full_row():
    step = KVCacheStep.from_model(_model(False), seq_len=4)
    state, _ = step.prefill([np.arange(4, dtype=np.int32)])
    with pytest.raises(ValueError, match="already holds seq_len = 4"):
        step.extend(state, np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="2 prompts for a batch of 1"):
        step.prefill([[1], [2]])


#: The quickstart MoE's router (configs/quickstart_moe.gin: 4 experts, top-2, capacity 1.25, 5 Sinkhorn iterations)
#: and its variants: plain top-k, capacity contested without Sinkhorn, routing groups of 8 tokens, dropless.
MOE = {"mlp": "moe", "moe_num_experts": 4, "moe_top_k": 2, "moe_capacity_factor": 1.25}
MOE_ROUTERS = {"top_k": dict(MOE, moe_capacity_factor=2.0), "capacity": MOE,
               "sinkhorn": dict(MOE, moe_router_sinkhorn_iters=5),
               "grouped": dict(MOE, moe_router_sinkhorn_iters=5, moe_group_size=8),
               "dropless": dict(MOE, moe_router_sinkhorn_iters=5, moe_dropless=True)}


@pytest.mark.integration
@pytest.mark.parametrize("router", sorted(MOE_ROUTERS))
def test_moe_cached_decoding_equals_the_cache_free_forward(router):
    """A 2-layer mixture of experts, prompts of 3, 9 and 20 tokens in rows of 32 (and a padding row): the prefill
    and every extend step's logits of the KV-cached step equal the cache-free step's (1e-5, float32), and greedy
    decoding gives the same tokens, whatever the router: the prompts' padding takes no expert capacity and
    enters no balancing, and a token routed alone at its extend is routed as in the forward pass over its row
    (each token by itself, ``causal``). Before, the prefill routed the padding, each extend routed one token as
    a group of its own, and ``moe_group_size`` made the first extend raise."""
    model = _model(False, **MOE_ROUTERS[router])
    L, new = 32, 8
    prompts = [np.random.default_rng(10 + i).integers(3, 128, size=n).astype(np.int32) for i, n in enumerate((3, 9, 20))]
    ref = decode.NoCacheStep.from_model(model, seq_len=L, batch_size=4)
    got = KVCacheStep.from_model(model, seq_len=L, batch_size=4)
    s_ref, l_ref = ref.prefill(prompts)
    s_got, l_got = got.prefill(prompts)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-5)
    for _ in range(new - 1):
        tokens = np.argmax(l_ref, axis=-1).astype(np.int32)
        s_ref, l_ref = ref.extend(s_ref, tokens)
        s_got, l_got = got.extend(s_got, tokens)
        np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-5)
    a, b = decode.greedy(got, prompts, new), decode.greedy(ref, prompts, new)
    assert [g.ids for g in a] == [g.ids for g in b]
    # the cache-free step is the model's own forward over each row, routed token by token: its last-token logits
    row = np.zeros((1, L), np.int32)
    row[0, :20] = prompts[2]
    seg = (np.arange(L) < 20).astype(np.int32)[None]
    full = model(jnp.asarray(row), jnp.asarray(seg), jnp.asarray(np.arange(L) * seg), routing="causal")
    np.testing.assert_allclose(ref.prefill([prompts[2]])[1][0], np.asarray(full)[0, 19], rtol=1e-5, atol=1e-5)


class _RowMeanMLP(nnx.Module):
    """An MLP that mixes tokens (adds its row's mean input) and offers no per-token routing."""

    routings = ("train",)

    def __init__(self, cfg, *, rngs):
        self.cfg = cfg

    def __call__(self, x_BxLxD, *, routing="train"):
        return jnp.broadcast_to(jnp.mean(x_BxLxD, axis=1, keepdims=True), x_BxLxD.shape), {}


def test_a_model_that_cannot_route_token_by_token_is_decoded_without_a_cache(caplog):
    """An MLP whose routings lack ``causal`` cannot be decoded one token at a time: KVCacheStep refuses it,
    step_class gives the cache-free step for it (the model's own forward on each row so far) and says so once in
    the log, and its greedy tokens are those of the cache-free step; a dense model and a mixture of experts get
    the KV cache."""
    add_mlp("row_mean_test", _RowMeanMLP, replace=True)
    model = _model(False, mlp="row_mean_test")
    with pytest.raises(ValueError, match="cannot route one token at a time"):
        KVCacheStep.from_model(model, seq_len=16)
    with caplog.at_level(logging.WARNING, logger="jaxpt.infer.kv_cache"):
        assert step_class(model.cfg) is decode.NoCacheStep
        assert step_class(model.cfg) is decode.NoCacheStep
    said = [r for r in caplog.records if r.name == "jaxpt.infer.kv_cache"]
    assert len(said) == 1 and "decoding without a cache" in said[0].getMessage()
    assert step_class(model.cfg, kv_cache=False) is decode.NoCacheStep
    assert step_class(_model(False).cfg) is KVCacheStep
    assert step_class(_model(False, **MOE).cfg) is KVCacheStep
    step = step_class(model.cfg).from_model(model, seq_len=16)
    ids = decode.greedy(step, [np.arange(3, 8, dtype=np.int32)], 4)[0].ids
    assert ids == decode.greedy(decode.NoCacheStep.from_model(model, seq_len=16), [np.arange(3, 8, dtype=np.int32)],
                                4)[0].ids
