"""Corpus-build decisions on small cases of issue 17: damaged inputs, rule blind spots, language ID, quotas,
decontamination of short eval examples, the stratified labelling sample. Beam-free except where noted."""

import collections
import dataclasses
import gzip
import json

import pytest

from data_pipelines.steps import decontamination, langid, quotas, rules as rule_step
from data_pipelines import draws, label_sample, readers, review
from data_pipelines.config import AdmissionConfig, BuildConfig, ConfigError, LangIdConfig, QuotaConfig, RuleConfig
from data_pipelines.config import DecontamConfig, Source
from jaxpt.data.documents import DocumentFormatError



def _src(name="t", fmt="jsonl", domain="web", languages=None):
    return Source(name=name, domain=domain, path="x", format=fmt, license="x", acquired="2026-01-01",
                  languages=languages)


# ---------------------------------------------------------------- item 4: damaged inputs


def test_issue_smallest_truncated_gzip_is_one_named_drop(tmp_path):
    # printf '{"id":"a","text":"one two three four five six"}\n' | gzip -c | head -c 40
    path = str(tmp_path / "t-00000.jsonl.gz")
    data = gzip.compress(b'{"id":"a","text":"one two three four five six"}\n', mtime=0)
    open(path, "wb").write(data[:40])
    out = list(readers.read_jsonl(path, _src(), AdmissionConfig()))
    assert len(out) == 1 and out[0]["verdict"] == "admission:truncated_file"
    assert out[0]["file"] == path and out[0]["lines_read"] == 0
    with pytest.raises(DocumentFormatError, match="t-00000.jsonl.gz: truncated_file"):
        list(readers.read_jsonl(path, _src(), AdmissionConfig(fail_on_damaged_file=True)))


def _warc_records(n, gz=True):
    """A WARC (gzip: one member per record, as warcio writes them) of `n` response records."""
    import io

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    w = WARCWriter(buf, gzip=gz)
    for i in range(n):
        body = f"<html><body><p>Page {i} has a paragraph of plain words.</p></body></html>".encode()
        http = StatusAndHeaders("200 OK", [("Content-Type", "text/html")], protocol="HTTP/1.1")
        w.write_record(w.create_warc_record(f"http://x/{i}", "response", payload=io.BytesIO(body),
                                            http_headers=http))
    return buf.getvalue()


def test_warc_cut_short_keeps_complete_records_and_counts_the_damage(tmp_path):
    data = _warc_records(5)
    whole, cut = str(tmp_path / "whole.warc.gz"), str(tmp_path / "cut.warc.gz")
    open(whole, "wb").write(data)
    open(cut, "wb").write(data[: len(data) - 60])  # inside the last record's gzip member
    good = list(readers.read_warc(whole, _src(fmt="warc"), AdmissionConfig()))
    assert [d["id"] for d in good] == [f"t/http://x/{i}" for i in range(5)]
    got = list(readers.read_warc(cut, _src(fmt="warc"), AdmissionConfig()))
    # warcio alone reads the cut member as a shorter fifth record without an error; here it is the drop.
    assert [d["id"] for d in got[:-1]] == [f"t/http://x/{i}" for i in range(4)]
    assert [d["text"] for d in got[:-1]] == [d["text"] for d in good[:4]]
    assert got[-1]["verdict"] == "admission:truncated_file" and got[-1]["file"] == cut
    assert got[-1]["lines_read"] == 4
    with pytest.raises(DocumentFormatError, match="cut.warc.gz: truncated_file after line 4"):
        list(readers.read_warc(cut, _src(fmt="warc"), AdmissionConfig(fail_on_damaged_file=True)))


def test_plain_warc_record_cut_short_is_the_damage_not_a_shorter_page(tmp_path):
    data = _warc_records(3, gz=False)
    cut = str(tmp_path / "cut.warc")
    open(cut, "wb").write(data[:-30])
    got = list(readers.read_warc(cut, _src(fmt="warc"), AdmissionConfig()))
    assert [d["id"] for d in got[:-1]] == ["t/http://x/0", "t/http://x/1"]
    assert got[-1]["verdict"] == "admission:truncated_file" and got[-1]["lines_read"] == 2
    assert "record 3 cut short" in got[-1]["sample"]


def test_parquet_unreadable_is_one_named_drop(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["one two three four five", "six seven eight nine ten"]}),
                   path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # the footer is gone
    got = list(readers.read_parquet(path, _src(fmt="parquet"), AdmissionConfig()))
    assert len(got) == 1 and got[0]["verdict"] == "admission:truncated_file" and got[0]["file"] == path


# ---------------------------------------------------------------- item 5: rule blind spots

# A short reference entry whose senses each end with the same citation tag on its own line.
CITATION_ENTRY = """Abide \\A*bide"\\, v. i.
   1. To wait; to pause; to delay.
      [Source 1913]
   2. To stay; to continue in a place.
      [Source 1913]
   3. To have one's abode; to dwell.
      [Source 1913]
"""
RULES_V1 = dict(dup_line_min_words=1, repetition_min_words=0)  # the old rules: every line, every length


