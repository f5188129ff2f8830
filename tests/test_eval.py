"""jaxpt.eval units, each against an independent value: rolling windows cover every token once; a hand-built
bigram model gives hand-computed log-likelihoods and task scores; packing and batch size do not change scores;
batched greedy decoding equals ``jaxpt.inference.generate_ids``; 13-gram decontamination on hand examples;
card hashing refuses a changed card until its version is bumped; Cohen's kappa by hand; the regression report
flags exactly the drops beyond tolerance."""

from __future__ import annotations

import copy
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT
from jaxpt import mesh as mesh_lib
from jaxpt.eval import card as card_lib
from jaxpt.eval import decontam, probes, regression, review
from jaxpt.eval.scorer import Scorer, Window, rolling_windows
from jaxpt.model import Decoder, ModelConfig

CARD = REPO_ROOT / "configs" / "eval" / "card_v1.yaml"


def one_device_mesh():
    return mesh_lib.make_mesh("data=1", devices=jax.devices()[:1])


# ------------------------------------------------------------------------------------------ windows


@pytest.mark.parametrize("L,stride,start", [(8, 1, 1), (8, 4, 1), (8, 7, 1), (8, 4, 5), (8, 3, 12), (2, 1, 1)])
def test_rolling_windows_score_every_token_once_with_enough_context(L, stride, start):
    for n in range(1, 40):
        ws = rolling_windows(np.arange(n), L, stride, start=start)
        scored = [int(t) for w in ws for t in w.tokens[w.first:]]
        assert scored == list(range(start, n)), (n, scored)
        for w in ws:
            assert 1 <= len(w.tokens) <= L and list(w.tokens) == list(range(w.tokens[0], w.tokens[0] + len(w.tokens)))
            for j in range(w.first, len(w.tokens)):  # local context j >= min(global index, L - stride)
                assert j >= min(int(w.tokens[j]), L - stride)


# ------------------------------------------------------------------------------------------ hand-built model


class CharTokenizer:
    """'a'..'d' -> ids 4..7; pad 0, eos 1 (no word-boundary marks: encoding joins trivially)."""

    pad_id, eos_id, vocab_size = 0, 1, 8

    def encode(self, text):
        return np.array([4 + "abcd".index(c) for c in text], np.int32)

    def decode(self, ids):
        return "".join("abcd"[i - 4] if i >= 4 else "" for i in np.asarray(ids).reshape(-1))


#: Next-token probabilities by previous token (rows sum to 1); rows a (4) and c (6) and specials are uniform.
P = np.full((8, 8), 1 / 8)
P[5] = [0.05, 0.05, 0.05, 0.05, 0.1, 0.1, 0.2, 0.4]    # after b: a .1, b .1, c .2, d .4
P[7] = [0.05, 0.05, 0.05, 0.05, 0.25, 0.25, 0.05, 0.25]  # after d: a .25, b .25, c .05, d .25


def bigram_model(P: np.ndarray) -> Decoder:
    """A Decoder whose next-token distribution is P[previous token]: one-hot embeddings, blocks whose output
    projections are zero (the residual passes through), final RMSNorm, output = log P / norm gain."""
    V = P.shape[0]
    cfg = ModelConfig(vocab_size=V, d_model=V, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=V, mlp_dim=8,
                      max_seq_len=16)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    model.embedding.value = np.eye(V, dtype=np.float32)
    for block in model.blocks:
        block.attn.wo.value = np.zeros_like(block.attn.wo.value)
        block.mlp.w_down.value = np.zeros_like(block.mlp.w_down.value)
    gain = 1.0 / math.sqrt(1.0 / V + cfg.norm_eps)  # RMSNorm of a one-hot row
    model.output.value = (np.log(P) / gain).astype(np.float32)  # [D, V]: logits after token i = log P[i]
    return model


