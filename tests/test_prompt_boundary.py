"""Model inputs built from a prompt or a context start as the run's training documents did (issue #34):
``DataConfig.document_boundary`` through :func:`jaxpt.data.boundary.context_start`.

A 'bos_eos' run (a Llama or Mistral base) puts BOS first in every input that the generator, the probe tasks, the
lm-eval adapter (loglikelihood, loglikelihood_rolling, generate_until), the seqio score and predict functions and the
spot-check sheet build; an 'eos' run (jaxpt's default) keeps the inputs it had before policies existed (a context as
it is, an empty one [EOS], the rolling prefix EOS). A SentencePiece tokenizer (BOS 3, EOS 1) and a random two-layer
model are built here. The expected values are computed independently of the code under test: the inputs are written
out by hand, each log-likelihood comes from one plain forward pass of the model over exactly those ids, and each greedy
generation is the argmax of one full forward pass per new token (no KV cache, no decoding loop of jaxpt's).
"""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpt
from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.data import boundary
from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.eval import probes
from jaxpt.infer import decode
from jaxpt.infer.kv_cache import KVCacheStep
from jaxpt.infer.restore import Restored
from jaxpt.model import Decoder, ModelConfig
from jaxpt.util.errors import ConfigError

TEXT = ("The river flows past the old stone mill, number 12, and on to the sea.\n"
        "def flow(river):\n    return river.speed * 2  # metres per second\n"
        "Rivers and streams meet at the delta.\n") * 20
PROMPTS = ["The river", "def flow(river):\n"]
BOS, EOS = 3, 1  # jaxpt's SentencePiece convention (jaxpt.data.tokenizer)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    t = Tokenizer.load(tokenizer_lib.train_sentencepiece(TEXT.splitlines(keepends=True), path, vocab_size=300))
    assert (t.bos_id, t.eos_id) == (BOS, EOS)
    return t


@pytest.fixture(scope="module")
def model(tok) -> Decoder:
    """Random params drawn on the host (std 0.5: peaked next-token distributions, so BOS first changes them)."""
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      mlp_dim=64, max_seq_len=64)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(1)
    state = jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype), state)
    return nnx.merge(graphdef, state)


def _restored(model, tok, policy: str) -> Restored:
    """What ``jaxpt.restore`` returns for a run whose ``DataConfig.document_boundary`` is ``policy``."""
    cfg = config_lib.TrainConfig(seq_len=32, data=config_lib.DataConfig(document_boundary=policy))
    mesh = mesh_lib.make_mesh("data=1", devices=jax.devices()[:1])
    return Restored(model=model, params=nnx.state(model, nnx.Param), config=cfg, tokenizer=tok, step=0, meta={},
                    mesh=mesh)


_FORWARD = {}


def _logp(model, ids) -> np.ndarray:
    """float64 [n, V]: log p(next token | ids[:k+1]) from one forward pass over ``ids`` (one row, one segment,
    padded at the end to max_seq_len so that one program serves every length: causal attention keeps the padding
    out of the first n positions)."""
    L = model.cfg.max_seq_len
    if id(model) not in _FORWARD:
        graphdef, params = nnx.split(model)
        fn = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, jnp.ones_like(t), jnp.arange(L, dtype=jnp.int32)[None]))
        _FORWARD[id(model)] = (fn, params)
    fn, params = _FORWARD[id(model)]
    n = len(ids)
    row = np.zeros((1, L), np.int32)
    row[0, :n] = ids
    return np.asarray(jax.nn.log_softmax(fn(params, jnp.asarray(row))[0, :n].astype(jnp.float32)), np.float64)


def _loglikelihood(model, ctx, cont) -> float:
    """log p(cont | ctx) by hand: one forward pass over ``ctx + cont``."""
    ids = np.concatenate([np.asarray(ctx, np.int32), np.asarray(cont, np.int32)])
    lp = _logp(model, ids)
    return float(sum(lp[k - 1, ids[k]] for k in range(len(ctx), len(ids))))


def _greedy(model, ids, n: int) -> list[int]:
    """Greedy continuation by hand: the argmax of a full forward pass per new token, stopped after EOS."""
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(np.argmax(_logp(model, ids)[-1])))
        ids.append(out[-1])
        if out[-1] == EOS:
            break
    return out


class SpyStep:
    """A :class:`jaxpt.infer.decode.DecodeStep` that records the prompts it is prefilled with."""

    def __init__(self, step):
        self.step, self.prompts = step, []
        self.batch_size, self.seq_len = step.batch_size, step.seq_len

    def prefill(self, prompts):
        self.prompts += [list(map(int, p)) for p in prompts]
        return self.step.prefill(prompts)

    def extend(self, state, tokens):
        return self.step.extend(state, tokens)


