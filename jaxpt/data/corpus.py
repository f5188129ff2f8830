"""A built corpus version (`python -m data_pipelines.build`): the one reader of its directory, and its training
stream.

Layout of a corpus version directory (`CorpusVersion` reads it; nothing else opens these files):

- ``mixture.json``: ``weights`` (domain -> sampling weight), ``shards`` (domain -> ArrayRecord paths relative to
  the directory), ``tfds`` (``name``, ``version``, ``data_dir``), and token/document counts;
- ``manifest.json``: the data version record (``data_version``, ``content_id``, counts, hashes); optional here;
- ``tfds/<name>/<version>/``: a TFDS dataset in the ArrayRecord file format, one split per domain. Each record is
  a serialized ``tf.train.Example`` with features ``id``, ``source``, ``domain``, ``lang``, ``text`` (strings) and
  ``tokens`` (``int32[n]`` token ids of the build's tokenizer, no BOS/EOS: the run's boundary policy adds them). Records are decoded by :mod:`jaxpt.data.example_proto`
  (protobuf and numpy; neither TensorFlow nor TFDS is needed to train);
- ``heldout/<domain>.jsonl.gz``: the held-out split, document files (`jaxpt.data.documents`).

The trainer reads a version with `corpus_mixture_iterator`, the one reader of its training split: packed batches
mixed by *tokens* (:mod:`jaxpt.data.mixture`; ``DataConfig.mixture_weights`` / ``mixture_schedule``, else
``mixture.json``'s weights), each logical data shard reading every domain at its full weight, with per-domain read
positions in its checkpointable state (``get_state`` / ``set_state``). `domain_source` gives random access to one
domain's records (Grain's ``RandomAccessDataSource`` protocol) for tools that inspect them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

import numpy as np

from jaxpt.data import boundary, example_proto, mixture
from jaxpt.util import fs
from jaxpt.util.errors import ConfigError


def _read_json(path: str) -> Any:
    try:
        return json.loads(fs.read_text(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None


@dataclasses.dataclass(frozen=True)
class CorpusVersion:
    """A corpus version directory, read: its ``mixture.json`` and (``{}`` when absent) ``manifest.json``.

    Attributes:
      path: the directory. mixture: ``mixture.json`` (holds ``weights`` and ``shards``). manifest: ``manifest.json``.
    """

    path: str
    mixture: dict
    manifest: dict

    @property
    def data_version(self) -> str | None:
        return self.manifest.get("data_version")

    @property
    def content_id(self) -> str | None:
        return self.manifest.get("content_id")

    def shard_paths(self) -> dict[str, list[str]]:
        """``{domain: [ArrayRecord shard paths]}`` as ``mixture.json`` lists them, domains sorted.

        Raises:
          FileNotFoundError: a listed shard does not exist (names it).
        """
        out = {}
        for domain, shards in sorted(self.mixture["shards"].items()):
            out[domain] = [fs.join(self.path, s) for s in shards]
            for s, full in zip(shards, out[domain]):
                if not fs.isfile(full):
                    raise FileNotFoundError(f"{self.path}/mixture.json lists shard {s}, which does not exist")
        return out

    def heldout_files(self) -> list[str]:
        """The held-out split's document files, ``heldout/*.jsonl.gz`` sorted ([] for a version built without)."""
        return fs.glob(fs.join(self.path, "heldout"), "*.jsonl.gz")

    def tfds_dir(self) -> str:
        """The TFDS dataset directory ``<path>/<data_dir>/<name>/<version>``. Raises ConfigError without ``tfds``."""
        t = self.mixture.get("tfds")
        if not isinstance(t, dict) or not {"data_dir", "name", "version"} <= set(t):
            raise ConfigError(f"{self.path}/mixture.json: no 'tfds' entry with data_dir, name and version")
        return fs.join(self.path, t["data_dir"], t["name"], t["version"])


