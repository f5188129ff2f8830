"""Continued pretraining of a Llama-3-style base on one's own JSON Lines, end to end, as the Hugging Face guide gives
it (the block after ``<!-- commands: tests/test_base_model_cpt.py -->``): convert, prepare with the base's
tokenizer, evaluate the base on the new and the old kind, train from it, evaluate again, export; then the export
generates in transformers.

The base is built here (nothing downloaded): a tiny random ``LlamaForCausalLM`` with Llama 3's RoPE scaling, and a
byte-level BPE ``tokenizer.json`` with Llama 3's special tokens and BOS post-processor, trained on a few KB of text.
References independent of jaxpt: the ids are the base's own fast tokenizer's; the generation is transformers' greedy
``generate`` on the exported folder, against jaxpt's greedy decoding of the continued checkpoint.
"""

import gzip
import json
import random
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT
from hf_tokenizers import TEXT, byte_level_bpe
from test_own_data import page_commands

pytestmark = pytest.mark.slow

PAGE = REPO_ROOT / "docs" / "guides" / "huggingface.md"
MARKER = "<!-- commands: tests/test_base_model_cpt.py -->"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
L = 64
#: Test-size overrides appended to the trainer's command (10 steps, batch 8, no in-loop evals; rows are the
#: converted model.gin's: the base's context L, shorter than the default).
TINY = ["--steps", "10", "--mesh", "data=2,fsdp=2,tensor=2",
        "--gin", "TrainConfig.global_batch_size = 8", "--gin", "TrainConfig.eval_every = 0",
        "--gin", "TrainConfig.progress_bar = False", "--gin", "OptimizerConfig.warmup_steps = 2",
        "--gin", "OptimizerConfig.decay_steps = 10", "--gin", "OptimizerConfig.peak_learning_rate = 3e-3"]


def _words(domain: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    syllables = {"rivers": "ba be bo du ka ki lo ma mi nu pa ra ri so ta to ve wa".split(),
                 "old": "the a of river mill stone sea and on past flows old".split()}[domain]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(200)]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(30, 90))) for _ in range(n)]


def _llama3_base(folder):
    """The base: tokenizer files as Llama 3 ships them and a random fp32 LlamaForCausalLM whose vocabulary is the
    tokenizer's."""
    import torch
    import transformers
    folder.mkdir()
    tok = byte_level_bpe([BOS, EOS], bos_template=BOS, vocab_size=400,
                         text=TEXT + "\n".join(_words("rivers", 50, 9) + _words("old", 50, 9)))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=L, rms_norm_eps=1e-5,
        rope_theta=500000.0, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(folder, safe_serialization=True)


def _jsonl(path, texts, domain):
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"{domain}-{i}", "text": text, "domain": domain}) + "\n")


def test_continued_pretraining_of_a_llama3_base_as_the_guide_gives_it(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    import jaxpt
    from jaxpt.data.tokenizer import Tokenizer
    commands = page_commands(MARKER, PAGE)
    assert [c[2] for c in commands] == ["jaxpt.tools.convert", "jaxpt.data.prepare"] + ["jaxpt.tools.evaluate"] * 2 + [
        "jaxpt.train"] + ["jaxpt.tools.evaluate"] * 4 + ["jaxpt.tools.convert"]
    _llama3_base(tmp_path / "llama3-base")
    (tmp_path / "my_docs").mkdir()
    _jsonl(tmp_path / "my_docs" / "a.jsonl", _words("rivers", 300, 1), "rivers")
    _jsonl(tmp_path / "old_docs.jsonl", _words("old", 40, 2), "old")
    (tmp_path / "eval").mkdir()
    outs = []
    for cmd in commands:
        argv = [sys.executable] + [a.replace("/models/llama3-base", str(tmp_path / "llama3-base")) for a in cmd[1:]]
        argv += TINY if cmd[2] == "jaxpt.train" else []
        r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                           env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)})
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        outs.append(r.stdout)

    # the corpus was tokenized with the base's tokenizer, and training put BOS and EOS around each document
    base_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "llama3-base"))
    prepared = json.loads((tmp_path / "artifacts" / "mine-base" / "prepare.json").read_text())
    ours = Tokenizer.load(tmp_path / "workdirs" / "base" / "tokenizer.json")
    assert prepared["inputs"]["tokenizer"]["sha256"] == ours.sha256
    assert "DataConfig.document_boundary = 'bos_eos'" in (tmp_path / "workdirs" / "base" / "model.gin").read_text()
    doc = json.loads(gzip.open(tmp_path / "artifacts" / "mine-base" / "train.jsonl.gz", "rt").readline())["text"]
    assert ours.encode(doc).tolist() == base_tok(doc, add_special_tokens=False)["input_ids"]

    # gain on the new kind, measured on the same documents before and after; the old kind scored both times
    report = {k: json.loads((tmp_path / "eval" / f"{k}.json").read_text())
              for k in ("base-new", "base-old", "continued-new", "continued-old")}
    loss = {k: v["overall"]["loss"] for k, v in report.items()}
    assert report["base-new"]["overall"]["tokens"] == report["continued-new"]["overall"]["tokens"] > 0
    assert report["base-old"]["overall"]["tokens"] == report["continued-old"]["overall"]["tokens"] > 0
    assert loss["continued-new"] < loss["base-new"] - 0.1, loss
    assert all(np.isfinite(v) for v in loss.values())
    # compare prints base -> new for each pair, overall and per domain, the figures of the reports themselves
    for out, kind, domain in ((outs[7], "new", "rivers"), (outs[8], "old", "old")):
        b, n = report[f"base-{kind}"], report[f"continued-{kind}"]
        assert f"{b['overall']['loss']:>10.4f} -> {n['overall']['loss']:>10.4f}" in out
        assert f"{b['by_domain'][domain]['loss']:>10.4f} -> {n['by_domain'][domain]['loss']:>10.4f}" in out

    # the export generates in transformers what jaxpt's greedy decoding of the continued checkpoint gives
    hf_dir = tmp_path / "hf" / "continued"
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    prompt = _words("rivers", 1, 1)[0][:40]
    inputs = tok(prompt, return_tensors="pt")
    assert inputs["input_ids"][0, 0].item() == ours.bos_id  # BOS before a prompt, as before each document
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    theirs = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    r = jaxpt.restore(tmp_path / "workdirs" / "continued")
    assert r.generate(prompt, max_new_tokens=8) == theirs  # the run's own boundary: BOS first
