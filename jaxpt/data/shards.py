"""Logical data shards: the unit of data-iterator state, independent of the number of processes.

The global batch is split into ``num_shards`` (S) logical data shards. Shard ``k`` is an independent Grain
pipeline that reads the ``k``-th of S interleaved slices of the data (the prepared sample: documents
``k, k + S, k + 2S, ...`` of the shuffled stream, `jaxpt.data.loader.make_train_dataset` with
``process_index=k, process_count=S``; a corpus version, or the sample with a mixture: positions
``k, k + S, ...`` of every group's document stream, `jaxpt.data.mixture`) and contributes ``global_batch_size / S`` rows to every step.

Assignment (:func:`jaxpt.data.stream.train_batches`): each of the P processes runs a *contiguous block* of
S / P shards, process ``p`` the shards ``p * S/P, ..., (p + 1) * S/P - 1``, and :class:`ShardedBatches`
concatenates their rows in shard order into its local batch; ``jax.make_array_from_process_local_data`` then
concatenates the local batches in process order. The rows of a global batch are therefore always shards ``0, 1, ..., S - 1`` in
that order, whatever P is. So

* the global batch of a step does not depend on how many processes read it (one process running all shards
  produces the same batches as several processes, which is what the multi-host equivalence test checks);
* a checkpoint stores one iterator state per *shard* (``shard_<k>-of-<S>.json``), and a run restored with
  a different process count reassigns the blocks to processes and continues exactly. The rule: the shard
  count is fixed for the life of a run (recorded in the checkpoint); the new process count must divide it
  (else a ConfigError), and ``global_batch_size`` must be divisible by it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import numpy as np
import orbax.checkpoint as ocp
from etils import epath


class ShardedBatches:
    """Iterator over this process's local batches: one Grain iterator per logical shard, rows concatenated.

    Args:
      make_iterator: ``(shard_index, num_shards) -> iterator`` of dicts of arrays [rows_per_shard, L].
      num_shards: logical shards in the whole job.
      shard_ids: the shards this process runs, in increasing order (its contiguous block: module docstring).

    Each ``next`` returns a dict of arrays [len(shard_ids) * rows_per_shard, L], the shards' rows concatenated
    in ``shard_ids`` order.
    """

    def __init__(self, make_iterator: Callable[[int, int], Any], num_shards: int, shard_ids: list[int]):
        self.num_shards = num_shards
        self.shard_ids = list(shard_ids)
        self.iterators = {k: make_iterator(k, num_shards) for k in self.shard_ids}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(self.iterators[k]) for k in self.shard_ids]
        return {key: np.concatenate([p[key] for p in parts], axis=0) for key in parts[0]}

    def get_state(self) -> dict[int, Any]:
        return {k: it.get_state() for k, it in self.iterators.items()}

    def set_state(self, states: dict[int, Any]) -> None:
        for k, st in states.items():
            self.iterators[k].set_state(st)

    def restart_step_count(self) -> None:
        """After a state carried from another run (a new stage reading on from its parent's data position): the
        next batch feeds this stream's first step. The read positions stay; a shard whose state counts steps (a
        token mixture, for its schedule) counts from that step again."""
        for it in self.iterators.values():
            if hasattr(it, "restart_step_count"):
                it.restart_step_count()


def _shard_file(directory: epath.Path, k: int, n: int) -> epath.Path:
    return directory / f"shard_{k:05d}-of-{n:05d}.json"


class DataShardsHandler(ocp.CheckpointHandler):
    """Orbax handler: each process writes (and reads) the state files of its own logical shards."""

    def save(self, directory: epath.Path, args: "DataShardsSave"):
        it: ShardedBatches = args.item
        for k, st in it.get_state().items():
            _shard_file(directory, k, it.num_shards).write_text(json.dumps(st, indent=1))

    def restore(self, directory: epath.Path, args: "DataShardsRestore") -> ShardedBatches:
        it: ShardedBatches = args.item
        states = {}
        for k in it.shard_ids:
            path = _shard_file(directory, k, it.num_shards)
            if not path.exists():
                found = sorted(p.name for p in directory.iterdir())
                raise FileNotFoundError(f"{path} is missing (checkpoint holds {found}); the data shard count "
                                        f"of the checkpoint and of this run differ")
            states[k] = json.loads(path.read_text())
        it.set_state(states)
        return it

    def structure(self, directory: epath.Path) -> Any:
        return None

    def metadata(self, directory: epath.Path) -> Any:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass

    @classmethod
    def typestr(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(DataShardsHandler, for_save=True)
@dataclasses.dataclass
class DataShardsSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(DataShardsHandler, for_restore=True)
@dataclasses.dataclass
class DataShardsRestore(ocp.args.CheckpointArgs):
    item: Any
