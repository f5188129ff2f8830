"""Quality: each document scored (a hashed n-gram LM of reference sources, or a classifier trained on labels), and per
source those under a drop quantile (calibrated on human labels or set) dropped."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib

import apache_beam as beam
import gin
import numpy as np

from jaxpt.util import fs
from jaxpt.util.errors import ConfigError

from data_pipelines import minhash, quality_model, writer
from data_pipelines.steps import base


REASONS = ("below_source_quantile",)

FORMAT = "jaxpt-quality-calibration-v1"


def scorer_identity(quality_cfg) -> dict:
    """What makes two builds' quality scores the same function of a document's text (given the same reference
    texts): the n-gram scorer's version, reference sources and hash-bucket count, or the classifier's version and
    file sha256."""
    if quality_cfg.scorer == "classifier":
        return {"version": quality_model.VERSION, "classifier_sha256": sha256_file(quality_cfg.classifier_path)}
    return {"version": quality_cfg.version, "reference_sources": sorted(quality_cfg.reference_sources),
            "num_buckets": int(quality_cfg.num_buckets)}


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(fs.read_bytes(path)).hexdigest()


@gin.configurable
@dataclasses.dataclass
class QualityConfig:
    """A hashed word uni+bigram language model trained on `reference_sources`; the score
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
        key = "QualityConfig.calibration"
        if not fs.isfile(self.calibration):
            raise ConfigError(f"{key} = {self.calibration!r}: no such file")
        raw = fs.read_bytes(self.calibration)
        try:
            cal = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{key}: {self.calibration} is not UTF-8 JSON ({e})") from None
        if not isinstance(cal, dict) or cal.get("format") != FORMAT or not isinstance(
                cal.get("sources"), dict):
            raise ConfigError(f"{key}: {self.calibration} is not a {FORMAT} file")
        if cal.get("scorer") != scorer_identity(self):
            raise ConfigError(f"{key}: {self.calibration} calibrates the scorer {cal.get('scorer')}, this build's is "
                              f"{scorer_identity(self)}: its quantiles do not apply; calibrate this scorer")
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

    def check(self, sources: list) -> None:
        """Resolve phase: `reference_sources` and the calibration's sources are registered, `validate`, the
        calibration file (`calibrated`). Raises ConfigError naming the key."""
        names = [s.name for s in sources]
        for q in self.reference_sources:
            if q not in names:
                raise ConfigError(f"QualityConfig.reference_sources: '{q}' is not a registered source")
        if self.enabled:
            self.validate()
            unknown = sorted(set((self.calibrated() or {}).get("sources", {})) - set(names))
            if unknown:
                raise ConfigError(f"QualityConfig.calibration: {self.calibration} calibrates sources this build "
                                  f"does not register: {unknown} (a renamed source, or another corpus's calibration)")

    def operative(self, out: dict) -> dict:
        """`out` (this config as a dict) as the operative config lists it: ``scorer`` only when it is the classifier
        (with the classifier file's sha256), ``calibration`` only when set, as its path, sha256 and per-source drop
        quantiles."""
        if self.scorer == "ngram":  # the default: listed as before the option existed
            del out["scorer"], out["classifier_path"]
        else:  # the classifier's identity, not the n-gram model's settings it does not use
            for k in ("reference_sources", "num_buckets"):
                del out[k]
            out["version"] = quality_model.VERSION
            out["classifier_sha256"] = sha256_file(self.classifier_path)
        cal = self.calibrated()
        if cal is None:
            del out["calibration"]
        else:
            out["calibration"] = {
                "path": self.calibration,
                "sha256": self.calibration_sha256(),
                "drop_quantile": {s: c["drop_quantile"] for s, c in sorted(cal["sources"].items())}}
        return out


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


class FeatureCounts(beam.CombineFn):
    """Integer bucket counts of hashed n-grams over reference documents (``int64[num_buckets]``)."""

    def __init__(self, num_buckets):
        self.num_buckets = num_buckets

    def create_accumulator(self):
        return np.zeros(self.num_buckets, dtype=np.int64)

    def add_input(self, acc, text):
        np.add.at(acc, _feature_ids(text, self.num_buckets), 1)
        return acc

    def merge_accumulators(self, accs):
        accs = list(accs)
        out = accs[0].copy()
        for a in accs[1:]:
            out += a
        return out

    def extract_output(self, acc):
        return acc


