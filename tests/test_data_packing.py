"""Packing: exact row layout on a hand-computed example, token conservation, checkpoint exactness."""

import collections
import json

import grain
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxpt.data import packing

PAD = 0


def _rows_as_lists(rows):
    return [{k: r[k].tolist() for k in packing.ROW_KEYS} for r in rows]


def _docs(*lists):
    return [np.asarray(x, np.int32) for x in lists]


def test_hand_computed_rows_without_eos():
    # 3 + 2 + 1 + 5 = 11 tokens into rows of 4: doc 1 overflows row 0, doc 3 overflows row 1.
    rows = list(packing.pack_documents(_docs([10, 11, 12], [20, 21], [30], [40, 41, 42, 43, 44]), 4))
    assert _rows_as_lists(rows) == [
        {"tokens": [10, 11, 12, 20], "segment_ids": [1, 1, 1, 2], "positions": [0, 1, 2, 0],
         "doc_index": [0, 0, 0, 1]},
        {"tokens": [21, 30, 40, 41], "segment_ids": [1, 2, 3, 3], "positions": [0, 0, 0, 1],
         "doc_index": [1, 2, 3, 3]},
        {"tokens": [42, 43, 44, PAD], "segment_ids": [1, 1, 1, 0], "positions": [0, 1, 2, 0],
         "doc_index": [3, 3, 3, -1]},
    ]
    assert all(v.dtype == np.int32 for r in rows for v in r.values())


def test_hand_computed_rows_with_eos_and_given_doc_indices():
    rows = list(packing.pack_documents(_docs([10, 11, 12], [20, 21], [30], [40, 41, 42, 43, 44]), 4,
                                       eos_id=1, doc_indices=[7, 5, 9, 2]))
    assert _rows_as_lists(rows) == [
        {"tokens": [10, 11, 12, 1], "segment_ids": [1, 1, 1, 1], "positions": [0, 1, 2, 3],
         "doc_index": [7, 7, 7, 7]},
        {"tokens": [20, 21, 1, 30], "segment_ids": [1, 1, 1, 2], "positions": [0, 1, 2, 0],
         "doc_index": [5, 5, 5, 9]},
        # doc 9's EOS overflowed: it opens row 2 as a one-token segment at position 0.
        {"tokens": [1, 40, 41, 42], "segment_ids": [1, 2, 2, 2], "positions": [0, 0, 1, 2],
         "doc_index": [9, 2, 2, 2]},
        {"tokens": [43, 44, 1, PAD], "segment_ids": [1, 1, 1, 0], "positions": [0, 1, 2, 0],
         "doc_index": [2, 2, 2, -1]},
    ]


def test_document_longer_than_several_rows_continues_row_after_row():
    rows = list(packing.pack_documents(_docs(list(range(100, 111))), 4))
    assert [r["tokens"].tolist() for r in rows] == [[100, 101, 102, 103], [104, 105, 106, 107],
                                                   [108, 109, 110, PAD]]
    assert [r["positions"].tolist() for r in rows] == [[0, 1, 2, 3]] * 2 + [[0, 1, 2, 0]]
    assert [r["segment_ids"].tolist() for r in rows] == [[1, 1, 1, 1]] * 2 + [[1, 1, 1, 0]]


def test_empty_documents_take_no_slot_and_empty_input_gives_no_rows():
    rows = list(packing.pack_documents(_docs([], [5, 6], []), 3))
    assert _rows_as_lists(rows) == [{"tokens": [5, 6, PAD], "segment_ids": [1, 1, 0], "positions": [0, 1, 0],
                                     "doc_index": [1, 1, -1]}]
    assert list(packing.pack_documents([], 8)) == []


def test_bad_input_raises():
    with pytest.raises(ValueError, match="seq_len"):
        list(packing.pack_documents(_docs([1]), 0))
    with pytest.raises(ValueError, match="1-D integer"):
        list(packing.pack_documents([np.zeros((2, 2), np.int32)], 4))
    with pytest.raises(ValueError, match="1-D integer"):
        list(packing.pack_documents([np.array([0.5, 1.5])], 4))


