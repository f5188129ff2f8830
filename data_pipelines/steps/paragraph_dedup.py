"""Paragraph dedup: units (paragraphs or lines) recurring in more than `max_documents` documents are removed.

A document is cut into *units* (`ParagraphDedupConfig.unit`): paragraphs, the text between blank lines, or lines.
A unit of at least `min_words` words (`minhash.words`) is *eligible*; it is identified by `exact_dedup.exact_key` of its
text, the sha256 of the text with whitespace runs collapsed to one space and case folded, the normalization of
document-level exact dedup: the same licence block or navigation bar comes re-wrapped and re-indented (man pages
rendered at another width, HTML extraction spacing) and in other capitals (``COPYRIGHT``), while punctuation, digits
and words stay significant (a different year or name is a different paragraph to exact matching; near matching
(`ParagraphDedupConfig.match = 'near'`) is what tolerates such edits, on units long enough for an edit to be told
from another text, `near_min_words`). Shorter units (headings such as ``SEE ALSO``, closing braces, signatures) are
never removed: they are structure, not boilerplate.

`split_units` keeps the separators, so `remove_units` with nothing to remove gives back the text unchanged, byte for
byte, and a removal keeps the spacing of the text around it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction

import apache_beam as beam
import gin

from jaxpt.util.errors import ConfigError

from data_pipelines import minhash
from data_pipelines.steps import base, exact_dedup, near_dedup
from data_pipelines.steps import rules as rules_step


@gin.configurable
@dataclasses.dataclass
class ParagraphDedupConfig:
    """Off by default: units (paragraphs between blank lines, or lines: `unit`) that recur in more than
    `max_documents` distinct documents are removed from every document that holds them .

    Counting runs on the documents that survived exact and near dedup, so a document copied a hundred times does not
    make its own paragraphs look like boilerplate; a unit repeated inside one document counts once. Units of fewer
    than `min_words` words (headings, braces, signatures) are never removed. ``match = 'exact'`` compares units by
    `exact_dedup.exact_key` (whitespace collapsed, case folded); ``'near'`` (the default) also joins units whose MinHash
    estimate of word-`shingle_size`-gram Jaccard with a cluster's centre is at least `threshold`, found through LSH
    (`bands` x `rows` of `num_perm` permutations, `minhash.MinHasher` with `seed`), and counts distinct documents
    over the cluster (`star_cluster`); only units of at least `near_min_words` words (19 at
    the defaults) are near-matched, since below that one substituted word already takes the true Jaccard under
    `threshold`: a near match there joins distinct texts of one template, not edits of one paragraph.

    A document that loses units and is left with no word is dropped as ``paragraph_dedup:all_removed``; one left
    under its rules' minimum length (`RuleConfig.min_words`, `RuleConfig.min_chars` of its domain and source) as
    ``paragraph_dedup:too_short_after_removal``. Documents of `skip_domains` and `skip_sources` are neither counted
    nor changed: by default code, where a repeated block (the classes every generated codec module repeats) is part of
    the program, and removing it breaks the file.

    `max_documents` = 10: in a sample of raw-v1's man pages, dictionaries and fortunes, paragraphs found in 3 to 10
    documents were mostly text related pages share as content (one option described in ``ls``, ``dir`` and ``vdir``,
    an untranslated code example), those in more than 10 mostly translation credits, licence and bug-report notes and
    the standard ``--help`` and ``--version`` lines.
    """

    enabled: bool = False
    unit: str = "paragraph"
    max_documents: int = 10
    min_words: int = 5
    match: str = "near"
    shingle_size: int = 3
    num_perm: int = 64
    bands: int = 16
    rows: int = 4
    threshold: float = 0.7
    seed: int = 1
    skip_domains: tuple[str, ...] = ("code",)
    skip_sources: tuple[str, ...] = ()

    def validate(self):
        """Raises ConfigError naming the field: an unknown `unit` or `match`, `max_documents` < 1, `min_words` < 1,
        `bands` * `rows` > `num_perm`, or `threshold` outside (0, 1]."""
        if self.unit not in ("paragraph", "line"):
            raise ConfigError(f"ParagraphDedupConfig.unit = {self.unit!r} must be 'paragraph' or 'line'")
        if self.match not in ("exact", "near"):
            raise ConfigError(f"ParagraphDedupConfig.match = {self.match!r} must be 'exact' or 'near'")
        for name in ("max_documents", "min_words", "shingle_size", "num_perm", "bands", "rows"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"ParagraphDedupConfig.{name} = {v!r} must be an integer >= 1")
        if self.bands * self.rows > self.num_perm:
            raise ConfigError(f"ParagraphDedupConfig: bands*rows = {self.bands * self.rows} > num_perm = "
                              f"{self.num_perm}")
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"ParagraphDedupConfig.threshold = {self.threshold} must be in (0, 1]")

    def check(self, sources: list) -> None:
        """Resolve phase (when enabled): `validate`, and every `skip_sources` name is registered."""
        if not self.enabled:
            return
        self.validate()
        names = [s.name for s in sources]
        for q in self.skip_sources:
            if q not in names:
                raise ConfigError(f"ParagraphDedupConfig.skip_sources: '{q}' is not a registered source")

    def operative(self, out: dict) -> dict | None:
        """Listed only when enabled, so a build with it off has the operative config, content id and manifest of a
        build made before it existed."""
        return out if self.enabled else None

# A paragraph ends at a run of blank lines (lines holding only spaces or tabs); a line at its newline.
_SEPARATOR = {"paragraph": re.compile(r"(\n(?:[^\S\n]*\n)+)"), "line": re.compile(r"(\n)")}
UNITS = tuple(_SEPARATOR)
# How many leading characters of a removed unit the decision log shows (the log's ``sample`` is 200 characters
# for a whole document; a document may lose many units).
LOG_CHARS = 60
HASH_CHARS = 16  # hex digits of `exact_dedup.exact_key` shown in the decision log (64 bits)
# Why a unit goes, by the rank its flag carries (`dedup_document`): its own normalized text recurs (exact), or only
# its near-duplicate cluster does (near).
EXACT, NEAR = 0, 1
# Why a document goes (stage ``paragraph_dedup``): no word is left, or what is left is under the rules' minimum
# length for its domain and source (`RuleConfig.min_words`, `RuleConfig.min_chars`).
ALL_REMOVED, TOO_SHORT = "all_removed", "too_short_after_removal"


def near_min_words(shingle_size: int, threshold: float) -> int:
    """The fewest words a unit needs to be near-matched at all (shorter units are matched exactly only).

    One word substituted inside a unit of ``n`` words changes ``s = shingle_size`` of its ``m = n - s + 1`` word
    shingles, so the true Jaccard of the two is ``(m - s) / (m + s)``: at least ``threshold`` only when
    ``m >= s (1 + t) / (1 - t)``. Below that length a near match cannot be "the same paragraph with an edit"; it is
    the MinHash estimate's noise, or a template whose filling differs (raw-v1's fortunes-de name jokes, 9 words that
    differ in their last two, were joined at shingle 3, threshold 0.7 before this rule). Shingle 3, threshold 0.7:
    19 words; the document stage's shingle 5, threshold 0.75: 39. ``threshold == 1`` near-matches no unit.
    """
    t = Fraction(threshold).limit_denominator(10**6)
    if t >= 1:
        return 1 << 62
    return math.ceil(shingle_size * (1 + t) / (1 - t)) + shingle_size - 1


def unit_reason(rank: int, unit: str) -> str:
    """``repeated_<unit>`` (rank `EXACT`) or ``near_repeated_<unit>`` (rank `NEAR`)."""
    return ("repeated_" if rank == EXACT else "near_repeated_") + unit


def split_units(text: str, unit: str) -> list[str]:
    """``[u0, s0, u1, s1, ..., un]``: units at even positions, the separators between them at odd ones, so that
    ``"".join(parts) == text``. A unit may be empty or blank (text starting or ending with a separator).

    Raises:
      ValueError: `unit` not in `UNITS`.
    """
    if unit not in _SEPARATOR:
        raise ValueError(f"unit = {unit!r} must be one of {list(UNITS)}")
    return _SEPARATOR[unit].split(text)


def eligible_units(parts: list[str], min_words: int) -> list[tuple[int, str, str]]:
    """``(position in parts, exact key, unit text)`` of every unit of `split_units` output `parts` with at least
    `min_words` words (and at least one), in order; a unit repeated inside the document is listed at each
    position."""
    out = []
    for i in range(0, len(parts), 2):
        n = len(minhash.words(parts[i]))
        if n and n >= min_words:
            out.append((i, exact_dedup.exact_key(parts[i]), parts[i]))
    return out


def remove_units(parts: list[str], remove: set[int]) -> str:
    """The text of `split_units` output `parts` without the units at positions `remove` (even indices).

    A removed unit goes with the separator before it (with the one after it if it is the first unit), so the
    spacing between the units that stay is what the text had there. With `remove` empty the result is
    ``"".join(parts)``.
    """
    out: list[str] = []
    for i in range(0, len(parts), 2):
        if i in remove:
            continue
        if out:
            out.append(parts[i - 1])
        out.append(parts[i])
    return "".join(out)


def log_entry(key: str, reason: str, text: str, centre: str | None = None) -> dict:
    """One removed unit as the decision log lists it: ``hash`` (the first `HASH_CHARS` hex digits of its exact key),
    ``reason``, ``bytes`` (UTF-8 bytes of the unit itself, separators not counted), ``text`` (its first `LOG_CHARS`
    characters) and, for a near match, ``cluster`` (the ``hash`` of its cluster's centre)."""
    out = {"hash": key[:HASH_CHARS], "reason": reason, "bytes": len(text.encode("utf-8")), "text": text[:LOG_CHARS]}
    if centre is not None and centre != key:
        out["cluster"] = centre[:HASH_CHARS]
    return out


def bottom_k(ids, k: int) -> tuple[str, ...]:
    """The `k` smallest distinct ids of `ids`, sorted. The bottom-k of a union is the bottom-k of the members'
    bottom-k, so a combiner that keeps only these knows exactly whether a unit is in more than ``k - 1``
    documents, with memory bounded by `k` whatever the number of documents."""
    return tuple(sorted(set(ids))[:k])


def star_cluster(members: list[tuple[str, "object", tuple[str, ...]]], threshold: float,
                 max_documents: int) -> list[tuple[str, str]]:
    """Near-duplicate units of one LSH bucket that together recur in more than `max_documents` documents.

    Args:
      members: ``(exact key, MinHash signature uint32[num_perm], bottom-k document ids)`` of the bucket's distinct
        units (k = max_documents + 1).
      threshold: minimum estimated Jaccard (`minhash.estimated_jaccard`) with the bucket's centre.
      max_documents: the `ParagraphDedupConfig` threshold.
    Returns:
      ``(key, centre key)`` of every member within `threshold` of the centre, when those members together are in
      more than `max_documents` distinct documents; else ``[]``. The centre is the member in most documents, then
      the smallest key. Each member is compared with the centre only (a star, not connected components), so a
      chain of small edits cannot join two unrelated paragraphs.
    """
    members = sorted(members, key=lambda m: (-len(m[2]), m[0]))
    centre_key, centre_sig, _ = members[0]
    near = [m for m in members if minhash.estimated_jaccard(m[1], centre_sig) >= threshold]
    docs = bottom_k((d for m in near for d in m[2]), max_documents + 1)
    if len(docs) <= max_documents:
        return []
    return [(m[0], centre_key) for m in near]


def dedup_document(text: str, unit: str, min_words: int, flags) -> tuple[str, list[dict]]:
    """`text` without its flagged units, and the decision-log entries (`log_entry`) of those removed, in order.

    Args:
      flags: exact key -> ``(rank, centre key)`` of every unit to remove (a mapping; rank `EXACT` or `NEAR`).
    Returns:
      ``(text, [])`` (the same text) when no unit of it is flagged.
    """
    parts = split_units(text, unit)
    remove, log = set(), []
    for i, key, u in eligible_units(parts, min_words):
        flag = flags.get(key)
        if flag is not None:
            remove.add(i)
            log.append(log_entry(key, unit_reason(flag[0], unit), u, flag[1] if flag[0] == NEAR else None))
    return (remove_units(parts, remove), log) if remove else (text, [])


def left_reason(text: str, rules: rules_step.RuleConfig | None) -> str | None:
    """Why a document that lost units is dropped, or None to keep it: `ALL_REMOVED` if no word is left;
    `TOO_SHORT` if `rules` (the rules of its domain and source, `RuleConfig.for_domain`; None when the rules stage
    is off) would drop what is left as ``too_few_words`` or ``too_short`` (each unless in `rules.skip`)."""
    n_words = len(minhash.words(text))
    if n_words == 0:
        return ALL_REMOVED
    if rules is None:
        return None
    if ("too_few_words" not in rules.skip and n_words < rules.min_words) or (
            "too_short" not in rules.skip and len(text) < rules.min_chars):
        return TOO_SHORT
    return None


REASONS = (ALL_REMOVED, TOO_SHORT)


def _paragraph_counted(doc: dict, cfg) -> bool:
    """Whether paragraph dedup counts and edits `doc` (`ParagraphDedupConfig.skip_domains`, `skip_sources`)."""
    return doc["domain"] not in cfg.skip_domains and doc["source"] not in cfg.skip_sources


def _unit_occurrences(doc: dict, cfg):
    """(exact key, (document id, unit text)) once per distinct eligible unit of a counted document."""
    if not _paragraph_counted(doc, cfg):
        return
    seen = set()
    for _, key, text in eligible_units(split_units(doc["text"], cfg.unit), cfg.min_words):
        if key not in seen:
            seen.add(key)
            yield key, (doc["id"], text)


class UnitDocuments(beam.CombineFn):
    """Per unit key: ``(the k smallest ids of the documents holding it, its smallest text)``
    (`bottom_k`): exact about "more than k - 1 documents" with at most k ids per key, however hot."""

    def __init__(self, k: int):
        self.k = k

    def create_accumulator(self):
        return (), None

    def add_input(self, acc, item):
        doc_id, text = item
        ids, t = acc
        return bottom_k(ids + (doc_id,), self.k), text if t is None or text < t else t

    def merge_accumulators(self, accs):
        accs = list(accs)
        texts = [t for _, t in accs if t is not None]
        return bottom_k([i for ids, _ in accs for i in ids], self.k), min(texts) if texts else None

    def extract_output(self, acc):
        return acc


class UnitSignature(beam.DoFn):
    """(key, (ids, text)) -> (key, (MinHash signature uint32[num_perm] of the text's word shingles, ids)), for units
    of at least `near_min_words` words; a shorter unit gets none (it is matched exactly only)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        self.hasher = minhash.MinHasher(self.cfg.num_perm, self.cfg.shingle_size, self.cfg.seed)
        self.min_words = near_min_words(self.cfg.shingle_size, self.cfg.threshold)

    def process(self, kv):
        key, (ids, text) = kv
        if len(minhash.words(text)) < self.min_words:
            return
        sig = self.hasher.signature(text)
        if sig is not None:
            yield key, (sig, ids)


def paragraph_flags(units, cfg):
    """PCollection of (unit key, (rank, centre key)) for every unit to remove (`dedup_document`).

    `units`: (key, (document id, text)) occurrences. A key in more than `max_documents` documents is flagged
    ``(EXACT, key)``; with ``match = 'near'``, the members of an LSH bucket that `star_cluster` joins are
    flagged ``(NEAR, centre)`` (the document stage's banding and join, `near_dedup.near_dedup`); a key flagged both ways keeps
    the smaller rank."""
    t = cfg.max_documents
    stats = units | "ParagraphDocs" >> beam.CombinePerKey(UnitDocuments(t + 1))
    exact = (stats | "ParagraphRecurring" >> beam.Filter(lambda kv, t: len(kv[1][0]) > t, t)
             | "ParagraphExactFlag" >> beam.Map(lambda kv: (kv[0], (EXACT, kv[0]))))
    if cfg.match == "exact":
        return exact
    sigs = stats | "ParagraphMinHash" >> beam.ParDo(UnitSignature(cfg))
    near = (
        near_dedup.lsh_buckets(sigs, cfg.bands, cfg.rows, prefix="Paragraph")
        | "ParagraphClusters" >> beam.FlatMap(
            lambda kv, c: star_cluster(list(kv[1]), c.threshold, c.max_documents), cfg)
        | "ParagraphNearFlag" >> beam.Map(lambda kc: (kc[0], (NEAR, kc[1])))
    )
    return (exact, near) | "ParagraphFlags" >> beam.Flatten() | "ParagraphFlagRank" >> beam.CombinePerKey(min)


class ApplyParagraphs(beam.DoFn):
    """Removes a document's flagged units (`dedup_document`); the document keeps the decision-log entries
    as ``paragraphs_removed``. One left with no word, or under its rules' minimum length, drops instead
    (`left_reason`), its decision row naming the units it lost."""

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        self.rules = {}

    def process(self, doc, flags):
        pc = self.cfg.paragraphs
        if not flags or not _paragraph_counted(doc, pc):
            yield doc
            return
        text, log = dedup_document(doc["text"], pc.unit, pc.min_words, flags)
        if not log:
            yield doc
            return
        rules = None
        if self.cfg.rules.enabled:
            key = (doc["domain"], doc["source"])
            rules = self.rules.get(key)
            if rules is None:
                rules = self.rules[key] = self.cfg.rules.for_domain(*key)
        reason = left_reason(text, rules)
        if reason:
            yield beam.pvalue.TaggedOutput(base.DROPS, base.decision(doc, "paragraph_dedup", reason, paragraphs_removed=log))
        else:
            yield dict(doc, text=text, paragraphs_removed=log)


def _paragraph_stage(docs, ctx: base.Context, cfg):
    """Paragraph dedup (`ParagraphDedupConfig`): returns the documents without their recurring units."""
    units = docs | "ParagraphUnits" >> beam.FlatMap(_unit_occurrences, cfg.paragraphs)
    flags = beam.pvalue.AsDict(paragraph_flags(units, cfg.paragraphs))
    return base.with_drops(docs, "ApplyParagraphs", beam.ParDo(ApplyParagraphs(cfg), flags), ctx)


class ParagraphDedup(base.Step):
    name = stage = "paragraph_dedup"
    config_field = "paragraphs"
    config = ParagraphDedupConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        return _paragraph_stage(docs, ctx, ctx.cfg) if ctx.cfg.paragraphs.enabled else docs

    def record(self, facts: base.Facts) -> dict:
        cfg = facts.cfg
        if not cfg.paragraphs.enabled:
            return {}
        return {"paragraph_dedup": dict(
            facts.operative["paragraphs"], key="sha256(casefold(collapse_whitespace(unit)))",
            units="paragraph: text between blank lines; line: text between newlines",
            counted_on="documents that survived exact and near dedup, each once per distinct unit",
            near_clusters="each bucket member against the bucket's centre (most documents, then smallest key)",
            near_min_words=near_min_words(cfg.paragraphs.shingle_size, cfg.paragraphs.threshold),
        )}
