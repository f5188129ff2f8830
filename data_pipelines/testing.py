"""A small seeded corpus with known duplicates, junk and bad records, for tests and examples.

`make_corpus(root)` writes sources in every reader format and returns the expected facts
(which ids are exact or near duplicates, which records are malformed and why).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random

EN = ("the a of and to in is was for on with as by at from that this which data system river city "
      "people time year work part world school state family group country problem hand place case "
      "week company number night point home water room mother area money story fact month lot right "
      "study book eye job word business issue side kind head house service friend father power hour "
      "game line end member law car name president team minute idea body information back parent face "
      "others level office door health person art war history party result change morning reason "
      "research girl guy moment air teacher force education builds keeps finds gives tells becomes "
      "shows leaves feels brings begins holds writes stands hears lets means sets meets runs pays").split()
DE = ("der die das und ist nicht ein eine mit von den zu im auf für sich dem des auch es an als "
      "wir sie er haben werden wird kann nach bei aus noch wie einem über einer so zum war hat nur "
      "oder aber vor zur bis mehr durch man sein wurde sei schon wenn sehr hier doch immer gegen "
      "Haus Stadt Zeit Jahr Mensch Kind Frau Mann Wasser Arbeit Schule Welt Leben Tag Hand Weg").split()
FR = ("le la les et est dans pour une un des que qui pas sur avec plus par mais ou comme tout nous "
      "vous ils elle fait être avoir sans sous leur même bien aussi maison ville temps année travail "
      "école monde vie jour main chemin femme homme enfant eau").split()


def _sentence(rng: random.Random, vocab: list[str], n: int) -> str:
    words = [rng.choice(vocab) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def prose(rng: random.Random, vocab: list[str], n_sentences: int) -> str:
    return " ".join(_sentence(rng, vocab, rng.randint(8, 16)) for _ in range(n_sentences))


def _write_jsonl_gz(path: str, lines: list[bytes]) -> None:
    with gzip.open(path, "wb") as f:
        for line in lines:
            f.write(line + b"\n")


def _rec(**kw) -> bytes:
    return json.dumps(kw, ensure_ascii=False).encode("utf-8")


def bad_input_lines() -> tuple[list[bytes], dict[str, int], int]:
    """Lines mixing every malformed kind with 3 good records; returns (lines, reasons, good)."""
    lines = [
        _rec(id="bad/good-1", text="A perfectly good record with enough words to pass every rule here."),
        b'{"id": "bad/broken", "text": "unterminated',
        b'{"id": "bad/utf8", "text": "caf\xc3\x28 au lait and more"}',
        bytes(b for b in range(256) if b != 10) * 4,  # a binary blob (newline bytes would split it into several counted lines)
        _rec(id="bad/empty", text=""),
        _rec(id="bad/huge", text="x" * (5 << 20)),
        _rec(id="bad/notext", body="no text field here"),
        b"[1, 2, 3]",
        _rec(id="bad/good-2", text="Another good record, long enough to be admitted by the reader."),
        _rec(id="bad/whitespace", text="   \n\t  "),
        _rec(id="bad/good-3", text="The third good record closes the file with plain words."),
    ]
    reasons = {"bad_json": 1, "invalid_utf8": 1, "binary": 1, "empty": 2, "oversized": 1,
               "missing_text": 1, "not_an_object": 1}
    return lines, reasons, 3


def make_corpus(root: str, seed: int = 0) -> dict:
    """Writes a small multi-format corpus under `root` and returns its expected facts.

    Files: ``web/pages.warc.gz`` (WARC, 6 HTML pages), ``en/news-*.jsonl.gz`` (English prose with
    exact and near duplicates, junk and French records), ``de/prose.jsonl.zst`` (German),
    ``ref/articles.parquet`` (English), ``eval/probe.jsonl`` (an eval set: an example that one English
    document contains, one that none contains, and ``probe-empty``, an example with no word).
    """
    rng = random.Random(seed)
    os.makedirs(os.path.join(root, "en"), exist_ok=True)
    facts = {"exact_groups": [], "near_pairs": [], "french": [], "junk": [], "eval_hit": None}
    en = []
    for i in range(160):
        en.append({"id": f"news/{i:04d}", "text": prose(rng, EN, rng.randint(3, 9))})
    # Exact duplicates: same words, other whitespace and case.
    for g in range(6):
        base = en[g]
        copies = [base["id"]]
        for c in range(g % 3 + 1):
            cid = f"news/exact-{g}-{c}"
            text = base["text"].replace(" ", "  ") if c % 2 == 0 else base["text"].upper()
            en.append({"id": cid, "text": text})
            copies.append(cid)
        facts["exact_groups"].append(copies)
    # Near duplicates: a long document with one word changed (word-5-gram Jaccard about 0.9).
    for g in range(6):
        base = {"id": f"news/long-{g}", "text": prose(rng, EN, 30)}
        words = base["text"].split()
        words[len(words) // 2] = "zebra"
        en.append(base)
        en.append({"id": f"news/near-{g}", "text": " ".join(words)})
        facts["near_pairs"].append((base["id"], f"news/near-{g}"))
    # Short documents (< 5 words) that must not collapse into one cluster.
    for i in range(5):
        en.append({"id": f"news/short-{i}", "text": f"{EN[40 + i]} {EN[60 + i]} {EN[80 + i]} {EN[90 + i]}"})
    for i in range(8):
        en.append({"id": f"news/fr-{i}", "text": prose(rng, FR, 4)})
        facts["french"].append(f"news/fr-{i}")
    junk = [
        "buy now! " * 200,
        "#### $$$ @@@ %%% ^^^ &&& *** ((( ))) ### !!! ??? ;;; ::: ~~~ ``` ### $$$ @@@ %%% !!! ### ...",
        "\n".join(["same line repeated here"] * 40),
    ]
    for i, t in enumerate(junk):
        en.append({"id": f"news/junk-{i}", "text": t})
        facts["junk"].append(f"news/junk-{i}")
    eval_text = " ".join(rng.choice(EN) for _ in range(30))
    contaminated = {"id": "news/contaminated", "text": prose(rng, EN, 3) + " " + eval_text + ". " + prose(rng, EN, 2)}
    en.append(contaminated)
    facts["eval_hit"] = contaminated["id"]
    rng.shuffle(en)
    half = len(en) // 2
    _write_jsonl_gz(os.path.join(root, "en", "news-00000.jsonl.gz"), [_rec(**d, lang="en") for d in en[:half]])
    _write_jsonl_gz(os.path.join(root, "en", "news-00001.jsonl.gz"), [_rec(**d, lang="en") for d in en[half:]])

    import zstandard

    os.makedirs(os.path.join(root, "de"), exist_ok=True)
    de_lines = b"".join(_rec(id=f"de/{i:03d}", text=prose(rng, DE, rng.randint(3, 6))) + b"\n" for i in range(40))
    with open(os.path.join(root, "de", "prose.jsonl.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(de_lines))

    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(root, "ref"), exist_ok=True)
    rows = [{"id": f"ref/{i:03d}", "text": prose(rng, EN, 5)} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(root, "ref", "articles.parquet"))

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    os.makedirs(os.path.join(root, "web"), exist_ok=True)
    facts["web_main_text"] = {}
    with open(os.path.join(root, "web", "pages.warc.gz"), "wb") as f:
        w = WARCWriter(f, gzip=True)
        for i in range(6):
            body_text = prose(rng, EN, 12)
            html = (f"<html><head><title>Page {i}</title></head><body><nav><a href='/'>Home</a> | "
                    f"<a href='/about'>About us</a> | <a href='/login'>Log in</a></nav>"
                    f"<article><h1>Story number {i}</h1><p>{body_text}</p></article>"
                    f"<footer>Copyright boilerplate footer text, all rights reserved.</footer></body></html>")
            uri = f"https://example.org/page{i}.html"
            headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.0")
            w.write_record(w.create_warc_record(uri, "response", payload=io.BytesIO(html.encode()),
                                                http_headers=headers))
            facts["web_main_text"][f"web/{uri}"] = body_text
    os.makedirs(os.path.join(root, "eval"), exist_ok=True)
    with open(os.path.join(root, "eval", "probe.jsonl"), "w") as f:
        f.write(json.dumps({"text": eval_text}) + "\n")
        f.write(json.dumps({"text": prose(rng, EN, 2)}) + "\n")
        f.write(json.dumps({"id": "probe-empty", "text": "?!"}) + "\n")  # no word: matches nothing, named
    facts["n_records"] = len(en) + 40 + 30 + 6
    return facts


def sources(root: str) -> list[dict]:
    """Registry entries for `make_corpus` output."""
    acq = "2026-11-29"
    return [
        {"name": "web", "domain": "web", "path": os.path.join(root, "web/pages.warc.gz"), "format": "warc",
         "license": "CC0-1.0", "acquired": acq, "languages": ["en"]},
        {"name": "news", "domain": "news", "path": os.path.join(root, "en/news-*.jsonl.gz"), "format": "jsonl",
         "license": "CC0-1.0", "acquired": acq, "languages": ["en"]},
        {"name": "de", "domain": "multilingual", "path": os.path.join(root, "de/*.jsonl.zst"), "format": "jsonl",
         "license": "CC0-1.0", "acquired": acq, "languages": ["de"]},
        {"name": "ref", "domain": "reference", "path": os.path.join(root, "ref/*.parquet"), "format": "parquet",
         "license": "CC0-1.0", "acquired": acq, "languages": ["en"]},
    ]


def train_tokenizer(texts: list[str], prefix: str, vocab_size: int = 400) -> str:
    """Trains a small SentencePiece BPE model with byte fallback; returns the .model path."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, minloglevel=2, num_threads=1,
        max_sentence_length=1 << 16,
    )
    return prefix + ".model"


GIN_TEMPLATE = """
import data_pipelines.config
BuildConfig.data_version = 'synthetic-1'
BuildConfig.source_root = '{root}'
BuildConfig.sources = {sources}
RuleConfig.min_words = 5
RuleConfig.per_domain = {{}}
QualityConfig.reference_sources = ['ref']
QualityConfig.drop_quantile = 0.05
DecontamConfig.eval_sets = {{'probe': '{root}/eval/probe.jsonl'}}
QuotaConfig.targets = {{'web': 0.1, 'news': 0.5, 'multilingual': 0.2, 'reference': 0.2}}
QuotaConfig.seed = 3
OutputConfig.dataset_name = 'synthetic_corpus'
OutputConfig.tokenizer_path = '{tokenizer}'
OutputConfig.shards_per_domain = 2
OutputConfig.decision_shards = 2
OutputConfig.review_samples_per_rule = 3
OutputConfig.owner = 'tests'
OutputConfig.heldout_fraction = 0.1
"""


def gin_config(root: str, tokenizer: str) -> str:
    return GIN_TEMPLATE.format(root=root, sources=json.dumps(sources(root)).replace("null", "None"),
                               tokenizer=tokenizer)
