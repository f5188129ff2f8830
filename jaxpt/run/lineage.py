"""Lineage: what a run continues, the one check that admits it, and the identity the run records.

A run starts in one of four ways, each decided once, before anything is written (:func:`trace`, called by
:func:`jaxpt.run.resolve.resolve`):

* **fresh**: no checkpoint in the workdir and no ``TrainConfig.init_from``;
* **resume**: the workdir's newest committed checkpoint (:class:`Checkpoint`), continued exactly;
* **stage**: a fresh workdir with ``TrainConfig.init_from = '<run dir>[@step]'`` (the newest committed step
  without ``@step``), ``TrainConfig.stage_name``, ``TrainConfig.reset_optimizer`` and ``TrainConfig.stage_data``: a
  new stage from another run's checkpoint (:class:`Parent`), e.g. a long-context extension. Everything else may
  change, within what the parent's params allow (e.g. ``seq_len``, ``ModelConfig.max_seq_len``, RoPE settings, the
  data mixture, the schedule; not ``d_model``);
* **converted**: a stage whose parent is a model converted from Hugging Face (``python -m jaxpt.tools.convert
  hf-to-jaxpt``), a checkpoint of params only (meta ``params_only``, step 0).

Every candidate checkpoint passes the one admission check, :func:`admit`: its saved settings are known to this
version (:func:`jaxpt.config.check_saved_config`), its params fit this model (:func:`check_compatible`), its
tokenizer is this run's (sha256), and the step relation holds (a resume goes forward from it; a stage trains past
it); a resume also keeps the data layout (logical data shards, batch-size ramp). Settings changed since the
checkpoint are reported, never silent.

The stage's first state (:func:`first_state`), from the parent checkpoint at step ``P``:

* ``params``: the parent's, unchanged.
* ``opt_state``: the parent's (Adam moments and their count, so bias correction continues), with the
  learning-rate schedule's count set to 0; or, with ``reset_optimizer`` (always, for a converted model), a fresh
  ``tx.init(params)``.
* ``step``: ``P`` (global steps continue; ``TrainConfig.steps`` is still the step to train up to, so a stage of
  100 steps after step 200 has ``steps = 300``); ``num_updates``: 0 and the schedule's horizon is
  ``steps - P`` (``OptimizerConfig.decay_steps``, when set, counts from the stage's start): a fresh schedule.
* ``rng``: the parent's (a converted model: from ``TrainConfig.seed``); ``lr_scale``: 1; spike-detection history:
  empty (the new length's losses are another distribution). The data stream is the stage's own (its ``seq_len``,
  paths and mixture), feeding steps ``P + 1`` on, and starts where ``TrainConfig.stage_data`` says
  (:func:`data_start`): on the parent's data it reads on from the parent checkpoint's data-iterator state
  (``continue``, the default), so no document of the parent's window comes again unless the config asks for it
  (``replay``); other data is read from its start (``fresh``).

The run's identity (:func:`identity`) is built here, once: the checkpoint ``meta`` item every save records and the
``stage`` and ``stages`` entries of ``run.json`` (:mod:`jaxpt.run.record`): the parent (absolute path and step),
the stage's name, start step, data version and the settings that changed. A resumed stage must name the same
parent.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.checkpoint import CheckpointConfig, Checkpointer, library_versions
from jaxpt.config import TrainConfig
from jaxpt.model import parametrization
from jaxpt.model.compat import compare_params, config_from_record
from jaxpt.model.decoder import count_params
from jaxpt.training import optim
from jaxpt.training.optim import check_schedule
from jaxpt.training.stability import init_history
from jaxpt.training.state import TrainState
from jaxpt.util import fs
from jaxpt.util.errors import CheckpointError, ConfigError

log = logging.getLogger("jaxpt.run.lineage")

#: The run record's file name in a workdir (:mod:`jaxpt.run.record` writes it; a stage reads its parent's).
RUN_FILE = "run.json"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its run directory (absolute), step and ``meta`` item (read once, by :func:`trace`)."""

    workdir: str
    step: int
    meta: dict
    stored_params: int | None = None  # elements of its stored params arrays (shapes only), when read

    @property
    def where(self) -> str:
        """``<workdir>/checkpoints/<step>``, as messages name it."""
        return f"{self.workdir}/checkpoints/{self.step}"


@dataclasses.dataclass(frozen=True)
class Parent(Checkpoint):
    """The checkpoint a stage starts from, and the settings the stage changes (``'Class.field = old -> new'``)."""

    changed: tuple = ()

    @property
    def spec(self) -> str:
        """``'<path>@<step>'``, the resolved ``TrainConfig.init_from`` (a converted model, step 0: the bare path)."""
        return _spec(self.workdir, self.step)

    @property
    def params_only(self) -> bool:
        """A checkpoint of params alone (a converted model): the optimizer and RNG start fresh."""
        return bool(self.meta.get("params_only"))


