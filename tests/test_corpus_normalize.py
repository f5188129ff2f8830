"""The corpus build's fast paths equal what they stand in for: normalization equals ftfy.fix_text, and rule
decisions computed from only the statistics of applied rules equal those computed from all of them."""

import math
import pathlib

import ftfy
import gin
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_pipelines.steps import normalization, rules as rule_step
from data_pipelines import build, minhash, neardup_eval
from data_pipelines.config import NormalizeConfig, RuleConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
NFC = NormalizeConfig()

# Pieces every ftfy fixer acts on (mojibake, entities, escapes, controls, C1, ligatures, width, quotes, line
# breaks, surrogates, decomposed accents), pieces it leaves alone, and the '<' that stops entity unescaping.
PIECES = ["plain ascii words", "a & b", "&amp;", "&#233;", "&lt;b&gt;", "&nbsp;x", "&notanentity", "<p>",
          "\x1b[31m", "\r\n", "\r", "\x00", "\x7f", "\x0b", "\x0c", "_\x08n", "\x85", "\x92", "Ã©", "Ã¼ber",
          "â€™", "â€œhiâ€\x9d", "Ãƒâ€šÃ‚Â", "ﬁnish", "ﬀ", "ＡＢＣ１２", "\u3000", "‘quoted’", "“double”",
          "e\u0301", "\u2028", "\u2029", "\ud83d", "\ufeff", "\u200b", "\u206a", "café", "Straße", "Привет",
          "日本語のテキスト", "ｶﾀｶﾅ", "\t", " ", "\n"]


@pytest.mark.integration
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=30))
def test_normalize_equals_ftfy_on_generated_text(parts):
    text = "".join(parts)
    assert normalization.normalize(text, NFC) == ftfy.fix_text(text, normalization="NFC")


def test_normalize_equals_ftfy_across_long_lines():
    # ftfy cuts a line longer than max_decode_length (1,000,000 characters) into pieces; the fast path does too.
    text = ("é" + "x" * 999_998 + "&amp;\n") + "ascii line\n" + "Ã© " * 10 + "<b>&amp;</b>\n"
    text += "&amp; after '<'"
    assert normalization.normalize(text, NFC) == ftfy.fix_text(text, normalization="NFC")


@pytest.fixture(scope="module")
def raw_v1_docs(raw_v1_dir):
    return neardup_eval.read_raw_docs(raw_v1_dir)


def test_normalize_equals_ftfy_on_raw_v1(raw_v1_docs):
    """Every 80th raw-v1 record ftfy is run on (not plain ASCII). (All 159,839 records were compared once, when the
    line-by-line path was written: all equal.)"""
    sample = [d["text"] for d in raw_v1_docs if not normalization._ftfy_fixed_point(d["text"])][::80]
    assert len(sample) > 500
    for text in sample:
        assert normalization.normalize(text, NFC) == ftfy.fix_text(text, normalization="NFC"), text[:200]


WORDS = ["word", "Wort", "слово", "日本", "語", "x1", "_", "123", "...", "#", "…", "{see}", "a_b", "ﬁ", "٣", "Ⅻ",
         "\u00a0", "\u2003", "\u3000", "\x1c", "\x1f", "\x85", " ", "\n", "\t", "-", "ー", "・"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=6)), max_size=60))
def test_word_statistics_equal_their_per_word_definitions(parts):
    """The alphabetic-word share and mean word length, counted by regular expressions, equal their definitions
    over str.split() words and `minhash.words` tokens."""
    text = "".join(parts)
    got = rule_step.rule_stats(text)
    ws = text.split()
    assert got["alpha_word_fraction"] == sum(1 for w in ws if rule_step._ALPHA_RE.search(w)) / max(1, len(ws))
    toks = minhash.words(text)
    spaced = [t for t in toks if not rule_step._CJK_RE.fullmatch(t)]
    if len(spaced) * 2 < len(toks) or not spaced:
        assert math.isnan(got["mean_word_length"])
    else:
        assert got["mean_word_length"] == sum(map(len, spaced)) / len(spaced)


def _reason_from_every_statistic(text: str, cfg: RuleConfig) -> str | None:
    """`rule_step.rule_reason` by its definition: every statistic computed, n-gram fractions NaN under
    `repetition_min_words` words, then the first failing rule not skipped."""
    if cfg.drop_cross_references and rule_step.is_cross_reference(text):
        return "cross_reference_only"
    s = rule_step.rule_stats(text, cfg.dup_line_min_words)
    if s["n_words"] < cfg.repetition_min_words:
        s.update(dict.fromkeys(("top_2gram_fraction", "top_3gram_fraction", "top_4gram_fraction",
                                "dup_5gram_fraction"), float("nan")))
    s["symbol_ratio"] = s["symbol_count"] / max(1, s["n_symbol_words"], cfg.repetition_min_words)
    for reason, stat, op, field in rule_step.RULES:
        limit = getattr(cfg, field)
        if reason not in cfg.skip and ((op == "<" and s[stat] < limit) or (op == ">" and s[stat] > limit)):
            return reason
    return None


RULE_NAMES = [r[0] for r in rule_step.RULES]
REPEATED = ["the cat sat on the mat", "the cat sat on the mat", "[1913 Webster]", "}", "See {word}.", "# x", "..."]


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(st.one_of(st.sampled_from(REPEATED), st.text(max_size=40)), max_size=40),
       skip=st.lists(st.sampled_from(RULE_NAMES), unique=True), min_words=st.sampled_from([0, 5, 50]),
       dup_min=st.sampled_from([1, 4]), strict=st.booleans())
def test_rule_reason_from_applied_statistics_equals_every_statistic(lines, skip, min_words, dup_min, strict):
    """rule_reason computes only the statistics of rules it applies; the decision is the one all statistics give."""
    text = "\n".join(lines)
    limits = dict(max_dup_line_fraction=0.05, max_dup_line_char_fraction=0.05, max_top_2gram_fraction=0.05,
                  max_top_3gram_fraction=0.05, max_top_4gram_fraction=0.05, max_dup_5gram_fraction=0.05,
                  min_words=1, min_chars=1) if strict else {}
    cfg = RuleConfig(skip=tuple(skip), repetition_min_words=min_words, dup_line_min_words=dup_min, **limits)
    assert rule_step.rule_reason(text, cfg) == _reason_from_every_statistic(text, cfg)


def test_rule_reason_from_applied_statistics_on_raw_v1_configs(raw_v1_docs):
    """The same on raw-v1 records (every 200th) under the build's own per-domain and per-source rules, and under
    rules that skip nothing."""
    try:
        cfg = build.load_config([str(REPO / "configs" / "data" / "raw_v1.gin")], [])
    finally:
        gin.clear_config()  # RuleConfig() elsewhere must not take raw_v1.gin's bindings
    domain = {s["name"]: s["domain"] for s in cfg.sources}
    docs = raw_v1_docs[::200]
    assert len(docs) > 700
    for d in docs:
        source = d["id"].split("/")[0]
        for rules in (cfg.rules.for_domain(domain[source], source), RuleConfig()):
            assert rule_step.rule_reason(d["text"], rules) == _reason_from_every_statistic(d["text"], rules), d["id"]