def test_citation_tag_entry_is_kept_and_was_dropped_by_rules_v1():
    cfg = RuleConfig(min_words=5, max_punct_ratio=0.45)  # raw_v1.gin's reference settings
    assert rule_step.rule_reason(CITATION_ENTRY, RuleConfig(**RULES_V1, min_words=5, max_punct_ratio=0.45)) \
        == "repeated_lines"  # 3 of 7 lines are one tag: 0.43 > 0.3
    assert rule_step.rule_reason(CITATION_ENTRY, cfg) is None
    # Repetition of real lines is still caught: the same sentence three times.
    spam = "\n".join(["Buy cheap watches at our store today"] * 3 + ["one line", "other line"])
    assert rule_step.rule_reason(spam, cfg) == "repeated_lines"


def test_short_documents_skip_ngram_repetition_rules_long_ones_do_not():
    # A 12-word fortune whose punch line repeats a pair of words: the top 2-gram is 0.24 of its letters.
    short = "Time flies like an arrow; fruit flies like a banana. Time flies."
    st = rule_step.rule_stats(short)
    assert st["top_2gram_fraction"] > 0.2
    assert rule_step.rule_reason(short, RuleConfig(**RULES_V1)) == "top_2gram"
    assert rule_step.rule_reason(short, RuleConfig()) is None
    # Past repetition_min_words the same rules still apply.
    long = " ".join(["click here now"] * 30)
    assert rule_step.rule_reason(long, RuleConfig()) in ("top_2gram", "top_3gram", "repeated_5grams")


def test_one_ellipsis_in_a_short_fortune_is_not_a_symbol_flood():
    fortune = "Символ США - Свобода... в железе.\n\t\t-- Евгений Кащеев\n"  # 1 ellipsis / 9 words
    assert rule_step.rule_reason(fortune, RuleConfig(**RULES_V1)) == "symbol_ratio"
    assert rule_step.rule_reason(fortune, RuleConfig()) is None
    flood = "#a #b #c #d #e #f #g word word word"  # 7 '#' over max(10, 50) words = 0.14
    assert rule_step.rule_reason(flood, RuleConfig()) == "symbol_ratio"


def test_rules_v4_keep_the_labelled_wrongful_drops_of_a_rules_v3_build():
    """The two rules-v4 changes, each on a document a rules-v3 build of raw-v1 dropped and both annotators labelled
    wrongful (data/labels/raw-v1-rules-v3), under raw_v1.gin's own rules; what those rules rightly dropped still
    goes."""
    import gin

    from data_pipelines import build

    try:
        cfg = build.load_config(["configs/data/raw_v1.gin"], ["OutputConfig.tokenizer_path = 'unused.model'"])
    finally:
        gin.clear_config()  # RuleConfig() elsewhere must not take raw_v1.gin's bindings
    fortune = cfg.rules.for_domain("multilingual", "fortunes-de")
    compound = "Hallo Weißbierüberschäumlasserinnen!\n"  # mean word length 17 > 12
    nospace = "Seraqueochefevaidescobrirqueeuderrubeicafénoteclado?\n"
    assert rule_step.rule_stats(nospace)["mean_word_length"] > 30
    v3 = dataclasses.replace(fortune, skip=tuple(r for r in fortune.skip if r != "long_words"))
    assert [rule_step.rule_reason(t, v3) for t in (compound, nospace)] == ["long_words", "long_words"]
    assert [rule_step.rule_reason(t, fortune) for t in (compound, nospace)] == [None, None]
    dragon = ("\t\t    ___====-_  _-====___\n\t      _--~~~#####//      \\\\#####~~~--_\n"
              "\t   _-~##########// (    ) \\\\##########~-_\n")
    assert rule_step.rule_reason(dragon, cfg.rules.for_domain("multilingual", "fortunes")) == "few_alpha_words"
    # A Japanese man page's example script (as manpages-ja initscript(5)): 8 '#' comment marks over 53
    # space-separated "words" read as 0.15 symbols per word in rules-v3 (> 0.1); counted per character, as the
    # word count is, it is 8 over some 300.
    comment = "                # 全てのプロセスに対するファイルディスクプリタの上限を設定する。\n"
    page = ("名前\n       initscript - inittabファイル中のコマンドを実行するスクリプト\n"
            + comment * 8 + "                ulimit -Hn 8192\n" * 10 + "                eval exec \"$4\"\n")
    st = rule_step.rule_stats(page)
    assert st["symbol_count"] == 8 and 50 <= st["n_ws_words"] < 80 and st["n_words"] > 200
    assert st["symbol_ratio"] == pytest.approx(8 / st["n_words"])
    man = cfg.rules.for_domain("multilingual", "manpages-ja")
    assert st["symbol_count"] / max(st["n_ws_words"], man.repetition_min_words) > man.max_symbol_ratio  # rules-v3
    assert rule_step.rule_reason(page, man) is None
    # Space-separated text keeps Gopher's per-word ratio.
    assert rule_step.rule_stats("#a #b #c #d #e #f #g word word word")["symbol_ratio"] == pytest.approx(0.7)


