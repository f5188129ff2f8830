"""`python -m data_pipelines.build --config configs/data/raw_v1.gin --output DIR [beam flags]`.

Runs the Beam graph of `data_pipelines.pipeline` (its `STEPS`), then writes the TFDS metadata, the mixture
weights (``DIR/mixture.json``) and the data version record (``DIR/manifest.json``). Flags the
script does not know go to Beam (``--runner``, ``--direct_num_workers``, ``--project``, ...).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time


from jaxpt import config as jaxpt_config
from jaxpt.util import progress as progress_lib
from jaxpt.util import fs, jsonl

from data_pipelines import config as config_lib
from data_pipelines import manifest as manifest_lib
from data_pipelines import pipeline, sink, writer
from data_pipelines import progress as build_progress
from data_pipelines.steps import base, decontamination, quotas
from data_pipelines.steps import write as write_step

# Moved to their steps; kept here for callers.
load_eval_index = decontamination.load_eval_index
decontamination_figures = decontamination.decontamination_figures
quota_warnings = quotas.quota_warnings

OUTPUT_SUBDIRS = ("tfds", "heldout", "decisions", "review", "_stats")


def load_config(config_files: list[str], bindings: list[str]) -> config_lib.BuildConfig:
    """Parses gin files + bindings and returns the validated BuildConfig."""
    fs.register_gin_reader()  # --config gs://b/build.gin
    # Checked first (a gin file is code: jaxpt.config.check_gin_text), and not finalized: a locked gin config would
    # refuse configurables registered later in the same process (the tokenizer CLI's, jaxpt's).
    jaxpt_config.parse_gin(config_files, bindings)
    cfg = config_lib.BuildConfig()
    cfg.registry()
    return cfg


def check_output(out_dir: str, overwrite: bool = False) -> None:
    """The build may write into ``out_dir``: missing, empty, or holding only what a build writes (a corpus version, or
    one cut short); a folder holding anything else is refused unless ``overwrite`` (the build deletes its outputs'
    names there first, and a mistyped --output once pointed it at a folder of other files).

    Raises:
      ConfigError: naming the folder, what it holds, and --overwrite; or naming a file ``out_dir`` is (never
        overwritten, --overwrite or not).
    """
    if fs.exists(out_dir) and not fs.isdir(out_dir):
        raise config_lib.ConfigError(f"--output {out_dir}: is a file, not a folder; a corpus version is a folder: "
                                     "choose a new or empty folder")
    if not fs.isdir(out_dir):
        return
    ours = set(OUTPUT_SUBDIRS) | {"manifest.json", "mixture.json"}
    other = sorted(set(fs.listdir(out_dir)) - ours)
    if other and not overwrite:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise config_lib.ConfigError(f"--output {out_dir}: holds {shown}, which is not a corpus version; choose an "
                                     "empty or new folder, or pass --overwrite to build there anyway")


def run(cfg: config_lib.BuildConfig, out_dir: str, beam_args: list[str] | None = None,
        overwrite: bool = False) -> dict:
    """Builds the corpus version into `out_dir` (:func:`check_output` first) and returns the manifest dict."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    sources = cfg.registry()
    for s in sources:  # a pattern matching no file, or in object storage: refused before the output is touched
        if s.format != "tfds":
            s.files(cfg.source_root)
    writer.TokenizerEncoder(cfg.output.tokenizer_path)  # fail before the pipeline starts
    eval_index = load_eval_index(cfg) if cfg.decontam.enabled else None
    sink.check_credentials(out_dir)
    check_output(out_dir, overwrite)
    fs.makedirs(out_dir)
    for sub in OUTPUT_SUBDIRS:
        fs.rmtree(fs.join(out_dir, sub))
    for f in ("manifest.json", "mixture.json"):
        fs.remove(fs.join(out_dir, f))
    beam_args = list(beam_args or [])
    if not any(a.startswith("--runner") for a in beam_args):
        beam_args += ["--runner=DirectRunner"]
    # Elements are plain dicts; Beam's inferred hints on multi-output DoFns are wrong, not useful.
    beam_args += ["--no_pipeline_type_check"]
    t0 = time.time()
    total_files = sum(1 if s.format == "tfds" else len(s.files(cfg.source_root)) for s in sources)
    with build_progress.BuildProgress(total_files), beam.Pipeline(options=PipelineOptions(beam_args)) as p:
        pipeline.build_graph(p, cfg, sources, out_dir, eval_index)
    beam_seconds = time.time() - t0
    return finalize(cfg, sources, out_dir, eval_index, beam_seconds)


def damaged_input_files(rows: list[dict]) -> list[dict]:
    """Input files cut short or corrupt (the ``admission:truncated_file`` decision rows), and files whose reading
    stopped at a bound (``decompressed_cap``, ``compression_ratio``; then with ``reason``): ``file``, ``source``
    and ``lines_read`` (complete lines admitted before), sorted by file."""
    out = []
    for r in rows:
        if r.get("reason") in ("truncated_file", *jsonl.BOUND_REASONS) and "lines_read" in r:
            entry = {"file": r["file"], "source": r["source"], "lines_read": r["lines_read"]}
            if r["reason"] != "truncated_file":
                entry["reason"] = r["reason"]
            out.append(entry)
    return sorted(out, key=lambda d: d["file"])


