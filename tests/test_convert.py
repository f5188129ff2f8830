"""Hugging Face in and out (jaxpt.tools.convert): logits of jaxpt and transformers (PyTorch, CPU, fp32) agree within
1e-4 both ways on small random Llama models built here (GQA; tied and untied embeddings; scanned and looped
layers), a SentencePiece tokenizer round-trips through the export, and what cannot be converted is refused.

The reference is transformers' own ``LlamaForCausalLM`` forward pass, an implementation independent of jaxpt's.
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxpt.hf import configs as hf_configs, convert, params as hf_params  # noqa: E402
from jaxpt.hf.families import ConvertError  # noqa: E402

from conftest import hf_logits, jaxpt_logits  # noqa: E402

V, D, N, H, K, F, L = 384, 64, 2, 4, 2, 128, 32

def _hf_model(tmp_path, *, tied: bool, kv_heads: int = K, name="hf", rope_scaling=None):
    """A random LlamaForCausalLM (fp32) saved as safetensors; returns (model, folder)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=N, num_attention_heads=H,
        num_key_value_heads=kv_heads, max_position_embeddings=L, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_theta=10000.0, rope_scaling=rope_scaling, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(cfg).eval().float()
    with torch.no_grad():  # non-trivial norms, so a wrong norm mapping cannot pass
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder

def _tokens(batch=2, seed=1):
    return np.random.default_rng(seed).integers(0, V, size=(batch, L)).astype(np.int32)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}

@pytest.mark.integration
@pytest.mark.parametrize("tied,scan,rope_scaling", [(False, False, None), (True, True, LLAMA3)])
def test_hf_to_jaxpt_logits_match_transformers(tmp_path, tied, scan, rope_scaling):
    """GQA (4 query heads over 2 kv heads), tied or untied embeddings, looped or scanned layers, plain RoPE or
    Llama 3.1's scaling, loaded sharded over data=2,fsdp=2,tensor=2: jaxpt's logits equal transformers' within
    1e-4."""
    import jaxpt
    hf_model, folder = _hf_model(tmp_path, tied=tied, rope_scaling=rope_scaling)
    out = convert.hf_to_jaxpt(folder, tmp_path / "jx", mesh="data=2,fsdp=2,tensor=2", scan_layers=scan)
    r = jaxpt.restore(out, mesh="data=2,fsdp=2,tensor=2", tokenizer_path=_no_tokenizer(tmp_path))
    assert r.step == 0 and r.config.model.tie_embeddings is tied and r.config.model.num_kv_heads == K
    assert r.config.model.rope_scaling == ("llama3" if rope_scaling else "none")
    wq = r.params["blocks"]["attn"]["wq"] if scan else r.params["blocks"][0]["attn"]["wq"]
    assert len(wq[...].sharding.device_set) == 8 and not wq[...].sharding.is_fully_replicated
    tokens = _tokens()
    np.testing.assert_allclose(jaxpt_logits(r, tokens), hf_logits(hf_model, tokens), atol=1e-4, rtol=0)
    gin_text = (tmp_path / "jx" / "model.gin").read_text()
    assert f"ModelConfig.tie_embeddings = {tied}" in gin_text and "ModelConfig.norm_eps = 1e-05" in gin_text

def _no_tokenizer(tmp_path):
    """A SentencePiece model for restore() of a checkpoint converted without one (restore needs a tokenizer)."""
    path = tmp_path / "tok" / "tokenizer.model"
    if not path.exists():
        _train_tokenizer(path)
    return path

def _train_tokenizer(path):
    from jaxpt.data.tokenizer import train_sentencepiece
    texts = [f"The river {w} flows past the {w} mill, number {i}.\n" for i, w in
             enumerate(["north", "south", "old", "new", "green", "stone", "quiet", "bright"] * 20)]
    return train_sentencepiece(texts, path, vocab_size=300)

def _jaxpt_checkpoint(tmp_path, tokenizer_path, **options):
    """A random jaxpt model (GQA, untied, looped layers; not from HF; ``options``: more ModelConfig fields) saved as
    a params-only checkpoint."""
    from flax import nnx

    from jaxpt import mesh as mesh_lib
    from jaxpt.training import state as state_lib
    from jaxpt.data.tokenizer import Tokenizer
    from jaxpt.model import ModelConfig
    cfg = ModelConfig(vocab_size=V, d_model=D, num_layers=N, num_heads=H, num_kv_heads=K, head_dim=D // H,
                      mlp_dim=F, max_seq_len=L, norm_eps=1e-5, rope_theta=1000.0, **options)
    rng = np.random.default_rng(7)  # on the host: no compile per initializer
    params = jax.tree.map(lambda v: v.replace(jax.numpy.asarray(
        1 + 0.3 * rng.standard_normal(v.shape) if len(v.shape) == 1 else 0.2 * rng.standard_normal(v.shape),
        np.float32)), state_lib.abstract_model(cfg)[1], is_leaf=lambda x: isinstance(x, nnx.Variable))
    train_cfg = convert._converted_config(cfg, str(tokenizer_path))
    out = tmp_path / "jaxpt_run"
    convert.write_params_checkpoint(str(out), train_cfg, params, mesh_lib.mesh_from_config({"data": 8}),
                                    Tokenizer.load(tokenizer_path), source={"format": "test"})
    return out