def test_code_closing_braces_are_not_duplicate_lines():
    code = "int f(int x) {\n  if (x) {\n    return 1;\n  }\n  return 0;\n}\nint g(void) {\n  return 2;\n}\n"
    st_old = rule_step.rule_stats(code, 1)
    st_new = rule_step.rule_stats(code, 4)
    assert st_old["dup_line_fraction"] == pytest.approx(3 / 9)  # '}' x3 of 9 non-empty lines
    assert st_new["dup_line_fraction"] == 0.0


def test_per_source_overrides_scope_a_threshold_to_one_source():
    rules = RuleConfig(per_domain={"m": {"max_dup_5gram_fraction": 0.16}},
                       per_source={"man": {"max_dup_5gram_fraction": 0.3, "min_alpha_word_fraction": 0.4}})
    assert rules.for_domain("m", "man").max_dup_5gram_fraction == 0.3
    assert rules.for_domain("m", "man").min_alpha_word_fraction == 0.4
    assert rules.for_domain("m", "fortunes").max_dup_5gram_fraction == 0.16
    assert rules.for_domain("x", "man").max_symbol_ratio == RuleConfig().max_symbol_ratio
    # A man page's options share one wording ("A logical value, if true"): about a fifth of its letters.
    page = "\n".join(f"-{c} " + " ".join(f"word{c}{k}" for k in range(14)) + ". A logical value, if true."
                      for c in "abcdef")
    assert 0.16 < rule_step.rule_stats(page)["dup_5gram_fraction"] <= 0.3
    assert rule_step.rule_reason(page, rules.for_domain("m", "fortunes")) == "repeated_5grams"
    assert rule_step.rule_reason(page, rules.for_domain("m", "man")) is None
    with pytest.raises(ConfigError, match=r"RuleConfig.per_source\['man'\]: unknown thresholds \['nope'\]"):
        RuleConfig(per_source={"man": {"nope": 1}}).for_domain("m", "man")


def test_skip_scopes_a_rule_to_the_domains_it_was_calibrated_on():
    # Two senses that share their closing gloss word for word: 2 of 4 lines are one 5-word line (0.5 > 0.3).
    entry = "Abide, v.\nTo wait for; to await.\nsee the entry for wait\nsee the entry for wait\n"
    assert rule_step.rule_stats(entry, 4)["dup_line_fraction"] == 0.5
    rules = RuleConfig(min_words=1, per_domain={"reference": {"skip": ["repeated_lines", "repeated_line_chars"]}},
                       per_source={"webcrawl": {"skip": []}})
    assert rule_step.rule_reason(entry, rules.for_domain("web", "pages")) == "repeated_lines"
    assert rule_step.rule_reason(entry, rules.for_domain("reference", "dict")) is None
    assert rule_step.rule_reason(entry, rules.for_domain("reference", "webcrawl")) == "repeated_lines"  # source wins
    # A skipped rule passes; the rules after it still apply.
    assert rule_step.rule_reason(entry.upper() + "# # # # # # #", rules.for_domain("reference", "dict")) \
        == "symbol_ratio"  # 7 '#' over max(13, 50) words = 0.14 > 0.1
    with pytest.raises(ConfigError, match=r"RuleConfig.skip .*unknown rules \['repeated_line'\]"):
        RuleConfig(skip=("repeated_line",)).for_domain("web", "pages")


def test_bare_cross_reference_entries_are_dropped_by_name_short_definitions_kept():
    gcide = "Unassayed \\Unassayed\\\n   See {assayed}.\n"
    jargon = "unswizzle\n v.\n\n    See {swizzle}.\n\n"
    devil = "RESTITUTOR, n.  Benefactor; philanthropist.\n\n"  # 4 words, a definition of its own
    foldoc = "NAK\n\n   {Negative Acknowledgement}\n\n"  # an expansion, not a pointer
    longer = "Abide\n\n   To wait. See {wait}.\n"
    on = RuleConfig(min_words=1, min_chars=1, drop_cross_references=True)
    assert [rule_step.rule_reason(t, on) for t in (gcide, jargon, devil, foldoc, longer)] \
        == ["cross_reference_only", "cross_reference_only", None, None, None]
    assert rule_step.rule_reason(gcide, RuleConfig(min_words=1, min_chars=1)) is None  # off by default
    # Scoped per domain: a fortune that happens to read "See {...}" is not a dictionary pointer.
    rules = RuleConfig(min_words=1, min_chars=1, per_domain={"reference": {"drop_cross_references": True}})
    assert rule_step.rule_reason(gcide, rules.for_domain("reference", "dict-gcide")) == "cross_reference_only"
    assert rule_step.rule_reason(gcide, rules.for_domain("multilingual", "fortunes")) is None


class _AlwaysGerman:
    """A detector that labels every text German (the failure on English dictionary entries), counting calls."""

    def __init__(self):
        self.texts = []

    def detect(self, texts, declared=None):
        self.texts += texts
        return [("de", 0.9, "detector") for _ in texts]


