"""jaxpt.data.corpus: mixing by weights, per-process shards, seeded order, checkpointable state."""

import collections
import dataclasses
import json
import os
import random

import numpy as np
import pytest

from data_pipelines import build, testing


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("raw"))
    testing.make_corpus(root, seed=11)
    rng = random.Random(3)
    tok = testing.train_tokenizer([testing.prose(rng, testing.EN + testing.DE, 4) for _ in range(200)],
                                  os.path.join(root, "sp"), vocab_size=512)
    with open(os.path.join(root, "b.gin"), "w") as f:
        f.write(testing.gin_config(root, tok))
    out = str(tmp_path_factory.mktemp("out"))
    build.run(build.load_config([os.path.join(root, "b.gin")], []), out)
    return out


def _all_tokens(out, domain):
    from jaxpt.data import corpus

    src = corpus.domain_source(out, domain)
    return [np.asarray(src[i]["tokens"], np.int32) for i in range(len(src))]


def _key(a):
    return a.tobytes()


class _Tok:
    pad_id, eos_id = 0, 2


def _stream(built, weights, shard=0, num_shards=1, seed=0, rows=4, seq_len=64):
    """The trainer's reader of a corpus version (the only one): logical shard ``shard`` of ``num_shards``."""
    from jaxpt.data import corpus, mixture
    schedule = None if weights is None else [(1, mixture.parse_weights(weights, "weights"))]
    return corpus.corpus_mixture_iterator(built, _Tok(), schedule, key="DataConfig.mixture_weights", seq_len=seq_len,
                                          rows=rows, seed=seed, shard=shard, num_shards=num_shards)


def _token_shares(it, batches, domains) -> dict:
    from jaxpt.data.mixture import GROUP_KEY
    counts = collections.Counter()
    for _ in range(batches):
        b = next(it)
        for gi, n in zip(*np.unique(b[GROUP_KEY], return_counts=True)):
            counts[it.groups[gi]] += int(n)
    total = sum(counts.values())
    return {d: counts[d] / total for d in domains}


@pytest.mark.parametrize("num_shards", [1, 2])
def test_every_shard_reads_each_domain_at_its_token_weight(built, num_shards):
    """The trainer's reader mixes by tokens, and each logical shard (process) reads every domain at its full
    weight: a second reader that skipped a domain whose share of a process's split was empty gave a domain of weight
    0.3 only 0.15 with two processes, and took the weights as document probabilities. It is gone; this is the
    one reader."""
    for shard in range(num_shards):
        shares = _token_shares(_stream(built, {"news": 0.7, "multilingual": 0.3}, shard, num_shards), 40,
                               ["news", "multilingual"])
        assert shares["multilingual"] == pytest.approx(0.3, abs=0.02)


def test_the_corpus_has_one_reader():
    """The document-weighted Grain reader that disagreed with the trainer's is gone (it skipped a domain whose share
    of a process's split was empty and read token weights as document probabilities)."""
    from jaxpt.data import corpus
    assert not hasattr(corpus, "corpus_dataset") and callable(corpus.corpus_mixture_iterator)


def test_shards_read_disjoint_documents_that_cover_an_epoch(built):
    from jaxpt.data import corpus
    n = len(corpus.domain_source(built, "news"))
    seen = []
    for shard in range(2):
        it = _stream(built, {"news": 1.0}, shard, 2, rows=1, seq_len=16)
        docs = set()
        while it.positions["news"] < n // 2:  # half an epoch each: the shard's share of one epoch
            docs |= set(np.unique(next(it)["doc_index"]).tolist())
        seen.append(docs - {-1})
    assert seen[0].isdisjoint(seen[1]) and len(seen[0] | seen[1]) >= n - 2  # an open document may span the end


def test_checkpoint_state_resumes_exactly(built):
    it = _stream(built, None, seed=5)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    expected = [next(it)["tokens"] for _ in range(5)]
    again = _stream(built, None, seed=5)
    again.set_state(state)
    assert all(np.array_equal(a, next(again)["tokens"]) for a in expected)
    other = _stream(built, None, seed=6)
    for _ in range(7):
        next(other)
    assert not all(np.array_equal(a, next(other)["tokens"]) for a in expected)


def test_bad_arguments(built, tmp_path):
    from jaxpt.util.errors import ConfigError
    with pytest.raises(ConfigError, match="DataConfig.mixture_weights.*nope"):
        _stream(built, {"nope": 1.0})
    with pytest.raises(ValueError, match="shard 2 not in"):
        _stream(built, None, shard=2, num_shards=2)
    with pytest.raises(FileNotFoundError, match="mixture.json"):
        _stream(str(tmp_path), None)


