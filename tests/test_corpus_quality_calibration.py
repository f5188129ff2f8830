"""Quality scores judged against human labels (issue 38): the blind stratified sample, the calibration's rates by
hand, the retention rule, and a build that drops by the calibrated quantiles and says so in its manifest."""

import collections
import json
import os
import random

import numpy as np
import pytest

from data_pipelines import build, calibrate, label_sample, manifest as manifest_lib, testing
from data_pipelines.config import ConfigError, QualityConfig


def _row(i, source, score, good=None, band=None, quantile=None, size=None):
    return {"id": f"{source}/{i}", "source": source, "quality_score": score, "good": good, "band": band,
            "score_quantile": quantile, "stratum_size": size}


# ---------------------------------------------------------------- the sample


def test_quality_sample_is_stratified_by_source_and_band_and_blind(tmp_path):
    rows = []
    for source, n in (("a", 400), ("b", 60)):
        for i in range(n):
            rows.append({"id": f"{source}/{i:04d}", "source": source, "domain": "web", "lang": "en", "n_chars": 5,
                         "verdict": "kept", "quality_score": -float(i)})  # score falls with i: rank = n-1-i
    rows.append({"id": "dup", "source": "a", "domain": "web", "verdict": "exact_dedup:duplicate"})  # never scored
    quant = label_sample.score_quantiles(rows)
    # the lowest score has 1 score at or below it of 400: the build drops it from q = 1/399 on; the highest never
    assert "dup" not in quant and quant["a/0399"] == (1 / 399, 400) and quant["a/0000"] == (400 / 399, 400)
    sample = label_sample.draw_quality(rows, 40, seed=3)
    per = collections.Counter((r["source"], r["band"]) for r in sample)
    # 8 strata (2 sources x 4 bands), 5 each, but b's lowest band holds 2 documents (c / 59 < 0.05: c <= 2): its 3
    # spare labels go to the first open strata in sorted order. Band k holds quantiles in [edges[k], edges[k+1]).
    assert per == {**{(s, b): 5 for s in ("a", "b") for b in range(4)}, ("b", 0): 2, ("a", 0): 6, ("a", 1): 6,
                   ("a", 2): 6}
    edges = label_sample.QUALITY_BANDS
    for r in sample:
        assert edges[r["band"]] <= r["score_quantile"] < edges[r["band"] + 1] or r["band"] == 3
    size_a = collections.Counter(label_sample.quality_band(q) for i, (q, n) in quant.items() if i.startswith("a/"))
    assert size_a == {0: 19, 1: 40, 2: 80, 3: 261}
    assert {r["stratum_size"] for r in sample if r["source"] == "a" and r["band"] == 0} == {19}
    assert [r["band"] for r in sample] != sorted(r["band"] for r in sample)  # file order does not reveal the band
    assert label_sample.draw_quality(rows, 40, seed=3) == sample
    out, key = str(tmp_path / "s.jsonl"), str(tmp_path / "s-key.jsonl")
    label_sample.write_quality_sample(sample, {r["id"]: "word " * 400 for r in sample}, out, key,
                                      build_content_id="abc")
    first = json.loads(open(out).readline())
    assert first["good"] is None and first["text_truncated"] and "quality_score" not in first and "band" not in first
    k = json.loads(open(key).readline())
    assert k["id"] == first["id"] and {"quality_score", "score_quantile", "band", "stratum_size"} <= set(k)
    assert k["build_content_id"] == "abc"


# ---------------------------------------------------------------- the calibration, by hand


def _two_band_source():
    """Source 's': band 0 (quantiles < 0.05) holds 10 documents, 2 labelled, both bad; band 1 holds 190, 4
    labelled: 3 good, 1 bad. Weights: 10/2 = 5 and 190/4 = 47.5."""
    return [_row(0, "s", -9.0, False, 0, 0.00, 10), _row(1, "s", -8.0, False, 0, 0.03, 10),
            _row(2, "s", -5.0, True, 1, 0.30, 190), _row(3, "s", -4.0, True, 1, 0.60, 190),
            _row(4, "s", -3.0, True, 1, 0.90, 190), _row(5, "s", -4.5, False, 1, 0.50, 190)]


