"""Grain input pipelines over prepared documents, and per-process slices of the global batch.

Train: documents (in memory) -> global seeded shuffle, reshuffled each epoch, repeated forever ->
every `process_count`-th document for this process -> tokenize (Grain read threads) -> pack
(`jaxpt.data.packing`) -> batches of `local_batch_size` rows. All randomness comes from `seed`, and
the iterator state (`get_state`/`set_state`) restores the stream exactly, so a resumed run sees the
same batches as an uninterrupted one.

Eval: held-out documents in file order, packed once, padded to whole batches with all-padding rows
(segment id 0), the same number of batches on every process, then finite.

`to_global_batch` turns each process's local batch into global `jax.Array`s sharded over the
mesh (`jax.make_array_from_process_local_data`), so the same code runs on one host or many.

Layout written by `python -m jaxpt.data.prepare`: `<dir>/train.jsonl.gz`, `<dir>/heldout.jsonl.gz`,
`<dir>/tokenizer.model`. Document files are read by `jaxpt.data.documents` (its contract: one JSON object with a
string `text` per line; anything else raises `DocumentFormatError`, a ConfigError naming file and line). The
paths and switches are configured by `jaxpt.config.DataConfig`; this module takes plain arguments so it stays
usable without gin.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping

import grain
import jax
import numpy as np

from jaxpt.data import boundary, documents, mixture, packing
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.util import fs
from jaxpt.util.errors import ConfigError

#: Batch keys that go to the devices; `doc_index` stays on the host (for listing a batch's documents).
DEVICE_KEYS = ("tokens", "segment_ids", "positions")


def load_texts(path: str | os.PathLike) -> list[str]:
    """The `text` of every document of a document file or glob (`jaxpt.data.documents.read_documents`), in file
    order (index = doc_index). Read once per process and shared by every logical data shard that reads the same
    unchanged files (:func:`load_documents`).

    Raises:
      DocumentFormatError: the file breaks the document contract (`jaxpt.data.documents`; names file:line).
      FileNotFoundError: a glob that matches no file.
    """
    return [d["text"] for d in load_documents(path)]


def load_documents(path: str | os.PathLike) -> tuple[dict, ...]:
    """Every document of ``path`` (a file or a glob), read once per process for the files as they are now (names,
    sizes and modification times; the shards of a run share one copy instead of each reading the files).

    Raises: as :func:`jaxpt.data.documents.read_documents`.
    """
    files = documents.expand(path) if documents.is_pattern(path) else [os.fspath(path)]
    return _read_once(os.fspath(path), tuple((f, *_signature(f)) for f in files))


def _signature(f: str) -> tuple:
    try:
        st = fs.path(f).stat()
        return st.length, getattr(st, "mtime", None)
    except OSError:
        return None, None


@functools.lru_cache(maxsize=4)
def _read_once(path: str, signature: tuple) -> tuple[dict, ...]:
    return tuple(documents.read_documents(path))


def document_ids(path: str | os.PathLike) -> list[str]:
    """The `id` of every document of a document file, in file order (`"<file name>:<line>"` where absent).

    `document_ids(path)[i]` is the document behind `doc_index == i` in batches made from `path`.

    Raises:
      DocumentFormatError: the file breaks the document contract (names file:line).
    """
    return [d["id"] for d in documents.read_documents(path)]


class _Tokenize:
    """Map doc index -> {'tokens': int32 [n], 'doc_index': int}. A class so Grain names the stage."""

    def __init__(self, texts: list[str], tokenizer: Tokenizer):
        self._texts, self._tokenizer = texts, tokenizer

    def __call__(self, doc_index: int) -> dict[str, Any]:
        return {"tokens": self._tokenizer.encode(self._texts[doc_index]), "doc_index": int(doc_index)}


def _check_process(process_index: int, process_count: int) -> None:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")


def make_train_dataset(
    documents_path: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    local_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    shuffle: bool = True,
    document_boundary: str = "eos",
    read_threads: int = 2,
    long_doc_min_chars: int = 0,
    long_doc_weight: float = 0.0,
) -> grain.IterDataset:
    """Infinite stream of packed training batches for one process.

    The documents are shuffled globally (the same order on every process, from `seed`; a new order
    each epoch), repeated forever, and process p takes documents p, p + P, p + 2P, ... of that
    stream (P = process_count), so within an epoch the processes read disjoint documents that
    together cover the file. Each process packs its own documents.

    Args:
      documents_path: prepared `train.jsonl.gz` (loaded into memory).
      tokenizer: tokenizer of the run; its pad, BOS and EOS ids are used.
      seq_len: row length in tokens.
      local_batch_size: rows per batch on this process (global batch / process_count).
      seed: shuffle seed in [0, 2**32).
      process_index, process_count: this process and the number of processes.
      shuffle: if False, documents come in file order (each epoch the same).
      document_boundary: the BOS/EOS around every document (`jaxpt.data.boundary`; 'eos': EOS appended).
      read_threads: threads tokenizing ahead (0: tokenize in the iterating thread).
      long_doc_min_chars, long_doc_weight: a length mixture (e.g. a long-context stage upweighting long
        documents): when ``long_doc_weight > 0``, documents of at least ``long_doc_min_chars`` characters form
        one stream and the others another (each shuffled, ``seed`` and ``seed + 1``, repeated forever), and
        each next document is drawn from the long stream with probability ``long_doc_weight``
        (``grain.MapDataset.mix``). 0: every document in one stream, in the natural proportion.

    Returns:
      A `grain.IterDataset` of dicts of int32 [local_batch_size, seq_len] numpy arrays: `tokens`, `segment_ids`,
      `positions`, `doc_index` (see `jaxpt.data.packing`). Its iterator supports exact `get_state`/`set_state`.

    Raises:
      ValueError: a bad argument. ConfigError: an empty document file (exit 2 in training, like a malformed one); a
        boundary policy the tokenizer cannot serve (`jaxpt.data.boundary.for_tokenizer`).
      DocumentFormatError: (a ConfigError) a line breaks the document contract (`jaxpt.data.documents`; names
        file:line).
    """
    _check_process(process_index, process_count)
    if local_batch_size < 1 or seq_len < 1:
        raise ValueError(f"local_batch_size and seq_len must be positive, got {local_batch_size}, {seq_len}")
    marks = boundary.for_tokenizer(document_boundary, tokenizer)
    texts = load_texts(documents_path)
    if not texts:
        raise ConfigError(f"{documents_path}: no documents")
    ds = _document_order(texts, seed, shuffle, long_doc_min_chars, long_doc_weight)[process_index::process_count]
    ds = ds.map(_Tokenize(texts, tokenizer))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=8 * max(read_threads, 1)))
    it = packing.PackedIterDataset(it, seq_len, pad_id=tokenizer.pad_id, eos_id=marks.eos_id, bos_id=marks.bos_id)
    return it.batch(local_batch_size, drop_remainder=True)


def _document_order(texts: list[str], seed: int, shuffle: bool, long_doc_min_chars: int,
                    long_doc_weight: float) -> grain.MapDataset:
    """The global, endless order of document indices into ``texts`` (before the per-process split): shuffled
    from ``seed`` (a new order each epoch) or in file order, or the length mixture of
    :func:`make_train_dataset` when ``long_doc_weight > 0``."""
    if long_doc_weight > 0:
        return _length_mixture(texts, long_doc_min_chars, long_doc_weight, seed, shuffle)
    ds = grain.MapDataset.range(len(texts))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None)


def sample_mixture_iterator(documents_path: str | os.PathLike, tokenizer: Tokenizer, schedule, *, key: str,
                            seq_len: int, rows: int, seed: int, shard: int = 0, num_shards: int = 1,
                            document_boundary: str = "eos", shuffle: bool = True, first_step: int = 1,
                            step_of_batch=None):
    """Prepared documents mixed by tokens (:mod:`jaxpt.data.mixture`) by their ``domain`` (and ``source``)
    fields: logical shard ``shard`` of ``num_shards``, batches of ``rows`` rows ``int32[rows, seq_len]``
    (``doc_index``: the document's line in the file, 0-based). Documents are tokenized as they are read, with
    ``document_boundary``'s BOS/EOS around each (:mod:`jaxpt.data.boundary`).

    Raises:
      ConfigError: a group with no documents (names ``key``, the group and the domains the file has), bad
        weights, a boundary policy the tokenizer cannot serve; DocumentFormatError for a malformed file (names
        file:line).
    """
    marks = boundary.for_tokenizer(document_boundary, tokenizer)
    docs = load_documents(documents_path)
    if not docs:
        raise ConfigError(f"{documents_path}: no documents")
    domains = [str(d.get("domain", "")) for d in docs]
    sources = [str(d.get("source", "")) for d in docs]
    texts = [d["text"] for d in docs]

    def fetch(i: int):
        return tokenizer.encode(texts[i]), i

    return mixture.mixture_iterator(domains, sources, fetch, schedule, key=key, seed=seed, shuffle=shuffle,
                                    shard=shard, num_shards=num_shards, rows=rows, seq_len=seq_len,
                                    pad_id=tokenizer.pad_id, eos_id=marks.eos_id, bos_id=marks.bos_id,
                                    first_step=first_step, step_of_batch=step_of_batch)


def _length_mixture(texts: list[str], min_chars: int, weight: float, seed: int, shuffle: bool) -> grain.MapDataset:
    """Infinite doc-index stream mixing short and long (``>= min_chars``) documents ``1 - weight : weight``.

    Raises:
      ValueError: ``weight`` not in (0, 1], or a weighted part with no documents.
    """
    if not 0 < weight <= 1:
        raise ValueError(f"long_doc_weight = {weight}: must be in (0, 1]")
    long_ids = [i for i, t in enumerate(texts) if len(t) >= min_chars]
    short_ids = [i for i, t in enumerate(texts) if len(t) < min_chars]
    parts, weights = [], []
    for k, (ids, w) in enumerate(((short_ids, 1.0 - weight), (long_ids, weight))):
        if w <= 0:
            continue
        if not ids:
            raise ValueError(f"long_doc_min_chars = {min_chars}: no {'long' if k else 'short'} documents to give "
                             f"weight {w}")
        part = grain.MapDataset.source(ids)
        parts.append((part.shuffle(seed=seed + k) if shuffle else part).repeat(None))
        weights.append(w)
    return grain.MapDataset.mix(parts, weights) if len(parts) > 1 else parts[0]


def make_eval_dataset(
    documents_path: str | os.PathLike | list,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    document_boundary: str = "eos",
) -> grain.IterDataset:
    """Finite stream of packed held-out batches for one process (no shuffle, no repeat).

    All documents are tokenized and packed at construction, in file order (held-out sets are
    small). The rows are padded with all-padding rows (segment ids 0, doc_index -1) to a multiple
    of `batch_size * process_count`, and process p takes rows p, p + P, ...: every process gets the
    same number of batches, which collective evaluation needs. Loss should be weighted by tokens
    with a target (see `jaxpt.data.packing`), so padding rows count for nothing.

    Args:
      documents_path: prepared `heldout.jsonl.gz`, or a list of such files (read in the order given; e.g. a
        corpus version's `heldout/<domain>.jsonl.gz`).
      tokenizer: tokenizer of the run.
      seq_len: row length in tokens.
      batch_size: rows per batch on this process.
      process_index, process_count: this process and the number of processes.
      document_boundary: the BOS/EOS around every document (use the same policy as training).

    Returns:
      A `grain.IterDataset` of dicts of int32 arrays of shape [batch_size, seq_len], with keys as in
      `make_train_dataset`; the number of batches is len(eval_dataset_rows) / (batch_size * P).

    Raises:
      ValueError: a bad argument.
      DocumentFormatError: (a ConfigError) a line breaks the document contract (names file:line).
    """
    _check_process(process_index, process_count)
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    marks = boundary.for_tokenizer(document_boundary, tokenizer)
    paths = documents_path if isinstance(documents_path, (list, tuple)) else [documents_path]
    texts = [t for path in paths for t in load_texts(path)]
    rows = list(packing.pack_documents(tokenizer.encode_batch(texts), seq_len, pad_id=tokenizer.pad_id,
                                       eos_id=marks.eos_id, bos_id=marks.bos_id))
    per_step = batch_size * process_count
    num_pad = -len(rows) % per_step
    if num_pad or not rows:
        num_pad = num_pad or per_step  # an empty file still yields one (all-padding) batch
        pad_row = {
            "tokens": np.full(seq_len, tokenizer.pad_id, np.int32),
            "segment_ids": np.zeros(seq_len, np.int32),
            "positions": np.zeros(seq_len, np.int32),
            "doc_index": np.full(seq_len, -1, np.int32),
        }
        rows += [pad_row] * num_pad
    ds = grain.MapDataset.source(rows[process_index::process_count]).batch(batch_size, drop_remainder=True)
    return ds.to_iter_dataset()


def to_global_batch(local_batch: Mapping[str, np.ndarray],
                    sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded by `sharding`, for the `DEVICE_KEYS` only.

    Each process passes its own [local_batch_size, seq_len] arrays; the global batch is their
    concatenation along axis 0 in process order ([local_batch_size * process_count, seq_len]),
    laid out over the devices by `sharding` (typically PartitionSpec(('data', 'fsdp'), None)).
    `doc_index` is left out: it stays on the host with the caller.

    Raises:
      KeyError: a device key is missing from `local_batch`.
      ValueError: (from JAX) the local shapes do not fit the sharding.
    """
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(local_batch[k]))
            for k in DEVICE_KEYS}
