"""The per-device memory of one training step, estimated without compiling.

:func:`estimate_memory` gives per-device bytes for params, gradients, the optimizer state, activations saved for the
backward pass under the remat policy, pipeline buffers and the logits, each divided by the mesh axes its logical axes
are sharded over (the same rules :mod:`jaxpt.mesh` applies), and compares the total with the device's memory. The
dry run (:mod:`jaxpt.run.resolve`), the planner (``python -m jaxpt.tools.plan``), ``python -m jaxpt.tools.compile``
(beside the compiled figure), the sweep and the gate all use it; ``tests/test_plan.py`` checks it against compiled
programs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxpt import mesh as mesh_lib
from jaxpt.mesh import _rules_dict
from jaxpt.model import tables
from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import count_params
from jaxpt.model.seams import SavedTensor as T
from jaxpt.training import optim
from jaxpt.training.state import abstract_model

GIB = 2 ** 30


#: Bytes per element of each dtype name used in configs.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of one training step (see :func:`estimate_memory`)."""

    params: int
    grads: int
    opt_state: int
    update: int
    gathered_params: int
    activations: int
    logits: int
    device_bytes: float | None = None
    usable_fraction: float = 0.9
    stash: int = 0
    pipeline: dict[str, Any] | None = None

    @property
    def state(self) -> int:
        """Bytes of the persistent train state (params + optimizer state)."""
        return self.params + self.opt_state

    @property
    def total(self) -> int:
        """Peak bytes: state + gradients + update + gathered weights + saved activations + logits buffers
        (+ the pipeline's micro-batch buffers)."""
        return (self.params + self.grads + self.opt_state + self.update + self.gathered_params
                + self.activations + self.logits + self.stash)

    @property
    def fits(self) -> bool | None:
        """``total <= usable_fraction * device_bytes``; None when the device memory is unknown."""
        if self.device_bytes is None:
            return None
        return self.total <= self.usable_fraction * self.device_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"params": self.params, "grads": self.grads, "opt_state": self.opt_state, "update": self.update,
                "gathered_params": self.gathered_params, "activations": self.activations, "logits": self.logits, "stash": self.stash,
                "pipeline": self.pipeline, "total": self.total,
                "device_bytes": self.device_bytes, "usable_fraction": self.usable_fraction, "fits": self.fits}


def local_elements(shape: tuple[int, ...], axes: tuple[str | None, ...], rules, sizes: Mapping[str, int]) -> int:
    """Elements of one device's shard of an array with logical ``axes`` under ``rules`` on mesh ``sizes``.

    Uses :func:`jaxpt.mesh.logical_to_spec` (a mesh axis shards at most one dimension; first use wins),
    and rounds each shard dimension up, as XLA pads uneven shards.
    """
    spec = mesh_lib.logical_to_spec(axes, rules)
    n = 1
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n *= -(-dim // math.prod(sizes.get(a, 1) for a in names))
    return n


def compute_rules(rules):
    """The rules with the batch's mesh axes removed from every other logical axis: how weights are laid
    out when a matmul uses them. Under FSDP (ZeRO-3, Rajbhandari et al. 2020) a weight is *stored*
    sharded over ``fsdp`` and all-gathered over it for compute; tensor-parallel axes stay sharded."""
    batch_axes = set(mesh_lib._rules_dict(rules).get("batch", ()))
    out = []
    for logical, mesh_axes in rules:
        names = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        # Experts are computed where they are stored (the tokens travel to them), never gathered.
        kept = tuple(a for a in names if logical in ("batch", "exp") or a not in batch_axes)
        out.append((logical, kept or None))
    return tuple(out)


def param_elements(cfg: ModelConfig, rules, sizes) -> tuple[int, int, int]:
    """``(stored, gathered_compute, gathered_lookup)`` per-device parameter elements, from the real param
    tree's shapes and logical axes (no arrays allocated).

    ``gathered_compute`` counts the all-gathered copies, in their compute layout (:func:`compute_rules`),
    of the matmul weights whose stored layout differs from it. ``gathered_lookup`` is the embedding
    table, which :class:`jaxpt.model.Decoder` replicates whole for the token lookup (in the param dtype)
    unless it is already replicated.

    With scanned layers and a remat policy, the blocks' gathered weights are counted for two layers (the one
    computing and the next one's gather in flight), not all: XLA then gathers inside the loop, once per layer
    per pass. Measured with ``python -m jaxpt.tools.compile``: Llama-3-8B on v5p-128 compiles to 12.5 GiB per chip,
    where counting every layer's gathered bf16 weights alone would be 14 GiB.
    """

    _, params = abstract_model(cfg)
    c_rules = compute_rules(rules)
    per_layer = cfg.scan_layers and cfg.remat_policy != "none"
    block_share = min(2, cfg.num_layers) / cfg.num_layers if per_layer else 1.0
    stored = gathered = lookup = 0
    for path, var in _variables_with_paths(params):
        axes, shape = tuple(var.get_metadata()["logical_axes"]), tuple(var.shape)
        s = local_elements(shape, axes, rules, sizes)
        stored += s
        if "embedding" in path:
            lookup += math.prod(shape) if s != math.prod(shape) else 0
        else:
            g = local_elements(shape, axes, c_rules, sizes)
            gathered += (g if g != s else 0) * (block_share if "blocks" in path else 1.0)
    return stored, int(gathered), lookup


def optimizer_state_elements(cfg: ModelConfig, rules, sizes, algorithm: str = "adamw") -> int:
    """Per-device elements of the optimizer state's param-shaped moments (before ZeRO-1's split): AdamW keeps two
    per parameter (``mu``, ``nu``); under ``OptimizerConfig.algorithm = 'muon'`` a matrix Muon updates keeps one
    (its momentum) and every other parameter AdamW's two (:func:`jaxpt.training.optim.muon_parameter_groups`)."""
    import jax
    _, params = abstract_model(cfg)
    labels = None
    if algorithm == "muon":  # the labels' leaves come in the order _variables_with_paths walks the variables
        labels = jax.tree_util.tree_leaves(optim.muon_parameter_groups(params)[0])
    total = 0
    for i, (_, var) in enumerate(_variables_with_paths(params)):
        s = local_elements(tuple(var.shape), tuple(var.get_metadata()["logical_axes"]), rules, sizes)
        total += s * (1 if labels is not None and labels[i] == "muon" else 2)
    return total


def _variables_with_paths(params):
    """``[(path names, nnx.Variable)]`` of a params state."""
    import jax
    from flax import nnx
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path), v)
            for path, v in leaves]


