"""data_pipelines.tokenizer (corpus reading, the balanced sample, the training CLI) and data_pipelines.vocab_report.

The corpus here is real sample text (code, dictionary articles, fortunes in eight languages) written in
the layout `python -m data_pipelines.build` produces: ArrayRecord shards of tf.train.Example records
listed in mixture.json. Expected values are computed in the test, by hand or with plain code.
"""

import csv
import dataclasses
import gzip
import hashlib
import json
import pathlib

import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from tensorflow_datasets.proto import tf_example_pb2

from data_pipelines import tokenizer as dt
from data_pipelines import vocab_report as vr
from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
HELDOUT = 0.1
# Small and fast: the whole sample is taken (budget above what the corpus has), 1024 pieces.
FAST = ["TokenizerConfig.sample_chars = 10000000", "TokenizerConfig.vocab_size = 1024",
        "TokenizerConfig.max_doc_chars = 3000", f"TokenizerConfig.heldout_fraction = {HELDOUT}"]


def _sample_docs():
    """Code, reference and multilingual documents (no CJK, so 1024 pieces cover the characters)."""
    docs = []
    wanted = {("code", None): 10, ("reference", "en"): 300}
    wanted.update({("multilingual", lang): 40 for lang in ("en", "de", "es", "it", "pl", "ru", "pt", "cs")})
    for domain in ("code", "reference", "multilingual"):
        with gzip.open(SAMPLE / f"{domain}.jsonl.gz", "rt", encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                key = (domain, d["lang"])
                if wanted.get(key, 0) > 0:
                    wanted[key] -= 1
                    docs.append(dict(d, text=d["text"][:6000]))
    return docs


def _example(doc) -> bytes:
    """A record as the corpus writer makes it (TFDS Text -> bytes_list, int32 Tensor -> int64_list)."""
    ex = tf_example_pb2.Example()
    for key in ("id", "source", "domain", "text"):
        ex.features.feature[key].bytes_list.value.append(doc[key].encode("utf-8"))
    ex.features.feature["lang"].bytes_list.value.append((doc["lang"] or "und").encode("utf-8"))
    ex.features.feature["tokens"].int64_list.value.extend([5, 6, 7])
    return ex.SerializeToString(deterministic=True)


def write_corpus_version(root: pathlib.Path, docs, store_text=True, blank=()) -> pathlib.Path:
    """The corpus layout; documents whose id is in `blank` (or all, without `store_text`) lose their text."""
    shards = {}
    for domain in sorted({d["domain"] for d in docs}):
        mine = [d for d in docs if d["domain"] == domain]
        names = []
        for i in range(2):
            name = f"tfds/c/1.0.0/c-{domain}.array_record-{i:05d}-of-00002"
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            w = ArrayRecordWriter(str(root / name), "group_size:1")
            for d in mine[i::2]:
                w.write(_example(d if store_text and d["id"] not in blank else dict(d, text="")))
            w.close()
            names.append(name)
        shards[domain] = names
    (root / "mixture.json").write_text(json.dumps({"shards": shards, "weights": {d: 1 for d in shards}}))
    (root / "manifest.json").write_text(json.dumps({"data_version": "test-v1", "content_id": "abc123"}))
    return root


@pytest.fixture(scope="module")
def docs():
    return _sample_docs()


@pytest.fixture(scope="module")
def corpus_dir(docs, tmp_path_factory):
    return write_corpus_version(tmp_path_factory.mktemp("corpus"), docs)


def heldout_by_hand(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:16], 16) < HELDOUT * 2**64


def test_water_fill_by_hand():
    # 900 characters over three domains: 'a' has only 100, so 'b' and 'c' share the other 800.
    assert dt.water_fill({"a": 100, "b": 1000, "c": 1000}, {"a": 1, "b": 1, "c": 1}, 900) == \
        {"a": 100, "b": 400, "c": 400}
    # Weights 3:1, 'b' unlisted; 'a' can give only 500 of its 750, so 'c' gets the 500 left.
    assert dt.water_fill({"a": 500, "b": 99, "c": 5000}, {"a": 3, "c": 1}, 1000) == {"a": 500, "b": 0, "c": 500}
    assert dt.water_fill({"a": 10}, {"a": 1}, 1000) == {"a": 10}


def _doc(i, domain, n):
    return dt.Document(f"{domain}/{i}", domain, "en", f"{domain}{i}:".ljust(n, "x"))


