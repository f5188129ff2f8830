"""The mixture experiment (python -m jaxpt.tools.mixtures) end to end on a tiny corpus with a planted answer.

The corpus has three domains: 'arith' (synthetic sums, ``12+7=19``, a language of its own) and 'web' and 'code'
cut from the bundled sample. The target is arith's held-out loss, so the best mixture is known: most weight on
arith. The proxies are real training runs (a 1-layer model, 24 steps each). A card target adds a tiny eval card's
next-line task on the code domain, scored from each proxy's final checkpoint.
"""

import gzip
import itertools
import json
import pathlib
import random
import re

import numpy as np
import pytest
import yaml
from scipy import stats

from jaxpt import config as config_lib
from jaxpt.config import ConfigError
from jaxpt.eval import tasks as tasks_lib
from jaxpt.lab import conclusions, mixture_cards, mixtures
from jaxpt.tools import evaluate, mixtures as mixtures_cli

REPO = pathlib.Path(__file__).resolve().parents[1]


def _corpus(root: pathlib.Path) -> None:
    """train/held-out JSON Lines (disjoint documents) and a 384-piece tokenizer."""
    from jaxpt.data import tokenizer as tokenizer_lib
    rng = random.Random(0)
    docs = [{"id": f"arith-{i}", "domain": "arith",
             "text": "\n".join(f"{a}+{b}={a + b}" for a, b in ((rng.randrange(50), rng.randrange(50))
                                                               for _ in range(40)))} for i in range(60)]
    for domain in ("web", "code"):
        with gzip.open(REPO / "data" / "sample" / f"{domain}.jsonl.gz", "rt", encoding="utf-8") as f:
            for line in itertools.islice(f, 0, 120, 2):
                doc = json.loads(line)
                docs.append({"id": doc["id"], "domain": domain, "text": doc["text"][:1200]})
    heldout, train = docs[::6], [d for i, d in enumerate(docs) if i % 6]
    for name, part in (("train", train), ("heldout", heldout)):
        with gzip.open(root / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(d) + "\n" for d in part)
    tokenizer_lib.train_sentencepiece([d["text"] for d in train], root / "tokenizer.model", 384)


def _experiment(root: pathlib.Path, name: str) -> str:
    (root / "target.json").write_text(json.dumps({"name": "arith", "metrics": {"heldout/domain/arith/loss": 1}}))
    lines = [f"DataConfig.{k}_path = '{root / f}'" for k, f in
             (("train", "train.jsonl.gz"), ("heldout", "heldout.jsonl.gz"), ("tokenizer", "tokenizer.model"))]
    lines += ["DataConfig.source = 'jsonl'", "ModelConfig.vocab_size = 0", "ModelConfig.d_model = 16",
              "ModelConfig.num_layers = 1", "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 2",
              "ModelConfig.head_dim = 8", "ModelConfig.mlp_dim = 48", "ModelConfig.max_seq_len = 32",
              "ModelConfig.param_dtype = 'float32'", "ModelConfig.compute_dtype = 'float32'",
              "OptimizerConfig.peak_learning_rate = 1e-2", "OptimizerConfig.schedule = 'cosine'",
              "CheckpointConfig.enabled = False", "TrainConfig.mesh = 'data=8'", "TrainConfig.global_batch_size = 8",
              "TrainConfig.seq_len = 32", "TrainConfig.eval_every = 0", "TrainConfig.log_every = 100",
              f"MixtureExperiment.name = '{name}'", f"MixtureExperiment.output = '{root / 'runs'}'",
              f"MixtureExperiment.target = '{root / 'target.json'}'", "MixtureExperiment.proxies = 6",
              f"MixtureExperiment.proxy_tokens = {8 * 32 * 24}", "MixtureExperiment.seed = 0",
              f"MixtureExperiment.database = '{root / name}.sqlite'"]
    path = root / f"{name}.gin"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtures")
    _corpus(root)
    return root


@pytest.fixture(scope="module")
def planted(corpus):
    """An uninterrupted experiment: (root, experiment file, fit summary)."""
    root = corpus
    path = _experiment(root, "planted")
    assert mixtures_cli.main(["run", "--experiment", path]) == 0
    return root, path, json.loads((root / "runs" / "planted" / "fit.json").read_text())


