"""Paragraph-level dedup (stage 6b, `ParagraphDedupConfig`): planted boilerplate removed, a paragraph shared by two
documents kept, boilerplate-only documents dropped by name, counts that add up, and the option off unchanged."""

import contextlib
import hashlib
import json
import os
import random

import pytest

import numpy as np

from data_pipelines import build, manifest as manifest_lib, minhash, testing
from data_pipelines.steps import exact_dedup, paragraph_dedup
from data_pipelines.config import ConfigError, ParagraphDedupConfig, RuleConfig

# Planted paragraphs. BOILER (27 words) is in 13 documents, FOOTER (17 words) in 11: both above the default
# ParagraphDedupConfig.max_documents = 10. BOILER_NEAR (one word of BOILER changed) is in 3 documents: kept by exact
# matching, removed by near matching (its cluster with BOILER spans 16 documents). TWICE is in 2 documents and
# HEADING (2 words, under min_words) in 12: both kept.
BOILER = ("This page is part of the Example Archive. Its text may be copied under the terms of the Creative Commons "
          "licence; see the archive's terms page for the details.")
BOILER_NEAR = BOILER.replace("terms page", "licence page")
FOOTER = "Follow the archive on the usual channels and write to the editors with any correction you find."
TWICE = ("A paragraph that two documents happen to share, quoted word for word from the same old letter about the "
         "river.")
HEADING = "See also:"
SHORT = "Short note here."


def _corpus() -> tuple[dict[str, list[tuple[str, list[str]]]], dict]:
    """Per source, documents as (id, paragraphs); paragraphs are joined by "\\n\\n" (one joint by "\\n \\n\\n").
    Returns (sources, facts): facts name the planted copies (their exact text) each document holds."""
    rng = random.Random(38)
    prose = lambda: testing.prose(rng, testing.EN, 3)  # noqa: E731
    alpha, beta = [], []
    for i in range(12):
        paras = [prose(), prose()]
        if i < 7:
            copy = BOILER.upper() if i == 3 else BOILER.replace(" the ", "\n  the ") if i == 4 else BOILER
            paras.insert(i % 3, copy)  # first, middle or last
        if i < 10:
            paras.append(FOOTER)
        if 7 <= i < 10:
            paras.insert(1, BOILER_NEAR)
        if i >= 10:
            paras.insert(1, TWICE)
        paras.insert(0, HEADING)
        alpha.append((f"alpha/{i:02d}", paras))
    for i in range(4):
        beta.append((f"beta/{i:02d}", [prose(), BOILER, prose()]))
    beta.append(("beta/only", [BOILER, FOOTER]))
    beta.append(("beta/short", [SHORT, BOILER]))
    return {"alpha": alpha, "beta": beta}


def _text(paras: list[str]) -> str:
    return "\n\n".join(paras[:-1]) + ("\n \n\n" if len(paras) > 1 else "") + paras[-1]


GIN = """
import data_pipelines.config
BuildConfig.data_version = 'paragraphs-1'
BuildConfig.source_root = '.'
BuildConfig.sources = [
  {'name': 'alpha', 'domain': 'web', 'path': 'alpha.jsonl', 'format': 'jsonl', 'license': 'CC0-1.0',
   'acquired': '2026-12-01', 'languages': None},
  {'name': 'beta', 'domain': 'reference', 'path': 'beta.jsonl', 'format': 'jsonl', 'license': 'CC0-1.0',
   'acquired': '2026-12-01', 'languages': None},
]
LangIdConfig.enabled = False
QuotaConfig.enabled = False
OutputConfig.tokenizer_path = 'sp.model'
OutputConfig.dataset_name = 'paragraphs'
OutputConfig.heldout_fraction = 0.25
OutputConfig.shards_per_domain = 1
OutputConfig.decision_shards = 1
OutputConfig.owner = 'tests'
"""