def test_declared_sources_take_their_declared_language_without_detection():
    from data_pipelines.steps import langid

    src = {n: Source(name=n, domain="reference", path="x", format="jsonl", license="x", acquired="2026-11-30",
                    languages=("en",)) for n in ("dict", "wiki")}
    clean = langid.IdentifyLanguage(LangIdConfig(declared_sources=("dict",)), src)
    clean.lid = _AlwaysGerman()
    text = "Spongoblast, n. (Zool.) One of the cells which, in sponges, secrete the spongin fibres."
    out = list(clean.process([{"id": f"{n}#1", "source": n, "domain": "reference", "text": text} for n in src]))
    kept = [d for d in out if not hasattr(d, "tag")]
    drops = [d.value for d in out if hasattr(d, "tag")]
    assert [(d["id"], d["lang"], d["lang_by"]) for d in kept] == [("dict#1", "en", "declared")]
    assert [(d["id"], d["verdict"]) for d in drops] == [("wiki#1", "langid:language_not_allowed")]
    assert clean.lid.texts == [text]  # run once, on the source not declared
    bad = BuildConfig(sources=[dict(name="dict", domain="reference", path="x", format="jsonl", license="x",
                                     acquired="2026-11-30")], langid=LangIdConfig(declared_sources=("dictt",)))
    with pytest.raises(ConfigError, match="LangIdConfig.declared_sources: 'dictt' is not a registered source"):
        bad.registry()


# ---------------------------------------------------------------- item 6: language ID


@pytest.fixture(scope="module")
def lid():
    return langid.LanguageIdentifier(LangIdConfig())


@pytest.mark.slow  # lingua loads 11 language models: ~25 s on a loaded 2-core host, once per process
def test_one_line_english_entry_takes_the_declared_language(lid):
    line = "Gesundheit, interj. Used to wish health."
    old = langid.LanguageIdentifier(LangIdConfig(min_chars=0, min_confidence=0.0, windows=1, max_chars=600))
    assert old.detect([line])[0][0] == "de"  # the issue's fault: a short English entry labelled German
    assert lid.detect([line], ["en"])[0][0::2] == ("en", "declared")


@pytest.mark.slow  # lingua loads 11 language models: ~25 s on a loaded 2-core host, once per process
def test_translated_man_page_with_english_header_is_labelled_by_its_body(lid):
    header = ("NAME\n       ls - list directory contents\n\nSYNOPSIS\n       ls [OPTION]... [FILE]...\n\n"
              "COPYRIGHT\n       Copyright 2020 Free Software Foundation, Inc. License GPLv3+: GNU GPL version 3 "
              "or later. This is free software: you are free to change and redistribute it. There is NO "
              "WARRANTY, to the extent permitted by law.\n") * 3
    body = ("BESCHREIBUNG\n       Auflisten von Informationen über die Dateien (standardmäßig das aktuelle "
            "Verzeichnis). Die Einträge werden alphabetisch sortiert, wenn keine Option angegeben ist.\n") * 12
    doc = header + body
    assert len(header) > 600
    old = langid.LanguageIdentifier(LangIdConfig(max_chars=600, windows=1, min_chars=0, min_confidence=0.0))
    assert old.detect([doc])[0][0] == "en"
    assert lid.detect([doc], ["en"])[0][0::2] == ("de", "detected")


@pytest.mark.slow  # lingua loads 11 language models: ~25 s on a loaded 2-core host, once per process
def test_long_text_in_another_language_is_still_detected(lid):
    de = "Der Hund läuft jeden Morgen schnell über die große Wiese und bellt laut, weil er sich freut."
    assert lid.detect([de], ["en"])[0][0::2] == ("de", "detected")
    assert lid.detect([""], [None])[0][0] == "und"


def test_spread_sample_covers_head_middle_and_tail():
    text = "a" * 1000 + "b" * 1000 + "c" * 1000
    s = langid.spread_sample(text, 300, 3)
    assert s == "a" * 100 + "\n" + "b" * 100 + "\n" + "c" * 100
    assert langid.spread_sample("short", 300, 3) == "short"


# ---------------------------------------------------------------- item 7: quotas


def _select(docs, fractions, seed):
    """Kept ids per group by the stage's rule: rank by seeded hash, cutoff from `quota_cutoff`."""
    groups = collections.defaultdict(list)
    for doc_id, g, n in docs:
        groups[g].append((draws.uniform(seed, doc_id), doc_id, n))
    kept = set()
    for g, items in groups.items():
        u_star = quotas.quota_cutoff(items, fractions[g])
        kept |= {i for u, i, _ in items if u < u_star}
    return kept


