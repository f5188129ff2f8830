"""Restore a trained model from a run's checkpoints on whatever devices are present (CPU included), and
generate from it greedily (:func:`generate`, over the one decoding loop in :mod:`jaxpt.infer.decode`).

For notebooks and evaluation scripts::

    import jaxpt
    r = jaxpt.restore("workdirs/quickstart")          # newest committed step, all local devices
    print(r.step, r.config.model, r.num_params)
    print(r.generate("The river", max_new_tokens=20))  # = jaxpt.generate(r.model, r.tokenizer, ..., document_boundary=)

(The module is ``jaxpt.infer.restore`` rather than ``jaxpt.restore`` so that importing it never shadows the
``jaxpt.restore`` function.)

Only the params (and the step) are read from the checkpoint's ``state`` item (an Orbax partial restore),
so the optimizer moments are never loaded and a checkpoint written by a newer or older train state
(extra bookkeeping fields) still restores. The arrays are placed on the *current* mesh (resharding), so a
checkpoint written on 8 devices as data=2,fsdp=2,tensor=2 restores on one CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.checkpoint import CheckpointConfig, Checkpointer, CheckpointError
from jaxpt.data import boundary
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.infer import decode
from jaxpt.infer.kv_cache import step_class
from jaxpt.model import ModelConfig, count_params
from jaxpt.training import state as state_lib
from jaxpt.util import fs


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

    @property
    def document_boundary(self) -> str:
        """The run's ``DataConfig.document_boundary``: how its training documents started and ended, so how a prompt
        starts (:func:`jaxpt.data.boundary.context_start`)."""
        return self.config.data.document_boundary

    def generate(self, prompt: str, max_new_tokens: int = 32, **kwargs) -> str:
        """:func:`generate` with this checkpoint's model, tokenizer and document boundary (a prompt starts as the
        run's documents did: with BOS for a Llama or Mistral base); ``kwargs`` as :func:`generate` takes them."""
        return generate(self.model, self.tokenizer, prompt, max_new_tokens,
                        document_boundary=self.document_boundary, **kwargs)


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
      tokenizer_path: the tokenizer to use (a SentencePiece model or a Hugging Face ``tokenizer.json``); by default
        the path recorded in the checkpoint, then ``DataConfig.tokenizer_path`` of its config (relative to the
        current directory).

    Note: parsing the saved config replaces the process's current gin bindings (as
    :func:`jaxpt.config.parse` does).

    Raises:
      CheckpointError: no committed checkpoint, an unknown ``step``, unreadable metadata or arrays, a
        saved config that does not parse, or no tokenizer file whose sha256 matches the checkpoint's.
    """

    ckpt = Checkpointer(str(workdir), CheckpointConfig(enabled=False), read_only=True)
    try:
        step = ckpt.committed_step(step)
        meta = ckpt.read_meta(step)
        where = f"{ckpt.directory}/{step}"
        cfg = config_from_meta(meta, where)
        check_stored_shapes(cfg.model, ckpt.stored_param_count(step), where)  # before a model is built from it
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

    Saved settings this version does not know follow the one rule of training resume
    (:func:`jaxpt.config.check_saved_config`): harmless ones are reported and ignored, any other is refused.

    Raises:
      CheckpointError: the config text is missing or does not parse with this version of jaxpt, or it sets
        an unknown setting that may change shapes or numerics (named).
    """
    import gin


    if not meta.get("config_gin"):
        raise CheckpointError(f"{where}: the checkpoint records no operative config ('config_gin')")
    try:
        settings = config_lib.saved_settings(dict(meta))
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    config_lib.check_saved_config(dict(meta), where)
    known = config_lib.config_fields()
    gin.clear_config()
    try:
        for key, value in settings.items():
            if key in known and not key.startswith("ModelConfig."):  # the model comes from meta["model"] below
                gin.bind_parameter(key, value)
        cfg = config_lib.build_config()
    except (ValueError, SyntaxError, TypeError) as e:
        raise CheckpointError(f"{where}: its saved gin config does not parse with this jaxpt: {e}") from e
    finally:
        gin.clear_config()
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    saved_model = {k.split(".", 1)[1]: v for k, v in settings.items()
                   if k.startswith("ModelConfig.") and k.split(".", 1)[1] in model_fields}
    saved_model.update({k: v for k, v in (meta.get("model") or {}).items() if k in model_fields})
    return dataclasses.replace(cfg, model=ModelConfig(**saved_model))


def check_stored_shapes(model_cfg, stored: int, where: str) -> None:
    """The model a checkpoint's metadata records has as many parameters as its stored arrays hold
    (:func:`jaxpt.model.count_params`, from shapes alone), checked before anything is built from the record (a
    record of 20,000 layers beside a small checkpoint built for minutes and filled memory).

    Raises:
      CheckpointError: naming both counts.
    """
    recorded = count_params(model_cfg)["total"]
    if recorded != stored:
        raise CheckpointError(f"{where}: its metadata records a model of {recorded:,} parameters, its arrays hold "
                              f"{stored:,}: the metadata does not describe this checkpoint")


