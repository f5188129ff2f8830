"""End-to-end corpus build on a small synthetic corpus (every reader format, known duplicates)."""

import collections
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from data_pipelines import build, draws, manifest as manifest_lib, pipeline, review, testing, writer
from data_pipelines.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Inputs, a tiny tokenizer, and two independent builds of the same inputs."""
    root = str(tmp_path_factory.mktemp("raw"))
    facts = testing.make_corpus(root)
    rng = random.Random(7)
    texts = [testing.prose(rng, testing.EN + testing.DE + testing.FR, 4) for _ in range(300)]
    tok = testing.train_tokenizer(texts, os.path.join(root, "sp"), vocab_size=512)
    gin_path = os.path.join(root, "build.gin")
    with open(gin_path, "w") as f:
        f.write(testing.gin_config(root, tok))
    outs = []
    for name in ("a", "b"):
        out = str(tmp_path_factory.mktemp(f"out_{name}"))
        cfg = build.load_config([gin_path], [])
        build.run(cfg, out)
        outs.append(out)
    return {"root": root, "facts": facts, "tok": tok, "gin": gin_path, "out": outs[0], "out2": outs[1]}


def _raw_records(root):
    """Every input record, read independently of the pipeline's readers."""
    import pyarrow.parquet as pq
    import zstandard

    recs = []
    for p in sorted(os.listdir(os.path.join(root, "en"))):
        with gzip.open(os.path.join(root, "en", p), "rt") as f:
            recs += [json.loads(x) for x in f]
    with open(os.path.join(root, "de", "prose.jsonl.zst"), "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read()
    recs += [json.loads(x) for x in data.decode().splitlines()]
    recs += pq.read_table(os.path.join(root, "ref", "articles.parquet")).to_pylist()
    return recs


def test_every_drop_names_a_stage_and_reason_its_step_declares(corpus):
    declared = {(s.stage, r) for s in pipeline.STEPS for r in s.reasons}
    seen = {(r["stage"], r["reason"]) for r in manifest_lib.read_decisions(corpus["out"]) if r["stage"]}
    assert len(seen) > 5 and seen <= declared, seen - declared


def test_counts_add_up_and_every_record_has_one_decision(corpus):
    m = json.load(open(os.path.join(corpus["out"], "manifest.json")))
    rows = manifest_lib.read_decisions(corpus["out"])
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == corpus["facts"]["n_records"]
    assert m["documents_in"] == corpus["facts"]["n_records"]
    dropped = sum(n for reasons in m["documents_dropped"].values() for n in reasons.values())
    assert m["documents_heldout"] == sum(1 for r in rows if r["verdict"] == "heldout") > 0
    assert m["documents_in"] == m["documents_out"] + m["documents_heldout"] + dropped


def _is_heldout(doc_id, fraction):
    """The split rule, recomputed here: the first 8 bytes of sha256(id), big-endian, below fraction * 2**64."""
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:16], 16) < fraction * 2 ** 64


def test_heldout_split_is_kept_out_of_training(corpus):
    """The held-out split: exactly the surviving documents the id-hash rule picks, none in the training shards,
    none with a duplicate text among the training documents, token counts as the tokenizer gives them."""
    import sentencepiece as spm
    import tensorflow_datasets as tfds

    out = corpus["out"]
    m = json.load(open(os.path.join(out, "manifest.json")))
    rows = {r["id"]: r for r in manifest_lib.read_decisions(out)}
    files = sorted(os.listdir(os.path.join(out, "heldout")))
    assert m["stages"]["heldout_split"]["files"] == [f"heldout/{f}" for f in files]
    held = []
    for f in files:
        held += writer.read_jsonl_gz(os.path.join(out, "heldout", f))
        assert {r["domain"] for r in writer.read_jsonl_gz(os.path.join(out, "heldout", f))} == {f[:-len(".jsonl.gz")]}
    held_ids = {r["id"] for r in held}
    assert len(held_ids) == len(held) == m["documents_heldout"]
    assert len({r["domain"] for r in held}) >= 2
    # Survivors of every filter (kept or held out) are split by the rule alone.
    survivors = [i for i, r in rows.items() if r["verdict"] in ("kept", "heldout")]
    assert held_ids == {i for i in survivors if _is_heldout(i, 0.1)}
    # No held-out id, and no held-out text, is in the training shards.
    train_ids, train_texts = set(), set()
    for domain in m["mixture"]["weights"]:
        ds = tfds.data_source("synthetic_corpus", split=domain, data_dir=os.path.join(out, "tfds"))
        for i in range(len(ds)):
            train_ids.add(ds[i]["id"].decode())
            train_texts.add(" ".join(ds[i]["text"].decode().split()).casefold())
    assert train_ids == {i for i in survivors if not _is_heldout(i, 0.1)}
    assert not held_ids & train_ids
    assert not {" ".join(r["text"].split()).casefold() for r in held} & train_texts
    sp = spm.SentencePieceProcessor(model_file=corpus["tok"])
    for r in held:
        assert r["n_tokens"] == len(sp.encode(r["text"])) == rows[r["id"]]["n_tokens"]
    by_domain = collections.Counter(r["domain"] for r in held)
    assert {d: v["documents"] for d, v in m["heldout_by_domain"].items()} == dict(by_domain)


