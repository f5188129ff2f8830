"""The train state, its abstract (shape-only) form, its shardings, and sharded initialization.

Params and optimizer state are created already sharded: :func:`init_state` runs the initializer under
``jax.jit`` with ``out_shardings``, so no full copy is ever materialized on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpt import mesh as mesh_lib
from jaxpt.model import Decoder, ModelConfig
from jaxpt.training.stability import StabilityConfig, init_history
from jaxpt.util.errors import ConfigError


class TrainState(flax.struct.PyTreeNode):
    """Everything that changes during training.

    Attributes:
      step: int32 scalar, train steps taken (global batches consumed), skipped steps included.
      params: ``nnx.State`` of the model's ``nnx.Param`` leaves.
      opt_state: optax state for ``params``.
      rng: a ``jax.random`` key (uint32[2]) advanced each step, for stochastic parts of training.
      num_updates: int32 scalar, optimizer updates applied (= step minus skipped steps); indexes the
        learning-rate schedule.
      lr_scale: float32 scalar multiplying every update (1.0; damped by divergence rollbacks).
      stability: rolling loss / grad-norm history for spike detection (:mod:`jaxpt.training.stability`).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    num_updates: jax.Array
    lr_scale: jax.Array
    stability: Any


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """Static pieces for a run: the model's graph definition, the optimizer, and the state shardings.

    ``opt_state_device_shardings`` is None unless the optimizer state is offloaded to host memory
    (``TrainConfig.offload_optimizer_state``): then ``shardings.opt_state`` are ``pinned_host`` shardings
    (where the state lives between steps) and these are the same shardings in device memory (where the
    train step brings it for the update, :func:`jaxpt.training.step.train_step`).

    ``update_shardings`` is None unless the optimizer state is sharded over the data-parallel axes
    (``TrainConfig.shard_optimizer_state``, ZeRO-1/2): then it is a params-shaped tree of the shardings the
    update runs in (each param's sharding, further split over the data-parallel axes it is replicated on,
    :func:`zero_sharding`); the optimizer state is stored in them and the gradients are constrained to them.
    """

    graphdef: Any
    tx: optax.GradientTransformation
    abstract: TrainState          # ShapeDtypeStructs with ``.sharding`` set
    shardings: TrainState         # NamedSharding per leaf
    stability: StabilityConfig
    opt_state_device_shardings: Any = None
    update_shardings: Any = None


#: The memory kind offloaded optimizer state lives in: host RAM the accelerator can DMA from directly.
HOST_MEMORY = "pinned_host"


def check_host_offload(mesh: Mesh) -> None:
    """Raise unless every device of ``mesh`` in this process has :data:`HOST_MEMORY` memory (TPU, GPU and, in
    jax 0.10.2, the CPU backend and compile-only TPU topology devices do).

    Raises:
      ConfigError: naming ``TrainConfig.offload_optimizer_state`` and the platform.
    """
    flat = list(mesh.devices.flat)
    # Only this process's devices show their memories (a compile-only topology's other hosts show none).
    local = [d for d in flat if d.process_index == jax.process_index()] or flat[:1]
    for d in local:
        try:
            kinds = {m.kind for m in d.addressable_memories()}
        except Exception:  # noqa: BLE001 - some backends do not implement memory spaces at all
            kinds = set()
        if HOST_MEMORY not in kinds:
            raise ConfigError(f"TrainConfig.offload_optimizer_state = True: {d.platform} device {d.id} has no "
                              f"{HOST_MEMORY!r} memory (its memories: {sorted(kinds) or 'none'})")


def _logical_axes_of(var: nnx.Variable) -> tuple:
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
        raise ValueError(f"parameter of shape {var.shape} has no logical_axes metadata")
    if len(axes) != len(var.shape):
        raise ValueError(f"parameter of shape {var.shape} has logical axes {axes} of a different rank")
    return tuple(axes)