@dataclasses.dataclass(frozen=True)
class Lineage:
    """What a run continues (module docstring), admitted.

    Attributes:
      resume: the workdir's newest committed checkpoint (None: the run does not resume).
      parent: a new stage's parent (None: no new stage begins; a resumed stage's parent is in ``resume.meta``).
      notes: saved settings ignored and settings changed since the checkpoint (logged, and in the start record).
    """

    resume: Checkpoint | None = None
    parent: Parent | None = None
    notes: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """``fresh``, ``resume``, ``stage`` or ``converted``."""
        if self.resume is not None:
            return "resume"
        if self.parent is not None:
            return "converted" if self.parent.params_only else "stage"
        return "fresh"

    @property
    def start_step(self) -> int:
        """The global step the run continues from (0 fresh; the checkpoint's step; a new stage's parent step)."""
        if self.resume is not None:
            return self.resume.step
        return self.parent.step if self.parent is not None else 0

    def nothing_to_do(self, cfg: TrainConfig) -> bool:
        """The newest checkpoint is already at ``TrainConfig.steps``."""
        return self.resume is not None and self.resume.step == cfg.steps


def _spec(path: str, step: int) -> str:
    """``'<path>@<step>'``; step 0 (only a converted model's checkpoint) is written as the bare path."""
    return f"{path}@{step}" if step else path


# ------------------------------------------------------------------------------------------ admission


def check_compatible(meta: dict[str, Any], model_cfg: Any, where: str) -> None:
    """Refuse a checkpoint whose params do not fit the current model, before Orbax reads any array.

    The params a model of the checkpoint's recorded config (``meta["model"]``) would have are compared,
    by path, shape and dtype, with those of ``model_cfg`` (:func:`jaxpt.model.compat.compare_params`);
    fields that change no param (e.g. ``attention_impl``, ``rope_theta``, ``remat_policy``) may differ.

    Raises:
      CheckpointError: naming each responsible field as ``<field>: checkpoint <saved> vs config <current>``
        (vocabulary size first, the usual culprit) and the first differing params, so a mismatch never
        surfaces as a shape error deep inside Orbax; or saying the recorded config cannot build a model.
    """
    saved = meta.get("model")
    if not saved:
        return
    try:
        saved_cfg = config_from_record(saved)
        mismatch = compare_params(saved_cfg, model_cfg)
    except Exception as e:  # noqa: BLE001 -- any failure to rebuild either model is reported as such
        raise CheckpointError(f"{where}: cannot compare the checkpoint's model with this one: "
                              f"{type(e).__name__}: {e}") from e
    if mismatch is None:
        return
    diffs = [f"{k}: checkpoint {getattr(saved_cfg, k)!r} vs config {getattr(model_cfg, k)!r}" for k in mismatch.fields]
    show = lambda sig: "absent" if sig is None else f"{list(sig[0])} {sig[1]}"  # noqa: E731
    params = [f"{path} {show(a)} vs {show(b)}" for path, a, b in mismatch.params[:4]]
    if len(mismatch.params) > 4:
        params.append(f"{len(mismatch.params) - 4} more")
    hint = ""
    if "vocab_size" in mismatch.fields:
        hint = " (the tokenizer's vocabulary differs from the one the checkpoint was trained with)"
    raise CheckpointError(f"{where}: checkpoint does not match this model{hint}: " + "; ".join(diffs)
                          + " (params differ: " + ", ".join(params) + ")")


