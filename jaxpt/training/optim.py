"""Optimizer: optax AdamW or Muon, learning-rate schedules, global-norm clipping, weight-decay mask."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from optax.contrib import _muon as optax_muon

from jaxpt import mesh as mesh_lib
from jaxpt.util.errors import ConfigError
from jaxpt.util.validation import check_types, non_negative, positive, require

Schedule = Literal["cosine", "wsd", "constant"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
Algorithm = Literal["adamw", "muon"]
ALGORITHMS: tuple[str, ...] = typing.get_args(Algorithm)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (Loshchilov & Hutter 2019), or Muon for the matrices, with warmup and a decay schedule.

    Attributes:
      algorithm: ``adamw`` (every parameter), or ``muon``: Muon (Jordan et al. 2024, "Muon: An optimizer for
        hidden layers in neural networks") for the matrix parameters of the blocks (attention ``wq``/``wk``/``wv``/
        ``wo``, MLP and expert ``w_gate``/``w_up``/``w_down``), AdamW with this config's ``b1``, ``b2``, ``eps`` for
        the rest (embedding, untied output, router, norm scales, biases), as the method prescribes
        (:func:`muon_parameter_groups`). With ``muon_consistent_rms > 0`` each Muon update is scaled to AdamW's
        typical update RMS (Liu et al. 2025, "Muon is Scalable for LLM Training", sec. 2.2), so both groups share
        ``peak_learning_rate``, the schedule and ``weight_decay`` (decoupled, ``lr * wd * param``, same mask).
      muon_momentum: Muon's momentum coefficient (Nesterov, as in Jordan et al. and optax); 0.95 by default.
      muon_ns_steps: Newton-Schulz iterations that orthogonalize the momentum (quintic, Jordan et al.'s
        coefficients); 5 by default.
      muon_consistent_rms: the target RMS of a Muon update before the learning rate: the orthogonalized update is
        scaled by ``muon_consistent_rms * sqrt(max(fan_in, fan_out))`` (Liu et al. 2025, eq. 4: 0.2 matches AdamW's
        update RMS). 0 uses Jordan et al.'s scaling ``sqrt(max(1, fan_out / fan_in))`` instead, whose learning
        rate is not AdamW's (Jordan et al. use about 0.02).
      peak_learning_rate: learning rate at the end of warmup.
      schedule: ``cosine`` (linear warmup, then cosine to ``min_lr_ratio * peak`` at ``decay_steps``),
        ``wsd`` (warmup-stable-decay, Hu et al. 2024 "MiniCPM": linear warmup, constant, then a linear
        decay over the last ``wsd_decay_fraction`` of ``decay_steps`` to ``min_lr_ratio * peak``), or
        ``constant`` (after warmup).
      warmup_steps: steps of linear warmup from 0.
      decay_steps: the step at which the schedule reaches its final value (usually the planned length of
        the run). Set it explicitly: with 0 the run's ``TrainConfig.steps`` is used, so resuming with a
        larger ``--steps`` would change the schedule of the steps already taken.
      min_lr_ratio: final learning rate as a fraction of the peak.
      wsd_decay_fraction: fraction of ``decay_steps`` spent in the WSD decay phase.
      b1, b2, eps: Adam moments' decay rates and epsilon.
      weight_decay: decoupled weight decay coefficient (applied as ``lr * wd * param``).
      decay_embeddings: whether the embedding table (and a tied output) gets weight decay. Off by default,
        as in GPT-NeoX/OLMo: decaying rarely-seen token rows shrinks them towards zero between updates.
      grad_clip_norm: clip the global gradient L2 norm to this value (0 disables).

    Raises:
      ConfigError: at construction, naming ``OptimizerConfig.<field> = <value>``: a wrong type, an unknown
        schedule, ``peak_learning_rate <= 0``, negative steps, ``weight_decay`` or ``grad_clip_norm``,
        ``min_lr_ratio`` outside [0, 1], ``wsd_decay_fraction`` outside (0, 1], ``b1``/``b2`` outside [0, 1)
        or ``eps <= 0``; an unknown ``algorithm``, ``muon_momentum`` outside [0, 1), ``muon_ns_steps < 1`` or
        ``muon_consistent_rms < 0``; with ``decay_steps`` set, phases that do not fit it (:func:`check_schedule`). (With
        ``decay_steps = 0`` the horizon is ``TrainConfig.steps``: :func:`jaxpt.config.validate` checks it.)
    """

    peak_learning_rate: float = 3e-3
    schedule: Schedule = "cosine"
    warmup_steps: int = 50
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    wsd_decay_fraction: float = 0.2
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    grad_clip_norm: float = 1.0
    algorithm: Algorithm = "adamw"
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_consistent_rms: float = 0.2

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "peak_learning_rate", "eps", "muon_ns_steps")
        non_negative(self, "warmup_steps", "decay_steps", "weight_decay", "grad_clip_norm", "muon_consistent_rms")
        require(self, "muon_momentum", 0 <= self.muon_momentum < 1, "must be in [0, 1)")
        require(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        require(self, "wsd_decay_fraction", 0 < self.wsd_decay_fraction <= 1, "must be in (0, 1]")
        for name in ("b1", "b2"):
            require(self, name, 0 <= getattr(self, name) < 1, "must be in [0, 1)")
        if self.decay_steps:  # the horizon is known: check the phases now (else validate does, with the steps)
            check_schedule(self, self.decay_steps)


def wsd_decay_length(cfg: OptimizerConfig, total_steps: int) -> int:
    """Steps of the WSD decay phase: ``round(wsd_decay_fraction * T)``, at least 1 (``T``: the horizon)."""
    return max(int(round(cfg.wsd_decay_fraction * total_steps)), 1)


def check_schedule(cfg: OptimizerConfig, total_steps: int) -> None:
    """Refuse a schedule whose phases do not fit its horizon ``T`` (``decay_steps``, else ``total_steps``).

    ``cosine`` needs ``warmup_steps < T`` (with ``warmup_steps == T`` the floor is never reached: LR(T) would be
    the peak); ``wsd`` needs ``warmup_steps + round(wsd_decay_fraction * T) <= T`` (else the decay starts late
    and the floor is reached after ``T``); ``constant`` needs ``warmup_steps <= T``.

    Raises:
      ConfigError: naming the keys (``OptimizerConfig.warmup_steps``, ``decay_steps``, ``wsd_decay_fraction``,
        or ``TrainConfig.steps`` when ``decay_steps`` is 0) and the values.
    """
    total = cfg.decay_steps or total_steps
    horizon = (f"OptimizerConfig.decay_steps = {cfg.decay_steps}" if cfg.decay_steps else
               f"TrainConfig.steps = {total_steps} (OptimizerConfig.decay_steps = 0)")
    w = cfg.warmup_steps
    if cfg.schedule == "cosine" and w >= total:
        raise ConfigError(f"OptimizerConfig.warmup_steps = {w} must be below the decay horizon {horizon}: a "
                          "cosine schedule needs steps left to decay to the floor")
    if cfg.schedule == "constant" and w > total:
        raise ConfigError(f"OptimizerConfig.warmup_steps = {w} exceeds the horizon {horizon}")
    if cfg.schedule == "wsd":
        d = wsd_decay_length(cfg, total)
        if w + d > total:
            raise ConfigError(
                f"OptimizerConfig.warmup_steps = {w} plus the WSD decay of {d} steps (OptimizerConfig."
                f"wsd_decay_fraction = {cfg.wsd_decay_fraction} of {total}) exceed the decay horizon {horizon}: "
                f"warmup and decay would overlap; shorten warmup or the decay fraction")


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The schedule as a function of the optimizer's update count (0-based: step ``s`` uses ``lr(s)``).

    Formulas (``p`` = peak, ``w`` = warmup, ``T`` = decay_steps or ``total_steps``, ``m`` = min_lr_ratio,
    ``d = max(round(wsd_decay_fraction * T), 1)``):
      warmup (``s < w``): ``p * s / w``.
      constant: ``p`` for ``s >= w``.
      cosine: ``p * (m + (1 - m) * 0.5 * (1 + cos(pi * (s - w) / (T - w))))`` for ``w <= s <= T``, then ``m * p``.
      wsd: ``p`` for ``w <= s <= T - d``, then ``p - (p - m * p) * (s - (T - d)) / d`` to ``m * p`` at ``T``, then
        ``m * p`` (Hu et al. 2024, sec. 4).

    Raises:
      ConfigError: (a ValueError) the phases do not fit the horizon (:func:`check_schedule`). An unknown schedule
        cannot reach here: :class:`OptimizerConfig` refuses it at construction.
    """
    check_schedule(cfg, total_steps)
    total = cfg.decay_steps or total_steps
    peak, floor = cfg.peak_learning_rate, cfg.peak_learning_rate * cfg.min_lr_ratio
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    if cfg.schedule == "constant":
        rest = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        rest = optax.cosine_decay_schedule(peak, total - cfg.warmup_steps, alpha=cfg.min_lr_ratio)
    else:
        decay = wsd_decay_length(cfg, total)
        rest = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
            [total - cfg.warmup_steps - decay])
    return optax.join_schedules([warmup, rest], [cfg.warmup_steps])


def _path_names(path) -> tuple[str, ...]:
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
    return tuple(names)


def weight_decay_mask(params: Any, decay_embeddings: bool = False) -> Any:
    """Pytree of bools: True where weight decay applies.

    Norm scales and biases never decay: any leaf of rank <= 1, and by name (a path element ``scale``, ``bias``
    or ending in ``_bias``) the stacked [layers, ...] ones of scanned layers and the per-head q/k/v biases
    [H, Hd] of ``ModelConfig.attention_bias``. The embedding table (and the output projection when tied, which
    *is* the embedding) decays only if ``decay_embeddings``; every other matrix decays.
    """
    def decide(path, leaf) -> bool:
        names = _path_names(path)
        if jnp.ndim(leaf) <= 1 or "scale" in names or any(n == "bias" or n.endswith("_bias") for n in names):
            return False
        if "embedding" in names:
            return decay_embeddings
        return True
    return jax.tree_util.tree_map_with_path(decide, params)


#: Muon's matrices by parameter name: ``(reduction axes, output axes, rank)`` with the axes counted from the end
#: (``optax.contrib.MuonDimensionNumbers``) and the rank without leading batch axes. Attention ``wq``/``wk``/``wv``
#: [D, heads, head_dim]: D in, heads x head_dim out; ``wo`` [heads, head_dim, D]; MLP ``w_gate``/``w_up`` [D, F],
#: ``w_down`` [F, D] (jaxpt/model/attention.py, mlp.py, moe.py). Up to :data:`_MUON_BATCH_AXES` leading axes (the
#: ``layers`` axis of ``ModelConfig.scan_layers``, the ``exp`` axis of MoE experts) are batch axes: each slice is
#: orthogonalized on its own.
_MUON_MATRICES = {
    "wq": ((-3,), (-2, -1), 3), "wk": ((-3,), (-2, -1), 3), "wv": ((-3,), (-2, -1), 3),
    "wo": ((-3, -2), (-1,), 3),
    "w_gate": ((-2,), (-1,), 2), "w_up": ((-2,), (-1,), 2), "w_down": ((-2,), (-1,), 2),
}
_MUON_BATCH_AXES = 2
#: Parameters AdamW updates under ``algorithm = 'muon'`` (besides biases: ``bias`` or ``*_bias``).
_ADAMW_NAMES = ("embedding", "output", "w_router", "scale")


def _muon_dims(path, leaf) -> optax.contrib.MuonDimensionNumbers | None:
    """Muon's dimension numbers for one parameter, None for one AdamW updates; ConfigError for any other."""
    names = [n for n in _path_names(path) if n != "value"]
    name, shape, where = names[-1] if names else "", tuple(jnp.shape(leaf)), "/".join(names)
    if name in _ADAMW_NAMES or name == "bias" or name.endswith("_bias"):
        return None
    if name in _MUON_MATRICES:
        reduction, output, rank = _MUON_MATRICES[name]
        if rank <= len(shape) <= rank + _MUON_BATCH_AXES:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)
        raise ConfigError(f"OptimizerConfig.algorithm = 'muon': parameter {where} has shape {shape}, not the "
                          f"[..., {rank} axes] of a {name} matrix (at most {_MUON_BATCH_AXES} leading batch axes)")
    raise ConfigError(
        f"OptimizerConfig.algorithm = 'muon': cannot tell whether parameter {where} (shape {shape}) is a matrix for "
        f"Muon ({', '.join(_MUON_MATRICES)}) or a parameter for AdamW ({', '.join(_ADAMW_NAMES)}, biases); add its "
        "name to jaxpt.training.optim, or use OptimizerConfig.algorithm = 'adamw'")


