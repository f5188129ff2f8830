"""Length-extrapolation figures (jaxpt.eval.extrapolation): buckets and the effective length, by hand."""

import numpy as np
import pytest

from jaxpt.eval.extrapolation import bucket_edges, effective_length, length_report


def test_bucket_edges_double_from_the_first():
    assert bucket_edges(512, 64) == [1, 64, 128, 256, 512]
    assert bucket_edges(300, 64) == [1, 64, 128, 256, 300]
    assert bucket_edges(32, 64) == [1, 32]


def test_length_report_means_by_hand():
    # 2 windows of L = 8; nll[w, p] = p (window 0) and p + 1 (window 1); column 0 is not scored.
    nll = np.stack([np.arange(8.0), np.arange(8.0) + 1])
    r = length_report(nll, [1, 4, 8])
    # positions 1..7: mean of 1..7 and 2..8 = (28 + 35) / 14 = 4.5
    assert r["loss"] == pytest.approx(4.5) and r["tokens"] == 14 and r["windows"] == 2
    # tail [4, 8): (4+5+6+7 + 5+6+7+8) / 8 = 6.0; bucket [1, 4): (1+2+3 + 2+3+4) / 6 = 2.5
    assert r["tail_loss"] == pytest.approx(6.0)
    assert r["buckets"] == [{"start": 1, "end": 4, "loss": pytest.approx(2.5), "tokens": 6},
                            {"start": 4, "end": 8, "loss": pytest.approx(6.0), "tokens": 8}]


def test_effective_length_stops_at_the_first_length_out_of_tolerance():
    tails = {128: 2.0, 256: 2.09, 512: 2.2, 1024: 2.0}
    # 2.09 <= 1.05 * 2.0 = 2.1 passes; 2.2 fails, so 1024 (back within) does not count.
    assert effective_length(tails, 128, 0.05) == 256
    assert effective_length(tails, 128, 0.2) == 1024
    assert effective_length(tails, 128, 0.0) == 128
    assert effective_length({128: 2.0, 256: float("nan")}, 128, 0.05) == 128  # a NaN loss is not within
    assert effective_length({256: 2.0}, 128, 0.05) is None  # the trained length was not measured
    with pytest.raises(ValueError, match="tolerance"):
        effective_length(tails, 128, -0.1)
