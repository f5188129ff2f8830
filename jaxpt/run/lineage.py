"""Training stages: continue from another run's checkpoint with new settings (e.g. a long-context extension).

A stage is an explicit, named operation, never a resume with changed settings: a fresh workdir, and
``TrainConfig.init_from = '<parent workdir>[@step]'`` (the newest committed step when ``@step`` is left out),
``TrainConfig.stage_name`` and ``TrainConfig.reset_optimizer``. Everything else may change, within what the parent's
params allow (:func:`jaxpt.checkpoint.check_compatible`: e.g. ``seq_len``, ``ModelConfig.max_seq_len``, RoPE
settings, the data mixture, the learning-rate schedule; not ``d_model``).

The stage's first state (:func:`begin_stage`), from the parent checkpoint at step ``P``:

* ``params``: the parent's, unchanged.
* ``opt_state``: the parent's (Adam moments and their count, so bias correction continues), with the
  learning-rate schedule's count set to 0; or, with ``reset_optimizer``, a fresh ``tx.init(params)``.
* ``step``: ``P`` (global steps continue; ``TrainConfig.steps`` is still the step to train up to, so a stage of
  100 steps after step 200 has ``steps = 300``); ``num_updates``: 0 and the schedule's horizon is
  ``steps - P`` (``OptimizerConfig.decay_steps``, when set, counts from the stage's start): a fresh schedule.
* ``rng``: the parent's; ``lr_scale``: 1; spike-detection history: empty (the new length's losses are another
  distribution). The data stream is the stage's own (its ``seq_len``, paths and mixture), from its seed.

The parent (absolute path and step), the stage's name and start step and the settings that changed are recorded
in every checkpoint's meta (``stage``) and in ``run.json`` (``stages``: the parent's stages, then this one), and a
resumed stage must name the same parent.

Continued pretraining from a converted model (``python -m jaxpt.tools.convert hf-to-jaxpt``): ``init_from`` names the
converter's output directory, whose checkpoint (step 0) holds params only (meta ``params_only``). The run takes
those params, a fresh optimizer state (``tx.init``: zero moments, whatever ``reset_optimizer`` says), a fresh RNG
from ``TrainConfig.seed``, its own data stream and a fresh schedule (warm-up from 0 over ``warmup_steps``); its
tokenizer must be the one converted with the model (sha256 compared; a model converted without a SentencePiece
``tokenizer.model`` is refused, since its token ids cannot be checked). ``run.json`` records the converted
directory as the parent and the Hugging Face folder it came from (``source``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpt.util import fs
from jaxpt.util.errors import ConfigError


def parse_init_from(text: str) -> tuple[str, int | None]:
    """``'dir@200'`` -> ``('dir', 200)``; ``'dir'`` -> ``('dir', None)``; ``''`` -> ``('', None)``.

    A trailing ``/checkpoints`` is dropped (the run directory is what is meant).

    Raises:
      ValueError: a step that is not a positive integer.
    """
    if not text:
        return "", None
    path, sep, step = text.rpartition("@")
    if not sep:
        path, step_n = text, None
    else:
        if not step.isdigit() or int(step) < 1:
            raise ValueError(f"'@{step}' is not a step (a positive integer)")
        step_n = int(step)
    path = path.rstrip("/")
    if fs.basename(path) == "checkpoints":
        path = fs.dirname(path)
    return path, step_n


def start_step(cfg) -> int:
    """The global step the run's stage starts from: the ``@step`` of ``TrainConfig.init_from`` (resolved by
    :func:`resolve`), else 0. The learning-rate schedule's horizon is ``TrainConfig.steps`` minus it."""
    if not cfg.init_from:
        return 0
    return parse_init_from(cfg.init_from)[1] or 0


@dataclasses.dataclass(frozen=True)
class Parent:
    """The checkpoint a stage starts from: run directory (absolute), step, its ``meta`` item, and the settings
    the stage changes (``'Class.field = old -> new'``, :func:`jaxpt.run.resolve.changed_settings`)."""

    workdir: str
    step: int
    meta: dict
    changed: tuple = ()

    @property
    def spec(self) -> str:
        return _spec(self.workdir, self.step)

    @property
    def params_only(self) -> bool:
        """A checkpoint of params alone (a converted model): the optimizer and RNG start fresh."""
        return bool(self.meta.get("params_only"))


def _spec(path: str, step: int) -> str:
    """``'<path>@<step>'``; step 0 (only a converted model's checkpoint) is written as the bare path."""
    return f"{path}@{step}" if step else path


