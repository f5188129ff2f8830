"""The tokenizer seam (jaxpt.data.tokenizer.Tokenizer.load): a Hugging Face byte-level BPE ``tokenizer.json`` and a
SentencePiece model behind one interface, and the document-boundary policy (jaxpt.data.boundary).

Every tokenizer is trained here on a few KB of text (nothing downloaded). The reference for ids is transformers'
own fast tokenizer loaded from the same folder (``add_special_tokens=False``), an implementation independent of
jaxpt's wrapper; the reference for packed rows and held-out windows is the token arrays written out by hand.
"""

import gzip
import hashlib
import json

import numpy as np
import pytest

from jaxpt import config as config_lib
from jaxpt.data import boundary, hf_tokenizer, loader, mixture, packing
from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.data.tokenizer import SentencePieceTokenizer, Tokenizer
from jaxpt.util.errors import ConfigError

from hf_tokenizers import HARD, TEXT, byte_level_bpe

tokenizers = pytest.importorskip("tokenizers")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """A Llama-3-style folder: tokenizer.json (post-processor adds BOS), config.json naming BOS/EOS ids, and a
    tokenizer_config.json whose eos_token disagrees (config.json wins)."""
    d = tmp_path_factory.mktemp("llama3")
    tok = byte_level_bpe([BOS, EOS, "<|reserved_0|>"], bos_template=BOS)
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 0, "eos_token_id": 1}))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": "<|reserved_0|>"}))
    return d


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A Qwen2-style folder: no BOS, EOS <|endoftext|> from tokenizer_config.json, a ByteLevel post-processor."""
    d = tmp_path_factory.mktemp("qwen")
    tok = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|endoftext|>",
                                                         "pad_token": "<|endoftext|>", "add_bos_token": False}))
    return d


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    return Tokenizer.load(tokenizer_lib.train_sentencepiece(TEXT.splitlines(keepends=True), path, vocab_size=300))


def _hf_fast(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------- the seam


def test_load_picks_the_backend_from_the_file(llama3_dir, sp_tok):
    """JSON -> the tokenizers backend; a SentencePiece proto -> the SentencePiece backend; both are Tokenizers."""
    hf = Tokenizer.load(llama3_dir / "tokenizer.json")
    assert isinstance(hf, hf_tokenizer.HFTokenizer) and isinstance(hf, Tokenizer) and hf.kind == "huggingface"
    assert isinstance(sp_tok, SentencePieceTokenizer) and isinstance(sp_tok, Tokenizer)
    assert tokenizer_lib.load(sp_tok.path).sha256 == sp_tok.sha256


def test_ids_equal_transformers_fast_tokenizer_on_hard_strings(llama3_dir):
    """jaxpt's ids of every hard string equal transformers' (add_special_tokens=False), as int32 arrays."""
    tok = Tokenizer.load(llama3_dir / "tokenizer.json")
    hf = _hf_fast(llama3_dir)
    for s in HARD:
        ids = tok.encode(s)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert ids.tolist() == hf(s, add_special_tokens=False)["input_ids"], s
    batch = tok.encode_batch(HARD)
    assert [b.tolist() for b in batch] == [tok.encode(s).tolist() for s in HARD]


@pytest.mark.parametrize("backend", ["huggingface", "sentencepiece"])
def test_decode_round_trips_exactly(backend, llama3_dir, sp_tok):
    """decode(encode(s)) == s for every hard string, for both backends (the SentencePiece model is jaxpt's
    byte-fallback one, which promises it: lossless_problems() == [])."""
    tok = Tokenizer.load(llama3_dir / "tokenizer.json") if backend == "huggingface" else sp_tok
    assert tok.lossless_problems() == []
    for s in HARD + ["a literal <|end_of_text|> in a document"]:
        assert tok.decode(tok.encode(s)) == s, s


def test_a_literal_special_token_string_is_text(llama3_dir):
    """A document typing "<|end_of_text|>" cannot forge an EOS: it is encoded as text (transformers'
    split_special_tokens=True gives the same ids), and the plain ids never contain the EOS id."""
    tok = Tokenizer.load(llama3_dir / "tokenizer.json")
    s = "before <|end_of_text|> after"
    ids = tok.encode(s).tolist()
    assert tok.eos_id not in ids
    transformers = pytest.importorskip("transformers")
    split = transformers.PreTrainedTokenizerFast.from_pretrained(str(llama3_dir), split_special_tokens=True)
    assert ids == split(s, add_special_tokens=False)["input_ids"]


def test_special_tokens_come_from_the_models_own_files(llama3_dir, qwen_dir, tmp_path):
    """config.json's ids win over tokenizer_config.json; Qwen has no BOS and pads with its EOS; a list of EOS ids
    gives its first; the Llama post-processor's BOS is its document-start convention."""
    l3 = Tokenizer.load(llama3_dir / "tokenizer.json")
    assert (l3.bos_id, l3.eos_id, l3.pad_id, l3.unk_id, l3.adds_bos) == (0, 1, 1, -1, True)
    assert l3.special_tokens.sources["eos"] == "config.json eos_token_id"
    qw = Tokenizer.load(qwen_dir / "tokenizer.json")
    assert (qw.bos_id, qw.eos_id, qw.pad_id, qw.adds_bos) == (-1, 0, 0, False)
    d = tmp_path / "instruct"
    d.mkdir()
    (d / "tokenizer.json").write_text((llama3_dir / "tokenizer.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [2, 1]}))
    assert Tokenizer.load(d / "tokenizer.json").eos_id == 2


def test_sha256_covers_special_choices_not_formatting(llama3_dir, tmp_path):
    """Another EOS choice is another identity; a copy written by jaxpt (its post-processor set, another JSON
    layout) keeps the identity and the ids."""
    tok = Tokenizer.load(llama3_dir / "tokenizer.json")
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((llama3_dir / "tokenizer.json").read_text())
    (other / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 2}))
    assert Tokenizer.load(other / "tokenizer.json").sha256 != tok.sha256
    copy = Tokenizer.load(tok.write(str(tmp_path / "copy"), add_bos_token=False))
    assert copy.sha256 == tok.sha256 and copy.adds_bos is False
    assert all(copy.encode(s).tolist() == tok.encode(s).tolist() for s in HARD)
    import pickle
    assert pickle.loads(pickle.dumps(tok)).encode(HARD[-2]).tolist() == tok.encode(HARD[-2]).tolist()