def is_corpus_version(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory holding ``mixture.json``."""
    return fs.isfile(fs.join(path, "mixture.json"))


def read_corpus_version(corpus_dir: str | os.PathLike) -> CorpusVersion:
    """Reads a corpus version directory (module docstring).

    Raises:
      FileNotFoundError: no ``mixture.json`` (names the path).
      ConfigError: ``mixture.json`` or ``manifest.json`` is not JSON, or the mixture lacks ``weights``/``shards``.
    """
    corpus_dir = os.fspath(corpus_dir)
    path = fs.join(corpus_dir, "mixture.json")
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: not a built corpus directory (no mixture.json)")
    mixture = _read_json(path)
    if not isinstance(mixture, dict) or not isinstance(mixture.get("weights"), dict) \
            or not isinstance(mixture.get("shards"), dict):
        raise ConfigError(f"{path}: not a corpus mixture (needs 'weights' and 'shards' objects)")
    manifest_path = fs.join(corpus_dir, "manifest.json")
    manifest = _read_json(manifest_path) if fs.isfile(manifest_path) else {}
    return CorpusVersion(corpus_dir, mixture, manifest if isinstance(manifest, dict) else {})


def read_mixture(corpus_dir: str) -> dict:
    """``mixture.json`` of a corpus; raises as :func:`read_corpus_version`."""
    return read_corpus_version(corpus_dir).mixture


def shard_records(paths: list[str]) -> Iterator[dict[str, str]]:
    """``{"id", "source", "domain", "lang", "text"}`` (strings, '' when a feature is absent) of every record of
    the ArrayRecord shards ``paths``, in order. Decoded by :mod:`jaxpt.data.example_proto` (no TensorFlow)."""
    from array_record.python import array_record_data_source

    for path in paths:
        # ArrayRecord's reader opens local files only: a shard in object storage is read from a local copy.
        source = array_record_data_source.ArrayRecordDataSource([fs.local_copy(path)])
        for i in range(len(source)):
            record = example_proto.parse_corpus_record(source[i])
            yield {k: record[k] for k in example_proto.CORPUS_TEXT_FEATURES}


class DomainSource:
    """Random-access source of one domain split: ``len()`` records, ``[i]`` -> the record dict of
    :func:`jaxpt.data.example_proto.parse_corpus_record` (``tokens`` ``int32[n]``, text features as str), in the
    order of the split's shards as ``mixture.json`` lists them (the TFDS split order). Picklable, for Grain."""

    def __init__(self, paths: list[str]):
        from array_record.python import array_record_data_source

        self._source = array_record_data_source.ArrayRecordDataSource(list(paths))

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict:
        return example_proto.parse_corpus_record(self._source[index])


def domain_source(corpus_dir: str, domain: str) -> DomainSource:
    """Random-access source of one domain split (:class:`DomainSource`; no TensorFlow or TFDS).

    Raises:
      ValueError: ``domain`` is not in the corpus's ``mixture.json`` shards.
      FileNotFoundError, ConfigError: as :meth:`CorpusVersion.shard_paths` / :func:`read_corpus_version`.
    """
    shards = read_corpus_version(corpus_dir).shard_paths()
    if domain not in shards:
        raise ValueError(f"{corpus_dir}/mixture.json: no shards for domain {domain!r} (has {sorted(shards)})")
    # ArrayRecord's reader opens local files only: shards in object storage are read from local copies
    # (:func:`jaxpt.util.fs.local_copy`, downloaded once per host and cached).
    return DomainSource([fs.local_copy(p) for p in shards[domain]])


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


def corpus_mixture_iterator(corpus_dir: str, tokenizer, schedule, *, key: str, seq_len: int, rows: int, seed: int,
                            shard: int = 0, num_shards: int = 1, document_boundary: str = "eos",
                            shuffle: bool = True, first_step: int = 1, step_of_batch=None):
    """The training stream of a corpus version, mixed by tokens (:mod:`jaxpt.data.mixture`): logical shard
    ``shard`` of ``num_shards``, batches of ``rows`` packed rows of ``seq_len`` tokens.

    Args:
      schedule: ``[(start_step, {group: weight})]`` (:func:`jaxpt.data.mixture.parse_schedule`); None: the
        corpus's ``mixture.json`` weights (its token shares), groups of weight 0 left out.
      key: the config key of ``schedule`` (errors name it).
      document_boundary: the BOS/EOS put around each record's tokens (:mod:`jaxpt.data.boundary`).
    Raises:
      ConfigError: a group the corpus has no documents of (names ``key``, the group and the domains), bad weights,
        a boundary policy the tokenizer cannot serve.
      FileNotFoundError: as :func:`read_corpus_version`.
    """
    marks = boundary.for_tokenizer(document_boundary, tokenizer)
    mix = read_mixture(corpus_dir)
    if schedule is None:
        key = f"{corpus_dir}/mixture.json weights"
        schedule = [(1, mixture.parse_weights({d: w for d, w in mix["weights"].items() if w}, key))]
    wanted = {g.split("/", 1)[0] for g in mixture.group_names(schedule)}
    by_source = {g.split("/", 1)[0] for g in mixture.group_names(schedule) if "/" in g}
    domains, sources, refs, srcs = [], [], [], {}
    for d in sorted(wanted & set(mix["weights"])):
        src = srcs[d] = domain_source(corpus_dir, d)
        n = len(src)
        domains += [d] * n
        refs += [(d, i) for i in range(n)]
        if d in by_source:  # read every record's source once (only for a domain split by source)
            sources += [_text(src[i]["source"]) for i in range(n)]
        else:
            sources += [""] * n
    if not domains and wanted:  # every wanted domain unknown: let assign_groups name them
        domains, sources = list(mix["weights"]), [""] * len(mix["weights"])
    for_packing = _ForPacking()

    def fetch(i: int):
        d, r = refs[i]
        element = for_packing(srcs[d][r])
        return element["tokens"], element["doc_index"]

    return mixture.mixture_iterator(domains, sources, fetch, schedule, key=key, seed=seed, shuffle=shuffle,
                                    shard=shard, num_shards=num_shards, rows=rows, seq_len=seq_len,
                                    pad_id=tokenizer.pad_id, eos_id=marks.eos_id, bos_id=marks.bos_id,
                                    first_step=first_step, step_of_batch=step_of_batch)


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
