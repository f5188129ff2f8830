"""Per-document logic of paragraph (or line) dedup, stage 6b, free of Beam so tests and benchmarks call it directly.

A document is cut into *units* (`ParagraphDedupConfig.unit`): paragraphs, the text between blank lines, or lines.
A unit of at least `min_words` words (`minhash.words`) is *eligible*; it is identified by `stages.exact_key` of its
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

import math
import re
from fractions import Fraction

from data_pipelines import minhash, stages
from data_pipelines.config import RuleConfig

# A paragraph ends at a run of blank lines (lines holding only spaces or tabs); a line at its newline.
_SEPARATOR = {"paragraph": re.compile(r"(\n(?:[^\S\n]*\n)+)"), "line": re.compile(r"(\n)")}
UNITS = tuple(_SEPARATOR)
# How many leading characters of a removed unit the decision log shows (the log's ``sample`` is 200 characters
# for a whole document; a document may lose many units).
LOG_CHARS = 60
HASH_CHARS = 16  # hex digits of `stages.exact_key` shown in the decision log (64 bits)
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
            out.append((i, stages.exact_key(parts[i]), parts[i]))
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


def left_reason(text: str, rules: RuleConfig | None) -> str | None:
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