def test_refusals_name_the_file(tmp_path, llama3_dir, sp_tok):
    """No EOS determinable: the error names the tokenizer.json, tokenizer_config.json and eos_token (and the run
    refuses it under DataConfig.tokenizer_path); jaxpt's own tokenizer record and seqio are refused by name."""
    d = tmp_path / "noeos"
    d.mkdir()
    (d / "tokenizer.json").write_text((llama3_dir / "tokenizer.json").read_text())
    with pytest.raises(ValueError) as e:
        Tokenizer.load(d / "tokenizer.json")
    msg = str(e.value)
    assert str(d / "tokenizer.json") in msg and "tokenizer_config.json" in msg and '"eos_token"' in msg
    assert EOS in msg  # the special tokens it has, as candidates
    from jaxpt.run import resolve
    cfg = config_lib.parse([], [f"DataConfig.tokenizer_path = {str(d / 'tokenizer.json')!r}"])
    with pytest.raises(ConfigError, match="DataConfig.tokenizer_path"):
        resolve.load_tokenizer(cfg)
    record = tmp_path / "rec" / "tokenizer.json"
    record.parent.mkdir()
    record.write_text(json.dumps({"format_version": 1, "tokenizer": {"file": "tokenizer.model"}}))
    with pytest.raises(ValueError, match="data_pipelines.tokenizer"):
        Tokenizer.load(record)
    with pytest.raises(ValueError, match="--no-seqio"):
        Tokenizer.load(llama3_dir / "tokenizer.json").as_seqio_vocabulary()


# -------------------------------------------------------------------------------------- the boundary policy


