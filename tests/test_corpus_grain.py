"""jaxpt.data.corpus: mixing by weights, per-process shards, seeded order, checkpointable state."""

import collections
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


def test_mixture_follows_weights(built):
    from jaxpt.data import corpus

    domains = {d: {_key(t) for t in _all_tokens(built, d)} for d in ("news", "multilingual")}
    ds = corpus.corpus_dataset(built, seed=0, weights={"news": 0.75, "multilingual": 0.25})
    it = iter(ds)
    counts = collections.Counter()
    for _ in range(2000):
        t = next(it)
        assert t.dtype == np.int32
        counts["news" if _key(t) in domains["news"] else "multilingual"] += 1
    assert counts["news"] / 2000 == pytest.approx(0.75, abs=0.03)


def test_process_shards_are_disjoint_and_cover(built):
    from jaxpt.data import corpus

    full = {_key(t) for t in _all_tokens(built, "news")}
    seen = []
    for pi in range(2):
        it = iter(corpus.corpus_dataset(built, seed=1, process_index=pi, process_count=2, weights={"news": 1.0}))
        seen.append({_key(next(it)) for _ in range(400)})  # many epochs of each half
    assert seen[0].isdisjoint(seen[1])
    assert seen[0] | seen[1] == full


def test_checkpoint_state_resumes_exactly(built):
    from jaxpt.data import corpus

    ds = corpus.corpus_dataset(built, seed=5)
    it = iter(ds)
    for _ in range(37):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(20)]
    it2 = iter(corpus.corpus_dataset(built, seed=5))
    it2.set_state(state)
    got = [next(it2) for _ in range(20)]
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    other = iter(corpus.corpus_dataset(built, seed=6))
    assert not all(np.array_equal(next(other), e) for e in expected[:10])


def test_bad_arguments(built, tmp_path):
    from jaxpt.data import corpus

    with pytest.raises(ValueError, match="not in"):
        corpus.corpus_dataset(built, seed=0, weights={"nope": 1.0})
    with pytest.raises(ValueError, match="process_index"):
        corpus.corpus_dataset(built, seed=0, process_index=2, process_count=2)
    with pytest.raises(FileNotFoundError, match="mixture.json"):
        corpus.corpus_dataset(str(tmp_path), seed=0)


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
    report = evaluate.run_card(jaxpt.restore(str(tmp_path / "run")), card_lib.load_card("configs/eval/card_v1.yaml"),
                               tasks={}, use_seqio=False)
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
