"""jaxpt.eval units, each against an independent value: rolling windows cover every token once; a hand-built
bigram model gives hand-computed log-likelihoods and task scores; packing and batch size do not change scores;
greedy decoding (``jaxpt.infer.decode``) equals an unpadded forward's argmax and one-at-a-time decoding, and gives the
hand-read continuations of a hand-built chain model with per-row stop strings (also through the lm-eval adapter);
13-gram decontamination on hand examples; card hashing refuses a changed card until its version is bumped;
Cohen's kappa by hand; the regression report flags exactly the drops beyond tolerance."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT
from jaxpt.infer import decode
from jaxpt import mesh as mesh_lib
from jaxpt.data import boundary
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


@pytest.mark.integration
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
    (lp, greedy), = scorer.loglikelihood([(boundary.context_start("eos", tok).apply(ctx), cont)])
    assert lp == pytest.approx(math.log(1 / 8) + math.log(0.4), rel=1e-5)
    assert greedy is False  # after eos every token ties; argmax picks id 0, not b


# ------------------------------------------------------------------------------------------ invariance


@pytest.fixture(scope="module")
def random_model():
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      mlp_dim=64, max_seq_len=24)
    return Decoder(cfg, rngs=nnx.Rngs(3))


@pytest.mark.slow
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


@pytest.mark.slow
def test_batched_greedy_is_the_argmax_of_an_unpadded_forward_and_equals_one_at_a_time(random_model):
    """decode.greedy over NoCacheStep (fixed [B, L] rows, prompts of different lengths, two batches) picks, at every
    step, the argmax of the model run once, unpadded, on the kept prompt plus the tokens before it (causal masking
    makes that one call see each step's context). The prompt of 20 tokens is longer than L - max_new_tokens = 16
    and keeps its last 16. One prompt per call with a row just long enough gives the same tokens."""
    L, new = 24, 8
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 64, size=n).astype(np.int32) for n in (1, 12, 5, 20)]
    got = decode.greedy(decode.NoCacheStep.from_model(random_model, seq_len=L, batch_size=3), prompts, new)
    for p, g in zip(prompts, got):
        kept = list(p[-(L - new):])
        assert len(kept) == min(len(p), 16) and len(g.ids) == new and g.stop_reason == "length" and g.text is None
        ids = np.asarray([kept + g.ids[:-1]], np.int32)
        logits = np.asarray(random_model(ids, np.ones_like(ids), np.arange(ids.shape[1], dtype=np.int32)[None]))
        assert g.ids == [int(np.argmax(logits[0, len(kept) - 1 + i])) for i in range(new)]
        alone = decode.NoCacheStep.from_model(random_model, seq_len=min(L, len(p) + new))
        assert decode.greedy(alone, [p], new)[0].ids == g.ids
    # EOS stops only the rows that emit it, and is kept in their ids.
    eos = got[1].ids[2]
    with_eos = decode.greedy(decode.NoCacheStep.from_model(random_model, seq_len=L, batch_size=3), prompts, new,
                             eos_id=eos)
    for g, e in zip(got, with_eos):
        cut = g.ids.index(eos) + 1 if eos in g.ids else new
        assert e.ids == g.ids[:cut] and e.stop_reason == ("eos" if eos in g.ids else "length")


def test_greedy_refuses_bad_arguments(random_model):
    step = decode.NoCacheStep.from_model(random_model, seq_len=8)
    with pytest.raises(ValueError, match=r"max_new_tokens = 8 must be in \[0, seq_len = 8\)"):
        decode.greedy(step, [[5]], 8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decode.greedy(step, [[5], []], 2)
    with pytest.raises(ValueError, match="one sequence of strings per prompt"):
        decode.greedy(step, [[5], [6]], 2, stop_strings=[["x"]], tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="is a string"):
        decode.greedy(step, [[5]], 2, stop_strings=["x"], tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="need a tokenizer"):
        decode.greedy(step, [[5]], 2, stop_strings=[["x"]])
    assert decode.greedy(step, [[5]], 0) == [decode.Generation([], None, "length")]


def chain_model(next_of: dict[int, int]) -> Decoder:
    """A bigram model whose greedy next token after ``i`` is ``next_of[i]`` (probability .9; others share .1)."""
    Q = np.full((8, 8), 0.1 / 7)
    for i, j in next_of.items():
        Q[i, j] = 0.9
    return bigram_model(Q)


#: Greedy continuation cycles a b c d a ... (ids 4 5 6 7); after EOS comes a.
CYCLE = {1: 4, 4: 5, 5: 6, 6: 7, 7: 4}


class WideCTokenizer(CharTokenizer):
    """CharTokenizer whose 'c' token decodes to two characters, "cx"."""

    def decode(self, ids):
        return super().decode(ids).replace("c", "cx")


@pytest.mark.integration
def test_stop_strings_and_eos_per_row_on_a_hand_built_chain():
    """Continuations read off the chain by hand. From "a" the model writes b c d a b c d ...:
    stop "ab" -> "bcdab" cut to "bcd"; stop "c" -> "b"; stops ("da", "cd") -> "bcd" holds "cd" first -> "b";
    no stop -> 6 tokens "bcdabc". From "dd" with EOS after c: "abc" then EOS (kept in the ids, not in the text).
    A stop string inside a token's text ("x" of "cx") cuts that token's text: "b" + "cx" -> "bc"."""
    tok = CharTokenizer()
    step = decode.NoCacheStep.from_model(chain_model(CYCLE), one_device_mesh(), mesh_lib.DEFAULT_RULES, seq_len=16,
                                         batch_size=3)
    prompts = [tok.encode(t) for t in ("a", "a", "a", "a")]
    gens = decode.greedy(step, prompts, 6, eos_id=1, stop_strings=[["ab"], ["c"], ["da", "cd"], []], tokenizer=tok)
    assert [g.text for g in gens] == ["bcd", "b", "b", "bcdabc"]
    assert [g.ids for g in gens] == [[5, 6, 7, 4, 5], [5, 6], [5, 6, 7], [5, 6, 7, 4, 5, 6]]
    assert [g.stop_reason for g in gens] == ["stop_string"] * 3 + ["length"]
    eos_after_c = decode.NoCacheStep.from_model(chain_model({**CYCLE, 6: 1}), seq_len=16)
    (g,) = decode.greedy(eos_after_c, [tok.encode("dd")], 6, eos_id=1, tokenizer=tok)
    assert (g.ids, g.text, g.stop_reason) == ([4, 5, 6, 1], "abc", "eos")
    (g,) = decode.greedy(step, [tok.encode("a")], 6, stop_strings=[["x"]], tokenizer=WideCTokenizer())
    assert (g.ids, g.text, g.stop_reason) == ([5, 6], "bc", "stop_string")


def test_lm_eval_generate_until_stops_each_request_on_its_own_strings():
    """Two requests with the same prompt, until=["ab"] and until=["c"]: "c" comes first in the continuation
    (b c d a b ...), yet the "ab" request must run on to "bcdab" and answer "bcd" (a union of the batch's stop
    strings would stop it at "bc", "c" included). Batched answers equal one-at-a-time answers; a request with a
    larger max_gen_toks and no stop string runs to its budget."""
    import types
    from lm_eval.api.instance import Instance
    from jaxpt.eval.harness import JaxptLM
    tok = CharTokenizer()
    cfg = types.SimpleNamespace(logical_axis_rules=mesh_lib.DEFAULT_RULES, seq_len=16,
                                data=types.SimpleNamespace(document_boundary="eos"))
    restored = types.SimpleNamespace(model=chain_model(CYCLE), mesh=one_device_mesh(), tokenizer=tok, config=cfg)
    lm = JaxptLM(restored=restored, batch_size=2)
    kwargs = [{"until": ["ab"], "max_gen_toks": 8}, {"until": ["c"], "max_gen_toks": 8},
              {"until": "da", "max_gen_toks": 8}, {"until": [], "max_gen_toks": 10}, {"max_gen_toks": 3}]
    reqs = [Instance("generate_until", {}, ("a", kw), i) for i, kw in enumerate(kwargs)]
    expected = ["bcd", "b", "bc", "bcdabcdabc", "bcd"]
    assert lm.generate_until(reqs) == expected
    assert [lm.generate_until([r])[0] for r in reqs] == expected
    with pytest.raises(ValueError, match="greedily only"):
        lm.generate_until([Instance("generate_until", {}, ("a", {"do_sample": True}), 0)])


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
    shutil.copytree(CARD.parent / "safety", tmp_path / "safety")
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


def test_a_card_whose_generations_do_not_fit_the_run_context_is_refused_naming_the_key():
    """Each generation length a card would use must leave a prompt token in the run's context (seq_len - 1 at
    most): the shipped card asks for decoding 32, spot check 48 and safety 32 new tokens. Only the generations
    that would run are checked (generate tasks, a review sheet, a safety section)."""
    card = card_lib.load_card(str(CARD))
    assert (card.decoding["max_new_tokens"], card.spot_check.max_new_tokens, card.safety.max_new_tokens) == \
        (32, 48, 32)
    for seq_len, tasks, spot, key in [(32, False, False, "safety"), (33, True, True, "spot_check"),
                                      (48, False, True, "spot_check")]:
        with pytest.raises(card_lib.CardError, match=rf"card_v1.yaml: {key}.max_new_tokens = \d+ does not fit "
                                                     rf"this run's context of {seq_len} tokens"):
            card_lib.check_generation_fits(card, seq_len, tasks=tasks, spot_check=spot)
    card_lib.check_generation_fits(card, 33, tasks=True, spot_check=False)  # 32 new tokens after 1 prompt token
    card_lib.check_generation_fits(card, 49, tasks=True, spot_check=True)
    no_safety = dataclasses.replace(card, safety=None)
    card_lib.check_generation_fits(no_safety, 32, tasks=False, spot_check=False)  # nothing generated
    with pytest.raises(card_lib.CardError, match="decoding.max_new_tokens = 32"):
        card_lib.check_generation_fits(no_safety, 32, tasks=True, spot_check=False)


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
    """A corpus version without JSON Lines: the decontamination reference is read from the ArrayRecord shards its
    mixture.json lists (serialized tf.train.Example with a ``text`` feature, as data_pipelines writes them)."""
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
    # A corpus version lists its shards in mixture.json (jaxpt.data.corpus reads the directory).
    (tmp_path / "mixture.json").write_text(json.dumps(
        {"weights": {"code": 1.0}, "shards": {"code": [str(shard.relative_to(tmp_path))]}}))
    assert list(heldout.training_texts(str(tmp_path))) == ["def f():\n    return 1\n", "Zwölf Boxkämpfer jagen Viktor"]
    with pytest.raises(FileNotFoundError, match="train source"):
        list(heldout.training_texts(str(tmp_path / "tfds")))


def test_two_heldout_reports_compare_as_figures_and_a_card_report_beside_one_is_refused():
    """`evaluate compare` of two `evaluate heldout` reports (a new user's crash: the card-report table read
    result['card']['name'] of None): base -> new per row, the change new - base, nothing flagged; different text or
    a card report beside a held-out one is IncompatibleReports (exit 2), not a traceback."""
    from jaxpt.eval import regression
    base = {"overall": {"loss": 6.0, "perplexity": 403.4, "tokens": 100},
            "by_domain": {"a": {"loss": 5.0, "tokens": 60}, "b": {"loss": 7.5, "tokens": 40}}}
    new = {"overall": {"loss": 3.5, "perplexity": 33.1, "tokens": 100},
           "by_domain": {"a": {"loss": 3.0, "tokens": 60}, "b": {"loss": 4.25, "tokens": 40}}}
    result = regression.compare(base, new)
    assert result["ok"] and not result["flagged"]
    assert [(r["name"], r["change"]) for r in result["rows"]] == [("overall", -2.5), ("domain=a", -2.0),
                                                                    ("domain=b", -3.25)]
    text = regression.format_comparison(result)
    assert "6.0000 ->     3.5000" in text and "domain=b" in text
    with pytest.raises(regression.IncompatibleReports, match="different text"):
        regression.compare(base, {**new, "overall": {**new["overall"], "tokens": 99}})
    with pytest.raises(regression.IncompatibleReports, match="only with another held-out report"):
        regression.compare(base, {"card": {"name": "c", "version": 1}, "tasks": {}})
