"""The Apache Beam graph of the corpus build (stages 1-12, and 6b when `ParagraphDedupConfig.enabled`).

Elements are plain dicts. A document dict flows through the stages; a stage that removes it emits a
*decision* dict on its ``drops`` output instead (``verdict = "<stage>:<reason>"``). Every input
record therefore ends as exactly one decision row: kept (written by stage 10), held out (``verdict =
"heldout"``: kept, but in the held-out split that training never reads) or dropped once.

Determinism: no step depends on bundle order. Grouped values are sorted by id before use,
combiners are integer sums, sampling uses `stages.uniform(seed, id)`, and every file is written
from a sorted list, so two runs on the same inputs give byte-identical files.
"""

from __future__ import annotations


import apache_beam as beam
import numpy as np

from jaxpt.util import fs, jsonl

from data_pipelines import minhash, paragraphs, progress, readers, sink, stages, writer
from data_pipelines.config import BuildConfig, Source

DROPS = "drops"
HELDOUT = "heldout"


def _paragraph_log(doc: dict) -> dict:
    """``{"paragraphs_removed": [...]}`` for a document that lost units at stage 6b, else ``{}`` (so a build without
    paragraph dedup writes the rows it always wrote)."""
    return {"paragraphs_removed": doc["paragraphs_removed"]} if doc.get("paragraphs_removed") else {}


def _decision(doc: dict, stage: str, reason: str, **extra) -> dict:
    return readers.drop(doc["id"], {"name": doc["source"], "domain": doc["domain"]}, stage, reason,
                        doc.get("text", ""), lang=doc.get("lang"), lang_by=doc.get("lang_by"),
                        n_chars=len(doc.get("text", "")), **{**_paragraph_log(doc), **extra})


# ---------------------------------------------------------------- stage 1


class ReadSource(beam.DoFn):
    """(source name, file path or None for TFDS) -> documents and admission drops."""

    def __init__(self, sources: dict[str, Source], cfg):
        self.sources, self.cfg = sources, cfg

    def process(self, item):
        name, path = item
        src = self.sources[name]
        it = readers.read_tfds(src, self.cfg) if src.format == "tfds" else readers.read_file(path, src, self.cfg)
        for rec in it:
            progress.count("read")
            if "verdict" in rec:
                yield beam.pvalue.TaggedOutput(DROPS, rec)
            else:
                yield rec
        progress.count("files")


# ---------------------------------------------------------------- stages 2-4


def _declared_language(doc: dict, source: Source) -> str | None:
    """The language language ID falls back on: the record's own ``lang`` if its source allows it, else the
    source's first allowed language (None if the source declares none)."""
    allowed = source.languages or ()
    hint = doc.get("lang_hint")
    if hint in allowed:
        return hint
    return allowed[0] if allowed else None


class CleanBatch(beam.DoFn):
    """Main-text extraction, normalization (2), language ID (3) and rule filters (4) on a batch."""

    def __init__(self, cfg: BuildConfig, sources: dict[str, Source]):
        self.cfg, self.sources = cfg, sources

    def setup(self):
        self.lid = stages.LanguageIdentifier(self.cfg.langid) if self.cfg.langid.enabled else None
        self.rules = {}

    def process(self, batch):
        docs = []
        for doc in batch:
            doc = readers.extract_main_text(doc, self.cfg.admission.extraction_seconds)
            if "verdict" in doc:
                yield beam.pvalue.TaggedOutput(DROPS, doc)
                continue
            text = stages.normalize(doc["text"], self.cfg.normalize)
            if not text.strip():
                yield beam.pvalue.TaggedOutput(DROPS, _decision(doc, "normalize", "empty_after_normalization"))
                continue
            docs.append(dict(doc, text=text))
        trusted = set(self.cfg.langid.declared_sources)
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
                        DROPS, _decision(doc, "langid", "language_not_allowed", detail=doc["lang"]))
                    continue
            elif doc["source"] in trusted and allowed is not None:
                doc["lang"], doc["lang_by"] = _declared_language(doc, self.sources[doc["source"]]), "declared"
            else:
                doc["lang"], doc["lang_by"] = doc.get("lang_hint") or "und", "record"
            if self.cfg.rules.enabled:
                key = (doc["domain"], doc["source"])
                rc = self.rules.get(key)
                if rc is None:
                    rc = self.rules[key] = self.cfg.rules.for_domain(*key)
                reason = stages.rule_reason(doc["text"], rc)
                if reason:
                    yield beam.pvalue.TaggedOutput(DROPS, _decision(doc, "rules", reason))
                    continue
            yield doc