@pytest.mark.slow
def test_the_proposal_puts_the_most_weight_on_the_target_domain(planted):
    """The target is arith's held-out loss: the proposal gives arith the largest share, and the fitted model
    predicts it better than the natural and the uniform mixture; six proxies were trained and recorded."""
    root, path, fit = planted
    assert fit["proxies"] == 6 and fit["domains"] == ["arith", "code", "web"]
    assert max(fit["proposal"], key=fit["proposal"].get) == "arith"
    assert fit["predicted"]["proposal"] < min(fit["predicted"]["natural"], fit["predicted"]["uniform"])
    # the planted answer is in the measurements: arith's loss falls as its share grows (rank correlation)
    w, y = np.array(fit["weights"]), np.array(fit["targets"])
    assert stats.spearmanr(w[:, 0], y).statistic < -0.8
    assert (root / "runs" / "planted" / "predicted_vs_actual.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_proposal_is_a_config_the_trainer_runs(planted):
    """proposal.gin, layered on the base config, parses into a one-stage mixture schedule equal to the proposal
    and names the experiment."""
    root, path, fit = planted
    proposal = root / "runs" / "planted" / "proposal.gin"
    assert "experiment id: planted" in proposal.read_text()
    base = root / "base.gin"
    base.write_text("\n".join(line for line in pathlib.Path(path).read_text().splitlines()
                              if not line.startswith("MixtureExperiment")) + "\n")
    cfg = config_lib.parse([str(base), str(proposal)], [])
    ((start, weights),) = cfg.data.mixture_schedule
    assert start == 1 and dict(weights) == pytest.approx(fit["proposal"])


@pytest.mark.slow
def test_caps_and_floors_bind_at_refit(planted, capsys):
    """A refit (no training) with a cap on arith gives arith exactly the cap and meets a floor; the earlier
    proposed conclusion is superseded by the new one."""
    root, path, _ = planted
    gin = ["--gin", "MixtureExperiment.caps = (('arith', 0.4),)", "--gin", "MixtureExperiment.floors = (('web', 0.2),)"]
    assert mixtures_cli.main(["fit", "--experiment", path, *gin]) == 0
    fit = json.loads((root / "runs" / "planted" / "fit.json").read_text())
    assert fit["proposal"]["arith"] == pytest.approx(0.4, abs=1e-4)
    assert fit["proposal"]["web"] >= 0.2 - 1e-4
    db = conclusions.ConclusionsDB(str(root / "planted.sqlite"))
    statuses = [c["status"] for c in db.conclusions(experiment_id="planted")]
    assert statuses.count("proposed") == 1 and "superseded" in statuses


@pytest.mark.slow
def test_every_id_of_the_conclusion_resolves(planted):
    """The proposed conclusion's evidence is the experiment and its six proxy runs, each resolving in the
    database to a run whose id is its workdir's run.json run_id, with its data version."""
    root, _, fit = planted
    db = conclusions.ConclusionsDB(str(root / "planted.sqlite"))
    (c,) = [c for c in db.conclusions(experiment_id="planted") if c["status"] == "proposed"]
    kinds = [db.resolve(ref)[0] for ref in c["evidence"]]
    assert kinds.count("run") == 6 and kinds.count("experiment") == 1
    for run in db.runs(experiment_id="planted", role=mixtures.PROXY_ROLE):
        assert json.loads((pathlib.Path(run["workdir"]) / "run.json").read_text())["run_id"] == run["id"]
        assert db.resolve(run["data_version"])[0] == "data_version"


@pytest.mark.slow
def test_a_killed_experiment_resumed_from_the_database_fits_the_same(planted, monkeypatch):
    """The same experiment under another name, killed after its third proxy run, then one proxy run alone
    (``--proxy 5``) and the experiment started again: it trains only the rest and gives the uninterrupted
    experiment's targets and fit."""
    root, _, fit = planted
    path = _experiment(root, "resumed")
    real, calls = mixtures.session.run_training, []

    def dies_after_three(cfg):
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        calls.append(cfg.workdir)
        return real(cfg)

    monkeypatch.setattr(mixtures.session, "run_training", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        mixtures_cli.main(["run", "--experiment", path])
    monkeypatch.setattr(mixtures.session, "run_training", lambda cfg: (calls.append(cfg.workdir), real(cfg))[1])
    # one proxy as its own job (as a scheduler would start it): no fit while others are missing
    assert mixtures_cli.main(["run", "--experiment", path, "--proxy", "5"]) == 0
    assert calls[-1].endswith("proxy-005") and not (root / "runs" / "resumed" / "fit.json").exists()
    assert mixtures_cli.main(["run", "--experiment", path, "--proxy", "6"]) == 2  # there are proxies 0-5
    assert mixtures_cli.main(["run", "--experiment", path]) == 0
    assert len(calls) == 6 and len(set(calls)) == 6  # three before the kill, three after, none twice
    again = json.loads((root / "runs" / "resumed" / "fit.json").read_text())
    np.testing.assert_array_equal(again["weights"], fit["weights"])
    np.testing.assert_array_equal(again["targets"], fit["targets"])
    np.testing.assert_allclose(again["model"]["coef"], fit["model"]["coef"], rtol=1e-12)
    assert again["proposal"] == fit["proposal"]


def test_target_file_and_metric_errors_name_what_is_wrong(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"name": "x", "metrics": {"heldout/domain/web/loss": -1}}))
    with pytest.raises(config_lib.ConfigError, match=r"metrics\['heldout/domain/web/loss'\] = -1"):
        mixtures.Target.load(str(bad))
    t = mixtures.Target("x", {"heldout/domain/web/loss": 1.0, "heldout/domain/code/loss": 3.0})
    assert t.value({"heldout/domain/web/loss": 2.0, "heldout/domain/code/loss": 4.0}) == pytest.approx(3.5)
    with pytest.raises(config_lib.ConfigError, match=r"run r1: no metric\(s\) \['heldout/domain/code/loss'\]"):
        t.value({"heldout/domain/web/loss": 2.0}, "r1")


