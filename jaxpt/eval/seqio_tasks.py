"""The probe tasks as seqio Tasks, and a seqio Evaluator run that scores them with a jaxpt model.

Each card task becomes ``seqio.TaskRegistry`` entry ``jaxpt.<task_set_version>.<task>``:

* source: a ``seqio.FunctionDataSource`` over the task's rows (built in memory from held-out text by
  :mod:`jaxpt.eval.probes`), split ``validation``;
* preprocessor :func:`joint_tokenize`: ``inputs`` and ``targets`` tokenized with the run tokenizer's seqio
  vocabulary, the targets' ids taken from the encoding of the joined text after the prefix it shares with the
  encoding of the inputs (the split :func:`jaxpt.eval.probes.encode_pair` makes), originals kept as
  ``*_pretokenized``;
* metric functions :func:`jaxpt.eval.probes.choice_metrics` (a ``(targets, scores)`` score metric over one row
  per choice, rank classification) or :func:`jaxpt.eval.probes.exact_match` (a ``(targets, predictions)``
  metric over greedy continuations), with a ``postprocess_fn`` that turns a row into what the metric reads.

:func:`evaluate_with_seqio` runs ``seqio.Evaluator`` (:class:`PassThroughConverter`, no packing) with a
``score_fn`` backed by :class:`jaxpt.eval.scorer.Scorer` and a ``predict_fn`` backed by :func:`jaxpt.infer.decode.greedy`.
Importing this module imports TensorFlow (through seqio); :mod:`jaxpt.eval.probes` scores the same rows without it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

import numpy as np
import seqio
import tensorflow as tf

from jaxpt.data import boundary
from jaxpt.eval import probes

SPLIT = "validation"


class PassThroughConverter(seqio.PassThroughFeatureConverter):
    """``seqio.PassThroughFeatureConverter`` with the class attributes ``seqio.Evaluator`` reads (seqio 0.0.20's
    leaves ``TASK_FEATURES`` and ``pack`` unset): examples reach ``score_fn``/``predict_fn`` unchanged, unpacked."""

    TASK_FEATURES = {"inputs": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
                     "targets": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32)}
    MODEL_FEATURES = TASK_FEATURES
    PACKING_FEATURE_DTYPE = None
    pack = False


def task_name(task_set_version: str, task: str) -> str:
    """Registry name of a probe task: ``jaxpt.<task_set_version>.<task>``."""
    return f"jaxpt.{task_set_version}.{task}"


def joint_tokenize(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
    """Tokenize ``inputs`` and ``targets`` so that ``inputs + targets`` ids equal the encoding of the joined text.

    Keeps ``inputs_pretokenized`` / ``targets_pretokenized``. At least one id stays in ``targets``.
    """
    vocab = output_features["targets"].vocabulary

    def fn(ex):
        ctx = tf.cast(vocab.encode_tf(ex["inputs"]), tf.int32)
        whole = tf.cast(vocab.encode_tf(tf.strings.join([ex["inputs"], ex["targets"]])), tf.int32)
        m = tf.minimum(tf.size(ctx), tf.size(whole) - 1)
        same = tf.cast(tf.equal(ctx[:m], whole[:m]), tf.int32)
        n = tf.reduce_sum(tf.math.cumprod(same))
        out = dict(ex)
        out.update(inputs=whole[:n], targets=whole[n:], inputs_pretokenized=ex["inputs"],
                   targets_pretokenized=ex["targets"])
        return out

    return dataset.map(fn, num_parallel_calls=1, deterministic=True)


def _choice_postprocess(output, example=None, is_target=False):
    return probes.choice_target(example) if is_target else output


def _line_postprocess(output, example=None, is_target=False):
    if isinstance(output, bytes):
        output = output.decode("utf-8")
    return probes.first_line(output)


def register(task_set_version: str, tasks: Mapping[str, probes.TaskExamples], vocabulary) -> dict[str, Any]:
    """Register (or re-register: examples depend on the held-out and training sources) one seqio Task per
    probe task. Returns ``{probe task name: seqio.Task}``."""
    out = {}
    for name, te in tasks.items():
        rows = probes.choice_rows(te.examples) if te.spec.is_choice else probes.generate_rows(te.examples)
        columns = {k: [r[k] for r in rows] for k in rows[0]}

        def dataset_fn(split, shuffle_files, seed=None, columns=columns):
            del split, shuffle_files, seed
            return tf.data.Dataset.from_tensor_slices(columns)

        full = task_name(task_set_version, name)
        if full in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(full)
        features = {"inputs": seqio.Feature(vocabulary, add_eos=False, required=False),
                    "targets": seqio.Feature(vocabulary, add_eos=False)}
        out[name] = seqio.TaskRegistry.add(
            full, source=seqio.FunctionDataSource(dataset_fn, splits=[SPLIT], num_input_examples={SPLIT: len(rows)}),
            output_features=features, preprocessors=[joint_tokenize],
            postprocess_fn=_choice_postprocess if te.spec.is_choice else _line_postprocess,
            metric_fns=[probes.choice_metrics] if te.spec.is_choice else [probes.exact_match])
    return out


def _score_fn(scorer, start: boundary.ContextStart, dataset) -> list[tuple[int, float]]:
    idx, reqs = [], []
    for i, ex in dataset.as_numpy_iterator():
        reqs.append((start.apply(ex["inputs"]), np.asarray(ex["targets"], np.int32)))
        idx.append(int(i))
    return list(zip(idx, (lp for lp, _ in scorer.loglikelihood(reqs))))


def _predict_fn(step, tokenizer, start: boundary.ContextStart, max_new_tokens: int,
                dataset) -> list[tuple[int, np.ndarray]]:
    idx, prompts = [], []
    for i, ex in dataset.as_numpy_iterator():
        prompts.append(start.apply(ex["inputs"]))
        idx.append(int(i))
    outs = [g.ids for g in probes.next_line_greedy(step, tokenizer, prompts, max_new_tokens)]
    padded = np.full((len(outs), max_new_tokens), tokenizer.pad_id, np.int32)  # seqio decodes a 2-D array
    for r, o in enumerate(outs):
        padded[r, :len(o)] = o
    return list(zip(idx, padded))


def evaluate_with_seqio(task_set_version: str, tasks: Mapping[str, probes.TaskExamples], scorer, tokenizer, *,
                        max_new_tokens: int, generator=None,
                        document_boundary: str = "eos") -> dict[str, dict[str, float]]:
    """Register the tasks and evaluate each with ``seqio.Evaluator``; returns ``{task: metrics}``.

    ``scorer`` scores choices; ``generator`` (a :class:`jaxpt.infer.decode.DecodeStep`, default
    ``scorer.decode_step()``) decodes greedily. Every context and prompt starts as ``document_boundary`` (the run's
    ``DataConfig.document_boundary``) says (:func:`jaxpt.data.boundary.context_start`), as in the direct path."""
    start = boundary.context_start(document_boundary, tokenizer)
    registered = register(task_set_version, tasks, tokenizer.as_seqio_vocabulary())
    generator = generator or scorer.decode_step()
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # the Evaluator warns that it has no metric logger
    results = {}
    try:
        for name, task in registered.items():
            evaluator = seqio.Evaluator(task.name, feature_converter=PassThroughConverter(),
                                        eval_split=SPLIT, use_cached=False, async_compute_metrics=False)
            metrics, _ = evaluator.evaluate(
                compute_metrics=True, score_fn=functools.partial(_score_fn, scorer, start),
                predict_fn=functools.partial(_predict_fn, generator, tokenizer, start, max_new_tokens))
            results[name] = {k: float(v) for k, v in metrics.result()[task.name].items()}
    finally:
        absl_logger.setLevel(level)
    return results
