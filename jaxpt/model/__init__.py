"""Flax NNX decoder-only transformer. Knows nothing of data, checkpoints or the train loop.

Seams: the attention math (:func:`dot_product_attention`, chosen by ``ModelConfig.attention_impl``) and the
MLP (``ModelConfig.mlp``) are registered implementations (:func:`register_attention`, :func:`register_mlp`);
auxiliary outputs carry declared reductions (:class:`AuxSpec`).
"""

from jaxpt.model.attention import dot_product_attention, register_attention
from jaxpt.model import attention_blockwise  # noqa: F401  registers attention_impl 'blockwise'
from jaxpt.model import attention_splash  # noqa: F401  registers attention_impl 'splash'
from jaxpt.model import attention_cudnn  # noqa: F401  registers attention_impl 'cudnn'
from jaxpt.model import attention_auto  # noqa: F401  registers attention_impl 'auto'
from jaxpt.model.auxiliary import AuxSpec
from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import Decoder, aux_specs, count_params
from jaxpt.model.mlp import register_mlp

__all__ = ["ModelConfig", "Decoder", "count_params", "aux_specs", "AuxSpec", "dot_product_attention",
           "register_attention", "register_mlp"]
