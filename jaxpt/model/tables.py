"""Which implementation a config name selects, for each seam of the model: one explicit table per seam.

:data:`ATTENTION` (``ModelConfig.attention_impl``) and :data:`MLPS` (``ModelConfig.mlp``) map each of jaxpt's
names (:data:`jaxpt.model.seams.ATTENTION_IMPLS`, :data:`jaxpt.model.seams.MLP_NAMES`) to an
:class:`~jaxpt.model.seams.Implementation`: the function or module class, the auxiliary outputs it returns and
the tensors it keeps for the backward pass (the memory planner's, :mod:`jaxpt.training.memory`). Adding an
implementation to jaxpt is one module with its function plus one row here and its name in
:mod:`jaxpt.model.seams`; a user's own is added by an explicit call (:func:`jaxpt.model.seams.add_attention`,
:func:`jaxpt.model.seams.add_mlp`), which :func:`attention` and :func:`mlp` also find.

This module imports the implementations; they never import it (nor :mod:`jaxpt.model.attention`, which looks
implementations up here).
"""

from __future__ import annotations

from jaxpt.model import attention_auto, attention_blockwise, attention_cudnn, attention_splash, attention_xla, moe
from jaxpt.model.auxiliary import AuxSpec
from jaxpt.model.mlp import SwiGLU, swiglu_saved_tensors
from jaxpt.model.seams import Implementation, added, check_name


def max_attention_logit(cfg) -> dict[str, AuxSpec]:
    """The auxiliary output of attention that materializes its logits: ``max_attention_logit`` (the largest
    scaled logit among allowed query-key pairs, float32 scalar), reduced by ``max``."""
    return {"max_attention_logit": AuxSpec("max")}


#: Attention implementations by ``ModelConfig.attention_impl`` (:mod:`jaxpt.model.attention` gives the contract).
ATTENTION: dict[str, Implementation] = {
    "xla": Implementation("xla", attention_xla.xla_attention, aux_specs=max_attention_logit,
                          saved_tensors=attention_xla.xla_saved_tensors),
    "blockwise": Implementation("blockwise", attention_blockwise.blockwise_attention, aux_specs=max_attention_logit,
                                saved_tensors=attention_blockwise.blockwise_saved_tensors),
    "splash": Implementation("splash", attention_splash.splash_attention,
                             saved_tensors=attention_splash.splash_saved_tensors),
    "cudnn": Implementation("cudnn", attention_auto.cudnn_attention,
                            saved_tensors=attention_cudnn.cudnn_saved_tensors),
    "auto": Implementation("auto", attention_auto.auto_attention, saved_tensors=attention_auto.auto_saved_tensors),
}

#: MLP module classes by ``ModelConfig.mlp`` (:mod:`jaxpt.model.mlp` gives the contract).
MLPS: dict[str, Implementation] = {
    "swiglu": Implementation("swiglu", SwiGLU, saved_tensors=swiglu_saved_tensors),
    "moe": Implementation("moe", moe.MoE, aux_specs=moe.moe_aux_specs, saved_tensors=moe.moe_saved_tensors),
}


def attention(name: str) -> Implementation:
    """The entry of ``ModelConfig.attention_impl = name``: :data:`ATTENTION`'s, else the user's.

    Raises:
      ConfigError: no such implementation (naming the config field and the choices).
    """
    check_name("attention_impl", name)
    return ATTENTION.get(name) or added("attention_impl", name)


def mlp(name: str) -> Implementation:
    """The entry of ``ModelConfig.mlp = name``: :data:`MLPS`'s, else the user's. Raises as :func:`attention`."""
    check_name("mlp", name)
    return MLPS.get(name) or added("mlp", name)
