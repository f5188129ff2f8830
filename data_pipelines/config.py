"""Typed, gin-configurable settings for every stage of the corpus build.

Each stage has one dataclass; gin binds its fields (``RuleConfig.min_words = 5``). `BuildConfig`
gathers them and validates the source registry. `BuildConfig.to_json()` is the operative config
written into the manifest.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any

import gin

from jaxpt.util import fs
from jaxpt.util.errors import ConfigError  # the one base (exit 2); re-exported as data_pipelines.config.ConfigError

FORMATS = ("jsonl", "parquet", "warc", "tfds")


@dataclasses.dataclass(frozen=True)
class Source:
    """One entry of the source registry.

    Attributes:
      name: unique short name; recorded on every document.
      domain: mixture domain (``web``, ``code``, ...).
      path: file path or glob (relative paths resolve against `BuildConfig.source_root`); for
        ``tfds`` the dataset name (``c4/en:3.1.0``).
      format: one of ``jsonl`` (.jsonl, .jsonl.gz, .jsonl.zst), ``parquet``, ``warc``, ``tfds``.
      license: license identifier (required).
      acquired: acquisition date, ISO ``YYYY-MM-DD`` (required).
      languages: allowed ISO 639-1 codes after language ID; None admits any (language ID skipped).
      text_field / id_field: record fields holding the text and the id (id defaults to
        ``<name>/<file>:<line>``).
      extract_html: run main-text extraction on the text field (always on for WARC).
      split / data_dir: TFDS split and data directory (``tfds`` only).
    """

    name: str
    domain: str
    path: str
    format: str
    license: str
    acquired: str
    languages: tuple[str, ...] | None = None
    text_field: str = "text"
    id_field: str | None = "id"
    extract_html: bool = False
    split: str = "train"
    data_dir: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], index: int) -> "Source":
        key = f"BuildConfig.sources[{index}]"
        if not isinstance(d, dict):
            raise ConfigError(f"{key}: expected a dict, got {type(d).__name__}")
        for req in ("name", "domain", "path", "format"):
            if not d.get(req):
                raise ConfigError(f"{key}: missing required field '{req}'")
        name = d["name"]
        for req in ("license", "acquired"):
            if not d.get(req):
                raise ConfigError(
                    f"{key} (source '{name}'): missing '{req}'; every source needs a license and an "
                    "acquisition date before it is admitted"
                )
        try:
            datetime.date.fromisoformat(str(d["acquired"]))
        except ValueError as e:
            raise ConfigError(f"{key} (source '{name}'): 'acquired' must be YYYY-MM-DD: {e}") from None
        if d["format"] not in FORMATS:
            raise ConfigError(f"{key} (source '{name}'): format '{d['format']}' not in {FORMATS}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{key} (source '{name}'): unknown fields {sorted(unknown)}")
        d = dict(d)
        if d.get("languages") is not None:
            d["languages"] = tuple(d["languages"])
        d["acquired"] = str(d["acquired"])
        return cls(**d)

    def files(self, root: str) -> list[str]:
        """Sorted input files of this source (not for ``tfds``). Raises ConfigError if none match."""
        pattern = self.path if os.path.isabs(self.path) or fs.is_remote(self.path) else fs.join(root, self.path)
        found = fs.glob_pattern(pattern)  # local or object storage (gs://)
        if not found:
            raise ConfigError(f"source '{self.name}': path '{pattern}' matches no file")
        return found


@gin.configurable
@dataclasses.dataclass
class AdmissionConfig:
    """Stage 1. Records above `max_record_bytes` of UTF-8 are dropped as ``oversized``; records
    holding a NUL byte, or whose share of control bytes that text does not use (all C0 controls but
    tab, LF, VT, FF, CR, backspace and ESC, plus DEL) exceeds `max_binary_fraction`, are dropped as
    ``binary``. (IRC colour codes put a few percent of STX/ETX bytes into real fortune cookies.)

    A compressed JSON Lines file cut short keeps the records read before the damage and counts one
    ``truncated_file`` drop naming the file; `fail_on_damaged_file` stops the build instead (exit 2, naming it).

    Bounds on hostile input (each hit is counted under its own reason, never held first):
      max_file_bytes: a JSON Lines file that decompresses past this many bytes keeps the lines read before and
        counts one ``decompressed_cap`` drop for the rest; a Parquet row group whose text column is larger
        (uncompressed, from the file's metadata) is one ``decompressed_cap`` drop per row, undecoded.
      max_compression_ratio: a compressed file whose decompressed bytes pass this many times the compressed bytes
        read (judged after 16 MiB decompressed) stops there with one ``compression_ratio`` drop (a decompression
        bomb: gzip reaches ~1000:1 on one repeated line; text corpora compress 3-10:1).
      extraction_seconds: main-text extraction of one HTML page that runs past this many seconds is stopped
        and the page counted ``extraction_timeout`` (0: no budget).
    """

    max_record_bytes: int = 4 << 20
    max_binary_fraction: float = 0.1
    samples_per_reason: int = 5
    fail_on_damaged_file: bool = False
    max_file_bytes: int = 16 << 30
    max_compression_ratio: float = 100.0
    extraction_seconds: float = 30.0


@gin.configurable
@dataclasses.dataclass
class NormalizeConfig:
    """Stage 2. ftfy repairs mojibake, strips terminal escapes and applies Unicode `normalization`."""

    normalization: str = "NFC"
    enabled: bool = True


@gin.configurable
@dataclasses.dataclass
class LangIdConfig:
    """Stage 3. Lingua (its models ship inside the wheel) restricted to `languages` (ISO 639-1).

    The detector reads `windows` evenly spaced slices of the document, `max_chars` characters in all, so
    a translated man page with an English header is judged by its body too. As lingua's authors advise
    for short or ambiguous input, a detection is trusted only when the sample has at least `min_chars`
    letters, the top language's confidence is at least `min_confidence` and its lead over the second is
    at least `min_relative_distance` (lingua's ``with_minimum_relative_distance``); otherwise the
    document takes its declared language: the record's own ``lang`` if the source allows it, else the
    source's first language. With no declared language it is ``und`` (dropped where a source restricts
    languages).

    `declared_sources` names sources whose text is in its declared language by construction (a monolingual
    English dictionary, whose entries quote etymologies, Latin taxa and foreign names that a detector
    mislabels): the detector is not run on them and each document takes its declared language, so none is
    dropped as ``language_not_allowed``."""

    languages: tuple[str, ...] = ("en", "de", "fr", "es", "it", "pl", "ru", "ja", "zh", "pt", "cs")
    max_chars: int = 1200
    windows: int = 4
    min_chars: int = 50
    min_confidence: float = 0.5
    min_relative_distance: float = 0.0
    declared_sources: tuple[str, ...] = ()
    enabled: bool = True


@gin.configurable
@dataclasses.dataclass
class RuleConfig:
    """Stage 4. Gopher (Rae et al. 2021, app. A) and C4 (Raffel et al. 2020) style thresholds.

    `per_domain` overrides any field for one domain, e.g. ``{"code": {"max_symbol_ratio": 1.0}}``;
    `per_source` then overrides fields for one source (by name), for a kind of text that shares a domain
    with others (man pages among fortunes).

    `skip` names rules (`stages.RULES` reasons, e.g. ``"repeated_lines"``) not applied at all; set per domain or
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
    drop_cross_references: bool = False  # reference entries whose body is only "See {x}." (`stages.is_cross_reference`)
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
        from data_pipelines.stages import RULES  # stages imports this module

        unknown = sorted(set(out.skip) - {r[0] for r in RULES})
        if unknown:
            raise ConfigError(f"RuleConfig.skip (for domain '{domain}', source '{source}') = {list(out.skip)}: "
                              f"unknown rules {unknown}; known: {[r[0] for r in RULES]}")
        return dataclasses.replace(out, skip=tuple(out.skip))


@gin.configurable
@dataclasses.dataclass
class ExactDedupConfig:
    """Stage 5. Documents with equal `key` (sha256 of text with whitespace runs collapsed and
    case folded) are duplicates; the smallest id is kept."""

    enabled: bool = True


@gin.configurable
@dataclasses.dataclass
class NearDedupConfig:
    """Stage 6. See `data_pipelines.minhash` for the method."""

    shingle_size: int = 5
    num_perm: int = 256
    bands: int = 42
    rows: int = 6
    threshold: float = 0.75
    seed: int = 1
    max_bucket: int = 64
    enabled: bool = True

    def validate(self):
        if self.bands * self.rows > self.num_perm:
            raise ConfigError(
                f"NearDedupConfig: bands*rows = {self.bands * self.rows} > num_perm = {self.num_perm}"
            )
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"NearDedupConfig.threshold = {self.threshold} must be in (0, 1]")


