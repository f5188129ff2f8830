"""Cut the bundled sample (`data/sample/*.jsonl.gz`) out of the raw-v1 corpus.

    python data/sample/make_sample.py [--raw ../shared/corpus/raw-v1] [--output data/sample]

The quickstart must run from a fresh clone, so a few MiB of raw-v1 live in the repository. This
script is how they were made; rerunning it on the same raw-v1 gives byte-identical files (seeded
sampling, sorted output, gzip with a zero timestamp and no file name).

What is kept, per domain (the plan is the `PLAN` table below):
- web: whole raw HTML pages of the Python 3.11 docs, navigation boilerplate included, exactly as
    in raw-v1. Main-text extraction happens later, in `jaxpt.data.prepare` (trafilatura), so the
    sample stays a faithful subset of the raw corpus. Index/table-of-contents pages (`genindex*`,
    `py-modindex`, `contents`, `search`) and pages over `MAX_WEB_PAGE_CHARS` are never picked.
- code: one CPython version per sampled module path. raw-v1 keeps up to four versions of each
    path on purpose (near duplicates for the dedup stage); taking one keeps near-copies of a held-out
    file out of training in the quickstart.
- reference: a seeded sample of articles from each of the four dictionaries.
- multilingual: fortune cookies from every fortune package and man pages in every language.

Each output file holds the documents of one domain, in the raw-v1 schema (id, text, source,
domain, lang, url_or_path, license), sorted by id. `MANIFEST.json` and `README.md` beside them are
written by this script too (counts, bytes, sha256, licenses), so they cannot drift from the files.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import pathlib
import random
import re
import sys
from typing import Any

SEED = 20261129
SCHEMA = ("id", "text", "source", "domain", "lang", "url_or_path", "license")
DOMAINS = ("web", "code", "reference", "multilingual")
MAX_WEB_PAGE_CHARS = 120_000
MAX_CODE_FILE_CHARS = 60_000
MAX_MANPAGE_CHARS = 40_000
# Index pages are huge lists of links; they teach a model nothing and dominate a small sample.
WEB_EXCLUDE = re.compile(r"(^|/)(genindex[^/]*|py-modindex|contents|search)\.html$")

# Documents to keep per raw-v1 source (code is planned per module path, see `_sample_code`).
PLAN: dict[str, int] = {
    "python3.11-doc": 100,
    "dict-gcide": 4000,
    "dict-foldoc": 1800,
    "dict-jargon": 600,
    "dict-devil": 400,
    "fortunes": 600,
    "fortunes-min": 150,
    "fortunes-de": 400,
    "fortunes-es": 400,
    "fortunes-it": 400,
    "fortunes-pl": 400,
    "fortunes-ru": 400,
    "fortunes-zh": 400,
    "fortunes-br": 400,
    "fortunes-cs": 400,
    "manpages-de": 25,
    "manpages-fr": 25,
    "manpages-es": 25,
    "manpages-it": 25,
    "manpages-ja": 25,
    "manpages-pl": 25,
    "manpages-ru": 25,
}
CODE_SOURCES = ("stdlib-py310", "stdlib-py311", "stdlib-py312", "stdlib-py313")
CODE_MODULE_PATHS = 330

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_RAW = REPO_ROOT.parent / "shared" / "corpus" / "raw-v1"
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent


def _read_source(raw: pathlib.Path, manifest: dict[str, Any], source: str) -> list[dict]:
    """All documents of one raw-v1 source, in shard order; raises on a schema mismatch."""
    docs = []
    for shard in manifest["sources"][source]["shards"]:
        path = raw / shard["file"]
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                doc = json.loads(line)
                if tuple(doc) != SCHEMA:
                    raise ValueError(f"{path}:{line_no}: fields {tuple(doc)} != raw-v1 schema {SCHEMA}")
                docs.append(doc)
    return docs


def _rng(source: str) -> random.Random:
    # str seeds go through sha512 in random.seed, so this does not depend on PYTHONHASHSEED.
    return random.Random(f"{SEED}/{source}")


def _sample(docs: list[dict], k: int, source: str) -> list[dict]:
    if k > len(docs):
        raise ValueError(f"PLAN asks {k} documents of {source!r}; only {len(docs)} are eligible")
    return _rng(source).sample(docs, k)


def _eligible(source: str, doc: dict) -> bool:
    if source == "python3.11-doc":
        return not WEB_EXCLUDE.search(doc["id"]) and len(doc["text"]) <= MAX_WEB_PAGE_CHARS
    if source.startswith("manpages-"):
        return len(doc["text"]) <= MAX_MANPAGE_CHARS
    return True


def _sample_code(raw: pathlib.Path, manifest: dict[str, Any]) -> list[dict]:
    """`CODE_MODULE_PATHS` module paths, each taken from one seeded-random CPython version."""
    by_path: dict[str, list[dict]] = {}
    for source in CODE_SOURCES:
        for doc in _read_source(raw, manifest, source):
            if 0 < len(doc["text"]) <= MAX_CODE_FILE_CHARS:
                module_path = doc["id"].split("/", 1)[1]
                by_path.setdefault(module_path, []).append(doc)
    rng = _rng("code")
    paths = rng.sample(sorted(by_path), CODE_MODULE_PATHS)
    return [rng.choice(by_path[p]) for p in sorted(paths)]


def _gzip_jsonl(docs: list[dict]) -> bytes:
    buf = io.BytesIO()
    # mtime=0 and an empty file name make the bytes a function of the documents alone.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        for doc in docs:
            gz.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
    return buf.getvalue()


def build(raw: pathlib.Path) -> dict[str, list[dict]]:
    """Returns {domain: documents sorted by id} sampled from raw-v1 at `raw`."""
    manifest = json.loads((raw / "MANIFEST.json").read_text())
    out: dict[str, list[dict]] = {d: [] for d in DOMAINS}
    for source, k in PLAN.items():
        eligible = [d for d in _read_source(raw, manifest, source) if _eligible(source, d)]
        for doc in _sample(eligible, k, source):
            out[doc["domain"]].append(doc)
    out["code"].extend(_sample_code(raw, manifest))
    for domain in DOMAINS:
        out[domain].sort(key=lambda d: d["id"])
        ids = [d["id"] for d in out[domain]]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate ids in domain {domain!r}")
    return out


def _source_table(raw_manifest: dict, files: dict[str, dict]) -> list[dict]:
    rows = []
    for domain in DOMAINS:
        for source, n in sorted(files[domain]["documents_per_source"].items()):
            meta = raw_manifest["sources"][source]
            rows.append({
                "source": source,
                "domain": domain,
                "package": meta["package"],
                "package_version": meta["package_version"],
                "license": meta["license"],
                "documents": n,
                "documents_in_raw_v1": meta["num_documents"],
            })
    return rows


def _readme(manifest: dict) -> str:
    lines = [
        "# Bundled sample of raw-v1",
        "",
        "A few MiB of the real raw-v1 corpus (`../shared/corpus/raw-v1`), so that `make quickstart`",
        "needs nothing outside the clone. Written by `make_sample.py` in this folder (seed",
        f"{manifest['seed']}); rerunning it on the same raw-v1 gives byte-identical files. Do not edit",
        "this README by hand: the script writes it, with `MANIFEST.json`.",
        "",
        "One gzip JSON Lines file per domain, raw-v1 schema (`id`, `text`, `source`, `domain`, `lang`,",
        "`url_or_path`, `license`), sorted by `id`. Text is kept exactly as in raw-v1, so web pages are",
        "raw HTML with navigation; `python -m jaxpt.data.prepare` extracts their main text with",
        "trafilatura. Code keeps one CPython version per module path (raw-v1 has up to four, as near",
        "duplicates). Index pages (`genindex*`, `py-modindex`, `contents`, `search`) are left out.",
        "",
        "## Files",
        "",
        "| file | documents | text bytes (UTF-8) | bytes on disk | sha256 |",
        "|---|---:|---:|---:|---|",
    ]
    for name, f in manifest["files"].items():
        lines.append(f"| `{name}` | {f['documents']} | {f['text_bytes']} | {f['bytes']} | `{f['sha256']}` |")
    lines += [
        "",
        f"Total: {manifest['num_documents']} documents, {manifest['bytes_on_disk']} bytes on disk.",
        "",
        "## Sources and licenses",
        "",
        "Licenses as given in raw-v1's README and MANIFEST; see each Debian package's `copyright`",
        "file for the full terms.",
        "",
        "| source | domain | package (version) | license | documents here | in raw-v1 |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in manifest["sources"]:
        lines.append(f"| {r['source']} | {r['domain']} | {r['package']} ({r['package_version']}) | "
                     f"{r['license']} | {r['documents']} | {r['documents_in_raw_v1']} |")
    lines.append("")
    return "\n".join(lines)


def write(raw: pathlib.Path, out_dir: pathlib.Path) -> dict:
    """Builds the sample and writes the domain files, MANIFEST.json and README.md to `out_dir`."""
    raw_manifest = json.loads((raw / "MANIFEST.json").read_text())
    by_domain = build(raw)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for domain in DOMAINS:
        docs = by_domain[domain]
        data = _gzip_jsonl(docs)
        (out_dir / f"{domain}.jsonl.gz").write_bytes(data)
        per_source: dict[str, int] = {}
        for d in docs:
            per_source[d["source"]] = per_source.get(d["source"], 0) + 1
        files[f"{domain}.jsonl.gz"] = {
            "domain": domain,
            "documents": len(docs),
            "documents_per_source": per_source,
            "text_bytes": sum(len(d["text"].encode("utf-8")) for d in docs),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    manifest = {
        "derived_from": raw_manifest["corpus_version"],
        "seed": SEED,
        "schema": list(SCHEMA),
        "num_documents": sum(f["documents"] for f in files.values()),
        "bytes_on_disk": sum(f["bytes"] for f in files.values()),
        "files": files,
        "sources": _source_table(raw_manifest, {f["domain"]: f for f in files.values()}),
    }
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    (out_dir / "README.md").write_text(_readme(manifest))
    return manifest


def main() -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from jaxpt.util import cli  # the shared flag grammar (--out: a deprecated spelling of --output)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", type=pathlib.Path, default=DEFAULT_RAW, help="raw-v1 folder")
    cli.add_flag(parser, "--output", "--out", type=pathlib.Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args()
    if not (args.raw / "MANIFEST.json").is_file():
        raise SystemExit(f"{args.raw}/MANIFEST.json not found: pass --raw <path to raw-v1>")
    manifest = write(args.raw, args.output)
    print(f"wrote {manifest['num_documents']} documents, {manifest['bytes_on_disk']} bytes to {args.output}")


if __name__ == "__main__":
    main()