def test_sample_is_balanced_seeded_and_fills_each_share_exactly():
    docs = [_doc(i, "a", 100) for i in range(10)] + [_doc(i, "b", 50) for i in range(3)] + \
        [_doc(i, "c", 1000) for i in range(20)]
    cfg = dt.TokenizerConfig(sample_chars=1000, max_doc_chars=300, seed=7)
    texts, comp = dt.balanced_sample(docs, cfg)
    # Shares: b has 150 < 333, so a and c get (1000 - 150) / 2 = 425 each. By hand, in seeded-hash order:
    expected = []
    for domain, budget in (("a", 425), ("b", 150), ("c", 425)):
        order = sorted((d for d in docs if d.domain == domain),
                       key=lambda d: hashlib.sha256(f"7:{d.id}".encode()).digest())
        used = 0
        for d in order:
            if used >= budget:
                break
            expected.append(d.text[:min(300, budget - used)])
            used += len(expected[-1])
    assert texts == expected
    assert [comp["domains"][d]["chars_sampled"] for d in "abc"] == [425, 150, 425] and comp["chars"] == 1000
    assert [comp["domains"][d]["documents_sampled"] for d in "abc"] == [5, 3, 2]
    assert [comp["domains"][d]["documents_cut"] for d in "abc"] == [1, 0, 2]  # a: 4 x 100 + 25; c: 300 + 125
    assert comp["languages"] == {"a/en": {"documents": 5, "chars": 425}, "b/en": {"documents": 3, "chars": 150},
                                 "c/en": {"documents": 2, "chars": 425}}
    other, _ = dt.balanced_sample(docs, dataclasses.replace(cfg, seed=8))
    assert other != texts and sum(map(len, other)) == 1000
    assert dt.balanced_sample(list(reversed(docs)), cfg)[0] == texts  # input order does not matter


def test_domain_weights_must_name_corpus_domains():
    cfg = dt.TokenizerConfig(domain_weights={"a": 1.0, "nope": 1.0})
    with pytest.raises(dt.ConfigError, match=r"TokenizerConfig.domain_weights: domains \['nope'\]"):
        dt.balanced_sample([_doc(0, "a", 10)], cfg)
    with pytest.raises(dt.ConfigError, match="TokenizerConfig.heldout_fraction"):
        dt.TokenizerConfig(heldout_fraction=1.5).validate()
    with pytest.raises(dt.ConfigError, match="model_type"):
        dt.TokenizerConfig(model_type="wordpiece").validate()


def test_reads_every_record_of_a_corpus_version_and_splits_by_id(corpus_dir, docs):
    corpus = dt.read_corpus(corpus_dir, HELDOUT)
    got = {d.id: d for d in corpus.train + corpus.heldout}
    assert len(got) == len(corpus.train) + len(corpus.heldout) == len(docs)
    for d in docs:
        g = got[d["id"]]
        assert (g.text, g.domain, g.lang) == (d["text"], d["domain"], d["lang"] or "und")
    assert {d.id for d in corpus.heldout} == {d["id"] for d in docs if heldout_by_hand(d["id"])}
    assert 40 < len(corpus.heldout) < 100
    assert (corpus.info["data_version"], corpus.info["content_id"]) == ("test-v1", "abc123")


def test_reads_a_prepared_sample(docs, tmp_path):
    for name, part in (("train", docs[:50]), ("heldout", docs[50:60])):
        with gzip.open(tmp_path / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(d) + "\n" for d in part)
    corpus = dt.read_corpus(tmp_path, HELDOUT)
    assert [d.id for d in corpus.train] == [d["id"] for d in docs[:50]]
    assert [d.text for d in corpus.heldout] == [d["text"] for d in docs[50:60]]
    with gzip.open(tmp_path / "train.jsonl.gz", "at") as f:
        f.write('{"id": "x"}\n')
    with pytest.raises(dt.ConfigError, match=r"train.jsonl.gz:51"):
        dt.read_corpus(tmp_path, HELDOUT)


