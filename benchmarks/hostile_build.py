"""A corpus build fed hostile files, beside the same build without them: peak RSS and wall time, side by side.

    python benchmarks/hostile_build.py [--bomb-gib 10] [--line-gib 1] [--extraction-seconds 2]

Builds the bundled sample's prose version (``configs/data/sample_prose.gin``: web pages + dictionaries) twice, each
in its own child process (its peak RSS is its own, from ``wait4``): once as is, once with one more source holding

- ``bomb.jsonl.gz``: one repeated JSON line, ``--bomb-gib`` GiB decompressed (gzip members of 64 MiB each);
- ``longline.jsonl.gz``: a good line, a ``--line-gib`` GiB line (hex text: it compresses as text does), a good line;
- ``pages.jsonl.gz``: a 1 MB HTML page that trafilatura needs seconds for (60,000 inline tags in one paragraph)
  and a normal page, with the build's extraction budget set to ``--extraction-seconds``.

Prints both builds' wall time and peak RSS, the hostile source's counts by reason, and whether every other
source's kept documents are identical (their whole decision rows). Figures only: nothing here
passes or fails. Needs ~1.5 GiB of free disk for the generated files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_pipelines import manifest as manifest_lib, testing  # noqa: E402


def _bomb(path: str, gib: int) -> None:
    line = b'{"text": "' + b"The same sentence, again and again. " * 30 + b'"}\n'
    block = line * ((64 << 20) // len(line))
    member = gzip.compress(block, compresslevel=9)
    with open(path, "wb") as f:
        for _ in range(gib * 16):
            f.write(member)


def _long_line(path: str, gib: int) -> None:
    with open(path, "wb") as raw:
        z = zlib.compressobj(1, zlib.DEFLATED, 31)
        raw.write(z.compress(b'{"text": "a good line before the long one, with enough words to keep"}\n{"text": "'))
        for _ in range(gib * 1024):
            raw.write(z.compress(os.urandom(1 << 19).hex().encode()))
        raw.write(z.compress(b'"}\n{"text": "a good line after the long one, with enough words to keep"}\n'))
        raw.write(z.flush())


def _pages(path: str) -> None:
    slow = "<html><body><p>" + "<b>w</b> <i>x</i> " * 60000 + "</p></body></html>"
    ok = "<html><body><article><p>" + "A sentence of main text about the sample. " * 40 + "</p></article></body></html>"
    with gzip.open(path, "wt") as f:
        for i, html in enumerate((slow, ok)):
            f.write(json.dumps({"id": f"page-{i}", "text": html}) + "\n")


def _build(gin: list[str], out: str) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit status) of one build in a child process."""
    cmd = [sys.executable, "-m", "data_pipelines.build", "--config", "configs/data/sample_prose.gin",
           "--output", out] + [a for g in gin for a in ("--gin", g)]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(out + ".log", "w"))
    _, status, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - t, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def _kept(out: str, skip: str) -> dict[str, str]:
    return {r["id"]: json.dumps(r, sort_keys=True) for r in manifest_lib.read_decisions(out) if r["source"] != skip}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bomb-gib", type=int, default=10)
    ap.add_argument("--line-gib", type=int, default=1)
    ap.add_argument("--extraction-seconds", type=float, default=2.0)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="hostile-build-")
    root = os.path.join(work, "inputs")
    os.makedirs(root)
    t = time.perf_counter()
    _bomb(os.path.join(root, "bomb.jsonl.gz"), args.bomb_gib)
    _long_line(os.path.join(root, "longline.jsonl.gz"), args.line_gib)
    _pages(os.path.join(root, "pages.jsonl.gz"))
    print(f"generated in {time.perf_counter() - t:.0f} s: " + ", ".join(
        f"{n} {os.path.getsize(os.path.join(root, n)) / 2**20:.1f} MiB" for n in sorted(os.listdir(root))))
    texts = [json.loads(x)["text"] for x in gzip.open(os.path.join(REPO, "data/sample/reference.jsonl.gz"), "rt")]
    tok = testing.train_tokenizer(texts[:3000], os.path.join(work, "sp"), vocab_size=2048)
    common = [f"OutputConfig.tokenizer_path = '{tok}'", f"AdmissionConfig.extraction_seconds = {args.extraction_seconds}",
              "BuildConfig.source_root = 'data/sample'"]
    hostile_src = (f"{{'name': 'hostile', 'domain': 'web', 'path': '{root}/*.jsonl.gz', 'format': 'jsonl', "
                   "'extract_html': True, 'license': 'CC0-1.0', 'acquired': '2026-12-03', 'languages': ['en']}")
    runs = {"base": common, "hostile": common + [f"BuildConfig.sources = [%WEB, %REFERENCE, {hostile_src}]"]}
    rows = {}
    for name, gin in runs.items():
        out = os.path.join(work, name)
        rows[name] = _build(gin, out)
        print(f"{name:8s} wall {rows[name][0]:7.1f} s   peak RSS {rows[name][1]:7.0f} MiB   exit {rows[name][2]}",
              flush=True)
    m = json.load(open(os.path.join(work, "hostile", "manifest.json")))
    print("hostile source, by reason:", {r: n for r, n in sorted(m["documents_dropped"].get("admission", {}).items())},
          "| documents in:", m["documents_in"])
    same = _kept(os.path.join(work, "base"), "hostile") == _kept(os.path.join(work, "hostile"), "hostile")
    print(f"every other source's decisions identical: {same}")
    print(f"RSS ratio hostile/base: {rows['hostile'][1] / rows['base'][1]:.2f}; "
          f"wall ratio: {rows['hostile'][0] / rows['base'][0]:.2f}; files kept in {work}")


if __name__ == "__main__":
    main()
