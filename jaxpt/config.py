"""Configuration: gin files and flags -> one typed, validated :class:`TrainConfig`.

Gin usage is T5X-style. Each config dataclass is a gin configurable under its own name::

    ModelConfig.d_model = 256
    OptimizerConfig.peak_learning_rate = 3e-3
    TrainConfig.global_batch_size = 16
    TrainConfig.mesh = 'data=2,fsdp=2,tensor=2'

``--config FILE`` may repeat (later files win), then the plain flags (``--workdir``, ``--steps``, ``--mesh``)
are applied as bindings, then every ``--gin 'BINDING'`` (applied last, so it wins over everything).

:func:`validate` checks the whole config before anything is compiled and raises :class:`ConfigError`
naming the offending key. This module never touches ``jax.distributed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import typing
from typing import Any, Sequence

import gin

from jaxpt import mesh as mesh_lib
from jaxpt.errors import ConfigError
from jaxpt.checkpoint import CheckpointConfig
from jaxpt.stability import StabilityConfig
from jaxpt.model.config import DTYPES, REMAT_POLICIES, ModelConfig
from jaxpt.optim import SCHEDULES, OptimizerConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training and held-out text come from.

    Attributes:
      source: ``sample`` (the quickstart's first data path: JSON Lines prepared by ``jaxpt.data.prepare``)
        or ``corpus`` (a corpus version built by ``data_pipelines.build``).
      train_path: JSON Lines (.jsonl.gz) of training documents (``source='sample'``).
      heldout_path: JSON Lines of held-out documents for the held-out loss (`source='sample'`; a corpus run uses
        its corpus version's own held-out split, `<corpus_dir>/heldout/`).
      tokenizer_path: SentencePiece model file.
      corpus_dir: a corpus version directory (``source='corpus'``).
      shuffle: shuffle documents (seeded by ``TrainConfig.seed``; a new order each epoch).
      add_eos: append EOS to every document before packing.
      num_shards: logical data shards (independent pipelines) the global batch is made of; each process
        runs a contiguous block of them. 0: one per process at the run's start, then kept (recorded in
        checkpoints). Fixed for a run, so a resume on another process count continues exactly (see
        :mod:`jaxpt.data.shards`).
    """

    source: str = "sample"
    train_path: str = "artifacts/sample/train.jsonl.gz"
    heldout_path: str = "artifacts/sample/heldout.jsonl.gz"
    tokenizer_path: str = "artifacts/sample/tokenizer.model"
    corpus_dir: str = ""
    shuffle: bool = True
    add_eos: bool = True
    num_shards: int = 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. Nested configs are built from their own gin bindings.

    Attributes:
      model, optimizer, data, checkpoint, stability: sub-configs.
      mesh: mesh sizes, e.g. ``'data=2,fsdp=2,tensor=2'``; one axis may be -1 (the remaining devices).
        With ``dcn_mesh`` set, these are the sizes *within* a slice (ICI).
      dcn_mesh: sizes *across* slices (data-center network), e.g. ``'data=4'`` for data parallelism over 4
        slices; empty for a single slice. The full mesh is their product per axis, built with
        ``mesh_utils.create_hybrid_device_mesh``.
      logical_axis_rules: ``((logical_axis, mesh_axis or tuple or None), ...)``, first match wins.
      global_batch_size: rows per step over all processes.
      grad_accum_steps: micro-batches per step (gradient accumulation); the loss is normalized by the
        global batch's target tokens, so this changes memory, not math.
      seq_len: tokens per row.
      steps: the global step to train up to.
      seed: seeds params, data order and the RNG carried in the train state.
      z_loss_weight: weight of the z-loss ``log(Z)^2`` (PaLM, Chowdhery et al. 2022, sec. 5); 0 disables.
      log_every: steps between metric records.
      eval_every: steps between held-out evaluations (0: only at the end).
      eval_batches: held-out batches per evaluation (0: the whole held-out set).
      workdir: run directory (metrics, TensorBoard, config.gin, checkpoints).
      progress_bar: show a tqdm bar on the terminal.
      log_batch_documents: append, per step, the indices of the documents in this process's rows to
        ``<workdir>/batches/process_<i>.jsonl`` (an audit trail for resumption and data debugging).
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    stability: StabilityConfig = dataclasses.field(default_factory=StabilityConfig)
    mesh: str = "data=-1"
    dcn_mesh: str = ""
    logical_axis_rules: tuple = mesh_lib.DEFAULT_RULES
    global_batch_size: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 256
    steps: int = 300
    seed: int = 0
    z_loss_weight: float = 1e-4
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 0
    workdir: str = "workdirs/default"
    progress_bar: bool = True
    log_batch_documents: bool = False