class Score(beam.DoFn):
    def process(self, doc, counts):
        model = getattr(self, "_model", None)
        if model is None or model.counts is not counts:
            model = self._model = HashedNgramLM(counts)
        yield dict(doc, quality=model.score(doc["text"]))


class ScoreByClassifier(beam.DoFn):
    """Scoring with ``QualityConfig.scorer = 'classifier'``: each document's log-odds of good
    (`quality_model.LabelClassifier`, loaded once per worker)."""

    def __init__(self, path: str):
        self._path = path

    def setup(self):
        self._model = quality_model.LabelClassifier.load(self._path)

    def process(self, doc):
        yield dict(doc, quality=self._model.score(doc["text"]))


def _thresholds(kv, quantiles: dict, default: float):
    source, scores = kv
    q = quantiles.get(source, default)
    scores = np.sort(np.asarray(list(scores), dtype=np.float64))
    return source, float(np.quantile(scores, q, method="lower")) if q > 0 else float("-inf")


def apply_quality(doc, thresholds):
    t = thresholds[doc["source"]]
    if doc["quality"] < t:
        yield beam.pvalue.TaggedOutput(base.DROPS, base.decision(doc, "quality", "below_source_quantile",
                                                        quality_score=doc["quality"], threshold=t))
    else:
        yield doc


def _quality_stage(p, docs, ctx: base.Context, cfg):
    """Score every document, drop those under their source's quantile. Returns (docs, thresholds)."""
    classifier = cfg.quality.scorer == "classifier"
    if not (cfg.quality.enabled and (cfg.quality.reference_sources or classifier)):
        return docs, p | "NoThresholds" >> beam.Create([])
    if classifier:
        docs = docs | "ScoreByClassifier" >> beam.ParDo(ScoreByClassifier(cfg.quality.classifier_path))
    else:
        refs = set(cfg.quality.reference_sources)
        counts = (
            docs | "RefDocs" >> beam.Filter(lambda d: d["source"] in refs)
            | "RefTexts" >> beam.Map(lambda d: d["text"])
            | "TrainLM" >> beam.CombineGlobally(FeatureCounts(cfg.quality.num_buckets))
        )
        docs = docs | "Score" >> beam.ParDo(Score(), beam.pvalue.AsSingleton(counts))
    thresholds = (
        docs | "SourceScores" >> beam.Map(lambda d: (d["source"], d["quality"]))
        | "GroupScores" >> beam.GroupByKey()
        | "Thresholds" >> beam.Map(_thresholds, cfg.quality.drop_quantiles(), cfg.quality.drop_quantile)
    )
    docs = base.with_drops(docs, "ApplyQuality", beam.FlatMap(apply_quality, beam.pvalue.AsDict(thresholds)), ctx)
    return docs, thresholds


def _calibration_record(quality) -> dict:
    """The manifest's account of a calibrated quality stage: the label set and, per source, the scorer's agreement
    with the labels and what each candidate quantile keeps and loses (`data_pipelines.calibrate`); {} without one."""
    cal = quality.calibrated() if quality.enabled else None
    if cal is None:
        return {}
    keep = ("labels", "labelled_good", "good_rate", "auc", "drop_quantile", "reason", "at_drop_quantile",
            "by_quantile")
    return {"calibration_label_set": cal.get("label_set"), "calibration_rule": cal.get("rule"),
            "calibration_by_source": {s: {k: c.get(k) for k in keep} for s, c in sorted(cal["sources"].items())}}


class Quality(base.Step):
    """Writes ``DIR/_stats/quality_thresholds.json`` (per source, the score under which documents drop)."""

    name = stage = config_field = "quality"
    config = QualityConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        docs, thresholds = _quality_stage(ctx.pipeline, docs, ctx, ctx.cfg)
        _ = (thresholds | "ThresholdDict" >> beam.combiners.ToDict()
             | "WriteThresholds" >> beam.Map(writer.write_json, fs.join(ctx.out_dir, "_stats", "quality_thresholds.json")))
        return docs

    def record(self, facts: base.Facts) -> dict:
        return {"quality": dict(facts.operative["quality"], thresholds_per_source=facts.stat("quality_thresholds.json"),
                                **_calibration_record(facts.cfg.quality))}
