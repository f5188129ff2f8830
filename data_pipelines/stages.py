"""Per-document logic of stages 2-9, free of Beam so tests and benchmarks call it directly."""

from __future__ import annotations

import collections
import hashlib
import math
import re
import string
import unicodedata
import zlib
from typing import Collection

import numpy as np

from data_pipelines import minhash
from jaxpt.eval import decontam as decontam_hash
from data_pipelines.config import LangIdConfig, NormalizeConfig, QuotaConfig, RuleConfig

# ---------------------------------------------------------------- stage 2: normalization


# ASCII text without these is a fixed point of ftfy.fix_text: mojibake, curly quotes, ligatures, width and
# normalization fixes all need non-ASCII input, and the remaining fixers act on HTML entities (ftfy's own pattern,
# chardata.HTML_ENTITY_RE: a '&' that starts none is left alone), ESC sequences, CR line breaks and control characters.
_FTFY_ASCII_TRIGGERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]|&#?[0-9A-Za-z]{1,24};")


def _ftfy_fixed_point(text: str) -> bool:
    """True if ftfy would return `text` (a whole text or one line of it) unchanged: plain ASCII without a trigger."""
    return text.isascii() and not _FTFY_ASCII_TRIGGERS.search(text)


def _fix_text(text: str, normalization: str) -> str:
    """``ftfy.fix_text(text, normalization=normalization)``, with each line that is a fixed point
    (`_ftfy_fixed_point`) passed through instead of fixed.

    ftfy.fix_text fixes a text one line at a time (each line, up to ``max_decode_length`` characters, through
    `ftfy.fix_and_explain`), and stops unescaping HTML entities from the first line holding a '<' on; this is that
    loop, so the result is the same (tests/test_corpus_normalize.py checks it on raw-v1 and on generated text).
    Documents that are mostly ASCII with a few accented names, '&' operators or typographic quotes cost the lines
    that hold them instead of every line.
    """
    import ftfy

    config = ftfy.TextFixerConfig(normalization=normalization, explain=False)
    out, pos = [], 0
    while pos < len(text):
        end = text.find("\n", pos) + 1 or len(text)
        end = min(end, pos + config.max_decode_length)
        line = text[pos:end]
        if config.unescape_html == "auto" and "<" in line:
            config = config._replace(unescape_html=False)
        out.append(line if _ftfy_fixed_point(line) else ftfy.fix_and_explain(line, config).text)
        pos = end
    return "".join(out)


def normalize(text: str, cfg: NormalizeConfig) -> str:
    """ftfy repair (mojibake, terminal escapes, HTML entities left in text) then Unicode
    `cfg.normalization` (NFC by default), equal to ``ftfy.fix_text(text, normalization=cfg.normalization)``.
    Plain ASCII without control characters or HTML entities is returned as is (ftfy would return it unchanged;
    about 60% of raw-v1's characters), and in other text only the lines that are not such are fixed (`_fix_text`)."""
    if not cfg.enabled or _ftfy_fixed_point(text):
        return text
    return _fix_text(text, cfg.normalization)


# ---------------------------------------------------------------- stage 3: language ID


def spread_sample(text: str, max_chars: int, windows: int) -> str:
    """`windows` evenly spaced slices of `text`, `max_chars` characters in all, joined by newlines (the whole
    text if it is no longer than `max_chars`), so a detector sees the body of a document, not only its head."""
    if len(text) <= max_chars or windows <= 1:
        return text[:max_chars]
    w = max_chars // windows
    step = (len(text) - w) / (windows - 1)
    return "\n".join(text[round(i * step): round(i * step) + w] for i in range(windows))