# Gin wrappers: the dataclasses stay plain Python (the model package knows nothing of gin).
_GIN_MODEL = gin.external_configurable(ModelConfig, name="ModelConfig", module="jaxpt")
_GIN_OPTIM = gin.external_configurable(OptimizerConfig, name="OptimizerConfig", module="jaxpt")
_GIN_DATA = gin.external_configurable(DataConfig, name="DataConfig", module="jaxpt")
_GIN_CKPT = gin.external_configurable(CheckpointConfig, name="CheckpointConfig", module="jaxpt")
_GIN_STAB = gin.external_configurable(StabilityConfig, name="StabilityConfig", module="jaxpt")
_GIN_TRAIN = gin.external_configurable(TrainConfig, name="TrainConfig", module="jaxpt")


def build_config() -> TrainConfig:
    """Instantiate :class:`TrainConfig` from the gin bindings currently parsed."""
    return _GIN_TRAIN(model=_GIN_MODEL(), optimizer=_GIN_OPTIM(), data=_GIN_DATA(), checkpoint=_GIN_CKPT(),
                      stability=_GIN_STAB())


def parse(config_files: Sequence[str] = (), bindings: Sequence[str] = (), *,
          workdir: str | None = None, steps: int | None = None, mesh: str | None = None) -> TrainConfig:
    """Parse gin files and bindings (see the module docstring for order) and build the config.

    Does not validate against devices; call :func:`validate` for that.

    Raises:
      ConfigError: missing file, unknown configurable or parameter, or a malformed binding (with the file
        and line, or the binding text).
    """
    gin.clear_config()
    for path in config_files:
        if not os.path.exists(path):
            raise ConfigError(f"--config {path}: no such file")
        try:
            gin.parse_config_file(path)
        except (ValueError, SyntaxError) as e:
            raise ConfigError(f"in config file {path}: {e}") from None
    flag_bindings = []
    if workdir is not None:
        flag_bindings.append(f"TrainConfig.workdir = {workdir!r}")
    if steps is not None:
        flag_bindings.append(f"TrainConfig.steps = {int(steps)}")
    if mesh is not None:
        flag_bindings.append(f"TrainConfig.mesh = {mesh!r}")
    for binding in [*flag_bindings, *bindings]:
        try:
            gin.parse_config(binding)
        except (ValueError, SyntaxError) as e:
            raise ConfigError(f"binding {binding!r}: {e}") from None
    try:
        return build_config()
    except TypeError as e:
        raise ConfigError(f"config: {e}") from None


