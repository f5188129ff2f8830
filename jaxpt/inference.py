"""Restore a trained model from a run's checkpoints on whatever devices are present (CPU included), and
generate from it greedily.

For notebooks and evaluation scripts::

    import jaxpt
    r = jaxpt.restore("workdirs/quickstart")          # newest committed step, all local devices
    print(r.step, r.config.model, r.num_params)
    print(jaxpt.generate(r.model, r.tokenizer, "The river", max_new_tokens=20))

(The module is ``jaxpt.inference`` rather than ``jaxpt.restore`` so that importing it never shadows the
``jaxpt.restore`` function.)

Only the params (and the step) are read from the checkpoint's ``state`` item (an Orbax partial restore),
so the optimizer moments are never loaded and a checkpoint written by a newer or older train state
(extra bookkeeping fields) still restores. The arrays are placed on the *current* mesh (resharding), so a
checkpoint written on 8 devices as data=2,fsdp=2,tensor=2 restores on one CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpt.checkpoint import CheckpointConfig, CheckpointError, Checkpointer


@dataclasses.dataclass
class Restored:
    """What :func:`restore` returns.

    Attributes:
      model: the :class:`jaxpt.model.Decoder` (an ``nnx.Module``) with the checkpoint's params merged in;
        call it as ``model(tokens, segment_ids, positions)`` (int32 [B, L] each) for float32 logits [B, L, V].
      params: the ``nnx.State`` of its ``nnx.Param`` leaves (jax.Arrays sharded over ``mesh``).
      config: the run's :class:`jaxpt.config.TrainConfig`, parsed from the operative gin config saved in
        the checkpoint, with ``model`` as recorded (vocabulary size resolved).
      tokenizer: the run's :class:`jaxpt.data.tokenizer.Tokenizer` (its sha256 checked against the checkpoint).
      step: the global step of the checkpoint.
      meta: the checkpoint's ``meta`` item (config text, mesh, versions, data version, ...).
      mesh: the mesh the params are placed on.
    """

    model: Any
    params: Any
    config: Any
    tokenizer: Any
    step: int
    meta: dict[str, Any]
    mesh: jax.sharding.Mesh

    @property
    def num_params(self) -> int:
        """Total number of parameters."""
        return int(sum(x.size for x in jax.tree.leaves(self.params)))


def restore(workdir: str | os.PathLike, step: int | None = None,
            mesh: jax.sharding.Mesh | str | Mapping[str, int] | None = None, *,
            tokenizer_path: str | os.PathLike | None = None) -> Restored:
    """Load the model, params, config and tokenizer of ``<workdir>/checkpoints/<step>``.

    Args:
      workdir: the run directory (holding ``checkpoints/``).
      step: which step; ``None`` = the newest *committed* one (incomplete saves are never picked).
      mesh: where to place the params: a ``jax.sharding.Mesh``, or sizes such as ``"fsdp=4"`` over all
        local devices. ``None``: the mesh the checkpoint was saved on if it fits the devices present,
        else ``data=<all devices>`` (params replicated, which any model shape allows).
      tokenizer_path: the SentencePiece model to use; by default the path recorded in the checkpoint,
        then ``DataConfig.tokenizer_path`` of its config (relative to the current directory).

    Note: parsing the saved config replaces the process's current gin bindings (as
    :func:`jaxpt.config.parse` does).

    Raises:
      CheckpointError: no committed checkpoint, an unknown ``step``, unreadable metadata or arrays, a
        saved config that does not parse, or no tokenizer file whose sha256 matches the checkpoint's.
    """
    from jaxpt import state as state_lib

    ckpt = Checkpointer(str(workdir), CheckpointConfig(enabled=False), read_only=True)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise CheckpointError(f"{ckpt.directory}: no committed checkpoint")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise CheckpointError(f"{ckpt.directory}: no committed step {step} (have {sorted(steps)})")
        meta = ckpt.read_meta(step)
        where = f"{ckpt.directory}/{step}"
        cfg = config_from_meta(meta, where)
        tokenizer = _load_tokenizer(meta, cfg, tokenizer_path, where)
        mesh = _resolve_mesh(mesh, meta)
        graphdef, abs_params = state_lib.abstract_model(cfg.model)
        shardings = state_lib.param_shardings(abs_params, mesh, cfg.logical_axis_rules)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abs_params, shardings)
        restored = ckpt.restore_params(step, target)
    finally:
        ckpt.close()
    from flax import nnx
    model = nnx.merge(graphdef, restored["params"])
    return Restored(model=model, params=restored["params"], config=cfg, tokenizer=tokenizer,
                    step=int(restored["step"]), meta=meta, mesh=mesh)


def config_from_meta(meta: Mapping[str, Any], where: str = "checkpoint"):
    """The :class:`jaxpt.config.TrainConfig` of a checkpoint: its saved operative gin config, with the
    recorded (resolved) model config.

    Raises:
      CheckpointError: the config text is missing or does not parse with this version of jaxpt.
    """
    import gin

    from jaxpt import config as config_lib
    from jaxpt.model import ModelConfig

    text = meta.get("config_gin")
    if not text:
        raise CheckpointError(f"{where}: the checkpoint records no operative config ('config_gin')")
    gin.clear_config()
    try:
        gin.parse_config(text, skip_unknown=True)
        cfg = config_lib.build_config()
    except (ValueError, SyntaxError, TypeError) as e:
        raise CheckpointError(f"{where}: its saved gin config does not parse with this jaxpt: {e}") from e
    finally:
        gin.clear_config()
    saved_model = meta.get("model")
    if saved_model:
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        cfg = dataclasses.replace(cfg, model=ModelConfig(**{k: v for k, v in saved_model.items() if k in known}))
    return cfg


def _load_tokenizer(meta: Mapping[str, Any], cfg, explicit, where: str):
    from jaxpt.data.tokenizer import Tokenizer

    want = (meta.get("tokenizer") or {}).get("sha256")
    candidates = ([explicit] if explicit is not None else
                  [(meta.get("tokenizer") or {}).get("path"), cfg.data.tokenizer_path])
    tried = []
    for path in candidates:
        if not path:
            continue
        if not os.path.exists(path):
            tried.append(f"{path} (missing)")
            continue
        tok = Tokenizer.load(path)
        if want and tok.sha256 != want:
            tried.append(f"{path} (sha256 {tok.sha256[:12]}, checkpoint has {want[:12]})")
            continue
        return tok
    raise CheckpointError(f"{where}: no usable tokenizer; tried {tried or ['(none recorded)']}; "
                          "pass tokenizer_path=")


def _resolve_mesh(mesh, meta: Mapping[str, Any]) -> jax.sharding.Mesh:
    from jaxpt import mesh as mesh_lib

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    if mesh is not None:
        return mesh_lib.make_mesh(mesh)
    saved = meta.get("mesh") or {}
    if saved and int(np.prod(list(saved.values()))) == jax.device_count():
        return mesh_lib.make_mesh(saved)
    return mesh_lib.make_mesh({"data": jax.device_count()})


# ------------------------------------------------------------------------------------------ generation


def generate_ids(model, prompt_ids, max_new_tokens: int, *, eos_id: int | None = None) -> list[int]:
    """Greedy decoding without a KV cache: each new token is the argmax of the logits at the last position.

    The context is one document (segment id 1, positions 0..n-1), right-padded to a fixed window (segment
    id 0) so one compiled forward pass serves every step; causal masking makes the padding invisible.
    When the context outgrows ``model.cfg.max_seq_len`` only the most recent tokens are kept (a sliding
    window, positions restarting at 0).

    Args:
      model: a :class:`jaxpt.model.Decoder`.
      prompt_ids: int token ids, shape [n] with n >= 1.
      max_new_tokens: tokens to add (>= 0).
      eos_id: stop after emitting this id (it is included in the result).

    Returns: the new token ids (at most ``max_new_tokens``), ints.

    Raises:
      ValueError: empty prompt or negative ``max_new_tokens``.
    """
    from flax import nnx

    ids = [int(i) for i in np.asarray(prompt_ids).reshape(-1)]
    if not ids:
        raise ValueError("generate: the prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens = {max_new_tokens} must be >= 0")
    window = min(model.cfg.max_seq_len, len(ids) + max_new_tokens)
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, tokens_1xW, n):
        positions_1xW = jnp.arange(window, dtype=jnp.int32)[None]
        segment_ids_1xW = (positions_1xW < n).astype(jnp.int32)
        logits_1xWxV = nnx.merge(graphdef, state)(tokens_1xW, segment_ids_1xW, positions_1xW)
        return jnp.argmax(logits_1xWxV[0, n - 1]).astype(jnp.int32)

    new: list[int] = []
    for _ in range(max_new_tokens):
        context = ids[-window:]
        tokens = np.zeros((1, window), np.int32)
        tokens[0, :len(context)] = context
        token = int(next_token(state, tokens, np.int32(len(context))))
        ids.append(token)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 32) -> str:
    """Greedy continuation of ``prompt`` (text in, text out), stopping at EOS. See :func:`generate_ids`.

    Raises:
      ValueError: the prompt encodes to no tokens, or negative ``max_new_tokens``.
    """
    new = generate_ids(model, tokenizer.encode(prompt), max_new_tokens, eos_id=tokenizer.eos_id)
    return tokenizer.decode(new)