def admit(candidate: Checkpoint, cfg: TrainConfig, tokenizer, *, resume: bool) -> list[str]:
    """The one admission check: may ``candidate`` continue this run (``resume``: as its own checkpoint; else as a
    new stage's parent or converted model)? Returns the notes to report (settings ignored or changed).

    In order: the step relation (a resume cannot go back, ``TrainConfig.steps >= step``; a stage must train past its
    parent, ``steps > step``); settings unknown to this version (:func:`jaxpt.config.check_saved_config`); the
    params (:func:`check_compatible`); the parametrization (:func:`_check_parametrization`); the tokenizer (the
    sha256 the checkpoint records must be this run's; a converted model without a recorded tokenizer is refused,
    since its token ids cannot be checked); the optimizer state's structure, unless a stage resets it
    (:func:`_check_optimizer_state`); for a resume, the data layout (logical data shards and the batch-size ramp
    must stay fixed).

    Raises:
      ConfigError: the step relation, or a converted model without a tokenizer (exit 2).
      CheckpointError: unknown numerics-changing settings, another model, parametrization (another width
        multiplier: :func:`_check_parametrization`), tokenizer, an optimizer state of another structure
        (:func:`_check_optimizer_state`) or data layout (exit 3).
    """
    meta, where = candidate.meta, candidate.where
    if resume and cfg.steps < candidate.step:
        raise ConfigError(f"TrainConfig.steps = {cfg.steps} is below step {candidate.step} of the newest checkpoint in "
                          f"{candidate.workdir}/checkpoints: training cannot go back; pass --steps above "
                          f"{candidate.step}, or another --workdir")
    if not resume and cfg.steps <= candidate.step:
        raise ConfigError(f"TrainConfig.steps = {cfg.steps} must exceed the parent's step {candidate.step} "
                          f"(TrainConfig.init_from = {cfg.init_from!r}): steps counts on from the parent")
    notes = [f"ignored saved setting {s}" for s in config_lib.check_saved_config(meta, where)]
    _check_recorded_model(candidate)
    check_compatible(meta, cfg.model, where)
    _check_parametrization(meta, cfg.model, where)
    _check_tokenizer(meta, cfg, tokenizer, where)
    _check_optimizer_state(meta, cfg, where, resume=resume)
    if resume:
        shards = meta.get("data_shards")
        if shards and cfg.data.num_shards and shards != cfg.data.num_shards:
            raise CheckpointError(f"{where} has {shards} data shards, DataConfig.num_shards = "
                                  f"{cfg.data.num_shards} (it must stay fixed for a run)")
        _check_ramp_unchanged(meta, cfg, where)
    return notes + config_lib.changed_settings(meta, cfg)


def _check_recorded_model(candidate: Checkpoint) -> None:
    """The model the checkpoint's metadata records has as many params as its stored arrays hold (counted from shapes:
    :func:`jaxpt.model.decoder.count_params`), before any model is built from the record.

    Raises:
      CheckpointError: naming both counts.
    """
    saved = candidate.meta.get("model")
    if not saved or candidate.stored_params is None:
        return
    try:
        recorded = count_params(config_from_record(saved))["total"]
    except Exception as e:  # noqa: BLE001 -- a record that builds no config is reported as such
        raise CheckpointError(f"{candidate.where}: its recorded model config is unreadable: {type(e).__name__}: {e}") \
            from e
    if recorded != candidate.stored_params:
        raise CheckpointError(f"{candidate.where}: its metadata records a model of {recorded:,} parameters, its arrays "
                              f"hold {candidate.stored_params:,}: the metadata does not describe this checkpoint")


def _check_parametrization(meta: dict, model_cfg, where: str) -> None:
    """The weights of a checkpoint continue only under the parametrization they were trained in: another width
    multiplier (:func:`jaxpt.model.parametrization.same_function`) multiplies the logits and the hidden matrices'
    learning rate by something else, so the run would continue from another model than the one saved. (µP at its
    base width is SP exactly and may take its place.)

    Raises:
      CheckpointError: naming ``ModelConfig.parametrization`` and ``ModelConfig.mup_base_d_model``, both sides.
    """
    saved = meta.get("model")
    if not saved:
        return
    saved_cfg = config_from_record(saved)
    if parametrization.same_function(saved_cfg, model_cfg):
        return
    raise CheckpointError(
        f"{where} was trained under {parametrization.describe(saved_cfg)}, this run sets "
        f"{parametrization.describe(model_cfg)} (ModelConfig.parametrization = {model_cfg.parametrization!r}, "
        f"ModelConfig.mup_base_d_model = {model_cfg.mup_base_d_model}): the same weights would compute other logits "
        f"and take other updates; keep ModelConfig.parametrization = {saved_cfg.parametrization!r} and "
        f"ModelConfig.mup_base_d_model = {saved_cfg.mup_base_d_model}")


def _check_tokenizer(meta: dict, cfg: TrainConfig, tokenizer, where: str) -> None:
    """The one tokenizer rule of :func:`admit`."""
    saved = (meta.get("tokenizer") or {}).get("sha256")
    if meta.get("params_only") and not saved:
        source = (meta.get("source") or {}).get("path", "?")
        raise ConfigError(f"TrainConfig.init_from = {cfg.init_from!r}: the model was converted without a tokenizer "
                          f"(no tokenizer.model or tokenizer.json in {source}), so DataConfig.tokenizer_path cannot be "
                          "checked against the one it was trained with; convert it again from a folder that has its "
                          "tokenizer")
    if saved and saved != tokenizer.sha256:
        raise CheckpointError(f"{where} was trained with tokenizer sha256 {saved[:12]}, this run uses "
                              f"{tokenizer.sha256[:12]} (DataConfig.tokenizer_path)")