def test_rates_are_the_stratified_estimates_computed_by_hand():
    rows = _two_band_source()
    w = calibrate.weights(rows)
    assert w == [5, 5, 47.5, 47.5, 47.5, 47.5]
    r = calibrate.rates_at(rows, w, 0.05)
    # dropped: band 0 (weight 10, all bad). good: 3 * 47.5 = 142.5; bad: 10 + 47.5 = 57.5
    assert r["good_lost"] == 0.0 and r["bad_removed"] == pytest.approx(10 / 57.5)
    assert r["drop_precision"] == 1.0 and r["accuracy"] == pytest.approx((10 + 142.5) / 200)
    assert r["dropped"] == pytest.approx(10 / 200)
    r = calibrate.rates_at(rows, w, 0.55)  # also drops s/2 (good, q .30) and s/5 (bad, q .50)
    assert r["good_lost"] == pytest.approx(47.5 / 142.5) and r["drop_precision"] == pytest.approx(57.5 / 105)
    assert calibrate.rates_at(rows, w, 0.0)["drop_precision"] is None
    # AUC: pairs (good, bad) weighted; every good scores above every bad except s/2 (-5.0) below s/5 (-4.5)
    pairs = [(wg * wb, sg > sb) for sg, wg, g in ((r_["quality_score"], x, r_["good"]) for r_, x in zip(rows, w))
             if g for sb, wb, b in ((r2["quality_score"], y, r2["good"]) for r2, y in zip(rows, w)) if not b]
    want = sum(p for p, ok in pairs if ok) / sum(p for p, _ in pairs)
    assert calibrate.weighted_auc([x["quality_score"] for x in rows], [x["good"] for x in rows], w) == \
        pytest.approx(want)


def test_good_rate_counts_every_labelled_document():
    rows = [dict(r, score_quantile=r["score_quantile"] if r["band"] == 0 else 1.5) for r in _two_band_source()]
    c = calibrate.calibrate_source(rows)  # a source of < 100 documents has quantiles above 1: still counted
    assert c["good_rate"] == pytest.approx(142.5 / 200)


def test_the_rule_takes_the_largest_quantile_within_the_limits():
    c = calibrate.calibrate_source(_two_band_source(), grid=(0.0, 0.05, 0.55), max_good_lost=0.05)
    assert c["drop_quantile"] == 0.05 and c["at_drop_quantile"]["good_lost"] == 0.0  # 0.55 loses a third of good
    loose = calibrate.calibrate_source(_two_band_source(), grid=(0.0, 0.05, 0.55), max_good_lost=0.5)
    assert loose["drop_quantile"] == 0.55  # precision 57.5/105 = 0.548 >= 0.5
    strict = calibrate.calibrate_source(_two_band_source(), grid=(0.0, 0.05, 0.55), max_good_lost=0.5,
                                        min_drop_precision=0.6)
    assert strict["drop_quantile"] == 0.05
    # Two labelled bad documents lie under 0.05; asking for three leaves no quantile > 0 (0.55 loses too much good).
    few = calibrate.calibrate_source(_two_band_source(), grid=(0.0, 0.05, 0.55), min_bad_below=3)
    assert few["drop_quantile"] == 0.0 and few["reason"] == "no grid quantile > 0 meets the rule"
    # A score whose low tail holds good documents drops nothing: the labels flipped, the tail is all good.
    flipped = [dict(r, good=not r["good"]) for r in _two_band_source()]
    c = calibrate.calibrate_source(flipped, grid=(0.0, 0.05, 0.55), max_good_lost=0.5)
    assert c["auc"] < 0.5 and c["drop_quantile"] == 0.0 and c["reason"] == "no grid quantile > 0 meets the rule"
    only_good = [dict(r, good=True) for r in _two_band_source()]
    assert calibrate.calibrate_source(only_good)["drop_quantile"] == 0.0


