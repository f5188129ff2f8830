"""A model-based quality scorer trained on human labels: scikit-learn's hashed character n-grams and logistic
regression, beside the reference-source n-gram model (`steps.quality.HashedNgramLM`).

The n-gram model scores how much a document resembles the reference sources; it never saw a human judgment. This
scorer learns the judgment itself from the labelled quality sample (`label_sample --kind quality`, labels ``good``):
:mod:`jaxpt.util.text_classifier`'s hashed character n-grams and logistic regression over a document's first
:data:`EXCERPT_CHARS` characters (what the annotators read). The score is the classifier's log-odds that a document
is good (higher is better, as for the n-gram model), so the quality stage's per-source quantiles and the calibration
apply to it unchanged. :func:`cross_validated_scores` gives every labelled document a score from a model that did
not train on it, for comparing the two scorers on the same held-out labels.
"""

from __future__ import annotations

import numpy as np

from jaxpt.util import text_classifier

VERSION = "label-classifier-v1"
EXCERPT_CHARS = 1500


class LabelClassifier(text_classifier.TextClassifier):
    """The trained quality scorer: ``score(text) -> float`` log-odds of good. ``sha256`` identifies the saved file."""

    @classmethod
    def load(cls, path: str) -> "LabelClassifier":  # type: ignore[override]
        """Reads a saved quality classifier.

        Raises:
          ValueError: naming the file, when it is not a saved classifier of this version.
        """
        return super().load(path, VERSION, what="quality classifier", default_excerpt_chars=EXCERPT_CHARS)


def train(texts: list[str], good: list[bool], *, c: float = 1.0, labels_sha256: str = "") -> LabelClassifier:
    """Fits the classifier on labelled texts (``good``: True for good).

    Raises:
      ValueError: fewer than two classes among the labels.
    """
    if len(set(good)) < 2:
        raise ValueError("the quality classifier needs both good and bad labels")
    m = text_classifier.train(texts, good, version=VERSION, excerpt_chars=EXCERPT_CHARS, c=c,
                              labels_sha256=labels_sha256)
    return LabelClassifier(m.coef, m.intercept, m.params)


def cross_validated_scores(texts: list[str], good: list[bool], groups: list[str], *, folds: int = 5,
                           seed: int = 0, c: float = 1.0) -> np.ndarray:
    """float64 [len(texts)]: out-of-fold log-odds of good (:func:`jaxpt.util.text_classifier.cross_validated_scores`,
    stratified by ``groups``, e.g. source, and label)."""
    return text_classifier.cross_validated_scores(texts, good, groups, version=VERSION, excerpt_chars=EXCERPT_CHARS,
                                                  folds=folds, seed=seed, c=c)
