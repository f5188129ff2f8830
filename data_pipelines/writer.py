"""The write step's output formats: tokenizer, ArrayRecord/TFDS shards, decision log, review samples.

Record format of the corpus shards (one ArrayRecord record per document, ``group_size:1`` for
random access, as TFDS writes them): a serialized ``tf.train.Example`` with the TFDS features of
`corpus_features()`:

  ``id`` (text), ``source`` (text), ``domain`` (text), ``lang`` (text, ISO 639-1 or ``und``),
  ``tokens`` (``int32[n]``, ids of `OutputConfig.tokenizer_path`'s tokenizer, no BOS/EOS), ``text`` (text, empty when
  `OutputConfig.store_text` is False).

Files live in ``DIR/tfds/<dataset_name>/1.0.0/<dataset_name>-<domain>.array_record-NNNNN-of-MMMMM``:
one TFDS split per domain, so ``tfds.data_sources(<dataset_name>, data_dir=DIR/tfds)`` opens it and
`jaxpt.data.corpus` reads it for training.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os

import numpy as np

from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.util import fs, jsonl
from jaxpt.util.errors import ConfigError

from data_pipelines import sink

DATASET_VERSION = "1.0.0"


def file_sha256(path: str) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class TokenizerEncoder:
    """The tokenizer named by `OutputConfig.tokenizer_path`, loaded as every jaxpt reader loads one
    (:meth:`jaxpt.data.tokenizer.Tokenizer.load`: a SentencePiece model, or a base model's Hugging Face
    ``tokenizer.json`` with its special-token files beside it), so a corpus version built for continued pretraining
    holds the base model's ids, exactly as training and held-out evaluation encode text.

    `encode(text)` returns ``int32[n]`` ids (no BOS/EOS). ``sha256``: the tokenizer's identity, as runs record it.

    Raises:
      FileNotFoundError: naming the path. ConfigError: a file that is not a tokenizer (naming the key and why).
    """

    def __init__(self, path: str):
        if not fs.exists(path):
            raise FileNotFoundError(f"OutputConfig.tokenizer_path: no tokenizer at '{path}'")
        try:
            self._tok = tokenizer_lib.Tokenizer.load(path)
        except ValueError as e:
            raise ConfigError(f"OutputConfig.tokenizer_path = {path!r}: {e}") from None
        self.path = path
        self.sha256 = self._tok.sha256
        self.vocab_size = self._tok.vocab_size
        self.kind = self._tok.kind

    def encode(self, text: str) -> np.ndarray:
        return self._tok.encode(text)


def corpus_features():
    """TFDS FeaturesDict of one corpus record (see module docstring)."""
    import tensorflow_datasets as tfds

    return tfds.features.FeaturesDict(
        {
            "id": tfds.features.Text(),
            "source": tfds.features.Text(),
            "domain": tfds.features.Text(),
            "lang": tfds.features.Text(),
            "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "text": tfds.features.Text(),
        }
    )


def tfds_dir(out_dir: str, dataset_name: str) -> str:
    return fs.join(out_dir, "tfds", dataset_name, DATASET_VERSION)


def shard_filename(dataset_name: str, domain: str, index: int, count: int) -> str:
    """TFDS default template ``{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}``.

    Raises:
      ConfigError: a name that would put the file in another folder (:func:`jaxpt.util.fs.contained`).
    """
    name = f"{dataset_name}-{domain}.array_record-{index:05d}-of-{count:05d}"
    if "/" in name or "\\" in name or name.startswith("."):
        raise ConfigError(f"shard file name {name!r} (dataset {dataset_name!r}, domain {domain!r}) would land in "
                          "another folder; refused")
    return name


def write_array_record(path: str, records: list[bytes]) -> None:
    """Writes `records` in order (``group_size:1``, the TFDS setting) to ``path`` (local or ``gs://``).

    ArrayRecord's writer opens local files only, so the shard is written to a local scratch file first and then
    sent through Beam's filesystems (`data_pipelines.sink`: one object upload to a bucket, a rename locally)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    with sink.local_scratch_dir() as d:
        local = os.path.join(d, fs.basename(path))
        w = ArrayRecordWriter(local, "group_size:1")
        for r in records:
            w.write(r)
        w.close()
        sink.upload_file(local, path)


def heldout_path(out_dir: str, domain: str) -> str:
    """``DIR/heldout/<domain>.jsonl.gz``: the held-out documents of one domain (id, source, domain, lang, text,
    n_tokens), sorted by id. `jaxpt.eval.heldout.resolve_source` and the trainer read this layout."""
    return fs.join(out_dir, "heldout", fs.contained(out_dir, f"{domain}.jsonl.gz"))


def write_jsonl_gz(path: str, rows: list[dict]) -> None:
    """Deterministic gzip JSON Lines (no file name or mtime in the gzip header; sorted keys), written through
    Beam's filesystems (`data_pipelines.sink`)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        for r in rows:
            gz.write(jsonl.dumps(r, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n")
    sink.write_bytes(path, buf.getvalue())


def read_jsonl_gz(path: str) -> list[dict]:
    """Rows of a JSON Lines file the build wrote (decision log, held-out split), in file order.

    Raises:
      FileFormatError: (a ConfigError) a line breaks the JSON Lines rules of `jaxpt.util.jsonl` (names file and line).
    """
    return jsonl.read_objects(path)


def write_tfds_metadata(out_dir: str, dataset_name: str, split_lengths: dict[str, list[int]],
                        description: str) -> None:
    """dataset_info.json + features.json for the written shards (one split per domain)."""
    import tensorflow_datasets as tfds

    data_dir = tfds_dir(out_dir, dataset_name)
    splits = []
    for split, lengths in sorted(split_lengths.items()):
        nbytes = sum(
            fs.path(fs.join(data_dir, shard_filename(dataset_name, split, i, len(lengths)))).stat().length
            for i in range(len(lengths))
        )
        splits.append(tfds.core.SplitInfo(name=split, shard_lengths=list(lengths), num_bytes=nbytes))
    tfds.folder_dataset.write_metadata(
        data_dir=data_dir,
        features=corpus_features(),
        split_infos=splits,
        filename_template=None,
        check_data=False,
        description=description,
    )


def write_json(obj, path: str) -> str:
    """`obj` as indented JSON with sorted keys at ``path`` (through `data_pipelines.sink`); returns ``path``."""
    sink.write_text(path, jsonl.dumps(obj, sort_keys=True, indent=1))
    return path
