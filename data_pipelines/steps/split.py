"""Split: the held-out share of the surviving documents (`OutputConfig.heldout_fraction`, after decontamination,
before quotas) to ``DIR/heldout/<domain>.jsonl.gz``, never into the training shards."""

from __future__ import annotations

import apache_beam as beam

from jaxpt.data.prepare import is_heldout
from jaxpt.util import fs

from data_pipelines import writer
from data_pipelines.steps import base, write


def split_heldout(doc, fraction):
    """Held-out documents leave on the HELDOUT output, before quotas (a held-out set keeps the natural mix)."""
    if fraction > 0 and is_heldout(doc["id"], fraction):
        yield beam.pvalue.TaggedOutput(base.HELDOUT, doc)
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
        yield beam.pvalue.TaggedOutput(base.DROPS, {
            "id": doc["id"], "source": doc["source"], "domain": doc["domain"], "lang": doc["lang"],
            "verdict": "heldout", "stage": None, "reason": None, "n_chars": len(doc["text"]),
            "lang_by": doc.get("lang_by"), **({"decoded_by": doc["decoded_by"]} if doc.get("decoded_by") else {}),
            "n_tokens": n_tokens, "quality_score": doc.get("quality"), "sample": "", **base.paragraph_log(doc),
        })


def write_heldout(kv, out_dir):
    """(domain, held-out records) -> ``writer.heldout_path(out_dir, domain)``, sorted by id; yields the path."""
    domain, rows = kv
    path = writer.heldout_path(out_dir, domain)
    writer.write_jsonl_gz(path, sorted(rows, key=lambda r: r["id"]))
    yield path


def _heldout_stage(docs, ctx: base.Context, cfg, out_dir: str):
    """Held-out documents to DIR/heldout/<domain>.jsonl.gz (and the decision log); returns the rest."""
    split = docs | "SplitHeldout" >> beam.FlatMap(split_heldout, cfg.output.heldout_fraction).with_outputs(
        base.HELDOUT, main="docs")
    held = base.with_drops(split[base.HELDOUT], "HeldoutRecords", beam.ParDo(HeldoutRecord(cfg.output)), ctx,
                           main="records")
    _ = (held | "GroupHeldout" >> beam.GroupByKey()
         | "WriteHeldout" >> beam.FlatMap(write_heldout, out_dir))
    return split.docs


class HeldoutSplit(base.Step):
    """Its decision rows are ``heldout`` (no stage, no reason)."""

    name = "heldout_split"
    config_field = "output"
    config = write.OutputConfig

    def expand(self, docs, ctx: base.Context):
        return _heldout_stage(docs, ctx, ctx.cfg, ctx.out_dir)

    def record(self, facts: base.Facts) -> dict:
        cfg = facts.cfg
        return {"heldout_split": {
            "rule": f"jaxpt.data.prepare.is_heldout(id, {cfg.output.heldout_fraction})",
            "fraction": cfg.output.heldout_fraction,
            "position": "after decontamination, before quotas (dedup ran on both splits)",
            "files": ["heldout/" + fs.basename(p) for p in fs.glob(fs.join(facts.out_dir, "heldout"), "*.jsonl.gz")]}}