def test_bad_corpus_directories_are_named(docs, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a corpus version"):
        dt.read_corpus(tmp_path, HELDOUT)
    write_corpus_version(tmp_path / "notext", docs[:20], store_text=False)
    with pytest.raises(dt.ConfigError, match="store_text"):
        dt.read_corpus(tmp_path / "notext", HELDOUT)
    # Some records without text: counted per domain and skipped, the rest read (in = read + skipped).
    blank = {d["id"] for d in docs[::7]}
    corpus = dt.read_corpus(write_corpus_version(tmp_path / "some", docs, blank=blank), HELDOUT)
    skipped = corpus.info["documents_without_text"]
    assert skipped == {dom: sum(d["domain"] == dom for d in docs[::7]) for dom in ("code", "multilingual", "reference")}
    assert {d.id for d in corpus.train + corpus.heldout} == {d["id"] for d in docs} - blank


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    args = ["--config", str(dt.DEFAULT_CONFIG), "--corpus", str(corpus_dir), "--output", str(out)]
    assert dt.main(args + sum((["--gin", b] for b in FAST), [])) == 0
    return out, args


def test_cli_trains_on_the_whole_training_split_in_sample_order(trained, docs, tmp_path):
    out, _ = trained
    # The budget exceeds the corpus, so the sample is every training document cut at 3000 characters,
    # domains in name order, documents in sha256("0:<id>") order: train on that by hand.
    train = [d for d in docs if not heldout_by_hand(d["id"])]
    texts = [d["text"][:3000] for domain in ("code", "multilingual", "reference")
             for d in sorted((x for x in train if x["domain"] == domain),
                             key=lambda x: hashlib.sha256(f"0:{x['id']}".encode()).digest())]
    by_hand = tokenizer_lib.train(texts, tmp_path / "t.model", tokenizer_lib.TrainerSettings(vocab_size=1024))
    model = (out / "tokenizer.model").read_bytes()
    assert model == by_hand.read_bytes()
    record = json.loads((out / "tokenizer.json").read_text())
    assert record["tokenizer"]["sha256"] == hashlib.sha256(model).hexdigest()
    assert record["sample"]["chars"] == sum(map(len, texts)) and record["sample"]["documents"] == len(texts)
    assert sum(d["chars_sampled"] for d in record["sample"]["domains"].values()) == record["sample"]["chars"]
    s = record["model_settings"]
    assert s["byte_fallback"] and s["split_digits"] and not s["add_dummy_prefix"]
    assert (s["normalization_rule_name"], s["remove_extra_whitespaces"], s["model_type"]) == ("identity", False, "bpe")
    assert [record["tokenizer"][k] for k in ("pad_id", "eos_id", "unk_id", "bos_id")] == [0, 1, 2, 3]
    assert record["corpus"]["data_version"] == "test-v1" and record["config"]["vocab_size"] == 1024


def test_recorded_heldout_bytes_per_token_by_hand(trained, docs):
    out, _ = trained
    tok = Tokenizer.load(out / "tokenizer.model")
    held = [d for d in docs if heldout_by_hand(d["id"]) and d["domain"] == "multilingual" and d["lang"] != "en"]
    n_bytes = sum(len(d["text"].encode()) for d in held)
    n_tokens = sum(len(tok.encode(d["text"])) for d in held)
    got = json.loads((out / "tokenizer.json").read_text())["heldout"]["other-language prose"]
    assert got["documents"] == len(held)
    assert got["bytes_per_token"] == pytest.approx(n_bytes / n_tokens, abs=1e-4)


def test_training_twice_gives_the_same_files(trained, tmp_path):
    out, args = trained
    assert dt.main(args[:-1] + [str(tmp_path)] + sum((["--gin", b] for b in FAST), [])) == 0
    for name in ("tokenizer.model", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()


def test_cli_errors_name_the_problem(corpus_dir, tmp_path, capsys):
    assert dt.main(["--config", str(tmp_path / "none.gin"), "--corpus", str(corpus_dir), "--output", "x"]) == 2
    assert "none.gin: no such file" in capsys.readouterr().err
    assert dt.main(["--config", str(dt.DEFAULT_CONFIG), "--corpus", str(tmp_path), "--output", str(tmp_path)]) == 2
    assert "neither a corpus version" in capsys.readouterr().err
    assert dt.main(["--config", str(dt.DEFAULT_CONFIG), "--gin", "TokenizerConfig.vocab_sise = 3",
                    "--corpus", str(corpus_dir), "--output", str(tmp_path)]) == 2
    assert "vocab_sise" in capsys.readouterr().err


# --------------------------------------------------------------------------------------- report

QUICKSTART = REPO / "configs" / "quickstart.gin"


@pytest.fixture(scope="module")
def reports(corpus_dir, tmp_path_factory):
    """The report run twice from scratch into two folders: by its own CLI (python -m data_pipelines.vocab_report)
    and by the tokenizer CLI's ``report`` subcommand, which runs the same."""
    outs = []
    for main, first in ((vr.main, []), (dt.main, ["report"])):
        out = tmp_path_factory.mktemp("report")
        argv = first + ["--corpus", str(corpus_dir), "--sizes", "2048,1024", "--model-config", str(QUICKSTART),
                        "--output", str(out)] + sum((["--gin", b] for b in FAST), [])
        assert main(argv) == 0
        outs.append(out)
    return outs


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_report_is_reproducible(reports):
    a, b = reports
    for name in ("vocab_report.csv", "bytes_per_token.csv", "vocab_report.md", "vocab_report.json",
                 "tokenizers/sp1024.model", "tokenizers/sp2048.model"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "vocab_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_bytes_per_token_by_hand(reports, docs):
    out = reports[0]
    slices = {(int(r["vocab_size"]), r["slice"]): r for r in _rows(out / "bytes_per_token.csv")}
    held = [d for d in docs if heldout_by_hand(d["id"])]
    for size in (1024, 2048):
        tok = Tokenizer.load(out / "tokenizers" / f"sp{size}.model")
        for name, members in (("code", [d for d in held if d["domain"] == "code"]),
                              ("english prose", [d for d in held if d["domain"] != "code" and d["lang"] == "en"]),
                              ("lang=ru", [d for d in held if d["lang"] == "ru"]),
                              ("all", held)):
            tokens = sum(len(tok.encode(d["text"])) for d in members)
            row = slices[(size, name)]
            assert int(row["documents"]) == len(members) and int(row["tokens"]) == tokens
            assert float(row["bytes_per_token"]) == pytest.approx(
                sum(len(d["text"].encode()) for d in members) / tokens, rel=1e-5)
            assert float(row["tokens_per_document"]) == pytest.approx(tokens / len(members), rel=1e-5)
    assert {n for _, n in slices} >= {"other-language prose", "domain=reference", "lang=de"}


def test_report_model_costs_by_hand(reports):
    rows = {int(r["vocab_size"]): r for r in _rows(reports[0] / "vocab_report.csv")}
    # quickstart.gin: d_model 256, 4 layers, 4 heads x 64, 2 kv heads, mlp 768, untied, seq_len 128.
    d, layers = 256, 4
    block_matmul = layers * (d * 4 * 64 * 2 + d * 2 * 64 * 2 + 3 * d * 768)
    blocks = block_matmul + layers * 2 * d
    for v, r in rows.items():
        assert int(r["embedding_params"]) == int(r["output_params"]) == v * d
        assert int(r["vocab_bytes_fp32"]) == 4 * 2 * v * d and int(r["vocab_bytes_bf16"]) == 2 * 2 * v * d
        total = 2 * v * d + blocks + d
        assert int(r["total_params"]) == total
        assert float(r["vocab_share"]) == pytest.approx(2 * v * d / total, rel=1e-5)
        flops = 6 * (block_matmul + d * v) + 6 * layers * 4 * 64 * 128
        assert float(r["flops_per_token"]) == pytest.approx(flops, rel=1e-5)
        assert float(r["flops_per_byte"]) == pytest.approx(flops / float(r["bpt_all"]), rel=1e-4)
    assert float(rows[2048]["bpt_all"]) > float(rows[1024]["bpt_all"])


def test_report_recommendation_follows_its_rule(reports):
    record = json.loads((reports[0] / "vocab_report.json").read_text())
    rows = record["rows"]
    best = min(r["flops_per_byte"] for r in rows)
    assert record["flops_tolerance"] == 0.0
    assert record["recommendation"] == next(r["vocab_size"] for r in rows if r["flops_per_byte"] == best)
    md = (reports[0] / "vocab_report.md").read_text()
    assert f"## Recommendation: {record['recommendation']}" in md and record["reasons"][0] in md
    # Made-up pairs: the cheaper one per byte wins; with a tolerance, the better-compressing one of a tie.
    fake = [dict(rows[0], vocab_size=1, flops_per_byte=100.0, bpt_all=2.0),
            dict(rows[0], vocab_size=2, flops_per_byte=97.0, bpt_all=2.5)]
    assert vr.recommend(fake)[0] == 2
    fake[1]["flops_per_byte"] = 104.0
    pick, reasons = vr.recommend(fake)
    assert pick == 1 and any(r.startswith("Near ties") and "2 (+4.0% FLOPs/byte, +25.0% bytes/token)" in r
                             for r in reasons)
    assert vr.recommend(fake, flops_tolerance=0.05)[0] == 2 and vr.recommend(fake, flops_tolerance=0.03)[0] == 1


def test_run_config_follows_the_tokenizer(reports):
    """A run's model takes its vocabulary from the tokenizer (ModelConfig.vocab_size = 0); nothing else moves."""
    from jaxpt import config as config_lib
    from jaxpt.run.resolve import resolve_vocab

    cfg = config_lib.parse([str(QUICKSTART)])
    small, large = (resolve_vocab(cfg, Tokenizer.load(reports[0] / "tokenizers" / f"sp{v}.model"))
                    for v in (1024, 2048))
    assert (small.model.vocab_size, large.model.vocab_size) == (1024, 2048)
    assert dataclasses.replace(large, model=dataclasses.replace(large.model, vocab_size=1024)) == small
