"""Tokenizers: one way to load any tokenizer (:meth:`Tokenizer.load`), two backends behind one interface.

:meth:`Tokenizer.load` picks the backend from the file's content: JSON (a Hugging Face ``tokenizer.json``, byte-level
BPE as Llama 3, Qwen and Mistral's newer models ship it) -> :class:`jaxpt.data.hf_tokenizer.HFTokenizer`, whose special
tokens come from the model's own ``config.json`` / ``generation_config.json`` / ``tokenizer_config.json`` beside it;
anything else is read as a SentencePiece model proto -> :class:`SentencePieceTokenizer`. Both give ids as int32 numpy
arrays, add no special token unless asked (the document-boundary policy, :mod:`jaxpt.data.boundary`, puts BOS/EOS
around documents), decode exactly what they encoded, and have a ``sha256`` covering everything that changes the ids.
Every reader of a tokenizer in jaxpt and ``data_pipelines`` goes through :meth:`Tokenizer.load`.

SentencePiece models jaxpt trains have fixed special ids that follow the T5/seqio convention, so
`seqio.SentencePieceVocabulary` accepts them as they are:

    PAD_ID = 0   padding; packing fills empty row slots with it (segment id 0 marks them)
    EOS_ID = 1   appended to each document when packing (`DataConfig.document_boundary`), so the model learns to stop
    UNK_ID = 2   never produced in practice: byte fallback covers every character
    BOS_ID = 3   put at each document's start by the 'bos' / 'bos_eos' boundary policies

Training settings keep text exactly (`TrainerSettings`): identity normalization (no NFKC), no
whitespace collapsing or stripping, no dummy space prefix (so the first word of a text and a text
cut anywhere decode to exactly their characters), whitespace-only pieces allowed (code indentation
becomes a few tokens, not one per space), digits split one per token, and byte fallback (a
character the model never saw becomes its UTF-8 bytes, one `<0xNN>` piece each, and decodes back
to those bytes). The trainer runs on one thread over the input in the order given, and the model
is serialized without its file name, so the same texts and settings give byte-identical files.

A SentencePiece model trained elsewhere may carry a normalizer (the library's default ``nmt_nfkc``: NFKC folding,
newlines and tabs to spaces, whitespace runs collapsed and stripped). jaxpt encodes with the model's pieces but
without its normalizer (identity rule, no whitespace removal; the dummy prefix as the model has it), because that is
what the exported Hugging Face tokenizer does: transformers converts a SentencePiece model for ``LlamaTokenizer``
without its normalizer (no precompiled charsmap, only the ``▁`` replacement), so jaxpt's ids and the exported
tokenizer's agree, and newlines, tabs and whitespace runs reach the model as the text has them (byte pieces where the
model has no piece), never silently turned into spaces. The model's own record of its normalizer is kept
(:meth:`SentencePieceTokenizer.settings`); ``sha256`` stays the file's. Known difference for a dummy-prefix model
only: a text that starts with a space gets one more ``▁`` from jaxpt than from transformers (whose Metaspace does not
prepend to a text already starting with one); jaxpt's own models have no dummy prefix.

Exact round trip, `decode(encode(s)) == s` for every str without surrogates (any text that is
valid UTF-8), holds with one escape. SentencePiece writes a space as U+2581 (LOWER ONE EIGHTH
BLOCK, `SPACE_SYMBOL`) inside pieces, so a literal U+2581 in the input would come back as a space.
`SentencePieceTokenizer.encode` therefore cuts the text at each U+2581, encodes the parts, and puts the three
byte-fallback ids of U+2581's UTF-8 bytes (E2 96 81) between them; SentencePiece decodes byte
pieces to the bytes themselves, so the plain `decode` returns U+2581. Text without U+2581 (nearly
all text) gets exactly SentencePiece's ids. The trainer cuts its input at U+2581 the same way.
The seqio vocabulary from `SentencePieceTokenizer.as_seqio_vocabulary` applies the same escape in both its
Python and TensorFlow encoders; decoding needs nothing special anywhere.

Older models trained with SentencePiece's dummy prefix (`add_dummy_prefix`, the quickstart's
tokenizer before this change) still round-trip: the parts after an escaped U+2581 are encoded
without the prefix, which the decoder only strips from the first piece. Their seqio TensorFlow
encoder is SentencePiece's own (U+2581 there becomes a space); the Python encoder is escaped.

Reference: Kudo & Richardson 2018, "SentencePiece" (arXiv:1808.06226); trainer and normalizer
options are those of sentencepiece 0.2.0 (`TrainerSpec`, `NormalizerSpec` in
sentencepiece_model.proto); transformers' ``LlamaConverter`` / ``LlamaTokenizer`` for the conversion.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import io
import json
import os
import pathlib
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from google.protobuf import message
from sentencepiece import sentencepiece_model_pb2

from jaxpt.data import hf_tokenizer
from jaxpt.util import fs

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BOS_ID = 3

#: SentencePiece's whitespace meta symbol; a literal one in the input is escaped (module docstring).
SPACE_SYMBOL = "\u2581"

#: SentencePiece's trainer drops "sentences" longer than this (bytes). Documents are fed in chunks
#: of at most this many characters, cut at line ends where possible.
MAX_SENTENCE_CHARS = 1 << 16


def _as_path(path: str | os.PathLike) -> pathlib.Path:
    """A local path as ``pathlib.Path``; an object-storage one (``gs://``) as ``etils.epath.Path`` (same API)."""
    return fs.path(path) if fs.is_remote(path) else pathlib.Path(path)


class Tokenizer(abc.ABC):
    """The tokenizer interface both backends implement, and the one way to load one (:meth:`load`).

    Properties: ``kind`` ('sentencepiece' or 'huggingface'), ``path``, ``sha256`` (the identity runs and corpus
    manifests record), ``vocab_size``, ``pad_id``/``eos_id``/``bos_id``/``unk_id`` (-1: none), ``adds_bos`` (whether
    the model's own tokenizer puts BOS before a text: its document-start convention), ``space_symbol_ids``. Methods:
    ``encode``/``encode_batch`` (int32 [n] each), ``decode``, ``settings``, ``lossless_problems``, ``learned_ids``,
    ``id_to_piece``, ``as_seqio_vocabulary`` (SentencePiece only), ``write`` (copy into a folder).
    """

    kind: str

    @staticmethod
    def load(path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer in ``path``, its backend picked from the content: a JSON file (a Hugging Face
        ``tokenizer.json``) -> :class:`jaxpt.data.hf_tokenizer.HFTokenizer`; else a SentencePiece model proto ->
        :class:`SentencePieceTokenizer`. ``path`` may be local or ``gs://``.

        Raises:
          FileNotFoundError: no such file.
          ValueError: naming the file: a folder (name the file in it), a file that is neither, or a
            ``tokenizer.json`` whose special tokens cannot be resolved (no EOS: what to add, and where).
        """
        p = _as_path(path)
        if p.is_dir():
            have = [n for n in ("tokenizer.model", "tokenizer.json") if (p / n).exists()]
            raise ValueError(f"{path}: a folder; name the tokenizer file in it"
                             + (f" ({' or '.join(str(p / n) for n in have)})" if have else ""))
        with p.open("rb") as f:
            head = f.read(64).lstrip()
        if head.startswith(b"{"):
            return hf_tokenizer.HFTokenizer.load(path)
        return SentencePieceTokenizer.load(path)

    @property
    @abc.abstractmethod
    def sha256(self) -> str:
        """The tokenizer's identity in run metadata and corpus manifests."""

    @abc.abstractmethod
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Token ids of ``text``: int32 [num_tokens]; BOS/EOS only if asked."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; special ids decode to ''; ValueError for an id outside [0, vocab_size)."""


#: Appended to a normalizing SentencePiece model's bytes in its sha256 (:attr:`SentencePieceTokenizer.sha256`).
ENCODING_WITHOUT_NORMALIZER = b"\0jaxpt: encoded without the model's normalizer"

#: The ``tokenizers`` backend is a Tokenizer too (it lives in its own module, which does not import this one).
Tokenizer.register(hf_tokenizer.HFTokenizer)

#: The one way to load a tokenizer (same as :meth:`Tokenizer.load`).
load = Tokenizer.load


class SentencePieceTokenizer(Tokenizer):
    """A loaded SentencePiece model (module docstring: special ids, the U+2581 escape, the normalizer).

    Encoding is thread-safe (SentencePiece's processor is read-only after loading), which lets
    Grain's read threads tokenize in parallel. The object pickles as its model bytes.
    """

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, path: str | os.PathLike | None = None):
        self._proto = bytes(model_proto)
        self._path = None if path is None else _as_path(path)
        self._spec = sentencepiece_model_pb2.ModelProto.FromString(self._proto)
        digest = hashlib.sha256(self._proto)
        if self.normalizes:  # ids differ from those of jaxpt before it encoded without the normalizer: another
            digest.update(ENCODING_WITHOUT_NORMALIZER)  # identity, so older runs and corpora are refused, not mixed
        self._sha256 = digest.hexdigest()
        self._sp = self._processor(add_dummy_prefix=self._spec.normalizer_spec.add_dummy_prefix)
        self._space_ids, self._sp_inner = self._space_escape()
        self._adds_bos = _sibling_add_bos_token(self._path)

    @property
    def normalizes(self) -> bool:
        """Whether the model's own normalizer rewrites text (a rule other than identity, or whitespace removal);
        jaxpt encodes without it (module docstring)."""
        n = self._spec.normalizer_spec
        return n.name not in ("identity", "") or bool(n.precompiled_charsmap) or n.remove_extra_whitespaces

    def _processor(self, *, add_dummy_prefix: bool) -> spm.SentencePieceProcessor:
        """A processor of this model with its normalizer off (module docstring) and the dummy prefix as given."""
        proto = self._proto
        if self.normalizes or add_dummy_prefix != self._spec.normalizer_spec.add_dummy_prefix:
            m = sentencepiece_model_pb2.ModelProto.FromString(self._proto)
            m.normalizer_spec.CopyFrom(_exact_normalizer(m.normalizer_spec, add_dummy_prefix))
            proto = m.SerializeToString()
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(proto)
        return sp

    def _space_escape(self) -> tuple[list[int] | None, spm.SentencePieceProcessor]:
        """(byte ids of U+2581 or None without byte fallback, processor for the parts after one)."""
        ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_SYMBOL.encode("utf-8")]
        if not all(self._sp.is_byte(i) for i in ids):
            return None, self._sp
        if not self._spec.normalizer_spec.add_dummy_prefix:
            return ids, self._sp
        return ids, self._processor(add_dummy_prefix=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        """Loads a `.model` file. Raises FileNotFoundError, or ValueError naming the file if unreadable."""
        path = _as_path(path)
        proto = path.read_bytes()
        try:
            return cls(proto, path)
        except (RuntimeError, OSError, ValueError, message.DecodeError) as e:
            raise ValueError(f"{path}: neither a SentencePiece model nor a Hugging Face tokenizer.json ({e})") from e

    def __reduce__(self):
        return (SentencePieceTokenizer, (self._proto, self._path))

    @property
    def adds_bos(self) -> bool:
        """Whether the model's own tokenizer puts BOS before a text: ``add_bos_token`` of a ``tokenizer_config.json``
        beside the file (a Hugging Face Llama folder), else False (jaxpt's models)."""
        return self._adds_bos

    @property
    def proto(self) -> bytes:
        """The model file's bytes."""
        return self._proto

    def write(self, folder: str | os.PathLike, **unused) -> str:
        """Writes ``folder/tokenizer.model`` (the model's bytes) and returns its path (local or ``gs://``)."""
        del unused
        path = fs.join(os.fspath(folder), "tokenizer.model")
        fs.makedirs(os.fspath(folder))
        fs.write_bytes_atomic(path, self._proto)
        return path

    @property
    def path(self) -> pathlib.Path | None:
        """The file the model was loaded from (None if built from bytes)."""
        return self._path

    @property
    def sha256(self) -> str:
        """Hex sha256 of the serialized model: the tokenizer's identity in run metadata. For a model with a
        normalizer (:attr:`normalizes`), of the model followed by :data:`ENCODING_WITHOUT_NORMALIZER`: its ids are
        not those it gave with its normalizer on (jaxpt before 2026-12), so a checkpoint or corpus version made
        then is refused as another tokenizer's instead of being read with different ids."""
        return self._sha256

    @property
    def vocab_size(self) -> int:
        """Number of ids; every id from `encode` is in [0, vocab_size)."""
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        """PAD_ID (0): fills empty row slots."""
        return self._sp.pad_id()

    @property
    def eos_id(self) -> int:
        """EOS_ID (1): ends each packed document."""
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        """BOS_ID (3): reserved, never added unless asked."""
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        """UNK_ID (2): unused in practice (byte fallback)."""
        return self._sp.unk_id()

    @property
    def space_symbol_ids(self) -> list[int] | None:
        """The ids a literal U+2581 encodes to (its three UTF-8 byte pieces); None without byte fallback."""
        return None if self._space_ids is None else list(self._space_ids)

    def settings(self) -> dict[str, Any]:
        """The model's own record of how it was trained and how it normalizes (from its proto).

        Keys: the `TrainerSettings` fields except `seed` (which the model does not store), plus
        ``pad_id``, ``eos_id``, ``unk_id``, ``bos_id``, ``num_byte_pieces``. Model type is lower case. The
        normalization fields are the model's own; jaxpt encodes without them (module docstring).
        """
        t, n = self._spec.trainer_spec, self._spec.normalizer_spec
        names = [f.name for f in dataclasses.fields(TrainerSettings) if f.name in t.DESCRIPTOR.fields_by_name]
        out = {name: getattr(t, name) for name in names}
        out.update(
            model_type=sentencepiece_model_pb2.TrainerSpec.ModelType.Name(t.model_type).lower(),
            vocab_size=self.vocab_size,
            character_coverage=round(t.character_coverage, 6),
            normalization_rule_name=n.name,
            remove_extra_whitespaces=n.remove_extra_whitespaces,
            add_dummy_prefix=n.add_dummy_prefix,
            pad_id=self.pad_id, eos_id=self.eos_id, unk_id=self.unk_id, bos_id=self.bos_id,
            num_byte_pieces=sum(self._sp.is_byte(i) for i in range(self.vocab_size)),
        )
        return out

    def lossless_problems(self) -> list[str]:
        """Reasons `decode(encode(s)) == s` can fail for this model; [] for models trained here.

        jaxpt encodes without the model's normalizer (module docstring), so a model is lossless when it has all 256
        byte-fallback pieces (so every character has ids and U+2581 can be escaped).
        """
        s = self.settings()
        problems = []
        if s["num_byte_pieces"] != 256 or self._space_ids is None:
            problems.append(f"byte fallback needs 256 byte pieces, the model has {s['num_byte_pieces']}")
        return problems

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Token ids of `text`: int32 array of shape [num_tokens]; BOS/EOS only if asked.

        A literal U+2581 becomes its three byte ids (module docstring); other text gets exactly
        SentencePiece's ids.
        """
        if self._space_ids is None or SPACE_SYMBOL not in text:
            ids = self._sp.encode(text, add_bos=add_bos, add_eos=add_eos)
        else:
            ids = [self.bos_id] * add_bos + self._encode_escaped(text) + [self.eos_id] * add_eos
        return np.asarray(ids, dtype=np.int32)

    def _encode_escaped(self, text: str) -> list[int]:
        first, *rest = text.split(SPACE_SYMBOL)
        ids = self._sp.encode(first)
        for part in rest:
            ids += self._space_ids
            ids += self._sp_inner.encode(part)
        return ids

    def encode_batch(self, texts: Sequence[str], *, num_threads: int = 1) -> list[np.ndarray]:
        """`encode` over many texts, using `num_threads` SentencePiece threads. Same ids as `encode`."""
        texts = list(texts)
        ids = self._sp.encode(texts, num_threads=num_threads)
        if self._space_ids is not None:
            for i, text in enumerate(texts):
                if SPACE_SYMBOL in text:
                    ids[i] = self._encode_escaped(text)
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids` (any int array or sequence, shape [n]). Special ids decode to ''.

        Raises:
          ValueError: an id outside [0, vocab_size), named with the tokenizer's size (e.g. a padded id of a
            model whose `vocab_size` is larger than this tokenizer's; decoding masks those, `jaxpt.infer.decode`).
        """
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        n = self.vocab_size
        bad = next((i for i in ids if not 0 <= i < n), None)
        if bad is not None:
            raise ValueError(f"Tokenizer.decode: id {bad} is outside this tokenizer's {n} pieces (ids 0..{n - 1})")
        return self._sp.decode(ids)

    def learned_ids(self) -> np.ndarray:
        """Ids of the trained pieces: int32 [n], every id that is neither special nor a byte piece."""
        sp = self._sp
        return np.asarray([i for i in range(self.vocab_size)
                           if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))], dtype=np.int32)

    def id_to_piece(self, i: int) -> str:
        """The piece string of id `i` (spaces shown as U+2581, bytes as `<0xNN>`)."""
        return self._sp.id_to_piece(int(i))

    def as_seqio_vocabulary(self) -> Any:
        """A `seqio.SentencePieceVocabulary` over the same file (imports seqio, hence TensorFlow, lazily).

        It is a subclass whose encoders apply this wrapper's U+2581 escape (Python: `encode` itself;
        TensorFlow: the same cut-and-insert with ragged ops), so both give `encode`'s ids for any
        text. Decoding is seqio's own (it stops at the first EOS, as seqio always does). For a legacy
        dummy-prefix model the TensorFlow encoder is seqio's unchanged (module docstring).

        A model with a normalizer gets it switched off there too (seqio's ``normalizer_spec_overrides``), so seqio
        encodes as jaxpt does.

        Raises ValueError if this tokenizer was not loaded from a file.
        """
        if self._path is None:
            raise ValueError("as_seqio_vocabulary needs a tokenizer loaded from a file (Tokenizer.load)")
        overrides = (_exact_normalizer(self._spec.normalizer_spec, self._spec.normalizer_spec.add_dummy_prefix)
                     if self.normalizes else None)
        return _seqio_vocabulary_class()(str(self._path), self, overrides)