def test_the_policy_is_a_config_value_and_add_eos_still_reads():
    assert config_lib.DataConfig().document_boundary == "eos"
    assert config_lib.DataConfig(add_eos=False).document_boundary == "none"
    assert config_lib.DataConfig(add_eos=False, document_boundary="bos_eos").document_boundary == "bos"
    cfg = config_lib.parse([], ["DataConfig.add_eos = False"])  # a config written before the policy
    assert cfg.data.document_boundary == "none"
    with pytest.raises(ConfigError, match="DataConfig.document_boundary"):
        config_lib.DataConfig(document_boundary="eos_bos")


def test_a_policy_the_tokenizer_cannot_serve_is_refused(qwen_dir):
    qwen = Tokenizer.load(qwen_dir / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"DataConfig.document_boundary = 'bos_eos'.*has none"):
        boundary.for_tokenizer("bos_eos", qwen)
    assert boundary.for_tokenizer("eos", qwen) == boundary.Boundary(bos_id=None, eos_id=0)


def test_packed_rows_put_bos_and_eos_where_configured():
    """Two documents [5, 6] and [7] in rows of 4: the exact rows of each policy."""
    docs = [np.array([5, 6], np.int32), np.array([7], np.int32)]
    want = {"eos": [[5, 6, 1, 7], [1, 9, 9, 9]], "bos": [[0, 5, 6, 0], [7, 9, 9, 9]],
            "bos_eos": [[0, 5, 6, 1], [0, 7, 1, 9]], "none": [[5, 6, 7, 9]]}
    for policy, rows in want.items():
        b = boundary.for_tokenizer(policy, type("T", (), {"bos_id": 0, "eos_id": 1})())
        got = list(packing.pack_documents(docs, 4, pad_id=9, bos_id=b.bos_id, eos_id=b.eos_id))
        assert [r["tokens"].tolist() for r in got] == rows, policy
    (row, _) = packing.pack_documents(docs, 4, pad_id=9, bos_id=0, eos_id=1)
    assert row["segment_ids"].tolist() == [1, 1, 1, 1] and row["positions"].tolist() == [0, 1, 2, 3]


def test_training_and_eval_streams_and_the_mixture_apply_the_policy(tmp_path, llama3_dir):
    """make_train_dataset (file order) and make_eval_dataset hold BOS text EOS for every document, the token
    mixture too: the rows equal packing the wrapped documents by hand."""
    tok = Tokenizer.load(llama3_dir / "tokenizer.json")
    texts = ["first document", "second one\nwith a line", "third"]
    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": str(i), "text": t, "domain": "web"}) + "\n")
    wrapped = [np.concatenate([[0], tok.encode(t), [1]]).astype(np.int32) for t in texts]
    flat = np.concatenate(wrapped * 4)
    train = iter(loader.make_train_dataset(path, tok, seq_len=8, local_batch_size=2, seed=0, shuffle=False,
                                           document_boundary="bos_eos", read_threads=0))
    got = np.concatenate([next(train)["tokens"].reshape(-1) for _ in range(2)])
    np.testing.assert_array_equal(got, flat[:got.size])
    ev = next(iter(loader.make_eval_dataset(path, tok, seq_len=64, batch_size=1, document_boundary="bos_eos")))
    np.testing.assert_array_equal(ev["tokens"][0][:sum(map(len, wrapped))], np.concatenate(wrapped))
    mix = mixture.TokenMixIterator(lambda g, pos: (tok.encode(texts[pos % 3]), pos % 3), [(1, {"web": 1.0})],
                                   rows=1, seq_len=8, eos_id=1, bos_id=0)
    got = np.concatenate([next(mix)["tokens"].reshape(-1) for _ in range(3)])
    np.testing.assert_array_equal(got, flat[:got.size])