def _check_optimizer_state(meta: dict, cfg: TrainConfig, where: str, *, resume: bool) -> None:
    """The checkpoint's optimizer state restores into this run's optimizer: the settings that decide its tree
    structure (:data:`jaxpt.training.optim.STATE_LAYOUT`: the algorithm, gradient clipping on or off) are the saved
    ones. Checked for a resume, and for a stage that keeps its parent's moments (no ``reset_optimizer``).

    Raises:
      CheckpointError: naming each such setting, both values, and the way out.
    """
    if not resume and (cfg.reset_optimizer or meta.get("params_only")):
        return  # a fresh optimizer state: the parent's is not read
    diffs = optim.state_layout_changes(
        config_lib.saved_settings({"config_gin": meta.get("config_gin")}),
        {f"OptimizerConfig.{f.name}": getattr(cfg.optimizer, f.name) for f in dataclasses.fields(cfg.optimizer)})
    if not diffs:
        return
    way = ("keep the saved settings, or start a new stage from this checkpoint with TrainConfig.init_from and "
           "TrainConfig.reset_optimizer = True" if resume else "set TrainConfig.reset_optimizer = True to start "
           "the optimizer afresh from the parent's weights, or keep the saved settings")
    raise CheckpointError(f"{where} holds an optimizer state of another structure than this run's optimizer ("
                          + "; ".join(diffs) + f"), so it cannot be restored: {way}")


def _check_ramp_unchanged(meta: dict, cfg: TrainConfig, where: str) -> None:
    """A batch-size ramp cannot change at a resume: the data iterator's saved position counts loader batches
    whose size comes from the ramp (:mod:`jaxpt.training.batch_ramp`), so another ramp would read from a wrong
    position.

    Raises:
      CheckpointError: naming ``TrainConfig.batch_size_schedule``, both values and the way out.
    """
    key = "TrainConfig.batch_size_schedule"
    saved = config_lib.saved_settings({"config_gin": meta.get("config_gin")}).get(key, "")
    saved = saved.strip("'\"") if isinstance(saved, str) else saved
    if (saved or cfg.batch_size_schedule) and saved != cfg.batch_size_schedule:
        raise CheckpointError(
            f"{where} was trained with {key} = {saved!r}, this run sets {cfg.batch_size_schedule!r}: the data "
            "iterator's position counts batches of the ramp's sizes, so a run cannot change its ramp at a resume "
            "(keep the saved schedule, or start a new stage from this checkpoint with TrainConfig.init_from)")


# ------------------------------------------------------------------------------------------ tracing a run's lineage


def trace(cfg: TrainConfig, tokenizer) -> tuple[TrainConfig, Lineage]:
    """Find what ``cfg``'s run continues and admit it (reads each checkpoint's metadata once; writes nothing).

    Returns ``cfg`` with ``TrainConfig.init_from`` resolved to ``'<abs parent dir>@<step>'`` (a converted model:
    its bare path), and the :class:`Lineage`.

    Raises:
      ConfigError, CheckpointError: as :func:`admit`; the workdir holds something that is not a restorable
        checkpoint; a resumed run names another parent than its checkpoint records; ``init_from`` names no run
        directory or committed step.
    """
    resume, notes = _newest_checkpoint(cfg), []
    if resume is not None:
        notes += admit(resume, cfg, tokenizer, resume=True)
        init_from = _check_resumed_stage(cfg, resume)
        if not init_from:
            return cfg, Lineage(resume, None, tuple(notes))
        cfg = dataclasses.replace(cfg, init_from=init_from)
        _check_stage_schedule(cfg)
        return cfg, Lineage(resume, None, tuple(notes))
    if not cfg.init_from:
        return cfg, Lineage()
    parent = _find_parent(cfg)
    changed = [n.split(": ", 1)[1] for n in admit(parent, cfg, tokenizer, resume=False)
               if n.startswith("changed since") and "TrainConfig.init_from" not in n]
    cfg = dataclasses.replace(cfg, init_from=parent.spec)
    _check_stage_schedule(cfg)
    parent = dataclasses.replace(parent, changed=tuple(changed))
    notes = [f"stage {cfg.stage_name or 'extension'} from {parent.spec} changes {c}" for c in changed]
    return cfg, Lineage(None, parent, tuple(notes))