class LanguageIdentifier:
    """Lingua detector over `cfg.languages`; the model ships inside the lingua wheel."""

    def __init__(self, cfg: LangIdConfig):
        from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

        langs = []
        for code in cfg.languages:
            try:
                langs.append(Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper())))
            except AttributeError:
                raise ValueError(f"LangIdConfig.languages: unknown ISO 639-1 code '{code}'") from None
        self.cfg = cfg
        self._detector = LanguageDetectorBuilder.from_languages(*langs).build()

    def detect(self, texts: list[str], declared: list[str | None] | None = None) -> list[tuple[str, float, str]]:
        """(ISO 639-1 code or ``und``, confidence in [0, 1], ``"detected"`` or ``"declared"``) for each text.

        Args:
          texts: documents (any length; `spread_sample` picks what the detector reads).
          declared: per text, the language to fall back on (`LangIdConfig`: too few letters, low confidence or a
            small lead over the runner-up); None falls back to ``und``.
        """
        declared = declared or [None] * len(texts)
        snippets = [spread_sample(t, self.cfg.max_chars, self.cfg.windows) for t in texts]
        out = []
        all_values = self._detector.compute_language_confidence_values_in_parallel(snippets)
        for snip, fallback, values in zip(snippets, declared, all_values):
            values = values if snip.strip() else []
            top = values[0] if values else None
            conf = top.value if top else 0.0
            lead = conf - (values[1].value if len(values) > 1 else 0.0)
            letters = sum(1 for c in snip if c.isalpha())
            if (top is None or conf == 0.0 or letters < self.cfg.min_chars or conf < self.cfg.min_confidence
                    or lead < self.cfg.min_relative_distance):
                out.append((fallback or "und", conf, "declared"))
            else:
                out.append((top.language.iso_code_639_1.name.lower(), conf, "detected"))
        return out


# ---------------------------------------------------------------- stage 4: rule filters

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


# ---------------------------------------------------------------- stage 5: exact dedup

_WS_RE = re.compile(r"\s+")


