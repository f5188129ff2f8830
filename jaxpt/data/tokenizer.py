"""SentencePiece tokenizer: a thin wrapper for the pipeline and a deterministic trainer.

Special ids are fixed and follow the T5/seqio convention, so `seqio.SentencePieceVocabulary` accepts
our models as they are:

    PAD_ID = 0   padding; packing fills empty row slots with it (segment id 0 marks them)
    EOS_ID = 1   appended to each document when packing (`add_eos`), so the model learns to stop
    UNK_ID = 2   never produced in practice: byte fallback covers every character
    BOS_ID = 3   reserved; never added unless asked

Training settings keep text exactly: identity normalization (no NFKC), no whitespace collapsing,
whitespace-only pieces allowed (code indentation becomes a few tokens, not one per space), digits
split one per token, and byte fallback, so `decode(encode(s)) == s` for any UTF-8 string. The
trainer runs on one thread over the input in the order given, and the model is serialized without
its file name, so the same texts and settings give byte-identical model files.
Reference: Kudo & Richardson 2018, "SentencePiece" (arXiv:1808.06226); trainer options are those of
sentencepiece 0.2.0 (`trainer_spec` in sentencepiece_model.proto).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pathlib
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BOS_ID = 3

#: SentencePiece's trainer drops "sentences" longer than this (bytes). Documents are fed in chunks
#: of at most this many characters, cut at line ends where possible.
MAX_SENTENCE_CHARS = 1 << 16


class Tokenizer:
    """A loaded SentencePiece model with the fixed special ids above.

    Encoding is thread-safe (SentencePiece's processor is read-only after loading), which lets
    Grain's read threads tokenize in parallel. The object pickles as its model bytes.
    """

    def __init__(self, model_proto: bytes, path: str | os.PathLike | None = None):
        self._proto = bytes(model_proto)
        self._path = None if path is None else pathlib.Path(path)
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(self._proto)
        self._sha256 = hashlib.sha256(self._proto).hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads a `.model` file. Raises FileNotFoundError, or ValueError naming the file if unreadable."""
        path = pathlib.Path(path)
        proto = path.read_bytes()
        try:
            return cls(proto, path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{path}: not a SentencePiece model ({e})") from e

    def __reduce__(self):
        return (Tokenizer, (self._proto, self._path))

    @property
    def path(self) -> pathlib.Path | None:
        """The file the model was loaded from (None if built from bytes)."""
        return self._path

    @property
    def sha256(self) -> str:
        """Hex sha256 of the serialized model: the tokenizer's identity in run metadata."""
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

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Token ids of `text`: int32 array of shape [num_tokens]; BOS/EOS only if asked."""
        ids = self._sp.encode(text, add_bos=add_bos, add_eos=add_eos)
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str], *, num_threads: int = 1) -> list[np.ndarray]:
        """`encode` over many texts, using `num_threads` SentencePiece threads. Same ids as `encode`."""
        ids = self._sp.encode(list(texts), num_threads=num_threads)
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids` (any int array or sequence, shape [n]). Special ids decode to ''."""
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    def id_to_piece(self, i: int) -> str:
        """The piece string of id `i` (spaces shown as U+2581, bytes as `<0xNN>`)."""
        return self._sp.id_to_piece(int(i))

    def as_seqio_vocabulary(self) -> Any:
        """A `seqio.SentencePieceVocabulary` over the same file (imports seqio, hence TensorFlow, lazily).

        Raises ValueError if this tokenizer was not loaded from a file.
        """
        if self._path is None:
            raise ValueError("as_seqio_vocabulary needs a tokenizer loaded from a file (Tokenizer.load)")
        import seqio  # pylint: disable=g-import-not-at-top

        return seqio.SentencePieceVocabulary(str(self._path))


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """SentencePiece trainer options we set (all others are sentencepiece 0.2.0 defaults)."""

    vocab_size: int = 8192
    model_type: str = "bpe"
    character_coverage: float = 0.9995
    byte_fallback: bool = True
    split_digits: bool = True
    remove_extra_whitespaces: bool = False
    normalization_rule_name: str = "identity"
    allow_whitespace_only_pieces: bool = True
    max_sentencepiece_length: int = 16
    seed: int = 0

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
    """Cuts each text into pieces of at most MAX_SENTENCE_CHARS characters, at line ends when possible."""
    for text in texts:
        start = 0
        while len(text) - start > MAX_SENTENCE_CHARS:
            cut = text.rfind("\n", start, start + MAX_SENTENCE_CHARS)
            cut = start + MAX_SENTENCE_CHARS if cut <= start else cut + 1
            yield text[start:cut]
            start = cut
        if start < len(text):
            yield text[start:]


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
    """Trains a SentencePiece model on `texts` and writes it to `model_path` (the `.model` file).

    Deterministic: the same texts in the same order with the same settings give the same file bytes.
    Whitespace is kept exactly (see the module docstring for all settings and the special ids).

    Args:
      texts: training documents, used in the order given; each is cut into pieces of at most
        MAX_SENTENCE_CHARS characters (the trainer's sentence limit) at line ends where possible.
      model_path: output file; its parent folder is created.
      vocab_size: exact size of the vocabulary, special and byte-fallback pieces included.
      model_type: 'bpe' or 'unigram'.
      seed: seeds SentencePiece's random generator (only used by options we leave off; recorded).
      character_coverage, byte_fallback, split_digits: sentencepiece trainer options.

    Returns:
      `model_path` as a Path.

    Raises:
      ValueError: the texts cannot support `vocab_size` pieces, or an option is invalid (the message
        is SentencePiece's).
    """
    settings = TrainerSettings(
        vocab_size=vocab_size,
        model_type=model_type,
        seed=seed,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        split_digits=split_digits,
    )
    model_path = pathlib.Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    try:
        # model_writer instead of model_prefix: the prefix would be recorded inside the model, making
        # the bytes depend on where it was trained.
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(texts), model_writer=buf, **settings.trainer_kwargs()
        )
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training for {model_path} failed: {e}") from e
    tmp = model_path.with_name(model_path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(model_path)
    return model_path
