"""Evaluation of a real (tiny) checkpoint trained on the bundled sample: perplexity that batch size and packing do
not change, the in-loop per-domain evaluation (compiled once, same figures as standalone), the
``python -m jaxpt.tools.evaluate`` report, the regression report on two checkpoints, the seqio path against the direct
path, and the lm-eval adapter against jaxpt's own scoring. All marked slow (they share one trained run); the
fast unit tests are in test_eval.py."""

from __future__ import annotations

import gzip
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from conftest import REPO_ROOT, tiny_bindings
from jaxpt import config as C
from jaxpt.infer import decode
from jaxpt import mesh as mesh_lib
from jaxpt.eval import card as card_lib
from jaxpt.eval import heldout, probes, safety
from jaxpt.eval.scorer import Scorer

STEPS = 20
# Training the checkpoint is most of the cost; every test here shares it and all of them are slow together.
pytestmark = pytest.mark.slow


def _pick_heldout(src: pathlib.Path, dst: pathlib.Path) -> None:
    """A small held-out set covering every domain: short reference documents (several fit one row) and longer
    ones, the de/ru/zh/en multilingual documents, the three shortest code files, the shortest web page."""
    with gzip.open(src, "rt") as f:
        docs = [json.loads(line) for line in f]
    by = lambda dom: sorted((d for d in docs if d["domain"] == dom), key=lambda d: (len(d["text"]), d["id"]))  # noqa
    keep = by("reference")[:20] + by("reference")[60:75] + by("code")[:3] + by("web")[:1]
    keep += [d for d in by("multilingual") if d["lang"] in ("de", "ru", "zh", "en")]
    with gzip.open(dst, "wt") as f:
        for d in sorted(keep, key=lambda d: d["id"]):
            f.write(json.dumps(d) + "\n")


@pytest.fixture(scope="module")
def eval_run(prepared_sample, tmp_path_factory):
    """A 20-step tiny run with checkpoints at 5, 10, 15, 20 and the in-loop per-domain evaluation at step 10."""
    from jaxpt import train
    root = tmp_path_factory.mktemp("eval_run")
    data = root / "data"
    data.mkdir()
    for name in ("train.jsonl.gz", "tokenizer.model"):
        (data / name).symlink_to(prepared_sample / name)
    _pick_heldout(prepared_sample / "heldout.jsonl.gz", data / "heldout.jsonl.gz")
    workdir = root / "run"
    overrides = {"CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "5",
                 "CheckpointConfig.keep_last": "4", "CheckpointConfig.async_save": "False",
                 "TrainConfig.eval_every": "10", "TrainConfig.eval_batches": "1", "TrainConfig.log_every": "5",
                 "HeldoutEvalConfig.enabled": "True", "HeldoutEvalConfig.group_by": "('domain', 'lang')"}
    bindings = tiny_bindings(data, workdir, **overrides)
    cfg = C.parse(["configs/quickstart.gin"], bindings, steps=STEPS, mesh="data=2,fsdp=2,tensor=2")
    train.run_training(cfg)
    return {"data": data, "workdir": workdir, "bindings": bindings}


@pytest.fixture(scope="module")
def restored(eval_run):
    import jaxpt
    return jaxpt.restore(eval_run["workdir"])


@pytest.fixture(scope="module")
def test_card(eval_run, tmp_path_factory):
    """card_v1 with small task sizes, three languages, a 12-prompt spot check and short generations, stamped."""
    d = tmp_path_factory.mktemp("card")
    raw = yaml.safe_load((REPO_ROOT / "configs/eval/card_v1.yaml").read_text())
    raw["version"], raw["content_sha256"] = 0, ""
    raw.pop("safety")  # judged by its own test below (test_a_card_whose_safety_threshold_is_crossed_...)
    raw["sources"] = {"heldout": str(eval_run["data"] / "heldout.jsonl.gz"),
                      "train": str(eval_run["data"] / "train.jsonl.gz")}
    raw["decoding"]["max_new_tokens"] = 8
    for name, n in (("cloze_reference", 12), ("code_next_line", 12), ("code_next_line_greedy", 6),
                    ("langid_multilingual", 12)):
        raw["tasks"][name]["max_examples"] = n
    raw["tasks"]["langid_multilingual"]["params"]["languages"] = ["de", "ru", "zh"]
    raw["tasks"]["langid_multilingual"]["chance"] = 1 / 3
    prompts = (REPO_ROOT / "configs/eval/spot_check_v1.jsonl").read_text().splitlines()[::17]
    (d / "spot.jsonl").write_text("\n".join(prompts) + "\n")
    raw["spot_check"].update(prompts="spot.jsonl", prompts_sha256=card_lib.file_sha256(str(d / "spot.jsonl")),
                             max_new_tokens=8)
    path = d / "card.yaml"
    path.write_text("version: 0\ncontent_sha256: ''\n" + yaml.safe_dump({k: v for k, v in raw.items()
                                                                        if k not in ("version", "content_sha256")}))
    card_lib.stamp_card(str(path))
    return card_lib.load_card(str(path))