def find_parent(cfg, tokenizer_sha256: str | None) -> Parent:
    """Find and check ``TrainConfig.init_from``'s checkpoint (reads, never writes).

    Raises:
      ConfigError: no such run directory or committed step, or ``TrainConfig.steps`` not above the parent's step.
      CheckpointError: the parent is of another model (:func:`jaxpt.checkpoint.check_compatible`) or tokenizer,
        or saves an unknown setting that changes numerics (:func:`jaxpt.checkpoint.check_saved_config`).
    """
    from jaxpt import checkpoint as ckpt_lib
    path, step = parse_init_from(cfg.init_from)
    where = f"TrainConfig.init_from = {cfg.init_from!r}"
    workdir = fs.realpath(path)  # symlinks resolved: one parent, one name
    if not fs.isdir(fs.join(workdir, "checkpoints")):
        raise ConfigError(f"{where}: {workdir} holds no checkpoints/ directory")
    ckpt = ckpt_lib.Checkpointer(workdir, ckpt_lib.CheckpointConfig(enabled=False), read_only=True)
    try:
        try:
            step = ckpt.committed_step(step)
        except ckpt_lib.CheckpointError as e:
            raise ConfigError(f"{where}: {e}") from None
        meta = ckpt.read_meta(step)
    finally:
        ckpt.close()
    if cfg.steps <= step:
        raise ConfigError(f"TrainConfig.steps = {cfg.steps} must exceed the parent's step {step} "
                          f"({where}): steps counts on from the parent")
    at = f"{ckpt.directory}/{step}"
    ckpt_lib.check_saved_config(meta, at)
    ckpt_lib.check_compatible(meta, cfg.model, at)
    saved_tok = (meta.get("tokenizer") or {}).get("sha256")
    if meta.get("params_only") and not saved_tok:
        source = (meta.get("source") or {}).get("path", "?")
        raise ConfigError(f"{where}: the model was converted without a SentencePiece tokenizer.model (from {source}), "
                          "so DataConfig.tokenizer_path cannot be checked against the one it was trained with")
    if saved_tok and tokenizer_sha256 and saved_tok != tokenizer_sha256:
        raise ckpt_lib.CheckpointError(f"{at} was trained with tokenizer sha256 {saved_tok[:12]}, this run uses "
                                       f"{tokenizer_sha256[:12]} (DataConfig.tokenizer_path)")
    return Parent(workdir, step, meta)


def check_resumed_stage(cfg, resume_meta: dict, where: str) -> str:
    """The ``init_from`` a run resuming its own checkpoint must have: that checkpoint's recorded parent.

    Returns the resolved ``'<abs parent dir>@<step>'`` ('' for a run that is not a stage).

    Raises:
      ConfigError: ``TrainConfig.init_from`` names another parent (or none, or one for a plain run): the
        schedule's horizon and the record depend on it.
    """
    saved = ((resume_meta.get("stage") or {}).get("parent")) or None
    saved_spec = _spec(saved["path"], saved["step"]) if saved else ""
    if not cfg.init_from and not saved:
        return ""
    path, step = parse_init_from(cfg.init_from)
    same_path = bool(path) and saved and fs.realpath(path) == fs.realpath(saved["path"])
    if same_path and step in (None, saved["step"]):
        return saved_spec
    raise ConfigError(f"TrainConfig.init_from = {cfg.init_from!r}, but the checkpoint {where} this run resumes "
                      + (f"belongs to a stage begun from {saved_spec!r}: set that" if saved else
                         "is of a run that began from scratch: start the stage in a new --workdir"))


def stage_record(cfg, parent: Parent | None, data_version: str | None = None) -> dict[str, Any]:
    """The ``stage`` entry of checkpoint meta and run.json: name, start step, parent, optimizer handling, and the
    stage's ``data_version`` (:func:`jaxpt.data.stream.data_version`; a continued-pretraining stage trains on
    another corpus version than its parent, and a data path is bookkeeping, so no changed setting would say so)."""
    record: dict[str, Any] = {"name": cfg.stage_name or ("extension" if parent else "base"),
                              "workdir": fs.absolute(cfg.workdir), "start_step": parent.step if parent else 0,
                              "target_steps": cfg.steps, "seq_len": cfg.seq_len,
                              "parent": {"path": parent.workdir, "step": parent.step} if parent else None}
    if data_version is not None:
        record["data_version"] = data_version
    if parent:
        record["reset_optimizer"] = cfg.reset_optimizer or parent.params_only
        record["changed_settings"] = list(parent.changed)
        if parent.meta.get("source"):
            record["source"] = parent.meta["source"]
    return record


def parent_stages(parent: Parent) -> list[dict[str, Any]]:
    """The stages of the parent's run as its ``run.json`` lists them, ended at the parent step (one synthesized
    from the parent's meta when its run.json is missing or predates stages); the last one's ``data_version``, when
    its record lacks it, is the parent checkpoint's (a converted model has none)."""
    from jaxpt.run.record import RUN_FILE
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


def restart_schedule(opt_state: Any) -> Any:
    """``opt_state`` with every learning-rate schedule count (``optax.ScaleByScheduleState``) set to 0; the rest
    (Adam's moments and count) kept."""
    def reset(x):
        if isinstance(x, optax.ScaleByScheduleState):
            return x._replace(count=jnp.zeros_like(x.count))
        return x
    return jax.tree.map(reset, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


def begin_stage(built, parent: Parent):
    """The stage's first :class:`jaxpt.training.state.TrainState` from ``parent`` (module docstring), placed in
    ``built``'s shardings (the parent may have been saved on another mesh).

    Raises:
      CheckpointError: the parent's state cannot be restored onto this run's state.
    """
    from jaxpt import checkpoint as ckpt_lib
    from jaxpt.training.stability import init_history
    from jaxpt.training.state import TrainState
    spec, cfg = built.spec, built.cfg
    ckpt = ckpt_lib.Checkpointer(parent.workdir, ckpt_lib.CheckpointConfig(enabled=False), read_only=True)
    try:
        if parent.params_only:  # a converted model: params alone (module docstring)
            saved = {"params": ckpt.restore_params(parent.step, spec.abstract.params)["params"],
                     "opt_state": None, "rng": jax.random.key_data(jax.random.key(cfg.seed + 1))}
        else:
            saved = ckpt.restore_fields(parent.step, spec.abstract, ("params", "opt_state", "rng"))
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
