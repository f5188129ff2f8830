"""The decoder-only transformer: embeddings, a stack of blocks (looped or ``nnx.scan``-ned), final norm,
output projection (tied or untied).

Each block returns its auxiliary outputs (those of its attention implementation and its MLP); the decoder
reduces them over layers as each one's :class:`jaxpt.model.auxiliary.AuxSpec` declares (:func:`aux_specs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpt.mesh import PIPELINE_AXIS, constrain, current_activation_sharding
from jaxpt.model import context_parallel, parametrization, tables
from jaxpt.model.attention import Attention
from jaxpt.model.auxiliary import AuxSpec, BatchTotals, merge_specs, reduce_aux
from jaxpt.model.config import ModelConfig
from jaxpt.model.layers import RMSNorm, _param
from jaxpt.model.moe import moe_param_counts
from jaxpt.model.pipeline import run_pipeline

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


def aux_specs(cfg: ModelConfig) -> dict[str, AuxSpec]:
    """Every auxiliary output a :class:`Decoder` of ``cfg`` returns, with its reduction.

    The union of what ``cfg.attention_impl`` and ``cfg.mlp`` declare.

    Raises:
      ConfigError: no implementation has the name (:mod:`jaxpt.model.tables`).
      ValueError: both declare the same name.
    """
    attn, mlp = tables.attention(cfg.attention_impl), tables.mlp(cfg.mlp)
    return merge_specs((f"attention_impl {attn.name!r}", attn.aux_specs(cfg)),
                       (f"mlp {mlp.name!r}", mlp.aux_specs(cfg)))


def routed(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s MLP routes tokens among each other (it declares ``routings``, :mod:`jaxpt.model.mlp`: the
    mixture of experts), so that its outputs depend on the routing a call asks for; every held-out figure of
    such a model then says which routing produced it.

    Raises:
      ConfigError: no MLP is named ``cfg.mlp``.
    """
    return bool(getattr(tables.mlp(cfg.mlp).fn, "routings", ()))


def eval_routing(cfg: ModelConfig) -> str:
    """The routing evaluation and decoding call ``cfg``'s model with: ``causal`` (each token routed by itself, so
    a prefix's outputs never depend on later tokens and a KV cache reproduces the forward pass) where its MLP
    offers it or routes nothing; else ``train`` (such a model is decoded without a KV cache,
    :func:`jaxpt.infer.kv_cache.step_class`).

    Raises:
      ConfigError: no MLP is named ``cfg.mlp``.
    """
    routings = getattr(tables.mlp(cfg.mlp).fn, "routings", ())
    return "causal" if not routings or "causal" in routings else "train"


def _mlp_options(mlp, routing: str, totals: BatchTotals | None) -> dict:
    """The keyword arguments a block gives its MLP: ``routing`` where it declares ``routings``, ``totals`` where
    it declares ``batch_totals`` and some are given (:mod:`jaxpt.model.mlp`).

    Raises:
      ValueError: the MLP declares ``routings`` without ``routing``.
    """
    options = {}
    routings = getattr(mlp, "routings", ())
    if routings:
        if routing not in routings:
            raise ValueError(f"routing {routing!r}: the MLP {type(mlp).__name__} routes as one of {tuple(routings)}")
        options["routing"] = routing
    if totals is not None and getattr(mlp, "batch_totals", ()):
        options["totals"] = totals
    return options