def muon_parameter_groups(params: Any) -> tuple[Any, Any]:
    """Which parameters Muon updates, and how each is seen as a matrix.

    Decided by the parameter's name (its last path element): the matrices of :data:`_MUON_MATRICES` go to Muon,
    with their reduction and output axes; the embedding, the untied ``output``, the MoE ``w_router``, norm
    ``scale``s and biases go to AdamW, as Muon prescribes (Jordan et al. 2024: Muon for hidden-layer matrices
    only). Shapes only are read: ``params`` may hold arrays or ``ShapeDtypeStruct``s.

    Returns:
      ``(labels, dims)``: params-shaped trees; ``labels`` holds ``'muon'`` or ``'adamw'``, ``dims`` an
      ``optax.contrib.MuonDimensionNumbers`` for a Muon leaf and ``optax.MaskedNode()`` for an AdamW one (the
      structure of the masked updates Muon sees inside ``optax.partition``).

    Raises:
      ConfigError: naming ``OptimizerConfig.algorithm = 'muon'`` and the parameter's path and shape, for a
        parameter of another name (a user-registered layer's) or a Muon matrix of an unexpected rank.
    """
    dims = jax.tree_util.tree_map_with_path(lambda p, x: _muon_dims(p, x) or optax.MaskedNode(), params)
    labels = jax.tree_util.tree_map_with_path(lambda p, x: "adamw" if _muon_dims(p, x) is None else "muon",
                                              params)
    return labels, dims


