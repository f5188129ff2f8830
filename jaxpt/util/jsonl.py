"""JSON Lines: the line rules every jaxpt reader of a ``.jsonl`` file shares.

A JSON Lines file is UTF-8 text, plain or compressed, one JSON object per line. Compression is recognized
by the file's magic bytes (gzip ``1f 8b``, zstd ``28 b5 2f fd``), so the suffix does not decide. Lines end
with LF (a CR before it is dropped); the last line may lack its LF, so a file with one trailing newline and a
file with none hold the same lines. Line numbers are 1-based.

A line breaks the rules for one of these reasons (:data:`LINE_REASONS`), the names the corpus build counts
its admission drops by (``admission:<reason>``):

- ``blank_line``: empty, or only whitespace (a second newline at the end of the file is one);
- ``invalid_utf8``: bytes that are not UTF-8;
- ``bad_json``: not one JSON value;
- ``not_an_object``: JSON, but not an object;
- ``truncated_file``: a compressed file that ends before its end-of-stream marker, or whose data is corrupt
  (a copy cut short, a failed download). The lines before the damage are read; the damaged tail is not.

A file format adds its own field checks on top (:mod:`jaxpt.data.documents`: a string ``text``;
:func:`jaxpt.run.monitor.read_metrics`: a ``step``) and its own error class, a :class:`jaxpt.util.errors.FileFormatError`.
Strict readers (:func:`iter_objects`) raise at the first bad line; the corpus build (``data_pipelines.readers``)
classifies each line with the same :func:`parse_object` and counts it instead.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import zlib
from typing import BinaryIO, Iterable, Iterator

from jaxpt.util import fs
from jaxpt.util.errors import FileFormatError

LINE_REASONS = ("blank_line", "invalid_utf8", "bad_json", "not_an_object", "truncated_file")
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 20  # bytes read (or decompressed) at a time


class LineError(ValueError):
    """One line breaks the rules: ``reason`` (a name of :data:`LINE_REASONS` or a format's own) and ``detail``.

    Carries no file or line: the reader that met it adds them (strict readers raise a FileFormatError; the
    corpus build counts a drop)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class _Damaged(Exception):
    """The compressed stream ended early or is corrupt (detail in args[0])."""


def compression(path: str | os.PathLike) -> str:
    """``"gzip"``, ``"zstd"`` or ``"none"``, from the first bytes of the file (an empty file is ``"none"``).

    Raises:
      FileNotFoundError, OSError: the file cannot be opened.
    """
    with fs.open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return "none"


def _plain_chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


def _gzip_chunks(f: BinaryIO) -> Iterator[bytes]:
    gz = gzip.GzipFile(fileobj=f, mode="rb")
    try:
        # read1: one decompression step per call, so the data before the damage is returned before the
        # error (read() would keep reading to fill its size and lose it with the exception).
        while chunk := gz.read1(_CHUNK):
            yield chunk
    except EOFError:
        raise _Damaged("the gzip stream ends before its end-of-stream marker (file cut short)") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise _Damaged(f"corrupt gzip data ({e})") from None


# Compressed bytes handed to the zstd decoder per call. Its decompress() returns everything the input makes, and
# one zstd block of at least 4 compressed bytes (an RLE block) makes at most 128 KiB, so 256 bytes make at most
# 8 MiB: memory stays bounded on a decompression bomb (6 KB of zstd can hold 200 MB of one byte).
_ZSTD_STEP = 256


def _zstd_chunks(f: BinaryIO) -> Iterator[bytes]:
    import zstandard  # only zstd files need it

    dctx = zstandard.ZstdDecompressor()
    obj, buf, pos = dctx.decompressobj(), b"", 0
    try:
        while True:
            if pos >= len(buf):
                buf, pos = f.read(_CHUNK), 0
                if not buf:
                    break
            data, pos = buf[pos:pos + _ZSTD_STEP], pos + _ZSTD_STEP
            out = obj.decompress(data)
            if out:
                yield out
            if obj.eof:  # a frame ended: whatever follows starts the next frame
                rest = obj.unused_data
                obj = dctx.decompressobj()
                buf, pos = rest + buf[pos:], 0
                if not buf and not (buf := f.read(_CHUNK)):
                    return
    except zstandard.ZstdError as e:
        raise _Damaged(f"corrupt zstd data ({e})") from None
    raise _Damaged("the zstd frame ends before its end (file cut short)")


@dataclasses.dataclass(frozen=True)
class LongLine:
    """A line longer than the reader's ``max_line_bytes``, yielded in place of its bytes, which are never held.

    Attributes:
      head: its first :data:`LONG_LINE_HEAD` bytes (for a review sample).
      length: its length in bytes (without the line end).
    """
    head: bytes
    length: int


LONG_LINE_HEAD = 200
BOUND_REASONS = ("decompressed_cap", "compression_ratio")
# The compression ratio is judged only once this many bytes were decompressed: a small file of repeated text
# may legitimately compress 1000:1; what must not pass is a large stream at that ratio (a decompression bomb).
RATIO_MIN_BYTES = 16 << 20


class _Line:
    """The line being read, held as its pieces (joined once, at its end: linear time), or, once it is past
    ``cap`` bytes, only its first bytes and its length."""

    def __init__(self, cap: int | None):
        self.cap, self.pieces, self.held, self.long_head, self.long_len = cap, [], 0, None, 0

    def add(self, part: bytes) -> None:
        if self.long_head is not None:
            self.long_len += len(part)
            return
        self.pieces.append(part)
        self.held += len(part)
        if self.cap is not None and self.held > self.cap + 1:  # (+1: a CR before the LF is not counted)
            self.long_head, self.long_len = b"".join(self.pieces)[:LONG_LINE_HEAD], self.held
            self.pieces = []

    def pending(self) -> bool:
        return bool(self.held) or self.long_head is not None

    def end(self) -> bytes | LongLine:
        if self.long_head is not None:
            out = LongLine(self.long_head, self.long_len)
        else:
            raw = b"".join(self.pieces)
            out = raw[:-1] if raw.endswith(b"\r") else raw
        self.pieces, self.held, self.long_head, self.long_len = [], 0, None, 0
        return out


def _check_bounds(path, error, line_no: int, total: int, packed: int, max_bytes, max_ratio) -> None:
    if max_bytes is not None and total > max_bytes:
        raise error.at(path, line_no, "decompressed_cap",
                       f"decompresses past {max_bytes} bytes (the reader's cap); the rest is not read")
    if max_ratio is not None and packed and total > RATIO_MIN_BYTES and total > max_ratio * packed:
        raise error.at(path, line_no, "compression_ratio",
                       f"{total} bytes from {packed} compressed (ratio {total / packed:.0f} > {max_ratio:g}: a "
                       "decompression bomb?); the rest is not read")


def iter_lines(path: str | os.PathLike, error: type[FileFormatError] = FileFormatError, *,
               max_line_bytes: int | None = None, max_bytes: int | None = None,
               max_ratio: float | None = None) -> Iterator[tuple[int, bytes | LongLine, bool]]:
    """``(line number, bytes without the line end, whether an LF ended it)`` for every line of ``path``.

    Only the last line can lack its LF. Decompresses gzip and zstd (by magic bytes). Time is linear in the
    file's decompressed size, and memory is bounded by the longest line held: a line longer than
    ``max_line_bytes`` is yielded as a :class:`LongLine` (its first bytes and its length), its bytes dropped as
    they are read.

    Args:
      path: the file.
      error: the FileFormatError subclass to raise (the file format's own).
      max_line_bytes: lines above this many bytes come as :class:`LongLine` (None: no limit).
      max_bytes: stop with reason ``decompressed_cap`` when the file would decompress past this many bytes (the
        lines wholly within the decompressed steps that fit are read).
      max_ratio: stop with reason ``compression_ratio`` once decompressed bytes exceed ``max_ratio`` times the
        compressed bytes read, judged past :data:`RATIO_MIN_BYTES` decompressed (a decompression bomb).

    Raises:
      error: reason ``truncated_file``, after the last complete line was yielded (``error.line`` is its number;
        the damaged tail, complete lines or not, is not yielded); reason ``decompressed_cap`` or
        ``compression_ratio`` (:data:`BOUND_REASONS`) after the lines before the bound was passed.
      FileNotFoundError, OSError: the file cannot be opened.
    """
    kind = compression(path)
    chunks = {"gzip": _gzip_chunks, "zstd": _zstd_chunks, "none": _plain_chunks}[kind]
    line_no, total, line = 0, 0, _Line(max_line_bytes)
    with fs.open(path, "rb") as f:
        try:
            for chunk in chunks(f):
                total += len(chunk)
                _check_bounds(path, error, line_no, total, f.tell() if kind != "none" else 0, max_bytes, max_ratio)
                start = 0
                while (nl := chunk.find(b"\n", start)) >= 0:
                    line.add(chunk[start:nl])
                    line_no += 1
                    yield line_no, line.end(), True
                    start = nl + 1
                line.add(chunk[start:])
        except _Damaged as e:
            raise error.at(path, line_no, "truncated_file", str(e)) from None
    if line.pending():
        yield line_no + 1, line.end(), False


def parse_object(raw: bytes) -> dict:
    """The JSON object on one line (``raw``: its bytes without the line end).

    Raises:
      LineError: reason ``blank_line``, ``invalid_utf8``, ``bad_json`` or ``not_an_object``.
    """
    if not raw.strip():
        raise LineError("blank_line", "a blank line (every line must be one JSON object)")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError("invalid_utf8", f"not UTF-8 ({e})") from None
    try:
        value = json.loads(line)
    except ValueError as e:
        raise LineError("bad_json", f"not JSON ({e}){_whole_document_hint(line)}") from None
    if not isinstance(value, dict):
        hint = " (a JSON array: JSON Lines holds one object per line)" if isinstance(value, list) else ""
        raise LineError("not_an_object", f"a JSON {type(value).__name__}, not an object{hint}")
    return value


def _whole_document_hint(line: str) -> str:
    """A hint for the usual cause of a line that opens or closes a JSON value and is not one: an indented
    (pretty-printed) JSON document given where JSON Lines, one whole object per line, is expected."""
    bare = line.strip()
    if bare in ("{", "[", "}", "]", "},", "],") or (bare.startswith('"') and bare.endswith(",")):
        return "; a pretty-printed JSON document? JSON Lines holds one whole object per line"
    return ""


def iter_objects(path: str | os.PathLike, *, error: type[FileFormatError] = FileFormatError,
                 partial_last_line: bool = False, max_line_bytes: int | None = None) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every line of ``path``, raising at the first line that breaks the rules.

    Args:
      path: a JSON Lines file (plain, gzip or zstd).
      error: the FileFormatError subclass to raise (the file format's own).
      partial_last_line: if True, a last line that lacks its LF and does not parse is skipped: a writer
        killed in the middle of a line (an appending log such as ``metrics.jsonl``). Any other bad line,
        or a last line that ends with LF, still raises.
      max_line_bytes: a line above this many bytes raises reason ``oversized`` before its bytes are held (read in
        linear time, :func:`iter_lines`); None: no limit.

    Raises:
      error: naming the file and the line, with a reason of :data:`LINE_REASONS` or ``oversized``.
      FileNotFoundError, OSError: the file cannot be opened.
    """
    for line_no, raw, terminated in iter_lines(path, error, max_line_bytes=max_line_bytes):
        if isinstance(raw, LongLine):
            raise error.at(path, line_no, "oversized", f"a line of {raw.length:,} bytes, past the limit of "
                                                       f"{max_line_bytes:,} bytes")
        try:
            obj = parse_object(raw)
        except LineError as e:
            if partial_last_line and not terminated:
                return
            raise error.at(path, line_no, e.reason, e.detail) from None
        yield line_no, obj


def drop_partial_last_line(path: str | os.PathLike) -> int:
    """Cut a last line that lacks its LF off a plain JSON Lines file an appender is about to extend.

    An appending writer killed mid-line leaves a partial last line; appending after it would glue the next
    record onto it and turn it into a bad line in the middle of the file, which no reader tolerates. Returns
    the number of bytes removed (0 when the file is missing, empty, or ends with LF).

    Raises:
      OSError: the file cannot be read or truncated.
    """
    if not fs.isfile(path):
        return 0
    if fs.is_remote(path):  # an object cannot be truncated: write back the complete lines
        data = fs.read_bytes(path)
        keep = data[:data.rfind(b"\n") + 1]
        if len(keep) != len(data):
            fs.write_bytes(path, keep)
        return len(data) - len(keep)
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        pos = size
        while pos > 0:
            step = min(_CHUNK, pos)
            f.seek(pos - step)
            block = f.read(step)
            if pos == size and block.endswith(b"\n"):
                return 0
            cut = block.rfind(b"\n")
            if cut >= 0:
                pos = pos - step + cut + 1
                break
            pos -= step
        f.truncate(pos)
        return size - pos


def read_objects(path: str | os.PathLike, **kwargs) -> list[dict]:
    """Every object of ``path`` in file order; arguments and errors as :func:`iter_objects`."""
    return [obj for _, obj in iter_objects(path, **kwargs)]



#: The key of a supersede marker in an append-only per-step log (``metrics.jsonl``, the batch document log).
SUPERSEDED_AFTER = "superseded_after"


def drop_superseded(records: Iterable[dict]) -> list[dict]:
    """The records of an append-only per-step log with its supersede markers applied, in order.

    A run resumed from a checkpoint older than its last logged step (the newer saves were lost), or rolled back,
    rewrites the steps after that checkpoint; its writer first appends a marker ``{"superseded_after": S, ...}``.
    Each marker drops every *earlier* record whose ``step`` is above ``S`` (``S = -1``: every earlier record, a
    fresh run in a used workdir), so the result holds one record per step; the markers themselves stay. The file
    keeps everything (append-only: tailing readers and object stores never see a rewrite).
    """
    out: list[dict] = []
    for rec in records:
        after = rec.get(SUPERSEDED_AFTER)
        if isinstance(after, int) and not isinstance(after, bool):
            out = [r for r in out if not (isinstance(r.get("step"), int) and r["step"] > after)]
        out.append(rec)
    return out


def last_step(path: str | os.PathLike) -> int | None:
    """The largest ``step`` among the records of ``path`` after :func:`drop_superseded` (None: no file, or no
    record with a step). A half-written last line is skipped."""
    if not fs.isfile(path):
        return None
    steps = [r["step"] for r in drop_superseded(read_objects(path, partial_last_line=True))
             if isinstance(r.get("step"), int) and SUPERSEDED_AFTER not in r]
    return max(steps) if steps else None


def finite(value):
    """``value`` with every non-finite float (Python or NumPy: NaN, +-infinity), at any depth of dicts, lists and
    tuples, replaced by its string (``"nan"``, ``"inf"``, ``"-inf"``), the form :class:`jaxpt.run.monitor.MetricWriter`
    writes. JSON has no such numbers: ``json.dumps`` writes ``NaN``/``Infinity`` by default, which strict parsers
    (``jq``, JavaScript, SQLite's JSON functions, ``json.dumps(allow_nan=False)``) refuse. Tuples become lists and
    NumPy scalars Python numbers; anything else is returned unchanged."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if hasattr(value, "dtype") and getattr(value, "shape", None) == ():  # a NumPy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def dumps(value, **kwargs) -> str:
    """``json.dumps`` of :func:`finite` ``(value)``: standard JSON a strict parser reads (keyword arguments as
    ``json.dumps``'s). Raises TypeError for a value JSON cannot hold, as ``json.dumps`` does."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
