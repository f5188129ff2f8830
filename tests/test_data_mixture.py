"""jaxpt.data.mixture: token-true shares whatever the shard count, per-group positions across a changed mixture,
staged mixtures, and config errors naming the key."""

import json

import numpy as np
import pytest

from jaxpt.data import mixture
from jaxpt.util.errors import ConfigError

SEQ = 64


def _corpus(sizes: dict[str, list[int]]):
    """Synthetic documents: group -> token lengths. Document i's tokens are ``i * 10_000 + arange(n)``, so each
    token names its document and its offset. Returns domains, sources, fetch, lengths."""
    domains, lengths = [], []
    for g, ls in sorted(sizes.items()):
        domains += [g] * len(ls)
        lengths += ls

    def fetch(i):
        return (i * 10_000 + np.arange(lengths[i])).astype(np.int32), i

    return domains, [""] * len(domains), fetch, lengths


def _iterators(corpus, schedule, num_shards, rows_total=16, seed=0):
    domains, sources, fetch, _ = corpus
    return [mixture.mixture_iterator(domains, sources, fetch, schedule, key="k", seed=seed, shuffle=True, shard=k,
                                     num_shards=num_shards, rows=rows_total // num_shards, seq_len=SEQ)
            for k in range(num_shards)]


def _global_tokens(its, steps, groups):
    """Token counts per group over ``steps`` global batches of all shards (padding excluded)."""
    counts = np.zeros(len(groups), np.int64)
    for _ in range(steps):
        for it in its:
            g = next(it)[mixture.GROUP_KEY]
            counts += np.bincount(g[g >= 0].ravel(), minlength=len(groups))
    return counts


@pytest.mark.parametrize("num_shards", [1, 2, 8])
def test_token_shares_follow_weights_whatever_the_shard_count(num_shards):
    """The issue's smallest case: A is 1 document of 1,000 tokens, B 10 documents of 10 tokens, B's weight 0.091.
    Sampling documents would give B about 10 * 10 / (10 * 10 + 1000 * 10 / ... ) ~ 0.001 of the tokens; the
    token share must be 0.091 (+-1 point) over 2**17 tokens, for 1, 2 and 8 shards (A has fewer documents than
    shards at 2 and 8)."""
    corpus = _corpus({"a": [1000], "b": [10] * 10})
    schedule = mixture.parse_schedule([(1, (("a", 0.909), ("b", 0.091)))])
    steps = 2 ** 17 // (16 * SEQ)
    counts = _global_tokens(_iterators(corpus, schedule, num_shards), steps, ["a", "b"])
    assert counts.sum() == steps * 16 * SEQ  # no padding in an endless stream
    assert counts[1] / counts.sum() == pytest.approx(0.091, abs=0.01)
    # the interleave's own bound: each shard within (groups x seq_len) tokens of each share (mixture docstring)
    assert abs(counts[1] - 0.091 * counts.sum()) <= num_shards * 2 * SEQ


def test_three_groups_skewed_lengths_shares():
    """Three groups with lengths 1..400 tokens (Pareto-like), weights 0.5/0.3/0.2: each within +-1 point over
    2**17 tokens on 8 shards (computed from the batches' group labels, not from the sampler's own counters)."""
    rng = np.random.default_rng(0)
    corpus = _corpus({"x": list(rng.integers(200, 400, 30)), "y": list(rng.integers(1, 20, 500)),
                      "z": list(rng.integers(20, 80, 7))})
    schedule = mixture.parse_schedule([(1, (("x", 5), ("y", 3), ("z", 2)))])
    counts = _global_tokens(_iterators(corpus, schedule, 8), 2 ** 17 // (16 * SEQ), ["x", "y", "z"])
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.2], atol=0.01)
    assert np.abs(counts - np.array([0.5, 0.3, 0.2]) * counts.sum()).max() <= 8 * 3 * SEQ


def _reads(batches, lengths):
    """Per group, the documents in the order the stream started them (a token at offset 0, which the synthetic
    tokens encode, starts a read), and every document's tokens concatenated in stream order."""
    order, tokens = {}, {}
    for b in batches:
        for row_t, row_d, row_g in zip(b["tokens"], b["doc_index"], b[mixture.GROUP_KEY]):
            for t, d, g in zip(row_t, row_d, row_g):
                if d < 0:
                    continue
                if t % 10_000 == 0:
                    order.setdefault(int(g), []).append(int(d))
                tokens.setdefault(int(d), []).append(int(t))
    return order, tokens