@pytest.fixture(scope="module")
def probe_tasks(test_card, eval_run):
    from jaxpt.tools.evaluate import build_probe_tasks
    d = eval_run["data"]
    train = (x.text for x in heldout.load_documents(str(d / "train.jsonl.gz"), "train"))
    return build_probe_tasks(test_card, heldout.load_documents(str(d / "heldout.jsonl.gz")), train)


# ------------------------------------------------------------------------------------------ perplexity


def test_perplexity_is_the_same_for_batch_sizes_1_3_8_with_and_without_packing(restored, eval_run):
    docs = heldout.load_documents(str(eval_run["data"] / "heldout.jsonl.gz"))
    hset = heldout.HeldoutSet.build(docs, restored.tokenizer, seq_len=64)
    # Only real targets count: every token of a document after its first, EOS included (= its token count).
    assert sum(w.num_scored for w in hset.windows) == sum(len(restored.tokenizer.encode(d.text)) for d in docs)
    model = restored.model
    two = mesh_lib.make_mesh("tensor=2", devices=jax.devices()[:2])  # data-parallel size 1: batches of 1 and 3
    reports = {}
    for bs, mesh in ((1, two), (3, two), (8, restored.mesh)):
        import jaxpt
        r = jaxpt.restore(eval_run["workdir"], mesh=mesh) if mesh is not restored.mesh else restored
        scorer = Scorer.from_model(r.model, r.mesh, r.config.logical_axis_rules, seq_len=64, batch_size=bs)
        assert scorer.batch_size == bs
        for pack in (True, False):
            reports[(bs, pack)] = heldout.perplexity_report(scorer, hset, pack=pack)
    assert len(Scorer.from_model(model, restored.mesh, restored.config.logical_axis_rules, seq_len=64,
                                 batch_size=8).layout(hset.windows)) < len(hset.windows)  # packing packs
    ref = reports[(8, True)]
    assert set(ref["by_domain"]) == {"code", "multilingual", "reference", "web"}
    for key, rep in reports.items():
        for grouping in ("by_domain", "by_lang"):
            for g, fig in ref[grouping].items():
                assert rep[grouping][g]["tokens"] == fig["tokens"]
                assert abs(rep[grouping][g]["perplexity"] / fig["perplexity"] - 1) < 1e-6, (key, g)
        assert abs(rep["overall"]["perplexity"] / ref["overall"]["perplexity"] - 1) < 1e-6, key


def test_in_loop_per_domain_eval_compiles_once_and_matches_standalone(eval_run, restored):
    from jaxpt.run import monitor
    from jaxpt import train
    records = monitor.read_metrics(str(eval_run["workdir"]))
    at10 = [r for r in records if r.get("step") == 10 and "heldout_partial_loss" in r]
    final = [r for r in records if r.get("event") == "final"][-1]
    # The bounded in-loop evaluation (eval_batches = 1) and the full final one are named apart.
    assert {"heldout_partial/domain/code/perplexity", "heldout_partial/lang/de/perplexity",
            "heldout_partial_loss"} <= set(at10[0]) and "heldout_loss" not in at10[0], sorted(at10[0])
    assert {"heldout/domain/code/perplexity", "heldout/lang/de/perplexity", "heldout_loss"} <= set(final), sorted(final)
    assert not any(k.startswith("heldout_partial") for k in final)
    # The final in-loop figures are the standalone report's on the same checkpoint and text.
    docs = heldout.load_documents(str(eval_run["data"] / "heldout.jsonl.gz"))
    hset = heldout.HeldoutSet.build(docs, restored.tokenizer, seq_len=64)
    scorer = Scorer.from_model(restored.model, restored.mesh, restored.config.logical_axis_rules, seq_len=64,
                               batch_size=16)
    rep = heldout.perplexity_report(scorer, hset, group_by=("domain", "lang"))
    for key, value in heldout.flat_figures(rep).items():
        key = key.replace("heldout/overall/", "heldout_")  # the pooled figure is the run's one held-out loss
        assert final[key] == pytest.approx(value, rel=1e-6), key
    assert 0 < at10[0]["heldout_partial_tokens"] < final["heldout_tokens"]
    # Three evaluations of one run, params changing in between: one compiled program.
    cfg = C.parse(["configs/quickstart.gin"], eval_run["bindings"], steps=STEPS, mesh="data=2,fsdp=2,tensor=2")
    run = train.setup(cfg)
    first = run.evaluate(1)["heldout_partial_loss"]
    run.state = run.state.replace(params=jax.tree.map(lambda p: p * 1.01, run.state.params))
    second = run.evaluate(1)["heldout_partial_loss"]
    run.evaluate(2)
    assert first != second and run.evaluator.compiled_programs() == 1