def test_byte_identical_rebuild(corpus):
    a = json.load(open(os.path.join(corpus["out"], "manifest.json")))
    b = json.load(open(os.path.join(corpus["out2"], "manifest.json")))
    assert a["output_sha256"] == b["output_sha256"]
    for f in ("manifest.json", "mixture.json"):
        assert open(os.path.join(corpus["out"], f), "rb").read() == open(os.path.join(corpus["out2"], f), "rb").read()
    # The recorded hashes are the files' real hashes.
    for rel, h in a["output_sha256"].items():
        assert hashlib.sha256(open(os.path.join(corpus["out"], rel), "rb").read()).hexdigest() == h


def test_exact_dedup_matches_independent_computation(corpus):
    """Among documents that reached stage 5, duplicates of (whitespace-collapsed, case-folded) text."""
    rows = {r["id"]: r for r in manifest_lib.read_decisions(corpus["out"])}
    early = {"admission", "normalize", "langid", "rules"}
    texts = {r["id"]: r["text"] for r in _raw_records(corpus["root"])}
    reached = [i for i, r in rows.items() if r["stage"] not in early and i in texts]
    groups = collections.defaultdict(list)
    for i in reached:
        groups[" ".join(texts[i].split()).casefold()].append(i)
    expected = sum(len(g) - 1 for g in groups.values())
    got = sum(1 for r in rows.values() if r["stage"] == "exact_dedup")
    assert got == expected == sum(len(g) - 1 for g in corpus["facts"]["exact_groups"])
    # Duplicates share the representative's cluster id (smallest id of the group).
    for g in corpus["facts"]["exact_groups"]:
        assert len({rows[i]["cluster_id"] for i in g}) == 1
        assert rows[min(g)]["verdict"] != "exact_dedup:duplicate"


def test_near_duplicates_clustered_short_docs_not_collapsed(corpus):
    rows = {r["id"]: r for r in manifest_lib.read_decisions(corpus["out"])}
    for a, b in corpus["facts"]["near_pairs"]:
        assert rows[a]["cluster_id"] == rows[b]["cluster_id"]
        assert [rows[a]["stage"], rows[b]["stage"]].count("near_dedup") == 1
    shorts = [rows[f"news/short-{i}"]["cluster_id"] for i in range(5)]
    assert len(set(shorts)) == 5


