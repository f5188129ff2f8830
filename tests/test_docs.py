"""The documentation holds its rules: a short README, user pages free of one machine's paths, commit hashes and
issue numbers, a configuration reference that describes every field, Getting-started commands that a test runs,
and a site that builds strictly.

User pages are README.md, data_pipelines/README.md and every page of the site (docs/*.md and the generated
reference); results pages (docs/results/) may name commits, nothing else is exempt. Each checker is shown to fail on
a planted example. No jax compile: the commands run here are a dry run, the run registry and ``make -n``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib
import importlib.util
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def _load_gen_reference():
    spec = importlib.util.spec_from_file_location("_jaxpt_gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_reference():
    return _load_gen_reference()


@pytest.fixture(scope="module")
def generated(gen_reference) -> dict[str, str]:
    """``{path under docs/: text}`` of the generated reference pages, as the site build makes them."""
    return gen_reference.pages()


def user_pages(generated: dict[str, str]) -> dict[str, str]:
    """``{path: text}`` of every user page: the two READMEs, docs/**/*.md and the generated pages."""
    pages = {p: (ROOT / p).read_text() for p in ("README.md", "data_pipelines/README.md")}
    pages |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted(DOCS.rglob("*.md"))}
    pages |= {f"docs/{p}": text for p, text in generated.items()}
    return pages


# ------------------------------------------------------------------------------------------ the page checker

#: Absolute paths of one machine (say what to substitute instead: BUILD_DIR, <tmp>, workdirs/...).
MACHINE_PATH = re.compile(r"/work/|/tmp/|/root/|/home/[A-Za-z]")
#: "issue 12", "issues 3 and 4", "#12" (not an anchor such as "#2-compile", not an HTML entity "&#12;").
ISSUE = re.compile(r"\bissues?\s+#?\d+\b|(?<![\w&/])#\d+(?![\w-])", re.I)
HEX_WORD = re.compile(r"(?<![\w-])[0-9a-f]{7,40}(?![\w-])")
#: A 7+ hex word next to the word "commit", whether git knows it or not.
NEAR_COMMIT = re.compile(r"\bcommits?\b[\s`:'\"(=]{1,4}[0-9a-f]{7,}\b|\b[0-9a-f]{7,}\b[\s`'\")]{1,4}commit", re.I)


def git_objects(words: set[str]) -> set[str]:
    """The words ``git cat-file`` resolves to an object of this repository (one batch process for all)."""
    if not words or not (ROOT / ".git").exists():
        return set()
    ordered = sorted(words)
    out = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"], input="\n".join(ordered) + "\n",
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return {w for w, line in zip(ordered, out) if not line.endswith((" missing", " ambiguous"))}


def page_problems(pages: dict[str, str]) -> list[str]:
    """Every machine path, issue number and (outside docs/results/) commit hash in ``pages``, as 'path: what'."""
    problems = []
    hex_words = {w for text in pages.values() for w in HEX_WORD.findall(text)}
    commits = git_objects(hex_words)
    for path, text in pages.items():
        problems += [f"{path}: machine path {m.group(0)!r}" for m in MACHINE_PATH.finditer(text)]
        problems += [f"{path}: issue number {m.group(0)!r}" for m in ISSUE.finditer(text)]
        if path.startswith("docs/results/"):
            continue
        problems += [f"{path}: commit {w}" for w in sorted(set(HEX_WORD.findall(text)) & commits)]
        problems += [f"{path}: hex word next to 'commit': {m.group(0)!r}" for m in NEAR_COMMIT.finditer(text)]
    return problems


def readme_problems(text: str) -> list[str]:
    problems = []
    if len(text.splitlines()) > README_MAX_LINES:
        problems.append(f"{len(text.splitlines())} lines: how-to goes to docs/, results to docs/results/")
    problems += [f"does not give `{c}`" for c in ("make quickstart", "make test") if c not in text]
    return problems


def test_readme_is_a_short_front_door():
    assert readme_problems((ROOT / "README.md").read_text()) == []
    assert readme_problems("make quickstart\nmake test\n" + "x\n" * 249) == ["251 lines: how-to goes to docs/, "
                                                                             "results to docs/results/"]
    assert readme_problems("make quickstart\n") == ["does not give `make test`"]


def test_user_pages_name_no_machine_path_commit_or_issue(generated):
    pages = user_pages(generated)
    assert len(pages) > 30 and "docs/reference/config.md" in pages  # the generated pages are checked too
    assert page_problems(pages) == []


def test_the_page_checker_finds_each_planted_fault():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    planted = {
        "a path under /work/": "docs/guides/x.md: machine path '/work/'",
        "cache in /tmp/jaxpt": "docs/guides/x.md: machine path '/tmp/'",
        "see /root/.cache": "docs/guides/x.md: machine path '/root/'",
        "at /home/alice/runs": "docs/guides/x.md: machine path '/home/a'",
        f"measured on {head} here": f"docs/guides/x.md: commit {head}",
        "built at commit abcdef12345": "docs/guides/x.md: hex word next to 'commit': 'commit abcdef12345'",
        "fixed in issue 12": "docs/guides/x.md: issue number 'issue 12'",
        "see (#12) for why": "docs/guides/x.md: issue number '#12'",
    }
    for text, expected in planted.items():
        assert page_problems({"docs/guides/x.md": text}) == [expected], text
    # What is allowed: anchors, entities, sha256 values; on a results page, a commit (but not a path).
    clean = "[x](tpu-vm.md#2-compile-before-booking) &#35; " + "a" * 64
    assert page_problems({"docs/guides/x.md": clean}) == []
    assert page_problems({"docs/results/x.md": f"commit {head}"}) == []
    assert page_problems({"docs/results/x.md": "in /tmp/x"}) == ["docs/results/x.md: machine path '/tmp/'"]


# ------------------------------------------------------------------------------------------ config reference


def config_reference_problems(gen_reference, classes: dict[str, type], page: str) -> list[str]:
    """Fields of ``classes`` missing from the generated configuration page ``page`` or without a description, and
    docstring entries naming no field."""
    problems = []
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", page, re.S | re.M))
    for name, cls in classes.items():
        rows = dict(re.findall(r"^\| `(\w+)` \| [^\n]*?\| ([^|\n]*) \|$", sections.get(name, ""), re.M))
        for f in dataclasses.fields(cls):
            if f.name not in rows:
                problems.append(f"{name}.{f.name}: not in the reference")
            elif not rows[f.name].strip():
                problems.append(f"{name}.{f.name}: no description (add it to the class docstring's Attributes:)")
        stray = set(gen_reference.attribute_docs(cls)) - {f.name for f in dataclasses.fields(cls)}
        problems += [f"{name}.{s}: described in the docstring but not a field" for s in sorted(stray)]
    return problems


def test_config_reference_describes_every_field_of_every_config(gen_reference, generated):
    from jaxpt.config import CONFIG_CLASSES

    page = generated["reference/config.md"]
    assert set(CONFIG_CLASSES) >= {"TrainConfig", "DataConfig", "HeldoutEvalConfig", "ModelConfig", "OptimizerConfig",
                                   "StabilityConfig", "CheckpointConfig"}
    assert config_reference_problems(gen_reference, CONFIG_CLASSES, page) == []
    # Independently of the page: every field's type and default as dataclasses.fields gives them.
    for name, cls in CONFIG_CLASSES.items():
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(gen_reference.default_of(f)):
                assert f"| `{f.name}` | " in page and f"`{gen_reference.default_of(f)!r}`" in page, (name, f.name)


def test_config_reference_check_fails_on_an_undescribed_or_missing_field(gen_reference):
    @dataclasses.dataclass(frozen=True)
    class PlantedConfig:
        """A config with one field described, one not, and one description of a field that does not exist.

        Attributes:
          described: has a description.
          removed: was a field once.
        """

        described: int = 1
        undescribed: str = "x"

    page = gen_reference.table(
        ["field", "type", "default", "description"],
        [[f"`{r['field']}`", f"`{r['type']}`", r["default"], r["description"]]
         for r in gen_reference.config_rows(PlantedConfig)])
    problems = config_reference_problems(gen_reference, {"PlantedConfig": PlantedConfig}, f"## PlantedConfig\n\n{page}\n")
    assert problems == ["PlantedConfig.undescribed: no description (add it to the class docstring's Attributes:)",
                        "PlantedConfig.removed: described in the docstring but not a field"]
    assert config_reference_problems(gen_reference, {"PlantedConfig": PlantedConfig}, "") == [
        "PlantedConfig.described: not in the reference", "PlantedConfig.undescribed: not in the reference",
        "PlantedConfig.removed: described in the docstring but not a field"]


def test_programs_reference_lists_every_program_and_its_flags(generated):
    spec = importlib.util.spec_from_file_location("_cli_for_docs_test", ROOT / "tests" / "test_cli.py")
    cli_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_tests)
    page = generated["reference/programs.md"]
    for program in cli_tests.PROGRAMS:
        assert f"\n## {program}\n" in page, program
    train = page.split("\n## jaxpt.train\n")[1].split("\n## ")[0]
    for flag in ("--config FILE", "--gin BINDING", "--workdir", "--steps", "--mesh", "--dry-run", "--profile-steps"):
        assert f"`{flag}" in train, flag
    for alias in cli_tests.ALIASES:
        assert f"`python -m {alias}`" in page, alias


# ------------------------------------------------------------------------------------------ Getting-started commands

GETTING_STARTED = DOCS / "getting-started"

#: Commands of the Getting-started pages that another check runs, and which one. Every other command there is run
#: by a test of this file (RUN_HERE).
RUN_ELSEWHERE = {
    "make quickstart": "the fresh-clone check (shared/tools/fresh-clone-check quickstart)",
    "make test": "CI (.ci/run) and the fresh-clone check",
    "pip install -e .[dev]": "make venv, which make test runs in CI (the Makefile's install line)",
    "pip install -e .[prepare]": "make venv-core, which make quickstart runs (the fresh-clone check; the Makefile's "
                                 "install line)",
    "python -m jaxpt.data.prepare --output artifacts/sample": "make quickstart (the fresh-clone check); "
                                                              "tests/test_data_prepare.py::test_cli_on_the_bundled_sample",
    "python -m jaxpt.train --config configs/quickstart.gin --workdir workdirs/quickstart": "make quickstart (the fresh-clone check)",
    "python -m jaxpt.data.prepare --source my_docs.jsonl --output artifacts/mine":
        "tests/test_own_data.py::test_the_own_data_recipe_runs_as_the_page_gives_it",
    "python -m jaxpt.train --config configs/quickstart.gin --config artifacts/mine/data.gin --workdir workdirs/mine":
        "tests/test_own_data.py::test_the_own_data_recipe_runs_as_the_page_gives_it",
    "python -m jaxpt.data.prepare --source my_docs.jsonl --output artifacts/mine --vocab-size 400":
        "tests/test_own_data.py::test_a_first_try_on_little_text_runs_as_the_page_gives_it",
    "python -m jaxpt.train --config configs/quickstart.gin --config artifacts/mine/data.gin --workdir workdirs/try "
    "--steps 10 --gin OptimizerConfig.warmup_steps = 2 --gin OptimizerConfig.decay_steps = 10":
        "tests/test_own_data.py::test_a_first_try_on_little_text_runs_as_the_page_gives_it",
    "python -m jaxpt.tools.evaluate heldout --workdir workdirs/mine":
        "tests/test_own_data.py::test_the_own_data_recipe_runs_as_the_page_gives_it",
}
RUN_HERE = {
    "make quickstart WORKDIR=workdirs/quickstart-2": "test_make_quickstart_takes_another_workdir",
    "python -m jaxpt.tools.runs list workdirs": "test_reading_a_run_commands",
    "python -m jaxpt.tools.runs show workdirs/quickstart": "test_reading_a_run_commands",
    "python -m jaxpt.tools.runs show workdirs/quickstart --goodput-plot goodput.png": "test_reading_a_run_commands",
    "python -m jaxpt.tools.runs compare workdirs/quickstart workdirs/my_docs": "test_reading_a_run_commands",
    "python -m jaxpt.tools.runs plot workdirs/quickstart workdirs/my_docs --output loss.png":
        "test_reading_a_run_commands",
}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block of a Markdown page."""
    return re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M)