def param_shardings(abstract_params: Any, mesh: Mesh, rules) -> Any:
    """NamedSharding for every param, from its ``logical_axes`` metadata and the rules."""
    return jax.tree.map(
        lambda v: v.replace(mesh_lib.named_sharding(mesh, _logical_axes_of(v), rules)),
        abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def zero_axes(mesh: Mesh, rules) -> tuple[str, ...]:
    """Mesh axes (size > 1) over which every device computes the same update unless the optimizer is sharded:
    those the ``batch`` and ``length`` logical axes map to (data parallelism, context parallelism; by the
    default rules ``data``, ``fsdp``, ``expert``, ``sequence``). A param sharded over one of them (FSDP's
    ``embed`` over ``fsdp``) is already split there; :func:`zero_sharding` adds only the others."""
    table = mesh_lib._rules_dict(rules)  # noqa: SLF001 - the same first-rule-wins reading as the specs
    axes = []
    for logical in ("batch", "length"):
        axes += [a for a in table.get(logical, ()) if a not in axes and mesh.shape[a] > 1]
    return tuple(axes)


def zero_sharding(sharding: NamedSharding, shape: tuple[int, ...], axes: tuple[str, ...]) -> NamedSharding:
    """``sharding`` (of an array of ``shape``) further split over the mesh ``axes`` it does not use yet: the layout
    of a param's optimizer state and update under ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
    Toward Training Trillion Parameter Models", stage 1: optimizer state partitioned over data parallelism).

    The new axes go on the dimension with the most elements per shard that their product still divides (after
    the axes already on that dimension, so a param sharded over ``fsdp`` is gathered from its ZeRO shards within
    each ``fsdp`` block). An array no dimension of which they divide (a scalar, an odd size) keeps ``sharding``:
    it stays replicated over them, which costs memory but not correctness.
    """
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {a for entry in spec for a in _spec_axes(entry)}
    extra = tuple(a for a in axes if a not in used)
    if not extra:
        return sharding
    mesh = sharding.mesh
    n = int(np.prod([mesh.shape[a] for a in extra]))
    best, best_local = None, 0
    for d, size in enumerate(shape):
        k = int(np.prod([mesh.shape[a] for a in _spec_axes(spec[d])]))
        if size % (k * n) == 0 and size // k > best_local:
            best, best_local = d, size // k
    if best is None:
        return sharding
    joined = _spec_axes(spec[best]) + extra
    spec[best] = joined[0] if len(joined) == 1 else joined
    while spec and spec[-1] is None:
        spec.pop()
    return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def abstract_model(cfg: ModelConfig) -> tuple[Any, Any]:
    """``(graphdef, abstract params)`` without allocating any array."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def make_state_spec(model_cfg: ModelConfig, tx_factory, mesh: Mesh, rules,
                    stability_cfg: StabilityConfig | None = None, *,
                    offload_optimizer_state: bool = False, shard_optimizer_state: bool = False) -> StateSpec:
    """Build the abstract train state and its shardings.

    Args:
      model_cfg: resolved model config (vocab size known).
      tx_factory: ``params -> optax.GradientTransformation`` (needs the params tree for the decay mask).
      mesh, rules: where and how to shard.
      stability_cfg: sizes the spike-detection history (default :class:`StabilityConfig`).
      offload_optimizer_state: keep every optimizer-state leaf in ``pinned_host`` memory between steps
        (same sharding, host memory kind); the device shardings are kept in
        ``StateSpec.opt_state_device_shardings``.
      shard_optimizer_state: ZeRO-1/2: store each param's optimizer state split over the data-parallel axes
        (:func:`zero_axes`) it is replicated on (:func:`zero_sharding`); the update runs on those shards
        (``StateSpec.update_shardings``) and the params are all-gathered after it. Per device, the optimizer
        state of a param replicated over ``N`` data-parallel devices shrinks ``N``-fold.

    Raises:
      ConfigError: ``offload_optimizer_state`` and the mesh's devices have no ``pinned_host`` memory
        (naming ``TrainConfig.offload_optimizer_state``).
    """
    stability_cfg = stability_cfg or StabilityConfig()
    graphdef, abs_params = abstract_model(model_cfg)
    tx = tx_factory(abs_params)
    p_shard = param_shardings(abs_params, mesh, rules)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Optimizer leaves that mirror a param (Adam moments, Muon's momentum) take its sharding; scalars (counts)
    # replicate. Inside ``optax.partition`` (Muon) a group's params-shaped state holds ``optax.MaskedNode`` (no array)
    # for the other group's params: it stays as it is.
    u_shard = None
    if shard_optimizer_state:
        axes = zero_axes(mesh, rules)
        u_shard = jax.tree.map(lambda s, a: zero_sharding(s, a.shape, axes), p_shard, abs_params)
    o_shard = optax.tree_map_params(
        tx, lambda v, s: s if jax.tree.leaves(v) else v, abs_opt, p_shard if u_shard is None else u_shard,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, nnx.Variable))
    o_device = None
    if offload_optimizer_state:
        check_host_offload(mesh)
        o_device, o_shard = o_shard, jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), o_shard)
    abs_hist = jax.eval_shape(lambda: init_history(stability_cfg))
    shardings = TrainState(step=replicated, params=p_shard, opt_state=o_shard, rng=replicated,
                           num_updates=replicated, lr_scale=replicated,
                           stability=jax.tree.map(lambda _: replicated, abs_hist))
    abs_state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=abs_params, opt_state=abs_opt,
        rng=jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
        num_updates=jax.ShapeDtypeStruct((), jnp.int32), lr_scale=jax.ShapeDtypeStruct((), jnp.float32),
        stability=abs_hist)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abs_state, shardings)
    return StateSpec(graphdef=graphdef, tx=tx, abstract=abstract, shardings=shardings,
                     stability=stability_cfg, opt_state_device_shardings=o_device, update_shardings=u_shard)


def init_state(spec: StateSpec, model_cfg: ModelConfig, seed: int) -> TrainState:
    """Initialize params and optimizer state directly into their shardings (``jit`` + ``out_shardings``)."""

    def init():
        model = Decoder(model_cfg, rngs=nnx.Rngs(params=seed))
        _, params = nnx.split(model, nnx.Param)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=spec.tx.init(params),
                          rng=jax.random.key_data(jax.random.key(seed + 1)),
                          num_updates=jnp.zeros((), jnp.int32), lr_scale=jnp.ones((), jnp.float32),
                          stability=init_history(spec.stability))

    return jax.jit(init, out_shardings=spec.shardings)()


def replicated_param_fraction(spec: StateSpec) -> float:
    """Fraction of parameter bytes that are fully replicated under the state's shardings."""
    pairs = zip(jax.tree.leaves(spec.shardings.params), jax.tree.leaves(spec.abstract.params))
    return mesh_lib.replicated_fraction(pairs)


def num_params(spec: StateSpec) -> int:
    """Total parameter count of the abstract state."""
    return sum(int(x.size) for x in jax.tree.leaves(spec.abstract.params))