class SpyScorer:
    """A scorer that records the ``(context, continuation)`` ids it is asked to score."""

    def __init__(self, scorer):
        self.scorer, self.requests = scorer, []

    def loglikelihood(self, requests, **kw):
        self.requests += [(list(map(int, c)), list(map(int, k))) for c, k in requests]
        return self.scorer.loglikelihood(requests, **kw)


def _start(policy, ids) -> list[int]:
    """The model input of context ``ids`` written out by hand: [BOS] + ids under 'bos_eos'; under 'eos' today's
    (before policies existed): the ids, an empty context [EOS]."""
    ids = list(map(int, ids))
    return [BOS] + ids if policy == "bos_eos" else (ids or [EOS])


def test_context_start_of_each_policy(tok):
    ids = [7, 8]
    cases = {"eos": ([7, 8], [EOS], EOS), "none": ([7, 8], [EOS], EOS),
             "bos": ([BOS, 7, 8], [BOS], BOS), "bos_eos": ([BOS, 7, 8], [BOS], BOS)}
    for policy, (full, empty, prefix) in cases.items():
        start = boundary.context_start(policy, tok)
        assert start.apply(ids).tolist() == full and start.apply([]).tolist() == empty, policy
        assert start.prefix_id == prefix and start.apply(ids).dtype == np.int32
    no_bos = types.SimpleNamespace(bos_id=-1, eos_id=5, path="qwen/tokenizer.json")
    assert boundary.context_start("eos", no_bos).apply([]).tolist() == [5]
    with pytest.raises(ConfigError, match=r"DataConfig.document_boundary = 'bos_eos'.*BOS.*qwen/tokenizer.json"):
        boundary.context_start("bos_eos", no_bos)
    with pytest.raises(ConfigError, match="must be one of"):
        boundary.context_start("bos+eos", tok)


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["bos_eos", "eos"])
def test_generation_starts_as_training_documents_did(tok, model, policy):
    """``Restored.generate`` (KV cache) and ``jaxpt.generate`` given the policy (no cache) equal greedy decoding by
    hand from [BOS] + prompt ('bos_eos') or from the prompt alone ('eos', as before); the two differ, so a generator
    that forgot the BOS fails here."""
    r = _restored(model, tok, policy)
    prompt = PROMPTS[0]
    want = tok.decode(_greedy(model, _start(policy, tok.encode(prompt)), 6))
    assert r.generate(prompt, 6) == want
    assert jaxpt.generate(model, tok, prompt, 6, kv_cache=False, document_boundary=policy) == want
    assert _greedy(model, [BOS, *tok.encode(prompt)], 6) != _greedy(model, tok.encode(prompt), 6)
    assert r.document_boundary == policy
    if policy == "bos_eos":  # an empty prompt is a document's start (under 'eos' it stays refused: nothing precedes)
        assert r.generate("", 3) == tok.decode(_greedy(model, [BOS], 3))


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["bos_eos", "eos"])
def test_lm_eval_adapter_inputs_follow_the_policy(tok, model, policy):
    """Each adapter method feeds the model [BOS] + context under 'bos_eos' (rolling: [BOS] + text, as lm-eval's
    prefix_token_id), today's inputs under 'eos'; the log-likelihoods equal one forward pass over exactly those ids
    and the generations greedy decoding by hand from them."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the `eval` extra)")
    from lm_eval.api.instance import Instance
    from jaxpt.eval.harness import JaxptLM
    lm = JaxptLM(restored=_restored(model, tok, policy), batch_size=2)
    lm.scorer, lm.decoder = SpyScorer(lm.scorer), SpyStep(lm.decoder)
    assert lm.prefix_token_id == (BOS if policy == "bos_eos" else EOS)

    pairs = [("The river", " flows"), ("", "The river"), ("def flow(river):\n", "    return")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    want_reqs = []
    for ctx_text, cont_text in pairs:
        ctx, cont = probes.encode_pair(tok, ctx_text, cont_text)
        want_reqs.append((_start(policy, ctx), cont.tolist()))
    assert lm.scorer.requests == want_reqs
    np.testing.assert_allclose([lp for lp, _ in got], [_loglikelihood(model, c, k) for c, k in want_reqs], rtol=1e-5)

    lm.scorer.requests.clear()
    text = TEXT[:30]
    assert len(tok.encode(text)) < 32  # one window of seq_len = 32: the whole text sees the prefix
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    prefix = [BOS] if policy == "bos_eos" else [EOS]
    assert lm.scorer.requests == [(prefix, tok.encode(text).tolist())]
    assert rolling == pytest.approx(_loglikelihood(model, prefix, tok.encode(text)), rel=1e-5)

    gens = lm.generate_until([Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 5}), i)
                              for i, p in enumerate(PROMPTS)])
    assert lm.decoder.prompts == [_start(policy, tok.encode(p)) for p in PROMPTS]
    assert gens == [tok.decode(_greedy(model, _start(policy, tok.encode(p)), 5)).split("\n\n")[0] for p in PROMPTS]


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["bos_eos", "eos"])
def test_probe_inputs_follow_the_policy(tok, model, policy):
    """A choice task's contexts (one empty) and a generate task's prompts reach the scorer and the decoder started
    as the policy says; the scores are the hand-computed log-likelihoods of exactly those inputs."""
    from jaxpt.eval.scorer import scorer_for_restored
    r = _restored(model, tok, policy)
    scorer = SpyScorer(scorer_for_restored(r, batch_size=2))
    spec = probes.TaskSpec("toy", "cloze", "x", 10, {"context": "{context}", "choice": "{choice}"}, 0.5, "accuracy")
    examples = [{"id": "1", "contexts": ["The river"] * 2, "continuations": [" flows", " stone"], "label": 0},
                {"id": "2", "contexts": [""] * 2, "continuations": ["The", "def"], "label": 1}]
    rows = probes.choice_rows(examples)
    scores = probes.score_choice_rows(scorer, tok, rows, policy)
    want = []
    for row in rows:
        ctx, cont = probes.encode_pair(tok, row["inputs"], row["targets"])
        want.append((_start(policy, ctx), cont.tolist()))
    assert scorer.requests == want
    np.testing.assert_allclose(scores, [_loglikelihood(model, c, k) for c, k in want], rtol=1e-5)
    metrics = probes.evaluate_task(scorer, tok, probes.TaskExamples(spec, examples, {}, {}), document_boundary=policy)
    assert metrics == probes.choice_metrics([probes.choice_target(x) for x in rows], scores)

    gen_spec = probes.TaskSpec("g", "next_line_greedy", "code", 10, {"context": "{context}"}, 0.0, "exact_match")
    gen_examples = [{"id": str(i), "prompt": p, "target": "x"} for i, p in enumerate(PROMPTS)]
    step = SpyStep(KVCacheStep.from_model(model, seq_len=32, batch_size=2, pad_id=tok.pad_id))
    probes.evaluate_task(scorer, tok, probes.TaskExamples(gen_spec, gen_examples, {}, {}), max_new_tokens=4,
                         generator=step, document_boundary=policy)
    assert step.prompts == [_start(policy, tok.encode(p)) for p in PROMPTS]


def test_spot_check_sheet_prompts_start_with_bos(tok, model, tmp_path):
    """The card's spot-check generations of a 'bos_eos' run decode from [BOS] + prompt (greedy by hand)."""
    from jaxpt.tools.evaluate import write_review_sheet
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    card = types.SimpleNamespace(name="c", version=1, spot_check=types.SimpleNamespace(
        prompts_path=str(prompts), max_new_tokens=4, labels=["ok"]))
    # 24: the row write_review_sheet asks for (the longest prompt, 15 ids, and 4 new, rounded up to 8), so it keeps it
    step = SpyStep(KVCacheStep.from_model(model, seq_len=24, batch_size=2, pad_id=tok.pad_id))
    write_review_sheet(_restored(model, tok, "bos_eos"), card, step, str(tmp_path / "sheet.jsonl"), "")
    assert step.prompts == [[BOS, *tok.encode(p).tolist()] for p in PROMPTS]
    sheet = [json.loads(line) for line in (tmp_path / "sheet.jsonl").read_text().splitlines()]
    assert [s["generation"] for s in sheet] == [tok.decode(_greedy(model, [BOS, *tok.encode(p)], 4)) for p in PROMPTS]


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["bos_eos", "eos"])
def test_seqio_score_and_predict_inputs_follow_the_policy(tok, model, policy):
    """The seqio path's ``score_fn`` and ``predict_fn`` start their inputs as the direct path does."""
    pytest.importorskip("seqio", reason="seqio is not installed (the `eval` extra)")
    from jaxpt.eval import seqio_tasks
    from jaxpt.eval.scorer import scorer_for_restored
    start = boundary.context_start(policy, tok)
    examples = [{"inputs": tok.encode("The river"), "targets": tok.encode(" flows")},
                {"inputs": np.zeros(0, np.int32), "targets": tok.encode("The")}]
    dataset = types.SimpleNamespace(as_numpy_iterator=lambda: iter(enumerate(examples)))
    scorer = SpyScorer(scorer_for_restored(_restored(model, tok, policy), batch_size=2))
    seqio_tasks._score_fn(scorer, start, dataset)
    assert scorer.requests == [(_start(policy, e["inputs"]), e["targets"].tolist()) for e in examples]
    step = SpyStep(KVCacheStep.from_model(model, seq_len=32, batch_size=2, pad_id=tok.pad_id))
    seqio_tasks._predict_fn(step, tok, start, 3, dataset)
    assert step.prompts == [_start(policy, e["inputs"]) for e in examples]