def _check_stage_schedule(cfg: TrainConfig) -> None:
    """The schedule's phases against the stage's horizon, ``steps`` minus the (now resolved) start step."""
    check_schedule(cfg.optimizer, cfg.steps - config_lib.start_step(cfg))


def _newest_checkpoint(cfg: TrainConfig) -> Checkpoint | None:
    """The workdir's newest committed checkpoint with its meta (None: checkpointing off, no checkpoint directory,
    or only incomplete saves, which the checkpointer deletes at its start).

    Raises:
      CheckpointError: the directory holds something that is not a restorable checkpoint.
    """
    directory = fs.join(cfg.workdir, "checkpoints")
    if not cfg.checkpoint.enabled or not fs.isdir(directory):
        return None
    ckpt = Checkpointer(cfg.workdir, cfg.checkpoint, read_only=True)
    try:
        step = ckpt.latest_step()
        if step is None:
            leftovers = fs.listdir(ckpt.directory) if ckpt.has_checkpoint_dirs() else []
            real = [n for n in leftovers if "tmp" not in n]
            if real:
                raise CheckpointError(f"{ckpt.directory} holds {sorted(real)} but no restorable checkpoint; "
                                      "move it away to start from scratch")
            if leftovers:
                log.warning("only incomplete saves in %s (%s); starting from step 0", ckpt.directory, leftovers)
            return None
        return Checkpoint(fs.dirname(ckpt.directory), step, ckpt.read_meta(step), ckpt.stored_param_count(step))
    finally:
        ckpt.close()


def _find_parent(cfg: TrainConfig) -> Parent:
    """``TrainConfig.init_from``'s checkpoint with its meta (read once).

    Raises:
      ConfigError: no such run directory or committed step.
    """
    path, step = config_lib.parse_init_from(cfg.init_from)
    where = f"TrainConfig.init_from = {cfg.init_from!r}"
    workdir = fs.realpath(path)  # symlinks resolved: one parent, one name
    if not fs.isdir(fs.join(workdir, "checkpoints")):
        raise ConfigError(f"{where}: {workdir} holds no checkpoints/ directory")
    ckpt = Checkpointer(workdir, CheckpointConfig(enabled=False), read_only=True)
    try:
        try:
            step = ckpt.committed_step(step)
        except CheckpointError as e:
            raise ConfigError(f"{where}: {e}") from None
        return Parent(fs.dirname(ckpt.directory), step, ckpt.read_meta(step), ckpt.stored_param_count(step))
    finally:
        ckpt.close()


def _check_resumed_stage(cfg: TrainConfig, resume: Checkpoint) -> str:
    """The ``init_from`` a run resuming its own checkpoint must have: that checkpoint's recorded parent.

    Returns the resolved ``'<abs parent dir>@<step>'`` ('' for a run that is not a stage).

    Raises:
      ConfigError: ``TrainConfig.init_from`` names another parent (or none, or one for a plain run): the
        schedule's horizon and the record depend on it.
    """
    saved = ((resume.meta.get("stage") or {}).get("parent")) or None
    saved_spec = _spec(saved["path"], saved["step"]) if saved else ""
    if not cfg.init_from and not saved:
        return ""
    path, step = config_lib.parse_init_from(cfg.init_from)
    same_path = bool(path) and saved and fs.realpath(path) == fs.realpath(saved["path"])
    if same_path and step in (None, saved["step"]):
        return saved_spec
    raise ConfigError(f"TrainConfig.init_from = {cfg.init_from!r}, but the checkpoint {fs.absolute(resume.where)} this "
                      "run resumes " + (f"belongs to a stage begun from {saved_spec!r}: set that" if saved else
                                        "is of a run that began from scratch: start the stage in a new --workdir"))


# ------------------------------------------------------------------------------------------ a stage's data


#: Settings that fix a data stream's document order: a data-iterator position names the same documents only under
#: the same values (and the same data version and logical data shard count).
ORDER_SETTINGS = ("TrainConfig.seed", "DataConfig.source", "DataConfig.shuffle", "DataConfig.long_doc_min_chars",
                  "DataConfig.long_doc_weight")


@dataclasses.dataclass(frozen=True)
class DataStart:
    """Where a new stage's data stream starts: ``TrainConfig.stage_data`` resolved (:func:`data_start`).

    Attributes:
      choice: ``continue`` (the parent checkpoint's data-iterator state carried), ``fresh`` or ``replay`` (the
        stage's data from its start).
      note: why, in words (logged once, and in the stage record as ``stage_data_note``).
      shards: with ``continue``, the parent's logical data shard count, which the stage keeps.
    """

    choice: str
    note: str
    shards: int | None = None

    @property
    def carries(self) -> bool:
        """The stage sets its stream to the parent's data position."""
        return self.choice == "continue"


