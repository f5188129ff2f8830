"""The checks of a config across its parts and against the devices, run once per start before anything compiles.

Each config dataclass already checked its own fields when it was built (types, ranges, choices;
:mod:`jaxpt.config`); :func:`validate` checks what needs two configs or the device count: mesh sizes, unused mesh
axes, batch and head divisibility, pipeline and context-parallel constraints, and the learning-rate phases
against the run's horizon. :func:`jaxpt.run.resolve.resolve` (a run, ``--dry-run``) and
:func:`jaxpt.run.resolve.layout` (compile-only and benchmark builds) call it; the builder does not.
"""

from __future__ import annotations

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.config import TrainConfig
from jaxpt.model import context_parallel
from jaxpt.training import batch_ramp
from jaxpt.training.optim import MUP_WITH_MUON, check_schedule
from jaxpt.util.errors import ConfigError


def _mesh_shape(cfg: TrainConfig, num_devices: int) -> mesh_lib.MeshShape:
    """Resolved ICI and DCN sizes; raises ConfigError naming ``TrainConfig.mesh`` or ``TrainConfig.dcn_mesh``."""
    try:
        return mesh_lib.resolve_mesh(cfg.mesh, cfg.dcn_mesh, num_devices)
    except mesh_lib.MeshError as e:
        raise ConfigError(f"TrainConfig.{e.key} = {getattr(cfg, e.key)!r}: {e}") from None


def _check_mesh_axes_used(cfg: TrainConfig, sizes: dict[str, int]) -> None:
    """An axis of size > 1 that no logical-axis rule uses only replicates work: refuse it, naming it."""
    model_axes = set(mesh_lib.LOGICAL_AXES) - ({"exp"} if not cfg.model.num_moe_layers else set())
    unused = mesh_lib.unused_mesh_axes(sizes, cfg.logical_axis_rules, model_axes)
    if not unused:
        return
    where = f"TrainConfig.mesh = {cfg.mesh!r}" + (f", TrainConfig.dcn_mesh = {cfg.dcn_mesh!r}" if cfg.dcn_mesh else "")
    reasons = []
    if "expert" in unused and not cfg.model.num_moe_layers:  # a rule uses it, but a dense model has nothing there
        reasons.append(f"mesh axis 'expert' (size {unused.pop('expert')}) has nothing to split: it splits the "
                       f"experts of MoE layers and ModelConfig.mlp = {cfg.model.mlp!r} has none; give it size 1, "
                       "or train an MoE model (ModelConfig.mlp = 'moe')")
    if unused:
        axes = ", ".join(f"{a!r} (size {n})" for a, n in unused.items())
        one = len(unused) == 1
        reasons.append(f"mesh {'axis' if one else 'axes'} {axes} {'is' if one else 'are'} used by no "
                       "TrainConfig.logical_axis_rules entry, so every array would be replicated over "
                       f"{'it' if one else 'them'} (the same work repeated); give {'it' if one else 'them'} "
                       f"size 1, or map a logical axis to {'it' if one else 'them'}")
    raise ConfigError(f"{where}: " + "; ".join(reasons))


def _check_expert_axis(cfg: TrainConfig, sizes: dict[str, int]) -> None:
    """Mesh ``expert`` splits the experts of each MoE layer (logical ``exp``) evenly. (For a dense model it is
    refused as unused: :func:`_check_mesh_axes_used`.)"""
    n, m = sizes["expert"], cfg.model
    if n > 1 and m.num_moe_layers and m.moe_num_experts % n:
        raise ConfigError(f"ModelConfig.moe_num_experts = {m.moe_num_experts} is not divisible by mesh "
                          f"expert = {n} (TrainConfig.mesh = {cfg.mesh!r})")
    if n > 1 and m.num_moe_layers and m.moe_dropless:
        # The dropless path sorts all of a call's assignments by expert and runs jax.lax.ragged_dot on them:
        # under the SPMD partitioner that is one global sort and every expert's weights gathered, not experts
        # split over devices with tokens exchanged. An expert-parallel dropless layer needs a shard_map with
        # a ragged all-to-all (MegaBlocks/MaxText style), which jaxpt does not have.
        raise ConfigError(f"ModelConfig.moe_dropless = True is not expert-parallel, so mesh expert = {n} "
                          f"(TrainConfig.mesh = {cfg.mesh!r}) is refused: use expert = 1 (experts then split "
                          "over fsdp/tensor like other weights), or capacity mode (moe_dropless = False; "
                          "moe_capacity_factor >= moe_num_experts / moe_top_k drops nothing)")