def test_issue_90_6_4_quota_meets_shares_and_is_monotone():
    # Domain a: languages at 90% / 6% / 4% of its documents (equal length); domain b makes a keep 10%.
    docs = [(f"{lang}{i}", f"a/{lang}", 100) for lang, n in (("en", 900), ("de", 60), ("cs", 40)) for i in range(n)]
    docs += [(f"b{i}", "b/en", 100) for i in range(100)]
    chars = collections.Counter()
    for _, g, n in docs:
        chars[tuple(g.split("/"))] += n
    cfg = QuotaConfig(targets={"a": 0.5, "b": 0.5}, long_tail_share=0.05, long_tail_floor=1.0, seed=3)
    f = quotas.quota_keep_fractions(dict(chars), cfg)
    # By hand: T = min(100000/0.5, 10000/0.5) = 20000, B_a = 10000 chars; floor F = 0.05 * 10000 = 500 chars.
    # cs (4000) and de (6000) keep max(p c, 500), en keeps 90000 p: solve 90000p + 600p + 500 = 10000 if 4000p < 500.
    p = 9500 / 96000
    assert f["a/en"] == pytest.approx(p) and f["a/de"] == pytest.approx(p)
    assert f["a/cs"] == pytest.approx(500 / 4000) and f["b/en"] == 1.0
    kept = _select(docs, f, cfg.seed)
    by_group = collections.Counter(g for doc_id, g, _ in docs if doc_id in kept)
    n_kept = {g: by_group[g] for g in ("a/en", "a/de", "a/cs")}
    assert n_kept["a/en"] >= n_kept["a/de"] >= n_kept["a/cs"] > 0  # monotone, nobody wiped out
    assert n_kept == {"a/en": round(90000 * p / 100), "a/de": round(6000 * p / 100), "a/cs": 5}
    share_a = sum(n_kept.values()) / (sum(n_kept.values()) + by_group["b/en"])
    assert abs(share_a - 0.5) <= 0.02
    assert quotas.quota_share_warnings({"a": sum(n_kept.values()), "b": by_group["b/en"]}, cfg.targets, 0.02) == []


def test_floors_never_give_a_smaller_group_more_text():
    cfg = QuotaConfig(targets={"a": 0.3, "b": 0.7}, long_tail_share=0.05, long_tail_floor=1.0)
    sizes = [5000, 900, 700, 400, 300, 120, 60, 10]
    chars = {("a", f"l{i}"): c for i, c in enumerate(sizes)}
    chars[("b", "en")] = 3000
    f = quotas.quota_keep_fractions(chars, cfg)
    kept = [f[f"a/l{i}"] * c for i, c in enumerate(sizes)]
    assert all(x >= y - 1e-6 for x, y in zip(kept, kept[1:]))
    budget = 0.3 * (3000 / 0.7)
    assert sum(kept) == pytest.approx(budget, rel=1e-6)


def test_quota_cutoff_keeps_the_hash_ranked_prefix_to_the_nearest_document():
    items = [(0.9, "c", 10), (0.1, "a", 10), (0.5, "b", 30), (0.7, "d", 10)]
    assert quotas.quota_cutoff(items, 0.0) == 0.1
    assert quotas.quota_cutoff(items, 1.0) == 2.0
    # Budget 0.4 * 60 = 24: 'a' (0 + 5 <= 24) kept, 'b' (10 + 15 = 25 > 24) is the cutoff.
    assert quotas.quota_cutoff(items, 0.4) == 0.5
    assert quotas.quota_cutoff(items, 0.5) == 0.7  # budget 30: b (25 <= 30) kept, d (40 + 5 > 30) not


def test_share_warning_names_domain_and_tolerance():
    w = quotas.quota_share_warnings({"a": 70, "b": 30}, {"a": 0.5, "b": 0.5}, 0.02)
    assert len(w) == 2 and "domain 'a' realized share 0.7000" in w[0] and "share_tolerance = 0.02" in w[0]
    assert quotas.quota_share_warnings({"a": 51, "b": 49}, {"a": 0.5, "b": 0.5}, 0.02) == []


@pytest.mark.parametrize("field,value", [("targets", {"a": -0.1}), ("targets", {"a": float("nan")}),
                                         ("long_tail_floor", 1.5), ("share_tolerance", -1.0)])
def test_bad_quota_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=f"QuotaConfig.{field}"):
        QuotaConfig(**{field: value}).validate()


# ---------------------------------------------------------------- item 8: decontamination


# Eval set 'qa' (file qa.jsonl, default DecontamConfig: ngram 13, min_ngram 3): one example per length class.
QA_EXAMPLES = [
    {"text": "Ouagadougou"},  # qa.jsonl:1, 1 word: short
    {"text": "Burkina Faso"},  # qa.jsonl:2, 2 words: short
    {"text": "Which river flows through the city of Ouagadougou in the dry season?"},  # qa.jsonl:3, 12 = n - 1
    {"text": "The quick brown fox jumps over the lazy dog while the farmer sleeps under trees."},  # qa.jsonl:4, 15
    {"id": "qa-empty", "text": " ?! -- "},  # no word: empty
]
# Training documents -> the example indices that must remove them (empty: it survives).
QA_DOCS = {
    "one_word_in_sentence": ("We flew to Ouagadougou last year and liked it.", []),
    "one_word_as_line": ("Capitals quiz\nOuagadougou\nNext question follows.", [0]),
    "one_word_as_document": ("  OUAGADOUGOU! ", [0]),
    "two_words_in_sentence": ("Burkina Faso is a landlocked country.", []),
    "two_words_as_paragraph": ("Intro paragraph here.\n\nBurkina\nFaso\n\nOutro text.", [1]),
    "two_words_plus_more_on_line": ("Burkina Faso, West Africa\nMore text.", []),
    "twelve_words_inside": ("Quiz: which river flows through the city of Ouagadougou in the dry season? No one.", [2]),
    "eleven_of_twelve": ("which river flows through the city of Ouagadougou in the wet season", []),
    "thirteen_gram_inside": ("Story: the quick brown fox jumps over the lazy dog while the farmer sleeps. End.", [3]),
    "twelve_of_the_long": ("the quick brown fox jumps over the lazy dog while the farmer rests.", []),
    "punctuation_only": ("?! --", []),
}