def test_label_files_are_checked_naming_file_and_line(tmp_path):
    key, labels = tmp_path / "key.jsonl", tmp_path / "labels.jsonl"
    key.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "good"}) + "\n"
                           for r in _two_band_source()))
    good = [{"id": r["id"], "good": r["good"]} for r in _two_band_source()]
    labels.write_text("".join(json.dumps(x) + "\n" for x in good))
    rows = calibrate.read_labels(str(labels), str(key))
    assert [r["good"] for r in rows] == [r["good"] for r in _two_band_source()]
    for bad, msg in ((good[:3] + [dict(good[3], good="yes")] + good[4:], r"labels.jsonl:4: bad_label: 'good' must be"),
                     (good + [good[0]], r"labels.jsonl:7: bad_label: 's/0' is labelled twice"),
                     (good + [{"id": "x", "good": True}], r"labels.jsonl:7: bad_label: 'x' is not in the sample key"),
                     (good[:5], r"1 sample documents have no label"),
                     (good[:2] + [{"id": "s/2", "Good": True}] + good[3:], r"labels.jsonl:3: bad_label: no 'good' "
                                                                            r"field \(the line has \['Good', 'id'\]\)")):
        labels.write_text("".join(json.dumps(x) + "\n" for x in bad))
        with pytest.raises(ConfigError, match=msg):
            calibrate.read_labels(str(labels), str(key))
    labels.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"labels.jsonl:1: "):
        calibrate.read_labels(str(labels), str(key))


# ---------------------------------------------------------------- the build uses it


def _calibration_file(path, quality: QualityConfig, quantiles: dict) -> str:
    cal = {"format": calibrate.FORMAT, "scorer": calibrate.scorer_identity(quality), "label_set": {"documents": 0},
           "rule": {}, "sources": {s: {"drop_quantile": q, "labels": 0, "auc": 0.9} for s, q in quantiles.items()}}
    path.write_text(json.dumps(cal))
    return str(path)


def test_a_calibration_for_another_scorer_or_overlapping_overrides_is_refused(tmp_path):
    q = QualityConfig(reference_sources=("ref",))
    other = QualityConfig(reference_sources=("ref",), version="another-scorer")
    path = _calibration_file(tmp_path / "cal.json", other, {"news": 0.1})
    with pytest.raises(ConfigError, match=r"QualityConfig.calibration: .*cal.json calibrates the scorer"):
        QualityConfig(reference_sources=("ref",), calibration=path).calibrated()
    path = _calibration_file(tmp_path / "cal.json", q, {"news": 0.1})
    with pytest.raises(ConfigError, match=r"per_source_drop_quantile both set the quantile of \['news'\]"):
        QualityConfig(reference_sources=("ref",), calibration=path, per_source_drop_quantile={"news": 0.2}).calibrated()
    with pytest.raises(ConfigError, match=r"QualityConfig.calibration = .*nothing.json.*no such file"):
        QualityConfig(calibration=str(tmp_path / "nothing.json")).calibrated()
    path = _calibration_file(tmp_path / "cal.json", q, {"news": 1.5})
    with pytest.raises(ConfigError, match=r"sources.news.drop_quantile = 1.5 must be in \[0, 1\)"):
        QualityConfig(reference_sources=("ref",), calibration=path).calibrated()
    assert QualityConfig(reference_sources=("ref",), calibration=_calibration_file(
        tmp_path / "cal.json", q, {"news": 0.1}), per_source_drop_quantile={"de": 0.3}).drop_quantiles() == \
        {"news": 0.1, "de": 0.3}