def test_filters_langid_decontamination(corpus):
    rows = {r["id"]: r for r in manifest_lib.read_decisions(corpus["out"])}
    for i in corpus["facts"]["french"]:
        assert rows[i]["verdict"] == "langid:language_not_allowed"
    for i in corpus["facts"]["junk"]:
        assert rows[i]["stage"] in ("rules", "langid"), rows[i]
    assert rows[corpus["facts"]["eval_hit"]]["verdict"] == "decontamination:eval_ngram_overlap"
    m = json.load(open(os.path.join(corpus["out"], "manifest.json")))
    assert m["decontaminated_ids"] == [corpus["facts"]["eval_hit"]]
    probe = m["stages"]["decontamination"]["eval_sets_report"]["probe"]
    assert (probe["examples"], probe["documents_removed"], probe["empty_examples"]) == (3, 1, ["probe-empty"])
    assert sum(c["examples"] for c in probe["by_length_class"].values()) == 3
    assert [(e["id"], e["rule"], e["documents_removed"]) for e in probe["matched_examples"]] == [
        ("probe.jsonl:1", "ngram", 1)]
    assert [w for w in m["decontamination_warnings"] if "probe-empty" in w]
    # WARC pages: main text kept, navigation and footer boilerplate gone.
    src = writer.corpus_features  # noqa: F841 (import check)
    import tensorflow_datasets as tfds

    ds = tfds.data_source("synthetic_corpus", split="web", data_dir=os.path.join(corpus["out"], "tfds"))
    assert len(ds) > 0
    for ex in ds:
        text = ex["text"].decode()
        assert "Log in" not in text and "all rights reserved" not in text
        assert text.strip() in {t.strip() for t in corpus["facts"]["web_main_text"].values()} or "Story number" in text


def test_manifest_figures_recomputed_from_decision_log(corpus):
    out = corpus["out"]
    m = json.load(open(os.path.join(out, "manifest.json")))
    rows = []
    for p in sorted(os.listdir(os.path.join(out, "decisions"))):
        with gzip.open(os.path.join(out, "decisions", p), "rt") as f:
            rows += [json.loads(x) for x in f]
    by_stage = collections.defaultdict(collections.Counter)
    for r in rows:
        if r["verdict"] not in ("kept", "heldout"):
            stage, reason = r["verdict"].split(":", 1)
            by_stage[stage][reason] += 1
    assert {s: dict(c) for s, c in by_stage.items()} == m["documents_dropped"]
    kept = [r for r in rows if r["verdict"] == "kept"]
    assert m["documents_out"] == len(kept)
    # Tokens: decision log total == tokens actually in the shards.
    import tensorflow_datasets as tfds

    shard_tokens = 0
    for domain in m["mixture"]["weights"]:
        ds = tfds.data_source("synthetic_corpus", split=domain, data_dir=os.path.join(out, "tfds"))
        shard_tokens += sum(len(ds[i]["tokens"]) for i in range(len(ds)))
    assert m["tokens_out"] == sum(r["n_tokens"] for r in kept) == shard_tokens
    # Token proportions and language coverage.
    tok = collections.Counter()
    for r in kept:
        tok[r["domain"]] += r["n_tokens"]
    for d, share in m["actual_token_proportions"].items():
        assert share == pytest.approx(tok[d] / sum(tok.values()))
    de = m["language_coverage"]["de"]
    # Coverage counts survivors of the filters in both splits (training and held out).
    assert de["documents_kept"] == sum(1 for r in rows if r["verdict"] in ("kept", "heldout") and r["lang"] == "de")


def test_quota_proportions_near_targets(corpus):
    mix = json.load(open(os.path.join(corpus["out"], "mixture.json")))
    for d, target in mix["target_weights"].items():
        # Character targets, token shares, seeded Bernoulli sampling of ~100 documents: loose bound.
        assert abs(mix["weights"][d] - target) < 0.08, (d, mix["weights"][d], target)


def test_quota_keeps_the_hash_ranked_prefix_of_each_group(corpus):
    """The Beam stage's selection equals the rule recomputed from the decision log: per (domain, lang) group, the
    documents ranked by uniform(seed, id) up to the group's character budget (`steps.quotas.quota_cutoff`)."""
    rows = [r for r in manifest_lib.read_decisions(corpus["out"]) if r["verdict"] in ("kept", "quota:downsampled")]
    fractions = json.load(open(os.path.join(corpus["out"], "_stats", "quota_fractions.json")))
    seed = build.load_config([corpus["gin"]], []).quotas.seed
    groups = collections.defaultdict(list)
    for r in rows:
        groups[f"{r['domain']}/{r['lang']}"].append((draws.uniform(seed, r["id"]), r["id"], r["n_chars"]))
    want = set()
    for g, items in groups.items():
        budget, before = fractions[g] * sum(n for _, _, n in items), 0
        for _, i, n in sorted(items):  # by hand: keep while the characters before + half its own fit
            if before + n / 2 > budget:
                break
            want.add(i)
            before += n
    assert {r["id"] for r in rows if r["verdict"] == "kept"} == want
    assert any(r["verdict"] == "quota:downsampled" for r in rows)  # the stage did select


