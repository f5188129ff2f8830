"""`python -m jaxpt.data.prepare`: documents -> cleaned train/held-out documents + tokenizer + a data config.

    python -m jaxpt.data.prepare --output artifacts/sample [--source data/sample]
        [--vocab-size 4096] [--heldout-fraction 0.05] [--seed 0] [--force]
    python -m jaxpt.data.prepare --source 'my_docs/*.jsonl' --output artifacts/mine     # your own documents
    python -m jaxpt.data.prepare --source 'my_docs/*.jsonl' --output artifacts/mine-l3 \
        --tokenizer base/tokenizer.json          # continued pretraining: the base model's tokenizer, not a new one

Reads the JSON Lines files `--source` names (a folder: its `*.jsonl`, `*.jsonl.gz` and `*.jsonl.zst` files; a file;
or a glob), in file-name then line order, with the document reader (`jaxpt.data.documents`: one JSON object per
line with a string `text`, at most `--max-document-bytes` long; the first line that breaks it stops the run with
`DocumentFormatError` naming file and line, exit 2). Fields of the raw-v1 schema (`SCHEMA`) a record lacks get
defaults (`id`: `<file>:<line>`, `source`: the file's name, `domain`: `default`, the others empty), and:

1. cleans: web pages (raw HTML) are reduced to their main text with trafilatura; other text is kept
   byte for byte;
2. drops, counting each by reason: `empty_text` (nothing but whitespace), `no_main_text`
   (trafilatura found no main text in a web page), `duplicate_id` (an id seen before),
   `exact_duplicate` (cleaned text identical to an earlier kept document's; dropping it before the
   split keeps a held-out text out of training);
3. splits by id: a document is held out iff the first 8 bytes of sha256(`id`), read as a
   big-endian integer, are below `heldout_fraction * 2**64`. The rule depends on the id alone, so a
   document stays on its side whatever else is in the sample or however it is ordered;
4. trains the tokenizer on the train split only (held-out text never reaches it), or, with `--tokenizer FILE`,
   uses that one (a base model's `tokenizer.json` with its special-token files beside it, or a SentencePiece
   model: `jaxpt.data.tokenizer.Tokenizer.load`), for continued pretraining of that model;
5. writes to `--output`: the tokenizer (`tokenizer.model`, or `tokenizer.json` and its `tokenizer_config.json`),
   `train.jsonl.gz`, `heldout.jsonl.gz` (raw-v1 schema, cleaned `text`), then `prepare.json` (settings, source
   hashes, the given tokenizer's sha256, counts per domain and per drop reason, output hashes, token counts, the
   data version) and `data.gin`, the `DataConfig` of these files for `python -m jaxpt.train --config
   <output>/data.gin` (with a given tokenizer it leaves `ModelConfig.vocab_size` to the model's config: a base
   model's embedding table is often larger than its tokenizer).

Idempotent: when `prepare.json` in `--output` records the same inputs (source file hashes),
settings and library versions, and the files it lists still have their recorded hashes, it prints
that and returns without work. Counts always add up: documents in = train + held-out + each drop.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import time
from importlib import metadata
from typing import Any

from jaxpt.data import documents, tokenizer as tokenizer_lib
from jaxpt.util import fs, jsonl

FORMAT_VERSION = 1
SCHEMA = ("id", "text", "source", "domain", "lang", "url_or_path", "license")
DROP_REASONS = ("empty_text", "no_main_text", "duplicate_id", "exact_duplicate")
OUTPUT_FILES = ("tokenizer.model", "train.jsonl.gz", "heldout.jsonl.gz")
#: The tokenizer files prepare writes for a given Hugging Face tokenizer (in place of ``tokenizer.model``).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPLIT_RULE = "heldout iff int.from_bytes(sha256(id.encode('utf-8'))[:8], 'big') < heldout_fraction * 2**64"


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """Everything besides the source files that decides the outputs."""

    vocab_size: int = 4096  # the vocabulary report on raw-v1 recommends 4096 for the quickstart model
    heldout_fraction: float = 0.05
    seed: int = 0

    def validate(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"--heldout-fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.vocab_size < 300:
            raise ValueError(f"--vocab-size must be at least 300 (bytes + specials), got {self.vocab_size}")


def is_heldout(doc_id: str, heldout_fraction: float) -> bool:
    """The split rule (SPLIT_RULE): True if document `doc_id` belongs to the held-out split."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return h < heldout_fraction * 2.0**64