def test_task_scoring_matches_a_hand_computed_example():
    """A cloze task on the bigram model: choice log-likelihoods and both accuracies computed by hand.

    Example 1, context "ab", label 1 ("dd"):
      "c":  log P[b,c] = log .2 = -1.609 (per char -1.609)   <- best by sum (wrong)
      "dd": log P[b,d] + log P[d,d] = log .4 + log .25 = log .1 = -2.303 (per char -1.151)   <- best per char
      "a":  log P[b,a] = log .1 = -2.303 (per char -2.303)
    Example 2, context "bd", label 0 ("a"): log P[d,a] = log .25 > log P[d,c] = log .05: right either way.
    So accuracy = 1/2 and accuracy_norm = 2/2.
    """
    tok = CharTokenizer()
    scorer = Scorer.from_model(bigram_model(P), one_device_mesh(), mesh_lib.DEFAULT_RULES, seq_len=16, batch_size=2)
    spec = probes.TaskSpec("toy", "cloze", "x", 10, {"context": "{context}", "choice": "{choice}"}, 0.4, "accuracy")
    examples = [{"id": "1", "contexts": ["ab"] * 3, "continuations": ["c", "dd", "a"], "label": 1},
                {"id": "2", "contexts": ["bd"] * 2, "continuations": ["a", "c"], "label": 0}]
    te = probes.TaskExamples(spec, examples, {}, {})
    scores = probes.score_choice_rows(scorer, tok, probes.choice_rows(examples))
    np.testing.assert_allclose(scores, np.log([0.2, 0.1, 0.1, 0.25, 0.05]), rtol=1e-5)
    assert probes.evaluate_task(scorer, tok, te) == {"accuracy": 0.5, "accuracy_norm": 1.0, "num_examples": 2.0}
    assert te.chance == pytest.approx((1 / 3 + 1 / 2) / 2)


def test_empty_context_is_scored_after_eos():
    """An empty context becomes [EOS]: log p("b") = log P[eos, b] = log 1/8."""
    tok = CharTokenizer()
    scorer = Scorer.from_model(bigram_model(P), one_device_mesh(), mesh_lib.DEFAULT_RULES, seq_len=16, batch_size=1)
    ctx, cont = probes.encode_pair(tok, "", "bd")
    assert len(ctx) == 0
    (lp, greedy), = scorer.loglikelihood([(probes.with_prefix(tok, ctx), cont)])
    assert lp == pytest.approx(math.log(1 / 8) + math.log(0.4), rel=1e-5)
    assert greedy is False  # after eos every token ties; argmax picks id 0, not b


# ------------------------------------------------------------------------------------------ invariance


@pytest.fixture(scope="module")
def random_model():
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      mlp_dim=64, max_seq_len=24)
    return Decoder(cfg, rngs=nnx.Rngs(3))


def test_scores_do_not_depend_on_packing_or_batch_size(random_model):
    """Window scores equal, for every layout, the model run directly on each window's tokens (no padding,
    no packing, no scorer)."""
    rng = np.random.default_rng(0)
    lengths = rng.choice([3, 11, 24], size=30)  # few distinct lengths: one reference compile each
    windows = [Window(rng.integers(4, 64, size=int(n)).astype(np.int32), int(rng.integers(1, n))) for n in lengths]
    forward = jax.jit(lambda t: random_model(t, jnp.ones_like(t), jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)))
    ref = []
    for w in windows:
        lp = jax.nn.log_softmax(np.asarray(forward(w.tokens[None])[0], np.float64))
        ref.append(sum(lp[j - 1, w.tokens[j]] for j in range(w.first, len(w.tokens))))
    for bs in (1, 3, 8):
        scorer = Scorer.from_model(random_model, one_device_mesh(), mesh_lib.DEFAULT_RULES, seq_len=24, batch_size=bs)
        for pack in (True, False):
            got = scorer.score(windows, pack=pack)
            np.testing.assert_allclose(got.logp, ref, rtol=2e-6, err_msg=f"batch {bs} pack {pack}")
            assert list(got.count) == [w.num_scored for w in windows]
        assert len(scorer.layout(windows, pack=True)) < len(windows)  # packing really shared rows


def test_batched_greedy_equals_generate_ids(random_model):
    """Scorer.greedy (fixed [B, L] rows, several prompts per call) picks the tokens of
    jaxpt.inference.generate_ids (one prompt, its own window)."""
    from jaxpt.inference import generate_ids
    scorer = Scorer.from_model(random_model, one_device_mesh(), mesh_lib.DEFAULT_RULES, seq_len=24, batch_size=2)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(4, 64, size=n)) for n in (1, 12, 5)]
    got = scorer.greedy(prompts, 8)
    assert got == [generate_ids(random_model, p, 8) for p in prompts]


# ------------------------------------------------------------------------------------------ decontamination


