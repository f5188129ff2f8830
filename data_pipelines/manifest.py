"""The data version record ``DIR/manifest.json``, recomputed from the decision log.

Every count in the manifest is a function of the decision rows (`figures_from_decisions`), so a
test can rebuild them from ``DIR/decisions/`` alone. Shard hashes are sha256 of the files.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Sequence

from jaxpt.util import fs

from data_pipelines import writer



def read_decisions(out_dir: str) -> list[dict]:
    """All decision rows of a built corpus, sorted by id."""
    rows = []
    for path in fs.glob(fs.join(out_dir, "decisions"), "*.jsonl.gz"):
        rows.extend(writer.read_jsonl_gz(path))
    return sorted(rows, key=lambda r: r["id"])


def figures_from_decisions(rows: list[dict], stages: Sequence[str] = ()) -> dict:
    """Counts, tokens, proportions and language coverage derived from decision rows only.

    `stages`: the decision stages in build order (`pipeline.decision_stages`); ``documents_dropped`` lists its
    stages in that order, then any other in sorted order.

    ``documents_in = documents_out + documents_heldout + documents_dropped_total``; tokens and proportions
    are of the training split (``documents_out``); held-out counts are per domain in ``heldout_by_domain``.
    """
    dropped = collections.defaultdict(lambda: collections.defaultdict(int))
    kept = [r for r in rows if r["verdict"] == "kept"]
    heldout = [r for r in rows if r["verdict"] == "heldout"]
    for r in rows:
        if r["verdict"] not in ("kept", "heldout"):
            dropped[r["stage"]][r["reason"]] += 1
    heldout_docs, heldout_tokens = collections.Counter(), collections.Counter()
    for r in heldout:
        heldout_docs[r["domain"]] += 1
        heldout_tokens[r["domain"]] += r["n_tokens"]
    tokens_by_domain = collections.Counter()
    docs_by_domain = collections.Counter()
    for r in kept:
        tokens_by_domain[r["domain"]] += r["n_tokens"]
        docs_by_domain[r["domain"]] += 1
    total_tokens = sum(tokens_by_domain.values())
    # Language coverage: among documents that passed language ID, the share kept (trained on or held out).
    lang_in = collections.Counter(r["lang"] for r in rows if r.get("lang"))
    lang_kept = collections.Counter(r["lang"] for r in kept + heldout if r.get("lang"))
    clusters = collections.Counter(r["cluster_id"] for r in rows)
    decoded_by = collections.Counter(r["decoded_by"].split(":")[0] for r in kept + heldout if r.get("decoded_by"))
    return {
        # Web pages kept or held out, by how their bytes were decoded (data_pipelines.readers.decode_page).
        **({"pages_decoded_by": dict(sorted(decoded_by.items()))} if decoded_by else {}),
        "documents_in": len(rows),
        "documents_out": len(kept),
        "documents_dropped": {s: dict(sorted(dropped[s].items()))
                              for s in [*dict.fromkeys(stages), *sorted(set(dropped) - set(stages))] if s in dropped},
        "documents_dropped_total": len(rows) - len(kept) - len(heldout),
        "documents_heldout": len(heldout),
        "heldout_by_domain": {d: {"documents": heldout_docs[d], "tokens": heldout_tokens[d]}
                              for d in sorted(heldout_docs)},
        "tokens_out": total_tokens,
        "tokens_by_domain": dict(sorted(tokens_by_domain.items())),
        "documents_by_domain": dict(sorted(docs_by_domain.items())),
        "actual_token_proportions": {d: t / total_tokens for d, t in sorted(tokens_by_domain.items())}
        if total_tokens else {},
        "language_coverage": {
            lang: {"documents_labelled": lang_in[lang], "documents_kept": lang_kept[lang],
                   "share_kept": lang_kept[lang] / lang_in[lang]}
            for lang in sorted(lang_in)
        },
        "duplicate_clusters": sum(1 for c in clusters.values() if c > 1),
        "documents_in_duplicate_clusters": sum(c for c in clusters.values() if c > 1),
    }


def paragraph_figures(rows: list[dict]) -> dict:
    """What paragraph dedup removed, from the decision rows' ``paragraphs_removed`` entries and its drops.

    Units are counted in every row that lists them, whatever the document's verdict (kept, held out, dropped by 6b
    or a later stage); bytes are the units' UTF-8 bytes (`steps.paragraph_dedup.log_entry`). Returns ``units_removed``,
    ``bytes_removed``, ``documents_changed`` (rows that lost a unit), ``documents_dropped`` (per stage-6b reason),
    ``by_reason`` (per unit reason: ``units``, ``bytes``) and ``by_source`` (per source: the same four figures).
    """
    def empty():
        return {"units_removed": 0, "bytes_removed": 0, "documents_changed": 0,
                "documents_dropped": collections.Counter(), "by_reason": {}}

    total, by_source = empty(), collections.defaultdict(empty)
    for r in rows:
        log = r.get("paragraphs_removed") or []
        dropped = r["stage"] == "paragraph_dedup"
        if not (log or dropped):
            continue
        for fig in (total, by_source[r["source"]]):
            fig["documents_changed"] += bool(log)
            if dropped:
                fig["documents_dropped"][r["reason"]] += 1
            for e in log:
                fig["units_removed"] += 1
                fig["bytes_removed"] += e["bytes"]
                reason = fig["by_reason"].setdefault(e["reason"], {"units": 0, "bytes": 0})
                reason["units"] += 1
                reason["bytes"] += e["bytes"]

    def plain(fig):
        return dict(fig, documents_dropped=dict(sorted(fig["documents_dropped"].items())),
                    by_reason=dict(sorted(fig["by_reason"].items())))

    return dict(plain(total), by_source={s: plain(f) for s, f in sorted(by_source.items())})


def shard_hashes(out_dir: str) -> dict[str, str]:
    """sha256 of every output file under tfds/, heldout/ and decisions/ (relative path -> hex)."""
    out = {}
    for sub in ("tfds", "heldout", "decisions"):
        if not fs.isdir(fs.join(out_dir, sub)):
            continue
        for root, _, files in fs.walk(fs.join(out_dir, sub)):
            for name in files:
                if name.startswith("."):  # as glob's "*" (hidden files were never part of the output)
                    continue
                path = fs.join(root, name)
                out[path[len(out_dir.rstrip("/")) + 1:]] = writer.file_sha256(path)
    out = dict(sorted(out.items()))
    return out


def config_hash(operative: dict, input_hashes: dict) -> str:
    blob = json.dumps({"config": operative, "inputs": input_hashes}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
