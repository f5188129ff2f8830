"""Rules: Gopher (Rae et al. 2021, app. A) and C4 (Raffel et al. 2020) quality rules, thresholds per domain and
source (`RuleConfig`)."""

from __future__ import annotations

import collections
import dataclasses
import re
import string
import unicodedata
from typing import Collection

import apache_beam as beam
import gin
import numpy as np

from jaxpt.util.errors import ConfigError

from data_pipelines import minhash
from data_pipelines.steps import base


@gin.configurable
@dataclasses.dataclass
class RuleConfig:
    """Gopher (Rae et al. 2021, app. A) and C4 (Raffel et al. 2020) style thresholds.

    `per_domain` overrides any field for one domain, e.g. ``{"code": {"max_symbol_ratio": 1.0}}``;
    `per_source` then overrides fields for one source (by name), for a kind of text that shares a domain
    with others (man pages among fortunes).

    `skip` names rules (`RULES` reasons, e.g. ``"repeated_lines"``) not applied at all; set per domain or
    per source, it scopes a rule to the text it was calibrated on. Gopher's repetition and quality rules (Rae et
    al. 2021, app. A, table A1) were tuned on MassiveWeb prose; on dictionaries, fortunes, man pages and
    documentation they mostly delete good text (`data/labels/raw-v1-clean-1`, README "Wrongful deletions").
    An unknown name raises ConfigError naming ``RuleConfig.skip`` (or the per-domain/per-source key).
    """

    min_words: int = 5
    max_words: int = 200_000
    min_chars: int = 20
    max_chars: int = 2_000_000
    max_non_printable_ratio: float = 0.02
    max_replacement_ratio: float = 0.001
    max_symbol_ratio: float = 0.1  # Gopher: '#' and '...' per word
    max_punct_ratio: float = 0.35  # share of characters that are punctuation or symbols
    max_dup_line_fraction: float = 0.3
    max_dup_line_char_fraction: float = 0.2
    max_top_2gram_fraction: float = 0.2
    max_top_3gram_fraction: float = 0.18
    max_top_4gram_fraction: float = 0.16
    max_dup_5gram_fraction: float = 0.15
    min_mean_word_length: float = 2.0
    max_mean_word_length: float = 12.0
    min_alpha_word_fraction: float = 0.6
    dup_line_min_words: int = 4  # shorter repeated lines (citation tags, braces) are structure, not duplicates
    repetition_min_words: int = 50  # n-gram repetition rules need this many words (Gopher's own floor)
    skip: tuple[str, ...] = ()
    drop_cross_references: bool = False  # reference entries whose body is only "See {x}." (`is_cross_reference`)
    per_domain: dict = dataclasses.field(default_factory=dict)
    per_source: dict = dataclasses.field(default_factory=dict)
    enabled: bool = True
    version: str = "rules-v2"

    def for_domain(self, domain: str, source: str | None = None) -> "RuleConfig":
        """This config with `per_domain[domain]`, then `per_source[source]`, applied. Raises ConfigError naming the
        key on an unknown field."""
        names = {f.name for f in dataclasses.fields(self)} - {"per_domain", "per_source"}
        out = dataclasses.replace(self, per_domain={}, per_source={})
        for key, over in ((f"per_domain['{domain}']", self.per_domain.get(domain, {})),
                          (f"per_source['{source}']", self.per_source.get(source, {}) if source else {})):
            bad = set(over) - names
            if bad:
                raise ConfigError(f"RuleConfig.{key}: unknown thresholds {sorted(bad)}")
            out = dataclasses.replace(out, **over)
        unknown = sorted(set(out.skip) - {r[0] for r in RULES})
        if unknown:
            raise ConfigError(f"RuleConfig.skip (for domain '{domain}', source '{source}') = {list(out.skip)}: "
                              f"unknown rules {unknown}; known: {[r[0] for r in RULES]}")
        return dataclasses.replace(out, skip=tuple(out.skip))


_ALPHA_RE = re.compile(r"[^\W\d_]")