def _layer_activations(cfg: ModelConfig, batch: int, seq_len: int):
    """Tensors one block produces, per the model code: the block's own (norms, projections, residuals) and
    those its attention implementation and MLP declare (``saved_tensors`` of their entries in
    :mod:`jaxpt.model.tables`).

    Returns ``[SavedTensor(name, kind, needed, shape, logical axes, bytes per element)]`` where kind is
    ``input`` (the block input, kept by every policy), ``dot`` (a weight matmul output), ``dot_batch`` (an
    attention einsum output, whose operands both carry the batch) or ``other``; ``needed`` marks what the
    plain backward pass reads (the rest is only kept when a remat policy saves it).
    """
    B, L, D, H, K, Hd = batch, seq_len, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    c = DTYPE_BYTES[cfg.compute_dtype]
    bld, blhd, blkd = ("batch", "length", "embed"), ("batch", "length", "heads", None), \
        ("batch", "length", "kv_heads", None)
    return [
        # name, kind, needed-by-plain-backward, shape, logical axes, bytes
        T("x_in", "input", True, (B, L, D), bld, c),
        T("attn_norm", "other", True, (B, L, D), bld, c),
        T("q", "dot", True, (B, L, H, Hd), blhd, c),
        T("k", "dot", True, (B, L, K, Hd), blkd, c),
        T("v", "dot", True, (B, L, K, Hd), blkd, c),
        # ModelConfig.qk_norm: the normalized q and k beside the projections the norm's backward reads.
        *([T("q_normed", "other", True, (B, L, H, Hd), blhd, c),
           T("k_normed", "other", True, (B, L, K, Hd), blkd, c)] if cfg.qk_norm else []),
        *tables.attention(cfg.attention_impl).saved_tensors(cfg, batch, seq_len),
        T("attn_proj", "dot", False, (B, L, D), bld, c),
        T("x_mid", "other", True, (B, L, D), bld, c),
        T("mlp_norm", "other", True, (B, L, D), bld, c),
        *tables.mlp(cfg.mlp).saved_tensors(cfg, batch, seq_len),
        T("mlp_proj", "dot", False, (B, L, D), bld, c),
    ]


def _saved_by_policy(policy: str, name: str, kind: str, needed: bool) -> bool:
    """Whether a block tensor stays alive from the forward to the backward pass under ``policy``.

    Policies are those of :func:`jaxpt.model.decoder._remat_policy` (``jax.checkpoint_policies``).
    ``save_qkv_proj`` is counted as documented: q, k and v kept (tagged ``checkpoint_name('qkv_proj')`` in
    :class:`jaxpt.model.attention.Attention`). XLA:CPU's compiled temp memory under it still measures
    within a few KiB of ``full`` (4-layer test model), so on CPU this estimate is high by the q/k/v bytes.
    """
    if kind == "input":
        return True
    if policy == "none":
        return needed
    if policy == "dots":
        return kind in ("dot", "dot_batch")
    if policy == "dots_no_batch":
        return kind == "dot"
    if policy == "save_qkv_proj":
        return name in ("q", "k", "v")
    return False  # full