def exact_key(text: str) -> str:
    """sha256 hex of the text with whitespace runs collapsed to one space and case folded."""
    return hashlib.sha256(_WS_RE.sub(" ", text).strip().casefold().encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- stage 7: quality model


def _feature_ids(text: str, num_buckets: int) -> np.ndarray:
    """Hashed unigram and bigram ids (``int64[2n-1]``) of a text's words, crc32 mod buckets."""
    toks = minhash.words(text[:100_000])
    if not toks:
        return np.zeros(0, dtype=np.int64)
    uni = [zlib.crc32(t.encode("utf-8")) for t in toks]
    bi = [zlib.crc32(f"{a}\x00{b}".encode("utf-8")) for a, b in zip(toks, toks[1:])]
    return np.asarray(uni + bi, dtype=np.int64) % num_buckets


class HashedNgramLM:
    """Add-one-smoothed hashed unigram+bigram model; score = mean log-probability per feature.

    Like CCNet's perplexity filter (Wenzek et al. 2020) with a feature-hashed count table in place
    of KenLM, so it trains in one Beam combine. Scores are negative; higher means closer to the
    reference set. `counts`: ``int64[num_buckets]``.
    """

    def __init__(self, counts: np.ndarray):
        self.counts = counts
        total = float(counts.sum()) + counts.shape[0]
        self._logp = np.log((counts + 1.0) / total)

    @staticmethod
    def count(text: str, num_buckets: int) -> np.ndarray:
        """Bucket counts (``int64[num_buckets]``) of one training text."""
        return np.bincount(_feature_ids(text, num_buckets), minlength=num_buckets).astype(np.int64)

    def score(self, text: str) -> float:
        ids = _feature_ids(text, self.counts.shape[0])
        if ids.size == 0:
            return float(np.log(1.0 / (float(self.counts.sum()) + self.counts.shape[0])))
        return float(self._logp[ids].mean())


# ---------------------------------------------------------------- stage 8: decontamination


def _word_hashes(toks: list[str]) -> np.ndarray:
    """``uint64[len(toks)]``: crc32 of each word (memoized per word by `minhash`)."""
    return np.fromiter(map(minhash._word_hash, toks), dtype=np.uint64, count=len(toks))


_combine = decontam_hash.combine_word_hashes  # the trainer's n-gram hash (jaxpt.eval.decontam): one definition


def _word_ngram_hashes(toks: list[str], n: int) -> np.ndarray:
    """``uint64[max(0, len(toks) - n + 1)]``: the hash of every word n-gram of `toks` (`ngram_hashes`)."""
    return _combine(_word_hashes(toks), n) if len(toks) >= n else np.zeros(0, dtype=np.uint64)


def ngram_hashes(text: str, n: int) -> set[int]:
    """64-bit hashes of the lower-cased word n-grams of `text` (`minhash.words`, n <= 64).

    Each word is hashed once (crc32); an n-gram's hash is the position-weighted sum of its word
    hashes (wrapping uint64) passed through the splitmix64 finalizer, vectorized over the text.
    """
    return set(_word_ngram_hashes(minhash.words(text), n).tolist())


_MASK64 = (1 << 64) - 1
_NGRAM_MULT_INT = [int(x) for x in decontam_hash.NGRAM_MULT]


def sequence_hash(toks: list[str]) -> int:
    """The `ngram_hashes` hash of the whole word sequence `toks` as one n-gram (1 <= len(toks) <= 64), in plain
    integers (the same wrapping uint64 arithmetic; a line or paragraph is too short to pay for numpy)."""
    x = sum(minhash._word_hash(w) * _NGRAM_MULT_INT[j] for j, w in enumerate(toks)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# Length class of an eval example (k words after `minhash.words`) -> the rule that matches it. With n =
# `DecontamConfig.ngram` and m = `DecontamConfig.min_ngram`: ``long`` (k >= n) by any shared n-gram (Brown et al.
# 2020, app. C); ``medium`` (m <= k < n) by its whole word sequence anywhere in a document; ``short`` (1 <= k < m)
# only where a whole unit of a document (`DecontamConfig.short_units`: the document, a paragraph, a line) has
# exactly its word sequence, as Dolma's paragraph decontamination falls back to a whole-paragraph match for
# paragraphs shorter than its n-gram; ``empty`` (k = 0) matches nothing and is reported by name.
DECONTAM_RULES = {"long": "ngram", "medium": "word_sequence", "short": "whole_unit", "empty": None}
DECONTAM_UNITS = ("document", "paragraph", "line")
_BLANK_RE = re.compile(r"\n[^\S\n]*\n")


def length_class(n_words: int, ngram: int, min_ngram: int) -> str:
    """``long``, ``medium``, ``short`` or ``empty`` for an example of `n_words` words (`DECONTAM_RULES`)."""
    if n_words >= ngram:
        return "long"
    if n_words >= min_ngram:
        return "medium"
    return "short" if n_words > 0 else "empty"


def unit_word_sequences(text: str, units: tuple[str, ...], doc_words: list[str] | None = None) -> list[list[str]]:
    """Word sequences (`minhash.words`) of the whole units of `text` named in `units` (`DECONTAM_UNITS`): the
    ``document``, each ``paragraph`` (text between blank lines) and each ``line``. Units without a word are left
    out; a unit may repeat (a one-line document is also its paragraph and its line). `doc_words`: the document's
    words if already computed."""
    out = []
    if "document" in units:
        out.append(minhash.words(text) if doc_words is None else doc_words)
    if "paragraph" in units:
        out += [minhash.words(p) for p in _BLANK_RE.split(text)]
    if "line" in units:
        out += [minhash.words(ln) for ln in text.split("\n")]
    return [w for w in out if w]


class EvalIndex:
    """Hashes of the eval examples of every eval set, by the rule that matches them (`DECONTAM_RULES`).

    Built once on the driver (`data_pipelines.build.load_eval_index`) and shipped to the Beam workers; `match`
    tells which examples a training document contains. Example ``i`` of set ``s`` is ``examples[s][i]``: a dict
    with ``id`` (the record's ``id``, or ``<file>:<line>``), ``n_words``, ``length_class`` and ``text`` (first
    200 characters, for the manifest). Hashes are 64-bit (`ngram_hashes`); a false match needs a collision.
    """

    def __init__(self, ngram: int, min_ngram: int, short_units: tuple[str, ...] = DECONTAM_UNITS):
        self.ngram, self.min_ngram, self.short_units = ngram, min_ngram, tuple(short_units)
        self.examples: dict[str, list[dict]] = {}
        # (rule, k) -> {hash: [(set, example index), ...]}
        self._tables: dict[tuple[str, int], dict[int, list[tuple[str, int]]]] = collections.defaultdict(dict)
        self._sorted: dict[tuple[str, int], np.ndarray] | None = None  # each table's hashes, sorted (uint64)

    def add_set(self, set_name: str) -> None:
        """Registers eval set `set_name`, so that a set with no example is reported too."""
        self.examples.setdefault(set_name, [])

    def add(self, set_name: str, example_id: str, text: str) -> None:
        """Adds one example of eval set `set_name` under the rule of its length class."""
        toks = minhash.words(text)
        cls = length_class(len(toks), self.ngram, self.min_ngram)
        examples = self.examples.setdefault(set_name, [])
        ref = (set_name, len(examples))
        examples.append({"id": example_id, "n_words": len(toks), "length_class": cls, "text": text[:200]})
        if cls == "long":
            hashes, key = _word_ngram_hashes(toks, self.ngram).tolist(), ("ngram", self.ngram)
        elif cls == "empty":
            return
        else:
            hashes, key = [sequence_hash(toks)], (DECONTAM_RULES[cls], len(toks))
        table = self._tables[key]
        self._sorted = None
        for h in set(hashes):
            refs = table.setdefault(h, [])
            if not refs or refs[-1] != ref:
                refs.append(ref)

    def match(self, text: str) -> list[tuple[str, int, str]]:
        """Sorted, distinct ``(set, example index, rule)`` of every example that `text` contains by its rule."""
        if self._sorted is None:
            self._sorted = {key: np.array(sorted(t), dtype=np.uint64) for key, t in self._tables.items()}
        found = set()
        toks = minhash.words(text)
        wh = short = None  # computed once per document, whatever the number of lengths
        for (rule, k), table in self._tables.items():
            if rule == "whole_unit":
                if short is None:
                    short = collections.defaultdict(set)
                    for u in unit_word_sequences(text, self.short_units, toks):
                        if len(u) < self.min_ngram:
                            short[len(u)].add(sequence_hash(u))
                hits = short.get(k, set()) & table.keys()
            else:
                if len(toks) < k:
                    continue
                wh = _word_hashes(toks) if wh is None else wh
                grams, keys = _combine(wh, k), self._sorted[(rule, k)]
                at = np.minimum(np.searchsorted(keys, grams), len(keys) - 1)
                hits = set(grams[keys[at] == grams].tolist())
            for h in hits:
                found.update((s, i, rule) for s, i in table[h])
        return sorted(found)

    def ngram_counts(self) -> dict[str, dict[str, int]]:
        """Per eval set, how many distinct hashes each rule holds (the manifest's ``eval_ngrams``)."""
        out: dict[str, collections.Counter] = {s: collections.Counter() for s in self.examples}
        for (rule, _), table in self._tables.items():
            for refs in table.values():
                for s in {s for s, _ in refs}:
                    out[s][rule] += 1
        return {s: dict(sorted(c.items())) for s, c in sorted(out.items())}

    def lengths(self) -> dict[str, list[int]]:
        """Per eval set, the n-gram lengths its hashes use (the manifest's ``eval_ngram_lengths``)."""
        out: dict[str, set[int]] = {s: set() for s in self.examples}
        for (_, k), table in self._tables.items():
            for refs in table.values():
                for s, _ in refs:
                    out[s].add(k)
        return {s: sorted(v) for s, v in sorted(out.items())}

    def __bool__(self) -> bool:
        return bool(self.examples)


def decontamination_report(index: EvalIndex, matches: dict[str, list], warn_documents_per_example: int,
                           max_listed: int = 100, max_ids: int = 20) -> dict:
    """Per eval set: examples and matches by length class and rule, and the documents each example removed.

    Args:
      index: the eval index the build matched with.
      matches: removed document id -> its ``eval_matches`` (``[set, example index, rule]`` rows, `EvalIndex.match`).
      warn_documents_per_example: an example that removed more documents than this is warned about (0: never).
      max_listed: at most this many matched examples are listed per set (most documents first).
      max_ids: at most this many removed document ids are listed per matched example (sorted; the decision log
        has them all: rows whose ``eval_matches`` hold ``[set, index, rule]`` with the example's ``index``).
    Returns:
      ``{"eval_sets": {set: report}, "warnings": [str]}``. A set's report holds ``examples``, ``documents_removed``
      (distinct documents it removed), ``by_length_class`` (per class: ``words`` (the range), ``rule``,
      ``examples``, ``examples_matched``, ``documents_removed``), ``empty_examples`` (ids of examples with no word,
      which match nothing), ``matched_examples`` (``id``, ``index`` (0-based position in its set, as in
      ``eval_matches``), ``length_class``, ``n_words``, ``rule``, ``documents_removed``, ``document_ids``, ``text``) and ``matched_examples_not_listed``.
    """
    n, m = index.ngram, index.min_ngram
    words = {"long": f">={n}", "medium": f"{m}-{n - 1}" if m < n else None,
             "short": f"1-{m - 1}" if m > 1 else None, "empty": "0"}
    docs_by_example: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    for doc_id, rows in matches.items():
        for s, i, _ in rows:
            docs_by_example[(s, i)].add(doc_id)
    sets, warnings = {}, []
    for s, examples in sorted(index.examples.items()):
        by_class = {}
        for cls, rule in DECONTAM_RULES.items():
            idx = [i for i, e in enumerate(examples) if e["length_class"] == cls]
            hit = [i for i in idx if docs_by_example.get((s, i))]
            by_class[cls] = {"words": words[cls], "rule": rule, "examples": len(idx), "examples_matched": len(hit),
                             "documents_removed": len(set().union(*(docs_by_example[(s, i)] for i in hit)))}
        matched = sorted(((len(docs_by_example[(s, i)]), i) for i in range(len(examples))
                          if docs_by_example.get((s, i))), key=lambda x: (-x[0], examples[x[1]]["id"]))
        listed = [dict(id=examples[i]["id"], index=i, length_class=examples[i]["length_class"],
                       n_words=examples[i]["n_words"], rule=DECONTAM_RULES[examples[i]["length_class"]],
                       documents_removed=d, document_ids=sorted(docs_by_example[(s, i)])[:max_ids],
                       text=examples[i]["text"][:80]) for d, i in matched[:max_listed]]
        empty = [e["id"] for e in examples if e["length_class"] == "empty"]
        sets[s] = {"examples": len(examples),
                   "documents_removed": len({d for (s2, _), ds in docs_by_example.items() if s2 == s for d in ds}),
                   "by_length_class": by_class, "empty_examples": empty, "matched_examples": listed,
                   "matched_examples_not_listed": max(0, len(matched) - max_listed)}
        if not examples:
            warnings.append(f"decontamination: eval set '{s}' has no example")
        if empty:
            warnings.append(f"decontamination: eval set '{s}' has {len(empty)} example(s) with no word after "
                            f"normalization, which match nothing: {', '.join(empty[:10])}")
        for d, i in matched:
            if warn_documents_per_example and d > warn_documents_per_example:
                e = examples[i]
                warnings.append(f"decontamination: example '{e['id']}' of eval set '{s}' ({e['n_words']} words, "
                                f"rule {DECONTAM_RULES[e['length_class']]}) removed {d} documents > "
                                f"DecontamConfig.warn_documents_per_example = {warn_documents_per_example}: "
                                f"{e['text'][:60]!r}")
    return {"eval_sets": sets, "warnings": warnings}


# ---------------------------------------------------------------- stage 9: quotas


def uniform(seed: int, doc_id: str) -> float:
    """Deterministic U[0, 1) draw from (seed, id): the first 8 bytes of sha256, over 2**64."""
    h = hashlib.sha256(f"{seed}\x00{doc_id}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def _solve_increasing(f, target: float, lo: float, hi: float, iters: int = 100) -> float:
    """The largest x in [lo, hi] with f(x) <= target, for nondecreasing f (bisection)."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def quota_keep_fractions(chars: dict[tuple[str, str], int], cfg: QuotaConfig) -> dict[str, float]:
    """Share of its characters each ``"domain/lang"`` group keeps (a float in [0, 1]).

    Args:
      chars: characters available per (domain, language) after stages 2-8.
    Returns:
      ``{"domain/lang": fraction}``; `quota_cutoff` turns a fraction into a deterministic selection.

    With A_d the characters of domain d and w_d its target share, the output total is T = min_d A_d / w_d
    (the largest total no domain must upsample for), so domain d's budget is B_d = w_d * T <= A_d characters.
    Within the domain, group g (c_g characters) keeps k_g = max(p_d * c_g, min(c_g, F_d)) characters, where the
    floor F_d = min(long_tail_floor * long_tail_share * B_d, F*) and p_d solves sum_g k_g = B_d (F* is the floor
    at which the floors alone fill the budget). k_g is nondecreasing in c_g, so a smaller group never keeps
    more text than a larger one (no cliff at `long_tail_share`), and each domain's total meets its budget exactly.
    """
    if not cfg.enabled or not cfg.targets:
        return {f"{d}/{l}": 1.0 for d, l in chars}
    groups: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (d, lang), c in chars.items():
        groups[d][lang] = c
    per_domain = {d: sum(g.values()) for d, g in groups.items()}
    live = {d: a for d, a in per_domain.items() if a > 0 and cfg.targets.get(d, 0) > 0}
    total = min(a / cfg.targets[d] for d, a in live.items()) if live else 0.0
    out = {}
    for d, g in sorted(groups.items()):
        if d not in live:
            out.update({f"{d}/{lang}": 0.0 for lang in g})
            continue
        budget = min(float(per_domain[d]), cfg.targets[d] * total)
        sizes = list(g.values())
        floor = cfg.long_tail_floor * cfg.long_tail_share * budget
        floor = min(floor, _solve_increasing(lambda f: sum(min(c, f) for c in sizes), budget, 0.0, max(sizes)))
        p = _solve_increasing(lambda q: sum(max(q * c, min(c, floor)) for c in sizes), budget, 0.0, 1.0)
        for lang, c in sorted(g.items()):
            out[f"{d}/{lang}"] = min(1.0, max(p * c, min(c, floor)) / c) if c else 0.0
    return out


def quota_cutoff(items: list[tuple[float, str, int]], fraction: float) -> float:
    """Hash cutoff that keeps `fraction` of a group's characters by rank, not by independent coin flips.

    Args:
      items: (``uniform(seed, id)``, id, characters) of every document of one (domain, language) group.
      fraction: share of the group's characters to keep (`quota_keep_fractions`).
    Returns:
      u* such that the group's documents with ``uniform(seed, id) < u*`` are kept: the shortest prefix of the
      documents ranked by their seeded hash whose characters reach the budget ``fraction * total`` to the nearest
      document (a document is kept while the characters before it plus half its own are within budget). 2.0
      keeps every document. Deterministic: same ids, seed and fraction give the same selection.
    """
    ranked = sorted(items)
    budget = fraction * sum(n for _, _, n in ranked)
    before = 0
    for u, _, n in ranked:
        if before + n / 2 > budget:
            return u
        before += n
    return 2.0


def quota_share_warnings(kept_chars: dict[str, int], targets: dict[str, float], tolerance: float) -> list[str]:
    """One message per domain whose realized share of kept characters strays from its target by more than
    `tolerance` (absolute, e.g. 0.02 = 2 points). Empty if there are no targets or no kept text."""
    total = sum(kept_chars.values())
    if not targets or not total:
        return []
    out = []
    for d, w in sorted(targets.items()):
        share = kept_chars.get(d, 0) / total
        if abs(share - w) > tolerance:
            out.append(f"quota: domain '{d}' realized share {share:.4f} of kept characters vs target {w:.4f} "
                       f"(off by {abs(share - w):.4f} > QuotaConfig.share_tolerance = {tolerance})")
    return out


def entropy_bits(p: list[float]) -> float:
    """Shannon entropy in bits of a distribution (helper for reports)."""
    return -sum(x * math.log2(x) for x in p if x > 0)