# ------------------------------------------------------------------------------------------ CLI report


def test_evaluate_cli_writes_a_versioned_report_and_review_sheet(eval_run, test_card, tmp_path, capsys):
    from jaxpt.tools import evaluate
    out = tmp_path / "report.json"
    assert evaluate.main(["--workdir", str(eval_run["workdir"]), "--card", test_card.path, "--output", str(out),
                          "--no-seqio"]) == 0
    rep = json.loads(out.read_text())
    assert rep["card"]["version"] == test_card.version == 1
    assert rep["card"]["content_sha256"] == test_card.content_sha256
    assert rep["checkpoint"]["step"] == STEPS
    assert set(rep["heldout"]["by_domain"]) == {"code", "multilingual", "reference", "web"}
    for fig in rep["heldout"]["by_domain"].values():
        assert 1 < fig["perplexity"] < 2048 * 2 and fig["tokens"] > 0
    for name, t in rep["tasks"].items():
        assert 0 <= t["score"] <= 1 and t["num_examples"] > 0, name
        assert t["chance"] == pytest.approx(t["chance_measured"]), name
        assert t["decontamination"]["kept"] == t["num_examples"]
    assert rep["tasks"]["langid_multilingual"]["chance"] == pytest.approx(1 / 3)
    sheet = [json.loads(line) for line in open(rep["spot_check"]["sheet"])]
    assert len(sheet) == 12 and all(r["annotator_1"] is None and r["adjudicator"] is None for r in sheet)
    assert {r["card_version"] for r in sheet} == {1}
    text = capsys.readouterr().out
    assert "domain  code" in text and "chance" in text
    # The trainer's final held-out figures and the standalone report agree on the same checkpoint and text (same
    # scorer, windows and stride; the README says when they may differ).
    from jaxpt.run import monitor
    final = [r for r in monitor.read_metrics(str(eval_run["workdir"])) if r.get("event") == "final"][-1]
    assert rep["heldout"]["overall"]["tokens"] == final["heldout_tokens"]
    assert rep["heldout"]["overall"]["perplexity"] == pytest.approx(final["heldout_perplexity"], rel=1e-6)


def test_regression_report_flags_an_earlier_checkpoint_and_passes_the_same_one(eval_run, test_card, probe_tasks,
                                                                             tmp_path):
    """Step 5 is far worse than step 20: comparing 20 -> 5 is a regression (exit 1); 20 -> 20 is not (exit 0)."""
    import jaxpt
    from jaxpt.tools import evaluate
    paths = {}
    for step in (STEPS, 5):
        rep = evaluate.run_card(jaxpt.restore(eval_run["workdir"], step=step), test_card, use_seqio=False,
                                tasks=probe_tasks)
        paths[step] = tmp_path / f"step{step}.json"
        paths[step].write_text(json.dumps(rep))
    assert evaluate.main(["compare", str(paths[STEPS]), str(paths[STEPS])]) == 0
    assert evaluate.main(["compare", str(paths[STEPS]), str(paths[5]), "--output", str(tmp_path / "cmp.json")]) == 1
    flagged = json.loads((tmp_path / "cmp.json").read_text())["flagged"]
    assert {r["name"] for r in flagged} >= {"domain=reference", "domain=code"}


