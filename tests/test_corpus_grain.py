"""jaxpt.data.corpus: mixing by weights, per-process shards, seeded order, checkpointable state."""

import collections
import json
import os
import random

import numpy as np
import pytest

from data_pipelines import build, testing
from jaxpt import config as C  # noqa: F401  (registers jaxpt's gin configurables before a build locks gin)
from jaxpt import train  # noqa: F401


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


def test_training_switches_to_the_corpus_with_a_gin_switch(built, tmp_path):
    """DataConfig.source = 'corpus' trains on the built shards: every packed token comes from the corpus."""
    from conftest import tiny_bindings
    from jaxpt import config as C
    from jaxpt import train
    from jaxpt.data import corpus

    tok_path = [json.load(open(os.path.join(built, "manifest.json")))["tokenizer"]["path"]]
    mix = corpus.read_mixture(built)
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(
        tmp_path, tmp_path / "run", **{"DataConfig.source": "'corpus'", "DataConfig.corpus_dir": repr(built),
                                       "DataConfig.tokenizer_path": repr(tok_path[0]),
                                       "TrainConfig.log_batch_documents": "True",
                                       "TrainConfig.eval_every": "0"}), steps=3, mesh="data=8")
    # Held-out text: the corpus has none in JSON Lines form here; point the held-out loss at a tiny file.
    import gzip
    heldout = tmp_path / "heldout.jsonl.gz"
    with gzip.open(heldout, "wt") as f:
        f.write(json.dumps({"id": "h1", "text": "a held-out sentence for the loss", "domain": "web"}) + "\n")
    import dataclasses
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, heldout_path=str(heldout)))
    final = train.run_training(cfg)
    assert final["step"] == 3 and np.isfinite(final["train_loss"])
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rec["data_version"] == json.load(open(os.path.join(built, "manifest.json")))["data_version"]
    assert sum(mix["weights"].values()) > 0
