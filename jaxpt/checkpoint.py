"""Checkpoints that resume exactly: Orbax ``CheckpointManager`` with asynchronous saves.

Layout: ``<workdir>/checkpoints/<step>/`` with three items:

* ``state``: the :class:`jaxpt.training.state.TrainState` (params, optimizer state, step, RNG), saved sharded by
  every process; restored onto the *current* mesh's abstract state, so a checkpoint written on one mesh
  and device count restores on another (resharding).
* ``data``: each process's Grain iterator state (``process_<i>-of-<n>.json``).
* ``meta``: JSON: the operative gin config, model config, data version, tokenizer path and sha256, mesh
  shape, model layout (scanned or not), library versions, process count.

A save is committed atomically by Orbax (written to a temporary directory, renamed when complete), so
a process killed inside an asynchronous save leaves no step that :meth:`Checkpointer.latest_step` picks up.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocm

from jaxpt.data.shards import DataShardsRestore, DataShardsSave, ShardedBatches
from jaxpt.util import fs
from jaxpt.util.errors import CheckpointError  # noqa: F401  raised here; importers name it from this module too
from jaxpt.util.validation import check_types, non_negative, require

log = logging.getLogger("jaxpt.checkpoint")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When to save and what to keep.

    Attributes:
      enabled: save checkpoints at all.
      save_every_steps: save when ``step % save_every_steps == 0`` (0 disables).
      save_every_minutes: also save when this many minutes passed since the last save (0 disables).
      keep_last: checkpoints kept among the most recent (older temporary ones are pruned).
      keep_every_steps: additionally keep every checkpoint whose step is a multiple of this, forever
        (0 disables).
      async_save: write in a background thread; the loop blocks only for the device-to-host copy.

    Raises:
      ConfigError: at construction, naming ``CheckpointConfig.<field> = <value>``: a wrong type, a negative
        interval or count, or ``keep_last < 1`` while ``enabled``.
    """

    enabled: bool = True
    save_every_steps: int = 100
    save_every_minutes: float = 0.0
    keep_last: int = 3
    keep_every_steps: int = 0
    async_save: bool = True

    def __post_init__(self) -> None:
        check_types(self)
        non_negative(self, "save_every_steps", "save_every_minutes", "keep_last", "keep_every_steps")
        require(self, "keep_last", not self.enabled or self.keep_last >= 1,
                "must be >= 1 when CheckpointConfig.enabled is True")


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose formats a checkpoint depends on."""
    import flax
    import optax
    import orbax.checkpoint
    versions = {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
                "optax": optax.__version__, "orbax-checkpoint": getattr(orbax.checkpoint, "__version__", "?")}
    try:
        import grain
        versions["grain"] = getattr(grain, "__version__", "?")
    except ImportError:
        pass
    return versions


def _data_save_args(data_iterator):
    if isinstance(data_iterator, ShardedBatches):
        return DataShardsSave(data_iterator)
    import grain
    return grain.checkpoint.CheckpointSave(data_iterator)


def _data_restore_args(data_iterator, meta: dict, where: str):
    """Per-shard iterator states (any process count dividing the shard count), or Grain's per-process files
    (same process count only).

    Raises:
      CheckpointError: the data layout of the checkpoint cannot feed this run.
    """
    if isinstance(data_iterator, ShardedBatches):
        saved = meta.get("data_shards")
        if saved is not None and saved != data_iterator.num_shards:
            raise CheckpointError(f"checkpoint {where} has {saved} data shards, this run {data_iterator.num_shards} "
                                  "(DataConfig.num_shards must stay fixed for a run)")
        return DataShardsRestore(data_iterator)
    import grain
    n_saved = meta.get("process_count", 1)
    if n_saved != jax.process_count():
        raise CheckpointError(f"checkpoint {where} was written by {n_saved} processes, this run has "
                              f"{jax.process_count()}: per-process iterator states need the same count")
    return grain.checkpoint.CheckpointRestore(data_iterator)


class Checkpointer:
    """Saves and restores train state, data-iterator state and metadata under ``<workdir>/checkpoints``."""

    def __init__(self, workdir: str, cfg: CheckpointConfig, *, read_only: bool = False):
        """``read_only``: only restore (never creates, saves to or prunes the directory), e.g. for notebooks."""
        self.cfg = cfg
        self.directory = fs.absolute(fs.join(workdir, "checkpoints"))
        if read_only:
            if not fs.isdir(self.directory):
                raise CheckpointError(f"{self.directory}: no such checkpoint directory")
            absl_logger = logging.getLogger("absl")
            level = absl_logger.level
            absl_logger.setLevel(logging.ERROR)  # Orbax warns that a read-only manager is read-only
            try:
                self.manager = ocp.CheckpointManager(
                    self.directory, item_names=("state", "data", "meta"),
                    options=ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False))
            finally:
                absl_logger.setLevel(level)
            return
        policies = []
        if cfg.save_every_steps:
            policies.append(ocm.FixedIntervalPolicy(cfg.save_every_steps))
        if cfg.save_every_minutes:
            # timedelta takes fractional seconds; int() would turn 0.01 minutes into "every step".
            policies.append(ocm.ContinuousCheckpointingPolicy(
                minimum_interval_secs=cfg.save_every_minutes * 60))
        keep = [ocm.LatestN(cfg.keep_last)]
        if cfg.keep_every_steps:
            keep.append(ocm.EveryNSteps(cfg.keep_every_steps))
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocm.AnySavePolicy(policies) if policies else ocm.SpecificStepsPolicy([]),
            preservation_policy=ocm.AnyPreservationPolicy(keep),
            enable_async_checkpointing=cfg.async_save,
            create=True,
            # A trainer killed inside a save leaves a partial temporary directory (never picked up as a
            # step); delete such leftovers when the next trainer starts, or a big model's disk fills up.
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "meta"))

    # ------------------------------------------------------------------ saving
    def should_save(self, step: int) -> bool:
        """Whether the save policy wants ``step`` (never for a step already saved)."""
        return self.cfg.enabled and self.manager.should_save(step)

    def save(self, step: int, state: Any, data_iterator: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving ``step`` (asynchronously when configured). Returns whether a save was started.

        The device-to-host copy happens before this returns, so ``state`` may be donated right after.
        """
        if not self.cfg.enabled:
            return False
        if step in self.manager.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=_data_save_args(data_iterator),
            meta=ocp.args.JsonSave(meta),
        )
        return bool(self.manager.save(step, args=args, force=force))

    def wait(self) -> None:
        """Block until every started save is committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # ------------------------------------------------------------------ restoring
    def latest_step(self) -> int | None:
        """The newest *committed* step, or None. Incomplete (temporary) saves are ignored."""
        self.manager.reload()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        self.manager.reload()
        return list(self.manager.all_steps())

    def committed_step(self, step: int | None = None) -> int:
        """``step`` if it is a committed checkpoint step, or the newest committed step when ``step`` is None.

        Raises:
          CheckpointError: no committed checkpoint at all, or none at ``step`` (the committed steps named).
        """
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no committed checkpoint")
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError(f"{self.directory}: no committed step {step} (have {sorted(steps)})")
        return step

    def has_checkpoint_dirs(self) -> bool:
        """True if the checkpoint directory holds anything (committed or not)."""
        return fs.isdir(self.directory) and bool(fs.listdir(self.directory))

    def read_meta(self, step: int) -> dict[str, Any]:
        """The ``meta`` item of ``step``.

        Raises:
          CheckpointError: it cannot be read.
        """
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return dict(restored["meta"])
        except Exception as e:  # Orbax raises many types; name the checkpoint instead.
            raise CheckpointError(f"checkpoint {self.directory}/{step}: cannot read its metadata: {e}") from e

    def stored_param_count(self, step: int) -> int:
        """Elements of the ``params`` arrays stored at ``step``, from the ``state`` item's metadata (shapes only; no
        array is read): what a checkpoint's recorded model config must agree with before a model is built from it.

        Raises:
          CheckpointError: the metadata cannot be read or holds no params.
        """
        try:
            tree = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state").tree
            params = tree["params"]
        except Exception as e:  # Orbax raises many types; name the checkpoint instead.
            raise CheckpointError(f"checkpoint {self.directory}/{step}: cannot read its arrays' shapes: "
                                  f"{type(e).__name__}: {e}") from e
        leaves = jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "shape"))
        return int(sum(int(np.prod(leaf.shape)) for leaf in leaves))

    def restore(self, step: int, abstract_state: Any, data_iterator: Any | None,
                meta: dict[str, Any] | None = None) -> Any:
        """Restore ``step`` onto ``abstract_state`` (ShapeDtypeStructs with the *current* shardings) and,
        if given, set ``data_iterator``'s position.

        Args:
          meta: the step's ``meta`` item when the caller has read it already (the data layout it records decides
            how the iterator state is read); read here when None.

        Returns the restored state, every array ready.

        Raises:
          CheckpointError: naming the checkpoint and what failed.
        """
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None:
            meta = self.read_meta(step) if meta is None else meta
            items["data"] = _data_restore_args(data_iterator, meta, f"{self.directory}/{step}")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.directory}/{step} could not be restored: "
                                  f"{type(e).__name__}: {e}") from e
        # Ready before it is returned (once per resume, not per step): Orbax fills the arrays from its own threads,
        # and the caller's first step then never overlaps that work. (Taken while chasing a test abort; that abort
        # was XLA:CPU's intra-op pool starved by one program's collectives, tests/conftest.py PJRT_NPROC.)
        return jax.block_until_ready(restored["state"])

    def restore_data(self, step: int, data_iterator: Any, meta: dict[str, Any] | None = None) -> None:
        """Set ``data_iterator``'s position to the data-iterator state of ``step`` alone (no array is read): a new
        stage reading on from where its parent stopped (:func:`jaxpt.run.lineage.begin_stage`).

        Raises:
          CheckpointError: naming the checkpoint and what failed (e.g. another data layout).
        """
        meta = self.read_meta(step) if meta is None else meta
        args = _data_restore_args(data_iterator, meta, f"{self.directory}/{step}")
        try:
            self.manager.restore(step, args=ocp.args.Composite(data=args))
        except Exception as e:  # Orbax raises many types; name the checkpoint instead.
            raise CheckpointError(f"checkpoint {self.directory}/{step}: cannot restore its data position: "
                                  f"{type(e).__name__}: {e}") from e

    def restore_params(self, step: int, abstract_params: Any) -> dict[str, Any]:
        """Restore only ``params`` and ``step`` of ``step`` (an Orbax partial restore: optimizer state and
        other train-state fields are not read), placed by ``abstract_params``' shardings.

        Returns ``{"params": ..., "step": int32 array}``.

        Raises:
          CheckpointError: naming the checkpoint and what failed (e.g. params of another shape).
        """
        item = {"params": abstract_params, "step": jax.ShapeDtypeStruct((), jax.numpy.int32)}
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        restore_args["step"] = ocp.RestoreArgs(restore_type=np.ndarray)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        try:
            return dict(self.manager.restore(step, args=ocp.args.Composite(state=args))["state"])
        except Exception as e:  # Orbax raises many types; name the checkpoint instead.
            raise CheckpointError(f"checkpoint {self.directory}/{step}: cannot restore its params: "
                                  f"{type(e).__name__}: {e}") from e

    def restore_fields(self, step: int, abstract_state: Any, fields: tuple[str, ...]) -> dict[str, Any]:
        """Restore only the train-state ``fields`` (e.g. ``("params", "opt_state", "rng")``) of ``step``, an Orbax
        partial restore placed by ``abstract_state``'s shardings (the other fields, e.g. a spike history sized by
        another ``StabilityConfig``, are not read).

        Returns ``{field: restored}``.

        Raises:
          CheckpointError: naming the checkpoint and what failed (e.g. an optimizer of another structure).
        """
        item = {name: getattr(abstract_state, name) for name in fields}
        args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                      partial_restore=True)
        try:
            return dict(self.manager.restore(step, args=ocp.args.Composite(state=args))["state"])
        except Exception as e:  # Orbax raises many types; name the checkpoint instead.
            raise CheckpointError(f"checkpoint {self.directory}/{step}: cannot restore {', '.join(fields)}: "
                                  f"{type(e).__name__}: {e}") from e

    def rewind(self, before: int, abstract_state: Any) -> tuple[Any, int]:
        """Delete every checkpoint at or after step ``before`` (saved from a state already in trouble) and
        restore the newest one before it, without touching the data iterator (so the batches in between are
        skipped). Returns ``(state, step)``, or ``(None, 0)`` when no checkpoint precedes ``before``."""
        self.wait()
        steps = self.all_steps()
        for s in steps:
            if s >= before:
                self.manager.delete(s)
        good = [s for s in steps if s < before]
        if not good:
            return None, 0
        return self.restore(max(good), abstract_state, data_iterator=None), max(good)
