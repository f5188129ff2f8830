"""Model families in and out (jaxpt.tools.convert's family table, ModelConfig.attention_bias / qk_norm).

For each family (Llama 3.2: llama3 RoPE scaling and tied embeddings; Mistral with an explicit head_dim; Qwen2 with
q/k/v biases; Qwen3 with per-head q/k RMSNorm and an explicit head_dim) a tiny random model is built here from its
``transformers`` config class (nothing downloaded), saved, converted in, and its logits compared with transformers'
(an implementation independent of jaxpt's); then exported back and loaded by transformers as the family's own
class, logits compared again; and, slow, trained 10 steps with jaxpt and exported and compared once more. What a
family jaxpt cannot represent carries is refused, naming the key or the tensor. The model options themselves are
checked apart: the KV-cache decoder applies them, weight decay skips them, their params are counted and sharded.
"""

import json
import unicodedata

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpt.model import Decoder, ModelConfig, count_params
from jaxpt.hf import configs as hf_configs, convert, safetensors as hf_st
from jaxpt.hf.families import ConvertError

from conftest import hf_logits, jaxpt_logits, word_documents
from hf_tokenizers import HARD, QWEN2_SPLIT, TEXT, byte_level_bpe

V, D, N, H, K, F, L = 384, 64, 2, 4, 2, 128, 32
MESH = "data=2,fsdp=2,tensor=2"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}
WORDS = ["north", "south", "old", "new", "green", "stone", "quiet", "bright", "river", "mill"]

# family -> (transformers config class name, its kwargs beyond the shared shape, the class transformers loads)
FAMILIES = {
    "llama3.2": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3),
                 "LlamaForCausalLM"),
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=4096), "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", dict(), "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True), "Qwen3ForCausalLM"),
}
# family -> each base's own tokenizer conventions: special tokens (ids 0, 1, ...), the BOS its tokenizer puts before
# every text (None: none), its EOS, and the document boundary conversion must therefore choose.
TOKENIZERS = {
    "llama3.2": (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"], "<|begin_of_text|>",
                 "<|end_of_text|>", "bos_eos"),
    "mistral": (["<unk>", "<s>", "</s>"], "<s>", "</s>", "bos_eos"),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>", "eos"),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>", "eos"),
}


# ------------------------------------------------------------------------------------------ the model options


def _random_model(scan=False, **options):
    cfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                      max_seq_len=32, scan_layers=scan, **options)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(5))))
    rng = np.random.default_rng(5)  # on the host: no compile per initializer; norms and biases non-trivial
    state = jax.tree_util.tree_map_with_path(lambda p, a: jax.numpy.asarray(
        1 + 0.3 * rng.standard_normal(a.shape) if "norm" in jax.tree_util.keystr(p)
        else 0.2 * rng.standard_normal(a.shape), a.dtype), state)
    return nnx.merge(graphdef, state)


