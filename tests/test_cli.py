"""Every program speaks one flag grammar (#32, "every program with one grammar"; the helper is jaxpt/util/cli.py).

The programs are discovered, not listed: every module under ``jaxpt/`` and ``data_pipelines/`` with a ``python -m``
guard and an argparse parser, plus the console scripts of ``pyproject.toml``. Each program's parsers are taken from
its own ``main`` (``ArgumentParser.parse_known_args`` is intercepted, so the check sees exactly what the program
parses), with every argparse subcommand and every manual one (a module's ``SUBCOMMANDS``). Checked: every visible
long option is kebab-case and an output location is spelled ``--output``; ``--help`` of every command exits 0 and
shows no deprecated spelling; each deprecated spelling parses to the same namespace as its replacement and prints
one note; the renamed flags are exactly :data:`RENAMED`. Scripts outside the packages (``benchmarks/``,
``data/sample/``) are checked from their source. The check itself is shown to fail on a snake_case flag.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import pathlib
import re
import subprocess
import sys
import tomllib
from unittest import mock

import pytest

from jaxpt.util import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The flags renamed when the grammar was made one (old -> new), by program: exactly the deprecated aliases.
RENAMED = {
    "jaxpt.train": {"--dry_run": "--dry-run", "--profile_steps": "--profile-steps",
                    "--coordinator_address": "--coordinator-address", "--num_processes": "--num-processes",
                    "--process_id": "--process-id", "--distributed_timeout_s": "--distributed-timeout-s"},
    "jaxpt.tools.plan": {"--profile_steps": "--profile-steps"},  # the config flags it shares with the trainer
    "jaxpt.tools.compile": {"--profile_steps": "--profile-steps"},
    "jaxpt.tools.sweep": {"--profile-steps": "--trace-steps", "--out": "--output"},
    "jaxpt.tools.scaling": {"--out": "--output"},
    "jaxpt.tools.convert": {"--max_seq_len": "--max-seq-len", "--scan_layers": "--scan-layers"},
    "jaxpt.tools.evaluate": {"--output-dir": "--output"},
}

#: Other spellings of "where this program writes" (the grammar's one spelling is --output).
_OUTPUT_SYNONYM = re.compile(r"--(out(-.*)?|output-.*|outdir|dest|destination|save-dir|save-to|target-dir)")


# ------------------------------------------------------------------------------------------ discovery


def _has_main_guard(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def _modules() -> dict[str, str]:
    """``{module: source}`` of every Python module under jaxpt/ and data_pipelines/."""
    out = {}
    for path in sorted([*ROOT.glob("jaxpt/**/*.py"), *ROOT.glob("data_pipelines/**/*.py")]):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path.read_text()
    return out


def _console_scripts() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def discover() -> tuple[list[str], list[str]]:
    """``(programs, aliases)``: modules with a ``python -m`` guard that parse flags (plus every console script's
    module), and the moved-program aliases (their guard calls ``run_moved``)."""
    programs, aliases = set(), set()
    for name, src in _modules().items():
        if not _has_main_guard(ast.parse(src)):
            continue
        if "run_moved(" in src:
            aliases.add(name)
        elif "argparse" in src:
            programs.add(name)
    programs |= {target.partition(":")[0] for target in _console_scripts().values()}
    return sorted(programs), sorted(aliases)


PROGRAMS, ALIASES = discover()


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(main, argv: list[str]) -> argparse.ArgumentParser:
    """The parser ``main(argv)`` builds (taken at its first ``parse_known_args``/``parse_args``; nothing runs)."""
    def capture(self, args=None, namespace=None):
        raise _Captured(self)
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            main(argv)
        except _Captured as c:
            return c.parser
    raise AssertionError(f"{main.__module__}.main({argv}) parsed no flags")


def commands(module: str) -> list[tuple[list[str], argparse.ArgumentParser]]:
    """``(argv prefix, parser)`` of every command of a program: its main parser, each manual subcommand (the
    module's ``SUBCOMMANDS``) and every argparse subparser, recursively."""
    mod = importlib.import_module(module)
    out = []
    for prefix in [[], *([s] for s in getattr(mod, "SUBCOMMANDS", ()))]:
        stack = [(prefix, parser_of(mod.main, [*prefix, "--help"]))]
        while stack:
            pre, p = stack.pop()
            out.append((pre, p))
            for a in p._actions:
                if isinstance(a, argparse._SubParsersAction):
                    stack += [([*pre, name], sub) for name, sub in a.choices.items()]
    return out


# ------------------------------------------------------------------------------------------ the rule


def grammar_problems(parser: argparse.ArgumentParser) -> list[str]:
    """What breaks the grammar among ``parser``'s long options (not its subparsers'): a visible one not kebab-case,
    an output location not spelled ``--output``, or a hidden one that is not a :mod:`jaxpt.util.cli` deprecated
    alias."""
    problems, deprecated = [], cli.deprecated_spellings(parser)
    for a in parser._actions:
        for opt in (o for o in a.option_strings if o.startswith("--")):
            if a.help == argparse.SUPPRESS:
                if opt not in deprecated:
                    problems.append(f"{opt}: hidden but not a deprecated alias (jaxpt.util.cli.add_flag)")
            elif not cli.is_kebab(opt):
                problems.append(f"{opt}: not kebab-case (e.g. --dry-run)")
            elif _OUTPUT_SYNONYM.fullmatch(opt):
                problems.append(f"{opt}: an output location is spelled --output")
    return problems


def _sample(action: argparse.Action) -> list[str]:
    """Command-line words that ``action`` accepts (a value its type and choices take, as many as its nargs)."""
    if action.nargs == 0:
        return []
    if action.choices:
        value = str(next(iter(action.choices)))
    else:
        value = next(v for v in ("3", "512,1024", "x") if _accepts(action, v))
    return [value] * (action.nargs if isinstance(action.nargs, int) else 1)


def _accepts(action: argparse.Action, value: str) -> bool:
    try:
        (action.type or str)(value)
        return True
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False


def _required_argv(parser: argparse.ArgumentParser, tested: argparse.Action) -> list[str]:
    """Words that satisfy ``parser``'s required options and positionals, ``tested``'s own group left out."""
    argv, positionals = [], []
    for a in parser._actions:
        if a is tested or isinstance(a, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        if not a.option_strings and a.nargs not in ("?", "*"):
            positionals += _sample(a)
        elif a.option_strings and a.required:
            argv += [a.option_strings[0], *_sample(a)]
    for g in parser._mutually_exclusive_groups:
        if g.required and tested not in g._group_actions:
            argv += [g._group_actions[0].option_strings[0], *_sample(g._group_actions[0])]
    return argv + positionals


def _help_text(module: str, argv: list[str]) -> str:
    """What ``main(argv + ['--help'])`` prints; asserts that it exits 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main([*argv, "--help"])
    assert exit_.value.code in (0, None), f"{module} {' '.join(argv)} --help exited {exit_.value.code}"
    return out.getvalue()


def _mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


# ------------------------------------------------------------------------------------------ tests


def test_discovery_finds_every_program_and_console_script():
    assert {"jaxpt.train", "jaxpt.data.prepare", "jaxpt.tools.evaluate", "jaxpt.tools.sweep", "jaxpt.tools.compile",
            "jaxpt.tools.runs", "data_pipelines.build", "data_pipelines.tokenizer"} <= set(PROGRAMS)
    assert {"jaxpt.evaluate", "jaxpt.compile"} <= set(ALIASES) and not set(PROGRAMS) & set(ALIASES)
    assert {t.partition(":")[0] for t in _console_scripts().values()} <= set(PROGRAMS)
    assert len(PROGRAMS) >= 16, PROGRAMS  # 11 under jaxpt/, 5 under data_pipelines/ when this test was written
    # no parser escapes the check: every module that builds one is a program
    builders = {name for name, src in _modules().items() if "ArgumentParser(" in src}
    assert builders <= set(PROGRAMS), sorted(builders - set(PROGRAMS))


@pytest.mark.parametrize("module", PROGRAMS)
def test_visible_long_options_are_kebab_case_and_outputs_are_output(module):
    problems = [f"{' '.join([module, *pre])}: {p}" for pre, parser in commands(module)
                for p in grammar_problems(parser)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module", PROGRAMS)
def test_help_exits_0_and_shows_no_deprecated_spelling(module):
    cmds = commands(module)
    deprecated = {old for _, p in cmds for old in cli.deprecated_spellings(p)}
    for pre, parser in cmds:
        text = _help_text(module, pre)
        assert text.startswith("usage:"), text[:200]
        shown = sorted(old for old in deprecated if _mentions(text, old))
        assert not shown, f"{module} {' '.join(pre)} --help shows deprecated {shown}"


@pytest.mark.parametrize("module", PROGRAMS)
def test_deprecated_spellings_parse_like_the_new_ones_and_warn_once(module, capsys):
    renamed = {}
    for _, parser in commands(module):
        actions = {o: a for a in parser._actions for o in a.option_strings}
        for old, new in cli.deprecated_spellings(parser).items():
            renamed[old] = new
            value, rest = _sample(actions[new]), _required_argv(parser, actions[new])
            capsys.readouterr()
            as_new = parser.parse_args([new, *value, *rest])
            assert capsys.readouterr().err == ""
            as_old = parser.parse_args([old, *value, *rest])
            assert capsys.readouterr().err.splitlines() == [cli.deprecation_note(old, new)]
            assert vars(as_old) == vars(as_new), (module, old)
    assert renamed == RENAMED.get(module, {})


def test_the_check_fails_on_snake_case_and_other_output_spellings():
    bad = argparse.ArgumentParser()
    for flag in ("--dry_run", "--out", "--output-dir", "--numSlices", "--steps"):
        bad.add_argument(flag)
    bad.add_argument("--hidden_snake", help=argparse.SUPPRESS)
    problems = grammar_problems(bad)
    assert [p.split(":")[0] for p in problems] == ["--dry_run", "--out", "--output-dir", "--numSlices",
                                                  "--hidden_snake"]
    good = argparse.ArgumentParser()
    cli.add_flag(good, "--dry-run", "--dry_run", action="store_true")
    cli.add_flag(good, "--output", "--out")
    assert grammar_problems(good) == []
    with pytest.raises(ValueError, match="kebab-case"):
        cli.add_flag(argparse.ArgumentParser(), "--dry_run")


def test_a_deprecated_spelling_warns_once_per_parse_and_satisfies_required(capsys):
    p = argparse.ArgumentParser(prog="x")
    cli.add_flag(p, "--gin-file", "--gin_file", action="append", default=[])
    cli.add_flag(p, "--output", "--output-dir", required=True)
    args = p.parse_args(["--gin_file", "a", "--gin-file", "b", "--gin_file", "c", "--output-dir", "o"])
    assert (args.gin_file, args.output) == (["a", "b", "c"], "o")
    assert capsys.readouterr().err.splitlines() == [cli.deprecation_note("--gin_file", "--gin-file"),
                                                   cli.deprecation_note("--output-dir", "--output")]
    p.parse_args(["--gin_file", "d", "--output", "o"])  # a new parse warns again
    assert capsys.readouterr().err.splitlines() == [cli.deprecation_note("--gin_file", "--gin-file")]
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert "--output is required" in capsys.readouterr().err


def test_scripts_outside_the_packages_declare_kebab_case_flags():
    """benchmarks/ and data/sample/ scripts (run by path, with import-time side effects) are checked from their
    source: every option literal given to ``add_argument``, and the new spelling given to ``cli.add_flag``."""
    bad = []
    for path in sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("data/**/*.py"), *ROOT.glob("jaxpt/**/*.py"),
                        *ROOT.glob("data_pipelines/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            words = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            flags = {"add_argument": words, "add_flag": words[:1]}.get(node.func.attr, [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {f}" for f in flags
                    if f.startswith("--") and (not cli.is_kebab(f) or _OUTPUT_SYNONYM.fullmatch(f))]
    assert not bad, bad


def _python_m(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.integration
@pytest.mark.parametrize("alias", ALIASES)
def test_moved_program_aliases_still_answer_help(alias):
    r = _python_m(alias, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage: python -m jaxpt.tools.") and "is now `python -m jaxpt.tools." in r.stderr


@pytest.mark.integration
def test_the_old_evaluate_form_runs_the_extrapolation_subcommand(tmp_path, capsys):
    r = _python_m("jaxpt.evaluate", "--workdir", str(tmp_path / "none"), "--lengths", "16,32")
    assert r.returncode == 2, r.stderr[-2000:]  # no checkpoint there: refused by the extrapolation command
    assert "is now `python -m jaxpt.tools.evaluate extrapolation`" in r.stderr
    from jaxpt.tools import evaluate  # the console script's old form (jaxpt-evaluate --lengths ...)
    assert evaluate.main(["--workdir", str(tmp_path / "none"), "--lengths", "16,32"]) == 2
    assert "use `extrapolation --lengths`" in capsys.readouterr().err
