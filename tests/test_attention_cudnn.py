"""``cudnn`` attention on a CPU host: the arguments it gives ``jax.nn.dot_product_attention``, run by the ``xla``
backend of that same function, equal the ``xla`` implementation (forward and gradients) on packed GQA batches with
padding; which implementation ``cudnn`` and ``auto`` resolve to per platform, and that a fallback is recorded, not
silent. No GPU here: cuDNN's kernel itself never runs in these tests."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpt.util.errors import ConfigError
from jaxpt.model import attention_auto, attention_cudnn, attention_splash, dot_product_attention
from jaxpt.model.attention_xla import attention_mask, xla_attention

from test_attention_blockwise import _inputs, _packed_segments

#: fp32: both compute one softmax over the same masked logits, in different op orders.
RTOL, ATOL = 2e-5, 2e-6


def test_segment_mask_with_causality_is_the_xla_mask():
    """The same-segment mask AND j <= i (what ``is_causal`` adds) is exactly ``attention_mask``, padding included."""
    segs = _packed_segments(3, 33)
    L = segs.shape[1]
    got = attention_cudnn.segment_mask(segs, segs) & jnp.tril(jnp.ones((L, L), bool))
    np.testing.assert_array_equal(got, attention_mask(segs)[:, 0])


@pytest.mark.integration
@pytest.mark.parametrize("H, K", [(4, 2), (8, 1)])
def test_cudnn_arguments_run_by_xla_equal_the_xla_implementation(H, K):
    """Packed rows with padding, GQA (G = 2, 8), L = 40: outputs and the gradients of <out, cot> w.r.t. q, k, v
    agree (fp32, rtol 2e-5, atol 2e-6)."""
    B, L, Hd = 2, 40, 8
    q, k, v, cot = _inputs(B, L, H, K, Hd, seed=H + K)
    segs = _packed_segments(B, L, seed=1)
    assert int(jnp.min(segs)) == 0 and int(jnp.max(segs)) > 2  # padding and several documents

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * cot)

    ref = lambda q, k, v: xla_attention(q, k, v, segs, segs, scale=Hd ** -0.5)[0]  # noqa: E731
    via = lambda q, k, v: attention_cudnn.dot_product_attention_via(  # noqa: E731
        "xla", q, k, v, segs, segs, scale=Hd ** -0.5)
    np.testing.assert_allclose(jax.jit(via)(q, k, v), jax.jit(ref)(q, k, v), rtol=RTOL, atol=ATOL)
    grads = [jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v) for fn in (via, ref)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl, platform, kw, want", [
    ("auto", "gpu", {}, "cudnn"), ("auto", "cuda", {"seq_len": 512}, "cudnn"), ("cudnn", "gpu", {}, "cudnn"),
    ("cudnn", "gpu", {"dtype": "float32"}, "blockwise"), ("cudnn", "gpu", {"dtype": "float32", "seq_len": 512}, "xla"),
    ("auto", "gpu", {"head_dim": 160}, "blockwise"),
    ("auto", "gpu", {"head_dim": 160, "compute_capability": "9.0"}, "cudnn"),
    ("auto", "gpu", {"head_dim": 12}, "blockwise"), ("cudnn", "gpu", {"seq_len": 8191}, "blockwise"),
    ("auto", "tpu", {}, "splash"), ("auto", "cpu", {}, "blockwise"), ("auto", "rocm", {}, "blockwise"),
    ("xla", "gpu", {}, "xla")])
def test_resolution_by_platform_dtype_and_head_dim(impl, platform, kw, want):
    """GPU: cudnn unless its kernel cannot take the shapes (fp32; head_dim not a multiple of 8, or above 128 before
    Hopper; an odd row), then auto's portable choice with a reason; other platforms as before."""
    kw = {"seq_len": 8192, "dtype": "bfloat16", "head_dim": 128, **kw}
    r = attention_auto.resolve(impl, platform, **kw)
    assert r.name == want
    assert bool(r.reason) == (impl in ("auto", "cudnn") and platform in ("gpu", "cuda") and want != "cudnn")


