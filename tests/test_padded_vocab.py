"""A model whose ``vocab_size`` is padded past its tokenizer's (rounded up to a multiple of 128, the common case)
never emits an id the tokenizer cannot decode (issue #34).

The tokenizer (400 pieces) is trained here on sample text; the model has 512 logits, and its padded ids are made
to win every argmax by a large margin (a constant direction in the residual stream, read by the output columns of
the padded ids only). Checked: greedy decoding with and without a KV cache, ``jaxpt.generate`` (greedy and
sampled), sampling at temperature 1 under several seeds (and, from fixed logits, in the masked softmax's
proportions), and the lm-eval adapter (generation, log-likelihood, rolling log-likelihood) run without error and
produce only ids below the tokenizer's size; scoring renormalises over the tokenizer's ids (the next-token
probabilities of the real ids sum to 1, and a continuation the masked argmax picks counts as greedy); and
``Tokenizer.decode`` refuses an out-of-range id with a ValueError naming the id and the tokenizer's size.
"""

import gzip
import itertools
import json
import math
import pathlib
import types

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpt
from jaxpt import mesh as mesh_lib
from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.eval.scorer import scorer_for_restored
from jaxpt.infer import decode
from jaxpt.infer.kv_cache import KVCacheStep
from jaxpt.model import Decoder, ModelConfig

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sample"
TOKENIZER_SIZE = 400
MODEL_VOCAB = 512  # the tokenizer's size rounded up to a multiple of 128
PROMPTS = ["def f(x):\n", "The ", "a"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    with gzip.open(SAMPLE / "reference.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 200)]
    path = tmp_path_factory.mktemp("tok") / "t.model"
    settings = tokenizer_lib.TrainerSettings(vocab_size=TOKENIZER_SIZE)
    t = Tokenizer.load(tokenizer_lib.train(texts, path, settings))
    assert t.vocab_size == TOKENIZER_SIZE
    return t


@pytest.fixture(scope="module")
def model() -> Decoder:
    """Random params (drawn on the host), then: dimension 0 of every embedding is 100 (the blocks add O(1) to the
    residual), the final norm's gain 1, so after the norm dimension 0 is about sqrt(D) > 0 at every position; the
    output's row 0 is 2 for the padded ids and 0 for the real ones. Padded logits lead by about 2 sqrt(32) = 11
    (the real ids keep about 4e-5 of the mass)."""
    cfg = ModelConfig(vocab_size=MODEL_VOCAB, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      mlp_dim=64, max_seq_len=32)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jax.numpy.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), state)
    m = nnx.merge(graphdef, state)
    m.embedding.value = m.embedding.value.at[:, 0].set(100.0)
    m.final_norm.scale.value = jax.numpy.ones_like(m.final_norm.scale.value)
    m.output.value = m.output.value.at[0, :].set(0.0).at[0, TOKENIZER_SIZE:].set(2.0)
    return m


def _prompt_ids(tok):
    return [tok.encode(p) for p in PROMPTS]


def _assert_in_range(gens, tok):
    ids = [i for g in gens for i in g.ids]
    assert ids and all(0 <= i < tok.vocab_size for i in ids), ids
    assert all(isinstance(g.text, str) for g in gens)


@pytest.mark.integration
@pytest.mark.parametrize("step_cls", [decode.NoCacheStep, KVCacheStep])
def test_greedy_decoding_never_emits_a_padded_id(tok, model, step_cls):
    step = step_cls.from_model(model, seq_len=32, batch_size=2, pad_id=tok.pad_id)
    _, logits = step.prefill(_prompt_ids(tok)[:2])
    assert logits.shape == (2, MODEL_VOCAB) and np.all(np.argmax(logits, -1) >= TOKENIZER_SIZE)  # padded ids lead
    gens = decode.greedy(step, _prompt_ids(tok), 8, eos_id=tok.eos_id, tokenizer=tok)
    _assert_in_range(gens, tok)
    assert all(len(g.ids) == 8 or g.stop_reason == "eos" for g in gens)
    assert isinstance(jaxpt.generate(model, tok, PROMPTS[0], 6), str)