def _need_hf():
    """Skip without the ``hf`` extra (torch, transformers, safetensors), which installs nothing on Python >= 3.12.
    Call it before any import of those modules: an import above it fails where the skip was meant."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")


@pytest.mark.parametrize("scan", [False, True])
def test_param_counts_and_no_weight_decay_for_biases_and_qk_norms(scan):
    """count_params equals the real tree's size with both options (the q/k/v biases (H + 2K) Hd and the two
    [Hd] norm scales per layer, counted by hand); the weight-decay mask leaves them undecayed while every
    projection still decays (scanned layers stack them to rank 2 and 3, so rank alone cannot tell)."""
    from jaxpt.training.optim import weight_decay_mask
    plain = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        mlp_dim=64, scan_layers=scan)
    both = ModelConfig(**{**plain.__dict__, "attention_bias": True, "qk_norm": True})
    _, params = nnx.split(nnx.eval_shape(lambda: Decoder(both, rngs=nnx.Rngs(0))), nnx.Param)
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(params)) == count_params(both)["total"]
    assert count_params(both)["total"] - count_params(plain)["total"] == 2 * ((4 + 2 * 2) * 8 + 2 * 8)
    assert count_params(both)["matmul"] == count_params(plain)["matmul"]
    mask = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(weight_decay_mask(params))}
    extra = {k: m for k, m in mask.items() if "_bias" in k or "q_norm" in k or "k_norm" in k}
    assert len(extra) == (5 if scan else 10) and not any(extra.values()), extra
    assert all(m for k, m in mask.items() if "'w" in k), mask


def test_bias_params_are_sharded_like_the_projections_heads():
    """q_bias [H, Hd] goes over ``tensor`` as wq's heads axis does; k/v biases as wk's kv heads."""
    from jaxpt import mesh as mesh_lib
    from jaxpt.training import state as state_lib
    cfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, attention_bias=True, qk_norm=True)
    _, abstract = state_lib.abstract_model(cfg)
    shardings = state_lib.param_shardings(abstract, mesh_lib.mesh_from_config(MESH), mesh_lib.DEFAULT_RULES)
    attn = shardings["blocks"][0]["attn"]
    spec = lambda v: tuple(getattr(v, "value", v).spec)  # noqa: E731
    assert spec(attn["q_bias"])[0] == spec(attn["wq"])[1] == "tensor"
    assert spec(attn["k_bias"])[0] == spec(attn["wk"])[1]


@pytest.mark.integration
@pytest.mark.parametrize("options", [{"attention_bias": True}, {"qk_norm": True}])
def test_the_kv_cache_decoder_applies_bias_and_qk_norm(options):
    """Cached decoding (prefill and extends at each row's own position) equals the cache-free forward of a model
    with the option: a decode path that skipped it would differ."""
    from jaxpt.infer import decode
    from jaxpt.infer.kv_cache import KVCacheStep
    model = _random_model(**options)
    prompts = [np.random.default_rng(i).integers(3, 128, size=n).astype(np.int32) for i, n in enumerate((1, 9, 4))]
    ref = decode.NoCacheStep.from_model(model, None, seq_len=32, batch_size=3)
    got = KVCacheStep.from_model(model, None, seq_len=32, batch_size=3)
    (s_ref, l_ref), (s_got, l_got) = ref.prefill(prompts), got.prefill(prompts)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-5)
    for _ in range(3):
        tokens = np.argmax(l_ref, axis=-1).astype(np.int32)
        (s_ref, l_ref), (s_got, l_got) = ref.extend(s_ref, tokens), got.extend(s_got, tokens)
        np.testing.assert_allclose(l_got, l_ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ families in and out


def _tokenizer_files(family, folder):
    """The family's byte-level BPE ``tokenizer.json`` (trained here, 300 ids: fewer than the model's V, so the
    vocabulary is padded as real bases' often is) and a ``tokenizer_config.json`` naming its special tokens as the
    base's own files do. Returns the (bos, eos) ids."""
    specials, bos, eos, _ = TOKENIZERS[family]
    text = TEXT + " ".join(WORDS * 30)
    # Qwen's tokenizer.json has its own split regex and an NFC normalizer; transformers 5 loads a qwen2/qwen3 folder
    # with its Qwen2Tokenizer, which normalises to NFC whatever the file says (checked: without it, e + U+0301 differ)
    qwen = family.startswith("qwen")
    byte_level_bpe(specials, bos_template=bos, vocab_size=300, text=text, nfc=qwen,
                   **({"split": QWEN2_SPLIT} if qwen else {})).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "add_bos_token": bos is not None}))
    return (specials.index(bos) if bos else None), specials.index(eos)


def _hf_model(family, folder):
    """A random fp32 model of ``family`` saved with save_pretrained (norms and biases made non-trivial, so a wrong
    mapping of either cannot pass), with the family's tokenizer files. Returns the model."""
    import torch
    import transformers
    cls_name, extra, _ = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    bos_id, eos_id = _tokenizer_files(family, folder)
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=N, num_attention_heads=H,
        num_key_value_heads=K, max_position_embeddings=L, rms_norm_eps=1e-5, initializer_range=0.2,
        bos_token_id=bos_id, eos_token_id=eos_id, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().float()
    with torch.no_grad():  # norms and biases non-trivial, so a wrong mapping of either cannot pass
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _check_tokenizers(family, hf_folder, converted, exported):
    """The converted model's tokenizer (jaxpt's HF backend) gives the base's ids on the hard strings, as the base's
    own fast tokenizer and the export's AutoTokenizer do, and decodes them back exactly; model.gin sets the family's
    document boundary, and the export's tokenizer puts BOS before a text exactly when that boundary does."""
    import transformers
    from jaxpt.data.tokenizer import Tokenizer
    _, bos, eos, boundary = TOKENIZERS[family]
    assert f"DataConfig.document_boundary = '{boundary}'" in (converted / "model.gin").read_text()
    ours = Tokenizer.load(converted / "tokenizer.json")
    base = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_folder))
    back = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert ours.eos_id == base.convert_tokens_to_ids(eos) and ours.bos_id == (
        base.convert_tokens_to_ids(bos) if bos else -1)
    for s in HARD:
        ids = ours.encode(s).tolist()
        assert ids == base(s, add_special_tokens=False)["input_ids"] == back(s, add_special_tokens=False)["input_ids"]
        # exact, but for the NFC normalizer of Qwen's tokenizer (it keeps the NFC form of the text)
        assert ours.decode(ids) == (unicodedata.normalize("NFC", s) if family.startswith("qwen") else s)
        assert back(s)["input_ids"] == ([ours.bos_id] if bos else []) + ids