def test_heldout_windows_start_with_bos_and_end_with_eos(llama3_dir):
    from jaxpt.eval import heldout
    tok = Tokenizer.load(llama3_dir / "tokenizer.json")
    docs = [heldout.Document("d0", "The river flows."), heldout.Document("d1", "def f(x):\n    return x\n")]
    for policy, head, tail in (("bos_eos", [0], [1]), ("eos", [], [1]), ("none", [], [])):
        hset = heldout.HeldoutSet.build(docs, tok, seq_len=64, document_boundary=policy)
        for w, d in zip(hset.windows, docs):
            assert w.tokens.tolist() == head + tok.encode(d.text).tolist() + tail, policy
            assert w.first == 1


# -------------------------------------------------------------------------------- conversion and export


def _jaxpt_checkpoint(out, tok, policy):
    """A random 2-layer jaxpt model (vocabulary 512 > the tokenizer's 500) saved as a converted checkpoint."""
    import jax
    from flax import nnx

    from jaxpt import mesh as mesh_lib
    from jaxpt.model import ModelConfig
    from jaxpt.hf import convert
    from jaxpt.training import state as state_lib
    cfg = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                      max_seq_len=32)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda v: v.replace(jax.numpy.asarray(0.02 * rng.standard_normal(v.shape), np.float32)),
                          state_lib.abstract_model(cfg)[1], is_leaf=lambda x: isinstance(x, nnx.Variable))
    train_cfg = convert._converted_config(cfg, str(tok.path), policy)
    convert.write_params_checkpoint(str(out), train_cfg, params, mesh_lib.mesh_from_config({"data": 8}), tok,
                                    source={"format": "test"})
    return out


@pytest.mark.integration
def test_export_then_conversion_keeps_the_tokenizer_and_the_policy(tmp_path, llama3_dir):
    """jaxpt-to-hf writes tokenizer.json + tokenizer_config.json that transformers loads with jaxpt's ids (and BOS
    added to a text, as the run's 'bos_eos' says); hf-to-jaxpt of that folder copies the tokenizer with the same
    sha256 and writes the base's convention into model.gin."""
    transformers = pytest.importorskip("transformers")
    from jaxpt.hf import convert
    import jaxpt
    tok = Tokenizer.load(llama3_dir / "tokenizer.json")
    run = _jaxpt_checkpoint(tmp_path / "run", tok, "bos_eos")
    export = convert.jaxpt_to_hf(run, tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(export)
    for s in HARD:
        assert auto(s, add_special_tokens=False)["input_ids"] == tok.encode(s).tolist(), s
    assert auto("a river")["input_ids"] == [0, *tok.encode("a river").tolist()]
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (0, 1)

    back = convert.hf_to_jaxpt(export, tmp_path / "jx")
    gin = (tmp_path / "jx" / "model.gin").read_text()
    assert "DataConfig.document_boundary = 'bos_eos'" in gin
    assert f"DataConfig.tokenizer_path = {str(tmp_path / 'jx' / 'tokenizer.json')!r}" in gin
    r = jaxpt.restore(back)
    assert r.tokenizer.kind == "huggingface" and r.tokenizer.sha256 == tok.sha256
    assert r.config.data.document_boundary == "bos_eos"


def test_qwen_convention_and_an_export_without_bos(tmp_path, qwen_dir, llama3_dir):
    """A Qwen folder's convention is 'eos' (its tokenizer adds nothing); a Llama tokenizer exported under 'eos'
    gets a post-processor that adds no BOS, so transformers starts a text as the run did."""
    transformers = pytest.importorskip("transformers")
    from jaxpt.hf import convert
    tok, policy = convert._base_tokenizer(str(qwen_dir), str(tmp_path / "q"), "qwen2")
    assert policy == "eos" and tok.bos_id == -1 and (tmp_path / "q" / "tokenizer.json").exists()
    l3 = Tokenizer.load(llama3_dir / "tokenizer.json")
    assert convert._base_tokenizer(str(llama3_dir), str(tmp_path / "l"), "llama")[1] == "bos_eos"
    convert._tokenizer_files(l3, str(tmp_path / "e"), 32, "eos")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "e"))
    assert auto("a river")["input_ids"] == l3.encode("a river").tolist()