def _layer_padded(x: jax.Array, dims: Any, mesh: Any, rules: Any) -> jax.Array:
    """``x`` (a stacked matrix ``[layers, (experts,) ...matrix axes]``) padded with zeros along its layer axis and
    sharded there over the mesh axes, its matrix axes whole on each device.

    An experts axis (a second leading axis) keeps the mesh axes ``rules`` give the logical ``exp`` axis (those of
    size > 1 whose product divides it); the layer axis takes every other mesh axis and is padded to a multiple of
    their product. Moving the experts too would make XLA gather every expert onto every device on the way.
    An unstacked matrix (no leading batch axis) is returned as it is; an unstacked MoE matrix ``[experts, ...]``
    is split along its experts as a stack."""
    reduction, output = optax_muon._normalize_axes(x, dims)  # noqa: SLF001 - optax's own reading of dims
    batch = x.ndim - len(reduction) - len(output)
    if batch == 0:
        return x
    sizes = mesh_lib.mesh_shape(mesh)
    inner: tuple[str, ...] = ()
    if batch > 1:
        entry = (tuple(mesh_lib.logical_to_spec(("exp",), rules, mesh)) or (None,))[0]
        named = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        inner = tuple(a for a in named if sizes[a] > 1)
        if x.shape[1] % math.prod(sizes[a] for a in inner):
            inner = ()
    outer = tuple(a for a in mesh.axis_names if a not in inner and sizes[a] > 1)
    pad = -x.shape[0] % math.prod(sizes[a] for a in outer)
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    lead = (outer or None, inner or None)[:min(batch, 2)]
    spec = jax.sharding.PartitionSpec(*lead, *([None] * (x.ndim - len(lead))))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def by_layer(inner: optax.GradientTransformation, dims: Any) -> optax.GradientTransformation:
    """``inner`` (Muon's momentum and Newton-Schulz orthogonalization) run with each stacked matrix split by layer.

    Under FSDP each matrix is split along a matrix axis, and Newton-Schulz needs it whole: left to XLA, every device
    gathers every stacked matrix (``[layers, d_model, mlp_dim]`` at once) and orthogonalizes all of them, so the
    per-device temporaries grow with the whole model and the work with the layer count (the per-chip figures for
    the presets before and after: docs/results/optimizers.md). Here the gradients and the momentum of each stacked matrix go to a layout split along
    the layer axis over every mesh axis (padded with zero matrices to a multiple of the device count), so each
    device orthogonalizes ``ceil(layers / devices)`` whole matrices per parameter, as distributed Muon does
    (Liu et al. 2025, "Muon is Scalable for LLM Training", sec. 2.3, gathers a whole matrix per update), and the
    momentum goes back to its own layout when the step stores it. The numbers are the same: a matrix is
    orthogonalized on one device in the order a single device would. Unstacked matrices (``scan_layers = False``)
    are left to XLA. Outside a traced step with a mesh (:func:`jaxpt.mesh.activation_sharding`), ``inner`` as is.

    Args:
      inner: ``optax.contrib.scale_by_muon`` (state ``MuonState(count, mu, ns_coeffs)``).
      dims: ``MuonDimensionNumbers`` per Muon leaf (:func:`muon_parameter_groups`).
    """

    def update(updates, state, params=None):
        ctx = mesh_lib.current_activation_sharding()
        if ctx is None or ctx[0].size == 1:
            return inner.update(updates, state, params)
        mesh, rules = ctx

        def pad(tree):  # a Muon leaf's dims is a subtree of dims where tree has an array: map gets it whole
            return jax.tree.map(lambda x, d: _layer_padded(x, d, mesh, rules), tree, dims)

        def unpad(tree, like):
            return jax.tree.map(lambda x, y: x[: y.shape[0]] if x.shape != y.shape else x, tree, like)

        out, new = inner.update(pad(updates), state._replace(mu=pad(state.mu)), None)
        return unpad(out, updates), new._replace(mu=unpad(new.mu, state.mu))

    return optax.GradientTransformation(inner.init, update)