@pytest.mark.slow
def test_the_build_drops_by_the_calibrated_quantiles_and_states_them(tmp_path):
    root = str(tmp_path / "raw")
    testing.make_corpus(root)
    rng = random.Random(7)
    tok = testing.train_tokenizer([testing.prose(rng, testing.EN + testing.DE, 4) for _ in range(200)],
                                  os.path.join(root, "sp"), vocab_size=400)
    gin_path = tmp_path / "build.gin"
    gin_path.write_text(testing.gin_config(root, tok))
    plain = build.load_config([str(gin_path)], [])
    cal = _calibration_file(tmp_path / "cal.json", plain.quality, {"news": 0.3, "de": 0.15, "ref": 0.0})
    cfg = build.load_config([str(gin_path)], [f"QualityConfig.calibration = '{cal}'"])
    out = str(tmp_path / "out")
    m = build.run(cfg, out)
    rows = manifest_lib.read_decisions(out)
    quant = label_sample.score_quantiles(rows)
    by_source = {}
    for source, q in (("news", 0.3), ("de", 0.15), ("ref", 0.0), ("web", plain.quality.drop_quantile)):
        scores = np.sort([r["quality_score"] for r in rows if r["source"] == source
                          and r.get("quality_score") is not None])
        t = np.quantile(scores, q, method="lower") if q > 0 else -np.inf
        dropped = sum(1 for r in rows if r["source"] == source and r["verdict"] == "quality:below_source_quantile")
        assert dropped == int((scores < t).sum()), source
        # what the calibration counts as dropped at q (score_quantile <= q) is what the build dropped, ties included
        assert sum(1 for r in rows if r["source"] == source and r["id"] in quant and q > 0
                   and quant[r["id"]][0] <= q) == dropped, source
        by_source[source] = (dropped, scores)
    assert by_source["news"][0] > 0 and by_source["ref"][0] == 0
    # de's lowest scores tie (documents with no bigram the reference model knows): at 0.15 its threshold is the tied
    # minimum, so the build drops none, and the calibration's quantiles say so too (the case a strict-rank quantile
    # got wrong).
    de_scores = by_source["de"][1]
    assert (de_scores == de_scores[0]).sum() > 0.15 * (len(de_scores) - 1) and by_source["de"][0] == 0
    stage = m["stages"]["quality"]
    assert stage["calibration"]["drop_quantile"] == {"de": 0.15, "news": 0.3, "ref": 0.0}
    assert stage["calibration"]["sha256"] == calibrate.sha256_file(cal)
    assert stage["calibration_by_source"]["news"]["auc"] == 0.9 and stage["version"] == plain.quality.version
    # The calibration is part of what the version is: its content id is that of the same config without it only
    # when the calibration is left out.
    inputs = {"x": "0"}
    assert manifest_lib.config_hash(cfg.to_json(), inputs) != manifest_lib.config_hash(plain.to_json(), inputs)
    assert "calibration" not in plain.to_json()["quality"] and "scorer" not in plain.to_json()["quality"]

    # The same corpus scored by a label-trained classifier: the decision log's scores are the classifier's.
    from data_pipelines import quality_model
    texts, good = _labelled_texts()
    clf = quality_model.train(texts, good)
    clf_path = str(tmp_path / "clf.npz")
    clf.save(clf_path)
    cfg = build.load_config([str(gin_path)], ["QualityConfig.scorer = 'classifier'",
                                              f"QualityConfig.classifier_path = '{clf_path}'"])
    out = str(tmp_path / "out_clf")
    m = build.run(cfg, out)
    assert m["stages"]["quality"]["classifier_sha256"] == clf.sha256
    assert m["stages"]["quality"]["version"] == quality_model.VERSION and "num_buckets" not in m["stages"]["quality"]
    rows = {r["id"]: r for r in manifest_lib.read_decisions(out)}
    news = [r for r in rows.values() if r["source"] == "news" and r.get("quality_score") is not None]
    seen = label_sample.texts_for({r["id"] for r in news}, cfg)  # the text as the filters saw it, read again
    assert len(news) > 10 and set(seen) == {r["id"] for r in news}
    np.testing.assert_allclose([r["quality_score"] for r in news], [clf.score(seen[r["id"]]) for r in news],
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the label-trained classifier


def _labelled_texts(n=120, seed=0):
    """Good: sentences of the synthetic vocabularies; bad: symbol and digit noise. Alternating."""
    rng = random.Random(seed)
    texts, good = [], []
    for i in range(n):
        if i % 2 == 0:
            texts.append(testing.prose(rng, testing.EN + testing.DE, 3))
        else:
            texts.append(" ".join("".join(rng.choice("#$%&*0123456789{}[]") for _ in range(rng.randint(2, 9)))
                                  for _ in range(40)))
        good.append(i % 2 == 0)
    return texts, good


@pytest.mark.integration
def test_the_classifier_learns_the_labels_out_of_fold_and_round_trips(tmp_path):
    from data_pipelines import quality_model
    texts, good = _labelled_texts()
    oof = quality_model.cross_validated_scores(texts, good, ["s"] * len(texts), folds=5)
    assert calibrate.weighted_auc(list(oof), good, [1.0] * len(good)) > 0.95
    model = quality_model.train(texts, good)
    path = str(tmp_path / "clf.npz")
    sha = model.save(path)
    back = quality_model.LabelClassifier.load(path)
    assert back.sha256 == sha == calibrate.sha256_file(path)
    np.testing.assert_allclose(back.scores(texts[:10]), model.scores(texts[:10]), rtol=1e-6)
    assert back.score(texts[0]) > 0 > back.score(texts[1])
    (tmp_path / "junk.npz").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"junk.npz: not a saved quality classifier"):
        quality_model.LabelClassifier.load(str(tmp_path / "junk.npz"))
    with pytest.raises(ConfigError, match=r"QualityConfig.classifier_path: .*junk.npz"):
        QualityConfig(scorer="classifier", classifier_path=str(tmp_path / "junk.npz")).validate()
    with pytest.raises(ConfigError, match=r"QualityConfig.scorer = 'bert' must be"):
        QualityConfig(scorer="bert").validate()
    # A calibration is tied to the classifier file: another classifier's calibration is refused.
    cal = _calibration_file(tmp_path / "cal.json", QualityConfig(scorer="classifier", classifier_path=path),
                            {"s": 0.1})
    assert QualityConfig(scorer="classifier", classifier_path=path, calibration=cal).drop_quantiles() == {"s": 0.1}
    quality_model.train(texts[:60], good[:60]).save(path)
    with pytest.raises(ConfigError, match=r"calibrates the scorer"):
        QualityConfig(scorer="classifier", classifier_path=path, calibration=cal).calibrated()