#: The largest tokenizer file jaxpt reads (a SentencePiece model or a Hugging Face tokenizer.json is a few MB).
MAX_TOKENIZER_BYTES = 256 * 2 ** 20


def _load_tokenizer(meta: Mapping[str, Any], cfg, explicit, where: str):

    want = (meta.get("tokenizer") or {}).get("sha256")
    candidates = ([explicit] if explicit is not None else
                  [(meta.get("tokenizer") or {}).get("path"), cfg.data.tokenizer_path])
    tried = []
    for path in candidates:
        if not path:
            continue
        if not fs.exists(path):
            tried.append(f"{path} (missing)")
            continue
        problem = fs.regular_file_problem(path, MAX_TOKENIZER_BYTES)
        if problem:  # a path from metadata: /dev/zero or a FIFO hung the reader
            tried.append(f"{path} ({problem})")
            continue
        try:
            tok = Tokenizer.load(path)  # either backend, picked from the file
        except ValueError as e:
            tried.append(f"{path} ({e})")
            continue
        if want and tok.sha256 != want:
            tried.append(f"{path} (sha256 {tok.sha256[:12]}, checkpoint has {want[:12]})")
            continue
        return tok
    raise CheckpointError(f"{where}: no usable tokenizer; tried {tried or ['(none recorded)']}; "
                          "pass tokenizer_path=")


def _resolve_mesh(mesh, meta: Mapping[str, Any]) -> jax.sharding.Mesh:

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    if mesh is not None:
        return mesh_lib.mesh_from_config(mesh)
    saved = meta.get("mesh") or {}
    if saved and int(np.prod(list(saved.values()))) == jax.device_count():
        return mesh_lib.mesh_from_config(saved)
    return mesh_lib.mesh_from_config({"data": jax.device_count()})


# ------------------------------------------------------------------------------------------ generation


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 32, *, stop_strings: Sequence[str] = (),
             kv_cache: bool = True, temperature: float = 0.0, seed: int = 0, document_boundary: str = "eos") -> str:
    """Continuation of ``prompt`` (text in, text out), stopped at EOS or before the first of ``stop_strings``: one
    row of :func:`jaxpt.infer.decode.greedy` (``temperature`` 0) or :func:`jaxpt.infer.decode.sample` (``temperature``
    > 0, drawn with ``seed``) over a :class:`jaxpt.infer.kv_cache.KVCacheStep` (``kv_cache=False``, or a model that
    cannot be decoded token by token: the cache-free :class:`jaxpt.infer.decode.NoCacheStep`,
    :func:`jaxpt.infer.kv_cache.step_class`) on the model's params wherever they live. Only ids the tokenizer has are
    emitted, however far the model's ``vocab_size`` is padded past it.

    The prompt starts as the run's training documents did (``document_boundary``, the run's
    ``DataConfig.document_boundary``; :func:`jaxpt.data.boundary.context_start`): ``'bos'``/``'bos_eos'`` put BOS
    before it (a Llama or Mistral base: an empty prompt is then ``[BOS]``, a document's start); ``'eos'`` and
    ``'none'`` leave it as it is.
    :meth:`Restored.generate` passes the checkpoint's own policy.

    Truncation (:mod:`jaxpt.infer.decode`): a prompt longer than ``model.cfg.max_seq_len - max_new_tokens`` tokens
    (BOS included) keeps its last that many. The row is only as long as the prompt and new tokens need, at most
    ``max_seq_len``.

    Raises:
      ValueError: the prompt encodes to no tokens and the policy puts no BOS before it, ``max_new_tokens`` is not in
        [0, max_seq_len), or a negative or non-finite ``temperature``.
      ConfigError: an unknown ``document_boundary``, or one with a BOS the tokenizer lacks.
    """
    start = boundary.context_start(document_boundary, tokenizer, "document_boundary")
    ids = tokenizer.encode(prompt)
    if len(ids) or start.bos_id is not None:  # an empty prompt without a BOS stays refused (nothing to continue)
        ids = start.apply(ids)
    row = max(2, min(model.cfg.max_seq_len, max(len(ids), 1) + max_new_tokens))
    step = step_class(model.cfg, kv_cache).from_model(model, seq_len=row, pad_id=tokenizer.pad_id)
    kwargs = dict(eos_id=tokenizer.eos_id, stop_strings=[stop_strings], tokenizer=tokenizer)
    if temperature == 0:
        (gen,) = decode.greedy(step, [ids], max_new_tokens, **kwargs)
    else:
        (gen,) = decode.sample(step, [ids], max_new_tokens, temperature=temperature, seed=seed, **kwargs)
    return gen.text
