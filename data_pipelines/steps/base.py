"""The step interface: a name, a config, the reasons it drops with, and a Beam transform on the documents.

Documents are plain dicts (``id``, ``source``, ``domain``, ``text``, ...). A step that removes a document emits a
*decision* dict on its ``drops`` output instead (``verdict = "<stage>:<reason>"``, `decision`), appended to
`Context.drops`, so every input record ends as exactly one decision row.
"""

from __future__ import annotations

import abc

import dataclasses
from typing import Any, Callable, ClassVar

from data_pipelines import readers


DROPS = "drops"
HELDOUT = "heldout"


@dataclasses.dataclass
class Context:
    """What a step's transform reads and leaves besides its documents.

    Attributes:
      pipeline: the ``beam.Pipeline``.
      cfg: the `config.BuildConfig`.
      sources: source name -> `sources.Source`.
      out_dir: the corpus version folder.
      eval_index: the decontamination step's `EvalIndex` (None without eval sets).
      drops: PCollections of decision rows, one per dropping transform.
      near_map: side input (AsDict) id -> near-duplicate cluster representative (set by near dedup).
      admitted: the documents past language ID and the rules (the long-tail coverage's "in"; set by the build).
    """

    pipeline: Any
    cfg: Any
    sources: dict
    out_dir: str
    eval_index: Any = None
    drops: list = dataclasses.field(default_factory=list)
    near_map: Any = None
    admitted: Any = None


@dataclasses.dataclass
class Facts:
    """What a step's manifest record reads, after the Beam graph ran.

    Attributes:
      cfg: the `config.BuildConfig`; operative: ``cfg.to_json()``; eval_index: as in `Context`;
      rows: every decision row (sorted by id); stat: ``stat(name)`` -> ``DIR/_stats/<name>`` parsed ({} if absent);
      out_dir: the corpus version folder.
    """

    cfg: Any
    operative: dict
    eval_index: Any
    rows: list
    stat: Callable[[str], dict]
    out_dir: str


class Step(abc.ABC):
    """One step of the build.

    Attributes:
      name: the step's name (its module's).
      stage: the ``stage`` of its decision rows (None: it drops nothing).
      config_field: the `BuildConfig` field holding its config (steps may share one), or None.
      config: that field's class (gin-configurable).
      reasons: every ``reason`` it drops with.
    """

    name: ClassVar[str]
    stage: ClassVar[str | None] = None
    config_field: ClassVar[str | None] = None
    config: ClassVar[type | None] = None
    reasons: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def expand(self, docs, ctx: Context):
        """Adds the step to the graph: its documents in (None for the first step), the survivors out."""

    def record(self, facts: Facts) -> dict:
        """``{manifest key: settings and figures}`` for ``manifest.json``'s ``stages`` ({}: none)."""
        return {}


def paragraph_log(doc: dict) -> dict:
    """``{"paragraphs_removed": [...]}`` for a document that lost units at paragraph dedup, else ``{}`` (so a build
    without paragraph dedup writes the rows it always wrote)."""
    return {"paragraphs_removed": doc["paragraphs_removed"]} if doc.get("paragraphs_removed") else {}


def decision(doc: dict, stage: str, reason: str, **extra) -> dict:
    """The decision row of `doc` dropped by `stage` for `reason` (`readers.drop`, plus its language and size)."""
    return readers.drop(doc["id"], {"name": doc["source"], "domain": doc["domain"]}, stage, reason,
                        doc.get("text", ""), lang=doc.get("lang"), lang_by=doc.get("lang_by"),
                        n_chars=len(doc.get("text", "")), **{**paragraph_log(doc), **extra})


def with_drops(pcoll, label: str, transform, ctx: Context, main: str = "docs"):
    """``pcoll | label >> transform.with_outputs(DROPS, main=main)``: its drops go to `ctx.drops`; returns the
    main output."""
    out = pcoll | label >> transform.with_outputs(DROPS, main=main)
    ctx.drops.append(out[DROPS])
    return getattr(out, main)