# ---------------------------------------------------------------- stage 5


def pick_exact(kv):
    """Keeps the smallest id of an exact-duplicate group; the others drop with cluster_id = it."""
    _, group = kv
    group = sorted(group, key=lambda d: d["id"])
    yield group[0]
    for d in group[1:]:
        yield beam.pvalue.TaggedOutput(
            DROPS, _decision(d, "exact_dedup", "duplicate", cluster_id=group[0]["id"], dup_of=group[0]["id"]))


# ---------------------------------------------------------------- stage 6


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
        yield beam.pvalue.TaggedOutput(DROPS, _decision(doc, "near_dedup", "near_duplicate", cluster_id=rep, dup_of=rep))


# ---------------------------------------------------------------- stage 6b: paragraph dedup


def _paragraph_counted(doc: dict, cfg) -> bool:
    """Whether stage 6b counts and edits `doc` (`ParagraphDedupConfig.skip_domains`, `skip_sources`)."""
    return doc["domain"] not in cfg.skip_domains and doc["source"] not in cfg.skip_sources


def _unit_occurrences(doc: dict, cfg):
    """(exact key, (document id, unit text)) once per distinct eligible unit of a counted document."""
    if not _paragraph_counted(doc, cfg):
        return
    seen = set()
    for _, key, text in paragraphs.eligible_units(paragraphs.split_units(doc["text"], cfg.unit), cfg.min_words):
        if key not in seen:
            seen.add(key)
            yield key, (doc["id"], text)


class UnitDocuments(beam.CombineFn):
    """Per unit key: ``(the k smallest ids of the documents holding it, its smallest text)``
    (`paragraphs.bottom_k`): exact about "more than k - 1 documents" with at most k ids per key, however hot."""

    def __init__(self, k: int):
        self.k = k

    def create_accumulator(self):
        return (), None

    def add_input(self, acc, item):
        doc_id, text = item
        ids, t = acc
        return paragraphs.bottom_k(ids + (doc_id,), self.k), text if t is None or text < t else t

    def merge_accumulators(self, accs):
        accs = list(accs)
        texts = [t for _, t in accs if t is not None]
        return paragraphs.bottom_k([i for ids, _ in accs for i in ids], self.k), min(texts) if texts else None

    def extract_output(self, acc):
        return acc


