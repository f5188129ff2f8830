"""The decoder-only transformer: embeddings, a stack of blocks (looped or ``nnx.scan``-ned), final norm,
output projection (tied or untied)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpt.mesh import constrain
from jaxpt.model.config import ModelConfig
from jaxpt.model.layers import Block, RMSNorm, _param

#: transform metadata so that ``nnx.vmap``/``nnx.scan`` add/remove the stacked ``layers`` logical axis.
_LAYERS_AXIS = {nnx.PARTITION_NAME: "layers", "logical_axes": "layers"}


def _remat_policy(name: str):
    cp = jax.checkpoint_policies
    return {
        "full": cp.nothing_saveable,
        "dots": cp.checkpoint_dots,
        "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
        "save_qkv_proj": cp.save_only_these_names("qkv_proj"),
    }[name]


class Decoder(nnx.Module):
    """Decoder-only language model.

    Params: ``embedding`` [V, D] (logical ``vocab, embed``); blocks (stacked with a leading ``layers`` axis
    when ``cfg.scan_layers``); ``final_norm`` [D]; ``output`` [D, V] unless ``cfg.tie_embeddings``.

    Call with ``tokens``, ``segment_ids``, ``positions`` (all [B, L] int32) to get logits [B, L, V] float32.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be resolved (from the tokenizer) before building")
        self.cfg = cfg
        pd = cfg.jnp_param_dtype
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, pd)
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYERS_AXIS)
            def make_blocks(rngs: nnx.Rngs):
                return Block(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        if not cfg.tie_embeddings:
            # A small std keeps the initial logits near 0, so the initial loss is about ln(V).
            self.output = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)

    def __call__(self, tokens_BxL: jax.Array, segment_ids_BxL: jax.Array, positions_BxL: jax.Array,
                 *, return_aux: bool = False):
        """Logits [B, L, V] float32; with ``return_aux``, ``(logits, {"max_attention_logit": scalar})``."""
        cfg = self.cfg
        cd = cfg.jnp_compute_dtype
        # The lookup gathers from the whole table (as ZeRO-3/FSDP gathers weights before use): a gather from
        # a table split over vocab and embed into batch-sharded activations has no efficient SPMD lowering.
        table_VxD = constrain(self.embedding[...], (None, None))
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0).astype(cd)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "embed"))

        def run_block(block: Block, carry):
            x, running_max = carry
            x, block_max = block(x, segment_ids_BxL, positions_BxL)
            return x, jnp.maximum(running_max, block_max)

        if cfg.remat_policy != "none":
            run_block = nnx.remat(run_block, policy=_remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)

        carry = (x_BxLxD, jnp.asarray(-jnp.inf, jnp.float32))
        if cfg.scan_layers:
            carry = nnx.scan(run_block, in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                             transform_metadata=_LAYERS_AXIS)(self.blocks, carry)
        else:
            for block in self.blocks:
                carry = run_block(block, carry)
        x_BxLxD, max_attention_logit = carry

        x_BxLxD = self.final_norm(x_BxLxD)
        if cfg.tie_embeddings:
            w_DxV = self.embedding[...].T
        else:
            w_DxV = self.output[...]
        logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV.astype(cd),
                                  preferred_element_type=jnp.float32)
        logits_BxLxV = constrain(logits_BxLxV, ("batch", "length", "vocab"))
        if return_aux:
            return logits_BxLxV, {"max_attention_logit": max_attention_logit}
        return logits_BxLxV


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by kind, from shapes alone (no arrays allocated).

    Returns ``{"total", "embedding", "output", "blocks", "matmul"}`` where ``matmul`` counts params that
    take part in a matmul per token: every block projection plus the output projection (tied or not);
    the embedding lookup is excluded (Kaplan et al. 2020; MaxText/Megatron MFU convention).
    """
    D, H, K, Hd, F, V, N = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                            cfg.vocab_size, cfg.num_layers)
    attn = D * H * Hd * 2 + D * K * Hd * 2
    mlp = 3 * D * F
    norms = 2 * D
    blocks = N * (attn + mlp + norms)
    embedding = V * D
    output = 0 if cfg.tie_embeddings else D * V
    return {
        "total": embedding + output + blocks + D,
        "embedding": embedding,
        "output": output,
        "blocks": blocks,
        "matmul": N * (attn + mlp) + D * V,
    }