def test_decontamination_by_13_grams():
    train = ["The quick brown fox jumps over the lazy dog while seven sleepy cats watch from the old fence.",
             "alpha beta gamma delta epsilon zeta eta",
             "theta iota kappa lambda mu nu",
             "天下难事必作于易天下大事必作于细是以圣人终不为大"]
    index = decontam.NgramIndex(train)
    examples = [
        "quick brown fox jumps over the lazy dog while seven sleepy cats watch",  # 13 shared words
        "QUICK, brown fox -- jumps over the lazy dog; while seven sleepy CATS!",  # same words: case/punct ignored
        "quick brown fox jumps over the lazy dog while seven sleepy cats purr",   # only 12 shared in a row
        "fox jumps over the lazy dog while seven",                                # 8 words, occurs: whole sequence
        "fox jumps over the lazy cat while seven",                                # 8 words, does not occur
        "one two three four",                                                     # too short to check
        "epsilon zeta eta theta iota kappa lambda mu",                            # spans two documents: clean
        "他说天下难事必作于易天下大事必作于细",                                           # 13 CJK characters shared
    ]
    res = decontam.decontaminate(examples, index, n=13, min_words=8)
    assert res.reason == ["contaminated", "contaminated", "", "contaminated", "", "too_short", "", "contaminated"]
    assert res.counts() == {"kept": 3, "too_short": 1, "contaminated": 4}


# ------------------------------------------------------------------------------------------ cards


def copy_card(tmp_path):
    shutil.copy(CARD, tmp_path / "card.yaml")
    shutil.copy(CARD.parent / "spot_check_v1.jsonl", tmp_path / "spot_check_v1.jsonl")
    return tmp_path / "card.yaml"


def test_shipped_card_loads_with_enough_spot_check_prompts():
    card = card_lib.load_card(str(CARD))
    assert card.version >= 1 and card.content_sha256 == card_lib.content_hash(card.raw)
    with open(card.spot_check.prompts_path) as f:
        prompts = [json.loads(line) for line in f]
    assert len(prompts) >= 200 and len({p["id"] for p in prompts}) == len(prompts)
    kinds = {t.kind for t in card.tasks}
    assert {"cloze", "next_line", "langid"} <= kinds
    for t in card.tasks:
        assert t.chance == pytest.approx(0.0 if t.kind == "next_line_greedy" else
                                         1 / len(t.params["languages"]) if t.kind == "langid" else 0.25)


def test_changed_card_is_refused_until_its_version_is_bumped(tmp_path):
    path = copy_card(tmp_path)
    v = card_lib.load_card(str(path)).version
    text = path.read_text()
    path.write_text(text.replace("threshold: 0.35", "threshold: 0.30", 1))
    with pytest.raises(card_lib.CardError, match=f"content changed since version {v}.*card-stamp"):
        card_lib.load_card(str(path))
    from jaxpt.tools import evaluate
    assert evaluate.main(["--workdir", str(tmp_path), "--card", str(path)]) == 2  # refused before any restore
    assert evaluate.main(["card-stamp", str(path)]) == 0
    card = card_lib.load_card(str(path))
    assert card.version == v + 1 and card.tasks[0].threshold == 0.30
    assert "# jaxpt evaluation card." in path.read_text()  # comments survive stamping
    with pytest.raises(card_lib.CardError, match="unchanged"):
        card_lib.stamp_card(str(path))
    # A spot-check prompt edited behind the card's back is refused too.
    sc = tmp_path / "spot_check_v1.jsonl"
    sc.write_text(sc.read_text().replace('"prompt": "', '"prompt": "X', 1))
    with pytest.raises(card_lib.CardError, match="spot-check set changed"):
        card_lib.load_card(str(path))


# ------------------------------------------------------------------------------------------ agreement


def test_cohen_kappa_by_hand(tmp_path):
    """20 yes/yes, 5 yes/no, 10 no/yes, 15 no/no: p_o = 35/50 = .7; p_e = .5 x .6 + .5 x .4 = .5;
    kappa = (.7 - .5) / (1 - .5) = .4."""
    pairs = [("good", "good")] * 20 + [("good", "bad")] * 5 + [("bad", "good")] * 10 + [("bad", "bad")] * 15
    k = review.cohen_kappa([a for a, _ in pairs], [b for _, b in pairs])
    assert k["observed"] == pytest.approx(0.7) and k["expected"] == pytest.approx(0.5)
    assert k["kappa"] == pytest.approx(0.4)
    sheet = tmp_path / "sheet.jsonl"
    with open(sheet, "w") as f:
        for i, (a, b) in enumerate(pairs + [("good", None)]):
            adj = "good" if a != b and b is not None and i % 3 else None
            f.write(json.dumps({"id": i, "labels": ["good", "acceptable", "bad"], "annotator_1": a,
                                "annotator_2": b, "adjudicator": adj}) + "\n")
    out = review.agreement(review.read_sheet(str(sheet)))
    assert out["kappa"] == pytest.approx(0.4) and out["n"] == 50 and out["items"] == 51
    assert out["unlabeled"] == {"annotator_1": 0, "annotator_2": 1}
    n_adj = sum(1 for i in range(20, 35) if i % 3)
    assert (out["disagreements"], out["adjudicated"], out["unresolved"]) == (15, n_adj, 15 - n_adj)
    from jaxpt.tools import evaluate
    assert evaluate.main(["agreement", str(sheet)]) == 0
    with open(sheet, "a") as f:
        f.write(json.dumps({"id": "x", "labels": ["good", "bad"], "annotator_1": "meh", "annotator_2": "good"}) + "\n")
    with pytest.raises(ValueError, match="'meh' is not one of"):
        review.agreement(review.read_sheet(str(sheet)))


