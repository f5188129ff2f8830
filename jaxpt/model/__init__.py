"""Flax NNX decoder-only transformer. Knows nothing of data, checkpoints or the train loop.

Seams: the attention math (:func:`dot_product_attention`, chosen by ``ModelConfig.attention_impl``) and the
MLP (``ModelConfig.mlp``) are looked up by name in explicit tables (:mod:`jaxpt.model.tables`); a user adds
an implementation of their own with an explicit call (:func:`add_attention`, :func:`add_mlp`;
:mod:`jaxpt.model.seams`). Auxiliary outputs carry declared reductions (:class:`AuxSpec`).
"""

from jaxpt.model.attention import dot_product_attention
from jaxpt.model.auxiliary import AuxSpec
from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import Decoder, aux_specs, count_params
from jaxpt.model.seams import add_attention, add_mlp

__all__ = ["ModelConfig", "Decoder", "count_params", "aux_specs", "AuxSpec", "dot_product_attention",
           "add_attention", "add_mlp"]
