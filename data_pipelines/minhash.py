"""Vectorized MinHash signatures, LSH banding, candidate verification, connected components.

Near-duplicate detection follows Broder (1997), "On the resemblance and containment of documents":
the probability that two sets share a min-hash under a random permutation equals their Jaccard
similarity, so the fraction of equal signature entries estimates Jaccard. LSH banding (Leskovec,
Rajaraman & Ullman, *Mining of Massive Datasets*, ch. 3.4) turns signatures into candidate pairs:
a pair with Jaccard J collides in at least one of `b` bands of `r` rows with probability
``1 - (1 - J**r)**b``.

Unlike a plain LSH index, a candidate pair only becomes a graph edge when its *estimated* Jaccard
(equal entries over all `num_perm` permutations) reaches `threshold`. That removes the band
collisions of dissimilar pairs that make plain LSH over-merge, while the loose banding keeps
recall high for pairs above the threshold.

Shingles are word n-grams over `words()`: lower-cased `\\w+` runs, with each CJK/kana character
its own word (those scripts do not separate words with spaces). A document with fewer words than
the shingle size gets exactly one shingle, the hash of its whole word sequence: it can only match a
document with the same word sequence, and short documents never collapse into one shared signature.
A document with no word at all has no signature (`None`) and is left out of near dedup.

Permutations are Dietzfelbinger's (1996) multiply-add-shift hashes
``h_i(x) = ((a_i * x + b_i) mod 2**64) >> 32`` of 32-bit shingle hashes `x`, with random 64-bit
`a_i`, `b_i`: a 2-independent family that numpy evaluates with wrapping uint64 arithmetic in three
vector operations. (A Carter-Wegman hash mod the Mersenne prime 2**61 - 1 needs `a_i` drawn from the
whole field, hence 93-bit products; restricting `a_i` to 32 bits to stay inside uint64 makes
``a_i * x`` barely wrap, so the minimum goes to the numerically smallest shingle and unrelated short
documents look alike. We measured exactly that failure before choosing multiply-add-shift.)
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import Iterable, Sequence

import numpy as np

_WORD_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|\w+")
# Bounds the (shingles x permutations) uint64 block: 4096 x 256 x 8 B = 8 MiB.
_CHUNK_ROWS = 4096
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@functools.lru_cache(maxsize=1 << 20)
def _word_hash(word: str) -> int:
    # Memoized: natural text repeats words, and a C-level cache hit beats encode + crc32.
    return zlib.crc32(word.encode("utf-8"))


def words(text: str) -> list[str]:
    """Lower-cased word tokens used for shingling (CJK and kana characters count as one word each)."""
    return _WORD_RE.findall(text.lower())


def word_shingles(text: str, k: int) -> set[tuple[str, ...]]:
    """Exact set of word k-grams (the reference the MinHash estimate approximates).

    Uses the same short-document rule as `MinHasher`: fewer than `k` words give one shingle made of
    all the words; no words give the empty set.
    """
    w = words(text)
    if not w:
        return set()
    if len(w) < k:
        return {tuple(w)}
    return {tuple(w[i : i + k]) for i in range(len(w) - k + 1)}


def jaccard(a: set, b: set) -> float:
    """Exact Jaccard similarity |a & b| / |a | b| (0.0 when both are empty)."""
    if not a and not b:
        return 0.0
    if len(a) > len(b):
        a, b = b, a
    inter = sum(1 for x in a if x in b)
    return inter / (len(a) + len(b) - inter)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer (Steele et al., 2014): avalanches uint64 values, wrapping arithmetic."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class MinHasher:
    """Computes MinHash signatures of documents' word-shingle sets.

    Args:
      num_perm: number of hash permutations (signature length).
      shingle_size: words per shingle (k).
      seed: seeds the permutation coefficients; same seed, same signatures on any machine.

    `signature(text)` returns a ``uint32[num_perm]`` array or ``None`` for a text without words.
    """

    def __init__(self, num_perm: int = 256, shingle_size: int = 5, seed: int = 1):
        if num_perm <= 0 or shingle_size <= 0:
            raise ValueError(f"num_perm and shingle_size must be positive, got {num_perm}, {shingle_size}")
        self.num_perm = num_perm
        self.shingle_size = shingle_size
        rng = np.random.Generator(np.random.PCG64(seed))
        self._a = rng.integers(0, 1 << 64, size=(1, num_perm), dtype=np.uint64, endpoint=False) | np.uint64(1)
        self._b = rng.integers(0, 1 << 64, size=(1, num_perm), dtype=np.uint64, endpoint=False)
        # Position multipliers that combine k word hashes into one shingle hash (order-sensitive).
        self._pos = rng.integers(1, 1 << 63, size=shingle_size, dtype=np.uint64) | np.uint64(1)
        self._buf = None

    def shingle_hashes(self, text: str) -> np.ndarray | None:
        """32-bit shingle hashes, ``uint64[n]`` (deduplicated when n > 64), or None without words."""
        w = words(text)
        if not w:
            return None
        wh = np.fromiter(map(_word_hash, w), dtype=np.uint64, count=len(w))
        k = self.shingle_size
        if len(w) < k:
            # One shingle of the whole (short) word sequence; position weights keep it order-sensitive.
            acc = np.array([np.sum(wh * self._pos[: len(w)], dtype=np.uint64) + np.uint64(len(w))],
                           dtype=np.uint64)
        else:
            n = len(w) - k + 1
            acc = np.zeros(n, dtype=np.uint64)
            for j in range(k):
                acc += wh[j : j + n] * self._pos[j]
        h = _mix64(acc + _GOLDEN) >> np.uint64(32)
        # Repeated shingles cannot change a minimum; dropping them pays off only on longer texts.
        return np.unique(h) if h.size > 64 else h

    def signature_from_hashes(self, h: np.ndarray) -> np.ndarray:
        """MinHash signature ``uint32[num_perm]`` of 32-bit shingle hashes ``h`` (``uint64[n]``, n>0)."""
        sig = np.full(self.num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
        if self._buf is None:
            # Reused scratch block: fresh multi-MiB temporaries per document cost page faults.
            self._buf = np.empty((_CHUNK_ROWS, self.num_perm), dtype=np.uint64)
        for start in range(0, len(h), _CHUNK_ROWS):
            chunk = h[start : start + _CHUNK_ROWS, None]
            x = self._buf[: chunk.shape[0]]
            np.multiply(chunk, self._a, out=x)  # wraps mod 2**64 by design
            x += self._b
            np.minimum(sig, x.min(axis=0), out=sig)
        # The minimum of the full 64-bit values orders by their top 32 bits first, so shifting after
        # the min equals the min of the shifted hashes.
        return (sig >> np.uint64(32)).astype(np.uint32)

    def signature(self, text: str) -> np.ndarray | None:
        """MinHash signature of `text` (``uint32[num_perm]``), or None when it has no words."""
        h = self.shingle_hashes(text)
        return None if h is None else self.signature_from_hashes(h)


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One bucket key per band, ``uint64[bands]``: a hash of the band's `rows` signature values (``sig``: ``uint32[num_perm]``).

    Raises ValueError if ``bands * rows`` exceeds the signature length.
    """
    if bands * rows > sig.shape[0]:
        raise ValueError(f"bands*rows = {bands * rows} exceeds num_perm = {sig.shape[0]}")
    block = sig[: bands * rows].reshape(bands, rows).astype(np.uint64)
    weights = _mix64(np.arange(1, rows + 1, dtype=np.uint64)) | np.uint64(1)
    return _mix64(np.sum(block * weights, axis=1, dtype=np.uint64))


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Fraction of equal signature entries: an unbiased estimate of the shingle sets' Jaccard."""
    return float(np.count_nonzero(sig_a == sig_b)) / sig_a.shape[0]