def _muon(cfg: OptimizerConfig, schedule: optax.Schedule, params: Any, mask: Any,
          adamw: optax.GradientTransformation) -> optax.GradientTransformation:
    """``partition``: Muon for the matrices, ``adamw`` for the rest (:func:`muon_parameter_groups`).

    The Muon branch is ``optax.contrib.muon``'s (optax 0.2.8): ``scale_by_muon`` (Nesterov momentum, Newton-Schulz
    orthogonalization), ``scale_by_shape`` (consistent RMS, Liu et al. 2025 eq. 4), decoupled weight decay with
    ``mask``, then the learning rate. Not ``optax.contrib.muon`` itself: its AdamW branch decays every parameter (no
    mask) and shares Muon's Nesterov flag, which would change the AdamW group's update from jaxpt's AdamW.
    """
    labels, dims = muon_parameter_groups(params)
    muon = optax.chain(
        by_layer(optax.contrib.scale_by_muon(ns_steps=cfg.muon_ns_steps, beta=cfg.muon_momentum, eps=cfg.eps,
                                             weight_dimension_numbers=dims), dims),
        optax_muon.scale_by_shape(dims, consistent_rms=cfg.muon_consistent_rms or None),
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": muon, "adamw": adamw}, labels)


#: The refusal of µP's per-parameter learning rates under Muon (raised here and by :func:`jaxpt.run.validate.validate`).
MUP_WITH_MUON = ("OptimizerConfig.algorithm = 'muon' with ModelConfig.parametrization = 'mup': µP's learning-rate "
                 "table is for Adam-type updates, and Muon sets the size of its matrices' updates itself; use one of "
                 "the two")


#: The :class:`OptimizerConfig` settings that decide the optimizer state's tree structure, each with the part of its
#: value that does (``grad_clip_norm`` adds a chain element only when positive). A checkpoint's optimizer state
#: restores under another config only where these agree (:func:`state_layout`); tests/test_muon.py varies every
#: field to keep this table complete.
STATE_LAYOUT = {"algorithm": lambda v: v, "grad_clip_norm": lambda v: float(v) > 0}


def _settings_of(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (``{'OptimizerConfig.<field>': value}``) completed with the :class:`OptimizerConfig` defaults."""
    return {f.name: settings.get(f"OptimizerConfig.{f.name}", f.default) for f in dataclasses.fields(OptimizerConfig)}


def state_layout(settings: dict[str, Any]) -> dict[str, Any]:
    """``{'OptimizerConfig.<field>': what decides the state's structure}`` (:data:`STATE_LAYOUT`) of ``settings``
    (``{'OptimizerConfig.<field>': value}``, e.g. a checkpoint's saved gin bindings); a field missing from it takes
    the :class:`OptimizerConfig` default. Two configs whose layouts are equal build optimizer states of the same tree
    structure, so one's checkpointed state restores under the other."""
    values = _settings_of(settings)
    return {f"OptimizerConfig.{k}": part(values[k]) for k, part in STATE_LAYOUT.items()}


def state_layout_changes(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """``'OptimizerConfig.<field> = <saved> there, <ours> here'`` for each :data:`STATE_LAYOUT` setting on which
    ``saved`` and ``ours`` (``{'OptimizerConfig.<field>': value}``, defaults filled in) build optimizer states of
    different tree structures; empty when one's state restores under the other."""
    a, b = _settings_of(saved), _settings_of(ours)
    return [f"OptimizerConfig.{k} = {a[k]!r} there, {b[k]!r} here" for k, part in STATE_LAYOUT.items()
            if part(a[k]) != part(b[k])]


def make_optimizer(cfg: OptimizerConfig, total_steps: int, params: Any,
                   lr_multipliers: Any | None = None) -> optax.GradientTransformation:
    """``clip_by_global_norm -> adamw(schedule, mask) [-> scale each parameter's update]``; with ``cfg.algorithm =
    'muon'`` the AdamW is applied to the non-matrix parameters only and Muon to the matrices
    (:func:`muon_parameter_groups`), same schedule and mask.

    ``params`` (arrays or ``ShapeDtypeStruct``s with the real tree structure) is used only to build the
    weight-decay mask and the Muon groups. Note the mask is decided on rank, so stacked (scanned) norm scales of
    shape [layers, D] are recognized by name (``scale``) instead. ``lr_multipliers``: a params-shaped tree of floats
    multiplying each parameter's whole AdamW update, i.e. its learning rate and its decoupled decay (µP's
    ``lr / m`` for hidden matrices, :func:`jaxpt.model.parametrization.lr_multipliers`); None adds nothing, so
    the optimizer and its state are exactly the plain AdamW ones.

    Raises:
      ConfigError: ``algorithm = 'muon'`` and a parameter it cannot classify (:func:`muon_parameter_groups`), or
        with ``lr_multipliers`` (µP's table is for Adam-type updates; Muon sets its matrices' update size itself).
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    mask = weight_decay_mask(params, cfg.decay_embeddings)
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.algorithm == "muon":
        if lr_multipliers is not None:
            raise ConfigError(MUP_WITH_MUON)
        tx = _muon(cfg, schedule, params, mask, tx)
    if lr_multipliers is not None:
        tx = scale_updates(tx, lr_multipliers)
    if cfg.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
    return tx


def scale_updates(tx: optax.GradientTransformation, multipliers: Any) -> optax.GradientTransformation:
    """``tx`` whose every update leaf is multiplied by its float in ``multipliers`` (a params-shaped tree), in the
    update's dtype. The state is ``tx``'s own, unchanged in structure, so a checkpoint's optimizer state restores
    whether or not the multipliers are there (µP at its base width and SP hold the same state)."""
    def update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        scaled = jax.tree.map(lambda u, m: u if m == 1.0 else u * jnp.asarray(m, u.dtype), updates, multipliers)
        return scaled, state
    return optax.GradientTransformation(tx.init, update)