def _check_batch(cfg: TrainConfig, sizes: dict[str, int]) -> None:
    """The global batch splits into micro-batches and each of those over the data-parallel shards."""
    dp = mesh_lib.data_parallel_size(sizes, cfg.logical_axis_rules)
    if cfg.global_batch_size % dp:
        raise ConfigError(
            f"TrainConfig.global_batch_size = {cfg.global_batch_size} is not divisible by the data-parallel "
            f"size {dp} (mesh {mesh_lib.format_mesh(sizes)}; batch is sharded over the 'batch' rule's axes)")
    if cfg.global_batch_size % (dp * cfg.grad_accum_steps):
        raise ConfigError(
            f"TrainConfig.global_batch_size = {cfg.global_batch_size} is not divisible by data-parallel size "
            f"{dp} x TrainConfig.grad_accum_steps = {cfg.grad_accum_steps} (each micro-batch must split "
            f"evenly over the data-parallel shards)")
    n = cfg.data.num_shards
    if n and cfg.global_batch_size % n:
        raise ConfigError(f"DataConfig.num_shards = {n} must divide TrainConfig.global_batch_size = "
                          f"{cfg.global_batch_size}")
    batch_ramp.validate(cfg, dp)


def _check_context_parallel(cfg: TrainConfig, sizes: dict[str, int]) -> None:
    """With the row split over devices (``length`` -> ``sequence``), each holds two equal chunks (causal load
    balancing, :mod:`jaxpt.model.context_parallel`) and the attention implementation must support it."""
    shards = mesh_lib.logical_axis_size(sizes, cfg.logical_axis_rules, "length")
    if shards == 1:
        return
    if cfg.seq_len % (2 * shards):
        raise ConfigError(
            f"TrainConfig.seq_len = {cfg.seq_len} is not divisible by 2 x {shards} (mesh "
            f"{mesh_lib.format_mesh(sizes)} splits each row over {shards} devices, each holding a front and a "
            f"back chunk for causal load balancing)")
    if cfg.model.attention_impl not in context_parallel.SUPPORTED:
        raise ConfigError(
            f"ModelConfig.attention_impl = {cfg.model.attention_impl!r} does not run with context parallelism "
            f"(mesh {mesh_lib.format_mesh(sizes)}); choose one of {', '.join(context_parallel.SUPPORTED)}")
    if cfg.model.attention_impl == "splash":
        bad = context_parallel.splash_misfit(cfg.seq_len, shards)
        if bad:
            raise ConfigError(f"TrainConfig.seq_len = {cfg.seq_len} with ModelConfig.attention_impl = 'splash' over "
                              f"mesh sequence = {shards}: {bad}")


def _check_pipeline(cfg: TrainConfig, sizes: dict[str, int]) -> None:
    """With ``stage > 1``: the micro-batches cover the stages, split each model call's batch evenly over the
    data-parallel shards, and the layers split into ``stages x pipeline_repeats`` equal groups."""
    m, S = cfg.model, sizes[mesh_lib.PIPELINE_AXIS]
    if S == 1:
        return
    M = m.pipeline_microbatches or S
    where = f"(mesh stage = {S})"
    if M < S:
        raise ConfigError(f"ModelConfig.pipeline_microbatches = {m.pipeline_microbatches} is fewer than the {S} "
                          f"pipeline stages {where}: every stage must have a micro-batch to work on")
    rows = cfg.global_batch_size // cfg.grad_accum_steps
    dp = mesh_lib.data_parallel_size(sizes, cfg.logical_axis_rules)
    if rows % (M * dp):
        raise ConfigError(
            f"ModelConfig.pipeline_microbatches = {M} does not divide the {rows} rows of each model call "
            f"(TrainConfig.global_batch_size = {cfg.global_batch_size} / TrainConfig.grad_accum_steps = "
            f"{cfg.grad_accum_steps}) into micro-batches that split evenly over the data-parallel size {dp}")
    if m.attention_impl == "splash":
        raise ConfigError(f"ModelConfig.attention_impl = 'splash' cannot run inside the pipeline {where}: its Pallas "
                          "kernel's own shard_map does not nest in the pipeline's yet; use 'blockwise' (or 'auto', "
                          "which picks it there)")
    if m.num_moe_layers:
        raise ConfigError(f"ModelConfig.mlp = 'moe' does not run inside the pipeline {where} yet (its per-expert "
                          "metrics and all-to-all are untested under the stage shard_map); use a mesh without stage")
    if mesh_lib.logical_axis_size(sizes, cfg.logical_axis_rules, "length") > 1:
        raise ConfigError(f"TrainConfig.mesh = {cfg.mesh!r}: context parallelism (the row split over `sequence`) "
                          f"does not run inside the pipeline {where} yet; use one or the other")
    groups = S * m.pipeline_repeats
    if m.num_layers % groups:
        raise ConfigError(f"ModelConfig.num_layers = {m.num_layers} is not divisible by {S} stages x "
                          f"ModelConfig.pipeline_repeats = {m.pipeline_repeats} {where}")