def test_sentencepiece_nmt_nfkc_model_keeps_newlines_as_the_export_does(tmp_path):
    """A SentencePiece model with the library's default normalizer (nmt_nfkc, whitespace collapsed, dummy prefix):
    jaxpt's ids equal the exported tokenizer's on text with newlines and tabs, and the newlines survive (the old
    encoding, SentencePiece's own, turned them into spaces while the export kept them)."""
    transformers = pytest.importorskip("transformers")
    from jaxpt.hf import convert
    settings = tokenizer_lib.TrainerSettings(vocab_size=300, normalization_rule_name="nmt_nfkc",
                                             remove_extra_whitespaces=True, add_dummy_prefix=True)
    tokenizer_lib.train(TEXT.splitlines(keepends=True), tmp_path / "nfkc" / "tokenizer.model", settings)
    tok = Tokenizer.load(tmp_path / "nfkc" / "tokenizer.model")
    assert tok.settings()["normalization_rule_name"] == "nmt_nfkc" and tok.normalizes
    convert._tokenizer_files(tok, str(tmp_path / "nfkc"), 64, "eos")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "nfkc"))
    for s in ["line one\nline two", "a\n\nb\tc", "code:\n    indented\r\nx  y", "The river\nflows"]:
        assert tok.encode(s).tolist() == auto(s, add_special_tokens=False)["input_ids"], s
        assert tok.decode(tok.encode(s)) == s
    assert "\n" in tok.decode(tok.encode("a\nb"))
    # another encoding than before, so another identity: a run or corpus made with the normalizer on is refused
    model_bytes = (tmp_path / "nfkc" / "tokenizer.model").read_bytes()
    assert tok.sha256 == hashlib.sha256(model_bytes + tokenizer_lib.ENCODING_WITHOUT_NORMALIZER).hexdigest()
    assert tok.sha256 != hashlib.sha256(model_bytes).hexdigest()


def test_a_model_without_a_normalizer_keeps_its_file_sha256(sp_tok):
    """jaxpt's own models (identity normalizer) keep the sha256 of the file, so existing runs and corpora read on."""
    assert not sp_tok.normalizes
    assert sp_tok.sha256 == hashlib.sha256(sp_tok.path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------- prepare and the corpus


def test_prepare_and_the_corpus_build_take_a_base_models_tokenizer(tmp_path, llama3_dir):
    """prepare --tokenizer copies the base tokenizer, records its sha256 and counts its tokens, and its data.gin
    leaves the model's vocabulary alone; the corpus build's encoder is the same tokenizer."""
    from data_pipelines import writer
    from jaxpt.data import prepare
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"The river {i} flows.\n  def f():\n\treturn {i}"})
                           + "\n" for i in range(40)))
    rec = prepare.prepare(str(src), str(tmp_path / "out"), tokenizer=llama3_dir / "tokenizer.json")
    tok = Tokenizer.load(llama3_dir / "tokenizer.json")
    assert rec["tokenizer"]["sha256"] == tok.sha256 == rec["inputs"]["tokenizer"]["sha256"]
    assert rec["tokenizer"]["file"] == "tokenizer.json" and "tokenizer.model" not in rec["outputs"]
    copied = Tokenizer.load(tmp_path / "out" / "tokenizer.json")
    assert copied.sha256 == tok.sha256
    docs = [json.loads(line) for line in gzip.open(tmp_path / "out" / "train.jsonl.gz", "rt")]
    assert rec["tokens"]["train"]["total"] == sum(len(tok.encode(d["text"])) for d in docs)
    gin = (tmp_path / "out" / "data.gin").read_text()
    assert str(tmp_path / "out" / "tokenizer.json") in gin and "vocab_size = 0" not in gin
    assert prepare.prepare(str(src), str(tmp_path / "out"), tokenizer=llama3_dir / "tokenizer.json")["up_to_date"]
    enc = writer.TokenizerEncoder(str(tmp_path / "out" / "tokenizer.json"))
    assert enc.sha256 == tok.sha256 and enc.kind == "huggingface"
    assert enc.encode(HARD[10]).tolist() == tok.encode(HARD[10]).tolist()
