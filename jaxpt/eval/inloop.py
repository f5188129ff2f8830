"""The trainer's held-out evaluation: one scorer for the in-loop, per-group and final figures.

Every held-out evaluation of the loop (``TrainConfig.eval_every`` steps, and the final one) is computed as
:func:`jaxpt.eval.heldout.perplexity_report` does: document-aligned rolling windows, only real target tokens,
independent of batch size and packing; the same computation as ``python -m jaxpt.tools.evaluate``. An evaluation
of every window reports ``heldout_loss``, ``heldout_perplexity`` and ``heldout_tokens``; one bounded by
``TrainConfig.eval_batches`` (``eval_batches x global_batch_size`` windows taken round-robin over the (domain,
language) groups) is a different quantity, on a subset, and is reported under its own names,
``heldout_partial_loss``, ``heldout_partial_perplexity`` and ``heldout_partial_tokens``, so no curve mixes the
two. The final evaluation scores every window. With ``HeldoutEvalConfig.enabled`` the record also breaks it down
as ``heldout/<grouping>/<group>/loss`` and ``.../perplexity`` (``heldout_partial/...`` for a bounded one). A model
whose MLP routes tokens (a mixture of experts) is scored with each token routed by itself (``causal``, so no score
sees a later token; :func:`jaxpt.model.decoder.eval_routing`), and its records say so: ``heldout_routing`` (or
``heldout_partial_routing``) ``"causal"`` beside the figures. The scorer runs on the run's mesh with the train state's param shardings and the global batch size and compiles once.
The held-out documents are read and checked at setup (:func:`load_heldout`, :func:`heldout_set`): a set with no
scored token (empty, or only 1-token documents with ``DataConfig.document_boundary = 'none'``) is a config error, never a
perfect-looking loss of 0.

The per-group breakdown is off by default (plain runs pay nothing). Its config is ``TrainConfig.heldout_eval``,
registered with gin and validated with the other configs in :mod:`jaxpt.config`::

    HeldoutEvalConfig.enabled = True
    HeldoutEvalConfig.group_by = ('domain', 'lang')
"""

from __future__ import annotations

import logging

from jaxpt.config import HeldoutEvalConfig
from jaxpt.eval import heldout
from jaxpt.eval.scorer import Scorer
from jaxpt.util.errors import ConfigError

log = logging.getLogger("jaxpt.eval.inloop")


def heldout_config(train_cfg) -> HeldoutEvalConfig:
    """The run's :class:`HeldoutEvalConfig`: ``TrainConfig.heldout_eval``."""
    return train_cfg.heldout_eval


def load_heldout(train_cfg) -> list[heldout.Document]:
    """Read and check a run's held-out documents (at setup, before anything compiles).

    The source is ``HeldoutEvalConfig.source`` when set, else the run's rule
    (:func:`jaxpt.eval.heldout.run_sources`: ``DataConfig.heldout_path``, or a corpus version's own held-out split).

    Raises:
      ConfigError: the source is missing (naming the config key) or holds no document.
      DocumentFormatError: (a ConfigError) a file is malformed, naming file and line.
    """
    cfg = heldout_config(train_cfg)
    source = cfg.source or heldout.run_sources(train_cfg.data)[0]
    key = ("HeldoutEvalConfig.source" if cfg.source else
           "DataConfig.corpus_dir" if train_cfg.data.source == "corpus" else "DataConfig.heldout_path")
    try:
        docs = heldout.load_documents(source, "heldout")
    except FileNotFoundError as e:
        if train_cfg.data.source == "corpus" and not cfg.source:
            raise ConfigError(f"{key} = {source!r}: no held-out split (heldout/*.jsonl.gz); rebuild the corpus "
                              "version with OutputConfig.heldout_fraction > 0") from None
        raise ConfigError(f"{key} = {source!r}: {e}") from None
    # A malformed file raises jaxpt.data.documents.DocumentFormatError (a ConfigError) naming file and line,
    # the same class as every other reader of document files.
    if not docs:
        raise ConfigError(f"{key} = {source!r}: the held-out set holds no document")
    return docs


