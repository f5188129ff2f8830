"""Offline corpus build and tokenizer training (Apache Beam, SentencePiece); may import jaxpt, never the reverse."""
