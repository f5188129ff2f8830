"""The admission step's readers: raw records of registered sources into documents or counted drops.

`cfg` (every reader's) is the admission step's `steps.admission.AdmissionConfig`.

Every record a reader meets becomes exactly one element: a document dict

    {"id", "source", "domain", "text", "lang_hint", "html": bool}

or a drop dict (see `drop`) with ``stage="admission"`` and one of the reasons below. Nothing is
skipped silently. Reasons: ``oversized``, ``binary``, ``blank_line``, ``invalid_utf8``, ``bad_json``,
``not_an_object``, ``missing_text``, ``empty`` (a text of only whitespace), ``truncated_file`` (a compressed
file cut short: one drop for the damaged tail, naming the file), ``decompressed_cap`` and ``compression_ratio``
(a file that decompresses past `AdmissionConfig.max_file_bytes`, or at a ratio above
`AdmissionConfig.max_compression_ratio`: a decompression bomb; one drop for the unread rest, naming the file).
(``extraction_empty`` and ``extraction_timeout``, also of stage ``admission``, are `steps.extraction`'s.)

Every reader bounds its work before it holds it: a line is not accumulated past ``max_record_bytes`` (it is
counted ``oversized`` from its first bytes and its length), a web page's HTTP body is decoded to at most one byte
past the cap, a Parquet row group's text is checked against the caps from the file's metadata before it is
decoded, and decompression runs in bounded steps. A build's memory is thus set by its configuration (the caps, and
the runner's own buffering), not by one hostile file.

A web page's bytes are decoded by what the page declares (:func:`decode_page`): the HTTP ``Content-Type`` charset,
else an HTML ``<meta charset>`` (or ``http-equiv`` Content-Type) in its head, else UTF-8 when the bytes are valid
UTF-8, else the charset a detector (``charset-normalizer``) names, else UTF-8 with replacement characters. Each kept
page records how it was decoded (``decoded_by``: ``http_header:<charset>``, ``html_meta:<charset>``, ``utf-8``,
``detected:<charset>`` or ``replacement``), and the manifest counts them; only bytes no path can decode as text (a
binary body) are dropped.

JSON Lines inputs follow the line rules of `jaxpt.util.jsonl` and the document contract of `jaxpt.data.documents`,
whose strict readers raise ``DocumentFormatError`` with these same reason names; here, for raw inputs, each
bad line is counted and dropped instead, so ``documents_in = kept + held out + every drop`` still holds.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from typing import Iterator

from jaxpt.util import fs, jsonl
from jaxpt.data.documents import DocumentFormatError

from data_pipelines.sources import Source

SAMPLE_CHARS = 500
# Control bytes that do not occur in text. Tab, LF, VT, FF, CR, backspace (nroff overstrike) and
# ESC (ANSI colour codes, e.g. in fortune cookies) do occur in real text; ftfy removes the escapes.
_CONTROL = bytes(b for b in range(32) if b not in (8, 9, 10, 11, 12, 13, 27)) + b"\x7f"
_CONTROL_TABLE = bytes.maketrans(b"", b"")


def drop(doc_id: str, source: Source | dict, stage: str, reason: str, sample: str = "", **extra) -> dict:
    """A decision record for a dropped document (`sample`: text kept for the review sample)."""
    src = source if isinstance(source, dict) else {"name": source.name, "domain": source.domain}
    out = {
        "id": doc_id,
        "source": src["name"],
        "domain": src["domain"],
        "verdict": f"{stage}:{reason}",
        "stage": stage,
        "reason": reason,
        "sample": sample[:SAMPLE_CHARS],
    }
    out.update(extra)
    return out


def _binary_fraction(raw: bytes) -> float:
    """Share of non-text control bytes; 1.0 if there is any NUL byte."""
    if not raw:
        return 0.0
    if b"\x00" in raw:
        return 1.0
    return (len(raw) - len(raw.translate(_CONTROL_TABLE, _CONTROL))) / len(raw)


def _admit_text(text, doc_id: str, source: Source, cfg: AdmissionConfig, extra: dict) -> dict:
    """Document or drop for a decoded record value `text`."""
    if text is None:
        return drop(doc_id, source, "admission", "missing_text", json.dumps(extra)[:SAMPLE_CHARS])
    if isinstance(text, bytes):
        if _binary_fraction(text) > cfg.max_binary_fraction:
            return drop(doc_id, source, "admission", "binary", repr(text[:200]))
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return drop(doc_id, source, "admission", "invalid_utf8", repr(text[:200]))
    if not isinstance(text, str):
        return drop(doc_id, source, "admission", "missing_text", repr(text)[:SAMPLE_CHARS])
    if len(text.encode("utf-8", "surrogatepass")) > cfg.max_record_bytes:
        return drop(doc_id, source, "admission", "oversized", text[:200])
    if not text.strip():
        return drop(doc_id, source, "admission", "empty", repr(text[:200]))
    if _binary_fraction(text[:100_000].encode("utf-8", "surrogatepass")) > cfg.max_binary_fraction:
        return drop(doc_id, source, "admission", "binary", repr(text[:200]))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON \ud800 escapes
        return drop(doc_id, source, "admission", "invalid_utf8", repr(text[:200]))
    return {
        "id": doc_id,
        "source": source.name,
        "domain": source.domain,
        "text": text,
        "lang_hint": extra.get("lang"),
        "html": source.extract_html,
    }


def _admit_line(raw: bytes, fallback_id: str, source: Source, cfg: AdmissionConfig) -> dict:
    """Document or drop for one JSON Lines line (`raw`: its bytes without the line end)."""
    if len(raw) > cfg.max_record_bytes:
        return drop(fallback_id, source, "admission", "oversized", repr(raw[:200]))
    if _binary_fraction(raw) > cfg.max_binary_fraction:
        return drop(fallback_id, source, "admission", "binary", repr(raw[:200]))
    try:
        rec = jsonl.parse_object(raw)  # the line rules every jaxpt reader holds a file to
    except jsonl.LineError as e:
        sample = repr(raw[:200]) if e.reason == "invalid_utf8" else raw.decode("utf-8", "replace")
        return drop(fallback_id, source, "admission", e.reason, sample)
    doc_id = str(rec.get(source.id_field) or fallback_id) if source.id_field else fallback_id
    return _admit_text(rec.get(source.text_field), doc_id, source, cfg, rec)


def read_jsonl(path: str, source: Source, cfg: AdmissionConfig) -> Iterator[dict]:
    """Records of a JSON Lines file (plain, gzip or zstd, told by magic bytes), one element per line.

    The lines are split and classified as every jaxpt reader does (`jaxpt.util.jsonl`), but a bad line is one counted
    drop, not an error: ``oversized``, ``binary``, ``blank_line``, ``invalid_utf8``, ``bad_json``,
    ``not_an_object``, then the record's own (`_admit_text`). A compressed file that is cut short or corrupt
    keeps the records before the damage and adds one ``truncated_file`` drop (id ``<source>/<file>:<n+1>`` after
    the n lines read; ``file`` and ``lines_read`` on the decision row), unless
    `AdmissionConfig.fail_on_damaged_file`, which raises.

    Raises:
      DocumentFormatError: (a ConfigError) a damaged file when `cfg.fail_on_damaged_file` is set.
    """
    base = os.path.basename(path)
    try:
        for lineno, raw, _ in jsonl.iter_lines(path, DocumentFormatError, max_line_bytes=cfg.max_record_bytes,
                                               max_bytes=cfg.max_file_bytes, max_ratio=cfg.max_compression_ratio):
            if isinstance(raw, jsonl.LongLine):  # never held: its first bytes and its length only
                yield drop(f"{source.name}/{base}:{lineno}", source, "admission", "oversized",
                           f"{raw.length} bytes: {raw.head!r}", bytes=raw.length)
                continue
            yield _admit_line(raw, f"{source.name}/{base}:{lineno}", source, cfg)
    except DocumentFormatError as e:  # truncated_file, decompressed_cap or compression_ratio (iter_lines)
        if cfg.fail_on_damaged_file:
            raise
        yield drop(f"{source.name}/{base}:{e.line + 1}", source, "admission", e.reason, str(e),
                   file=path, lines_read=e.line)


def _damaged(path: str, source: Source, cfg: AdmissionConfig, n_read: int, detail: str) -> dict:
    """The ``truncated_file`` drop for a file damaged after `n_read` records (or the error, if configured)."""
    if cfg.fail_on_damaged_file:
        raise DocumentFormatError.at(path, n_read, "truncated_file", detail)
    return drop(f"{source.name}/{os.path.basename(path)}:{n_read + 1}", source, "admission", "truncated_file",
                f"{path}: truncated_file after record {n_read}: {detail}", file=path, lines_read=n_read)


def read_parquet(path: str, source: Source, cfg: AdmissionConfig) -> Iterator[dict]:
    """Rows of a Parquet file, one element per row. A file that cannot be read to its end (cut short, corrupt
    footer or page) keeps the rows read before the damage and adds one ``truncated_file`` drop naming it
    (``lines_read``: rows read), unless `AdmissionConfig.fail_on_damaged_file`, which raises.

    Only the text and id columns are read. Their size is checked before a value is decoded: a row group whose
    text column is larger than `AdmissionConfig.max_file_bytes` uncompressed (the file's metadata) gives one
    ``decompressed_cap`` drop per row, unread; the text column is read dictionary-encoded, so a value repeated
    over many rows is held once, and a value longer than ``max_record_bytes`` is an ``oversized`` drop from its
    length, never turned into a Python string.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = os.path.basename(path)
    row = 0
    try:
        pf = pq.ParquetFile(fs.open(path, "rb") if fs.is_remote(path) else path,
                            read_dictionary=[source.text_field])
        columns = [c for c in dict.fromkeys([source.text_field, source.id_field]) if c in pf.schema_arrow.names]
        text_chunk = _parquet_column_index(pf, source.text_field)
        for g in range(pf.num_row_groups):
            meta = pf.metadata.row_group(g)
            size = meta.column(text_chunk).total_uncompressed_size if text_chunk is not None else 0
            if size > cfg.max_file_bytes:
                for _ in range(meta.num_rows):
                    yield drop(f"{source.name}/{base}:{row}", source, "admission", "decompressed_cap",
                               f"row group {g}: text column of {size} bytes uncompressed > max_file_bytes "
                               f"{cfg.max_file_bytes}", file=path)
                    row += 1
                continue
            for batch in pf.iter_batches(batch_size=256, row_groups=[g], columns=columns):
                ids = batch.column(source.id_field).to_pylist() if source.id_field in columns else None
                text = batch.column(source.text_field) if source.text_field in columns else None
                lengths = _value_bytes(text) if text is not None else None
                for i in range(batch.num_rows):
                    fallback_id = f"{source.name}/{base}:{row}"
                    row += 1
                    doc_id = str(ids[i] or fallback_id) if ids is not None else fallback_id
                    if lengths is not None and lengths[i] > cfg.max_record_bytes:
                        yield drop(doc_id, source, "admission", "oversized", f"{lengths[i]} bytes",
                                   bytes=int(lengths[i]))
                        continue
                    value = text[i].as_py() if text is not None else None
                    yield _admit_text(value, doc_id, source, cfg, {source.id_field: doc_id})
    except (pa.ArrowException, OSError) as e:
        yield _damaged(path, source, cfg, row, f"unreadable Parquet data ({e})")


def _parquet_column_index(pf, name: str) -> int | None:
    """The index of the Parquet leaf column ``name`` in the file's row-group metadata (None: not a column)."""
    for j in range(pf.metadata.num_columns):
        if pf.metadata.schema.column(j).path == name:
            return j
    return None


def _value_bytes(column) -> list[int]:
    """Bytes of each value of a string/binary Arrow column (0 for a null or a non-string value), computed from
    the column's offsets (a dictionary column's from its dictionary): no value is decoded."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(column.type):
        if not (pa.types.is_string(column.type.value_type) or pa.types.is_binary(column.type.value_type)
                or pa.types.is_large_string(column.type.value_type)):
            return [0] * len(column)
        lengths = pc.binary_length(column.dictionary).to_pylist()
        return [0 if k is None else (lengths[k] or 0) for k in column.indices.to_pylist()]
    if not (pa.types.is_string(column.type) or pa.types.is_binary(column.type)
            or pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type)):
        return [0] * len(column)
    return [n or 0 for n in pc.binary_length(column).to_pylist()]


def gzip_intact_end(path: str) -> tuple[int, str | None]:
    """(compressed offset where the last complete gzip member ends, damage or None) for a gzip file.

    A WARC.gz holds one gzip member per record; a file cut short or corrupt has a last member without its
    end-of-stream marker, which warcio reads as a shorter record (or stops at) without an error.
    """
    import zlib

    good_end, offset, d, started = 0, 0, zlib.decompressobj(31), False
    with fs.open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            data = chunk
            while data:
                try:
                    # at most 1 MiB out per call (a record's member may be a decompression bomb); the input not
                    # yet decompressed waits in unconsumed_tail
                    d.decompress(data, 1 << 20)
                except zlib.error as e:
                    return good_end, f"corrupt gzip data ({e})"
                started = True
                if d.eof:
                    used = len(data) - len(d.unused_data)
                    offset += used
                    good_end = offset
                    data, d, started = d.unused_data, zlib.decompressobj(31), False
                elif d.unconsumed_tail:
                    offset += len(data) - len(d.unconsumed_tail)
                    data = d.unconsumed_tail
                else:
                    offset += len(data)
                    data = b""
    if started:
        return good_end, "the gzip stream ends before its end-of-stream marker (file cut short)"
    return good_end, None


_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.I)
_HEADER_CHARSET = re.compile(r"""charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.I)
#: Bytes of a page's start searched for a ``<meta>`` charset (the HTML spec's prescan looks at the first 1024).
META_PRESCAN_BYTES = 4096


