"""How initialization, per-parameter learning rates and the output scale depend on width: SP or µP.

``ModelConfig.parametrization = 'sp'`` (standard parametrization, the default) initializes every matrix with
``init_std`` (GPT-2 style; the residual output projections ``wo`` and ``w_down`` with ``init_std / sqrt(2 N)``),
uses one Adam learning rate for all parameters and no output multiplier, so the best learning rate moves with
width. ``'mup'`` is the Maximal Update Parametrization for Adam-type optimizers (Yang et al. 2022, "Tensor
Programs V", Table 3, in the output-multiplier form the paper's ``mup`` package implements as ``MuReadout``; see
its Table 9 for the equivalence). With the width multiplier ``m = d_model / mup_base_d_model``:

- embedding (input weights): init std ``init_std``, Adam LR ``lr``, no multiplier;
- hidden matrices ``wq wk wv w_gate w_up``: init std ``init_std / sqrt(m)``, Adam LR ``lr / m``;
- residual output matrices ``wo w_down``: init std ``init_std / sqrt(2 N m)``, Adam LR ``lr / m``;
- output projection (untied, or the tied embedding): init std ``init_std``, Adam LR ``lr``, and the logits
  multiplied by ``1 / m``;
- norm scales (also the q/k norms) and the q/k/v biases: ones / zeros, Adam LR ``lr``.

At ``m = 1`` (``d_model == mup_base_d_model``) µP is SP exactly: same initial params, same updates, same logits.
Width is meant to grow by ``num_heads`` and ``mlp_dim`` with ``head_dim`` fixed, so the attention's
``1 / sqrt(head_dim)`` is a constant and µP's ``1 / head_dim`` rule changes nothing. µP transfers the learning
rate across width only, not depth (CompleteP, Dey et al. 2025, adds depth); a mixture-of-experts model is refused
(its router is a readout µP would have to scale, which jaxpt does not do yet). Decoupled weight decay is
applied as ``lr * wd * param`` inside AdamW, so the hidden matrices' ``1 / m`` scales their decay too, as the
``mup`` package's ``MuAdamW`` does.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from jaxpt.model.config import ModelConfig
from jaxpt.util.errors import ConfigError

#: Matrices with two width dimensions (fan-in and fan-out both grow with ``d_model``): µP's "hidden weights".
HIDDEN_MATRICES = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})
#: Parameters with one width dimension, or none: µP's input / output weights, norm scales and biases.
VECTOR_LIKE = frozenset({"embedding", "output", "scale", "q_bias", "k_bias", "v_bias"})


def width_multiplier(cfg: ModelConfig) -> float:
    """``m = d_model / mup_base_d_model`` under µP, 1.0 under SP (dimensionless)."""
    return cfg.d_model / cfg.mup_base_d_model if cfg.parametrization == "mup" else 1.0


def hidden_init_std(cfg: ModelConfig, std: float) -> float:
    """The init std of a hidden matrix whose SP std is ``std``: ``std / sqrt(m)`` (variance ``1 / fan_in``
    relative to the base width), ``std`` under SP."""
    m = width_multiplier(cfg)
    return std if m == 1.0 else std / math.sqrt(m)


def output_multiplier(cfg: ModelConfig) -> float:
    """The factor on the output logits: ``1 / m`` under µP (``MuReadout``), 1.0 under SP."""
    return 1.0 / width_multiplier(cfg)


def describe(cfg: ModelConfig) -> str:
    """One line for logs and the dry run: ``'SP'`` or ``'µP (base width 128, m = 2)'``."""
    if cfg.parametrization != "mup":
        return "SP"
    return f"µP (base width {cfg.mup_base_d_model}, m = {width_multiplier(cfg):g})"


def tied_multiplier(cfg: ModelConfig) -> bool:
    """Whether the logits carry a ``1 / m`` other than 1 on a tied embedding: no separate ``lm_head`` can absorb it,
    so such a model cannot be exported to a format without an output multiplier (Hugging Face)."""
    return cfg.tie_embeddings and width_multiplier(cfg) != 1.0


def notes(cfg: ModelConfig) -> list[str]:
    """What a user should know before training under this parametrization (logged at start, shown by the dry run):
    a tied µP model cannot be exported to Hugging Face (its ``1 / m`` has no ``lm_head`` to go into)."""
    if tied_multiplier(cfg):
        return [f"ModelConfig.tie_embeddings = True under {describe(cfg)}: the model trains, but cannot be exported to "
                "Hugging Face (the logits' 1/m multiplier has no separate lm_head to be folded into)"]
    return []


def same_function(saved: ModelConfig, current: ModelConfig) -> bool:
    """Whether the same weights compute the same logits and take the same updates under both configs: the same
    width multiplier (SP is ``m = 1``), so µP at its base width and SP count as the same."""
    return width_multiplier(saved) == width_multiplier(current)


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))) for k in path)


def lr_multipliers(cfg: ModelConfig, params: Any) -> Any | None:
    """A params-shaped tree of Python floats multiplying each parameter's Adam update (its learning rate):
    ``1 / m`` for :data:`HIDDEN_MATRICES`, 1.0 for :data:`VECTOR_LIKE`; None under SP (no scaling at all).

    ``params``: arrays or ``ShapeDtypeStruct``s with the model's tree structure (paths name the modules).

    Raises:
      ConfigError: a parameter of rank >= 2 that is neither (e.g. a custom MLP's matrix added with
        :func:`jaxpt.model.seams.add_mlp`), naming its path and ``ModelConfig.parametrization``: µP must know
        which dimensions grow with width, so it refuses to guess.
    """
    if cfg.parametrization != "mup":
        return None
    m = width_multiplier(cfg)

    def decide(path, leaf) -> float:
        names = _names(path)
        if HIDDEN_MATRICES & set(names):
            return 1.0 / m
        if VECTOR_LIKE & set(names) or len(getattr(leaf, "shape", ())) <= 1:
            return 1.0
        raise ConfigError(f"ModelConfig.parametrization = 'mup': the parameter {'/'.join(names)} (shape "
                          f"{tuple(leaf.shape)}) is neither a hidden matrix {sorted(HIDDEN_MATRICES)} nor an "
                          "input/output weight, norm or bias; µP cannot tell which of its dimensions grow with width")
    return jax.tree_util.tree_map_with_path(decide, params)