def _qa_index(tmp_path, **over):
    from data_pipelines import build

    ev = tmp_path / "qa.jsonl"
    ev.write_text("".join(json.dumps(e) + "\n" for e in QA_EXAMPLES))
    cfg = BuildConfig(sources=[], decontam=DecontamConfig(eval_sets={"qa": str(ev)}, **over))
    cfg.decontam.validate()
    return build.load_eval_index(cfg)


def _decontaminate(index, docs: dict[str, str]):
    """(kept ids, {dropped id: decision row}) of `decontamination.Decontaminate` over `docs` (id -> text)."""
    from data_pipelines.steps import decontamination

    dc, kept, dropped = decontamination.Decontaminate(index), [], {}
    for doc_id, text in docs.items():
        for out in dc.process({"id": doc_id, "source": "s", "domain": "web", "lang": "en", "text": text}):
            if isinstance(out, dict):
                kept.append(out["id"])
            else:
                dropped[out.value["id"]] = out.value
    return kept, dropped


def test_eval_examples_of_every_length_remove_exactly_their_documents(tmp_path):
    """1- and 2-word examples remove only documents where they are a whole line, paragraph or document; the
    12-word (n - 1) example removes a document holding its word sequence, the 15-word one a document sharing a
    13-gram; 11 of 12 words, 12 of 13 or a word inside a sentence remove nothing; the empty example matches nothing."""
    index = _qa_index(tmp_path)
    assert [e["length_class"] for e in index.examples["qa"]] == ["short", "short", "medium", "long", "empty"]
    assert [e["id"] for e in index.examples["qa"]] == ["qa.jsonl:1", "qa.jsonl:2", "qa.jsonl:3", "qa.jsonl:4",
                                                       "qa-empty"]
    kept, dropped = _decontaminate(index, {k: v[0] for k, v in QA_DOCS.items()})
    assert sorted(kept) == sorted(k for k, v in QA_DOCS.items() if not v[1])
    rule = {0: "whole_unit", 1: "whole_unit", 2: "word_sequence", 3: "ngram"}
    for doc_id, (_, want) in QA_DOCS.items():
        if want:
            row = dropped[doc_id]
            assert row["eval_matches"] == [["qa", i, rule[i]] for i in want], doc_id
            assert row["verdict"] == ("decontamination:eval_unit_match" if want[0] < 2
                                      else "decontamination:eval_ngram_overlap"), doc_id
            assert row["detail"] == "qa"
    # Counts add up: in = kept + each drop reason.
    reasons = collections.Counter(r["reason"] for r in dropped.values())
    assert reasons == {"eval_unit_match": 3, "eval_ngram_overlap": 2}
    assert len(QA_DOCS) == len(kept) + sum(reasons.values())


def test_short_examples_match_only_the_configured_units(tmp_path):
    docs = {k: QA_DOCS[k][0] for k in ("one_word_as_line", "one_word_as_document", "two_words_as_paragraph")}
    _, dropped = _decontaminate(_qa_index(tmp_path, short_units=("document",)), docs)
    assert sorted(dropped) == ["one_word_as_document"]
    _, dropped = _decontaminate(_qa_index(tmp_path, short_units=("paragraph",)), docs)
    assert sorted(dropped) == ["one_word_as_document", "two_words_as_paragraph"]  # a one-line doc is a paragraph
    _, dropped = _decontaminate(_qa_index(tmp_path, short_units=("line",)), docs)
    assert sorted(dropped) == ["one_word_as_document", "one_word_as_line"]
    # min_ngram = 1 matches a one-word example anywhere: a sentence that merely names the city goes too, which is
    # why short examples are matched as whole units by default.
    docs["one_word_in_sentence"] = QA_DOCS["one_word_in_sentence"][0]
    _, dropped = _decontaminate(_qa_index(tmp_path, min_ngram=1), docs)
    assert sorted(dropped) == sorted(docs)