@pytest.mark.slow
def test_training_switches_to_the_corpus_with_a_gin_switch(built, tmp_path):
    """DataConfig.source = 'corpus' trains on the built shards and evaluates on the version's own held-out
    split (heldout/<domain>.jsonl.gz), per domain, never on another corpus's text."""
    from conftest import tiny_bindings
    from data_pipelines import writer
    from jaxpt import config as C
    from jaxpt import train
    from jaxpt.data import corpus

    tok_path = [json.load(open(os.path.join(built, "manifest.json")))["tokenizer"]["path"]]
    mix = corpus.read_mixture(built)

    def cfg_for(corpus_dir, workdir):
        return C.parse(["configs/quickstart.gin"], tiny_bindings(
            tmp_path, workdir, **{"DataConfig.source": "'corpus'", "DataConfig.corpus_dir": repr(str(corpus_dir)),
                                  "DataConfig.tokenizer_path": repr(tok_path[0]),
                                  "TrainConfig.log_batch_documents": "True", "TrainConfig.eval_every": "0",
                                  "HeldoutEvalConfig.enabled": "True", "HeldoutEvalConfig.group_by": "('domain',)",
                                  "CheckpointConfig.enabled": "True"}),
                       steps=3, mesh="data=8")

    # tiny_bindings points DataConfig.heldout_path at tmp_path/heldout.jsonl.gz, which does not exist: a corpus
    # run must not read it.
    assert not (tmp_path / "heldout.jsonl.gz").exists()
    final = train.run_training(cfg_for(built, tmp_path / "run"))
    assert final["step"] == 3 and np.isfinite(final["train_loss"])
    held = [r for f in sorted(os.listdir(os.path.join(built, "heldout")))
            for r in writer.read_jsonl_gz(os.path.join(built, "heldout", f))]
    # Each held-out document contributes its tokens plus EOS, less its first token, as targets (long documents
    # are split into windows, whose first tokens are not targets either): at most this many.
    assert 0 < final["heldout_tokens"] <= sum(r["n_tokens"] for r in held)
    assert {k.split("/")[2] for k in final if k.startswith("heldout/domain/")} == {r["domain"] for r in held}
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rec["data_version"] == json.load(open(os.path.join(built, "manifest.json")))["data_version"]
    assert sum(mix["weights"].values()) > 0

    # The standalone evaluator's default held-out source for this run is the same split, reported per domain,
    # and its figures agree with the in-loop ones (same documents, windows and scoring).
    import jaxpt
    from jaxpt.tools import evaluate
    from jaxpt.eval import card as card_lib
    card = dataclasses.replace(card_lib.load_card("configs/eval/card_v1.yaml"), safety=None)  # held-out figures only
    report = evaluate.run_card(jaxpt.restore(str(tmp_path / "run")), card, tasks={}, use_seqio=False)
    assert report["heldout"]["source"] == str(built)
    assert set(report["heldout"]["by_domain"]) == {r["domain"] for r in held}
    for d, fig in report["heldout"]["by_domain"].items():
        assert fig["loss"] == pytest.approx(final[f"heldout/domain/{d}/loss"], rel=1e-4)

    # A corpus version without a held-out split is refused before anything compiles, naming the key.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "mixture.json").write_text(json.dumps(mix))
    with pytest.raises(C.ConfigError, match="DataConfig.corpus_dir.*no held-out split"):
        train.run_training(cfg_for(bare, tmp_path / "run_bare"))


def test_domain_source_reads_the_tfds_split_in_its_order_without_tfds(built):
    """The core reader (no TFDS) gives the records TFDS's own data source gives, index for index."""
    tfds = pytest.importorskip("tensorflow_datasets")  # the `data` extra, as the reference
    from jaxpt.data import corpus

    for domain in ("news", "multilingual"):
        ours = corpus.domain_source(built, domain)
        theirs = tfds.builder_from_directory(corpus.read_corpus_version(built).tfds_dir()).as_data_source(
            split=domain)
        assert len(ours) == len(theirs) > 0
        for i in range(len(ours)):
            np.testing.assert_array_equal(ours[i]["tokens"], np.asarray(theirs[i]["tokens"], np.int32))
            assert ours[i]["id"] == theirs[i]["id"].decode()


def test_a_mixture_experiment_reads_a_corpus_versions_domains_and_records_it_with_an_older_manifest(built, tmp_path):
    """A mixture experiment on a corpus version: its natural mixture is the manifest's tokens_by_domain, and the
    version goes into the conclusions database before any proxy trains, even from a manifest written before the
    build wrote strict JSON (an unset quality threshold as -Infinity)."""
    import shutil
    from jaxpt import config as C
    from jaxpt.lab import conclusions, mixtures

    corpus_dir = tmp_path / "v"
    shutil.copytree(built, corpus_dir)
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    manifest.setdefault("stages", {}).setdefault("quality", {})["thresholds_per_source"] = {"t": float("-inf")}
    (corpus_dir / "manifest.json").write_text(json.dumps(manifest))  # Python's default: -Infinity
    assert "-Infinity" in (corpus_dir / "manifest.json").read_text()
    cfg = C.TrainConfig(data=C.DataConfig(source="corpus", corpus_dir=str(corpus_dir)))
    assert mixtures.domain_tokens(cfg) == {k: int(v) for k, v in manifest["tokens_by_domain"].items()}
    with conclusions.ConclusionsDB(str(tmp_path / "team.sqlite")) as db:
        ident = conclusions.record_data_version(db, cfg)
        kind, row = db.resolve(ident)
    assert ident == manifest["data_version"] and kind == "data_version"
    assert row["path"] == str(corpus_dir)
    assert row["details"]["manifest"]["stages"]["quality"]["thresholds_per_source"] == {"t": "-inf"}
    assert row["details"]["manifest"]["tokens_by_domain"] == manifest["tokens_by_domain"]