def data_start(cfg: TrainConfig, parent: Parent | None, data_version: str) -> DataStart | None:
    """The stage's :class:`DataStart` from ``TrainConfig.stage_data`` (None: no new stage). ``'auto'`` is
    ``'continue'`` when ``data_version`` (:func:`jaxpt.data.stream.data_version`) is the one the parent checkpoint
    records, ``'fresh'`` when it differs or the parent is a converted model.

    Raises:
      ConfigError: naming ``TrainConfig.stage_data``: ``'fresh'`` on the parent's data (a replay by another name);
        ``'auto'`` on the parent's data in another order, or with a parent that records no data version (a choice
        is needed); ``'continue'`` that cannot carry the parent's position (:func:`_check_carry`).
    """
    if parent is None:
        return None
    key, choice = f"TrainConfig.stage_data = {cfg.stage_data!r}", cfg.stage_data
    theirs = None if parent.params_only else parent.meta.get("data_version")
    same = theirs == data_version
    if choice == "auto" and not parent.params_only and not theirs:
        raise ConfigError(f"{key}: the parent checkpoint {parent.where} records no data version, so whether the "
                          "stage's data is the parent's cannot be told: set 'continue', 'fresh' or 'replay'")
    if choice == "auto" and same:
        changes = _order_changes(cfg, parent)
        if changes:
            raise ConfigError(
                f"{key}: the stage trains on its parent's data (data version {theirs}) in another order "
                f"({'; '.join(changes)}): the parent's data position cannot be carried into it, and reading it from "
                "its start would re-read documents the parent trained on; keep the parent's settings to read on from "
                "its position, or set TrainConfig.stage_data = 'replay' to re-read on purpose")
    if choice == "auto":
        choice = "continue" if same else "fresh"
    if choice == "fresh" and same:
        raise ConfigError(f"{key}, but the stage's data is the parent's data (data version {theirs}): reading it from "
                          "its start re-reads the documents the parent trained on; set 'continue' to read on from the "
                          "parent's data position, or 'replay' to re-read them on purpose")
    if choice == "continue":
        shards = _check_carry(cfg, parent, data_version, key)
        return DataStart("continue", f"the parent's data version {theirs}: reading on from the data position of "
                                     f"{parent.where}", shards)
    source = "a converted model, with no data position" if parent.params_only else f"data version {theirs}"
    if choice == "fresh":
        return DataStart("fresh", f"data version {data_version}, the parent's {source}: read from its start")
    return DataStart("replay", f"data version {data_version} read from its start on request; the parent's {source}"
                     + (": the documents of the parent's steps come again" if same else ""))


def _check_carry(cfg: TrainConfig, parent: Parent, data_version: str, key: str) -> int:
    """The parent's data position can feed this stage: the same data version, document order and logical data
    shards (a converted model has no position). Returns the shard count.

    Raises:
      ConfigError: naming ``key`` and what differs.
    """
    theirs = parent.meta.get("data_version")
    if parent.params_only:
        raise ConfigError(f"{key}: the parent {parent.spec} is a converted model, with no data position to carry; "
                          "set 'fresh'")
    if theirs != data_version:
        raise ConfigError(f"{key}: the stage's data version {data_version} is not the parent's {theirs}: the parent's "
                          "data position means nothing in other data; set 'fresh'")
    changes = _order_changes(cfg, parent)
    if changes:
        raise ConfigError(f"{key}: {'; '.join(changes)} changes the document order, so the parent's data position "
                          "would name other documents; keep the parent's settings, or set 'replay'")
    shards = parent.meta.get("data_shards")
    if not shards:
        raise ConfigError(f"{key}: the parent checkpoint {parent.where} records no logical data shards (written "
                          "before them), so its data position cannot be carried; set 'replay' or 'fresh'")
    if (cfg.data.num_shards and cfg.data.num_shards != shards) or cfg.global_batch_size % shards:
        raise ConfigError(
            f"{key}: the parent's data position is held by its {shards} logical data shards, which the stage must "
            f"keep, but DataConfig.num_shards = {cfg.data.num_shards} and TrainConfig.global_batch_size = "
            f"{cfg.global_batch_size}: leave num_shards at 0 (or {shards}) with a batch it divides, or set 'replay'")
    return int(shards)