# One match per whitespace-separated word (str.split's words: re's \s and str.split both use Unicode's whitespace)
# that holds an _ALPHA_RE character: a match starts only at a word's start, and ends at its first such character.
_ALPHA_WORD_RE = re.compile(r"(?<!\S)\S*?[^\W\d_]")


_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


_TABLES: dict[str, dict[int, None]] = {}


def _deletion_table(kind: str) -> dict[int, None]:
    """str.translate table deleting one class of code points, so counting runs in C.

    ``punct``: Unicode categories P* and S* plus ASCII punctuation; ``nonprint``: Cc, Cf, Co, Cn
    except tab, newline and carriage return.
    """
    if kind not in _TABLES:
        if kind == "punct":
            keep = lambda c: unicodedata.category(c)[0] in "PS" or c in string.punctuation  # noqa: E731
        else:
            keep = lambda c: unicodedata.category(c) in ("Cc", "Cf", "Co", "Cn") and c not in "\n\t\r"  # noqa: E731
        # Planes 0-2 hold every assigned letter, punctuation and symbol in practice; Co/Cn beyond
        # them are rare enough to ignore for a ratio.
        _TABLES[kind] = {i: None for i in range(0x30000) if keep(chr(i))}
    return _TABLES[kind]


def _count_in(text: str, kind: str) -> int:
    return len(text) - len(text.translate(_deletion_table(kind)))


# The statistics each group of rules reads that no other rule does: `rule_stats` leaves out a group whose rules are
# all skipped (rule_reason's decision reads nothing else, so it is the same either way).
_LINE_RULES = {"repeated_lines": "dup_line_fraction", "repeated_line_chars": "dup_line_char_fraction"}


_NGRAM_RULES = {"top_2gram": "top_2gram_fraction", "top_3gram": "top_3gram_fraction",
                "top_4gram": "top_4gram_fraction", "repeated_5grams": "dup_5gram_fraction"}


