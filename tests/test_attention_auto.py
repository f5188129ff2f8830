"""``auto`` attention: which implementation each platform and row length gets, and that it computes the same
attention as ``xla`` while declaring no auxiliary output."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpt.model import dot_product_attention
from jaxpt.model.attention_auto import LONG_ROW, choose

from test_attention_blockwise import _inputs, _packed_segments


@pytest.mark.parametrize("platform, seq_len, want", [
    ("tpu", 8192, "splash"), ("tpu", 256, "splash"), ("tpu", 200, "blockwise"), ("tpu", 64, "blockwise"),
    ("cpu", LONG_ROW, "blockwise"), ("cpu", LONG_ROW - 1, "xla"), ("gpu", 8192, "cudnn"), ("gpu", 512, "cudnn"),
    ("rocm", 8192, "blockwise"), ("rocm", 512, "xla")])
def test_auto_choice_by_platform_and_row_length(platform, seq_len, want):
    """TPU: splash for whole 128-multiple blocks; CUDA GPU: cudnn (bf16, head_dim 128); elsewhere blockwise from
    LONG_ROW tokens, xla below."""
    assert choose(platform, seq_len) == want


@pytest.mark.integration
def test_auto_equals_xla_on_cpu_and_reports_no_max_logit():
    q, k, v, _ = _inputs(2, 40, 4, 2, 8)
    segs = _packed_segments(2, 40)
    want, _ = dot_product_attention(q, k, v, segs, impl="xla")
    got, aux = dot_product_attention(q, k, v, segs, impl="auto")
    assert aux == {}
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got.dtype == jnp.float32
