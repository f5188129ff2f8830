"""``tf.train.Example`` decoding without TensorFlow or TFDS: the record format of corpus shards.

A corpus version's ArrayRecord shards hold serialized ``tf.train.Example`` messages (see
``data_pipelines/writer.py``). Training workers must read them with the core install only (no TensorFlow, TFDS,
Beam), so the message types are declared here from the public schema
(``tensorflow/core/example/{example,feature}.proto``) into a private protobuf descriptor pool, and parsed by the
protobuf runtime (its C implementation, upb, where installed) -- the same bytes, the same field numbers:

    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }
    message Feature { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    message Features { map<string, Feature> feature = 1; }
    message Example { Features features = 1; }

Packed and unpacked repeated encodings are both accepted (protobuf parsers always accept both).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_PACKAGE = "jaxpt.tf_example"


@functools.cache
def example_class() -> type:
    """The ``Example`` message class (a protobuf ``Message`` subclass; ``Example.FromString(bytes)`` parses)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # core dep (sentencepiece's)

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="jaxpt/tf_example.proto", package=_PACKAGE, syntax="proto3")
    for name, kind in (("BytesList", f.TYPE_BYTES), ("FloatList", f.TYPE_FLOAT), ("Int64List", f.TYPE_INT64)):
        fdp.message_type.add(name=name).field.add(name="value", number=1, label=f.LABEL_REPEATED, type=kind)
    feature = fdp.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, kind) in enumerate((("bytes_list", "BytesList"), ("float_list", "FloatList"),
                                           ("int64_list", "Int64List")), start=1):
        feature.field.add(name=name, number=number, label=f.LABEL_OPTIONAL, type=f.TYPE_MESSAGE,
                          type_name=f".{_PACKAGE}.{kind}", oneof_index=0)
    features = fdp.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, label=f.LABEL_OPTIONAL, type=f.TYPE_STRING)
    entry.field.add(name="value", number=2, label=f.LABEL_OPTIONAL, type=f.TYPE_MESSAGE,
                    type_name=f".{_PACKAGE}.Feature")
    features.field.add(name="feature", number=1, label=f.LABEL_REPEATED, type=f.TYPE_MESSAGE,
                       type_name=f".{_PACKAGE}.Features.FeatureEntry")
    fdp.message_type.add(name="Example").field.add(name="features", number=1, label=f.LABEL_OPTIONAL,
                                                   type=f.TYPE_MESSAGE, type_name=f".{_PACKAGE}.Features")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Example"))


def parse_example(data: bytes) -> dict[str, Any]:
    """A serialized ``tf.train.Example`` -> ``{name: value}``: a bytes feature -> ``list[bytes]``, an int64
    feature -> ``int64[n]``, a float feature -> ``float32[n]`` (numpy); a feature with no kind set -> ``[]``.

    Raises:
      google.protobuf.message.DecodeError: ``data`` is not a valid serialized message.
    """
    out: dict[str, Any] = {}
    for name, feature in example_class().FromString(data).features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            out[name] = list(feature.bytes_list.value)
        elif kind == "int64_list":
            out[name] = np.asarray(feature.int64_list.value, dtype=np.int64)
        elif kind == "float_list":
            out[name] = np.asarray(feature.float_list.value, dtype=np.float32)
        else:
            out[name] = []
    return out


#: The text features of a corpus record (``data_pipelines/writer.py``), decoded as UTF-8 ('' when absent).
CORPUS_TEXT_FEATURES = ("id", "source", "domain", "lang", "text")


def parse_corpus_record(data: bytes) -> dict[str, Any]:
    """One corpus shard record -> ``{"id", "source", "domain", "lang", "text"}`` (str, '' when absent) and
    ``"tokens"`` (``int32[n]`` SentencePiece ids; empty when absent).

    Raises:
      google.protobuf.message.DecodeError: not a serialized Example.
      ValueError: a token id does not fit int32.
    """
    example = parse_example(data)
    record: dict[str, Any] = {}
    for key in CORPUS_TEXT_FEATURES:
        values = example.get(key)
        record[key] = values[0].decode("utf-8") if isinstance(values, list) and values else ""
    tokens = example.get("tokens")
    tokens = np.zeros((0,), np.int64) if tokens is None or isinstance(tokens, list) else tokens
    if tokens.size and (tokens.min() < np.iinfo(np.int32).min or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError(f"corpus record {record['id']!r}: a token id does not fit int32")
    record["tokens"] = tokens.astype(np.int32)
    return record
