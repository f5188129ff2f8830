"""The document-boundary policy: which special tokens mark where a document starts and ends.

``DataConfig.document_boundary`` is one of :data:`DOCUMENT_BOUNDARIES`:

=============  ================================  ==================================================================
policy         a document's tokens               convention of
=============  ================================  ==================================================================
``eos``        ``text EOS``                      jaxpt's own models (the default), GPT-2, Qwen2/2.5/3
``bos``        ``BOS text``                      (rare; a model that marks starts only)
``bos_eos``    ``BOS text EOS``                  Llama 2 / 3 / 3.1 / 3.2, Mistral (their tokenizers add BOS to every
                                                 text; their pretraining documents end with EOS)
``none``       ``text``                          documents run into each other (only segment ids separate them)
=============  ================================  ==================================================================

The same policy is applied wherever documents are tokenized for training or evaluation: packing
(:mod:`jaxpt.data.packing`, :mod:`jaxpt.data.mixture`), the held-out windows (:mod:`jaxpt.eval.heldout`) and the
length-extrapolation stream. A converted model's ``model.gin`` sets its base model's convention
(:mod:`jaxpt.tools.convert`), and its export writes ``add_bos_token`` accordingly, so the exported tokenizer starts a
text as training did. BOS is never a target (it is a segment's first token, which nothing predicts); EOS is, so the
model learns to stop.

Model inputs built from a prompt or a context (generation, the probe tasks, the lm-eval adapter, the spot-check
sheet) start as documents did in training: :func:`context_start` gives the tokens put before them under the run's
policy (``[BOS]`` before every context under ``bos``/``bos_eos``; under ``eos``/``none`` nothing, and an empty
context the one token ``[EOS]``, the document boundary a model trained with EOS saw last).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpt.util.errors import ConfigError

#: The policies (module docstring).
DOCUMENT_BOUNDARIES = ("eos", "bos", "bos_eos", "none")


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The ids a policy puts around each document (None: nothing there).

    Attributes:
      bos_id: put before each document's tokens.
      eos_id: put after them.
    """

    bos_id: int | None = None
    eos_id: int | None = None

    def wrap(self, tokens: np.ndarray) -> np.ndarray:
        """``[bos] + tokens + [eos]`` as the policy has them: int32 [n + (0, 1 or 2)]."""
        tokens = np.asarray(tokens, np.int32)
        if self.bos_id is None and self.eos_id is None:
            return tokens
        head = [np.int32(self.bos_id)] if self.bos_id is not None else []
        tail = [np.int32(self.eos_id)] if self.eos_id is not None else []
        return np.concatenate([np.asarray(head, np.int32), tokens, np.asarray(tail, np.int32)])

    @property
    def start(self) -> np.ndarray:
        """What a document starts with: int32 [1] (BOS) or [0]."""
        return np.asarray([] if self.bos_id is None else [self.bos_id], np.int32)


def strip_eos(policy: str) -> str:
    """``policy`` without its EOS (the meaning of the deprecated ``DataConfig.add_eos = False``)."""
    return {"eos": "none", "bos_eos": "bos"}.get(policy, policy)


def for_tokenizer(policy: str, tokenizer, key: str = "DataConfig.document_boundary") -> Boundary:
    """The :class:`Boundary` of ``policy`` with ``tokenizer``'s BOS and EOS ids.

    Raises:
      ConfigError: an unknown policy, or one that needs a BOS (EOS) the tokenizer does not have (a Qwen tokenizer has
        no BOS), naming ``key`` and the tokenizer's file.
    """
    if policy not in DOCUMENT_BOUNDARIES:
        raise ConfigError(f"{key} = {policy!r}: must be one of {DOCUMENT_BOUNDARIES}")
    out = Boundary(bos_id=tokenizer.bos_id if policy in ("bos", "bos_eos") else None,
                   eos_id=tokenizer.eos_id if policy in ("eos", "bos_eos") else None)
    for name, value in (("BOS", out.bos_id), ("EOS", out.eos_id)):
        if value is not None and value < 0:
            raise ConfigError(f"{key} = {policy!r} puts a {name} token around each document, but the tokenizer "
                              f"({getattr(tokenizer, 'path', None)}) has none; choose a policy without it "
                              f"({', '.join(repr(p) for p in DOCUMENT_BOUNDARIES)})")
    return out


@dataclasses.dataclass(frozen=True)
class ContextStart:
    """How a model input built from a prompt or a context starts under a policy (:func:`context_start`).

    Attributes:
      bos_id: put before every context (``bos``/``bos_eos``: every training document started with it); None: nothing.
      prefix_id: the token an input starts with when there is no context to condition on: ``bos_id`` if there is one,
        else EOS (the boundary after the previous document). lm-evaluation-harness's ``prefix_token_id``: what
        ``loglikelihood_rolling`` scores a document's first token after, and an empty context's one token.
    """

    bos_id: int | None
    prefix_id: int

    def apply(self, ids) -> np.ndarray:
        """The model input of context ``ids``: ``[BOS] + ids`` (with a BOS), else ``ids``, or ``[prefix_id]`` when
        ``ids`` is empty (a model input holds at least one token). int32 [n + 1] or [max(n, 1)]."""
        ids = np.asarray(ids, np.int32).reshape(-1)
        if self.bos_id is not None:
            return np.concatenate([np.asarray([self.bos_id], np.int32), ids])
        return ids if len(ids) else np.asarray([self.prefix_id], np.int32)


def context_start(policy: str, tokenizer, key: str = "DataConfig.document_boundary") -> ContextStart:
    """The :class:`ContextStart` of ``policy`` with ``tokenizer``'s BOS and EOS ids (the policy is the run's
    ``DataConfig.document_boundary``; ``jaxpt.restore(...).config.data.document_boundary`` for a checkpoint).

    ``eos`` (and ``none``) reproduce jaxpt's convention from before policies existed: a context as it is, an empty one
    ``[EOS]``. ``bos``/``bos_eos`` put BOS first, as the base model's tokenizer does (Llama's ``add_bos_token``).

    Raises:
      ConfigError: as :func:`for_tokenizer` (an unknown policy, or a BOS the tokenizer lacks), naming ``key``.
    """
    marks = for_tokenizer(policy, tokenizer, key)
    return ContextStart(bos_id=marks.bos_id,
                        prefix_id=int(tokenizer.eos_id) if marks.bos_id is None else int(marks.bos_id))
