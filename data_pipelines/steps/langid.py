"""Language ID: each document's language (lingua, or declared), and drops outside its source's languages."""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import gin

from jaxpt.util.errors import ConfigError

from data_pipelines.steps import base


REASONS = ("language_not_allowed",)

@gin.configurable
@dataclasses.dataclass
class LangIdConfig:
    """Lingua (its models ship inside the wheel) restricted to `languages` (ISO 639-1).

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

    def check(self, sources: list) -> None:
        """Resolve phase: every `declared_sources` name is registered. Raises ConfigError naming it."""
        names = [s.name for s in sources]
        for q in self.declared_sources:
            if q not in names:
                raise ConfigError(f"LangIdConfig.declared_sources: '{q}' is not a registered source")

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


def _declared_language(doc: dict, source) -> str | None:
    """The language language ID falls back on: the record's own ``lang`` if its source allows it, else the
    source's first allowed language (None if the source declares none)."""
    allowed = source.languages or ()
    hint = doc.get("lang_hint")
    if hint in allowed:
        return hint
    return allowed[0] if allowed else None


class IdentifyLanguage(beam.DoFn):
    """A batch of documents -> each with ``lang`` and ``lang_by`` (``detected``, ``declared`` or ``record``), or its
    ``language_not_allowed`` drop."""

    def __init__(self, cfg: LangIdConfig, sources: dict):
        self.cfg, self.sources = cfg, sources

    def setup(self):
        self.lid = LanguageIdentifier(self.cfg) if self.cfg.enabled else None

    def process(self, batch):
        docs = [dict(d) for d in batch]
        trusted = set(self.cfg.declared_sources)
        need = [d for d in docs if self.lid and self.sources[d["source"]].languages is not None
                and d["source"] not in trusted]
        declared = [_declared_language(d, self.sources[d["source"]]) for d in need]
        langs = dict(zip((d["id"] for d in need),
                         self.lid.detect([d["text"] for d in need], declared) if need else []))
        for doc in docs:
            allowed = self.sources[doc["source"]].languages
            if doc["id"] in langs:
                doc["lang"], _, doc["lang_by"] = langs[doc["id"]]
                if doc["lang"] not in allowed:
                    yield beam.pvalue.TaggedOutput(
                        base.DROPS, base.decision(doc, "langid", "language_not_allowed", detail=doc["lang"]))
                    continue
            elif doc["source"] in trusted and allowed is not None:
                doc["lang"], doc["lang_by"] = _declared_language(doc, self.sources[doc["source"]]), "declared"
            else:
                doc["lang"], doc["lang_by"] = doc.get("lang_hint") or "und", "record"
            yield doc


class LanguageId(base.Step):
    """Detection runs on batches (lingua's parallel detector)."""

    name = stage = config_field = "langid"
    config = LangIdConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        batches = docs | "Batch" >> beam.BatchElements(min_batch_size=32, max_batch_size=256)
        return base.with_drops(batches, "LangId", beam.ParDo(IdentifyLanguage(ctx.cfg.langid, ctx.sources)), ctx)

    def record(self, facts: base.Facts) -> dict:
        return {"langid": facts.operative["langid"]}