@pytest.mark.integration
def test_jaxpt_to_hf_logits_and_tokenizer(tmp_path):
    """A jaxpt checkpoint (random init, GQA, untied) exports to a folder transformers loads; its logits equal
    jaxpt's within 1e-4, and AutoTokenizer encodes and decodes as jaxpt's SentencePiece tokenizer does."""
    import jaxpt
    tok = _train_tokenizer(tmp_path / "tok" / "tokenizer.model")
    workdir = _jaxpt_checkpoint(tmp_path, tok)
    out = convert.jaxpt_to_hf(workdir, tmp_path / "hf", max_shard_bytes=200_000)  # several files + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    r = jaxpt.restore(workdir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf_model.config.num_key_value_heads == K and not hf_model.config.tie_word_embeddings
    tokens = _tokens()
    np.testing.assert_allclose(hf_logits(hf_model, tokens), jaxpt_logits(r, tokens), atol=1e-4, rtol=0)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = ["The river flows past the mill.", "  two spaces, 12345 digits\nand a newline", "über café"]
    for text in texts:
        ids = r.tokenizer.encode(text).tolist()
        assert hf_tok.encode(text, add_special_tokens=False) == ids, text
        assert hf_tok.decode(ids) == r.tokenizer.decode(ids) == text
    ids = r.tokenizer.encode("a \u2581 b").tolist()  # jaxpt escapes a literal U+2581 to bytes: decodes alike
    assert hf_tok.decode(ids) == r.tokenizer.decode(ids) == "a \u2581 b"
    assert hf_tok.eos_token_id == r.tokenizer.eos_id and hf_tok.pad_token_id == r.tokenizer.pad_id

@pytest.mark.integration
def test_a_mup_model_exports_with_its_output_multiplier_folded_in(tmp_path):
    """µP at m = 4 (d_model 64, base 16): the logits carry 1/4, which the export folds into lm_head, so transformers'
    Llama computes jaxpt's logits within 1e-4 (and the logits are not those of the same params without it); a tied
    µP model cannot carry the multiplier and is refused, naming both keys."""
    import jaxpt
    tok = _train_tokenizer(tmp_path / "tok" / "tokenizer.model")
    workdir = _jaxpt_checkpoint(tmp_path, tok, parametrization="mup", mup_base_d_model=16)
    out = convert.jaxpt_to_hf(workdir, tmp_path / "hf")
    r = jaxpt.restore(workdir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens()
    want = jaxpt_logits(r, tokens)
    np.testing.assert_allclose(hf_logits(hf_model, tokens), want, atol=1e-4, rtol=0)
    sp_workdir = _jaxpt_checkpoint(tmp_path / "sp", tok)   # the same params (same rng), no multiplier
    assert np.abs(jaxpt_logits(jaxpt.restore(sp_workdir), tokens) - 4 * want).max() < 1e-3
    from jaxpt.model import ModelConfig
    with pytest.raises(ConvertError, match="parametrization = 'mup' with ModelConfig.tie_embeddings = True"):
        hf_configs.export_family(ModelConfig(d_model=64, parametrization="mup", mup_base_d_model=16,
                                          tie_embeddings=True))


@pytest.mark.integration
def test_round_trip_through_both_directions(tmp_path):
    """HF -> jaxpt -> HF gives back the same tensors (tied and untied are each their own layout)."""
    from safetensors.numpy import load_file
    hf_model, folder = _hf_model(tmp_path, tied=True, kv_heads=1, name="mqa")
    jx = convert.hf_to_jaxpt(folder, tmp_path / "jx")
    tok = _train_tokenizer(tmp_path / "t" / "tokenizer.model")
    from jaxpt.checkpoint import CheckpointConfig, Checkpointer
    ckpt = Checkpointer(jx, CheckpointConfig(enabled=False), read_only=True)
    meta = ckpt.read_meta(0)
    ckpt.close()
    assert meta["params_only"] and meta["source"]["model_type"] == "llama"
    import jaxpt
    r = jaxpt.restore(jx, tokenizer_path=tok)
    back = hf_params.hf_tensors_from_params(r.params, r.config.model)
    orig = load_file(str(folder / "model.safetensors"))
    assert set(back) == set(orig) - {"lm_head.weight"}
    for name, a in back.items():
        np.testing.assert_array_equal(a, orig[name], err_msg=name)

def test_refusals_name_the_key(tmp_path):
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 128, "vocab_size": 256}
    with pytest.raises(ConvertError, match="model_type = 'gemma'"):
        hf_configs.model_config_from_hf({**base, "model_type": "gemma"})
    with pytest.raises(ConvertError, match="hidden_act = 'gelu'"):
        hf_configs.model_config_from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ConvertError, match="sliding_window = 16"):
        hf_configs.model_config_from_hf({**base, "model_type": "mistral", "sliding_window": 16}, max_seq_len=64)
    m = hf_configs.model_config_from_hf({**base, "model_type": "mistral", "sliding_window": 16,
                                      "max_position_embeddings": 64})
    assert m.max_seq_len == 16 and m.num_kv_heads == 4 and m.head_dim == 16
    m = hf_configs.model_config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                               "original_max_position_embeddings": 8192,
                                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                                      "rope_theta": 500000.0})
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_len, m.rope_theta) == \
        ("llama3", 8.0, 8192, 500000.0)
    with pytest.raises(ConvertError, match="rope_type = 'dynamic'"):
        hf_configs.model_config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