def _codec(name: str | None) -> str | None:
    """Python's codec name for a declared charset, or None when Python knows no such codec."""
    if not name:
        return None
    try:
        return codecs.lookup(name.strip().strip("'\"")).name
    except LookupError:
        return None


def decode_page(body: bytes, content_type: str | None) -> tuple[str, str]:
    """``(text, decoded_by)`` of a web page's bytes (the order in the module docstring). A declared charset whose
    codec rejects the bytes falls through to the next path.

    ``decoded_by``: ``http_header:<codec>``, ``html_meta:<codec>``, ``utf-8``, ``detected:<codec>`` or
    ``replacement``.
    """
    header = _HEADER_CHARSET.search(content_type or "")
    meta = _META_CHARSET.search(body[:META_PRESCAN_BYTES])
    for how, name in (("http_header", header and header.group(1)),
                      ("html_meta", meta and meta.group(1).decode("ascii", "replace"))):
        codec = _codec(name)
        if codec is not None:
            try:
                return body.decode(codec), f"{how}:{codec}"
            except UnicodeDecodeError:
                pass
    try:
        return body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        pass
    import charset_normalizer  # the `data` extra's detector (a dependency of requests, which Beam pulls in)
    best = charset_normalizer.from_bytes(body).best()
    codec = _codec(best.encoding) if best is not None else None
    if codec is not None:
        try:
            return body.decode(codec), f"detected:{codec}"
        except UnicodeDecodeError:
            pass
    return body.decode("utf-8", "replace"), "replacement"


