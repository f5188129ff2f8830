"""Decontamination of evaluation examples against a training split by word n-gram overlap.

An example is *contaminated* when any of its lower-cased word ``n``-grams (13 by default, the GPT-3 rule:
Brown et al. 2020, app. C) occurs anywhere in the training text. An example with fewer than ``n`` words but
at least ``min_words`` is checked with its whole word sequence as one n-gram (it is contaminated if that exact
word sequence occurs in training); an example with fewer than ``min_words`` words cannot be checked and is
dropped as ``too_short``.

Words are ``\\w+`` runs, except that each CJK ideograph or kana is one word (Chinese and Japanese have no
spaces), the same rule as ``data_pipelines`` uses for its own decontamination, so eval sets exported from
here decontaminate a corpus build consistently. N-grams are compared by 64-bit hashes (crc32 per word, a
position-weighted sum, then the splitmix64 finalizer); a false match needs a 64-bit collision.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Iterable, Sequence

import numpy as np

_WORD_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|\w+")
#: Per-position uint64 multipliers of the n-gram hash (odd multiples of the golden-ratio constant; n <= 64).
NGRAM_MULT = np.array([(0x9E3779B97F4A7C15 * (2 * j + 1)) % (1 << 64) for j in range(64)], dtype=np.uint64)


def words(text: str) -> list[str]:
    """Lower-cased words of ``text`` (see the module docstring)."""
    return _WORD_RE.findall(text.lower())


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer (Steele et al. 2014), elementwise on uint64."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _word_hashes(word_list: Sequence[str]) -> np.ndarray:
    return np.fromiter((zlib.crc32(w.encode("utf-8")) for w in word_list), np.uint64, count=len(word_list))


def combine_word_hashes(wh: np.ndarray, n: int) -> np.ndarray:
    """uint64 ``[max(0, len(wh) - n + 1)]``: the hash of every n-gram of the uint64 word hashes ``wh [W]`` (crc32
    per word), the position-weighted sum (wrapping uint64, :data:`NGRAM_MULT`) through the splitmix64 finalizer.
    The one n-gram hash of jaxpt: the trainer's probe decontamination and the corpus build
    (`data_pipelines.steps.decontamination`) both use it, so their matches agree. Requires n <= 64."""
    m = len(wh) - n + 1
    if m <= 0:
        return np.zeros(0, np.uint64)
    acc = np.zeros(m, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc += wh[j:j + m] * NGRAM_MULT[j]
    return _mix64(acc)


def ngram_hashes(word_list: Sequence[str], n: int) -> np.ndarray:
    """uint64 hashes of every word n-gram of ``word_list`` (shape [max(0, len - n + 1)]), 1 <= n <= 64."""
    if not 1 <= n <= 64:
        raise ValueError(f"n-gram size {n} not in [1, 64]")
    return combine_word_hashes(_word_hashes(word_list), n)


class NgramIndex:
    """Word n-gram hashes of a training split, built once and queried for any n-gram size.

    Words are hashed in one pass over the texts; the n-grams of a given size are computed (vectorized, never
    across a document boundary) and kept sorted the first time that size is asked for.

    Args:
      texts: the training documents (iterated once).
    """

    def __init__(self, texts: Iterable[str]):
        ids: list[np.ndarray] = []
        vocab: dict[str, int] = {}
        self.num_documents = 0
        for text in texts:
            ids.append(np.fromiter((vocab.setdefault(w, len(vocab)) for w in words(text)), np.int64))
            self.num_documents += 1
        word_hash = _word_hashes(list(vocab))
        lengths = np.array([len(x) for x in ids], np.int64)
        flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        self._hashes = word_hash[flat] if len(flat) else np.zeros(0, np.uint64)
        self._doc = np.repeat(np.arange(len(lengths)), lengths)
        self.num_words = int(len(flat))
        self._by_n: dict[int, np.ndarray] = {}

    def ngrams(self, n: int) -> np.ndarray:
        """Sorted uint64 hashes of every word n-gram inside one training document (duplicates kept)."""
        if n not in self._by_n:
            h = combine_word_hashes(self._hashes, n)
            inside = self._doc[:len(h)] == self._doc[n - 1:n - 1 + len(h)]
            self._by_n[n] = np.sort(h[inside])  # np.unique's hash path is slow on uint64
        return self._by_n[n]

    def contains(self, hashes: np.ndarray, n: int) -> np.ndarray:
        """bool array: which of ``hashes`` (n-gram hashes of size ``n``) occur in the training split."""
        table = self.ngrams(n)
        if not len(table) or not len(hashes):
            return np.zeros(len(hashes), bool)
        pos = np.clip(np.searchsorted(table, hashes), 0, len(table) - 1)
        return table[pos] == hashes


@dataclasses.dataclass
class DecontamResult:
    """Verdict per example: ``clean`` bool [num_examples], and ``reason`` per example (``""``, ``too_short``
    or ``contaminated``)."""

    clean: np.ndarray
    reason: list[str]

    def counts(self) -> dict[str, int]:
        out = {"kept": int(self.clean.sum()), "too_short": 0, "contaminated": 0}
        for r in self.reason:
            if r:
                out[r] += 1
        return out


def decontaminate(example_texts: Sequence[str], index: NgramIndex, *, n: int = 13,
                  min_words: int = 8) -> DecontamResult:
    """Which examples share no word n-gram with the training split (see the module docstring).

    Args:
      example_texts: the full text of each example (prompt and answer together).
      index: the training split's :class:`NgramIndex`.
      n: n-gram size in words.
      min_words: examples with fewer words are dropped as ``too_short``.

    Returns: a :class:`DecontamResult`.

    Raises:
      ValueError: ``min_words`` not in [1, n].
    """
    if not 1 <= min_words <= n:
        raise ValueError(f"decontaminate: need 1 <= min_words <= n, got min_words={min_words}, n={n}")
    reason = [""] * len(example_texts)
    for i, text in enumerate(example_texts):
        w = words(text)
        if len(w) < min_words:
            reason[i] = "too_short"
        elif index.contains(ngram_hashes(w, min(n, len(w))), min(n, len(w))).any():
            reason[i] = "contaminated"
    clean = np.array([r == "" for r in reason], bool)
    return DecontamResult(clean, reason)