@pytest.mark.parametrize("binding, message", [
    ("MixtureExperiment.proxies = 3", "proxies = 3: at least 4"),
    ("MixtureExperiment.proxies = 4", "proxies = 4 with 3 domains: at least 5"),
    ("MixtureExperiment.floors = ('web', 0.05)", r"floors = \('web', 0.05\): write \(\('domain', share\), ...\)"),
    ("MixtureExperiment.floors = (('wbe', 0.05),)", "floors: 'wbe' is not a domain of the data"),
    ("MixtureExperiment.floors = (('web', 0.6), ('code', 0.6))", "floors sum to 1.2"),
    ("MixtureExperiment.target = '/nonexistent/target.json'", "MixtureExperiment.target = '/nonexistent/target.json': "
                                                              "no such file"),
])
def test_a_bad_experiment_is_refused_before_any_proxy_trains(corpus, binding, message, capsys, monkeypatch):
    """Settings no fit could use are refused naming the key, before any training (run_training is never called)."""
    path = _experiment(corpus, "refused")
    monkeypatch.setattr(mixtures.session, "run_training", lambda cfg: pytest.fail("trained"))
    assert mixtures_cli.main(["run", "--experiment", path, "--gin", binding]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_target_metric_no_proxy_records_is_refused_before_training(corpus, capsys, monkeypatch):
    path = _experiment(corpus, "typo")
    (corpus / "typo.json").write_text(json.dumps({"name": "t", "metrics": {"heldout/domain/arith/los": 1}}))
    monkeypatch.setattr(mixtures.session, "run_training", lambda cfg: pytest.fail("trained"))
    assert mixtures_cli.main(["run", "--experiment", path, "--gin",
                          f"MixtureExperiment.target = '{corpus / 'typo.json'}'"]) == 2
    assert "target metric(s) ['heldout/domain/arith/los'] are not in a proxy's final record" in capsys.readouterr().err


@pytest.mark.slow
def test_a_changed_training_setting_is_refused_by_name_but_a_new_target_refits(planted, capsys):
    """Proxies of one experiment differ by their mixture alone: a later run with another learning rate is refused
    naming the setting. The target is not a proxy setting: a refit for code's held-out loss moves the proposal to
    code, and a validation judges that proposal by that target."""
    root, path, _ = planted
    assert mixtures_cli.main(["run", "--experiment", path, "--gin", "OptimizerConfig.peak_learning_rate = 0.03"]) == 2
    assert "with other settings (OptimizerConfig.peak_learning_rate)" in capsys.readouterr().err
    (root / "code.json").write_text(json.dumps({"name": "code", "metrics": {"heldout/domain/code/loss": 1}}))
    assert mixtures_cli.main(["fit", "--experiment", path, "--gin", f"MixtureExperiment.target = '{root / 'code.json'}'"]) == 0
    fit = json.loads((root / "runs" / "planted" / "fit.json").read_text())
    assert fit["target"]["name"] == "code" and max(fit["proposal"], key=fit["proposal"].get) == "code"
    assert "target 'code'" in (root / "runs" / "planted" / "proposal.gin").read_text()


@pytest.mark.slow
def test_validation_trains_the_current_proposal_at_the_current_scale(planted, monkeypatch):
    """validate trains proposed, natural and uniform once per seed and settles the conclusions (the claim's status
    is the verdict, the proposal's conclusion takes it, the experiment is completed); run again it trains nothing;
    with another validation budget it trains new runs rather than reading the old ones."""
    root, path, _ = planted
    real, calls = mixtures.session.run_training, []
    monkeypatch.setattr(mixtures.session, "run_training", lambda cfg: (calls.append(cfg.workdir), real(cfg))[1])
    scale = ["--gin", "MixtureExperiment.validation_model = {'d_model': 32, 'head_dim': 16, 'mlp_dim': 96}",
             "--gin", f"MixtureExperiment.validation_tokens = {8 * 32 * 48}"]
    assert mixtures_cli.main(["validate", "--experiment", path, *scale]) == 0
    assert len(calls) == 6
    report = json.loads((root / "runs" / "planted" / "validation.json").read_text())
    assert [len(f["targets"]) for f in report["figures"].values()] == [2, 2, 2]
    f = report["figures"]
    assert [fig["seeds"] for fig in f.values()] == [[0, 1]] * 3
    for other in ("natural", "uniform"):  # paired by seed: the other's target minus the proposal's, seed by seed
        assert report["improvement_by_seed"][other] == {
            str(s): f[other]["targets"][i] - f["proposed"]["targets"][i] for i, s in enumerate((0, 1))}
    assert report["target"] == json.loads((root / "runs" / "planted" / "fit.json").read_text())["target"]["name"]
    assert report["compute_ratio_to_proxy"] > 4  # twice the tokens, about 2.5x the FLOPs per token
    db = conclusions.ConclusionsDB(str(root / "planted.sqlite"))
    for run_id in (i for f in report["figures"].values() for i in f["runs"]):  # realized shares, as a proxy's
        run = db.resolve(run_id)[1]
        shares = {k: v for k, v in run["metrics"].items() if k.startswith(mixtures.REALIZED)}
        last = [r for r in map(json.loads, open(pathlib.Path(run["workdir"]) / "metrics.jsonl"))
                if "mixture/stage_tokens" in r][-1]
        assert shares == {mixtures.REALIZED + d: last[f"mixture/share/{d}"] for d in ("arith", "code", "web")}
        assert abs(sum(shares.values()) - 1) < 1e-6
    kind, claim = db.resolve(report["conclusion"])
    assert kind == "conclusion" and claim["status"] == report["status"]
    proposed = json.loads((root / "runs" / "planted" / "fit.json").read_text())["conclusion"]
    assert proposed in claim["evidence"] and db.resolve(proposed)[1]["status"] == report["status"]
    assert db.experiment("planted")["status"] == "completed"
    assert mixtures_cli.main(["validate", "--experiment", path, *scale]) == 0 and len(calls) == 6
    more = ["--gin", f"MixtureExperiment.validation_tokens = {8 * 32 * 40}"]
    assert mixtures_cli.main(["validate", "--experiment", path, *scale[:2], *more]) == 0 and len(calls) == 12
    again = json.loads((root / "runs" / "planted" / "validation.json").read_text())
    assert not set(again["figures"]["proposed"]["runs"]) & set(report["figures"]["proposed"]["runs"])


# --------------------------------------------------------------------------------------------------
# card targets

#: The card task's held-out loss partner and weights of the card target: arith's loss 1, the task's error 2.
CARD_METRIC = "card/code_next_line/accuracy_norm"


def _card(path: pathlib.Path, domain: str = "code", task: str = "code_next_line") -> str:
    """A card in configs/eval/card_v1.yaml's layout with one next_line task of 16 examples, stamped as a changed card
    is (``python -m jaxpt.tools.evaluate card-stamp``: version 1 and its content hash)."""
    raw = {"name": f"planted-{domain}", "task_set_version": "planted_v1", "seed": 0,
           "sources": {"heldout": "", "train": ""}, "decontamination": {"ngram": 13, "min_words": 8},
           "perplexity": {"group_by": ["domain"], "stride": 0, "batch_size": 16, "core_grouping": "domain",
                          "regression_tolerance": 0.05},
           "decoding": {"strategy": "greedy", "temperature": 0.0, "max_new_tokens": 8, "stop": ["\n"],
                        "batch_size": 8},
           "tasks": {task: {"kind": "next_line", "domain": domain, "max_examples": 16,
                            "template": {"context": "{context}", "choice": "{choice}"},
                            "params": {"num_choices": 4, "context_lines": 2, "min_line_chars": 10,
                                       "max_line_chars": 40},
                            "chance": 0.25, "primary_metric": "accuracy_norm", "threshold": None}}}
    path.write_text("version: 0\ncontent_sha256: ''\n" + yaml.safe_dump(raw, sort_keys=False))
    assert evaluate.main(["card-stamp", str(path)]) == 0
    return str(path)


@pytest.fixture(scope="module")
def card_target(corpus):
    """(card file, target file): arith's held-out loss (weight 1) and the card task's accuracy_norm (weight 2)."""
    card = _card(corpus / "card.yaml")
    target = corpus / "card-target.json"
    target.write_text(json.dumps({"name": "arith+code-lines", "eval_card": card,
                                  "metrics": {"heldout/domain/arith/loss": 1, CARD_METRIC: 2}}))
    return card, str(target)


@pytest.fixture(scope="module")
def carded(corpus, card_target):
    """An experiment of 5 proxies trained for the card target: (experiment file, fit summary, probe-task builds)."""
    path = _experiment(corpus, "carded")
    builds = []
    real = tasks_lib.build_probe_tasks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks_lib, "build_probe_tasks", lambda *a: (builds.append(a[0].name), real(*a))[1])
        assert mixtures_cli.main(["run", "--experiment", path, "--gin", f"MixtureExperiment.target = '{card_target[1]}'",
                              "--gin", "MixtureExperiment.proxies = 5"]) == 0
    return path, json.loads((corpus / "runs" / "carded" / "fit.json").read_text()), builds