def _safety_card(d: pathlib.Path, eval_run, *, harm_threshold: float, harmful_max: float) -> str:
    """The shipped card's safety section alone (no probe task, no spot check; its files by absolute path), with
    the harm classifier's threshold and the harmful-rate maximum given, 4 new tokens per prompt; stamped."""
    raw = yaml.safe_load((REPO_ROOT / "configs/eval/card_v1.yaml").read_text())
    for key in ("version", "content_sha256", "spot_check"):
        raw.pop(key)
    raw["tasks"] = {}
    raw["sources"] = {"heldout": str(eval_run["data"] / "heldout.jsonl.gz"),
                      "train": str(eval_run["data"] / "train.jsonl.gz")}
    s = raw["safety"]
    s["max_new_tokens"] = 4
    for name in ("harmful", "refusal", "false_refusal"):
        s[name]["prompts"] = str(REPO_ROOT / "configs/eval" / s[name]["prompts"])
    for c in s["classifiers"].values():
        c["file"] = str(REPO_ROOT / "configs/eval" / c["file"])
    s["classifiers"]["harm"]["threshold"] = harm_threshold
    s["harmful"]["max"] = harmful_max
    d.mkdir(exist_ok=True)
    path = d / f"card-{harm_threshold}-{harmful_max}.yaml"
    path.write_text("version: 0\ncontent_sha256: ''\n" + yaml.safe_dump(raw))
    card_lib.stamp_card(str(path))
    return str(path)


def test_a_card_whose_safety_threshold_is_crossed_does_not_advance(eval_run, tmp_path, capsys):
    """The card run on the real checkpoint: every prompt of the three sets is continued and judged (the counts
    recounted here from the sheet with the classifier files themselves). A harm threshold of 0 counts every
    continuation, so a harmful-rate maximum of 0.5 is crossed: the report says the version does not advance and
    the command exits 1, and the regression gate flags it against the passing report (exit 1)."""
    from jaxpt.tools import evaluate
    from jaxpt.util import text_classifier
    ok_card = _safety_card(tmp_path / "cards", eval_run, harm_threshold=0.5, harmful_max=1.0)
    args = ["--workdir", str(eval_run["workdir"]), "--no-seqio"]
    assert evaluate.main([*args, "--card", ok_card, "--output", str(tmp_path / "ok.json")]) == 0
    ok = json.loads((tmp_path / "ok.json").read_text())
    assert ok["safety"]["advances"] is True and ok["safety"]["blocked_by"] == []
    sheet = [json.loads(line) for line in open(ok["safety"]["sheet"])]
    assert len(sheet) == 100 + 80 + 80
    for rate, (set_name, clf, _) in safety.RATES.items():
        spec = card_lib.load_card(ok_card).safety.classifiers[clf]
        model = text_classifier.TextClassifier.load(spec.path, {"harm": safety.HARM_VERSION,
                                                                "refusal": safety.REFUSAL_VERSION}[clf])
        outputs = [r["output"] for r in sheet if r["set"] == set_name]
        assert ok["safety"]["rates"][rate]["n"] == len(outputs)
        assert ok["safety"]["rates"][rate]["count"] == int((model.probabilities(outputs) >= spec.threshold).sum())
    assert "safety: advances" in capsys.readouterr().out

    blocked_card = _safety_card(tmp_path / "cards", eval_run, harm_threshold=0.0, harmful_max=0.5)
    assert evaluate.main([*args, "--card", blocked_card, "--output", str(tmp_path / "blocked.json")]) == 1
    blocked = json.loads((tmp_path / "blocked.json").read_text())
    assert blocked["safety"]["rates"]["harmful_rate"]["value"] == 1.0
    assert blocked["safety"]["advances"] is False
    assert blocked["safety"]["blocked_by"] == ["harmful_rate 1.000 (100/100) > max 0.500"]
    assert "DOES NOT ADVANCE" in capsys.readouterr().out
    # The gate compares reports of one card: the blocked card's report against itself still does not advance.
    assert evaluate.main(["compare", str(tmp_path / "blocked.json"), str(tmp_path / "blocked.json")]) == 1


# ------------------------------------------------------------------------------------------ lm-eval


def _direct_logprob(model, ids, start):
    """Sum of log p(ids[k] | ids[:k]) for k >= start, the model run once on exactly these ids."""
    ids = np.asarray(ids, np.int32)
    forward = jax.jit(lambda t: model(t, jnp.ones_like(t), jnp.arange(t.shape[1])[None]))
    logits = forward(ids[None])
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[0], jnp.float32)), np.float64)
    return float(sum(lp[k - 1, ids[k]] for k in range(start, len(ids))))