def _exact_normalizer(spec, add_dummy_prefix: bool):
    """``spec`` (a ``NormalizerSpec``) with normalization off: identity rule, no charsmap, whitespace kept."""
    out = sentencepiece_model_pb2.NormalizerSpec()
    out.CopyFrom(spec)
    out.name, out.precompiled_charsmap = "identity", b""
    out.remove_extra_whitespaces, out.add_dummy_prefix = False, add_dummy_prefix
    return out


def _sibling_add_bos_token(path) -> bool:
    """``add_bos_token`` of the ``tokenizer_config.json`` beside ``path`` (False without one)."""
    if path is None:
        return False
    config = fs.join(fs.dirname(os.fspath(path)), "tokenizer_config.json")
    try:
        value = json.loads(fs.read_text(config)).get("add_bos_token") if fs.isfile(config) else None
    except (ValueError, AttributeError):
        return False
    return value if isinstance(value, bool) else False


@functools.cache
def _seqio_vocabulary_class() -> type:
    import seqio  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    class EscapedSentencePieceVocabulary(seqio.SentencePieceVocabulary):
        """seqio's SentencePiece vocabulary with `Tokenizer`'s U+2581 escape in both encoders."""

        def __init__(self, sentencepiece_model_file: str, tokenizer: SentencePieceTokenizer, overrides=None):
            super().__init__(sentencepiece_model_file, normalizer_spec_overrides=overrides)
            self._jaxpt_tokenizer = tokenizer

        def _encode(self, s: str) -> Sequence[int]:
            return self._jaxpt_tokenizer.encode(s).tolist()

        def _encode_tf(self, s):
            """Scalar string -> int32 [n]; string [batch] -> ragged int32 [batch, (n)]."""
            tok = self._jaxpt_tokenizer
            if tok.space_symbol_ids is None or tok._sp_inner is not tok._sp:  # pylint: disable=protected-access
                return super()._encode_tf(s)
            space = tf.constant(tok.space_symbol_ids, tf.int32)
            s = tf.convert_to_tensor(s, tf.string)

            def with_space_after(parts):  # ragged [rows, (ids)] -> each row followed by U+2581's ids
                tail = tf.RaggedTensor.from_tensor(tf.tile(space[None], [parts.nrows(), 1]))
                return tf.concat([tf.cast(parts, tf.int32), tail], axis=1)

            parts = tf.strings.split(s, SPACE_SYMBOL)  # [parts] or ragged [batch, (parts)]
            if s.shape.rank == 0:
                ids = with_space_after(self.tf_tokenizer.tokenize(parts)).flat_values
                return ids[:-len(tok.space_symbol_ids)]
            if s.shape.rank != 1:
                raise ValueError(f"encode_tf takes a scalar or 1-D string tensor, got shape {s.shape}")
            ids = self.tf_tokenizer.tokenize(parts.values)  # ragged [all parts, (ids)]
            ids = parts.with_values(with_space_after(ids)).merge_dims(1, 2)
            return ids[:, :-len(tok.space_symbol_ids)]

    return EscapedSentencePieceVocabulary


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """SentencePiece trainer options we set (all others are sentencepiece 0.2.0 defaults).

    The defaults keep text exactly (module docstring). `vocab_size` counts every piece: the four
    specials, the 256 byte pieces and the learned ones. `character_coverage` is the share of training
    characters that get their own piece; the rarer rest is left to byte fallback.
    """

    vocab_size: int = 8192
    model_type: str = "bpe"
    character_coverage: float = 0.9995
    byte_fallback: bool = True
    split_digits: bool = True
    remove_extra_whitespaces: bool = False
    add_dummy_prefix: bool = False
    normalization_rule_name: str = "identity"
    allow_whitespace_only_pieces: bool = True
    max_sentencepiece_length: int = 16
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError naming the field on a setting SentencePiece would reject or misuse."""
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {self.model_type!r}")
        if self.vocab_size < 4 + 256 * self.byte_fallback + 1:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no room beside 4 specials and 256 bytes")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError(f"character_coverage must be in (0, 1], got {self.character_coverage}")

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `spm.SentencePieceTrainer.train`, special ids and determinism included."""
        kwargs = dataclasses.asdict(self)
        del kwargs["seed"]
        return dict(
            kwargs,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            # Determinism: one thread, input order as given, no sampling of sentences.
            num_threads=1,
            shuffle_input_sentence=False,
            input_sentence_size=0,
            max_sentence_length=4 * MAX_SENTENCE_CHARS,  # bytes; a char is at most 4 UTF-8 bytes
            hard_vocab_limit=True,
            minloglevel=2,
        )


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    """Cuts each text at U+2581 (as `Tokenizer.encode` does), then into pieces of at most
    MAX_SENTENCE_CHARS characters, at line ends when possible."""
    for document in texts:
        for text in document.split(SPACE_SYMBOL):
            start = 0
            while len(text) - start > MAX_SENTENCE_CHARS:
                cut = text.rfind("\n", start, start + MAX_SENTENCE_CHARS)
                cut = start + MAX_SENTENCE_CHARS if cut <= start else cut + 1
                yield text[start:cut]
                start = cut
            if start < len(text):
                yield text[start:]