def test_resume_with_changed_weights_repeats_and_skips_nothing():
    """Train 7 steps with weights 0.8/0.2, save the state (JSON), resume with 0.2/0.8 (a stage boundary): within
    each group's first epoch no document repeats, none is skipped, and the documents open at the boundary
    continue at their offsets (every document's tokens arrive whole and in order)."""
    sizes = {"a": [37 + 13 * i for i in range(40)], "b": [5 + (7 * i) % 50 for i in range(120)]}
    corpus = _corpus(sizes)
    _, _, _, lengths = corpus
    first = mixture.parse_schedule([(1, (("a", 0.8), ("b", 0.2)))])
    second = mixture.parse_schedule([(1, (("a", 0.2), ("b", 0.8)))])
    it = _iterators(corpus, first, 1)[0]
    batches = [next(it) for _ in range(7)]
    state = json.loads(json.dumps(it.get_state()))
    assert state["open"]  # documents are in progress at the boundary (else the test proves less)
    it2 = _iterators(corpus, second, 1)[0]
    it2.set_state(state)
    batches += [next(it2) for _ in range(30)]
    order, tokens = _reads(batches, lengths)
    start = {"a": 0, "b": 40}
    for gi, g in enumerate(["a", "b"]):
        n = len(sizes[g])
        seen = order[gi][:n]
        assert len(seen) == len(set(seen)), f"group {g}: a document repeats before the epoch ends"
        if len(order[gi]) > n:  # a full epoch was read: it covered every document of the group
            assert sorted(seen) == list(range(start[g], start[g] + n)), f"group {g}: a document was skipped"
    for d, toks in tokens.items():
        first_pass = toks[:lengths[d]]
        np.testing.assert_array_equal(first_pass, d * 10_000 + np.arange(len(first_pass)))
    assert len(order[1]) > len(sizes["b"])  # group b wrapped into its second epoch in this run
    # the second stage follows its own weights: b's share of the tokens after the resume is 0.8
    g = np.concatenate([b[mixture.GROUP_KEY].ravel() for b in batches[7:]])
    assert (g == 1).mean() == pytest.approx(0.8, abs=0.02)


def test_unchanged_weights_resume_bitwise():
    """A state saved and restored (through JSON) with the same weights gives exactly the uninterrupted batches."""
    corpus = _corpus({"a": [300, 17, 90], "b": [3] * 50})
    schedule = mixture.parse_schedule([(1, (("a", 1), ("b", 1))), (6, (("a", 1), ("b", 9)))])
    ref = _iterators(corpus, schedule, 2)[1]
    want = [next(ref) for _ in range(12)]
    it = _iterators(corpus, schedule, 2)[1]
    for _ in range(4):
        next(it)
    again = _iterators(corpus, schedule, 2)[1]
    again.set_state(json.loads(json.dumps(it.get_state())))
    for w, got in zip(want[4:], (next(again) for _ in range(8))):
        for k in w:
            np.testing.assert_array_equal(w[k], got[k])


def test_staged_schedule_switches_at_its_step():
    """Stage 2 starts at step 5: batches 1-4 follow stage 1's weights, 5-12 stage 2's, each by tokens."""
    corpus = _corpus({"a": [50] * 30, "b": [7] * 200})
    schedule = mixture.parse_schedule([(1, (("a", 0.9), ("b", 0.1))), (5, (("a", 0.1), ("b", 0.9)))])
    it = _iterators(corpus, schedule, 1, rows_total=32)[0]
    batches = [next(it)[mixture.GROUP_KEY] for _ in range(12)]
    share_b = lambda bs: (np.concatenate([b.ravel() for b in bs]) == 1).mean()  # noqa: E731
    assert share_b(batches[:4]) == pytest.approx(0.1, abs=0.03)
    assert share_b(batches[5:]) == pytest.approx(0.9, abs=0.03)  # step 5 may finish stage 1's last document


@pytest.mark.parametrize("weights, match", [
    ((("web", -0.5), ("code", 1)), "mixture_weights: weight of 'web' = -0.5"),
    ((("web", float("nan")),), "weight of 'web' = nan"),
    ((("web", 0), ("code", 0.0)), "all weights are 0"),
    ((("web", 1), ("web", 2)), "'web' is given twice"),
    ((("web",),), "is not \\('group', weight\\)"),
])
def test_bad_weights_are_config_errors_naming_the_key(weights, match):
    from jaxpt.config import DataConfig
    with pytest.raises(ConfigError, match=match):
        DataConfig(mixture_weights=weights)