def _tokens(seed=1):
    return np.random.default_rng(seed).integers(0, V, size=(2, L)).astype(np.int32)


def _export_and_compare(workdir, out, family, want_logits, tokens):
    """Export ``workdir``, load it with transformers: the family's class, and logits within 1e-4 of ``want``."""
    import torch
    import transformers
    convert.jaxpt_to_hf(workdir, out)
    hf_cfg = json.loads((out / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded).__name__ == FAMILIES[family][2] == hf_cfg["architectures"][0]
    np.testing.assert_allclose(hf_logits(loaded, tokens), want_logits, atol=1e-4, rtol=0)
    return loaded


@pytest.mark.integration
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_and_out_logits_match_transformers(family, tmp_path):
    """Converted in (sharded over data=2,fsdp=2,tensor=2): jaxpt's logits equal transformers' within 1e-4 (fp32);
    exported back: transformers loads the family's own class, whose logits equal the original's within 1e-4; the
    base's tokenizer.json travels both ways with equal ids (:func:`_check_tokenizers`)."""
    import jaxpt
    _need_hf()
    hf_model = _hf_model(family, tmp_path / "hf")
    out = convert.hf_to_jaxpt(tmp_path / "hf", tmp_path / "jx", mesh=MESH)
    r = jaxpt.restore(out, mesh=MESH)
    m = r.config.model
    assert (m.attention_bias, m.qk_norm) == (family == "qwen2", family == "qwen3")
    assert m.head_dim == FAMILIES[family][1].get("head_dim", D // H)
    tokens = _tokens()
    want = hf_logits(hf_model, tokens)
    np.testing.assert_allclose(jaxpt_logits(r, tokens), want, atol=1e-4, rtol=0)
    _export_and_compare(out, tmp_path / "back", family, want, tokens)
    _check_tokenizers(family, tmp_path / "hf", tmp_path / "jx", tmp_path / "back")


def _jsonl(path, n, seed):
    return word_documents(path, n, seed, WORDS, 25)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trained_10_steps_exports_and_matches(family, tmp_path):
    """Converted, continued for 10 steps with jaxpt (fresh AdamW, lr 1e-3), exported: transformers loads the
    family's class (Mistral known from the run's recorded source) and its logits equal the trained jaxpt model's
    within 1e-4, which moved away from the base model's (so the comparison sees the trained params)."""
    import jaxpt
    from jaxpt import config as C, train
    _need_hf()
    hf_model = _hf_model(family, tmp_path / "hf")
    base = convert.hf_to_jaxpt(tmp_path / "hf", tmp_path / "base", mesh=MESH)
    data = tmp_path / "data"
    data.mkdir()
    b = {"DataConfig.train_path": repr(str(_jsonl(data / "train.jsonl.gz", 200, 1))),
         "DataConfig.heldout_path": repr(str(_jsonl(data / "heldout.jsonl.gz", 20, 2))),
         "TrainConfig.init_from": repr(str(base)), "TrainConfig.seq_len": str(L),
         "TrainConfig.global_batch_size": "8", "TrainConfig.eval_every": "0", "TrainConfig.eval_batches": "1",
         "TrainConfig.progress_bar": "False", "TrainConfig.stage_name": "'continued'",
         "OptimizerConfig.schedule": "'constant'", "OptimizerConfig.warmup_steps": "1",
         "OptimizerConfig.decay_steps": "0", "OptimizerConfig.peak_learning_rate": "1e-3"}
    workdir = tmp_path / "run"
    cfg = C.parse([str(tmp_path / "base" / "model.gin")], [f"{k} = {v}" for k, v in b.items()],
                  workdir=str(workdir), steps=10, mesh=MESH)
    train.run_training(cfg)
    r = jaxpt.restore(workdir, mesh=MESH)
    assert r.step == 10
    tokens = _tokens(2)
    trained = jaxpt_logits(r, tokens)
    assert np.abs(trained - hf_logits(hf_model, tokens)).max() > 1e-2
    _export_and_compare(workdir, tmp_path / "back", family, trained, tokens)


# ------------------------------------------------------------------------------------------ refusals


BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 256}


@pytest.mark.parametrize("hf, message", [
    ({"model_type": "gemma"}, r"model_type = 'gemma': jaxpt's model lacks a GeGLU MLP"),
    ({"model_type": "phi3"}, r"model_type = 'phi3': .*fused qkv_proj"),
    ({"model_type": "mixtral"}, r"model_type = 'mixtral': .*mixture-of-experts"),
    ({"model_type": "falcon"}, r"model_type = 'falcon': jaxpt reads \('llama', 'mistral', 'qwen2', 'qwen3'\)"),
    ({"model_type": "llama", "attention_bias": True}, r"attention_bias = True: .*o_proj"),
    ({"model_type": "qwen3", "head_dim": 16, "attention_bias": True}, r"attention_bias = True: .*o_proj"),
    ({"model_type": "qwen2", "mlp_bias": True}, r"mlp_bias = True"),
    ({"model_type": "qwen3"}, r"no head_dim"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, r"partial_rotary_factor = 0.5"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0,
      "max_position_embeddings": 64, "_max_seq_len": 64}, r"sliding_window = 16: .*--max-seq-len 64"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["full_attention", "chunked_attention"]}, r"layer_types has \['chunked_attention'\]"),
])
def test_refusals_name_what_is_missing(hf, message):
    hf = dict(hf)
    max_seq_len = hf.pop("_max_seq_len", 0)
    with pytest.raises(ConvertError, match=message):
        hf_configs.model_config_from_hf({**BASE, **hf}, max_seq_len=max_seq_len)