def train(texts: Iterable[str], model_path: str | os.PathLike, settings: TrainerSettings) -> pathlib.Path:
    """Trains a SentencePiece model on `texts` with `settings` and writes it to `model_path`.

    Deterministic: the same texts in the same order with the same settings give the same file bytes.

    Args:
      texts: training documents, used in the order given; each is cut at U+2581 and into pieces of
        at most MAX_SENTENCE_CHARS characters (the trainer's sentence limit) at line ends where possible.
      model_path: output `.model` file; its parent folder is created.
      settings: trainer options; `settings.seed` seeds SentencePiece's random generator (used only
        by sampling options we leave off; recorded for completeness).

    Returns:
      `model_path` as a Path.

    Raises:
      ValueError: a bad setting, or the texts cannot support `vocab_size` pieces (the message is
        SentencePiece's, prefixed with `model_path`).
    """
    settings.validate()
    model_path = _as_path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(settings.seed)
    buf = io.BytesIO()
    try:
        # model_writer instead of model_prefix: the prefix would be recorded inside the model, making
        # the bytes depend on where it was trained.
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(texts), model_writer=buf, **settings.trainer_kwargs()
        )
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training for {model_path} failed: {e}") from e
    fs.write_bytes_atomic(model_path, buf.getvalue())
    return model_path


def train_sentencepiece(
    texts: Iterable[str],
    model_path: str | os.PathLike,
    vocab_size: int = 8192,
    *,
    model_type: str = "bpe",
    seed: int = 0,
    character_coverage: float = 0.9995,
    byte_fallback: bool = True,
    split_digits: bool = True,
) -> pathlib.Path:
    """`train` with `TrainerSettings` built from these arguments (the others at their defaults).

    Raises ValueError as `train` does.
    """
    settings = TrainerSettings(
        vocab_size=vocab_size,
        model_type=model_type,
        seed=seed,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        split_digits=split_digits,
    )
    return train(texts, model_path, settings)