@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """How :mod:`jaxpt.model.pipeline` runs the layers on a mesh: ``stages`` S, ``microbatches`` M, ``repeats``
    R, ``layers_per_group`` K = N / (S R), ``iterations`` T = M R + S - 1 (every stage runs its K-layer group
    T times, M R of them on real micro-batches: the rest is the bubble)."""

    stages: int
    microbatches: int
    repeats: int
    layers_per_group: int
    iterations: int

    @property
    def bubble_fraction(self) -> float:
        """``(S - 1) / (M R + S - 1)`` (:func:`jaxpt.model.pipeline.bubble_fraction`)."""
        return (self.stages - 1) / self.iterations

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "bubble_fraction": self.bubble_fraction}


def pipeline_shape(cfg: ModelConfig, sizes: Mapping[str, int]) -> PipelineShape | None:
    """The :class:`PipelineShape` of ``cfg`` on mesh ``sizes``, or None without stages (``stage`` = 1)."""
    S = sizes.get(mesh_lib.PIPELINE_AXIS, 1)
    if S == 1:
        return None
    M, R = cfg.pipeline_microbatches or S, cfg.pipeline_repeats
    return PipelineShape(S, M, R, cfg.num_layers // (S * R), M * R + S - 1)


def activation_bytes(cfg: ModelConfig, batch: int, seq_len: int, rules, sizes: Mapping[str, int]) -> int:
    """Per-device bytes of activations held for the backward pass under ``cfg.remat_policy``.

    Method (the per-layer accounting of Korthikanti et al. 2022, "Reducing Activation Recomputation in
    Large Transformer Models", sec. 4, applied to this model: RMSNorm, GQA, fp32 softmax, SwiGLU, no
    dropout): sum, over the tensors of :func:`_layer_activations` that the policy keeps, of their
    per-device shard bytes, times ``num_layers``; with any remat policy, add one block's full set for the
    block being recomputed in the backward pass. Plus the final norm's input and output.

    Pipelined (mesh ``stage`` > 1, :func:`pipeline_shape`): per stage, ``T x K`` layer passes over one
    micro-batch of ``B / M`` rows each (the in-flight micro-batches' stash, bubble iterations included), in
    place of ``N`` layers over ``B`` rows; the remat block is one micro-batch's.
    """
    layer = _layer_activations(cfg, batch, seq_len)

    def nbytes(entries):
        return sum(local_elements(shape, axes, rules, sizes) * b for _, _, _, shape, axes, b in entries)

    policy = cfg.remat_policy
    kept = [e for e in layer if _saved_by_policy(policy, e[0], e[1], e[2])]
    pipe = pipeline_shape(cfg, sizes)
    if pipe is None:
        total = cfg.num_layers * nbytes(kept)
        if policy != "none":
            total += nbytes([e for e in layer if e[2]])
    else:
        # Per stage: every one of its T iterations keeps its K layers' tensors of one micro-batch for the
        # backward pass (bubble iterations too: the scan saves them), i.e. N/S layers x B rows x
        # (1 + (S - 1) / (M R)): the stash of the in-flight micro-batches.
        micro = _layer_activations(cfg, batch // pipe.microbatches, seq_len)
        kept_m = [e for e in micro if _saved_by_policy(policy, e[0], e[1], e[2])]
        total = pipe.iterations * pipe.layers_per_group * nbytes(kept_m)
        if policy != "none":
            total += nbytes([e for e in micro if e[2]])
    final = ("final", "other", True, (batch, seq_len, cfg.d_model), ("batch", "length", "embed"),
             DTYPE_BYTES[cfg.compute_dtype])
    return total + 2 * nbytes([final])


def pipeline_buffer_bytes(cfg: ModelConfig, batch: int, seq_len: int, rules, sizes: Mapping[str, int]) -> int:
    """Per-stage bytes of the pipeline's own buffers (0 without stages): the ``M`` micro-batches' inputs and
    the circulating buffer stage 0 refills from the last stage, each ``[B, L, D]`` in the compute dtype, and,
    for the circular schedule (``R > 1``), the stage's layer groups gathered from the ``[N, ...]`` stored layout
    (a stage's layers are not contiguous there; :mod:`jaxpt.model.pipeline`)."""
    pipe = pipeline_shape(cfg, sizes)
    if pipe is None:
        return 0
    x = local_elements((batch, seq_len, cfg.d_model), ("batch", "length", "embed"), rules, sizes)
    regroup = 0
    if pipe.repeats > 1 and cfg.scan_layers:
        regroup = count_params(cfg)["blocks"] // pipe.stages * DTYPE_BYTES[cfg.param_dtype]
        regroup //= math.prod(sizes.get(a, 1) for a in ("fsdp", "tensor"))
    return 2 * x * DTYPE_BYTES[cfg.compute_dtype] + regroup


def logits_bytes(cfg: ModelConfig, batch: int, seq_len: int, rules, sizes: Mapping[str, int]) -> int:
    """Per-device bytes of the fp32 logits and their gradient, alive together at the loss (``2 B L V`` x 4,
    divided by the shards of ``batch`` and ``vocab``); with ``cfg.loss_chunk_size`` only one chunk's
    (``2 B chunk V`` x 4: :func:`jaxpt.training.step.chunked_token_losses`)."""
    rows = min(cfg.loss_chunk_size, seq_len) if cfg.loss_chunk_size else seq_len
    return 2 * 4 * local_elements((batch, rows, cfg.vocab_size), ("batch", "length", "vocab"), rules, sizes)


def zero_factor(rules, sizes: Mapping[str, int]) -> int:
    """How many ways ``TrainConfig.shard_optimizer_state`` (ZeRO-1) splits the optimizer state and the update beyond
    the params' own sharding: the product of the data-parallel axes (those of ``batch`` and ``length``) that the
    ``embed`` rule (FSDP) does not already use (:func:`jaxpt.training.state.zero_sharding`). An estimate: it assumes every
    param has a dimension that product divides (true of the usual power-of-two shapes)."""
    table = _rules_dict(rules)
    axes = {a for logical in ("batch", "length") for a in table.get(logical, ())} - set(table.get("embed", ()))
    return math.prod(sizes.get(a, 1) for a in axes)


def estimate_memory(cfg, sizes: Mapping[str, int], device_bytes: float | None = None,
                    usable_fraction: float = 0.9) -> MemoryEstimate:
    """Per-device memory of one train step of ``cfg`` (a :class:`jaxpt.config.TrainConfig`) on a mesh.

    Params are sharded by their logical axes and ``cfg.logical_axis_rules``; gradients have the params'
    shape, dtype and sharding; AdamW keeps two moments per param in the param dtype (optax ``adamw``
    with ``mu_dtype=None``), Muon one per matrix it updates (:func:`optimizer_state_elements`); the optimizer's update is one more param-sized tree, alive with the old
    params until the step commits (or skips) it. With ``TrainConfig.shard_optimizer_state`` the moments are split a
    further :func:`zero_factor` ways; the gradients and the update are not: the compiled step (XLA on CPU; measured
    in ``tests/test_plan.py``) keeps them whole-size as temporaries, all-reducing the gradients and slicing after.
    Weights sharded over the batch's axes (FSDP) are all-gathered for compute;
    their gathered copies (in the compute dtype) are counted for every layer at once, because XLA keeps
    the forward pass's gathered weights for the backward pass unless a remat policy makes it re-gather,
    which it does not reliably do. The embedding table is gathered whole for the lookup (see
    :func:`param_elements`). Activations: :func:`activation_bytes`; logits: :func:`logits_bytes`.
    Buffers XLA adds on its own (collective scratch, layout copies, fusion temporaries) are not
    modelled, so this is a floor; ``tests/test_plan.py`` checks it against ``memory_analysis()`` of the
    compiled quickstart step on 8 CPU devices.

    Args:
      cfg: train config with ``model.vocab_size`` resolved (> 0).
      sizes: resolved mesh sizes ``{axis: size}``.
      device_bytes: memory of one device, for :attr:`MemoryEstimate.fits` (None: unknown).
      usable_fraction: share of ``device_bytes`` a step may use (the runtime reserves the rest).

    Raises:
      ValueError: ``model.vocab_size`` not resolved.
    """
    m = cfg.model
    if m.vocab_size <= 0:
        raise ValueError("ModelConfig.vocab_size = 0: resolve it from the tokenizer first")
    rules = cfg.logical_axis_rules
    stored, gathered, lookup = param_elements(m, rules, sizes)
    p = stored * DTYPE_BYTES[m.param_dtype]
    pipe = pipeline_shape(m, sizes)
    z = zero_factor(rules, sizes) if getattr(cfg, "shard_optimizer_state", False) else 1
    return MemoryEstimate(
        stash=pipeline_buffer_bytes(m, cfg.global_batch_size, cfg.seq_len, rules, sizes),
        pipeline=None if pipe is None else pipe.as_dict(),
        params=p, grads=p, update=p,
        opt_state=optimizer_state_elements(m, rules, sizes, cfg.optimizer.algorithm) * DTYPE_BYTES[m.param_dtype] // z,
        gathered_params=gathered * DTYPE_BYTES[m.compute_dtype] + lookup * DTYPE_BYTES[m.param_dtype],
        activations=activation_bytes(m, cfg.global_batch_size, cfg.seq_len, rules, sizes),
        logits=logits_bytes(m, cfg.global_batch_size, cfg.seq_len, rules, sizes),
        device_bytes=device_bytes, usable_fraction=usable_fraction)