def rule_stats(text: str, dup_line_min_words: int = 1, skip: Collection[str] = (),
               repetition_min_words: int = 0) -> dict[str, float]:
    """Quality signals of Gopher (Rae et al. 2021, table A1) and C4 used by `rule_reason`.

    Words are whitespace-separated tokens, except that the word count and n-gram statistics use
    `minhash.words` so CJK text (no spaces) is measured per character. A repeated line of fewer than
    `dup_line_min_words` whitespace words (a citation tag such as ``[1913 Webster]``, a closing brace, a
    separator) counts as a line but not as a duplicate: such lines are structure, not repeated boilerplate.
    `skip`: rule names (`RULES`) whose own statistics are not needed; the duplicate-line fractions and each
    n-gram fraction are left out of the result when every rule reading them is named (the n-gram counts are
    most of this function's time on long documents). A text of fewer than `repetition_min_words` words gets NaN
    n-gram fractions, not computed.
    """
    n_chars = len(text)
    ws_words = text.split()
    toks = minhash.words(text)
    n_words = len(toks)
    st = {"n_chars": n_chars, "n_words": n_words}
    sample = text[:200_000]
    st["non_printable_ratio"] = _count_in(sample, "nonprint") / max(1, len(sample))
    st["replacement_ratio"] = sample.count("\ufffd") / max(1, len(sample))
    st["punct_ratio"] = _count_in(sample, "punct") / max(1, len(sample))
    # A token holding no CJK character is never a CJK one: most texts skip the per-token test.
    spaced = [t for t in toks if not _CJK_RE.fullmatch(t)] if _CJK_RE.search("".join(toks)) else toks
    mostly_cjk = len(spaced) * 2 < n_words
    st["symbol_count"] = text.count("#") + text.count("...") + text.count("\u2026")
    st["n_ws_words"] = len(ws_words)
    # Gopher's symbol-to-word ratio counts space-separated words; mostly-CJK text has few spaces, so a Japanese
    # man page with a handful of '#' comments read as 0.2 symbols per "word". There words are counted per
    # character, as for the word count above (rules-v4: that page was a labelled wrongful drop).
    st["n_symbol_words"] = n_words if mostly_cjk else len(ws_words)
    st["symbol_ratio"] = st["symbol_count"] / max(1, st["n_symbol_words"])
    # Gopher's word-length bounds assume space-separated words. In CJK text every character is a
    # token, so the bounds apply to the other tokens only, and not at all to mostly-CJK text
    # (NaN compares false, so the rule passes).
    st["mean_word_length"] = float("nan") if mostly_cjk or not spaced else sum(map(len, spaced)) / len(spaced)
    st["alpha_word_fraction"] = len(_ALPHA_WORD_RE.findall(text)) / max(1, len(ws_words))
    if not set(_LINE_RULES) <= set(skip):
        lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
        counts = collections.Counter(lines)
        dups = {ln: c for ln, c in counts.items() if c > 1 and len(ln.split()) >= dup_line_min_words}
        st["dup_line_fraction"] = sum(dups.values()) / max(1, len(lines))
        st["dup_line_char_fraction"] = sum(len(ln) * c for ln, c in dups.items()) / max(1, n_chars)
    ngrams = [rule for rule in _NGRAM_RULES if rule not in skip]
    if not ngrams:
        return st
    total_chars = sum(map(len, toks)) or 1
    if mostly_cjk or n_words < repetition_min_words:
        # Character n-grams of CJK text repeat by nature (common two- and three-character words);
        # the Gopher repetition bounds are calibrated on word n-grams, so they are not applied. Nor to short
        # texts (`rule_reason`).
        for rule in ngrams:
            st[_NGRAM_RULES[rule]] = float("nan")
        return st
    for n in (2, 3, 4):
        if f"top_{n}gram" not in ngrams:
            continue
        if n_words < n:
            st[f"top_{n}gram_fraction"] = 0.0
            continue
        grams = collections.Counter(zip(*(toks[i:] for i in range(n))))
        gram, c = grams.most_common(1)[0]
        st[f"top_{n}gram_fraction"] = (c * sum(map(len, gram)) / total_chars) if c > 1 else 0.0
    if "repeated_5grams" not in ngrams:
        return st
    if n_words >= 5:
        grams = list(zip(*(toks[i:] for i in range(5))))
        counts5 = collections.Counter(grams)
        covered = np.zeros(n_words, dtype=bool)
        for i, g in enumerate(grams):
            if counts5[g] > 1:
                covered[i : i + 5] = True
        lens = np.fromiter(map(len, toks), dtype=np.int64, count=n_words)
        st["dup_5gram_fraction"] = float(lens[covered].sum()) / total_chars
    else:
        st["dup_5gram_fraction"] = 0.0
    return st


# (reason, statistic, comparison, config field) in evaluation order; the first failure is the reason.
RULES = (
    ("too_few_words", "n_words", "<", "min_words"),
    ("too_many_words", "n_words", ">", "max_words"),
    ("too_short", "n_chars", "<", "min_chars"),
    ("too_long", "n_chars", ">", "max_chars"),
    ("non_printable", "non_printable_ratio", ">", "max_non_printable_ratio"),
    ("garbled", "replacement_ratio", ">", "max_replacement_ratio"),
    ("symbol_ratio", "symbol_ratio", ">", "max_symbol_ratio"),
    ("punctuation_density", "punct_ratio", ">", "max_punct_ratio"),
    ("repeated_lines", "dup_line_fraction", ">", "max_dup_line_fraction"),
    ("repeated_line_chars", "dup_line_char_fraction", ">", "max_dup_line_char_fraction"),
    ("top_2gram", "top_2gram_fraction", ">", "max_top_2gram_fraction"),
    ("top_3gram", "top_3gram_fraction", ">", "max_top_3gram_fraction"),
    ("top_4gram", "top_4gram_fraction", ">", "max_top_4gram_fraction"),
    ("repeated_5grams", "dup_5gram_fraction", ">", "max_dup_5gram_fraction"),
    ("short_words", "mean_word_length", "<", "min_mean_word_length"),
    ("long_words", "mean_word_length", ">", "max_mean_word_length"),
    ("few_alpha_words", "alpha_word_fraction", "<", "min_alpha_word_fraction"),
)


