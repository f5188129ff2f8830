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