def test_sliding_windows_as_each_family_switches_them():
    """Qwen2's window counts only with use_sliding_window and for layers >= max_window_layers (then max_seq_len
    defaults to the window); Mistral's whenever set; Llama has none."""
    q = {**BASE, "model_type": "qwen2", "sliding_window": 16, "max_position_embeddings": 64}
    assert hf_configs.model_config_from_hf(q).max_seq_len == 64                       # use_sliding_window off
    on = {**q, "use_sliding_window": True}
    assert hf_configs.model_config_from_hf({**on, "max_window_layers": 2}).max_seq_len == 64   # no layer slides
    assert hf_configs.model_config_from_hf({**on, "max_window_layers": 1}).max_seq_len == 16
    assert hf_configs.model_config_from_hf({**on, "layer_types": ["full_attention"] * 2}).max_seq_len == 64
    m = {**BASE, "model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 64}
    assert hf_configs.model_config_from_hf(m).max_seq_len == 16
    assert hf_configs.model_config_from_hf({**m, "sliding_window": None}).max_seq_len == 64
    assert hf_configs.model_config_from_hf({**m, "model_type": "llama"}).max_seq_len == 64


@pytest.mark.parametrize("family, edit, message", [
    ("llama3.2", lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
     r"1 tensor\(s\) that the config.json does not announce .*model.layers.0.self_attn.q_proj.bias"),
    ("qwen2", lambda t: t.update({"model.layers.1.self_attn.o_proj.bias": np.zeros(64, np.float32)}),
     r"model.layers.1.self_attn.o_proj.bias"),
    ("qwen3", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
     r"1 tensor\(s\) the config.json implies are missing: model.layers.1.self_attn.k_norm.weight"),
    ("llama3.2", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}), r"lm_head.weight"),
])
def test_tensors_the_mapping_would_drop_or_lacks_are_refused(family, edit, message, tmp_path):
    """An unannounced bias (on a Llama; an o_proj bias on a Qwen2), a missing q/k norm and a tied model's
    lm_head that differs from its embedding are refused at conversion, naming the tensor."""
    _need_hf()
    from safetensors.numpy import load_file, save_file
    _hf_model(family, tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=message):
        convert.hf_to_jaxpt(tmp_path / "hf", tmp_path / "jx", mesh=MESH)


def test_a_tied_lm_head_equal_to_the_embedding_and_rope_buffers_are_accepted(tmp_path):
    """A tied checkpoint that also stores lm_head (equal to the embedding) and RoPE's inv_freq buffers converts:
    neither is a parameter the mapping would lose."""
    _need_hf()
    from safetensors.numpy import load_file, save_file
    _hf_model("qwen3", tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = hf_configs.model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()),
                                       tensors=hf_st.SafetensorsFolder(tmp_path / "hf"))
    assert cfg.tie_embeddings and cfg.qk_norm


def test_export_refuses_bias_with_qk_norm():
    cfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, attention_bias=True, qk_norm=True)
    with pytest.raises(ConvertError, match="attention_bias = True with ModelConfig.qk_norm = True"):
        hf_configs.hf_config_from_model(cfg)
    assert hf_configs.hf_config_from_model(ModelConfig(), source_model_type="mistral")["model_type"] == "mistral"
    assert hf_configs.hf_config_from_model(ModelConfig())["architectures"] == ["LlamaForCausalLM"]
