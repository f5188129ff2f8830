"""Mixture-of-experts MLP (``ModelConfig.mlp = 'moe'``): a softmax top-k router over SwiGLU experts.

Routing (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al. 2021):

* The router runs in float32 whatever the compute dtype: ``logits = x @ w_router + router_bias``,
  ``p = softmax(logits)``, each token's top-k experts chosen by ``p``. Gates: ``p`` of the chosen expert for
  k = 1 (Switch: the router gets the main loss's gradient through it), the top-k ``p`` renormalized to sum to 1
  for k >= 2 (GShard, Mixtral).
* Sinkhorn-balanced choice (``moe_router_sinkhorn_iters > 0``; Clark et al. 2022, S-BASE): the top k of
  ``logits + b`` with per-expert offsets ``b`` that balance each routing group's soft assignment
  (:func:`sinkhorn_offsets`), so a part of the logits shared by all tokens (the tokens' hidden states are
  nearly alike early in training) cannot send them all to the same experts; gates as above.
* Capacity mode (default): tokens are routed within groups, one group per row of the batch (``G = B``
  groups of ``S = L`` tokens), or ``moe_group_size`` consecutive tokens of a row (``G = B L / S``). Expert capacity is ``C = min(S, ceil(k * S * capacity_factor / E))``. Slots
  are filled choice by choice (every token's first choice, then every token's second choice, ...), tokens in
  row order, as GShard does; an assignment past capacity is dropped: that expert contributes nothing to the
  token, which passes through the block's residual (and its other experts). The token exchange is
  expressed as GShard's dispatch/combine einsums over ``[E, G, C, D]`` arrays whose ``exp`` axis is sharded
  over the ``expert`` mesh axis, while the tokens' ``batch`` axis is sharded over ``data x fsdp x expert``:
  XLA's SPMD partitioner turns the resharding into all-to-alls (see the README for the HLO check).
* Dropless mode (``moe_dropless``): the ``G S k`` assignments are sorted by expert and multiplied group by
  group with ``jax.lax.ragged_dot`` (MegaBlocks, Gale et al. 2023, in spirit); nothing is dropped.

Routing modes (``routing``, a keyword of the call; :data:`ROUTINGS`):

* ``train`` (default): as configured above: Sinkhorn offsets from each whole routing group and capacity slots
  given first choices before second choices, so a token's output depends on the other tokens of its group,
  later ones included. Training uses it.
* ``causal``: each token by itself: the plain top-k of its router probabilities (no Sinkhorn offsets) and every
  assignment kept (no capacity, no group), so a token's output depends on that token alone: a prefix's outputs
  never change with later tokens, and decoding one token at a time against a KV cache reproduces the forward
  pass over the whole row. Evaluation and decoding use it (:func:`jaxpt.model.decoder.eval_routing`). Capacity
  mode then runs every expert on every token (:meth:`MoE._every_expert`: ``E / k`` times the expert FLOPs of a
  routed call, without the dispatch einsums); dropless mode keeps its sorted ``ragged_dot``.

Auxiliary outputs (:class:`jaxpt.model.auxiliary.AuxSpec`), each computed per MoE layer over all the tokens of
the call, or, given the whole batch's :class:`jaxpt.model.auxiliary.BatchTotals` (gradient accumulation: one call
per micro-batch), this micro-batch's part of the whole batch's value, so that the parts *sum* over micro-batches
to the value of one call on the whole batch (``T`` then counts the whole batch's real tokens, and ``f_i`` below
is the whole batch's, from a forward pass over every micro-batch: :func:`jaxpt.training.step.batch_totals`):

* ``moe/load_balance_loss``: ``E * sum_i f_i P_i`` (Fedus et al. 2021, eq. 4) with ``f_i`` the fraction of
  the ``T k`` routed assignments that chose expert i (before capacity; k = 1 is eq. 4 exactly) and ``P_i``
  the mean router probability of expert i; 1.0 when perfectly balanced. Mean over layers, weighted by
  ``moe_load_balance_weight``.
* ``moe/router_z_loss``: ``mean_t (logsumexp_j logits_tj)^2`` (Zoph et al. 2022, ST-MoE, eq. 5). Mean over
  layers, weighted by ``moe_router_z_loss_weight``.
* ``moe/dropped_fraction``: dropped assignments / ``T k`` (0 in dropless mode). Mean over layers.
* ``moe/expert_share``: ``f_i`` per MoE layer, ``[num_moe_layers, E]`` (each row sums to 1), reported as
  ``moe/expert_share/layer{j}/expert{i}`` where j counts MoE layers (decoder layer ``(j + 1) moe_every - 1``).
* ``moe/router_share``: the same fraction for the plain top-k of the router's probabilities, ``[num_moe_layers,
  E]``: what the router alone prefers, and how ``causal`` routing (evaluation, decoding) routes them. It equals
  ``moe/expert_share`` without Sinkhorn selection; with it, it shows a router drifting or a forced bias that
  the balanced selection hides.

Padding tokens (segment id 0; the block passes the segment ids) take no capacity and have zero gates (in
dropless mode too), and count in none of the statistics above: ``T`` is the number of real tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpt.mesh import constrain
from jaxpt.model.auxiliary import AuxSpec, BatchTotals
from jaxpt.model.config import DTYPES, ModelConfig
from jaxpt.model.layers import _param
from jaxpt.model.mlp import SwiGLU
from jaxpt.model.seams import SavedTensor

LOAD_BALANCE = "moe/load_balance_loss"
ROUTER_Z = "moe/router_z_loss"
DROPPED = "moe/dropped_fraction"
SHARE = "moe/expert_share"
ROUTER_SHARE = "moe/router_share"

#: Routing modes of :class:`MoE` (module docstring): ``train`` (groups, capacity, Sinkhorn as configured) and
#: ``causal`` (each token by itself).
ROUTINGS: tuple[str, ...] = ("train", "causal")


def moe_aux_specs(cfg: ModelConfig) -> dict[str, AuxSpec]:
    """The auxiliary outputs of :class:`MoE` (module docstring), the two losses weighted from ``cfg``.

    Each is *summed* over micro-batches: given the whole batch's :class:`BatchTotals`, a call returns its
    micro-batch's part of the whole batch's value (module docstring)."""
    return {LOAD_BALANCE: AuxSpec("mean", "sum", loss_weight=cfg.moe_load_balance_weight),
            ROUTER_Z: AuxSpec("mean", "sum", loss_weight=cfg.moe_router_z_loss_weight),
            DROPPED: AuxSpec("mean", "sum"),
            SHARE: AuxSpec("stack", "sum", index_names=("layer", "expert")),
            ROUTER_SHARE: AuxSpec("stack", "sum", index_names=("layer", "expert"))}


def expert_capacity(cfg: ModelConfig, group_size: int) -> int:
    """Slots per expert per group: ``min(S, ceil(k * S * capacity_factor / E))`` (GShard, sec. 2.2).

    ``S`` caps it: a group's S tokens each choose an expert at most once.
    """
    c = math.ceil(cfg.moe_top_k * group_size * cfg.moe_capacity_factor / cfg.moe_num_experts)
    return max(1, min(group_size, c))


class Routing(NamedTuple):
    """The router's decisions for ``G`` groups of ``S`` tokens, ``E`` experts, top ``k``.

    Attributes:
      probs: float32 [G, S, E] softmax of the logits.
      experts: int32 [G, S, k] chosen experts, best first.
      gates: float32 [G, S, k] combine weight of each choice (before dropping).
      load_balance_loss, router_z_loss: float32 scalars (module docstring).
      share: float32 [E] fraction of the ``G S k`` assignments routed to each expert (sums to 1).
      router_share: float32 [E] the same for the plain top-k of ``probs`` (equal to ``share`` without Sinkhorn).
    """

    probs: jax.Array
    experts: jax.Array
    gates: jax.Array
    load_balance_loss: jax.Array
    router_z_loss: jax.Array
    share: jax.Array
    router_share: jax.Array


def sinkhorn_offsets(logits_GxSxE: jax.Array, w_GxS: jax.Array, iters: int) -> jax.Array:
    """Per-group, per-expert offsets ``b [G, E]`` float32 that balance the soft assignment of each group.

    Sinkhorn-Knopp in the log domain (Cuturi 2013; used for routing by Clark et al. 2022, "Unified Scaling Laws
    for Routed Language Models", S-BASE, and Megatron-LM's ``sinkhorn`` router): find ``a [G, S]``, ``b [G, E]``
    with ``P_gse = w_gs exp(l_gse + a_gs + b_ge)`` having row sums 1 (each real token one unit) and column sums
    ``n_g / E`` (each expert an equal part of the group's ``n_g`` real tokens), alternating
    ``a = -logsumexp_e(l + b)``, ``b = log(n_g / E) - log sum_s w exp(l + a)`` ``iters`` times from ``b = 0``.
    ``l + b`` orders each token's experts as the balanced assignment does (``a`` is per token). Only ``b`` is
    returned, under ``stop_gradient``: the offsets choose experts, they carry no gradient.

    Args:
      logits_GxSxE: router logits (float32). w_GxS: float32 1 at real tokens, 0 at padding.
      iters: Sinkhorn iterations (>= 1). A group with no real token gets ``b = 0``.
    """
    l = jax.lax.stop_gradient(logits_GxSxE.astype(jnp.float32))
    E = l.shape[-1]
    n_G = jnp.sum(w_GxS, axis=1)
    has_G1 = (n_G > 0)[:, None]
    log_target_G1 = jnp.log(jnp.maximum(n_G, 1.0) / E)[:, None]
    b = jnp.zeros((l.shape[0], E), jnp.float32)
    for _ in range(iters):
        a_GxS = -jax.nn.logsumexp(l + b[:, None, :], axis=-1)
        col_GxE = jax.nn.logsumexp(l + a_GxS[..., None], axis=1, b=jnp.broadcast_to(w_GxS[..., None], l.shape))
        b = jnp.where(has_G1, log_target_G1 - jnp.where(has_G1, col_GxE, 0.0), 0.0)
    return jax.lax.stop_gradient(b)


def route(logits_GxSxE: jax.Array, k: int, valid_GxS: jax.Array | None = None, sinkhorn_iters: int = 0, *,
          num_tokens: jax.Array | None = None, balance_share: jax.Array | None = None) -> Routing:
    """Softmax top-k routing and its balance statistics from float32 router logits ``[G, S, E]``.

    Load-balancing loss: Fedus et al. 2021 (Switch Transformer), eq. 4, ``E * sum_i f_i P_i``, with ``f_i`` over
    all k choices. Router z-loss: Zoph et al. 2022 (ST-MoE), eq. 5, ``mean_t logsumexp(logits_t)^2``.

    With ``sinkhorn_iters > 0`` and groups of more than one token, each token's k experts are the top k of
    ``logits + b`` with :func:`sinkhorn_offsets` ``b`` of its group (Clark et al. 2022, S-BASE): a per-expert
    offset that cancels what all tokens of the group share, so the choice follows what tells them apart. The
    gates stay the softmax probabilities of the chosen experts (renormalized for k >= 2), so the router gets
    the same gradient as without it. Groups of one token (decoding) route by plain top-k: Sinkhorn would make
    every expert equal there.

    Args:
      logits_GxSxE: router logits (cast to float32).
      k: experts per token.
      valid_GxS: bool, False at padding tokens (segment id 0); None: every token is real. The statistics
        (``f_i``, ``P_i``, the z-loss mean, ``share``, ``router_share``) are over real tokens only, so padding neither pulls the
        balancing loss nor shows in the shares; with no real token at all they are 0.
      sinkhorn_iters: 0: plain top-k of the probabilities; else Sinkhorn-balanced selection (above).
      num_tokens: float32 scalar, the real tokens the statistics are normalized by; None: this call's. Given the
        whole batch's count, each statistic is this call's part of the whole batch's (they sum over the calls).
      balance_share: float32 [E], the ``f_i`` of the balancing loss (the whole batch's ``share``); None: this
        call's ``share``. With both, the loss is this call's part of the whole batch's ``E sum_i f_i P_i``.
    """
    E = logits_GxSxE.shape[-1]
    logits = logits_GxSxE.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    w_GxS = jnp.ones(logits.shape[:2], jnp.float32) if valid_GxS is None else valid_GxS.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w_GxS), 1.0) if num_tokens is None else num_tokens

    def share_of(experts_GxSxK):
        chosen_GxSxE = jnp.sum(jax.nn.one_hot(experts_GxSxK, E, dtype=jnp.float32), axis=-2)
        return jnp.einsum("gse,gs->e", chosen_GxSxE, w_GxS) / (n * k)

    top_p, experts = jax.lax.top_k(probs, k)
    router_share = share_of(experts)
    balanced = bool(sinkhorn_iters) and logits.shape[1] > 1
    if balanced:
        b_GxE = sinkhorn_offsets(logits, w_GxS, sinkhorn_iters)
        _, experts = jax.lax.top_k(jax.lax.stop_gradient(logits) + b_GxE[:, None, :], k)
        top_p = jnp.take_along_axis(probs, experts, axis=-1)
    gates = top_p if k == 1 else top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    share = share_of(experts) if balanced else router_share
    mean_prob = jnp.einsum("gse,gs->e", probs, w_GxS) / n
    f = share if balance_share is None else balance_share
    load_balance = E * jnp.sum(jax.lax.stop_gradient(f) * mean_prob)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * w_GxS) / n
    return Routing(probs, experts.astype(jnp.int32), gates, load_balance, z, share, router_share)


def dispatch_and_combine(experts_GxSxK: jax.Array, gates_GxSxK: jax.Array, num_experts: int,
                         capacity: int, valid_GxS: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard's capacity-limited slot assignment.

    Slots of each expert in a group are given choice by choice (all first choices in token order, then all
    second choices, ...); an assignment whose slot would be ``>= capacity`` is dropped. Padding tokens
    (``valid_GxS`` False) are not assigned at all: they take no slot and are not counted as dropped.

    Args:
      experts_GxSxK: int32 chosen experts. gates_GxSxK: float32 combine weights. num_experts: E.
      capacity: C slots per expert per group.
      valid_GxS: bool, False at padding tokens; None: all tokens are real.
    Returns:
      ``(dispatch bool [G, S, E, C], combine float32 [G, S, E, C], dropped int32 scalar)``: ``dispatch`` is
      1 where token s fills slot c of expert e; ``combine`` the gate there; ``dropped`` the number of
      real tokens' assignments over capacity.
    """
    G, S, K = experts_GxSxK.shape
    onehot_GxSxKxE = jax.nn.one_hot(experts_GxSxK, num_experts, dtype=jnp.int32)
    if valid_GxS is not None:
        onehot_GxSxKxE = onehot_GxSxKxE * valid_GxS[:, :, None, None].astype(jnp.int32)
    onehot_GxKxSxE = jnp.swapaxes(onehot_GxSxKxE, 1, 2)
    flat = onehot_GxKxSxE.reshape(G, K * S, num_experts)
    slot = (jnp.cumsum(flat, axis=1) - 1).reshape(G, K, S, num_experts)
    kept = (onehot_GxKxSxE > 0) & (slot < capacity)
    slot_GxKxS = jnp.sum(jnp.where(kept, slot, 0), axis=-1)
    kept_GxKxS = jnp.any(kept, axis=-1)
    slot_oh_GxKxSxC = jax.nn.one_hot(slot_GxKxS, capacity, dtype=jnp.float32) * kept_GxKxS[..., None]
    expert_oh_GxKxSxE = onehot_GxKxSxE.astype(jnp.float32)
    dispatch = jnp.einsum("gkse,gksc->gsec", expert_oh_GxKxSxE, slot_oh_GxKxSxC) > 0
    gates_GxKxS = jnp.swapaxes(gates_GxSxK, 1, 2)
    combine = jnp.einsum("gkse,gksc,gks->gsec", expert_oh_GxKxSxE, slot_oh_GxKxSxC, gates_GxKxS)
    dropped = jnp.sum(onehot_GxKxSxE) - jnp.sum(kept_GxKxS.astype(jnp.int32))
    return dispatch, combine, dropped


def moe_saved_tensors(cfg: ModelConfig, batch: int, seq_len: int) -> list[SavedTensor]:
    """What :class:`MoE` keeps for the backward pass: router probabilities, combine weights and the experts'
    ``[E, groups, C, ...]`` inputs, hidden states and outputs (plus a shared expert's), by routing group."""
    c = jnp.dtype(DTYPES[cfg.compute_dtype]).itemsize
    E, F, D = cfg.moe_num_experts, cfg.mlp_dim, cfg.d_model
    S = cfg.moe_group_size or seq_len
    C, batch = expert_capacity(cfg, S), batch * seq_len // S   # batch: routing groups from here on
    ebcf = ("exp", "batch", None, "mlp")
    out = [SavedTensor("router_probs", "other", True, (batch, seq_len, E), ("batch", "length", None), 4),
           SavedTensor("combine", "other", True, (batch, S, E, C), ("batch", "length", None, None), 4),
           SavedTensor("expert_in", "other", True, (E, batch, C, D), ("exp", "batch", None, "embed"), c),
           SavedTensor("gate", "dot", True, (E, batch, C, F), ebcf, c),
           SavedTensor("up", "dot", True, (E, batch, C, F), ebcf, c),
           SavedTensor("h", "other", True, (E, batch, C, F), ebcf, c),
           SavedTensor("expert_out", "dot", True, (E, batch, C, D), ("exp", "batch", None, "embed"), c)]
    if cfg.moe_shared_expert_dim:
        blf = ("batch", "length", "mlp")
        shape = (batch, seq_len, cfg.moe_shared_expert_dim)
        out += [SavedTensor("shared_gate", "dot", True, shape, blf, c),
                SavedTensor("shared_up", "dot", True, shape, blf, c),
                SavedTensor("shared_h", "other", True, shape, blf, c)]
    return out


class MoE(nnx.Module):
    """Mixture of SwiGLU experts with a softmax top-k router (module docstring), optional shared expert.

    Params: ``w_router`` [D, E] (``embed, None``) and ``router_bias`` [E] (zeros), used in float32;
    ``w_gate``, ``w_up`` [E, D, F] (``exp, embed, mlp``), ``w_down`` [E, F, D] (``exp, mlp, embed``);
    ``shared`` (a :class:`SwiGLU` of width ``moe_shared_expert_dim``) if nonzero.

    Call: ``x [B, L, D]`` (compute dtype) -> ``(y [B, L, D] compute dtype, aux)``, aux as
    :func:`moe_aux_specs` declares (scalars float32; ``moe/expert_share`` float32 [E] for this layer); the
    ``routing`` mode and the whole batch's ``totals`` as :meth:`__call__` says.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        E, D, F = cfg.moe_num_experts, cfg.d_model, cfg.mlp_dim
        pd = cfg.jnp_param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.w_router = _param(rngs, (D, E), ("embed", None), cfg.moe_router_init_std or cfg.init_std, pd)
        self.router_bias = nnx.Param(jnp.zeros((E,), pd), logical_axes=(None,))
        self.w_gate = _param(rngs, (E, D, F), ("exp", "embed", "mlp"), cfg.init_std, pd)
        self.w_up = _param(rngs, (E, D, F), ("exp", "embed", "mlp"), cfg.init_std, pd)
        self.w_down = _param(rngs, (E, F, D), ("exp", "mlp", "embed"), out_std, pd)
        if cfg.moe_shared_expert_dim:
            import dataclasses
            self.shared = SwiGLU(dataclasses.replace(cfg, mlp="swiglu", mlp_dim=cfg.moe_shared_expert_dim),
                                 rngs=rngs)

    #: The block passes the token's segment ids (0 = padding) to this MLP (see :mod:`jaxpt.model.mlp`).
    takes_segment_ids = True
    #: The routing modes ``__call__`` takes as ``routing=`` (module docstring; :mod:`jaxpt.model.mlp`).
    routings = ROUTINGS
    #: Of its auxiliary outputs, those it needs over the whole batch when called on one micro-batch of it
    #: (``totals=``, :class:`jaxpt.model.auxiliary.BatchTotals`): ``f_i`` of the balancing loss.
    batch_totals = (SHARE,)

    def router_logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """float32 [B, L, E] router logits, computed in float32."""
        return (jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32), self.w_router[...].astype(jnp.float32))
                + self.router_bias[...].astype(jnp.float32))

    def __call__(self, x_BxLxD, segment_ids_BxL=None, *, routing: str = "train", totals: BatchTotals | None = None):
        """``x [B, L, D]``, optional ``segment_ids [B, L]`` int32 (0 marks padding) -> ``(y [B, L, D], aux)``.

        Padding tokens are routed (their router output is computed) but take no expert capacity, get a zero
        output, and count in none of the statistics: shares, losses and the dropped fraction are over real
        tokens.

        Args:
          routing: ``train`` or ``causal`` (:data:`ROUTINGS`, module docstring).
          totals: the whole batch's real-token count and ``moe/expert_share`` row of this layer (``per_layer``
            may lack it: then this call's shares weight the balancing loss); None: this call is the whole batch.
        Raises:
          ValueError: an unknown ``routing``; ``moe_group_size`` not dividing ``L`` (``train`` routing).
        """
        cfg = self.cfg
        B, L, _ = x_BxLxD.shape
        if routing not in ROUTINGS:
            raise ValueError(f"MoE routing {routing!r}: choose one of {ROUTINGS}")
        causal = routing == "causal"
        valid_BxL = None if segment_ids_BxL is None else segment_ids_BxL > 0
        # routing group: Sinkhorn balances within it, capacity counts within it (causal routing has neither)
        S = L if causal else cfg.moe_group_size or L
        if L % S:
            raise ValueError(f"ModelConfig.moe_group_size = {S} does not divide the row length {L}")
        G = B * L // S
        n_total = None if totals is None else totals.tokens
        share = None if totals is None else totals.per_layer.get(SHARE)
        routed = route(self.router_logits(x_BxLxD).reshape(G, S, -1), cfg.moe_top_k,
                       None if valid_BxL is None else valid_BxL.reshape(G, S),
                       0 if causal else cfg.moe_router_sinkhorn_iters, num_tokens=n_total, balance_share=share)
        routed = routed._replace(**{f: getattr(routed, f).reshape(B, L, -1) for f in ("probs", "experts", "gates")})
        if valid_BxL is not None:
            routed = routed._replace(gates=routed.gates * valid_BxL[..., None].astype(routed.gates.dtype))
        if cfg.moe_dropless or causal:
            y_BxLxD = (self._dropless if cfg.moe_dropless else self._every_expert)(x_BxLxD, routed)
            dropped = jnp.zeros((), jnp.int32)
        else:
            y_BxLxD, dropped = self._capacity(x_BxLxD, routed, valid_BxL)
        if cfg.moe_shared_expert_dim:
            y_BxLxD = y_BxLxD + self.shared(x_BxLxD)[0]
        if n_total is None:
            n_total = B * L if valid_BxL is None else jnp.maximum(jnp.sum(valid_BxL.astype(jnp.float32)), 1.0)
        aux = {LOAD_BALANCE: routed.load_balance_loss, ROUTER_Z: routed.router_z_loss,
               DROPPED: dropped.astype(jnp.float32) / (n_total * cfg.moe_top_k), SHARE: routed.share,
               ROUTER_SHARE: routed.router_share}
        return constrain(y_BxLxD, ("batch", "length", "embed")), aux

    def _expert_weights(self):
        cd = self.cfg.jnp_compute_dtype
        return self.w_gate[...].astype(cd), self.w_up[...].astype(cd), self.w_down[...].astype(cd)

    def _capacity(self, x_BxLxD, routing: Routing, valid_BxL=None):
        """Dispatch/combine einsums over ``[E, G, C, D]`` (GShard); XLA inserts the all-to-alls."""
        cfg = self.cfg
        cd = cfg.jnp_compute_dtype
        B, L, D = x_BxLxD.shape
        S = cfg.moe_group_size or L
        if L % S:
            raise ValueError(f"ModelConfig.moe_group_size = {S} does not divide the row length {L}")
        G = B * L // S
        x_GxSxD = constrain(x_BxLxD.reshape(G, S, D), ("batch", None, "embed"))
        experts_GxSxK = routing.experts.reshape(G, S, -1)
        gates_GxSxK = routing.gates.reshape(G, S, -1)
        C = expert_capacity(cfg, S)
        valid_GxS = None if valid_BxL is None else valid_BxL.reshape(G, S)
        dispatch, combine, dropped = dispatch_and_combine(experts_GxSxK, gates_GxSxK, cfg.moe_num_experts, C,
                                                          valid_GxS)
        w_gate, w_up, w_down = self._expert_weights()
        ebcd, ebcf = ("exp", "batch", None, "embed"), ("exp", "batch", None, "mlp")
        x_ExGxCxD = constrain(jnp.einsum("gsec,gsd->egcd", dispatch.astype(cd), x_GxSxD), ebcd)
        gate_ExGxCxF = jnp.einsum("egcd,edf->egcf", x_ExGxCxD, w_gate)
        up_ExGxCxF = jnp.einsum("egcd,edf->egcf", x_ExGxCxD, w_up)
        h_ExGxCxF = constrain(jax.nn.silu(gate_ExGxCxF) * up_ExGxCxF, ebcf)
        out_ExGxCxD = constrain(jnp.einsum("egcf,efd->egcd", h_ExGxCxF, w_down), ebcd)
        y_GxSxD = jnp.einsum("gsec,egcd->gsd", combine.astype(cd), out_ExGxCxD)
        return y_GxSxD.reshape(B, L, D), dropped

    def _every_expert(self, x_BxLxD, routing: Routing):
        """Causal routing in capacity mode: every expert runs on every token, and a token's output is the sum of
        its experts' outputs times its gates (the other experts' weight is 0): no capacity and no group, so each
        token's output depends on that token alone, up to the order of float sums within its own matmuls.
        Costs ``E / k`` times the expert FLOPs of a routed call (evaluation and decoding only). The ``[E, B, L,
        .]`` activations shard their experts over ``expert`` as the dispatched ones do."""
        cfg = self.cfg
        cd = cfg.jnp_compute_dtype
        onehot_BxLxKxE = jax.nn.one_hot(routing.experts, cfg.moe_num_experts, dtype=jnp.float32)
        weight_BxLxE = jnp.einsum("blke,blk->ble", onehot_BxLxKxE, routing.gates).astype(cd)
        w_gate, w_up, w_down = self._expert_weights()
        gate_ExBxLxF = jnp.einsum("bld,edf->eblf", x_BxLxD, w_gate)
        up_ExBxLxF = jnp.einsum("bld,edf->eblf", x_BxLxD, w_up)
        h_ExBxLxF = constrain(jax.nn.silu(gate_ExBxLxF) * up_ExBxLxF, ("exp", "batch", "length", "mlp"))
        out_ExBxLxD = constrain(jnp.einsum("eblf,efd->ebld", h_ExBxLxF, w_down), ("exp", "batch", "length", "embed"))
        return jnp.einsum("ebld,ble->bld", out_ExBxLxD, weight_BxLxE)

    def _dropless(self, x_BxLxD, routing: Routing):
        """Assignments sorted by expert, ``jax.lax.ragged_dot`` per expert group, scattered back and summed."""
        cfg = self.cfg
        B, L, D = x_BxLxD.shape
        E, K = cfg.moe_num_experts, cfg.moe_top_k
        x_TxD = x_BxLxD.reshape(B * L, D)
        expert_A = routing.experts.reshape(-1)                       # A = T k assignments, token-major
        token_A = jnp.repeat(jnp.arange(B * L, dtype=jnp.int32), K)
        order = jnp.argsort(expert_A, stable=True)
        token_sorted = token_A[order]
        group_sizes = jnp.bincount(expert_A, length=E).astype(jnp.int32)
        w_gate, w_up, w_down = self._expert_weights()
        xs_AxD = x_TxD[token_sorted]
        gate_AxF = jax.lax.ragged_dot(xs_AxD, w_gate, group_sizes)
        up_AxF = jax.lax.ragged_dot(xs_AxD, w_up, group_sizes)
        out_AxD = jax.lax.ragged_dot(jax.nn.silu(gate_AxF) * up_AxF, w_down, group_sizes)
        gate_A = routing.gates.reshape(-1)[order].astype(out_AxD.dtype)
        y_TxD = jnp.zeros_like(x_TxD).at[token_sorted].add(out_AxD * gate_A[:, None])
        return y_TxD.reshape(B, L, D)


def moe_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Params of one MoE layer: ``{"total", "active", "router"}``.

    ``total``: router ``D E + E``, experts ``3 D F E``, shared expert ``3 D F_s``; ``active`` (per token, in a
    matmul): router ``D E``, ``k`` experts ``3 D F k``, shared expert. Used by
    :func:`jaxpt.model.decoder.count_params`.
    """
    D, F, E, K, Fs = cfg.d_model, cfg.mlp_dim, cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_shared_expert_dim
    return {"total": D * E + E + 3 * D * F * E + 3 * D * Fs,
            "active": D * E + 3 * D * F * K + 3 * D * Fs,
            "router": D * E + E}
