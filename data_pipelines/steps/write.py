"""Write: the training documents tokenized into ArrayRecord shards, one decision row per input record, the review
samples per rule and the long-tail coverage (`data_pipelines.writer` formats)."""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import gin
import numpy as np

from jaxpt.util import fs, jsonl
from jaxpt.util.errors import ConfigError

from data_pipelines import draws, minhash, progress, sink, writer
from data_pipelines.steps import base


@gin.configurable
@dataclasses.dataclass
class OutputConfig:
    """`tokenizer_path` is the corpus's tokenizer: a SentencePiece model (``tokenizer.model``, e.g.
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

    def check(self, sources: list) -> None:
        """Resolve phase: a tokenizer, an owner, a held-out fraction in [0, 1). Raises ConfigError naming the key."""
        if not self.tokenizer_path:
            raise ConfigError("OutputConfig.tokenizer_path: a tokenizer is required (a SentencePiece model, or a base "
                              "model's tokenizer.json)")
        if not self.owner:
            raise ConfigError("OutputConfig.owner: name the team or person who owns this data version")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"OutputConfig.heldout_fraction = {self.heldout_fraction} must be in [0, 1)")


class Tokenize(beam.DoFn):
    """Document -> ((domain, shard), (id, serialized example)) plus its kept decision row."""

    def __init__(self, out_cfg):
        self.cfg = out_cfg

    def setup(self):
        self.enc = writer.TokenizerEncoder(self.cfg.tokenizer_path)
        self.features = writer.corpus_features()
        from tensorflow.core.example import example_pb2  # defers tensorflow

        self._example = example_pb2.Example

    def process(self, doc):
        tokens = self.enc.encode(doc["text"])
        ex = self.features.serialize_example({
            "id": doc["id"], "source": doc["source"], "domain": doc["domain"], "lang": doc["lang"],
            "tokens": tokens, "text": doc["text"] if self.cfg.store_text else "",
        })
        # tf.Example holds a protobuf map, whose default wire order varies between processes.
        ex = self._example.FromString(ex).SerializeToString(deterministic=True)
        shard = int(draws.uniform(1, doc["id"]) * self.cfg.shards_per_domain)
        yield (doc["domain"], shard), (doc["id"], ex)
        yield beam.pvalue.TaggedOutput(base.DROPS, {
            "id": doc["id"], "source": doc["source"], "domain": doc["domain"], "lang": doc["lang"],
            "verdict": "kept", "stage": None, "reason": None, "n_chars": len(doc["text"]),
            "lang_by": doc.get("lang_by"), **({"decoded_by": doc["decoded_by"]} if doc.get("decoded_by") else {}),
            "n_tokens": int(tokens.size), "quality_score": doc.get("quality"), "sample": "", **base.paragraph_log(doc),
        })


def write_shard(kv, out_dir, out_cfg):
    (domain, shard), items = kv
    items = sorted(items)
    name = writer.shard_filename(out_cfg.dataset_name, domain, shard, out_cfg.shards_per_domain)
    writer.write_array_record(fs.join(writer.tfds_dir(out_dir, out_cfg.dataset_name), name),
                              [ex for _, ex in items])
    yield name


def finalize_decision(row, near_map):
    row = dict(row)
    cid = row.get("cluster_id") or row["id"]
    row["cluster_id"] = near_map.get(cid, cid)
    row.setdefault("quality_score", None)
    row.setdefault("n_tokens", 0)
    row.setdefault("lang", None)
    row.setdefault("lang_by", None)
    return row


def write_decisions(kv, out_dir, n):
    shard, rows = kv
    rows = sorted(rows, key=lambda r: r["id"])
    for r in rows:
        r.pop("sample", None)
    path = fs.join(out_dir, "decisions", f"decisions-{shard:05d}-of-{n:05d}.jsonl.gz")
    writer.write_jsonl_gz(path, rows)
    yield path


def write_review(kv, out_dir):
    (stage, reason), items = kv
    rows = [dict(r, review_priority=u) for u, r in sorted(items, key=lambda x: (x[0], x[1]["id"]))]
    path = fs.join(out_dir, "review", f"{stage}__{reason}.jsonl")
    sink.write_text(path, "".join(jsonl.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows))
    yield path


class TermDF(beam.CombineFn):
    """Saturating (at 255) document frequencies of hashed word types, ``uint8[num_buckets]``."""

    def __init__(self, num_buckets=1 << 22):
        self.num_buckets = num_buckets

    def create_accumulator(self):
        return np.zeros(self.num_buckets, dtype=np.uint8)

    def add_input(self, acc, text):
        ids = np.unique(np.fromiter(map(minhash._word_hash, minhash.words(text)), dtype=np.int64) % self.num_buckets)
        acc[ids] = np.minimum(acc[ids], 254) + 1
        return acc

    def merge_accumulators(self, accs):
        accs = list(accs)
        out = accs[0].astype(np.uint16)
        for a in accs[1:]:
            out += a
        return np.minimum(out, 255).astype(np.uint8)

    def extract_output(self, acc):
        return acc


def write_longtail(df_all, df_kept, out_dir, max_df):
    rare = (df_all >= 1) & (df_all <= max_df)
    stats = {
        "rare_term_definition": f"hashed word types (2^{int(np.log2(df_all.size))} buckets) in 1..{max_df} admitted documents",
        "rare_terms_in": int(rare.sum()),
        "rare_terms_kept": int((rare & (df_kept > 0)).sum()),
        "all_terms_in": int((df_all > 0).sum()),
        "all_terms_kept": int((df_kept > 0).sum()),
    }
    sink.write_text(fs.join(out_dir, "_stats", "longtail.json"), jsonl.dumps(stats, sort_keys=True, indent=1))
    return stats


def _count_decision(row: dict) -> dict:
    """``row`` unchanged, counted in the build's progress as kept, held out or dropped by its verdict."""
    v = row["verdict"]
    progress.count(v if v in ("kept", "heldout") else "dropped")
    return row


