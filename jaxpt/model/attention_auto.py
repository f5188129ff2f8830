"""``auto`` attention, and which implementation ``auto`` and ``cudnn`` actually run on a platform.

:func:`resolve` is the one place that decides:

* ``auto`` on TPU: ``splash`` (the fused Pallas kernel) when the row is a whole number of its blocks, else
  ``blockwise``.
* ``auto`` on a CUDA GPU: ``cudnn`` (:mod:`jaxpt.model.attention_cudnn`), which falls back as ``cudnn`` does.
* ``cudnn`` on a CUDA GPU: itself when cuDNN's flash kernel takes the shapes
  (:func:`jaxpt.model.attention_cudnn.unsupported_reason`), else the off-accelerator choice below, with the
  reason recorded; on any other platform a :class:`~jaxpt.util.errors.ConfigError`.
* ``auto`` elsewhere (CPU, ROCm): ``blockwise`` for rows of :data:`LONG_ROW` tokens or more (memory O(L x block)),
  ``xla`` below (fastest at short rows).

The platform is that of the mesh the step is traced for (:func:`jaxpt.mesh.activation_sharding`), so a
compile-only TPU topology on a CPU host chooses ``splash``. What runs is never silent: the first trace of
each (requested, used, reason) is logged on ``jaxpt.attention`` (a warning when it is a fallback), and
:func:`resolve_for` gives the same answer to reports (``jaxpt.tools.compile``'s ``attention_impl_used``, the train
loop's ``start`` record) before anything is traced. Which implementation runs depends on the target, so
``auto`` and ``cudnn`` declare no auxiliary output: ``max_attention_logit`` is absent under them, never faked.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import jax

from jaxpt.model import attention_blockwise, attention_cudnn, attention_splash
from jaxpt.model.attention_xla import xla_attention, xla_saved_tensors
from jaxpt.model.config import ModelConfig
from jaxpt.util.errors import ConfigError

log = logging.getLogger("jaxpt.attention")

#: Rows at least this long (tokens) use ``blockwise`` off TPU: at 2048 the [B, H, L, L] fp32 scores of
#: ``xla`` are 16 MiB per head per row.
LONG_ROW = 2048

#: Platform names of CUDA GPUs (``Device.platform``; ``jax.default_backend()`` says ``gpu``).
CUDA_PLATFORMS = ("gpu", "cuda")


class Resolution(NamedTuple):
    """The implementation that runs for a requested ``attention_impl``: ``name`` and, for a fallback, ``reason``
    (empty when the requested implementation, or ``auto``'s first choice, runs)."""

    name: str
    reason: str = ""


def _portable(seq_len: int) -> str:
    return "blockwise" if seq_len >= LONG_ROW else "xla"


def resolve(impl: str, platform: str, *, seq_len: int, dtype: str = "bfloat16", head_dim: int = 128,
            compute_capability: str | None = None) -> Resolution:
    """The implementation ``impl`` runs as on ``platform`` (``tpu``/``gpu``/``cuda``/``rocm``/``cpu``) for rows of
    ``seq_len`` tokens with the given compute ``dtype`` name and ``head_dim`` (module docstring). Implementations
    other than ``auto`` and ``cudnn`` resolve to themselves.

    Raises:
      ConfigError: ``cudnn`` on a platform that is not a CUDA GPU (naming ``ModelConfig.attention_impl``).
    """
    if impl == "cudnn" and platform not in CUDA_PLATFORMS:
        raise ConfigError(f"ModelConfig.attention_impl = 'cudnn' runs cuDNN's kernel on NVIDIA GPUs; this step is "
                          f"built for {platform} devices (use 'auto', which picks the platform's kernel)")
    if impl == "auto" and platform == "tpu":
        block = min(attention_splash.BLOCK, seq_len)
        if seq_len % block == 0 and block % 128 == 0:
            return Resolution("splash")
        return Resolution("blockwise", f"splash needs rows that are a multiple of {block} (and 128); got {seq_len}")
    if impl in ("auto", "cudnn") and platform in CUDA_PLATFORMS:
        why = attention_cudnn.unsupported_reason(dtype=dtype, head_dim=head_dim, seq_len=seq_len,
                                                 compute_capability=compute_capability)
        return Resolution(_portable(seq_len), why) if why else Resolution("cudnn")
    if impl == "auto":
        return Resolution(_portable(seq_len))
    return Resolution(impl)


def choose(platform: str, seq_len: int, **kw) -> str:
    """The name of :func:`resolve`'s choice for ``auto`` (keyword arguments as :func:`resolve`'s)."""
    return resolve("auto", platform, seq_len=seq_len, **kw).name


def _compute_capability(devices: Sequence) -> str | None:
    return getattr(devices[0], "compute_capability", None) if devices else None


def resolve_for(cfg: ModelConfig, seq_len: int, devices: Sequence) -> Resolution:
    """:func:`resolve` of ``cfg.attention_impl`` for the platform of ``devices`` (e.g. a built mesh's), ``seq_len``
    tokens per row, ``cfg``'s compute dtype and head_dim. Raises as :func:`resolve`."""
    devices = list(devices)
    return resolve(cfg.attention_impl, devices[0].platform, seq_len=seq_len, dtype=cfg.compute_dtype,
                   head_dim=cfg.head_dim, compute_capability=_compute_capability(devices))


_noted: set[tuple[str, str, str]] = set()


def note(requested: str, r: Resolution) -> None:
    """Log once per process what ``requested`` runs as (a warning for a fallback, info otherwise)."""
    key = (requested, r.name, r.reason)
    if key in _noted:
        return
    _noted.add(key)
    if r.reason:
        log.warning("attention_impl %r runs as %r: %s", requested, r.name, r.reason)
    else:
        log.info("attention_impl %r runs as %r", requested, r.name)


def dispatch(requested: str, q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
    """Run :func:`resolve`'s choice for ``requested`` on the traced platform; note it. Returns ``(out, {})``:
    no auxiliary output whichever runs (the table entries of ``auto``/``cudnn`` declare none)."""
    platform, mesh, _ = attention_splash._platform()
    devices = list(mesh.devices.flat) if mesh is not None else None
    dtype = jax.numpy.dtype(q_BxLxHxHd.dtype).name
    r = resolve(requested, platform, seq_len=q_BxLxHxHd.shape[1], dtype=dtype, head_dim=q_BxLxHxHd.shape[-1],
                compute_capability=_compute_capability(devices or jax.devices()))
    inner = jax.sharding.get_abstract_mesh()
    if r.name == "splash" and not inner.empty and inner.manual_axes:
        # Inside the pipeline's shard_map splash's own shard_map cannot nest (yet).
        r = Resolution("blockwise", "splash does not nest inside the pipeline's shard_map")
    note(requested, r)
    fn = {"splash": attention_splash.splash_attention, "blockwise": attention_blockwise.blockwise_attention,
          "xla": xla_attention, "cudnn": attention_cudnn._cudnn_kernel}[r.name]
    out, _ = fn(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, scale=scale)
    return out, {}


def auto_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
    """Dispatch to :func:`resolve`'s implementation for ``auto``. Returns ``(out [B, L, H, Hd], {})``."""
    return dispatch("auto", q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, scale=scale)


def cudnn_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
    """``cudnn``: causal, document-masked grouped-query attention by cuDNN's fused kernel
    (:mod:`jaxpt.model.attention_cudnn`), or the recorded fallback (:func:`resolve`). Returns
    ``(out [B, L, H, Hd] in q's dtype, {})``.

    Raises:
      ConfigError: the step is built for a non-GPU platform (naming ``ModelConfig.attention_impl``).
    """
    return dispatch("cudnn", q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, scale=scale)


def auto_saved_tensors(cfg, batch: int, seq_len: int):
    """The planner counts the off-TPU choice: ``xla``'s [L, L] tensors below :data:`LONG_ROW`, else ``blockwise``'s."""
    if seq_len >= LONG_ROW:
        return attention_blockwise.blockwise_saved_tensors(cfg, batch, seq_len)
    return xla_saved_tensors(cfg, batch, seq_len)