def language_label_origins(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per source, how many documents got their language from the detector (``detected``), from the declared
    language because detection was unsure (``declared``, `LangIdConfig`) or from the record (``record``: sources
    without language ID). Rows dropped before language ID have no origin and are not counted."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        if r.get("lang_by"):
            out[r["source"]][r["lang_by"]] += 1
    return {s: dict(sorted(c.items())) for s, c in sorted(out.items())}


def finalize(cfg, sources, out_dir, eval_index, beam_seconds) -> dict:
    """After the Beam graph: TFDS metadata, ``DIR/mixture.json`` (per-domain token weights and shard lists) and
    ``DIR/manifest.json`` (the data version record, every count recomputed from the decision log).

    Returns the manifest dict, plus ``_beam_seconds`` (wall seconds of the Beam pipeline; not written).

    Raises:
      AssertionError: the decision log does not add up (in = out + held out + dropped); impossible by construction.
    """
    lengths = write_step.complete_shards(cfg, out_dir)
    writer.write_tfds_metadata(out_dir, cfg.output.dataset_name, lengths,
                               description=f"jaxpt corpus {cfg.data_version}: one split per domain.")
    rows = manifest_lib.read_decisions(out_dir)
    figs = manifest_lib.figures_from_decisions(rows, pipeline.decision_stages())
    if figs["documents_in"] != figs["documents_out"] + figs["documents_heldout"] + figs["documents_dropped_total"]:
        raise AssertionError("decision log does not add up")  # impossible by construction; guards edits
    stats_dir = fs.join(out_dir, "_stats")

    def stat(name):
        path = fs.join(stats_dir, name)
        return json.loads(fs.read_text(path)) if fs.exists(path) else {}

    tokens = figs["tokens_by_domain"]
    total = sum(tokens.values())
    mixture = {
        "weights": {d: (tokens.get(d, 0) / total if total else 0.0) for d in sorted(lengths)},
        "target_weights": dict(sorted(cfg.quotas.targets.items())),
        "tokens": {d: tokens.get(d, 0) for d in sorted(lengths)},
        "documents": {d: sum(lengths[d]) for d in sorted(lengths)},
        "tfds": {"name": cfg.output.dataset_name, "version": writer.DATASET_VERSION, "data_dir": "tfds"},
        "shards": {
            d: [os.path.join("tfds", cfg.output.dataset_name, writer.DATASET_VERSION,
                             writer.shard_filename(cfg.output.dataset_name, d, i, len(lengths[d])))
                for i in range(len(lengths[d]))]
            for d in sorted(lengths)
        },
    }
    sink.write_text(fs.join(out_dir, "mixture.json"), jsonl.dumps(mixture, sort_keys=True, indent=1))
    input_hashes = {}
    for s in sources:
        if s.format != "tfds":
            for path in s.files(cfg.source_root):
                input_hashes[f"{s.name}:{os.path.basename(path)}"] = writer.file_sha256(path)
    operative = cfg.to_json()
    enc = writer.TokenizerEncoder(cfg.output.tokenizer_path)
    decontam = decontamination_figures(cfg, eval_index, rows)
    longtail = stat("longtail.json")
    if longtail:
        longtail["rare_term_share_kept"] = longtail["rare_terms_kept"] / max(1, longtail["rare_terms_in"])
    manifest = {
        "data_version": cfg.data_version,
        "content_id": manifest_lib.config_hash(operative, input_hashes),
        "owner": cfg.output.owner,
        "sources": [
            {"name": s.name, "domain": s.domain, "format": s.format, "path": s.path, "license": s.license,
             "acquired": s.acquired, "languages": list(s.languages) if s.languages else None}
            for s in sources
        ],
        "input_file_sha256": input_hashes,
        "stages": pipeline.stage_records(base.Facts(cfg, operative, eval_index, rows, stat, out_dir)),
        "tokenizer": {"path": cfg.output.tokenizer_path, "kind": enc.kind, "sha256": enc.sha256,
                      "vocab_size": enc.vocab_size},
        **figs,
        "long_tail_coverage": {"terms": longtail, "languages": figs["language_coverage"]},
        **({"paragraph_dedup": manifest_lib.paragraph_figures(rows)} if cfg.paragraphs.enabled else {}),
        "decontaminated_ids": [r["id"] for r in rows if r["stage"] == "decontamination"],
        "damaged_input_files": damaged_input_files(rows),
        "quota_share_warnings": quota_warnings(cfg, rows),
        "decontamination_warnings": decontam["warnings"],
        "language_labels_by_source": language_label_origins(rows),
        "mixture": mixture,
        "output_sha256": manifest_lib.shard_hashes(out_dir),
    }
    sink.write_text(fs.join(out_dir, "manifest.json"),
                         jsonl.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=False))
    manifest["_beam_seconds"] = beam_seconds
    return manifest


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", required=True, help="gin file (repeatable)")
    ap.add_argument("--gin", action="append", default=[], help="gin binding, e.g. 'RuleConfig.min_words=10'")
    ap.add_argument("--output", required=True, help="corpus version directory (new, empty, or an earlier version)")
    ap.add_argument("--overwrite", action="store_true", help="build into --output even if it holds other files")
    args, beam_args = ap.parse_known_args(argv)
    progress_lib.quiet_startup()
    try:
        cfg = load_config(args.config, args.gin)
        t = time.time()
        m = run(cfg, args.output, beam_args, overwrite=args.overwrite)
    except (config_lib.ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: m[k] for k in ("data_version", "documents_in", "documents_out", "documents_heldout",
                                        "heldout_by_domain", "tokens_out", "documents_dropped")}, indent=1))
    if "paragraph_dedup" in m:
        pd = m["paragraph_dedup"]
        print(f"paragraph dedup: {pd['units_removed']} units ({pd['bytes_removed']} bytes) removed from "
              f"{pd['documents_changed']} documents; dropped {pd['documents_dropped']}")
    for w in m["quota_share_warnings"] + m["decontamination_warnings"]:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"built {args.output} in {time.time() - t:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