def _order_changes(cfg: TrainConfig, parent: Parent) -> list[str]:
    """The :data:`ORDER_SETTINGS` (and whether the stream is a token mixture) the stage changes, as
    ``'Class.field = old -> new'``."""
    defaults = config_lib.config_fields()
    saved = config_lib.saved_settings({"config_gin": parent.meta.get("config_gin")})
    now = config_lib.saved_settings({"config_gin": config_lib.operative_config_str(cfg)})
    out = []
    for k in ORDER_SETTINGS:
        old, new = (config_lib.RENAMED_VALUES.get(k, {}).get(v, v) if isinstance(v, str) else v
                    for v in (saved.get(k, defaults[k]["default"]), now.get(k, defaults[k]["default"])))
        if not config_lib.same_value(old, new):
            out.append(f"{k} = {old!r} -> {new!r}")
    mixed = [bool(s.get("DataConfig.mixture_weights") or s.get("DataConfig.mixture_schedule")) for s in (saved, now)]
    if mixed[0] != mixed[1]:
        out.append("DataConfig.mixture_weights / mixture_schedule: " + " -> ".join(
            "a token mixture" if m else "none" for m in mixed))
    return out


# ------------------------------------------------------------------------------------------ the run's identity


@dataclasses.dataclass
class Identity:
    """What the run records about itself, built once (:func:`identity`).

    Attributes:
      config_text: the operative gin config (:func:`jaxpt.config.operative_config_str`).
      data_version: the training data's identifier (:func:`jaxpt.data.stream.data_version`).
      stage: this stage's record (name, workdir, start step, target steps, seq_len, parent, data version, ...).
      stages: the stages that led to this run, the parent's first, this one last (``run.json``'s ``stages``).
      meta: the ``meta`` item every checkpoint of this session saves (:func:`checkpoint_meta`).
    """

    config_text: str
    data_version: str
    stage: dict
    stages: list
    meta: dict


def identity(cfg: TrainConfig, lin: Lineage, mesh, tokenizer, config_text: str, data_version: str,
             data_shards: int, start: DataStart | None = None) -> Identity:
    """The run's :class:`Identity`. A resumed run keeps the stage its checkpoint recorded; a new one records its
    stage (:func:`stage_record`, with where its data started, ``start``) after its parent's stages
    (:func:`parent_stages`)."""
    stage = (lin.resume.meta.get("stage") if lin.resume is not None else None) or \
        stage_record(cfg, lin.parent, data_version, start)
    stages = [*(parent_stages(lin.parent) if lin.parent is not None else []), stage]
    meta = checkpoint_meta(cfg, mesh, tokenizer, config_text, data_version, data_shards)
    meta["stage"] = stage
    return Identity(config_text, data_version, stage, stages, meta)


def checkpoint_meta(cfg: TrainConfig, mesh, tokenizer, config_text: str, data_version: str,
                    data_shards: int | None) -> dict[str, Any]:
    """What a checkpoint records besides arrays (its ``meta`` item): enough to rebuild the run and to refuse a
    wrong one: operative gin config, resolved model config, mesh, tokenizer path and sha256, data version,
    process count, logical data shards, batch shape, library versions, and every setting's default and whether
    it is bookkeeping (:func:`jaxpt.config.config_fields`, for :func:`jaxpt.config.check_saved_config` of other
    versions)."""
    return {
        "config_gin": config_text,
        "model": dataclasses.asdict(cfg.model),
        "mesh": mesh_lib.mesh_shape(mesh),
        "model_layout": {"scan_layers": cfg.model.scan_layers},
        "tokenizer": {"path": fs.absolute(cfg.data.tokenizer_path), "sha256": tokenizer.sha256},
        "data_version": data_version,
        "process_count": jax.process_count(),
        "data_shards": data_shards,
        "global_batch_size": cfg.global_batch_size,
        "seq_len": cfg.seq_len,
        "libraries": library_versions(),
        "config_fields": config_lib.config_fields(),
    }


def stage_record(cfg: TrainConfig, parent: Parent | None, data_version: str | None = None,
                 start: DataStart | None = None) -> dict[str, Any]:
    """The ``stage`` entry of checkpoint meta and run.json: name, start step, parent, optimizer handling, the
    stage's ``data_version`` (:func:`jaxpt.data.stream.data_version`; a continued-pretraining stage trains on
    another corpus version than its parent, and a data path is bookkeeping, so no changed setting would say so) and
    where its data started (``stage_data``, ``stage_data_note``: :func:`data_start`)."""
    record: dict[str, Any] = {"name": cfg.stage_name or ("extension" if parent else "base"),
                              "workdir": fs.absolute(cfg.workdir), "start_step": parent.step if parent else 0,
                              "target_steps": cfg.steps, "seq_len": cfg.seq_len,
                              "parent": {"path": parent.workdir, "step": parent.step} if parent else None}
    if data_version is not None:
        record["data_version"] = data_version
    if parent:
        record["reset_optimizer"] = cfg.reset_optimizer or parent.params_only
        record["changed_settings"] = list(parent.changed)
        if start is not None:
            record["stage_data"], record["stage_data_note"] = start.choice, start.note
        if parent.meta.get("source"):
            record["source"] = parent.meta["source"]
    return record


