"""An eval card's probe tasks: their examples built from held-out documents (decontaminated against the training
text) and scored, through seqio or directly with the same metric functions (:mod:`jaxpt.eval.probes`).
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxpt.eval import decontam, probes


def build_probe_tasks(card, heldout_docs, train_texts) -> dict[str, Any]:
    """Every card task's examples (held-out only, decontaminated against ``train_texts``), by task name."""
    index = decontam.NgramIndex(train_texts)
    return {spec.name: probes.build_task(spec, heldout_docs, index, seed=card.seed, ngram=card.ngram,
                                         min_words=card.min_words) for spec in card.tasks}


def score_tasks(card, tasks, scorer, generator, restored, use_seqio: bool) -> dict[str, dict[str, float]]:
    """Each probe task's metrics by name: through its seqio Task and ``seqio.Evaluator`` (``use_seqio``; imports
    TensorFlow), else the same rows scored directly with the same metric functions."""
    max_new = int(card.decoding["max_new_tokens"])
    boundary_policy = restored.config.data.document_boundary
    if use_seqio:
        seqio_tasks = extra_module("jaxpt.eval.seqio_tasks",  # defers tensorflow (and seqio)
                                   "scoring probe tasks through seqio (or pass --no-seqio)")
        return seqio_tasks.evaluate_with_seqio(card.task_set_version, tasks, scorer, restored.tokenizer,
                                               max_new_tokens=max_new, generator=generator,
                                               document_boundary=boundary_policy)
    return {n: probes.evaluate_task(scorer, restored.tokenizer, te, max_new_tokens=max_new, generator=generator,
                                    document_boundary=boundary_policy) for n, te in tasks.items()}


def extra_module(name: str, what: str):
    """Imports ``name``, a module of the ``eval`` extra. Raises ValueError (exit 2) naming the extra to install."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise ValueError(f"{what} needs the eval extra ({e.name} is not installed): pip install 'jaxpt[eval]'") \
            from None