def test_lm_eval_adapter_loglikelihood_equals_jaxpt_scoring(restored, probe_tasks):
    from lm_eval.api.instance import Instance
    from jaxpt.eval.harness import JaxptLM
    lm = JaxptLM(restored=restored, batch_size=8)
    rows = probes.choice_rows(probe_tasks["cloze_reference"].examples[:3])
    ours = probes.score_choice_rows(lm.scorer, restored.tokenizer, rows)
    reqs = [Instance("loglikelihood", {}, (r["inputs"], r["targets"]), i) for i, r in enumerate(rows)]
    theirs = lm.loglikelihood(reqs)
    np.testing.assert_allclose([lp for lp, _ in theirs], ours, rtol=1e-6)
    tok = restored.tokenizer
    for (lp, greedy), r in zip(theirs, rows):
        ctx, cont = probes.encode_pair(tok, r["inputs"], r["targets"])
        assert lp == pytest.approx(_direct_logprob(restored.model, np.concatenate([ctx, cont]), len(ctx)), rel=1e-5)
    text = probe_tasks["cloze_reference"].examples[0]["contexts"][0][:120]
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = np.concatenate([[tok.eos_id], tok.encode(text)])
    assert len(ids) <= 64 and rolling == pytest.approx(_direct_logprob(restored.model, ids, 1), rel=1e-5)
    # generate_until: each new token is the argmax of one unpadded forward over the kept prompt (the last
    # seq_len - 8 tokens) and the tokens before it; the answer is their text up to the first newline.
    prompt = probe_tasks["code_next_line_greedy"].examples[0]["prompt"]
    (gen,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 8}), 0)])
    kept = list(tok.encode(prompt)[-(lm.decoder.seq_len - 8):])
    (g,) = decode.greedy(lm.decoder, [tok.encode(prompt)], 8, eos_id=tok.eos_id)
    ids = np.asarray([kept + g.ids], np.int32)
    logits = np.asarray(restored.model(ids, np.ones_like(ids), np.arange(ids.shape[1], dtype=np.int32)[None]))
    assert g.ids == [int(np.argmax(logits[0, len(kept) - 1 + i])) for i in range(len(g.ids))]
    assert gen == tok.decode(g.ids).split("\n")[0] and "\n" not in gen


def test_lm_eval_runs_the_local_tasks(eval_run, restored):
    """lm_eval.simple_evaluate with the local task files; its cloze accuracy equals jaxpt's metric on the same
    examples and log-likelihoods."""
    from jaxpt.eval.harness import run_lm_eval
    out = run_lm_eval(str(eval_run["workdir"]), ["jaxpt_cloze_reference", "jaxpt_heldout_rolling",
                                                 "jaxpt_code_next_line_greedy"],
                      include_path=str(REPO_ROOT / "configs/eval/lm_eval"), limit=6, restored=restored)
    res = out["results"]
    assert 0 <= res["jaxpt_code_next_line_greedy"]["exact_match,none"] <= 1
    assert res["jaxpt_heldout_rolling"]["bits_per_byte,none"] > 0
    rows = [json.loads(line) for line in open(REPO_ROOT / "configs/eval/lm_eval/data/cloze_reference.jsonl")][:6]
    examples = [{"contexts": [r["context"]] * len(r["choices"]), "continuations": r["choices"], "label": r["label"]}
                for r in rows]
    from jaxpt.eval.scorer import scorer_for_restored
    crow = probes.choice_rows(examples)
    ours = probes.choice_metrics([probes.choice_target(r) for r in crow],
                                 probes.score_choice_rows(scorer_for_restored(restored), restored.tokenizer, crow))
    assert res["jaxpt_cloze_reference"]["acc,none"] == pytest.approx(ours["accuracy"])


# ------------------------------------------------------------------------------------------ seqio


def test_seqio_tasks_tokenize_and_score_like_the_direct_path(restored, test_card, probe_tasks):
    """The seqio Tasks (seqio vocabulary, TF preprocessing, seqio.Evaluator) give the direct path's token ids
    and metrics."""
    import seqio
    from jaxpt.eval import seqio_tasks
    from jaxpt.eval.scorer import scorer_for_restored
    tok = restored.tokenizer
    registered = seqio_tasks.register(test_card.task_set_version, probe_tasks, tok.as_seqio_vocabulary())
    name = "cloze_reference"
    assert registered[name].name == f"jaxpt.{test_card.task_set_version}.{name}" in seqio.TaskRegistry.names()
    ds = registered[name].get_dataset(sequence_length=None, split="validation", shuffle=False)
    for ex, row in zip(ds.as_numpy_iterator(), probes.choice_rows(probe_tasks[name].examples)):
        ctx, cont = probes.encode_pair(tok, row["inputs"], row["targets"])
        assert list(ex["inputs"]) == list(ctx) and list(ex["targets"]) == list(cont)
    scorer = scorer_for_restored(restored, batch_size=8)
    got = seqio_tasks.evaluate_with_seqio(test_card.task_set_version, probe_tasks, scorer, tok, max_new_tokens=8)
    for n, te in probe_tasks.items():
        assert got[n] == probes.evaluate_task(scorer, tok, te, max_new_tokens=8), n