class UnitSignature(beam.DoFn):
    """(key, (ids, text)) -> (key, (MinHash signature uint32[num_perm] of the text's word shingles, ids)), for units
    of at least `paragraphs.near_min_words` words; a shorter unit gets none (it is matched exactly only)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        self.hasher = minhash.MinHasher(self.cfg.num_perm, self.cfg.shingle_size, self.cfg.seed)
        self.min_words = paragraphs.near_min_words(self.cfg.shingle_size, self.cfg.threshold)

    def process(self, kv):
        key, (ids, text) = kv
        if len(minhash.words(text)) < self.min_words:
            return
        sig = self.hasher.signature(text)
        if sig is not None:
            yield key, (sig, ids)


def paragraph_flags(units, cfg):
    """PCollection of (unit key, (rank, centre key)) for every unit to remove (`paragraphs.dedup_document`).

    `units`: (key, (document id, text)) occurrences. A key in more than `max_documents` documents is flagged
    ``(EXACT, key)``; with ``match = 'near'``, the members of an LSH bucket that `paragraphs.star_cluster` joins are
    flagged ``(NEAR, centre)`` (the document stage's banding and join, `near_dedup`); a key flagged both ways keeps
    the smaller rank."""
    t = cfg.max_documents
    stats = units | "ParagraphDocs" >> beam.CombinePerKey(UnitDocuments(t + 1))
    exact = (stats | "ParagraphRecurring" >> beam.Filter(lambda kv, t: len(kv[1][0]) > t, t)
             | "ParagraphExactFlag" >> beam.Map(lambda kv: (kv[0], (paragraphs.EXACT, kv[0]))))
    if cfg.match == "exact":
        return exact
    sigs = stats | "ParagraphMinHash" >> beam.ParDo(UnitSignature(cfg))
    near = (
        lsh_buckets(sigs, cfg.bands, cfg.rows, prefix="Paragraph")
        | "ParagraphClusters" >> beam.FlatMap(
            lambda kv, c: paragraphs.star_cluster(list(kv[1]), c.threshold, c.max_documents), cfg)
        | "ParagraphNearFlag" >> beam.Map(lambda kc: (kc[0], (paragraphs.NEAR, kc[1])))
    )
    return (exact, near) | "ParagraphFlags" >> beam.Flatten() | "ParagraphFlagRank" >> beam.CombinePerKey(min)


class ApplyParagraphs(beam.DoFn):
    """Removes a document's flagged units (`paragraphs.dedup_document`); the document keeps the decision-log entries
    as ``paragraphs_removed``. One left with no word, or under its rules' minimum length, drops instead
    (`paragraphs.left_reason`), its decision row naming the units it lost."""

    def __init__(self, cfg: BuildConfig):
        self.cfg = cfg

    def setup(self):
        self.rules = {}

    def process(self, doc, flags):
        pc = self.cfg.paragraphs
        if not flags or not _paragraph_counted(doc, pc):
            yield doc
            return
        text, log = paragraphs.dedup_document(doc["text"], pc.unit, pc.min_words, flags)
        if not log:
            yield doc
            return
        rules = None
        if self.cfg.rules.enabled:
            key = (doc["domain"], doc["source"])
            rules = self.rules.get(key)
            if rules is None:
                rules = self.rules[key] = self.cfg.rules.for_domain(*key)
        reason = paragraphs.left_reason(text, rules)
        if reason:
            yield beam.pvalue.TaggedOutput(DROPS, _decision(doc, "paragraph_dedup", reason, paragraphs_removed=log))
        else:
            yield dict(doc, text=text, paragraphs_removed=log)


def _paragraph_stage(docs, drops: list, cfg: BuildConfig):
    """Stage 6b (`ParagraphDedupConfig`): returns the documents without their recurring units."""
    units = docs | "ParagraphUnits" >> beam.FlatMap(_unit_occurrences, cfg.paragraphs)
    flags = beam.pvalue.AsDict(paragraph_flags(units, cfg.paragraphs))
    out = docs | "ApplyParagraphs" >> beam.ParDo(ApplyParagraphs(cfg), flags).with_outputs(DROPS, main="docs")
    drops.append(out[DROPS])
    return out.docs


# ---------------------------------------------------------------- stage 7


class FeatureCounts(beam.CombineFn):
    """Integer bucket counts of hashed n-grams over reference documents (``int64[num_buckets]``)."""

    def __init__(self, num_buckets):
        self.num_buckets = num_buckets

    def create_accumulator(self):
        return np.zeros(self.num_buckets, dtype=np.int64)

    def add_input(self, acc, text):
        np.add.at(acc, stages._feature_ids(text, self.num_buckets), 1)
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
            model = self._model = stages.HashedNgramLM(counts)
        yield dict(doc, quality=model.score(doc["text"]))


class ScoreByClassifier(beam.DoFn):
    """Stage 7 with ``QualityConfig.scorer = 'classifier'``: each document's log-odds of good
    (`quality_model.LabelClassifier`, loaded once per worker)."""

    def __init__(self, path: str):
        self._path = path

    def setup(self):
        from data_pipelines import quality_model
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
        yield beam.pvalue.TaggedOutput(DROPS, _decision(doc, "quality", "below_source_quantile",
                                                        quality_score=doc["quality"], threshold=t))
    else:
        yield doc


# ---------------------------------------------------------------- stage 8


class Decontaminate(beam.DoFn):
    """Drops a document containing an eval example (`stages.EvalIndex.match`; `DecontamConfig` says by which rule
    for which example length). The decision row names the sets (``detail``) and lists every match as
    ``eval_matches``: ``[set, example index, rule]``, from which the manifest counts the documents each example
    removed. The reason is ``eval_ngram_overlap`` when an n-gram or word-sequence rule matched, else
    ``eval_unit_match`` (only a short example matched, as a whole document, paragraph or line), so the review sample
    of the short-example rule is its own."""

    def __init__(self, eval_index: stages.EvalIndex):
        self.eval_index = eval_index

    def process(self, doc):
        hits = self.eval_index.match(doc["text"])
        if not hits:
            yield doc
            return
        rules = {rule for _, _, rule in hits}
        reason = "eval_unit_match" if rules == {"whole_unit"} else "eval_ngram_overlap"
        yield beam.pvalue.TaggedOutput(DROPS, _decision(
            doc, "decontamination", reason, detail=",".join(sorted({s for s, _, _ in hits})),
            eval_matches=[list(h) for h in hits], quality_score=doc.get("quality")))


# ---------------------------------------------------------------- stage 8b: held-out split


def split_heldout(doc, fraction):
    """Held-out documents leave on the HELDOUT output, before quotas (a held-out set keeps the natural mix)."""
    from jaxpt.data.prepare import is_heldout

    if fraction > 0 and is_heldout(doc["id"], fraction):
        yield beam.pvalue.TaggedOutput(HELDOUT, doc)
    else:
        yield doc


class HeldoutRecord(beam.DoFn):
    """Held-out document -> (domain, JSON record with its token count) plus its ``heldout`` decision row."""

    def __init__(self, out_cfg):
        self.cfg = out_cfg

    def setup(self):
        self.enc = writer.TokenizerEncoder(self.cfg.tokenizer_path)

    def process(self, doc):
        n_tokens = int(self.enc.encode(doc["text"]).size)
        yield doc["domain"], {"id": doc["id"], "source": doc["source"], "domain": doc["domain"],
                              "lang": doc["lang"], "text": doc["text"], "n_tokens": n_tokens}
        yield beam.pvalue.TaggedOutput(DROPS, {
            "id": doc["id"], "source": doc["source"], "domain": doc["domain"], "lang": doc["lang"],
            "verdict": "heldout", "stage": None, "reason": None, "n_chars": len(doc["text"]),
            "lang_by": doc.get("lang_by"), **({"decoded_by": doc["decoded_by"]} if doc.get("decoded_by") else {}),
            "n_tokens": n_tokens, "quality_score": doc.get("quality"), "sample": "", **_paragraph_log(doc),
        })


def write_heldout(kv, out_dir):
    """(domain, held-out records) -> ``writer.heldout_path(out_dir, domain)``, sorted by id; yields the path."""
    domain, rows = kv
    path = writer.heldout_path(out_dir, domain)
    writer.write_jsonl_gz(path, sorted(rows, key=lambda r: r["id"]))
    yield path


# ---------------------------------------------------------------- stage 9


def _group(doc) -> str:
    return f"{doc['domain']}/{doc['lang']}"


def apply_quota(doc, fractions, cutoffs, seed):
    """Keeps a document whose seeded hash ranks it inside its group's character budget (`stages.quota_cutoff`)."""
    g = _group(doc)
    if stages.uniform(seed, doc["id"]) < cutoffs[g]:
        yield doc
    else:
        yield beam.pvalue.TaggedOutput(DROPS, _decision(doc, "quota", "downsampled", keep_fraction=fractions[g],
                                                        quality_score=doc.get("quality")))


# ---------------------------------------------------------------- stage 10


class Tokenize(beam.DoFn):
    """Document -> ((domain, shard), (id, serialized example)) plus its kept decision row."""

    def __init__(self, out_cfg):
        self.cfg = out_cfg

    def setup(self):
        self.enc = writer.TokenizerEncoder(self.cfg.tokenizer_path)
        self.features = writer.corpus_features()
        from tensorflow.core.example import example_pb2

        self._example = example_pb2.Example

    def process(self, doc):
        tokens = self.enc.encode(doc["text"])
        ex = self.features.serialize_example({
            "id": doc["id"], "source": doc["source"], "domain": doc["domain"], "lang": doc["lang"],
            "tokens": tokens, "text": doc["text"] if self.cfg.store_text else "",
        })
        # tf.Example holds a protobuf map, whose default wire order varies between processes.
        ex = self._example.FromString(ex).SerializeToString(deterministic=True)
        shard = int(stages.uniform(1, doc["id"]) * self.cfg.shards_per_domain)
        yield (doc["domain"], shard), (doc["id"], ex)
        yield beam.pvalue.TaggedOutput(DROPS, {
            "id": doc["id"], "source": doc["source"], "domain": doc["domain"], "lang": doc["lang"],
            "verdict": "kept", "stage": None, "reason": None, "n_chars": len(doc["text"]),
            "lang_by": doc.get("lang_by"), **({"decoded_by": doc["decoded_by"]} if doc.get("decoded_by") else {}),
            "n_tokens": int(tokens.size), "quality_score": doc.get("quality"), "sample": "", **_paragraph_log(doc),
        })


def write_shard(kv, out_dir, out_cfg):
    (domain, shard), items = kv
    items = sorted(items)
    name = writer.shard_filename(out_cfg.dataset_name, domain, shard, out_cfg.shards_per_domain)
    writer.write_array_record(fs.join(writer.tfds_dir(out_dir, out_cfg.dataset_name), name),
                              [ex for _, ex in items])
    yield name


# ---------------------------------------------------------------- stages 11-12


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


# ---------------------------------------------------------------- the graph


def build_graph(p: beam.Pipeline, cfg: BuildConfig, sources: list[Source], out_dir: str,
                eval_index: stages.EvalIndex | None) -> None:
    """Adds every stage to pipeline `p`; outputs land in `out_dir` (manifest written afterwards)."""
    by_name = {s.name: s for s in sources}
    inputs = []
    for s in sources:
        inputs += [(s.name, None)] if s.format == "tfds" else [(s.name, f) for f in s.files(cfg.source_root)]

    read = (
        p | "Inputs" >> beam.Create(inputs)
        | "Read" >> beam.ParDo(ReadSource(by_name, cfg.admission)).with_outputs(DROPS, main="docs")
    )
    drops = [read[DROPS]]
    docs = read.docs | "SpreadDocs" >> beam.Reshuffle()

    clean = (
        docs | "Batch" >> beam.BatchElements(min_batch_size=32, max_batch_size=256)
        | "Clean" >> beam.ParDo(CleanBatch(cfg, by_name)).with_outputs(DROPS, main="docs")
    )
    drops.append(clean[DROPS])
    docs = clean.docs

    df_all = docs | "TextsAll" >> beam.Map(lambda d: d["text"]) | "DFAll" >> beam.CombineGlobally(TermDF())

    if cfg.exact.enabled:
        ex = (
            docs | "ExactKey" >> beam.Map(lambda d: (stages.exact_key(d["text"]), d))
            | "GroupExact" >> beam.GroupByKey()
            | "PickExact" >> beam.FlatMap(pick_exact).with_outputs(DROPS, main="docs")
        )
        drops.append(ex[DROPS])
        docs = ex.docs

    if cfg.near.enabled:
        near_map = near_dedup(docs, cfg.near)
    else:
        near_map = p | "NoNear" >> beam.Create([])
    near_side = beam.pvalue.AsDict(near_map)
    nd = docs | "ApplyNear" >> beam.FlatMap(apply_near, near_side).with_outputs(DROPS, main="docs")
    drops.append(nd[DROPS])
    docs = nd.docs

    if cfg.paragraphs.enabled:
        docs = _paragraph_stage(docs, drops, cfg)

    docs, p_thresholds = _quality_stage(p, docs, drops, cfg)

    if cfg.decontam.enabled and eval_index:
        dc = docs | "Decontaminate" >> beam.ParDo(Decontaminate(eval_index)).with_outputs(
            DROPS, main="docs")
        drops.append(dc[DROPS])
        docs = dc.docs

    docs = _heldout_stage(docs, drops, cfg, out_dir)
    docs, fractions = _quota_stage(docs, drops, cfg)

    df_kept = docs | "TextsKept" >> beam.Map(lambda d: d["text"]) | "DFKept" >> beam.CombineGlobally(TermDF())
    _ = df_all | "LongTail" >> beam.Map(lambda a, k: write_longtail(a, k, out_dir, 3), beam.pvalue.AsSingleton(df_kept))

    tok = docs | "Tokenize" >> beam.ParDo(Tokenize(cfg.output)).with_outputs(DROPS, main="records")
    drops.append(tok[DROPS])
    _ = (tok.records | "GroupShards" >> beam.GroupByKey()
         | "WriteShards" >> beam.FlatMap(write_shard, out_dir, cfg.output))

    _write_decision_log(drops, near_side, cfg, out_dir)
    _ = (p_thresholds | "ThresholdDict" >> beam.combiners.ToDict()
         | "WriteThresholds" >> beam.Map(_write_json, fs.join(out_dir, "_stats", "quality_thresholds.json")))
    _ = (fractions | "WriteFractions" >> beam.Map(_write_json, fs.join(out_dir, "_stats", "quota_fractions.json")))


def _quality_stage(p, docs, drops: list, cfg: BuildConfig):
    """Stage 7: score every document, drop those under their source's quantile. Returns (docs, thresholds)."""
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
    q = docs | "ApplyQuality" >> beam.FlatMap(apply_quality, beam.pvalue.AsDict(thresholds)).with_outputs(
        DROPS, main="docs")
    drops.append(q[DROPS])
    return q.docs, thresholds


def _heldout_stage(docs, drops: list, cfg: BuildConfig, out_dir: str):
    """Stage 8b: held-out documents to DIR/heldout/<domain>.jsonl.gz (and the decision log); returns the rest."""
    split = docs | "SplitHeldout" >> beam.FlatMap(split_heldout, cfg.output.heldout_fraction).with_outputs(
        HELDOUT, main="docs")
    held = split[HELDOUT] | "HeldoutRecords" >> beam.ParDo(HeldoutRecord(cfg.output)).with_outputs(
        DROPS, main="records")
    drops.append(held[DROPS])
    _ = (held.records | "GroupHeldout" >> beam.GroupByKey()
         | "WriteHeldout" >> beam.FlatMap(write_heldout, out_dir))
    return split.docs


def _quota_stage(docs, drops: list, cfg: BuildConfig):
    """Stage 9: per-(domain, lang) character budgets (`stages.quota_keep_fractions`), then per group the documents
    ranked by seeded hash up to the budget (`stages.quota_cutoff`). Returns (docs, fractions)."""
    seed = cfg.quotas.seed
    chars = (
        docs | "GroupChars" >> beam.Map(lambda d: ((d["domain"], d["lang"]), len(d["text"])))
        | "SumChars" >> beam.CombinePerKey(sum)
        | "CharsDict" >> beam.combiners.ToDict()
    )
    fractions = chars | "QuotaFractions" >> beam.Map(stages.quota_keep_fractions, cfg.quotas)
    cutoffs = (
        docs | "QuotaRanks" >> beam.Map(lambda d: (_group(d), (stages.uniform(seed, d["id"]), d["id"], len(d["text"]))))
        | "GroupRanks" >> beam.GroupByKey()
        | "QuotaCutoffs" >> beam.Map(lambda kv, f: (kv[0], stages.quota_cutoff(list(kv[1]), f[kv[0]])),
                                     beam.pvalue.AsSingleton(fractions))
        | "CutoffDict" >> beam.combiners.ToDict()
    )
    qt = docs | "ApplyQuota" >> beam.FlatMap(apply_quota, beam.pvalue.AsSingleton(fractions),
                                             beam.pvalue.AsSingleton(cutoffs), seed).with_outputs(DROPS, main="docs")
    drops.append(qt[DROPS])
    return qt.docs, fractions


def _count_decision(row: dict) -> dict:
    """``row`` unchanged, counted in the build's progress as kept, held out or dropped by its verdict."""
    v = row["verdict"]
    progress.count(v if v in ("kept", "heldout") else "dropped")
    return row


def _write_decision_log(drops: list, near_side, cfg: BuildConfig, out_dir: str) -> None:
    """Stages 11-12: one decision row per input record (sharded by id hash) and the review samples per rule."""
    # Counted where each stage emits its rows (the Maps fuse into the producing stages), not after the Flatten,
    # whose next step waits for near-dedup's side input.
    counted = [d | f"CountDecisions{i}" >> beam.Map(_count_decision) for i, d in enumerate(drops)]
    decisions = (
        tuple(counted) | "AllDecisions" >> beam.Flatten()
        | "ClusterIds" >> beam.Map(finalize_decision, near_side)
    )
    n_dec = cfg.output.decision_shards
    _ = (
        decisions | "DecisionShard" >> beam.Map(lambda r: (int(stages.uniform(2, r["id"]) * n_dec), r))
        | "GroupDecisions" >> beam.GroupByKey()
        | "WriteDecisions" >> beam.FlatMap(write_decisions, out_dir, n_dec)
    )
    seed, n_rev = cfg.output.review_seed, cfg.output.review_samples_per_rule
    _ = (
        decisions | "Dropped" >> beam.Filter(lambda r: r["verdict"] not in ("kept", "heldout"))
        | "ReviewKey" >> beam.Map(lambda r: ((r["stage"], r["reason"]), (stages.uniform(seed, r["id"]), r)))
        | "ReviewSample" >> beam.combiners.Top.PerKey(n_rev, key=lambda x: (-x[0], x[1]["id"]))
        | "WriteReview" >> beam.FlatMap(write_review, out_dir)
    )


def _write_json(obj, path):
    sink.write_text(path, jsonl.dumps(obj, sort_keys=True, indent=1))
    return path