def build_mlp(cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int | None = None) -> nnx.Module:
    """The MLP ``cfg.mlp`` names (:data:`jaxpt.model.tables.MLPS`), initialized from ``rngs``; for a mixture of
    experts placed every ``moe_every``-th layer, the dense ``swiglu`` at decoder layer ``layer`` when it is not an
    MoE layer (:meth:`ModelConfig.is_moe_layer`; ``layer=None``, as in a scanned stack, means an MoE layer).

    Returns: the module, mapping ``x [B, L, D]`` to ``(y [B, L, D], aux)`` in the compute dtype.
    Raises:
      ConfigError: no MLP is named ``cfg.mlp``.
    """
    if cfg.mlp == "moe" and layer is not None and not cfg.is_moe_layer(layer):
        return tables.mlp("swiglu").fn(cfg, rngs=rngs)
    return tables.mlp(cfg.mlp).fn(cfg, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the MLP is ``cfg.mlp``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int | None = None):
        pd = cfg.jnp_param_dtype
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.mlp = build_mlp(cfg, rngs=rngs, layer=layer)  # layer: MoE placement (ModelConfig.moe_every)

    def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL, *, routing: str = "train",
                 totals: BatchTotals | None = None):
        """Returns ``(x [B, L, D], aux)``: aux the union of the attention's and the MLP's for this block.

        ``routing`` and ``totals`` (this layer's) reach an MLP that declares ``routings`` / ``batch_totals``
        (:mod:`jaxpt.model.mlp`); an MLP that declares no routings treats each token by itself in every routing.
        Raises ValueError for a routing the MLP does not run."""
        attn_out, attn_aux = self.attn(self.attn_norm(x_BxLxD), segment_ids_BxL, positions_BxL)
        x_BxLxD = constrain(x_BxLxD + attn_out, ("batch", "length", "embed"))
        x_BxLxD, mlp_aux = self.mlp_half(x_BxLxD, segment_ids_BxL, routing=routing, totals=totals)
        return constrain(x_BxLxD, ("batch", "length", "embed")), {**attn_aux, **mlp_aux}

    def mlp_half(self, x_BxLxD, segment_ids_BxL, *, routing: str = "train", totals: BatchTotals | None = None):
        """The block's second half, ``x + mlp(mlp_norm(x))``: ``(x [B, L, D], the MLP's aux)``, the MLP given the
        segment ids (int32 [B, L], 0 = padding), ``routing`` and ``totals`` as it declares
        (:mod:`jaxpt.model.mlp`). Decoding with a KV cache calls it too (:mod:`jaxpt.infer.kv_cache`)."""
        h_BxLxD = self.mlp_norm(x_BxLxD)
        # An MLP that must tell padding from tokens (a mixture of experts: padding takes no capacity) says so.
        seg = (segment_ids_BxL,) if getattr(self.mlp, "takes_segment_ids", False) else ()
        mlp_out, mlp_aux = self.mlp(h_BxLxD, *seg, **_mlp_options(self.mlp, routing, totals))
        return x_BxLxD + mlp_out, mlp_aux