@gin.configurable
@dataclasses.dataclass
class ParagraphDedupConfig:
    """Stage 6b, off by default: units (paragraphs between blank lines, or lines: `unit`) that recur in more than
    `max_documents` distinct documents are removed from every document that holds them (`data_pipelines.paragraphs`).

    Counting runs on the documents that survived exact and near dedup, so a document copied a hundred times does not
    make its own paragraphs look like boilerplate; a unit repeated inside one document counts once. Units of fewer
    than `min_words` words (headings, braces, signatures) are never removed. ``match = 'exact'`` compares units by
    `stages.exact_key` (whitespace collapsed, case folded); ``'near'`` (the default) also joins units whose MinHash
    estimate of word-`shingle_size`-gram Jaccard with a cluster's centre is at least `threshold`, found through LSH
    (`bands` x `rows` of `num_perm` permutations, `minhash.MinHasher` with `seed`), and counts distinct documents
    over the cluster (`paragraphs.star_cluster`); only units of at least `paragraphs.near_min_words` words (19 at
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


@gin.configurable
@dataclasses.dataclass
class QualityConfig:
    """Stage 7. A hashed word uni+bigram language model trained on `reference_sources`; the score
    is the mean log-probability per word. Per source, documents below the `drop_quantile` of
    that source's scores are dropped (`per_source_drop_quantile` overrides).

    `scorer = 'classifier'` scores with a classifier trained on human quality labels instead
    (`data_pipelines.quality_model`, saved at `classifier_path`; `reference_sources` unused).

    `calibration`: a calibration file (`python -m data_pipelines.calibrate`: the scorer checked against human labels)
    whose per-source ``drop_quantile`` replaces `drop_quantile` for the sources it covers; the manifest records its
    sha256 and table. It must have been made for this scorer (`version`, `reference_sources`, `num_buckets`), and a
    source may not also be in `per_source_drop_quantile`."""

    reference_sources: tuple[str, ...] = ()
    num_buckets: int = 1 << 20
    drop_quantile: float = 0.05
    per_source_drop_quantile: dict = dataclasses.field(default_factory=dict)
    enabled: bool = True
    version: str = "hashed-bigram-lm-v1"
    calibration: str = ""
    scorer: str = "ngram"
    classifier_path: str = ""

    def validate(self) -> None:
        """Raises ConfigError naming the key: an unknown `scorer`, or ``'classifier'`` without a readable
        `classifier_path`."""
        if self.scorer not in ("ngram", "classifier"):
            raise ConfigError(f"QualityConfig.scorer = {self.scorer!r} must be 'ngram' or 'classifier'")
        if self.scorer == "classifier":
            from data_pipelines import quality_model
            if not self.classifier_path or not fs.isfile(self.classifier_path):
                raise ConfigError(f"QualityConfig.classifier_path = {self.classifier_path!r}: QualityConfig.scorer = "
                                  f"'classifier' needs a saved classifier (python -m data_pipelines.calibrate "
                                  f"--train-classifier)")
            try:
                quality_model.LabelClassifier.load(self.classifier_path)
            except ValueError as e:
                raise ConfigError(f"QualityConfig.classifier_path: {e}") from None

    def calibrated(self) -> dict | None:
        """The calibration file's content (None without one), checked against this scorer; read once per config
        object, so a file changed during a build does not give its stages two different calibrations.

        Raises:
          ConfigError: naming ``QualityConfig.calibration``: the file is missing or not a calibration, was made for
            another scorer, or shares a source with ``per_source_drop_quantile``.
        """
        if not self.calibration:
            return None
        cached = self.__dict__.get("_calibrated")
        if cached is not None and cached[0] == self.calibration:
            return cached[1]  # read once: every stage of a build sees the same content
        from data_pipelines import calibrate
        key = "QualityConfig.calibration"
        if not fs.isfile(self.calibration):
            raise ConfigError(f"{key} = {self.calibration!r}: no such file")
        raw = fs.read_bytes(self.calibration)
        try:
            cal = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{key}: {self.calibration} is not UTF-8 JSON ({e})") from None
        if not isinstance(cal, dict) or cal.get("format") != calibrate.FORMAT or not isinstance(
                cal.get("sources"), dict):
            raise ConfigError(f"{key}: {self.calibration} is not a {calibrate.FORMAT} file")
        if cal.get("scorer") != calibrate.scorer_identity(self):
            raise ConfigError(f"{key}: {self.calibration} calibrates the scorer {cal.get('scorer')}, this build's is "
                              f"{calibrate.scorer_identity(self)}: its quantiles do not apply; calibrate this scorer")
        both = sorted(set(cal["sources"]) & set(self.per_source_drop_quantile))
        if both:
            raise ConfigError(f"{key} and QualityConfig.per_source_drop_quantile both set the quantile of {both}")
        for src, c in cal["sources"].items():
            q = c.get("drop_quantile") if isinstance(c, dict) else None
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q < 1.0:
                raise ConfigError(f"{key}: {self.calibration}: sources.{src}.drop_quantile = {q!r} must be in [0, 1)")
        self.__dict__["_calibrated"] = (self.calibration, cal, hashlib.sha256(raw).hexdigest())
        return cal

    def calibration_sha256(self) -> str:
        """Hex sha256 of the calibration file's bytes as :meth:`calibrated` read them ("" without one)."""
        return self.__dict__["_calibrated"][2] if self.calibrated() is not None else ""

    def drop_quantiles(self) -> dict[str, float]:
        """``{source: drop quantile}`` for the sources that do not take `drop_quantile`: the calibration's, then
        `per_source_drop_quantile`."""
        cal = self.calibrated()
        out = {s: float(c["drop_quantile"]) for s, c in (cal or {}).get("sources", {}).items()}
        return {**out, **self.per_source_drop_quantile}


