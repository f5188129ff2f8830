"""Training-side reader of a built corpus version (`python -m data_pipelines.build`).

A corpus directory holds ``mixture.json`` (per-domain weights and shard lists) and a TFDS dataset
in the ArrayRecord file format under ``tfds/<name>/<version>/``, one split per domain. Each record
is a serialized ``tf.train.Example`` with features ``id``, ``source``, ``domain``, ``lang``,
``text`` (strings) and ``tokens`` (``int32[n]`` SentencePiece ids, no BOS/EOS). TFDS decodes
records with numpy; TensorFlow is not imported.

`corpus_dataset` returns a Grain ``IterDataset`` of ``int32[n]`` token arrays: each domain is
sharded by process (``records[process_index::process_count]``), shuffled with a seed, repeated
without end, and the domains are mixed by their weights (Grain's ``MapDataset.mix``). Iterators are
checkpointable (``get_state`` / ``set_state``).
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import grain
import numpy as np


def read_mixture(corpus_dir: str) -> dict:
    """``mixture.json`` of a corpus. Raises FileNotFoundError naming the path."""
    path = os.path.join(corpus_dir, "mixture.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: not a built corpus directory (no mixture.json)")
    with open(path) as f:
        return json.load(f)


def domain_source(corpus_dir: str, domain: str):
    """Random-access TFDS source of one domain split (records decode to dicts of numpy arrays)."""
    import tensorflow_datasets as tfds

    mix = read_mixture(corpus_dir)
    t = mix["tfds"]
    data_dir = os.path.join(corpus_dir, t["data_dir"], t["name"], t["version"])
    return tfds.builder_from_directory(data_dir).as_data_source(split=domain)


def _tokens(example) -> np.ndarray:
    return np.asarray(example["tokens"], dtype=np.int32)


class _ForPacking:
    """Record -> ``{"tokens": int32[n], "doc_index": int}`` for :class:`jaxpt.data.packing.PackedIterDataset`.

    ``doc_index`` is a stable 31-bit number derived from the record's ``id`` (crc32), so a batch's documents
    can be listed and compared across runs."""

    def __call__(self, example) -> dict:
        import zlib
        doc_id = example["id"]
        doc_id = doc_id.decode() if isinstance(doc_id, bytes) else str(doc_id)
        return {"tokens": _tokens(example), "doc_index": zlib.crc32(doc_id.encode()) & 0x7FFFFFFF}


def packed_corpus_dataset(corpus_dir: str, tokenizer, *, seq_len: int, local_batch_size: int, seed: int,
                          process_index: int = 0, process_count: int = 1, add_eos: bool = True):
    """The training stream of a corpus version: mixed by the corpus weights, packed like the sample path
    (:mod:`jaxpt.data.packing`), batched to ``[local_batch_size, seq_len]`` dicts. Checkpointable."""
    from jaxpt.data import packing
    ds = _mixed(corpus_dir, seed=seed, process_index=process_index, process_count=process_count,
                record_fn=_ForPacking())
    ds = packing.PackedIterDataset(ds, seq_len, pad_id=tokenizer.pad_id,
                                   eos_id=tokenizer.eos_id if add_eos else None)
    return ds.batch(local_batch_size, drop_remainder=True)


def corpus_dataset(
    corpus_dir: str,
    *,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    weights: Mapping[str, float] | None = None,
) -> grain.IterDataset:
    return _mixed(corpus_dir, seed=seed, process_index=process_index, process_count=process_count,
                  weights=weights, record_fn=_tokens)


def _mixed(corpus_dir: str, *, seed: int, process_index: int = 0, process_count: int = 1,
           weights: Mapping[str, float] | None = None, record_fn=_tokens) -> grain.IterDataset:
    """Infinite, mixed, per-process stream of token arrays (``int32[n]``).

    Args:
      corpus_dir: built corpus directory.
      seed: shuffling seed (domain i uses ``seed + i`` in sorted domain order).
      process_index, process_count: this host's slice of every domain (``jax.process_index()``
        and ``jax.process_count()`` in training).
      weights: domain -> sampling weight; defaults to ``mixture.json`` ``weights``. Domains with
        weight 0 or no records on this process are left out.
    Raises:
      ValueError: unknown domain in `weights`, bad process slice, or nothing to read.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    mix = read_mixture(corpus_dir)
    weights = dict(weights if weights is not None else mix["weights"])
    unknown = set(weights) - set(mix["weights"])
    if unknown:
        raise ValueError(f"weights: domains {sorted(unknown)} not in {corpus_dir}/mixture.json")
    parts, part_weights = [], []
    for i, domain in enumerate(sorted(weights)):
        if weights[domain] <= 0:
            continue
        ds = grain.MapDataset.source(domain_source(corpus_dir, domain))[process_index::process_count]
        if len(ds) == 0:
            continue
        parts.append(ds.shuffle(seed=seed + i).repeat().map(record_fn))
        part_weights.append(float(weights[domain]))
    if not parts:
        raise ValueError(f"{corpus_dir}: no records for process {process_index} of {process_count}")
    return grain.MapDataset.mix(parts, part_weights).to_iter_dataset()
