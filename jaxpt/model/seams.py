"""What both sides of the model's two seams share: the names ``ModelConfig`` accepts, the entry type of the
tables (:mod:`jaxpt.model.tables`) and the memory planner's :class:`SavedTensor`. Imports no implementation.

The seams are the attention math (``ModelConfig.attention_impl``) and the block's MLP (``ModelConfig.mlp``).
jaxpt's own implementations are the keys of :data:`jaxpt.model.tables.ATTENTION` and
:data:`jaxpt.model.tables.MLPS`, whose names :data:`ATTENTION_IMPLS` and :data:`MLP_NAMES` list here, so that
:class:`jaxpt.model.config.ModelConfig` checks a name without importing what it names.

Extension point: a user's own implementation is added by an explicit call, made before a ``ModelConfig``
that names it is built; jaxpt's modules never call these themselves::

    from jaxpt.model import AuxSpec, add_attention

    def my_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
        ...

    add_attention("my_attention", my_attention, aux_specs={"max_attention_logit": AuxSpec("max")})
    ModelConfig(attention_impl="my_attention")

(:func:`add_mlp` likewise, with an ``nnx.Module`` class or factory.) Each entry declares what the rest of the
stack needs to know without running it: the auxiliary outputs it returns (:class:`AuxSpec` by name) and, for
the memory planner, the tensors it keeps for the backward pass (:class:`SavedTensor`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxpt.model.auxiliary import AuxSpec
from jaxpt.util.errors import ConfigError

#: ``ModelConfig.attention_impl`` values jaxpt implements (the keys of :data:`jaxpt.model.tables.ATTENTION`).
ATTENTION_IMPLS: tuple[str, ...] = ("xla", "blockwise", "splash", "cudnn", "auto")
#: ``ModelConfig.mlp`` values jaxpt implements (the keys of :data:`jaxpt.model.tables.MLPS`).
MLP_NAMES: tuple[str, ...] = ("swiglu", "moe")


class SavedTensor(NamedTuple):
    """One tensor a layer produces per forward pass, as the memory planner (:mod:`jaxpt.training.memory`)
    counts it.

    Attributes:
      name: label, e.g. ``"probs"``.
      kind: ``input`` (kept by every remat policy), ``dot`` (a weight-matmul output), ``dot_batch`` (a
        matmul whose operands both carry the batch, e.g. attention scores) or ``other``.
      needed: whether the plain (no-remat) backward pass reads it, so it stays alive without a policy.
      shape: its full (unsharded) shape.
      axes: logical axis names per dimension (``None``: never sharded).
      bytes_per_element: 4 for float32, 2 for bfloat16, ...
    """

    name: str
    kind: str
    needed: bool
    shape: tuple
    axes: tuple
    bytes_per_element: int


#: ``cfg -> {name: AuxSpec}`` (``cfg`` a :class:`jaxpt.model.config.ModelConfig`).
AuxSpecs = Callable[[Any], Mapping[str, AuxSpec]]
#: ``(cfg, batch, seq_len) -> [SavedTensor]``.
SavedTensors = Callable[[Any, int, int], list[SavedTensor]]


def no_aux(cfg) -> dict[str, AuxSpec]:
    """The :data:`AuxSpecs` of an implementation without auxiliary outputs: ``{}``."""
    return {}


def nothing_saved(cfg, batch: int, seq_len: int) -> list[SavedTensor]:
    """The :data:`SavedTensors` of an implementation that keeps nothing beyond its caller's tensors: ``[]``."""
    return []


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of a seam: an entry of a table in :mod:`jaxpt.model.tables`.

    Attributes:
      name: the config value that selects it.
      fn: the implementation: a function (attention) or an ``nnx.Module`` class / factory (MLP).
      aux_specs: ``cfg -> {name: AuxSpec}``: every auxiliary output ``fn`` returns, and nothing else.
      saved_tensors: ``(cfg, batch, seq_len) -> [SavedTensor]``: what one call keeps for the backward pass.
    """

    name: str
    fn: Any
    aux_specs: AuxSpecs = no_aux
    saved_tensors: SavedTensors = nothing_saved


#: ``ModelConfig`` field -> (jaxpt's names, the user's implementations added by :func:`add_attention` /
#: :func:`add_mlp`, by name, in the order added).
_SEAMS: dict[str, tuple[tuple[str, ...], dict[str, Implementation]]] = {
    "attention_impl": (ATTENTION_IMPLS, {}),
    "mlp": (MLP_NAMES, {}),
}


def _as_spec_fn(aux_specs: Mapping[str, AuxSpec] | AuxSpecs | None) -> AuxSpecs:
    if aux_specs is None:
        return no_aux
    if callable(aux_specs):
        return aux_specs
    frozen = dict(aux_specs)
    return lambda cfg: frozen


def _add(field: str, name: str, fn, aux_specs, saved_tensors, replace: bool):
    builtin, extra = _SEAMS[field]
    if name in builtin:
        raise ValueError(f"ModelConfig.{field} {name!r} is jaxpt's own; give yours another name")
    if name in extra and not replace:
        raise ValueError(f"ModelConfig.{field} {name!r} is already added (replace=True replaces it)")
    extra[name] = Implementation(name, fn, _as_spec_fn(aux_specs), saved_tensors or nothing_saved)
    return fn


def add_attention(name: str, fn: Callable, *, aux_specs: Mapping[str, AuxSpec] | AuxSpecs | None = None,
                  saved_tensors: SavedTensors | None = None, replace: bool = False) -> Callable:
    """Make ``fn`` the attention implementation ``ModelConfig.attention_impl = name`` selects (module docstring).

    Args:
      name: the config value.
      fn: ``fn(q [B, L, H, Hd], k [B, M, K, Hd], v [B, M, K, Hd], q_segment_ids [B, L] int32,
        kv_segment_ids [B, M] int32, *, scale) -> (out [B, L, H, Hd] compute dtype, aux)``, masking as
        :mod:`jaxpt.model.attention` specifies.
      aux_specs: the auxiliary outputs ``fn`` returns: a mapping, or a function of the config (e.g. a
        loss weight read from it). Default: none.
      saved_tensors: for the memory planner; default: nothing beyond the caller's own tensors.
      replace: allow adding ``name`` again (e.g. a test module imported twice).
    Returns: ``fn`` unchanged.
    Raises:
      ValueError: ``name`` is one of jaxpt's, or already added and ``replace`` is False.
    """
    return _add("attention_impl", name, fn, aux_specs, saved_tensors, replace)


def add_mlp(name: str, fn: Callable, *, aux_specs: Mapping[str, AuxSpec] | AuxSpecs | None = None,
            saved_tensors: SavedTensors | None = None, replace: bool = False) -> Callable:
    """Make ``fn`` (an ``nnx.Module`` class or factory called as ``fn(cfg, rngs=rngs)``) the MLP
    ``ModelConfig.mlp = name`` selects; the module maps ``x [B, L, D]`` to ``(y [B, L, D], aux)`` in the compute
    dtype (:mod:`jaxpt.model.mlp`). Args, returns and raises as :func:`add_attention`'s."""
    return _add("mlp", name, fn, aux_specs, saved_tensors, replace)


def names(field: str) -> tuple[str, ...]:
    """The values ``ModelConfig.<field>`` (``attention_impl`` or ``mlp``) accepts: jaxpt's, then the user's
    in the order added."""
    builtin, extra = _SEAMS[field]
    return builtin + tuple(extra)


def check_name(field: str, name: str) -> None:
    """Raise unless ``ModelConfig.<field>`` accepts ``name`` (:func:`names`).

    Raises:
      ConfigError: ``ModelConfig.<field> = <name>: choose one of (<names>)``.
    """
    if name not in names(field):
        raise ConfigError(f"ModelConfig.{field} = {name!r}: choose one of {names(field)}")


def added(field: str, name: str) -> Implementation | None:
    """The user's implementation ``name`` of ``field`` (:func:`add_attention`, :func:`add_mlp`); None for any
    other name (jaxpt's are in :mod:`jaxpt.model.tables`)."""
    return _SEAMS[field][1].get(name)
