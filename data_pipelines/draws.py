"""Seeded, order-free draws from a document id (quota ranks, shard and decision-log placement, review samples)."""

from __future__ import annotations

import hashlib


def uniform(seed: int, doc_id: str) -> float:
    """Deterministic U[0, 1) draw from (seed, id): the first 8 bytes of sha256, over 2**64."""
    h = hashlib.sha256(f"{seed}\x00{doc_id}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64
