"""Held-out perplexity per domain and language inside the train loop.

Enabled from gin (off by default, so plain runs pay nothing); the config is ``TrainConfig.heldout_eval``,
registered and validated with the other configs in :mod:`jaxpt.config`::

    HeldoutEvalConfig.enabled = True
    HeldoutEvalConfig.group_by = ('domain', 'lang')

Every held-out evaluation of the loop (``TrainConfig.eval_every`` steps, and the final one) then adds
``heldout/<grouping>/<group>/loss`` and ``.../perplexity`` to the record (metrics.jsonl and TensorBoard),
computed as :func:`jaxpt.eval.heldout.perplexity_report` does: document-aligned windows, only real target
tokens, independent of batch size and packing. The scorer runs on the run's mesh with the train state's param
shardings and the global batch size, is built on the first evaluation and reused, so it compiles once. In-loop
evaluations bounded by ``TrainConfig.eval_batches`` score ``eval_batches x global_batch_size`` windows taken
round-robin over the (domain, language) groups; the final evaluation scores every window.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from jaxpt.eval import heldout
from jaxpt.eval.scorer import Scorer
from jaxpt.validation import check_types, non_negative, require


@dataclasses.dataclass(frozen=True)
class HeldoutEvalConfig:
    """In-loop per-group held-out evaluation.

    Attributes:
      enabled: add the per-group figures to every held-out evaluation of the loop.
      group_by: groupings to report (``domain``, ``lang``, ``domain_lang``).
      source: held-out source (file or corpus directory); '' = ``DataConfig.heldout_path`` (or ``corpus_dir``).
      stride: new tokens per later window of a long document; 0 = ``seq_len // 2``.

    Raises:
      ConfigError: at construction, naming ``HeldoutEvalConfig.<field> = <value>``: a wrong type, a grouping
        not in :data:`jaxpt.eval.heldout.GROUPINGS`, or a negative ``stride``.
    """

    enabled: bool = False
    group_by: tuple[str, ...] = ("domain", "lang")
    source: str = ""
    stride: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "group_by", set(self.group_by) <= set(heldout.GROUPINGS),
                f"each grouping must be one of {heldout.GROUPINGS}")
        non_negative(self, "stride")


# run -> {limit: (Scorer, HeldoutSet)}; weak, so a finished run's evaluator goes with it.
_CACHE: dict[int, tuple[Any, dict]] = {}


def _evaluator(run, cfg: HeldoutEvalConfig, limit: int):
    key = id(run)
    entry = _CACHE.get(key)
    if entry is None or entry[0]() is not run:
        _CACHE[key] = entry = (weakref.ref(run, lambda _: _CACHE.pop(key, None)), {})
    built = entry[1]
    if "scorer" not in built:
        tc = run.cfg
        built["scorer"] = Scorer(run.spec.graphdef, run.state.params, run.mesh, tc.logical_axis_rules,
                                 seq_len=tc.seq_len, batch_size=tc.global_batch_size, pad_id=run.tokenizer.pad_id)
        built["scorer"].params = None  # the train state is donated every step: never hold on to its buffers
        built["docs"] = heldout.load_documents(cfg.source or heldout.run_sources(tc.data)[0], "heldout")
    if limit not in built:
        built[limit] = heldout.HeldoutSet.build(built["docs"], run.tokenizer, seq_len=run.cfg.seq_len,
                                                stride=cfg.stride or None, add_eos=run.cfg.data.add_eos,
                                                max_windows=limit * run.cfg.global_batch_size)
    return built["scorer"], built[limit]


def heldout_figures(run, limit: int) -> dict[str, float]:
    """Per-group held-out figures for the loop's record, or ``{}`` when ``HeldoutEvalConfig.enabled`` is off.

    Args:
      run: the :class:`jaxpt.train.Run` (mesh, state, tokenizer, config); its ``cfg.heldout_eval`` decides.
      limit: the evaluation's batch bound (``TrainConfig.eval_batches``; 0 = everything).
    """
    cfg = run.cfg.heldout_eval
    if not cfg.enabled:
        return {}
    scorer, hset = _evaluator(run, cfg, limit)
    scorer.params = run.state.params
    try:
        report = heldout.perplexity_report(scorer, hset, group_by=cfg.group_by)
    finally:
        scorer.params = None
    return heldout.flat_figures(report)


def compiled_programs(run) -> int:
    """How many programs the run's in-loop evaluator has compiled (1 after any number of evaluations)."""
    entry = _CACHE.get(id(run))
    if entry is None or "scorer" not in entry[1]:
        return 0
    return entry[1]["scorer"]._fn._cache_size()
