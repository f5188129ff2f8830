"""The site's reference pages, generated from the code at build time, so they cannot drift from it.

``mkdocs build`` runs this file as a hook (``hooks:`` in ``mkdocs.yml``): :func:`on_files` adds each page of
:data:`PAGES` to the build as a virtual file, nothing is written into ``docs/``. To read the pages without a build::

    python docs/gen_reference.py --output /some/dir      # writes reference/*.md under it

What each page is read from:

* ``reference/config.md``: every config dataclass of :data:`jaxpt.config.CONFIG_CLASSES`, every field with its
  type and default (``dataclasses.fields``) and its description, parsed from the ``Attributes:`` section of the
  class docstring (:func:`attribute_docs`);
* ``reference/programs.md``: every program and its flags, found as ``tests/test_cli.py`` finds them (its
  ``discover`` and ``commands``: each program's own ``main`` builds its parser, nothing runs);
* ``reference/extensions.md``: the model's seams (:mod:`jaxpt.model.tables`, :mod:`jaxpt.model.seams`), the loop's
  hooks (:mod:`jaxpt.run.hooks`), the data sources (``DataConfig.source``) and eval cards (:mod:`jaxpt.eval.card`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import pathlib
import re
import sys
import typing
from typing import Any, Callable
from unittest import mock

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file (by MkDocs or by hand): the checkout's packages come first
    sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------------------------------ Markdown helpers

_ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|obj):`~?([^`]+)`")
_CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def md_text(text: str) -> str:
    """Docstring prose as Markdown on one line: Sphinx roles become code spans; outside code spans, ``&``, ``<``,
    ``>`` and ``|`` are escaped (a table cell, and no HTML by accident). A ``|`` inside a code span needs no escape:
    the tables extension does not split cells there."""
    text = _ROLE.sub(r"`\1`", " ".join(text.split()))
    parts = _CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "".join(parts)


def code(text: str) -> str:
    """``text`` as one inline code span."""
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def md_block(text: str) -> str:
    """Docstring prose that keeps its bullet lists: each paragraph or ``- `` item through :func:`md_text`, with
    the blank line Markdown needs before a list."""
    out, item = [], []
    for line in inspect.cleandoc(text).splitlines() + [""]:
        starts_item = line.lstrip().startswith("- ")
        if (starts_item or not line.strip()) and item:
            out.append(md_text(" ".join(item)))
            item = []
            if not starts_item:
                out.append("")
        if starts_item and out and out[-1] and not out[-1].startswith("- "):
            out.append("")
        if line.strip():
            item.append(line.strip())
    return "\n".join(out).strip()


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def first_paragraph(doc: str | None) -> str:
    return (inspect.cleandoc(doc or "").split("\n\n") or [""])[0]


# ------------------------------------------------------------------------------------------ config reference

_ENTRY = re.compile(r"^(\w+(?:\s*,\s*\w+)*)\s*:\s?(.*)$")


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: description}`` from the ``Attributes:`` section of ``cls``'s docstring (Google style): an entry
    ``name: text`` (or ``a, b: text`` for fields described together) at the section's indentation, continued by
    more deeply indented lines; the section ends at the first line indented as the header (``Raises:``)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    out: dict[str, str] = {}
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return out
    header_indent = len(lines[start]) - len(lines[start].lstrip())
    names: list[str] = []
    entry_indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break
        m = _ENTRY.match(line.strip())
        if m and (entry_indent is None or indent == entry_indent):
            entry_indent = indent
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
        elif names:
            for n in names:
                out[n] = f"{out[n]} {line.strip()}".strip()
    return out


def type_name(tp: Any) -> str:
    """A field's type as written in the code: ``int``, ``tuple[str, ...]``, ``'a' | 'b'`` for a ``Literal``."""
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return re.sub(r"\btyping\.", "", str(tp))


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def config_rows(cls: type) -> list[dict[str, str]]:
    """One row per field of ``cls``: ``{"field", "type", "default", "description"}`` (description '' when the
    docstring has none: the tests refuse that)."""
    hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = default_of(f)
        if dataclasses.is_dataclass(default):
            shown = f"[{type(default).__name__}](#{type(default).__name__.lower()})"
        elif default is dataclasses.MISSING:
            shown = "(required)"
        else:
            shown = code(repr(default))
        rows.append({"field": f.name, "type": type_name(hints[f.name]), "default": shown,
                     "description": docs.get(f.name, "")})
    return rows


