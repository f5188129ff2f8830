"""``auto`` attention: the implementation that suits the platform the step is built for.

* TPU: ``splash`` (the fused Pallas kernel) when the row is a whole number of its blocks, else ``blockwise``.
* GPU and CPU: ``blockwise`` for rows of :data:`LONG_ROW` tokens or more (memory O(L x block)), ``xla``
  below (fastest at short rows). A cuDNN path (``jax.nn.dot_product_attention(implementation="cudnn")``) is
  not wired in: its mask support for packed segments varies by cuDNN version, so GPUs use these fallbacks.

The platform is that of the mesh the step is traced for (:func:`jaxpt.mesh.activation_sharding`), so a
compile-only TPU topology on a CPU host chooses ``splash``. Which implementation runs depends on the target,
so ``auto`` declares no auxiliary output: ``max_attention_logit`` is absent under it, never faked.
"""

from __future__ import annotations

from jaxpt.model import attention_blockwise, attention_splash
from jaxpt.model.attention import _xla_saved_tensors, register_attention, xla_attention

#: Rows at least this long (tokens) use ``blockwise`` off TPU: at 2048 the [B, H, L, L] fp32 scores of
#: ``xla`` are 16 MiB per head per row.
LONG_ROW = 2048


def choose(platform: str, seq_len: int) -> str:
    """The implementation name ``auto`` uses on ``platform`` (``tpu``/``gpu``/``cuda``/``rocm``/``cpu``) for rows of
    ``seq_len`` tokens."""
    if platform == "tpu":
        block = min(attention_splash.BLOCK, seq_len)
        return "splash" if seq_len % block == 0 and block % 128 == 0 else "blockwise"
    return "blockwise" if seq_len >= LONG_ROW else "xla"


def auto_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
    """Dispatch to :func:`choose`'s implementation. Returns ``(out [B, L, H, Hd], {})``."""
    import jax
    platform, _, _ = attention_splash._platform()
    name = choose(platform, q_BxLxHxHd.shape[1])
    inner = jax.sharding.get_abstract_mesh()
    if name == "splash" and not inner.empty and inner.manual_axes:
        name = "blockwise"  # inside the pipeline's shard_map splash's own shard_map cannot nest (yet)
    fn = {"splash": attention_splash.splash_attention, "blockwise": attention_blockwise.blockwise_attention,
          "xla": xla_attention}[name]
    out, _ = fn(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, scale=scale)
    return out, {}


def _auto_saved_tensors(cfg, batch: int, seq_len: int):
    """The planner counts the off-TPU choice: ``xla``'s [L, L] tensors below :data:`LONG_ROW`, else ``blockwise``'s."""
    if seq_len >= LONG_ROW:
        return attention_blockwise._blockwise_saved_tensors(cfg, batch, seq_len)
    return _xla_saved_tensors(cfg, batch, seq_len)


register_attention("auto", saved_tensors=_auto_saved_tensors)(auto_attention)
