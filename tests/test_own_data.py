"""Your own text in three commands, as the Getting-started page gives them: prepare a JSON Lines file of documents
(split, tokenizer, data config), train on it, evaluate the checkpoint's held-out perplexity. The commands are read
from the page (the block after ``<!-- commands: tests/test_own_data.py -->``) and run as a user would, with the
page's example file name replaced by a file this test writes and flags that shrink the model for the test."""

import gzip
import json
import pathlib
import random
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow

PAGE = REPO_ROOT / "docs" / "getting-started" / "own-data.md"
MARKER = "<!-- commands: tests/test_own_data.py -->"
#: Test-size overrides appended to the trainer's command (a tiny model, a few steps).
TINY = ["--steps", "12", "--mesh", "data=8", "--gin", "ModelConfig.d_model = 64", "--gin", "ModelConfig.num_layers = 2",
        "--gin", "ModelConfig.num_heads = 4", "--gin", "ModelConfig.num_kv_heads = 2", "--gin",
        "ModelConfig.head_dim = 16", "--gin", "ModelConfig.mlp_dim = 128", "--gin", "TrainConfig.seq_len = 64",
        "--gin", "ModelConfig.max_seq_len = 64", "--gin", "TrainConfig.progress_bar = False",
        "--gin", "OptimizerConfig.decay_steps = 12", "--gin", "OptimizerConfig.warmup_steps = 2"]


def page_commands(marker: str = MARKER, page: pathlib.Path = PAGE) -> list[list[str]]:
    """The commands of ``page``'s block after ``marker`` (``$`` prompts and continuation lines joined)."""
    text = page.read_text()
    assert marker in text, f"{page}: no {marker} block"
    block = re.search(r"```[a-z]*\n(.*?)```", text[text.index(marker):], re.S).group(1)
    block = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip() and not
            line.lstrip().startswith("#")]


def _documents(path: pathlib.Path, n: int = 400) -> None:
    rng = random.Random(0)
    syllables = {"rivers": "ba be bo du ka ki lo ma mi nu pa ra ri so ta to ve wa".split(),
                 "markets": "ch ge ha ja ke lu mo ne pi qu ry sa te ul vo xe yo zi".split()}
    vocab = {d: ["".join(rng.choice(s) for _ in range(rng.randint(1, 4))) for _ in range(400)]
             for d, s in syllables.items()}
    with open(path, "w") as f:
        for i in range(n):
            domain = "rivers" if i % 2 else "markets"
            words = [rng.choice(vocab[domain]) for _ in range(rng.randint(40, 120))]
            f.write(json.dumps({"id": f"doc-{i}", "text": " ".join(words), "domain": domain}) + "\n")


def _substitute(arg: str, replace: dict) -> str:
    for old, new in replace.items():
        arg = arg.replace(old, new)
    return arg


def test_the_own_data_recipe_runs_as_the_page_gives_it(tmp_path):
    commands = page_commands()
    assert [c[:3] for c in commands] == [["python", "-m", "jaxpt.data.prepare"], ["python", "-m", "jaxpt.train"],
                                         ["python", "-m", "jaxpt.tools.evaluate"]]
    _documents(tmp_path / "my_docs.jsonl")
    replace = {"my_docs.jsonl": str(tmp_path / "my_docs.jsonl"), "artifacts/mine": str(tmp_path / "prepared"),
               "workdirs/mine": str(tmp_path / "run")}
    outs = []
    for i, cmd in enumerate(commands):
        argv = [sys.executable] + [_substitute(a, replace) for a in cmd[1:]]
        argv += {0: ["--vocab-size", "512"], 1: TINY, 2: ["--output", str(tmp_path / "heldout.json")]}[i]
        r = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-3000:]}"
        outs.append(r.stdout)
    assert "data config" in outs[0] and (tmp_path / "prepared" / "data.gin").is_file()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r.get("event") == "final"][-1]
    first = next(r for r in records if "loss" in r and "event" not in r)
    assert final["step"] == 12 and final["heldout_loss"] < first["loss"]  # it learned something
    report = json.loads((tmp_path / "heldout.json").read_text())
    heldout_docs = [json.loads(line) for line in gzip.open(tmp_path / "prepared" / "heldout.jsonl.gz", "rt")]
    assert report["overall"]["documents"] == len(heldout_docs) > 0
    assert set(report["by_domain"]) == {d["domain"] for d in heldout_docs} == {"rivers", "markets"}
    # The same held-out set the trainer scored at its end: the same loss (the same program, the same windows).
    assert report["overall"]["loss"] == pytest.approx(final["heldout_loss"], rel=1e-4)


