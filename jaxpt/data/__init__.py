"""The first data path: tokenizer, document preparation, packing, Grain pipelines, global batches.

Modules (import them directly; this package imports nothing so `prepare` stays free of jax):

- `jaxpt.data.documents`: the one reader of document JSON Lines and its contract (`DocumentFormatError`).
- `jaxpt.data.corpus`:    the one reader of a corpus version directory, and its mixed training stream.
- `jaxpt.data.tokenizer`: the tokenizer seam (`Tokenizer.load` picks the backend from the file), the SentencePiece
                          backend and its deterministic trainer.
- `jaxpt.data.hf_tokenizer`: the Hugging Face `tokenizers` backend (`tokenizer.json`) and its special tokens.
- `jaxpt.data.boundary`:  the document-boundary policy (BOS/EOS around each document).
- `jaxpt.data.prepare`:   `python -m jaxpt.data.prepare`: sample -> train/held-out split + tokenizer.
- `jaxpt.data.packing`:   concat-then-split packing with segment ids and positions (pure + Grain).
- `jaxpt.data.loader`:    train/eval Grain datasets and per-process slices of the global batch.
- `jaxpt.data.shards`:    logical data shards (iterator state independent of the process count).
"""
