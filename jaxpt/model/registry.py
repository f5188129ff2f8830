"""Named implementations of a model part (attention, MLP), chosen by a :class:`ModelConfig` field.

(Not to be confused with :mod:`jaxpt.run.record`, the registry of training runs.)

Adding an implementation is one registered function or module class plus one config value::

    @ATTENTION.register("my_attention", aux_specs={"max_attention_logit": AuxSpec("max")})
    def my_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
        ...

    ModelConfig(attention_impl="my_attention")

Each entry also declares what the rest of the stack needs to know without running it: the auxiliary
outputs it returns (:class:`jaxpt.model.auxiliary.AuxSpec` by name) and, for the memory planner, the
tensors it keeps for the backward pass (:class:`SavedTensor`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

from jaxpt.util.errors import ConfigError
from jaxpt.model.auxiliary import AuxSpec
from jaxpt.model.config import ModelConfig


class SavedTensor(NamedTuple):
    """One tensor a layer produces per forward pass, as the memory planner (:mod:`jaxpt.tools.plan`) counts it.

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


AuxSpecs = Callable[[ModelConfig], Mapping[str, AuxSpec]]
SavedTensors = Callable[[ModelConfig, int, int], list[SavedTensor]]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A registered implementation.

    Attributes:
      name: the config value that selects it.
      fn: the implementation: a function (attention) or an ``nnx.Module`` class / factory (MLP).
      aux_specs: ``cfg -> {name: AuxSpec}``: every auxiliary output ``fn`` returns, and nothing else.
      saved_tensors: ``(cfg, batch, seq_len) -> [SavedTensor]``: what one call keeps for the backward pass.
    """

    name: str
    fn: Any
    aux_specs: AuxSpecs
    saved_tensors: SavedTensors


def _as_spec_fn(aux_specs: Mapping[str, AuxSpec] | AuxSpecs | None) -> AuxSpecs:
    if aux_specs is None:
        return lambda cfg: {}
    if callable(aux_specs):
        return aux_specs
    frozen = dict(aux_specs)
    return lambda cfg: frozen


class Registry:
    """Implementations of one model part, selected by the :class:`ModelConfig` field ``config_field``."""

    def __init__(self, config_field: str):
        self.config_field = config_field
        self._entries: dict[str, Implementation] = {}

    def register(self, name: str, *, aux_specs: Mapping[str, AuxSpec] | AuxSpecs | None = None,
                 saved_tensors: SavedTensors | None = None, replace: bool = False):
        """Decorator registering ``fn`` under ``name``; returns ``fn`` unchanged.

        Args:
          name: the config value.
          aux_specs: the auxiliary outputs ``fn`` returns: a mapping, or a function of the config (e.g. a
            loss weight read from it). Default: none.
          saved_tensors: for the memory planner; default: nothing beyond the caller's own tensors.
          replace: allow re-registering ``name`` (e.g. a test reloading its module).
        Raises:
          ValueError: ``name`` is taken and ``replace`` is False.
        """
        def decorator(fn):
            if name in self._entries and not replace:
                raise ValueError(f"ModelConfig.{self.config_field} {name!r} is already registered")
            self._entries[name] = Implementation(name, fn, _as_spec_fn(aux_specs),
                                                 saved_tensors or (lambda cfg, batch, seq_len: []))
            return fn
        return decorator

    def get(self, name: str) -> Implementation:
        """The entry for ``name``.

        Raises:
          ConfigError: no such implementation (naming the config field and the registered choices).
        """
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(f"ModelConfig.{self.config_field} = {name!r}: choose one of {self.names()}") from None

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order."""
        return tuple(self._entries)
