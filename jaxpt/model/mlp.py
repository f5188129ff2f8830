"""The block's MLP, chosen by ``ModelConfig.mlp`` from :data:`jaxpt.model.tables.MLPS`, and the dense one, ``swiglu``.

An MLP is an ``nnx.Module`` class (or factory) called as ``cls(cfg, rngs=rngs)`` whose ``__call__`` maps
``x [B, L, D]`` (compute dtype, already normalized) to ``(y [B, L, D] in the compute dtype, aux)``, where
``aux`` holds exactly the auxiliary outputs its table entry declares: none for a dense MLP; a
mixture-of-experts MLP would return e.g. a load-balancing loss declared with a ``loss_weight``
(:class:`jaxpt.model.auxiliary.AuxSpec`), which the train step adds to the loss. An MLP class whose
``takes_segment_ids`` is True is called as ``mlp(x, segment_ids [B, L] int32)`` instead (0 marks padding: the
mixture of experts gives it no capacity and leaves it out of its statistics).

An MLP whose output for a token may depend on *other* tokens of the call (the mixture of experts: capacity and
balancing within a routing group) must name the routing modes it runs in ``routings``: ``train`` (its configured routing, which training
uses) and, where it can route each token by itself, ``causal``; the block then calls it with ``routing=<name>`` (:func:`jaxpt.model.decoder.eval_routing`:
``causal``, each token by itself, for evaluation and decoding, where the MLP offers it; without it a KV cache
cannot reproduce the model's forward, and decoding runs without one). An MLP without ``routings`` is taken to
treat each token by itself (like ``swiglu``). An MLP whose statistics need the whole batch under gradient
accumulation names those auxiliary outputs in ``batch_totals``; the block then passes ``totals=``, a
:class:`jaxpt.model.auxiliary.BatchTotals` (or None), and its aux outputs must be parts that sum over
micro-batches to the whole batch's value. Params carry
``logical_axes`` metadata like every other param (see :mod:`jaxpt.mesh`). The mixture of experts is
:mod:`jaxpt.model.moe`; :func:`jaxpt.model.decoder.build_mlp` builds the one a layer has.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpt.mesh import constrain
from jaxpt.model import parametrization
from jaxpt.model.config import DTYPES, ModelConfig
from jaxpt.model.layers import _param
from jaxpt.model.seams import SavedTensor


def swiglu_saved_tensors(cfg: ModelConfig, batch: int, seq_len: int) -> list[SavedTensor]:
    """What :class:`SwiGLU` keeps for the backward pass: ``gate``, ``up`` and ``h``, ``[B, L, F]`` each."""
    c = jnp.dtype(DTYPES[cfg.compute_dtype]).itemsize
    blf = ("batch", "length", "mlp")
    shape = (batch, seq_len, cfg.mlp_dim)
    return [SavedTensor("gate", "dot", True, shape, blf, c), SavedTensor("up", "dot", True, shape, blf, c),
            SavedTensor("h", "other", True, shape, blf, c)]


class SwiGLU(nnx.Module):
    """Gated MLP ``down(silu(x @ gate) * (x @ up))`` (Shazeer 2020, "GLU Variants Improve Transformer").

    Params: ``w_gate``, ``w_up`` [D, F], ``w_down`` [F, D]. No auxiliary outputs.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, F = cfg.d_model, cfg.mlp_dim
        pd = cfg.jnp_param_dtype
        # GPT-2 style residual scaling; under µP both stds shrink with width (jaxpt.model.parametrization)
        std = parametrization.hidden_init_std(cfg, cfg.init_std)
        out_std = parametrization.hidden_init_std(cfg, cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), std, pd)
        self.w_up = _param(rngs, (D, F), ("embed", "mlp"), std, pd)
        self.w_down = _param(rngs, (F, D), ("mlp", "embed"), out_std, pd)

    def __call__(self, x_BxLxD):
        """Returns ``(y [B, L, D], {})``."""
        cd = self.cfg.jnp_compute_dtype
        w_gate, w_up = self.w_gate[...].astype(cd), self.w_up[...].astype(cd)
        if self.cfg.fused_projections:  # one GEMM against [D, 2, F] (ModelConfig.fused_projections)
            y_BxLx2xF = jnp.einsum("bld,dsf->blsf", x_BxLxD, jnp.stack((w_gate, w_up), axis=1))
            gate_BxLxF, up_BxLxF = y_BxLx2xF[:, :, 0], y_BxLx2xF[:, :, 1]
        else:
            gate_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, w_gate)
            up_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, w_up)
        h_BxLxF = constrain(jax.nn.silu(gate_BxLxF) * up_BxLxF, ("batch", "length", "mlp"))
        return jnp.einsum("blf,fd->bld", h_BxLxF, self.w_down[...].astype(cd)), {}
