"""Continued pretraining from a Hugging Face model (jaxpt.tools.convert + TrainConfig.init_from, jaxpt.run.lineage).

A random Llama (transformers, PyTorch) with a SentencePiece tokenizer is converted and trained on for one step.
Checked: the loss of step 1 equals the base model's loss on that very batch, computed by transformers itself
document by document (an implementation independent of jaxpt's packing, masking and loss); the optimizer starts
fresh (zero moments, a warm-up from 0); run.json names the converted parent and its HF source; a tokenizer other
than the base model's is refused.
"""

import gzip
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxpt import config as C  # noqa: E402
from jaxpt.hf import convert  # noqa: E402
from jaxpt.run import monitor
from jaxpt import train
from jaxpt.checkpoint import CheckpointError  # noqa: E402
from jaxpt.util.errors import ConfigError  # noqa: E402

WORDS = ["north", "south", "old", "new", "green", "stone", "quiet", "bright", "river", "mill"]


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 25)))) + "." for _ in range(n)]


def _jsonl(path, texts):
    with gzip.open(path, "wt") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": str(i), "text": t}) + "\n")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(converted dir, HF model, data dir): a random Llama with a 300-piece SentencePiece tokenizer."""
    from jaxpt.data.tokenizer import train_sentencepiece
    tmp = tmp_path_factory.mktemp("cpt")
    hf_dir = tmp / "hf"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval().float()
    model.save_pretrained(hf_dir, safe_serialization=True)
    train_sentencepiece(_texts(300, 0), hf_dir / "tokenizer.model", vocab_size=300)
    data = tmp / "data"
    data.mkdir()
    _jsonl(data / "train.jsonl.gz", _texts(200, 1))
    _jsonl(data / "heldout.jsonl.gz", _texts(20, 2))
    convert.hf_to_jaxpt(hf_dir, tmp / "base", mesh="fsdp=8")
    return tmp / "base", model, data


def _cfg(base_dir, data, workdir, **extra):
    b = {"DataConfig.train_path": repr(str(data / "train.jsonl.gz")),
         "DataConfig.heldout_path": repr(str(data / "heldout.jsonl.gz")),
         "TrainConfig.init_from": repr(str(base_dir)), "TrainConfig.seq_len": "32",
         "TrainConfig.global_batch_size": "8", "TrainConfig.log_every": "1", "TrainConfig.eval_every": "0",
         "TrainConfig.eval_batches": "1", "TrainConfig.progress_bar": "False", "TrainConfig.z_loss_weight": "0.0",
         "TrainConfig.stage_name": "'continued'", "CheckpointConfig.enabled": "False",
         "OptimizerConfig.schedule": "'constant'", "OptimizerConfig.warmup_steps": "1",
         "OptimizerConfig.decay_steps": "0", "OptimizerConfig.peak_learning_rate": "1e-3", **extra}
    return C.parse([str(base_dir / "model.gin")], [f"{k} = {v}" for k, v in b.items()], workdir=str(workdir),
                   steps=1, mesh="data=2,fsdp=2,tensor=2")


def _hf_loss(model, batch) -> float:
    """Mean next-token cross-entropy of ``batch`` by transformers, each packed document run on its own."""
    total, count = 0.0, 0
    for tokens, seg in zip(batch["tokens"], batch["segment_ids"]):
        for s in np.unique(seg[seg != 0]):
            doc = tokens[seg == s].astype(np.int64)
            if len(doc) < 2:
                continue
            with torch.no_grad():
                logits = model(torch.from_numpy(doc[None])).logits[0, :-1]
            ce = torch.nn.functional.cross_entropy(logits, torch.from_numpy(doc[1:]), reduction="sum")
            total, count = total + float(ce), count + len(doc) - 1
    return total / count


@pytest.mark.slow
def test_step_1_loss_is_the_base_models_loss_on_that_batch(base, tmp_path):
    import jax

    from jaxpt.run import resolve as preflight, lineage as stage
    base_dir, hf_model, data = base
    seen = {}
    states = {}

    def capture(step, batch):
        seen.setdefault(step, jax.tree.map(np.asarray, batch))
        return batch

    def capture_state(step, state):
        states.setdefault(step, jax.device_get(state))
        return state

    workdir = tmp_path / "run"
    train.run_training(_cfg(base_dir, data, workdir), batch_injector=capture, fault_injector=capture_state)
    records = [r for r in monitor.read_metrics(str(workdir)) if "loss" in r]
    assert [r["step"] for r in records] == [1]
    assert np.isclose(records[0]["loss"], _hf_loss(hf_model, seen[1]), rtol=1e-5, atol=0)
    assert records[0]["learning_rate"] == 0.0  # a fresh warm-up from 0
    start = states[1]
    assert int(start.step) == 0 and int(start.num_updates) == 0
    moments = [np.abs(np.asarray(x)).max() for p, x in jax.tree_util.tree_leaves_with_path(start.opt_state)
               if any(getattr(k, "name", None) in ("mu", "nu") for k in p)]
    assert moments and max(moments) == 0.0  # a fresh optimizer state

    run = json.loads((workdir / "run.json").read_text())
    first, cont = run["stages"]
    assert first["workdir"] == str(base_dir.resolve()) and first["end_step"] == 0
    assert cont["parent"] == {"path": str(base_dir.resolve()), "step": 0} and cont["reset_optimizer"] is True
    assert cont["source"]["format"] == "huggingface" and cont["name"] == "continued"
    pre = preflight.resolve(_cfg(base_dir, data, tmp_path / "again"))
    assert pre.cfg.init_from == str(base_dir.resolve()) and C.start_step(pre.cfg) == 0


@pytest.mark.integration
def test_a_tokenizer_other_than_the_base_models_is_refused(base, tmp_path):
    from jaxpt.run import resolve as preflight
    from jaxpt.data.tokenizer import train_sentencepiece
    base_dir, _, data = base
    other = train_sentencepiece(_texts(300, 5) + ["zebra quartz"] * 50, tmp_path / "other.model", vocab_size=300)
    cfg = _cfg(base_dir, data, tmp_path / "run", **{"DataConfig.tokenizer_path": repr(str(other))})
    with pytest.raises(CheckpointError, match="tokenizer sha256"):
        preflight.resolve(cfg)
    meta_less = tmp_path / "no_tok"
    convert.write_params_checkpoint(str(meta_less), C.parse([str(base_dir / "model.gin")]), _params(base_dir),
                                    _mesh(), None, source={"format": "huggingface", "path": "x"})
    with pytest.raises(ConfigError, match="converted without a tokenizer"):
        preflight.resolve(_cfg(meta_less, data, tmp_path / "run2",
                             **{"DataConfig.tokenizer_path": repr(str(base_dir / "tokenizer.model"))}))


def _mesh():
    from jaxpt import mesh as mesh_lib
    return mesh_lib.mesh_from_config({"data": 8})


def _params(base_dir):
    import jaxpt
    return jaxpt.restore(base_dir, mesh=_mesh()).params
