"""A small linear text classifier trained on human labels: scikit-learn's hashed character n-grams and logistic
regression, saved as one ``.npz``.

Two users: the corpus build's label-trained quality scorer (:mod:`data_pipelines.quality_model`) and the eval
card's harmful-content classifier (:mod:`jaxpt.eval.safety`). Features are
``HashingVectorizer(analyzer='char_wb', ngram_range=(2, 4), n_features=2**18)`` counts of a text's first
``excerpt_chars`` characters, sublinear tf (``log(1 + count)``) and L2-normalised; the classifier is
``LogisticRegression(C, class_weight='balanced')`` (a linear text classifier in the fastText tradition, Joulin et al.
2017, "Bag of Tricks for Efficient Text Classification", from a well-kept library; the hashing makes it
vocabulary-free, so the weights alone describe it). A score is the classifier's log-odds of the positive label.

The ``.npz`` holds ``coef`` float32 [n_features], ``intercept`` float32 [] and ``params`` (JSON: the feature
settings, ``version`` naming what the classifier is for, ``excerpt_chars``, ``c``, the training labels' sha256 and
count). scikit-learn is imported only when a classifier is trained or used (the ``data`` and ``eval`` extras).
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Sequence

import numpy as np

from jaxpt.util import fs

#: Feature settings every saved classifier records (``params``); ``n_features`` fixes the weight vector's length.
FEATURES = {"analyzer": "char_wb", "ngram_range": [2, 4], "n_features": 1 << 18, "lowercase": True}


def _vectorizer(params: dict):
    from sklearn.feature_extraction.text import HashingVectorizer
    return HashingVectorizer(analyzer=params["analyzer"], ngram_range=tuple(params["ngram_range"]),
                             n_features=params["n_features"], lowercase=params["lowercase"], alternate_sign=False,
                             norm=None)


def features(texts: Sequence[str], params: dict, vectorizer=None):
    """Sparse float64 [len(texts), n_features]: ``log(1 + count)`` of each hashed character n-gram of each text's
    first ``params['excerpt_chars']`` characters, rows L2-normalised. ``vectorizer``: one built for ``params``,
    reused."""
    from sklearn.preprocessing import normalize
    n = int(params["excerpt_chars"])
    x = (vectorizer or _vectorizer(params)).transform([t[:n] for t in texts])
    x.data = np.log1p(x.data)
    return normalize(x)


class TextClassifier:
    """A trained classifier: :meth:`scores` gives log-odds of the positive label. ``sha256`` identifies the saved
    file; ``params['version']`` what it was trained for."""

    def __init__(self, coef: np.ndarray, intercept: float, params: dict, sha256: str = ""):
        self.coef, self.intercept, self.params, self.sha256 = coef.astype(np.float32), float(intercept), params, sha256
        self._vectorizer, self._coef64 = _vectorizer(params), self.coef.astype(np.float64)  # built once, not per text

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """float64 [len(texts)]: log-odds of the positive label."""
        return np.asarray(features(texts, self.params, self._vectorizer) @ self._coef64 + self.intercept).ravel()

    def score(self, text: str) -> float:
        """One text's log-odds of the positive label."""
        return float(self.scores([text])[0])

    def probabilities(self, texts: Sequence[str]) -> np.ndarray:
        """float64 [len(texts)] in (0, 1): the logistic of :meth:`scores`."""
        return 1.0 / (1.0 + np.exp(-self.scores(texts)))

    def save(self, path: str) -> str:
        """Writes the ``.npz`` (module docstring); returns its sha256."""
        buf = io.BytesIO()
        np.savez(buf, coef=self.coef, intercept=np.float32(self.intercept), params=json.dumps(self.params))
        data = buf.getvalue()
        fs.replace_local(path, data)
        self.sha256 = hashlib.sha256(data).hexdigest()
        return self.sha256

    @classmethod
    def load(cls, path: str, version: str, *, what: str = "text classifier",
             default_excerpt_chars: int | None = None) -> "TextClassifier":
        """Reads a saved classifier of ``version``.

        Args:
          what: the classifier's name in error messages (e.g. ``'quality classifier'``).
          default_excerpt_chars: ``excerpt_chars`` for a file saved before the field was recorded.

        Raises:
          ValueError: naming the file, when it is not a saved classifier, or one of another version.
        """
        data = fs.read_bytes(path)
        try:
            z = np.load(io.BytesIO(data), allow_pickle=False)
            params = json.loads(str(z["params"]))
            coef, intercept = z["coef"], float(z["intercept"])
        except Exception as e:  # noqa: BLE001  (any unreadable file is the same refusal)
            raise ValueError(f"{path}: not a saved {what} ({type(e).__name__}: {e})") from None
        if params.get("version") != version or coef.shape != (params.get("n_features"),):
            raise ValueError(f"{path}: a classifier of version {params.get('version')!r} with {coef.shape} weights; "
                             f"a {what} is {version!r}")
        if "excerpt_chars" not in params and default_excerpt_chars is not None:
            params["excerpt_chars"] = default_excerpt_chars
        return cls(coef, intercept, params, hashlib.sha256(data).hexdigest())


def train(texts: Sequence[str], positive: Sequence[bool], *, version: str, excerpt_chars: int, c: float = 1.0,
          labels_sha256: str = "") -> TextClassifier:
    """Fits the classifier on labelled texts (``positive``: True for the positive label).

    Raises:
      ValueError: fewer than two classes among the labels.
    """
    from sklearn.linear_model import LogisticRegression
    if len(set(positive)) < 2:
        raise ValueError(f"training {version} needs both positive and negative labels")
    params = dict(FEATURES, version=version, excerpt_chars=excerpt_chars, c=c, labels_sha256=labels_sha256,
                  trained_on=len(texts))
    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=2000)
    clf.fit(features(texts, params), np.asarray(positive, dtype=bool))
    return TextClassifier(clf.coef_[0], clf.intercept_[0], params)


def cross_validated_scores(texts: Sequence[str], positive: Sequence[bool], groups: Sequence[str], *,
                           version: str, excerpt_chars: int, folds: int = 5, seed: int = 0,
                           c: float = 1.0) -> np.ndarray:
    """float64 [len(texts)]: each text scored by a classifier trained on the other folds only
    (``StratifiedKFold(folds, shuffle, seed)`` stratified by ``groups`` (e.g. source or category) and label together;
    strata smaller than ``folds`` are pooled by label), so its agreement with the labels is measured on labels it
    did not see."""
    from sklearn.model_selection import StratifiedKFold
    strata = [f"{g}|{y}" for g, y in zip(groups, positive)]
    counts = {s: strata.count(s) for s in set(strata)}
    strata = [s if counts[s] >= folds else f"rare|{s.split('|')[1]}" for s in strata]
    out = np.zeros(len(texts))
    for train_idx, test_idx in StratifiedKFold(folds, shuffle=True, random_state=seed).split(texts, strata):
        model = train([texts[i] for i in train_idx], [positive[i] for i in train_idx], version=version,
                      excerpt_chars=excerpt_chars, c=c)
        out[test_idx] = model.scores([texts[i] for i in test_idx])
    return out