def test_bad_schedules_and_unknown_groups():
    from jaxpt.config import DataConfig
    with pytest.raises(ConfigError, match="mixture_schedule.*starts at step 3"):
        DataConfig(mixture_schedule=((3, (("a", 1),)),))
    with pytest.raises(ConfigError, match="mixture_schedule.*start 1 does not follow 4"):
        DataConfig(mixture_schedule=((1, (("a", 1),)), (4, (("a", 1),)), (1, (("a", 1),))))
    with pytest.raises(ConfigError, match=r"mixture_schedule\[stage at step 4\]: weight of 'b' = -1"):
        DataConfig(mixture_schedule=((1, (("a", 1),)), (4, (("b", -1),))))
    with pytest.raises(ConfigError, match="not a dict"):
        DataConfig(mixture_schedule=((1, {"a": 1}),))
    with pytest.raises(ConfigError, match="not both"):
        DataConfig(mixture_weights=(("a", 1),), mixture_schedule=((1, (("a", 1),)),))
    schedule = mixture.parse_schedule([(1, (("web", 1), ("wbe", 1)))])
    with pytest.raises(ConfigError, match=r"DataConfig.mixture_weights: group 'wbe': no domain 'wbe'.*\['code', 'web'\]"):
        mixture.assign_groups(["web", "code"], ["s", "t"], mixture.group_names(schedule), "DataConfig.mixture_weights")
    with pytest.raises(ConfigError, match="domain 'web' has no source 'zz'.*\\['s'\\]"):
        mixture.assign_groups(["web", "code"], ["s", "t"], ["web/zz"], "K")


def test_source_groups_split_a_domain():
    """'ref/hq' takes that source's documents of the domain; 'ref' takes the rest."""
    members = mixture.assign_groups(["ref", "ref", "ref", "code"], ["hq", "lq", "hq", "x"],
                                    ["code", "ref", "ref/hq"], "K")
    assert members == {"code": [3], "ref": [1], "ref/hq": [0, 2]}


@pytest.mark.slow
def test_staged_sample_run_logs_shares_and_resumes_with_a_new_mixture(prepared_sample, tmp_path):
    """A run on the sample with a two-stage schedule, checkpointed at step 4, then resumed to step 8 with another
    schedule (a changed mixture at a stage boundary): it resumes without error; run.json records each session's
    mixture; metrics.jsonl's ``mixture/share/<group>`` equal the token shares counted independently from the
    same stream (rebuilt from the config); and no document of the log appears in two non-adjacent steps (a
    document split across rows may span adjacent steps; none is read twice)."""
    from conftest import tiny_bindings
    from jaxpt import config as C, train
    from jaxpt.data import stream
    from jaxpt.data.tokenizer import Tokenizer

    first = "((1, (('code', 0.5), ('reference', 0.3), ('multilingual', 0.2))), " \
            "(3, (('code', 0.1), ('reference', 0.1), ('multilingual', 0.8))))"
    second = "((1, (('code', 0.2), ('reference', 0.8))),)"

    from jaxpt.data import documents
    import gzip
    held = tmp_path / "heldout.jsonl.gz"  # three documents: the final full evaluation stays short
    with gzip.open(held, "wt") as f:
        for d in documents.read_documents(prepared_sample / "heldout.jsonl.gz")[:3]:
            f.write(json.dumps(d) + "\n")

    def cfg(schedule, steps):
        return C.parse(["configs/quickstart.gin"], tiny_bindings(
            prepared_sample, tmp_path / "run", **{"DataConfig.mixture_schedule": schedule,
                                                  "DataConfig.heldout_path": repr(str(held)),
                                                  "DataConfig.num_shards": "2",
                                                  "TrainConfig.log_batch_documents": "True",
                                                  "CheckpointConfig.enabled": "True",
                                                  "CheckpointConfig.save_every_steps": "4"}),
            steps=steps, mesh="data=8")

    c1 = cfg(first, 4)
    train.run_training(c1)
    train.run_training(cfg(second, 8))

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shares = {r["step"]: r for r in records if "mixture/stage" in r}
    # independent count: the first session's stream rebuilt from its config, steps 1..4
    tok = Tokenizer.load(c1.data.tokenizer_path)
    batches = stream.train_batches(c1, tok, stream.data_shard_count(c1), first_step=1)
    groups = mixture.group_names(mixture.schedule_from_config(c1.data))
    counts = {0: np.zeros(len(groups)), 1: np.zeros(len(groups))}
    for step in range(1, 5):
        g = next(batches)[mixture.GROUP_KEY]
        counts[0 if step < 3 else 1] += np.bincount(g[g >= 0].ravel(), minlength=len(groups))
    for step, stage in ((2, 0), (4, 1)):
        assert shares[step]["mixture/stage"] == stage
        for i, name in enumerate(groups):
            assert shares[step][f"mixture/share/{name}"] == pytest.approx(counts[stage][i] / counts[stage].sum())
    # the second session's mixture has no multilingual group (a multilingual document open at the boundary waits
    # in the data state for a stage that names the group again): the shares count code and reference only
    assert "mixture/share/multilingual" not in shares[8]
    assert shares[8]["mixture/share/code"] + shares[8]["mixture/share/reference"] == pytest.approx(1.0)

    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [s["mixture"][0]["start_step"] for s in run["sessions"]] == [1, 1]
    assert run["sessions"][0]["mixture"][1] == {"start_step": 3, "weights": {"code": 0.1, "reference": 0.1,
                                                                             "multilingual": 0.8}}
    assert run["sessions"][1]["mixture"][0]["weights"] == {"code": 0.2, "reference": 0.8}

    steps_of: dict[int, list[int]] = {}
    for line in (tmp_path / "run" / "batches" / "process_0.jsonl").read_text().splitlines():
        r = json.loads(line)
        for d in r.get("doc_index", []):
            steps_of.setdefault(d, []).append(r["step"])
    assert max(max(s) for s in steps_of.values()) == 8
    for d, s in steps_of.items():
        assert s == list(range(s[0], s[0] + len(s))), f"document {d} read at steps {s}"


