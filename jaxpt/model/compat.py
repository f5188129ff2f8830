"""Whether params built for one model config fit another: compared by param path, shape and dtype.

Used to refuse a checkpoint of another model before any array is read
(:func:`jaxpt.run.lineage.check_compatible`). Nothing here lists "shape fields": the abstract params of each
config are built (``nnx.eval_shape``, no arrays allocated) and compared, and a differing field is blamed
when its value alone changes the params. A field that changes no param (``rope_theta`` and every RoPE scaling
setting, ``max_seq_len``, ``remat_policy``, ``attention_impl``, ``compute_dtype``, ...) never makes two configs
incompatible: that is what lets a long-context stage (:mod:`jaxpt.run.lineage`) continue a checkpoint with new RoPE
settings and a longer row. Such a change still changes numerics, so it is reported (resume) or recorded (stage).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
from flax import nnx

from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import Decoder

#: ``(shape, dtype name)`` of one param.
Signature = tuple[tuple[int, ...], str]


def param_signatures(cfg: ModelConfig) -> dict[str, Signature]:
    """``{"blocks/attn/wq": ((D, H, Hd), "float32"), ...}`` for every param of a :class:`Decoder` of ``cfg``.

    Paths join the attribute names and layer indices with ``/``; scanned layers appear once, with the
    leading ``layers`` dimension. No array is allocated.

    Raises:
      ValueError, ConfigError: ``cfg`` cannot build a model (e.g. unresolved vocabulary, unknown MLP).
    """
    return dict(_param_signatures(cfg))


@functools.lru_cache(maxsize=32)  # configs are frozen (hashable); the per-field probes rebuild a few
def _param_signatures(cfg: ModelConfig) -> dict[str, Signature]:
    params = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(k, "key", getattr(k, "idx", ""))) for k in path
                 if not isinstance(k, jax.tree_util.GetAttrKey)]
        out["/".join(names)] = (tuple(leaf.shape), str(leaf.dtype))
    return out


def config_from_record(record: Mapping[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from its ``dataclasses.asdict`` record (e.g. a checkpoint's ``model`` meta).

    Keys this version does not know are dropped; fields the record lacks (added since it was written)
    take their defaults, which keep the behaviour of the version that wrote it.
    """
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in record.items() if k in known})


@dataclasses.dataclass(frozen=True)
class ParamsMismatch:
    """How the params of a saved config differ from the current one's.

    Attributes:
      params: ``[(path, saved signature or None if absent, current signature or None if absent)]``.
      fields: config fields responsible: those whose saved value alone (on the current config) changes
        the params, vocabulary size first; if no single field does, every field that differs.
    """

    params: list[tuple[str, Signature | None, Signature | None]]
    fields: list[str]


def _diff(a: Mapping[str, Signature], b: Mapping[str, Signature]):
    return [(p, a.get(p), b.get(p)) for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)]


def _changes_params(current: ModelConfig, field: str, value: Any, reference: Mapping[str, Signature]) -> bool:
    try:
        return param_signatures(dataclasses.replace(current, **{field: value})) != reference
    except Exception:  # noqa: BLE001 -- a value that cannot even build a model surely changes it
        return True


def compare_params(saved: ModelConfig, current: ModelConfig) -> ParamsMismatch | None:
    """None when a model of ``saved`` and one of ``current`` have the same param paths, shapes and dtypes;
    otherwise what differs and which fields are responsible.

    Raises:
      ValueError, ConfigError: either config cannot build a model.
    """
    now = param_signatures(current)
    params = _diff(param_signatures(saved), now)
    if not params:
        return None
    differing = [f.name for f in dataclasses.fields(ModelConfig)
                 if getattr(saved, f.name) != getattr(current, f.name)]
    differing.sort(key=lambda name: name != "vocab_size")  # the usual culprit first
    blamed = [f for f in differing if _changes_params(current, f, getattr(saved, f), now)]
    return ParamsMismatch(params=params, fields=blamed or differing)