def verified_pairs(ids: Sequence[str], sigs: np.ndarray, threshold: float) -> list[tuple[str, str]]:
    """Pairs of one LSH bucket whose estimated Jaccard is at least `threshold`.

    Args:
      ids: document ids of the bucket members (m of them).
      sigs: their signatures, ``uint32[m, num_perm]``.
      threshold: minimum estimated Jaccard in [0, 1].
    Returns pairs ``(a, b)`` with ``a < b``.
    """
    m = len(ids)
    out = []
    for i in range(m - 1):
        est = np.count_nonzero(sigs[i + 1 :] == sigs[i], axis=1) / sigs.shape[1]
        for off in np.nonzero(est >= threshold)[0]:
            a, b = ids[i], ids[i + 1 + int(off)]
            out.append((a, b) if a < b else (b, a))
    return out


def representative_key(doc_id: str, n_chars: int) -> tuple[int, str]:
    """Sort key of the representative rule: the longest document wins, then the smallest id."""
    return (-n_chars, doc_id)


def connected_components(
    edges: Iterable[tuple[str, str]], n_chars: dict[str, int]
) -> dict[str, str]:
    """Maps every document on an edge to its cluster representative (union-find).

    Args:
      edges: verified duplicate pairs of document ids.
      n_chars: characters per document on an edge (used by `representative_key`).
    Returns ``{doc_id: representative_id}`` for every node of a component of size >= 2 (the
    representative maps to itself).
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for a, b in edges:
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[str, list[str]] = {}
    for x in parent:
        members.setdefault(find(x), []).append(x)
    out = {}
    for group in members.values():
        rep = min(group, key=lambda d: representative_key(d, n_chars[d]))
        for d in group:
            out[d] = rep
    return out


def near_dedup_in_memory(
    docs: Iterable[tuple[str, str]],
    *,
    num_perm: int = 256,
    shingle_size: int = 5,
    bands: int = 42,
    rows: int = 6,
    threshold: float = 0.75,
    seed: int = 1,
    max_bucket: int = 64,
    candidates: set | None = None,
) -> dict[str, str]:
    """Single-process near dedup with the same functions the Beam stage uses.

    Args:
      docs: ``(doc_id, text)`` pairs with unique ids.
      max_bucket: buckets larger than this verify each member against the bucket's first member and
        its neighbour in id order instead of all pairs (bounded work on huge buckets).
      candidates: if given, receives every LSH candidate pair ``(a, b)``, ``a < b``, before
        verification (buckets up to `max_bucket` members), for evaluation.
    Returns the ``{doc_id: representative_id}`` map of `connected_components` (ids not in it are
    singletons).
    """
    hasher = MinHasher(num_perm, shingle_size, seed)
    ids: list[str] = []
    sig_rows: list[np.ndarray] = []
    n_chars: dict[str, int] = {}
    for doc_id, text in docs:
        sig = hasher.signature(text)
        if sig is None:
            continue
        ids.append(doc_id)
        sig_rows.append(sig)
        n_chars[doc_id] = len(text)
    if not ids:
        return {}
    sigs = np.stack(sig_rows)
    del sig_rows
    # Buckets without per-entry Python objects: sort the (band, key) table and cut it into runs.
    keys = band_keys_batch(sigs, bands, rows)  # uint64[n, bands]
    band = np.broadcast_to(np.arange(bands, dtype=np.int64), keys.shape).ravel()
    keys = keys.ravel()
    doc = np.repeat(np.arange(len(ids), dtype=np.int64), bands)
    order = np.lexsort((doc, keys, band))
    band, keys, doc = band[order], keys[order], doc[order]
    new_run = np.ones(len(keys), dtype=bool)
    new_run[1:] = (band[1:] != band[:-1]) | (keys[1:] != keys[:-1])
    starts = np.flatnonzero(new_run)
    ends = np.append(starts[1:], len(keys))
    edges = set()
    sig_of = _RowView(ids, sigs)
    for a, b in zip(starts[ends - starts > 1].tolist(), ends[ends - starts > 1].tolist()):
        members = [ids[i] for i in doc[a:b].tolist()]
        edges.update(bucket_edges(members, sig_of, threshold, max_bucket))
        if candidates is not None and len(members) <= max_bucket:
            m = sorted(members)
            candidates.update((x, y) for i, x in enumerate(m) for y in m[i + 1 :])
    return connected_components(sorted(edges), n_chars)


class _RowView:
    """Read-only ``{doc_id: signature}`` view over a signature matrix (no per-document arrays)."""

    def __init__(self, ids: list[str], sigs: np.ndarray):
        self._index = {d: i for i, d in enumerate(ids)}
        self._sigs = sigs

    def __getitem__(self, doc_id: str) -> np.ndarray:
        return self._sigs[self._index[doc_id]]


def band_keys_batch(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """`band_keys` for a matrix of signatures: ``uint32[n, num_perm]`` -> ``uint64[n, bands]``."""
    if bands * rows > sigs.shape[1]:
        raise ValueError(f"bands*rows = {bands * rows} exceeds num_perm = {sigs.shape[1]}")
    weights = _mix64(np.arange(1, rows + 1, dtype=np.uint64)) | np.uint64(1)
    out = np.empty((sigs.shape[0], bands), dtype=np.uint64)
    for start in range(0, sigs.shape[0], 8192):
        block = sigs[start : start + 8192, : bands * rows].reshape(-1, bands, rows).astype(np.uint64)
        out[start : start + 8192] = _mix64(np.sum(block * weights, axis=2, dtype=np.uint64))
    return out


def bucket_edges(
    members: Sequence[str], sigs: dict[str, np.ndarray], threshold: float, max_bucket: int
) -> list[tuple[str, str]]:
    """Verified edges among one bucket's members (all pairs up to `max_bucket` members)."""
    members = sorted(set(members))
    if len(members) <= max_bucket:
        return verified_pairs(members, np.stack([sigs[m] for m in members]), threshold)
    out = []
    first = sigs[members[0]]
    for prev, cur in zip(members, members[1:]):
        for other, osig in ((members[0], first), (prev, sigs[prev])):
            if other != cur and estimated_jaccard(osig, sigs[cur]) >= threshold:
                out.append((other, cur))
    return out
