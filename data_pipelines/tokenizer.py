"""`python -m data_pipelines.tokenizer`: the corpus tokenizer.

    python -m data_pipelines.tokenizer --config configs/data/tokenizer.gin --corpus DIR --output TOKDIR

The report that sizes its vocabulary is `data_pipelines.vocab_report` (``python -m data_pipelines.vocab_report``;
``python -m data_pipelines.tokenizer report ...`` runs it too).

`--corpus` is either a corpus version built by `python -m data_pipelines.build` (``mixture.json``
lists its ArrayRecord shards of ``tf.train.Example`` records with ``id``, ``domain``, ``lang`` and
``text``; see `data_pipelines.writer`; read by `jaxpt.data.corpus.read_corpus_version`) or a prepared sample
from `python -m jaxpt.data.prepare` (``train.jsonl.gz`` and ``heldout.jsonl.gz``). Document files (a prepared
sample, a version's held-out split) are read by `jaxpt.data.documents` and need a ``domain`` on every record;
a line that breaks that contract stops the run with ``DocumentFormatError`` naming file and line (exit 2).

Held-out text. The tokenizer never sees it; the report measures on it. In a corpus version it is the
version's own held-out split (``heldout/*.jsonl.gz``, the documents the build kept out of training); a
version built without one is split here by `jaxpt.data.prepare.is_heldout` (a hash of its id alone,
share `TokenizerConfig.heldout_fraction`). In a prepared sample it is ``heldout.jsonl.gz``.

Training sample (`balanced_sample`). `TokenizerConfig.sample_chars` characters of training text,
shared between domains by `TokenizerConfig.domain_weights` (equal when empty). A domain with less
text than its share gives all it has and the rest is shared again among the others by weight
(water filling), so the sample is as balanced as the corpus allows. Inside a domain documents are
taken in the order of sha256(f"{seed}:{id}"), each cut to `max_doc_chars`, the last one cut to
fill the share exactly. The sample depends on the corpus, the config and the seed only.

Training writes ``TOKDIR/tokenizer.model`` (`jaxpt.data.tokenizer.train`: BPE by default, byte
fallback, digits split, whitespace exact, no dummy prefix, PAD=0 EOS=1 UNK=2 BOS=3) and then
``TOKDIR/tokenizer.json``: the operative settings, the model's own settings, the corpus it came
from (a corpus version's data version and content id from its manifest; for a prepared sample the
sha256 of its two files), the documents read (records without text, from a corpus built with
``OutputConfig.store_text = False``, are counted and skipped), the sample's composition per domain and per
language, held-out bytes per token, and the model's sha256 (the identity that the corpus manifest
and every run's ``run.json`` record).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from jaxpt.util.errors import ConfigError  # the one base (exit 2); re-exported as data_pipelines.tokenizer.ConfigError

from data_pipelines import vocab_report
from data_pipelines.tokenizer_training import (  # noqa: F401 (the library's names, read as data_pipelines.tokenizer.X)
    CODE_DOMAIN, DEFAULT_CONFIG, FORMAT_VERSION, NO_LANG, REPO_ROOT, Corpus, Document, TokenizerConfig,
    balanced_sample, common_flags, load_config, measure, read_corpus, slice_names, train_tokenizer, water_fill,
    write_json)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (module docstring). Returns the exit status: 0, or 2 with the error on stderr.

    ``report ...`` runs `data_pipelines.vocab_report` (the vocabulary-size report has its own module)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return vocab_report.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m data_pipelines.tokenizer",
        description="Train the corpus tokenizer (the vocabulary-size report: python -m data_pipelines.vocab_report).")
    common_flags(parser, config_required=True)
    parser.add_argument("--output", required=True, help="TOKDIR for tokenizer.model/.json (local or gs://)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        cfg = load_config(args.config or [DEFAULT_CONFIG], args.gin)
        record = train_tokenizer(cfg, args.corpus, args.output)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    h = record["heldout"]["all"]
    print(f"{args.output}/tokenizer.model: {record['tokenizer']['vocab_size']} pieces, sha256 "
          f"{record['tokenizer']['sha256'][:12]}, sample {record['sample']['chars']:,} characters, held-out "
          f"{h['bytes_per_token']:.3f} bytes/token; {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
