"""Document JSON Lines: the one reader of document files, and the contract it holds them to.

Every jaxpt entry point that reads documents reads them here: training (``DataConfig.train_path`` and
``heldout_path``, :mod:`jaxpt.data.loader`), ``python -m jaxpt.data.prepare``, held-out evaluation
(:mod:`jaxpt.eval.heldout`, ``python -m jaxpt.tools.evaluate``), and in ``data_pipelines`` the tokenizer (on a
prepared sample or a corpus version's held-out split), the near-duplicate evaluation and the decontamination
eval sets of the corpus build.

The contract. A document file is a JSON Lines file (:mod:`jaxpt.util.jsonl`: plain, gzip or zstd by magic bytes;
one trailing newline or none). Each line is one JSON object with

- ``text``: a string (``""`` included) that encodes as UTF-8, on a line of at most :data:`MAX_DOCUMENT_BYTES`
  (4 MiB, the corpus build's ``AdmissionConfig.max_record_bytes``; ``prepare --max-document-bytes`` changes it
  there): a longer line is never held, since tokenizing one costs hundreds of times its size in memory;
- ``id``: optional; a string when present. A record without one gets ``"<file name>:<line>"``;
- any other fields (``domain``, ``lang``, ``source``, ...), passed through untouched.

Nothing else is accepted: the first line that breaks the contract raises :class:`DocumentFormatError` (a
``ConfigError``: exit 2 at every entry point), whose message names the file and the 1-based line, with one
of the reasons (:data:`REASONS`):

- the line rules of :mod:`jaxpt.util.jsonl`: ``blank_line``, ``invalid_utf8``, ``bad_json``, ``not_an_object``,
  ``truncated_file`` (a compressed file cut short: the file and the last complete line are named);
- ``missing_text``: no ``text``, or not a string; ``invalid_utf8`` also for a ``text`` holding a lone
  surrogate (a ``\\ud800`` escape), which cannot be written as UTF-8;
- ``bad_id``: an ``id`` that is not a string;
- ``missing_field``: a field a caller requires (``required``) is absent;
- ``oversized``: a line past the size limit (split such a document into smaller ones).

The corpus build reads its raw inputs with the same line rules but counts each bad line as a drop by the
same reason instead of raising (``data_pipelines.readers``).
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

from jaxpt.util import fs, jsonl
from jaxpt.util.errors import FileFormatError

REASONS = jsonl.LINE_REASONS + ("missing_text", "bad_id", "missing_field", "oversized")
MAX_DOCUMENT_BYTES = 4 << 20  # bytes of one document's JSON line (4 MiB)


class DocumentFormatError(FileFormatError):
    """A document file breaks the contract of :mod:`jaxpt.data.documents` at one line (file, line, reason)."""


def check_text(record: dict, field: str = "text") -> str:
    """The record's text, checked: a string that encodes as UTF-8.

    Raises:
      jsonl.LineError: reason ``missing_text`` (absent or not a string) or ``invalid_utf8`` (lone surrogate).
    """
    text = record.get(field)
    if not isinstance(text, str):
        what = "absent" if field not in record else f"a JSON {type(text).__name__}"
        raise jsonl.LineError("missing_text", f"'{field}' must be a string; it is {what}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise jsonl.LineError("invalid_utf8", f"'{field}' holds a lone surrogate ({e})") from None
    return text


def _check_document(record: dict, required: Iterable[str]) -> None:
    check_text(record)
    if "id" in record and not isinstance(record["id"], str):
        raise jsonl.LineError("bad_id", f"'id' must be a string; it is a JSON {type(record['id']).__name__}")
    missing = [k for k in required if k not in record]
    if missing:
        raise jsonl.LineError("missing_field", f"no {missing} (this file needs fields {list(required)})")


def iter_documents(path: str | os.PathLike, required: Iterable[str] = (),
                   max_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for every document of ``path``, in file order, checked line by line.

    Args:
      path: a document JSON Lines file (plain, gzip or zstd).
      required: further fields every record must hold (any JSON value), e.g. the raw-v1 schema.
      max_bytes: the longest line (bytes) read; a longer one raises reason ``oversized`` without being held.

    Returns:
      Records as parsed (dicts), each with a string ``text`` and a string ``id`` (``"<file name>:<line>"``
      when the file gave none).

    Raises:
      DocumentFormatError: at the first line that breaks the contract (module docstring), naming file and line.
      FileNotFoundError, OSError: the file cannot be opened.
    """
    required = tuple(required)
    name = os.path.basename(os.fspath(path))
    for line_no, record in jsonl.iter_objects(path, error=DocumentFormatError, max_line_bytes=max_bytes):
        try:
            _check_document(record, required)
        except jsonl.LineError as e:
            raise DocumentFormatError.at(path, line_no, e.reason, e.detail) from None
        record.setdefault("id", f"{name}:{line_no}")
        yield line_no, record


def is_pattern(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a glob (holds ``*``, ``?`` or ``[``)."""
    return any(c in os.fspath(path) for c in "*?[")


def expand(path: str | os.PathLike) -> list[str]:
    """The document files ``path`` names: itself (a file), or every file a glob matches, sorted (``[]`` when none
    does or the file is missing)."""
    path = os.fspath(path)
    if is_pattern(path):
        return [p for p in fs.glob_pattern(path) if fs.isfile(p)]
    return [path] if path and fs.isfile(path) else []


def read_documents(path: str | os.PathLike, required: Iterable[str] = ()) -> list[dict]:
    """Every document of ``path`` (a file, or a glob of files read in sorted order, their documents concatenated) in
    file order (index i = line i + 1 of a single file); checked as :func:`iter_documents`.

    Raises:
      FileNotFoundError: a glob that matches no file (a missing single file: as :func:`iter_documents`).
    """
    files = expand(path) if is_pattern(path) else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no file matches")
    return [record for f in files for _, record in iter_documents(f, required)]


def read_texts(path: str | os.PathLike) -> list[str]:
    """The ``text`` of every document of ``path`` (a file or a glob, as :func:`read_documents`)."""
    return [record["text"] for record in read_documents(path)]