@pytest.mark.integration
def test_review_samples_and_wrongful_rate(corpus, tmp_path):
    out = corpus["out"]
    files = sorted(os.listdir(os.path.join(out, "review")))
    assert "langid__language_not_allowed.jsonl" in files
    sample = [json.loads(x) for x in open(os.path.join(out, "review", "langid__language_not_allowed.jsonl"))]
    assert len(sample) == 3 and all(s["sample"] for s in sample)
    exact = [json.loads(x) for x in open(os.path.join(out, "review", "exact_dedup__duplicate.jsonl"))]
    labels = tmp_path / "labels.jsonl"
    # 1 of 3 language drops judged wrongful (33% > 20%: warn); 0 of the exact-dedup sample.
    with open(labels, "w") as f:
        for k, s in enumerate(sample):
            f.write(json.dumps({"id": s["id"], "wrongful": k == 0}) + "\n")
        for s in exact:
            f.write(json.dumps({"id": s["id"], "wrongful": False}) + "\n")
    rates = review.wrongful_rates(out, str(labels))
    assert rates["langid:language_not_allowed"]["rate"] == pytest.approx(1 / 3)
    assert rates["langid:language_not_allowed"]["warn"] is True
    z2, n = 1.959964 ** 2, len(exact)  # Wilson upper bound at k = 0: z^2 / (n + z^2)
    assert rates["exact_dedup:duplicate"] == {"labelled": n, "wrongful": 0, "rate": 0.0,
                                              "ci95": [0.0, pytest.approx(z2 / (n + z2))], "warn": False}
    proc = subprocess.run([sys.executable, "-m", "data_pipelines.review", out, str(labels)],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0
    assert "WARNING: langid:language_not_allowed" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "nope", "wrongful": true}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        review.wrongful_rates(out, str(bad))


def test_source_without_license_or_date_is_refused(corpus, tmp_path):
    text = open(corpus["gin"]).read()
    for field in ("license", "acquired"):
        broken = re.sub(rf'"{field}": "[^"]*", ', "", text, count=1)
        p = tmp_path / f"no_{field}.gin"
        p.write_text(broken)
        with pytest.raises(ConfigError, match=rf"sources\[0\].*missing '{field}'"):
            build.load_config([str(p)], [])


@pytest.mark.integration
def test_tfds_local_dataset_accepted_as_source(corpus, tmp_path):
    """The built corpus is itself a local TFDS dataset: read it back as a source."""
    tfds_dir = os.path.join(corpus["out"], "tfds", "synthetic_corpus", "1.0.0")
    text = open(corpus["gin"]).read()
    src = ("[{'name': 'again', 'domain': 'news', 'path': 'synthetic_corpus', 'format': 'tfds', "
           f"'split': 'news', 'data_dir': '{tfds_dir}', 'license': 'CC0-1.0', 'acquired': '2026-11-29', "
           "'languages': ['en']}]")
    text = re.sub(r"BuildConfig.sources = .*", f"BuildConfig.sources = {src}", text)
    text = text.replace("QualityConfig.reference_sources = ['ref']", "QualityConfig.reference_sources = []")
    text = re.sub(r"QuotaConfig.targets = .*", "QuotaConfig.targets = {'news': 1.0}", text)
    p = tmp_path / "tfds.gin"
    p.write_text(text)
    cfg = build.load_config([str(p)], ["DecontamConfig.eval_sets = {}", "OutputConfig.heldout_fraction = 0.0"])
    m = build.run(cfg, str(tmp_path / "out"))
    n_news = json.load(open(os.path.join(corpus["out"], "mixture.json")))["documents"]["news"]
    assert m["documents_in"] == n_news
    assert m["documents_out"] == n_news  # already clean and deduplicated