def test_a_converted_model_is_not_scored_on_a_held_out_set_it_was_never_given():
    """A model converted from Hugging Face carries the quickstart's default DataConfig: scoring it on that silently
    was the old behaviour; now the held-out set must be named."""
    from types import SimpleNamespace

    from jaxpt import config as C
    from jaxpt.tools import evaluate
    converted = SimpleNamespace(meta={"params_only": True, "source": {"path": "hf/llama"}}, config=C.parse([], []))
    with pytest.raises(ValueError, match="converted from hf/llama: it has no held-out set of its own; pass --heldout"):
        evaluate.heldout_source(converted, None)
    assert evaluate.heldout_source(converted, "mine.jsonl") == "mine.jsonl"
    trained = SimpleNamespace(meta={}, config=C.parse([], ["DataConfig.heldout_path = 'h.jsonl'"]))
    assert evaluate.heldout_source(trained, None) == "h.jsonl"


def test_a_card_on_data_without_its_domains_says_what_to_do_before_scoring():
    from types import SimpleNamespace

    from jaxpt.eval.card import load_card
    from jaxpt.tools import evaluate
    card = load_card(str(REPO_ROOT / "configs" / "eval" / "card_v1.yaml"))
    docs = [SimpleNamespace(domain="rivers"), SimpleNamespace(domain="markets")]
    with pytest.raises(ValueError, match=r"its tasks need held-out documents of domains .*mine.jsonl has "
                                         r"\['markets', 'rivers'\].*python -m jaxpt.tools.evaluate heldout"):
        evaluate.check_card_domains(card, docs, "mine.jsonl")
    evaluate.check_card_domains(card, [SimpleNamespace(domain=s.domain) for s in card.tasks], "ok.jsonl")


def test_a_first_try_on_little_text_runs_as_the_page_gives_it(tmp_path):
    """The page's first try on a few hundred documents: its --vocab-size fits them, and its short schedule (10 steps,
    warmup 2) runs to the end (the quickstart's 30-step warmup would be refused against a 10-step decay)."""
    commands = page_commands("<!-- commands: tests/test_own_data.py::little -->")
    assert [c[:3] for c in commands] == [["python", "-m", "jaxpt.data.prepare"], ["python", "-m", "jaxpt.train"]]
    _documents(tmp_path / "my_docs.jsonl", n=300)
    replace = {"my_docs.jsonl": str(tmp_path / "my_docs.jsonl"), "artifacts/mine": str(tmp_path / "prepared"),
               "workdirs/try": str(tmp_path / "run")}
    tiny = TINY[2:-4]  # the small model, not TINY's steps and schedule: the page's own are under test
    assert tiny[0] == "--mesh" and "OptimizerConfig" not in " ".join(tiny)
    for i, cmd in enumerate(commands):
        argv = [sys.executable] + [_substitute(a, replace) for a in cmd[1:]] + ([] if i == 0 else tiny)
        r = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-3000:]}"
    assert json.loads((tmp_path / "prepared" / "prepare.json").read_text())["tokenizer"]["vocab_size"] == 400
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r.get("event") == "final"][-1]["step"] == 10
