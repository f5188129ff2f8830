"""MinHash signatures, LSH banding with verification, and connected components."""

import random

import numpy as np
import pytest

from data_pipelines.steps import normalization, quotas, rules
from data_pipelines import minhash
from data_pipelines.config import QuotaConfig


def _naive_signature(hasher, text):
    """Reference: per-shingle, per-permutation Python loop with the same hash family."""
    h = hasher.shingle_hashes(text)
    mask = (1 << 64) - 1
    sig = []
    for a, b in zip(hasher._a[0].tolist(), hasher._b[0].tolist()):
        sig.append(min(((a * int(x) + b) & mask) >> 32 for x in h.tolist()))
    return np.array(sig, dtype=np.uint32)


def test_vectorized_signature_equals_naive_loop():
    rng = random.Random(0)
    text = " ".join(rng.choice("alpha beta gamma delta eps zeta eta theta iota kappa".split()) for _ in range(5000))
    hasher = minhash.MinHasher(num_perm=16, shingle_size=5, seed=3)
    np.testing.assert_array_equal(hasher.signature(text), _naive_signature(hasher, text))


@pytest.mark.parametrize("overlap", [0.2, 0.5, 0.8, 0.95])
def test_estimated_jaccard_is_close_to_exact(overlap):
    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(5000)]
    base = [rng.choice(vocab) for _ in range(600)]
    other = [w if rng.random() < overlap else rng.choice(vocab) for w in base]
    a, b = " ".join(base), " ".join(other)
    exact = minhash.jaccard(minhash.word_shingles(a, 5), minhash.word_shingles(b, 5))
    hasher = minhash.MinHasher(num_perm=512, shingle_size=5, seed=2)
    est = minhash.estimated_jaccard(hasher.signature(a), hasher.signature(b))
    # Std of the estimate is sqrt(J(1-J)/512) <= 0.022; allow 4 sigma.
    assert abs(est - exact) < 0.09, (exact, est)


def test_short_documents_are_not_collapsed():
    hasher = minhash.MinHasher(num_perm=64, shingle_size=5)
    s1, s2, s3 = hasher.signature("red car"), hasher.signature("blue boat"), hasher.signature("Red  CAR!")
    assert minhash.estimated_jaccard(s1, s2) < 0.1
    assert minhash.estimated_jaccard(s1, s3) == 1.0  # same word sequence
    assert hasher.signature("!!! ...") is None


def test_verification_blocks_band_collisions_and_cc_representative():
    rng = random.Random(5)
    vocab = [f"w{i}" for i in range(3000)]
    base = [rng.choice(vocab) for _ in range(400)]
    near = list(base)
    for i in range(0, 400, 50):
        near[i] = "changed"
    far = base[:120] + [rng.choice(vocab) for _ in range(280)]  # Jaccard ~0.15 with base
    docs = [("a", " ".join(base)), ("b", " ".join(near) + " extra words here"), ("c", " ".join(far))]
    cmap = minhash.near_dedup_in_memory(docs, threshold=0.6)
    assert cmap.get("a") == cmap.get("b") == "b"  # longest text is the representative
    assert "c" not in cmap
    # With verification off (threshold 0) every candidate pair merges.
    cands = set()
    minhash.near_dedup_in_memory(docs, threshold=0.0, bands=128, rows=2, candidates=cands)
    assert ("a", "c") in cands


def test_connected_components_chain_and_rule():
    cmap = minhash.connected_components([("a", "b"), ("b", "c"), ("x", "y")], {"a": 5, "b": 9, "c": 9, "x": 1, "y": 1})
    assert cmap == {"a": "b", "b": "b", "c": "b", "x": "x", "y": "x"}


def test_band_keys_validate():
    with pytest.raises(ValueError, match="exceeds num_perm"):
        minhash.band_keys(np.zeros(10, dtype=np.uint32), 4, 3)


def test_quota_fractions_by_hand():
    cfg = QuotaConfig(targets={"a": 0.5, "b": 0.5}, long_tail_share=0.1, long_tail_floor=1.0)
    chars = {("a", "en"): 900, ("a", "xx"): 50, ("b", "en"): 300}
    f = quotas.quota_keep_fractions(chars, cfg)
    # A_a = 950, A_b = 300 -> T = min(1900, 600) = 600, B_a = 300; floor F = 1.0 * 0.1 * 300 = 30 chars.
    # 'xx' keeps max(50 p, 30), 'en' keeps 900 p: 900 p + 50 p = 300 -> p = 300/950 (50 p = 15.8 < 30, so no),
    # 900 p + 30 = 300 -> p = 270/900 and 'xx' keeps 30 of 50. Domain a keeps exactly its 300.
    assert f == {"a/en": pytest.approx(270 / 900), "a/xx": pytest.approx(30 / 50), "b/en": 1.0}


def test_rule_stats_by_hand():
    st = rules.rule_stats("one two\none two\nthree four five six")
    assert st["n_words"] == 8
    assert st["dup_line_fraction"] == pytest.approx(2 / 3)
    assert st["mean_word_length"] == pytest.approx(sum(map(len, "one two one two three four five six".split())) / 8)


def test_normalize_ascii_fast_path_equals_ftfy():
    import ftfy

    from data_pipelines.config import NormalizeConfig

    rng = random.Random(9)
    alphabet = "abc XYZ 019 .,;:!?'\"()[]{}<>#@*+-=/\\|_~`$%^\n\t"
    specials = ["&amp;", "&lt;b&gt;", "\x1b[31m", "\r\n", "_\x08n", "\x00", "\x7f", "a\x0bb"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        if rng.random() < 0.4:
            text += rng.choice(specials) + text
        assert normalization.normalize(text, NormalizeConfig()) == ftfy.fix_text(text, normalization="NFC"), repr(text)


def test_band_keys_batch_matches_single():
    rng = np.random.default_rng(0)
    sigs = rng.integers(0, 1 << 32, size=(5, 64), dtype=np.uint64).astype(np.uint32)
    batch = minhash.band_keys_batch(sigs, 10, 6)
    for i in range(5):
        np.testing.assert_array_equal(batch[i], minhash.band_keys(sigs[i], 10, 6))


def test_word_length_rule_skips_cjk_text():
    from data_pipelines.config import RuleConfig

    zh = "我们今天去公园散步，天气很好，大家都很高兴。" * 3
    assert np.isnan(rules.rule_stats(zh)["mean_word_length"])
    assert rules.rule_reason(zh, RuleConfig(min_words=5)) is None
    mixed = "The quick brown fox 跳 jumps over"
    assert rules.rule_stats(mixed)["mean_word_length"] == pytest.approx(len("Thequickbrownfoxjumpsover") / 6)
