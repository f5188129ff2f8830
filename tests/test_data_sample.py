"""The bundled sample: files match their manifest, all four domains, raw-v1 schema, reproducible."""

import gzip
import hashlib
import importlib.util
import json
import pathlib

import pytest

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
SCHEMA = ["id", "text", "source", "domain", "lang", "url_or_path", "license"]


@pytest.fixture(scope="module")
def manifest():
    return json.loads((SAMPLE / "MANIFEST.json").read_text())


def _docs(name):
    with gzip.open(SAMPLE / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_files_match_manifest_and_readme(manifest):
    readme = (SAMPLE / "README.md").read_text()
    assert set(manifest["files"]) == {p.name for p in SAMPLE.glob("*.jsonl.gz")}
    total = 0
    for name, meta in manifest["files"].items():
        data = (SAMPLE / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], name
        assert meta["sha256"] in readme, f"README.md lacks the sha256 of {name}"
        docs = _docs(name)
        assert len(docs) == meta["documents"]
        assert {d["domain"] for d in docs} == {meta["domain"]}
        total += len(data)
    assert 3 * 2**20 <= total <= 5 * 2**20, f"sample is {total} bytes; the plan is 3-5 MiB"


def test_documents_follow_the_raw_v1_schema_with_licenses(manifest):
    licenses = {s["source"]: s["license"] for s in manifest["sources"]}
    ids = []
    for name in manifest["files"]:
        for d in _docs(name):
            assert list(d) == SCHEMA
            assert d["license"] == licenses[d["source"]]
            ids.append(d["id"])
    assert len(ids) == len(set(ids)) == manifest["num_documents"]


def test_covers_all_domains_and_several_languages(manifest):
    assert {m["domain"] for m in manifest["files"].values()} == {"web", "code", "reference", "multilingual"}
    langs = {d["lang"] for d in _docs("multilingual.jsonl.gz")}
    assert {"en", "de", "fr", "es", "it", "pl", "ru", "ja", "zh", "cs", "pt"} <= langs
    assert not any("genindex" in d["id"] for d in _docs("web.jsonl.gz"))


@pytest.mark.raw_v1
def test_make_sample_reproduces_the_committed_files(raw_v1_dir, manifest, tmp_path):
    spec = importlib.util.spec_from_file_location("make_sample", SAMPLE / "make_sample.py")
    make_sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_sample)
    rebuilt = make_sample.write(raw_v1_dir, tmp_path)
    assert rebuilt["files"] == manifest["files"]
    for name in manifest["files"]:
        assert (tmp_path / name).read_bytes() == (SAMPLE / name).read_bytes(), name