def test_decontamination_report_counts_examples_rules_and_documents(tmp_path):
    from data_pipelines import build

    index = _qa_index(tmp_path)
    extra = {"line_again": "Ouagadougou\nis the capital."}  # the 1-word example removes a second document
    _, dropped = _decontaminate(index, {**{k: v[0] for k, v in QA_DOCS.items()}, **extra})
    rep = decontamination.decontamination_report(index, {d: r["eval_matches"] for d, r in dropped.items()}, 1)
    qa = rep["eval_sets"]["qa"]
    assert qa["examples"] == 5 and qa["documents_removed"] == 6
    assert qa["by_length_class"] == {
        "long": {"words": ">=13", "rule": "ngram", "examples": 1, "examples_matched": 1, "documents_removed": 1},
        "medium": {"words": "3-12", "rule": "word_sequence", "examples": 1, "examples_matched": 1,
                   "documents_removed": 1},
        "short": {"words": "1-2", "rule": "whole_unit", "examples": 2, "examples_matched": 2, "documents_removed": 4},
        "empty": {"words": "0", "rule": None, "examples": 1, "examples_matched": 0, "documents_removed": 0}}
    assert sum(c["examples"] for c in qa["by_length_class"].values()) == qa["examples"]
    assert qa["empty_examples"] == ["qa-empty"]
    assert [(e["id"], e["documents_removed"], e["rule"]) for e in qa["matched_examples"]] == [
        ("qa.jsonl:1", 3, "whole_unit"), ("qa.jsonl:2", 1, "whole_unit"), ("qa.jsonl:3", 1, "word_sequence"),
        ("qa.jsonl:4", 1, "ngram")]
    assert qa["matched_examples_not_listed"] == 0
    # Each listed example names the documents it removed and its index in the decision log's eval_matches.
    for e in qa["matched_examples"]:
        assert e["document_ids"] == sorted(d for d, r in dropped.items()
                                           if any(m[:2] == ["qa", e["index"]] or tuple(m[:2]) == ("qa", e["index"])
                                                  for m in r["eval_matches"]))
    assert qa["matched_examples"][0]["index"] == 0 and len(qa["matched_examples"][0]["document_ids"]) == 3
    # Warnings: the empty example by name, and the example that removed 3 > 1 documents.
    assert len(rep["warnings"]) == 2
    assert "qa-empty" in rep["warnings"][0] and "match nothing" in rep["warnings"][0]
    assert "'qa.jsonl:1'" in rep["warnings"][1] and "removed 3 documents" in rep["warnings"][1]
    assert "DecontamConfig.warn_documents_per_example = 1" in rep["warnings"][1]
    # A set whose file holds no example is reported, not left out.
    (tmp_path / "none.jsonl").write_text("")
    cfg = BuildConfig(sources=[], decontam=DecontamConfig(eval_sets={"none": str(tmp_path / "none.jsonl")}))
    rep = decontamination.decontamination_report(build.load_eval_index(cfg), {}, 100)
    assert rep["eval_sets"]["none"]["examples"] == 0
    assert rep["warnings"] == ["decontamination: eval set 'none' has no example"]


def test_sequence_hash_is_the_ngram_hash_of_the_whole_sequence():
    from data_pipelines import minhash

    for text in ("a", "Burkina Faso", "ein zwei drei vier", "東京 タワー", " ".join(map(str, range(64)))):
        w = minhash.words(text)
        assert {decontamination.sequence_hash(w)} == decontamination.ngram_hashes(text, len(w)), text


@pytest.mark.parametrize("over,match", [({"min_ngram": 20}, "DecontamConfig.min_ngram = 20"),
                                        ({"short_units": ("sentence",)}, "DecontamConfig.short_units"),
                                        ({"short_units": ()}, "DecontamConfig.short_units"),
                                        ({"warn_documents_per_example": -1},
                                         "DecontamConfig.warn_documents_per_example = -1")])
def test_bad_decontam_config_names_the_field(over, match):
    with pytest.raises(ConfigError, match=match):
        DecontamConfig(**over).validate()


# ---------------------------------------------------------------- labels: the stratified sample


