"""`python -m jaxpt.data.prepare`: raw sample -> cleaned train/held-out documents + tokenizer.

    python -m jaxpt.data.prepare --output artifacts/sample [--source data/sample]
        [--vocab-size 4096] [--heldout-fraction 0.05] [--seed 0] [--force]

Reads every `*.jsonl.gz` under `--source` (raw-v1 schema), in file-name then line order, with the document
reader (`jaxpt.data.documents`: one JSON object per line, a string `text`, and here every field of `SCHEMA`;
the first line that breaks it stops the run with `DocumentFormatError` naming file and line, exit 2), and:

1. cleans: web pages (raw HTML) are reduced to their main text with trafilatura; other text is kept
   byte for byte;
2. drops, counting each by reason: `empty_text` (nothing but whitespace), `no_main_text`
   (trafilatura found no main text in a web page), `duplicate_id` (an id seen before),
   `exact_duplicate` (cleaned text identical to an earlier kept document's; dropping it before the
   split keeps a held-out text out of training);
3. splits by id: a document is held out iff the first 8 bytes of sha256(`id`), read as a
   big-endian integer, are below `heldout_fraction * 2**64`. The rule depends on the id alone, so a
   document stays on its side whatever else is in the sample or however it is ordered;
4. trains the tokenizer on the train split only (held-out text never reaches it);
5. writes to `--output`: `tokenizer.model`, `train.jsonl.gz`, `heldout.jsonl.gz` (raw-v1 schema,
   cleaned `text`) and, last, `prepare.json` (settings, source hashes, counts per domain and per
   drop reason, output hashes, token counts).

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
import sys
import time
from importlib import metadata
from typing import Any

from jaxpt.data import documents, tokenizer as tokenizer_lib
from jaxpt.util import fs

FORMAT_VERSION = 1
SCHEMA = ("id", "text", "source", "domain", "lang", "url_or_path", "license")
DROP_REASONS = ("empty_text", "no_main_text", "duplicate_id", "exact_duplicate")
OUTPUT_FILES = ("tokenizer.model", "train.jsonl.gz", "heldout.jsonl.gz")
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
    import trafilatura  # pylint: disable=g-import-not-at-top  (slow import; only web pages need it)

    text = trafilatura.extract(html, include_comments=False, include_tables=True, favor_recall=True,
                               deduplicate=False, with_metadata=False)
    return text or ""


def clean_and_split(source_files: list[str], settings: PrepareSettings) -> tuple[
        list[dict], list[dict], dict[str, Any]]:
    """Reads, cleans, drops and splits; returns (train docs, held-out docs, counts)."""
    train, heldout = [], []
    drops: collections.Counter = collections.Counter()
    per_domain: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seen_ids: set[str] = set()
    seen_texts: set[bytes] = set()
    docs_in = 0
    for path in source_files:
        for _, doc in documents.iter_documents(path, required=SCHEMA):
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


def _write_jsonl_gz(path: str, docs: list[dict]) -> None:
    buf = io.BytesIO()
    # mtime=0 and no file name: the bytes depend on the documents only (prepare is deterministic).
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=6, mtime=0) as gz:
        for doc in docs:
            gz.write((json.dumps({k: doc[k] for k in SCHEMA}, ensure_ascii=False) + "\n").encode("utf-8"))
    if fs.is_remote(path):  # one object upload is atomic
        fs.write_bytes(path, buf.getvalue())
        return
    fs.replace_local(path, buf.getvalue())


def _source_files(source_dir: str) -> list[str]:
    return fs.glob(source_dir, "*.jsonl.gz")


def _inputs_record(source_dir: str, settings: PrepareSettings) -> dict[str, Any]:
    files = _source_files(source_dir)
    if not files:
        raise FileNotFoundError(f"no *.jsonl.gz files in --source {source_dir}")
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
            settings: PrepareSettings = PrepareSettings(), *, force: bool = False) -> dict[str, Any]:
    """Runs the steps in the module docstring; returns the prepare.json record. ``source_dir`` and ``output``
    may be local or object storage (``gs://``, through `jaxpt.util.fs`).

    Raises:
      FileNotFoundError: `source_dir` holds no `*.jsonl.gz` file.
      ValueError: a bad setting.
      DocumentFormatError: (a ConfigError) a source line breaks the document contract or lacks a `SCHEMA`
        field (names file:line and the reason).
    """
    # Imported here so `--help` and the up-to-date check stay fast.

    settings.validate()
    source_dir, output = os.fspath(source_dir), os.fspath(output)
    inputs = _inputs_record(source_dir, settings)
    if not force and (record := _up_to_date(output, inputs)) is not None:
        record["up_to_date"] = True
        return record
    start = time.perf_counter()
    fs.makedirs(output)
    fs.remove(fs.join(output, "prepare.json"))  # written last: its presence means complete
    train, heldout, counts = clean_and_split(_source_files(source_dir), settings)
    model_path = tokenizer_lib.train_sentencepiece(
        (d["text"] for d in train), fs.join(output, "tokenizer.model"), settings.vocab_size, seed=settings.seed)
    tok = tokenizer_lib.Tokenizer.load(model_path)
    _write_jsonl_gz(fs.join(output, "train.jsonl.gz"), train)
    _write_jsonl_gz(fs.join(output, "heldout.jsonl.gz"), heldout)
    tokens = {split: _token_counts(tok, docs) for split, docs in (("train", train), ("heldout", heldout))}
    record = {
        "inputs": inputs,
        "counts": counts,
        "tokens": tokens,
        "tokenizer": {"file": "tokenizer.model", "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                      "pad_id": tok.pad_id, "eos_id": tok.eos_id, "unk_id": tok.unk_id, "bos_id": tok.bos_id},
        "outputs": {name: _sha256_file(fs.join(output, name)) for name in OUTPUT_FILES},
        "seconds": round(time.perf_counter() - start, 2),
    }
    fs.write_text_atomic(fs.join(output, "prepare.json"), json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    record["up_to_date"] = False
    return record


def _token_counts(tok, docs: list[dict]) -> dict[str, int]:
    """Tokens per domain (EOS not included)."""
    counts: collections.Counter = collections.Counter()
    for doc, ids in zip(docs, tok.encode_batch([d["text"] for d in docs], num_threads=2)):
        counts[doc["domain"]] += len(ids)
    return dict(sorted(counts.items()), total=sum(counts.values()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxpt.data.prepare",
                                     description="Split the bundled sample and train its tokenizer.")
    parser.add_argument("--output", required=True, help="output folder (local or gs://)")
    parser.add_argument("--source", default="data/sample",
                        help="folder of raw-v1-schema *.jsonl.gz files, local or gs:// (default: data/sample)")
    parser.add_argument("--vocab-size", type=int, default=PrepareSettings.vocab_size)
    parser.add_argument("--heldout-fraction", type=float, default=PrepareSettings.heldout_fraction)
    parser.add_argument("--seed", type=int, default=PrepareSettings.seed)
    parser.add_argument("--force", action="store_true", help="redo even if the output is up to date")
    args = parser.parse_args(argv)
    settings = PrepareSettings(args.vocab_size, args.heldout_fraction, args.seed)
    try:
        record = prepare(args.source, args.output, settings, force=args.force)
    except (ValueError, FileNotFoundError) as e:  # ConfigError (a malformed source line) is a ValueError
        print(f"prepare: error: {e}", file=sys.stderr)
        sys.exit(2)
    c = record["counts"]
    state = "up to date, nothing to do" if record["up_to_date"] else f"done in {record['seconds']} s"
    print(f"prepare: {args.output}: {state}. documents in {c['documents_in']}: train {c['train']}, "
          f"heldout {c['heldout']}, dropped {c['dropped']}; train tokens {record['tokens']['train']['total']}, "
          f"heldout tokens {record['tokens']['heldout']['total']}; tokenizer sha256 "
          f"{record['tokenizer']['sha256'][:12]}")


if __name__ == "__main__":
    main()
