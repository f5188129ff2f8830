"""Tokenizer round trip: decode(encode(x)) == x exactly for any text, checked by hypothesis.

The model is trained here with the settings `data_pipelines.tokenizer` uses (no dummy prefix), on
real sample text; the strings are built from whitespace runs, words it saw, emoji, CJK, combining
marks, control characters (NUL included), characters it never saw, SentencePiece's own meta symbol
U+2581 and literal piece names such as `<0x41>` and `</s>`.
"""

import gzip
import itertools
import json
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sentencepiece import sentencepiece_model_pb2

from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import SPACE_SYMBOL, SentencePieceTokenizer, Tokenizer

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
EXAMPLES = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _texts(name, n):
    with gzip.open(SAMPLE / name, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in itertools.islice(f, n)]


@pytest.fixture(scope="module")
def training_texts():
    return _texts("code.jsonl.gz", 8) + _texts("multilingual.jsonl.gz", 400) + _texts("reference.jsonl.gz", 200)


@pytest.fixture(scope="module")
def tok(training_texts, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "t.model"
    return Tokenizer.load(tokenizer_lib.train(training_texts, path, tokenizer_lib.TrainerSettings(vocab_size=600)))


@pytest.fixture(scope="module")
def unigram_tok(training_texts, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "u.model"
    settings_ = tokenizer_lib.TrainerSettings(vocab_size=600, model_type="unigram")
    return Tokenizer.load(tokenizer_lib.train(training_texts, path, settings_))


@pytest.fixture(scope="module")
def legacy_tok(tok):
    """The same model with SentencePiece's dummy prefix switched on, as tokenizers trained before had it."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(tok.path.read_bytes())
    proto.normalizer_spec.add_dummy_prefix = True
    return SentencePieceTokenizer(proto.SerializeToString())


@pytest.fixture(scope="module")
def seen_words(training_texts):
    words = sorted({w for t in training_texts[:60] for w in t.split()})
    assert len(words) > 200
    return words


WHITESPACE = " \t\n\r\x0b\x0c\x85\xa0\u2028\u3000"
CJK = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF)
EMOJI = st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF)
COMBINING = st.characters(categories=["Mn", "Me"])
CONTROL = st.characters(categories=["Cc", "Cf"])  # NUL and the rest of C0/C1, plus BOM, ZWJ, bidi marks
UNSEEN = st.characters(categories=["Co", "Cn"])  # private use and unassigned code points
LITERALS = st.sampled_from([SPACE_SYMBOL, "<0x41>", "<0x00>", "<s>", "</s>", "<unk>", "<pad>", " \u2047 ", "\ufffd"])


def fragments(seen_words):
    return st.one_of(
        st.text(alphabet=WHITESPACE, min_size=1, max_size=8),
        st.sampled_from(seen_words),
        st.text(st.one_of(CJK, EMOJI, COMBINING, CONTROL, UNSEEN), min_size=1, max_size=4),
        LITERALS,
        st.text(alphabet="0123456789.,-", min_size=1, max_size=6),
        st.text(max_size=6),  # anything at all (no surrogates: a str that is valid UTF-8)
    )


def mixed_text(seen_words):
    return st.lists(fragments(seen_words), max_size=24).map("".join)


def test_round_trip_is_exact_for_any_text(tok, seen_words):
    @EXAMPLES
    @given(mixed_text(seen_words))
    def check(text):
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ((ids >= 0) & (ids < tok.vocab_size)).all()
        assert tok.unk_id not in ids.tolist()
        assert tok.decode(ids) == text

    check()


def test_decoding_pieces_concatenates_their_texts(tok, seen_words):
    """Without a dummy prefix decode is a concatenation: a packed row cut anywhere between documents
    decodes to exactly the documents' text, and a document's ids need not start a sequence."""

    @EXAMPLES
    @given(mixed_text(seen_words), mixed_text(seen_words))
    def check(a, b):
        assert tok.decode(np.concatenate([tok.encode(a), tok.encode(b)])) == a + b

    check()


def test_batch_encoding_matches_single(tok, seen_words):
    @settings(max_examples=40, deadline=None)
    @given(st.lists(mixed_text(seen_words), max_size=8))
    def check(texts):
        batch = tok.encode_batch(texts, num_threads=2)
        assert [b.tolist() for b in batch] == [tok.encode(t).tolist() for t in texts]

    check()


def test_unigram_models_round_trip_too(unigram_tok, seen_words):
    assert unigram_tok.settings()["model_type"] == "unigram" and unigram_tok.lossless_problems() == []

    @settings(max_examples=120, deadline=None)
    @given(mixed_text(seen_words))
    def check(text):
        assert unigram_tok.decode(unigram_tok.encode(text)) == text

    check()


def test_legacy_dummy_prefix_models_still_round_trip(legacy_tok, seen_words):
    @settings(max_examples=120, deadline=None)
    @given(mixed_text(seen_words))
    def check(text):
        assert legacy_tok.decode(legacy_tok.encode(text)) == text

    check()


def test_ordinary_text_gets_sentencepieces_own_ids(tok, training_texts):
    """The U+2581 escape only touches text that contains U+2581: ids of other text are SentencePiece's."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tok.path))
    for text in training_texts[:100]:
        assert SPACE_SYMBOL not in text
        assert tok.encode(text).tolist() == sp.encode(text)


def test_literal_space_symbol_is_its_utf8_bytes(tok):
    # Without the escape SentencePiece reads U+2581 as a space: "a▁b" would decode to "a b".
    byte_ids = [tok._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_SYMBOL.encode()]  # pylint: disable=protected-access
    assert tok.space_symbol_ids == byte_ids
    ids = tok.encode("a" + SPACE_SYMBOL + "b").tolist()
    assert ids == tok.encode("a").tolist() + byte_ids + tok.encode("b").tolist()
    assert tok.decode(ids) == "a\u2581b"
    assert tok.encode(SPACE_SYMBOL, add_bos=True, add_eos=True).tolist() == [3, *byte_ids, 1]


def test_unseen_characters_become_their_bytes(tok):
    """Byte fallback: a character the model never saw is one `<0xNN>` piece per UTF-8 byte, and decodes
    to the character, never to the piece names."""
    for ch in ("\ue000", "\U0010fffd", "\U0001f9ea", "\x00", "\u0378"):
        pieces = [tok.id_to_piece(i) for i in tok.encode(ch)]
        assert pieces == [f"<0x{b:02X}>" for b in ch.encode("utf-8")]
        assert tok.decode(tok.encode(ch)) == ch


def test_whitespace_is_never_changed(tok):
    for text in ("", " ", "   ", "\t\t x \n\n\n", "\r\n\r\n", "  lead", "trail  ", "a  b\t\tc\n \n"):
        assert tok.decode(tok.encode(text)) == text
    # No dummy prefix: a text starting with a word and one starting with a space differ by one space.
    assert tok.decode(tok.encode(" The")) == " The" and tok.decode(tok.encode("The")) == "The"


def test_model_records_exact_text_settings(tok):
    s = tok.settings()
    assert (s["pad_id"], s["eos_id"], s["unk_id"], s["bos_id"]) == (0, 1, 2, 3)
    assert s["byte_fallback"] and s["split_digits"] and s["num_byte_pieces"] == 256
    assert s["normalization_rule_name"] == "identity" and not s["remove_extra_whitespaces"]
    assert not s["add_dummy_prefix"] and s["model_type"] == "bpe" and s["vocab_size"] == 600
    assert tok.lossless_problems() == []
    assert len(tok.learned_ids()) == 600 - 4 - 256


def test_a_normalizing_model_is_encoded_without_its_normalizer(tok):
    """jaxpt encodes without the model's normalizer (as the exported LlamaTokenizer does), so a model that says
    remove_extra_whitespaces still keeps every whitespace run and is lossless; the model's own record is kept."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(tok.path.read_bytes())
    proto.normalizer_spec.remove_extra_whitespaces = True
    collapsing = SentencePieceTokenizer(proto.SerializeToString())
    assert collapsing.settings()["remove_extra_whitespaces"] and collapsing.lossless_problems() == []
    for text in ("  lead", "a  b\t\tc\n \n", "trail  "):
        assert collapsing.encode(text).tolist() == tok.encode(text).tolist()
        assert collapsing.decode(collapsing.encode(text)) == text


def test_lossy_models_are_named_as_such(tok):
    proto = sentencepiece_model_pb2.ModelProto.FromString(tok.path.read_bytes())
    proto.trainer_spec.byte_fallback = False
    for piece in proto.pieces:  # byte pieces turned into plain ones: no byte fallback left
        if piece.type == piece.BYTE:
            piece.type = piece.USER_DEFINED
    problems = SentencePieceTokenizer(proto.SerializeToString()).lossless_problems()
    assert problems == ["byte fallback needs 256 byte pieces, the model has 0"]
