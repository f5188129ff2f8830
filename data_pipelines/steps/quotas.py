"""Quotas: per-domain character budgets from `QuotaConfig.targets`, met by keeping documents in seeded-hash rank."""

from __future__ import annotations

import collections
import dataclasses
import math

import apache_beam as beam
import gin

from jaxpt.util import fs
from jaxpt.util.errors import ConfigError

from data_pipelines import draws, writer
from data_pipelines.steps import base


REASONS = ("downsampled",)

@gin.configurable
@dataclasses.dataclass
class QuotaConfig:
    """`targets`: share of output characters per domain (sums to 1). The largest total
    that no domain must upsample to reach is chosen, and each domain's budget is its share of it.
    Within a domain every (domain, language) group keeps at least min(its characters,
    `long_tail_floor` * `long_tail_share` of the domain's budget), the rest of the budget going to all
    groups in proportion to their size, so a smaller group never keeps more text than a larger one
    (`quota_keep_fractions`). Documents are chosen by rank of a seeded hash of their id up to
    the group's budget (`quota_cutoff`), not by independent coin flips. A domain whose
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

    def check(self, sources: list) -> None:
        """Resolve phase: a target for every registered domain (when there are targets), `validate`."""
        if self.enabled and self.targets:
            missing = {s.domain for s in sources} - set(self.targets)
            if missing:
                raise ConfigError(f"QuotaConfig.targets: no target for domains {sorted(missing)}")
        self.validate()


def _solve_increasing(f, target: float, lo: float, hi: float, iters: int = 100) -> float:
    """The largest x in [lo, hi] with f(x) <= target, for nondecreasing f (bisection)."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def quota_keep_fractions(chars: dict[tuple[str, str], int], cfg: QuotaConfig) -> dict[str, float]:
    """Share of its characters each ``"domain/lang"`` group keeps (a float in [0, 1]).

    Args:
      chars: characters available per (domain, language) after the steps before quotas.
    Returns:
      ``{"domain/lang": fraction}``; `quota_cutoff` turns a fraction into a deterministic selection.

    With A_d the characters of domain d and w_d its target share, the output total is T = min_d A_d / w_d
    (the largest total no domain must upsample for), so domain d's budget is B_d = w_d * T <= A_d characters.
    Within the domain, group g (c_g characters) keeps k_g = max(p_d * c_g, min(c_g, F_d)) characters, where the
    floor F_d = min(long_tail_floor * long_tail_share * B_d, F*) and p_d solves sum_g k_g = B_d (F* is the floor
    at which the floors alone fill the budget). k_g is nondecreasing in c_g, so a smaller group never keeps
    more text than a larger one (no cliff at `long_tail_share`), and each domain's total meets its budget exactly.
    """
    if not cfg.enabled or not cfg.targets:
        return {f"{d}/{l}": 1.0 for d, l in chars}
    groups: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (d, lang), c in chars.items():
        groups[d][lang] = c
    per_domain = {d: sum(g.values()) for d, g in groups.items()}
    live = {d: a for d, a in per_domain.items() if a > 0 and cfg.targets.get(d, 0) > 0}
    total = min(a / cfg.targets[d] for d, a in live.items()) if live else 0.0
    out = {}
    for d, g in sorted(groups.items()):
        if d not in live:
            out.update({f"{d}/{lang}": 0.0 for lang in g})
            continue
        budget = min(float(per_domain[d]), cfg.targets[d] * total)
        sizes = list(g.values())
        floor = cfg.long_tail_floor * cfg.long_tail_share * budget
        floor = min(floor, _solve_increasing(lambda f: sum(min(c, f) for c in sizes), budget, 0.0, max(sizes)))
        p = _solve_increasing(lambda q: sum(max(q * c, min(c, floor)) for c in sizes), budget, 0.0, 1.0)
        for lang, c in sorted(g.items()):
            out[f"{d}/{lang}"] = min(1.0, max(p * c, min(c, floor)) / c) if c else 0.0
    return out


def quota_cutoff(items: list[tuple[float, str, int]], fraction: float) -> float:
    """Hash cutoff that keeps `fraction` of a group's characters by rank, not by independent coin flips.

    Args:
      items: (``uniform(seed, id)``, id, characters) of every document of one (domain, language) group.
      fraction: share of the group's characters to keep (`quota_keep_fractions`).
    Returns:
      u* such that the group's documents with ``uniform(seed, id) < u*`` are kept: the shortest prefix of the
      documents ranked by their seeded hash whose characters reach the budget ``fraction * total`` to the nearest
      document (a document is kept while the characters before it plus half its own are within budget). 2.0
      keeps every document. Deterministic: same ids, seed and fraction give the same selection.
    """
    ranked = sorted(items)
    budget = fraction * sum(n for _, _, n in ranked)
    before = 0
    for u, _, n in ranked:
        if before + n / 2 > budget:
            return u
        before += n
    return 2.0