def _write_decision_log(drops: list, near_side, cfg, out_dir: str) -> None:
    """One decision row per input record (sharded by id hash) and the review samples per rule."""
    # Counted where each stage emits its rows (the Maps fuse into the producing stages), not after the Flatten,
    # whose next step waits for near-dedup's side input.
    counted = [d | f"CountDecisions{i}" >> beam.Map(_count_decision) for i, d in enumerate(drops)]
    decisions = (
        tuple(counted) | "AllDecisions" >> beam.Flatten()
        | "ClusterIds" >> beam.Map(finalize_decision, near_side)
    )
    n_dec = cfg.output.decision_shards
    _ = (
        decisions | "DecisionShard" >> beam.Map(lambda r: (int(draws.uniform(2, r["id"]) * n_dec), r))
        | "GroupDecisions" >> beam.GroupByKey()
        | "WriteDecisions" >> beam.FlatMap(write_decisions, out_dir, n_dec)
    )
    seed, n_rev = cfg.output.review_seed, cfg.output.review_samples_per_rule
    _ = (
        decisions | "Dropped" >> beam.Filter(lambda r: r["verdict"] not in ("kept", "heldout"))
        | "ReviewKey" >> beam.Map(lambda r: ((r["stage"], r["reason"]), (draws.uniform(seed, r["id"]), r)))
        | "ReviewSample" >> beam.combiners.Top.PerKey(n_rev, key=lambda x: (-x[0], x[1]["id"]))
        | "WriteReview" >> beam.FlatMap(write_review, out_dir)
    )


def complete_shards(cfg, out_dir) -> dict[str, list[int]]:
    """Writes empty shards for (domain, index) slots no document hashed to; returns lengths."""
    from array_record.python import array_record_data_source

    data_dir = writer.tfds_dir(out_dir, cfg.output.dataset_name)
    domains = sorted({s.domain for s in cfg.registry()})
    n = cfg.output.shards_per_domain
    lengths = {}
    for d in domains:
        lens = []
        for i in range(n):
            path = fs.join(data_dir, writer.shard_filename(cfg.output.dataset_name, d, i, n))
            if not fs.exists(path):
                writer.write_array_record(path, [])
            # ArrayRecord opens local files only: a shard in object storage is counted from a local copy.
            src = array_record_data_source.ArrayRecordDataSource([fs.local_copy(path)])
            lens.append(len(src))
        lengths[d] = lens
    return lengths


class Write(base.Step):
    """Last: its transform reads `Context.drops`, `Context.near_map` and `Context.admitted`."""

    name = "write"
    config_field = "output"
    config = OutputConfig

    def expand(self, docs, ctx: base.Context):
        cfg, out_dir = ctx.cfg, ctx.out_dir
        df_all = ctx.admitted | "TextsAll" >> beam.Map(lambda d: d["text"]) | "DFAll" >> beam.CombineGlobally(TermDF())
        df_kept = docs | "TextsKept" >> beam.Map(lambda d: d["text"]) | "DFKept" >> beam.CombineGlobally(TermDF())
        _ = df_all | "LongTail" >> beam.Map(lambda a, k: write_longtail(a, k, out_dir, 3),
                                            beam.pvalue.AsSingleton(df_kept))
        records = base.with_drops(docs, "Tokenize", beam.ParDo(Tokenize(cfg.output)), ctx, main="records")
        _ = (records | "GroupShards" >> beam.GroupByKey()
             | "WriteShards" >> beam.FlatMap(write_shard, out_dir, cfg.output))
        _write_decision_log(ctx.drops, ctx.near_map, cfg, out_dir)
        return None
