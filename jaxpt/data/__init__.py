"""The first data path: tokenizer, document preparation, packing, Grain pipelines, global batches.

Modules (import them directly; this package imports nothing so `prepare` stays free of jax):

- `jaxpt.data.tokenizer`: SentencePiece wrapper and deterministic trainer.
- `jaxpt.data.prepare`:   `python -m jaxpt.data.prepare`: sample -> train/held-out split + tokenizer.
- `jaxpt.data.packing`:   concat-then-split packing with segment ids and positions (pure + Grain).
- `jaxpt.data.loader`:  train/eval Grain datasets and per-process slices of the global batch.
"""
