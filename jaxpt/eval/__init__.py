"""Evaluation during and after training (``python -m jaxpt.tools.evaluate`` is the entry point).

Modules, one-way: ``scorer`` (one compiled scoring program over a mesh) <- ``heldout`` (perplexity per
domain and language) and ``probes`` (probe tasks from held-out text; ``decontam`` for 13-gram overlap) <-
``card`` (versioned eval cards), ``review`` (spot-check sheets, Cohen's kappa), ``regression`` (compare two
reports), ``seqio_tasks`` (the probes as seqio Tasks; imports TensorFlow), ``harness`` (lm-evaluation-harness
model adapter; imports lm_eval), ``inloop`` (the train loop's per-domain held-out figures). Greedy generation
is :mod:`jaxpt.infer.decode`.
"""