def _reference_token_stream(docs, seq_len, eos_id):
    """Token-by-token reference: (token, doc, segment, position) per slot, padding as (PAD, -1, 0, 0)."""
    slots, row_slot, segment, prev_doc, pos = [], 0, 0, None, 0
    for d, doc in enumerate(docs):
        for tok in list(doc) + ([eos_id] if eos_id is not None else []):
            if row_slot == 0:
                segment, prev_doc = 0, None
            if d != prev_doc:
                segment, pos, prev_doc = segment + 1, 0, d
            slots.append((int(tok), d, segment, pos))
            pos += 1
            row_slot = (row_slot + 1) % seq_len
    slots += [(PAD, -1, 0, 0)] * (-len(slots) % seq_len)
    return slots


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), max_size=25),
    seq_len=st.integers(1, 17),
    add_eos=st.booleans(),
    data=st.data(),
)
def test_packing_matches_token_by_token_reference_and_conserves_tokens(lengths, seq_len, add_eos, data):
    docs = [np.asarray(data.draw(st.lists(st.integers(4, 999), min_size=n, max_size=n)), np.int32)
            for n in lengths]
    eos_id = 1 if add_eos else None
    rows = list(packing.pack_documents(docs, seq_len, eos_id=eos_id))
    got = [(int(t), int(d), int(s), int(p)) for r in rows
           for t, d, s, p in zip(r["tokens"], r["doc_index"], r["segment_ids"], r["positions"])]
    assert got == _reference_token_stream(docs, seq_len, eos_id)
    # The property the issue names, stated directly: the multiset of tokens in equals the one out.
    tokens_in = collections.Counter(int(t) for d in docs for t in d)
    tokens_in[1] += len(docs) if add_eos else 0
    tokens_out = collections.Counter(int(t) for r in rows for t in r["tokens"][r["segment_ids"] > 0])
    assert +tokens_in == tokens_out
    # Only the last row may hold padding, and no row is all padding.
    assert all((r["segment_ids"] > 0).all() for r in rows[:-1])
    assert all((r["segment_ids"] > 0).any() for r in rows)


def _grain_source(docs):
    elements = [{"tokens": d, "doc_index": i} for i, d in enumerate(docs)]
    return grain.MapDataset.source(elements).to_iter_dataset()


def _random_docs(seed, n=40, max_len=23):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 500, size=rng.integers(0, max_len), dtype=np.int32) for _ in range(n)]


def test_grain_dataset_yields_the_rows_of_pack_documents():
    docs = _random_docs(0)
    expected = list(packing.pack_documents(docs, 7, eos_id=1))
    got = list(packing.PackedIterDataset(_grain_source(docs), 7, eos_id=1))
    assert _rows_as_lists(got) == _rows_as_lists(expected)


def test_state_restore_after_every_row_gives_the_uninterrupted_rows():
    docs = _random_docs(1)
    ds = packing.PackedIterDataset(_grain_source(docs), 5, eos_id=1)
    uninterrupted = _rows_as_lists(ds)
    it = iter(ds)
    for k in range(len(uninterrupted) + 1):
        # JSON round trip: Grain/Orbax store iterator state as JSON.
        state = json.loads(json.dumps(it.get_state()))
        resumed = iter(ds)
        resumed.set_state(state)
        assert _rows_as_lists(resumed) == uninterrupted[k:], f"resumed after {k} rows"
        if k < len(uninterrupted):
            next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_state_restore_mid_document_with_infinite_shuffled_parent():
    docs = _random_docs(2, n=9, max_len=40)
    src = grain.MapDataset.source([{"tokens": d, "doc_index": i} for i, d in enumerate(docs)])
    ds = packing.PackedIterDataset(src.shuffle(seed=3).repeat(None).to_iter_dataset(), 16, eos_id=1)
    it = iter(ds)
    for _ in range(13):
        next(it)
    state = it.get_state()
    assert state["in_document"], "this seed should leave a document split across rows (test premise)"
    expected = [next(it) for _ in range(40)]
    resumed = iter(ds)
    resumed.set_state(state)
    assert _rows_as_lists([next(resumed) for _ in range(40)]) == _rows_as_lists(expected)
