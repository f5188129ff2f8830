"""Held-out perplexity per domain and per language.

Sources (:func:`load_documents`) are pluggable: a prepared JSON Lines file (``heldout.jsonl.gz`` of
``python -m jaxpt.data.prepare``), or a corpus version directory holding ``heldout.jsonl.gz`` or
``heldout/*.jsonl.gz``; each file is read by :mod:`jaxpt.data.documents` (one JSON object per line with a string
``text``; ``id``, ``domain``, ``lang`` when known), so a malformed line raises ``DocumentFormatError`` naming it.

Each document is tokenized as in training (BOS/EOS around it as ``DataConfig.document_boundary`` says,
:mod:`jaxpt.data.boundary`) and cut into rolling windows that start at the document's first token (BOS when the
policy puts one there) (:func:`jaxpt.eval.scorer.rolling_windows`), so the scored tokens are
exactly the document's tokens after its first one: padding and the first token of each document never count,
and neither the batch size nor packing changes which tokens are scored or what context they see. Per group we
report the summed negative log-likelihood (nats), scored tokens, mean loss, perplexity ``exp(loss)`` and
bits per UTF-8 byte (``nll / ln 2 / bytes``, comparable across tokenizers; Gao et al. 2020, "The Pile", sec. 3).

Probabilities are over the tokenizer's ids: a model whose ``vocab_size`` is padded past its tokenizer's is scored
with the padded ids masked (:class:`jaxpt.eval.scorer.Scorer`'s ``num_ids``), as in every other jaxpt evaluation.
The training loss normalises over all the model's ids, so for such a model the held-out loss is that loss on the
same text less ``-log(1 - m)``, ``m`` the mass on padded ids (near 0 once trained: no padded id is ever a target).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from jaxpt.config import GROUPINGS
from jaxpt.data import boundary, corpus, documents
from jaxpt.eval.scorer import Scorer, Window, rolling_windows
from jaxpt.util import fs

#: Group keys a report can break down by.
#: Placeholder for a document without a domain or language (code has no language).
UNKNOWN = "none"


@dataclasses.dataclass(frozen=True)
class Document:
    """A held-out document: ``id``, ``text``, ``domain`` and ``lang`` (``UNKNOWN`` when missing)."""

    id: str
    text: str
    domain: str = UNKNOWN
    lang: str = UNKNOWN

    def group(self, by: str) -> str:
        if by == "domain":
            return self.domain
        if by == "lang":
            return self.lang
        if by == "domain_lang":
            return f"{self.domain}/{self.lang}"
        raise ValueError(f"unknown grouping {by!r}; choose from {GROUPINGS}")


def read_documents(path: str) -> list[Document]:
    """Documents of one document file (``.jsonl`` or ``.jsonl.gz``), in file order.

    Raises:
      DocumentFormatError: (a ConfigError) a line breaks the document contract of :mod:`jaxpt.data.documents`
        (names file, line and reason). A record without ``id`` gets ``"<file name>:<line>"``.
    """
    return [Document(r["id"], r["text"], r.get("domain") or UNKNOWN, r.get("lang") or UNKNOWN)
            for r in documents.read_documents(path)]


def resolve_source(source: str, split: str = "heldout") -> list[str]:
    """The JSON Lines files behind a source: a file, a glob of files, or a directory (a prepared sample or a corpus
    version) with ``<split>.jsonl.gz``, ``<split>.jsonl`` or ``<split>/*.jsonl[.gz]``.

    Raises:
      FileNotFoundError: naming the source and what was looked for.
    """
    if fs.isfile(source):
        return [source]
    if documents.is_pattern(source):
        files = documents.expand(source)
        if files:
            return files
        raise FileNotFoundError(f"{split} source {source}: no file matches")
    if fs.isdir(source):
        for cand in (fs.join(source, f"{split}.jsonl.gz"), fs.join(source, f"{split}.jsonl")):
            if fs.isfile(cand):
                return [cand]
        files = sorted(fs.glob(fs.join(source, split), "*.jsonl.gz") + fs.glob(fs.join(source, split), "*.jsonl"))
        if files:
            return files
        raise FileNotFoundError(f"{split} source {source}: a directory without {split}.jsonl.gz or "
                                f"{split}/*.jsonl.gz")
    raise FileNotFoundError(f"{split} source {source}: no such file or directory")


def run_sources(data_cfg) -> tuple[str, str]:
    """``(held-out source, training source)`` of a run's ``DataConfig``: the prepared sample's two files, or, for
    ``source='corpus'``, the corpus directory for both (its ``heldout/`` split, which the build keeps out of the
    training shards, and the shards). The one rule the trainer, the in-loop evaluator and ``jaxpt.tools.evaluate`` use."""
    if data_cfg.source == "corpus":
        return data_cfg.corpus_dir, data_cfg.corpus_dir
    return data_cfg.heldout_path, data_cfg.train_path


def load_documents(source: str, split: str = "heldout") -> list[Document]:
    """All documents of ``source`` (see :func:`resolve_source`), files in sorted order."""
    docs: list[Document] = []
    for path in resolve_source(source, split):
        docs += read_documents(path)
    return docs


def training_texts(source: str) -> Iterator[str]:
    """Texts of a training split for decontamination, streamed: document files as in :func:`resolve_source` (split
    ``train``), or else the ``text`` of every record of a corpus version's shards (:mod:`jaxpt.data.corpus`).

    Raises:
      FileNotFoundError: neither document files nor a corpus version (``mixture.json``) are found, or a shard the
        mixture lists is missing.
      DocumentFormatError: (a ConfigError) a line of a document file breaks the document contract.
    """
    try:
        paths = resolve_source(source, "train")
    except FileNotFoundError:
        if not corpus.is_corpus_version(source):
            raise
        shards = [p for ps in corpus.read_corpus_version(source).shard_paths().values() for p in ps]
        for record in corpus.shard_records(shards):
            yield record["text"]
        return
    for path in paths:
        yield from documents.read_texts(path)


@dataclasses.dataclass
class HeldoutSet:
    """Documents cut into scoring windows, ready for any number of evaluations.

    Attributes:
      docs: the documents.
      windows: rolling windows over every document's tokens.
      window_doc: int64 [num_windows], the document of each window.
      doc_bytes: int64 [num_docs], UTF-8 bytes of each document's text.
      subset: True when only some windows were kept (``max_windows``).
    """

    docs: list[Document]
    windows: list[Window]
    window_doc: np.ndarray
    doc_bytes: np.ndarray
    subset: bool = False

    @classmethod
    def build(cls, docs: Sequence[Document], tokenizer, *, seq_len: int, stride: int | None = None,
              document_boundary: str = "eos", max_windows: int = 0,
              interleave_by: str = "domain_lang") -> "HeldoutSet":
        """Tokenize (BOS/EOS around each document as ``document_boundary`` says, as in training) and cut into
        windows.

        Args:
          document_boundary: :data:`jaxpt.data.boundary.DOCUMENT_BOUNDARIES` (ConfigError if the tokenizer lacks
            a token it needs).
          stride: new tokens per later window of a long document (default ``seq_len // 2``).
          max_windows: 0 for all; else keep this many windows, taken round-robin over the groups of
            ``interleave_by`` (so a bounded in-loop evaluation still covers every group), each group's windows
            in document order.
        """
        stride = stride or seq_len // 2
        marks = boundary.for_tokenizer(document_boundary, tokenizer)
        ids = tokenizer.encode_batch([d.text for d in docs])
        windows, owner = [], []
        for i, t in enumerate(ids):
            ws = rolling_windows(marks.wrap(t), seq_len, stride)
            windows += ws
            owner += [i] * len(ws)
        owner_arr = np.asarray(owner, np.int64)
        subset = False
        if max_windows and max_windows < len(windows):
            by_group: dict[str, list[int]] = {}
            for w, i in enumerate(owner):
                by_group.setdefault(docs[i].group(interleave_by), []).append(w)
            order = _round_robin([by_group[g] for g in sorted(by_group)])[:max_windows]
            order.sort()
            windows = [windows[w] for w in order]
            owner_arr = owner_arr[order]
            subset = True
        doc_bytes = np.array([len(d.text.encode("utf-8")) for d in docs], np.int64)
        return cls(list(docs), windows, owner_arr, doc_bytes, subset)


def _round_robin(lists: Sequence[Sequence[int]]) -> list[int]:
    out, k = [], 0
    while any(k < len(x) for x in lists):
        out += [x[k] for x in lists if k < len(x)]
        k += 1
    return out


def _figures(nll: float, tokens: int, nbytes: int, documents: int) -> dict[str, float]:
    loss = nll / tokens if tokens else float("nan")
    return {"documents": documents, "tokens": int(tokens), "nll_sum": nll, "loss": loss,
            "perplexity": math.exp(loss) if tokens else float("nan"),
            "bytes": int(nbytes), "bits_per_byte": nll / math.log(2) / nbytes if nbytes else float("nan")}


def perplexity_report(scorer: Scorer, hset: HeldoutSet, *, group_by: Iterable[str] = GROUPINGS,
                      pack: bool = True, progress: str | None = None) -> dict[str, Any]:
    """Score every window and pool by document group.

    Returns ``{"overall": figures, "by_<grouping>": {group: figures}, "subset": bool}`` where figures are
    ``documents``, ``tokens`` (scored), ``nll_sum`` (nats), ``loss`` (nats per token), ``perplexity``,
    ``bytes`` and ``bits_per_byte``. Bytes count whole documents, so ``bits_per_byte`` is only reported for
    full (not subset) evaluations. For a model whose MLP routes tokens (a mixture of experts) also
    ``"routing"``: the routing the figures come from (:attr:`Scorer.routing`; ``causal`` unless asked otherwise).
    ``progress``: as :meth:`Scorer.score`.
    """
    res = scorer.score(hset.windows, pack=pack, progress=progress)
    nd = len(hset.docs)
    doc_nll = np.zeros(nd, np.float64)
    doc_tok = np.zeros(nd, np.int64)
    # Per-document sums in window order, then per-group sums in document order: fixed summation order.
    for w in range(len(hset.windows)):
        doc_nll[hset.window_doc[w]] -= res.logp[w]
        doc_tok[hset.window_doc[w]] += res.count[w]
    seen = doc_tok > 0

    def pool(mask: np.ndarray) -> dict[str, float]:
        nbytes = int(hset.doc_bytes[mask].sum()) if not hset.subset else 0
        return _figures(float(doc_nll[mask].sum()), int(doc_tok[mask].sum()), nbytes, int(mask.sum()))

    report: dict[str, Any] = {"overall": pool(seen), "subset": hset.subset}
    if scorer.routed:
        report["routing"] = scorer.routing
    for by in group_by:
        keys = np.array([d.group(by) for d in hset.docs])
        report[f"by_{by}"] = {g: pool(seen & (keys == g)) for g in sorted(set(keys[seen].tolist()))}
    return report


def flat_figures(report: dict[str, Any], prefix: str = "heldout") -> dict[str, float]:
    """``{"<prefix>/<grouping>/<group>/loss": ..., ".../perplexity": ...}`` scalars for metrics.jsonl."""
    out = {f"{prefix}/overall/loss": report["overall"]["loss"],
           f"{prefix}/overall/perplexity": report["overall"]["perplexity"]}
    for key, groups in report.items():
        if key.startswith("by_"):
            for g, fig in groups.items():
                out[f"{prefix}/{key[3:]}/{g}/loss"] = fig["loss"]
                out[f"{prefix}/{key[3:]}/{g}/perplexity"] = fig["perplexity"]
    return out