class Decoder(nnx.Module):
    """Decoder-only language model.

    Params: ``embedding`` [V, D] (logical ``vocab, embed``); blocks (stacked with a leading ``layers`` axis
    when ``cfg.scan_layers``); ``final_norm`` [D]; ``output`` [D, V] unless ``cfg.tie_embeddings``.

    Call with ``tokens``, ``segment_ids``, ``positions`` (all [B, L] int32) to get logits [B, L, V] float32.

    Raises (at build): ValueError: ``vocab_size`` unresolved; ConfigError: an unknown ``attention_impl`` or
    ``mlp``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be resolved (from the tokenizer) before building")
        aux_specs(cfg)  # unknown implementations fail here, naming the config field, not at the first call
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
            self.blocks = nnx.List([Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        if not cfg.tie_embeddings:
            # A small std keeps the initial logits near 0, so the initial loss is about ln(V).
            self.output = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)

    def aux_specs(self) -> dict[str, AuxSpec]:
        """The auxiliary outputs ``__call__(..., return_aux=True)`` returns: :func:`aux_specs` of the config."""
        return aux_specs(self.cfg)

    def _pipeline_mesh(self, batch: int):
        """The mesh to pipeline over, or None: a ``stage`` axis > 1 in the enclosing activation sharding, and a
        batch the micro-batches divide (a batch they do not, e.g. one-row decoding, runs the layers unpipelined;
        training batches are checked by :func:`jaxpt.config.validate`)."""
        ctx = current_activation_sharding()
        if ctx is None or ctx[0].shape.get(PIPELINE_AXIS, 1) == 1:
            return None
        stages = ctx[0].shape[PIPELINE_AXIS]
        m = self.cfg.pipeline_microbatches or stages
        return ctx[0] if batch % m == 0 and self.cfg.num_layers % (stages * self.cfg.pipeline_repeats) == 0 else None

    def _run_pipelined(self, mesh, x_BxLxD, segment_ids_BxL, positions_BxL):
        """All blocks as a pipeline over ``mesh``'s stages (:func:`jaxpt.model.pipeline.run_pipeline`).

        The per-layer weights go in stacked ``[num_layers, ...]``: as stored with ``scan_layers``, else
        stacked here from the list of blocks (correct, but then every stage holds every layer's weights)."""
        cfg = self.cfg
        if cfg.scan_layers:
            stacked = nnx.to_pure_dict(nnx.split(self.blocks)[1])
        else:
            per_block = [nnx.to_pure_dict(nnx.split(b)[1]) for b in self.blocks]
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_block)
        block_def, block_state = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))

        def run_block(p, x, seg, pos):
            state = jax.tree.map(lambda v: v, block_state)
            nnx.replace_by_pure_dict(state, p)
            return nnx.merge(block_def, state)(x, seg, pos)

        if cfg.remat_policy != "none":
            run_block = jax.checkpoint(run_block, policy=_remat_policy(cfg.remat_policy), prevent_cse=False)

        def group(p_K, x, seg, pos):
            def body(x, p):
                return run_block(p, x, seg, pos)
            return jax.lax.scan(body, x, p_K)

        stages = mesh.shape[PIPELINE_AXIS]
        return run_pipeline(group, stacked, x_BxLxD, (segment_ids_BxL, positions_BxL), mesh=mesh,
                            microbatches=cfg.pipeline_microbatches or stages, repeats=cfg.pipeline_repeats,
                            aux_specs=self.aux_specs())

    def _run_blocks(self, x_BxLxD, segment_ids_BxL, positions_BxL, routing: str = "train",
                    totals: BatchTotals | None = None):
        """All blocks in order. Returns ``(x [B, L, D], aux reduced over layers)``; ``routing`` and ``totals`` as
        :meth:`__call__` takes them (each block gets its layer's row of ``totals``).

        Under a mesh with ``stage > 1`` (see :meth:`_pipeline_mesh`) the blocks run as a pipeline (in their
        training routing, with no totals: a routed MLP does not run there, :func:`jaxpt.run.validate.validate`)."""
        cfg = self.cfg
        mesh = self._pipeline_mesh(x_BxLxD.shape[0])
        if mesh is not None:
            return self._run_pipelined(mesh, x_BxLxD, segment_ids_BxL, positions_BxL)

        def run_block(block: Block, x, layer_totals):
            return block(x, segment_ids_BxL, positions_BxL, routing=routing, totals=layer_totals)

        if cfg.remat_policy != "none":
            run_block = nnx.remat(run_block, policy=_remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers and totals is None:
            def run_scanned(block, x):
                return run_block(block, x, None)
            # Per-layer aux values come out stacked on a leading [num_layers] axis.
            x_BxLxD, per_layer = nnx.scan(run_scanned, in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0),
                                          transform_metadata=_LAYERS_AXIS)(self.blocks, x_BxLxD)
        elif cfg.scan_layers:  # every layer has the same MLP: each gets its row of the stacked totals
            def run_scanned_with(block, x, rows):
                return run_block(block, x, BatchTotals(totals.tokens, rows))
            x_BxLxD, per_layer = nnx.scan(run_scanned_with, in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                                          transform_metadata=_LAYERS_AXIS)(self.blocks, x_BxLxD,
                                                                           dict(totals.per_layer))
        else:
            per_layer, j = {}, 0   # j counts the layers whose MLP takes totals (the rows of totals.per_layer)
            for block in self.blocks:
                layer_totals = None
                if totals is not None and getattr(block.mlp, "batch_totals", ()):
                    layer_totals, j = totals.layer(j), j + 1
                x_BxLxD, aux = run_block(block, x_BxLxD, layer_totals)
                for name, value in aux.items():
                    per_layer.setdefault(name, []).append(value)
        return x_BxLxD, reduce_aux(self.aux_specs(), per_layer, over="layers")

    def batch_totals(self) -> tuple[str, ...]:
        """The auxiliary outputs whose whole-batch values the model's MLPs take under gradient accumulation
        (their ``batch_totals``, :mod:`jaxpt.model.mlp`): ``("moe/expert_share",)`` for a mixture of experts,
        ``()`` when no layer needs any (then no call needs :class:`BatchTotals`)."""
        blocks = [self.blocks] if self.cfg.scan_layers else list(self.blocks)
        return tuple(dict.fromkeys(n for b in blocks for n in getattr(b.mlp, "batch_totals", ())))

    def hidden(self, tokens_BxL: jax.Array, segment_ids_BxL: jax.Array, positions_BxL: jax.Array, *,
               routing: str = "train", totals: BatchTotals | None = None):
        """The final hidden states, before the output projection: ``(x [B, L, D] in the compute dtype,
        after the final norm; aux as in :meth:`__call__`)``. With :meth:`output_weights` this lets a loss
        compute the logits a chunk at a time (:func:`jaxpt.training.step.chunked_token_losses`). ``routing``,
        ``totals``: as :meth:`__call__` takes them.

        With context parallelism (the ``length`` axis sharded, :mod:`jaxpt.model.context_parallel`) the blocks
        run on the row in load-balanced (zigzag) order; the hidden states come back in the natural order."""
        cd = self.cfg.jnp_compute_dtype
        shards = context_parallel.current_shards()
        if shards > 1:
            tokens_BxL, segment_ids_BxL, positions_BxL = (
                constrain(context_parallel.to_zigzag(a, shards), ("batch", "length"))
                for a in (tokens_BxL, segment_ids_BxL, positions_BxL))
        # The lookup gathers from the whole table (as ZeRO-3/FSDP gathers weights before use): a gather from
        # a table split over vocab and embed into batch-sharded activations has no efficient SPMD lowering.
        table_VxD = constrain(self.embedding[...], (None, None))
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0).astype(cd)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "embed"))
        x_BxLxD, aux = self._run_blocks(x_BxLxD, segment_ids_BxL, positions_BxL, routing, totals)
        x_BxLxD = self.final_norm(x_BxLxD)
        if shards > 1:
            x_BxLxD = constrain(context_parallel.from_zigzag(x_BxLxD, shards), ("batch", "length", "embed"))
        return x_BxLxD, aux

    def output_weights(self) -> jax.Array:
        """The output projection ``[D, V]`` in the compute dtype (the embedding transposed when tied), times µP's
        output multiplier ``1 / m`` (:func:`jaxpt.model.parametrization.output_multiplier`; none under SP)."""
        w_DxV = self.embedding[...].T if self.cfg.tie_embeddings else self.output[...]
        mult = parametrization.output_multiplier(self.cfg)
        if mult != 1.0:
            w_DxV = w_DxV * jnp.asarray(mult, w_DxV.dtype)
        return w_DxV.astype(self.cfg.jnp_compute_dtype)

    def __call__(self, tokens_BxL: jax.Array, segment_ids_BxL: jax.Array, positions_BxL: jax.Array,
                 *, return_aux: bool = False, routing: str = "train", totals: BatchTotals | None = None):
        """Logits [B, L, V] float32; with ``return_aux``, ``(logits, aux)``: each output of
        :meth:`aux_specs` reduced over layers (``{"max_attention_logit": float32 scalar}`` by default).

        Args:
          routing: how an MLP that routes tokens among each other (a mixture of experts) routes them: ``train``
            (as configured: the training routing) or ``causal`` (each token by itself: what evaluation and
            decoding use, :func:`eval_routing`); other MLPs ignore it.
          totals: the whole batch's statistics when this call sees one micro-batch of it (gradient
            accumulation, :func:`jaxpt.training.step.batch_totals`); ``per_layer`` stacked over the layers whose
            MLP takes them. None: the call is the whole batch.
        Raises:
          ValueError: a routing an MLP does not run.
        """
        x_BxLxD, aux = self.hidden(tokens_BxL, segment_ids_BxL, positions_BxL, routing=routing, totals=totals)
        logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, self.output_weights(),
                                  preferred_element_type=jnp.float32)
        logits_BxLxV = constrain(logits_BxLxV, ("batch", "length", "vocab"))
        if return_aux:
            return logits_BxLxV, aux
        return logits_BxLxV


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by kind, from shapes alone (no arrays allocated).

    Returns ``{"total", "embedding", "output", "blocks", "matmul", "experts"}`` where ``matmul`` counts params
    that take part in a matmul *per token*: every block projection plus the output projection (tied or not);
    the embedding lookup is excluded (Kaplan et al. 2020; MaxText/Megatron MFU convention). A mixture-of-experts
    layer counts all its experts in ``total``/``blocks``/``experts`` but only the router and the ``top_k``
    experts a token goes through (plus a shared expert) in ``matmul``: the active params
    (:func:`jaxpt.model.moe.moe_param_counts`). ``experts``: params of all MoE layers (0 when dense). Norm scales
    (the q/k norms of ``qk_norm`` too) and the q/k/v biases of ``attention_bias`` count in ``total``/``blocks``,
    not in ``matmul``.
    """
    D, H, K, Hd, F, V, N = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                            cfg.vocab_size, cfg.num_layers)
    attn = D * H * Hd * 2 + D * K * Hd * 2
    attn_bias = (H + 2 * K) * Hd if cfg.attention_bias else 0   # q/k/v biases: no matmul
    qk_norms = 2 * Hd if cfg.qk_norm else 0
    n_moe = cfg.num_moe_layers
    moe = moe_param_counts(cfg) if n_moe else {"total": 0, "active": 0}
    dense_mlp = 3 * D * F
    mlp_total = (N - n_moe) * dense_mlp + n_moe * moe["total"]
    mlp_active = (N - n_moe) * dense_mlp + n_moe * moe["active"]
    norms = 2 * D + qk_norms
    blocks = N * (attn + attn_bias + norms) + mlp_total
    embedding = V * D
    output = 0 if cfg.tie_embeddings else D * V
    return {
        "total": embedding + output + blocks + D,
        "embedding": embedding,
        "output": output,
        "blocks": blocks,
        "matmul": N * attn + mlp_active + D * V,
        "experts": n_moe * moe["total"],
    }