def commands(text: str) -> list[str]:
    """The shell commands of a page's ```bash blocks, continuation lines joined, comments dropped, each normalized
    to its words (``pip install -e '.[dev]'`` -> ``pip install -e .[dev]``)."""
    out = []
    for lang, body in fenced_blocks(text):
        if lang != "bash":
            continue
        for cmd in re.sub(r"\\\n\s*", " ", body).splitlines():
            words = shlex.split(cmd, comments=True)
            if words:
                out.append(" ".join(words))
    return out


def getting_started_commands() -> dict[str, list[str]]:
    return {p.name: commands(p.read_text()) for p in sorted(GETTING_STARTED.glob("*.md"))}


def test_every_getting_started_command_is_run_by_a_test():
    found = {c for cmds in getting_started_commands().values() for c in cmds}
    assert found, "no commands found on the Getting-started pages"
    unaccounted = found - set(RUN_ELSEWHERE) - set(RUN_HERE)
    assert not unaccounted, f"commands no test runs (run them here, or name the test in RUN_ELSEWHERE): {unaccounted}"
    stale = (set(RUN_ELSEWHERE) | set(RUN_HERE)) - found
    assert not stale, f"listed but no longer on the pages: {stale}"
    # A command must be in a ```bash block to be seen: no other shell-like fence on these pages.
    for page in GETTING_STARTED.glob("*.md"):
        assert {lang for lang, _ in fenced_blocks(page.read_text())} <= {"bash", "text", "json", ""}, page.name


