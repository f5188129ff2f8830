"""prepare: counted drops, the id-hash split, tokenizer from train text only, determinism, idempotence."""

import gzip
import hashlib
import itertools
import json
import os
import pathlib

import pytest

from jaxpt.data import prepare as prepare_lib
from jaxpt.data.documents import DocumentFormatError
from jaxpt.data import tokenizer as tokenizer_lib

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
SETTINGS = prepare_lib.PrepareSettings(vocab_size=2000, heldout_fraction=0.2, seed=0)
STRIDES = {"code": 30, "multilingual": 25, "reference": 40, "web": 30}


def _read(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _write(path, docs):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def _doc(doc_id, text, domain="reference"):
    return {"id": doc_id, "text": text, "source": "test", "domain": domain, "lang": "en",
            "url_or_path": doc_id, "license": "public-domain"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A spread of real sample documents from all four domains, plus one document per drop reason."""
    src = tmp_path_factory.mktemp("source")
    for domain, stride in STRIDES.items():
        with gzip.open(SAMPLE / f"{domain}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs = [json.loads(line) for line in itertools.islice(f, 0, None, stride)]
        _write(src / f"{domain}.jsonl.gz", docs)
    first_fortune = _read(src / "multilingual.jsonl.gz")[0]
    _write(src / "zz-bad.jsonl.gz", [
        _doc("test/empty", " \n\t "),
        _doc("test/no-main-text", "<html><head><title>x</title></head><body></body></html>", "web"),
        dict(first_fortune, text="a different text under an id seen before"),
        _doc("test/copy-of-a-fortune", first_fortune["text"]),
    ])
    return src


@pytest.fixture(scope="module")
def prepared(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    return out, prepare_lib.prepare(source, out, SETTINGS)


def _source_docs(source):
    return [d for f in sorted(source.glob("*.jsonl.gz")) for d in _read(f)]


def test_counts_add_up_and_each_drop_reason_is_counted(source, prepared):
    out, record = prepared
    counts = record["counts"]
    assert counts["documents_in"] == len(_source_docs(source))
    assert counts["dropped"] == {"empty_text": 1, "no_main_text": 1, "duplicate_id": 1, "exact_duplicate": 1}
    assert counts["train"] == len(_read(out / "train.jsonl.gz"))
    assert counts["heldout"] == len(_read(out / "heldout.jsonl.gz"))
    assert counts["documents_in"] == counts["train"] + counts["heldout"] + sum(counts["dropped"].values())
    for domain, c in counts["per_domain"].items():
        drops = sum(v for k, v in c.items() if k.startswith("dropped_"))
        assert c["in"] == c.get("train", 0) + c.get("heldout", 0) + drops, domain
    assert set(counts["per_domain"]) == {"code", "multilingual", "reference", "web"}


def test_split_follows_the_id_hash_rule_and_is_disjoint(prepared):
    out, record = prepared

    def heldout_by_hand(doc_id):  # the documented rule, computed independently of prepare.is_heldout
        return int(hashlib.sha256(doc_id.encode()).hexdigest()[:16], 16) < 0.2 * 2**64

    train_ids = [d["id"] for d in _read(out / "train.jsonl.gz")]
    heldout_ids = [d["id"] for d in _read(out / "heldout.jsonl.gz")]
    assert heldout_ids and train_ids
    assert all(heldout_by_hand(i) for i in heldout_ids)
    assert not any(heldout_by_hand(i) for i in train_ids)
    assert not set(train_ids) & set(heldout_ids)
    assert record["inputs"]["split_rule"] == prepare_lib.SPLIT_RULE


def test_web_pages_become_main_text_and_other_text_is_kept_exactly(source, prepared):
    out, _ = prepared
    raw = {}
    for d in _source_docs(source):
        raw.setdefault(d["id"], d)  # the first of a duplicated id is the one kept
    kept = _read(out / "train.jsonl.gz") + _read(out / "heldout.jsonl.gz")
    web = [d for d in kept if d["domain"] == "web"]
    assert web and all("<div" not in d["text"] and "</a>" not in d["text"] for d in web)
    assert all(len(d["text"]) < len(raw[d["id"]]["text"]) / 2 for d in web)  # navigation is gone
    assert all(d["text"] == raw[d["id"]]["text"] for d in kept if d["domain"] != "web")
    assert all(list(d) == list(prepare_lib.SCHEMA) for d in kept)


def test_tokenizer_is_trained_on_the_train_split_only(prepared, tmp_path):
    out, record = prepared
    train_texts = [d["text"] for d in _read(out / "train.jsonl.gz")]
    by_hand = tokenizer_lib.train_sentencepiece(train_texts, tmp_path / "t.model", SETTINGS.vocab_size)
    assert by_hand.read_bytes() == (out / "tokenizer.model").read_bytes()
    assert record["tokenizer"]["sha256"] == hashlib.sha256(by_hand.read_bytes()).hexdigest()
    assert record["tokenizer"]["vocab_size"] == 2000


def test_prepare_is_deterministic(source, prepared, tmp_path):
    out, record = prepared
    again = prepare_lib.prepare(source, tmp_path / "again", SETTINGS)
    assert not again["up_to_date"]
    assert again["outputs"] == record["outputs"]
    for name in prepare_lib.OUTPUT_FILES:
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name


def test_rerun_with_same_inputs_is_a_no_op_and_changes_trigger_a_redo(source, prepared, tmp_path):
    out, record = prepared
    mtimes = {n: os.stat(out / n).st_mtime_ns for n in prepare_lib.OUTPUT_FILES + ("prepare.json",)}
    rerun = prepare_lib.prepare(source, out, SETTINGS)
    assert rerun["up_to_date"] and rerun["outputs"] == record["outputs"]
    assert mtimes == {n: os.stat(out / n).st_mtime_ns for n in mtimes}
    # A different setting, a changed source file, or a damaged output: not up to date.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in source.glob("*.jsonl.gz"):
        (copy / f.name).write_bytes(f.read_bytes())
    assert prepare_lib._up_to_date(out, prepare_lib._inputs_record(copy, SETTINGS)) is not None
    other = prepare_lib.PrepareSettings(vocab_size=2001, heldout_fraction=0.2)
    assert prepare_lib._up_to_date(out, prepare_lib._inputs_record(copy, other)) is None
    _write(copy / "zz-bad.jsonl.gz", [_doc("test/new", "new text")])
    assert prepare_lib._up_to_date(out, prepare_lib._inputs_record(copy, SETTINGS)) is None


def test_bad_records_are_reported_with_file_and_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "broken.jsonl.gz", "wt") as f:
        f.write(json.dumps(_doc("ok", "fine")) + "\n{not json\n")
    with pytest.raises(DocumentFormatError, match=r"broken\.jsonl\.gz:2: bad_json: not JSON"):
        prepare_lib.prepare(src, tmp_path / "out", SETTINGS)
    _write(src / "broken.jsonl.gz", [{"text": 7}])
    with pytest.raises(DocumentFormatError, match=r"broken\.jsonl\.gz:1: missing_text"):
        prepare_lib.prepare(src, tmp_path / "out", SETTINGS)
    with pytest.raises(FileNotFoundError, match="no JSON Lines files"):
        prepare_lib.prepare(tmp_path / "out", tmp_path / "out2", SETTINGS)
    with pytest.raises(ValueError, match="heldout-fraction"):
        prepare_lib.prepare(src, tmp_path / "out", prepare_lib.PrepareSettings(heldout_fraction=1.5))


@pytest.mark.slow  # the whole bundled sample: ~20 s
def test_cli_on_the_bundled_sample(tmp_path, capsys):
    prepare_lib.main(["--output", str(tmp_path / "sample"), "--source", str(SAMPLE)])
    assert "done in" in capsys.readouterr().out
    record = json.loads((tmp_path / "sample" / "prepare.json").read_text())
    manifest = json.loads((SAMPLE / "MANIFEST.json").read_text())
    assert record["counts"]["documents_in"] == manifest["num_documents"]
    for domain, c in record["counts"]["per_domain"].items():
        assert c["train"] > 0 and c["heldout"] > 0, domain
    assert record["tokenizer"]["vocab_size"] == prepare_lib.PrepareSettings().vocab_size == 4096
    prepare_lib.main(["--output", str(tmp_path / "sample"), "--source", str(SAMPLE)])
    assert "up to date" in capsys.readouterr().out


def test_own_documents_with_text_only_are_prepared_with_defaults_and_a_data_config(tmp_path):
    """Your own JSON Lines (a plain file, a glob, only `text`) are prepared like the sample: missing raw-v1 fields get
    defaults, and `data.gin` names the prepared files for the trainer."""
    src = tmp_path / "mine"
    src.mkdir()
    words = "the river runs past old mills and new bridges under a grey northern sky".split()
    for part in range(2):
        with open(src / f"part-{part}.jsonl", "w") as f:
            for i in range(150):
                n = 30 + i % 7 + 40 * part  # the parts' texts differ (an exact duplicate would be dropped)
                f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(n))}) + "\n")
    out = tmp_path / "out"
    record = prepare_lib.prepare(str(src / "*.jsonl"), out, prepare_lib.PrepareSettings(vocab_size=300))
    assert record["counts"]["documents_in"] == 300
    assert record["counts"]["train"] + record["counts"]["heldout"] + sum(record["counts"]["dropped"].values()) == 300
    kept = [json.loads(line) for line in gzip.open(out / "train.jsonl.gz", "rt")]
    assert {d["source"] for d in kept} == {"part-0", "part-1"} and {d["domain"] for d in kept} == {"default"}
    assert all(d["id"].startswith(("part-0.jsonl:", "part-1.jsonl:")) for d in kept)
    gin_text = (out / "data.gin").read_text()
    assert f"DataConfig.train_path = {str(out / 'train.jsonl.gz')!r}" in gin_text
    assert "DataConfig.source = 'jsonl'" in gin_text and record["data_version"].startswith("prepared:")
    same = prepare_lib.prepare(str(src), tmp_path / "out2", prepare_lib.PrepareSettings(vocab_size=300))
    assert same["data_version"] == record["data_version"]  # the same documents, from the folder this time


def test_too_many_pieces_for_little_text_names_the_flag_and_leaves_the_folder(tmp_path):
    """A 4096-piece tokenizer on 300 short documents: the error names --vocab-size and the most the text supports
    (SentencePiece's figure), and the folder a previous prepare completed is left as it was (prepare.json too);
    that figure then works."""
    import re
    src = tmp_path / "few.jsonl"
    words = "the river runs past old mills and new bridges under a grey northern sky".split()
    src.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(30 + i % 9))})
                           + "\n" for i in range(300)))
    out = tmp_path / "out"
    prepare_lib.prepare(str(src), out, prepare_lib.PrepareSettings(vocab_size=300))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=r"pass --vocab-size (\d+) or less; .* was left as it was") as e:
        prepare_lib.prepare(str(src), out, prepare_lib.PrepareSettings(vocab_size=4096))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    most = int(re.search(r"--vocab-size (\d+)", str(e.value)).group(1))
    assert 300 <= most < 4096
    rec = prepare_lib.prepare(str(src), out, prepare_lib.PrepareSettings(vocab_size=most))
    assert rec["tokenizer"]["vocab_size"] == most
