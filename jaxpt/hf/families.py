"""The Hugging Face families jaxpt reads and writes, the ones it refuses and why, and the converter's error
(:mod:`jaxpt.hf`). A new family is a row here (and in :data:`FAMILY_BOUNDARY`); what it reads beyond the Llama
layout goes in :mod:`jaxpt.hf.configs`, tensors Llama lacks in :mod:`jaxpt.hf.params`.
"""

from __future__ import annotations

import dataclasses

from jaxpt.util.errors import ConfigError



class ConvertError(ConfigError):
    """A checkpoint or config the converter cannot translate faithfully (the message names the key)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family jaxpt reads and writes: a Llama-layout decoder (RMSNorm, RoPE, GQA, SwiGLU) and
    what it adds (:mod:`jaxpt.hf`'s family table).

    Attributes:
      model_type: ``config.json``'s ``model_type``.
      architecture: the ``transformers`` class an export of this family names (``architectures``).
      attention_bias: its q/k/v projections carry biases (``ModelConfig.attention_bias``; Qwen2).
      qk_norm: it normalizes each head of q and k before RoPE (``ModelConfig.qk_norm``; Qwen3).
      sliding_window_keys: the keys that switch its sliding window on (``sliding_window`` alone for Mistral;
        ``use_sliding_window`` and ``max_window_layers`` too for Qwen); empty: it has none.
    """

    model_type: str
    architecture: str
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window_keys: tuple[str, ...] = ()


#: The families :func:`jaxpt.hf.configs.model_config_from_hf` reads and
#: :func:`jaxpt.hf.configs.hf_config_from_model` writes, by ``model_type``.
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM"),
    "mistral": Family("mistral", "MistralForCausalLM", sliding_window_keys=("sliding_window",)),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", attention_bias=True,
                    sliding_window_keys=("use_sliding_window", "sliding_window", "max_window_layers")),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qk_norm=True,
                    sliding_window_keys=("use_sliding_window", "sliding_window", "max_window_layers")),
}
#: ``model_type`` values read by :func:`jaxpt.hf.configs.model_config_from_hf`.
ARCHITECTURES = tuple(FAMILIES)
#: Families jaxpt's model cannot represent, with what it lacks (named in the refusal).
UNSUPPORTED: dict[str, str] = {
    "gemma": "a GeGLU MLP (gelu), RMSNorm scaled by (1 + w) and embeddings scaled by sqrt(hidden_size)",
    "gemma2": "a GeGLU MLP, (1 + w) RMSNorm, norms after attention and MLP, logit soft-capping and alternating "
              "sliding-window layers",
    "gemma3_text": "a GeGLU MLP, (1 + w) RMSNorm, norms after attention and MLP and local/global attention layers "
                   "with two RoPE bases",
    "phi": "LayerNorm with biases, a GELU MLP with biases, parallel attention and MLP and partial rotary embeddings",
    "phi3": "fused qkv_proj / gate_up_proj tensors and LongRoPE scaling",
    "mixtral": "mixture-of-experts MLPs (the converter maps dense models only)",
    "qwen2_moe": "mixture-of-experts MLPs with a gated shared expert (the converter maps dense models only)",
    "qwen3_moe": "mixture-of-experts MLPs (the converter maps dense models only)",
    "olmo2": "q/k RMSNorm over all heads together and norms after (not before) attention and MLP",
    "gpt2": "LayerNorm, learned absolute positions, a GELU MLP and biases everywhere",
    "gpt_neox": "LayerNorm, parallel attention and MLP, partial rotary embeddings and biases",
}
#: A base model's document-boundary convention by ``model_type``, used when its tokenizer files do not say
#: (``tokenizer_config.json``'s ``add_bos_token``, or a ``tokenizer.json`` post-processor, say first): Llama and
#: Mistral tokenizers put BOS before every text (``LlamaTokenizer``'s ``add_bos_token`` defaults to True) and their
#: pretraining documents end with EOS; Qwen's add nothing and its documents end with ``<|endoftext|>``.
FAMILY_BOUNDARY = {"llama": "bos_eos", "mistral": "bos_eos", "qwen2": "eos", "qwen3": "eos"}