def heldout_set(train_cfg, docs: list[heldout.Document], tokenizer) -> heldout.HeldoutSet:
    """Every scoring window of the run's held-out documents (what the final evaluation scores).

    Raises:
      ConfigError: the windows score no token: every document tokenizes to one token or none, with nothing
        around it (``DataConfig.document_boundary = 'none'``); a loss over 0 tokens would read as a perfect model.
    """
    c = train_cfg
    hset = heldout.HeldoutSet.build(docs, tokenizer, seq_len=c.seq_len, stride=heldout_config(c).stride or None,
                                    document_boundary=c.data.document_boundary)
    if not sum(w.num_scored for w in hset.windows):
        key = "HeldoutEvalConfig.source" if heldout_config(c).source else "DataConfig.heldout_path"
        raise ConfigError(f"{key}: the held-out set's {len(docs)} documents have no token to score (a document's "
                          f"first token is never scored; DataConfig.document_boundary = "
                          f"{c.data.document_boundary!r}): a held-out loss "
                          "over 0 tokens would read as a perfect model")
    return hset


class HeldoutEvaluator:
    """A run's held-out loss: one :class:`jaxpt.eval.scorer.Scorer` on the run's mesh (compiled once, reused by
    every evaluation), over document-aligned rolling windows of the held-out documents, as
    :func:`jaxpt.eval.heldout.perplexity_report` computes them. The in-loop figures, the final figure and
    ``python -m jaxpt.tools.evaluate`` therefore agree on the same checkpoint.

    Args:
      train_cfg: the run's config (``seq_len``, ``global_batch_size``, ``document_boundary``, ``heldout_eval``).
      mesh, graphdef: the run's mesh and model graph definition.
      tokenizer: the run's tokenizer.
      docs: the held-out documents (:func:`load_heldout`).
      full_set: their windows, if already built (:func:`heldout_set`, which checks there is a token to score).
    """

    def __init__(self, train_cfg, mesh, graphdef, abstract_params, tokenizer, docs: list[heldout.Document],
                 full_set: heldout.HeldoutSet | None = None):
        self.cfg, self.eval_cfg = train_cfg, heldout_config(train_cfg)
        self.tokenizer, self.docs = tokenizer, docs
        self.scorer = Scorer(graphdef, abstract_params, mesh, train_cfg.logical_axis_rules,
                             seq_len=train_cfg.seq_len, batch_size=train_cfg.global_batch_size,
                             pad_id=tokenizer.pad_id, num_ids=tokenizer.vocab_size, place_params=False)
        self._sets: dict[int, heldout.HeldoutSet] = {} if full_set is None else {0: full_set}

    def _windows(self, limit: int) -> heldout.HeldoutSet:
        if limit not in self._sets:
            c = self.cfg
            self._sets[limit] = heldout.HeldoutSet.build(
                self.docs, self.tokenizer, seq_len=c.seq_len, stride=self.eval_cfg.stride or None,
                document_boundary=c.data.document_boundary, max_windows=limit * c.global_batch_size)
        return self._sets[limit]

    def evaluate(self, params, limit: int) -> dict[str, float]:
        """Held-out figures of ``params``: ``heldout_loss`` (nats per scored token), ``heldout_perplexity`` and
        ``heldout_tokens`` (scored tokens) when every window is scored, ``heldout_partial_loss``,
        ``heldout_partial_perplexity`` and ``heldout_partial_tokens`` when ``limit`` bounded the windows; plus
        ``<that prefix>/<grouping>/<group>/loss|perplexity`` when ``HeldoutEvalConfig.enabled``; for a model whose
        MLP routes tokens, ``<that prefix>_routing``, the routing the figures come from (a string). Over 0 scored
        tokens the loss and perplexity are NaN (written ``"nan"``) and a warning is logged.

        ``limit``: 0 scores every window; else ``limit x global_batch_size`` windows, round-robin over groups.
        """
        hset = self._windows(limit)
        group_by = self.eval_cfg.group_by if self.eval_cfg.enabled else ()
        self.scorer.params = params
        try:
            # every window (the final evaluation, or eval_batches = 0) is long work: report its progress
            report = heldout.perplexity_report(self.scorer, hset, group_by=group_by,
                                               progress=None if hset.subset else "held-out evaluation")
        finally:
            self.scorer.params = None  # the train state is donated every step: never hold on to its buffers
        overall = report["overall"]
        if not overall["tokens"]:
            log.warning("held-out evaluation scored 0 tokens: loss and perplexity are NaN, not figures")
        prefix = "heldout_partial" if hset.subset else "heldout"
        out = {f"{prefix}_loss": overall["loss"], f"{prefix}_perplexity": overall["perplexity"],
               f"{prefix}_tokens": float(overall["tokens"])}
        if "routing" in report:
            out[f"{prefix}_routing"] = report["routing"]
        if group_by:
            out.update({k: v for k, v in heldout.flat_figures(report, prefix).items() if "/overall/" not in k})
        return out

    def compiled_programs(self) -> int:
        """Programs the scorer has compiled (1 after any number of evaluations)."""
        return self.scorer._fn._cache_size()
