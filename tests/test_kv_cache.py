"""The KV-cached decode step (jaxpt.infer.kv_cache) equals the cache-free reference (jaxpt.infer.decode.NoCacheStep).

Prompts of different lengths share a batch (rows at different positions), one longer than the row keeps its
tail, and the batch is sharded over a data x tensor mesh (rows over data, kv heads over tensor). Checked: the
prefill and every extend step's logits equal the cache-free step's within float32 rounding, and greedy decoding
gives the same tokens; for looped and scanned layers, and on a sharded mesh.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpt.infer import decode
from jaxpt import mesh as mesh_lib
from jaxpt.infer.kv_cache import KVCacheStep
from jaxpt.model import Decoder, ModelConfig


def _model(scan: bool):
    """A random model, its params drawn on the host (eager initializers would compile one program each)."""
    cfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, max_seq_len=32, scan_layers=scan)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(5))))
    rng = np.random.default_rng(5)
    state = jax.tree.map(lambda a: jax.numpy.asarray(0.2 * rng.standard_normal(a.shape), a.dtype), state)
    return nnx.merge(graphdef, state)


PROMPTS = [np.random.default_rng(i).integers(3, 128, size=n).astype(np.int32) for i, n in enumerate((1, 9, 4, 30))]


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