@gin.configurable
@dataclasses.dataclass
class DecontamConfig:
    """Stage 8. `eval_sets` maps a name to a path/glob of document files (`jaxpt.data.documents`: a string
    ``text`` per line, one eval example each; a malformed line stops the build with DocumentFormatError naming it).
    A training document is dropped when it contains an example of any length; words are lower-cased
    `minhash.words` (``\\w+`` runs, one per CJK character), so case, punctuation and spacing do not matter.

    By the example's word count k (`stages.DECONTAM_RULES`):

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
        """Raises ConfigError naming the field unless 1 <= min_ngram <= ngram <= 64 (`stages.ngram_hashes` handles
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


@gin.configurable
@dataclasses.dataclass
class QuotaConfig:
    """Stage 9. `targets`: share of output characters per domain (sums to 1). The largest total
    that no domain must upsample to reach is chosen, and each domain's budget is its share of it.
    Within a domain every (domain, language) group keeps at least min(its characters,
    `long_tail_floor` * `long_tail_share` of the domain's budget), the rest of the budget going to all
    groups in proportion to their size, so a smaller group never keeps more text than a larger one
    (`stages.quota_keep_fractions`). Documents are chosen by rank of a seeded hash of their id up to
    the group's budget (`stages.quota_cutoff`), not by independent coin flips. A domain whose
    realized share of kept characters strays from its target by more than `share_tolerance` is
    warned about in the build summary and listed in the manifest (``quota_share_warnings``)."""

    targets: dict = dataclasses.field(default_factory=dict)
    long_tail_share: float = 0.05
    long_tail_floor: float = 1.0
    seed: int = 0
    share_tolerance: float = 0.02
    enabled: bool = True

    def validate(self):
        """Raises ConfigError naming the field: a negative or NaN target, long-tail settings outside [0, 1], or a
        negative tolerance."""
        for d, w in sorted(self.targets.items()):
            if not (isinstance(w, (int, float)) and w >= 0):  # NaN fails w >= 0
                raise ConfigError(f"QuotaConfig.targets['{d}'] = {w} must be a number >= 0")
        for name in ("long_tail_share", "long_tail_floor"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"QuotaConfig.{name} = {v} must be in [0, 1]")
        if not self.share_tolerance >= 0:
            raise ConfigError(f"QuotaConfig.share_tolerance = {self.share_tolerance} must be >= 0")


@gin.configurable
@dataclasses.dataclass
class OutputConfig:
    """Stage 10-12. `tokenizer_path` is the corpus's tokenizer: a SentencePiece model (``tokenizer.model``, e.g.
    from ``python -m data_pipelines.tokenizer``), or, for a corpus version built for continued pretraining, the base
    model's Hugging Face ``tokenizer.json`` (its ``config.json`` / ``tokenizer_config.json`` beside it name the special
    tokens); loaded by :meth:`jaxpt.data.tokenizer.Tokenizer.load`, recorded in the manifest with its sha256.

    `heldout_fraction` is the share of surviving documents (after decontamination, before quotas) kept out of
    training by `jaxpt.data.prepare.is_heldout` (sha256 of the id): they go to ``DIR/heldout/<domain>.jsonl.gz``
    for held-out perplexity and probe tasks, never into the TFDS shards. Deduplication ran before the split,
    so no held-out document has an exact or near duplicate in training. 0 disables the split.
    """

    tokenizer_path: str = ""
    heldout_fraction: float = 0.02
    dataset_name: str = "jaxpt_corpus"
    shards_per_domain: int = 2
    decision_shards: int = 4
    review_samples_per_rule: int = 20
    review_seed: int = 0
    owner: str = ""
    store_text: bool = True


@gin.configurable
@dataclasses.dataclass
class BuildConfig:
    """The whole build: registry plus stage configs."""

    data_version: str = ""
    source_root: str = "."
    sources: list = dataclasses.field(default_factory=list)
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    normalize: NormalizeConfig = dataclasses.field(default_factory=NormalizeConfig)
    langid: LangIdConfig = dataclasses.field(default_factory=LangIdConfig)
    rules: RuleConfig = dataclasses.field(default_factory=RuleConfig)
    exact: ExactDedupConfig = dataclasses.field(default_factory=ExactDedupConfig)
    near: NearDedupConfig = dataclasses.field(default_factory=NearDedupConfig)
    paragraphs: ParagraphDedupConfig = dataclasses.field(default_factory=ParagraphDedupConfig)
    quality: QualityConfig = dataclasses.field(default_factory=QualityConfig)
    decontam: DecontamConfig = dataclasses.field(default_factory=DecontamConfig)
    quotas: QuotaConfig = dataclasses.field(default_factory=QuotaConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)

    def registry(self) -> list[Source]:
        """Validated sources. Raises ConfigError naming the offending entry."""
        if not self.sources:
            raise ConfigError("BuildConfig.sources: the source registry is empty")
        out = [Source.from_dict(d if isinstance(d, dict) else d, i) for i, d in enumerate(self.sources)]
        names = [s.name for s in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"BuildConfig.sources: duplicate source names {dup}")
        for q in self.quality.reference_sources:
            if q not in names:
                raise ConfigError(f"QualityConfig.reference_sources: '{q}' is not a registered source")
        if self.quality.enabled:
            self.quality.validate()
            unknown = sorted(set((self.quality.calibrated() or {}).get("sources", {})) - set(names))
            if unknown:
                raise ConfigError(f"QualityConfig.calibration: {self.quality.calibration} calibrates sources this build "
                                  f"does not register: {unknown} (a renamed source, or another corpus's calibration)")
        for q in self.langid.declared_sources:
            if q not in names:
                raise ConfigError(f"LangIdConfig.declared_sources: '{q}' is not a registered source")
        if self.quotas.enabled and self.quotas.targets:
            domains = {s.domain for s in out}
            missing = domains - set(self.quotas.targets)
            if missing:
                raise ConfigError(f"QuotaConfig.targets: no target for domains {sorted(missing)}")
        if not self.output.tokenizer_path:
            raise ConfigError("OutputConfig.tokenizer_path: a tokenizer is required (a SentencePiece model, or a base "
                              "model's tokenizer.json)")
        if not self.output.owner:
            raise ConfigError("OutputConfig.owner: name the team or person who owns this data version")
        if not 0.0 <= self.output.heldout_fraction < 1.0:
            raise ConfigError(f"OutputConfig.heldout_fraction = {self.output.heldout_fraction} must be in [0, 1)")
        self.near.validate()
        if self.paragraphs.enabled:
            self.paragraphs.validate()
            for q in self.paragraphs.skip_sources:
                if q not in names:
                    raise ConfigError(f"ParagraphDedupConfig.skip_sources: '{q}' is not a registered source")
        self.decontam.validate()
        self.quotas.validate()
        return out

    def to_json(self) -> dict:
        """Plain-JSON view of every setting (the operative config). Paragraph dedup is listed only when enabled, so
        a build with it off has the operative config, content id and manifest of a build made before it existed.
        Likewise ``quality.calibration`` is listed only when set, as the file's path, sha256 and per-source drop
        quantiles (what the build uses of it), and ``quality.scorer`` only when it is the classifier (with the
        classifier file's sha256)."""
        out = dataclasses.asdict(self)
        if not self.paragraphs.enabled:
            del out["paragraphs"]
        if self.quality.scorer == "ngram":  # the default: listed as before the option existed
            del out["quality"]["scorer"], out["quality"]["classifier_path"]
        else:  # the classifier's identity, not the n-gram model's settings it does not use
            from data_pipelines import calibrate, quality_model
            for k in ("reference_sources", "num_buckets"):
                del out["quality"][k]
            out["quality"]["version"] = quality_model.VERSION
            out["quality"]["classifier_sha256"] = calibrate.sha256_file(self.quality.classifier_path)
        cal = self.quality.calibrated()
        if cal is None:
            del out["quality"]["calibration"]
        else:
            out["quality"]["calibration"] = {
                "path": self.quality.calibration,
                "sha256": self.quality.calibration_sha256(),
                "drop_quantile": {s: c["drop_quantile"] for s, c in sorted(cal["sources"].items())}}
        return out