def config_page() -> str:
    from jaxpt.config import CONFIG_CLASSES

    order = ["TrainConfig", *sorted(n for n in CONFIG_CLASSES if n != "TrainConfig")]
    out = [
        "# Configuration reference",
        "",
        "Generated from the code at build time (`docs/gen_reference.py`): every config dataclass jaxpt registers",
        "with gin (`jaxpt.config.CONFIG_CLASSES`), every field with its type, its default and the description in",
        "the class docstring. Set a field in a gin file or with `--gin`, as `ClassName.field = value`:",
        "",
        "```",
        "ModelConfig.d_model = 512",
        "OptimizerConfig.peak_learning_rate = 3e-4",
        "TrainConfig.mesh = 'fsdp=-1'",
        "```",
        "",
        "Each class checks its own fields when it is built and names the key it refuses",
        "(`config error: ModelConfig.compute_dtype = 'float8': choose one of ...`, exit 2); checks that need two",
        "configs or the devices run once per start (`python -m jaxpt.train --dry-run` runs them all).",
        "",
    ]
    for name in order:
        cls = CONFIG_CLASSES[name]
        summary = first_paragraph(cls.__doc__)
        out += [f"## {name}", "", f"`{cls.__module__}.{name}`" + (f": {md_text(summary)}" if not
                                                                   summary.startswith("Attributes:") else ""), ""]
        rows = [[code(r["field"]), code(r["type"]), r["default"], md_text(r["description"])]
                for r in config_rows(cls)]
        out += [table(["field", "type", "default", "description"], rows), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ programs reference


def _load_cli_discovery():
    """``tests/test_cli.py`` as a module: its ``discover``/``commands`` are the one list of programs and parsers."""
    spec = importlib.util.spec_from_file_location("_jaxpt_docs_cli_discovery", ROOT / "tests" / "test_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def program_commands() -> dict[str, list[tuple[list[str], argparse.ArgumentParser]]]:
    """``{program module: [(subcommand words, parser), ...]}`` for every program ``tests/test_cli.py`` finds. Each
    parser's ``prog`` reads ``python -m <module> ...`` (``sys.argv[0]`` is set so while the parsers are built)."""
    cli_tests = _load_cli_discovery()
    out = {}
    for module in cli_tests.PROGRAMS:
        with mock.patch.object(sys, "argv", [f"python -m {module}"]):
            out[module] = cli_tests.commands(module)
    return out


def program_aliases() -> dict[str, str]:
    """``{old module: its docstring}``: the deprecated ``python -m`` names and where each program moved."""
    cli_tests = _load_cli_discovery()
    return {module: importlib.import_module(module).__doc__ or "" for module in cli_tests.ALIASES}


def console_scripts() -> dict[str, str]:
    """``{program module: console script}`` from ``pyproject.toml``."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    return {target.partition(":")[0]: name for name, target in scripts.items()}


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(action.metavar or action.dest)
    metavar = ""
    if action.nargs != 0:
        metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                     else action.dest.upper())
        if isinstance(metavar, tuple):
            metavar = " ".join(metavar)
        metavar = f" {metavar}" + (" ..." if action.nargs in ("+", "*") else "")
    return code(", ".join(action.option_strings) + metavar)


def flag_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    """One row per visible option and positional of ``parser``: flag, default, help (``%(default)s`` expanded).
    Hidden deprecated spellings are listed by :func:`programs_page` apart."""
    formatter = parser._get_formatter()
    rows = []
    for a in parser._actions:
        if a.help == argparse.SUPPRESS or isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        default = "" if a.default is None or a.default is argparse.SUPPRESS or a.nargs == 0 else code(repr(a.default))
        required = " (required)" if a.required and a.option_strings else ""
        rows.append([_flag_cell(a), default, md_text(formatter._expand_help(a) if a.help else "") + required])
    return rows


def programs_page() -> str:
    from jaxpt.util import cli

    scripts = console_scripts()
    commands = program_commands()
    order = ["jaxpt.train", *sorted(m for m in commands if m.startswith("jaxpt.") and m != "jaxpt.train"),
             *sorted(m for m in commands if not m.startswith("jaxpt."))]
    out = [
        "# Programs and flags",
        "",
        "Generated from the code at build time (`docs/gen_reference.py`): the programs `tests/test_cli.py`",
        "discovers (every module with a `python -m` entry point that parses flags, and every console script of",
        "`pyproject.toml`), each with the flags its own parser takes. One grammar for all: long flags are",
        "kebab-case, and a flag naming where a program writes is `--output`. Flags renamed to fit the grammar",
        "still parse for one release, print one `note: ... is deprecated` line, and are listed under each program.",
        "",
        "| program | console script |",
        "|---|---|",
    ]
    out += [f"| [`python -m {m}`](#{m.replace('.', '')}) | {code(scripts[m]) if m in scripts else ''} |"
            for m in order]
    out += ["", "Old names that still run, for one release, printing where the program moved:", "",
            table(["old name", "what it says"], [[code(f"python -m {old}"), md_text(doc)]
                                                 for old, doc in sorted(program_aliases().items())]), ""]
    for module in order:
        out += [f"## {module}", ""]
        for words, parser in commands[module]:
            if words:
                out += [f"### {module} {' '.join(words)}", ""]
            summary = first_paragraph(parser.description)
            if summary:
                out += [md_text(summary), ""]
            usage = parser.format_usage().strip().removeprefix("usage: ")
            out += ["```text", " ".join(usage.split()), "```", ""]
            rows = flag_rows(parser)
            if rows:
                out += [table(["flag", "default", "what"], rows), ""]
            old = cli.deprecated_spellings(parser)
            if old:
                out += ["Deprecated spellings: " + ", ".join(f"{code(o)} (now {code(n)})"
                                                              for o, n in sorted(old.items())) + ".", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ extension points


def _where(obj: Any) -> str:
    return f"{obj.__module__}.{getattr(obj, '__qualname__', getattr(obj, '__name__', type(obj).__name__))}"


def extensions_page() -> str:
    from jaxpt.config import DataConfig
    from jaxpt.eval import card as card_lib, probes
    from jaxpt.model import seams, tables
    from jaxpt.model.config import ModelConfig
    from jaxpt.run import context, hooks

    cfg = ModelConfig()

    def seam_rows(table_: dict) -> list[list[str]]:
        rows = []
        for name, impl in table_.items():
            try:
                aux = ", ".join(code(k) for k in impl.aux_specs(cfg)) or "none"
            except Exception:  # an aux spec that needs another config (e.g. MoE fields) is named by the table
                aux = "(depends on the config)"
            rows.append([code(name), code(_where(impl.fn)), aux])
        return rows

    out = [
        "# Extension points",
        "",
        "Generated from the code at build time (`docs/gen_reference.py`). Where jaxpt is meant to be extended,",
        "and what it offers there today.",
        "",
        "## Attention and MLP implementations",
        "",
        md_text(first_paragraph(tables.__doc__)),
        "",
        "`ModelConfig.attention_impl` selects from `jaxpt.model.tables.ATTENTION`:",
        "",
        table(["name", "implementation", "auxiliary outputs (default ModelConfig)"], seam_rows(tables.ATTENTION)),
        "",
        "`ModelConfig.mlp` selects from `jaxpt.model.tables.MLPS`:",
        "",
        table(["name", "implementation", "auxiliary outputs (default ModelConfig)"], seam_rows(tables.MLPS)),
        "",
        "Adding your own is one explicit call, made before a `ModelConfig` that names it is built (jaxpt's",
        "modules never make it themselves):",
        "",
        "```python",
        _literal_block(seams.__doc__),
        "```",
        "",
    ]
    for fn in (seams.add_attention, seams.add_mlp):
        sig = str(inspect.signature(fn)).replace("jaxpt.model.seams.", "")
        out += [f"### `{fn.__name__}`", "", "```python", f"{fn.__name__}{sig}", "```", "",
                md_text(first_paragraph(fn.__doc__)), ""]
        args = re.search(r"Args:\n(.*?)(?:\n\s*Returns:|\Z)", inspect.cleandoc(fn.__doc__), re.S)
        if args:
            entries = re.findall(r"^  (\w+): (.*?)(?=^  \w+: |\Z)", args.group(1), re.S | re.M)
            out += [table(["argument", "meaning"], [[code(n), md_text(t)] for n, t in entries]), ""]
    out += [
        "## Hooks of the train loop",
        "",
        md_text(first_paragraph(hooks.__doc__)),
        "",
        "A hook subclasses `jaxpt.run.hooks.Hook` and overrides the points it acts at (each does nothing by",
        "default). The loop's hooks are assembled in `jaxpt.run.context.default_hooks`: a new periodic action is a",
        "new hook there, not an edit of the loop.",
        "",
        table(["method", "called when"], [
            [code(f"{name}{inspect.signature(getattr(hooks.Hook, name))}"),
             md_text(_hook_point(hooks.__doc__, name)
                     or f"the loop ends (`LoopContext.close`: {first_paragraph(context.LoopContext.close.__doc__)})")]
            for name in ("on_batch", "on_dispatched", "on_reported", "on_rewind", "close")]),
        "",
        "jaxpt's own hooks:",
        "",
        table(["hook", "what it does"], [[code(h.__name__), md_text(first_paragraph(h.__doc__))]
                                         for h in _subclasses(hooks, hooks.Hook)]),
        "",
        f"Which of them a run gets: {md_text(first_paragraph(context.default_hooks.__doc__))}",
        "",
        "## Data sources",
        "",
        "`DataConfig.source` chooses where training text comes from:",
        "",
        table(["value", "what"], [[code(repr(v)), md_text(_source_text(v))]
                                  for v in typing.get_args(typing.get_type_hints(DataConfig)["source"])]),
        "",
        "Every document file (training, held-out, decontamination sets) is read by one reader,",
        "`jaxpt.data.documents`:",
        "",
        md_block(_section(importlib.import_module("jaxpt.data.documents").__doc__, "The contract.",
                          "The corpus build")),
        "",
        "A new source is a new `DataConfig.source` value, its checks in `jaxpt.run.resolve` and its batches in",
        "`jaxpt.data.stream.train_batches`.",
        "",
        "## Eval cards",
        "",
        md_text(first_paragraph(card_lib.__doc__)),
        "",
        md_text(_paragraph_after(card_lib.__doc__, "Versioning:")),
        "",
        f"Probe task kinds (`jaxpt.eval.probes.KINDS`): {', '.join(code(k) for k in probes.KINDS)}. The card",
        "jaxpt ships, `configs/eval/card_v1.yaml`, states every field with a comment:",
        "",
        "```yaml",
        (ROOT / "configs" / "eval" / "card_v1.yaml").read_text().rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(out)


def _literal_block(doc: str) -> str:
    """The first ``::`` literal block of a docstring, dedented (an example in the code's own words)."""
    lines = inspect.cleandoc(doc).splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("::")) + 1
    block = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    return inspect.cleandoc("\n".join(block))


def _hook_point(doc: str, name: str) -> str:
    m = re.search(rf"``{name}\([^`]*\)``: (.*?)(?=\n\* |\n\n|\Z)", doc, re.S)
    return m.group(1) if m else ""


def _subclasses(module, base: type) -> list[type]:
    return [c for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, base) and c is not base and c.__module__ == module.__name__]


def _source_text(value: str) -> str:
    from jaxpt.config import DataConfig

    doc = attribute_docs(DataConfig)["source"]
    m = re.search(rf"``{value}``\s*\(([^()]*(?:\([^()]*\)[^()]*)*)\)", doc)
    return m.group(1) if m else doc


def _section(doc: str, start: str, stop: str) -> str:
    """The part of a docstring from the paragraph starting ``start`` to the one starting ``stop``."""
    text = inspect.cleandoc(doc)
    i = text.find(start)
    j = text.find(stop, i)
    return text[i:j if j > i else None] if i >= 0 else ""


def _paragraph_after(doc: str, marker: str) -> str:
    text = inspect.cleandoc(doc)
    i = text.find(marker)
    return text[i:].split("\n\n")[0] if i >= 0 else ""


# ------------------------------------------------------------------------------------------ the pages

PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_page,
    "reference/programs.md": programs_page,
    "reference/extensions.md": extensions_page,
}


def pages() -> dict[str, str]:
    """``{path under docs/: Markdown}`` of every generated page. A path under the checkout (a default some program
    computes from its own location) is written relative to it, as a user's checkout would have it."""
    return {path: make().replace(f"{ROOT}/", "") + "\n" for path, make in PAGES.items()}


def on_files(files, config):
    """MkDocs hook: add the generated pages to the build as virtual files (nothing is written into docs/)."""
    from mkdocs.structure.files import File  # defers mkdocs: only a docs build has it

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/gen_reference.py", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="directory to write the pages under (reference/*.md)")
    args = parser.parse_args(argv)
    for path, text in pages().items():
        target = pathlib.Path(args.output) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
