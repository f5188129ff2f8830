"""Normalization: ftfy repair and Unicode normalization (`NormalizeConfig`)."""

from __future__ import annotations

import dataclasses
import re

import apache_beam as beam
import gin

from data_pipelines.steps import base


REASONS = ("empty_after_normalization",)

@gin.configurable
@dataclasses.dataclass
class NormalizeConfig:
    """ftfy repairs mojibake, strips terminal escapes and applies Unicode `normalization`."""

    normalization: str = "NFC"
    enabled: bool = True


# ASCII text without these is a fixed point of ftfy.fix_text: mojibake, curly quotes, ligatures, width and
# normalization fixes all need non-ASCII input, and the remaining fixers act on HTML entities (ftfy's own pattern,
# chardata.HTML_ENTITY_RE: a '&' that starts none is left alone), ESC sequences, CR line breaks and control characters.
_FTFY_ASCII_TRIGGERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]|&#?[0-9A-Za-z]{1,24};")


def _ftfy_fixed_point(text: str) -> bool:
    """True if ftfy would return `text` (a whole text or one line of it) unchanged: plain ASCII without a trigger."""
    return text.isascii() and not _FTFY_ASCII_TRIGGERS.search(text)


def _fix_text(text: str, normalization: str) -> str:
    """``ftfy.fix_text(text, normalization=normalization)``, with each line that is a fixed point
    (`_ftfy_fixed_point`) passed through instead of fixed.

    ftfy.fix_text fixes a text one line at a time (each line, up to ``max_decode_length`` characters, through
    `ftfy.fix_and_explain`), and stops unescaping HTML entities from the first line holding a '<' on; this is that
    loop, so the result is the same (tests/test_corpus_normalize.py checks it on raw-v1 and on generated text).
    Documents that are mostly ASCII with a few accented names, '&' operators or typographic quotes cost the lines
    that hold them instead of every line.
    """
    import ftfy

    config = ftfy.TextFixerConfig(normalization=normalization, explain=False)
    out, pos = [], 0
    while pos < len(text):
        end = text.find("\n", pos) + 1 or len(text)
        end = min(end, pos + config.max_decode_length)
        line = text[pos:end]
        if config.unescape_html == "auto" and "<" in line:
            config = config._replace(unescape_html=False)
        out.append(line if _ftfy_fixed_point(line) else ftfy.fix_and_explain(line, config).text)
        pos = end
    return "".join(out)


def normalize(text: str, cfg: NormalizeConfig) -> str:
    """ftfy repair (mojibake, terminal escapes, HTML entities left in text) then Unicode
    `cfg.normalization` (NFC by default), equal to ``ftfy.fix_text(text, normalization=cfg.normalization)``.
    Plain ASCII without control characters or HTML entities is returned as is (ftfy would return it unchanged;
    about 60% of raw-v1's characters), and in other text only the lines that are not such are fixed (`_fix_text`)."""
    if not cfg.enabled or _ftfy_fixed_point(text):
        return text
    return _fix_text(text, cfg.normalization)


def _normalize_doc(doc: dict, cfg: NormalizeConfig):
    text = normalize(doc["text"], cfg)
    if not text.strip():
        yield beam.pvalue.TaggedOutput(base.DROPS, base.decision(doc, "normalize", "empty_after_normalization"))
    else:
        yield dict(doc, text=text)


class Normalization(base.Step):
    name = "normalization"
    stage = config_field = "normalize"
    config = NormalizeConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        return base.with_drops(docs, "Normalize", beam.FlatMap(_normalize_doc, ctx.cfg.normalize), ctx)

    def record(self, facts: base.Facts) -> dict:
        return {"normalize": facts.operative["normalize"]}