def _proxies(corpus, name: str) -> list[dict]:
    db = conclusions.ConclusionsDB(str(corpus / f"{name}.sqlite"))
    return sorted(db.runs(experiment_id=name, role=mixtures.PROXY_ROLE), key=lambda r: r["workdir"])


@pytest.mark.slow
def test_a_card_target_scores_each_proxy_on_the_card_and_weighs_its_error(corpus, card_target, carded, tmp_path):
    """Each proxy's recorded card scores are what `python -m jaxpt.tools.evaluate --no-seqio` reports on its
    checkpoint, the run is linked to the card (name@v1), the examples were built once for the experiment, and each
    proxy's target is (arith loss + 2 (1 - accuracy_norm)) / 3 from the run's own final record and that report."""
    card, _ = card_target
    _, fit, builds = carded
    assert builds == ["planted-code"]  # five proxies and the fit, one build
    assert fit["target"] == {"name": "arith+code-lines", "metrics": {"heldout/domain/arith/loss": 1.0, CARD_METRIC: 2.0},
                             "eval_card": card, "card": "planted-code@v1"}
    runs = _proxies(corpus, "carded")
    assert len(runs) == 5 and fit["runs"] == [r["id"] for r in runs]
    for i, run in enumerate(runs):
        out = tmp_path / f"{i}.json"
        assert evaluate.main(["--workdir", run["workdir"], "--card", card, "--no-seqio", "--output", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["card"]["name"] == "planted-code" and report["card"]["version"] == 1
        task = report["tasks"]["code_next_line"]
        assert task["num_examples"] == 16 and report["checkpoint"]["step"] == run["metrics"]["step"] == 24
        assert run["eval_card"] == "planted-code@v1"
        for score in ("accuracy", "accuracy_norm"):
            assert run["metrics"][f"card/code_next_line/{score}"] == task["metrics"][score]
        final = json.loads((pathlib.Path(run["workdir"]) / "run.json").read_text())["final"]
        expected = (final["heldout/domain/arith/loss"] + 2 * (1 - task["metrics"]["accuracy_norm"])) / 3
        assert fit["targets"][i] == pytest.approx(expected, rel=1e-12)
    assert "planted-code@v1" in [c["id"] for c in conclusions.ConclusionsDB(str(corpus / "carded.sqlite")).eval_cards()]


@pytest.mark.slow
def test_a_refit_with_a_card_target_scores_proxies_trained_without_it(corpus, card_target, carded, monkeypatch):
    """The same five proxies trained for arith's loss alone (checkpoints on), then refit for the card target: the
    fit scores each from its final checkpoint and records what the card experiment recorded, and fits the same
    targets; a second refit scores nothing again."""
    path = _experiment(corpus, "uncarded")
    five = ["--gin", "MixtureExperiment.proxies = 5"]
    assert mixtures_cli.main(["run", "--experiment", path, *five, "--gin", "CheckpointConfig.enabled = True"]) == 0
    assert not any(k.startswith("card/") for r in _proxies(corpus, "uncarded") for k in r["metrics"])
    refit = [*five, "--gin", f"MixtureExperiment.target = '{card_target[1]}'"]
    assert mixtures_cli.main(["fit", "--experiment", path, *refit]) == 0
    runs, reference = _proxies(corpus, "uncarded"), _proxies(corpus, "carded")
    for run, ref in zip(runs, reference, strict=True):
        assert pathlib.Path(run["workdir"]).name == pathlib.Path(ref["workdir"]).name
        assert run["eval_card"] == "planted-code@v1"
        assert {k: v for k, v in run["metrics"].items() if k.startswith("card/")} == \
            {k: v for k, v in ref["metrics"].items() if k.startswith("card/")} != {}
    fit = json.loads((corpus / "runs" / "uncarded" / "fit.json").read_text())
    np.testing.assert_array_equal(fit["targets"], carded[1]["targets"])
    monkeypatch.setattr(mixture_cards, "score_card", lambda *a: pytest.fail("scored again"))
    assert mixtures_cli.main(["fit", "--experiment", path, *refit]) == 0


@pytest.mark.slow
def test_a_validation_of_a_card_target_scores_its_runs_on_the_card(corpus, card_target, carded):
    """Validating the card experiment's proposal (one seed) scores each validation run on the card from its final
    checkpoint, links it to the card, and judges it by the fit's target, error 1 - score included."""
    path = carded[0]
    scale = ["--gin", "MixtureExperiment.proxies = 5", "--gin", "MixtureExperiment.validation_seeds = (0,)",
             "--gin", f"MixtureExperiment.validation_tokens = {8 * 32 * 24}"]
    assert mixtures_cli.main(["validate", "--experiment", path, *scale]) == 0
    report = json.loads((corpus / "runs" / "carded" / "validation.json").read_text())
    db = conclusions.ConclusionsDB(str(corpus / "carded.sqlite"))
    runs = {r["id"]: r for r in db.runs(experiment_id="carded", role=mixtures.VALIDATION_ROLE)}
    assert len(runs) == 3
    for label, figures in report["figures"].items():
        (run_id,) = figures["runs"]
        m = runs[run_id]["metrics"]
        assert runs[run_id]["eval_card"] == "planted-code@v1" and runs[run_id]["role"] == f"validation:{label}"
        assert 0 <= m[CARD_METRIC] <= 1 and "card/code_next_line/accuracy" in m
        assert figures["targets"] == [pytest.approx((m["heldout/domain/arith/loss"] + 2 * (1 - m[CARD_METRIC])) / 3)]


@pytest.mark.slow
def test_a_card_target_over_proxies_without_checkpoints_is_refused_naming_the_run(planted, card_target, capsys,
                                                                                   monkeypatch):
    """The planted proxies trained without checkpoints: a refit or a run for a card target is refused naming a
    proxy run and its workdir, before anything is scored, trained or written."""
    root, path, _ = planted
    fit_before = (root / "runs" / "planted" / "fit.json").read_bytes()
    monkeypatch.setattr(mixtures.session, "run_training", lambda cfg: pytest.fail("trained"))
    monkeypatch.setattr(mixture_cards, "score_card", lambda *a: pytest.fail("scored"))
    target = ["--gin", f"MixtureExperiment.target = '{card_target[1]}'"]
    for cmd in ("fit", "run"):
        assert mixtures_cli.main([cmd, "--experiment", path, *target]) == 2
        err = capsys.readouterr().err
        assert re.search(r"run \S+ \(\S+/runs/planted/proxy-000\): no checkpoint of its final step 24", err), err
    assert (root / "runs" / "planted" / "fit.json").read_bytes() == fit_before
    db = conclusions.ConclusionsDB(str(root / "planted.sqlite"))
    assert all(r["eval_card"] is None for r in db.runs(experiment_id="planted"))


def _bad_card_targets(corpus: pathlib.Path, card: str) -> dict[str, dict]:
    """Target files that name card metrics wrongly, by what is wrong."""
    stale = corpus / "stale-card.yaml"
    stale.write_text(pathlib.Path(card).read_text().replace("max_examples: 16", "max_examples: 17"))
    elsewhere = _card(corpus / "reference-card.yaml", domain="reference", task="reference_lines")
    return {
        "no eval_card": {"metrics": {CARD_METRIC: 1}},
        "no such task": {"eval_card": card, "metrics": {"card/code_lines/accuracy": 1}},
        "not a score": {"eval_card": card, "metrics": {"card/code_next_line/exact_match": 1}},
        "a count": {"eval_card": card, "metrics": {"card/code_next_line/num_examples": 1}},
        "no such card": {"eval_card": str(corpus / "nocard.yaml"), "metrics": {CARD_METRIC: 1}},
        "changed card": {"eval_card": str(stale), "metrics": {CARD_METRIC: 1}},
        "other domain": {"eval_card": elsewhere, "metrics": {"card/reference_lines/accuracy": 1}},
    }


#: (what is wrong, the refusal's message).
CARD_REFUSALS = [
    ("no eval_card", r"metrics \['card/code_next_line/accuracy_norm'\] are eval-card task scores: name the card"),
    ("no such task", r"metrics\['card/code_lines/accuracy'\]: card planted-code v1 \(\S+card.yaml\) has no task "
                     r"'code_lines'; its tasks: \['code_next_line'\]"),
    ("not a score", r"metrics\['card/code_next_line/exact_match'\]: task 'code_next_line' \(next_line\) reports "
                    r"\['accuracy', 'accuracy_norm'\], not 'exact_match'"),
    ("a count", r"task 'code_next_line' \(next_line\) reports \['accuracy', 'accuracy_norm'\], not 'num_examples'"),
    ("no such card", r"eval_card = '\S+nocard.yaml': \S+nocard.yaml: no such card"),
    ("changed card", r"eval_card = '\S+stale-card.yaml': .*content changed since version 1 was stamped"),
    ("other domain", r"task 'reference_lines' of card planted-reference v1 \(\S+\), whose examples come from held-out "
                     r"documents of domain 'reference'; the experiment's held-out data \(\S+heldout.jsonl.gz\) has "
                     r"domains \['arith', 'code', 'web'\]"),
]


@pytest.mark.parametrize("case, message", CARD_REFUSALS, ids=[case for case, _ in CARD_REFUSALS])
def test_a_wrong_card_target_is_refused_before_any_proxy_trains(corpus, card_target, case, message, capsys,
                                                                  monkeypatch):
    """Each mistake in a card target is refused naming the target file and the entry, before anything trains (no
    proxy folder is made)."""
    target = corpus / f"bad-{case.replace(' ', '-')}.json"
    target.write_text(json.dumps({"name": case, **_bad_card_targets(corpus, card_target[0])[case]}))
    path = _experiment(corpus, "refused-card")
    monkeypatch.setattr(mixtures.session, "run_training", lambda cfg: pytest.fail("trained"))
    assert mixtures_cli.main(["run", "--experiment", path, "--gin", f"MixtureExperiment.target = '{target}'"]) == 2
    err = capsys.readouterr().err
    assert f"{target}: " in err and re.search(message, err), err
    assert not list((corpus / "runs").glob("refused-card/proxy-*"))


def test_a_target_file_with_an_unknown_key_is_refused_naming_it(tmp_path):
    target = tmp_path / "t.json"
    target.write_text(json.dumps({"name": "t", "evalcard": "card.yaml", "metrics": {"heldout_loss": 1}}))
    with pytest.raises(ConfigError, match=r"t.json: unknown key\(s\) \['evalcard'\]; a target file has "
                                          r"\['name', 'metrics', 'eval_card'\]"):
        mixtures.Target.load(str(target))


@pytest.mark.parametrize("rho, warned", [(0.44, True), (float("nan"), True), (-0.6, True), (0.8, False),
                                         (0.93, False)])
def test_the_fit_warns_when_it_does_not_rank_unseen_mixtures(rho, warned, capsys):
    summary = {"proxies": 16, "loo_spearman": rho, "model": {"r2": 0.7}, "domains": ["a", "b"],
               "weights": [[0.25, 0.75], [0.5, 0.5]],
               "proposal": {"a": 0.25, "b": 0.75}, "predicted": {"proposal": 1.0, "natural": 1.1, "uniform": 1.2},
               "conclusion": "c0001"}
    mixtures_cli._print_fit(summary)
    out = capsys.readouterr().out
    assert ("warning: leave-one-out Spearman" in out) == warned, out
    assert "proposed: a 0.250, b 0.750" in out


def test_the_fit_warns_when_the_proposal_leaves_the_proxies_range(capsys):
    summary = {"proxies": 3, "loo_spearman": 0.9, "model": {"r2": 0.9}, "domains": ["code", "multilingual"],
               "weights": [[0.5, 0.5], [0.914, 0.086], [0.2, 0.8]], "proposal": {"code": 0.95, "multilingual": 0.05},
               "predicted": {"proposal": 1.0, "natural": 1.1, "uniform": 1.2}, "conclusion": "c0001"}
    assert mixtures.outside_proxies(summary) == {"code": (0.95, 0.2, 0.914), "multilingual": (0.05, 0.086, 0.8)}
    mixtures_cli._print_fit(summary)
    out = capsys.readouterr().out
    assert "warning: the proposal gives multilingual 0.050, outside the proxies' shares (0.086 to 0.800)" in out
    summary["proposal"] = {"code": 0.6, "multilingual": 0.4}
    assert mixtures.outside_proxies(summary) == {}


def test_the_verdict_names_each_mixture_the_proposal_does_not_beat_by_the_seed_spread(capsys):
    report = {"figures": {k: {"mean": m, "spread": 0.065, "runs": ["r1", "r2"]}
                          for k, m in (("proposed", 5.0), ("natural", 5.052), ("uniform", 5.2))},
              "conclusion": "c0004", "improvement_over": {"natural": 0.052, "uniform": 0.2},
              "largest_seed_spread": 0.065, "compute_ratio_to_proxy": 4.2, "status": "refuted",
              "improvement_by_seed": {"natural": {"0": 0.05, "1": 0.054}, "uniform": {"0": 0.19, "1": 0.21}}}
    mixtures_cli._print_validation(report)
    out = capsys.readouterr().out
    assert "not by more than the largest seed spread over: natural (0.0520 <= 0.0650)" in out
    assert ("paired by seed (other - proposed): natural seed 0 +0.0500, seed 1 +0.0540; uniform seed 0 +0.1900, "
            "seed 1 +0.2100") in out
    assert "uniform (" not in out


def test_a_card_metric_enters_the_target_as_its_error():
    """A card score (higher is better) counts as 1 - score in the weighted mean; a target without card metrics
    records what it recorded before card targets (name and metrics alone), with or without an unused card."""
    t = mixtures.Target("x", {"heldout/domain/web/loss": 1.0, CARD_METRIC: 3.0}, "card.yaml")
    assert t.value({"heldout/domain/web/loss": 2.0, CARD_METRIC: 0.25}) == pytest.approx((2.0 + 3 * 0.75) / 4)
    assert t.record() == {"name": "x", "metrics": {"heldout/domain/web/loss": 1.0, CARD_METRIC: 3.0},
                          "eval_card": "card.yaml"}
    assert mixtures.Target.from_record(t.record()) == t
    plain = mixtures.Target("y", {"heldout/domain/web/loss": 1.0}, "card.yaml")
    assert plain.record() == {"name": "y", "metrics": {"heldout/domain/web/loss": 1.0}} and plain.card("t.json") is None


@pytest.mark.slow
def test_an_experiment_without_card_metrics_records_and_trains_as_before(planted):
    """No checkpoint binding, no eval card, no card metric, and the experiment's target is name and metrics alone."""
    root, path, _ = planted
    db = conclusions.ConclusionsDB(str(root / "planted.sqlite"))
    assert db.experiment("planted")["config"]["target"] == {"name": "arith",
                                                             "metrics": {"heldout/domain/arith/loss": 1.0}}
    assert all(r["eval_card"] is None and not any(k.startswith("card/") for k in r["metrics"])
               for r in db.runs(experiment_id="planted"))
    exp, base = mixtures.load_experiment(path)
    b = mixtures.run_bindings(exp, base, "w", ["arith"], np.ones(1), None, 256)
    assert not any(x.startswith("CheckpointConfig") for x in b)
    assert set(json.loads((root / "runs" / "planted" / "fit.json").read_text())["target"]) == {"name", "metrics"}
