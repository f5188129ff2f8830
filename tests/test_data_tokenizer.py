"""Tokenizer: exact round trip (whitespace included), fixed special ids, deterministic training."""

import gzip
import hashlib
import itertools
import json
import pathlib
import pickle

import numpy as np
import pytest

from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import Tokenizer

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
VOCAB = 512


def _sample_texts(name, n):
    with gzip.open(SAMPLE / name, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in itertools.islice(f, n)]


@pytest.fixture(scope="module")
def texts():
    # Real text of three kinds: Python (indentation), fortunes in several languages, dictionary entries.
    return _sample_texts("code.jsonl.gz", 12) + _sample_texts("multilingual.jsonl.gz", 600) + \
        _sample_texts("reference.jsonl.gz", 300)


@pytest.fixture(scope="module")
def model_path(texts, tmp_path_factory):
    return tokenizer_lib.train_sentencepiece(texts, tmp_path_factory.mktemp("tok") / "t.model", VOCAB)


@pytest.fixture(scope="module")
def tok(model_path):
    return Tokenizer.load(model_path)


def test_special_ids_and_vocab_size(tok):
    assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.bos_id) == (0, 1, 2, 3)
    assert (tokenizer_lib.PAD_ID, tokenizer_lib.EOS_ID) == (0, 1)
    assert tok.vocab_size == VOCAB


@pytest.mark.parametrize("text", [
    "",
    "plain words",
    "  two leading spaces, three trailing   ",
    "def f(x):\n    if x:\n\t\treturn  x  # tabs, runs of spaces\n\n\n",
    "\n\nleading newlines\r\nand a CRLF",
    "Größe, naïve café — “quotes” 中文字符 日本語のテキスト Ünïcödé 🙂",
    "\x1b[33mANSI colour\x1b[m and NUL-free control \x07 bell",
    "digits 1234567890 and 3.14159",
])
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ((ids >= 0) & (ids < tok.vocab_size)).all()
    assert tok.decode(ids) == text


def test_round_trip_on_every_training_text(tok, texts):
    assert [tok.decode(ids) for ids in tok.encode_batch(texts, num_threads=2)] == texts


def test_encode_batch_matches_encode(tok, texts):
    batch = tok.encode_batch(texts[:50], num_threads=2)
    assert all(np.array_equal(b, tok.encode(t)) for b, t in zip(batch, texts[:50]))


def test_no_bos_or_eos_unless_asked(tok):
    plain = tok.encode("hello world").tolist()
    assert tok.bos_id not in plain and tok.eos_id not in plain
    assert tok.encode("hello world", add_eos=True).tolist() == plain + [1]
    assert tok.encode("hello world", add_bos=True).tolist() == [3] + plain


def test_digits_are_split_one_per_token(tok):
    pieces = [tok.id_to_piece(i) for i in tok.encode("x 90210")]
    digits = [p.lstrip("\u2581") for p in pieces if any(c.isdigit() for c in p)]
    assert digits == ["9", "0", "2", "1", "0"]


def test_whitespace_runs_are_learned_as_pieces(tok):
    # Python indentation is common in the training text, so a piece of 4+ spaces ("▁▁▁▁") must exist.
    pieces = {tok.id_to_piece(i) for i in range(tok.vocab_size)}
    assert any(len(p) >= 4 and set(p) == {"\u2581"} for p in pieces)


def test_training_is_deterministic_to_the_byte(texts, model_path, tmp_path):
    again = tokenizer_lib.train_sentencepiece(iter(texts), tmp_path / "elsewhere" / "other-name.model", VOCAB)
    assert again.read_bytes() == model_path.read_bytes()
    assert Tokenizer.load(again).sha256 == hashlib.sha256(model_path.read_bytes()).hexdigest()


def test_pickle_keeps_the_model(tok, texts):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.sha256 == tok.sha256 and clone.path == tok.path
    assert np.array_equal(clone.encode(texts[0]), tok.encode(texts[0]))


def test_errors_name_the_file(tmp_path, texts):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model"):
        Tokenizer.load(bad)
    with pytest.raises(ValueError, match="small.model"):
        tokenizer_lib.train_sentencepiece(["tiny text"], tmp_path / "small.model", 5000)


@pytest.mark.slow  # imports seqio, hence TensorFlow: 4 s alone, far more on a busy machine
def test_seqio_vocabulary_encodes_identically(tok, texts):
    vocab = tok.as_seqio_vocabulary()
    assert (vocab.pad_id, vocab.eos_id, vocab.vocab_size) == (0, 1, VOCAB)
    for text in texts[:20]:
        assert list(vocab.encode(text)) == tok.encode(text).tolist()