def _sha256_file(path: str) -> str:
    return hashlib.sha256(fs.read_bytes(path)).hexdigest()


def _library_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in ("sentencepiece", "trafilatura")}


def extract_main_text(html: str) -> str:
    """Main text of an HTML page (trafilatura 2.x, tables kept, no comments); '' if none found."""
    try:
        import trafilatura  # slow to import; only web pages need it (the `prepare` extra)
    except ImportError:
        raise ValueError("a web page (domain 'web', raw HTML) needs trafilatura to extract its main text: "
                         "pip install 'jaxpt[prepare]'") from None

    text = trafilatura.extract(html, include_comments=False, include_tables=True, favor_recall=True,
                               deduplicate=False, with_metadata=False)
    return text or ""


def clean_and_split(source_files: list[str], settings: PrepareSettings,
                    max_document_bytes: int = documents.MAX_DOCUMENT_BYTES
                    ) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """Reads, cleans, drops and splits; returns (train docs, held-out docs, counts).

    Raises:
      DocumentFormatError: a line breaks the document contract; a line past ``max_document_bytes`` (reason
        ``oversized``) is refused before it is held, with what to do.
    """
    train, heldout = [], []
    drops: collections.Counter = collections.Counter()
    per_domain: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seen_ids: set[str] = set()
    seen_texts: set[bytes] = set()
    docs_in = 0
    for path in source_files:
        for doc in _documents(path, max_document_bytes):
            doc = {**_defaults(path), **doc}
            docs_in += 1
            domain = doc["domain"]
            per_domain[domain]["in"] += 1
            text = extract_main_text(doc["text"]) if domain == "web" else doc["text"]
            reason = None
            if doc["id"] in seen_ids:
                reason = "duplicate_id"
            elif not text.strip():
                reason = "no_main_text" if domain == "web" and doc["text"].strip() else "empty_text"
            else:
                digest = hashlib.sha256(text.encode("utf-8")).digest()
                if digest in seen_texts:
                    reason = "exact_duplicate"
                seen_texts.add(digest)
            seen_ids.add(doc["id"])
            if reason is not None:
                drops[reason] += 1
                per_domain[domain][f"dropped_{reason}"] += 1
                continue
            doc = dict(doc, text=text)
            split = "heldout" if is_heldout(doc["id"], settings.heldout_fraction) else "train"
            (heldout if split == "heldout" else train).append(doc)
            per_domain[domain][split] += 1
    counts = {
        "documents_in": docs_in,
        "train": len(train),
        "heldout": len(heldout),
        "dropped": {r: drops[r] for r in DROP_REASONS},
        "per_domain": {d: dict(sorted(c.items())) for d, c in sorted(per_domain.items())},
    }
    if docs_in != len(train) + len(heldout) + sum(drops.values()):
        raise AssertionError(f"counts do not add up: {counts}")
    return train, heldout, counts


def _documents(path: str, max_bytes: int):
    """The records of ``path`` (:func:`jaxpt.data.documents.iter_documents`); an ``oversized`` line's error says what
    to do."""
    try:
        for _, doc in documents.iter_documents(path, max_bytes=max_bytes):
            yield doc
    except documents.DocumentFormatError as e:
        if e.reason != "oversized":
            raise
        raise documents.DocumentFormatError.at(
            e.path, e.line, e.reason, f"{e.detail}: split it into smaller documents, or raise --max-document-bytes "
            "(tokenizing a document takes hundreds of times its size in memory)") from None


def _defaults(path: str) -> dict[str, str]:
    """The `SCHEMA` fields a record of ``path`` gets when it lacks them (its `id` comes from the reader)."""
    name = fs.basename(path)
    for suffix in (".gz", ".zst", ".jsonl"):
        name = name[:-len(suffix)] if name.endswith(suffix) else name
    return {"source": name, "domain": "default", "lang": "", "url_or_path": "", "license": ""}


