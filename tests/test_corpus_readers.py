"""Stage 1 readers: malformed input is counted by reason, nothing crashes, nothing is lost."""

import collections
import gzip
import os

import pytest

from data_pipelines import readers, testing
from data_pipelines.config import AdmissionConfig, ConfigError, Source


def _source(path, fmt="jsonl", **kw):
    return Source(name="bad", domain="web", path=path, format=fmt, license="CC0-1.0", acquired="2026-11-29", **kw)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_bad_input_counted_by_reason(tmp_path, suffix):
    lines, reasons, good = testing.bad_input_lines()
    data = b"\n".join(lines) + b"\n"
    path = str(tmp_path / f"bad{suffix}")
    if suffix == ".jsonl.gz":
        data = gzip.compress(data)
    elif suffix == ".jsonl.zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as f:
        f.write(data)
    out = list(readers.read_jsonl(path, _source(path), AdmissionConfig()))
    assert len(out) == len(lines)  # one element per line: no silent loss
    docs = [o for o in out if "verdict" not in o]
    drops = collections.Counter(o["reason"] for o in out if "verdict" in o)
    assert len(docs) == good
    assert dict(drops) == reasons
    assert all(o["sample"] is not None for o in out if "verdict" in o)
    ids = [o["id"] for o in out]
    assert len(set(ids)) == len(ids)


def test_parquet_missing_text_and_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.Table.from_pylist([
        {"id": "a", "text": b"fine bytes text"},
        {"id": "b", "text": None},
        {"id": "c", "text": b"\xff\xfe bad utf8"},
    ]), path)
    out = list(readers.read_parquet(path, _source(path, "parquet"), AdmissionConfig()))
    assert [o.get("reason") for o in out] == [None, "missing_text", "invalid_utf8"]
    assert out[0]["text"] == "fine bytes text"


def test_registry_errors_name_the_key():
    base = {"name": "s", "domain": "d", "path": "p", "format": "jsonl", "license": "MIT", "acquired": "2026-01-02"}
    Source.from_dict(base, 0)
    with pytest.raises(ConfigError, match=r"sources\[3\] \(source 's'\): missing 'license'"):
        Source.from_dict({k: v for k, v in base.items() if k != "license"}, 3)
    with pytest.raises(ConfigError, match="YYYY-MM-DD"):
        Source.from_dict(dict(base, acquired="last week"), 0)
    with pytest.raises(ConfigError, match="format 'csv'"):
        Source.from_dict(dict(base, format="csv"), 0)