def read_warc(path: str, source: Source, cfg: AdmissionConfig) -> Iterator[dict]:
    """WARC ``response`` records (HTML marked for main-text extraction); other record types
    (warcinfo, request, metadata) are not documents and are not counted.

    A compressed WARC cut short or corrupt (`gzip_intact_end`), a record shorter than its Content-Length (plain
    or compressed; warcio returns it short without an error), or a file warcio cannot parse to its end keeps the
    records in its complete part and adds one ``truncated_file`` drop naming the file (``lines_read``: response
    records read), unless `AdmissionConfig.fail_on_damaged_file`, which raises.
    """
    from warcio.archiveiterator import ArchiveIterator

    good_end, damage = gzip_intact_end(path) if jsonl.compression(path) == "gzip" else (None, None)
    n = 0
    with fs.open(path, "rb") as f:
        it = ArchiveIterator(f)
        try:
            for rec in it:
                # At most one byte past the cap is decoded (an HTTP body may be gzip- or brotli-encoded: a few MB
                # can inflate to GiB); the rest of the record is skipped by the iterator, not held.
                body = (rec.content_stream().read(cfg.max_record_bytes + 1) if rec.rec_type == "response"
                        else None)
                # (get_record_offset reads the record to its end, so only after the body was read)
                if damage and it.get_record_offset() >= good_end:
                    break  # this record's gzip member is the damaged one
                if body is None:
                    continue
                uri = rec.rec_headers.get_header("WARC-Target-URI") or rec.rec_headers.get_header("WARC-Record-ID")
                doc_id = f"{source.name}/{uri}"
                if len(body) > cfg.max_record_bytes:  # (not read to its end: a cut-short record shows at the next)
                    n += 1
                    yield drop(doc_id, source, "admission", "oversized", repr(body[:200]))
                    continue
                missing = getattr(rec.raw_stream, "limit", 0)  # declared block bytes the file does not hold
                if missing > 0:
                    damage = damage or f"WARC record {n + 1} cut short: {missing} of its Content-Length bytes missing"
                    break
                n += 1
                yield _admit_page(body, rec, doc_id, source, cfg)
        except Exception as e:  # warcio raises ArchiveLoadFailed, zlib.error, EOFError, ValueError on bad input
            damage = damage or f"unparseable WARC data ({type(e).__name__}: {e})"
    if damage:
        yield _damaged(path, source, cfg, n, damage)