def write_data_config(output: str, tokenizer_file: str = "tokenizer.model", given_tokenizer: bool = False) -> str:
    """Write ``output/data.gin``: the ``DataConfig`` of the prepared files (paths as ``output`` was given), for
    ``python -m jaxpt.train --config`` beside a model config. ``tokenizer_file``: the tokenizer's name in ``output``;
    ``given_tokenizer``: a base model's (``--tokenizer``): the model's config keeps its own ``vocab_size``. Returns
    its path."""
    path = fs.join(output, "data.gin")
    vocab = ("# ModelConfig.vocab_size: the base model's (its model.gin); its table may be larger than the tokenizer"
             if given_tokenizer else "ModelConfig.vocab_size = 0   # the tokenizer's")
    fs.write_text_atomic(path, "\n".join([
        f"# The documents prepared by python -m jaxpt.data.prepare into {output}.",
        "DataConfig.source = 'jsonl'",
        f"DataConfig.train_path = {fs.join(output, 'train.jsonl.gz')!r}",
        f"DataConfig.heldout_path = {fs.join(output, 'heldout.jsonl.gz')!r}",
        f"DataConfig.tokenizer_path = {fs.join(output, tokenizer_file)!r}",
        vocab, ""]))
    return path


def _write_jsonl_gz(path: str, docs: list[dict]) -> None:
    buf = io.BytesIO()
    # mtime=0 and no file name: the bytes depend on the documents only (prepare is deterministic).
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=6, mtime=0) as gz:
        for doc in docs:
            gz.write((json.dumps({k: doc[k] for k in SCHEMA}, ensure_ascii=False) + "\n").encode("utf-8"))
    fs.write_bytes_atomic(path, buf.getvalue())


#: The document files of a `--source` folder.
SOURCE_PATTERNS = ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst")


def _source_files(source: str) -> list[str]:
    """The document files `--source` names: a folder's `SOURCE_PATTERNS` files, a file, or a glob's files."""
    if fs.isdir(source):
        return sorted({f for pattern in SOURCE_PATTERNS for f in fs.glob(source, pattern)}, key=fs.basename)
    return documents.expand(source)


def _inputs_record(source_dir: str, settings: PrepareSettings) -> dict[str, Any]:
    files = _source_files(source_dir)
    if not files:
        raise FileNotFoundError(f"--source {source_dir}: no JSON Lines files (a folder of "
                                f"{', '.join(SOURCE_PATTERNS)} files, a file, or a glob)")
    return {
        "format_version": FORMAT_VERSION,
        "settings": dataclasses.asdict(settings),
        "split_rule": SPLIT_RULE,
        "libraries": _library_versions(),
        "sources": [{"file": fs.basename(f), "sha256": _sha256_file(f), "bytes": fs.path(f).stat().length}
                    for f in files],
    }


