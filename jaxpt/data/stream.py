"""A run's training stream: logical data shards, this process's batches, and device placement.

The trainer asks this module for its batches (:func:`train_batches`), how many logical shards the run has
(:func:`data_shard_count`), how to put this process's rows on the mesh (:func:`to_device`) and what the
training data is (:func:`data_version`). Shard semantics are in :mod:`jaxpt.data.shards`.
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

from jaxpt import mesh as mesh_lib
from jaxpt.data import corpus, documents, loader, mixture
from jaxpt.data.corpus import corpus_mixture_iterator
from jaxpt.data.shards import ShardedBatches
from jaxpt.training import batch_ramp
from jaxpt.util import fs, jsonl
from jaxpt.util.errors import ConfigError

#: Keys of a device batch; each is an int32 array [B, L] (see :mod:`jaxpt.training.step`).
DEVICE_KEYS = ("tokens", "segment_ids", "positions")


def loader_batch_size(cfg) -> int:
    """Global rows of one loader batch: ``global_batch_size``, or with a batch-size ramp the greatest common
    divisor of its sizes (a step takes several, :func:`next_batch`; :mod:`jaxpt.training.batch_ramp`)."""
    return batch_ramp.from_config(cfg).unit


def next_batch(batches, count: int = 1) -> dict[str, np.ndarray]:
    """The next ``count`` loader batches of ``batches``, rows concatenated in order (``count`` 1: the batch
    itself): a step of a batch-size ramp takes as many as its size needs."""
    if count == 1:
        return next(batches)
    parts = [next(batches) for _ in range(count)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def local_batch_size(cfg) -> int:
    """Rows this process contributes to each global batch (``global_batch_size / process_count``)."""
    return cfg.global_batch_size // jax.process_count()


#: The most logical data shards a run gets by default (``DataConfig.num_shards = 0``): runs on up to this many
#: processes (hosts) can start, grow and shrink without setting it.
DEFAULT_MAX_SHARDS = 256


def default_shard_count(cfg) -> int:
    """The logical data shards of a run that does not set ``DataConfig.num_shards``: the largest divisor of the
    loader batch (:func:`loader_batch_size`: ``global_batch_size``, or a ramp's smallest unit) not above
    :data:`DEFAULT_MAX_SHARDS`, so that every process count that divides it can run the run and resume it, growing
    or shrinking (the shard count is fixed for the life of a run; :mod:`jaxpt.data.shards`)."""
    unit = loader_batch_size(cfg)
    return max(d for d in range(1, min(unit, DEFAULT_MAX_SHARDS) + 1) if unit % d == 0)


def data_shard_count(cfg, saved_shards: int | None = None) -> int:
    """The run's logical data shard count: ``DataConfig.num_shards``, else the count its checkpoints recorded
    (``saved_shards``), else :func:`default_shard_count` (see :mod:`jaxpt.data.shards`)."""
    if cfg.data.num_shards:
        return cfg.data.num_shards
    if saved_shards:
        return int(saved_shards)
    return default_shard_count(cfg)


def check_shards(cfg, num_shards: int, recorded: bool = False, processes: int | None = None) -> None:
    """``processes`` (default: this run's process count) can run ``num_shards`` logical data shards of ``cfg``
    (``recorded``: the count comes from the run's checkpoints, so it cannot change); checked before a run writes
    anything.

    Raises:
      ConfigError: the process count does not divide the shard count (saying what to resume on, and what to set
        when starting a run that must grow), or the shard count does not divide the (loader) batch.
    """
    P, unit = processes or jax.process_count(), loader_batch_size(cfg)
    if num_shards % P:
        held = (f"the {num_shards} logical data shards this run's checkpoints record (fixed for the life of a run, so "
                "its data position carries over exactly)" if recorded else
                f"DataConfig.num_shards = {num_shards} logical data shards")
        raise ConfigError(
            f"{P} processes cannot share {held} evenly: run on a process count that divides {num_shards}; a run "
            f"that must run on {P} processes starts with DataConfig.num_shards = {unit} (one shard per row of the "
            f"{unit}-row loader batch: every process count that divides it can then start, grow and shrink it)")
    if cfg.global_batch_size % num_shards:
        raise ConfigError(f"TrainConfig.global_batch_size = {cfg.global_batch_size} is not divisible by the "
                          f"{num_shards} data shards")
    if unit % num_shards:
        raise ConfigError(f"TrainConfig.batch_size_schedule = {cfg.batch_size_schedule!r}: its loader batch of "
                          f"{unit} rows (the greatest common divisor of the sizes) is not divisible by the "
                          f"{num_shards} data shards")


def _shard_iterator(cfg, tokenizer, k: int, n: int, first_step: int):
    """Iterator of logical shard ``k`` of ``n``: local batches ``int32[global_batch / n, seq_len]`` per key, the
    first feeding global step ``first_step``.

    A corpus version, or the sample with ``DataConfig.mixture_weights`` / ``mixture_schedule``, is mixed by
    tokens (:mod:`jaxpt.data.mixture`); the sample without a mixture is read in its natural proportion."""
    schedule, key = mixture.schedule_from_config(cfg.data), mixture.config_key(cfg.data)
    rows = loader_batch_size(cfg) // n  # rows of one loader batch (a batch-size ramp takes several a step)
    step_of_batch = _step_of_batch(cfg, first_step)
    if cfg.data.source == "corpus":  # a corpus version built by data_pipelines.build
        return corpus_mixture_iterator(
            cfg.data.corpus_dir, tokenizer, schedule, key=key, seq_len=cfg.seq_len, rows=rows, seed=cfg.seed,
            shard=k, num_shards=n, document_boundary=cfg.data.document_boundary, shuffle=cfg.data.shuffle,
            first_step=first_step, step_of_batch=step_of_batch)
    if schedule is not None:
        return loader.sample_mixture_iterator(
            cfg.data.train_path, tokenizer, schedule, key=key, seq_len=cfg.seq_len, rows=rows, seed=cfg.seed,
            shard=k, num_shards=n, document_boundary=cfg.data.document_boundary, shuffle=cfg.data.shuffle,
            first_step=first_step, step_of_batch=step_of_batch)
    return iter(loader.make_train_dataset(
        cfg.data.train_path, tokenizer, seq_len=cfg.seq_len, local_batch_size=rows,
        seed=cfg.seed, process_index=k, process_count=n, shuffle=cfg.data.shuffle,
        document_boundary=cfg.data.document_boundary,
        long_doc_min_chars=cfg.data.long_doc_min_chars, long_doc_weight=cfg.data.long_doc_weight))


def _step_of_batch(cfg, first_step: int):
    """Loader batch index (0-based) -> the global step it feeds under a batch-size ramp (a step of ``B`` rows
    takes ``B / unit`` loader batches, :mod:`jaxpt.training.batch_ramp`); None without a ramp (one batch a step)."""
    ramp = batch_ramp.from_config(cfg)
    if len(ramp.sizes) == 1:
        return None
    base = ramp.rows_through(first_step - 1)

    def step_of(b: int) -> int:  # the first step whose loader batches reach past index b (binary search)
        lo, hi = first_step, first_step + b
        while lo < hi:
            mid = (lo + hi) // 2
            if (ramp.rows_through(mid) - base) // ramp.unit > b:
                hi = mid
            else:
                lo = mid + 1
        return lo

    return step_of


def train_batches(cfg, tokenizer, num_shards: int, *, first_step: int):
    """This process's iterator of local batches: its contiguous block of logical data shards, rows
    concatenated in shard order (so the global row order does not depend on the process count).

    ``first_step``: the global step the first batch feeds (1; a stage from a parent at step ``P``: ``P + 1``, which
    positions a mixture schedule and a batch-size ramp; :attr:`jaxpt.run.resolve.Resolved.first_step`).

    Raises:
      ConfigError: as :func:`check_shards` (which :func:`jaxpt.run.resolve.resolve` runs before anything is written).
    """
    P, p = jax.process_count(), jax.process_index()
    check_shards(cfg, num_shards)
    per_process = num_shards // P
    shard_ids = list(range(p * per_process, (p + 1) * per_process))
    return ShardedBatches(lambda k, n: _shard_iterator(cfg, tokenizer, k, n, first_step), num_shards, shard_ids)


def to_device(mesh, rules, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows (``int32[local_batch, seq_len]`` per key) -> global arrays
    ``int32[global_batch, seq_len]`` sharded over the ``batch`` rule's mesh axes, for :data:`DEVICE_KEYS`."""
    sharding = mesh_lib.batch_sharding(mesh, rules)
    return loader.to_global_batch({k: local_batch[k] for k in DEVICE_KEYS}, sharding)


def data_version(cfg) -> str:
    """An identifier of the training data. A corpus version: its manifest's ``data_version``, else
    ``content:<first 16 hex of its content id>`` (read by :func:`jaxpt.data.corpus.read_corpus_version`). The
    prepared sample: ``prepare.json``'s ``data_version``, else ``sha256:<first 16 hex>`` of that file. Other JSON Lines
    files: ``files:<first 16 hex>`` of their names and sizes (a cheap identity, not a content hash).

    Raises:
      FileNotFoundError, ConfigError: a corpus directory that is not a corpus version (as ``read_corpus_version``).
    """
    d = cfg.data
    if d.source == "corpus":
        version = corpus.read_corpus_version(d.corpus_dir)
        if version.data_version:
            return version.data_version
        return f"content:{version.content_id[:16]}" if version.content_id else "unknown"
    path = fs.join(fs.dirname(d.train_path), "prepare.json")
    if not fs.exists(path):
        files = [(fs.basename(f), fs.path(f).stat().length) for f in documents.expand(d.train_path)]
        return f"files:{hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]}" if files else "unknown"
    raw = fs.read_bytes(path)
    try:
        version = json.loads(raw).get("data_version")
    except (ValueError, AttributeError):
        version = None
    return version or f"sha256:{hashlib.sha256(raw).hexdigest()[:16]}"


class BatchDocumentLog:
    """Per-process JSON Lines ``<workdir>/batches/process_<i>.jsonl`` of ``{"step", "doc_index"}``: which
    documents fed each step (an audit trail for resumption and data debugging).

    ``start_step``: the step the run starts from. When the log holds lines of later steps (a session whose last
    checkpoints were lost; any line, for a fresh run), a marker ``{"step", "superseded_after": start_step}``
    (-1 for a fresh run) is appended first; :func:`jaxpt.util.jsonl.drop_superseded` applies it, leaving one line
    per step. None: plain append.
    """

    def __init__(self, workdir: str, start_step: int | None = None):
        fs.makedirs(fs.join(workdir, "batches"))
        self.path = fs.join(workdir, "batches", f"process_{jax.process_index()}.jsonl")
        jsonl.drop_partial_last_line(self.path)  # a line half-written by a killed run must not end up mid-file
        self._f = fs.Appender(self.path)
        if start_step is not None:
            last, after = jsonl.last_step(self.path), start_step if start_step else -1
            if last is not None and last > after:
                self.rewind(after)

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (a rollback or resume): supersede the lines after it."""
        self._f.write(f'{{"step": {max(step, 0)}, "{jsonl.SUPERSEDED_AFTER}": {step}}}\n')

    def write(self, step: int, doc_index: np.ndarray) -> None:
        """Record the documents (``doc_index >= 0``; -1 is padding) of this process's rows of ``step``."""
        docs = sorted(int(d) for d in np.unique(doc_index) if d >= 0)
        self._f.write(f'{{"step": {step}, "doc_index": {docs}}}\n')

    def close(self) -> None:
        self._f.close()