_XREF_RE = re.compile(r"See(?: also)? \{[^{}\n]+\}(?:,? (?:and )?\{[^{}\n]+\})*\.?")


_POS_RE = re.compile(r"[a-z]{1,6}\.(?: ?[a-z]{1,6}\.)?")


def is_cross_reference(text: str) -> bool:
    """True if `text` is a dictionary entry whose body is only a cross-reference: a headword line, an optional
    part-of-speech line (``v.``, ``adj.``), then ``See {word}.`` (GCIDE, Jargon File and FOLDOC markup), e.g.
    ``"Unassayed \\Unassayed\\\n   See {assayed}.\n"``. Such an entry carries no text of its own; the word
    count cannot tell it from a short definition ("RESTITUTOR, n.  Benefactor; philanthropist.")."""
    lines = [ln.strip() for ln in text.strip().split("\n") if ln.strip()]
    body = lines[1:]
    if body and _POS_RE.fullmatch(body[0]):
        body = body[1:]
    return len(body) == 1 and _XREF_RE.fullmatch(body[0]) is not None


def rule_reason(text: str, cfg: RuleConfig) -> str | None:
    """Name of the first rule `text` fails under `cfg` (already resolved per domain), else None.

    The n-gram repetition rules (top 2/3/4-gram, duplicated 5-grams) apply only to documents of at least
    `cfg.repetition_min_words` words: Gopher calibrated them on documents of 50 words or more, and in a
    ten-word entry one repeated pair of words is already a fifth of its characters. For the same reason the
    symbol ratio ('#' and ellipses per word) divides by at least `cfg.repetition_min_words` words. Rules named
    in `cfg.skip` are not applied. With `cfg.drop_cross_references`, a bare cross-reference entry
    (`is_cross_reference`) is ``cross_reference_only``, checked first.
    """
    if cfg.drop_cross_references and is_cross_reference(text):
        return "cross_reference_only"
    # Only the statistics of applied rules are computed (`rule_stats`' `skip`); under repetition_min_words words the
    # n-gram fractions are NaN (NaN compares false: the rule passes).
    st = rule_stats(text, cfg.dup_line_min_words, cfg.skip, cfg.repetition_min_words)
    # Likewise '#' and ellipses per word: one '...' in a seven-word fortune is 0.14 > 0.1, so the ratio's
    # denominator is at least repetition_min_words words (a short text may hold up to 5 such symbols at 0.1).
    st["symbol_ratio"] = st["symbol_count"] / max(1, st["n_symbol_words"], cfg.repetition_min_words)
    for reason, stat, op, field in RULES:
        if reason in cfg.skip:
            continue
        limit = getattr(cfg, field)
        if (op == "<" and st[stat] < limit) or (op == ">" and st[stat] > limit):
            return reason
    return None


REASONS = ("cross_reference_only", *(r[0] for r in RULES))


class ApplyRules(beam.DoFn):
    """Drops a document failing a rule of its domain and source (`rule_reason`, `RuleConfig.for_domain`)."""

    def __init__(self, cfg: RuleConfig):
        self.cfg = cfg

    def setup(self):
        self.rules = {}

    def process(self, doc):
        key = (doc["domain"], doc["source"])
        rc = self.rules.get(key)
        if rc is None:
            rc = self.rules[key] = self.cfg.for_domain(*key)
        reason = rule_reason(doc["text"], rc)
        if reason:
            yield beam.pvalue.TaggedOutput(base.DROPS, base.decision(doc, "rules", reason))
        else:
            yield doc


class Rules(base.Step):
    name = stage = config_field = "rules"
    config = RuleConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        if not ctx.cfg.rules.enabled:
            return docs
        return base.with_drops(docs, "Rules", beam.ParDo(ApplyRules(ctx.cfg.rules)), ctx)

    def record(self, facts: base.Facts) -> dict:
        return {"rules": {"version": facts.cfg.rules.version, "thresholds": facts.operative["rules"]}}
