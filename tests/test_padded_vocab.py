"""A model whose ``vocab_size`` is padded past its tokenizer's (rounded up to a multiple of 128, the common case)
never emits an id the tokenizer cannot decode (issue #34).

``Tokenizer.decode`` refuses an out-of-range id with a ValueError naming the id and the tokenizer's size.
"""

import gzip
import itertools
import json
import pathlib

import pytest

from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import Tokenizer

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
TOKENIZER_SIZE = 400
MODEL_VOCAB = 512  # the tokenizer's size rounded up to a multiple of 128


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    with gzip.open(SAMPLE / "reference.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 200)]
    path = tmp_path_factory.mktemp("tok") / "t.model"
    settings = tokenizer_lib.TrainerSettings(vocab_size=TOKENIZER_SIZE)
    t = Tokenizer.load(tokenizer_lib.train(texts, path, settings))
    assert t.vocab_size == TOKENIZER_SIZE
    return t


def test_decode_refuses_an_out_of_range_id_by_name(tok):
    assert tok.decode([tok.vocab_size - 1]) is not None
    for bad in (tok.vocab_size, MODEL_VOCAB - 1, -1):
        with pytest.raises(ValueError, match=rf"id {bad}\b.*{tok.vocab_size}"):
            tok.decode([5, bad, 6])