def _up_to_date(output: str, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The existing prepare.json if it matches `inputs` and its listed outputs are intact, else None."""
    record_path = fs.join(output, "prepare.json")
    if not fs.isfile(record_path):
        return None
    try:
        record = json.loads(fs.read_text(record_path))
    except json.JSONDecodeError:
        return None
    if record.get("inputs") != inputs:
        return None
    for name, digest in record.get("outputs", {}).items():
        f = fs.join(output, name)
        if not fs.isfile(f) or _sha256_file(f) != digest:
            return None
    return record


def prepare(source_dir: str | os.PathLike, output: str | os.PathLike,
            settings: PrepareSettings = PrepareSettings(), *, force: bool = False,
            max_document_bytes: int = documents.MAX_DOCUMENT_BYTES,
            tokenizer: str | os.PathLike | None = None) -> dict[str, Any]:
    """Runs the steps in the module docstring; returns the prepare.json record. ``source_dir`` and ``output``
    may be local or object storage (``gs://``, through `jaxpt.util.fs`). ``max_document_bytes``: the longest
    document line read (a longer one is refused before it is held; it decides no output, so it is not a setting).
    ``tokenizer``: a tokenizer file to use instead of training one (``--tokenizer``; ``settings.vocab_size`` and
    ``seed`` are then unused).

    Raises:
      FileNotFoundError: `source_dir` holds no `*.jsonl.gz` file, or no such ``tokenizer``.
      ValueError: a bad setting, or a ``tokenizer`` that cannot be loaded (naming the file).
      DocumentFormatError: (a ConfigError) a source line breaks the document contract or lacks a `SCHEMA`
        field (names file:line and the reason).
    """
    settings.validate()
    source_dir, output = os.fspath(source_dir), os.fspath(output)
    given = tokenizer_lib.Tokenizer.load(tokenizer) if tokenizer is not None else None  # refused before any work
    inputs = _inputs_record(source_dir, settings)
    if given is not None:  # the tokenizer trainer's settings are not used: none recorded as if they were
        inputs["settings"].update(vocab_size=None, seed=None)
        inputs["tokenizer"] = {"path": fs.absolute(os.fspath(tokenizer)), "kind": given.kind, "sha256": given.sha256,
                               "libraries": {"tokenizers": metadata.version("tokenizers")}}
    if not force and (record := _up_to_date(output, inputs)) is not None:
        write_data_config(output, record["tokenizer"]["file"], given is not None)
        record["up_to_date"] = True
        return record
    start = time.perf_counter()
    train, heldout, counts = clean_and_split(_source_files(source_dir), settings, max_document_bytes)
    # trained before anything in `output` is touched
    model_bytes = _train_tokenizer(train, settings, output) if given is None else None
    fs.makedirs(output)
    fs.remove(fs.join(output, "prepare.json"))  # written last: its presence means complete
    model_path = given.write(output) if given is not None else fs.join(output, "tokenizer.model")
    if given is None:
        fs.write_bytes_atomic(model_path, model_bytes)
    tok = tokenizer_lib.Tokenizer.load(model_path)
    tok_files = HF_TOKENIZER_FILES if tok.kind == "huggingface" else ("tokenizer.model",)
    _write_jsonl_gz(fs.join(output, "train.jsonl.gz"), train)
    _write_jsonl_gz(fs.join(output, "heldout.jsonl.gz"), heldout)
    tokens = {split: _token_counts(tok, docs) for split, docs in (("train", train), ("heldout", heldout))}
    record = {
        "inputs": inputs,
        "counts": counts,
        "tokens": tokens,
        "tokenizer": {"file": fs.basename(model_path), "kind": tok.kind, "sha256": tok.sha256,
                      "vocab_size": tok.vocab_size, "pad_id": tok.pad_id, "eos_id": tok.eos_id, "unk_id": tok.unk_id,
                      "bos_id": tok.bos_id},
        "outputs": {name: _sha256_file(fs.join(output, name)) for name in (*tok_files, *OUTPUT_FILES[1:])},
        "seconds": round(time.perf_counter() - start, 2),
    }
    # The data's identity, from what was written (the same inputs and settings give the same version).
    record["data_version"] = "prepared:" + hashlib.sha256(
        json.dumps(record["outputs"], sort_keys=True).encode()).hexdigest()[:16]
    fs.write_text_atomic(fs.join(output, "prepare.json"), jsonl.dumps(record, indent=1, ensure_ascii=False) + "\n")
    write_data_config(output, fs.basename(model_path), given is not None)
    record["up_to_date"] = False
    return record


def _train_tokenizer(train: list[dict], settings: PrepareSettings, output: str) -> bytes:
    """The SentencePiece model's bytes, trained on the train split in a scratch folder.

    Raises:
      ValueError: the text cannot support ``settings.vocab_size`` pieces, naming ``--vocab-size`` and the most
        the text supports (SentencePiece's figure); ``output`` is left as it was.
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = tokenizer_lib.train_sentencepiece((d["text"] for d in train), os.path.join(tmp, "tokenizer.model"),
                                                     settings.vocab_size, seed=settings.seed)
        except ValueError as e:
            most = re.search(r"value <= (\d+)", str(e))
            hint = f"pass --vocab-size {most.group(1)} or less" if most else "pass a smaller --vocab-size"
            raise ValueError(f"a {settings.vocab_size}-piece tokenizer does not fit this little text ({len(train)} "
                             f"training documents): {hint}; {output} was left as it was "
                             f"(SentencePiece said: {str(e).split(': ', 1)[-1]})") from None
        return path.read_bytes()


def _token_counts(tok, docs: list[dict]) -> dict[str, int]:
    """Tokens per domain (EOS not included)."""
    counts: collections.Counter = collections.Counter()
    for doc, ids in zip(docs, tok.encode_batch([d["text"] for d in docs], num_threads=2)):
        counts[doc["domain"]] += len(ids)
    return dict(sorted(counts.items()), total=sum(counts.values()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxpt.data.prepare",
                                     description="Split documents into train and held-out sets and train their "
                                                 "tokenizer (the bundled sample, or your own JSON Lines).")
    parser.add_argument("--output", required=True, help="output folder (local or gs://)")
    parser.add_argument("--source", default="data/sample",
                        help="JSON Lines documents: a folder of *.jsonl[.gz|.zst] files, a file or a glob, local or "
                             "gs:// (default: data/sample, the bundled sample)")
    parser.add_argument("--vocab-size", type=int, default=PrepareSettings.vocab_size,
                        help="tokenizer pieces, at least 300; a small text supports fewer (a few hundred "
                             f"documents: about 500) (default: {PrepareSettings.vocab_size})")
    parser.add_argument("--heldout-fraction", type=float, default=PrepareSettings.heldout_fraction,
                        help="share of documents held out, by a hash of their id "
                             f"(default: {PrepareSettings.heldout_fraction})")
    parser.add_argument("--seed", type=int, default=PrepareSettings.seed,
                        help=f"the tokenizer trainer's seed (the held-out split is by id, unseeded) (default: {PrepareSettings.seed})")
    parser.add_argument("--max-document-bytes", type=int, default=documents.MAX_DOCUMENT_BYTES,
                        help="the longest document line read, in bytes; a longer one stops the run naming its file "
                             f"and line before it is held (default: {documents.MAX_DOCUMENT_BYTES}, 4 MiB)")
    parser.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="use this tokenizer instead of training one: a base model's tokenizer.json (its "
                             "config.json / tokenizer_config.json beside it name the special tokens) or a "
                             "SentencePiece model; for continued pretraining of that model")
    parser.add_argument("--force", action="store_true", help="redo even if the output is up to date")
    args = parser.parse_args(argv)
    settings = PrepareSettings(args.vocab_size, args.heldout_fraction, args.seed)
    try:
        record = prepare(args.source, args.output, settings, force=args.force,
                         max_document_bytes=args.max_document_bytes, tokenizer=args.tokenizer)
    except (ValueError, FileNotFoundError) as e:  # ConfigError (a malformed source line) is a ValueError
        print(f"prepare: error: {e}", file=sys.stderr)
        sys.exit(2)
    c = record["counts"]
    state = "up to date, nothing to do" if record["up_to_date"] else f"done in {record['seconds']} s"
    print(f"prepare: {args.output}: {state}. documents in {c['documents_in']}: train {c['train']}, "
          f"heldout {c['heldout']}, dropped {c['dropped']}; train tokens {record['tokens']['train']['total']}, "
          f"heldout tokens {record['tokens']['heldout']['total']}; tokenizer sha256 "
          f"{record['tokenizer']['sha256'][:12]}; data config {fs.join(args.output, 'data.gin')} ({_next(args)})")


def _next(args) -> str:
    """The training command to run next: a given tokenizer is a base model's, so continue that model."""
    data = fs.join(args.output, "data.gin")
    if args.tokenizer is None:
        return f"python -m jaxpt.train --config configs/quickstart.gin --config {data}"
    base = fs.dirname(fs.absolute(os.fspath(args.tokenizer)))
    return (f"continue the base: python -m jaxpt.train --config {fs.join(base, 'model.gin')} --config {data} "
            f"--gin \"TrainConfig.init_from = '{base}'\"")


if __name__ == "__main__":
    main()
