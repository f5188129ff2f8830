"""Admission: source files to documents; the bounded readers (`data_pipelines.readers`) count every bad record."""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import gin

from jaxpt.util import jsonl

from data_pipelines import progress, readers
from data_pipelines.steps import base


@gin.configurable
@dataclasses.dataclass
class AdmissionConfig:
    """Records above `max_record_bytes` of UTF-8 are dropped as ``oversized``; records
    holding a NUL byte, or whose share of control bytes that text does not use (all C0 controls but
    tab, LF, VT, FF, CR, backspace and ESC, plus DEL) exceeds `max_binary_fraction`, are dropped as
    ``binary``. (IRC colour codes put a few percent of STX/ETX bytes into real fortune cookies.)

    A compressed JSON Lines file cut short keeps the records read before the damage and counts one
    ``truncated_file`` drop naming the file; `fail_on_damaged_file` stops the build instead (exit 2, naming it).

    Bounds on hostile input (each hit is counted under its own reason, never held first):
      max_file_bytes: a JSON Lines file that decompresses past this many bytes keeps the lines read before and
        counts one ``decompressed_cap`` drop for the rest; a Parquet row group whose text column is larger
        (uncompressed, from the file's metadata) is one ``decompressed_cap`` drop per row, undecoded.
      max_compression_ratio: a compressed file whose decompressed bytes pass this many times the compressed bytes
        read (judged after 16 MiB decompressed) stops there with one ``compression_ratio`` drop (a decompression
        bomb: gzip reaches ~1000:1 on one repeated line; text corpora compress 3-10:1).
      extraction_seconds: main-text extraction of one HTML page that runs past this many seconds is stopped
        and the page counted ``extraction_timeout`` (0: no budget).
    """

    max_record_bytes: int = 4 << 20
    max_binary_fraction: float = 0.1
    samples_per_reason: int = 5
    fail_on_damaged_file: bool = False
    max_file_bytes: int = 16 << 30
    max_compression_ratio: float = 100.0
    extraction_seconds: float = 30.0


REASONS = ("oversized", "binary", "missing_text", "empty", *jsonl.LINE_REASONS, *jsonl.BOUND_REASONS)


class ReadSource(beam.DoFn):
    """(source name, file path or None for TFDS) -> documents and admission drops."""

    def __init__(self, sources: dict, cfg):
        self.sources, self.cfg = sources, cfg

    def process(self, item):
        name, path = item
        src = self.sources[name]
        it = readers.read_tfds(src, self.cfg) if src.format == "tfds" else readers.read_file(path, src, self.cfg)
        for rec in it:
            progress.count("read")
            if "verdict" in rec:
                yield beam.pvalue.TaggedOutput(base.DROPS, rec)
            else:
                yield rec
        progress.count("files")


class Admission(base.Step):
    """(source, file) pairs read into documents, then spread over the workers."""

    name = stage = config_field = "admission"
    config = AdmissionConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        inputs = []
        for s in ctx.sources.values():
            inputs += [(s.name, None)] if s.format == "tfds" else [(s.name, f) for f in s.files(ctx.cfg.source_root)]
        files = ctx.pipeline | "Inputs" >> beam.Create(inputs)
        docs = base.with_drops(files, "Read", beam.ParDo(ReadSource(ctx.sources, ctx.cfg.admission)), ctx)
        return docs | "SpreadDocs" >> beam.Reshuffle()

    def record(self, facts: base.Facts) -> dict:
        return {"admission": facts.operative["admission"]}