@pytest.mark.integration
def test_sampling_never_emits_a_padded_id(tok, model):
    """Temperature 1 under several seeds (the padded ids hold all but about 4e-5 of each unmasked distribution, so
    unmasked they are all that is drawn): every sampled id is real, seeds differ, the same seed repeats, and a row's
    draws do not depend on the batch."""
    step = KVCacheStep.from_model(model, seq_len=32, batch_size=3, pad_id=tok.pad_id)
    unmasked = decode.sample(step, _prompt_ids(tok), 4, seed=0, num_ids=MODEL_VOCAB)  # ids only: no tokenizer
    assert all(i >= TOKENIZER_SIZE for g in unmasked for i in g.ids)  # what the mask is up against
    runs = [decode.sample(step, _prompt_ids(tok), 8, temperature=1.0, seed=s, eos_id=tok.eos_id, tokenizer=tok)
            for s in range(4)]
    for gens in runs:
        _assert_in_range(gens, tok)
    assert len({tuple(tuple(g.ids) for g in gens) for gens in runs}) > 1
    one_row = KVCacheStep.from_model(model, seq_len=32, batch_size=1, pad_id=tok.pad_id)
    again = decode.sample(one_row, _prompt_ids(tok), 8, temperature=1.0, seed=2, eos_id=tok.eos_id, tokenizer=tok)
    assert [g.ids for g in again] == [g.ids for g in runs[2]]
    text = jaxpt.generate(model, tok, PROMPTS[1], 6, temperature=1.0, seed=3)
    assert isinstance(text, str)


class FixedLogits:
    """A :class:`jaxpt.infer.decode.DecodeStep` whose every row's next-token logits are ``logits``."""

    seq_len = 4

    def __init__(self, logits, batch_size):
        self.logits, self.batch_size = np.asarray(logits, np.float32), batch_size

    def prefill(self, prompts):
        return None, np.tile(self.logits, (len(prompts), 1))


def test_sampling_draws_the_softmax_of_the_real_ids():
    """4,000 rows (each its own generator), one token each, at temperature 0.5 from logits whose two padded ids
    lead: the real ids' frequencies are softmax(2 * logits[:4]) within 4 standard errors, the padded never drawn."""
    logits = np.array([0.0, 1.0, 2.0, 0.5, 9.0, 9.0])
    n = 4000
    gens = decode.sample(FixedLogits(logits, batch_size=1000), [[1]] * n, 1, temperature=0.5, seed=7, num_ids=4)
    counts = np.bincount([g.ids[0] for g in gens], minlength=6)
    p = np.exp(2 * logits[:4]) / np.exp(2 * logits[:4]).sum()
    assert counts[4:].sum() == 0
    np.testing.assert_array_less(np.abs(counts[:4] / n - p), 4 * np.sqrt(p * (1 - p) / n))


def _restored(model, tok):
    cfg = types.SimpleNamespace(logical_axis_rules=mesh_lib.DEFAULT_RULES, seq_len=32,
                                data=types.SimpleNamespace(document_boundary="eos"))
    mesh = mesh_lib.make_mesh("data=1", devices=jax.devices()[:1])
    return types.SimpleNamespace(model=model, mesh=mesh, tokenizer=tok, config=cfg)


@pytest.mark.integration
def test_lm_eval_adapter_with_a_padded_vocabulary(tok, model):
    """Generation, log-likelihood and rolling log-likelihood through the adapter run and give real text and finite
    scores (an out-of-range id would fail ``Tokenizer.decode``)."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the `eval` extra)")
    from lm_eval.api.instance import Instance
    from jaxpt.eval.harness import JaxptLM
    lm = JaxptLM(restored=_restored(model, tok), batch_size=2)
    reqs = [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 6}), i)
            for i, p in enumerate(PROMPTS)]
    assert all(isinstance(t, str) for t in lm.generate_until(reqs))
    pairs = [Instance("loglikelihood", {}, (p, " the"), i) for i, p in enumerate(PROMPTS)]
    assert all(math.isfinite(lp) and lp < 0 for lp, _ in lm.loglikelihood(pairs))
    rolling = [Instance("loglikelihood_rolling", {}, (p,), i) for i, p in enumerate(PROMPTS)]
    assert all(math.isfinite(lp) and lp < 0 for lp in lm.loglikelihood_rolling(rolling))


def test_scoring_renormalises_over_the_tokenizers_ids(tok, model):
    """After [EOS], the probabilities of all 400 real next tokens sum to 1 (unmasked, the padded ids would take all
    but about 4e-5 of it), and the real token of highest logit is scored as the greedy continuation."""
    scorer = scorer_for_restored(_restored(model, tok), seq_len=16, batch_size=8)  # the adapter's and the cards'
    eos = np.asarray([tok.eos_id], np.int32)
    scores = scorer.loglikelihood([(eos, np.asarray([i], np.int32)) for i in range(tok.vocab_size)])
    logp = np.array([lp for lp, _ in scores])
    assert np.exp(logp).sum() == pytest.approx(1.0, abs=1e-4)
    best = int(np.argmax(logp))
    assert [g for _, g in scores] == [i == best for i in range(tok.vocab_size)]


def test_decode_refuses_an_out_of_range_id_by_name(tok):
    assert tok.decode([tok.vocab_size - 1]) is not None
    for bad in (tok.vocab_size, MODEL_VOCAB - 1, -1):
        with pytest.raises(ValueError, match=rf"id {bad}\b.*{tok.vocab_size}"):
            tok.decode([5, bad, 6])
