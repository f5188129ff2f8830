"""The corpus tokenizer's library: its config, the corpus reader, the balanced training sample, training and held-out
measurement (`python -m data_pipelines.tokenizer` is its command line; read its docstring for the method)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import time
from importlib import metadata
from typing import Any, Sequence

import gin
import numpy as np

from jaxpt import config as jaxpt_config
from jaxpt.util import fs, jsonl
from jaxpt.data import corpus as corpus_lib
from jaxpt.data import documents
from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.prepare import is_heldout
from jaxpt.util.errors import ConfigError  # the one base (exit 2); re-exported as data_pipelines.tokenizer.ConfigError


FORMAT_VERSION = 1
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "data" / "tokenizer.gin"
#: Language label of documents without one (code, or text language ID could not place).
NO_LANG = "und"
CODE_DOMAIN = "code"


@dataclasses.dataclass
class TokenizerConfig:
    """Tokenizer training settings (gin: ``TokenizerConfig.<field>``).

    Attributes:
      vocab_size: pieces in the vocabulary, the 4 specials and 256 byte pieces included.
      model_type: ``bpe`` (default) or ``unigram``.
      character_coverage: share of sample characters that get their own piece; rarer ones are
        left to byte fallback (SentencePiece's `character_coverage`).
      max_sentencepiece_length: longest piece, in characters.
      sample_chars: characters of training text in the sample (all domains).
      domain_weights: domain -> share of `sample_chars`; empty = equal shares. Domains of the
        corpus left out get none; a listed domain missing from the corpus is an error.
      max_doc_chars: longest prefix of one document taken into the sample (keeps one huge file
        from standing for its domain).
      heldout_fraction: share of a corpus version's documents held out (by id hash).
      seed: orders documents for the sample; also seeds SentencePiece.
    """

    vocab_size: int = 4096
    model_type: str = "bpe"
    character_coverage: float = 0.9995
    max_sentencepiece_length: int = 16
    sample_chars: int = 8_000_000
    domain_weights: dict = dataclasses.field(default_factory=dict)
    max_doc_chars: int = 20_000
    heldout_fraction: float = 0.05
    seed: int = 0

    def validate(self) -> None:
        """Raises ConfigError naming the `TokenizerConfig.<field>` that is out of range."""
        checks = {
            "sample_chars": self.sample_chars > 0,
            "max_doc_chars": self.max_doc_chars > 0,
            "heldout_fraction": 0.0 < self.heldout_fraction < 1.0,
            "domain_weights": all(isinstance(w, (int, float)) and w >= 0 for w in self.domain_weights.values())
            and (not self.domain_weights or sum(self.domain_weights.values()) > 0),
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"TokenizerConfig.{key} = {getattr(self, key)!r} is out of range")
        try:
            self.trainer_settings().validate()
        except ValueError as e:
            raise ConfigError(f"TokenizerConfig: {e}") from None

    def trainer_settings(self, vocab_size: int | None = None) -> tokenizer_lib.TrainerSettings:
        """SentencePiece settings: these fields over `TrainerSettings`' exact-text defaults."""
        return tokenizer_lib.TrainerSettings(
            vocab_size=vocab_size or self.vocab_size, model_type=self.model_type,
            character_coverage=self.character_coverage,
            max_sentencepiece_length=self.max_sentencepiece_length, seed=self.seed)


_GIN_CONFIG = None


def load_config(config_files: Sequence[str | os.PathLike], bindings: Sequence[str] = ()) -> TokenizerConfig:
    """Parses gin files and bindings into a validated TokenizerConfig.

    Raises ConfigError naming the file or binding that does not parse or validate.
    """
    global _GIN_CONFIG
    if _GIN_CONFIG is None:  # registered on first use, so `python -m` (module run as __main__) registers once
        _GIN_CONFIG = gin.external_configurable(TokenizerConfig, name="TokenizerConfig", module="data_pipelines")
    fs.register_gin_reader()  # --config gs://b/tokenizer.gin
    jaxpt_config.parse_gin([str(p) for p in config_files], bindings)  # checked first: a gin file is code
    cfg = _GIN_CONFIG()
    cfg.validate()
    return cfg


# ----------------------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class Document:
    """One document's text and labels (`lang` is an ISO 639-1 code or NO_LANG)."""

    id: str
    domain: str
    lang: str
    text: str


@dataclasses.dataclass
class Corpus:
    """Training and held-out documents of a corpus, and where they came from."""

    train: list[Document]
    heldout: list[Document]
    info: dict[str, Any]


def _document(id_: str, domain: str, lang: str | None, text: str) -> Document:
    return Document(id_, domain, lang or NO_LANG, text)


def _read_corpus_version(corpus_dir: pathlib.Path, heldout_fraction: float) -> Corpus:
    """Documents of every shard listed in ``mixture.json`` (training) and of the version's own held-out split
    (``heldout/*.jsonl.gz``, written by the build). A version built without that split (``OutputConfig.
    heldout_fraction = 0``) is split here by `is_heldout` with ``heldout_fraction``. The directory is read by
    `jaxpt.data.corpus.read_corpus_version`."""
    version = corpus_lib.read_corpus_version(corpus_dir)
    own_heldout = version.heldout_files()
    train, heldout = [], []
    no_text = collections.Counter()
    for domain, shards in version.shard_paths().items():
        for r in corpus_lib.shard_records(shards):
            doc = _document(r["id"], r["domain"] or domain, r["lang"], r["text"])
            if not doc.text:
                no_text[domain] += 1
                continue
            (heldout if not own_heldout and is_heldout(doc.id, heldout_fraction) else train).append(doc)
    for path in own_heldout:
        heldout += _read_documents(path)
    if no_text and not (train or heldout):
        raise ConfigError(f"{corpus_dir}: records carry no text (built with OutputConfig.store_text = False?); "
                          "tokenizer training needs the text")
    info = {
        "kind": "corpus_version",
        "data_version": version.data_version,
        "content_id": version.content_id,
        "heldout_rule": ("the version's heldout/ split" if own_heldout
                         else f"jaxpt.data.prepare.is_heldout(id, {heldout_fraction})"),
        "documents_without_text": dict(sorted(no_text.items())),
    }
    return Corpus(train, heldout, info)


def _read_documents(path: pathlib.Path) -> list[Document]:
    """Documents of a document file (`jaxpt.data.documents`; each needs a ``domain`` here).

    Raises:
      DocumentFormatError: (a ConfigError) a line breaks the document contract or has no ``domain`` (file, line).
    """
    return [_document(d["id"], d["domain"], d.get("lang"), d["text"])
            for d in documents.read_documents(path, required=("domain",))]


def _read_prepared(corpus_dir: pathlib.Path) -> Corpus:
    heldout_path = corpus_dir / "heldout.jsonl.gz"
    if not heldout_path.is_file():
        raise FileNotFoundError(f"{corpus_dir}: has train.jsonl.gz but no heldout.jsonl.gz")
    files = {name: hashlib.sha256((corpus_dir / name).read_bytes()).hexdigest()
             for name in ("train.jsonl.gz", "heldout.jsonl.gz")}
    info = {
        "kind": "prepared_sample",
        "data_version": None,
        "content_id": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(),
        "files_sha256": files,
        "heldout_rule": "heldout.jsonl.gz",
    }
    return Corpus(_read_documents(corpus_dir / "train.jsonl.gz"), _read_documents(heldout_path), info)


def read_corpus(corpus_dir: str | os.PathLike, heldout_fraction: float) -> Corpus:
    """Reads a corpus version or a prepared sample (module docstring).

    Raises:
      FileNotFoundError: `corpus_dir` is neither (the message says what was looked for), or a listed
        shard is missing.
      DocumentFormatError: (a ConfigError) a line of a document file breaks the document contract (file, line).
      ConfigError: a malformed mixture.json, or shards without text.
    """
    corpus_dir = pathlib.Path(corpus_dir)
    if corpus_lib.is_corpus_version(corpus_dir):
        corpus = _read_corpus_version(corpus_dir, heldout_fraction)
    elif (corpus_dir / "train.jsonl.gz").is_file():
        corpus = _read_prepared(corpus_dir)
    else:
        raise FileNotFoundError(f"--corpus {corpus_dir}: neither a corpus version (mixture.json) nor a prepared "
                                "sample (train.jsonl.gz)")
    if not corpus.train:
        raise ConfigError(f"--corpus {corpus_dir}: no training documents")
    corpus.info.update(path=str(corpus_dir.resolve()), documents_train=len(corpus.train),
                       documents_heldout=len(corpus.heldout))
    return corpus


# ---------------------------------------------------------------------------------------- sampling


def water_fill(available: dict[str, int], weights: dict[str, float], total: int) -> dict[str, int]:
    """Characters per domain: `total` shared by weight, no domain above what it has.

    A domain whose weighted share exceeds `available` gives all of it, and what it leaves is shared
    again among the rest by weight, until every share fits. Shares are floored to integers.
    """
    budgets: dict[str, int] = {d: 0 for d in available}
    active = {d: float(weights.get(d, 0.0)) for d in available if weights.get(d, 0.0) > 0}
    remaining = float(total)
    while active:
        weight_sum = sum(active.values())
        share = {d: remaining * w / weight_sum for d, w in active.items()}
        short = sorted(d for d in active if available[d] <= share[d])
        if not short:
            budgets.update({d: int(s) for d, s in share.items()})
            break
        for d in short:
            budgets[d] = available[d]
            remaining -= available[d]
            del active[d]
    return budgets


def _sample_key(seed: int, doc_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:{doc_id}".encode("utf-8")).digest()


def balanced_sample(docs: Sequence[Document], cfg: TokenizerConfig) -> tuple[list[str], dict[str, Any]]:
    """The domain-balanced, seeded training sample (module docstring) and its composition.

    Returns:
      (texts in domain then key order, composition): ``composition["domains"][d]`` has documents and
      characters available and sampled, documents cut, and the share of the sample;
      ``composition["languages"]["d/lang"]`` has the sampled documents and characters.

    Raises:
      ConfigError: `domain_weights` names a domain the corpus does not have.
    """
    by_domain: dict[str, list[Document]] = collections.defaultdict(list)
    for doc in docs:
        by_domain[doc.domain].append(doc)
    unknown = sorted(set(cfg.domain_weights) - set(by_domain))
    if unknown:
        raise ConfigError(f"TokenizerConfig.domain_weights: domains {unknown} are not in the corpus "
                          f"(it has {sorted(by_domain)})")
    weights = cfg.domain_weights or {d: 1.0 for d in by_domain}
    available = {d: sum(min(len(x.text), cfg.max_doc_chars) for x in ds) for d, ds in by_domain.items()}
    budgets = water_fill(available, weights, cfg.sample_chars)
    texts, domains, languages = [], {}, collections.defaultdict(collections.Counter)
    for domain in sorted(by_domain):
        used = cut = taken = 0
        for doc in sorted(by_domain[domain], key=lambda x: _sample_key(cfg.seed, x.id)):
            if used >= budgets[domain]:
                break
            text = doc.text[:min(cfg.max_doc_chars, budgets[domain] - used)]
            cut += len(text) < len(doc.text)
            texts.append(text)
            used, taken = used + len(text), taken + 1
            languages[f"{domain}/{doc.lang}"].update(documents=1, chars=len(text))
        domains[domain] = {"documents_available": len(by_domain[domain]), "chars_available": available[domain],
                           "weight": float(weights.get(domain, 0.0)), "documents_sampled": taken,
                           "documents_cut": cut, "chars_sampled": used}
    total = sum(d["chars_sampled"] for d in domains.values())
    for d in domains.values():
        d["share"] = round(d["chars_sampled"] / total, 6) if total else 0.0
    composition = {"chars": total, "documents": len(texts), "domains": domains,
                   "languages": {k: dict(v) for k, v in sorted(languages.items())}}
    return texts, composition


# ---------------------------------------------------------------------------------------- measuring


def slice_names(doc: Document) -> list[str]:
    """The held-out slices a document counts in.

    ``all``; ``english prose`` (not code, lang en); ``code``; ``other-language prose`` (not code,
    a language other than en or und); ``domain=<d>``; ``lang=<l>`` (not code).
    """
    names = ["all", f"domain={doc.domain}"]
    if doc.domain == CODE_DOMAIN:
        names.append("code")
    else:
        names.append(f"lang={doc.lang}")
        if doc.lang == "en":
            names.append("english prose")
        elif doc.lang != NO_LANG:
            names.append("other-language prose")
    return names


def measure(tok: tokenizer_lib.Tokenizer, docs: Sequence[Document]) -> dict[str, dict[str, float]]:
    """Bytes per token and tokens per document per slice (`slice_names`) of `docs`.

    Returns ``{slice: {"documents", "bytes", "tokens", "bytes_per_token", "tokens_per_document"}}``;
    bytes are UTF-8 bytes of the text, tokens exclude BOS/EOS, and ratios are of the slice totals.
    Also ``{"pieces": {"unused_share": ...}}``: the share of non-special, non-byte pieces no held-out
    document uses.
    """
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    used = np.zeros(tok.vocab_size, dtype=bool)
    for doc, ids in zip(docs, tok.encode_batch([d.text for d in docs], num_threads=2)):
        used[ids] = True
        n_bytes = len(doc.text.encode("utf-8"))
        for name in slice_names(doc):
            totals[name].update(documents=1, bytes=n_bytes, tokens=len(ids))
    out = {}
    for name, t in sorted(totals.items()):
        out[name] = {"documents": t["documents"], "bytes": t["bytes"], "tokens": t["tokens"],
                     # NaN over no token: 0 bytes/token would read as a figure
                     "bytes_per_token": t["bytes"] / t["tokens"] if t["tokens"] else float("nan"),
                     "tokens_per_document": t["tokens"] / t["documents"]}
    learned = tok.learned_ids()
    out["pieces"] = {"unused_share": float(np.mean(~used[learned])) if learned.size else float("nan")}
    return out


def _heldout_summary(figures: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {name: {"documents": f["documents"], "bytes_per_token": round(f["bytes_per_token"], 4),
                   "tokens_per_document": round(f["tokens_per_document"], 2)}
            for name, f in figures.items() if name != "pieces"}


# ---------------------------------------------------------------------------------------- training


def write_json(path: str | os.PathLike, record: dict) -> None:
    """``record`` as sorted, indented JSON at ``path`` (local or ``gs://``; a reader never sees half of it)."""
    fs.write_text_atomic(os.fspath(path), jsonl.dumps(record, indent=1, ensure_ascii=False, sort_keys=True) + "\n")


def train_tokenizer(cfg: TokenizerConfig, corpus_dir: str | os.PathLike,
                    output: str | os.PathLike) -> dict[str, Any]:
    """Trains ``output/tokenizer.model`` on the sample of `corpus_dir` and writes ``tokenizer.json``.

    ``tokenizer.json`` is written last (and removed first), so its presence means the pair is whole.
    Returns its record.

    Raises:
      ConfigError, FileNotFoundError: as `read_corpus` and `balanced_sample`; ValueError from
        SentencePiece when the sample cannot support `vocab_size` pieces (needs more text or a
        smaller vocabulary).
    """
    start = time.perf_counter()
    cfg.validate()
    output = os.fspath(output)  # local or gs:// (jaxpt.util.fs)
    fs.makedirs(output)
    fs.remove(fs.join(output, "tokenizer.json"))
    corpus = read_corpus(corpus_dir, cfg.heldout_fraction)
    texts, composition = balanced_sample(corpus.train, cfg)
    model_path = tokenizer_lib.train(texts, fs.join(output, "tokenizer.model"), cfg.trainer_settings())
    tok = tokenizer_lib.Tokenizer.load(model_path)
    problems = tok.lossless_problems()
    if problems:  # cannot happen with TrainerSettings' defaults; guards edits to them
        raise AssertionError(f"{model_path} would not round-trip text: {problems}")
    record = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"file": "tokenizer.model", "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                      "pad_id": tok.pad_id, "eos_id": tok.eos_id, "unk_id": tok.unk_id, "bos_id": tok.bos_id,
                      "space_symbol_ids": tok.space_symbol_ids},
        "config": dataclasses.asdict(cfg),
        "model_settings": tok.settings(),
        "corpus": corpus.info,
        "sample": composition,
        "heldout": _heldout_summary(measure(tok, corpus.heldout)),
        "libraries": {name: metadata.version(name) for name in ("sentencepiece",)},
    }
    write_json(fs.join(output, "tokenizer.json"), record)
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


# ------------------------------------------------------------------------------------------ report


# --------------------------------------------------------------------------------------------- CLI


def common_flags(parser: argparse.ArgumentParser, config_required: bool) -> None:
    parser.add_argument("--config", action="append", required=config_required, default=None,
                        help=f"gin file (repeatable){'' if config_required else f'; default {DEFAULT_CONFIG}'}")
    parser.add_argument("--gin", action="append", default=[], help="gin binding, e.g. 'TokenizerConfig.seed = 1'")
    parser.add_argument("--corpus", required=True, type=pathlib.Path,
                        help="corpus version (mixture.json) or prepared sample (train.jsonl.gz)")
