"""Device mesh construction and logical-axis sharding.

Every parameter and every activation that matters carries *logical* axis names (``embed``, ``vocab``,
``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``exp``, ``layers``, ``batch``, ``length``). A rule list, set in
the config, maps each logical axis to zero, one or several *mesh* axes (``stage``, ``data``, ``fsdp``, ``tensor``,
``sequence``, ``expert``). This module is the only place where the two vocabularies meet.

``stage`` is the pipeline axis (:mod:`jaxpt.model.pipeline`): only the stacked ``layers`` axis of the weights
maps to it (each stage stores its share of the layer stack); the schedule moves activations along it.

The model calls :func:`constrain` on activations; outside an :func:`activation_sharding` context that call
is a no-op, so the model runs unsharded in a notebook exactly as it does under ``jax.jit`` on a mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
from typing import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

#: Mesh axes in the order they are laid out over devices (outermost first). ``stage`` and then ``data`` are
#: outermost so they land on the slowest links (DCN across slices): a pipeline sends one micro-batch's
#: activations per step between neighbours, the least traffic of any split; ``tensor`` is innermost, on the
#: fastest (ICI / NVLink).
MESH_AXES: tuple[str, ...] = ("stage", "data", "fsdp", "sequence", "expert", "tensor")

#: The pipeline-parallel mesh axis. It is used by the pipeline schedule (a ``shard_map`` over it) whenever its
#: size is > 1, whatever the rules say; among the rules only ``layers`` may map to it.
PIPELINE_AXIS = "stage"

#: Logical axis names the model uses.
LOGICAL_AXES: tuple[str, ...] = (
    "batch", "length", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp", "exp", "layers", "norm",
)

#: Default rules: FSDP (ZeRO-3) shards params on ``embed``; Megatron tensor parallelism shards ``heads``,
#: ``kv_heads``, ``mlp`` and ``vocab`` over ``tensor``; the batch goes over ``data``, ``fsdp`` and ``expert``; the
#: tokens of a row over ``sequence`` (context parallelism, :mod:`jaxpt.model.context_parallel`; no parameter has a
#: ``length`` axis, and at ``sequence=1`` the axis is dropped from every spec, so the program is unchanged);
#: the stacked layers over ``stage`` (a no-op unless the mesh has ``stage > 1``).
#: Expert parallelism (GShard, Lepikhin et al. 2021): expert weights are split over ``expert`` by their
#: ``exp`` axis, while everything outside the MoE layers treats ``expert`` as more data parallelism; inside
#: an MoE layer the tokens, batch-sharded over ``expert`` too, are exchanged all-to-all so each device gets
#: its experts' tokens (an array with both ``exp`` and ``batch`` gives ``expert`` to ``exp``, the first to
#: claim it, and shards ``batch`` over ``data`` x ``fsdp`` only).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("exp", "expert"),
    ("batch", ("data", "fsdp", "expert")),
    ("length", "sequence"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", "stage"),
    ("norm", None),
)

Rules = Sequence[tuple[str, str | Sequence[str] | None]]


class MeshError(ValueError):
    """A mesh specification that cannot be built on the devices present.

    Attributes:
      key: the ``TrainConfig`` field at fault: ``mesh`` (sizes within a slice) or ``dcn_mesh`` (across).
    """

    def __init__(self, message: str, key: str = "mesh"):
        super().__init__(message)
        self.key = key


def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """Parse ``"data=2,fsdp=2,tensor=2"`` (or a mapping) into ``{axis: size}``.

    Axes not named get size 1. One axis may be ``-1`` to take the remaining devices.

    Raises:
      MeshError: unknown axis name, malformed entry, non-positive size, or more than one ``-1``.
    """
    if isinstance(spec, str):
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise MeshError(f"mesh entry {part!r} is not of the form axis=size (in {spec!r})")
            name, value = (s.strip() for s in part.split("=", 1))
            try:
                sizes[name] = int(value)
            except ValueError:
                raise MeshError(f"mesh axis {name!r} has non-integer size {value!r} (in {spec!r})") from None
    else:
        sizes = dict(spec)
    for name, size in sizes.items():
        if name not in MESH_AXES:
            raise MeshError(f"unknown mesh axis {name!r}; known axes: {', '.join(MESH_AXES)}")
        if size == 0 or size < -1:
            raise MeshError(f"mesh axis {name!r} has size {size}; sizes are positive, or -1 for 'the rest'")
    if sum(1 for s in sizes.values() if s == -1) > 1:
        raise MeshError(f"at most one mesh axis may be -1, got {sizes}")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fill a ``-1`` axis and check that the product of sizes equals ``num_devices``.

    Raises:
      MeshError: the sizes do not multiply to the device count (or do not divide it, with ``-1``).
    """
    sizes = dict(sizes)
    known = math.prod(s for s in sizes.values() if s != -1)
    auto = [a for a, s in sizes.items() if s == -1]
    if auto:
        if num_devices % known:
            raise MeshError(
                f"mesh {format_mesh(sizes)}: the fixed axes (product {known}) do not divide the "
                f"{num_devices} devices, so -1 on {auto[0]!r} cannot be filled")
        sizes[auto[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise MeshError(
            f"mesh {format_mesh(sizes)} has {math.prod(sizes.values())} devices in all, but "
            f"{num_devices} devices are present (config key: mesh / --mesh)")
    return sizes


def format_mesh(sizes: Mapping[str, int]) -> str:
    """``{'data': 2, 'fsdp': 1, ...}`` -> ``'data=2'`` (axes of size 1 omitted, unless all are)."""
    named = [f"{a}={s}" for a, s in sizes.items() if s != 1]
    return ",".join(named) or "data=1"


def make_mesh(sizes: Mapping[str, int] | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a ``jax.sharding.Mesh`` with all of :data:`MESH_AXES` (size-1 axes included).

    Axis types are ``Auto``: shardings follow the annotations (``out_shardings``, ``with_sharding_constraint``)
    and XLA's propagation, as in pjit.

    Args:
      sizes: ``{axis: size}`` or a string spec; one axis may be -1.
      devices: devices to use (default: all of ``jax.devices()``).

    Raises:
      MeshError: see :func:`parse_mesh_spec` and :func:`resolve_mesh_shape`.
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_mesh_shape(parse_mesh_spec(sizes), len(devices))
    axis_shapes = tuple(shape[a] for a in MESH_AXES)
    try:
        return jax.make_mesh(axis_shapes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                             devices=devices)
    except NotImplementedError as e:
        return Mesh(_split_device_grid(axis_shapes, devices, e), MESH_AXES,
                    axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _split_device_grid(axis_shapes: Sequence[int], devices: Sequence[jax.Device], why: Exception) -> np.ndarray:
    """The device grid of a mesh whose axis sizes are not products of whole physical torus dimensions (e.g.
    expert=8 on v5p's 4x4x4): ``mesh_utils.create_device_mesh`` with ``allow_split_physical_axes=True``, which
    ``jax.make_mesh`` allows only on v5e. Such an axis spans parts of two physical rings, so its collectives are
    slower than on a whole ring; the warning says so and names the shape."""
    from jax.experimental import mesh_utils
    log.warning("mesh %s does not map onto whole physical axes of this topology (%s); splitting physical axes, "
                "so collectives over the split axes are slower than on whole rings",
                ",".join(f"{a}={n}" for a, n in zip(MESH_AXES, axis_shapes) if n != 1) or "data=1",
                str(why).split(".")[0])
    return mesh_utils.create_device_mesh(list(axis_shapes), devices[:math.prod(axis_shapes)],
                                         allow_split_physical_axes=True)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Resolved mesh sizes, every axis of :data:`MESH_AXES` present.

    Attributes:
      ici: sizes within a slice (inter-chip interconnect); their product is the devices per slice.
      dcn: sizes across slices (data-center network); all 1 for a single slice.
    """

    ici: Mapping[str, int]
    dcn: Mapping[str, int]

    @property
    def sizes(self) -> dict[str, int]:
        """The whole mesh: ``ici[axis] * dcn[axis]`` per axis."""
        return {a: self.ici[a] * self.dcn[a] for a in MESH_AXES}

    @property
    def num_slices(self) -> int:
        return math.prod(self.dcn.values())


def resolve_mesh(mesh_spec: str | Mapping[str, int], dcn_spec: str | Mapping[str, int],
                 num_devices: int) -> MeshShape:
    """Resolve ``TrainConfig.mesh`` (within a slice) and ``TrainConfig.dcn_mesh`` (across) for ``num_devices``.

    An empty ``dcn_spec`` means one slice. ``dcn_spec`` sizes are explicit (no ``-1``); one ``mesh_spec`` axis
    may be ``-1`` to take the devices of a slice left over.

    Raises:
      MeshError: with ``key='dcn_mesh'``: malformed, a ``-1``, or a slice count that does not divide the
        devices; with ``key='mesh'``: malformed, or sizes whose product is not the devices per slice.
    """
    try:
        dcn = parse_mesh_spec(dcn_spec) if dcn_spec else {a: 1 for a in MESH_AXES}
    except MeshError as e:
        raise MeshError(str(e), key="dcn_mesh") from None
    if -1 in dcn.values():
        raise MeshError("sizes across slices are explicit (their product is the number of slices); -1 is "
                        "not allowed", key="dcn_mesh")
    num_slices = math.prod(dcn.values())
    if num_devices % num_slices:
        raise MeshError(f"{num_slices} slices do not divide {num_devices} devices", key="dcn_mesh")
    ici = resolve_mesh_shape(parse_mesh_spec(mesh_spec), num_devices // num_slices)
    return MeshShape(ici=ici, dcn=dcn)


def mesh_from_config(mesh_spec: str | Mapping[str, int], dcn_spec: str | Mapping[str, int] = "",
                     devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The run's mesh from ``TrainConfig.mesh`` and ``TrainConfig.dcn_mesh``: hybrid over slices, else plain.

    Args:
      mesh_spec: sizes within a slice, e.g. ``'fsdp=2,tensor=2'``; one axis may be -1.
      dcn_spec: sizes across slices, e.g. ``'data=2'``; empty (or all 1) for a single slice.
      devices: devices to use (default: all of ``jax.devices()``).

    Returns:
      A ``Mesh`` over all of :data:`MESH_AXES` (size-1 axes included) whose axis sizes are
      :attr:`MeshShape.sizes` of :func:`resolve_mesh`.

    Raises:
      MeshError: see :func:`resolve_mesh` (``key`` names the field at fault).
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_mesh(mesh_spec, dcn_spec, len(devices))
    if shape.num_slices == 1:
        return make_mesh(shape.ici, devices)
    return make_hybrid_mesh(shape.ici, shape.dcn, devices)


def _granules(devices: Sequence[jax.Device], num_slices: int) -> tuple[list[list[jax.Device]], bool]:
    """``num_slices`` equal groups of devices, and whether they are real slices or processes.

    Multi-slice TPUs number their slices (``slice_index``); other platforms (CPU, GPU) run one granule per
    process. When neither count equals ``num_slices`` (one process simulating several slices, or several
    processes per slice) the devices, ordered by (slice, process, id), are cut into contiguous blocks.
    """
    for attr in ("slice_index", "process_index"):
        groups: dict[int, list[jax.Device]] = {}
        for d in devices:
            groups.setdefault(getattr(d, attr, 0), []).append(d)
        if len(groups) == num_slices and len({len(g) for g in groups.values()}) == 1:
            return [groups[k] for k in sorted(groups)], True
    ordered = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id))
    per = len(ordered) // num_slices
    return [ordered[i * per:(i + 1) * per] for i in range(num_slices)], False


def make_hybrid_mesh(ici: Mapping[str, int] | str, dcn: Mapping[str, int] | str,
                     devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over several slices: ``ici`` sizes within a slice, ``dcn`` sizes across slices.

    Laid out as ``jax.experimental.mesh_utils.create_hybrid_device_mesh`` does (each slice's devices form
    an ``ici``-shaped block, the blocks are tiled ``dcn``-wise), so the factor of an axis that spans slices
    (by default ``data``) goes over the data-center network and the rest stays on the inter-chip
    interconnect. Slices are found by :func:`_granules`; a single process can thus simulate several slices.

    Raises:
      MeshError: see :func:`resolve_mesh`.
    """
    from jax.experimental import mesh_utils

    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_mesh(ici, dcn, len(devices))
    ici_shape = [shape.ici[a] for a in MESH_AXES]
    granules, physical = _granules(devices, shape.num_slices)
    def block(g):
        if not physical:
            return np.array(g).reshape(ici_shape)
        try:
            return mesh_utils.create_device_mesh(ici_shape, g)
        except NotImplementedError as e:
            return _split_device_grid(ici_shape, g, e)
    blocks = [block(g) for g in granules]
    tiling = np.empty(shape.num_slices, dtype=object)
    for i, block in enumerate(blocks):
        tiling[i] = block
    dev = np.block(tiling.reshape([shape.dcn[a] for a in MESH_AXES]).tolist())
    return Mesh(dev, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """``{axis: size}`` of a mesh, in :data:`MESH_AXES` order."""
    return {a: int(mesh.shape[a]) for a in mesh.axis_names}


# --------------------------------------------------------------------------------------------------
# Logical axes -> mesh axes.


def _rules_dict(rules: Rules) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for logical, mesh_axes in rules:
        if logical in out:
            continue  # first rule wins, as in flax.linen / T5X
        if mesh_axes is None:
            out[logical] = ()
        elif isinstance(mesh_axes, str):
            out[logical] = (mesh_axes,)
        else:
            out[logical] = tuple(mesh_axes)
    return out


def rule_mesh_axes(rules: Rules) -> frozenset[str]:
    """Mesh axes that some logical axis maps to under ``rules`` (first rule per logical axis wins)."""
    return frozenset(a for axes in _rules_dict(rules).values() for a in axes)


#: Mesh axes that mean something only when the model has a given logical axis: ``expert`` splits the
#: experts (``exp``) of MoE layers. The batch is sharded over it too (so tokens are spread before the
#: all-to-all), but for a model without experts that is only data parallelism under another name.
AXIS_NEEDS_LOGICAL: dict[str, str] = {"expert": "exp"}


def unused_mesh_axes(mesh_sizes: Mapping[str, int], rules: Rules,
                     model_axes: Iterable[str] | None = None) -> dict[str, int]:
    """``{axis: size}`` of mesh axes of size > 1 that no rule uses, in :data:`MESH_AXES` order; with
    ``model_axes`` (the logical axes the model's params carry), also those of :data:`AXIS_NEEDS_LOGICAL`
    whose logical axis the model lacks (``expert`` for a dense model).

    Nothing is sharded over such an axis (or nothing it exists for), so every array is replicated along it
    and each of its devices repeats the same work. :data:`PIPELINE_AXIS` is never unused: the pipeline schedule
    splits the layers over it even where no rule stores the weights split (then each stage holds them all).
    """
    used = set(rule_mesh_axes(rules)) | {PIPELINE_AXIS}
    if model_axes is not None:
        present = set(model_axes)
        used -= {a for a, logical in AXIS_NEEDS_LOGICAL.items() if logical not in present}
    return {a: s for a, s in mesh_sizes.items() if s > 1 and a not in used}


def validate_rules(rules: Rules) -> None:
    """Check a rule list: logical names known, mesh names known.

    Raises:
      ValueError: naming the offending rule (config key ``logical_axis_rules``), also a logical axis other
        than ``layers`` mapped to :data:`PIPELINE_AXIS`.
    """
    for entry in rules:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"logical_axis_rules: entry {entry!r} is not a (logical, mesh) pair")
        logical, mesh_axes = entry
        if logical not in LOGICAL_AXES:
            raise ValueError(f"logical_axis_rules: unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
        names = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
        if not isinstance(names, (tuple, list)):
            raise ValueError(f"logical_axis_rules: {logical!r} maps to {mesh_axes!r}; expected a mesh axis, "
                             "a tuple of mesh axes, or None")
        for n in names:
            if n not in MESH_AXES:
                raise ValueError(f"logical_axis_rules: {logical!r} maps to unknown mesh axis {n!r}")
            if n == PIPELINE_AXIS and logical != "layers":
                raise ValueError(f"logical_axis_rules: {logical!r} maps to {n!r}, the pipeline axis; only 'layers' "
                                 "may (the schedule moves everything else between stages itself)")


def logical_to_spec(axes: Sequence[str | None], rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """Map logical axis names of one array to a ``PartitionSpec``.

    A mesh axis is used at most once per array (later dims that would reuse it stay unsharded), and
    mesh axes of size 1 are dropped so specs stay readable. ``None`` in ``axes`` means unsharded.
    """
    table = _rules_dict(rules)
    used: set[str] = set()
    spec: list = []
    for name in axes:
        mesh_axes = table.get(name, ()) if name is not None else ()
        chosen = tuple(
            a for a in mesh_axes
            if a not in used and (mesh is None or mesh.shape[a] > 1))
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], rules: Rules) -> NamedSharding:
    """``NamedSharding`` for an array with the given logical axes."""
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh))


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of a ``[batch, length]`` input array (batch over ``data`` x ``fsdp`` by the default rules)."""
    return named_sharding(mesh, ("batch", "length"), rules)


def data_parallel_size(mesh_sizes: Mapping[str, int], rules: Rules) -> int:
    """Number of shards the batch dimension is split into under ``rules`` (product of its mesh axes)."""
    return logical_axis_size(mesh_sizes, rules, "batch")


def logical_axis_size(mesh_sizes: Mapping[str, int], rules: Rules, logical: str) -> int:
    """Number of shards the logical axis ``logical`` is split into under ``rules`` (product of its mesh axes);
    e.g. ``length``: how many devices one row's tokens are split over (context parallelism)."""
    axes = _rules_dict(rules).get(logical, ())
    return math.prod(mesh_sizes.get(a, 1) for a in axes)


def replicated_fraction(shardings_and_arrays: Iterable[tuple[NamedSharding, jax.ShapeDtypeStruct]]) -> float:
    """Fraction of bytes, over (sharding, array) pairs, held fully replicated on every device.

    An array is fully replicated when its sharding splits none of its dimensions over a mesh axis of size > 1.
    Returns a float in [0, 1] (0 when there are no bytes).
    """
    total = replicated = 0
    for sharding, arr in shardings_and_arrays:
        nbytes = math.prod(arr.shape) * np.dtype(arr.dtype).itemsize
        total += nbytes
        if sharding.is_fully_replicated:
            replicated += nbytes
    return replicated / total if total else 0.0


# --------------------------------------------------------------------------------------------------
# Activation constraints (used by the model).


@dataclasses.dataclass(frozen=True)
class _ActivationContext:
    mesh: Mesh
    rules: Rules


_ACTIVATION_CONTEXT: contextvars.ContextVar[_ActivationContext | None] = contextvars.ContextVar(
    "jaxpt_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules):
    """Within this context (at trace time), :func:`constrain` pins activations to ``rules`` on ``mesh``."""
    token = _ACTIVATION_CONTEXT.set(_ActivationContext(mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVATION_CONTEXT.reset(token)


def current_activation_sharding() -> tuple[Mesh, tuple] | None:
    """``(mesh, rules)`` of the enclosing :func:`activation_sharding` (at trace time), else None. For code that
    must run per device under ``shard_map`` (a Pallas kernel cannot be auto-partitioned)."""
    ctx = _ACTIVATION_CONTEXT.get()
    return None if ctx is None else (ctx.mesh, ctx.rules)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical axis names; a no-op outside :func:`activation_sharding`.

    Raises:
      ValueError: ``len(axes) != x.ndim``.
    """
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: {len(axes)} logical axes {tuple(axes)} for an array of rank {x.ndim}")
    ctx = _ACTIVATION_CONTEXT.get()
    if ctx is None:
        return x
    mesh = ctx.mesh
    inner = jax.sharding.get_abstract_mesh()
    if not inner.empty and inner.manual_axes:
        # Inside a shard_map manual over some axes (the pipeline's ``stage``): constrain over the others, on
        # the mesh as the shard_map sees it (its manual axes typed Manual; the rules never name them).
        mesh = inner
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, axes, ctx.rules))
