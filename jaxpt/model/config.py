"""Model hyper-parameters (plain dataclass; gin registration lives in :mod:`jaxpt.config`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_qkv_proj")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama-style: RMSNorm, RoPE, GQA, SwiGLU).

    Attributes:
      vocab_size: tokens in the vocabulary; 0 means "take it from the tokenizer" (resolved before build).
      d_model: residual stream width (``embed`` axis).
      num_layers: transformer blocks.
      num_heads: query heads (``heads`` axis).
      num_kv_heads: key/value heads for grouped-query attention (Ainslie et al. 2023); divides ``num_heads``.
      head_dim: width of each head (``head_dim`` axis).
      mlp_dim: hidden width of the SwiGLU MLP (``mlp`` axis; Shazeer 2020).
      max_seq_len: longest row, in tokens, the model is built and validated for.
      rope_theta: RoPE base frequency (Su et al. 2021).
      tie_embeddings: output projection reuses the embedding table (transposed).
      param_dtype: dtype params are stored and optimized in (``float32`` usual).
      compute_dtype: dtype of activations and matmul inputs (``bfloat16`` usual on accelerators).
      norm_eps: RMSNorm epsilon.
      init_std: std of the normal initializer of input projections and the embedding.
      scan_layers: stack blocks and run them with ``nnx.scan`` (one compiled block: faster compile).
      remat_policy: activation checkpointing: ``none``, ``full`` (save nothing), ``dots`` (save matmul
        outputs), ``dots_no_batch`` (save matmuls without batch dims, i.e. weight matmuls),
        ``save_qkv_proj`` (save the q/k/v projections only).
    """

    vocab_size: int = 8192
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 64
    mlp_dim: int = 1024
    max_seq_len: int = 256
    rope_theta: float = 10_000.0
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    norm_eps: float = 1e-6
    init_std: float = 0.02
    scan_layers: bool = False
    remat_policy: str = "none"

    @property
    def jnp_param_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def jnp_compute_dtype(self):
        return DTYPES[self.compute_dtype]
