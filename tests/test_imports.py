"""jaxpt's import graph, drawn from the source (module-level and function-local imports), holds its layering.

The layers, lowest first (a module may import its own layer and those below it, never one above; no circle among
jaxpt modules, counting imports inside functions):

    util < mesh < model < training < data < checkpoint < config < infer < eval < run < hf < lab < programs

``programs`` are ``jaxpt.train``, ``jaxpt.tools.*``, the package's ``__init__`` and the thin ``python -m`` aliases of
moved programs. So the model knows nothing of data, checkpoints or the loop; nothing below ``jaxpt.run`` imports it;
only programs import ``jaxpt.tools``; ``jaxpt`` never imports ``data_pipelines``. A function-local import of a jaxpt
module is allowed only with a comment on its line naming the heavy optional dependency it defers
(``# defers tensorflow``): deferring is for what a core install lacks, not for hiding a circle.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYERS = ["util", "mesh", "model", "training", "data", "checkpoint", "config", "infer", "eval", "run", "hf", "lab",
          "programs"]
PROGRAMS = {"jaxpt", "jaxpt.train", "jaxpt.tools", "jaxpt.compile", "jaxpt.convert", "jaxpt.gate", "jaxpt.evaluate"}
#: Optional dependencies heavy enough that importing the jaxpt module which needs them is deferred into a function.
HEAVY_OPTIONAL = ("tensorflow", "seqio", "lm_eval", "torch", "transformers", "apache_beam", "libtpu")
DEFERS = re.compile(r"#.*\bdefers\b\s+(" + "|".join(HEAVY_OPTIONAL) + r")\b")


def modules(root: pathlib.Path, package: str = "jaxpt") -> dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every module of ``package`` (``jaxpt``, ``data_pipelines``) under ``root``."""
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _targets(node, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement names: ``import a.b`` -> ``a.b``; ``from a import b, c`` -> ``a.b``,
    ``a.c`` (each resolved by :func:`import_graph` to the longest module prefix: the submodule ``a.b``, or ``a``
    when ``b`` is a name defined in it)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]


def _dynamic_target(call: ast.Call, package: str = "jaxpt") -> str | None:
    """The module a call such as ``importlib.import_module("jaxpt.eval.harness")`` (or a helper whose name ends in
    ``_module``) imports, when its first argument is a literal jaxpt module name; else None."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    arg = call.args[0] if call.args else None
    if name.endswith("_module") and isinstance(arg, ast.Constant) and str(arg.value).startswith(package + "."):
        return arg.value
    return None


def import_graph(root: pathlib.Path, package: str = "jaxpt") -> dict[str, list[tuple[str, int, bool, str]]]:
    """``{module: [(imported module of package, line, inside a function, source line), ...]}`` for every module of
    ``package``; an import of a name from a module counts as importing that module."""
    mods = modules(root, package)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text, str(path))
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        edges = []
        for node in ast.walk(tree):
            target = _dynamic_target(node, package) if isinstance(node, ast.Call) else None
            if target and resolve(target):
                edges.append((resolve(target), node.lineno, True, lines[node.lineno - 1]))
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            hits = {resolve(t) for t in _targets(node, name, path.name == "__init__.py")}
            edges += [(hit, node.lineno, id(node) in inside, lines[node.lineno - 1])
                      for hit in sorted(h for h in hits if h and h != name)]
        graph[name] = edges
    return graph


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (``jaxpt.run.loop`` -> ``run``)."""
    if module in PROGRAMS or module.startswith("jaxpt.tools."):
        return LAYERS.index("programs")
    return LAYERS.index(module.split(".")[1])


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in {e[0] for e in graph.get(v, [])}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph) -> list[str]:
    """Imports of a higher layer: ``'a (layer) -> b (layer), line N'``."""
    return [f"{m} ({LAYERS[layer(m)]}) -> {t} ({LAYERS[layer(t)]}), line {line}" for m, edges in sorted(graph.items())
            for t, line, _, _ in edges if layer(t) > layer(m)]


def undeclared_local_imports(graph) -> list[str]:
    """Function-local imports of jaxpt modules without a ``# defers <heavy optional dependency>`` comment."""
    return [f"{m}:{line}: {src.strip()}" for m, edges in sorted(graph.items()) for _, line, local, src in edges
            if local and not DEFERS.search(src)]


@pytest.fixture(scope="module")
def graph():
    g = import_graph(ROOT)
    assert len(g) > 80 and sum(len(e) for e in g.values()) > 300  # the walk saw the package and its imports
    return g


def test_every_module_has_a_layer(graph):
    assert all(0 <= layer(m) < len(LAYERS) for m in graph)


def test_no_circle_among_jaxpt_modules(graph):
    assert circles(graph) == []


def test_no_module_imports_a_higher_layer(graph):
    assert upward(graph) == []


def test_function_local_imports_of_jaxpt_name_the_heavy_dependency_they_defer(graph):
    assert undeclared_local_imports(graph) == []


def test_jaxpt_never_imports_data_pipelines():
    hits = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in modules(ROOT).values()
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
            and any(t.split(".")[0] == "data_pipelines" for t in _targets(n, "jaxpt.x", False))]
    assert hits == []


def test_the_checks_catch_a_back_import(graph):
    """A back-import added to the real graph (the filesystem layer importing the run loop, inside a function, with
    no comment) is reported as a circle, an upward arrow and an undeclared local import; so is a model module
    importing the data stream at module level."""
    bad = {m: list(e) for m, e in graph.items()}
    bad["jaxpt.util.fs"].append(("jaxpt.run.loop", 1, True, "    from jaxpt.run import loop"))
    bad["jaxpt.model.decoder"].append(("jaxpt.data.stream", 1, False, "from jaxpt.data import stream"))
    assert any("jaxpt.util.fs" in c and "jaxpt.run.loop" in c for c in circles(bad))
    assert "jaxpt.util.fs (util) -> jaxpt.run.loop (run), line 1" in upward(bad)
    assert "jaxpt.model.decoder (model) -> jaxpt.data.stream (data), line 1" in upward(bad)
    assert "jaxpt.util.fs:1: from jaxpt.run import loop" in undeclared_local_imports(bad)
    ok = {"jaxpt.tools.evaluate": [("jaxpt.eval.seqio_tasks", 3, True, "    from jaxpt.eval import seqio_tasks  "
                                                                         "# defers tensorflow")]}
    assert undeclared_local_imports(ok) == []


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "jaxpt"
    (pkg / "util").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "util" / "__init__.py").write_text("")
    (pkg / "util" / "a.py").write_text("def f():\n    from jaxpt.run import b\n\n\ndef g():\n"
                                       "    return importlib.import_module('jaxpt.run.b')  # defers torch\n")
    (pkg / "run").mkdir()
    (pkg / "run" / "__init__.py").write_text("")
    (pkg / "run" / "b.py").write_text("from ..util import a\n")
    g = import_graph(tmp_path)
    assert sorted(g["jaxpt.util.a"]) == [("jaxpt.run.b", 2, True, "    from jaxpt.run import b"), (
        "jaxpt.run.b", 6, True, "    return importlib.import_module('jaxpt.run.b')  # defers torch")]
    assert g["jaxpt.run.b"] == [("jaxpt.util.a", 1, False, "from ..util import a")]
    assert circles(g) == [["jaxpt.run.b", "jaxpt.util.a"]]