def test_the_command_check_sees_a_new_command():
    page = "```bash\npython -m jaxpt.tools.runs list workdirs\npython -m jaxpt.tools.gate \\\n    workdirs/x  # judge\n```\n"
    found = set(commands(page))
    assert found == {"python -m jaxpt.tools.runs list workdirs", "python -m jaxpt.tools.gate workdirs/x"}
    assert found - set(RUN_ELSEWHERE) - set(RUN_HERE) == {"python -m jaxpt.tools.gate workdirs/x"}


def _page_command(page: str, start: str) -> list[str]:
    """The words of the one command on Getting-started page ``page`` that starts with ``start``."""
    (cmd,) = [c for c in getting_started_commands()[page] if c.startswith(start)]
    return shlex.split(cmd)


def _write_run(workdir: pathlib.Path, run_id: str, losses: list[float]) -> None:
    """A run directory as the trainer leaves it, for the registry's readers: run.json and metrics.jsonl."""
    workdir.mkdir(parents=True)
    goodput = {"productive_s": 100.0, "startup_s": 10.0, "compile_s": 20.0, "data_wait_s": 1.0, "checkpoint_s": 5.0,
               "eval_s": 8.0, "redone_s": 0.0, "wall_s": 144.0}
    record = {"run_id": run_id, "status": "completed", "config_hash": run_id * 4, "data_version": "sample-1",
              "tokenizer": {"path": "tok.model", "sha256": "ab" * 32}, "git": {"commit": "0" * 40, "dirty": False},
              "mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "num_params": 5_250_000, "target_steps": 20,
              "started_at": f"2026-01-0{len(run_id) % 9 + 1}T00:00:00Z", "ended_at": "2026-01-02T00:00:00Z",
              "sessions": [{"start_step": 0, "last_step": 20, "goodput": goodput}],
              "final": {"step": 20, "train_loss": losses[-1], "heldout_loss": losses[-1] + 0.1}, "events": []}
    (workdir / "run.json").write_text(json.dumps(record))
    with open(workdir / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": 10 * i, "loss": loss, "grad_norm": 1.0 / i, "learning_rate": 3e-3}) + "\n")


def _run_program(words: list[str]) -> tuple[int, str]:
    """``python -m MODULE ARGS`` run in this process (the program's own ``main``): exit status and stdout."""
    assert words[:2] == ["python", "-m"], words
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = importlib.import_module(words[2]).main(words[3:])
        except SystemExit as e:
            rc = e.code
    return rc or 0, out.getvalue()


def test_reading_a_run_commands(tmp_path, monkeypatch):
    _write_run(tmp_path / "workdirs" / "quickstart", "quickstart-run", [8.3, 6.1])
    _write_run(tmp_path / "workdirs" / "my_docs", "my-docs-run", [8.1, 5.9])
    monkeypatch.chdir(tmp_path)
    runs = [c for c in getting_started_commands()["reading-a-run.md"] if c.startswith("python -m jaxpt.tools.runs")]
    assert len(runs) == 5
    outputs = {}
    for cmd in runs:
        rc, out = _run_program(shlex.split(cmd))
        assert rc == 0, (cmd, out)
        outputs[cmd] = out
    assert "quickstart-run" in outputs["python -m jaxpt.tools.runs list workdirs"]
    assert "my-docs-run" in outputs["python -m jaxpt.tools.runs list workdirs"]
    assert "goodput" in outputs["python -m jaxpt.tools.runs show workdirs/quickstart"]
    assert (tmp_path / "goodput.png").stat().st_size > 0 and (tmp_path / "loss.png").stat().st_size > 0
    compare = outputs["python -m jaxpt.tools.runs compare workdirs/quickstart workdirs/my_docs"]
    assert "final.train_loss" in compare and "-0.2" in compare


@pytest.mark.integration
def test_make_quickstart_takes_another_workdir():
    if shutil.which("make") is None:
        pytest.skip("no make on this host")
    words = _page_command("quickstart.md", "make quickstart WORKDIR=")
    out = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    workdir = words[-1].split("=", 1)[1]
    assert re.search(rf"-m jaxpt\.train --config configs/quickstart\.gin --workdir {re.escape(workdir)}$", out, re.M), out


def _gin_block(page: str) -> str:
    (body,) = [body for lang, body in fenced_blocks((GETTING_STARTED / page).read_text())
               if lang == "" and "DataConfig" in body]
    return body


@pytest.mark.integration
def test_own_data_without_preparing_dry_run(tmp_path):
    """The page's "Without preparing" data config, as written, passes the dry run on files where it says they are (a
    glob of training files, a held-out file, a tokenizer) and takes effect (the tokenizer's vocabulary)."""
    from jaxpt.data import tokenizer as tokenizer_lib

    data = tmp_path / "my_docs"
    (data / "train").mkdir(parents=True)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    docs = [{"text": " ".join(words[(i + j) % len(words)] for j in range(40 + i))} for i in range(60)]
    for name, part in (("train/a.jsonl.gz", docs[:25]), ("train/b.jsonl.gz", docs[25:50]),
                       ("heldout.jsonl.gz", docs[50:])):
        with gzip.open(data / name, "wt") as f:
            f.writelines(json.dumps(d) + "\n" for d in part)
    tokenizer_lib.train_sentencepiece((d["text"] for d in docs), data / "tokenizer.model", 300)
    (tmp_path / "data.gin").write_text(_gin_block("own-data.md"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # conftest's XLA_FLAGS: the 8 devices of the quickstart mesh
    proc = subprocess.run([sys.executable, "-m", "jaxpt.train", "--config", str(ROOT / "configs" / "quickstart.gin"),
                           "--config", "data.gin", "--workdir", "workdirs/mine", "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every check passed" in proc.stdout and "vocabulary 300" in proc.stdout, proc.stdout
    assert not (tmp_path / "workdirs").exists()  # a dry run writes nothing


# ------------------------------------------------------------------------------------------ the site


def _nav_pages(nav) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_nav_and_every_nav_entry_has_a_page(generated):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} | set(generated)
    assert sorted(nav) == sorted(pages)
    assert config["strict"] is True and config["validation"]["links"]["anchors"] == "warn"


def _mkdocs_available() -> bool:
    return importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("material") is not None


needs_mkdocs = pytest.mark.skipif(not _mkdocs_available(),
                                  reason="mkdocs-material is not installed (the docs extra: pip install -e '.[docs]')")


def _mkdocs_build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.integration
@needs_mkdocs
def test_the_site_builds_strictly(tmp_path):
    proc = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("index.html", "reference/config/index.html", "reference/programs/index.html",
                 "getting-started/own-data/index.html", "results/throughput/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


@pytest.mark.integration
@needs_mkdocs
def test_the_strict_settings_fail_on_a_broken_link_or_anchor(tmp_path):
    """A two-page site with this project's strict and validation settings: it builds, and a link to a missing page
    or anchor makes it fail."""
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    site = tmp_path / "mini"
    (site / "docs").mkdir(parents=True)
    config = {"site_name": "x", "strict": settings["strict"], "validation": settings["validation"],
              "nav": ["index.md", "other.md"]}
    (site / "mkdocs.yml").write_text(yaml.safe_dump(config))
    (site / "docs" / "other.md").write_text("# Other\n\n## A section\n")
    (site / "docs" / "index.md").write_text("# Home\n\n[other](other.md#a-section)\n")
    assert _mkdocs_build(site / "mkdocs.yml", tmp_path / "out1").returncode == 0
    for broken in ("[gone](missing.md)", "[anchor](other.md#no-such-section)"):
        (site / "docs" / "index.md").write_text(f"# Home\n\n{broken}\n")
        proc = _mkdocs_build(site / "mkdocs.yml", tmp_path / "out2")
        assert proc.returncode != 0 and "Aborted" in proc.stderr + proc.stdout, broken