# ------------------------------------------------------------------------------------------ regression


def fake_report(version=1, digest="h1"):
    return {"card": {"name": "c", "version": version, "content_sha256": digest},
            "checkpoint": {"step": 1},
            "tasks": {"core_task": {"primary_metric": "accuracy", "metrics": {"accuracy": 0.60}, "core": True,
                                    "regression_tolerance": 0.05, "examples_sha256": "e"},
                      "side_task": {"primary_metric": "exact_match", "metrics": {"exact_match": 0.50},
                                    "core": False, "regression_tolerance": 0.05, "examples_sha256": "f"}},
            "heldout": {"overall": {"tokens": 100}, "core_grouping": "domain", "regression_tolerance": 0.05,
                        "by_domain": {"code": {"perplexity": 10.0}, "web": {"perplexity": 20.0}}}}


def test_regression_flags_only_core_drops_beyond_tolerance(tmp_path):
    base = fake_report()
    assert regression.compare(base, copy.deepcopy(base))["ok"]

    def changed(acc=0.60, side=0.50, code=10.0):
        r = copy.deepcopy(base)
        r["tasks"]["core_task"]["metrics"]["accuracy"] = acc
        r["tasks"]["side_task"]["metrics"]["exact_match"] = side
        r["heldout"]["by_domain"]["code"]["perplexity"] = code
        return regression.compare(base, r)

    assert changed(acc=0.56)["ok"] and changed(code=10.4)["ok"] and changed(side=0.0)["ok"]
    res = changed(acc=0.54)
    assert not res["ok"] and [r["name"] for r in res["flagged"]] == ["core_task"]
    assert [r["name"] for r in changed(code=10.6)["flagged"]] == ["domain=code"]
    with pytest.raises(regression.IncompatibleReports, match="version"):
        regression.compare(base, fake_report(version=2))
    with pytest.raises(regression.IncompatibleReports, match="without a version bump"):
        regression.compare(base, fake_report(digest="h2"))
    from jaxpt.tools import evaluate
    paths = {}
    for name, r in {"base": base, "same": copy.deepcopy(base), "other": fake_report(version=2)}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(r))
    bad = copy.deepcopy(base)
    bad["tasks"]["core_task"]["metrics"]["accuracy"] = 0.5
    paths["bad"] = tmp_path / "bad.json"
    paths["bad"].write_text(json.dumps(bad))
    assert evaluate.main(["compare", str(paths["base"]), str(paths["same"])]) == 0
    assert evaluate.main(["compare", str(paths["base"]), str(paths["bad"])]) == 1
    assert evaluate.main(["compare", str(paths["base"]), str(paths["other"])]) == 2


@pytest.mark.slow
def test_training_texts_from_corpus_shards(tmp_path):
    """A corpus version without JSON Lines: the decontamination reference is read from its ArrayRecord shards
    (serialized tf.train.Example with a ``text`` feature, as data_pipelines writes them)."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from tensorflow.core.example import example_pb2
    from jaxpt.eval import heldout
    shard = tmp_path / "tfds" / "corpus" / "1.0.0" / "corpus-code.array_record-00000-of-00001"
    shard.parent.mkdir(parents=True)
    w = ArrayRecordWriter(str(shard), "group_size:1")
    for text in ("def f():\n    return 1\n", "Zwölf Boxkämpfer jagen Viktor"):
        ex = example_pb2.Example()
        ex.features.feature["text"].bytes_list.value.append(text.encode("utf-8"))
        ex.features.feature["id"].bytes_list.value.append(b"x")
        w.write(ex.SerializeToString())
    w.close()
    assert list(heldout.training_texts(str(tmp_path))) == ["def f():\n    return 1\n", "Zwölf Boxkämpfer jagen Viktor"]
    with pytest.raises(FileNotFoundError, match="train source"):
        list(heldout.training_texts(str(tmp_path / "tfds")))