def quota_share_warnings(kept_chars: dict[str, int], targets: dict[str, float], tolerance: float) -> list[str]:
    """One message per domain whose realized share of kept characters strays from its target by more than
    `tolerance` (absolute, e.g. 0.02 = 2 points). Empty if there are no targets or no kept text."""
    total = sum(kept_chars.values())
    if not targets or not total:
        return []
    out = []
    for d, w in sorted(targets.items()):
        share = kept_chars.get(d, 0) / total
        if abs(share - w) > tolerance:
            out.append(f"quota: domain '{d}' realized share {share:.4f} of kept characters vs target {w:.4f} "
                       f"(off by {abs(share - w):.4f} > QuotaConfig.share_tolerance = {tolerance})")
    return out


def entropy_bits(p: list[float]) -> float:
    """Shannon entropy in bits of a distribution (helper for reports)."""
    return -sum(x * math.log2(x) for x in p if x > 0)


def _group(doc) -> str:
    return f"{doc['domain']}/{doc['lang']}"


def apply_quota(doc, fractions, cutoffs, seed):
    """Keeps a document whose seeded hash ranks it inside its group's character budget (`quota_cutoff`)."""
    g = _group(doc)
    if draws.uniform(seed, doc["id"]) < cutoffs[g]:
        yield doc
    else:
        yield beam.pvalue.TaggedOutput(base.DROPS, base.decision(doc, "quota", "downsampled", keep_fraction=fractions[g],
                                                        quality_score=doc.get("quality")))


def _quota_stage(docs, ctx: base.Context, cfg):
    """Per-(domain, lang) character budgets (`quota_keep_fractions`), then per group the documents
    ranked by seeded hash up to the budget (`quota_cutoff`). Returns (docs, fractions)."""
    seed = cfg.quotas.seed
    chars = (
        docs | "GroupChars" >> beam.Map(lambda d: ((d["domain"], d["lang"]), len(d["text"])))
        | "SumChars" >> beam.CombinePerKey(sum)
        | "CharsDict" >> beam.combiners.ToDict()
    )
    fractions = chars | "QuotaFractions" >> beam.Map(quota_keep_fractions, cfg.quotas)
    cutoffs = (
        docs | "QuotaRanks" >> beam.Map(lambda d: (_group(d), (draws.uniform(seed, d["id"]), d["id"], len(d["text"]))))
        | "GroupRanks" >> beam.GroupByKey()
        | "QuotaCutoffs" >> beam.Map(lambda kv, f: (kv[0], quota_cutoff(list(kv[1]), f[kv[0]])),
                                     beam.pvalue.AsSingleton(fractions))
        | "CutoffDict" >> beam.combiners.ToDict()
    )
    docs = base.with_drops(docs, "ApplyQuota", beam.FlatMap(apply_quota, beam.pvalue.AsSingleton(fractions),
                                                          beam.pvalue.AsSingleton(cutoffs), seed), ctx)
    return docs, fractions


def quota_warnings(cfg, rows: list[dict]) -> list[str]:
    """`quota_share_warnings` on the training split's characters per domain (decision rows ``kept``)."""
    kept = collections.Counter()
    for r in rows:
        if r["verdict"] == "kept":
            kept[r["domain"]] += r.get("n_chars") or 0
    if not cfg.quotas.enabled:
        return []
    return quota_share_warnings(dict(kept), cfg.quotas.targets, cfg.quotas.share_tolerance)


class Quotas(base.Step):
    """Writes ``DIR/_stats/quota_fractions.json`` (the share of characters each domain/language keeps)."""

    name = config_field = "quotas"
    stage = "quota"
    config = QuotaConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        docs, fractions = _quota_stage(docs, ctx, ctx.cfg)
        _ = (fractions | "WriteFractions" >> beam.Map(writer.write_json,
                                                      fs.join(ctx.out_dir, "_stats", "quota_fractions.json")))
        return docs

    def record(self, facts: base.Facts) -> dict:
        return {"quotas": dict(facts.operative["quotas"], keep_fractions=facts.stat("quota_fractions.json"))}
