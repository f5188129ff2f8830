"""Logical data shards: the unit of data-iterator state, independent of the number of processes.

The global batch is split into ``num_shards`` logical data shards, each an independent Grain pipeline over
documents ``k, k + S, k + 2S, ...`` of the shuffled stream (S = ``num_shards``) that contributes
``global_batch_size / S`` rows. Process ``p`` of ``P`` runs shards ``p, p + P, ...`` and hands their rows,
concatenated in shard order, to ``jax.make_array_from_process_local_data``. So

* the global batch of a step does not depend on how many processes read it (one process running all shards
  produces the same batches as several processes, which is what the multi-host equivalence test checks);
* a checkpoint stores one iterator state per *shard* (``shard_<k>-of-<S>.json``), and a run restored with
  a different process count reassigns shards to processes and continues exactly. The rule: the shard count
  is fixed for the life of a run (recorded in the checkpoint); the new process count must divide it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import numpy as np
import orbax.checkpoint as ocp
from etils import epath


class ShardAssignmentError(ValueError):
    """The process count does not divide the run's number of data shards."""


def shards_of_process(num_shards: int, process_index: int, process_count: int) -> list[int]:
    """Logical shards read by one process.

    Raises:
      ShardAssignmentError: ``process_count`` does not divide ``num_shards``.
    """
    if num_shards % process_count:
        raise ShardAssignmentError(
            f"{process_count} processes cannot share {num_shards} data shards evenly; this run's data "
            f"shard count is fixed (DataConfig.num_shards, recorded in its checkpoints): use a process "
            f"count that divides {num_shards}")
    return list(range(process_index, num_shards, process_count))


class ShardedBatches:
    """Iterator over this process's local batches: one Grain iterator per logical shard, rows concatenated.

    Args:
      make_iterator: ``(shard_index, num_shards) -> iterator`` of dicts of arrays [rows_per_shard, L].
      num_shards: logical shards in the whole job.
      shard_ids: the shards this process runs.
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