def _check_types(obj: Any, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            _check_types(value, type(value).__name__)
            continue
        hint = hints[f.name]
        ok = True
        if hint is bool:
            ok = isinstance(value, bool)
        elif hint is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif hint is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif hint is str:
            ok = isinstance(value, str)
        elif hint is tuple:
            ok = isinstance(value, (tuple, list))
        if not ok:
            raise ConfigError(f"{key} = {value!r}: expected {getattr(hint, '__name__', hint)}, "
                              f"got {type(value).__name__}")


def _mesh_sizes(cfg: TrainConfig, num_devices: int) -> dict[str, int]:
    """Resolved ``{axis: size}`` of the whole mesh (ICI x DCN); raises ConfigError naming the key."""
    try:
        dcn = mesh_lib.parse_mesh_spec(cfg.dcn_mesh) if cfg.dcn_mesh else {a: 1 for a in mesh_lib.MESH_AXES}
    except mesh_lib.MeshError as e:
        raise ConfigError(f"TrainConfig.dcn_mesh = {cfg.dcn_mesh!r}: {e}") from None
    num_slices = math.prod(dcn.values())
    if num_slices < 1 or num_devices % num_slices:
        raise ConfigError(f"TrainConfig.dcn_mesh = {cfg.dcn_mesh!r}: {num_slices} slices do not divide "
                          f"{num_devices} devices")
    try:
        ici = mesh_lib.resolve_mesh_shape(mesh_lib.parse_mesh_spec(cfg.mesh), num_devices // num_slices)
    except mesh_lib.MeshError as e:
        raise ConfigError(f"TrainConfig.mesh = {cfg.mesh!r}: {e}") from None
    sizes = {a: ici[a] * dcn[a] for a in mesh_lib.MESH_AXES}
    try:
        mesh_lib.validate_rules(cfg.logical_axis_rules)
    except ValueError as e:
        raise ConfigError(f"TrainConfig.{e}") from None

    return sizes


def _validate_policies(cfg: TrainConfig) -> None:
    """Optimizer, stability, checkpoint and data settings; raises ConfigError naming the key."""
    o = cfg.optimizer
    if o.warmup_steps < 0 or o.peak_learning_rate <= 0:
        raise ConfigError("OptimizerConfig.warmup_steps must be >= 0 and peak_learning_rate > 0")
    from jaxpt.optim import learning_rate_schedule
    try:
        learning_rate_schedule(o, cfg.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    st = cfg.stability
    if st.spike_window < 1 or st.spike_k <= 0 or not 0 < st.lr_damping <= 1 or st.rollback_loss_ratio <= 1:
        raise ConfigError("StabilityConfig: need spike_window >= 1, spike_k > 0, 0 < lr_damping <= 1, "
                          "rollback_loss_ratio > 1")
    c = cfg.checkpoint
    if min(c.save_every_steps, c.keep_last, c.keep_every_steps) < 0 or c.save_every_minutes < 0:
        raise ConfigError("CheckpointConfig: save_every_steps, save_every_minutes, keep_last and "
                          "keep_every_steps must be >= 0")
    if c.enabled and c.keep_last < 1:
        raise ConfigError("CheckpointConfig.keep_last must be >= 1 when checkpointing is enabled")
    if cfg.data.num_shards < 0 or (cfg.data.num_shards and cfg.global_batch_size % cfg.data.num_shards):
        raise ConfigError(f"DataConfig.num_shards = {cfg.data.num_shards} must be >= 0 and divide "
                          f"TrainConfig.global_batch_size = {cfg.global_batch_size}")
    if cfg.data.source == "corpus" and not cfg.data.corpus_dir:
        raise ConfigError("DataConfig.corpus_dir must be set when DataConfig.source = 'corpus'")


def validate(cfg: TrainConfig, num_devices: int) -> dict[str, int]:
    """Check the whole config against itself and the device count, before any compile.

    Returns the resolved mesh sizes ``{axis: size}``.

    Raises:
      ConfigError: naming the key: wrong types; mesh product != device count; global batch not divisible
        by the data-parallel size; heads or kv heads not divisible by ``tensor``; ``seq_len`` above
        ``ModelConfig.max_seq_len``; odd ``head_dim`` (RoPE needs pairs); unknown dtype, remat policy,
        schedule or data source; bad logical-axis rules; non-positive sizes.
    """
    _check_types(cfg, "TrainConfig")
    m, o = cfg.model, cfg.optimizer
    sizes = _mesh_sizes(cfg, num_devices)
    for key, value in [("TrainConfig.global_batch_size", cfg.global_batch_size),
                       ("TrainConfig.seq_len", cfg.seq_len), ("TrainConfig.steps", cfg.steps),
                       ("TrainConfig.log_every", cfg.log_every), ("ModelConfig.d_model", m.d_model),
                       ("ModelConfig.num_layers", m.num_layers), ("ModelConfig.num_heads", m.num_heads),
                       ("ModelConfig.num_kv_heads", m.num_kv_heads), ("ModelConfig.head_dim", m.head_dim),
                       ("ModelConfig.mlp_dim", m.mlp_dim), ("ModelConfig.max_seq_len", m.max_seq_len)]:
        if value <= 0:
            raise ConfigError(f"{key} = {value}: must be positive")

    dp = mesh_lib.data_parallel_size(sizes, cfg.logical_axis_rules)
    if cfg.grad_accum_steps < 1:
        raise ConfigError(f"TrainConfig.grad_accum_steps = {cfg.grad_accum_steps}: must be >= 1")
    if cfg.global_batch_size % (dp * cfg.grad_accum_steps):
        raise ConfigError(
            f"TrainConfig.global_batch_size = {cfg.global_batch_size} is not divisible by data-parallel size "
            f"{dp} x TrainConfig.grad_accum_steps = {cfg.grad_accum_steps} (each micro-batch must split "
            f"evenly over the data-parallel shards)")
    if cfg.global_batch_size % dp:
        raise ConfigError(
            f"TrainConfig.global_batch_size = {cfg.global_batch_size} is not divisible by the data-parallel "
            f"size {dp} (mesh {mesh_lib.format_mesh(sizes)}; batch is sharded over the 'batch' rule's axes)")
    tensor = sizes["tensor"]
    if m.num_heads % tensor:
        raise ConfigError(f"ModelConfig.num_heads = {m.num_heads} is not divisible by mesh tensor = {tensor}")
    if m.num_kv_heads % tensor:
        raise ConfigError(f"ModelConfig.num_kv_heads = {m.num_kv_heads} is not divisible by mesh tensor = {tensor}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"ModelConfig.num_heads = {m.num_heads} is not a multiple of "
                          f"ModelConfig.num_kv_heads = {m.num_kv_heads} (grouped-query attention)")
    if cfg.seq_len > m.max_seq_len:
        raise ConfigError(f"TrainConfig.seq_len = {cfg.seq_len} exceeds ModelConfig.max_seq_len = {m.max_seq_len}")
    if m.head_dim % 2:
        raise ConfigError(f"ModelConfig.head_dim = {m.head_dim} must be even for rotary embeddings")
    for key, value, allowed in [("ModelConfig.param_dtype", m.param_dtype, tuple(DTYPES)),
                                ("ModelConfig.compute_dtype", m.compute_dtype, tuple(DTYPES)),
                                ("ModelConfig.remat_policy", m.remat_policy, REMAT_POLICIES),
                                ("OptimizerConfig.schedule", o.schedule, SCHEDULES),
                                ("DataConfig.source", cfg.data.source, ("sample", "corpus"))]:
        if value not in allowed:
            raise ConfigError(f"{key} = {value!r}: choose one of {allowed}")
    if m.vocab_size < 0:
        raise ConfigError(f"ModelConfig.vocab_size = {m.vocab_size}: must be >= 0 (0 = from the tokenizer)")
    _validate_policies(cfg)
    return sizes


def operative_config_str() -> str:
    """The gin operative config: every parameter of every configurable that was called, defaults included."""
    return gin.operative_config_str()


def config_hash(text: str) -> str:
    """sha256 of the operative config text (hex), used in run records."""
    return hashlib.sha256(text.encode()).hexdigest()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The config flags shared by every entry point that builds a TrainConfig."""
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="gin file; may repeat, later files win")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                        help="gin binding such as 'TrainConfig.seed = 1'; may repeat; applied last")
    parser.add_argument("--workdir", help="run directory (TrainConfig.workdir)")
    parser.add_argument("--steps", type=int, help="global step to train up to (TrainConfig.steps)")
    parser.add_argument("--mesh", help="mesh sizes, e.g. data=2,fsdp=2,tensor=2 (TrainConfig.mesh)")


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Build the config from parsed :func:`add_arguments` flags."""
    return parse(args.config, args.gin, workdir=args.workdir, steps=args.steps, mesh=args.mesh)