def test_label_sample_is_stratified_seeded_and_feeds_review(tmp_path):
    rows = []
    for rule, n in (("rules:repeated_lines", 500), ("langid:language_not_allowed", 30), ("quality:below", 200)):
        for d in ("web", "code"):
            rows += [{"id": f"{rule}/{d}/{i}", "verdict": rule, "stage": rule.split(":")[0], "domain": d,
                      "source": "s", "lang": "en", "n_chars": 10} for i in range(n)]
    rows += [{"id": f"dup{i}", "verdict": "exact_dedup:duplicate", "stage": "exact_dedup", "domain": "web",
              "source": "s", "lang": "en", "n_chars": 10} for i in range(50)]
    rows += [{"id": f"k{i}", "verdict": "kept", "stage": None, "domain": "web", "source": "s", "lang": "en",
              "n_chars": 10} for i in range(50)]
    sample = label_sample.draw(rows, 100, seed=5)
    per = collections.Counter((r["verdict"], r["domain"]) for r in sample)
    # 6 strata, 100 labels: 30-document strata fit in full, the rest get equal shares (17,17,17,17 / 16,16)
    assert sum(per.values()) == 100 and set(per) == {(r, d) for r in ("rules:repeated_lines",
           "langid:language_not_allowed", "quality:below") for d in ("web", "code")}
    assert sorted(per.values()) == [16, 16, 17, 17, 17, 17]
    assert label_sample.draw(rows, 100, seed=5) == sample and label_sample.draw(rows, 100, seed=6) != sample
    assert label_sample.allocate({"a": 3, "b": 100, "c": 100}, 100) == {"a": 3, "b": 49, "c": 48}
    out = str(tmp_path / "sample.jsonl")
    label_sample.write_sample(sample, {r["id"]: "x" * 2000 for r in sample}, out)
    first = json.loads(open(out).readline())
    assert len(first["text"]) == 1500 and first["text_truncated"] and first["wrongful"] is None
    # The filled sample is a labels file for review.wrongful_rates.
    build_dir = tmp_path / "build" / "decisions"
    build_dir.mkdir(parents=True)
    with gzip.open(build_dir / "decisions-00000-of-00001.jsonl.gz", "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(out) as f, open(tmp_path / "labels.jsonl", "w") as g:
        for k, line in enumerate(f):
            g.write(json.dumps(dict(json.loads(line), wrongful=k % 4 == 0)) + "\n")
    rates = review.wrongful_rates(str(tmp_path / "build"), str(tmp_path / "labels.jsonl"))
    assert sum(r["labelled"] for r in rates.values()) == 100


def test_cohen_kappa_and_wilson_interval_by_hand():
    a = {"1": True, "2": True, "3": False, "4": False, "5": False}
    b = {"1": True, "2": False, "3": False, "4": False, "5": True, "6": True}
    k = review.cohen_kappa(a, b)
    # p_o = 3/5; shares of 'wrongful' 2/5 and 2/5: p_e = 0.16 + 0.36 = 0.52; kappa = 0.08 / 0.48.
    assert k["n"] == 5 and k["agreement"] == pytest.approx(0.6) and k["kappa"] == pytest.approx(0.08 / 0.48)
    assert k["disagreements"] == ["2", "5"]
    # Wilson: k=2, n=10 -> center (0.2 + z^2/20) / (1 + z^2/10), by the formula with z = 1.96.
    z = 1.959964
    c = (0.2 + z * z / 20) / (1 + z * z / 10)
    h = z * (0.2 * 0.8 / 10 + z * z / 400) ** 0.5 / (1 + z * z / 10)
    assert review.wilson_interval(2, 10) == pytest.approx((c - h, c + h))
    assert review.wilson_interval(2, 10) == pytest.approx((0.0567, 0.5098), abs=1e-4)  # published table value



# ---------------------------------------------------------------- web pages in the charset they declare


def _warc_pages(pages):
    """A gzip WARC of ``(body bytes, Content-Type)`` response records."""
    import io

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    w = WARCWriter(buf, gzip=True)
    for i, (body, ctype) in enumerate(pages):
        http = StatusAndHeaders("200 OK", [("Content-Type", ctype)], protocol="HTTP/1.1")
        w.write_record(w.create_warc_record(f"http://x/{i}", "response", payload=io.BytesIO(body), http_headers=http))
    return buf.getvalue()


def test_warc_pages_are_decoded_by_their_declared_charset_and_counted_by_how(tmp_path):
    """Latin-1, windows-1252 and Shift_JIS pages were all dropped as invalid_utf8: the reader never read the HTTP
    charset or the HTML <meta charset>. Each is now decoded by what it declares (a declared charset that cannot
    decode the bytes falls through), UTF-8 without a declaration as UTF-8, an undeclared non-UTF-8 page by a
    detector, and each kept page says how."""
    french = "Le cœur de l'été à Noël: «déjà vu» — prix 5 €".encode("cp1252")
    latin = "Señor Müller aß Käse in São Paulo. Æsop, Øresund.".encode("latin-1")
    japanese = "日本語のウェブページです。東京は晴れ。今日は良い天気ですね。" * 3
    pages = [
        (b"<html><body><p>" + french + b"</p></body></html>", "text/html; charset=windows-1252"),
        (b"<html><head><meta charset='iso-8859-1'></head><body><p>" + latin + b"</p></body></html>", "text/html"),
        (b'<html><head><meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS"></head><body><p>'
         + japanese.encode("shift_jis") + b"</p></body></html>", "text/html"),
        ("<html><body><p>plain UTF-8: naïve café</p></body></html>".encode(), "text/html"),
        (b"<html><body><p>" + latin + b"</p></body></html>", "text/html; charset=utf-8"),  # a wrong declaration
        (b"<html><body><p>" + japanese.encode("euc_jp") + b"</p></body></html>", "text/html"),  # undeclared
    ]
    path = str(tmp_path / "pages.warc.gz")
    open(path, "wb").write(_warc_pages(pages))
    got = list(readers.read_warc(path, _src(fmt="warc"), AdmissionConfig()))
    assert [d.get("verdict") for d in got] == [None] * 6  # every page kept as a document
    assert "déjà vu" in got[0]["text"] and "5 €" in got[0]["text"]
    assert "São Paulo" in got[1]["text"] and "Øresund" in got[1]["text"]
    assert japanese in got[2]["text"]
    assert "naïve café" in got[3]["text"]
    assert [d["decoded_by"].split(":")[0] for d in got] == [
        "http_header", "html_meta", "html_meta", "utf-8", "detected", "detected"]
    assert got[0]["decoded_by"] == "http_header:cp1252" and got[2]["decoded_by"] == "html_meta:shift_jis"
    assert japanese in got[5]["text"] and "Müller" in got[4]["text"]


def test_undecodable_bytes_fall_back_to_replacement_and_binary_is_dropped():
    text, how = readers.decode_page(bytes(range(0x80, 0x100)) * 4, "text/html; charset=ascii")
    assert how in ("replacement",) or how.startswith("detected:")
    assert readers.decode_page(b"abc \xff\xfe", None)[0].startswith("abc")