def parent_stages(parent: Parent) -> list[dict[str, Any]]:
    """The stages of the parent's run as its ``run.json`` lists them, ended at the parent step (one synthesized
    from the parent's meta when its run.json is missing or predates stages); the last one's ``data_version``, when
    its record lacks it, is the parent checkpoint's (a converted model has none)."""
    stages = []
    try:
        stages = json.loads(fs.read_text(fs.join(parent.workdir, RUN_FILE))).get("stages") or []
    except (OSError, ValueError):
        pass
    stages = [dict(s) for s in stages if s.get("start_step", 0) < parent.step]
    if not stages:
        stages = [{"name": "base", "workdir": parent.workdir, "start_step": 0, "parent": None,
                   "seq_len": parent.meta.get("seq_len")}]
    stages[-1]["end_step"] = parent.step
    if parent.meta.get("data_version"):
        stages[-1].setdefault("data_version", parent.meta["data_version"])
    return stages


# ------------------------------------------------------------------------------------------ the first state


def first_state(lin: Lineage, built, ckpt: Checkpointer | None, batches, start: DataStart | None = None) -> TrainState:
    """The state the run's first step starts from: the resumed checkpoint (``batches`` set to its data position),
    a new stage's (:func:`begin_stage`; ``batches`` set to the parent's data position when ``start`` carries it), or
    a fresh one (:meth:`jaxpt.run.build.Built.init_state`).

    Raises:
      CheckpointError: the checkpoint cannot be restored onto this run's state.
    """
    if lin.resume is not None:
        import time
        t0 = time.perf_counter()
        state = ckpt.restore(lin.resume.step, built.spec.abstract, batches, meta=lin.resume.meta)
        log.info("restored step %d from %s in %.1f s", lin.resume.step, ckpt.directory, time.perf_counter() - t0)
        return state
    if lin.parent is not None:
        return begin_stage(built, lin.parent, batches if start is not None and start.carries else None)
    return built.init_state()


def restart_schedule(opt_state: Any) -> Any:
    """``opt_state`` with every learning-rate schedule count (``optax.ScaleByScheduleState``) set to 0; the rest
    (Adam's moments and count) kept."""
    def reset(x):
        if isinstance(x, optax.ScaleByScheduleState):
            return x._replace(count=jnp.zeros_like(x.count))
        return x
    return jax.tree.map(reset, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


def begin_stage(built, parent: Parent, batches=None) -> TrainState:
    """The stage's first :class:`jaxpt.training.state.TrainState` from ``parent`` (module docstring), placed in
    ``built``'s shardings (the parent may have been saved on another mesh). ``batches`` (the stage's stream, when it
    carries the parent's data position): set to that position, its next batch feeding the stage's first step.

    Raises:
      CheckpointError: the parent's state or data position cannot be restored onto this run's.
    """
    spec, cfg = built.spec, built.cfg
    ckpt = Checkpointer(parent.workdir, CheckpointConfig(enabled=False), read_only=True)
    try:
        if batches is not None:
            ckpt.restore_data(parent.step, batches, parent.meta)
            batches.restart_step_count()
        if parent.params_only:  # a converted model: params alone (module docstring)
            saved = {"params": ckpt.restore_params(parent.step, spec.abstract.params)["params"],
                     "opt_state": None, "rng": jax.random.key_data(jax.random.key(cfg.seed + 1))}
        else:
            fields = ("params", "rng") if cfg.reset_optimizer else ("params", "opt_state", "rng")
            saved = {"opt_state": None, **ckpt.restore_fields(parent.step, spec.abstract, fields)}
    finally:
        ckpt.close()

    def make(params, opt_state, rng):
        fresh = cfg.reset_optimizer or opt_state is None
        opt = spec.tx.init(params) if fresh else restart_schedule(opt_state)
        return TrainState(
            step=jnp.asarray(parent.step, jnp.int32), params=params, opt_state=opt, rng=rng,
            num_updates=jnp.zeros((), jnp.int32), lr_scale=jnp.ones((), jnp.float32),
            stability=init_history(spec.stability))

    return jax.jit(make, out_shardings=spec.shardings)(saved["params"], saved["opt_state"], saved["rng"])
