"""Model hyper-parameters (plain dataclass; gin registration lives in :mod:`jaxpt.config`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax.numpy as jnp

from jaxpt.model import seams
from jaxpt.model.rope import RopeScaling
from jaxpt.util.validation import check_types, non_negative, positive, require

Dtype = Literal["float32", "bfloat16", "float16"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "save_qkv_proj"]
Parametrization = Literal["sp", "mup"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES: tuple[str, ...] = typing.get_args(RematPolicy)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama-style: RMSNorm, RoPE, GQA, SwiGLU by default).

    Attributes:
      vocab_size: tokens in the vocabulary; 0 means "take it from the tokenizer" (resolved before build).
      d_model: residual stream width (``embed`` axis).
      num_layers: transformer blocks.
      num_heads: query heads (``heads`` axis).
      num_kv_heads: key/value heads for grouped-query attention (Ainslie et al. 2023); divides ``num_heads``.
      head_dim: width of each head (``head_dim`` axis).
      mlp_dim: hidden width of the MLP (``mlp`` axis; SwiGLU: Shazeer 2020).
      max_seq_len: longest row, in tokens, the model is built and validated for.
      rope_theta: RoPE base frequency (Su et al. 2021).
      rope_scaling: how RoPE frequencies are rescaled for a longer context (:mod:`jaxpt.model.rope`, with the
        formulas and sources): ``none``, ``linear`` (position interpolation, Chen et al. 2023), ``llama3``
        (Llama 3.1's frequency scaling), ``yarn`` (Peng et al. 2023, with its attention temperature). Changes no
        parameter, so a checkpoint continues under another scaling (a long-context extension stage).
      rope_scaling_factor: ``s``, how many times longer than ``rope_original_max_len`` the context becomes
        (``linear``, ``llama3``, ``yarn``).
      rope_original_max_len: ``L0``, the context length the model was trained at before scaling (``llama3``,
        ``yarn``; Hugging Face ``original_max_position_embeddings``).
      rope_low_freq_factor, rope_high_freq_factor: ``llama3``: wavelengths above ``L0 / low`` are interpolated by
        ``s``, below ``L0 / high`` kept, smoothly in between (Llama 3.1: 1 and 4).
      rope_beta_fast, rope_beta_slow: ``yarn``: dimensions rotating more than ``beta_fast`` times over ``L0`` are
        kept, fewer than ``beta_slow`` times interpolated, a linear ramp between (paper: 32 and 1).
      rope_attention_factor: ``yarn``: multiplier of rotated queries and keys (logits scale by its square);
        0: ``0.1 ln(s) + 1`` (Peng et al. 2023, eq. 22).
      tie_embeddings: output projection reuses the embedding table (transposed).
      attention_bias: learned biases on the query, key and value projections (``q_bias`` [H, Hd], ``k_bias`` and
        ``v_bias`` [K, Hd], zeros at init; none on the output projection), as Qwen2 / Qwen2.5 have. Changes the
        params.
      qk_norm: RMSNorm with a learned ``[head_dim]`` scale over each head of the queries and of the keys, after
        the projection (and its bias) and before RoPE (``q_norm``, ``k_norm``; epsilon ``norm_eps``), as Qwen3 has
        (Dehghani et al. 2023 normalize q and k per head for training stability). Changes the params.
      param_dtype: dtype params are stored and optimized in (``float32`` usual).
      compute_dtype: dtype of activations and matmul inputs (``bfloat16`` usual on accelerators).
      norm_eps: RMSNorm epsilon.
      init_std: std of the normal initializer of input projections and the embedding.
      parametrization: ``sp`` (standard: one learning rate, width-independent init) or ``mup`` (the Maximal Update
        Parametrization, Yang et al. 2022: hidden matrices initialized with ``init_std / sqrt(m)`` and updated with
        ``lr / m``, logits multiplied by ``1 / m``, for ``m = d_model / mup_base_d_model``; the table is in
        :mod:`jaxpt.model.parametrization`). Under µP a learning rate tuned at the base width transfers to wider
        models. Changes no parameter's shape; changes the init, the updates and the logits.
      mup_base_d_model: the base width µP's multipliers are relative to (the width the learning rate was tuned
        at); required (> 0) with ``parametrization = 'mup'``, refused with ``sp`` (0 there).
      scan_layers: stack blocks and run them with ``nnx.scan`` (one compiled block: faster compile).
      remat_policy: activation checkpointing: ``none``, ``full`` (save nothing), ``dots`` (save matmul
        outputs), ``dots_no_batch`` (save matmuls without batch dims, i.e. weight matmuls),
        ``save_qkv_proj`` (save the q/k/v projections only).
      attention_impl: how softmax(q k^T) v is computed, a name in :data:`jaxpt.model.tables.ATTENTION` (or one
        added with :func:`jaxpt.model.seams.add_attention`): ``xla`` (einsums with a materialized [L, M] mask, reports
        ``max_attention_logit``), ``blockwise`` (pure-JAX flash-style, memory O(L x block), reports it),
        ``splash`` (the Pallas TPU kernel; interpret mode elsewhere; no max logit), ``cudnn`` (cuDNN's fused
        kernel via ``jax.nn.dot_product_attention``, CUDA GPUs only: a ConfigError elsewhere, a logged fallback
        where cuDNN cannot take the shapes; no max logit), ``auto`` (splash on TPU, cudnn on CUDA GPUs, else
        blockwise for long rows, xla for short; :func:`jaxpt.model.attention_auto.resolve`). Changes no
        parameter, so a checkpoint resumes under another.
      mlp: the block's MLP, a name in :data:`jaxpt.model.tables.MLPS` (or added with
        :func:`jaxpt.model.seams.add_mlp`): ``swiglu`` (dense) or ``moe``
        (a mixture of SwiGLU experts, :class:`jaxpt.model.moe.MoE`; ``mlp_dim`` is then each expert's width).
      moe_num_experts: experts per MoE layer (``exp`` logical axis, sharded over the ``expert`` mesh axis).
      moe_top_k: experts each token is routed to (softmax then top-k; k = 1 is Switch, k = 2 GShard/Mixtral).
      moe_every: every ``moe_every``-th layer (layers ``moe_every - 1, 2 moe_every - 1, ...``) has the MoE MLP,
        the others the dense ``swiglu`` of width ``mlp_dim``; 1: every layer. With ``scan_layers`` it must be 1.
      moe_capacity_factor: expert capacity per group (one row of ``seq_len`` tokens) is
        ``min(S, ceil(top_k * S * moe_capacity_factor / num_experts))`` tokens; assignments past it are dropped
        (the token passes through the residual). ``num_experts / top_k`` or more never drops.
      moe_group_size: tokens per routing group in capacity mode (rows are cut into groups of this many
        consecutive tokens; it must divide ``seq_len``); 0: one group per row. The dispatch/combine einsums cost
        ``4 S E C D`` FLOPs per group of ``S``, i.e. ``2 S / (3 F)`` of the expert FLOPs: 38% for
        Mixtral-8x7B at S = 8192, 5% at S = 1024.
      moe_dropless: no capacity: tokens sorted by expert and multiplied group by group
        (``jax.lax.ragged_dot``); nothing is dropped.
      moe_shared_expert_dim: width of a dense SwiGLU expert every token also goes through (DeepSeekMoE); 0: none.
      moe_load_balance_weight: weight of the Switch/GShard load-balancing loss (Fedus et al. 2021, eq. 4).
      moe_router_z_loss_weight: weight of the router z-loss (Zoph et al. 2022, ST-MoE, eq. 5).
      moe_router_init_std: std of the router weights' normal init; 0: ``init_std``. Switch Transformer
        (Fedus et al. 2021, sec. 2.4) scales the router's (and every) init down for stable routing.
      moe_router_sinkhorn_iters: 0: each token's experts are its top-k router probabilities. > 0: they are the
        top k of the logits plus per-expert offsets that balance each routing group, from this many Sinkhorn
        iterations (Clark et al. 2022, S-BASE; :func:`jaxpt.model.moe.sinkhorn_offsets`); gates and gradients
        unchanged. Keeps routing balanced while the tokens' hidden states are nearly alike (early training).
      fused_projections: compute the attention's q, k and v projections as one matmul (k and v only, when
        ``num_kv_heads < num_heads``) and SwiGLU's gate and up projections as one, against the weights stacked
        at trace time (``[D, 3, H, Hd]``, ``[D, 2, F]``): fewer, larger GEMMs (on the 8-device CPU reference
        model of ``benchmarks/train_throughput.py``, a plain-JAX step ran 1.12x faster so). The params keep
        their separate layout (checkpoints, conversion and sharding rules are unchanged); the same math up to
        float rounding. Changes no parameter.
      loss_chunk_size: tokens per chunk (along the sequence) in which the train and eval steps compute the
        output logits and the cross-entropy, forward and backward, so the [B, L, V] float32 logits never exist
        whole (:func:`jaxpt.training.step.chunked_token_losses`); 0: all at once. Changes no parameter.
      pipeline_microbatches: with a ``stage`` mesh axis of size S > 1, the micro-batches ``M`` each model call's
        batch is cut into and streamed through the stages (:mod:`jaxpt.model.pipeline`); 0: ``M = S``. More
        micro-batches shrink the bubble ``(S - 1) / (M R + S - 1)`` at the cost of smaller matmuls. Unused
        without stages; changes no parameter. Checked against the batch and the mesh by
        :func:`jaxpt.config.validate`.
      pipeline_repeats: ``R``, layer groups per stage: 1 is GPipe (each stage one block of ``num_layers / S``
        consecutive layers); ``R > 1`` is the circular schedule (each stage ``R`` groups of
        ``num_layers / (S R)`` layers, micro-batches go round the stages ``R`` times), whose bubble is ``R``
        times smaller for the same ``M``. Changes no parameter.

    Raises:
      ConfigError: at construction, naming ``ModelConfig.<field> = <value>``: a wrong type, an unknown dtype
        or remat policy, an unknown ``attention_impl`` or ``mlp``, a non-positive size, a negative ``vocab_size``, an odd ``head_dim`` (RoPE rotates
        pairs), ``num_heads`` not a multiple of ``num_kv_heads``, a non-positive ``rope_theta``,
        ``norm_eps``, ``init_std`` or ``pipeline_repeats``, or a negative ``pipeline_microbatches``; an unknown
        ``rope_scaling``; for a scaling other than ``none``, a ``rope_scaling_factor`` below 1; for
        ``llama3``/``yarn``, no ``rope_original_max_len``; for ``llama3``, ``rope_high_freq_factor <=
        rope_low_freq_factor`` or a non-positive one; for ``yarn``, ``rope_beta_fast <= rope_beta_slow`` or a
        non-positive one, or a negative ``rope_attention_factor``; for ``mlp = 'moe'``: ``moe_top_k`` outside
        ``[1, moe_num_experts]``, a non-positive ``moe_capacity_factor`` or ``moe_every``, ``moe_every`` not
        dividing ``num_layers`` or above 1 with ``scan_layers``, or a negative loss weight, ``moe_router_init_std``,
        ``moe_router_sinkhorn_iters`` or ``moe_shared_expert_dim``.
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
    rope_scaling: RopeScaling = "none"
    rope_scaling_factor: float = 1.0
    rope_original_max_len: int = 0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "float32"
    norm_eps: float = 1e-6
    init_std: float = 0.02
    parametrization: Parametrization = "sp"
    mup_base_d_model: int = 0
    scan_layers: bool = False
    remat_policy: RematPolicy = "none"
    attention_impl: str = "xla"
    mlp: str = "swiglu"
    fused_projections: bool = True
    loss_chunk_size: int = 0
    pipeline_microbatches: int = 0
    pipeline_repeats: int = 1
    moe_num_experts: int = 8
    moe_top_k: int = 2
    moe_every: int = 1
    moe_capacity_factor: float = 1.25
    moe_group_size: int = 0
    moe_dropless: bool = False
    moe_shared_expert_dim: int = 0
    moe_load_balance_weight: float = 0.01
    moe_router_z_loss_weight: float = 0.001
    moe_router_init_std: float = 0.0
    moe_router_sinkhorn_iters: int = 0

    @property
    def jnp_param_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def jnp_compute_dtype(self):
        return DTYPES[self.compute_dtype]

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "max_seq_len",
                 "rope_theta", "norm_eps", "init_std")
        require(self, "loss_chunk_size", self.loss_chunk_size >= 0, "must be >= 0 (0 = no chunking)")
        require(self, "pipeline_microbatches", self.pipeline_microbatches >= 0, "must be >= 0 (0 = one per stage)")
        positive(self, "pipeline_repeats")
        require(self, "vocab_size", self.vocab_size >= 0, "must be >= 0 (0 = from the tokenizer)")
        require(self, "head_dim", self.head_dim % 2 == 0, "must be even for rotary embeddings")
        require(self, "num_heads", self.num_heads % self.num_kv_heads == 0,
                f"must be a multiple of ModelConfig.num_kv_heads = {self.num_kv_heads} (grouped-query attention)")
        self._check_rope_scaling()
        if self.mlp == "moe":
            self._check_moe()
        if self.parametrization == "mup":
            require(self, "mup_base_d_model", self.mup_base_d_model > 0,
                    "must be set (> 0: the width the learning rate was tuned at) with "
                    "ModelConfig.parametrization = 'mup'")
            require(self, "parametrization", self.mlp != "moe",
                    "'mup' is not available for ModelConfig.mlp = 'moe' (the router is a readout jaxpt's µP "
                    "does not scale); use 'sp'")
        else:
            require(self, "mup_base_d_model", self.mup_base_d_model == 0,
                    f"is set but ModelConfig.parametrization = {self.parametrization!r} ignores it: set "
                    "ModelConfig.parametrization = 'mup', or leave mup_base_d_model at 0")
        seams.check_name("attention_impl", self.attention_impl)   # ConfigError "...: choose one of (...)"
        seams.check_name("mlp", self.mlp)

    def _check_rope_scaling(self) -> None:
        kind = self.rope_scaling
        if kind == "none":
            return
        require(self, "rope_scaling_factor", self.rope_scaling_factor >= 1.0,
                f"must be >= 1 with ModelConfig.rope_scaling = {kind!r} (how many times longer the context gets)")
        if kind in ("llama3", "yarn"):
            require(self, "rope_original_max_len", self.rope_original_max_len > 0,
                    f"must be set (> 0: the pre-extension context length) with ModelConfig.rope_scaling = {kind!r}")
        if kind == "llama3":
            positive(self, "rope_low_freq_factor", "rope_high_freq_factor")
            require(self, "rope_high_freq_factor", self.rope_high_freq_factor > self.rope_low_freq_factor,
                    f"must exceed ModelConfig.rope_low_freq_factor = {self.rope_low_freq_factor}")
        if kind == "yarn":
            positive(self, "rope_beta_fast", "rope_beta_slow")
            require(self, "rope_beta_fast", self.rope_beta_fast > self.rope_beta_slow,
                    f"must exceed ModelConfig.rope_beta_slow = {self.rope_beta_slow}")
            require(self, "rope_attention_factor", self.rope_attention_factor >= 0,
                    "must be >= 0 (0: 0.1 ln(s) + 1)")

    def _check_moe(self) -> None:
        positive(self, "moe_num_experts", "moe_top_k", "moe_every", "moe_capacity_factor")
        non_negative(self, "moe_group_size", "moe_shared_expert_dim", "moe_load_balance_weight",
                     "moe_router_z_loss_weight", "moe_router_init_std", "moe_router_sinkhorn_iters")
        require(self, "moe_top_k", self.moe_top_k <= self.moe_num_experts,
                f"must be at most ModelConfig.moe_num_experts = {self.moe_num_experts}")
        require(self, "moe_every", self.num_layers % self.moe_every == 0,
                f"must divide ModelConfig.num_layers = {self.num_layers}")
        require(self, "moe_every", self.moe_every == 1 or not self.scan_layers,
                "must be 1 with ModelConfig.scan_layers = True (a scanned stack has identical layers)")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has the MoE MLP (``mlp = 'moe'`` and every ``moe_every``-th)."""
        return self.mlp == "moe" and layer % self.moe_every == self.moe_every - 1

    @property
    def num_moe_layers(self) -> int:
        """Layers with the MoE MLP (0 for a dense model)."""
        return self.num_layers // self.moe_every if self.mlp == "moe" else 0
