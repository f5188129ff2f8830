"""The seqio vocabulary of a tokenizer encodes and decodes like the wrapper, in Python and in TensorFlow.

Slow: importing seqio imports TensorFlow (about 20 s on a busy 2-core machine).
"""

import gzip
import itertools
import json
import pathlib

import pytest

from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import SPACE_SYMBOL, Tokenizer

pytestmark = pytest.mark.slow

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
ESCAPED = ["a" + SPACE_SYMBOL + "b", SPACE_SYMBOL, SPACE_SYMBOL * 2 + " x " + SPACE_SYMBOL, "", "  two\tspaces\n"]


@pytest.fixture(scope="module")
def texts():
    out = []
    for name, n in (("code.jsonl.gz", 6), ("multilingual.jsonl.gz", 300), ("reference.jsonl.gz", 150)):
        with gzip.open(SAMPLE / name, "rt", encoding="utf-8") as f:
            out += [json.loads(line)["text"] for line in itertools.islice(f, n)]
    return out


@pytest.fixture(scope="module")
def tok(texts, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "t.model"
    return Tokenizer.load(tokenizer_lib.train(texts, path, tokenizer_lib.TrainerSettings(vocab_size=700)))


@pytest.fixture(scope="module")
def vocab(tok):
    import seqio

    v = tok.as_seqio_vocabulary()
    assert isinstance(v, seqio.SentencePieceVocabulary)
    return v


def test_ids_and_size_match(tok, vocab):
    assert (vocab.pad_id, vocab.eos_id, vocab.unk_id, vocab.bos_id, vocab.vocab_size) == (0, 1, 2, 3, 700)


def test_python_encode_and_decode_match(tok, vocab, texts):
    for text in texts[:40] + ESCAPED:
        ids = tok.encode(text).tolist()
        assert list(vocab.encode(text)) == ids
        assert vocab.decode(ids) == tok.decode(ids) == text


def test_tensorflow_encode_and_decode_match(tok, vocab, texts):
    import tensorflow as tf

    sample = texts[:20] + ESCAPED
    for text in sample:  # scalar input, as seqio's preprocessors call it
        assert vocab.encode_tf(tf.constant(text)).numpy().tolist() == tok.encode(text).tolist()
    batch = vocab.encode_tf(tf.constant(sample))  # 1-D input gives a ragged [batch, (ids)]
    assert batch.to_list() == [tok.encode(t).tolist() for t in sample]
    decoded = vocab.decode_tf(batch.to_tensor(default_value=0)).numpy().tolist()
    assert [d.decode("utf-8") for d in decoded] == sample
    # Inside a traced graph (tf.data maps trace their functions) the escape still applies.
    ds = tf.data.Dataset.from_tensor_slices(sample).map(vocab.encode_tf)
    assert [x.tolist() for x in ds.as_numpy_iterator()] == [tok.encode(t).tolist() for t in sample]
