"""Train/eval Grain pipelines: exact resume, process sharding, token conservation, global batches."""

import gzip
import itertools
import json
import pathlib

import grain
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxpt.data import loader
from jaxpt.data.documents import DocumentFormatError
from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import Tokenizer

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
SEQ_LEN = 64
SEED = 7


def _docs_from_sample():
    docs = []
    for domain, stride in (("multilingual", 100), ("reference", 160), ("code", 330)):
        with gzip.open(SAMPLE / f"{domain}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs += [json.loads(line) for line in itertools.islice(f, 0, None, stride)]
    for d in docs:  # keep the test fast: long code files are cut, which changes nothing tested here
        d["text"] = d["text"][:1000]
    return docs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    docs = _docs_from_sample()
    with gzip.open(root / "train.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    model = tokenizer_lib.train_sentencepiece([d["text"] for d in docs], root / "tokenizer.model", 1500)
    return root / "train.jsonl.gz", Tokenizer.load(model), docs


def _expected_stream(tok, docs, order):
    """Tokens and doc indices of documents `order`, each followed by EOS, laid end to end."""
    pieces = [np.append(tok.encode(docs[i]["text"]), tok.eos_id) for i in order]
    return np.concatenate(pieces), np.concatenate([np.full(len(p), i) for p, i in zip(pieces, order)])


def _stream(batches):
    """(tokens, doc_index) of all non-padding slots, in row-major order."""
    rows = [{k: b[k][r] for k in b} for b in batches for r in range(b["tokens"].shape[0])]
    keep = [r["segment_ids"] > 0 for r in rows]
    return (np.concatenate([r["tokens"][m] for r, m in zip(rows, keep)]),
            np.concatenate([r["doc_index"][m] for r, m in zip(rows, keep)]))


def _global_order(n, epochs, shuffle=True):
    """The documented document order: Grain's seeded global shuffle, reshuffled each epoch."""
    ds = grain.MapDataset.range(n)
    ds = (ds.shuffle(seed=SEED) if shuffle else ds).repeat(None)
    return [ds[i] for i in range(n * epochs)]


def test_batches_have_the_documented_shapes_and_dtypes(data):
    path, tok, _ = data
    batch = next(iter(loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=4, seed=SEED)))
    assert set(batch) == {"tokens", "segment_ids", "positions", "doc_index"}
    assert all(v.shape == (4, SEQ_LEN) and v.dtype == np.int32 for v in batch.values())


def test_train_stream_is_the_shuffled_documents_with_eos_and_no_token_lost(data):
    # Over more than two epochs, so the per-epoch reshuffle and the epoch boundary are covered.
    path, tok, docs = data
    it = iter(loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=4, seed=SEED))
    tokens, doc_index = _stream([next(it) for _ in range(100)])
    order = _global_order(len(docs), epochs=8)
    want_tokens, want_doc_index = _expected_stream(tok, docs, order)
    assert len(tokens) > 2 * sum(len(tok.encode(d["text"])) + 1 for d in docs), "test premise: > 2 epochs"
    np.testing.assert_array_equal(tokens, want_tokens[:len(tokens)])
    np.testing.assert_array_equal(doc_index, want_doc_index[:len(tokens)])
    assert order[:len(docs)] != list(range(len(docs))) and order[:len(docs)] != order[len(docs):2 * len(docs)]