def validate(cfg: TrainConfig, num_devices: int) -> dict[str, int]:
    """Check the config across its parts and against the device count, before any compile.

    Each config already checked its own fields when it was built (types, ranges, choices); this checks
    what needs two configs or the devices.

    Args:
      cfg: the config.
      num_devices: devices in the whole run (all processes).

    Returns:
      The resolved mesh sizes ``{axis: size}`` (ICI x DCN per axis, every axis of ``mesh.MESH_AXES``).

    Raises:
      ConfigError: naming the key: mesh sizes that do not fit the devices (``TrainConfig.mesh`` /
        ``dcn_mesh``); a mesh axis of size > 1 that no logical-axis rule uses; a global batch not divisible
        by the data-parallel size x ``grad_accum_steps``, or by ``DataConfig.num_shards``; with mesh
        ``stage > 1``, ``ModelConfig.pipeline_microbatches`` below the stage count or not dividing each model
        call's rows into data-parallel-divisible micro-batches, ``ModelConfig.num_layers`` not divisible by
        stages x ``ModelConfig.pipeline_repeats``, ``attention_impl = 'splash'``, an MoE MLP, or the row also split over
        ``sequence``; heads or kv heads not divisible by mesh ``tensor``; ``seq_len`` above
        ``ModelConfig.max_seq_len``; with the row split over ``sequence`` (context parallelism), ``seq_len`` not
        divisible by 2 x its size, or an ``attention_impl`` that does not support it, or rows splash cannot
        block; schedule phases that do not fit the decay horizon (:func:`jaxpt.training.optim.check_schedule`; a stage's
        horizon is ``steps`` minus its start step, :func:`jaxpt.config.start_step`); mesh ``expert`` > 1 for a
        model without MoE layers, or not dividing ``ModelConfig.moe_num_experts``, or with
        ``ModelConfig.moe_dropless`` (not expert-parallel); ``ModelConfig.parametrization = 'mup'`` with
        ``OptimizerConfig.algorithm = 'muon'``.
    """
    m = cfg.model
    sizes = _mesh_shape(cfg, num_devices).sizes
    _check_mesh_axes_used(cfg, sizes)
    _check_expert_axis(cfg, sizes)
    _check_batch(cfg, sizes)
    _check_pipeline(cfg, sizes)
    tensor = sizes["tensor"]
    if m.num_heads % tensor:
        raise ConfigError(f"ModelConfig.num_heads = {m.num_heads} is not divisible by mesh tensor = {tensor}")
    if m.num_kv_heads % tensor:
        raise ConfigError(f"ModelConfig.num_kv_heads = {m.num_kv_heads} is not divisible by mesh tensor = {tensor}")
    if m.num_moe_layers and m.moe_group_size and cfg.seq_len % m.moe_group_size:
        raise ConfigError(f"ModelConfig.moe_group_size = {m.moe_group_size} does not divide TrainConfig.seq_len = "
                          f"{cfg.seq_len} (routing groups are cut from rows)")
    if cfg.seq_len > m.max_seq_len:
        raise ConfigError(f"TrainConfig.seq_len = {cfg.seq_len} exceeds ModelConfig.max_seq_len = {m.max_seq_len}")
    _check_context_parallel(cfg, sizes)
    start = config_lib.start_step(cfg)
    if start and cfg.steps <= start:
        raise ConfigError(f"TrainConfig.steps = {cfg.steps} must exceed the step the stage starts from ({start}, "
                          f"TrainConfig.init_from = {cfg.init_from!r}): steps counts from the start of the first stage")
    check_schedule(cfg.optimizer, cfg.steps - start)
    if m.parametrization == "mup" and cfg.optimizer.algorithm == "muon":
        raise ConfigError(MUP_WITH_MUON)
    return sizes
