"""A model-based quality scorer trained on human labels: scikit-learn's hashed character n-grams and logistic
regression, beside the reference-source n-gram model (`stages.HashedNgramLM`).

The n-gram model scores how much a document resembles the reference sources; it never saw a human judgment. This
scorer learns the judgment itself from the labelled quality sample (`label_sample --kind quality`, labels ``good``):
features are ``HashingVectorizer(analyzer='char_wb', ngram_range=(2, 4), n_features=2**18)`` counts of the first
:data:`EXCERPT_CHARS` characters (what the annotators read), sublinear tf and L2-normalised, the classifier
``LogisticRegression(C, class_weight='balanced')`` (a linear text classifier in the fastText tradition, Joulin et al.
2017, from a well-kept library; the hashing makes it vocabulary-free so one file holds it). The score is the
classifier's log-odds that a document is good (higher is better, as for the n-gram model), so the quality stage's
per-source quantiles and the calibration apply to it unchanged.

Saved as a ``.npz``: ``coef`` float32 [n_features], ``intercept`` float32 [], ``params`` (JSON of the feature
settings and the training labels' sha256). :func:`cross_validated_scores` gives every labelled document a score
from a model that did not train on it, for comparing the two scorers on the same held-out labels.
"""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np

from jaxpt.util import fs

VERSION = "label-classifier-v1"
EXCERPT_CHARS = 1500
FEATURES = {"analyzer": "char_wb", "ngram_range": [2, 4], "n_features": 1 << 18, "lowercase": True}


def _vectorizer(params: dict):
    from sklearn.feature_extraction.text import HashingVectorizer
    return HashingVectorizer(analyzer=params["analyzer"], ngram_range=tuple(params["ngram_range"]),
                             n_features=params["n_features"], lowercase=params["lowercase"], alternate_sign=False,
                             norm=None)


def features(texts: list[str], params: dict = FEATURES, vectorizer=None):
    """Sparse float64 [len(texts), n_features]: log(1 + count) of each hashed character n-gram of each text's first
    :data:`EXCERPT_CHARS` characters, rows L2-normalised. ``vectorizer``: one built for ``params``, reused."""
    from sklearn.preprocessing import normalize
    x = (vectorizer or _vectorizer(params)).transform([t[:EXCERPT_CHARS] for t in texts])
    x.data = np.log1p(x.data)
    return normalize(x)


class LabelClassifier:
    """The trained scorer: ``score(text) -> float`` log-odds of good. ``sha256`` identifies the saved file."""

    def __init__(self, coef: np.ndarray, intercept: float, params: dict, sha256: str = ""):
        self.coef, self.intercept, self.params, self.sha256 = coef.astype(np.float32), float(intercept), params, sha256
        self._vectorizer, self._coef64 = _vectorizer(params), self.coef.astype(np.float64)  # built once, not per text

    def scores(self, texts: list[str]) -> np.ndarray:
        """float64 [len(texts)]: log-odds of good."""
        return np.asarray(features(texts, self.params, self._vectorizer) @ self._coef64 + self.intercept).ravel()

    def score(self, text: str) -> float:
        """One document's log-odds of good."""
        return float(self.scores([text])[0])

    def save(self, path: str) -> str:
        """Writes the ``.npz`` (module docstring); returns its sha256."""
        buf = io.BytesIO()
        np.savez(buf, coef=self.coef, intercept=np.float32(self.intercept), params=json.dumps(self.params))
        data = buf.getvalue()
        fs.replace_local(path, data)
        self.sha256 = hashlib.sha256(data).hexdigest()
        return self.sha256

    @classmethod
    def load(cls, path: str) -> "LabelClassifier":
        """Reads a saved classifier.

        Raises:
          ValueError: naming the file, when it is not a saved classifier of this version.
        """
        data = fs.read_bytes(path)
        try:
            z = np.load(io.BytesIO(data), allow_pickle=False)
            params = json.loads(str(z["params"]))
            coef, intercept = z["coef"], float(z["intercept"])
        except Exception as e:  # noqa: BLE001  (any unreadable file is the same refusal)
            raise ValueError(f"{path}: not a saved quality classifier ({type(e).__name__}: {e})") from None
        if params.get("version") != VERSION or coef.shape != (params.get("n_features"),):
            raise ValueError(f"{path}: a classifier of version {params.get('version')!r} with {coef.shape} weights; "
                             f"this jaxpt reads {VERSION!r}")
        return cls(coef, intercept, params, hashlib.sha256(data).hexdigest())


def train(texts: list[str], good: list[bool], *, c: float = 1.0, labels_sha256: str = "") -> LabelClassifier:
    """Fits the classifier on labelled texts (``good``: True for good).

    Raises:
      ValueError: fewer than two classes among the labels.
    """
    from sklearn.linear_model import LogisticRegression
    if len(set(good)) < 2:
        raise ValueError("the quality classifier needs both good and bad labels")
    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=2000)
    clf.fit(features(texts), np.asarray(good, dtype=bool))
    params = dict(FEATURES, version=VERSION, c=c, labels_sha256=labels_sha256, trained_on=len(texts))
    return LabelClassifier(clf.coef_[0], clf.intercept_[0], params)


def cross_validated_scores(texts: list[str], good: list[bool], groups: list[str], *, folds: int = 5,
                           seed: int = 0, c: float = 1.0) -> np.ndarray:
    """float64 [len(texts)]: each document scored by a classifier trained on the other folds only
    (``StratifiedKFold(folds, shuffle, seed)`` over the labels, stratified by ``groups`` (e.g. source) and label
    together), so its agreement with the labels is measured on labels it did not see."""
    from sklearn.model_selection import StratifiedKFold
    strata = [f"{g}|{y}" for g, y in zip(groups, good)]
    counts = {s: strata.count(s) for s in set(strata)}
    strata = [s if counts[s] >= folds else f"rare|{s.split('|')[1]}" for s in strata]  # tiny strata pooled
    out = np.zeros(len(texts))
    for train_idx, test_idx in StratifiedKFold(folds, shuffle=True, random_state=seed).split(texts, strata):
        model = train([texts[i] for i in train_idx], [good[i] for i in train_idx], c=c)
        out[test_idx] = model.scores([texts[i] for i in test_idx])
    return out