@contextlib.contextmanager
def _cwd(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def write_inputs(root: str) -> dict:
    """The two sources as plain JSON Lines (no gzip header time), the build's gin file and a tokenizer."""
    docs = _corpus()
    for name, rows in docs.items():
        with open(os.path.join(root, f"{name}.jsonl"), "w") as f:
            for doc_id, paras in rows:
                f.write(json.dumps({"id": doc_id, "text": _text(paras)}) + "\n")
    with open(os.path.join(root, "build.gin"), "w") as f:
        f.write(GIN)
    texts = [_text(p) for rows in docs.values() for _, p in rows]
    with _cwd(root):  # the model records its prefix: a relative one keeps its bytes (and the manifest) the same
        testing.train_tokenizer(texts, "sp", vocab_size=400)
    return docs


def run_build(root: str, out: str, bindings: list[str]) -> dict:
    import gin

    with _cwd(root):
        try:
            cfg = build.load_config(["build.gin"], bindings)
        finally:
            gin.clear_config()  # ParagraphDedupConfig() elsewhere must not take these bindings
        return build.run(cfg, out)


# sha256 of manifest.json of the build above with paragraph dedup off, recorded on the commit before the option existed
# (4538fb5; re-recorded there after the tokenizer seam added the tokenizer's kind to manifests, first on 47db206).
# The manifest holds the operative config, the content id and the sha256 of every shard, held-out file and decision
# log, so an equal manifest means byte-identical output. A change of the manifest's own fields, or a library upgrade
# that changes the bytes on both sides (SentencePiece, ArrayRecord, TensorFlow's Example), needs it re-recorded:
# build on a commit without stage 6b.
MANIFEST_SHA256_OFF = "7a8101e7256cc7f65f746aa4ad6b844a7bf5d7326e3af3253b6cd215f72ef8d3"

NEAR = ["ParagraphDedupConfig.enabled = True", "ParagraphDedupConfig.skip_domains = []"]
EXACT = NEAR + ["ParagraphDedupConfig.match = 'exact'"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("paragraphs"))
    docs = write_inputs(root)
    outs = {}
    for name, bindings in (("off", []), ("exact", EXACT), ("near", NEAR), ("near2", NEAR)):
        run_build(root, name, bindings)
        outs[name] = os.path.join(root, name)
    return {"root": root, "docs": docs, "out": outs}


def _manifest(out):
    return json.load(open(os.path.join(out, "manifest.json")))


def _planted(docs, removed: set[str]) -> dict[str, list[str]]:
    """Per document id, the planted copies (their exact text) that match one of `removed` (BOILER, FOOTER, ...)
    after whitespace collapsing and case folding: what the stage must take out, found here without the stage's
    splitting or hashing."""
    norm = lambda t: " ".join(t.split()).casefold()  # noqa: E731
    targets = {norm(t) for t in removed}
    return {doc_id: [p for p in paras if norm(p) in targets] for rows in docs.values() for doc_id, paras in rows}


@pytest.mark.slow  # the module's four Beam builds: ~60 s on a loaded 2-core host
def test_option_off_is_byte_identical_to_the_build_before_it(built):
    m = _manifest(built["out"]["off"])
    assert "paragraph_dedup" not in m and "paragraph_dedup" not in m["stages"]
    assert all("paragraphs_removed" not in r for r in manifest_lib.read_decisions(built["out"]["off"]))
    sha = hashlib.sha256(open(os.path.join(built["out"]["off"], "manifest.json"), "rb").read()).hexdigest()
    assert sha == MANIFEST_SHA256_OFF


@pytest.mark.slow  # the module's four Beam builds: ~60 s on a loaded 2-core host
@pytest.mark.parametrize("mode", ["exact", "near"])
def test_recurring_paragraphs_removed_twice_shared_kept_counts_add_up(built, mode):
    """Exact: BOILER (13 documents, one copy upper-cased, one re-wrapped) and FOOTER (11) go; near: BOILER_NEAR (3
    documents, one word from BOILER) goes too. TWICE (2 documents) and HEADING (12, under min_words) stay."""
    out, docs = built["out"][mode], built["docs"]
    removed = {BOILER, FOOTER} | ({BOILER_NEAR} if mode == "near" else set())
    planted = _planted(docs, removed)
    rows = {r["id"]: r for r in manifest_lib.read_decisions(out)}
    m = _manifest(out)
    # Documents in = kept + held out + each drop; the two boilerplate documents drop by the new reasons.
    drops = {s: n for reasons in m["documents_dropped"].values() for s, n in reasons.items()}
    assert m["documents_in"] == 18 == m["documents_out"] + m["documents_heldout"] + sum(drops.values())
    assert m["documents_dropped"] == {"paragraph_dedup": {"all_removed": 1, "too_short_after_removal": 1}}
    assert rows["beta/only"]["verdict"] == "paragraph_dedup:all_removed"
    assert rows["beta/short"]["verdict"] == "paragraph_dedup:too_short_after_removal"
    # Each row lists exactly its planted copies, in order, with their bytes and first characters.
    for doc_id, copies in planted.items():
        log = rows[doc_id].get("paragraphs_removed", [])
        assert [(e["bytes"], e["text"]) for e in log] == [(len(c.encode()), c[:60]) for c in copies], doc_id
        want = ["near_repeated_paragraph" if c == BOILER_NEAR else "repeated_paragraph" for c in copies]
        assert [e["reason"] for e in log] == want
        assert all(len(e["hash"]) == 16 for e in log)
    # The manifest's figures equal the planted copies, by hand.
    n_bytes = {s: sum(len(c.encode()) for d, cs in planted.items() if d.startswith(s) for c in cs)
               for s in ("alpha", "beta")}
    n_units = {s: sum(len(cs) for d, cs in planted.items() if d.startswith(s)) for s in ("alpha", "beta")}
    assert n_units == {"alpha": 17 + (3 if mode == "near" else 0), "beta": 4 + 3}
    pd = m["paragraph_dedup"]
    assert (pd["units_removed"], pd["bytes_removed"]) == (sum(n_units.values()), sum(n_bytes.values()))
    for s in ("alpha", "beta"):
        assert (pd["by_source"][s]["units_removed"], pd["by_source"][s]["bytes_removed"]) == (n_units[s], n_bytes[s])
    assert pd["by_source"]["beta"]["documents_dropped"] == {"all_removed": 1, "too_short_after_removal": 1}
    assert pd["by_reason"].get("near_repeated_paragraph", {}).get("units", 0) == (3 if mode == "near" else 0)
    # The texts training reads and the held-out split are the documents without those copies, spacing kept.
    texts = _output_texts(out)
    for rows_ in docs.values():
        for doc_id, paras in rows_:
            if rows[doc_id]["verdict"] in ("kept", "heldout"):
                kept = [p for p in paras if p not in planted[doc_id]]
                assert texts[doc_id] == _rejoin(paras, kept), doc_id
                assert rows[doc_id]["n_chars"] == len(texts[doc_id])
    assert TWICE in texts["alpha/10"] and TWICE in texts["alpha/11"]
    assert all(texts[d].startswith(HEADING) for d in texts if d.startswith("alpha/"))
    assert (BOILER_NEAR in texts["alpha/07"]) == (mode == "exact")


def _rejoin(paras: list[str], kept: list[str]) -> str:
    """`_text` of the kept paragraphs, each keeping the separator it had before it (the last one "\\n \\n\\n")."""
    out = ""
    for i, p in enumerate(paras):
        if p not in kept:
            continue
        if out:
            out += "\n \n\n" if i == len(paras) - 1 else "\n\n"
        out += p
    return out


def _output_texts(out: str) -> dict[str, str]:
    """Document id -> text, from the training shards and the held-out files."""
    import tensorflow_datasets as tfds

    from data_pipelines import writer

    texts = {}
    for domain in ("web", "reference"):
        ds = tfds.data_source("paragraphs", split=domain, data_dir=os.path.join(out, "tfds"))
        texts.update({ds[i]["id"].decode(): ds[i]["text"].decode() for i in range(len(ds))})
    for f in os.listdir(os.path.join(out, "heldout")):
        texts.update({r["id"]: r["text"] for r in writer.read_jsonl_gz(os.path.join(out, "heldout", f))})
    return texts


@pytest.mark.slow  # the module's four Beam builds: ~60 s on a loaded 2-core host
def test_same_input_same_output(built):
    a, b = (open(os.path.join(built["out"][n], "manifest.json"), "rb").read() for n in ("near", "near2"))
    assert a == b


# ---------------------------------------------------------------- the per-document logic, without Beam


def test_split_and_remove_keep_the_text_and_its_spacing():
    text = "\n\nHead line\n  \n\tBody one\nstill body\n\n\nTail\n"
    parts = paragraph_dedup.split_units(text, "paragraph")
    assert parts[::2] == ["", "Head line", "\tBody one\nstill body", "Tail\n"]
    assert paragraph_dedup.remove_units(parts, set()) == text
    assert paragraph_dedup.remove_units(parts, {4}) == "\n\nHead line\n\n\nTail\n"  # the separator before it goes
    assert paragraph_dedup.remove_units(parts, {2}) == "\n  \n\tBody one\nstill body\n\n\nTail\n"
    lines = paragraph_dedup.split_units("a b\nc d\n", "line")
    assert lines[::2] == ["a b", "c d", ""] and paragraph_dedup.remove_units(lines, {0}) == "c d\n"
    with pytest.raises(ValueError, match="unit"):
        paragraph_dedup.split_units(text, "sentence")


def test_units_are_matched_by_whitespace_collapsed_case_folded_text():
    flags = {exact_dedup.exact_key("Copyright the Authors, all rights reserved."): (paragraph_dedup.EXACT, "k")}
    text = "Intro words here.\n\nCOPYRIGHT  the authors,\nall rights RESERVED.\n\nOutro."
    out, log = paragraph_dedup.dedup_document(text, "paragraph", 5, flags)
    assert out == "Intro words here.\n\nOutro."
    removed = "COPYRIGHT  the authors,\nall rights RESERVED."
    assert log == [{"hash": exact_dedup.exact_key("copyright the authors, all rights reserved.")[:16],
                    "reason": "repeated_paragraph", "bytes": 44, "text": removed}]
    near = {k: (paragraph_dedup.NEAR, "c" * 64) for k in flags}
    assert paragraph_dedup.dedup_document(text, "paragraph", 5, near)[1][0]["cluster"] == "c" * 16
    # Punctuation is significant to exact matching; a unit under min_words is never looked up.
    assert paragraph_dedup.dedup_document(text.replace("RESERVED.", "RESERVED!"), "paragraph", 5, flags)[1] == []
    assert paragraph_dedup.dedup_document(text, "paragraph", 7, flags)[1] == []


def test_document_left_empty_or_under_its_rules_minimum_is_named():
    rules = RuleConfig(min_words=5, min_chars=20)
    assert paragraph_dedup.left_reason(" \n -- \n", rules) == "all_removed"
    assert paragraph_dedup.left_reason("Three words left.", rules) == "too_short_after_removal"
    lenient = RuleConfig(min_words=5, min_chars=1, skip=("too_few_words",))
    assert paragraph_dedup.left_reason("Three words left.", lenient) is None
    assert paragraph_dedup.left_reason("Five words are left here.", rules) is None
    assert paragraph_dedup.left_reason("Three words left.", None) is None  # rules stage off: only an empty one goes


def _sig(seed_values):
    return np.asarray(seed_values, dtype=np.uint32)


def test_star_cluster_counts_distinct_documents_of_members_near_the_centre():
    """A: 6 documents, B: 4 (one shared with A), C: 3, at estimated Jaccard 1.0, 0.75 and 0.5 from A."""
    a, b, c = _sig([1, 2, 3, 4]), _sig([1, 2, 3, 9]), _sig([1, 2, 8, 9])
    members = [("kb", b, ("d1", "d6", "d7", "d8")), ("ka", a, ("d1", "d2", "d3", "d4", "d5", "d6")),
               ("kc", c, ("d9", "d10", "d11"))]
    # A and B span d1-d8: 8 documents > 7, so both go, with A (most documents) the centre; C is too far from A.
    assert paragraph_dedup.star_cluster(members, 0.7, 7) == [("ka", "ka"), ("kb", "ka")]
    assert paragraph_dedup.star_cluster(members, 0.7, 8) == []  # 8 documents is not more than 8
    # B is within 0.7 of C's neighbour B, but members are compared with the centre only: no chain from A to C.
    assert [k for k, _ in paragraph_dedup.star_cluster(members, 0.5, 7)] == ["ka", "kb", "kc"]


def test_unit_documents_combiner_is_exact_about_the_threshold_at_bounded_memory():
    comb = paragraph_dedup.UnitDocuments(3)
    accs = []
    for ids in (["d5", "d1"], ["d1", "d4"], ["d9", "d2", "d3"]):
        acc = comb.create_accumulator()
        for i in ids:
            acc = comb.add_input(acc, (i, f"text of {i}"))
        accs.append(acc)
    assert accs[2] == (("d2", "d3", "d9"), "text of d2")
    assert comb.merge_accumulators(accs) == (("d1", "d2", "d3"), "text of d1")


def test_code_is_not_counted_by_default_and_a_repeat_inside_a_document_counts_once():
    text = "One two three four five.\n\none TWO three four five.\n\nSix seven eight nine ten."
    doc = {"id": "x", "domain": "web", "source": "s", "text": text}
    keys = [k for k, _ in paragraph_dedup._unit_occurrences(doc, ParagraphDedupConfig())]
    assert len(keys) == 2 == len(set(keys))
    assert list(paragraph_dedup._unit_occurrences(dict(doc, domain="code"), ParagraphDedupConfig())) == []


@pytest.mark.parametrize("field,value", [("unit", "sentence"), ("match", "fuzzy"), ("max_documents", 0),
                                         ("bands", 40), ("threshold", 0.0)])
def test_bad_paragraph_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=f"ParagraphDedupConfig.*{'bands' if field == 'bands' else field}"):
        ParagraphDedupConfig(enabled=True, **{field: value}).validate()


