"""Decontamination: documents holding an example of an eval set (`DecontamConfig`) are dropped."""

from __future__ import annotations

import collections
import dataclasses
import os
import re

import apache_beam as beam
import gin
import numpy as np

from jaxpt.data import documents
from jaxpt.eval import decontam as decontam_hash
from jaxpt.util import fs
from jaxpt.util.errors import ConfigError

from data_pipelines import minhash
from data_pipelines.steps import base


REASONS = ("eval_ngram_overlap", "eval_unit_match")

@gin.configurable
@dataclasses.dataclass
class DecontamConfig:
    """`eval_sets` maps a name to a path/glob of document files (`jaxpt.data.documents`: a string
    ``text`` per line, one eval example each; a malformed line stops the build with DocumentFormatError naming it).
    A training document is dropped when it contains an example of any length; words are lower-cased
    `minhash.words` (``\\w+`` runs, one per CJK character), so case, punctuation and spacing do not matter.

    By the example's word count k (`DECONTAM_RULES`):

    - k >= `ngram` (``long``): the document shares any `ngram`-word n-gram with it (GPT-3's rule, Brown et al.
      2020, app. C; lm-evaluation-harness uses 13).
    - `min_ngram` <= k < `ngram` (``medium``): the document contains its whole word sequence.
    - 1 <= k < `min_ngram` (``short``): a whole unit of the document named in `short_units` (the document, a
      paragraph between blank lines, a line) has exactly its word sequence. One or two words occur inside most
      documents, so matching them anywhere would remove the corpus; a line or paragraph that is nothing but the
      example is a copy of it (Dolma's paragraph decontamination likewise matches a paragraph shorter than its
      n-gram as a whole, and the GPT-4 technical report uses a whole example shorter than its 50-character probes).
    - k = 0 (``empty``, e.g. only punctuation): matches nothing; counted and named in the manifest and the build
      summary.

    The manifest reports, per eval set and length class, how many examples matched and how many documents they
    removed, and lists matched examples with the documents each removed; an example that removed more than
    `warn_documents_per_example` documents (0: no limit) is warned about, so an over-broad example shows."""

    eval_sets: dict = dataclasses.field(default_factory=dict)
    ngram: int = 13
    min_ngram: int = 3
    short_units: tuple[str, ...] = ("document", "paragraph", "line")
    warn_documents_per_example: int = 100
    enabled: bool = True

    def validate(self):
        """Raises ConfigError naming the field unless 1 <= min_ngram <= ngram <= 64 (`ngram_hashes` handles
        n <= 64), `short_units` is a non-empty subset of ``document``, ``paragraph``, ``line`` and
        `warn_documents_per_example` >= 0."""
        if not 1 <= self.ngram <= 64:
            raise ConfigError(f"DecontamConfig.ngram = {self.ngram} must be in [1, 64]")
        if not 1 <= self.min_ngram <= self.ngram:
            raise ConfigError(f"DecontamConfig.min_ngram = {self.min_ngram} must be in [1, ngram = {self.ngram}]")
        units = ("document", "paragraph", "line")
        if isinstance(self.short_units, str) or not self.short_units or set(self.short_units) - set(units):
            raise ConfigError(f"DecontamConfig.short_units = {self.short_units!r} must be a non-empty list of "
                              f"{list(units)}")
        if not (isinstance(self.warn_documents_per_example, int) and self.warn_documents_per_example >= 0):
            raise ConfigError(f"DecontamConfig.warn_documents_per_example = {self.warn_documents_per_example} "
                              "must be an integer >= 0 (0: never warn)")

    def check(self, sources: list) -> None:
        """Resolve phase: `validate`."""
        self.validate()


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

    Built once on the driver (`load_eval_index`) and shipped to the Beam workers; `match`
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


def load_eval_index(cfg) -> EvalIndex:
    """The eval examples of every set in `DecontamConfig.eval_sets`, hashed by the rule of their length class.

    Each file of a set is a document file (`jaxpt.data.documents`: one JSON object with a string ``text`` per
    line, plain or gzip); each line is one example, named by its ``id`` or ``<file name>:<line>``. Every example
    is indexed: long ones by their `DecontamConfig.ngram`-grams, shorter ones by their whole word sequence, matched
    anywhere (``medium``) or only as a whole unit of a document (``short``); an example with no word is kept in the
    index (``empty``) so the manifest names it (`DECONTAM_RULES`).

    Raises:
      ConfigError: a pattern that matches no file.
      DocumentFormatError: (a ConfigError) a line of an eval set breaks the document contract (file, line, reason).
    """
    dc = cfg.decontam
    index = EvalIndex(dc.ngram, dc.min_ngram, tuple(dc.short_units))
    for name, pattern in sorted(dc.eval_sets.items()):
        path = pattern if os.path.isabs(pattern) or fs.is_remote(pattern) else fs.join(cfg.source_root, pattern)
        files = fs.glob_pattern(path) or fs.glob_pattern(pattern)
        if not files:
            raise ConfigError(f"DecontamConfig.eval_sets['{name}']: '{pattern}' matches no file")
        index.add_set(name)
        for f in files:
            for _, record in documents.iter_documents(f):
                index.add(name, record["id"], record["text"])
    return index


def decontamination_figures(cfg, eval_index, rows: list[dict]) -> dict:
    """`decontamination_report` from the decision log's decontamination rows (their ``eval_matches``)."""
    if not eval_index:
        return {"eval_sets": {}, "warnings": []}
    matches = {r["id"]: r["eval_matches"] for r in rows if r["stage"] == "decontamination"}
    return decontamination_report(eval_index, matches, cfg.decontam.warn_documents_per_example)


class Decontaminate(beam.DoFn):
    """Drops a document containing an eval example (`EvalIndex.match`; `DecontamConfig` says by which rule
    for which example length). The decision row names the sets (``detail``) and lists every match as
    ``eval_matches``: ``[set, example index, rule]``, from which the manifest counts the documents each example
    removed. The reason is ``eval_ngram_overlap`` when an n-gram or word-sequence rule matched, else
    ``eval_unit_match`` (only a short example matched, as a whole document, paragraph or line), so the review sample
    of the short-example rule is its own."""

    def __init__(self, eval_index: EvalIndex):
        self.eval_index = eval_index

    def process(self, doc):
        hits = self.eval_index.match(doc["text"])
        if not hits:
            yield doc
            return
        rules = {rule for _, _, rule in hits}
        reason = "eval_unit_match" if rules == {"whole_unit"} else "eval_ngram_overlap"
        yield beam.pvalue.TaggedOutput(base.DROPS, base.decision(
            doc, "decontamination", reason, detail=",".join(sorted({s for s, _, _ in hits})),
            eval_matches=[list(h) for h in hits], quality_score=doc.get("quality")))


class Decontamination(base.Step):
    name = stage = "decontamination"
    config_field = "decontam"
    config = DecontamConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        if not (ctx.cfg.decontam.enabled and ctx.eval_index):
            return docs
        return base.with_drops(docs, "Decontaminate", beam.ParDo(Decontaminate(ctx.eval_index)), ctx)

    def record(self, facts: base.Facts) -> dict:
        index = facts.eval_index
        report = decontamination_figures(facts.cfg, index, facts.rows)
        return {"decontamination": {**facts.operative["decontam"], "rules": DECONTAM_RULES,
                                     "eval_ngrams": index.ngram_counts() if index else {},
                                     "eval_ngram_lengths": index.lengths() if index else {},
                                     "eval_sets_report": report["eval_sets"]}}