def test_stages_count_steps_not_loader_batches_under_a_batch_size_ramp():
    """With TrainConfig.batch_size_schedule '1:4,3:8' (full batch 8, loader batch 4), steps 1-2 take one loader
    batch and steps 3+ two: loader batches 0, 1, 2, 3, 4, 5 feed steps 1, 2, 3, 3, 4, 4 (counted by hand)."""
    import types
    from jaxpt.data import stream
    cfg = types.SimpleNamespace(batch_size_schedule="1:4,3:8", global_batch_size=8, grad_accum_steps=1,
                                batch_lr_scaling="none")
    step_of = stream._step_of_batch(cfg, 1)
    assert [step_of(b) for b in range(6)] == [1, 2, 3, 3, 4, 4]
    assert stream._step_of_batch(types.SimpleNamespace(batch_size_schedule="", global_batch_size=8,
                                                       grad_accum_steps=1, batch_lr_scaling="none"), 1) is None


def test_preflight_names_an_unknown_group_before_anything_is_written(prepared_sample, tmp_path):
    """A misspelt group (or a source the domain lacks) fails preflight (so ``--dry-run`` too), naming the key,
    the group and what exists; the workdir is not created."""
    from conftest import tiny_bindings
    from jaxpt import config as C
    from jaxpt.run import resolve as preflight
    for weights, words in (("(('referenc', 1.0),)", "no domain 'referenc'"),
                           ("(('reference/dict-nope', 1.0),)", "has no source 'dict-nope'")):
        cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared_sample, tmp_path / "run", **{
            "DataConfig.mixture_weights": weights}))
        with pytest.raises(ConfigError, match=f"DataConfig.mixture_weights: group .*{words}"):
            preflight.resolve(cfg)
    assert not (tmp_path / "run").exists()


def test_an_unreachable_bucket_is_a_config_error_naming_the_key(monkeypatch):
    from jaxpt.util import fs

    from jaxpt.run import resolve as preflight
    def unreachable(path):
        raise OSError("Could not resolve host: storage.googleapis.com")
    monkeypatch.setattr(fs, "exists", unreachable)
    with pytest.raises(ConfigError, match=r"TrainConfig.workdir = 'gs://b/run': cannot reach object storage "
                                          r"\(OSError: Could not resolve host.*STORAGE_EMULATOR_HOST"):
        preflight._check_reachable("TrainConfig.workdir", "gs://b/run")
    preflight._check_reachable("TrainConfig.workdir", "/tmp/local")  # local paths are not probed here