@pytest.mark.parametrize("shingle,threshold", [(3, 0.7), (5, 0.75), (2, 0.5), (4, 0.9)])
def test_near_min_words_is_the_shortest_unit_an_edit_keeps_above_the_threshold(shingle, threshold):
    """Counted on exact shingle sets: the shortest unit whose copy with one word substituted in its middle still has
    Jaccard >= threshold with it is `near_min_words` long (and every longer one is too)."""
    def jaccard_after_one_edit(n):
        ws = [f"w{i}" for i in range(n)]
        edited = ws[: n // 2] + ["other"] + ws[n // 2 + 1:]
        a, b = (minhash.word_shingles(" ".join(w), shingle) for w in (ws, edited))
        return len(a & b) / len(a | b)
    ok = [n for n in range(2 * shingle + 1, 200) if jaccard_after_one_edit(n) >= threshold - 1e-12]
    assert ok and ok == list(range(ok[0], 200))
    assert paragraph_dedup.near_min_words(shingle, threshold) == ok[0]
    assert paragraph_dedup.near_min_words(3, 1.0) > 10**9


def test_a_template_of_short_units_is_not_near_matched_a_long_edited_paragraph_is():
    """raw-v1's fortunes-de name jokes: 9-word cookies of one template that differ in their last two words were
    joined by near matching. Units under `near_min_words` get no signature (exact matching only); BOILER (27 words)
    and its one-word edit get one and share an LSH bucket."""
    cfg = ParagraphDedupConfig(enabled=True)
    sigs = paragraph_dedup.UnitSignature(cfg)
    sigs.setup()
    jokes = ["Wie man sein Kind nicht nennen sollte: Dick Opf", "Wie man sein Kind nicht nennen sollte: Dick Tat"]
    assert [len(minhash.words(j)) for j in jokes] == [9, 9] and paragraph_dedup.near_min_words(3, 0.7) == 19
    assert [list(sigs.process((exact_dedup.exact_key(j), (("d1",), j)))) for j in jokes] == [[], []]
    (_, (a, _)), = sigs.process(("b", (("d1",), BOILER)))
    (_, (b, _)), = sigs.process(("bn", (("d2",), BOILER_NEAR)))
    assert set(minhash.band_keys(a, cfg.bands, cfg.rows)) & set(minhash.band_keys(b, cfg.bands, cfg.rows))
    assert minhash.estimated_jaccard(a, b) >= cfg.threshold
