"""Near dedup: MinHash LSH over word shingles (`data_pipelines.minhash`), verified pairs, connected components; the
longest text of a cluster is kept."""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import gin

from jaxpt.util.errors import ConfigError

from data_pipelines import minhash
from data_pipelines.steps import base


REASONS = ("near_duplicate",)

@gin.configurable
@dataclasses.dataclass
class NearDedupConfig:
    """See `data_pipelines.minhash` for the method."""

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

    def check(self, sources: list) -> None:
        """Resolve phase: `validate`."""
        self.validate()

class Signature(beam.DoFn):
    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        self.hasher = minhash.MinHasher(self.cfg.num_perm, self.cfg.shingle_size, self.cfg.seed)

    def process(self, doc):
        sig = self.hasher.signature(doc["text"])
        if sig is not None:
            yield doc["id"], (sig, len(doc["text"]))


def _bucket_members(kv):
    ids = sorted(set(kv[1]))
    if len(ids) > 1:
        for i in ids:
            yield i, kv[0]


def _to_buckets(kv):
    doc_id, grouped = kv
    sigs = grouped["sig"]
    if not sigs:
        return
    sig, n = sigs[0]
    for bucket in grouped["bucket"]:
        yield bucket, (doc_id, sig, n)


def _verify_bucket(kv, cfg):
    members = {m[0]: m for m in kv[1]}
    sigs = {k: v[1] for k, v in members.items()}
    for a, b in minhash.bucket_edges(list(members), sigs, cfg.threshold, cfg.max_bucket):
        yield (a, b, members[a][2], members[b][2])


def _components(edges):
    edges = sorted(set(edges))
    n_chars = {}
    for a, b, na, nb in edges:
        n_chars[a], n_chars[b] = na, nb
    return sorted(minhash.connected_components([(a, b) for a, b, _, _ in edges], n_chars).items())


def lsh_buckets(sigs, bands: int, rows: int, prefix: str = ""):
    """The LSH buckets of keyed MinHash signatures, as Beam groups them: ``sigs`` is a PCollection of
    ``(key, (signature uint32[num_perm], payload))``; the result, of ``(bucket, [(key, signature, payload), ...])``
    for every bucket with more than one member (`_bucket_members`, `_to_buckets`), one bucket per band key
    (`minhash.band_keys` with ``bands`` x ``rows``). ``prefix`` names the transforms (unique per stage)."""
    members = (
        sigs
        | f"{prefix}BandKeys" >> beam.FlatMap(
            lambda kv, b, r: (((i, int(k)), kv[0]) for i, k in enumerate(minhash.band_keys(kv[1][0], b, r))),
            bands, rows)
        | f"{prefix}GroupBands" >> beam.GroupByKey()
        | f"{prefix}BucketMembers" >> beam.FlatMap(_bucket_members)
    )
    return (
        {"sig": sigs, "bucket": members}
        | f"{prefix}JoinSigs" >> beam.CoGroupByKey()
        | f"{prefix}ToBuckets" >> beam.FlatMap(_to_buckets)
        | f"{prefix}GroupBuckets" >> beam.GroupByKey()
    )


def near_dedup(docs, cfg):
    """PCollection of (id, representative id) for every member of a near-duplicate cluster."""
    sigs = docs | "MinHash" >> beam.ParDo(Signature(cfg))
    edges = lsh_buckets(sigs, cfg.bands, cfg.rows) | "Verify" >> beam.FlatMap(_verify_bucket, cfg)
    return (
        edges
        | "AllEdges" >> beam.combiners.ToList()
        | "Components" >> beam.FlatMap(_components)
    )


def apply_near(doc, near_map):
    rep = near_map.get(doc["id"])
    if rep is None or rep == doc["id"]:
        yield doc
    else:
        yield beam.pvalue.TaggedOutput(base.DROPS, base.decision(doc, "near_dedup", "near_duplicate", cluster_id=rep, dup_of=rep))


class NearDedup(base.Step):
    """Sets `Context.near_map` (the decision log's cluster ids read it)."""

    name = stage = "near_dedup"
    config_field = "near"
    config = NearDedupConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        if ctx.cfg.near.enabled:
            near_map = near_dedup(docs, ctx.cfg.near)
        else:
            near_map = ctx.pipeline | "NoNear" >> beam.Create([])
        ctx.near_map = beam.pvalue.AsDict(near_map)
        return base.with_drops(docs, "ApplyNear", beam.FlatMap(apply_near, ctx.near_map), ctx)

    def record(self, facts: base.Facts) -> dict:
        return {"near_dedup": dict(facts.operative["near"], shingles="word n-grams (minhash.words)",
                                   representative="longest text, then smallest id",
                                   verification="estimated Jaccard >= threshold before union",
                                   clusters="connected components",
                                   short_documents="fewer words than shingle_size: one shingle of all words")}