@pytest.mark.parametrize("platform", ["cpu", "tpu", "rocm"])
def test_cudnn_off_a_cuda_gpu_is_a_config_error(platform):
    with pytest.raises(ConfigError, match="ModelConfig.attention_impl = 'cudnn'.*" + platform):
        attention_auto.resolve("cudnn", platform, seq_len=64)


def test_cudnn_traced_on_cpu_raises_config_error():
    q, k, v, _ = _inputs(1, 16, 2, 1, 8)
    with pytest.raises(ConfigError, match="ModelConfig.attention_impl = 'cudnn'"):
        dot_product_attention(q, k, v, jnp.ones((1, 16), jnp.int32), impl="cudnn")


@pytest.fixture
def gpu_platform(monkeypatch):
    """Trace as if for a GPU: the platform is injected and cuDNN's call is run by the xla backend of
    ``jax.nn.dot_product_attention``; returns the list of implementations it was called with."""
    calls = []
    monkeypatch.setattr(attention_splash, "_platform", lambda: ("gpu", None, None))
    real = attention_cudnn.dot_product_attention_via

    def via(implementation, *args, **kw):
        calls.append(implementation)
        return real("xla", *args, **kw)

    monkeypatch.setattr(attention_cudnn, "dot_product_attention_via", via)
    monkeypatch.setattr(attention_auto, "_noted", set())
    return calls


@pytest.mark.integration
@pytest.mark.parametrize("impl", ["auto", "cudnn"])
def test_on_gpu_auto_and_cudnn_call_cudnn_and_say_so(impl, gpu_platform, caplog):
    """bf16 inputs on an (injected) GPU: the cuDNN call is made with implementation='cudnn', its result equals
    xla's (bf16 tolerance), no max logit is reported, and the choice is logged once."""
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in _inputs(2, 32, 4, 2, 8))
    segs = _packed_segments(2, 32)
    with caplog.at_level(logging.INFO, logger="jaxpt.attention"):
        got, aux = jax.jit(lambda *a: dot_product_attention(*a, impl=impl))(q, k, v, segs)
        jax.jit(lambda *a: dot_product_attention(*a, impl=impl))(q, k, v, segs)  # traced again: no second note
    want, _ = jax.jit(lambda *a: dot_product_attention(*a, impl="xla"))(q, k, v, segs)
    assert gpu_platform == ["cudnn", "cudnn"] and aux == {}
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    said = [r for r in caplog.records if r.name == "jaxpt.attention"]
    assert len(said) == 1 and "runs as 'cudnn'" in said[0].getMessage() and said[0].levelno == logging.INFO


def test_on_gpu_fp32_cudnn_falls_back_with_a_warning(gpu_platform, caplog):
    """fp32 compute: cuDNN is not called; xla runs (short row) and equals xla exactly; a warning names the reason."""
    q, k, v, _ = _inputs(2, 32, 4, 2, 8)
    segs = _packed_segments(2, 32)
    with caplog.at_level(logging.INFO, logger="jaxpt.attention"):
        got, aux = jax.jit(lambda *a: dot_product_attention(*a, impl="cudnn"))(q, k, v, segs)
    want, _ = jax.jit(lambda *a: dot_product_attention(*a, impl="xla"))(q, k, v, segs)
    assert gpu_platform == [] and aux == {}
    np.testing.assert_array_equal(got, want)
    said = [r for r in caplog.records if r.name == "jaxpt.attention"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "runs as 'xla'" in said[0].getMessage() and "float32" in said[0].getMessage()


def test_compile_for_cpu_with_cudnn_exits_2_naming_the_key(capsys):
    """``python -m jaxpt.tools.compile`` refuses ``cudnn`` for a CPU target before compiling (exit 2, the key named)."""
    import pathlib
    from jaxpt.tools import compile as compile_lib
    quickstart = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.gin")
    rc = compile_lib.main(["--config", quickstart, "--gin", "ModelConfig.vocab_size = 256", "--gin",
                           "ModelConfig.attention_impl = 'cudnn'", "--topology", "cpu:8"])
    assert rc == 2
    assert "ModelConfig.attention_impl = 'cudnn'" in capsys.readouterr().err
