"""Context parallelism (the ``sequence`` mesh axis): the zigzag layout, attention per implementation against an
unsharded reference, the quickstart's losses against ``data=8``, config validation, and the ``sequence=1``
program left unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpt.run import build as builder
from jaxpt import config as C
from jaxpt import mesh as M
from jaxpt.util.errors import ConfigError
from jaxpt.model import context_parallel as cp
from jaxpt.model.attention import dot_product_attention
from jaxpt.model.attention_xla import xla_attention
from jaxpt.run.validate import validate

QUICKSTART = "configs/quickstart.gin"


def packed_rows(rng, batch: int, length: int, chunk: int, vocab: int = 512):
    """Rows of documents of random lengths (3..29 tokens) with per-document positions, a padding tail on row
    0; returns the batch and checks that documents cross ``chunk``-token boundaries (the property under test)."""
    seg = np.zeros((batch, length), np.int32)
    pos = np.zeros((batch, length), np.int32)
    for b in range(batch):
        t, d = 0, 1
        while t < length:
            n = min(int(rng.integers(3, 30)), length - t)
            seg[b, t:t + n], pos[b, t:t + n] = d, np.arange(n)
            t, d = t + n, d + 1
    seg[0, -5:], pos[0, -5:] = 0, 0
    boundaries = np.arange(chunk, length, chunk)
    crossing = (seg[:, boundaries - 1] == seg[:, boundaries]) & (seg[:, boundaries] != 0)
    assert crossing.sum() >= batch, "the rows must have documents that cross chunk boundaries"
    assert (pos[:, boundaries][crossing] > 0).all()    # such a document's positions continue over the boundary
    tokens = rng.integers(1, vocab, (batch, length)).astype(np.int32)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def test_zigzag_order_by_hand():
    # L = 8 over 2 devices: 4 chunks of 2; device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
    np.testing.assert_array_equal(cp.zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    # 4 devices, 8 chunks of 1: (0, 7), (1, 6), (2, 5), (3, 4).
    np.testing.assert_array_equal(cp.zigzag_order(8, 4), [0, 7, 1, 6, 2, 5, 3, 4])
    np.testing.assert_array_equal(cp.zigzag_order(6, 1), np.arange(6))
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    z = cp.to_zigzag(x, 4)
    np.testing.assert_array_equal(z, np.asarray(x)[:, cp.zigzag_order(16, 4)])
    np.testing.assert_array_equal(cp.from_zigzag(z, 4), x)
    # Causal work is balanced: device i's two chunks attend (i + 1) + (2s - i) = 2s + 1 chunks of keys.
    s, L = 4, 64
    order = cp.zigzag_order(L, s).reshape(s, -1)
    work = [sum(int(i) + 1 for i in part) for part in order]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="not a multiple of 2 x 4"):
        cp.zigzag_order(20, 4)


def _reference(batch, q, k, v):
    """Unsharded xla attention in the natural row order (no mesh): the independent reference."""
    out, aux = xla_attention(q, k, v, batch["segment_ids"], batch["segment_ids"], scale=q.shape[-1] ** -0.5)
    return out, aux


@pytest.mark.integration
def test_blockwise_with_row_indices_skips_and_masks_by_index():
    """blockwise on a zigzag-permuted row with small tiles (so tiles are skipped by index, not by position)
    equals xla attention on the natural row, permuted."""
    rng = np.random.default_rng(2)
    B, L, H, K, Hd = 2, 64, 4, 2, 8
    batch = packed_rows(rng, B, L, chunk=8)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, n, Hd)), jnp.float32) for n in (H, K, K))
    order = cp.zigzag_order(L, 4)
    seg = jnp.asarray(batch["segment_ids"])
    from jaxpt.model.attention_blockwise import blockwise_attention
    out, aux = blockwise_attention(q[:, order], k[:, order], v[:, order], seg[:, order], seg[:, order],
                                   scale=Hd ** -0.5, block_q=8, block_k=8, q_index_L=jnp.asarray(order),
                                   kv_index_M=jnp.asarray(order))
    ref, ref_aux = _reference(batch, q, k, v)
    np.testing.assert_allclose(out, np.asarray(ref)[:, order], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(aux["max_attention_logit"], ref_aux["max_attention_logit"], rtol=1e-6)


@pytest.mark.parametrize("impl,mesh_spec,B,L", [
    ("xla", "sequence=4,data=2", 2, 64),
    ("blockwise", "sequence=2,fsdp=2,tensor=2", 2, 64),
    # splash (Pallas interpret mode on CPU): its query blocks with segment ids are multiples of 128 tokens, so
    # the chunks are too: L = 2 x 2 x 128.
    pytest.param("splash", "sequence=2,tensor=2,data=2", 2, 512, marks=pytest.mark.slow),
])
@pytest.mark.integration
def test_attention_under_context_parallelism_equals_unsharded(impl, mesh_spec, B, L):
    """Forward output, max logit and gradients of q, k, v of each implementation on rows split over `sequence`
    equal unsharded xla attention on the natural row (GQA: 4 query heads over 2 kv heads)."""
    rng = np.random.default_rng(1)
    H, K, Hd = 4, 2, 8
    batch = packed_rows(rng, B, L, chunk=L // 8)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, n, Hd)), jnp.float32) for n in (H, K, K))
    w = jnp.asarray(rng.normal(size=(B, L, H, Hd)), jnp.float32)   # a random cotangent
    mesh = M.make_mesh(mesh_spec)
    shards = cp.num_shards(mesh, M.DEFAULT_RULES)

    def sharded_loss(q, k, v, seg):
        zz = lambda x: cp.to_zigzag(x, shards)  # noqa: E731
        with M.activation_sharding(mesh, M.DEFAULT_RULES):
            out, aux = dot_product_attention(zz(q), zz(k), zz(v), zz(seg), impl=impl)
        out = cp.from_zigzag(out, shards)
        return jnp.sum(out * w), (out, aux)

    def reference_loss(q, k, v, seg):
        out, aux = _reference({"segment_ids": seg}, q, k, v)
        return jnp.sum(out * w), (out, aux)

    seg = jnp.asarray(batch["segment_ids"])
    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v, seg)  # noqa: E731
    (gq, gk, gv), (out, aux) = grad(sharded_loss)
    (rq, rk, rv), (ref, ref_aux) = grad(reference_loss)
    assert shards == 4 if mesh_spec.startswith("sequence=4") else shards == 2
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    for g, r in ((gq, rq), (gk, rk), (gv, rv)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5)
    if impl != "splash":
        np.testing.assert_allclose(aux["max_attention_logit"], ref_aux["max_attention_logit"], rtol=1e-6)
    else:
        assert aux == {}


def _quickstart(mesh: str):
    # The quickstart's model and settings; only the vocabulary is fixed (no tokenizer file) and the mesh changed.
    return C.parse([QUICKSTART], ["ModelConfig.vocab_size = 512"], mesh=mesh)


@pytest.mark.slow
def test_quickstart_losses_with_sequence_axis_equal_data_parallel():
    """The quickstart on sequence=2,data=4 and sequence=4,fsdp=2 gives the data=8 losses (rel 1e-4) over 8
    steps on packed rows whose documents cross the chunk boundaries of both layouts."""
    cfg = _quickstart("data=8")
    B, L = cfg.global_batch_size, cfg.seq_len
    rng = np.random.default_rng(0)
    batches = [packed_rows(rng, B, L, chunk=L // 8) for _ in range(8)]
    losses = {}
    for mesh in ("data=8", "sequence=2,data=4", "sequence=4,fsdp=2"):
        built = builder.build_for(_quickstart(mesh))
        assert built.sizes["sequence"] == int(mesh.split(",")[0].split("=")[1]) if "sequence" in mesh else 1
        state, out = built.init_state(), []
        shardings = built.batch_shardings()
        for b in batches:
            state, metrics = built.train_step(state, {k: jax.device_put(b[k], shardings[k]) for k in shardings})
            out.append(metrics["loss"])
        losses[mesh] = np.asarray(jax.device_get(out))
    ref = losses["data=8"]
    for mesh in ("sequence=2,data=4", "sequence=4,fsdp=2"):
        np.testing.assert_allclose(losses[mesh], ref, rtol=1e-4, err_msg=mesh)
    # The losses move (updates change them step to step), so the equality is not of constants.
    assert np.ptp(ref[1:]) > 1e-3, ref


def test_seq_len_must_split_into_two_chunks_per_device():
    with pytest.raises(ConfigError, match=r"TrainConfig\.seq_len = 36 is not divisible by 2 x 4"):
        validate(C.parse([QUICKSTART], ["TrainConfig.seq_len = 36"], mesh="sequence=4,fsdp=2"), 8)
    assert validate(C.parse([QUICKSTART], ["TrainConfig.seq_len = 40"], mesh="sequence=4,fsdp=2"), 8)["sequence"] == 4
    # splash's query chunks must be whole 128-multiple blocks: 512 / (2 x 4) = 64 tokens are not.
    splash = ["ModelConfig.attention_impl = 'splash'", "ModelConfig.max_seq_len = 1024"]
    with pytest.raises(ConfigError, match=r"TrainConfig\.seq_len = 512 with ModelConfig\.attention_impl = 'splash'"):
        validate(C.parse([QUICKSTART], splash + ["TrainConfig.seq_len = 512"], mesh="sequence=4,fsdp=2"), 8)
    assert validate(C.parse([QUICKSTART], splash + ["TrainConfig.seq_len = 1024"], mesh="sequence=4,fsdp=2"), 8)
    # Not checked without context parallelism.
    assert validate(C.parse([QUICKSTART], ["TrainConfig.seq_len = 36"], mesh="data=8"), 8)["sequence"] == 1


@pytest.mark.integration
def test_sequence_of_one_leaves_the_program_unchanged():
    """With sequence=1 the length -> sequence rule changes nothing: the train step's HLO equals the one built
    with `length` unmapped (the rules before context parallelism)."""
    cfg = _quickstart("data=2,fsdp=2,tensor=2")
    old_rules = tuple(r if r[0] != "length" else ("length", None) for r in M.DEFAULT_RULES)
    assert old_rules != M.DEFAULT_RULES
    new = builder.build_for(cfg).hlo_fingerprint()
    old = builder.build_for(dataclasses.replace(cfg, logical_axis_rules=old_rules)).hlo_fingerprint()
    assert new == old
