"""Exact dedup: documents with equal `exact_key` are one; the smallest id is kept."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import apache_beam as beam
import gin

from data_pipelines.steps import base


REASONS = ("duplicate",)

@gin.configurable
@dataclasses.dataclass
class ExactDedupConfig:
    """Documents with equal `key` (sha256 of text with whitespace runs collapsed and
    case folded) are duplicates; the smallest id is kept."""

    enabled: bool = True


_WS_RE = re.compile(r"\s+")


def exact_key(text: str) -> str:
    """sha256 hex of the text with whitespace runs collapsed to one space and case folded."""
    return hashlib.sha256(_WS_RE.sub(" ", text).strip().casefold().encode("utf-8")).hexdigest()


def pick_exact(kv):
    """Keeps the smallest id of an exact-duplicate group; the others drop with cluster_id = it."""
    _, group = kv
    group = sorted(group, key=lambda d: d["id"])
    yield group[0]
    for d in group[1:]:
        yield beam.pvalue.TaggedOutput(
            base.DROPS, base.decision(d, "exact_dedup", "duplicate", cluster_id=group[0]["id"], dup_of=group[0]["id"]))


class ExactDedup(base.Step):
    name = stage = "exact_dedup"
    config_field = "exact"
    config = ExactDedupConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        if not ctx.cfg.exact.enabled:
            return docs
        groups = (docs | "ExactKey" >> beam.Map(lambda d: (exact_key(d["text"]), d))
                  | "GroupExact" >> beam.GroupByKey())
        return base.with_drops(groups, "PickExact", beam.FlatMap(pick_exact), ctx)

    def record(self, facts: base.Facts) -> dict:
        return {"exact_dedup": {"key": "sha256(casefold(collapse_whitespace(text)))", "representative": "smallest id"}}
