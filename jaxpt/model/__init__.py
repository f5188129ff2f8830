"""Flax NNX decoder-only transformer. Knows nothing of data, checkpoints or the train loop."""

from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import Decoder, count_params

__all__ = ["ModelConfig", "Decoder", "count_params"]