def test_processes_read_disjoint_documents_that_cover_the_file(data):
    path, tok, docs = data
    n = len(docs)
    order = _global_order(n, epochs=8)
    firsts = []
    for p in range(2):
        ds = loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=2, seed=SEED,
                                         process_index=p, process_count=2)
        it = iter(ds)
        tokens, doc_index = _stream([next(it) for _ in range(60)])
        want_tokens, want_doc_index = _expected_stream(tok, docs, order[p::2])
        np.testing.assert_array_equal(tokens, want_tokens[:len(tokens)])
        np.testing.assert_array_equal(doc_index, want_doc_index[:len(tokens)])
        # The documents of the first epoch, in the order this process met them.
        first_epoch = list(dict.fromkeys(doc_index.tolist()))[: (n - p + 1) // 2]
        assert len(first_epoch) == (n - p + 1) // 2, "test premise: a whole epoch was read"
        firsts.append(first_epoch)
    assert not set(firsts[0]) & set(firsts[1])
    assert set(firsts[0]) | set(firsts[1]) == set(range(n))


def test_resume_from_saved_state_gives_the_same_batches(data):
    path, tok, _ = data
    ds = loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=3, seed=SEED)
    it = iter(ds)
    for _ in range(17):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    expected = [next(it) for _ in range(25)]
    resumed = iter(loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=3, seed=SEED))
    resumed.set_state(state)
    for want, got in zip(expected, [next(resumed) for _ in range(25)]):
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_no_shuffle_reads_in_file_order_and_seed_changes_the_order(data):
    path, tok, docs = data
    it = iter(loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=2, seed=SEED,
                                          shuffle=False, read_threads=0))
    _, doc_index = _stream([next(it) for _ in range(5)])
    assert list(dict.fromkeys(doc_index.tolist())) == list(range(len(set(doc_index.tolist()))))
    a = next(iter(loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=2, seed=1)))
    b = next(iter(loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=2, seed=2)))
    assert not np.array_equal(a["doc_index"], b["doc_index"])


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_is_finite_padded_and_covers_every_token_once(data, process_count):
    path, tok, docs = data
    batch_size = 4
    per_process = []
    for p in range(process_count):
        ds = loader.make_eval_dataset(path, tok, seq_len=SEQ_LEN, batch_size=batch_size,
                                        process_index=p, process_count=process_count)
        per_process.append(list(ds))
        assert list(ds) and len(list(ds)) == len(per_process[0]), "every process gets the same count"
    # Interleave the processes' rows back into global row order: process p holds rows p, p + P, ...
    rows = []
    for step_batches in zip(*per_process):
        for r in range(batch_size):
            for b in step_batches:
                rows.append({k: b[k][r] for k in b})
    tokens, doc_index = _stream([{k: np.stack([r[k] for r in rows]) for k in rows[0]}])
    want_tokens, want_doc_index = _expected_stream(tok, docs, range(len(docs)))
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(doc_index, want_doc_index)
    pad_rows = [r for r in rows if not (r["segment_ids"] > 0).any()]
    assert all((r["doc_index"] == -1).all() and (r["tokens"] == tok.pad_id).all() for r in pad_rows)
    assert len(rows) % (batch_size * process_count) == 0
    assert len(rows) - len(pad_rows) == -(-len(want_tokens) // SEQ_LEN)


def test_document_ids_map_doc_index_back_to_ids(data):
    path, tok, docs = data
    ids = loader.document_ids(path)
    assert ids == [d["id"] for d in docs]
    batch = next(iter(loader.make_eval_dataset(path, tok, seq_len=SEQ_LEN, batch_size=2)))
    first = batch["doc_index"][0, 0]
    n = int((batch["doc_index"][0] == first).sum())
    want = np.append(tok.encode(docs[first]["text"]), tok.eos_id)
    np.testing.assert_array_equal(batch["tokens"][0, :n], want[:n])


def test_bad_arguments_and_records_raise(data, tmp_path):
    path, tok, _ = data
    with pytest.raises(ValueError, match="process_index"):
        loader.make_train_dataset(path, tok, seq_len=8, local_batch_size=1, seed=0, process_index=2,
                                    process_count=2)
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"id": "a", "text": "x"}\n{"id": "b"}\n')
    with pytest.raises(DocumentFormatError, match=r"bad\.jsonl\.gz:2: missing_text"):
        loader.document_ids(bad)


def test_to_global_batch_shards_device_keys_over_data_and_fsdp(data):
    path, tok, _ = data
    assert jax.device_count() == 8, "tests run with 8 simulated CPU devices (tests/conftest.py)"
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    local = next(iter(loader.make_train_dataset(path, tok, seq_len=SEQ_LEN, local_batch_size=8, seed=SEED)))
    batch = loader.to_global_batch(local, sharding)
    assert set(batch) == set(loader.DEVICE_KEYS)  # doc_index stays on the host
    for k, arr in batch.items():
        assert isinstance(arr, jax.Array) and arr.sharding == sharding and arr.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(arr), local[k])
        # 4 batch shards of 2 rows; each is replicated over the 2 `tensor` devices.
        assert {s.data.shape for s in arr.addressable_shards} == {(2, SEQ_LEN)}
        for s in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), local[k][s.index])
