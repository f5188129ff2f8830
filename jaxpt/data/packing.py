"""Concat-then-split packing of tokenized documents into fixed-length rows.

Documents are laid end to end into rows of `seq_len` tokens. When a document does not fit in what
is left of a row, the row is filled with its head and the rest continues at the start of the next
row. No token is ever dropped; only the last row of a finite stream is padded.

Every row is a dict of int32 numpy arrays of shape [seq_len]:

- `tokens`:      token ids; `pad_id` in padding slots.
- `segment_ids`: 1, 2, 3, ... for the document pieces in the row, in order; 0 marks padding.
                 Attention must not cross segment ids (and never attends to segment 0).
- `positions`:   0, 1, 2, ... restarting at every segment. A document that overflows into the next
                 row starts there as a new segment at position 0 again, not at its offset in the
                 document. Its attention cannot reach the previous row anyway, so the continuation
                 is a fresh context either way; with RoPE only position differences matter, so
                 the choice changes nothing inside a segment.
- `doc_index`:   index of the source document each token came from (the order of the input
                 stream, or the `doc_index` the caller gives); -1 for padding.

For next-token training a position i has a target iff `segment_ids[i + 1] == segment_ids[i] != 0`
(target `tokens[i + 1]`); the last token of each segment piece has none. With `eos_id` set, every
document ends with EOS, so the model learns where documents stop; with `bos_id` set, every document starts
with BOS (never a target: it is its segment's first token). Which of the two a run puts there is its
document-boundary policy (`DataConfig.document_boundary`, :mod:`jaxpt.data.boundary`).

`pack_documents` is the plain generator; `PackedIterDataset` is the same packing as a Grain
`IterDataset` whose iterator has exact `get_state`/`set_state` for checkpointing.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import grain
import numpy as np

from jaxpt.data.boundary import Boundary

ROW_KEYS = ("tokens", "segment_ids", "positions", "doc_index")


class _RowPacker:
    """Fills rows from one document at a time; holds the current document and the offset into it."""

    def __init__(self, seq_len: int, *, pad_id: int = 0, eos_id: int | None = None, bos_id: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.boundary = Boundary(bos_id=bos_id, eos_id=eos_id)
        self.doc: np.ndarray | None = None  # the current document's tokens (BOS/EOS around them)
        self.doc_index = -1
        self.offset = 0  # tokens of `doc` already emitted

    def start(self, tokens: np.ndarray, doc_index: int, offset: int = 0) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"document {doc_index}: tokens must be a 1-D integer array, got "
                             f"shape {tokens.shape} dtype {tokens.dtype}")
        self.doc, self.doc_index, self.offset = self.boundary.wrap(tokens), int(doc_index), offset

    def fill(self, next_doc) -> dict[str, np.ndarray] | None:
        """Builds one row, calling `next_doc()` -> (tokens, doc_index) or None (end) for more input.

        Returns None when the input is exhausted and nothing is pending (no empty row is emitted).
        """
        row = {
            "tokens": np.full(self.seq_len, self.pad_id, np.int32),
            "segment_ids": np.zeros(self.seq_len, np.int32),
            "positions": np.zeros(self.seq_len, np.int32),
            "doc_index": np.full(self.seq_len, -1, np.int32),
        }
        filled = segment = 0
        while filled < self.seq_len:
            if self.doc is None:
                nxt = next_doc()
                if nxt is None:
                    break
                self.start(*nxt)
                if self.doc.size == 0:  # empty document without BOS/EOS: contributes nothing
                    self.doc = None
                    continue
            n = min(self.doc.size - self.offset, self.seq_len - filled)
            segment += 1
            span = slice(filled, filled + n)
            row["tokens"][span] = self.doc[self.offset:self.offset + n]
            row["segment_ids"][span] = segment
            row["positions"][span] = np.arange(n, dtype=np.int32)
            row["doc_index"][span] = self.doc_index
            filled += n
            self.offset += n
            if self.offset == self.doc.size:
                self.doc = None
        return row if filled else None


def pack_documents(
    docs: Iterable[np.ndarray],
    seq_len: int,
    *,
    pad_id: int = 0,
    eos_id: int | None = None,
    doc_indices: Iterable[int] | None = None,
    bos_id: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Packs documents into rows (see the module docstring for the row layout).

    Args:
      docs: token arrays, each 1-D integer of shape [num_tokens] (may be empty).
      seq_len: row length in tokens.
      pad_id: token id written into padding slots.
      eos_id: if not None, appended to every document.
      doc_indices: the `doc_index` of each document; default 0, 1, 2, ... in input order.
      bos_id: if not None, put before every document.

    Yields:
      dicts of int32 arrays of shape [seq_len] with keys `tokens`, `segment_ids`, `positions`,
      `doc_index`. The last row is padded; no row is all padding.

    Raises:
      ValueError: seq_len < 1, or a document that is not a 1-D integer array.
    """
    packer = _RowPacker(seq_len, pad_id=pad_id, eos_id=eos_id, bos_id=bos_id)
    indexed = zip(doc_indices, docs) if doc_indices is not None else enumerate(docs)
    it = iter(indexed)

    def next_doc():
        nxt = next(it, None)
        return None if nxt is None else (nxt[1], nxt[0])

    while (row := packer.fill(next_doc)) is not None:
        yield row


