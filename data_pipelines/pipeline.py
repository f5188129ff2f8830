"""The corpus build's Apache Beam graph: `STEPS` in order, each one module of `data_pipelines.steps`.

Every input record ends as exactly one decision row: kept (written by the write step), held out (``verdict =
"heldout"``: kept, but in the held-out split that training never reads) or dropped once (``<stage>:<reason>``).

Determinism: no step depends on bundle order. Grouped values are sorted by id before use, combiners are integer
sums, sampling uses `draws.uniform(seed, id)`, and every file is written from a sorted list, so two runs on the
same inputs give byte-identical files.
"""

from __future__ import annotations

import apache_beam as beam

from data_pipelines.steps import (admission, base, decontamination, exact_dedup, extraction, langid, near_dedup,
                                  normalization, paragraph_dedup, quality, quotas, rules, split, write)

#: The build, in order; the manifest's ``stages`` records come from these, in this order.
STEPS: tuple[base.Step, ...] = (
    admission.Admission(),
    extraction.Extraction(),
    normalization.Normalization(),
    langid.LanguageId(),
    rules.Rules(),
    exact_dedup.ExactDedup(),
    near_dedup.NearDedup(),
    paragraph_dedup.ParagraphDedup(),
    quality.Quality(),
    decontamination.Decontamination(),
    split.HeldoutSplit(),
    quotas.Quotas(),
    write.Write(),
)
#: The documents past this step are the long-tail coverage's admitted documents (`Context.admitted`).
ADMITTED_AFTER = "rules"


def config_fields() -> list[tuple[str, type]]:
    """``(BuildConfig field, config class)`` of the steps' configs, in step order, each once."""
    out = {}
    for s in STEPS:
        if s.config_field and s.config_field not in out:
            out[s.config_field] = s.config
    return list(out.items())


def decision_stages() -> list[str]:
    """The ``stage`` names of the decision rows, in step order, each once."""
    return list(dict.fromkeys(s.stage for s in STEPS if s.stage))


def build_graph(p: beam.Pipeline, cfg, sources: list, out_dir: str, eval_index) -> None:
    """Adds every step to pipeline `p` (`cfg`: a `config.BuildConfig`; `sources`: its registry; `eval_index`: the
    decontamination step's `EvalIndex` or None); outputs land in `out_dir` (manifest written afterwards)."""
    ctx = base.Context(pipeline=p, cfg=cfg, sources={s.name: s for s in sources}, out_dir=out_dir,
                       eval_index=eval_index)
    docs = None
    for step in STEPS:
        docs = step.expand(docs, ctx)
        if step.name == ADMITTED_AFTER:
            ctx.admitted = docs


def stage_records(facts: base.Facts) -> dict:
    """The manifest's ``stages``: every step's settings and figures (`base.Step.record`)."""
    out = {}
    for s in STEPS:
        out.update(s.record(facts))
    return out