def _admit_page(body: bytes, rec, doc_id: str, source: Source, cfg: AdmissionConfig) -> dict:
    """Document or drop for a WARC response body: binary bytes are dropped as such; text is decoded by its declared
    charset (:func:`decode_page`) and admitted as HTML."""
    if _binary_fraction(body) > cfg.max_binary_fraction:
        return drop(doc_id, source, "admission", "binary", repr(body[:200]))
    headers = rec.http_headers
    text, decoded_by = decode_page(body, headers.get_header("Content-Type") if headers is not None else None)
    doc = _admit_text(text, doc_id, source, cfg, {})
    if "text" in doc:
        doc["html"] = True
        doc["decoded_by"] = decoded_by
    return doc


def read_tfds(source: Source, cfg: AdmissionConfig) -> Iterator[dict]:
    """Examples of a locally prepared TFDS dataset (`path` = name[:version], `data_dir`)."""
    import tensorflow_datasets as tfds

    if source.data_dir and os.path.exists(os.path.join(source.data_dir, "dataset_info.json")):
        builder = tfds.builder_from_directory(source.data_dir)
    else:
        builder = tfds.builder(source.path, data_dir=source.data_dir)
    ds = builder.as_data_source(split=source.split)
    for i in range(len(ds)):
        ex = ds[i]
        fallback_id = f"{source.name}/{source.split}:{i}"
        raw_id = ex.get(source.id_field) if source.id_field else None
        if isinstance(raw_id, bytes):
            raw_id = raw_id.decode("utf-8", "replace")
        yield _admit_text(ex.get(source.text_field), str(raw_id or fallback_id), source, cfg, {})


def read_file(path: str, source: Source, cfg: AdmissionConfig) -> Iterator[dict]:
    """Dispatches on `source.format`."""
    if source.format == "jsonl":
        return read_jsonl(path, source, cfg)
    if source.format == "parquet":
        return read_parquet(path, source, cfg)
    if source.format == "warc":
        return read_warc(path, source, cfg)
    raise ValueError(f"source '{source.name}': no file reader for format '{source.format}'")