class PackedIterDataset(grain.IterDataset):
    """Grain `IterDataset` packing a stream of documents into rows (module docstring has the layout).

    The parent yields mappings with `tokens` (1-D int array, [num_tokens]) and `doc_index` (int).
    The output yields the row dicts of `pack_documents`. Finite parents give a padded last row.
    """

    def __init__(self, parent: grain.IterDataset, seq_len: int, *, pad_id: int = 0,
                 eos_id: int | None = None, bos_id: int | None = None):
        super().__init__(parent)
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self._seq_len, self._pad_id, self._eos_id, self._bos_id = seq_len, pad_id, eos_id, bos_id

    def __iter__(self) -> "PackedDatasetIterator":
        return PackedDatasetIterator(self._parent.__iter__(), self._seq_len, pad_id=self._pad_id,
                                     eos_id=self._eos_id, bos_id=self._bos_id)

    def __str__(self) -> str:
        return f"PackedIterDataset(seq_len={self._seq_len}, bos_id={self._bos_id}, eos_id={self._eos_id})"


class PackedDatasetIterator(grain.DatasetIterator):
    """Iterator of `PackedIterDataset` with exact checkpointing.

    State: the parent's state from *before* it yielded the document being split across rows, plus
    how many of that document's tokens were already emitted. `set_state` restores the parent, reads
    that document again and resumes at the offset, so a restored iterator yields exactly the rows
    the original would have (given a deterministic parent, which every Grain MapDataset-backed
    pipeline is).
    """

    def __init__(self, parent: grain.DatasetIterator, seq_len: int, *, pad_id: int = 0,
                 eos_id: int | None = None, bos_id: int | None = None):
        super().__init__(parent)
        self._packer = _RowPacker(seq_len, pad_id=pad_id, eos_id=eos_id, bos_id=bos_id)
        self._state_before_doc: Any = None

    def _next_doc(self) -> tuple[np.ndarray, int] | None:
        state = self._parent.get_state()
        try:
            element = next(self._parent)
        except StopIteration:
            return None
        self._state_before_doc = state
        return _unpack_element(element)

    def __next__(self) -> dict[str, np.ndarray]:
        row = self._packer.fill(self._next_doc)
        if row is None:
            raise StopIteration
        return row

    def get_state(self) -> dict[str, Any]:
        if self._packer.doc is None:
            return {"parent": self._parent.get_state(), "in_document": False, "offset": 0}
        return {"parent": self._state_before_doc, "in_document": True, "offset": self._packer.offset}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._packer.doc = None
        if state["in_document"]:
            try:
                element = next(self._parent)
            except StopIteration as e:
                raise ValueError(f"cannot restore {self}: the parent has no document at the saved state "
                                 f"{state['parent']}") from e
            self._state_before_doc = state["parent"]
            tokens, doc_index = _unpack_element(element)
            self._packer.start(tokens, doc_index, offset=int(state["offset"]))

    def __str__(self) -> str:
        return f"PackedDatasetIterator(seq_len={self._packer.seq_len})"


def _unpack_element(element: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    try:
        return element["tokens"], int(element["doc_index"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"packing expects elements {{'tokens': int array, 'doc_index': int}}, got "
                         f"{type(element).__name__} {list(element) if isinstance(element, Mapping) else ''}"
                         ) from e
