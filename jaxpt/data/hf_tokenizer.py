"""The Hugging Face ``tokenizers`` backend: a ``tokenizer.json`` (byte-level BPE as Llama 3, Qwen and Mistral's newer
models ship it) behind the same interface as the SentencePiece one (:class:`jaxpt.data.tokenizer.Tokenizer`).

Encoding is the ``tokenizers`` library's own, with ``add_special_tokens=False``: jaxpt adds no special token itself;
the document-boundary policy (:mod:`jaxpt.data.boundary`) puts BOS/EOS around each document. A literal special-token
string in the text (``"<|end_of_text|>"`` typed into a document) is encoded as the text it is
(``Tokenizer.encode_special_tokens``; transformers' ``split_special_tokens=True``), so a document can neither forge a
document boundary nor lose those characters in a round trip; every other text gets exactly transformers' ids
(``tokenizer(text, add_special_tokens=False)``). ``decode`` skips special tokens (as the SentencePiece backend decodes
them to ''), so ``decode(encode(s)) == s`` for every ``s`` a byte-level BPE without a normalizer represents: all text.

Special tokens come from the model's own files beside ``tokenizer.json`` (:func:`resolve_special_tokens`): BOS and EOS
from ``config.json``'s ``bos_token_id``/``eos_token_id`` (they win: the model was trained with them), else
``generation_config.json``'s, else ``tokenizer_config.json``'s ``bos_token``/``eos_token`` (else
``special_tokens_map.json``'s); a list of EOS ids (an instruct model's stop tokens) gives its first, the document end.
Pad: the same files' ``pad_token_id``/``pad_token``, else the EOS id (padding slots are masked by segment id 0, so any
id serves; this is transformers' own habit for models without one). Unk: ``tokenizer_config.json``'s ``unk_token``,
else the BPE model's ``unk_token``, else none (-1). A tokenizer with no EOS named anywhere is refused, naming the file
and what to add.

The identity (``sha256``) is the sha256 of the ``tokenizer.json`` content (parsed, its ``post_processor`` left out,
re-serialized with sorted keys: the post-processor only adds special tokens to transformers' own calls, never to
jaxpt's ids) together with the resolved special ids: everything that changes the ids jaxpt trains on, and nothing
that does not (formatting, the exported post-processor).

Reference: the ``tokenizers`` library (https://huggingface.co/docs/tokenizers, ``tokenizer.json`` schema of
``tokenizers`` 0.2x); transformers' special-token files (``PreTrainedTokenizerBase``, ``GenerationConfig``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np
import tokenizers

from jaxpt.util import fs

#: The files beside ``tokenizer.json`` that name special tokens, in order of precedence for BOS and EOS ids.
SPECIAL_TOKEN_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")

#: Strings the round-trip check of :meth:`HFTokenizer.lossless_problems` encodes and decodes.
ROUND_TRIP_PROBES = ("  two  spaces ", "\ttab\t\tand\r\nCRLF\n\n", " lead", "emoji 😀🧪", "日本語 中文", "e\u0301 a\u0308",
                     "def f(x):\n    return x  # ok\n", "\x00\x1f\u200d\ufeff", "")


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The resolved special ids of a ``tokenizer.json`` (-1: none) and where each came from.

    Attributes:
      bos_id, eos_id, pad_id, unk_id: token ids in [0, vocab_size), or -1 for none (EOS is never -1).
      adds_bos: whether the model's own tokenizer puts BOS before a text (``tokenizer_config.json``'s
        ``add_bos_token``, else whether ``tokenizer.json``'s post-processor adds it): its document-start convention.
      sources: ``{'bos': 'config.json bos_token_id', ...}``, for messages and :meth:`HFTokenizer.settings`.
    """

    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    adds_bos: bool
    sources: Mapping[str, str]

    def ids(self) -> dict[str, int]:
        """``{'bos_id', 'eos_id', 'pad_id', 'unk_id'}`` (the part of the identity)."""
        return {"bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id, "unk_id": self.unk_id}


def _read_json(path: str) -> Any:
    try:
        return json.loads(fs.read_text(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def _content(token: Any) -> str | None:
    """A special-token entry of ``tokenizer_config.json``: a string, an AddedToken dict (``content``) or null."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _no_eos(tok: tokenizers.Tokenizer, path: str, folder: str) -> ValueError:
    """The error for a ``tokenizer.json`` whose EOS no file beside it names: what to add, and where."""
    named = sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
    hint = f" (its special tokens: {', '.join(named[:8])}{', ...' if len(named) > 8 else ''})" if named else ""
    return ValueError(
        f"{path}: no EOS token is named for this tokenizer: neither config.json / generation_config.json "
        f"(eos_token_id) nor tokenizer_config.json / special_tokens_map.json (eos_token) in {folder} name one; "
        f"add \"eos_token\": \"<the model's end-of-document token>\" to {fs.join(folder, 'tokenizer_config.json')}"
        f"{hint}")


def resolve_special_tokens(tok: tokenizers.Tokenizer, path: str) -> SpecialTokens:
    """Special ids of ``tok`` (loaded from ``path``, a ``tokenizer.json``) from the files beside it (module docstring).

    Raises:
      ValueError: a file beside it that is not JSON; a named token the vocabulary lacks or an id outside it (naming
        the file and key); no EOS named anywhere (naming ``path`` and what to add to ``tokenizer_config.json``).
    """
    folder = fs.dirname(path)
    files = {}
    for name in SPECIAL_TOKEN_FILES:
        p = fs.join(folder, name)
        if fs.isfile(p):
            value = _read_json(p)
            files[name] = value if isinstance(value, dict) else {}
    size = _vocab_size(tok)
    ids, sources = {}, {}

    def from_id(kind: str, name: str, key: str) -> bool:
        value = files.get(name, {}).get(key)
        if isinstance(value, list) and value and kind == "eos":
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        if not 0 <= value < size:
            raise ValueError(f"{fs.join(folder, name)}: {key} = {value} is outside the tokenizer's {size} ids ({path})")
        ids[kind], sources[kind] = value, f"{name} {key}"
        return True

    def from_token(kind: str, name: str, key: str) -> bool:
        token = _content(files.get(name, {}).get(key))
        if token is None:
            return False
        i = tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{fs.join(folder, name)}: {key} = {token!r} is not a token of {path}")
        ids[kind], sources[kind] = i, f"{name} {key}"
        return True

    for kind in ("bos", "eos", "pad"):
        _ = (any(from_id(kind, name, f"{kind}_token_id") for name in SPECIAL_TOKEN_FILES[:2])
             or any(from_token(kind, name, f"{kind}_token") for name in SPECIAL_TOKEN_FILES[2:]))
    if "eos" not in ids:
        raise _no_eos(tok, path, folder)
    if "pad" not in ids:
        ids["pad"], sources["pad"] = ids["eos"], "the EOS id (no pad token named)"
    if not any(from_token("unk", name, "unk_token") for name in SPECIAL_TOKEN_FILES[2:]):
        model_unk = json.loads(tok.to_str()).get("model", {}).get("unk_token")
        if isinstance(model_unk, str) and tok.token_to_id(model_unk) is not None:
            ids["unk"], sources["unk"] = tok.token_to_id(model_unk), "tokenizer.json model.unk_token"
    flag = files.get("tokenizer_config.json", {}).get("add_bos_token")
    if isinstance(flag, bool):
        adds_bos, sources["adds_bos"] = flag, "tokenizer_config.json add_bos_token"
    else:
        adds_bos = "bos" in ids and _post_processor_adds(tok, ids["bos"])
        sources["adds_bos"] = "tokenizer.json post_processor"
    return SpecialTokens(bos_id=ids.get("bos", -1), eos_id=ids["eos"], pad_id=ids["pad"], unk_id=ids.get("unk", -1),
                         adds_bos=adds_bos, sources=sources)


def _post_processor_adds(tok: tokenizers.Tokenizer, bos_id: int) -> bool:
    """Whether ``tok``'s post-processor puts ``bos_id`` before a text (``add_special_tokens=True``)."""
    with_special = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    return len(with_special) > len(plain) and with_special[0] == bos_id


def _vocab_size(tok: tokenizers.Tokenizer) -> int:
    """One more than the largest id (added tokens included): every id ``encode`` gives is below it."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def canonical_json(data: Mapping[str, Any]) -> bytes:
    """``tokenizer.json`` content without its ``post_processor``, serialized with sorted keys (the hashed form)."""
    return json.dumps({k: v for k, v in data.items() if k != "post_processor"}, sort_keys=True, ensure_ascii=False,
                      separators=(",", ":")).encode("utf-8")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with Hugging Face ``tokenizers`` and its resolved special tokens (module docstring).

    Same interface as :class:`jaxpt.data.tokenizer.SentencePieceTokenizer`: ids are int32 numpy arrays, ``encode``
    adds no special token unless asked. Encoding is thread-safe (the Rust tokenizer is immutable once built). Pickles
    as its JSON text and special tokens.
    """

    kind = "huggingface"

    def __init__(self, tokenizer_json: str | bytes, specials: SpecialTokens | None = None,
                 path: str | os.PathLike | None = None):
        text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) else tokenizer_json
        self._json = text
        self._path = None if path is None else fs.path(path) if fs.is_remote(path) else pathlib.Path(path)
        self._tok = tokenizers.Tokenizer.from_str(text)
        self._tok.encode_special_tokens = True  # a literal "<|end_of_text|>" in a document is text (module docstring)
        self._decoder = tokenizers.Tokenizer.from_str(text)
        if specials is None:
            if path is None:
                raise ValueError("HFTokenizer: special tokens are resolved from the files beside tokenizer.json; "
                                 "give `specials` or a `path`")
            specials = resolve_special_tokens(self._decoder, os.fspath(path))
        self._specials = specials
        self._size = _vocab_size(self._tok)
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._sha256 = hashlib.sha256(canonical_json(json.loads(text)) + b"\n"
                                      + json.dumps(specials.ids(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HFTokenizer":
        """Loads ``path`` (a ``tokenizer.json``) and the special tokens named beside it.

        Raises:
          FileNotFoundError: no such file. ValueError: naming the file: not a ``tokenizer.json`` (jaxpt's own tokenizer
            record is named as such), or the special tokens cannot be resolved (:func:`resolve_special_tokens`).
        """
        path = os.fspath(path)
        text = fs.read_text(path)
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if isinstance(data, dict) and "format_version" in data and "tokenizer" in data and "model" not in data:
            raise ValueError(f"{path}: this is the record python -m data_pipelines.tokenizer writes beside its model, "
                             f"not a Hugging Face tokenizer; use {data['tokenizer'].get('file', 'tokenizer.model')} "
                             "beside it")
        if not isinstance(data, dict) or "model" not in data:
            raise ValueError(f"{path}: not a Hugging Face tokenizer.json (no 'model' entry)")
        try:
            tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # pylint: disable=broad-except  (tokenizers raises its own Exception types)
            raise ValueError(f"{path}: not a usable Hugging Face tokenizer.json ({e})") from None
        return cls(text, path=path)

    def __reduce__(self):
        return (HFTokenizer, (self._json, self._specials, None if self._path is None else str(self._path)))

    @property
    def path(self):
        """The ``tokenizer.json`` it was loaded from (None if built from text)."""
        return self._path

    @property
    def sha256(self) -> str:
        """The identity (module docstring): hex sha256 of the canonical ``tokenizer.json`` and the special ids."""
        return self._sha256

    @property
    def vocab_size(self) -> int:
        """Number of ids (added tokens included); every id from ``encode`` is in [0, vocab_size)."""
        return self._size

    @property
    def bos_id(self) -> int:
        """BOS (-1: the model has none, e.g. Qwen)."""
        return self._specials.bos_id

    @property
    def eos_id(self) -> int:
        """EOS: ends each document under the ``eos`` and ``bos_eos`` boundary policies."""
        return self._specials.eos_id

    @property
    def pad_id(self) -> int:
        """Pad: fills empty row slots (the EOS id when the model names none)."""
        return self._specials.pad_id

    @property
    def unk_id(self) -> int:
        """Unk (-1 for a byte-level BPE, which has none)."""
        return self._specials.unk_id

    @property
    def adds_bos(self) -> bool:
        """Whether the model's own tokenizer puts BOS before a text: its document-start convention."""
        return self._specials.adds_bos

    @property
    def special_tokens(self) -> SpecialTokens:
        """The resolved special tokens and their sources."""
        return self._specials

    @property
    def space_symbol_ids(self) -> None:
        """None: the SentencePiece backend's U+2581 escape does not apply."""
        return None

    def settings(self) -> dict[str, Any]:
        """What the file says about how it encodes: backend, model and component types, special ids and sources."""
        data = json.loads(self._json)
        kind = lambda part: (data.get(part) or {}).get("type")  # noqa: E731
        return {"backend": self.kind, "model_type": (data.get("model") or {}).get("type"),
                "normalizer": kind("normalizer"), "pre_tokenizer": kind("pre_tokenizer"), "decoder": kind("decoder"),
                "post_processor": kind("post_processor"), "vocab_size": self.vocab_size, **self._specials.ids(),
                "adds_bos": self.adds_bos, "special_token_sources": dict(self._specials.sources)}

    def lossless_problems(self) -> list[str]:
        """Strings of :data:`ROUND_TRIP_PROBES` for which ``decode(encode(s)) != s``, as ``'s -> decoded'``; [] for a
        byte-level BPE without a normalizer (Llama 3, Qwen)."""
        out = []
        for s in ROUND_TRIP_PROBES:
            back = self.decode(self.encode(s))
            if back != s:
                out.append(f"{s!r} decodes as {back!r}")
        return out

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Token ids of ``text``: int32 [num_tokens]; BOS/EOS only if asked (ValueError if the model has no BOS)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(self._specials_around(ids, add_bos, add_eos), dtype=np.int32)

    def _specials_around(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        if add_bos and self.bos_id < 0:
            raise ValueError(f"{self._path}: this tokenizer has no BOS token")
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def encode_batch(self, texts: Sequence[str], *, num_threads: int = 1) -> list[np.ndarray]:
        """``encode`` over many texts (``tokenizers``' parallel batch; ``num_threads`` is ignored: its thread pool is
        sized by ``RAYON_NUM_THREADS``). Same ids as ``encode``."""
        del num_threads
        return [np.asarray(e.ids, dtype=np.int32)
                for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (any int array or sequence, shape [n]); special tokens decode to ''.

        Raises:
          ValueError: an id outside [0, vocab_size), named with the tokenizer's size.
        """
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = next((i for i in ids if not 0 <= i < self._size), None)
        if bad is not None:
            raise ValueError(f"Tokenizer.decode: id {bad} is outside this tokenizer's {self._size} pieces "
                             f"(ids 0..{self._size - 1})")
        return self._decoder.decode(ids, skip_special_tokens=True)

    def learned_ids(self) -> np.ndarray:
        """Ids of the vocabulary's non-special tokens: int32 [n]."""
        return np.asarray([i for i in range(self._size) if i not in self._special_ids
                           and self._tok.id_to_token(i) is not None], dtype=np.int32)

    def id_to_piece(self, i: int) -> str | None:
        """The token string of id ``i`` (byte-level BPE shows bytes as its printable alphabet, a space as 'Ġ')."""
        return self._tok.id_to_token(int(i))

    def as_seqio_vocabulary(self) -> Any:
        """Refused: seqio vocabularies are SentencePiece models.

        Raises:
          ValueError: always, naming the file and what to do instead.
        """
        raise ValueError(f"{self._path}: a Hugging Face tokenizer.json cannot serve seqio (its vocabularies are "
                         "SentencePiece models); score the probe tasks without seqio (python -m jaxpt.tools.evaluate "
                         "... --no-seqio)")

    def write(self, folder: str, *, add_bos_token: bool | None = None, model_max_length: int | None = None) -> str:
        """Writes ``folder/tokenizer.json`` (this tokenizer's JSON; with ``add_bos_token`` given, its post-processor
        set so that transformers' ``add_special_tokens=True`` puts BOS before a text iff ``add_bos_token``) and
        ``folder/tokenizer_config.json`` naming the resolved special tokens, so that jaxpt loads the copy with the same
        ids and sha256 and ``transformers.AutoTokenizer`` loads it as a fast tokenizer. Returns the
        ``tokenizer.json`` path. ``folder`` may be local or ``gs://``."""
        data = json.loads(self._json)
        adds = (self.adds_bos if add_bos_token is None else add_bos_token) and self.bos_id >= 0
        if adds != (self.bos_id >= 0 and _post_processor_adds(self._decoder, self.bos_id)):
            data["post_processor"] = self._post_processor(adds)
        piece = lambda i: self.id_to_piece(i) if i >= 0 else None  # noqa: E731
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": piece(self.bos_id),
                  "eos_token": piece(self.eos_id), "pad_token": piece(self.pad_id), "unk_token": piece(self.unk_id),
                  "add_bos_token": adds, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False}
        if model_max_length:
            config["model_max_length"] = int(model_max_length)
        fs.makedirs(folder)
        path = fs.join(folder, "tokenizer.json")
        fs.write_text_atomic(path, json.dumps(data, ensure_ascii=False, indent=1) + "\n")
        fs.write_text_atomic(fs.join(folder, "tokenizer_config.json"), json.dumps(config, indent=1) + "\n")
        return path

    def _post_processor(self, add_bos: bool) -> dict[str, Any]:
        """A ``TemplateProcessing`` post-processor adding BOS before each sequence (or nothing)."""
        if not add_bos:
            single, special = [{"Sequence": {"id": "A", "type_id": 0}}], {}
            pair = [*single, {"Sequence": {"id": "B", "type_id": 1}}]
        else:
            bos = self.id_to_piece(self.bos_id)
            tok = lambda type_id: {"SpecialToken": {"id": bos, "type_id": type_id}}  # noqa: E731
            single = [tok(0), {"Sequence": {"id": "A", "type_id": 0}}]
            pair = [*single, tok(1), {"Sequence": {"id": "B", "type_id": 1}}]
            special = {bos: {"id": bos, "ids": [self.bos_id], "tokens": [bos]}}
        return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}