@pytest.mark.integration
def test_compare_scorers_uses_out_of_fold_scores():
    texts, good = _labelled_texts(100)
    rows = [dict(_row(i, "ab"[i % 4 // 2], float(i % 3), g, 0, 0.5, 50)) for i, g in enumerate(good)]
    cmp = calibrate.compare_scorers(rows, {r["id"]: t for r, t in zip(rows, texts)})
    assert set(cmp) == {"a", "b", "all"} and cmp["all"]["labels"] == 100
    assert cmp["all"]["classifier_auc"] > 0.95 and abs(cmp["all"]["score_auc"] - 0.5) < 0.15  # score i % 3: noise


# ---------------------------------------------------------------- the committed label set and raw-v1's calibration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABELS = os.path.join(REPO, "data", "labels", "raw-v1-quality-1")


def _jsonl_rows(name):
    with open(os.path.join(LABELS, name)) as f:
        return [json.loads(line) for line in f]


def test_the_label_set_is_two_annotators_settled_by_a_third_reading():
    from data_pipelines import review
    a, b = _jsonl_rows("labels_annotator_a.jsonl"), _jsonl_rows("labels_annotator_b.jsonl")
    sample = _jsonl_rows("sample.jsonl")
    assert [r["id"] for r in a] == [r["id"] for r in b] == [r["id"] for r in sample] and len(sample) >= 400
    assert len({r["source"] for r in sample}) == 26 and all(r["good"] is None for r in sample)
    k = review.cohen_kappa({r["id"]: r["good"] for r in a}, {r["id"]: r["good"] for r in b})
    assert k["kappa"] > 0.9 and len(k["disagreements"]) == 2
    third = {r["id"]: r["good"] for r in _jsonl_rows("labels_third_reading.jsonl")}
    assert set(third) == set(k["disagreements"])
    bl = {r["id"]: r["good"] for r in b}
    want = [(r["id"], r["good"] if r["good"] == bl[r["id"]] else third[r["id"]]) for r in a]
    assert [(r["id"], r["good"]) for r in _jsonl_rows("labels_final.jsonl")] == want


def test_raw_v1_calibration_follows_from_the_labels_and_fits_raw_v1s_scorer():
    import gin
    cal_path = os.path.join(LABELS, "calibration.json")
    committed = json.load(open(cal_path))
    rows = calibrate.read_labels(os.path.join(LABELS, "labels_final.jsonl"), os.path.join(LABELS, "sample-key.jsonl"))
    again = calibrate.calibrate(rows, committed["scorer"], committed["label_set"])
    assert again["rule"] == committed["rule"]
    assert {s: c["drop_quantile"] for s, c in again["sources"].items()} == \
        {s: c["drop_quantile"] for s, c in committed["sources"].items()}
    assert committed["label_set"]["labels_sha256"] == calibrate.sha256_file(os.path.join(LABELS, "labels_final.jsonl"))
    assert committed["label_set"]["key_sha256"] == calibrate.sha256_file(os.path.join(LABELS, "sample-key.jsonl"))
    assert committed["label_set"]["build_content_ids"] == [
        "372aab9c9944c3411dd5b6b7e11dcaff9b1cb932d34689d6bd5e5cda3b27f7df"]  # the build in the label set's README
    assert {s: c["drop_quantile"] for s, c in committed["sources"].items() if c["drop_quantile"] > 0} == \
        {"dict-foldoc": 0.02, "dict-jargon": 0.1, "python3.11-doc": 0.1}
    cwd = os.getcwd()
    try:
        os.chdir(REPO)  # raw_v1.gin names the calibration relative to the repository root
        cfg = build.load_config(["configs/data/raw_v1.gin"], ["OutputConfig.tokenizer_path = 'unused.model'"])
        assert cfg.quality.calibrated() == committed
        assert cfg.quality.drop_quantiles()["dict-jargon"] == 0.1
    finally:
        os.chdir(cwd)
        gin.clear_config()  # later tests' configs must not take raw_v1.gin's bindings


def test_cli_refusals_are_one_line_errors_naming_the_problem(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"id": f"d{i}", "good": i % 3 > 0}) + "\n" for i in range(6)))
    b.write_text("".join(json.dumps({"id": f"d{i}", "good": i % 3 > 0}) + "\n" for i in range(5)))
    assert calibrate.main(["--labels", str(a), "--agreement", str(b)]) == 2
    assert "label different documents: 1 ids are in one file only, e.g. ['d5']" in capsys.readouterr().err
    b.write_text(a.read_text())
    assert calibrate.main(["--labels", str(a), "--agreement", str(b)]) == 0
    assert json.loads(capsys.readouterr().out)["kappa"] == 1.0
    assert calibrate.main(["--labels", str(tmp_path / "none.jsonl"), "--agreement", str(b)]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_a_calibration_of_sources_the_build_lacks_is_refused(tmp_path):
    import gin
    root = str(tmp_path)
    gin_path = tmp_path / "build.gin"
    gin_path.write_text(testing.gin_config(root, "unused.model"))
    try:
        plain = build.load_config([str(gin_path)], [])
        cal = _calibration_file(tmp_path / "cal.json", plain.quality, {"news": 0.1, "newz": 0.2})
        with pytest.raises(ConfigError, match=r"calibrates sources this build does not register: \['newz'\]"):
            build.load_config([str(gin_path)], [f"QualityConfig.calibration = '{cal}'"]).registry()
    finally:
        gin.clear_config()
