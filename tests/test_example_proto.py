"""jaxpt.data.example_proto: tf.train.Example records decoded without TensorFlow/TFDS, byte for byte as TFDS."""

import numpy as np
import pytest

from jaxpt.data import example_proto


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative varints
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # wire type 2: length-delimited
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _example(features: dict[str, bytes]) -> bytes:
    entries = b"".join(_field(1, _field(1, k.encode()) + _field(2, v)) for k, v in features.items())
    return _field(1, entries)


def test_hand_encoded_wire_format_decodes():
    # Written from the wire-format spec (protobuf encoding guide): packed int64s, one unpacked, bytes, floats.
    tokens_packed = _field(3, _field(1, b"".join(_varint(t) for t in (5, 300, 2**31 - 1, 0))))
    tokens_unpacked = _field(3, _varint(1 << 3 | 0) + _varint(-7))  # field 1, wire type 0
    floats = _field(2, _field(1, np.array([0.5, -2.0], "<f4").tobytes()))
    raw = _example({"id": _field(1, _field(1, "dé".encode())), "tokens": tokens_packed,
                    "neg": tokens_unpacked, "w": floats, "empty": b""})
    ex = example_proto.parse_example(raw)
    assert ex["id"] == ["dé".encode()]
    assert ex["tokens"].tolist() == [5, 300, 2**31 - 1, 0]
    assert ex["neg"].tolist() == [-7]
    assert ex["w"].tolist() == [0.5, -2.0]
    assert ex["empty"] == []
    rec = example_proto.parse_corpus_record(raw)
    assert rec["id"] == "dé" and rec["text"] == "" and rec["tokens"].dtype == np.int32
    assert rec["tokens"].tolist() == [5, 300, 2**31 - 1, 0]


def test_token_outside_int32_is_refused():
    raw = _example({"id": _field(1, _field(1, b"x")), "tokens": _field(3, _field(1, _varint(2**31)))})
    with pytest.raises(ValueError, match="does not fit int32"):
        example_proto.parse_corpus_record(raw)


def test_records_serialized_by_tfds_decode_to_the_same_values():
    pytest.importorskip("tensorflow_datasets")  # the `data` extra; the writer's own features
    from data_pipelines import writer

    value = {"id": "doc-1", "source": "web", "domain": "news", "lang": "de", "text": "Grüße\n",
             "tokens": np.array([0, 1, 511, 2**31 - 1], np.int32)}
    rec = example_proto.parse_corpus_record(writer.corpus_features().serialize_example(value))
    assert {k: rec[k] for k in example_proto.CORPUS_TEXT_FEATURES} == {k: value[k] for k in
                                                                    example_proto.CORPUS_TEXT_FEATURES}
    np.testing.assert_array_equal(rec["tokens"], value["tokens"])
