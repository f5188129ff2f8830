"""Size limits the architecture issue (#12) set for the code, kept by a test so they cannot drift again
(``jaxpt/train.py`` had grown from 399 to 534 lines and four functions past 60 lines before this test)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_TRAIN_LINES = 400
MAX_FUNCTION_LINES = 60


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_train_module_keeps_setup_loop_and_main_only():
    lines = len((ROOT / "jaxpt" / "train.py").read_text().splitlines())
    assert lines <= MAX_TRAIN_LINES, f"jaxpt/train.py has {lines} lines (limit {MAX_TRAIN_LINES}): move helpers to their owners"


def test_no_function_in_jaxpt_is_over_60_lines():
    files = sorted((ROOT / "jaxpt").rglob("*.py"))
    assert len(files) > 50  # the walk found the package
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in files for name, line, n in _functions(p)
            if n > MAX_FUNCTION_LINES]
    assert not long, "functions over 60 lines (docstring included): " + "; ".join(long)


def test_the_counter_sees_a_long_function(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n" + "    x = 1\n" * 70 + "\n\ndef g():\n    return 2\n")
    assert [(name, n) for name, _, n in _functions(src)] == [("f", 71), ("g", 2)]


def _model_imports() -> dict[str, set[str]]:
    """``jaxpt.model`` module -> the ``jaxpt.model`` modules it imports, at module level or inside a function."""
    pkg = ROOT / "jaxpt" / "model"
    names = {f"jaxpt.model.{p.stem}" for p in pkg.glob("*.py") if p.stem != "__init__"} | {"jaxpt.model"}
    graph = {}
    for p in pkg.glob("*.py"):
        me = "jaxpt.model" if p.stem == "__init__" else f"jaxpt.model.{p.stem}"
        out = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                        for a in node.names}
        graph[me] = {m for m in out if m in names and m != me}
    return graph


def test_no_import_cycle_in_the_model_package():
    """Implementations are chosen from explicit tables (jaxpt/model/tables.py), not registered by importing them,
    so no jaxpt.model module reaches itself through imports (function-local ones count)."""
    graph = _model_imports()
    assert "jaxpt.model.tables" in graph and "jaxpt.model.registry" not in graph
    assert _cycle(graph) is None, "import cycle: " + " -> ".join(_cycle(graph))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None (depth-first search)."""
    done: set[str] = set()

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        done.add(node)
        return None

    for m in sorted(graph):
        found = None if m in done else visit(m, [m])
        if found:
            return found
    return None


def test_the_cycle_search_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
