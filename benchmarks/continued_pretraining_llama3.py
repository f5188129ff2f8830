"""Continued pretraining of a Llama-3-style base on one's own JSON Lines, measured, with the Hugging Face guide's
own commands (docs/guides/huggingface.md, the block after ``<!-- commands: tests/test_base_model_cpt.py -->``).

    nice -n 5 python benchmarks/continued_pretraining_llama3.py [--output workdirs/cpt-llama3] [--base-steps 200]
        [--steps 100] [--peak-lr 1e-3]

1. **The base** (what a lab would publish; built here, nothing downloaded): a byte-level BPE ``tokenizer.json``
   with Llama 3's split regex and special tokens (``<|begin_of_text|>`` added before every text by its
   post-processor, ``<|end_of_text|>``), 4,096 ids, trained with ``tokenizers`` on the bundled sample's training
   text; the quickstart model with Llama 3's RoPE (theta 500,000) pretrained ``--base-steps`` steps on the *old*
   kind (reference and web documents) with ``DataConfig.document_boundary = 'bos_eos'``; exported with
   ``jaxpt-to-hf`` as a Hugging Face Llama folder. From here on it is treated as any downloaded base.
2. **The guide's commands**, each printed before it runs, with the page's example paths replaced by this run's and
   the trainer's steps and schedule shortened: convert the base, prepare the *new* kind (code and multilingual
   documents, as one's own JSON Lines) with the base's tokenizer, score the base on the new and the old held-out
   documents, continue ``--steps`` steps, score again, export.
3. The export generates in transformers (greedy, a prompt from the new held-out set) beside jaxpt's own greedy
   decoding of the same checkpoint.

Prints the table (markdown) and writes ``<output>/report.json``. Figures only, never pass/fail; they go to
docs/results/continued-pretraining.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import shutil
import sys
import time

from continued_pretraining import ROOT, run

sys.path.insert(0, os.path.join(ROOT, "tests"))
from hf_tokenizers import LLAMA3_SPLIT  # noqa: E402  (the split regex, shared with the tests)

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
MARKER = "<!-- commands: tests/test_base_model_cpt.py -->"
OLD, NEW = ("reference", "web"), ("code", "multilingual")


def guide_commands() -> list[list[str]]:
    """The guide's block after :data:`MARKER`, one argv per command."""
    import re
    text = open(os.path.join(ROOT, "docs", "guides", "huggingface.md")).read()
    block = re.search(r"```[a-z]*\n(.*?)```", text[text.index(MARKER):], re.S).group(1)
    block = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def make_tokenizer(out: str, texts: list[str]) -> str:
    """A Llama-3-style tokenizer.json (+ tokenizer_config.json) in ``out``; returns the tokenizer.json path."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, special_tokens=[BOS, EOS],
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    return os.path.join(out, "tokenizer.json")


def read_texts(path: str) -> list[dict]:
    """The records (dicts) of a gzip JSON Lines file, in order."""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> int:
    """Run the guide's continued-pretraining commands on a locally built Llama-3-style base; prints the before/after
    held-out figures. Returns the exit status.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="workdirs/cpt-llama3")
    p.add_argument("--base-steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--peak-lr", type=float, default=1e-3)
    p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    args = p.parse_args(argv)
    out = os.path.join(ROOT, args.output)
    py, t0 = sys.executable, time.perf_counter()
    sample = os.path.join(ROOT, "data", "sample")

    # 1. the base
    old_src, new_src = os.path.join(out, "old_docs"), os.path.join(out, "my_docs")
    for folder, domains in ((old_src, OLD), (new_src, NEW)):
        os.makedirs(folder, exist_ok=True)
        for d in domains:
            shutil.copy(os.path.join(sample, f"{d}.jsonl.gz"), os.path.join(folder, f"{d}.jsonl.gz"))
    tok_json = os.path.join(out, "tokenizer", "tokenizer.json")
    if not os.path.exists(tok_json):
        texts = [r["text"] for d in OLD + NEW for r in read_texts(os.path.join(sample, f"{d}.jsonl.gz"))]
        make_tokenizer(os.path.dirname(tok_json), texts)
    old_prep = os.path.join(out, "old-prepared")
    run([py, "-m", "jaxpt.data.prepare", "--source", old_src, "--output", old_prep, "--tokenizer", tok_json],
        done=os.path.join(old_prep, "data.gin"))
    pre = os.path.join(out, "pretrained")
    run([py, "-m", "jaxpt.train", "--config", "configs/quickstart.gin", "--config", os.path.join(old_prep, "data.gin"),
         "--workdir", pre, "--steps", str(args.base_steps), "--mesh", args.mesh,
         "--gin", "ModelConfig.vocab_size = 4096", "--gin", "ModelConfig.rope_theta = 500000.0",
         "--gin", "DataConfig.document_boundary = 'bos_eos'", "--gin", "TrainConfig.eval_every = 0",
         "--gin", f"OptimizerConfig.decay_steps = {args.base_steps}", "--gin", "TrainConfig.progress_bar = False"],
        done=os.path.join(pre, "checkpoints", str(args.base_steps)))
    base_hf = os.path.join(out, "llama3-base")
    run([py, "-m", "jaxpt.tools.convert", "jaxpt-to-hf", "--workdir", pre, "--output", base_hf],
        done=os.path.join(base_hf, "config.json"))
    old_heldout = os.path.join(old_prep, "heldout.jsonl.gz")

    # 2. the guide's commands
    replace = {"/models/llama3-base": base_hf, "my_docs/*.jsonl": os.path.join(new_src, "*.jsonl.gz"),
               "old_docs.jsonl": old_heldout}
    os.makedirs(os.path.join(out, "eval"), exist_ok=True)
    for cmd in guide_commands():
        argv = _in([py] + [_sub(a, replace) for a in cmd[1:]], out)
        if cmd[2] == "jaxpt.train":  # later flags and bindings win
            argv += ["--steps", str(args.steps), "--mesh", args.mesh, "--gin", "TrainConfig.eval_every = 0",
                     "--gin", "TrainConfig.progress_bar = False", "--gin", "OptimizerConfig.warmup_steps = 10",
                     "--gin", f"OptimizerConfig.decay_steps = {args.steps}",
                     "--gin", f"OptimizerConfig.peak_learning_rate = {args.peak_lr}"]
        run(argv, done=_output_of(argv, args.steps))

    # 3. figures and a generation
    rep = {k: json.load(open(os.path.join(out, "eval", f"{k}.json")))["overall"]
           for k in ("base-new", "base-old", "continued-new", "continued-old")}
    import torch
    import transformers

    import jaxpt
    hf_dir = os.path.join(out, "hf", "continued")
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = read_texts(os.path.join(out, "artifacts", "mine-base", "heldout.jsonl.gz"))[0]["text"][:80]
    inputs = tok(prompt, return_tensors="pt")
    gen = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    theirs = tok.decode(gen[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    r = jaxpt.restore(os.path.join(out, "workdirs", "continued"))
    ours = r.generate(prompt, max_new_tokens=24)  # with the run's boundary: BOS first, as transformers
    report = {"heldout": rep, "prompt": prompt, "transformers": theirs, "jaxpt": ours, "equal": theirs == ours,
              "base_steps": args.base_steps, "steps": args.steps, "peak_lr": args.peak_lr,
              "wall_s": time.perf_counter() - t0}
    json.dump(report, open(os.path.join(out, "report.json"), "w"), indent=1)
    print("\n| model | new kind held-out (tokens) | old kind held-out (tokens) |\n|---|---:|---:|")
    for m in ("base", "continued"):
        n, o = rep[f"{m}-new"], rep[f"{m}-old"]
        print(f"| {m} | {n['loss']:.3f} ({n['tokens']:,}) | {o['loss']:.3f} ({o['tokens']:,}) |")
    print(f"\nprompt: {prompt!r}\ntransformers: {theirs!r}\njaxpt:        {ours!r}\nequal: {theirs == ours}")
    print(f"wall {report['wall_s']:.0f} s")
    return 0


def _sub(arg: str, replace: dict) -> str:
    for old, new in replace.items():
        arg = arg.replace(old, new)
    return arg


def _in(argv: list[str], out: str) -> list[str]:
    """The guide's relative paths (workdirs/, artifacts/, eval/, hf/) placed under ``out``."""
    rel = ("workdirs/", "artifacts/", "eval/", "hf/")
    fixed = []
    for a in argv:
        for r in rel:
            a = a.replace(f"'{r}", f"'{out}/{r}")
            if a.startswith(r):
                a = os.path.join(out, a)
        fixed.append(a)
    return fixed


def _output_of(argv: list[str], steps: int) -> str | None:
    """What a command writes last, to skip it when an interrupted benchmark is started again."""
    if "--output" in argv:
        o = argv[argv.index("--output") + 1]
        return o if o.endswith(".json") else os.path.join(o, "config.json" if "jaxpt-to-hf" in argv else "data.gin"
                                                           if "jaxpt.data.prepare" in argv else "model.gin")
    if "jaxpt.train" in argv:
        return os.path.join(argv[argv.index("--workdir") + 1], "checkpoints", str(steps))
    return None


if __name__ == "__main__":
    sys.exit(main())
